//! Page files opened and registered with NIXL once, kept open up to a bound.
//!
//! SGLang opens and registers every file on every transfer and never closes or deregisters it (docs/sglang.md#fixed-5:
//! one descriptor and one registration leaked per file per transfer). Here each page file is opened and registered on
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

/// Recently used page files (generic over the entry, so the cache's bookkeeping is tested without NIXL).
#[derive(Debug)]
pub(crate) struct FileCache<T = OpenPage> {
    pages: HashMap<PageKey, (Arc<T>, u64)>,
    /// Use tick → key, oldest first.
    order: BTreeMap<u64, PageKey>,
    tick: u64,
    capacity: usize,
    opened: u64,
}

impl<T> FileCache<T> {
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
    pub(crate) fn get(&mut self, key: &PageKey) -> Option<Arc<T>> {
        let tick = self.next_tick();
        let (page, used) = self.pages.get_mut(key)?;
        self.order.remove(used);
        *used = tick;
        self.order.insert(tick, *key);
        Some(Arc::clone(page))
    }

    /// Keeps `page` as the open file of `key` (replacing an older one), closing the least recently used beyond the
    /// capacity. Files still held by a transfer close when it lets go.
    pub(crate) fn insert(&mut self, key: PageKey, page: Arc<T>) {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use hicache_core::hash::PageKey;
    use proptest::prelude::*;

    use super::FileCache;

    #[derive(Clone, Debug)]
    enum Step {
        Get(u8),
        Insert(u8, u32),
        Forget(u8),
        Clear,
    }

    fn key(index: u8) -> PageKey {
        PageKey::from_bytes([index; 32])
    }

    proptest! {
        /// The cache against a model: a list of (key, value), most recently used last, cut to the capacity.
        #[test]
        fn the_cache_keeps_the_most_recently_used(
            capacity in 1usize..6,
            steps in prop::collection::vec(prop_oneof![
                4 => (0u8..8).prop_map(Step::Get),
                4 => (0u8..8, any::<u32>()).prop_map(|(key, value)| Step::Insert(key, value)),
                1 => (0u8..8).prop_map(Step::Forget),
                1 => Just(Step::Clear),
            ], 0..80),
        ) {
            let mut cache: FileCache<u32> = FileCache::new(capacity);
            let mut model: Vec<(u8, u32)> = Vec::new();
            for step in steps {
                match step {
                    Step::Get(index) => {
                        let expected = model.iter().position(|entry| entry.0 == index).map(|at| model.remove(at));
                        if let Some(entry) = expected {
                            model.push(entry);
                        }
                        prop_assert_eq!(cache.get(&key(index)).map(|value| *value), expected.map(|entry| entry.1));
                    }
                    Step::Insert(index, value) => {
                        model.retain(|entry| entry.0 != index);
                        model.push((index, value));
                        if model.len() > capacity {
                            model.remove(0);
                        }
                        cache.insert(key(index), Arc::new(value));
                    }
                    Step::Forget(index) => {
                        model.retain(|entry| entry.0 != index);
                        cache.forget(&key(index));
                    }
                    Step::Clear => {
                        model.clear();
                        cache.clear();
                    }
                }
                prop_assert_eq!(cache.len(), model.len());
                prop_assert_eq!(cache.order.len(), cache.pages.len(), "the order lists each entry once");
            }
        }
    }
}
