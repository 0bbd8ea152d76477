//! Page files opened and registered with NIXL once, kept open up to a bound.
//!
//! SGLang opens and registers every file on every transfer and never closes or deregisters it (§17 item 5: one
//! descriptor and one registration leaked per file per transfer). Here each page file is opened and registered on
//! first use and stays so while it is among the `capacity` most recently used; a file that falls out is deregistered
//! and closed once no transfer holds it.
//!
//! A cached descriptor is used only while the page's path still names the same file (device and inode checked with
//! one `stat`, with its size): a page removed, replaced or truncated since, by this process or another, is opened
//! afresh, and is then a miss or a corrupt page.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use hicache_core::hash::PageKey;
use nixl_sys::{MemType, NixlError, RegistrationHandle};

use crate::agent::{NixlAgent, Region};

/// An open, registered page file. The registration is released before the file closes (field order).
#[derive(Debug)]
pub(crate) struct OpenPage {
    _registration: RegistrationHandle,
    file: File,
    /// Device, inode and size of the file, to tell whether the path still names it, whole.
    identity: (u64, u64, u64),
}

impl OpenPage {
    /// Registers `file`, `len` bytes from offset 0, with the agent.
    pub(crate) fn register(agent: &NixlAgent, file: File, len: usize) -> Result<Self, (File, NixlError)> {
        let metadata = match file.metadata() {
            Ok(metadata) => metadata,
            // fstat of an open descriptor does not fail in practice; treat it as an unusable file
            Err(_) => return Err((file, NixlError::InvalidParam)),
        };
        let region = Region { address: 0, len, mem_type: MemType::File, device: file.as_raw_fd() as u64 };
        match agent.register(&region) {
            Ok(registration) => Ok(Self { _registration: registration, identity: identity(&metadata), file }),
            Err(failure) => Err((file, failure)),
        }
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// The same file with its identity read again (after it was written: a new file grows to its page).
    pub(crate) fn refreshed(mut self) -> Self {
        if let Ok(metadata) = self.file.metadata() {
            self.identity = identity(&metadata);
        }
        self
    }

    /// Whether `path` still names this file, at the size it had when opened (a page truncated in place since is
    /// opened afresh, and then found short).
    pub(crate) fn is_at(&self, path: &Path) -> bool {
        std::fs::metadata(path).is_ok_and(|metadata| identity(&metadata) == self.identity)
    }
}

fn identity(metadata: &std::fs::Metadata) -> (u64, u64, u64) {
    (metadata.dev(), metadata.ino(), metadata.len())
}

/// Recently used page files.
#[derive(Debug)]
pub(crate) struct FileCache {
    pages: HashMap<PageKey, (Arc<OpenPage>, u64)>,
    /// Use tick → key, oldest first.
    order: BTreeMap<u64, PageKey>,
    tick: u64,
    capacity: usize,
    opened: u64,
}

impl FileCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { pages: HashMap::new(), order: BTreeMap::new(), tick: 0, capacity: capacity.max(1), opened: 0 }
    }

    /// Files opened and registered so far.
    pub(crate) fn opened(&self) -> u64 {
        self.opened
    }

    /// Files now open.
    pub(crate) fn len(&self) -> usize {
        self.pages.len()
    }

    /// The open file of `key`, marked as just used.
    pub(crate) fn get(&mut self, key: &PageKey) -> Option<Arc<OpenPage>> {
        let tick = self.next_tick();
        let (page, used) = self.pages.get_mut(key)?;
        self.order.remove(used);
        *used = tick;
        self.order.insert(tick, *key);
        Some(Arc::clone(page))
    }

    /// Keeps `page` as the open file of `key` (replacing an older one), closing the least recently used beyond the
    /// capacity. Files still held by a transfer close when it lets go.
    pub(crate) fn insert(&mut self, key: PageKey, page: Arc<OpenPage>) {
        self.opened += 1;
        let tick = self.next_tick();
        if let Some((_, used)) = self.pages.insert(key, (page, tick)) {
            self.order.remove(&used);
        }
        self.order.insert(tick, key);
        while self.pages.len() > self.capacity {
            let Some((_, oldest)) = self.order.pop_first() else { break };
            self.pages.remove(&oldest);
        }
    }

    /// Forgets `key`'s file (it was removed or found stale).
    pub(crate) fn forget(&mut self, key: &PageKey) {
        if let Some((_, used)) = self.pages.remove(key) {
            self.order.remove(&used);
        }
    }

    /// Forgets every file.
    pub(crate) fn clear(&mut self) {
        self.pages.clear();
        self.order.clear();
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}
