//! One test per SGLang 0.5.2 bug that hicache fixes (docs/sglang.md, bugs fixed), named after its number there, each
//! showing the situation that breaks SGLang and what hicache does instead. The wider behaviour of each fix is tested
//! beside its code (`controller_l1_l2.rs`, `controller_storage.rs`, `controller_lockstep.rs`, `tree.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use hicache_core::collective::{Collective, InProcessGroup, ReduceOp, SingleRank};
use hicache_core::config::{PrefetchPolicy, WritePolicy};
use hicache_core::controller::{CacheController, PrefetchDone, PrefetchStop, StorageSettings};
use hicache_core::device_slots::{DeviceSlotAllocator as _, PagedSlots};
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PartialPage, page_keys};
use hicache_core::host_pool::PageState;
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FaultPlan, FaultyStorage, MemoryStorage, MemoryStore, StorageBackend};
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap, ProducerSlot, SlotBusy, SlotReuse, Stream};
use hicache_core::tree::NodeId;
use hicache_core::tree::{HiRadixTree, TreeSettings};
use hicache_core::{HiCacheBuilder, HiCacheConfig};

const PAGE: usize = 2;
const LAYERS: usize = 2;
const DEVICE_PAGES: usize = 8;
const HOST_PAGES: usize = 16;

fn geometry() -> KvGeometry {
    KvGeometry::mha(LAYERS, 1, 4, KvDtype::Bf16).unwrap()
}

fn memory(store: &Arc<MemoryStore>, rank: usize, ranks: usize) -> MemoryStorage {
    let mut namespace = StorageNamespace::single_rank("bugs", geometry(), HostLayout::PageFirst, PAGE);
    namespace.tp_rank = rank;
    namespace.tp_size = ranks;
    MemoryStorage::shared(store.clone(), &namespace)
}

fn controller(completion: Completion, storage: Option<Arc<dyn StorageBackend>>) -> CacheController<CpuEngine> {
    controller_with(completion, storage, PrefetchPolicy::BestEffort)
}

fn controller_with(
    completion: Completion,
    storage: Option<Arc<dyn StorageBackend>>,
    policy: PrefetchPolicy,
) -> CacheController<CpuEngine> {
    let device = DeviceLayoutMap::new(geometry(), DEVICE_PAGES * PAGE).unwrap();
    let host = HostLayoutMap::new(geometry(), HostLayout::PageFirst, PAGE, HOST_PAGES).unwrap();
    let engine = CpuEngine::new(device, host, completion).unwrap();
    engine.with_device(|bytes| bytes.iter_mut().enumerate().for_each(|(index, byte)| *byte = index as u8));
    let builder = HiCacheBuilder::new(
        HiCacheConfig { page_size: PAGE, mem_layout: HostLayout::PageFirst, ..HiCacheConfig::default() },
        engine,
    );
    match storage {
        None => builder.build_controller().unwrap(),
        Some(storage) => {
            let settings = StorageSettings {
                page_size: PAGE,
                batch_pages: 2,
                prefetch_threshold: PAGE,
                policy,
                timeout_base: Duration::from_secs(3),
                timeout_per_ki_token: Duration::ZERO,
                timeout_max: Duration::from_secs(3),
                read_deadline: Duration::from_secs(30),
                capacity_tokens: ((HOST_PAGES - DEVICE_PAGES) * PAGE) as u64,
                backup_skip: false,
                write_bytes_per_s: 0,
                tick_slots: 4,
                by_cost: false,
                split: false,
                meet: false,
                priors: hicache_core::cost::Priors::UNKNOWN,
                trailing: None,
            };
            // this process is the rank the backend was opened for
            let rank = storage.namespace().map_or(0, |namespace| namespace.tp_rank);
            builder.with_tp_rank(rank).with_storage(storage).with_storage_settings(settings).build_controller().unwrap()
        }
    }
}

/// Writes `pages` device pages with keys of `tokens` to the host and on to storage; returns once stored.
fn store_pages(controller: &mut CacheController<CpuEngine>, tokens: &[u32]) {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let keys = page_keys(tokens, PAGE, None, PartialPage::Reject).unwrap();
    let slots = device.alloc_pages(keys.len()).unwrap();
    let pages = controller.write(&slots, NodeId(1), Some(&keys)).unwrap().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while controller.backups_in_flight() > 0 || controller.outstanding().0 > 0 {
        controller.tick(&mut SingleRank).unwrap();
        assert!(Instant::now() < deadline);
    }
    controller.evict_device(&pages).unwrap();
    device.free(&slots).unwrap();
    controller.evict_host(&pages).unwrap();
}

fn result(controller: &mut CacheController<CpuEngine>, request: &str) -> PrefetchDone {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let report = controller.tick(&mut SingleRank).unwrap();
        if let Some(done) = report.prefetches.into_iter().find(|done| done.request_id == request) {
            return done;
        }
        assert!(Instant::now() < deadline, "no result");
    }
}

