//! The tiered prefix tree (SGLang's `HiRadixCache`, docs/sglang.md#tree, #acks to #load-back, #prefetch): a radix tree
//! over token ids whose nodes hold device slots (L1), host pages (L2) and page keys, driving a [`CacheController`].
//!
//! * Children are keyed by their first page of tokens; every node's key is a whole number of pages, and splits
//!   happen at page boundaries, so page keys stay aligned with nodes.
//! * A node is *device-resident* (`device` set) or *evicted*; it is *backed up* when it has host pages. Device
//!   residency is prefix-closed: a resident node's parent is resident (docs/sglang.md#tree). An evicted node is always
//!   backed up: evicting a node without a host copy deletes it.
//! * `lock_ref` counts users along the path to the root (a request using a prefix, a copy in flight), and protects
//!   from device eviction; `host_ref` protects host pages a prefetch will hang new nodes under.
//! * Access order is a logical clock, not wall time, so TP ranks that make the same calls evict the same nodes.
//!
//! Departures from SGLang, each for a bug listed in docs/sglang.md: `write_back` backs up to storage as well (item 3),
//! a failed `write_back` backup at eviction drops the node instead of crashing later (item 4), and everything that can
//! differ between TP ranks goes through the controller's one reduction per tick (items 2, 16).

mod evict;
mod invariants;
mod storage;

use std::num::NonZeroUsize;

use rustc_hash::FxHashMap as HashMap;

use crate::config::WritePolicy;
use crate::controller::CacheController;
pub use crate::controller::NodeId;
use crate::device_slots::DeviceSlot;
use crate::device_slots::DeviceSlotAllocator;
use crate::error::Error;
use crate::hash::{PageHasher, PageKey, PartialPage};
use crate::host_pool::HostPageId;
use crate::transfer::{LayerDoneCounter, TransferEngine};

pub use storage::{PrefetchCheck, TickSummary};

/// What [`HiRadixTree::match_prefix`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatchResult {
    /// Device slots of the matched prefix that is on the device (L1 hit), in token order.
    pub device_slots: Vec<DeviceSlot>,
    /// The deepest matched node that is on the device (the root when none is).
    pub last_device_node: NodeId,
    /// The deepest matched node that has a host copy (the root when none has).
    pub last_host_node: NodeId,
    /// The deepest matched node.
    pub last_node: NodeId,
    /// Tokens matched below `last_device_node` that are only on the host (L2 hit).
    pub host_hit_length: usize,
    /// The tokens of `device_slots` a request may use when it loads nothing back: all of them, except with a
    /// [trailing window](HiRadixTree#trailing-windows), where the device part may end at a page whose window is not
    /// held (the match goes on to one on the host): then the deepest usable end before it.
    pub device_usable: usize,
}

/// Counters of what the tree did, since it was made or reset.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TreeStats {
    /// Tokens whose device copy was dropped while a host copy stayed.
    pub device_evicted_tokens: usize,
    /// Tokens dropped from the device with no host copy (lost; recomputed if asked again).
    pub dropped_tokens: usize,
    /// Tokens dropped from the host (storage may still hold them).
    pub host_evicted_tokens: usize,
    /// Tokens a write to the host could not take (host pool full even after eviction).
    pub write_refused_tokens: usize,
    /// Times device eviction waited for a backup to storage to unpin host pages, rather than drop a node's KV.
    pub backup_waits: usize,
}

/// Knobs of the tree (SGLang's constants, configurable).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeSettings {
    /// When nodes are backed up to the host.
    pub write_policy: WritePolicy,
    /// Hits before `write_through_selective` backs a node up (SGLang: 2).
    pub write_through_selective_threshold: u32,
    /// Fewest host tokens worth loading back (SGLang: 10).
    pub load_back_threshold: usize,
    /// The trailing window of a hybrid model whose sidecar pools only the last pages of a prefix need (a Mamba
    /// state: 1 page, a sliding window: the pages it spans; the largest of the model's such pools), `None` for a
    /// model without (see [trailing windows](HiRadixTree#trailing-windows)).
    pub trailing_window: Option<NonZeroUsize>,
}

