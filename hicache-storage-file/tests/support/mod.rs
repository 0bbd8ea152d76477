//! Helpers shared by the file tier's tests.

use std::path::{Path, PathBuf};

/// The files under `dir`, at any depth, whose paths `keep` accepts, in no particular order.
pub(crate) fn files_under(dir: &Path, keep: impl Fn(&Path) -> bool) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if keep(&path) {
                found.push(path);
            }
        }
    }
    found
}