#[test]
fn item_01_a_cut_off_prefetch_returns_its_unfinished_pages_exactly_once() {
    // SGLang releases host[completed:] in _page_transfer and again in prefetch_io_aux_func: two owners per page
    let store = MemoryStore::new();
    let tokens: Vec<u32> = (0..8 * PAGE as u32).collect();
    store_pages(&mut controller(Completion::Immediate, Some(Arc::new(memory(&store, 0, 1)))), &tokens);
    // every read but the first fails, so the prefetch ends partway
    let faulty = Arc::new(FaultyStorage::new(memory(&store, 0, 1), FaultPlan::default()));
    let mut rig = controller(Completion::Immediate, Some(faulty.clone()));
    rig.prefetch("r", &tokens, None).unwrap();
    faulty.set_plan(FaultPlan { partial_batch: Some(1), ..FaultPlan::default() });
    rig.finish_prefetch("r");
    let done = result(&mut rig, "r");
    assert!(done.host_pages.len() < 8);
    let deadline = Instant::now() + Duration::from_secs(10);
    while rig.prefetches_in_flight() > 0 {
        rig.tick(&mut SingleRank).unwrap();
        assert!(Instant::now() < deadline);
    }
    rig.host().check_invariants().unwrap();
    assert_eq!(rig.host().available(), HOST_PAGES - done.host_pages.len(), "every other page back, once");
    rig.evict_host(&done.host_pages).unwrap();
    assert_eq!(rig.host().available(), HOST_PAGES);
}

#[test]
fn item_02_ranks_that_fetch_different_amounts_free_the_same_pages() {
    // SGLang's release queue gets per-rank chunk counts (and empty chunks), so its MIN-drained frees drift apart
    let store = MemoryStore::new();
    let tokens: Vec<u32> = (100..100 + 8 * PAGE as u32).collect();
    for rank in 0..2 {
        store_pages(&mut controller(Completion::Immediate, Some(Arc::new(memory(&store, rank, 2)))), &tokens);
    }
    let groups = InProcessGroup::new(2, Duration::from_secs(20)).unwrap();
    let results: Vec<(usize, Vec<PageState>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|mut group| {
                let store = store.clone();
                let tokens = tokens.clone();
                scope.spawn(move || {
                    let rank = group.rank();
                    let faulty = Arc::new(FaultyStorage::new(memory(&store, rank, 2), FaultPlan::default()));
                    let mut rig =
                        controller_with(Completion::Immediate, Some(faulty.clone()), PrefetchPolicy::WaitComplete);
                    rig.prefetch("r", &tokens, None).unwrap();
                    // rank 1 reads only the first page of a batch: it fetches 1 page where rank 0 fetches 8
                    if rank == 1 {
                        faulty.set_plan(FaultPlan { partial_batch: Some(1), ..FaultPlan::default() });
                    }
                    let own = if rank == 0 { 8 * PAGE } else { PAGE };
                    let deadline = Instant::now() + Duration::from_secs(10);
                    let mut done = [0i64];
                    while done[0] == 0 {
                        rig.tick(&mut group).unwrap();
                        done[0] = i64::from(rig.prefetch_progress("r") == Some(own));
                        group.all_reduce(&mut done, ReduceOp::Min).unwrap();
                        assert!(Instant::now() < deadline, "rank {rank} fetched {:?}", rig.prefetch_progress("r"));
                    }
                    rig.finish_prefetch("r");
                    let mut kept = None;
                    while rig.prefetches_in_flight() > 0 {
                        let report = rig.tick(&mut group).unwrap();
                        kept = kept.or(report.prefetches.first().map(|done| done.host_pages.len()));
                    }
                    (kept.unwrap(), rig.host().states().to_vec())
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().unwrap()).collect()
    });
    assert_eq!(results[0].0, 1, "the TP minimum");
    assert_eq!(results[0], results[1], "same pages kept, same pages freed, on both ranks");
}

#[test]
fn item_03_write_back_reaches_storage() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    // SGLang calls write_backup_storage only in writing_check's non-write_back branch
    let store = MemoryStore::new();
    let rig = controller(Completion::Immediate, Some(Arc::new(memory(&store, 0, 1))));
    let settings = TreeSettings { write_policy: WritePolicy::WriteBack, ..TreeSettings::default() };
    let mut tree = HiRadixTree::new(rig, settings);
    let tokens: Vec<u32> = (0..3 * PAGE as u32).collect();
    let slots = device.alloc_pages(3).unwrap();
    tree.insert(&tokens, &slots, &mut device).unwrap();
    assert_eq!(tree.evict(3 * PAGE, &mut device).unwrap(), 3 * PAGE);
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.len() < 3 {
        tree.tick(&mut SingleRank).unwrap();
        assert!(Instant::now() < deadline, "write_back never reached storage");
    }
}

