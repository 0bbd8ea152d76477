//! The in-memory storage backend: a hash map shared by any number of namespaces, as a cluster is.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{
    GetOutcome, PageSegments, PageSegmentsMut, SetOutcome, StatsRecorder, StorageBackend, StorageStats, check_batch,
    gather, scatter, segments_len, size_mismatch,
};
use crate::error::Error;
use crate::hash::PageKey;
use crate::namespace::StorageNamespace;

/// (namespace digest, page key) → page bytes.
type Objects = HashMap<(Arc<str>, PageKey), Arc<[u8]>>;

/// The shared map of objects of every namespace.
#[derive(Debug, Default)]
pub struct MemoryStore {
    objects: RwLock<Objects>,
}

impl MemoryStore {
    /// An empty store, to share between backends.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Objects in the store, all namespaces.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether the store holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn read(&self) -> RwLockReadGuard<'_, Objects> {
        // a panic while holding the lock cannot leave the map half-updated: every update is one insert or remove
        self.objects.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Objects> {
        self.objects.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A backend over a [`MemoryStore`] for one namespace.
#[derive(Debug)]
pub struct MemoryStorage {
    store: Arc<MemoryStore>,
    namespace: StorageNamespace,
    digest: Arc<str>,
    page_bytes: usize,
    stats: StatsRecorder,
}

impl MemoryStorage {
    /// A backend with a store of its own.
    pub fn new(namespace: &StorageNamespace) -> Self {
        Self::shared(MemoryStore::new(), namespace)
    }

    /// A backend over a shared store.
    pub fn shared(store: Arc<MemoryStore>, namespace: &StorageNamespace) -> Self {
        Self {
            store,
            namespace: namespace.clone(),
            digest: namespace.digest().into(),
            page_bytes: namespace.page_bytes(),
            stats: StatsRecorder::default(),
        }
    }

    /// The underlying store.
    pub fn store(&self) -> &Arc<MemoryStore> {
        &self.store
    }

    fn object_key(&self, key: &PageKey) -> (Arc<str>, PageKey) {
        (self.digest.clone(), *key)
    }
}

impl StorageBackend for MemoryStorage {
    fn name(&self) -> &str {
        "memory"
    }

    fn namespace(&self) -> Option<&StorageNamespace> {
        Some(&self.namespace)
    }

    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
        let objects = self.store.read();
        let hits = keys.iter().take_while(|key| objects.contains_key(&self.object_key(key))).count();
        self.stats.record_exists(keys.len(), hits);
        Ok(hits)
    }

    fn batch_contains(&self, keys: &[PageKey]) -> Result<Vec<bool>, Error> {
        let objects = self.store.read();
        Ok(keys.iter().map(|key| objects.contains_key(&self.object_key(key))).collect())
    }

    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
        check_batch(keys.len(), pages.len())?;
        let found: Vec<Option<Arc<[u8]>>> = {
            let objects = self.store.read();
            keys.iter().map(|key| objects.get(&self.object_key(key)).cloned()).collect()
        };
        let outcomes: Vec<GetOutcome> = found
            .into_iter()
            .zip(pages.iter_mut())
            .map(|(object, page)| match object {
                None => GetOutcome::Miss,
                Some(bytes) if bytes.len() != segments_len(page) => {
                    GetOutcome::Failed(size_mismatch(segments_len(page), self.page_bytes))
                }
                Some(bytes) => {
                    scatter(&bytes, page);
                    GetOutcome::Hit
                }
            })
            .collect();
        self.stats.record_get(&outcomes, |_| self.page_bytes);
        Ok(outcomes)
    }

    fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
        check_batch(keys.len(), pages.len())?;
        let outcomes: Vec<SetOutcome> = keys
            .iter()
            .zip(pages)
            .map(|(key, page)| {
                if segments_len(page) != self.page_bytes {
                    return SetOutcome::Failed(size_mismatch(segments_len(page), self.page_bytes));
                }
                if self.store.read().contains_key(&self.object_key(key)) {
                    return SetOutcome::AlreadyPresent;
                }
                let bytes: Arc<[u8]> = gather(page).into();
                match self.store.write().entry(self.object_key(key)) {
                    std::collections::hash_map::Entry::Occupied(_) => SetOutcome::AlreadyPresent,
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        slot.insert(bytes);
                        SetOutcome::Stored
                    }
                }
            })
            .collect();
        self.stats.record_set(&outcomes, |_| self.page_bytes);
        Ok(outcomes)
    }

    fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
        let mut objects = self.store.write();
        let removed = keys.iter().filter(|key| objects.remove(&self.object_key(key)).is_some()).count();
        self.stats.record_removed(removed as u64);
        Ok(removed)
    }

    fn clear(&self) -> Result<u64, Error> {
        let mut objects = self.store.write();
        let before = objects.len();
        objects.retain(|(namespace, _), _| *namespace != self.digest);
        let removed = (before - objects.len()) as u64;
        self.stats.record_removed(removed);
        Ok(removed)
    }

    fn stats(&self) -> StorageStats {
        self.stats.snapshot()
    }

    fn list(&self) -> Result<Vec<(PageKey, u64)>, Error> {
        let objects = self.store.read();
        Ok(objects
            .iter()
            .filter(|((namespace, _), _)| *namespace == self.digest)
            .map(|((_, key), bytes)| (*key, bytes.len() as u64))
            .collect())
    }
}