impl Default for TreeSettings {
    fn default() -> Self {
        Self {
            write_policy: WritePolicy::WriteThrough,
            write_through_selective_threshold: 2,
            load_back_threshold: 10,
            trailing_window: None,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) parent: Option<NodeId>,
    pub(crate) children: HashMap<Box<[u32]>, NodeId>,
    pub(crate) key: Vec<u32>,
    pub(crate) device: Option<Vec<DeviceSlot>>,
    pub(crate) host: Option<Vec<HostPageId>>,
    /// One per page when storage is on, else empty.
    pub(crate) hashes: Vec<PageKey>,
    /// Per page, whether the entries of the trailing-window pools at its end are held: one per page with a trailing
    /// window, else empty.
    pub(crate) trailing: Vec<bool>,
    pub(crate) lock_ref: u32,
    pub(crate) host_ref: u32,
    pub(crate) hit_count: u32,
    pub(crate) last_access: u64,
}

impl Node {
    pub(crate) fn evicted(&self) -> bool {
        self.device.is_none()
    }

    pub(crate) fn backed_up(&self) -> bool {
        self.host.is_some()
    }
}

/// The deepest usable end of a run of pages, given per page whether the trailing window's entries at its end are
/// held: the most pages `n` whose last `min(n, window)` pages hold them (0 when no page does).
fn deepest_usable(held: impl Iterator<Item = bool>, window: NonZeroUsize) -> usize {
    // pages so far, and how many of the last of them are held
    let (mut pages, mut run, mut usable) = (0, 0, 0);
    for held in held {
        pages += 1;
        run = if held { run + 1 } else { 0 };
        if run >= pages.min(window.get()) {
            usable = pages;
        }
    }
    usable
}

/// The tree and the controller it drives.
///
/// # Trailing windows
///
/// A hybrid model may keep sidecar pools that a prefix needs only at its end: a Mamba (linear-attention) state is
/// the state after the prefix's last page, a sliding window's KV that of its last pages. With such a model
/// ([`TreeSettings::trailing_window`]: `w` pages), the tree knows per page whether the entries of those pools at the
/// page's end are held (a Mamba state is kept at some pages only: where a request ended, or where the engine saved
/// one; a sliding window's KV is kept for the pages an engine computed), and a prefix of `n` pages is *usable* only
/// when its last `min(n, w)` pages hold them. A match ends at the deepest usable end of the cached prefix, so a
/// request is never given a prefix whose state or window is missing: it recomputes from there.
///
/// Which pages hold the entries is the engine's word when it inserts
/// ([`insert_with_trailing`](Self::insert_with_trailing)); a split divides them; a copy to the host or back, or an
/// eviction, keeps them. Entries the engine recomputes for pages the tree already holds are not taken (on the
/// device the tree keeps its slots, which other requests may be reading; an evicted node's host copy keeps its
/// bytes), so a page that lacks them keeps lacking them until its node leaves the tree. Storage keeps a node's
/// window, and a prefetch reads the window at the end of its hit ([`Trailing`](crate::controller::Trailing)): the
/// pages it brings hold the entries from there on.
#[derive(Debug)]
pub struct HiRadixTree<E: TransferEngine> {
    controller: CacheController<E>,
    settings: TreeSettings,
    page_size: usize,
    nodes: HashMap<NodeId, Node>,
    root: NodeId,
    next_id: u64,
    clock: u64,
    hasher: PageHasher,
    /// Device tokens of unlocked resident nodes (evictable), and of locked ones.
    evictable_tokens: usize,
    protected_tokens: usize,
    /// Nodes with a device → host write in flight, and whether the write holds a lock on them.
    ongoing_writes: HashMap<NodeId, bool>,
    /// Pages of writes acked outside a tick (device eviction waits for its writes), reported by the next tick.
    written_since_tick: usize,
    /// Nodes with a host → device load in flight (locked until the ack).
    ongoing_loads: HashMap<NodeId, ()>,
    /// Prefetches in flight: request → (node they hang under, the tokens asked for).
    ongoing_prefetches: HashMap<String, (NodeId, Vec<u32>)>,
    stats: TreeStats,
}

impl<E: TransferEngine> HiRadixTree<E> {
    /// A tree over `controller`; page keys are computed for new nodes only when the controller has storage. A
    /// controller whose storage settings have a [trailing window](Self#trailing-windows) gives the tree its window
    /// (`settings.trailing_window` is then not read): what storage keeps and reads of a window and where matches end
    /// come from one value.
    pub fn new(controller: CacheController<E>, settings: TreeSettings) -> Self {
        let trailing_window = controller.trailing().map(|trailing| trailing.window).or(settings.trailing_window);
        let settings = TreeSettings { trailing_window, ..settings };
        let root = NodeId(0);
        let mut nodes = HashMap::default();
        nodes.insert(root, Self::root_node());
        Self {
            page_size: controller.page_size(),
            controller,
            settings,
            nodes,
            root,
            next_id: 1,
            clock: 0,
            hasher: PageHasher::new(),
            evictable_tokens: 0,
            protected_tokens: 0,
            ongoing_writes: HashMap::default(),
            written_since_tick: 0,
            ongoing_loads: HashMap::default(),
            ongoing_prefetches: HashMap::default(),
            stats: TreeStats::default(),
        }
    }

