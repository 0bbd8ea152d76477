//! Temporary folders that must go however the command ends: on return, on an error, and on SIGINT, SIGTERM or
//! SIGHUP (a signal handler thread removes every registered folder, then exits with 128 + the signal's number, as a
//! shell reports a process killed by it). SIGKILL cannot be caught; what it leaves is named so it is recognisable.
//!
//! The handler holds the folder list from its first removal to its exit, and the command's own way out, [`close`],
//! takes the list before it returns: a process that fails on its own while a signal's removal runs (a rank whose
//! peer was stopped at the same moment) waits for the removal instead of ending it halfway.

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

/// Removes `folder` (another process's) if this process is stopped by a signal; nothing on a normal exit. A rank of
/// `replay --processes` registers its launcher's folders: when the launcher is killed, the kernel stops its ranks
/// with SIGTERM (the parent-death signal), and they remove what the launcher could not.
pub(crate) fn remove_on_signal(folder: PathBuf) {
    install_handler();
    lock().push(folder);
}

/// Called once, as the command ends on its own: a signal handler already removing folders finishes (and exits the
/// process with the signal's status) before this returns; a signal that comes after it removes nothing, since the
/// command is ending and its own guards have removed what they made.
pub(crate) fn close() {
    // never unlocked: the process is ending
    std::mem::forget(lock());
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
                // held until the exit: `close` on another thread waits here
                let mut folders = lock();
                for folder in folders.drain(..) {
                    remove_while_written(&folder);
                }
                crate::exit::now(u8::try_from(128 + signal).unwrap_or(u8::MAX));
            }
        });
        drop(spawned);
    });
}

/// Removes `folder` while I/O threads may still be writing below it. Storage threads make missing folders below the
/// one they were given, so a removal in place can lose the race against them for as long as they run. The folder is
/// first renamed to a unique name beside it (atomic; every path they hold then names nothing, and nothing is ever made
/// below the new name), and the renamed folder is removed. Where the rename fails, it is removed in place.
fn remove_while_written(folder: &Path) {
    let mut target = folder.to_path_buf();
    if let (Some(parent), Some(name)) = (folder.parent(), folder.file_name())
        && let Ok(empty) = tempfile::Builder::new()
            .prefix(&format!(".{}.removing-", name.to_string_lossy()))
            .tempdir_in(parent)
            .map(tempfile::TempDir::keep)
    {
        // renaming a folder over an empty one replaces it
        match std::fs::rename(folder, &empty) {
            Ok(()) => target = empty,
            Err(_) => drop(std::fs::remove_dir(&empty)),
        }
    }
    for _ in 0..100 {
        if std::fs::remove_dir_all(&target).is_ok() || !target.exists() {
            break;
        }
    }
}
