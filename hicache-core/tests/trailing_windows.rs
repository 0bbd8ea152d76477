//! A hybrid model with a trailing window (a sliding window's KV) through the whole stack: the KV's rank and the
//! window pool's TP ranks run the same script in lockstep over one collective, each with its own storage namespace.
//! The pool's ranks store only the window at each node's end, read only the window at a hit's end, and every rank
//! agrees on one length that every rank's storage can restore, which the least of their longest ones is not.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hicache_core::collective::{Collective, InProcessGroup};
use hicache_core::config::{PrefetchPolicy, WritePolicy};
use hicache_core::controller::{PrefetchStart, Trailing};
use hicache_core::device_slots::{DeviceSlotAllocator as _, PagedSlots};
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PageKey, PartialPage, page_keys};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FaultPlan, FaultyStorage, MemoryStorage, MemoryStore, StorageBackend};
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap};
use hicache_core::tree::{HiRadixTree, PrefetchCheck};
use hicache_core::{DeviceSlot, HiCacheBuilder, HiCacheConfig};
use proptest::prelude::*;

const PAGE: usize = 2;
const LAYERS: usize = 2;
const WINDOW: usize = 2;

fn geometry() -> KvGeometry {
    KvGeometry::mha(LAYERS, 1, 4, KvDtype::Bf16).unwrap()
}

/// One rank: the KV's (`pool` false) or a TP rank of the window pool.
struct Rank {
    tree: HiRadixTree<CpuEngine>,
    device: PagedSlots,
    storage: Arc<dyn StorageBackend>,
    pool: bool,
}