#[test]
fn item_04_a_write_back_eviction_without_host_room_does_not_crash() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    // SGLang appends the node to write_back_nodes although write_backup failed, then asserts node.backuped
    let rig = controller(Completion::Immediate, None);
    let settings = TreeSettings { write_policy: WritePolicy::WriteBack, ..TreeSettings::default() };
    let mut tree = HiRadixTree::new(rig, settings);
    let tokens: Vec<u32> = (0..4 * PAGE as u32).collect();
    let slots = device.alloc_pages(4).unwrap();
    tree.insert(&tokens, &slots, &mut device).unwrap();
    // fill the host pool with copies no one can evict: four unacked writes of 4 pages from other device pages
    let other_slots = device.alloc_pages(4).unwrap();
    for node in 0..4 {
        assert!(tree.controller_mut().write(&other_slots, NodeId(90 + node), None).unwrap().is_some());
    }
    assert_eq!(tree.controller().host().available(), 0);
    let freed = tree.evict(4 * PAGE, &mut device).unwrap();
    assert_eq!(freed, 4 * PAGE, "the node was dropped (its KV is recomputed if asked again), not asserted on");
    tree.check_invariants().unwrap();
    assert_eq!(tree.stats().dropped_tokens, 4 * PAGE);
}

#[test]
fn item_06_a_batch_with_failed_pages_counts_only_the_pages_that_arrived() {
    // SGLang's 3FS zero-copy get: `if page_data:` is true for a list of Nones, so the whole batch is counted
    let store = MemoryStore::new();
    let tokens: Vec<u32> = (200..200 + 4 * PAGE as u32).collect();
    store_pages(&mut controller(Completion::Immediate, Some(Arc::new(memory(&store, 0, 1)))), &tokens);
    let faulty = Arc::new(FaultyStorage::new(
        memory(&store, 0, 1),
        FaultPlan { partial_batch: Some(1), ..FaultPlan::default() },
    ));
    let mut rig = controller(Completion::Immediate, Some(faulty));
    rig.prefetch("r", &tokens, None).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    // the first page arrives, then the read of the rest fails: wait for that failure, not for a guessed time
    while rig.prefetch_failure("r").is_none() {
        rig.tick(&mut SingleRank).unwrap();
        assert!(Instant::now() < deadline, "no read failure within 10 s");
        std::thread::yield_now();
    }
    assert_eq!(rig.prefetch_progress("r"), Some(PAGE));
    rig.finish_prefetch("r");
    let done = result(&mut rig, "r");
    assert_eq!((done.host_pages.len(), done.explanation.stop), (1, PrefetchStop::Failed));
}

#[test]
fn item_07_a_page_gone_between_exists_and_get_does_not_shift_the_others() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    // SGLang's 3FS batch_get slices destinations by found-key position: later pages land on the wrong host slots
    let store = MemoryStore::new();
    let tokens: Vec<u32> = (300..300 + 4 * PAGE as u32).collect();
    let mut writer = controller(Completion::Immediate, Some(Arc::new(memory(&store, 0, 1))));
    let expected: Vec<u8> = {
        let slots = device.alloc_pages(4).unwrap();
        let keys = page_keys(&tokens, PAGE, None, PartialPage::Reject).unwrap();
        let pages = writer.write(&slots, NodeId(1), Some(&keys)).unwrap().unwrap();
        while writer.backups_in_flight() > 0 || writer.outstanding().0 > 0 {
            writer.tick(&mut SingleRank).unwrap();
        }
        hicache_core::transfer::TransferEngine::host_memory(writer.engine()).copy_pages_out(&pages).unwrap()
    };
    // page 1 is gone, but the existence query (stale metadata, as 3FS's after an LRU reuse) still says present
    let keys = page_keys(&tokens, PAGE, None, PartialPage::Reject).unwrap();
    let reader = memory(&store, 0, 1);
    assert_eq!(reader.remove(&keys[1..2]).unwrap(), 1);
    let mut rig =
        controller_with(Completion::Immediate, Some(Arc::new(StaleExists(reader))), PrefetchPolicy::WaitComplete);
    rig.prefetch("r", &tokens, None).unwrap();
    rig.finish_prefetch("r");
    let done = result(&mut rig, "r");
    assert_eq!(done.explanation.tp_min_hit_tokens, 4 * PAGE, "the query believed every page was there");
    assert_eq!(done.host_pages.len(), 1, "the fetch stops at the missing page; pages 2 and 3 are not moved up");
    let got =
        hicache_core::transfer::TransferEngine::host_memory(rig.engine()).copy_pages_out(&done.host_pages).unwrap();
    assert_eq!(got, expected[..got.len()], "whatever arrived is at its own place");
}

