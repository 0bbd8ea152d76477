//! The device↔host operations the controller queues, merges and acks (docs/sglang.md#operations): a
//! [`CacheOperation`] moves a run of pages between the device and host pools, and queued ones are merged into one
//! transfer; operation ids ([`OpId`], handed out in order by [`OpIds`]) and the tree-node tags ([`NodeId`]) the acks
//! carry back.

use crate::device_slots::DeviceSlot;
use crate::error::Error;
use crate::host_pool::HostPageId;

/// Id of an operation, unique within its controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

/// Id of a prefix-tree node. The tree assigns them and never reuses one, not even after a reset, so an id of a node
/// that is gone names no other node: the tree's methods answer it with [`Error::UnknownNode`](crate::Error). The
/// controller takes them as opaque tags of its operations (an engine driving it directly may use its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u64);

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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::host_pool::HostPageAllocator;

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
