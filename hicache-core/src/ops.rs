//! Cache and storage operations: what the controller queues, merges and tracks (docs/sglang.md#operations).
//!
//! A [`CacheOperation`] moves a run of pages between the device and host pools; queued operations are merged into
//! one transfer. A prefetch from storage (in `controller/`) carries a [`Progress`] counter that the I/O thread
//! advances only after the bytes are in host memory, and that the scheduler can terminate: after termination no
//! increment succeeds, so the count it read is final.

use std::fmt;

use crate::error::Error;
use crate::host_pool::HostPageId;
use crate::sync::{AtomicU64, Ordering};

/// Id of an operation, unique within its controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

/// Id of a prefix-tree node. The tree assigns them and never reuses one, not even after a reset, so an id of a node
/// that is gone names no other node: the tree's methods answer it with [`Error::UnknownNode`](crate::Error). The
/// controller takes them as opaque tags of its operations (an engine driving it directly may use its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u64);

/// A device pool slot: one token of the device KV pool.
pub type DeviceSlot = u32;

/// Hands out operation ids in order. Each controller owns one, so ids are identical on every TP rank.
#[derive(Debug, Default)]
pub struct OpIds {
    next: u64,
}

impl OpIds {
    /// The next id.
    pub(crate) fn next_id(&mut self) -> OpId {
        self.next += 1;
        OpId(self.next)
    }

    /// Starts again from 1, as after a reset.
    pub fn reset(&mut self) {
        self.next = 0;
    }
}

/// A device↔host transfer of whole pages: `host_pages[i]` pairs with `device_slots[i*page_size..(i+1)*page_size]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheOperation {
    /// The operation's id (the first operation's id for a merged one).
    pub id: OpId,
    /// Host pages, in order.
    pub host_pages: Vec<HostPageId>,
    /// Device slots, `page_size` per host page, in the same order.
    pub device_slots: Vec<DeviceSlot>,
    /// Tree nodes whose data this moves; acked together when the transfer completes.
    pub node_ids: Vec<NodeId>,
    /// Lower runs first; defaults to the id.
    pub priority: i64,
}

impl CacheOperation {
    /// A validated operation.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `page_size` is zero or the device slots are not `page_size` per host page.
    pub fn new(
        id: OpId,
        host_pages: Vec<HostPageId>,
        device_slots: Vec<DeviceSlot>,
        page_size: usize,
        node_id: NodeId,
        priority: Option<i64>,
    ) -> Result<Self, Error> {
        if page_size == 0 || host_pages.len().checked_mul(page_size) != Some(device_slots.len()) {
            return Err(Error::InvalidArgument {
                field: "device_slots",
                reason: format!(
                    "{} device slots for {} host pages of {page_size} tokens",
                    device_slots.len(),
                    host_pages.len()
                ),
            });
        }
        Ok(Self { id, host_pages, device_slots, node_ids: vec![node_id], priority: priority.unwrap_or(id.0 as i64) })
    }

    /// Merges queued operations into one, as SGLang's `merge_ops`: host pages and device slots concatenated in queue
    /// order, the minimum priority, every node id. A single operation comes back unchanged; `None` for no operation.
    pub fn merge(ops: Vec<CacheOperation>) -> Option<CacheOperation> {
        let mut ops = ops.into_iter();
        let mut merged = ops.next()?;
        for op in ops {
            merged.host_pages.extend(op.host_pages);
            merged.device_slots.extend(op.device_slots);
            merged.node_ids.extend(op.node_ids);
            merged.priority = merged.priority.min(op.priority);
        }
        Some(merged)
    }
}

/// A completed-token counter with a terminate flag, shared by an I/O worker and the scheduler.
///
/// The worker calls `increment` after the pages' bytes are in host memory; the increment is a release, and
/// `terminate` and [`completed`](Self::completed) are acquires, so a reader that sees `n` completed tokens also sees
/// their bytes. Once terminated, no increment succeeds: the count read at termination is final. One word holds both,
/// so the flag and the count change together.
#[derive(Default)]
pub struct Progress {
    /// Bit 63: terminated. Bits 0–62: completed tokens.
    word: AtomicU64,
}

const TERMINATED: u64 = 1 << 63;

/// An increment refused because the operation was terminated first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Terminated {
    /// The final count.
    pub completed: u64,
}

impl Progress {
    /// Adds `tokens` unless terminated; returns the new count.
    ///
    /// # Errors
    ///
    /// [`Terminated`] with the final count when the operation was terminated before this increment.
    ///
    /// # Panics
    ///
    /// When the count would reach 2^63 tokens (a caller bug).
    pub(crate) fn increment(&self, tokens: u64) -> Result<u64, Terminated> {
        let mut current = self.word.load(Ordering::Relaxed);
        loop {
            if current & TERMINATED != 0 {
                return Err(Terminated { completed: current & !TERMINATED });
            }
            let next = current.checked_add(tokens).filter(|next| next & TERMINATED == 0).expect("token count overflow");
            match self.word.compare_exchange_weak(current, next, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return Ok(next),
                Err(actual) => current = actual,
            }
        }
    }

