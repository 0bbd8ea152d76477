//! Page groups of hybrid models: which prefixes of a run of pages can be restored, and the one length every rank
//! can restore.
//!
//! A hybrid model keeps, beside its KV pool, sidecar pools under the same page keys: a linear-attention (Mamba)
//! state or a sliding-window KV that only a window of the last pages needs, a sparse-attention indexer that every
//! page needs. A page group is a page's KV entry and its sidecar entries. A prefix of `n` pages can be restored only
//! when every pool holds what restoring it needs:
//!
//! - the KV pool: pages `0..n` ([`HitPolicy::AllPages`], always);
//! - a pool with [`HitPolicy::AllPages`] (an indexer, a draft model's KV): pages `0..n` as well;
//! - a pool with [`HitPolicy::TrailingPages`] (a state, a sliding window): only the last `window` pages before `n`,
//!   so a state written at page 8 and page 4 makes prefixes 4 and 8 restorable but not 6.
//!
//! The restorable lengths of a rank are therefore a set, not a prefix: a rank whose longest restorable prefix is 8
//! may not be able to restore 6. Ranks of one tensor-parallel group each hold their own shard of every pool, and may
//! hold different windows (one rank's state at page 8 was evicted, another's at page 4); the length they load is the
//! longest one in every rank's set ([`agreed_prefix`]), not the least of their longest ones, which another rank may
//! not be able to restore.
//!
//! [`restorable`] answers as SGLang's `batch_exists_v2` does (its `PoolTransferResult`: the KV hit, each pool's own
//! boundary, the restorable lengths), checked against SGLang's own code in `tests/pool_groups.rs`.
//!
//! [`GroupStorage`] keeps page groups in storage: one backend per pool, every pool's entries under the same page
//! keys (each backend serves its own namespace, [`StorageNamespace::sidecar`] for a sidecar pool, so entries of
//! different pools never share an object). It never hands back a KV page without what its group needs: a query
//! counts only prefixes every pool can restore, and a read counts only prefixes whose every needed entry was read
//! whole (an entry evicted since the query, damaged, or left out by a writer that died halfway is a miss there, and
//! the restored prefix ends before it). A backend with checksums (the file tier's native format, whose checksums
//! bind the namespace, so the pool and the entry size) turns a damaged entry into a miss; one without returns what
//! it holds.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use super::{GetOutcome, PageSegments, PageSegmentsMut, SetOutcome, StorageBackend};
use crate::error::Error;
use crate::hash::PageKey;
use crate::namespace::StorageNamespace;

/// What a sidecar pool must hold for a prefix to be restorable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HitPolicy {
    /// Every page of the prefix (SGLang's `all_pages`: an indexer, a draft model's KV).
    AllPages,
    /// The last `window` pages of the prefix (SGLang's `trailing_pages`: a Mamba state, a sliding window); a window
    /// of 0 counts as 1, as in SGLang.
    TrailingPages {
        /// Pages the prefix's last pages must hold.
        window: usize,
    },
}

impl HitPolicy {
    /// SGLang's name of the policy.
    pub fn name(self) -> &'static str {
        match self {
            HitPolicy::AllPages => "all_pages",
            HitPolicy::TrailingPages { .. } => "trailing_pages",
        }
    }
}

/// Which pages of a run one sidecar pool holds.
#[derive(Clone, Copy, Debug)]
pub struct PoolPresence<'a> {
    /// What restoring a prefix needs of the pool.
    pub policy: HitPolicy,
    /// Per page of the run, whether the pool holds the page's entry (whole: a damaged or partly written entry is not
    /// held). Pages past its end are not held.
    pub held: &'a [bool],
}

/// What one rank can restore of a run of pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restorable {
    /// The leading pages whose KV entries are all held.
    pub kv_pages: usize,
    /// Per sidecar pool, in the order given, its own boundary: `None` where it is 0, or where no prefix was left to
    /// judge when its turn came (SGLang reports neither).
    pub pool_pages: Vec<Option<usize>>,
    /// The restorable prefix lengths, ascending, each at least 1.
    pub lengths: Vec<usize>,
}

impl Restorable {
    /// The longest restorable prefix (0 when none is).
    pub fn longest(&self) -> usize {
        self.lengths.last().copied().unwrap_or(0)
    }
}

