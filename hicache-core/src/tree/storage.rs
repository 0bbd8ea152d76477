//! The tree's side of transfers: load-back, the tick (acks, backups, prefetch results), and prefetch from storage
//! (docs/sglang.md#acks, #load-back, #prefetch, #stop-policies).

use rustc_hash::FxHashMap as HashMap;

use super::{HiRadixTree, Node};
use crate::collective::Collective;
use crate::controller::NodeId;
use crate::controller::{Meeting, PrefetchDone, PrefetchExplanation, PrefetchHead, PrefetchStart, TickProgress};
use crate::device_slots::DeviceSlot;
use crate::device_slots::DeviceSlotAllocator;
use crate::error::Error;
use crate::hash::PageKey;
use crate::host_pool::HostPageId;
use crate::transfer::{ProducerSlot, SlotBusy, SlotReuse, TransferEngine};

/// The answer of [`HiRadixTree::check_prefetch_progress`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchCheck {
    /// No prefetch is pending for the request: schedule it (match its prefix again first).
    Ready,
    /// Its prefetch is stopping; the result arrives at a tick.
    Waiting,
}

/// What one tick did.
#[derive(Debug, Default)]
pub struct TickSummary {
    /// Device → host writes acked.
    pub writes_acked: usize,
    /// Of those, writes whose transfer failed: their nodes stay on the device without a host copy.
    pub writes_failed: usize,
    /// Pages those writes copied, and those of writes acked since the last tick outside it (`write_back`'s writes at
    /// device eviction).
    pub pages_written: usize,
    /// Host → device loads acked.
    pub loads_acked: usize,
    /// Pages written to storage by the backups that finished.
    pub pages_backed_up: usize,
    /// Pages whose backup failed.
    pub pages_backup_failed: usize,
    /// Finished prefetches: the explanation, and the tokens that were new to the tree (the rest were there already).
    pub prefetches: Vec<(PrefetchExplanation, usize)>,
}

impl<E: TransferEngine> HiRadixTree<E> {
    /// Loads the evicted part of the match ending at `last_node` back to the device: all of it or nothing
    /// (docs/sglang.md#load-back), when it is at least the load-back threshold, into slots taken from the engine's
    /// `device` allocator, evicting device pages once (their slots go back to it) if it has too few free. Returns the
    /// device slots of the loaded tokens (empty when nothing was loaded); the load starts with
    /// [`start_loading`](Self::start_loading). The loaded nodes stay locked until their load is acked.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownNode`] when `last_node` is not in the tree (removed, or from before a reset); controller and
    /// allocator errors (bugs).
    pub fn load_back(
        &mut self,
        last_node: NodeId,
        device: &mut dyn DeviceSlotAllocator,
    ) -> Result<Vec<DeviceSlot>, Error> {
        self.live(last_node)?;
        let mut to_load = Vec::new();
        let mut node = last_node;
        while self.node(node).evicted() {
            to_load.push(node);
            node = self.node(node).parent.expect("the root is resident");
        }
        to_load.reverse();
        let ancestor = node;
        let host: Vec<HostPageId> =
            to_load.iter().flat_map(|id| self.node(*id).host.clone().expect("evicted nodes are backed up")).collect();
        if host.is_empty() || host.len() * self.page_size < self.settings.load_back_threshold {
            return Ok(Vec::new());
        }
        // the ancestor must stay resident, and the nodes to load on the host, while this makes room (a write_back
        // eviction may need host room itself)
        self.lock_path(ancestor);
        let mut slots = device.alloc_pages(host.len());
        if slots.is_none() {
            to_load.iter().for_each(|id| self.node_mut(*id).host_ref += 1);
            let evicted = self.evict(host.len() * self.page_size, device);
            to_load.iter().for_each(|id| self.node_mut(*id).host_ref -= 1);
            evicted?;
            slots = device.alloc_pages(host.len());
        }
        self.unlock_path(ancestor);
        let Some(slots) = slots else { return Ok(Vec::new()) };
        if let Err(error) = self.controller.load(&host, &slots, last_node, None) {
            device.free(&slots)?;
            return Err(error);
        }
        let mut offset = 0;
        for id in &to_load {
            let node = self.node_mut(*id);
            let len = node.key.len();
            node.device = Some(slots[offset..offset + len].to_vec());
            // a node the caller locked while it was evicted is protected from the moment it is resident
            if node.lock_ref > 0 {
                self.protected_tokens += len;
            } else {
                self.evictable_tokens += len;
            }
            offset += len;
        }
        self.lock_path(last_node);
        self.ongoing_loads.insert(last_node, ());
        Ok(slots)
    }

