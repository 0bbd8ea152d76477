//! The tiered prefix tree on the CPU engine with in-memory storage: matching and splitting at pages, the three write
//! policies (write_back reaching storage, docs/sglang.md#fixed-3 and #fixed-4), device and host eviction, load-back,
//! prefetch from storage, and the tree's invariants under random operation sequences (proptest). Every byte that comes
//! back to the device is checked against bytes derived from the token prefix it belongs to.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hicache_core::DeviceSlot;
use hicache_core::collective::SingleRank;
use hicache_core::config::{PrefetchPolicy, WritePolicy};
use hicache_core::controller::{Meeting, PrefetchHead, PrefetchStart, PrefetchStop, StorageSettings};
use hicache_core::device_slots::{DeviceSlotAllocator as _, PagedSlots};
use hicache_core::error::ErrorKind;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PartialPage, page_keys};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, MemoryStorage, MemoryStore, StorageBackend, StorageStats};
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap};
use hicache_core::tree::{HiRadixTree, PrefetchCheck};
use hicache_core::{HiCacheBuilder, HiCacheConfig};
use proptest::prelude::*;

const PAGE: usize = 2;
const LAYERS: usize = 2;

fn geometry() -> KvGeometry {
    KvGeometry::mha(LAYERS, 1, 4, KvDtype::Bf16).unwrap()
}

struct Rig {
    tree: HiRadixTree<CpuEngine>,
    /// The engine's device slot allocator, which the tree borrows for loads, evictions and inserts.
    device: PagedSlots,
    requests: usize,
}

fn rig(policy: WritePolicy, device_pages: usize, host_pages: usize, store: Option<&Arc<MemoryStore>>) -> Rig {
    rig_with(policy, device_pages, host_pages, store, |settings| settings)
}

fn rig_with(
    policy: WritePolicy,
    device_pages: usize,
    host_pages: usize,
    store: Option<&Arc<MemoryStore>>,
    adjust: impl FnOnce(StorageSettings) -> StorageSettings,
) -> Rig {
    let namespace = StorageNamespace::single_rank("tree-test", geometry(), HostLayout::LayerFirst, PAGE);
    let backend =
        store.map(|store| Arc::new(MemoryStorage::shared(store.clone(), &namespace)) as Arc<dyn StorageBackend>);
    rig_on(policy, device_pages, host_pages, backend, adjust)
}

/// [`rig_with`] on any storage backend.
fn rig_on(
    policy: WritePolicy,
    device_pages: usize,
    host_pages: usize,
    backend: Option<Arc<dyn StorageBackend>>,
    adjust: impl FnOnce(StorageSettings) -> StorageSettings,
) -> Rig {
    let device = DeviceLayoutMap::new(geometry(), device_pages * PAGE).unwrap();
    let host = HostLayoutMap::new(geometry(), HostLayout::LayerFirst, PAGE, host_pages).unwrap();
    let engine = CpuEngine::new(device, host, Completion::Immediate).unwrap();
    let config = HiCacheConfig {
        page_size: PAGE,
        mem_layout: HostLayout::LayerFirst,
        write_policy: policy,
        write_through_selective_threshold: 2,
        load_back_threshold: 1,
        ..HiCacheConfig::default()
    };
    let mut builder = HiCacheBuilder::new(config, engine);
    if let Some(backend) = backend {
        let settings = StorageSettings {
            page_size: PAGE,
            batch_pages: 4,
            prefetch_threshold: 2 * PAGE,
            policy: PrefetchPolicy::WaitComplete,
            timeout_base: Duration::from_secs(3),
            timeout_per_ki_token: Duration::ZERO,
            timeout_max: Duration::from_secs(3),
            read_deadline: Duration::from_secs(30),
            capacity_tokens: ((host_pages - device_pages) * PAGE) as u64,
            backup_skip: false,
            write_bytes_per_s: 0,
            tick_slots: 8,
            by_cost: false,
            split: false,
            meet: false,
            priors: hicache_core::cost::Priors::UNKNOWN,
            trailing: None,
        };
        builder = builder.with_storage(backend).with_storage_settings(adjust(settings));
    }
    Rig { tree: builder.build().unwrap(), device: PagedSlots::new(device_pages, PAGE).unwrap(), requests: 0 }
}

