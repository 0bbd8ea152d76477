//! Host page allocator: page-granular, O(1) alloc and free, with every page's state checked on every call.
//!
//! SGLang's host pool hands out token indices, frees with an O(pool) `torch.cat`, accepts a page freed twice, and
//! checks its state machine only when the logger is at DEBUG (spec §4, §17 items 1, 21). Here a page id names a whole
//! page of one pool, a double free or a page of another pool is an error, and every transition is checked, always.
//! A call that fails changes nothing.
//!
//! States and transitions (SGLang's `MemoryStateInt`):
//!
//! | call | from | to |
//! |---|---|---|
//! | [`alloc`](HostPageAllocator::alloc) | idle | reserved |
//! | [`protect_write`](HostPageAllocator::protect_write) (D2H starts) | reserved | protected |
//! | [`protect_load`](HostPageAllocator::protect_load) (H2D starts) | backup | protected |
//! | [`complete_io`](HostPageAllocator::complete_io) | protected | synced |
//! | [`update_backup`](HostPageAllocator::update_backup) (device copy evicted) | synced | backup |
//! | [`update_prefetch`](HostPageAllocator::update_prefetch) (prefetched page inserted) | reserved | backup |
//! | [`update_synced`](HostPageAllocator::update_synced) (fresh device copy) | any but idle | synced |
//! | [`free`](HostPageAllocator::free) | any but idle | idle |

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::Error;

/// One page of one host pool.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostPageId {
    pool: u32,
    index: u32,
}

impl HostPageId {
    /// The page's index in its pool (its position in the host buffer, in pages).
    pub const fn index(self) -> usize {
        self.index as usize
    }

    /// The first host token slot of the page.
    pub const fn first_token(self, page_size: usize) -> usize {
        self.index as usize * page_size
    }
}

impl fmt::Debug for HostPageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page {} of pool {}", self.index, self.pool)
    }
}

impl fmt::Display for HostPageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// State of a host page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageState {
    /// Free.
    Idle,
    /// Allocated, no data yet (a write or prefetch target).
    Reserved,
    /// A device↔host copy is using it.
    Protected,
    /// Holds the same data as a device copy.
    Synced,
    /// Holds the only copy above storage (the device copy was evicted, or it was prefetched).
    Backup,
}

impl fmt::Display for PageState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Idle => "idle",
            Self::Reserved => "reserved",
            Self::Protected => "protected",
            Self::Synced => "synced",
            Self::Backup => "backup",
        })
    }
}

static NEXT_POOL: AtomicU32 = AtomicU32::new(1);

/// Page-granular allocator with per-page states.
#[derive(Debug)]
pub struct HostPageAllocator {
    pool: u32,
    states: Vec<PageState>,
    /// Free pages, popped from the end; starts as `pages-1, …, 1, 0` so a fresh pool hands out ascending runs.
    free: Vec<u32>,
}

impl HostPageAllocator {
    /// An allocator of `pages` pages, all idle.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `pages` is zero or does not fit in 32 bits.
    pub fn new(pages: usize) -> Result<Self, Error> {
        let count = u32::try_from(pages)
            .ok()
            .filter(|&count| count > 0)
            .ok_or(Error::InvalidArgument { field: "pages", reason: format!("{pages} is not in [1, 2^32)") })?;
        Ok(Self {
            pool: NEXT_POOL.fetch_add(1, Ordering::Relaxed),
            states: vec![PageState::Idle; pages],
            free: (0..count).rev().collect(),
        })
    }

    /// Total pages.
    pub fn capacity(&self) -> usize {
        self.states.len()
    }

    /// Idle pages.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// The id of page `index` of this pool, whatever its state (for tests and for rebuilding state).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `index` is out of range.
    pub fn page_id(&self, index: usize) -> Result<HostPageId, Error> {
        if index < self.states.len() {
            Ok(HostPageId { pool: self.pool, index: index as u32 })
        } else {
            Err(Error::InvalidArgument {
                field: "page",
                reason: format!("{index} out of range ({} pages)", self.states.len()),
            })
        }
    }

