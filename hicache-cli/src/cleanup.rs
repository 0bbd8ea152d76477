//! Temporary folders that must go however the command ends: on return, on an error, and on SIGINT, SIGTERM or
//! SIGHUP (a signal handler thread removes every registered folder, then exits with 128 + the signal's number, as a
//! shell reports a process killed by it). SIGKILL cannot be caught; what it leaves is named so it is recognisable.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};

static FOLDERS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static HANDLER: Once = Once::new();

/// A folder removed when this guard drops or when the process is stopped by a signal.
#[derive(Debug)]
pub(crate) struct TempFolder {
    path: PathBuf,
}

impl TempFolder {
    /// A new folder in `parent`, named `{prefix}{random}`.
    pub(crate) fn new_in(parent: &Path, prefix: &str) -> anyhow::Result<Self> {
        install_handler();
        let folder = tempfile::Builder::new().prefix(prefix).tempdir_in(parent)?.keep();
        lock().push(folder.clone());
        Ok(Self { path: folder })
    }

    /// A new folder in the system's temporary directory.
    pub(crate) fn new(prefix: &str) -> anyhow::Result<Self> {
        Self::new_in(&std::env::temp_dir(), prefix)
    }

    /// Where it is.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempFolder {
    fn drop(&mut self) {
        lock().retain(|folder| *folder != self.path);
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn lock() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    FOLDERS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn install_handler() {
    HANDLER.call_once(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else { return };
        let spawned = std::thread::Builder::new().name("hicache-signals".into()).spawn(move || {
            if let Some(signal) = signals.forever().next() {
                for folder in lock().drain(..) {
                    // I/O threads may still be adding files (a removal then finds a folder not empty); they make
                    // folders only below the one removed here, so once it is gone it stays gone
                    for _ in 0..100 {
                        if std::fs::remove_dir_all(&folder).is_ok() || !folder.exists() {
                            break;
                        }
                    }
                }
                std::process::exit(128 + signal);
            }
        });
        drop(spawned);
    });
}