    /// Starts every queued load (one event per layer) and returns the producer slot for the forward pass, `None`
    /// when nothing was queued; waits when the slot's previous load is still in flight (docs/sglang.md#fixed-17).
    ///
    /// # Errors
    ///
    /// Engine errors.
    pub fn start_loading(&mut self) -> Result<Option<ProducerSlot>, Error> {
        match self.controller.start_loading(SlotReuse::Wait)? {
            Ok(slot) => Ok(slot),
            Err(SlotBusy { slot }) => Err(Error::Internal(format!("{slot} busy after waiting"))),
        }
    }

    /// Starts a prefetch of `tokens` (those after the match) for `request_id`, below `last_host_node` (the match's
    /// deepest backed-up node, which must be the deepest matched node). Returns what the controller said.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownNode`] when `last_host_node` is not in the tree; as
    /// [`CacheController::prefetch`](crate::controller::CacheController::prefetch).
    pub fn prefetch_from_storage(
        &mut self,
        request_id: &str,
        last_host_node: NodeId,
        tokens: &[u32],
    ) -> Result<PrefetchStart, Error> {
        self.live(last_host_node)?;
        let last_key: Option<PageKey> = self.node(last_host_node).hashes.last().copied();
        // the tokens on the path to the node: what the request has before the prefetch's
        let mut cached_tokens = 0;
        let mut walk = Some(last_host_node);
        while let Some(id) = walk {
            cached_tokens += self.node(id).key.len();
            walk = self.node(id).parent;
        }
        let start = self.controller.prefetch_after(request_id, tokens, last_key, cached_tokens)?;
        if let PrefetchStart::Started(_) = start {
            self.node_mut(last_host_node).host_ref += 1;
            let whole = tokens.len() - tokens.len() % self.page_size;
            self.ongoing_prefetches.insert(request_id.to_owned(), (last_host_node, tokens[..whole].to_vec()));
        }
        Ok(start)
    }

    /// The engine computed `tokens` after a prefix of `prefix` tokens in `elapsed`: its prefill, which the cost
    /// model weighs against bringing pages from storage ([`crate::cost`]; until the engine reports, or the config
    /// gives `prior_prefill_tokens_per_s`, a storage hit is read to measure the tier: whole, or an engine that splits
    /// reads its last quarter while computing the rest).
    pub fn observe_prefill(&mut self, tokens: usize, prefix: usize, elapsed: std::time::Duration) {
        self.controller.observe_prefill(tokens, prefix, elapsed);
    }

    /// A load of `bytes` from the host to the device took `elapsed` (for the cost model).
    pub fn observe_load(&mut self, bytes: u64, elapsed: std::time::Duration) {
        self.controller.observe_load(bytes, elapsed);
    }

    /// What `request_id`'s pending prefetch leaves to the engine to compute first. A split plan ([`crate::cost`],
    /// config `prefetch_split`) fetches only the hit's tail, and the engine computes the head beside the reads: on
    /// [`PrefetchHead::Compute`] it inserts the head's KV into the tree (after the request's match) before it calls
    /// [`check_prefetch_progress`](Self::check_prefetch_progress), and the fetched tail joins the tree below it (a
    /// tail whose head is not in the tree when the result comes is given back). While the answer is
    /// [`PrefetchHead::NotPlanned`], such an engine does not ask for the result yet (asking first rules a split out).
    pub fn prefetch_head(&self, request_id: &str) -> PrefetchHead {
        self.controller.prefetch_head(request_id)
    }

    /// Where the reads of `request_id`'s pending prefetch are, for an engine that meets them (config
    /// `prefetch_meet`): see [`prefetch_meeting`](crate::controller::CacheController::prefetch_meeting). Such an
    /// engine computes the prompt from the prefetch's first token while the reads run from the end; once its compute
    /// meets the reads every rank has done ([`Meeting::met`]), it inserts the KV it computed, as far as it got, and
    /// calls [`meet_prefetch`](Self::meet_prefetch); the pages read join the tree below it at a tick.
    pub fn prefetch_meeting(&self, request_id: &str) -> Option<Meeting> {
        self.controller.prefetch_meeting(request_id)
    }

    /// The engine's compute met `request_id`'s reads: see
    /// [`meet_prefetch`](crate::controller::CacheController::meet_prefetch). The request waits for the tick that
    /// brings the result, as after [`check_prefetch_progress`](Self::check_prefetch_progress).
    pub fn meet_prefetch(&mut self, request_id: &str) -> bool {
        self.controller.meet_prefetch(request_id)
    }

    /// Whether `request_id` can be scheduled; a pending prefetch is asked to stop (by policy), and the request
    /// waits for the tick that brings the result.
    pub fn check_prefetch_progress(&mut self, request_id: &str) -> PrefetchCheck {
        if !self.ongoing_prefetches.contains_key(request_id) {
            return PrefetchCheck::Ready;
        }
        self.controller.finish_prefetch(request_id);
        PrefetchCheck::Waiting
    }