/// The bytes of one item: a function of the token's page key, its place in the page, the layer and the part.
fn derived(seed: &[u8; 32], offset: usize, layer: usize, part: usize, out: &mut [u8]) {
    let mut state = u64::from_le_bytes(seed[..8].try_into().unwrap()) ^ ((offset * 131 + layer * 7 + part) as u64);
    for chunk in out.chunks_mut(8) {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
}

impl Rig {
    /// Writes the KV of `tokens[from..]` (whole pages) into `slots`, as a prefill would.
    fn fill(&self, tokens: &[u32], from: usize, slots: &[DeviceSlot]) {
        self.visit(tokens, from, slots, |bytes, expected| bytes.copy_from_slice(expected));
    }

    /// Checks the KV of `tokens[..slots.len()]` in `slots`.
    fn verify(&self, tokens: &[u32], slots: &[DeviceSlot]) {
        self.visit(tokens, 0, slots, |bytes, expected| assert_eq!(bytes, expected, "device bytes differ"));
    }

    fn visit(&self, tokens: &[u32], from: usize, slots: &[DeviceSlot], mut each: impl FnMut(&mut [u8], &[u8])) {
        let keys = page_keys(&tokens[..from + slots.len()], PAGE, None, PartialPage::Reject).unwrap();
        let map = self.tree.controller().engine().device_map();
        let item = geometry().item_bytes();
        let mut expected = vec![0u8; item];
        self.tree.controller().engine().with_device(|bytes| {
            for (index, &slot) in slots.iter().enumerate() {
                let position = from + index;
                for layer in 0..LAYERS {
                    for &part in geometry().parts() {
                        derived(keys[position / PAGE].as_bytes(), position % PAGE, layer, part.index(), &mut expected);
                        let at = map.item_offset(slot as usize, layer, part);
                        each(&mut bytes[at..at + item], &expected);
                    }
                }
            }
        });
    }

    /// A request: match, prefetch what storage has beyond the match (when there is storage), load back, prefill the
    /// rest, insert, release. Returns (device hit, host hit) tokens.
    fn request(&mut self, tokens: &[u32]) -> Option<(usize, usize)> {
        let matched = self.tree.match_prefix(tokens);
        if self.tree.controller().has_storage() && matched.last_host_node == matched.last_node {
            let after = matched.device_slots.len() + matched.host_hit_length;
            let id = format!("request-{}", self.requests);
            self.requests += 1;
            if let Ok(PrefetchStart::Started(_)) =
                self.tree.prefetch_from_storage(&id, matched.last_host_node, &tokens[after..])
            {
                let deadline = Instant::now() + Duration::from_secs(10);
                while self.tree.check_prefetch_progress(&id) == PrefetchCheck::Waiting {
                    self.tick();
                    assert!(Instant::now() < deadline, "prefetch never finished");
                }
            }
        }
        let matched = self.tree.match_prefix(tokens);
        let mut slots = matched.device_slots.clone();
        let loaded = self.tree.load_back(matched.last_node, &mut self.device).unwrap();
        let host_hit = loaded.len();
        // as the scheduler does: lock the deepest resident node of what the request uses
        let locked = if loaded.is_empty() { matched.last_device_node } else { matched.last_node };
        self.tree.inc_lock_ref(locked).unwrap();
        if !loaded.is_empty() {
            let consumer = self.tree.start_loading().unwrap();
            self.tree.layers().set_consumer(consumer);
            for layer in 0..LAYERS {
                self.tree.layers().wait_until(layer).unwrap();
            }
            slots.extend(&loaded);
        }
        self.verify(tokens, &slots);
        let cached = slots.len();
        let new_pages = (tokens.len() - cached) / PAGE;
        let fresh = match self.device.alloc_pages(new_pages) {
            Some(fresh) => fresh,
            None => {
                self.tree.evict(new_pages * PAGE, &mut self.device).unwrap();
                match self.device.alloc_pages(new_pages) {
                    Some(fresh) => fresh,
                    None => {
                        self.tree.dec_lock_ref(locked).unwrap();
                        return None;
                    }
                }
            }
        };
        self.fill(tokens, cached, &fresh);
        slots.extend(&fresh);
        self.tree.insert(tokens, &slots, &mut self.device).unwrap();
        self.tree.dec_lock_ref(locked).unwrap();
        Some((matched.device_slots.len(), host_hit))
    }

    fn tick(&mut self) -> hicache_core::tree::TickSummary {
        let summary = self.tree.tick(&mut SingleRank).unwrap();
        self.tree.check_invariants().unwrap();
        summary
    }
}

fn tokens(conversation: u32, len_pages: usize) -> Vec<u32> {
    (0..(len_pages * PAGE) as u32).map(|index| conversation * 10_000 + index).collect()
}

#[test]
fn matches_split_at_pages_and_share_prefixes() {
    let mut rig = rig(WritePolicy::WriteThrough, 32, 64, None);
    let a = tokens(1, 4);
    assert_eq!(rig.request(&a), Some((0, 0)));
    let mut b = a[..2 * PAGE].to_vec();
    b.extend(tokens(2, 3));
    assert_eq!(rig.request(&b), Some((2 * PAGE, 0)), "two shared pages, split off a's node");
    rig.tree.check_invariants().unwrap();
    // a partial page is not matched
    let mut c = a.clone();
    c.push(9);
    let matched = rig.tree.match_prefix(&c);
    assert_eq!(matched.device_slots.len(), 4 * PAGE);
    assert_eq!(rig.tree.node_count(), 1 + 3, "root, the shared pages, a's rest, b's rest");
}

#[test]
fn write_policies_back_up_when_they_say() {
    for (policy, writes_after) in [
        (WritePolicy::WriteThrough, [1, 0]),
        (WritePolicy::WriteThroughSelective, [0, 1]),
        (WritePolicy::WriteBack, [0, 0]),
    ] {
        let mut rig = rig(policy, 32, 64, None);
        let a = tokens(1, 3);
        for (round, expected) in writes_after.iter().enumerate() {
            rig.request(&a);
            let summary = rig.tick();
            assert_eq!(summary.writes_acked, *expected, "{policy}, round {round}");
        }
    }
}

#[test]
fn write_back_backs_up_at_eviction_and_reaches_storage() {
    // docs/sglang.md#fixed-3: SGLang's write_back never reaches storage
    let store = MemoryStore::new();
    let mut rig = rig(WritePolicy::WriteBack, 8, 16, Some(&store));
    let a = tokens(1, 3);
    rig.request(&a);
    assert_eq!(rig.tree.evict(3 * PAGE, &mut rig.device).unwrap(), 3 * PAGE);
    rig.tree.check_invariants().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.len() < 3 {
        rig.tick();
        assert!(Instant::now() < deadline, "the backup did not reach storage");
    }
    // and it comes back from the host
    assert_eq!(rig.request(&a), Some((0, 3 * PAGE)));
}

#[test]
fn write_back_eviction_without_host_room_drops_the_node_instead_of_crashing() {
    // docs/sglang.md#fixed-4: SGLang appends the node anyway and asserts `backuped` later
    let mut rig = rig(WritePolicy::WriteBack, 8, 9, None);
    let a = tokens(1, 4);
    rig.request(&a);
    // fill the host pool with a locked, backed-up node
    let b = tokens(2, 4);
    rig.request(&b);
    let matched = rig.tree.match_prefix(&b);
    rig.tree.inc_lock_ref(matched.last_node).unwrap();
    assert_eq!(rig.tree.evict(4 * PAGE, &mut rig.device).unwrap(), 4 * PAGE, "some node gave its pages up");
    rig.tree.check_invariants().unwrap();
}

#[test]
fn evicted_pages_load_back_byte_for_byte_and_host_eviction_forgets_them() {
    let mut rig = rig(WritePolicy::WriteThrough, 8, 16, None);
    let a = tokens(1, 4);
    rig.request(&a);
    rig.tick();
    assert_eq!(rig.tree.evict(8 * PAGE, &mut rig.device).unwrap(), 4 * PAGE);
    assert_eq!(rig.tree.device_tokens(), (0, 0));
    let matched = rig.tree.match_prefix(&a);
    assert_eq!((matched.device_slots.len(), matched.host_hit_length), (0, 4 * PAGE));
    assert_eq!(rig.request(&a), Some((0, 4 * PAGE)), "loaded back and verified");
    rig.tick();
    rig.tree.evict(8 * PAGE, &mut rig.device).unwrap();
    assert_eq!(rig.tree.evict_host(8 * PAGE).unwrap(), 4 * PAGE);
    assert_eq!(rig.tree.node_count(), 1);
    assert_eq!(rig.request(&a), Some((0, 0)), "gone from L1 and L2");
}

#[test]
fn idle_means_no_prefetch_pending_and_no_host_transfer_unacked() {
    let store = MemoryStore::new();
    let mut rig = rig(WritePolicy::WriteThrough, 8, 16, Some(&store));
    assert!(rig.tree.is_idle());
    rig.request(&tokens(1, 5));
    // the write's ack waits for a tick
    assert!(!rig.tree.is_idle());
    rig.tree.drain(&mut SingleRank, Instant::now() + Duration::from_secs(30), &mut |_| {}).unwrap();
    assert!(rig.tree.is_idle());
    // a prefetch pending keeps the tree busy until its result comes at a tick
    rig.tree.evict(8 * PAGE, &mut rig.device).unwrap();
    rig.tree.evict_host(8 * PAGE).unwrap();
    let prompt = tokens(1, 5);
    let matched = rig.tree.match_prefix(&prompt);
    let anchor = matched.last_host_node;
    let start = rig.tree.prefetch_from_storage("r", anchor, &prompt).unwrap();
    assert!(matches!(start, PrefetchStart::Started(_)), "{start:?}");
    assert!(!rig.tree.is_idle());
    rig.tree.check_prefetch_progress("r");
    let deadline = Instant::now() + Duration::from_secs(30);
    while rig.tree.prefetches_pending() > 0 {
        assert!(Instant::now() < deadline, "the prefetch never finished");
        rig.tick();
    }
    assert!(rig.tree.is_idle());
    rig.tree.check_invariants().unwrap();
}

#[test]
fn drain_waits_for_writes_and_backups_within_its_deadline() {
    let store = MemoryStore::new();
    let mut rig = rig(WritePolicy::WriteThrough, 8, 16, Some(&store));
    rig.request(&tokens(1, 5));
    // the host write happened (the CPU engine copies at once) but its ack, and so the backup, waits for a tick
    assert!(!rig.tree.is_drained());
    let error =
        rig.tree.drain(&mut SingleRank, Instant::now(), &mut |_| panic!("no tick past the deadline")).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::TimedOut, "{error}");
    assert!(error.to_string().contains("drain"), "{error}");
    let (mut ticks, mut backed_up) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    rig.tree
        .drain(&mut SingleRank, deadline, &mut |summary| {
            ticks += 1;
            backed_up += summary.pages_backed_up;
        })
        .unwrap();
    assert!(rig.tree.is_drained());
    assert!(ticks >= 1);
    assert_eq!((store.len(), backed_up), (5, 5), "every page stored, each counted once");
    rig.tree.check_invariants().unwrap();
}