/// A backend whose existence query says every key is present (the metadata is stale); reads are real.
struct StaleExists(MemoryStorage);

impl StorageBackend for StaleExists {
    fn name(&self) -> &str {
        "stale-exists"
    }

    fn batch_exists(&self, keys: &[hicache_core::hash::PageKey]) -> Result<usize, hicache_core::Error> {
        Ok(keys.len())
    }

    fn batch_get(
        &self,
        keys: &[hicache_core::hash::PageKey],
        pages: &mut [hicache_core::storage::PageSegmentsMut<'_>],
    ) -> Result<Vec<hicache_core::storage::GetOutcome>, hicache_core::Error> {
        self.0.batch_get(keys, pages)
    }

    fn batch_set(
        &self,
        keys: &[hicache_core::hash::PageKey],
        pages: &[hicache_core::storage::PageSegments<'_>],
    ) -> Result<Vec<hicache_core::storage::SetOutcome>, hicache_core::Error> {
        self.0.batch_set(keys, pages)
    }

    fn remove(&self, keys: &[hicache_core::hash::PageKey]) -> Result<usize, hicache_core::Error> {
        self.0.remove(keys)
    }

    fn clear(&self) -> Result<u64, hicache_core::Error> {
        self.0.clear()
    }

    fn stats(&self) -> hicache_core::storage::StorageStats {
        self.0.stats()
    }
}

#[test]
fn item_14_reset_waits_for_copies_and_leaves_no_stale_state() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    // SGLang's reset clears its ack lists without synchronising and keeps ongoing_* dicts while resetting node ids
    let mut rig = controller(Completion::Manual, None);
    let slots = device.alloc_pages(2).unwrap();
    rig.write(&slots, NodeId(1), None).unwrap().unwrap();
    assert_eq!(rig.engine().pending(), (1, 0));
    rig.reset();
    assert_eq!(rig.engine().pending(), (0, 0), "the copy finished before the pools were cleared");
    assert_eq!((rig.outstanding(), rig.host().available()), ((0, 0, 0), HOST_PAGES));
    assert!(rig.take_write_acks(1).is_err());
}

#[test]
fn item_16_a_rank_with_nothing_to_ack_still_enters_the_tick() {
    // SGLang's writing_check skips its all-reduce when the local ongoing_write_through is empty: a hang
    let groups = InProcessGroup::new(2, Duration::from_secs(5)).unwrap();
    let results: Vec<usize> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|mut group| {
                scope.spawn(move || {
                    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
                    let mut rig = controller(Completion::Immediate, None);
                    // only rank 0 writes; rank 1 has nothing in flight, and ticks all the same
                    if group.rank() == 0 {
                        let slots = device.alloc_pages(1).unwrap();
                        rig.write(&slots, NodeId(1), None).unwrap().unwrap();
                    }
                    (0..3).map(|_| rig.tick(&mut group).unwrap().write_acks.len()).sum()
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().unwrap()).collect()
    });
    assert_eq!(results, [0, 0], "the MIN over ranks holds rank 0's ack back (rank 1 never had it), and no one hangs");
}

#[test]
fn item_17_a_fourth_load_waits_or_reports_busy_instead_of_asserting() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    // SGLang's LayerDoneCounter.update_producer asserts when the slot's last load has not finished
    let mut rig = controller(Completion::Manual, None);
    let slots = device.alloc_pages(4).unwrap();
    let pages = rig.write(&slots, NodeId(1), None).unwrap().unwrap();
    rig.engine().run_pending();
    rig.take_write_acks(1).unwrap();
    rig.evict_device(&pages).unwrap();
    device.free(&slots).unwrap();
    for (index, page) in pages.iter().take(3).enumerate() {
        rig.load(&[*page], &device.alloc_pages(1).unwrap(), NodeId(index as u64), None).unwrap();
        rig.start_loading(SlotReuse::Refuse).unwrap().unwrap();
    }
    rig.load(&pages[3..], &device.alloc_pages(pages[3..].len()).unwrap(), NodeId(9), None).unwrap();
    assert_eq!(ring(rig.start_loading(SlotReuse::Refuse).unwrap()), Err(0));
    assert_eq!(ring(rig.start_loading(SlotReuse::Wait).unwrap()), Ok(Some(0)));
    assert!(rig.engine().complete_next(Stream::Load) || rig.engine().pending().1 == 0);
}

/// A load's start as ring indices: the producer slot it took, or the busy slot it was refused.
fn ring(started: Result<Option<ProducerSlot>, SlotBusy>) -> Result<Option<usize>, usize> {
    started.map(|slot| slot.map(ProducerSlot::index)).map_err(|busy| busy.slot.index())
}