    /// Aborts `request_id`'s prefetch (a request dropped from the queue); its pages return at later ticks.
    pub fn release_aborted_request(&mut self, request_id: &str) {
        if self.ongoing_prefetches.contains_key(request_id) {
            self.controller.abort_prefetch(request_id);
        }
    }

    /// The scheduler's tick (SGLang's `check_hicache_events`): the controller's one TP reduction, then write acks
    /// (unlock), load acks (unlock), finished backups, and prefetch results inserted as host-only nodes.
    ///
    /// # Errors
    ///
    /// The collective's errors; controller errors (bugs).
    pub fn tick(&mut self, collective: &mut dyn Collective) -> Result<TickSummary, Error> {
        let mut progress = self.controller.begin_tick(collective)?;
        let report = loop {
            match progress {
                TickProgress::Done(report) => break report,
                TickProgress::NeedsHostPages(paused) => {
                    // a failure here leaves the prefetch without room: it is revoked, and the error shows at the next
                    // call
                    let _ = self.evict_host(paused.pages() * self.page_size);
                    progress = self.controller.resume_tick(paused)?;
                }
            }
        };
        let mut summary = TickSummary {
            writes_acked: report.write_acks.len(),
            pages_written: std::mem::take(&mut self.written_since_tick),
            ..TickSummary::default()
        };
        for ack in &report.write_acks {
            if ack.failed.is_some() {
                summary.writes_failed += 1;
                self.write_failed(ack);
            } else {
                summary.pages_written += ack.host_pages.len();
            }
            self.write_acked(&ack.node_ids);
        }
        for backup in &report.backups {
            let stored = backup.pages.iter().filter(|page| **page == crate::controller::PageBackup::Stored).count();
            summary.pages_backed_up += stored;
            summary.pages_backup_failed +=
                backup.pages.iter().filter(|page| matches!(page, crate::controller::PageBackup::Failed(_))).count();
        }
        for done in report.prefetches {
            let explanation = done.explanation.clone();
            let new = self.prefetch_done(done)?;
            summary.prefetches.push((explanation, new));
        }
        summary.loads_acked = self.loading_check()?;
        Ok(summary)
    }

    /// Whether nothing is in flight: every device → host write acked, every backup to storage finished and taken,
    /// every load acked. (A backup to storage is submitted when its host write is acked, so no page is queued for
    /// storage then either.)
    pub fn is_drained(&self) -> bool {
        self.controller.backups_in_flight() == 0 && self.controller.outstanding() == (0, 0, 0)
    }

    /// Whether nothing the scheduler waits for is in flight: no prefetch pending and no device ↔ host transfer
    /// queued or unacked (backups to storage may still run: they hold no request back). A scheduler that cannot
    /// place its next request while the tree is idle never will.
    pub fn is_idle(&self) -> bool {
        self.prefetches_pending() == 0 && self.controller.outstanding() == (0, 0, 0)
    }

    /// Ticks until [`is_drained`](Self::is_drained), handing `each` every tick's summary; an engine calls it to know
    /// that what it inserted has reached the host and storage. Ranks of a TP group call it together: the condition
    /// reads what each tick reduced, so they tick the same number of times.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when `deadline` passes first (naming `drain`); the tick's errors.
    pub fn drain(
        &mut self,
        collective: &mut dyn Collective,
        deadline: std::time::Instant,
        each: &mut dyn FnMut(&TickSummary),
    ) -> Result<(), Error> {
        let started = std::time::Instant::now();
        while !self.is_drained() {
            if std::time::Instant::now() >= deadline {
                return Err(Error::Timeout {
                    backend: if self.controller.backups_in_flight() > 0 { "storage" } else { "host" }.to_owned(),
                    operation: "drain (writes or backups still in flight)",
                    waited_ms: started.elapsed().as_millis() as u64,
                });
            }
            let summary = self.tick(collective)?;
            each(&summary);
            std::thread::yield_now();
        }
        Ok(())
    }

    fn write_acked(&mut self, node_ids: &[NodeId]) {
        for id in node_ids {
            if let Some(locked) = self.ongoing_writes.remove(id)
                && locked
            {
                self.unlock_path(*id);
            }
        }
    }

    /// A write that failed: its nodes have no host copy (the controller freed the pages); they stay on the device,
    /// as nodes whose write the host pool refused.
    fn write_failed(&mut self, ack: &crate::controller::Ack<E::Event>) {
        for id in &ack.node_ids {
            if let Some(node) = self.nodes.get_mut(id)
                && node.host.as_deref() == Some(ack.host_pages.as_slice())
            {
                node.host = None;
            }
        }
    }

    /// Waits for every device → host write and takes the acks (`write_back` eviction).
    pub(super) fn take_all_writes(&mut self) -> Result<(), Error> {
        for ack in self.controller.take_all_write_acks()? {
            if ack.failed.is_some() {
                self.write_failed(&ack);
            } else {
                self.written_since_tick += ack.host_pages.len();
            }
            self.write_acked(&ack.node_ids);
        }
        Ok(())
    }

