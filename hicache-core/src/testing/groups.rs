//! Page groups of a hybrid model for the tiers' tests: a run of KV pages with a Mamba state pool (a state at some
//! pages, the ends of nodes; window 1) and an indexer pool (every page), random bytes, written and read back through
//! [`GroupStorage`].

use std::sync::Arc;

use super::conformance::{random_keys, random_pages};
use crate::hash::PageKey;
use crate::storage::groups::{GroupStorage, HitPolicy, SidecarPool};
use crate::storage::{PageSegments, PageSegmentsMut, StorageBackend};

/// Bytes of a state entry.
pub const STATE_BYTES: usize = 3000;
/// Bytes of an indexer entry.
pub const INDEXER_BYTES: usize = 528;

/// The pools of the run: `state` (window 1) and `indexer` (every page), in that order.
pub fn pools(state: Arc<dyn StorageBackend>, indexer: Arc<dyn StorageBackend>) -> Vec<SidecarPool> {
    vec![
        SidecarPool { name: "mamba".into(), policy: HitPolicy::TrailingPages { window: 1 }, backend: state },
        SidecarPool { name: "indexer".into(), policy: HitPolicy::AllPages, backend: indexer },
    ]
}

/// A run of pages and their groups' bytes.
#[derive(Clone, Debug)]
pub struct HybridRun {
    /// The pages' keys.
    pub keys: Vec<PageKey>,
    /// The KV pages.
    pub kv: Vec<Vec<u8>>,
    /// The pages (indices) that end a node, where a state is kept, and the states.
    pub states: Vec<(usize, Vec<u8>)>,
    /// The indexer entries, one per page.
    pub entries: Vec<Vec<u8>>,
}

/// What a read of a prefix gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupRead {
    /// The restored length.
    pub restored: usize,
    /// The KV pages read.
    pub kv: Vec<Vec<u8>>,
    /// The state read (the one that ends the prefix).
    pub state: Vec<u8>,
    /// The indexer entries read.
    pub entries: Vec<Vec<u8>>,
}

impl HybridRun {
    /// `pages` pages of `page_bytes` with states at the ends of the nodes `ends` (lengths, so a state at page
    /// `end - 1`).
    pub fn new(pages: usize, page_bytes: usize, ends: &[usize]) -> Self {
        let states = random_pages(ends.len(), STATE_BYTES);
        Self {
            keys: random_keys(pages),
            kv: random_pages(pages, page_bytes),
            states: ends.iter().map(|end| end - 1).zip(states).collect(),
            entries: random_pages(pages, INDEXER_BYTES),
        }
    }

    /// Writes the run's groups (states and indexer entries first, then the KV); returns the pages whose group was
    /// stored whole.
    ///
    /// # Panics
    ///
    /// When a backend call fails as a whole.
    pub fn write(&self, groups: &GroupStorage) -> usize {
        let pages: Vec<PageSegments<'_>> = self.kv.iter().map(|page| vec![page.as_slice()]).collect();
        let sidecars = [
            self.states.iter().map(|(page, state)| (*page, vec![state.as_slice()])).collect(),
            self.entries.iter().enumerate().map(|(page, entry)| (page, vec![entry.as_slice()])).collect(),
        ];
        groups.set(&self.keys, &pages, &sidecars).expect("the group write").pages
    }

    /// What a whole read of the prefix of `length` pages gives: its KV pages, the state that ends it, its indexer
    /// entries.
    ///
    /// # Panics
    ///
    /// When no state ends the prefix.
    pub fn expected(&self, length: usize) -> GroupRead {
        let state = self.states.iter().find(|(page, _)| page + 1 == length).expect("a state ends the prefix");
        GroupRead {
            restored: length,
            kv: self.kv[..length].to_vec(),
            state: state.1.clone(),
            entries: self.entries[..length].to_vec(),
        }
    }
}

/// Reads the prefix of `length` pages of `keys` (pages of `page_bytes`) from groups of [`pools`].
///
/// # Panics
///
/// When a backend call fails as a whole.
pub fn read(groups: &GroupStorage, keys: &[PageKey], length: usize, page_bytes: usize) -> GroupRead {
    let mut kv = vec![vec![0u8; page_bytes]; length];
    let mut state = vec![0u8; STATE_BYTES];
    let mut entries = vec![vec![0u8; INDEXER_BYTES]; length];
    let restored = {
        let mut kv_pages: Vec<PageSegmentsMut<'_>> = kv.iter_mut().map(|page| vec![page.as_mut_slice()]).collect();
        let mut sidecars = vec![
            vec![vec![state.as_mut_slice()]],
            entries.iter_mut().map(|entry| vec![entry.as_mut_slice()]).collect::<Vec<_>>(),
        ];
        groups.get(keys, length, &mut kv_pages, &mut sidecars).expect("the group read")
    };
    GroupRead { restored, kv, state, entries }
}