    /// The state of a page of this pool.
    ///
    /// # Errors
    ///
    /// [`Error::ForeignPage`] for a page of another pool.
    pub fn state(&self, page: HostPageId) -> Result<PageState, Error> {
        self.check_owned(page)?;
        Ok(self.states[page.index()])
    }

    /// Allocates `count` pages, all or none; they become reserved. `None` when fewer than `count` are idle.
    pub fn alloc(&mut self, count: usize) -> Option<Vec<HostPageId>> {
        let keep = self.free.len().checked_sub(count)?;
        let pages: Vec<HostPageId> =
            self.free.drain(keep..).rev().map(|index| HostPageId { pool: self.pool, index }).collect();
        for page in &pages {
            self.states[page.index()] = PageState::Reserved;
        }
        Some(pages)
    }

    /// Frees pages in any state but idle.
    ///
    /// # Errors
    ///
    /// [`Error::DoubleFree`] for an idle page or a page listed twice, [`Error::ForeignPage`] for a page of another
    /// pool; nothing is freed then.
    pub fn free(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.check_distinct(pages)?;
        for &page in pages {
            if self.state(page)? == PageState::Idle {
                return Err(Error::DoubleFree { page: page.to_string() });
            }
        }
        for &page in pages {
            self.states[page.index()] = PageState::Idle;
            self.free.push(page.index);
        }
        Ok(())
    }

    /// Returns every page to idle (SGLang's `clear`), as after a reset.
    pub fn clear(&mut self) {
        self.states.fill(PageState::Idle);
        self.free = (0..self.states.len() as u32).rev().collect();
    }