/// Which prefixes of a run of pages a rank can restore, given which KV entries (`kv_held`) and sidecar entries it
/// holds (see the module).
pub fn restorable(kv_held: &[bool], pools: &[PoolPresence<'_>]) -> Restorable {
    let kv_pages = kv_held.iter().position(|&held| !held).unwrap_or(kv_held.len());
    let holds = |pool: &PoolPresence<'_>, page: usize| pool.held.get(page).copied().unwrap_or(false);
    let mut lengths: Vec<usize> = (1..=kv_pages).collect();
    let mut pool_pages = vec![None; pools.len()];
    for (pool, pages) in pools.iter().zip(&mut pool_pages) {
        if lengths.is_empty() {
            break;
        }
        let fits: Vec<bool> = match pool.policy {
            HitPolicy::AllPages => {
                let boundary = (0..kv_pages).position(|page| !holds(pool, page)).unwrap_or(kv_pages);
                (0..=kv_pages).map(|length| length <= boundary).collect()
            }
            HitPolicy::TrailingPages { window } => {
                let window = window.max(1);
                (0..=kv_pages)
                    .map(|length| length > 0 && (length.saturating_sub(window)..length).all(|page| holds(pool, page)))
                    .collect()
            }
        };
        let boundary = (1..=kv_pages).rev().find(|&length| fits[length]).unwrap_or(0);
        *pages = (boundary > 0).then_some(boundary);
        lengths.retain(|&length| fits[length]);
    }
    Restorable { kv_pages, pool_pages, lengths }
}

/// The longest prefix every rank can restore: the largest length in every rank's [`Restorable::lengths`], capped at
/// `cap` pages (what the caller has room for); 0 when there is none, or no rank.
pub fn agreed_prefix(ranks: &[&[usize]], cap: usize) -> usize {
    let Some((first, others)) = ranks.split_first() else {
        return 0;
    };
    first
        .iter()
        .copied()
        .filter(|&length| length <= cap && others.iter().all(|lengths| lengths.contains(&length)))
        .max()
        .unwrap_or(0)
}

/// The pages of a run that restoring a prefix of `length` pages needs of a pool with `policy`.
pub fn needed(policy: HitPolicy, length: usize) -> std::ops::Range<usize> {
    match policy {
        HitPolicy::AllPages => 0..length,
        HitPolicy::TrailingPages { window } => length.saturating_sub(window.max(1))..length,
    }
}

/// One sidecar pool of a [`GroupStorage`].
#[derive(Clone)]
pub struct SidecarPool {
    /// The pool's name (SGLang's: `mamba`, `swa`, `indexer`, `draft`, ...).
    pub name: String,
    /// What restoring a prefix needs of it.
    pub policy: HitPolicy,
    /// Where its entries are kept.
    pub backend: Arc<dyn StorageBackend>,
}

impl fmt::Debug for SidecarPool {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("SidecarPool")
            .field("name", &self.name)
            .field("policy", &self.policy)
            .field("backend", &self.backend.name())
            .finish()
    }
}

/// Page groups in storage: the KV pages in one backend, each sidecar pool's entries in another, under the same
/// page keys (see the module).
pub struct GroupStorage {
    kv: Arc<dyn StorageBackend>,
    sidecars: Vec<SidecarPool>,
}

impl fmt::Debug for GroupStorage {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.debug_struct("GroupStorage").field("kv", &self.kv.name()).field("sidecars", &self.sidecars).finish()
    }
}

/// What a group write stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupWrite {
    /// The leading pages whose KV entry and every all-pages sidecar entry are stored.
    pub pages: usize,
    /// Per sidecar pool, per entry given, whether it is stored.
    pub sidecars: Vec<Vec<bool>>,
}

impl GroupStorage {
    /// Groups of the KV pages in `kv` and the sidecar pools `sidecars`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `sidecars` when a name is empty, `kv` or given twice, or when two pools'
    /// backends serve the same namespace (their entries would overwrite each other).
    pub fn new(kv: Arc<dyn StorageBackend>, sidecars: Vec<SidecarPool>) -> Result<Self, Error> {
        let bad = |reason: String| Err(Error::InvalidArgument { field: "sidecars", reason });
        let mut names = HashSet::new();
        for pool in &sidecars {
            if pool.name.is_empty() || pool.name == "kv" || !names.insert(pool.name.as_str()) {
                return bad(format!("pool name {:?} is empty, `kv` or given twice", pool.name));
            }
        }
        let namespaces: Vec<(&str, &StorageNamespace)> = std::iter::once(("kv", kv.namespace()))
            .chain(sidecars.iter().map(|pool| (pool.name.as_str(), pool.backend.namespace())))
            .filter_map(|(name, namespace)| Some((name, namespace?)))
            .collect();
        for (index, (name, namespace)) in namespaces.iter().enumerate() {
            if let Some((other, _)) = namespaces[..index].iter().find(|(_, seen)| seen == namespace) {
                return bad(format!("pools `{other}` and `{name}` are kept in the same namespace"));
            }
        }
        Ok(Self { kv, sidecars })
    }