    fn root_node() -> Node {
        Node {
            parent: None,
            children: HashMap::default(),
            key: Vec::new(),
            device: Some(Vec::new()),
            host: Some(Vec::new()),
            hashes: Vec::new(),
            trailing: Vec::new(),
            lock_ref: 1,
            host_ref: 0,
            hit_count: 0,
            last_access: 0,
        }
    }

    /// The controller.
    pub fn controller(&self) -> &CacheController<E> {
        &self.controller
    }

    /// The per-layer completion of loads, for the forward pass: the engine marks the load it consumes
    /// (`set_consumer`) and waits for each layer (`wait_until`, or its GPU stream on the layer's event).
    pub fn layers(&mut self) -> &mut LayerDoneCounter<E::Event> {
        self.controller.layers()
    }

    /// The controller, mutably: for tests that set up states the tree's own calls do not reach (it bypasses the
    /// tree's bookkeeping, so it is not offered outside the `testing` feature).
    #[cfg(feature = "testing")]
    pub fn controller_mut(&mut self) -> &mut CacheController<E> {
        &mut self.controller
    }

    /// The root node.
    pub fn root(&self) -> NodeId {
        self.root
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Device tokens the tree could evict now, and device tokens locked by users.
    pub fn device_tokens(&self) -> (usize, usize) {
        (self.evictable_tokens, self.protected_tokens)
    }

    /// What the tree did so far.
    pub fn stats(&self) -> &TreeStats {
        &self.stats
    }

    /// Pages whose [trailing-window](Self#trailing-windows) entries the tree holds (a Mamba state, a sliding
    /// window's KV at a page's end): on the device and on the host, a page of a node held in both counted in each.
    /// `(0, 0)` without a trailing window. It walks every node.
    pub fn trailing_held(&self) -> (usize, usize) {
        let (mut device, mut host) = (0, 0);
        for node in self.nodes.values() {
            let held = node.trailing.iter().filter(|&&held| held).count();
            if node.device.is_some() {
                device += held;
            }
            if node.host.is_some() {
                host += held;
            }
        }
        (device, host)
    }

    /// Nodes in the tree, the root included.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub(crate) fn node(&self, id: NodeId) -> &Node {
        self.nodes.get(&id).expect("node ids handed out by the tree are live")
    }

    pub(crate) fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes.get_mut(&id).expect("node ids handed out by the tree are live")
    }

    /// The page keys of `node`'s last page, or `None` for the root or without storage.
    pub fn last_key(&self, node: NodeId) -> Option<PageKey> {
        self.nodes.get(&node).and_then(|node| node.hashes.last().copied())
    }