    /// Reserved → protected, when a device-to-host copy starts.
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] naming the first page in another state; nothing changes then.
    pub fn protect_write(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.transition(pages, "protect_write", &[PageState::Reserved], PageState::Protected)
    }

    /// Backup → protected, when a host-to-device copy starts.
    ///
    /// # Errors
    ///
    /// As [`protect_write`](Self::protect_write).
    pub fn protect_load(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.transition(pages, "protect_load", &[PageState::Backup], PageState::Protected)
    }

    /// Protected → synced, when a copy completes.
    ///
    /// # Errors
    ///
    /// As [`protect_write`](Self::protect_write).
    pub fn complete_io(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.transition(pages, "complete_io", &[PageState::Protected], PageState::Synced)
    }

    /// Synced → backup, when the device copy is evicted.
    ///
    /// # Errors
    ///
    /// As [`protect_write`](Self::protect_write).
    pub fn update_backup(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.transition(pages, "update_backup", &[PageState::Synced], PageState::Backup)
    }

    /// Reserved → backup, when prefetched pages are inserted into the tree.
    ///
    /// # Errors
    ///
    /// As [`protect_write`](Self::protect_write).
    pub fn update_prefetch(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.transition(pages, "update_prefetch", &[PageState::Reserved], PageState::Backup)
    }

    /// Any allocated state → synced, when an evicted node gets a fresh device copy.
    ///
    /// # Errors
    ///
    /// As [`protect_write`](Self::protect_write).
    pub fn update_synced(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        const ALLOCATED: [PageState; 4] =
            [PageState::Reserved, PageState::Protected, PageState::Synced, PageState::Backup];
        self.transition(pages, "update_synced", &ALLOCATED, PageState::Synced)
    }

    /// Checks that `pages` are all in `state` (the precondition of `evict_device`: synced, `evict_host`: backup).
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] naming the first page in another state.
    pub fn expect_state(&self, pages: &[HostPageId], operation: &'static str, state: PageState) -> Result<(), Error> {
        self.check_states(pages, operation, &[state])
    }

    fn transition(
        &mut self,
        pages: &[HostPageId],
        operation: &'static str,
        from: &[PageState],
        to: PageState,
    ) -> Result<(), Error> {
        self.check_distinct(pages)?;
        self.check_states(pages, operation, from)?;
        for page in pages {
            self.states[page.index()] = to;
        }
        Ok(())
    }

    fn check_states(&self, pages: &[HostPageId], operation: &'static str, allowed: &[PageState]) -> Result<(), Error> {
        for &page in pages {
            let found = self.state(page)?;
            if !allowed.contains(&found) {
                return Err(Error::PageState {
                    page: page.to_string(),
                    operation,
                    expected: allowed.iter().map(PageState::to_string).collect::<Vec<_>>().join(" or "),
                    found: found.to_string(),
                });
            }
        }
        Ok(())
    }

    fn check_owned(&self, page: HostPageId) -> Result<(), Error> {
        if page.pool != self.pool || page.index() >= self.states.len() {
            return Err(Error::ForeignPage { page: page.to_string(), pool: self.pool });
        }
        Ok(())
    }

    /// A page listed twice in one call would be freed or moved twice; refuse it (sorting a copy: O(n log n) in the
    /// call's pages, never in the pool's size).
    fn check_distinct(&self, pages: &[HostPageId]) -> Result<(), Error> {
        if pages.len() < 2 {
            return Ok(());
        }
        let mut indices: Vec<u32> = pages.iter().map(|page| page.index).collect();
        indices.sort_unstable();
        match indices.windows(2).find(|pair| pair[0] == pair[1]) {
            Some(pair) => {
                Err(Error::DoubleFree { page: format!("page {} of pool {} (listed twice)", pair[0], self.pool) })
            }
            None => Ok(()),
        }
    }

    /// Checks the allocator's own invariants: the free list holds exactly the idle pages, once each.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] describing the first violation.
    pub fn check_invariants(&self) -> Result<(), Error> {
        let mut seen = vec![false; self.states.len()];
        for &index in &self.free {
            let slot = seen
                .get_mut(index as usize)
                .ok_or_else(|| Error::Internal(format!("free page {index} out of range")))?;
            if std::mem::replace(slot, true) {
                return Err(Error::Internal(format!("page {index} is on the free list twice")));
            }
            if self.states[index as usize] != PageState::Idle {
                return Err(Error::Internal(format!("free page {index} is {}", self.states[index as usize])));
            }
        }
        let idle = self.states.iter().filter(|&&state| state == PageState::Idle).count();
        if idle != self.free.len() {
            return Err(Error::Internal(format!("{idle} idle pages but {} on the free list", self.free.len())));
        }
        Ok(())
    }

    /// The state of every page, in page order (to compare allocators across TP ranks).
    pub fn states(&self) -> &[PageState] {
        &self.states
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn double_free_and_foreign_pages_are_refused_and_change_nothing() {
        let mut pool = HostPageAllocator::new(4).unwrap();
        let mut other = HostPageAllocator::new(4).unwrap();
        let pages = pool.alloc(2).unwrap();
        assert_eq!(pages.iter().map(|page| page.index()).collect::<Vec<_>>(), [0, 1]);
        pool.free(&pages[..1]).unwrap();
        let error = pool.free(&pages).unwrap_err();
        assert!(matches!(error, Error::DoubleFree { .. }), "{error}");
        assert_eq!(pool.state(pages[1]).unwrap(), PageState::Reserved, "a failed free frees nothing");
        let foreign = other.alloc(1).unwrap();
        assert!(matches!(pool.free(&foreign).unwrap_err(), Error::ForeignPage { .. }));
        assert!(matches!(pool.free(&[pages[1], pages[1]]).unwrap_err(), Error::DoubleFree { .. }));
        pool.check_invariants().unwrap();
        assert_eq!(pool.available(), 3);
    }

    #[test]
    fn transitions_are_checked_in_release_builds_too() {
        let mut pool = HostPageAllocator::new(2).unwrap();
        let pages = pool.alloc(2).unwrap();
        let error = pool.complete_io(&pages).unwrap_err().to_string();
        assert_eq!(
            error,
            "complete_io on page 0 of pool 1: expected protected, found reserved"
                .replace("pool 1", &format!("pool {}", pool.pool))
        );
        pool.protect_write(&pages).unwrap();
        pool.complete_io(&pages).unwrap();
        pool.update_backup(&pages).unwrap();
        pool.protect_load(&pages[..1]).unwrap();
        assert!(pool.update_backup(&pages).is_err(), "page 0 is protected, so nothing moves");
        assert_eq!(pool.state(pages[1]).unwrap(), PageState::Backup);
        assert!(pool.alloc(1).is_none());
    }

    #[derive(Clone, Debug)]
    enum Step {
        Alloc(usize),
        Free(Vec<usize>),
        Move(usize, Vec<usize>),
        Clear,
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let step = prop_oneof![
            4 => (0usize..6).prop_map(Step::Alloc),
            3 => prop::collection::vec(0usize..24, 0..4).prop_map(Step::Free),
            4 => (0usize..7, prop::collection::vec(0usize..24, 0..4)).prop_map(|(op, pages)| Step::Move(op, pages)),
            1 => Just(Step::Clear),
        ];
        prop::collection::vec(step, 0..80)
    }

    /// The transition table, written out independently of the allocator.
    fn model_transition(op: usize, state: PageState) -> Option<PageState> {
        use PageState::*;
        match (op, state) {
            (0, Reserved) => Some(Protected),
            (1, Backup) => Some(Protected),
            (2, Protected) => Some(Synced),
            (3, Synced) => Some(Backup),
            (4, Reserved) => Some(Backup),
            (5, Idle) => None,
            (5, _) => Some(Synced),
            (6, Idle) => None,
            (6, _) => Some(Idle),
            _ => None,
        }
    }

    proptest! {
        #[test]
        fn random_sequences_match_a_model(steps in steps()) {
            const PAGES: usize = 16;
            let mut pool = HostPageAllocator::new(PAGES).unwrap();
            let mut model: HashMap<usize, PageState> = (0..PAGES).map(|page| (page, PageState::Idle)).collect();
            for step in steps {
                match step {
                    Step::Alloc(count) => {
                        let idle = model.values().filter(|&&state| state == PageState::Idle).count();
                        match pool.alloc(count) {
                            Some(pages) => {
                                prop_assert!(count <= idle);
                                prop_assert_eq!(pages.len(), count);
                                for page in pages {
                                    prop_assert_eq!(model.insert(page.index(), PageState::Reserved), Some(PageState::Idle));
                                }
                            }
                            None => prop_assert!(count > idle),
                        }
                    }
                    Step::Free(indices) | Step::Move(6, indices) => {
                        // indices ≥ PAGES stand for pages of another pool
                        let pages: Vec<HostPageId> = indices
                            .iter()
                            .map(|&index| pool.page_id(index).unwrap_or(HostPageId { pool: u32::MAX, index: index as u32 }))
                            .collect();
                        let mut sorted = indices.clone();
                        sorted.sort_unstable();
                        sorted.dedup();
                        let valid = sorted.len() == indices.len()
                            && indices.iter().all(|index| model.get(index).is_some_and(|&state| state != PageState::Idle));
                        prop_assert_eq!(pool.free(&pages).is_ok(), valid);
                        if valid {
                            for index in indices {
                                model.insert(index, PageState::Idle);
                            }
                        }
                    }
                    Step::Move(op, indices) => {
                        let pages: Vec<HostPageId> = indices.iter().filter_map(|&index| pool.page_id(index).ok()).collect();
                        let mut sorted: Vec<usize> = pages.iter().map(|page| page.index()).collect();
                        sorted.sort_unstable();
                        sorted.dedup();
                        let next: Option<Vec<PageState>> = if sorted.len() == pages.len() {
                            pages.iter().map(|page| model_transition(op, model[&page.index()])).collect()
                        } else {
                            None
                        };
                        let result = match op {
                            0 => pool.protect_write(&pages),
                            1 => pool.protect_load(&pages),
                            2 => pool.complete_io(&pages),
                            3 => pool.update_backup(&pages),
                            4 => pool.update_prefetch(&pages),
                            _ => pool.update_synced(&pages),
                        };
                        prop_assert_eq!(result.is_ok(), next.is_some());
                        if let Some(next) = next {
                            for (page, state) in pages.iter().zip(next) {
                                model.insert(page.index(), state);
                            }
                        }
                    }
                    Step::Clear => {
                        pool.clear();
                        model.values_mut().for_each(|state| *state = PageState::Idle);
                    }
                }
                pool.check_invariants().map_err(|error| TestCaseError::fail(error.to_string()))?;
                for (index, state) in pool.states().iter().enumerate() {
                    prop_assert_eq!(*state, model[&index]);
                }
            }
        }
    }
}
