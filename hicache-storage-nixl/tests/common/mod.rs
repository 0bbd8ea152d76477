//! Shared by the NIXL tests: where the NIXL library is, and backends over a temporary directory.
//!
//! The tests run against the real library of the `nixl-cu12` wheel. `cargo xtask ci` (or `cargo xtask nixl`)
//! downloads and unpacks it under `target/nixl/`; `$HICACHE_NIXL_LIB_DIR` points elsewhere. Without it a test fails
//! with instructions: never a silent skip.

use std::path::{Path, PathBuf};

use hicache_storage_nixl::{LIB_DIR_ENV, NixlConfig, PluginChoice};

/// The folder holding `libnixl_capi.so`.
pub(crate) fn lib_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(LIB_DIR_ENV).filter(|dir| !dir.is_empty()) {
        return PathBuf::from(dir);
    }
    let unpacked = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/nixl");
    find_library(&unpacked, 4).unwrap_or_else(|| {
        panic!(
            "the NIXL library is needed: run `cargo xtask nixl` (downloads the nixl-cu12 wheel into target/nixl) or \
             set {LIB_DIR_ENV} to the wheel's folder holding libnixl_capi.so; looked in {}",
            unpacked.display()
        )
    })
}

fn find_library(dir: &Path, depth: usize) -> Option<PathBuf> {
    if dir.join("libnixl_capi.so").is_file() {
        return Some(dir.to_path_buf());
    }
    if depth == 0 {
        return None;
    }
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).ok()?.filter_map(|entry| entry.ok().map(|e| e.path())).collect();
    entries.sort();
    entries.into_iter().filter(|path| path.is_dir()).find_map(|path| find_library(&path, depth - 1))
}

/// A config over `dir` with the POSIX plugin and the test library.
pub(crate) fn config(dir: &Path) -> NixlConfig {
    NixlConfig { lib_dir: Some(lib_dir()), plugin: PluginChoice::Named("POSIX".into()), ..NixlConfig::new(dir) }
}
