//! The byte capacity of one namespace, held across every process that shares the directory.
//!
//! A small file beside the namespace's pages holds the bytes its page files take (u64 LE). A writer that stores a
//! page takes an exclusive lock on that file (`flock`, so it is also released when a process dies), adds the page's
//! bytes, and, when the total passes the capacity, counts the directory and evicts least recently used pages (by
//! modification time, which reads touch) until it is back under, then writes the new total. When the total it finds
//! is not the one it last wrote, another process changed the directory, so it counts the directory again first. An evicted page that a
//! reader has open stays readable to it (the file is unlinked, not truncated).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt as _;
use std::path::Path;

/// The account file of a namespace, open for the life of the backend.
#[derive(Debug)]
pub(crate) struct SharedAccount {
    file: File,
}

impl SharedAccount {
    /// Opens (creating if needed) the account file at `path`.
    pub(crate) fn open(path: &Path) -> io::Result<Self> {
        let file = File::options().read(true).write(true).create(true).truncate(false).open(path)?;
        Ok(Self { file })
    }

    /// Locks the account against every other process (and, through the caller's in-process lock, every thread).
    pub(crate) fn lock(&self) -> io::Result<Locked<'_>> {
        self.file.lock()?;
        Ok(Locked { file: &self.file })
    }
}

/// The account while locked; unlocked when dropped.
#[derive(Debug)]
pub(crate) struct Locked<'a> {
    file: &'a File,
}

impl Locked<'_> {
    /// The bytes recorded, or `None` for a new account.
    pub(crate) fn bytes(&self) -> io::Result<Option<u64>> {
        let mut buffer = [0u8; 8];
        match self.file.read_at(&mut buffer, 0) {
            Ok(8) => Ok(Some(u64::from_le_bytes(buffer))),
            Ok(_) => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Records `bytes`.
    pub(crate) fn set(&self, bytes: u64) -> io::Result<()> {
        self.file.write_all_at(&bytes.to_le_bytes(), 0)
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}
