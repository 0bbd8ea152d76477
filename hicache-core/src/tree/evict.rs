//! Device and host eviction: least recently used leaves first (docs/sglang.md#device-eviction, #host-eviction).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rustc_hash::FxHashSet as HashSet;

use super::HiRadixTree;
use crate::config::WritePolicy;
use crate::controller::NodeId;
use crate::device_slots::DeviceSlotAllocator;
use crate::error::Error;
use crate::transfer::TransferEngine;

impl<E: TransferEngine> HiRadixTree<E> {
    /// Frees at least `tokens` device tokens if it can, least recently used leaves first, giving their slots back to
    /// the engine's `device` allocator: a backed-up node keeps its host copy; one without is backed up first under
    /// `write_back` (and on to storage), otherwise deleted (its KV will be recomputed). Locked nodes are skipped.
    /// Returns the tokens freed.
    ///
    /// # Errors
    ///
    /// Controller and allocator errors (bugs).
    pub fn evict(&mut self, tokens: usize, device: &mut dyn DeviceSlotAllocator) -> Result<usize, Error> {
        let write_back = self.settings.write_policy == WritePolicy::WriteBack;
        let mut heap: BinaryHeap<Reverse<(u64, NodeId)>> = self
            .nodes
            .iter()
            .filter(|(id, _)| self.is_device_leaf(**id))
            .map(|(id, node)| Reverse((node.last_access, *id)))
            .collect();
        let mut evicted = 0;
        let mut written: Vec<NodeId> = Vec::new();
        let mut pending: HashSet<NodeId> = HashSet::default();
        while evicted < tokens {
            let Some(Reverse((_, id))) = heap.pop() else { break };
            let node = self.node(id);
            if node.lock_ref > 0 || node.evicted() {
                continue;
            }
            let parent = node.parent.expect("the root is not a leaf");
            if node.backed_up() {
                evicted += self.evict_backed_up(id, device)?;
            } else if write_back && self.rescue(id)? > 0 {
                // the copy is in flight: the device slots are freed once every write is acked, below
                evicted += self.node(id).key.len();
                written.push(id);
                pending.insert(id);
            } else if let Some(freed) = self.delete_unbacked(id, device)? {
                // no host copy (or, under write_back, no room for one: SGLang would assert later,
                // docs/sglang.md#fixed-4)
                evicted += freed;
            } else {
                continue;
            }
            if parent != self.root
                && !self.node(parent).evicted()
                && self.node(parent).lock_ref == 0
                && self
                    .node(parent)
                    .children
                    .values()
                    .all(|child| self.node(*child).evicted() || pending.contains(child))
            {
                heap.push(Reverse((self.node(parent).last_access, parent)));
            }
        }
        if !written.is_empty() {
            self.take_all_writes()?;
            for id in written {
                // a node whose write failed has no host copy: it stays on the device
                if self.node(id).backed_up() {
                    self.evict_backed_up(id, device)?;
                }
            }
        }
        tracing::debug!(asked = tokens, evicted, "device eviction");
        Ok(evicted)
    }

    /// `write_back`'s eviction write of a device leaf. While backups to storage pin the host pool, it waits for the
    /// oldest to finish and tries again rather than lose the KV: every rank has the same backups queued, so every
    /// rank waits for the same ones. (A `write_through` node whose write the full host pool refused is dropped, as in
    /// SGLang: waiting there stalled the scheduler and churned the host pool for less hit rate in replays.) Returns
    /// the tokens written (0: none).
    fn rescue(&mut self, id: NodeId) -> Result<usize, Error> {
        let mut written = self.write_to_host(id, true)?;
        while written == 0 && self.controller.backups_in_flight() > 0 {
            self.controller.take_backups(1)?;
            self.stats.backup_waits += 1;
            written = self.write_to_host(id, true)?;
        }
        Ok(written)
    }

    fn is_device_leaf(&self, id: NodeId) -> bool {
        let node = self.node(id);
        id != self.root && !node.evicted() && node.children.values().all(|child| self.node(*child).evicted())
    }