/// The bytes of one item of a pool: a function of the pool, the token's page key, its place in the page, the layer
/// and the part, so an entry of the wrong pool or page fails the check.
fn derived(pool: bool, key: &PageKey, offset: usize, layer: usize, part: usize, out: &mut [u8]) {
    let seed = u64::from_le_bytes(key.as_bytes()[..8].try_into().unwrap()) ^ u64::from(pool) << 63;
    let mut state = seed ^ ((offset * 131 + layer * 7 + part) as u64);
    for chunk in out.chunks_mut(8) {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
}

impl Rank {
    fn new(rank: usize, store: &Arc<MemoryStore>, faults: FaultPlan) -> Self {
        let pool = rank > 0;
        let tp_rank = rank.saturating_sub(1);
        let mut namespace =
            StorageNamespace::single_rank(if pool { "swa" } else { "kv" }, geometry(), HostLayout::PageFirst, PAGE);
        namespace.tp_rank = tp_rank;
        namespace.tp_size = if pool { 2 } else { 1 };
        let storage: Arc<dyn StorageBackend> =
            Arc::new(FaultyStorage::new(MemoryStorage::shared(store.clone(), &namespace), faults));
        let device = DeviceLayoutMap::new(geometry(), 16 * PAGE).unwrap();
        let host = HostLayoutMap::new(geometry(), HostLayout::PageFirst, PAGE, 32).unwrap();
        let engine = CpuEngine::new(device, host, Completion::Immediate).unwrap();
        let config = HiCacheConfig {
            page_size: PAGE,
            mem_layout: HostLayout::PageFirst,
            write_policy: WritePolicy::WriteThrough,
            load_back_threshold: 1,
            prefetch_threshold: PAGE,
            prefetch_policy: PrefetchPolicy::WaitComplete,
            ..HiCacheConfig::default()
        };
        let tree = HiCacheBuilder::new(config, engine)
            .with_storage(storage.clone())
            .with_tp_rank(tp_rank)
            .with_trailing(Trailing { window: NonZeroUsize::new(WINDOW).unwrap(), pool })
            .build()
            .unwrap();
        Self { tree, device: PagedSlots::new(16, PAGE).unwrap(), storage, pool }
    }

    /// Visits the items of `tokens[from..from + slots.len()]` in `slots` with their expected bytes.
    fn visit(&self, tokens: &[u32], from: usize, slots: &[DeviceSlot], mut each: impl FnMut(usize, &mut [u8], &[u8])) {
        let keys = page_keys(&tokens[..from + slots.len()], PAGE, None, PartialPage::Reject).unwrap();
        let map = self.tree.controller().engine().device_map();
        let item = geometry().item_bytes();
        let mut expected = vec![0u8; item];
        self.tree.controller().engine().with_device(|bytes| {
            for (index, &slot) in slots.iter().enumerate() {
                let position = from + index;
                for layer in 0..LAYERS {
                    for &part in geometry().parts() {
                        let key = &keys[position / PAGE];
                        derived(self.pool, key, position % PAGE, layer, part.index(), &mut expected);
                        let at = map.item_offset(slot as usize, layer, part);
                        each(position / PAGE, &mut bytes[at..at + item], &expected);
                    }
                }
            }
        });
    }

    /// Checks what a request got: every page's KV on the KV's rank, the window before its end on a pool's.
    fn verify(&self, tokens: &[u32], slots: &[DeviceSlot]) {
        let pages = slots.len() / PAGE;
        let window = if self.pool { pages.saturating_sub(WINDOW) } else { 0 };
        self.visit(tokens, 0, slots, |page, bytes, expected| {
            if page >= window {
                assert_eq!(bytes, expected, "pool {}: page {page} of {pages} differs", self.pool);
            }
        });
    }

    /// A request: match, load back, check, compute the rest (every page's window entries held), insert. Returns
    /// the pages it got from the cache.
    fn request(&mut self, tokens: &[u32]) -> usize {
        self.request_holding(tokens, &vec![true; tokens.len() / PAGE]).expect("room on the device")
    }

    /// [`request`](Self::request) computing the window entries of the pages `held` names only (a pool's rank writes
    /// zeros for the others); `None` when the device has no room for the rest.
    fn request_holding(&mut self, tokens: &[u32], held: &[bool]) -> Option<usize> {
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
        self.verify(tokens, &slots);
        let cached = slots.len();
        let pages = (tokens.len() - cached) / PAGE;
        let fresh = match self.device.alloc_pages(pages) {
            Some(fresh) => fresh,
            None => {
                self.tree.evict(pages * PAGE, &mut self.device).unwrap();
                let Some(fresh) = self.device.alloc_pages(pages) else {
                    self.tree.dec_lock_ref(locked).unwrap();
                    return None;
                };
                fresh
            }
        };
        let pool = self.pool;
        self.visit(tokens, cached, &fresh, |page, bytes, expected| {
            if pool && !held[page] {
                bytes.fill(0);
            } else {
                bytes.copy_from_slice(expected);
            }
        });
        slots.extend(&fresh);
        self.tree.insert_with_trailing(tokens, &slots, &mut self.device, held).unwrap();
        self.tree.dec_lock_ref(locked).unwrap();
        Some(cached / PAGE)
    }

    /// Prefetches what storage holds of `tokens` below the root, ticking until the result is in the tree; returns
    /// the tokens it brought.
    fn prefetch(&mut self, id: &str, tokens: &[u32], collective: &mut dyn Collective) -> usize {
        let root = self.tree.root();
        let started = self.tree.prefetch_from_storage(id, root, tokens).unwrap();
        assert!(matches!(started, PrefetchStart::Started(_)), "{started:?}");
        self.wait_prefetch(id, collective)
    }

    /// Ticks until `id`'s prefetch result is in the tree; returns the tokens it brought.
    fn wait_prefetch(&mut self, id: &str, collective: &mut dyn Collective) -> usize {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut fetched = 0;
        while self.tree.check_prefetch_progress(id) == PrefetchCheck::Waiting {
            assert!(Instant::now() < deadline, "the prefetch never finished");
            for (explanation, _) in self.tree.tick(collective).unwrap().prefetches {
                fetched = explanation.fetched_tokens;
            }
        }
        fetched
    }

    fn held(&self, keys: &[PageKey]) -> Vec<bool> {
        self.storage.batch_contains(keys).unwrap()
    }
}

/// Every rank runs `script` on a thread of its own; returns their results in rank order.
fn lockstep<T: Send>(
    ranks: usize,
    faults: impl Fn(usize) -> FaultPlan + Sync,
    script: impl Fn(&mut Rank, &mut InProcessGroup) -> T + Sync,
) -> Vec<T> {
    let store = MemoryStore::new();
    let groups = InProcessGroup::new(ranks, Duration::from_secs(30)).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, mut group)| {
                let (store, script, faults) = (&store, &script, &faults);
                scope.spawn(move || script(&mut Rank::new(rank, store, faults(rank)), &mut group))
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().unwrap()).collect()
    })
}

fn conversation() -> Vec<u32> {
    (0..(8 * PAGE) as u32).map(|token| 7000 + token).collect()
}