    fn tick_clock(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn new_id(&mut self) -> NodeId {
        let id = NodeId(self.next_id);
        self.next_id += 1;
        id
    }

    fn child_key(&self, key: &[u32]) -> Box<[u32]> {
        key[..self.page_size.min(key.len())].into()
    }

    /// Length of the common prefix of `a` and `b`, in whole pages.
    fn match_len(&self, a: &[u32], b: &[u32]) -> usize {
        let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        common - common % self.page_size
    }

    fn aligned<'t>(&self, tokens: &'t [u32]) -> &'t [u32] {
        &tokens[..tokens.len() - tokens.len() % self.page_size]
    }

    /// Finds the longest cached prefix of `tokens` (whole pages) that is usable (with a trailing window: whose last
    /// pages hold the window's entries), splitting the node where the match ends inside it.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> MatchResult {
        let tokens = self.aligned(tokens);
        let (usable, held) = self.usable_len(tokens);
        let tokens = &tokens[..usable];
        let now = self.tick_clock();
        let mut node = self.root;
        let mut device_slots = Vec::new();
        let mut rest = tokens;
        while !rest.is_empty() {
            let Some(&child) = self.node(node).children.get(&self.child_key(rest)) else { break };
            let prefix = self.match_len(&self.node(child).key, rest);
            let child = if prefix < self.node(child).key.len() { self.split(child, prefix) } else { child };
            let entry = self.node_mut(child);
            entry.last_access = now;
            if let Some(device) = &entry.device {
                device_slots.extend_from_slice(device);
            }
            node = child;
            rest = &rest[prefix..];
        }
        let device_usable = match self.settings.trailing_window {
            Some(window) => {
                let device_pages = device_slots.len() / self.page_size;
                deepest_usable(held[..device_pages].iter().copied(), window) * self.page_size
            }
            None => device_slots.len(),
        };
        let last_node = node;
        let mut host_hit_length = 0;
        let mut last_device_node = last_node;
        while self.node(last_device_node).evicted() {
            let entry = self.node(last_device_node);
            host_hit_length += entry.key.len();
            last_device_node = entry.parent.expect("the root is resident");
        }
        let mut last_host_node = last_node;
        while !self.node(last_host_node).backed_up() {
            last_host_node = self.node(last_host_node).parent.expect("the root is backed up");
        }
        MatchResult { device_slots, last_device_node, last_host_node, last_node, host_hit_length, device_usable }
    }

    /// The tokens of the longest usable cached prefix of `tokens` (whole pages) with a trailing window: the deepest
    /// page end along the cached path whose last `min(end, window)` pages hold the window's entries, and the flags of
    /// the cached pages along the path (at least those of the usable prefix). Without a trailing window, all of
    /// `tokens` (the match itself stops where the tree does) and no flags.
    fn usable_len(&self, tokens: &[u32]) -> (usize, Vec<bool>) {
        let Some(window) = self.settings.trailing_window else { return (tokens.len(), Vec::new()) };
        let (mut node, mut rest) = (self.root, tokens);
        let mut held = Vec::new();
        while !rest.is_empty() {
            let Some(&child) = self.node(node).children.get(&self.child_key(rest)) else { break };
            let entry = self.node(child);
            let prefix = self.match_len(&entry.key, rest);
            held.extend_from_slice(&entry.trailing[..prefix / self.page_size]);
            if prefix < entry.key.len() {
                break;
            }
            node = child;
            rest = &rest[prefix..];
        }
        (deepest_usable(held.iter().copied(), window) * self.page_size, held)
    }

    /// Splits `child` after `prefix` tokens (whole pages, less than its key): a new node takes the first part and
    /// becomes `child`'s parent. Returns the new node.
    fn split(&mut self, child: NodeId, prefix: usize) -> NodeId {
        let pages = prefix / self.page_size;
        let id = self.new_id();
        let child_key = self.child_key(&self.node(child).key);
        let node = self.node_mut(child);
        let parent = node.parent.expect("the root is never split");
        let upper = Node {
            parent: Some(parent),
            children: HashMap::default(),
            key: node.key.drain(..prefix).collect(),
            device: node.device.as_mut().map(|device| device.drain(..prefix).collect()),
            host: node.host.as_mut().map(|host| host.drain(..pages).collect()),
            hashes: if node.hashes.is_empty() { Vec::new() } else { node.hashes.drain(..pages).collect() },
            trailing: if node.trailing.is_empty() { Vec::new() } else { node.trailing.drain(..pages).collect() },
            lock_ref: node.lock_ref,
            host_ref: node.host_ref,
            hit_count: node.hit_count,
            last_access: node.last_access,
        };
        node.parent = Some(id);
        let lower_key = self.child_key(&self.node(child).key);
        let mut upper = upper;
        upper.children.insert(lower_key, child);
        self.nodes.insert(id, upper);
        self.node_mut(parent).children.insert(child_key, id);
        id
    }

    /// Locks `node` and its ancestors against device eviction; returns the resident tokens that became protected.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownNode`] when `node` is not in the tree (removed, or handed out before a [`reset`](Self::reset)).
    pub fn inc_lock_ref(&mut self, node: NodeId) -> Result<usize, Error> {
        self.live(node)?;
        Ok(self.lock_path(node))
    }

    /// Releases a lock taken with [`inc_lock_ref`](Self::inc_lock_ref); returns the tokens that became evictable.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownNode`] as [`inc_lock_ref`](Self::inc_lock_ref); [`Error::InvalidArgument`] when a node on the
    /// path is not locked (more releases than locks). Nothing changes then.
    pub fn dec_lock_ref(&mut self, node: NodeId) -> Result<usize, Error> {
        self.live(node)?;
        let mut current = Some(node);
        while let Some(id) = current.filter(|&id| id != self.root) {
            let entry = self.node(id);
            if entry.lock_ref == 0 {
                return Err(Error::InvalidArgument {
                    field: "node",
                    reason: format!(
                        "node {} on the path of node {} is not locked: more releases than locks",
                        id.0, node.0
                    ),
                });
            }
            current = entry.parent;
        }
        Ok(self.unlock_path(node))
    }

    /// Whether `node` is in the tree.
    pub(crate) fn live(&self, node: NodeId) -> Result<(), Error> {
        if self.nodes.contains_key(&node) { Ok(()) } else { Err(Error::UnknownNode { node: node.0 }) }
    }

    /// [`inc_lock_ref`](Self::inc_lock_ref) of a node known to be live.
    pub(crate) fn lock_path(&mut self, node: NodeId) -> usize {
        let mut delta = 0;
        let mut current = Some(node);
        while let Some(id) = current {
            if id == self.root {
                break;
            }
            let entry = self.node_mut(id);
            if entry.lock_ref == 0 && !entry.evicted() {
                delta += entry.key.len();
            }
            entry.lock_ref += 1;
            current = entry.parent;
        }
        self.evictable_tokens -= delta;
        self.protected_tokens += delta;
        delta
    }

    /// [`dec_lock_ref`](Self::dec_lock_ref) of a node known to be live and locked along its path.
    ///
    /// # Panics
    ///
    /// When a node on the path is not locked (a bug of this crate).
    pub(crate) fn unlock_path(&mut self, node: NodeId) -> usize {
        let mut delta = 0;
        let mut current = Some(node);
        while let Some(id) = current {
            if id == self.root {
                break;
            }
            let entry = self.node_mut(id);
            assert!(entry.lock_ref > 0, "unlock of unlocked node {id:?}");
            entry.lock_ref -= 1;
            if entry.lock_ref == 0 && !entry.evicted() {
                delta += entry.key.len();
            }
            current = entry.parent;
        }
        self.evictable_tokens += delta;
        self.protected_tokens -= delta;
        delta
    }

    /// Inserts `tokens` (whole pages are kept) whose KV is in `device_slots` (one per token). Nodes already on the
    /// device keep their slots, and the caller's duplicates go back to the engine's `device` allocator; evicted nodes
    /// take the caller's slots again (recomputed); the rest becomes a new leaf. Returns the tokens that were already
    /// on the device. With a [trailing window](Self#trailing-windows), the caller holds the window's entries at
    /// every page it inserts (a sliding window's KV of tokens it computed); see
    /// [`insert_with_trailing`](Self::insert_with_trailing) for an engine that holds them at some pages only.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when there are fewer slots than whole-page tokens; controller errors (bugs).
    pub fn insert(
        &mut self,
        tokens: &[u32],
        device_slots: &[DeviceSlot],
        device: &mut dyn DeviceSlotAllocator,
    ) -> Result<usize, Error> {
        // without a trailing window the flags are not read: none are made
        let held = match self.settings.trailing_window {
            Some(_) => vec![true; tokens.len() / self.page_size],
            None => Vec::new(),
        };
        self.insert_with_trailing(tokens, device_slots, device, &held)
    }

    /// [`insert`](Self::insert), with the pages at whose end the caller holds the entries of the model's
    /// [trailing-window](Self#trailing-windows) pools (`trailing`, one per whole page of `tokens`: a Mamba state
    /// where the request ends, or where the engine saved one). A new leaf takes them; pages already on the device
    /// keep what they hold; an evicted node that takes the caller's slots again holds an entry only where both its
    /// host copy and the caller do. Without a trailing window, `trailing` is not read.
    ///
    /// # Errors
    ///
    /// As [`insert`](Self::insert); [`Error::InvalidArgument`] naming `trailing` when a trailing window is set and it
    /// does not have one value per whole page of `tokens`.
    pub fn insert_with_trailing(
        &mut self,
        tokens: &[u32],
        device_slots: &[DeviceSlot],
        device: &mut dyn DeviceSlotAllocator,
        trailing: &[bool],
    ) -> Result<usize, Error> {
        let tokens = self.aligned(tokens);
        if device_slots.len() < tokens.len() {
            return Err(Error::InvalidArgument {
                field: "device_slots",
                reason: format!("{} slots for {} tokens", device_slots.len(), tokens.len()),
            });
        }
        let pages = tokens.len() / self.page_size;
        if self.settings.trailing_window.is_some() && trailing.len() != pages {
            return Err(Error::InvalidArgument {
                field: "trailing",
                reason: format!("{} values for {pages} whole pages of tokens", trailing.len()),
            });
        }
        let now = self.tick_clock();
        let mut node = self.root;
        let (mut rest, mut slots) = (tokens, &device_slots[..tokens.len()]);
        let mut already = 0;
        while !rest.is_empty() {
            let Some(&child) = self.node(node).children.get(&self.child_key(rest)) else { break };
            let prefix = self.match_len(&self.node(child).key, rest);
            let child = if prefix < self.node(child).key.len() { self.split(child, prefix) } else { child };
            self.node_mut(child).last_access = now;
            let (mine, theirs) = slots.split_at(prefix);
            if self.node(child).evicted() {
                // recomputed: the node takes the caller's slots, its host copy is in sync again
                let host = self.node(child).host.clone().expect("evicted nodes are backed up");
                self.controller.host_resynced(&host)?;
                let locked = self.node(child).lock_ref > 0;
                // the device copy is the caller's now and the host copy stays: an entry is held where both hold it
                let first_page = (tokens.len() - rest.len()) / self.page_size;
                let callers = trailing.get(first_page..first_page + prefix / self.page_size).unwrap_or_default();
                for (held, &callers) in self.node_mut(child).trailing.iter_mut().zip(callers) {
                    *held &= callers;
                }
                self.node_mut(child).device = Some(mine.to_vec());
                if locked {
                    self.protected_tokens += prefix;
                } else {
                    self.evictable_tokens += prefix;
                }
            } else {
                let duplicates: Vec<DeviceSlot> = {
                    let kept = self.node(child).device.as_ref().expect("resident");
                    mine.chunks(self.page_size)
                        .zip(kept.chunks(self.page_size))
                        .filter(|(given, kept)| given != kept)
                        .flat_map(|(given, _)| given.iter().copied())
                        .collect()
                };
                if !duplicates.is_empty() {
                    device.free(&duplicates)?;
                }
                already += prefix;
                self.inc_hit_count(child)?;
            }
            node = child;
            rest = &rest[prefix..];
            slots = theirs;
        }
        if !rest.is_empty() {
            let hashes = if self.controller.has_storage() {
                let last = self.node(node).hashes.last().copied();
                self.hasher.page_keys(rest, self.page_size, last, PartialPage::Reject)?
            } else {
                Vec::new()
            };
            let trailing = if self.settings.trailing_window.is_some() {
                trailing[(tokens.len() - rest.len()) / self.page_size..].to_vec()
            } else {
                Vec::new()
            };
            let id = self.new_id();
            let leaf = Node {
                parent: Some(node),
                children: HashMap::default(),
                key: rest.to_vec(),
                device: Some(slots.to_vec()),
                host: None,
                hashes,
                trailing,
                lock_ref: 0,
                host_ref: 0,
                hit_count: 0,
                last_access: now,
            };
            let child_key = self.child_key(rest);
            self.nodes.insert(id, leaf);
            self.node_mut(node).children.insert(child_key, id);
            self.evictable_tokens += rest.len();
            self.inc_hit_count(id)?;
        }
        Ok(already)
    }

    fn inc_hit_count(&mut self, node: NodeId) -> Result<(), Error> {
        let threshold = match self.settings.write_policy {
            WritePolicy::WriteBack => return Ok(()),
            WritePolicy::WriteThrough => 1,
            WritePolicy::WriteThroughSelective => self.settings.write_through_selective_threshold,
        };
        let entry = self.node_mut(node);
        entry.hit_count += 1;
        if !entry.backed_up() && entry.hit_count >= threshold {
            self.write_to_host(node, false)?;
        }
        Ok(())
    }

    /// Writes `node`'s device copy to new host pages (and on to storage when it has page keys), evicting host
    /// pages once if the pool is full; returns the tokens written (0 when there was no room).
    fn write_to_host(&mut self, node: NodeId, write_back: bool) -> Result<usize, Error> {
        let entry = self.node(node);
        let slots = entry.device.clone().expect("only resident nodes are written");
        let keys = (!entry.hashes.is_empty()).then(|| entry.hashes.clone());
        let trailing = entry.trailing.clone();
        let mut pages = self.controller.write_held(&slots, node, keys.as_deref(), &trailing)?;
        if pages.is_none() {
            self.evict_host(slots.len())?;
            pages = self.controller.write_held(&slots, node, keys.as_deref(), &trailing)?;
        }
        let Some(pages) = pages else {
            tracing::debug!(node = node.0, tokens = slots.len(), "host pool full: backup refused");
            self.stats.write_refused_tokens += slots.len();
            return Ok(0);
        };
        self.node_mut(node).host = Some(pages);
        self.ongoing_writes.insert(node, !write_back);
        if !write_back {
            self.lock_path(node);
        }
        Ok(slots.len())
    }

    /// Empties the tree and resets the controller (SGLang's `/flush_cache`): in-flight copies and storage I/O are
    /// waited for first; storage keeps its pages. The nodes' device slots are not given back one by one: the engine
    /// empties its allocator with it, as SGLang's flush does.
    pub fn reset(&mut self) {
        self.controller.reset();
        self.nodes.clear();
        self.nodes.insert(self.root, Self::root_node());
        // ids are never reused, so an id from before the reset names no node after it
        self.clock = 0;
        self.evictable_tokens = 0;
        self.protected_tokens = 0;
        self.ongoing_writes.clear();
        self.written_since_tick = 0;
        self.ongoing_loads.clear();
        self.ongoing_prefetches.clear();
        self.stats = TreeStats::default();
    }
}
