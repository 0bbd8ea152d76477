//! The capacity account of a file backend: bytes held per page and least-recently-used order, for eviction.
//!
//! Built from the directory (file sizes, and modification times as recency, which every process's reads touch) at
//! open, before an eviction, and whenever another process changed the shared account (`account.rs`); in between it
//! is kept in memory: a hit or a write makes a page the most recent.

use std::collections::{BTreeMap, HashMap};

use hicache_core::hash::PageKey;

/// Pages, their sizes, and their recency.
#[derive(Debug, Default)]
pub(crate) struct LruIndex {
    entries: HashMap<PageKey, (u64, u64)>,
    by_tick: BTreeMap<u64, PageKey>,
    total: u64,
    next_tick: u64,
}

impl LruIndex {
    /// Bytes held by all pages.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Pages held.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Records a page of `bytes` as the most recent (replacing any earlier record of it).
    pub(crate) fn insert(&mut self, key: PageKey, bytes: u64) {
        self.remove(&key);
        self.next_tick += 1;
        self.entries.insert(key, (bytes, self.next_tick));
        self.by_tick.insert(self.next_tick, key);
        self.total += bytes;
    }

    /// How recent a held page is (larger is more recent), within this index.
    pub(crate) fn recency(&self, key: &PageKey) -> Option<u64> {
        self.entries.get(key).map(|&(_, tick)| tick)
    }

    /// Makes a page the most recent, if held.
    pub(crate) fn touch(&mut self, key: &PageKey) {
        if let Some(&(bytes, _)) = self.entries.get(key) {
            self.insert(*key, bytes);
        }
    }

    /// Forgets a page; returns its bytes if it was held.
    pub(crate) fn remove(&mut self, key: &PageKey) -> Option<u64> {
        let (bytes, tick) = self.entries.remove(key)?;
        self.by_tick.remove(&tick);
        self.total -= bytes;
        Some(bytes)
    }

    /// Removes and returns least recent pages, sparing `keep` (which becomes the most recent), until the total is
    /// at most `limit`. A spared page larger than the limit stays alone.
    pub(crate) fn evict_to(&mut self, limit: u64, keep: &PageKey) -> Vec<PageKey> {
        let kept = self.remove(keep);
        let room = limit.saturating_sub(kept.unwrap_or(0));
        let mut victims = Vec::new();
        while self.total > room {
            let Some((_, key)) = self.by_tick.pop_first() else { break };
            let (bytes, _) = self.entries.remove(&key).expect("every tick names an entry");
            self.total -= bytes;
            victims.push(key);
        }
        if let Some(bytes) = kept {
            self.insert(*keep, bytes);
        }
        victims
    }

    /// Checks that the maps agree and the total is their sum.
    #[cfg(test)]
    pub(crate) fn check(&self) {
        assert_eq!(self.entries.len(), self.by_tick.len());
        for (tick, key) in &self.by_tick {
            assert_eq!(self.entries[key].1, *tick);
        }
        assert_eq!(self.total, self.entries.values().map(|(bytes, _)| bytes).sum::<u64>());
    }
}

#[cfg(test)]
mod tests {
    use hicache_core::hash::page_key;

    use super::*;

    fn key(n: u32) -> PageKey {
        page_key(None, &[n])
    }

    #[test]
    fn evicts_least_recent_first_and_spares_the_new_page() {
        let mut index = LruIndex::default();
        for n in 0..4 {
            index.insert(key(n), 10);
        }
        index.touch(&key(0));
        // order now 1, 2, 3, 0
        assert_eq!(index.evict_to(25, &key(3)), [key(1), key(2)]);
        index.check();
        assert_eq!((index.total(), index.len()), (20, 2));
        // the spared page stays even when it alone is over the limit
        index.insert(key(9), 100);
        assert_eq!(index.evict_to(50, &key(9)), [key(0), key(3)]);
        index.check();
        assert_eq!(index.len(), 1);
        assert_eq!(index.remove(&key(9)), Some(100));
        assert_eq!(index.total(), 0);
    }
}
