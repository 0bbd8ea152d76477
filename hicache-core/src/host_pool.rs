//! Host page allocator: page-granular, with every page's state checked on every call, handing out a request's
//! pages as one contiguous run when the pool has one.
//!
//! SGLang's host pool hands out token indices FIFO with no locality, frees with an O(pool) `torch.cat`, accepts a page
//! freed twice, and checks its state machine only when the logger is at DEBUG (docs/sglang.md#host-pool, #fixed-1,
//! #fixed-21). Here a page id names a whole page of one pool, a double free or a page of another pool is an error, and
//! every transition is checked, always. A call that fails changes nothing.
//!
//! Contiguity: idle pages are a bitmap, and `alloc(n)` takes the first run of `n` idle pages from a roving cursor
//! (next fit), looking at most [`SCAN_WORDS`] words of 64 pages; without such a run it takes idle pages in
//! ascending order from the cursor (a scan of the bitmap). A request's pages next to each other in the host pool are one long copy per
//! layer, which the GPU engine's `auto` backend gives to the copy engine (0.97–0.99 of PCIe bandwidth on an H200,
//! against 0.88–0.94 for the kernel over scattered pages). Alloc costs O(`SCAN_WORDS` + n / 64), free O(n).
//!
//! States and transitions (SGLang's `MemoryStateInt`):
//!
//! | call | from | to |
//! |---|---|---|
//! | [`alloc`](HostPageAllocator::alloc) | idle | reserved |
//! | `protect_write` (D2H starts) | reserved | protected |
//! | `protect_load` (H2D starts) | backup | protected |
//! | `complete_io` | protected | synced |
//! | `update_backup` (device copy evicted) | synced | backup |
//! | `update_prefetch` (prefetched page inserted) | reserved | backup |
//! | `update_synced` (fresh device copy) | any but idle | synced |
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

/// Words of the idle bitmap (64 pages each) `alloc` searches for a contiguous run before it settles for scattered
/// pages: 32 768 pages, a 256 GB pool of 8 MiB pages.
pub const SCAN_WORDS: usize = 512;