#[test]
fn pages_evicted_from_the_host_come_back_from_storage() {
    let store = MemoryStore::new();
    let mut rig = rig(WritePolicy::WriteThrough, 8, 16, Some(&store));
    let a = tokens(1, 5);
    rig.request(&a);
    let deadline = Instant::now() + Duration::from_secs(10);
    // stored, and the backup taken at a tick (until then its host pages are pinned and cannot be evicted)
    rig.tree.drain(&mut SingleRank, deadline, &mut |_| {}).unwrap();
    assert_eq!(store.len(), 5);
    rig.tree.evict(10 * PAGE, &mut rig.device).unwrap();
    assert_eq!(rig.tree.evict_host(10 * PAGE).unwrap(), 5 * PAGE);
    let mut b = a.clone();
    b.extend(tokens(2, 1));
    let matched = rig.tree.match_prefix(&b);
    assert_eq!(matched.last_host_node, rig.tree.root());
    let start = rig.tree.prefetch_from_storage("b", matched.last_host_node, &b).unwrap();
    assert!(matches!(start, PrefetchStart::Started(_)), "{start:?}");
    assert_eq!(rig.tree.check_prefetch_progress("b"), PrefetchCheck::Waiting);
    let summary = loop {
        let summary = rig.tick();
        if !summary.prefetches.is_empty() {
            break summary;
        }
        assert!(Instant::now() < deadline);
    };
    let (explanation, new) = &summary.prefetches[0];
    assert_eq!(
        (explanation.stop.clone(), explanation.fetched_tokens, *new),
        (PrefetchStop::Complete, 5 * PAGE, 5 * PAGE)
    );
    assert_eq!(rig.tree.check_prefetch_progress("b"), PrefetchCheck::Ready);
    assert_eq!(rig.request(&b), Some((0, 5 * PAGE)), "the L3 pages loaded to the device, verified");
}

/// A rig whose cost plan splits a hit: a page (64 bytes) reads in 2 ms, as long as its compute (2 tokens at 1000
/// tokens per second).
fn splitting_rig(store: &Arc<MemoryStore>) -> Rig {
    rig_with(WritePolicy::WriteThrough, 16, 32, Some(store), splitting_rig_settings)
}

fn splitting_rig_settings(settings: StorageSettings) -> StorageSettings {
    StorageSettings {
        by_cost: true,
        split: true,
        priors: hicache_core::cost::Priors {
            storage_read_bytes_per_s: Some(64.0 / 2e-3),
            storage_call_s: 0.0,
            load_bytes_per_s: 1e10,
            prefill_tokens_per_s: Some(1000.0),
        },
        ..settings
    }
}

