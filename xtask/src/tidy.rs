//! The tidy test: the code map in ARCHITECTURE.md matches the tree, every Rust file opens with a `//!` line, the
//! README's test command is the one `.ci/run` runs, the repository stands alone (no references to documents outside
//! it, no talk of how the work was organised), every `docs/sglang.md#anchor` it points at exists, and every cargo
//! feature it tells a user to build with exists.

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
        .map(|word| word.split('#').next().unwrap_or_default().trim_end_matches("/").to_owned())
        .filter(|word| !word.is_empty() && !word.starts_with("http") && !word.starts_with("../"))
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    files_ending(dir, &[".rs"], out);
}

/// Files under `dir` whose names end in one of `endings`, outside build outputs, fuzzing state and `.ci/`.
fn files_ending(dir: &Path, endings: &[&str], out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|error| panic!("listing {}: {error}", dir.display())) {
        let path = entry.expect("directory entry").path();
        let name = path.file_name().and_then(|name| name.to_str()).unwrap_or_default();
        if path.is_dir() {
            if !matches!(name, "target" | ".git" | ".gpu" | ".ci" | "corpus" | "artifacts" | "coverage") {
                files_ending(&path, endings, out);
            }
        } else if endings.iter().any(|ending| name.ends_with(ending)) {
            out.push(path);
        }
    }
}

/// The repository's text files: code, docs, scripts, manifests and measured data.
fn text_files(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    files_ending(root, &[".rs", ".md", ".toml", ".py", ".sh", ".txt", ".json", ".h", ".cu", ".yml"], &mut files);
    files.push(root.join("README.md"));
    files.sort();
    files.dedup();
    // this file holds examples of what the checks look for
    files.retain(|file| !file.ends_with("xtask/src/tidy.rs"));
    files
}

// The phrases are assembled from pieces, so this file does not contain what it looks for.
/// The folder of documents outside the repository.
const OUTSIDE_FOLDER: &str = concat!("..", "/sha", "red");
/// A section of an outside document, and its list of bugs.
const SECTION: &str = concat!("spec ", "§");
const BUG_LIST: &str = concat!("§", "17");
/// A ticket number.
const TICKET: &str = concat!("iss", "ue #");
/// A period of the work, as a whole word.
const WORK_PERIOD: &str = concat!("sess", "ion");

/// Lines of `text` that break the rule that the repository stands alone: a reference to a document outside it or
/// to sections of one, or talk of how the work was organised (its periods and ticket numbers).
fn outside_references(text: &str) -> Vec<String> {
    let forbidden = [OUTSIDE_FOLDER, SECTION, BUG_LIST, TICKET];
    let plural = format!("{WORK_PERIOD}s");
    text.lines()
        .filter(|line| {
            let lower = line.to_lowercase();
            forbidden.iter().any(|word| lower.contains(word))
                || lower.split(|ch: char| !ch.is_ascii_alphanumeric()).any(|word| word == WORK_PERIOD || word == plural)
        })
        .map(|line| line.trim().to_owned())
        .collect()
}

/// Anchors a text points at in `docs/sglang.md`: `docs/sglang.md#a`, and `#b` after it on the same line.
fn sglang_anchors(text: &str) -> Vec<String> {
    let mut anchors = Vec::new();
    for line in text.lines() {
        let Some(start) = line.find("sglang.md#") else { continue };
        let rest = &line[start + "sglang.md".len()..];
        for piece in rest.split('#').skip(1) {
            let anchor: String =
                piece.chars().take_while(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || *ch == '-').collect();
            if !anchor.is_empty() {
                anchors.push(anchor);
            }
        }
    }
    anchors
}

/// Feature names given as `--features NAME` in a text.
fn named_features(text: &str) -> Vec<String> {
    text.split("--features")
        .skip(1)
        .filter_map(|rest| {
            let name: String = rest
                .trim_start_matches([' ', '='])
                .chars()
                .take_while(|ch| ch.is_ascii_alphanumeric() || *ch == '-' || *ch == '_' || *ch == ',')
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .flat_map(|names| names.split(',').map(str::to_owned).collect::<Vec<_>>())
        .filter(|name| !name.is_empty())
        .collect()
}

/// Feature names declared in the `[features]` tables of every crate of the workspace.
fn declared_features(root: &Path) -> Vec<String> {
    let mut manifests = Vec::new();
    files_ending(root, &["Cargo.toml"], &mut manifests);
    let mut features = Vec::new();
    for manifest in manifests {
        let text = read(&manifest);
        let mut in_table = false;
        for line in text.lines() {
            let line = line.trim();
            if line.starts_with('[') {
                in_table = line == "[features]";
            } else if in_table && let Some((name, _)) = line.split_once('=') {
                features.push(name.trim().trim_matches('"').to_owned());
            }
        }
    }
    features
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
    // (paths under target/ are made by `cargo xtask ci`'s own steps, so a checkout has them only after one)
    for path in paths.iter().filter(|path| !path.starts_with("target/")) {
        assert!(root.join(path).exists(), "ARCHITECTURE.md names `{path}`, which does not exist");
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

#[test]
fn the_repository_stands_alone() {
    let root = project_root();
    let files = text_files(&root);
    assert!(files.len() > 50, "found only {} text files", files.len());
    let mut found = Vec::new();
    for file in &files {
        for line in outside_references(&read(file)) {
            found.push(format!("{}: {line}", file.strip_prefix(&root).unwrap_or(file).display()));
        }
    }
    assert!(
        found.is_empty(),
        "references outside the repository or to how the work was organised:\n{}",
        found.join("\n")
    );
}

#[test]
fn every_sglang_anchor_exists() {
    let root = project_root();
    let sglang = read(&root.join("docs/sglang.md"));
    let mut pointed = 0;
    for file in text_files(&root) {
        for anchor in sglang_anchors(&read(&file)) {
            pointed += 1;
            assert!(
                sglang.contains(&format!("<a id=\"{anchor}\"></a>")),
                "{} points at docs/sglang.md#{anchor}, which has no such anchor",
                file.display()
            );
        }
    }
    assert!(pointed > 40, "only {pointed} pointers into docs/sglang.md were found");
}

#[test]
fn every_feature_a_text_names_exists() {
    let root = project_root();
    let declared = declared_features(&root);
    assert!(declared.iter().any(|feature| feature == "cuda"), "no features found: {declared:?}");
    for file in text_files(&root) {
        for feature in named_features(&read(&file)) {
            assert!(
                declared.contains(&feature),
                "{} names `--features {feature}`, which no crate declares",
                file.display()
            );
        }
    }
}

#[test]
fn the_checks_see_what_they_look_for() {
    let expected = [
        format!("see {OUTSIDE_FOLDER}/x"),
        format!("in {WORK_PERIOD} 4"),
        format!("the {WORK_PERIOD}s"),
        format!("{TICKET}3"),
        format!("{SECTION}7.1"),
        format!("{BUG_LIST} item 2"),
    ];
    assert_eq!(outside_references(&format!("ok\n{}\nfine", expected.join("\n"))), expected);
    assert!(outside_references(&format!("a {WORK_PERIOD}less design, ob{WORK_PERIOD}s")).is_empty());
    assert_eq!(sglang_anchors("x (docs/sglang.md#fixed-1 and #fixed-2). #other"), ["fixed-1", "fixed-2", "other"]);
    assert_eq!(
        named_features("`cargo build --features cuda,nixl` and --features=file; --features {feature}"),
        ["cuda", "nixl", "file"]
    );
}