    /// Marks the operation terminated and returns the final count.
    pub(crate) fn terminate(&self) -> u64 {
        self.word.fetch_or(TERMINATED, Ordering::AcqRel) & !TERMINATED
    }

    /// Tokens completed so far.
    pub fn completed(&self) -> u64 {
        self.word.load(Ordering::Acquire) & !TERMINATED
    }

    /// Whether [`terminate`](Self::terminate) was called.
    pub(crate) fn is_terminated(&self) -> bool {
        self.word.load(Ordering::Acquire) & TERMINATED != 0
    }
}

impl fmt::Debug for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Progress")
            .field("completed", &self.completed())
            .field("terminated", &self.is_terminated())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::host_pool::HostPageAllocator;

    #[test]
    fn increments_after_terminate_fail_with_the_final_count() {
        let progress = Progress::default();
        assert_eq!(progress.increment(64), Ok(64));
        assert_eq!(progress.increment(64), Ok(128));
        assert_eq!(progress.terminate(), 128);
        assert_eq!(progress.increment(64), Err(Terminated { completed: 128 }));
        assert!(progress.is_terminated());
        assert_eq!(progress.completed(), 128);
        assert_eq!(progress.terminate(), 128, "terminating twice keeps the count");
    }

    #[test]
    fn device_slots_must_cover_whole_pages() {
        let mut pool = HostPageAllocator::new(4).unwrap();
        let pages = pool.alloc(2).unwrap();
        let error = CacheOperation::new(OpId(1), pages.clone(), vec![0; 7], 4, NodeId(1), None).unwrap_err();
        assert_eq!(error.to_string(), "device_slots: 7 device slots for 2 host pages of 4 tokens");
        assert_eq!(CacheOperation::new(OpId(1), pages, vec![0; 8], 4, NodeId(1), None).unwrap().priority, 1);
    }

    proptest! {
        #[test]
        fn merge_concatenates_in_order_with_min_priority(
            specs in prop::collection::vec((1usize..4, any::<i16>(), any::<bool>()), 0..8),
        ) {
            const PAGE: usize = 2;
            let mut pool = HostPageAllocator::new(64).unwrap();
            let mut ids = OpIds::default();
            let ops: Vec<CacheOperation> = specs
                .iter()
                .enumerate()
                .map(|(n, &(pages, priority, explicit))| {
                    let host = pool.alloc(pages).unwrap();
                    let slots = (0..pages * PAGE).map(|slot| (n * 100 + slot) as DeviceSlot).collect();
                    CacheOperation::new(ids.next_id(), host, slots, PAGE, NodeId(n as u64), explicit.then_some(priority.into())).unwrap()
                })
                .collect();
            let merged = CacheOperation::merge(ops.clone());
            let Some(merged) = merged else {
                prop_assert!(ops.is_empty());
                return Ok(());
            };
            let host: Vec<HostPageId> = ops.iter().flat_map(|op| op.host_pages.clone()).collect();
            let slots: Vec<DeviceSlot> = ops.iter().flat_map(|op| op.device_slots.clone()).collect();
            let nodes: Vec<NodeId> = ops.iter().flat_map(|op| op.node_ids.clone()).collect();
            prop_assert_eq!(&merged.host_pages, &host);
            prop_assert_eq!(&merged.device_slots, &slots);
            prop_assert_eq!(&merged.node_ids, &nodes);
            prop_assert_eq!(merged.priority, ops.iter().map(|op| op.priority).min().unwrap());
            prop_assert_eq!(merged.id, ops[0].id);
            if ops.len() == 1 {
                prop_assert_eq!(&merged, &ops[0]);
            }
        }
    }
}

#[cfg(all(test, loom))]
#[expect(unsafe_code, reason = "loom's UnsafeCell stands for the host page the worker writes and the scheduler reads")]
mod loom_tests {
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    use super::*;

    /// Data written before it is counted: a scheduler that terminates and reads `n` completed pages must see every one
    /// of those pages' bytes, whichever way the worker's writes and increments interleave with the termination.
    #[test]
    fn terminated_count_covers_only_written_pages() {
        loom::model(|| {
            let progress = Arc::new(Progress::default());
            let pages = Arc::new([UnsafeCell::new(0u8), UnsafeCell::new(0u8)]);
            let worker = {
                let (progress, pages) = (progress.clone(), pages.clone());
                loom::thread::spawn(move || {
                    for (index, page) in pages.iter().enumerate() {
                        page.with_mut(|byte| {
                            // SAFETY: the scheduler reads page `index` only after the count includes it, and the
                            // count includes it only after this write (the increment below); loom checks exactly this.
                            unsafe { *byte = index as u8 + 1 }
                        });
                        if progress.increment(1).is_err() {
                            break;
                        }
                    }
                })
            };
            let completed = progress.terminate() as usize;
            for (index, page) in pages.iter().take(completed).enumerate() {
                // SAFETY: as above: page `index` is counted, so its write happened before and no write follows.
                page.with(|byte| assert_eq!(unsafe { *byte }, index as u8 + 1));
            }
            worker.join().unwrap();
            assert_eq!(progress.completed() as usize, completed, "nothing counted after termination");
        });
    }
}