/// Stores a conversation of `pages` pages and forgets it on the device and the host; returns its tokens.
fn stored_only(rig: &mut Rig, pages: usize) -> Vec<u32> {
    let a = tokens(1, pages);
    rig.request(&a);
    rig.tree.drain(&mut SingleRank, Instant::now() + Duration::from_secs(10), &mut |_| {}).unwrap();
    rig.tree.evict(64 * PAGE, &mut rig.device).unwrap();
    assert_eq!(rig.tree.evict_host(64 * PAGE).unwrap(), pages * PAGE);
    a
}

/// Ticks until the split plan of `request` is known; returns its head's tokens.
fn planned_head(rig: &mut Rig, request: &str) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match rig.tree.prefetch_head(request) {
            PrefetchHead::Compute(head) => return head,
            PrefetchHead::NotPlanned => {}
            PrefetchHead::Nothing => panic!("the prefetch was not split"),
        }
        assert!(rig.tick().prefetches.is_empty(), "the prefetch ended without a split");
        assert!(Instant::now() < deadline, "no plan");
    }
}

/// Waits until the fetch thread has read `tokens` of `request`'s prefetch (the head's compute took as long as the
/// tail's read, as planned: the scheduler then has no reason to stop waiting), then ticks until the result comes.
fn prefetch_result(
    rig: &mut Rig,
    request: &str,
    tokens: usize,
) -> (hicache_core::controller::PrefetchExplanation, usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while rig.tree.controller().prefetch_progress(request) != Some(tokens) {
        assert!(Instant::now() < deadline, "the tail was not read");
        std::thread::yield_now();
    }
    assert_eq!(rig.tree.check_prefetch_progress(request), PrefetchCheck::Waiting);
    loop {
        if let Some(done) = rig.tick().prefetches.pop() {
            return done;
        }
        assert!(Instant::now() < deadline, "no result");
    }
}

#[test]
fn a_split_hit_has_its_head_computed_and_its_fetched_tail_hung_below_it() {
    let store = MemoryStore::new();
    let mut rig = splitting_rig(&store);
    let a = stored_only(&mut rig, 10);
    let mut b = a.clone();
    b.extend(tokens(2, 1));
    let matched = rig.tree.match_prefix(&b);
    assert!(matches!(rig.tree.prefetch_from_storage("b", matched.last_host_node, &b), Ok(PrefetchStart::Started(_))));
    let head = planned_head(&mut rig, "b");
    assert!((4 * PAGE..=6 * PAGE).contains(&head), "about half the hit is computed: {head}");
    // the engine computes the head (its KV from the tokens, as a prefill) and inserts it while the tail is read
    let slots = rig.device.alloc_pages(head / PAGE).unwrap();
    rig.fill(&b, 0, &slots);
    rig.tree.insert(&b[..head], &slots, &mut rig.device).unwrap();
    let (explanation, new) = prefetch_result(&mut rig, "b", 10 * PAGE - head);
    let plan = explanation.plan.expect("planned by cost");
    assert_eq!(plan.reason, hicache_core::cost::PlanReason::Split);
    assert_eq!((plan.compute_head_pages * PAGE, plan.fetch_pages * PAGE), (head, 10 * PAGE - head));
    assert_eq!(
        (explanation.stop, explanation.fetched_tokens, new),
        (PrefetchStop::Complete, 10 * PAGE - head, 10 * PAGE - head)
    );
    rig.tree.check_invariants().unwrap();
    // the request finds the head on the device and the tail on the host: every byte as computed
    assert_eq!(rig.request(&b), Some((head, 10 * PAGE - head)));
}

#[test]
fn a_split_tail_whose_head_never_came_is_given_back() {
    let store = MemoryStore::new();
    let mut rig = splitting_rig(&store);
    let a = stored_only(&mut rig, 10);
    let matched = rig.tree.match_prefix(&a);
    assert!(matches!(rig.tree.prefetch_from_storage("a", matched.last_host_node, &a), Ok(PrefetchStart::Started(_))));
    let head = planned_head(&mut rig, "a");
    assert!(head > 0);
    let free_before = rig.tree.controller().host().available();
    let (explanation, new) = prefetch_result(&mut rig, "a", 10 * PAGE - head);
    assert_eq!((explanation.fetched_tokens, new), (10 * PAGE - head, 0), "nothing to hang the tail from");
    assert!(rig.tree.controller().host().available() > free_before, "the tail's pages are free again");
    rig.tree.check_invariants().unwrap();
    // a request the scheduler wants at once (before its plan) is never split: its hit comes whole
    assert_eq!(rig.request(&a), Some((0, 10 * PAGE)));
}

/// Storage whose reads pass only as far as the test lets them: `open` reads may start, then each waits until the
/// test opens another (hit queries and writes pass).
struct Gated {
    inner: MemoryStorage,
    open: std::sync::Mutex<usize>,
    opened: std::sync::Condvar,
}

impl Gated {
    fn new(store: &Arc<MemoryStore>, open: usize) -> Arc<Self> {
        let namespace = StorageNamespace::single_rank("tree-test", geometry(), HostLayout::LayerFirst, PAGE);
        let inner = MemoryStorage::shared(store.clone(), &namespace);
        Arc::new(Self { inner, open: std::sync::Mutex::new(open), opened: std::sync::Condvar::new() })
    }

    /// Lets every read through from now on.
    fn open_all(&self) {
        *self.open.lock().unwrap() = usize::MAX;
        self.opened.notify_all();
    }
}

impl StorageBackend for Gated {
    fn name(&self) -> &str {
        "gated"
    }

    fn batch_exists(&self, keys: &[hicache_core::hash::PageKey]) -> Result<usize, hicache_core::Error> {
        self.inner.batch_exists(keys)
    }