    /// The sidecar pools, in the order their entries are passed.
    pub fn sidecars(&self) -> &[SidecarPool] {
        &self.sidecars
    }

    /// Which prefixes of the run `keys` can be restored from storage now.
    ///
    /// # Errors
    ///
    /// A failure of a whole call to a backend.
    pub fn query(&self, keys: &[PageKey]) -> Result<Restorable, Error> {
        let kv_pages = self.kv.batch_exists(keys)?.min(keys.len());
        let kv_held: Vec<bool> = (0..keys.len()).map(|page| page < kv_pages).collect();
        // only the pages the KV holds can be part of a restorable prefix
        let keys = &keys[..kv_pages];
        let mut held = Vec::with_capacity(self.sidecars.len());
        for pool in &self.sidecars {
            held.push(match pool.policy {
                HitPolicy::AllPages => {
                    let present = pool.backend.batch_exists(keys)?.min(keys.len());
                    (0..keys.len()).map(|page| page < present).collect()
                }
                // a window is held at some pages only: every page is asked
                HitPolicy::TrailingPages { .. } => {
                    let held = pool.backend.batch_contains(keys)?;
                    if held.len() != keys.len() {
                        return Err(Error::storage(
                            pool.backend.name(),
                            format!("{} answers for {} keys (pool `{}`)", held.len(), keys.len(), pool.name),
                        ));
                    }
                    held
                }
            });
        }
        Ok(self.restorable(&kv_held, &held))
    }