/// Three requests of growing prefixes of one conversation (3, 5 and 8 pages) leave nodes ending at pages 3, 5 and 8:
/// the KV's rank stores every page, the window pool's ranks the two pages before each end. Then each pool rank
/// loses one entry: rank 0 page 3's (it can restore 3 and 8), rank 1 page 7's (3, 4 and 5). The least of their
/// longest lengths, 5, is not one rank 0 can restore; the ranks agree on 3, every rank's prefetch brings 3 pages, and
/// every byte a request then gets is right, the window's entries included.
#[test]
fn pool_ranks_store_windows_and_every_rank_agrees_on_a_length_all_can_restore() {
    let tokens = conversation();
    let keys = page_keys(&tokens, PAGE, None, PartialPage::Reject).unwrap();
    let results = lockstep(
        3,
        |_| FaultPlan::default(),
        |rank, group| {
            for (pages, cached) in [(3, 0), (5, 3), (8, 5)] {
                assert_eq!(rank.request(&tokens[..pages * PAGE]), cached, "pool {}", rank.pool);
                rank.tree.drain(group, Instant::now() + Duration::from_secs(20), &mut |_| {}).unwrap();
            }
            let stored = rank.held(&keys);
            let lost = match group.rank() {
                1 => Some(keys[3]),
                2 => Some(keys[7]),
                _ => None,
            };
            if let Some(key) = lost {
                assert_eq!(rank.storage.remove(&[key]).unwrap(), 1);
            }
            rank.tree.reset();
            let fetched = rank.prefetch("again", &tokens, group);
            let got = rank.request(&tokens);
            rank.tree.check_invariants().unwrap();
            (stored, fetched, got)
        },
    );
    let all = vec![true; 8];
    let windows = vec![false, true, true, true, true, false, true, true];
    assert_eq!(results[0].0, all, "the KV's rank stores every page");
    assert_eq!(results[1].0, windows, "a pool's rank stores the window before each node's end");
    assert_eq!(results[2].0, windows);
    for (rank, (_, fetched, got)) in results.iter().enumerate() {
        assert_eq!(*fetched, 3 * PAGE, "rank {rank}: the agreed hit is 3 pages");
        assert_eq!(*got, 3, "rank {rank}: the request gets the 3 pages from the cache");
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// A request of a conversation's first `pages`, holding the window entries of the pages `held` names.
    Request {
        conversation: u32,
        pages: usize,
        held: Vec<bool>,
    },
    Evict(usize),
    EvictHost(usize),
    /// Device and host emptied (storage keeps its pages): the next requests come back from storage.
    Reset,
    Tick,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u32..3, 1usize..8, prop::collection::vec(prop::bool::weighted(0.7), 8))
            .prop_map(|(conversation, pages, held)| Op::Request { conversation, pages, held }),
        1 => (1usize..12).prop_map(|pages| Op::Evict(pages * PAGE)),
        1 => (1usize..12).prop_map(|pages| Op::EvictHost(pages * PAGE)),
        1 => Just(Op::Reset),
        2 => Just(Op::Tick),
    ]
}

fn tokens_of(conversation: u32, pages: usize) -> Vec<u32> {
    (0..(pages * PAGE) as u32).map(|token| conversation * 10_000 + token).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// The KV's rank and the window pool's two TP ranks run random requests (window entries held at random pages),
    /// evictions, resets and ticks in lockstep, each rank's storage failing and damaging pages at random of its
    /// own. Every request has every byte right on every rank (the window's entries included) and gets the same
    /// number of pages from the cache on every rank, prefetched from storage first where the tree ends.
    #[test]
    fn every_rank_restores_the_same_whole_groups_under_faults(
        ops in prop::collection::vec(op(), 1..40),
        seed in any::<u64>(),
    ) {
        let faults = |rank: usize| FaultPlan {
            page_failure_ppm: 100_000,
            corruption_ppm: 100_000,
            seed: seed ^ (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            ..FaultPlan::default()
        };
        let results = lockstep(3, faults, |rank, group| {
            let mut got = Vec::new();
            for (index, op) in ops.iter().enumerate() {
                match op {
                    Op::Request { conversation, pages, held } => {
                        let tokens = tokens_of(*conversation, *pages);
                        let matched = rank.tree.match_prefix(&tokens);
                        let after = matched.device_slots.len() + matched.host_hit_length;
                        if matched.last_host_node == matched.last_node && after < tokens.len() {
                            let id = format!("request-{index}");
                            let node = matched.last_host_node;
                            if let PrefetchStart::Started(_) =
                                rank.tree.prefetch_from_storage(&id, node, &tokens[after..]).unwrap()
                            {
                                rank.wait_prefetch(&id, group);
                            }
                        }
                        got.push(rank.request_holding(&tokens, &held[..*pages]));
                    }
                    Op::Evict(tokens) => {
                        rank.tree.evict(*tokens, &mut rank.device).unwrap();
                    }
                    Op::EvictHost(tokens) => {
                        rank.tree.evict_host(*tokens).unwrap();
                    }
                    Op::Reset => {
                        rank.tree.drain(group, Instant::now() + Duration::from_secs(20), &mut |_| {}).unwrap();
                        rank.tree.reset();
                        rank.device = PagedSlots::new(16, PAGE).unwrap();
                    }
                    Op::Tick => {
                        rank.tree.tick(group).unwrap();
                    }
                }
                rank.tree.check_invariants().unwrap();
            }
            got
        });
        prop_assert_eq!(&results[0], &results[1]);
        prop_assert_eq!(&results[0], &results[2]);
    }
}