    fn batch_get(
        &self,
        keys: &[hicache_core::hash::PageKey],
        pages: &mut [hicache_core::storage::PageSegmentsMut<'_>],
    ) -> Result<Vec<GetOutcome>, hicache_core::Error> {
        let mut open = self.open.lock().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while *open == 0 {
            let wait = deadline.checked_duration_since(Instant::now()).expect("the test never opened the gate");
            open = self.opened.wait_timeout(open, wait).unwrap().0;
        }
        *open = open.saturating_sub(1);
        drop(open);
        self.inner.batch_get(keys, pages)
    }

    fn batch_set(
        &self,
        keys: &[hicache_core::hash::PageKey],
        pages: &[hicache_core::storage::PageSegments<'_>],
    ) -> Result<Vec<hicache_core::storage::SetOutcome>, hicache_core::Error> {
        self.inner.batch_set(keys, pages)
    }

    fn remove(&self, keys: &[hicache_core::hash::PageKey]) -> Result<usize, hicache_core::Error> {
        self.inner.remove(keys)
    }

    fn clear(&self) -> Result<u64, hicache_core::Error> {
        self.inner.clear()
    }

    fn stats(&self) -> StorageStats {
        self.inner.stats()
    }
}

/// [`splitting_rig`] for an engine that meets the reads, on `gated` storage: reads of 2 pages, from the end.
fn meeting_rig(gated: &Arc<Gated>) -> Rig {
    let backend = gated.clone() as Arc<dyn StorageBackend>;
    rig_on(WritePolicy::WriteThrough, 16, 32, Some(backend), |settings| {
        let split = splitting_rig_settings(settings);
        StorageSettings { meet: true, batch_pages: 2, ..split }
    })
}

/// Ticks until `request`'s reads run from the end (its plan is known and its pages reserved).
fn meeting(rig: &mut Rig, request: &str) -> Meeting {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(meeting) = rig.tree.prefetch_meeting(request) {
            return meeting;
        }
        assert!(rig.tick().prefetches.is_empty(), "the prefetch ended before its reads");
        assert!(Instant::now() < deadline, "no reads");
    }
}

/// Waits until `request`'s reads have brought `tokens` from the end.
fn arrived(rig: &Rig, request: &str, tokens: usize) -> Meeting {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let meeting = rig.tree.prefetch_meeting(request).expect("still read");
        if meeting.arrived_tokens >= tokens {
            assert_eq!(meeting.arrived_tokens, tokens, "read past the gate");
            assert_eq!(meeting.arrived_after > Duration::ZERO, tokens > 0, "the reads' time up to the last");
            assert!(tokens == 0 || meeting.reads_started.is_some(), "reads arrived before they started");
            return meeting;
        }
        assert!(Instant::now() < deadline, "the reads did not arrive");
        std::thread::yield_now();
    }
}

/// The engine has computed `b`'s first `computed` tokens (their KV, inserted) and met the reads: ticks until the
/// result comes, and returns its explanation and the tokens it added to the tree.
fn meet(rig: &mut Rig, b: &[u32], computed: usize) -> (hicache_core::controller::PrefetchExplanation, usize) {
    if computed > 0 {
        let slots = rig.device.alloc_pages(computed / PAGE).unwrap();
        rig.fill(b, 0, &slots);
        rig.tree.insert(&b[..computed], &slots, &mut rig.device).unwrap();
    }
    assert!(rig.tree.meet_prefetch("b"));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(done) = rig.tick().prefetches.pop() {
            return done;
        }
        assert!(Instant::now() < deadline, "no result");
    }
}

/// A conversation of 10 stored pages and one new one, asked for as `b`; its meeting once its reads run: the whole
/// hit is read from the end, the split's head too (the engine computes it anyway, and reads that come sooner than
/// planned meet it earlier).
fn returning(rig: &mut Rig) -> (Vec<u32>, Meeting) {
    let a = stored_only(rig, 10);
    let mut b = a.clone();
    b.extend(tokens(2, 1));
    let matched = rig.tree.match_prefix(&b);
    assert!(matches!(rig.tree.prefetch_from_storage("b", matched.last_host_node, &b), Ok(PrefetchStart::Started(_))));
    let meeting = meeting(rig, "b");
    assert_eq!((meeting.head_tokens, meeting.read_tokens), (0, 10 * PAGE), "{meeting:?}");
    assert!((4 * PAGE..=6 * PAGE).contains(&meeting.planned_head_tokens), "about half the hit: {meeting:?}");
    (b, meeting)
}

/// The plan split the hit (about half of it a head to compute), and yet every page of it was reserved to be read.
fn planned_a_split_and_read_it_all(explanation: &hicache_core::controller::PrefetchExplanation) {
    let plan = explanation.plan.expect("by cost");
    assert!((4..=6).contains(&plan.compute_head_pages), "about half the hit is computed: {plan:?}");
    assert_eq!(explanation.reserved_tokens, 10 * PAGE);
}

#[test]
fn an_engine_that_meets_the_reads_computes_on_past_the_head_and_takes_the_pages_read_from_the_end() {
    let store = MemoryStore::new();
    // one read (a batch of 2 pages) passes, the next waits
    let gated = Gated::new(&store, 1);
    let mut rig = meeting_rig(&gated);
    let (b, _) = returning(&mut rig);
    // the first batch read is the hit's last two pages; the engine computes up to them, past the planned head
    let meeting = arrived(&rig, "b", 2 * PAGE);
    let computed = 8 * PAGE;
    assert!(!meeting.met(computed - PAGE, 2 * PAGE) && meeting.met(computed, 2 * PAGE), "{meeting:?}");
    let (explanation, new) = meet(&mut rig, &b, computed);
    gated.open_all();
    planned_a_split_and_read_it_all(&explanation);
    assert_eq!((explanation.stop, explanation.fetched_tokens, new), (PrefetchStop::Met, 2 * PAGE, 2 * PAGE));
    // the blocked read's pages go back once it returns
    rig.tree.drain(&mut SingleRank, Instant::now() + Duration::from_secs(10), &mut |_| {}).unwrap();
    rig.tree.check_invariants().unwrap();
    // the computed head on the device, the last two pages from storage: every byte where it belongs
    assert_eq!(rig.request(&b), Some((computed, 2 * PAGE)));
}

#[test]
fn reads_faster_than_planned_bring_the_whole_hit_the_split_head_too() {
    let store = MemoryStore::new();
    let gated = Gated::new(&store, usize::MAX);
    let mut rig = meeting_rig(&gated);
    let (b, _) = returning(&mut rig);
    // every page arrived before the engine computed any: it meets them at the hit's first token
    let meeting = arrived(&rig, "b", 10 * PAGE);
    assert!(meeting.met(0, 10 * PAGE));
    let (explanation, new) = meet(&mut rig, &b, 0);
    planned_a_split_and_read_it_all(&explanation);
    assert_eq!((explanation.stop, explanation.fetched_tokens, new), (PrefetchStop::Complete, 10 * PAGE, 10 * PAGE));
    assert_eq!(rig.request(&b), Some((0, 10 * PAGE)));
}