    /// Takes finished loads and unlocks their nodes (no TP reduction: forward passes keep ranks in step, as SGLang).
    fn loading_check(&mut self) -> Result<usize, Error> {
        let count = self.controller.completed_loads();
        let acks = self.controller.take_load_acks(count)?;
        for ack in &acks {
            for id in &ack.node_ids {
                if self.ongoing_loads.remove(id).is_some() {
                    self.unlock_path(*id);
                }
            }
        }
        Ok(acks.len())
    }

    /// Inserts a prefetch's pages below the node it was asked under (below a split's head, which the engine
    /// inserted); pages of tokens already in the tree are given back, and all of them when the head is not there.
    /// Returns the tokens new to the tree.
    fn prefetch_done(&mut self, done: PrefetchDone) -> Result<usize, Error> {
        let Some((anchor, tokens)) = self.ongoing_prefetches.remove(&done.request_id) else {
            return Err(Error::Internal(format!("a prefetch result for unknown request {}", done.request_id)));
        };
        self.node_mut(anchor).host_ref -= 1;
        if done.host_pages.is_empty() {
            return Ok(0);
        }
        let (head, fetched) = (done.head_tokens, done.host_pages.len() * self.page_size);
        let Some(below) = self.descend(anchor, &tokens[..head]) else {
            // the engine did not insert the head (or it is gone): the tail has nothing to hang from
            self.controller.evict_host(&done.host_pages)?;
            return Ok(0);
        };
        let (duplicates, new) =
            self.insert_host(below, &tokens[head..head + fetched], done.host_pages, done.keys, done.trailing_from);
        if !duplicates.is_empty() {
            self.controller.evict_host(&duplicates)?;
        }
        Ok(new)
    }

    /// The node where `tokens` end below `anchor` (split there if they end inside one), when the tree holds all of
    /// them (on the device or the host).
    fn descend(&mut self, anchor: NodeId, tokens: &[u32]) -> Option<NodeId> {
        let mut node = anchor;
        let mut rest = tokens;
        while !rest.is_empty() {
            let child = *self.node(node).children.get(&self.child_key(rest))?;
            let prefix = self.match_len(&self.node(child).key, rest);
            if prefix < self.node(child).key.len() && prefix < rest.len() {
                // the tokens leave this node's key before its end
                return None;
            }
            node = if prefix < self.node(child).key.len() { self.split(child, prefix) } else { child };
            rest = &rest[prefix..];
        }
        Some(node)
    }

    /// Hangs host-only nodes for `tokens` below `anchor`, the trailing-window pools' entries held from page
    /// `trailing_from` of them on; returns the pages of tokens already there, and the tokens added.
    fn insert_host(
        &mut self,
        anchor: NodeId,
        tokens: &[u32],
        pages: Vec<HostPageId>,
        keys: Vec<PageKey>,
        trailing_from: usize,
    ) -> (Vec<HostPageId>, usize) {
        let now = self.tick_clock();
        let mut node = anchor;
        let mut rest = tokens;
        let mut duplicates = Vec::new();
        let mut taken = 0;
        while !rest.is_empty() {
            let Some(&child) = self.node(node).children.get(&self.child_key(rest)) else { break };
            let prefix = self.match_len(&self.node(child).key, rest);
            let child = if prefix < self.node(child).key.len() { self.split(child, prefix) } else { child };
            self.node_mut(child).last_access = now;
            let prefix_pages = prefix / self.page_size;
            duplicates.extend_from_slice(&pages[taken..taken + prefix_pages]);
            taken += prefix_pages;
            node = child;
            rest = &rest[prefix..];
        }
        if !rest.is_empty() {
            let id = self.new_id();
            let child_key = self.child_key(rest);
            let hashes = if self.controller.has_storage() { keys[taken..].to_vec() } else { Vec::new() };
            let trailing = if self.settings.trailing_window.is_some() {
                (taken..pages.len()).map(|page| page >= trailing_from).collect()
            } else {
                Vec::new()
            };
            self.nodes.insert(
                id,
                Node {
                    parent: Some(node),
                    children: HashMap::default(),
                    key: rest.to_vec(),
                    device: None,
                    host: Some(pages[taken..].to_vec()),
                    hashes,
                    trailing,
                    lock_ref: 0,
                    host_ref: 0,
                    hit_count: 0,
                    last_access: now,
                },
            );
            self.node_mut(node).children.insert(child_key, id);
        }
        (duplicates, rest.len())
    }

    /// Prefetches in flight (their requests wait for a tick).
    pub fn prefetches_pending(&self) -> usize {
        self.ongoing_prefetches.len()
    }
}