/// Page-granular allocator with per-page states.
#[derive(Debug)]
pub struct HostPageAllocator {
    pool: u32,
    states: Vec<PageState>,
    /// Bit `i % 64` of word `i / 64` is set when page `i` is idle.
    idle: Vec<u64>,
    /// Idle pages.
    available: usize,
    /// Where the next search starts (just past the last allocation).
    cursor: usize,
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
        let mut allocator = Self {
            pool: NEXT_POOL.fetch_add(1, Ordering::Relaxed),
            states: vec![PageState::Idle; count as usize],
            idle: Vec::new(),
            available: 0,
            cursor: 0,
        };
        allocator.clear();
        Ok(allocator)
    }

    /// Total pages.
    pub fn capacity(&self) -> usize {
        self.states.len()
    }

    /// Idle pages.
    pub fn available(&self) -> usize {
        self.available
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
    ///
    /// The pages are one contiguous run, in ascending order, when the search finds a run of `count` idle pages (the
    /// first from the cursor, within [`SCAN_WORDS`] words); otherwise idle pages in ascending order from the cursor.
    pub fn alloc(&mut self, count: usize) -> Option<Vec<HostPageId>> {
        if count > self.available {
            return None;
        }
        if count == 0 {
            return Some(Vec::new());
        }
        let indices: Vec<usize> = match self.find_run(count) {
            Some(start) => (start..start + count).collect(),
            None => self.first_idle(count),
        };
        for &index in &indices {
            self.set_idle(index, false);
            self.states[index] = PageState::Reserved;
        }
        self.available -= count;
        self.cursor = (indices[count - 1] + 1) % self.states.len();
        Some(indices.into_iter().map(|index| HostPageId { pool: self.pool, index: index as u32 }).collect())
    }

    /// The start of the first run of `count` idle pages at or after the cursor, then from the pool's start, within
    /// [`SCAN_WORDS`] words of pages examined.
    fn find_run(&self, count: usize) -> Option<usize> {
        let pages = self.states.len();
        let mut budget = SCAN_WORDS * 64;
        for (from, to) in [(self.cursor, pages), (0, self.cursor)] {
            let mut position = from;
            while position < to && budget > 0 {
                let window = to.min(position + budget);
                let Some(start) = self.next_in(position, window, true) else {
                    budget -= window - position;
                    break;
                };
                if start + count > pages {
                    break;
                }
                // the run may extend past `to`: only its first `count` pages matter
                match self.next_in(start, start + count, false) {
                    None => return Some(start),
                    Some(taken) => {
                        budget = budget.saturating_sub(taken + 1 - position);
                        position = taken + 1;
                    }
                }
            }
        }
        None
    }

    /// The first page in `[from, to)` that is idle (`idle`) or not (`!idle`).
    fn next_in(&self, from: usize, to: usize, idle: bool) -> Option<usize> {
        if from >= to {
            return None;
        }
        let word_at = |word: usize| if idle { self.idle[word] } else { !self.idle[word] };
        let mut word = from / 64;
        let mut bits = word_at(word) & (u64::MAX << (from % 64));
        loop {
            if bits != 0 {
                let found = word * 64 + bits.trailing_zeros() as usize;
                return (found < to).then_some(found);
            }
            word += 1;
            if word * 64 >= to {
                return None;
            }
            bits = word_at(word);
        }
    }

    /// The first `count` idle pages at or after the cursor, then from the pool's start (there are that many).
    fn first_idle(&self, count: usize) -> Vec<usize> {
        let pages = self.states.len();
        let mut found = Vec::with_capacity(count);
        for (from, to) in [(self.cursor, pages), (0, self.cursor)] {
            let mut position = from;
            while found.len() < count {
                let Some(index) = self.next_in(position, to, true) else { break };
                found.push(index);
                position = index + 1;
            }
        }
        found
    }

    fn set_idle(&mut self, index: usize, idle: bool) {
        let bit = 1u64 << (index % 64);
        if idle {
            self.idle[index / 64] |= bit;
        } else {
            self.idle[index / 64] &= !bit;
        }
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
            self.set_idle(page.index(), true);
        }
        self.available += pages.len();
        Ok(())
    }

    /// Returns every page to idle (SGLang's `clear`), as after a reset.
    pub fn clear(&mut self) {
        let pages = self.states.len();
        self.states.fill(PageState::Idle);
        self.idle = vec![u64::MAX; pages.div_ceil(64)];
        if !pages.is_multiple_of(64) {
            // bits past the last page stay clear
            *self.idle.last_mut().expect("at least one page") = (1u64 << (pages % 64)) - 1;
        }
        self.available = pages;
        self.cursor = 0;
    }

    /// Reserved → protected, when a device-to-host copy starts.
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] naming the first page in another state; nothing changes then.
    pub(crate) fn protect_write(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.transition(pages, "protect_write", &[PageState::Reserved], PageState::Protected)
    }

    /// Backup → protected, when a host-to-device copy starts.
    ///
    /// # Errors
    ///
    /// As [`protect_write`](Self::protect_write).
    pub(crate) fn protect_load(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.transition(pages, "protect_load", &[PageState::Backup], PageState::Protected)
    }

    /// Protected → synced, when a copy completes.
    ///
    /// # Errors
    ///
    /// As [`protect_write`](Self::protect_write).
    pub(crate) fn complete_io(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.transition(pages, "complete_io", &[PageState::Protected], PageState::Synced)
    }

    /// Synced → backup, when the device copy is evicted.
    ///
    /// # Errors
    ///
    /// As [`protect_write`](Self::protect_write).
    pub(crate) fn update_backup(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.transition(pages, "update_backup", &[PageState::Synced], PageState::Backup)
    }

    /// Reserved → backup, when prefetched pages are inserted into the tree.
    ///
    /// # Errors
    ///
    /// As [`protect_write`](Self::protect_write).
    pub(crate) fn update_prefetch(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        self.transition(pages, "update_prefetch", &[PageState::Reserved], PageState::Backup)
    }

    /// Any allocated state → synced, when an evicted node gets a fresh device copy.
    ///
    /// # Errors
    ///
    /// As [`protect_write`](Self::protect_write).
    pub(crate) fn update_synced(&mut self, pages: &[HostPageId]) -> Result<(), Error> {
        const ALLOCATED: [PageState; 4] =
            [PageState::Reserved, PageState::Protected, PageState::Synced, PageState::Backup];
        self.transition(pages, "update_synced", &ALLOCATED, PageState::Synced)
    }

    /// Checks that `pages` are all in `state` (the precondition of `evict_device`: synced, `evict_host`: backup).
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] naming the first page in another state.
    pub(crate) fn expect_state(
        &self,
        pages: &[HostPageId],
        operation: &'static str,
        state: PageState,
    ) -> Result<(), Error> {
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

    /// Checks the allocator's own invariants: the bitmap marks exactly the idle pages (and nothing past the last
    /// page), and the count agrees.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] describing the first violation.
    pub fn check_invariants(&self) -> Result<(), Error> {
        let pages = self.states.len();
        if self.idle.len() != pages.div_ceil(64) || self.cursor >= pages {
            return Err(Error::Internal(format!(
                "bitmap of {} words or cursor {} for {pages} pages",
                self.idle.len(),
                self.cursor
            )));
        }
        for index in 0..self.idle.len() * 64 {
            let marked = self.idle[index / 64] >> (index % 64) & 1 == 1;
            let idle = self.states.get(index).is_some_and(|&state| state == PageState::Idle);
            if marked != idle {
                return Err(Error::Internal(format!("page {index}: marked idle {marked}, idle {idle}")));
            }
        }
        let idle = self.states.iter().filter(|&&state| state == PageState::Idle).count();
        if idle != self.available {
            return Err(Error::Internal(format!("{idle} idle pages but {} counted", self.available)));
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

    #[test]
    fn a_churned_pool_hands_out_a_run_where_it_has_one_and_ascending_pages_otherwise() {
        let mut pool = HostPageAllocator::new(200).unwrap();
        let all = pool.alloc(200).unwrap();
        let indices = |pages: &[HostPageId]| pages.iter().map(|page| page.index()).collect::<Vec<_>>();
        // free every third page, and one run of five at 131..136 (130 and 136 stay taken)
        let scattered: Vec<HostPageId> = all.iter().copied().filter(|page| page.index() % 3 == 0).collect();
        pool.free(&scattered).unwrap();
        pool.free(&all[131..136].iter().copied().filter(|page| page.index() % 3 != 0).collect::<Vec<_>>()).unwrap();
        assert_eq!(indices(&pool.alloc(5).unwrap()), [131, 132, 133, 134, 135]);
        // no run of four remains: the next idle pages after the cursor, ascending
        assert_eq!(indices(&pool.alloc(4).unwrap()), [138, 141, 144, 147]);
        pool.check_invariants().unwrap();
        // runs are sought from the cursor on, then from the start: 9..20 is the first run of three
        pool.free(&all[10..20].iter().copied().filter(|page| page.index() % 3 != 0).collect::<Vec<_>>()).unwrap();
        assert_eq!(indices(&pool.alloc(3).unwrap()), [9, 10, 11]);
        assert_eq!(indices(&pool.alloc(3).unwrap()), [12, 13, 14]);
        pool.check_invariants().unwrap();
        // a pool that is not a whole number of words: the last page is handed out, nothing past it
        let mut odd = HostPageAllocator::new(65).unwrap();
        assert_eq!(odd.alloc(65).unwrap().last().unwrap().index(), 64);
        assert!(odd.alloc(1).is_none());
        odd.check_invariants().unwrap();
    }

    #[test]
    fn the_search_for_a_run_is_bounded() {
        let pages = SCAN_WORDS * 64 * 2;
        let mut pool = HostPageAllocator::new(pages).unwrap();
        let all = pool.alloc(pages).unwrap();
        // single idle pages over the whole first half, and a run of four beyond it
        let singles: Vec<HostPageId> = all[..pages / 2].iter().copied().step_by(2).collect();
        pool.free(&singles).unwrap();
        pool.free(&all[pages - 10..pages - 6]).unwrap();
        let got: Vec<usize> = pool.alloc(4).unwrap().iter().map(|page| page.index()).collect();
        assert_eq!(got, [0, 2, 4, 6], "the run lies past the search budget: scattered pages from the cursor");
        // within the budget from the cursor, the run is found
        let near: Vec<HostPageId> = all[pages / 2 + 1..pages / 2 + 5].to_vec();
        pool.free(&near).unwrap();
        let got: Vec<usize> = pool.alloc(4).unwrap().iter().map(|page| page.index()).collect();
        assert_eq!(got, (pages / 2 + 1..pages / 2 + 5).collect::<Vec<_>>());
        pool.check_invariants().unwrap();
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
                        // an independent look for a run of `count` idle pages: then the allocation must be one
                        let has_run = count > 0 && (0..=PAGES.saturating_sub(count)).any(|start| {
                            (start..start + count).all(|page| model[&page] == PageState::Idle)
                        });
                        match pool.alloc(count) {
                            Some(pages) => {
                                prop_assert!(count <= idle);
                                prop_assert_eq!(pages.len(), count);
                                if has_run {
                                    let contiguous = pages.windows(2).all(|pair| pair[1].index() == pair[0].index() + 1);
                                    prop_assert!(contiguous, "a run of {} existed but got {:?}", count, pages);
                                }
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