#[test]
fn an_engine_whose_reads_never_came_computes_everything_and_keeps_none() {
    let store = MemoryStore::new();
    let gated = Gated::new(&store, 0);
    let mut rig = meeting_rig(&gated);
    let (b, meeting) = returning(&mut rig);
    assert_eq!(meeting.arrived_tokens, 0);
    assert!(meeting.met(10 * PAGE, 0) && !meeting.met(10 * PAGE - 1, 0));
    // the first read holds its pages in the gate
    let deadline = Instant::now() + Duration::from_secs(10);
    while rig.tree.prefetch_meeting("b").expect("still read").reads_started.is_none() {
        assert!(Instant::now() < deadline, "the reads did not start");
        std::thread::yield_now();
    }
    let (explanation, new) = meet(&mut rig, &b, 10 * PAGE);
    planned_a_split_and_read_it_all(&explanation);
    assert_eq!((explanation.stop, explanation.fetched_tokens, new), (PrefetchStop::Met, 0, 0));
    gated.open_all();
    let deadline = Instant::now() + Duration::from_secs(10);
    rig.tree.drain(&mut SingleRank, deadline, &mut |_| {}).unwrap();
    rig.tree.check_invariants().unwrap();
    assert_eq!(rig.request(&b), Some((10 * PAGE, 0)));
    // the read let out of the gate returns, and its prefetch gives its reserved pages back (a drain waits for
    // writes and backups, not for reads no one waits for)
    while rig.tree.controller().prefetches_in_flight() > 0 {
        assert!(Instant::now() < deadline, "the read let out of the gate never returned");
        rig.tick();
        std::thread::yield_now();
    }
    // every page reserved for the reads came back: with the tree emptied, the whole host pool is free
    rig.tree.drain(&mut SingleRank, deadline, &mut |_| {}).unwrap();
    rig.tree.evict(64 * PAGE, &mut rig.device).unwrap();
    rig.tree.evict_host(64 * PAGE).unwrap();
    assert_eq!(rig.tree.controller().host().available(), 32, "the reserved pages are free again");
}

#[test]
fn an_aborted_request_gives_its_prefetch_back_and_reset_empties_everything() {
    let store = MemoryStore::new();
    let mut rig = rig(WritePolicy::WriteThrough, 8, 16, Some(&store));
    let a = tokens(1, 5);
    rig.request(&a);
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.len() < 5 || rig.tree.controller().backups_in_flight() > 0 {
        rig.tick();
        assert!(Instant::now() < deadline);
    }
    rig.tree.evict(10 * PAGE, &mut rig.device).unwrap();
    rig.tree.evict_host(10 * PAGE).unwrap();
    let root = rig.tree.root();
    assert!(matches!(rig.tree.prefetch_from_storage("gone", root, &a).unwrap(), PrefetchStart::Started(_)));
    rig.tree.release_aborted_request("gone");
    let summary = loop {
        let summary = rig.tick();
        if !summary.prefetches.is_empty() {
            break summary;
        }
        assert!(Instant::now() < deadline);
    };
    assert_eq!(summary.prefetches[0].0.stop, PrefetchStop::Aborted);
    assert_eq!(summary.prefetches[0].1, 0, "nothing inserted");
    assert_eq!(rig.tree.node_count(), 1);
    while rig.tree.controller().prefetches_in_flight() > 0 {
        rig.tick();
        assert!(Instant::now() < deadline);
    }
    assert_eq!(rig.tree.controller().host().available(), 16, "every reserved page came back");
    // reset: a tree with resident, host-only and locked nodes becomes empty, and works as new
    rig.request(&a);
    let b = tokens(2, 3);
    rig.request(&b);
    let matched = rig.tree.match_prefix(&b);
    rig.tree.inc_lock_ref(matched.last_node).unwrap();
    rig.tree.reset();
    // the engine empties its device allocator with the flush (the nodes' slots are not given back one by one)
    rig.device.clear();
    rig.tree.check_invariants().unwrap();
    assert_eq!((rig.tree.node_count(), rig.tree.device_tokens()), (1, (0, 0)));
    assert_eq!(rig.tree.controller().host().available(), 16);
    // nothing on the device any more (storage may still serve b, if its backup finished before the reset)
    assert_eq!(rig.request(&b).map(|(device, _)| device), Some(0));
    // a node id from before the reset names no node after it, though the tree has nodes again: an error, not a
    // panic, and never another node
    let stale = matched.last_node;
    let now = rig.tree.match_prefix(&b).last_node;
    assert_ne!(stale, now, "ids are not reused after a reset");
    let unknown = format!("node {} is not in the tree (removed, or from before a reset)", stale.0);
    let protected = rig.tree.device_tokens().1;
    assert_eq!(rig.tree.inc_lock_ref(stale).unwrap_err().to_string(), unknown);
    assert_eq!(rig.tree.dec_lock_ref(stale).unwrap_err().to_string(), unknown);
    assert_eq!(rig.tree.load_back(stale, &mut rig.device).unwrap_err().to_string(), unknown);
    assert!(rig.tree.prefetch_from_storage("late", stale, &b).is_err());
    assert_eq!(rig.tree.last_key(stale), None);
    assert_eq!(rig.tree.device_tokens().1, protected, "nothing was locked or released by the stale ids");
    // more releases than locks: refused before anything changes (once b's write to the host is acked, nothing
    // holds its nodes)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while rig.tree.device_tokens().1 > 0 {
        assert!(std::time::Instant::now() < deadline, "b's write was never acked");
        rig.tick();
    }
    assert_eq!(rig.tree.inc_lock_ref(now).unwrap(), b.len());
    assert_eq!(rig.tree.dec_lock_ref(now).unwrap(), b.len());
    let error = rig.tree.dec_lock_ref(now).unwrap_err().to_string();
    assert!(error.starts_with("node: node ") && error.contains("more releases than locks"), "{error}");
    assert_eq!(rig.tree.device_tokens(), (b.len(), 0), "the refused release changed nothing");
    rig.tree.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Request { conversation: u32, pages: usize },
    Evict(usize),
    EvictHost(usize),
    Tick,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..4, 1usize..8).prop_map(|(conversation, pages)| Op::Request { conversation, pages }),
        1 => (1usize..12).prop_map(|pages| Op::Evict(pages * PAGE)),
        1 => (1usize..12).prop_map(|pages| Op::EvictHost(pages * PAGE)),
        2 => Just(Op::Tick),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random requests over a few conversations (shared prefixes of several lengths), evictions and ticks, under
    /// every write policy: every invariant holds after every step, and every byte a request gets back is right.
    #[test]
    fn invariants_hold_under_random_operations(
        ops in prop::collection::vec(op(), 1..80),
        policy in 0usize..3,
        storage in any::<bool>(),
    ) {
        let policy = [WritePolicy::WriteThrough, WritePolicy::WriteThroughSelective, WritePolicy::WriteBack][policy];
        let store = MemoryStore::new();
        let mut rig = rig(policy, 12, 20, storage.then_some(&store));
        for op in ops {
            match op {
                Op::Request { conversation, pages } => {
                    rig.request(&tokens(conversation, pages));
                }
                Op::Evict(tokens) => {
                    rig.tree.evict(tokens, &mut rig.device).unwrap();
                }
                Op::EvictHost(tokens) => {
                    rig.tree.evict_host(tokens).unwrap();
                }
                Op::Tick => {
                    rig.tick();
                }
            }
            rig.tree.check_invariants().unwrap();
            rig.tree.controller().host().check_invariants().unwrap();
        }
    }
}

