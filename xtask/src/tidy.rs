//! The tidy test: the code map in ARCHITECTURE.md matches the tree, every Rust file opens with a `//!` line, and the
//! README's test command is the one `.ci/run` runs.

use std::fs;
use std::path::{Path, PathBuf};

use crate::project_root;

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|error| panic!("reading {}: {error}", path.display()))
}

/// Workspace members, from the root manifest's `members = [...]`.
fn members(root: &Path) -> Vec<String> {
    let manifest = read(&root.join("Cargo.toml"));
    let line = manifest.lines().find(|line| line.trim_start().starts_with("members")).expect("members line");
    line.split('"').skip(1).step_by(2).map(str::to_owned).collect()
}

/// Words in backticks that name a path: they contain `/` or end in a known extension.
fn named_paths(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|word| !word.contains(' ') && !word.contains('{'))
        .filter(|word| word.starts_with(|first: char| first.is_ascii_alphanumeric() || first == '.'))
        .filter(|word| {
            word.contains('/') || [".rs", ".md", ".toml", ".json", ".py"].iter().any(|ext| word.ends_with(ext))
        })
        .map(|word| word.trim_end_matches("/").to_owned())
        .filter(|word| !word.is_empty() && !word.starts_with("http") && !word.starts_with("../"))
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|error| panic!("listing {}: {error}", dir.display())) {
        let path = entry.expect("directory entry").path();
        let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
        if path.is_dir() {
            if !matches!(name, "target" | ".git" | ".gpu" | "corpus" | "artifacts" | "coverage") {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

#[test]
fn architecture_maps_every_crate_and_names_only_real_paths() {
    let root = project_root();
    let architecture = read(&root.join("ARCHITECTURE.md"));
    for member in members(&root) {
        assert!(
            architecture.contains(&format!("`{member}/`")),
            "ARCHITECTURE.md has no entry `{member}/` for a workspace crate"
        );
    }
    let paths = named_paths(&architecture);
    assert!(paths.len() > 10, "ARCHITECTURE.md names only {} paths; is the code map there?", paths.len());
    for path in paths {
        assert!(root.join(&path).exists(), "ARCHITECTURE.md names `{path}`, which does not exist");
    }
}

#[test]
fn every_rust_file_opens_with_a_module_doc() {
    let root = project_root();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(files.len() > 10, "found only {} Rust files", files.len());
    for file in files {
        let text = read(&file);
        assert!(text.starts_with("//!"), "{} does not open with a `//!` line", file.display());
    }
}

#[test]
fn ci_runs_the_readme_test_command() {
    let root = project_root();
    let readme = read(&root.join("README.md"));
    let ci = read(&root.join(".ci/run"));
    assert!(readme.contains("cargo xtask ci"), "README.md does not give the test command");
    assert!(readme.contains("cargo run --release -p hicache-cli -- replay"), "README.md does not give the main job");
    assert!(
        ci.lines().any(|line| line.trim_start().starts_with("exec cargo xtask ci")),
        ".ci/run does not run `cargo xtask ci`"
    );
}

#[test]
fn path_extraction_finds_paths_and_skips_code() {
    let found = named_paths("see `hicache-core/src/hash.rs`, `Cargo.toml`, `a b/c`, `--flag`, `{hash}_x`, `x`");
    assert_eq!(found, ["hicache-core/src/hash.rs", "Cargo.toml"]);
}
