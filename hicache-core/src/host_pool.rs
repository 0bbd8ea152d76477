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
    pub(crate) const fn new(pool: u32, index: usize) -> Self {
        Self { pool, index: index as u32 }
    }

    /// The pool the page belongs to.
    pub(crate) const fn pool(self) -> u32 {
        self.pool
    }

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

/// A pool id no allocator or host memory has yet.
pub(crate) fn next_pool() -> u32 {
    NEXT_POOL.fetch_add(1, Ordering::Relaxed)
}

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
        Self::for_pool(next_pool(), pages)
    }

    /// An allocator of `pages` pages of pool `pool` (a [`HostMemory`](crate::host_memory::HostMemory)'s).
    pub(crate) fn for_pool(pool: u32, pages: usize) -> Result<Self, Error> {
        let count = u32::try_from(pages)
            .ok()
            .filter(|&count| count > 0)
            .ok_or(Error::InvalidArgument { field: "pages", reason: format!("{pages} is not in [1, 2^32)") })?;
        let mut allocator =
            Self { pool, states: vec![PageState::Idle; count as usize], idle: Vec::new(), available: 0, cursor: 0 };
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
mod tests;
