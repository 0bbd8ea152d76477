//! Storage counters: what each backend records and reports through `StorageBackend::stats`.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::{GetOutcome, SetOutcome};

/// A snapshot of a backend's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct StorageStats {
    /// Keys asked about by `batch_exists`.
    pub exists_keys: u64,
    /// Of those, counted present.
    pub exists_hits: u64,
    /// Pages read: hits.
    pub get_hits: u64,
    /// Pages read: misses.
    pub get_misses: u64,
    /// Pages read: failures.
    pub get_failures: u64,
    /// Pages written.
    pub set_stored: u64,
    /// Pages already present when written.
    pub set_present: u64,
    /// Pages whose write failed.
    pub set_failures: u64,
    /// Bytes delivered by hits.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Pages removed (by `remove`, `clear`, and eviction in backends with a capacity).
    pub removed: u64,
    /// Bytes copied through an intermediate buffer on their way between the caller's segments and storage (a bounce
    /// buffer for memory the transport cannot reach); 0 when every byte moves straight from and into the segments.
    pub staging_bytes: u64,
}

/// Counters of several backends together (the chunk tiers of one unified storage, say).
impl std::ops::AddAssign for StorageStats {
    fn add_assign(&mut self, other: Self) {
        let Self {
            exists_keys,
            exists_hits,
            get_hits,
            get_misses,
            get_failures,
            set_stored,
            set_present,
            set_failures,
            bytes_read,
            bytes_written,
            removed,
            staging_bytes,
        } = other;
        self.exists_keys += exists_keys;
        self.exists_hits += exists_hits;
        self.get_hits += get_hits;
        self.get_misses += get_misses;
        self.get_failures += get_failures;
        self.set_stored += set_stored;
        self.set_present += set_present;
        self.set_failures += set_failures;
        self.bytes_read += bytes_read;
        self.bytes_written += bytes_written;
        self.removed += removed;
        self.staging_bytes += staging_bytes;
    }
}

/// Thread-safe counters behind [`StorageStats`].
#[derive(Debug, Default)]
pub struct StatsRecorder {
    exists_keys: AtomicU64,
    exists_hits: AtomicU64,
    get_hits: AtomicU64,
    get_misses: AtomicU64,
    get_failures: AtomicU64,
    set_stored: AtomicU64,
    set_present: AtomicU64,
    set_failures: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    removed: AtomicU64,
    staging_bytes: AtomicU64,
}

fn add(counter: &AtomicU64, amount: usize) {
    counter.fetch_add(amount as u64, Ordering::Relaxed);
}

impl StatsRecorder {
    /// Records a `batch_exists` of `keys` keys that found `hits`.
    pub fn record_exists(&self, keys: usize, hits: usize) {
        add(&self.exists_keys, keys);
        add(&self.exists_hits, hits);
    }

    /// Records the outcomes of a `batch_get` whose hits delivered `page_bytes[i]` each.
    pub fn record_get(&self, outcomes: &[GetOutcome], page_bytes: impl Fn(usize) -> usize) {
        for (index, outcome) in outcomes.iter().enumerate() {
            match outcome {
                GetOutcome::Hit => {
                    add(&self.get_hits, 1);
                    add(&self.bytes_read, page_bytes(index));
                }
                GetOutcome::Miss => add(&self.get_misses, 1),
                GetOutcome::Failed(_) => add(&self.get_failures, 1),
            }
        }
    }

    /// Records the outcomes of a `batch_set` whose stored pages were `page_bytes[i]` each.
    pub fn record_set(&self, outcomes: &[SetOutcome], page_bytes: impl Fn(usize) -> usize) {
        for (index, outcome) in outcomes.iter().enumerate() {
            match outcome {
                SetOutcome::Stored => {
                    add(&self.set_stored, 1);
                    add(&self.bytes_written, page_bytes(index));
                }
                SetOutcome::AlreadyPresent => add(&self.set_present, 1),
                SetOutcome::Failed(_) => add(&self.set_failures, 1),
            }
        }
    }

    /// Records removed pages.
    pub fn record_removed(&self, pages: u64) {
        self.removed.fetch_add(pages, Ordering::Relaxed);
    }

    /// Records bytes copied through an intermediate buffer.
    pub fn record_staging(&self, bytes: usize) {
        add(&self.staging_bytes, bytes);
    }

    /// A snapshot.
    pub fn snapshot(&self) -> StorageStats {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        StorageStats {
            exists_keys: load(&self.exists_keys),
            exists_hits: load(&self.exists_hits),
            get_hits: load(&self.get_hits),
            get_misses: load(&self.get_misses),
            get_failures: load(&self.get_failures),
            set_stored: load(&self.set_stored),
            set_present: load(&self.set_present),
            set_failures: load(&self.set_failures),
            bytes_read: load(&self.bytes_read),
            bytes_written: load(&self.bytes_written),
            removed: load(&self.removed),
            staging_bytes: load(&self.staging_bytes),
        }
    }
}