    /// Reads the groups of the prefix of `length` pages of `keys`: the KV pages into `kv` (one destination per
    /// page), and each sidecar pool's entries [`needed`] for that length into `sidecars[pool]` (one destination per
    /// needed page, in page order). Returns the restored length: `length` when every entry was read whole, else the
    /// longest shorter prefix whose every needed entry is among those read whole, or 0 (a caller that wants a
    /// shorter prefix then queries again). Destinations past the restored length hold nothing usable.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `length`, `kv` or `sidecars` when they do not match; a failure of a whole
    /// call to a backend.
    pub fn get(
        &self,
        keys: &[PageKey],
        length: usize,
        kv: &mut [PageSegmentsMut<'_>],
        sidecars: &mut [Vec<PageSegmentsMut<'_>>],
    ) -> Result<usize, Error> {
        self.check(keys, length, kv.len(), sidecars.iter().map(Vec::len))?;
        let kv_held = hits(&self.kv.batch_get(&keys[..length], kv)?);
        let mut held = Vec::with_capacity(self.sidecars.len());
        for (pool, pages) in self.sidecars.iter().zip(sidecars) {
            let range = needed(pool.policy, length);
            let read = hits(&pool.backend.batch_get(&keys[range.clone()], pages)?);
            let mut pool_held = vec![false; length];
            pool_held[range].copy_from_slice(&read);
            held.push(pool_held);
        }
        Ok(self.restorable(&kv_held, &held).longest())
    }

    /// Writes the groups of the run `keys`: each sidecar pool's entries first (`sidecars[pool]`: the pages it has an
    /// entry for, with the entry; every page for an all-pages pool, the pages ending a window for a trailing one),
    /// then the KV pages, up to the first page whose all-pages sidecar entry was not stored: a KV page is never
    /// stored without them (the sidecar pools are flushed before the KV is written). A trailing entry that was not
    /// stored makes the prefixes it ends unrestorable, which a query then tells.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `kv` or `sidecars` when they do not match `keys`, an all-pages pool lacks an
    /// entry for a page, or an entry names a page outside the run; a failure of a whole call to a backend.
    pub fn set(
        &self,
        keys: &[PageKey],
        kv: &[PageSegments<'_>],
        sidecars: &[Vec<(usize, PageSegments<'_>)>],
    ) -> Result<GroupWrite, Error> {
        let bad = |field: &'static str, reason: String| Err(Error::InvalidArgument { field, reason });
        if kv.len() != keys.len() {
            return bad("kv", format!("{} pages for {} keys", kv.len(), keys.len()));
        }
        if sidecars.len() != self.sidecars.len() {
            return bad("sidecars", format!("entries of {} pools for {} pools", sidecars.len(), self.sidecars.len()));
        }
        let mut complete = keys.len();
        let mut stored = Vec::with_capacity(sidecars.len());
        for (pool, entries) in self.sidecars.iter().zip(sidecars) {
            if let Some((page, _)) = entries.iter().find(|(page, _)| *page >= keys.len()) {
                return bad("sidecars", format!("pool `{}`: page {page} of a run of {}", pool.name, keys.len()));
            }
            if pool.policy == HitPolicy::AllPages && !entries.iter().map(|(page, _)| *page).eq(0..keys.len()) {
                return bad("sidecars", format!("pool `{}` needs an entry for every page, in order", pool.name));
            }
        }
        for (pool, entries) in self.sidecars.iter().zip(sidecars) {
            let pool_keys: Vec<PageKey> = entries.iter().map(|(page, _)| keys[*page]).collect();
            let pages: Vec<PageSegments<'_>> = entries.iter().map(|(_, page)| page.clone()).collect();
            let outcomes: Vec<bool> = self.backend_set(&pool.backend, &pool_keys, &pages)?;
            if pool.policy == HitPolicy::AllPages {
                complete = complete.min(outcomes.iter().position(|stored| !stored).unwrap_or(keys.len()));
            }
            stored.push(outcomes);
        }
        // written before the KV, not only taken (a backend may write behind): so no process, and no crash, finds a
        // KV page whose entries are still on their way
        for pool in &self.sidecars {
            pool.backend.flush()?;
        }
        let outcomes = self.backend_set(&self.kv, &keys[..complete], &kv[..complete])?;
        let pages = outcomes.iter().position(|stored| !stored).unwrap_or(complete);
        Ok(GroupWrite { pages, sidecars: stored })
    }

    /// Removes the groups of `keys` from every pool (the KV first, so no query finds a group losing its entries);
    /// returns how many KV pages were present.
    ///
    /// # Errors
    ///
    /// A failure of a whole call to a backend.
    pub fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
        let removed = self.kv.remove(keys)?;
        for pool in &self.sidecars {
            pool.backend.remove(keys)?;
        }
        Ok(removed)
    }

    /// [`restorable`] for what the KV (`kv_held`) and each sidecar pool (`held`, in order) hold.
    fn restorable(&self, kv_held: &[bool], held: &[Vec<bool>]) -> Restorable {
        let presence: Vec<PoolPresence<'_>> =
            self.sidecars.iter().zip(held).map(|(pool, held)| PoolPresence { policy: pool.policy, held }).collect();
        restorable(kv_held, &presence)
    }

    fn backend_set(
        &self,
        backend: &Arc<dyn StorageBackend>,
        keys: &[PageKey],
        pages: &[PageSegments<'_>],
    ) -> Result<Vec<bool>, Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        Ok(backend.batch_set(keys, pages)?.iter().map(SetOutcome::is_stored).collect())
    }

    fn check(
        &self,
        keys: &[PageKey],
        length: usize,
        kv: usize,
        sidecars: impl ExactSizeIterator<Item = usize>,
    ) -> Result<(), Error> {
        let bad = |field: &'static str, reason: String| Err(Error::InvalidArgument { field, reason });
        if length > keys.len() {
            return bad("length", format!("{length} pages of a run of {}", keys.len()));
        }
        if kv != length {
            return bad("kv", format!("{kv} destinations for {length} pages"));
        }
        if sidecars.len() != self.sidecars.len() {
            return bad(
                "sidecars",
                format!("destinations of {} pools for {} pools", sidecars.len(), self.sidecars.len()),
            );
        }
        for (pool, given) in self.sidecars.iter().zip(sidecars) {
            let wanted = needed(pool.policy, length).len();
            if given != wanted {
                return bad(
                    "sidecars",
                    format!(
                        "pool `{}`: {given} destinations for the {wanted} entries a prefix of {length} needs",
                        pool.name
                    ),
                );
            }
        }
        Ok(())
    }
}

/// Per outcome, whether the page was read whole.
fn hits(outcomes: &[GetOutcome]) -> Vec<bool> {
    outcomes.iter().map(|outcome| *outcome == GetOutcome::Hit).collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A state written at pages 4 and 8 (window 1) makes 4 and 8 restorable, not 6; with another rank holding its
    /// states at 4 and 6 the ranks agree on 4, where the least of their longest (8 and 6) would be 6, which the
    /// first rank cannot restore.
    #[test]
    fn a_trailing_state_restores_only_where_it_was_written() {
        let kv = [true; 10];
        let mut state = [false; 10];
        state[3] = true;
        state[7] = true;
        let first = restorable(&kv, &[PoolPresence { policy: HitPolicy::TrailingPages { window: 1 }, held: &state }]);
        assert_eq!(first.lengths, [4, 8]);
        assert_eq!((first.kv_pages, first.pool_pages.as_slice(), first.longest()), (10, &[Some(8)][..], 8));
        let mut other = [false; 10];
        other[3] = true;
        other[5] = true;
        let second = restorable(&kv, &[PoolPresence { policy: HitPolicy::TrailingPages { window: 1 }, held: &other }]);
        assert_eq!(second.lengths, [4, 6]);
        assert_eq!(agreed_prefix(&[&first.lengths, &second.lengths], 10), 4);
        assert_eq!(agreed_prefix(&[&first.lengths, &second.lengths], 3), 0);
    }

    /// An indexer missing at page 3 cuts every prefix past 3, whatever the KV holds.
    #[test]
    fn a_missing_indexer_page_cuts_the_prefix() {
        let kv = [true; 6];
        let indexer = [true, true, true, false, true, true];
        let found = restorable(&kv, &[PoolPresence { policy: HitPolicy::AllPages, held: &indexer }]);
        assert_eq!((found.lengths.as_slice(), found.longest()), (&[1, 2, 3][..], 3));
        assert_eq!(restorable(&kv, &[]).longest(), 6);
        assert_eq!(restorable(&[false, true], &[]).lengths, Vec::<usize>::new());
    }

    /// Which entries a rank holds: KV and a few pools, per page.
    fn rank() -> impl Strategy<Value = (Vec<bool>, Vec<(HitPolicy, Vec<bool>)>)> {
        let policy =
            prop_oneof![Just(HitPolicy::AllPages), (0usize..4).prop_map(|window| HitPolicy::TrailingPages { window })];
        (
            prop::collection::vec(prop::bool::weighted(0.85), 0..12),
            prop::collection::vec((policy, prop::collection::vec(prop::bool::weighted(0.7), 0..12)), 0..4),
        )
    }

    proptest! {
        /// Against the definition, prefix by prefix: a length is restorable exactly when the KV holds all its pages
        /// and every pool holds what its policy needs; the agreed length is restorable on every rank and no longer
        /// one is.
        #[test]
        fn lengths_are_the_prefixes_every_pool_can_restore(ranks in prop::collection::vec(rank(), 1..4), cap in 0usize..14) {
            let mut all = Vec::new();
            for (kv, pools) in &ranks {
                let presence: Vec<PoolPresence<'_>> =
                    pools.iter().map(|(policy, held)| PoolPresence { policy: *policy, held }).collect();
                let found = restorable(kv, &presence);
                let holds = |held: &[bool], page: usize| held.get(page).copied().unwrap_or(false);
                let expected: Vec<usize> = (1..=kv.len())
                    .filter(|&length| {
                        (0..length).all(|page| kv[page])
                            && pools.iter().all(|(policy, held)| {
                                let first = match policy {
                                    HitPolicy::AllPages => 0,
                                    HitPolicy::TrailingPages { window } => length.saturating_sub((*window).max(1)),
                                };
                                (first..length).all(|page| holds(held, page))
                            })
                    })
                    .collect();
                prop_assert_eq!(&found.lengths, &expected);
                prop_assert!(found.lengths.iter().all(|&length| length <= found.kv_pages));
                all.push(found.lengths);
            }
            let lengths: Vec<&[usize]> = all.iter().map(Vec::as_slice).collect();
            let agreed = agreed_prefix(&lengths, cap);
            let everywhere = |length: usize| all.iter().all(|lengths| lengths.contains(&length));
            if agreed > 0 {
                prop_assert!(agreed <= cap && everywhere(agreed));
            }
            prop_assert!(((agreed + 1)..=cap.min(12)).all(|length| !everywhere(length)));
        }
    }
}