/// A write-through write whose transfer fails leaves its node on the device without a host copy: the tick says so,
/// the host pages go back, and evicting the node drops it (its KV would be recomputed) instead of keeping a host copy.
#[test]
fn a_failed_write_leaves_the_node_on_the_device_without_a_host_copy() {
    let mut rig = rig(WritePolicy::WriteThrough, 8, 16, None);
    rig.tree.controller().engine().fail_next(hicache_core::transfer::Stream::Write);
    let a = tokens(1, 2);
    rig.request(&a).expect("room for the request");
    let summary = rig.tick();
    assert_eq!((summary.writes_acked, summary.writes_failed), (1, 1));
    assert_eq!(rig.tree.controller().host().available(), 16, "the failed write's host pages went back");
    rig.tree.check_invariants().unwrap();
    let dropped = rig.tree.stats().dropped_tokens;
    rig.tree.evict(8 * PAGE, &mut rig.device).unwrap();
    assert_eq!(rig.tree.stats().dropped_tokens - dropped, a.len(), "no host copy: the node is dropped");
    let matched = rig.tree.match_prefix(&a);
    assert_eq!(matched.device_slots.len() + matched.host_hit_length, 0);
}

// Trailing windows: the trailing pool's entry of a page is modelled by one item of the page (its last token's V in
// the last layer), which holds its derived bytes where the engine holds the entry and zeros where it does not. The
// item travels with the page through every copy, so a match is checked against the bytes themselves.

/// Whether the item at `position`, `layer`, `part` is a page's trailing entry.
fn trailing_item(position: usize, layer: usize, part: usize) -> bool {
    position % PAGE == PAGE - 1 && layer == LAYERS - 1 && part == geometry().parts().last().unwrap().index()
}

fn trailing_rig(device_pages: usize, host_pages: usize, window: usize) -> Rig {
    let device = DeviceLayoutMap::new(geometry(), device_pages * PAGE).unwrap();
    let host = HostLayoutMap::new(geometry(), HostLayout::LayerFirst, PAGE, host_pages).unwrap();
    let engine = CpuEngine::new(device, host, Completion::Immediate).unwrap();
    let config = HiCacheConfig {
        page_size: PAGE,
        mem_layout: HostLayout::LayerFirst,
        write_policy: WritePolicy::WriteThrough,
        load_back_threshold: 1,
        ..HiCacheConfig::default()
    };
    let tree = HiCacheBuilder::new(config, engine)
        .with_trailing(hicache_core::controller::Trailing {
            window: std::num::NonZeroUsize::new(window).unwrap(),
            pool: false,
        })
        .build()
        .unwrap();
    Rig { tree, device: PagedSlots::new(device_pages, PAGE).unwrap(), requests: 0 }
}

impl Rig {
    /// Writes the KV of `tokens[from..]` into `slots` as [`fill`](Self::fill), with the trailing entries of the pages
    /// `held` does not name zeroed (`held`: one per page of `tokens`).
    fn fill_trailing(&self, tokens: &[u32], from: usize, slots: &[DeviceSlot], held: &[bool]) {
        self.fill(tokens, from, slots);
        let map = self.tree.controller().engine().device_map();
        let part = *geometry().parts().last().unwrap();
        self.tree.controller().engine().with_device(|bytes| {
            for (index, &slot) in slots.iter().enumerate() {
                let position = from + index;
                if trailing_item(position, LAYERS - 1, part.index()) && !held[position / PAGE] {
                    let at = map.item_offset(slot as usize, LAYERS - 1, part);
                    bytes[at..at + geometry().item_bytes()].fill(0);
                }
            }
        });
    }

    /// Checks the KV of `tokens[..slots.len()]` in `slots`: every item but the trailing entries, and the trailing
    /// entries of the last `window` pages.
    fn verify_trailing(&self, tokens: &[u32], slots: &[DeviceSlot], window: usize) {
        let pages = slots.len() / PAGE;
        let keys = page_keys(&tokens[..slots.len()], PAGE, None, PartialPage::Reject).unwrap();
        let map = self.tree.controller().engine().device_map();
        let item = geometry().item_bytes();
        let mut expected = vec![0u8; item];
        self.tree.controller().engine().with_device(|bytes| {
            for (position, &slot) in slots.iter().enumerate() {
                for layer in 0..LAYERS {
                    for &part in geometry().parts() {
                        if trailing_item(position, layer, part.index())
                            && position / PAGE < pages.saturating_sub(window)
                        {
                            continue;
                        }
                        derived(keys[position / PAGE].as_bytes(), position % PAGE, layer, part.index(), &mut expected);
                        let at = map.item_offset(slot as usize, layer, part);
                        assert_eq!(
                            &bytes[at..at + item],
                            &expected[..],
                            "page {} of {pages}, layer {layer}, part {}: bytes differ",
                            position / PAGE,
                            part.index()
                        );
                    }
                }
            }
        });
    }

