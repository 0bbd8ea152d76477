//! Host pages of storage operations go back to the allocator through explicit release messages, each page exactly
//! once, on the scheduler's thread.
//!
//! SGLang's I/O thread queues "release these host indices" chunks and the scheduler frees however many chunks the TP
//! MIN of the queue sizes says; the aux thread releases a partial prefetch's tail twice (docs/sglang.md#fixed-1) and
//! empty or per-rank-sized chunks make the queues drift apart across ranks (item 2). Here a message names its operation
//! and a page range of it; the ledger hands each page back once and refuses a second release of any page as an error (a
//! bug to report, never a double free).

use rustc_hash::FxHashMap as HashMap;
use std::ops::Range;

use crate::controller::OpId;
use crate::error::Error;
use crate::host_pool::HostPageId;

/// A release message: pages `range` of operation `op`'s host pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    /// The operation.
    pub op: OpId,
    /// Positions in the operation's host pages.
    pub range: Range<usize>,
}

#[derive(Debug)]
struct Held {
    pages: Vec<HostPageId>,
    released: Vec<bool>,
    left: usize,
}

/// Host pages held by storage operations, and which have been released.
#[derive(Debug, Default)]
pub struct ReleaseLedger {
    held: HashMap<OpId, Held>,
}

impl ReleaseLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `op` holds `pages`.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] when `op` is already held.
    pub fn hold(&mut self, op: OpId, pages: Vec<HostPageId>) -> Result<(), Error> {
        if self.held.contains_key(&op) {
            return Err(Error::Internal(format!("operation {} holds host pages already", op.0)));
        }
        let left = pages.len();
        if left > 0 {
            self.held.insert(op, Held { released: vec![false; left], pages, left });
        }
        Ok(())
    }

    /// Records that `op` holds `pages` as well, at positions after those it held (a prefetch reserves its hit in
    /// steps while the query runs). An operation holding nothing yet starts at position 0.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] when a page of `op` was released already: positions would no longer be stable.
    pub fn extend(&mut self, op: OpId, pages: Vec<HostPageId>) -> Result<(), Error> {
        let Some(held) = self.held.get_mut(&op) else { return self.hold(op, pages) };
        if held.left != held.pages.len() {
            return Err(Error::Internal(format!("operation {} grew after a release", op.0)));
        }
        held.left += pages.len();
        held.released.resize(held.released.len() + pages.len(), false);
        held.pages.extend(pages);
        Ok(())
    }

    /// Applies a release: returns the pages to free now. An empty range releases nothing and is not an error.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] for an unknown operation, a range beyond its pages, or a page released before; nothing
    /// is released then.
    pub fn release(&mut self, message: &Release) -> Result<Vec<HostPageId>, Error> {
        if message.range.is_empty() {
            return Ok(Vec::new());
        }
        let op = message.op.0;
        let held = self
            .held
            .get_mut(&message.op)
            .ok_or_else(|| Error::Internal(format!("release of operation {op}, which holds no host pages")))?;
        if message.range.end > held.pages.len() {
            return Err(Error::Internal(format!(
                "release of pages {:?} of operation {op}, which holds {}",
                message.range,
                held.pages.len()
            )));
        }
        if let Some(position) = message.range.clone().find(|&position| held.released[position]) {
            return Err(Error::Internal(format!("page {position} of operation {op} released twice")));
        }
        for position in message.range.clone() {
            held.released[position] = true;
        }
        held.left -= message.range.len();
        let pages = held.pages[message.range.clone()].to_vec();
        if held.left == 0 {
            self.held.remove(&message.op);
        }
        Ok(pages)
    }

    /// Pages still held by `op`, in order.
    #[cfg(test)]
    pub(crate) fn held_by(&self, op: OpId) -> Vec<HostPageId> {
        self.held.get(&op).map_or_else(Vec::new, |held| {
            held.pages.iter().zip(&held.released).filter(|(_, released)| !**released).map(|(page, _)| *page).collect()
        })
    }

    /// Operations holding pages.
    pub fn operations(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::host_pool::HostPageAllocator;

    proptest! {
        /// Random releases against a model: every page comes back exactly once, overlaps are refused whole, and the
        /// allocator never sees a double free.
        #[test]
        fn every_page_comes_back_exactly_once(
            ops in prop::collection::vec(1usize..8, 1..5),
            releases in prop::collection::vec((0usize..5, 0usize..9, 0usize..9), 0..60),
        ) {
            let mut allocator = HostPageAllocator::new(64).unwrap();
            let mut ledger = ReleaseLedger::new();
            let mut model: Vec<Vec<bool>> = Vec::new();
            for (index, &count) in ops.iter().enumerate() {
                // held in one step or two, as a prefetch reserves its hit while the query runs
                let first = count / (1 + index % 2);
                ledger.hold(OpId(index as u64), allocator.alloc(first).unwrap()).unwrap();
                ledger.extend(OpId(index as u64), allocator.alloc(count - first).unwrap()).unwrap();
                model.push(vec![false; count]);
            }
            for (op, start, len) in releases {
                let message = Release { op: OpId(op as u64), range: start..start + len };
                let expected_ok = len == 0 || (op < model.len()
                    && start + len <= model[op].len()
                    && model[op][start..start + len].iter().all(|released| !released)
                    && model[op].iter().any(|released| !released));
                match ledger.release(&message) {
                    Ok(pages) => {
                        prop_assert!(expected_ok, "{:?} accepted", message);
                        prop_assert_eq!(pages.len(), len);
                        allocator.free(&pages).unwrap();
                        if len > 0 {
                            model[op][start..start + len].iter_mut().for_each(|released| *released = true);
                        }
                    }
                    Err(_) => prop_assert!(!expected_ok, "{:?} refused", message),
                }
                allocator.check_invariants().unwrap();
            }
            let still_held: usize = model.iter().map(|op| op.iter().filter(|released| !**released).count()).sum();
            prop_assert_eq!(allocator.available(), 64 - still_held);
            prop_assert_eq!(ledger.operations(), model.iter().filter(|op| op.iter().any(|released| !released)).count());
        }
    }

    #[test]
    fn the_partial_prefetch_tail_is_released_once() {
        // SGLang 0.5.2 releases host[completed:] in _page_transfer and again in prefetch_io_aux_func
        // (docs/sglang.md#fixed-1)
        let mut allocator = HostPageAllocator::new(8).unwrap();
        let mut ledger = ReleaseLedger::new();
        ledger.hold(OpId(1), allocator.alloc(6).unwrap()).unwrap();
        let tail = Release { op: OpId(1), range: 4..6 };
        allocator.free(&ledger.release(&tail).unwrap()).unwrap();
        let error = ledger.release(&tail).unwrap_err().to_string();
        assert!(error.contains("page 4 of operation 1 released twice"), "{error}");
        assert_eq!(ledger.held_by(OpId(1)).len(), 4);
        assert_eq!(allocator.available(), 4);
    }

    #[test]
    fn an_operation_grows_in_steps_until_its_first_release() {
        let mut allocator = HostPageAllocator::new(8).unwrap();
        let mut ledger = ReleaseLedger::new();
        let first = allocator.alloc(2).unwrap();
        let second = allocator.alloc(3).unwrap();
        ledger.extend(OpId(1), first.clone()).unwrap();
        ledger.extend(OpId(1), second.clone()).unwrap();
        assert_eq!(ledger.held_by(OpId(1)), [first, second.clone()].concat());
        assert_eq!(ledger.release(&Release { op: OpId(1), range: 2..5 }).unwrap(), second);
        let error = ledger.extend(OpId(1), allocator.alloc(1).unwrap()).unwrap_err().to_string();
        assert!(error.contains("operation 1 grew after a release"), "{error}");
        assert_eq!(ledger.held_by(OpId(1)).len(), 2);
    }
}