    /// Drops the device copy of a backed-up node whose host copy is synced.
    fn evict_backed_up(&mut self, id: NodeId, device: &mut dyn DeviceSlotAllocator) -> Result<usize, Error> {
        let node = self.node(id);
        let slots = node.device.clone().expect("resident");
        let host = node.host.clone().expect("backed up");
        self.controller.evict_device(&host)?;
        device.free(&slots)?;
        self.node_mut(id).device = None;
        self.evictable_tokens -= slots.len();
        self.stats.device_evicted_tokens += slots.len();
        Ok(slots.len())
    }

    /// Frees a device leaf that has no host copy and removes it from the tree, with its host-only descendants
    /// (their prefix is gone, so nothing can match them; SGLang leaves them orphaned). `None`, changing nothing, when
    /// a descendant is protected by a prefetch or being written to storage.
    fn delete_unbacked(&mut self, id: NodeId, device: &mut dyn DeviceSlotAllocator) -> Result<Option<usize>, Error> {
        let mut subtree = vec![id];
        let mut index = 0;
        while index < subtree.len() {
            subtree.extend(self.node(subtree[index]).children.values().copied());
            index += 1;
        }
        for &descendant in &subtree[1..] {
            // a resident descendant is one whose write_back copy is still in flight
            let node = self.node(descendant);
            let Some(host) = node.host.as_ref().filter(|_| node.evicted()) else { return Ok(None) };
            if node.host_ref > 0 || node.lock_ref > 0 || self.controller.is_pinned(host) {
                return Ok(None);
            }
        }
        for &descendant in &subtree[1..] {
            let node = self.nodes.remove(&descendant).expect("live");
            self.controller.evict_host(&node.host.expect("backed up"))?;
        }
        let node = self.nodes.remove(&id).expect("live");
        let slots = node.device.expect("resident");
        device.free(&slots)?;
        let key = self.child_key(&node.key);
        self.node_mut(node.parent.expect("not the root")).children.remove(&key);
        self.evictable_tokens -= slots.len();
        self.stats.dropped_tokens += slots.len();
        Ok(Some(slots.len()))
    }

    /// Frees at least `tokens` host tokens if it can: least recently used nodes that are only on the host, have no
    /// children, are not protected by a prefetch and are not being written to storage. They leave the tree; a later
    /// request finds them in storage only. Returns the tokens freed.
    ///
    /// # Errors
    ///
    /// Controller errors (bugs).
    pub fn evict_host(&mut self, tokens: usize) -> Result<usize, Error> {
        let evicted = self.evict_host_nodes(tokens)?;
        self.stats.host_evicted_tokens += evicted;
        Ok(evicted)
    }

    fn evict_host_nodes(&mut self, tokens: usize) -> Result<usize, Error> {
        let mut heap: BinaryHeap<Reverse<(u64, NodeId)>> = self
            .nodes
            .iter()
            .filter(|(id, node)| **id != self.root && node.children.is_empty())
            .map(|(id, node)| Reverse((node.last_access, *id)))
            .collect();
        let mut evicted = 0;
        while evicted < tokens {
            let Some(Reverse((_, id))) = heap.pop() else { break };
            let node = self.node(id);
            if !node.evicted() || node.host_ref > 0 || node.lock_ref > 0 {
                continue;
            }
            if self.controller.is_pinned(node.host.as_ref().expect("evicted nodes are backed up")) {
                continue;
            }
            let node = self.nodes.remove(&id).expect("live");
            self.controller.evict_host(node.host.as_ref().expect("backed up"))?;
            evicted += node.key.len();
            let parent = node.parent.expect("not the root");
            let (root, page_size) = (self.root, self.page_size);
            let entry = self.node_mut(parent);
            entry.children.remove(&node.key[..page_size]);
            if parent != root && entry.children.is_empty() && entry.evicted() {
                heap.push(Reverse((entry.last_access, parent)));
            }
        }
        Ok(evicted)
    }
}