    /// A request of a model with a trailing window: match, load back, check, compute the rest with the entries of
    /// `held` (one per page of `tokens`) held, insert. Returns the pages the request got from the cache, `None`
    /// when the device had no room.
    fn request_trailing(&mut self, tokens: &[u32], held: &[bool], window: usize) -> Option<usize> {
        let matched = self.tree.match_prefix(tokens);
        let mut slots = matched.device_slots.clone();
        let loaded = self.tree.load_back(matched.last_node, &mut self.device).unwrap();
        let locked = if loaded.is_empty() { matched.last_device_node } else { matched.last_node };
        self.tree.inc_lock_ref(locked).unwrap();
        if loaded.is_empty() {
            slots.truncate(matched.device_usable);
        } else {
            let consumer = self.tree.start_loading().unwrap();
            self.tree.layers().set_consumer(consumer);
            for layer in 0..LAYERS {
                self.tree.layers().wait_until(layer).unwrap();
            }
            slots.extend(&loaded);
        }
        self.verify_trailing(tokens, &slots, window);
        let cached = slots.len();
        let new_pages = (tokens.len() - cached) / PAGE;
        let fresh = match self.device.alloc_pages(new_pages) {
            Some(fresh) => fresh,
            None => {
                self.tree.evict(new_pages * PAGE, &mut self.device).unwrap();
                let Some(fresh) = self.device.alloc_pages(new_pages) else {
                    self.tree.dec_lock_ref(locked).unwrap();
                    return None;
                };
                fresh
            }
        };
        self.fill_trailing(tokens, cached, &fresh, held);
        slots.extend(&fresh);
        self.tree.insert_with_trailing(tokens, &slots, &mut self.device, held).unwrap();
        self.tree.dec_lock_ref(locked).unwrap();
        Some(cached / PAGE)
    }
}

/// Where a request's state is held only at some pages (a Mamba state where requests ended), a match ends at the
/// deepest page whose state is held; with a sliding window of two pages, where the two pages before it hold theirs.
#[test]
fn a_match_ends_where_the_trailing_window_is_held() {
    let held = [false, false, true, false, false, true];
    let a = tokens(1, 6);
    let mut rig = trailing_rig(16, 32, 1);
    assert_eq!(rig.request_trailing(&a, &held, 1), Some(0));
    assert_eq!(rig.tree.trailing_held(), (2, 2), "two states on the device, written through to the host at once");
    let pages = |rig: &mut Rig, tokens: &[u32]| {
        let matched = rig.tree.match_prefix(tokens);
        (matched.device_slots.len() + matched.host_hit_length) / PAGE
    };
    assert_eq!(pages(&mut rig, &a), 6);
    assert_eq!(pages(&mut rig, &a[..5 * PAGE]), 3, "pages 4 and 5 hold no state: the match ends after page 3");
    assert_eq!(pages(&mut rig, &a[..2 * PAGE]), 0, "no state before page 3");
    // a second request shares the first four pages: the match gives it three, it computes the rest
    let mut b = a[..4 * PAGE].to_vec();
    b.extend(tokens(2, 2));
    assert_eq!(rig.request_trailing(&b, &[true; 6], 1), Some(3));
    assert_eq!(pages(&mut rig, &b), 6);
    assert_eq!(pages(&mut rig, &b[..4 * PAGE]), 3, "a page already in the tree keeps lacking its state");
    assert_eq!(rig.tree.trailing_held(), (4, 4), "a's at pages 3 and 6, and b's new pages 5 and 6");
    rig.tick();
    rig.tree.evict(2 * PAGE, &mut rig.device).unwrap();
    assert_eq!(rig.tree.trailing_held(), (3, 4), "a's leaf left the device with its state and kept it on the host");
    rig.tree.check_invariants().unwrap();

    let held = [false, true, true, false, true, true];
    let mut rig = trailing_rig(16, 32, 2);
    rig.request_trailing(&a, &held, 2).unwrap();
    assert_eq!(pages(&mut rig, &a), 6);
    assert_eq!(pages(&mut rig, &a[..5 * PAGE]), 3, "the window of pages 2 and 3 is held, that of 4 and 5 is not");
    assert_eq!(pages(&mut rig, &a[..2 * PAGE]), 0, "page 1 alone is held: the window before page 2 is not whole");
    // evicted to the host and loaded back, the pages keep their entries (checked byte for byte by the request)
    rig.tick();
    rig.tree.evict(6 * PAGE, &mut rig.device).unwrap();
    assert_eq!(rig.request_trailing(&a, &held, 2), Some(6));
    rig.tree.check_invariants().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random requests holding their trailing entries at random pages, evictions and ticks, with windows of 1 to 3
    /// pages: every invariant holds, and every prefix a request gets has every byte right, the entries of its
    /// trailing window included (a match that ended where they are missing would fail the check).
    #[test]
    fn every_matched_prefix_holds_its_trailing_window(
        ops in prop::collection::vec((op(), prop::collection::vec(any::<bool>(), 8)), 1..80),
        window in 1usize..4,
    ) {
        let mut rig = trailing_rig(12, 20, window);
        for (op, held) in ops {
            match op {
                Op::Request { conversation, pages } => {
                    rig.request_trailing(&tokens(conversation, pages), &held[..pages], window);
                }
                Op::Evict(tokens) => {
                    rig.tree.evict(tokens, &mut rig.device).unwrap();
                }
                Op::EvictHost(tokens) => {
                    rig.tree.evict_host(tokens).unwrap();
                }
                Op::Tick => {
                    rig.tick();
                }
            }
            rig.tree.check_invariants().unwrap();
        }
    }
}
