//! The controller's storage half on the CPU engine with in-memory and fault-injecting storage: backups that reach
//! storage under every write policy, prefetches that reserve only the hit, the three stop policies, releases applied
//! exactly once, and reset as a quiesce. Bytes are checked against a reference built from the device pool here.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use hicache_core::collective::SingleRank;
use hicache_core::config::PrefetchPolicy;
use hicache_core::controller::{
    CacheController, PageBackup, PrefetchDone, PrefetchHead, PrefetchStart, PrefetchStop, StorageFailure,
    StorageSettings, TickReport,
};
use hicache_core::device_slots::{DeviceSlotAllocator as _, PagedSlots};
use hicache_core::error::{Error, ErrorKind};
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PageKey, PartialPage, page_keys};
use hicache_core::host_memory::MemoryRegion;
use hicache_core::host_pool::{HostPageId, PageState};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::rate_limit::{Clock, ManualClock, SystemClock};
use hicache_core::storage::{
    FailureKind, FaultPlan, FaultyStorage, GetOutcome, MemoryStorage, MemoryStore, PageSegments, PageSegmentsMut,
    SetOutcome, StorageBackend, StorageStats,
};
use hicache_core::transfer::{Completion, CpuEngine, CpuEvent, DeviceLayoutMap, TransferEngine};
use hicache_core::tree::NodeId;
use hicache_core::{HiCacheBuilder, HiCacheConfig};
use rand::RngExt as _;

const PAGE: usize = 4;
const LAYERS: usize = 2;
const DEVICE_PAGES: usize = 16;
const HOST_PAGES: usize = 40;
const THRESHOLD: usize = 2 * PAGE;

fn geometry() -> KvGeometry {
    KvGeometry::mha(LAYERS, 1, 4, KvDtype::Bf16).unwrap()
}

fn namespace(rank: usize, size: usize) -> StorageNamespace {
    let mut namespace = StorageNamespace::single_rank("storage-test", geometry(), HostLayout::LayerFirst, PAGE);
    namespace.tp_rank = rank;
    namespace.tp_size = size;
    namespace
}

fn settings(policy: PrefetchPolicy) -> StorageSettings {
    StorageSettings {
        page_size: PAGE,
        batch_pages: 2,
        prefetch_threshold: THRESHOLD,
        policy,
        timeout_base: Duration::from_secs(3),
        timeout_per_ki_token: Duration::ZERO,
        timeout_max: Duration::from_secs(3),
        read_deadline: Duration::from_secs(30),
        capacity_tokens: ((HOST_PAGES - DEVICE_PAGES) * PAGE) as u64,
        backup_skip: false,
        write_bytes_per_s: 0,
        tick_slots: 8,
        by_cost: false,
        split: false,
        meet: false,
        priors: hicache_core::cost::Priors::UNKNOWN,
        trailing: None,
    }
}

fn controller(storage: Arc<dyn StorageBackend>, settings: StorageSettings, clock: Arc<dyn Clock>) -> Rig {
    let device = DeviceLayoutMap::new(geometry(), DEVICE_PAGES * PAGE).unwrap();
    let host = HostLayoutMap::new(geometry(), HostLayout::LayerFirst, PAGE, HOST_PAGES).unwrap();
    let engine = CpuEngine::new(device, host, Completion::Immediate).unwrap();
    engine.with_device(|bytes| rand::rng().fill(bytes));
    // this process is the rank the backend was opened for
    let rank = storage.namespace().map_or(0, |namespace| namespace.tp_rank);
    HiCacheBuilder::new(
        HiCacheConfig { page_size: PAGE, mem_layout: HostLayout::LayerFirst, ..HiCacheConfig::default() },
        engine,
    )
    .with_tp_rank(rank)
    .with_storage(storage)
    .with_storage_settings(settings)
    .with_clock(clock)
    .build_controller()
    .unwrap()
}

type Rig = CacheController<CpuEngine>;

/// The flat pages (docs/sglang.md#flat-pages) of device slots, built from the device map and the layout's flat order,
/// not through the engine's copies.
fn expected_flat_pages(rig: &Rig, slots: &[u32]) -> Vec<u8> {
    let device = rig.engine().device_map();
    let host = rig.engine().host_map();
    let item = geometry().item_bytes();
    let mut out = vec![0u8; slots.len() / PAGE * host.page_bytes()];
    rig.engine().with_device(|bytes| {
        for (page, page_slots) in slots.chunks(PAGE).enumerate() {
            for (token, &slot) in page_slots.iter().enumerate() {
                for layer in 0..LAYERS {
                    for &part in geometry().parts() {
                        let from = device.item_offset(slot as usize, layer, part);
                        let to = page * host.page_bytes() + host.flat_offset(token, layer, part);
                        out[to..to + item].copy_from_slice(&bytes[from..from + item]);
                    }
                }
            }
        }
    });
    out
}

/// Fills the host pool with pages holding the only copy above storage (written from the device, acked, the device
/// copy evicted: evictable) until `free` pages are left; returns them.
fn fill_host_pool(rig: &mut Rig, device: &mut PagedSlots, free: usize) -> Vec<HostPageId> {
    let mut filled = Vec::new();
    while rig.host().available() > free {
        let slots = device.alloc_pages(1).unwrap();
        let pages = rig.write(&slots, NodeId(9), None).unwrap().unwrap();
        rig.take_all_write_acks().unwrap();
        rig.evict_device(&pages).unwrap();
        device.free(&slots).unwrap();
        filled.extend(pages);
    }
    filled
}

fn host_bytes(rig: &Rig, pages: &[HostPageId]) -> Vec<u8> {
    rig.engine().host_memory().copy_pages_out(pages).unwrap()
}

fn tokens(seed: u32, pages: usize) -> Vec<u32> {
    (0..(pages * PAGE) as u32).map(|index| seed.wrapping_mul(1_000_003).wrapping_add(index)).collect()
}

/// Ticks until `done` says so, collecting every report; fails after 10 s.
fn tick_until(rig: &mut Rig, mut done: impl FnMut(&Rig, &[TickReport<CpuEvent>]) -> bool) -> Vec<TickReport<CpuEvent>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut reports = Vec::new();
    loop {
        reports.push(rig.tick(&mut SingleRank).unwrap());
        if done(rig, &reports) {
            return reports;
        }
        assert!(Instant::now() < deadline, "not done after 10 s");
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn prefetch_result(rig: &mut Rig, request: &str) -> PrefetchDone {
    let reports = tick_until(rig, |_, reports| {
        reports.iter().any(|report| report.prefetches.iter().any(|done| done.request_id == request))
    });
    reports.into_iter().flat_map(|report| report.prefetches).find(|done| done.request_id == request).unwrap()
}

/// Writes `pages` device pages of `tokens` with keys, acks the write, waits for the backup to storage, and drops
/// the device copy; returns the device slots (freed) and the expected flat bytes.
fn store_through(rig: &mut Rig, tokens: &[u32]) -> (Vec<PageKey>, Vec<u8>, Vec<HostPageId>) {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let keys = page_keys(tokens, PAGE, None, PartialPage::Reject).unwrap();
    let slots = device.alloc_pages(keys.len()).unwrap();
    let expected = expected_flat_pages(rig, &slots);
    let pages = rig.write(&slots, NodeId(1), Some(&keys)).unwrap().unwrap();
    let reports = tick_until(rig, |_, reports| reports.iter().any(|report| !report.backups.is_empty()));
    let backup = reports.iter().flat_map(|report| &report.backups).next().unwrap();
    assert!(backup.pages.iter().all(|page| *page == PageBackup::Stored), "{:?}", backup.pages);
    rig.evict_device(&pages).unwrap();
    device.free(&slots).unwrap();
    (keys, expected, pages)
}

fn memory(store: &Arc<MemoryStore>, rank: usize, size: usize) -> MemoryStorage {
    MemoryStorage::shared(store.clone(), &namespace(rank, size))
}

#[test]
fn a_stored_prefix_is_prefetched_byte_for_byte_into_a_fresh_host_pool() {
    let store = MemoryStore::new();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
    let mut writer = controller(Arc::new(memory(&store, 0, 1)), settings(PrefetchPolicy::WaitComplete), clock.clone());
    let prompt = tokens(1, 5);
    let (keys, expected, _) = store_through(&mut writer, &prompt);
    assert_eq!(store.len(), 5);

    let mut reader = controller(Arc::new(memory(&store, 0, 1)), settings(PrefetchPolicy::WaitComplete), clock);
    let mut asked = prompt.clone();
    asked.extend(tokens(2, 3)); // 3 more pages storage does not hold, and a partial tail
    asked.extend([7, 7]);
    assert_eq!(reader.prefetch("r1", &asked, None).unwrap(), PrefetchStart::Started(hicache_core::controller::OpId(1)));
    assert!(reader.finish_prefetch("r1"));
    let done = prefetch_result(&mut reader, "r1");
    assert_eq!(done.keys, keys);
    assert_eq!(done.explanation.stop, PrefetchStop::Complete);
    assert_eq!(
        (done.explanation.requested_tokens, done.explanation.tp_min_hit_tokens, done.explanation.fetched_tokens),
        (8 * PAGE, 5 * PAGE, 5 * PAGE)
    );
    assert_eq!(host_bytes(&reader, &done.host_pages), expected);
    assert!(done.host_pages.iter().all(|&page| reader.host().state(page).unwrap() == PageState::Backup));
    // the caller owns them: it can load them to the device, or give them back
    reader.evict_host(&done.host_pages).unwrap();
    assert_eq!(reader.host().available(), HOST_PAGES);
    assert_eq!(reader.prefetch_capacity().unwrap().occupied(), 0);
    assert_eq!(reader.prefetches_in_flight(), 0);
}

#[test]
fn host_pages_are_reserved_for_the_hit_only_and_a_small_hit_is_revoked() {
    // docs/sglang.md#fixed-18: SGLang reserves the whole prompt before the hit is known
    let store = MemoryStore::new();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
    let mut rig = controller(Arc::new(memory(&store, 0, 1)), settings(PrefetchPolicy::WaitComplete), clock);
    let prompt = tokens(3, 20);
    let (_, _, host_pages) = store_through(&mut rig, &prompt[..3 * PAGE]);
    rig.evict_host(&host_pages).unwrap();
    assert_eq!(rig.prefetch("big", &prompt, None).unwrap(), PrefetchStart::Started(hicache_core::controller::OpId(3)));
    assert_eq!(rig.host().available(), HOST_PAGES, "nothing reserved before the hit is known");
    let reports = tick_until(&mut rig, |rig, _| rig.prefetch_progress("big").is_some_and(|tokens| tokens > 0));
    assert!(reports.iter().all(|report| report.prefetches.is_empty()));
    assert!(rig.host().available() >= HOST_PAGES - 3, "3 pages reserved for a 3-page hit of a 20-page prompt");
    rig.finish_prefetch("big");
    let done = prefetch_result(&mut rig, "big");
    assert_eq!(done.explanation.reserved_tokens, 3 * PAGE);
    assert_eq!(done.host_pages.len(), 3);

    // a hit below the threshold: revoked, nothing reserved, nothing held against the capacity
    let one_page = tokens(5, 20);
    let (_, _, pages) = store_through(&mut rig, &one_page[..PAGE]);
    rig.evict_host(&pages).unwrap();
    let before = rig.host().available();
    rig.prefetch("small", &one_page, None).unwrap();
    let done = prefetch_result(&mut rig, "small");
    assert_eq!(done.explanation.stop, PrefetchStop::Revoked);
    assert_eq!((done.explanation.local_hit_tokens, done.host_pages.len()), (PAGE, 0));
    assert_eq!(rig.host().available(), before);
    assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0);
}

#[test]
fn short_requests_and_a_full_capacity_are_refused_before_any_query() {
    let store = MemoryStore::new();
    let storage = Arc::new(FaultyStorage::new(memory(&store, 0, 1), FaultPlan::default()));
    let mut small = settings(PrefetchPolicy::WaitComplete);
    small.capacity_tokens = (3 * PAGE) as u64;
    let mut rig = controller(storage.clone(), small, Arc::new(SystemClock::new()));
    assert_eq!(
        rig.prefetch("short", &tokens(1, 1), None).unwrap(),
        PrefetchStart::Refused(PrefetchStop::BelowThreshold)
    );
    assert!(matches!(rig.prefetch("a", &tokens(2, 4), None).unwrap(), PrefetchStart::Started(_)));
    // SGLang's rule: a prefetch starting below the limit may take it over; the next one waits
    assert_eq!(rig.prefetch("b", &tokens(3, 4), None).unwrap(), PrefetchStart::Refused(PrefetchStop::CapacityLimited));
    let error = rig.prefetch("a", &tokens(2, 4), None).unwrap_err();
    assert!(error.to_string().contains("request a has a prefetch already"), "{error}");
    rig.finish_prefetch("a");
    prefetch_result(&mut rig, "a");
    assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0);
    assert!(matches!(rig.prefetch("b", &tokens(3, 4), None).unwrap(), PrefetchStart::Started(_)));
}

/// Lets calls through one at a time as it is opened.
#[derive(Debug, Default)]
struct Gate {
    allowed: Mutex<usize>,
    opened: Condvar,
    /// Callers waiting at the gate now.
    waiting: AtomicUsize,
}

impl Gate {
    fn open(&self, calls: usize) {
        *self.allowed.lock().unwrap() += calls;
        self.opened.notify_all();
    }

    fn pass(&self) {
        let mut allowed = self.allowed.lock().unwrap();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        while *allowed == 0 {
            allowed = self.opened.wait(allowed).unwrap();
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        *allowed -= 1;
    }

    /// Waits (real time, bounded) until every call let through has passed and another waits at the gate.
    fn await_held_caller(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let allowed = self.allowed.lock().unwrap();
            if *allowed == 0 && self.waiting.load(Ordering::SeqCst) > 0 {
                return;
            }
            drop(allowed);
            assert!(std::time::Instant::now() < deadline, "no call was held at the gate");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits (real time, bounded) until a caller waits at the gate.
    fn await_caller(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while self.waiting.load(Ordering::SeqCst) == 0 {
            assert!(std::time::Instant::now() < deadline, "no call reached the gate");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A backend whose gets wait at a gate (each `open` lets one more batch through), and, when asked for, whose
/// existence checks wait at another.
#[derive(Debug)]
struct Gated {
    inner: MemoryStorage,
    gets: Gate,
    queries: Option<Gate>,
    /// Host memory regions told and not forgotten.
    registered: Mutex<usize>,
    forgotten: Condvar,
}

impl Gated {
    fn new(inner: MemoryStorage) -> Self {
        Self { inner, gets: Gate::default(), queries: None, registered: Mutex::new(0), forgotten: Condvar::new() }
    }

    fn with_query_gate(inner: MemoryStorage) -> Self {
        Self { queries: Some(Gate::default()), ..Self::new(inner) }
    }

    fn registered(&self) -> usize {
        *self.registered.lock().unwrap()
    }

    /// Waits (real time, bounded) until every region told was forgotten.
    fn await_forgotten(&self) {
        let registered = self.registered.lock().unwrap();
        let (registered, _) =
            self.forgotten.wait_timeout_while(registered, Duration::from_secs(20), |count| *count > 0).unwrap();
        assert_eq!(*registered, 0, "the host pool was not forgotten");
    }

    fn open(&self, batches: usize) {
        self.gets.open(batches);
    }

    fn open_queries(&self, batches: usize) {
        self.queries.as_ref().expect("a query gate").open(batches);
    }
}

impl StorageBackend for Gated {
    fn name(&self) -> &str {
        "gated"
    }

    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
        if let Some(gate) = &self.queries {
            gate.pass();
        }
        self.inner.batch_exists(keys)
    }

    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
        self.gets.pass();
        self.inner.batch_get(keys, pages)
    }

    fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
        self.inner.batch_set(keys, pages)
    }

    fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
        self.inner.remove(keys)
    }

    fn clear(&self) -> Result<u64, Error> {
        self.inner.clear()
    }

    fn stats(&self) -> StorageStats {
        self.inner.stats()
    }

    fn register_host_memory(&self, _region: &MemoryRegion) -> Result<(), Error> {
        *self.registered.lock().unwrap() += 1;
        Ok(())
    }

    fn unregister_host_memory(&self, _region: &MemoryRegion) {
        *self.registered.lock().unwrap() -= 1;
        self.forgotten.notify_all();
    }
}

/// Stores `pages` pages of `seed`'s tokens through a helper controller; returns the tokens and expected bytes.
fn seed_storage(store: &Arc<MemoryStore>, seed: u32, pages: usize) -> (Vec<u32>, Vec<u8>) {
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
    let mut writer = controller(Arc::new(memory(store, 0, 1)), settings(PrefetchPolicy::WaitComplete), clock);
    let prompt = tokens(seed, pages);
    let (_, expected, _) = store_through(&mut writer, &prompt);
    (prompt, expected)
}

#[test]
fn best_effort_cuts_off_with_what_arrived_and_releases_the_tail_once_when_the_reader_is_done() {
    // docs/sglang.md#fixed-1: SGLang releases the unfinished tail twice
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 6, 6);
    let gated = Arc::new(Gated::new(memory(&store, 0, 1)));
    let mut rig = controller(gated.clone(), settings(PrefetchPolicy::BestEffort), Arc::new(SystemClock::new()));
    rig.prefetch("r", &prompt, None).unwrap();
    gated.open(1);
    // the first batch has arrived, and the hit query (which may still run when it lands) has reserved the whole hit
    tick_until(&mut rig, |rig, _| {
        rig.prefetch_progress("r") == Some(2 * PAGE) && rig.host().available() == HOST_PAGES - 6
    });
    let free_while_fetching = rig.host().available();
    // the fetch thread now waits at the gate holding the second batch's pages
    rig.finish_prefetch("r");
    let reports = tick_until(&mut rig, |_, reports| reports.iter().any(|report| !report.prefetches.is_empty()));
    let done = &reports.last().unwrap().prefetches[0];
    assert_eq!(done.explanation.stop, PrefetchStop::CutOff);
    assert_eq!((done.host_pages.len(), done.explanation.fetched_tokens), (2, 2 * PAGE));
    assert_eq!(host_bytes(&rig, &done.host_pages), expected[..2 * rig.engine().host_map().page_bytes()]);
    assert_eq!(rig.host().available(), free_while_fetching, "the tail stays reserved while the reader may write it");
    assert_eq!(rig.prefetches_in_flight(), 1, "draining");
    gated.open(10);
    tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
    assert_eq!(rig.host().available(), HOST_PAGES - 2, "the 4 tail pages came back, once");
    rig.host().check_invariants().unwrap();
    assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0);
    rig.evict_host(&done.host_pages).unwrap();
    assert_eq!(rig.host().available(), HOST_PAGES);
}

#[test]
fn wait_complete_waits_for_every_page_and_timeout_stops_at_its_limit() {
    let store = MemoryStore::new();
    let (prompt, _) = seed_storage(&store, 7, 6);
    for policy in [PrefetchPolicy::WaitComplete, PrefetchPolicy::Timeout] {
        let gated = Arc::new(Gated::new(memory(&store, 0, 1)));
        let clock = Arc::new(ManualClock::new());
        let mut rig = controller(gated.clone(), settings(policy), clock.clone());
        rig.prefetch("r", &prompt, None).unwrap();
        gated.open(1);
        tick_until(&mut rig, |rig, _| rig.prefetch_progress("r") == Some(2 * PAGE));
        rig.finish_prefetch("r");
        clock.advance(Duration::from_secs(2));
        for _ in 0..20 {
            assert!(rig.tick(&mut SingleRank).unwrap().prefetches.is_empty(), "{policy}: not yet");
        }
        match policy {
            PrefetchPolicy::WaitComplete => {
                gated.open(10);
                let done = prefetch_result(&mut rig, "r");
                assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::Complete, 6));
            }
            _ => {
                clock.advance(Duration::from_millis(1001));
                // the limit passed: the next tick sees it, the one after terminates; the gate stays shut
                let done = prefetch_result(&mut rig, "r");
                assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::TimedOut, 2));
                assert!(done.explanation.elapsed > Duration::from_secs(3));
                gated.open(10);
                tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
            }
        }
    }
}

#[test]
fn a_failed_page_stops_the_fetch_at_that_page() {
    // docs/sglang.md#fixed-6: SGLang's 3FS path counts a whole batch of failed pages as fetched
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 8, 6);
    // gets pass only the first page of each batch to the backend; the second fails as injected
    let faulty = Arc::new(FaultyStorage::new(
        memory(&store, 0, 1),
        FaultPlan { partial_batch: Some(1), ..FaultPlan::default() },
    ));
    let mut rig = controller(faulty, settings(PrefetchPolicy::WaitComplete), Arc::new(SystemClock::new()));
    rig.prefetch("r", &prompt, None).unwrap();
    rig.finish_prefetch("r");
    let done = prefetch_result(&mut rig, "r");
    let fetched = done.host_pages.len();
    assert_eq!(fetched, 1, "the page after the failed one is not counted although it may have been read");
    assert_eq!(done.explanation.stop, PrefetchStop::Failed);
    // the failure stays typed up to the engine: the page, and the backend's kind for it
    let failure = done.explanation.error.as_ref().expect("the read failure is explained");
    assert_eq!(failure.page_kind(), Some(FailureKind::Injected), "{failure}");
    assert!(
        matches!(failure, StorageFailure::Page { key, .. } if *key == page_keys(&prompt, PAGE, None, PartialPage::Reject).unwrap()[1]),
        "{failure}"
    );
    assert!(failure.to_string().contains("page"), "{failure}");
    let page_bytes = rig.engine().host_map().page_bytes();
    assert_eq!(host_bytes(&rig, &done.host_pages), expected[..fetched * page_bytes]);
    tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
    assert_eq!(rig.host().available(), HOST_PAGES - fetched);
}

#[test]
fn a_page_evicted_between_exists_and_get_does_not_shift_later_pages() {
    // docs/sglang.md#fixed-7: SGLang's 3FS get slices destinations by found-key position
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 9, 6);
    let faulty = Arc::new(FaultyStorage::new(
        memory(&store, 0, 1),
        FaultPlan { evict_after_exists: true, ..FaultPlan::default() },
    ));
    let mut rig = controller(faulty, settings(PrefetchPolicy::WaitComplete), Arc::new(SystemClock::new()));
    rig.prefetch("r", &prompt, None).unwrap();
    rig.finish_prefetch("r");
    let done = prefetch_result(&mut rig, "r");
    // the first key of each exists batch vanished before the read: the fetch stops there, nothing shifted
    let page_bytes = rig.engine().host_map().page_bytes();
    assert_eq!(done.explanation.stop, PrefetchStop::Failed);
    assert_eq!(host_bytes(&rig, &done.host_pages), expected[..done.host_pages.len() * page_bytes]);
}

#[test]
fn every_write_policy_reaches_storage_including_write_back() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    // docs/sglang.md#fixed-3: SGLang's write_back never writes to storage
    let store = MemoryStore::new();
    let mut rig =
        controller(Arc::new(memory(&store, 0, 1)), settings(PrefetchPolicy::BestEffort), Arc::new(SystemClock::new()));
    // write_back: the write happens at device eviction, and the eviction takes every ack at once
    let prompt = tokens(10, 3);
    let keys = page_keys(&prompt, PAGE, None, PartialPage::Reject).unwrap();
    let slots = device.alloc_pages(3).unwrap();
    let pages = rig.write(&slots, NodeId(4), Some(&keys)).unwrap().unwrap();
    let acks = rig.take_all_write_acks().unwrap();
    assert!(acks[0].storage_op.is_some());
    rig.evict_device(&pages).unwrap();
    device.free(&slots).unwrap();
    let error = rig.evict_host(&pages).unwrap_err().to_string();
    assert!(error.contains("pinned"), "pages being written to storage are not evictable: {error}");
    assert!(rig.is_pinned(&pages));
    let reports = tick_until(&mut rig, |_, reports| reports.iter().any(|report| !report.backups.is_empty()));
    let backup = &reports.iter().flat_map(|report| &report.backups).next().unwrap();
    assert_eq!(backup.node_ids, [NodeId(4)]);
    assert!(!rig.is_pinned(&pages));
    rig.evict_host(&pages).unwrap();
    let reader = memory(&store, 0, 1);
    assert_eq!(reader.batch_exists(&keys).unwrap(), 3);
}

#[test]
fn backups_record_each_page_and_go_on_past_a_failure() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    // docs/sglang.md#fixed-27: SGLang stops at the first failed batch and records nothing
    let store = MemoryStore::new();
    let faulty = Arc::new(FaultyStorage::new(memory(&store, 0, 1), FaultPlan::default()));
    let mut rig = controller(faulty.clone(), settings(PrefetchPolicy::BestEffort), Arc::new(SystemClock::new()));
    let prompt = tokens(11, 6);
    let keys = page_keys(&prompt, PAGE, None, PartialPage::Reject).unwrap();
    let slots = device.alloc_pages(6).unwrap();
    // the backup's calls are the 1st, 2nd and 3rd batch_set; fail the second as a whole
    faulty.set_plan(FaultPlan { fail_call: Some(faulty.calls() + 2), ..FaultPlan::default() });
    rig.write(&slots, NodeId(1), Some(&keys)).unwrap().unwrap();
    let reports = tick_until(&mut rig, |_, reports| reports.iter().any(|report| !report.backups.is_empty()));
    let backup = reports.iter().flat_map(|report| &report.backups).next().unwrap();
    let stored: Vec<bool> = backup.pages.iter().map(|page| *page == PageBackup::Stored).collect();
    assert_eq!(stored, [true, true, false, false, true, true]);
    let PageBackup::Failed(failure) = &backup.pages[2] else { panic!("{:?}", backup.pages[2]) };
    // a whole call failed: its error kind, not a page's
    assert_eq!((failure.kind(), failure.page_kind()), (ErrorKind::Storage, None), "{failure}");
    assert!(failure.to_string().contains("injected failure"), "{failure}");
    let reader = memory(&store, 0, 1);
    let present: Vec<bool> = keys.iter().map(|key| reader.exists(key).unwrap()).collect();
    assert_eq!(present, stored);
}

#[test]
fn mla_ranks_other_than_zero_skip_the_write_and_ack_at_once() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let store = MemoryStore::new();
    let mut skip = settings(PrefetchPolicy::BestEffort);
    skip.backup_skip = true;
    let mut rig = controller(Arc::new(memory(&store, 1, 2)), skip, Arc::new(SystemClock::new()));
    let prompt = tokens(12, 2);
    let keys = page_keys(&prompt, PAGE, None, PartialPage::Reject).unwrap();
    let slots = device.alloc_pages(2).unwrap();
    rig.write(&slots, NodeId(1), Some(&keys)).unwrap().unwrap();
    let report = rig.tick(&mut SingleRank).unwrap();
    assert_eq!(report.write_acks.len(), 1);
    let report = rig.tick(&mut SingleRank).unwrap();
    assert_eq!(report.backups[0].pages, [PageBackup::Skipped, PageBackup::Skipped]);
    assert!(store.is_empty());
}

#[test]
fn an_aborted_prefetch_keeps_nothing_and_returns_every_page() {
    let store = MemoryStore::new();
    let (prompt, _) = seed_storage(&store, 13, 6);
    let gated = Arc::new(Gated::new(memory(&store, 0, 1)));
    let mut rig = controller(gated.clone(), settings(PrefetchPolicy::WaitComplete), Arc::new(SystemClock::new()));
    rig.prefetch("r", &prompt, None).unwrap();
    gated.open(1);
    tick_until(&mut rig, |rig, _| rig.prefetch_progress("r") == Some(2 * PAGE));
    assert!(rig.abort_prefetch("r"));
    let done = prefetch_result(&mut rig, "r");
    assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::Aborted, 0));
    assert_eq!(done.explanation.local_fetched_tokens, 2 * PAGE);
    assert!(!rig.abort_prefetch("r"), "gone");
    gated.open(10);
    tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
    assert_eq!(rig.host().available(), HOST_PAGES);
}

#[test]
fn the_agreed_leading_hit_is_read_while_the_query_goes_on() {
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 17, 7);
    let page_bytes = {
        let rig = controller(
            Arc::new(memory(&store, 0, 1)),
            settings(PrefetchPolicy::WaitComplete),
            Arc::new(SystemClock::new()),
        );
        rig.engine().host_map().page_bytes()
    };
    for ending in ["complete", "abort", "reset"] {
        let gated = Arc::new(Gated::with_query_gate(memory(&store, 0, 1)));
        let mut rig = controller(gated.clone(), settings(PrefetchPolicy::WaitComplete), Arc::new(SystemClock::new()));
        gated.open(100);
        rig.prefetch("r", &prompt, None).unwrap();
        // one batch of two pages answered (the threshold): its pages are reserved and read, the query waits
        gated.open_queries(1);
        tick_until(&mut rig, |rig, _| rig.prefetch_progress("r") == Some(2 * PAGE));
        assert_eq!(rig.host().available(), HOST_PAGES - 2, "{ending}: only the agreed pages are reserved");
        match ending {
            "complete" => {
                gated.open_queries(1);
                tick_until(&mut rig, |rig, _| rig.prefetch_progress("r") == Some(4 * PAGE));
                gated.open_queries(10);
                rig.finish_prefetch("r");
                let done = prefetch_result(&mut rig, "r");
                assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::Complete, 7));
                assert_eq!(done.explanation.tp_min_hit_tokens, 7 * PAGE);
                assert_eq!(host_bytes(&rig, &done.host_pages), expected[..7 * page_bytes]);
                rig.evict_host(&done.host_pages).unwrap();
            }
            "abort" => {
                assert!(rig.abort_prefetch("r"));
                gated.open_queries(10);
                let done = prefetch_result(&mut rig, "r");
                assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::Aborted, 0));
                tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
            }
            _ => {
                // the query thread still waits; reset must not wait for reads that were never queued
                let opener = {
                    let gated = gated.clone();
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_millis(20));
                        gated.open_queries(10);
                    })
                };
                rig.reset();
                opener.join().unwrap();
            }
        }
        assert_eq!(rig.host().available(), HOST_PAGES, "{ending}");
        assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0, "{ending}");
        rig.host().check_invariants().unwrap();
    }
}

#[test]
fn a_hit_query_that_hangs_does_not_hold_up_best_effort_or_timeout() {
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 18, 6);
    let page_bytes =
        controller(Arc::new(memory(&store, 0, 1)), settings(PrefetchPolicy::BestEffort), Arc::new(SystemClock::new()))
            .engine()
            .host_map()
            .page_bytes();
    for (policy, answered) in [
        (PrefetchPolicy::BestEffort, 0),
        (PrefetchPolicy::BestEffort, 1),
        (PrefetchPolicy::Timeout, 0),
        (PrefetchPolicy::Timeout, 1),
    ] {
        // the storage answers `answered` query batches of two pages, then hangs (a stuck mount)
        let gated = Arc::new(Gated::with_query_gate(memory(&store, 0, 1)));
        gated.open(100);
        let clock = Arc::new(ManualClock::new());
        let mut rig = controller(gated.clone(), settings(policy), clock.clone());
        rig.prefetch("r", &prompt, None).unwrap();
        gated.open_queries(answered);
        if answered > 0 {
            tick_until(&mut rig, |rig, _| rig.prefetch_progress("r") == Some(2 * PAGE));
        }
        rig.finish_prefetch("r");
        if policy == PrefetchPolicy::Timeout {
            for _ in 0..10 {
                assert!(rig.tick(&mut SingleRank).unwrap().prefetches.is_empty(), "{policy}: before its limit");
            }
            clock.advance(Duration::from_secs(4));
        }
        let done = prefetch_result(&mut rig, "r");
        let stop = if policy == PrefetchPolicy::BestEffort { PrefetchStop::CutOff } else { PrefetchStop::TimedOut };
        assert_eq!((done.explanation.stop, done.host_pages.len()), (stop, 2 * answered), "{policy}, {answered}");
        assert_eq!(host_bytes(&rig, &done.host_pages), expected[..2 * answered * page_bytes]);
        tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
        rig.evict_host(&done.host_pages).unwrap();
        assert_eq!(rig.host().available(), HOST_PAGES);
        assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0);
        // the storage recovers: the query thread ends (and the controller can be dropped, joining it)
        gated.open_queries(100);
    }
}

/// Opens a gated storage's gates when dropped, so a failing test does not hang joining I/O threads held at a gate.
struct OpenGates(Arc<Gated>);

impl Drop for OpenGates {
    fn drop(&mut self) {
        self.0.open(1000);
        if self.0.queries.is_some() {
            self.0.open_queries(1000);
        }
    }
}

#[test]
fn a_stuck_read_or_query_costs_the_read_deadline_under_every_policy() {
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 19, 6);
    let page_bytes =
        controller(Arc::new(memory(&store, 0, 1)), settings(PrefetchPolicy::BestEffort), Arc::new(SystemClock::new()))
            .engine()
            .host_map()
            .page_bytes();
    // wait_complete would wait for ever on a stuck mount; the read deadline stops it. The others stop a stuck
    // read by their own rule once the scheduler asks; a stuck hit query is watched from the start.
    for (policy, stuck, stop) in [
        (PrefetchPolicy::WaitComplete, "read", PrefetchStop::Stalled),
        (PrefetchPolicy::WaitComplete, "query", PrefetchStop::Stalled),
        (PrefetchPolicy::Timeout, "read", PrefetchStop::TimedOut),
        (PrefetchPolicy::Timeout, "query", PrefetchStop::Stalled),
        (PrefetchPolicy::BestEffort, "read", PrefetchStop::CutOff),
        (PrefetchPolicy::BestEffort, "query", PrefetchStop::Stalled),
    ] {
        let what = format!("{policy}, stuck {stuck}");
        // the storage answers one read batch (two pages) or one query batch, then hangs (a stuck mount)
        let gated = Arc::new(if stuck == "query" {
            Gated::with_query_gate(memory(&store, 0, 1))
        } else {
            Gated::new(memory(&store, 0, 1))
        });
        if stuck == "query" {
            gated.open(100);
            gated.open_queries(1);
        } else {
            gated.open(1);
        }
        let clock = Arc::new(ManualClock::new());
        let mut rig = controller(gated.clone(), settings(policy), clock.clone());
        let _open = OpenGates(gated.clone());
        rig.prefetch("r", &prompt, None).unwrap();
        // the first batch has arrived; with the query let through, it has also reserved the whole hit (it may still
        // run when the first batch lands, and the next read starts only once it has)
        tick_until(&mut rig, |rig, _| {
            rig.prefetch_progress("r") == Some(2 * PAGE)
                && (stuck == "query" || rig.host().available() == HOST_PAGES - 6)
        });
        if stuck == "read" {
            // the next read batch is in flight, stuck (on a loaded machine the I/O thread may not have started it)
            gated.gets.await_caller();
        }
        // progress is seen at ticks: the deadline counts from the tick that saw the last change
        for _ in 0..3 {
            assert!(rig.tick(&mut SingleRank).unwrap().prefetches.is_empty(), "{what}");
        }
        if policy == PrefetchPolicy::WaitComplete {
            rig.finish_prefetch("r");
            clock.advance(Duration::from_secs(29));
            for _ in 0..10 {
                assert!(rig.tick(&mut SingleRank).unwrap().prefetches.is_empty(), "{what}: before the deadline");
            }
        }
        clock.advance(Duration::from_secs(31));
        let mut early: Vec<PrefetchDone> = Vec::new();
        for _ in 0..3 {
            early.extend(rig.tick(&mut SingleRank).unwrap().prefetches);
        }
        rig.finish_prefetch("r");
        let done = early.pop().unwrap_or_else(|| prefetch_result(&mut rig, "r"));
        assert_eq!((done.explanation.stop, done.host_pages.len()), (stop, 2), "{what}");
        assert_eq!(host_bytes(&rig, &done.host_pages), expected[..2 * page_bytes], "{what}");
        rig.evict_host(&done.host_pages).unwrap();
        if stuck == "read" {
            // the stuck read still holds its pages: they come back only when it returns
            for _ in 0..5 {
                rig.tick(&mut SingleRank).unwrap();
            }
            assert!(rig.host().available() < HOST_PAGES, "{what}: pages freed under a read in flight");
            gated.open(100);
        } else {
            gated.open_queries(100);
        }
        tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
        assert_eq!(rig.host().available(), HOST_PAGES, "{what}");
        assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0, "{what}");
        rig.host().check_invariants().unwrap();
    }
}

#[test]
fn reset_waits_for_storage_io_and_leaves_nothing_behind() {
    // docs/sglang.md#fixed-14: SGLang's reset neither joins its I/O thread nor clears its storage records
    let store = MemoryStore::new();
    let (prompt, _) = seed_storage(&store, 14, 6);
    let gated = Arc::new(Gated::new(memory(&store, 0, 1)));
    let mut rig = controller(gated.clone(), settings(PrefetchPolicy::WaitComplete), Arc::new(SystemClock::new()));
    rig.prefetch("r", &prompt, None).unwrap();
    gated.open(1);
    tick_until(&mut rig, |rig, _| rig.prefetch_progress("r") == Some(2 * PAGE));
    // the fetch thread must be inside its next read (at the gate) before the reset, or the reset may stop the
    // prefetch before that read starts and return at once
    tick_until(&mut rig, |_, _| gated.gets.waiting.load(Ordering::SeqCst) > 0);
    let opened = Arc::new(AtomicBool::new(false));
    let opener = {
        let (gated, opened) = (gated.clone(), opened.clone());
        std::thread::spawn(move || {
            // (time for a reset that does not wait to return first; a slow machine only makes the test weaker)
            std::thread::sleep(Duration::from_millis(50));
            opened.store(true, Ordering::SeqCst);
            gated.open(1);
        })
    };
    rig.reset(); // the fetch thread is inside a read: reset waits for it
    assert!(opened.load(Ordering::SeqCst), "reset returned while the reader held host pages");
    opener.join().unwrap();
    assert_eq!((rig.prefetches_in_flight(), rig.host().available()), (0, HOST_PAGES));
    assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0);
    assert!(!rig.prefetch_pending("r"));
    // and the controller works as new
    gated.open(100);
    rig.prefetch("r", &prompt, None).unwrap();
    rig.finish_prefetch("r");
    assert_eq!(prefetch_result(&mut rig, "r").host_pages.len(), 6);
}

#[test]
fn host_eviction_on_demand_makes_room_for_a_hit() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let store = MemoryStore::new();
    let (prompt, _) = seed_storage(&store, 15, 6);
    let mut rig = controller(
        Arc::new(memory(&store, 0, 1)),
        settings(PrefetchPolicy::WaitComplete),
        Arc::new(SystemClock::new()),
    );
    // fill the host pool with backed-up pages the callback may evict
    let mut evictable = fill_host_pool(&mut rig, &mut device, 2);
    rig.prefetch("r", &prompt, None).unwrap();
    rig.finish_prefetch("r");
    let mut asked = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let done = loop {
        let report = rig
            .tick_with(&mut SingleRank, &mut |rig, pages| {
                asked.push(pages);
                let victims: Vec<HostPageId> = evictable.drain(..pages).collect();
                rig.evict_host(&victims).unwrap();
            })
            .unwrap();
        if let Some(done) = report.prefetches.into_iter().next() {
            break done;
        }
        assert!(Instant::now() < deadline);
    };
    assert_eq!(asked, [4], "6 pages needed, 2 free");
    assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::Complete, 6));
}

#[test]
fn a_host_pool_too_small_for_the_hit_keeps_what_fits_and_says_why() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 16, 10);
    let mut rig = controller(
        Arc::new(memory(&store, 0, 1)),
        settings(PrefetchPolicy::WaitComplete),
        Arc::new(SystemClock::new()),
    );
    // two device-pool-fulls of synced pages leave 8 host pages, too few for the 10-page hit, and nothing evictable
    for node in 1..=2 {
        let slots = device.alloc_pages(DEVICE_PAGES).unwrap();
        rig.write(&slots, NodeId(node), None).unwrap().unwrap();
        rig.take_all_write_acks().unwrap();
        device.free(&slots).unwrap();
    }
    assert_eq!(rig.host().available(), HOST_PAGES - 2 * DEVICE_PAGES);
    rig.prefetch("r", &prompt, None).unwrap();
    rig.finish_prefetch("r");
    let done = prefetch_result(&mut rig, "r");
    assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::HostPoolFull, 8));
    assert_eq!((done.explanation.tp_min_hit_tokens, done.explanation.reserved_tokens), (10 * PAGE, 8 * PAGE));
    assert_eq!(host_bytes(&rig, &done.host_pages), expected[..8 * rig.engine().host_map().page_bytes()]);
    rig.evict_host(&done.host_pages).unwrap();

    // with fewer free pages than the threshold, nothing is reserved at all
    let slots = device.alloc_pages(7).unwrap();
    rig.write(&slots, NodeId(3), None).unwrap().unwrap();
    rig.take_all_write_acks().unwrap();
    assert_eq!(rig.host().available(), 1);
    rig.prefetch("s", &prompt, None).unwrap();
    let done = prefetch_result(&mut rig, "s");
    assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::HostPoolFull, 0));
    assert_eq!(rig.host().available(), 1);
    assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0);
}

/// Settings that fetch by cost, with these priors (storage bytes per second, prefill tokens per second).
fn by_cost(policy: PrefetchPolicy, storage_read_bytes_per_s: f64, prefill_tokens_per_s: f64) -> StorageSettings {
    StorageSettings {
        by_cost: true,
        split: false,
        meet: false,
        priors: hicache_core::cost::Priors {
            storage_read_bytes_per_s: Some(storage_read_bytes_per_s),
            storage_call_s: 0.0,
            load_bytes_per_s: 1e10,
            prefill_tokens_per_s: Some(prefill_tokens_per_s),
        },
        ..settings(policy)
    }
}

#[test]
fn a_hit_slower_to_read_than_to_compute_is_not_fetched_and_a_fast_one_is_fetched_whole() {
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 11, 6);
    // 6 pages of 128 bytes at 1 kB/s: 0.77 s to read; 24 tokens at a million tokens/s: 24 µs to compute
    let storage = Arc::new(FaultyStorage::new(memory(&store, 0, 1), FaultPlan::default()));
    let mut rig =
        controller(storage.clone(), by_cost(PrefetchPolicy::WaitComplete, 1e3, 1e6), Arc::new(SystemClock::new()));
    rig.prefetch("slow", &prompt, None).unwrap();
    rig.finish_prefetch("slow");
    let done = prefetch_result(&mut rig, "slow");
    assert_eq!(done.explanation.stop, PrefetchStop::RecomputeFaster);
    assert_eq!((done.explanation.tp_min_hit_tokens, done.host_pages.len()), (6 * PAGE, 0));
    let plan = done.explanation.plan.expect("a plan was made");
    assert_eq!((plan.fetch_pages, plan.reason), (0, hicache_core::cost::PlanReason::RecomputeFaster));
    assert!(plan.recompute < plan.fetch_all, "{plan:?}");
    assert_eq!(storage.stats().get_hits, 0, "nothing was read");
    assert_eq!(rig.host().available(), HOST_PAGES);
    assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0);

    // the same hit, with storage at 1 GB/s and compute at a thousand tokens/s: all of it, byte for byte
    let mut rig =
        controller(storage.clone(), by_cost(PrefetchPolicy::WaitComplete, 1e9, 1e3), Arc::new(SystemClock::new()));
    rig.prefetch("fast", &prompt, None).unwrap();
    rig.finish_prefetch("fast");
    let done = prefetch_result(&mut rig, "fast");
    assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::Complete, 6));
    assert_eq!(done.explanation.plan.map(|plan| plan.reason), Some(hicache_core::cost::PlanReason::FetchAll));
    assert_eq!(host_bytes(&rig, &done.host_pages), expected);
    assert!(done.explanation.read_time > Duration::ZERO);
}

#[test]
fn without_a_compute_rate_a_hit_is_fetched_whole_and_the_engine_report_gives_one() {
    let store = MemoryStore::new();
    let (prompt, _) = seed_storage(&store, 12, 6);
    let mut settings = by_cost(PrefetchPolicy::WaitComplete, 1e3, 1.0);
    settings.priors.prefill_tokens_per_s = None;
    let mut rig = controller(Arc::new(memory(&store, 0, 1)), settings, Arc::new(SystemClock::new()));
    rig.prefetch("unknown", &prompt, None).unwrap();
    rig.finish_prefetch("unknown");
    let done = prefetch_result(&mut rig, "unknown");
    assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::Complete, 6));
    assert_eq!(done.explanation.plan.map(|plan| plan.reason), Some(hicache_core::cost::PlanReason::Unmeasured));
    rig.evict_host(&done.host_pages).unwrap();
    // the engine reports its prefill (4096 tokens in 100 µs); the next tick agrees on it
    rig.observe_prefill(4096, 0, Duration::from_micros(100));
    rig.tick(&mut SingleRank).unwrap();
    let rates = rig.agreed_rates().unwrap();
    let tokens_per_s = 1.0 / rates.prefill_s_per_token.expect("reported");
    assert!((tokens_per_s / 40.96e6 - 1.0).abs() < 1e-3, "{rates:?}");
}

#[test]
fn the_scheduler_stops_waiting_for_pages_that_compute_faster_than_they_arrive() {
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 13, 6);
    let gated = Arc::new(Gated::new(memory(&store, 0, 1)));
    // the priors say storage is fast (1 GB/s against a million tokens/s): the whole hit is reserved
    let mut rig =
        controller(gated.clone(), by_cost(PrefetchPolicy::WaitComplete, 1e9, 1e6), Arc::new(SystemClock::new()));
    rig.prefetch("r", &prompt, None).unwrap();
    tick_until(&mut rig, |rig, _| rig.host().available() == HOST_PAGES - 6);
    // the first batch (2 pages, 256 bytes) takes at least 50 ms: 5 kB/s at most, measured
    gated.gets.await_caller();
    std::thread::sleep(Duration::from_millis(50));
    gated.open(1);
    tick_until(&mut rig, |rig, _| rig.prefetch_progress("r") == Some(2 * PAGE));
    // the fetch thread waits at the gate with the second batch; the request is wanted now, and the 4 pages left
    // would take 100 ms to read against 16 µs to compute: stop waiting, keep the 2 that came
    rig.finish_prefetch("r");
    let done = prefetch_result(&mut rig, "r");
    assert_eq!(done.explanation.stop, PrefetchStop::RecomputeFaster);
    assert_eq!((done.host_pages.len(), done.explanation.fetched_tokens), (2, 2 * PAGE));
    assert_eq!(host_bytes(&rig, &done.host_pages), expected[..2 * rig.engine().host_map().page_bytes()]);
    let rates = rig.agreed_rates().unwrap();
    assert!(rates.storage_read_bytes_per_s.unwrap() < 6e3, "the measured rate replaced the prior: {rates:?}");
    // the tail comes back once the reader is done with it
    gated.open(10);
    tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
    assert_eq!(rig.host().available(), HOST_PAGES - 2);
    rig.host().check_invariants().unwrap();
    assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0);
}

#[test]
fn a_split_waits_for_a_tail_whose_reads_are_expected_to_end_soon() {
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 14, 6);
    // (clock time the engine spent on the head before it asks for the request, whether the scheduler stops waiting)
    let cases = [
        // after 3.9 s of the 4 the tail's read is expected to take, 0.1 s is left against 2 s to compute it
        (Duration::from_millis(3900), false),
        // at once, the whole 4 s is
        (Duration::ZERO, true),
        // 0.1 s overdue: expected within 0.1 s more
        (Duration::from_millis(4100), false),
        // 3 s overdue: as much again, against 2 s to compute
        (Duration::from_secs(7), true),
        // 20 s overdue: no more than a whole read (4 s)
        (Duration::from_secs(24), true),
    ];
    for (head_time, stops) in cases {
        let gated = Arc::new(Gated::new(memory(&store, 0, 1)));
        let clock = Arc::new(ManualClock::new());
        let page_bytes = controller(gated.clone(), settings(PrefetchPolicy::WaitComplete), clock.clone())
            .engine()
            .host_map()
            .page_bytes();
        // a page reads in 2 s and computes in 1 s: the plan computes 4 pages while the other 2 are read, 4 s each
        let mut settings = by_cost(PrefetchPolicy::WaitComplete, page_bytes as f64 / 2.0, PAGE as f64);
        settings.split = true;
        let mut rig = controller(gated.clone(), settings, clock.clone());
        rig.prefetch("r", &prompt, None).unwrap();
        assert_eq!(rig.prefetch_head("r"), PrefetchHead::NotPlanned);
        tick_until(&mut rig, |rig, _| rig.prefetch_head("r") != PrefetchHead::NotPlanned);
        assert_eq!(rig.prefetch_head("r"), PrefetchHead::Compute(4 * PAGE));
        gated.gets.await_caller();
        clock.advance(head_time);
        rig.finish_prefetch("r");
        if stops {
            let done = prefetch_result(&mut rig, "r");
            assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::RecomputeFaster, 0));
            gated.open(10);
            tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
        } else {
            rig.tick(&mut SingleRank).unwrap();
            assert_eq!(rig.prefetch_head("r"), PrefetchHead::Compute(4 * PAGE), "still waiting for the tail");
            gated.open(10);
            let done = prefetch_result(&mut rig, "r");
            assert_eq!((done.explanation.stop, done.head_tokens), (PrefetchStop::Complete, 4 * PAGE));
            assert_eq!(done.explanation.plan.map(|plan| plan.reason), Some(hicache_core::cost::PlanReason::Split));
            assert_eq!(host_bytes(&rig, &done.host_pages), expected[4 * page_bytes..]);
        }
        assert_eq!(rig.host().available(), HOST_PAGES - if stops { 0 } else { 2 });
        rig.host().check_invariants().unwrap();
    }
}

#[test]
fn closing_leaves_a_storage_call_that_never_returns_and_the_pool_is_forgotten_once_it_does() {
    let store = MemoryStore::new();
    let (prompt, _) = seed_storage(&store, 15, 6);
    // with nothing in flight, closing forgets the host pool before it returns
    let gated = Arc::new(Gated::new(memory(&store, 0, 1)));
    let rig = controller(gated.clone(), settings(PrefetchPolicy::WaitComplete), Arc::new(SystemClock::new()));
    assert_eq!(gated.registered(), 1);
    drop(rig);
    assert_eq!(gated.registered(), 0);
    // the fetch thread is inside a get that does not return; closing waits the read deadline (2 s) for it
    let gated = Arc::new(Gated::new(memory(&store, 0, 1)));
    let settings = StorageSettings { read_deadline: Duration::from_secs(2), ..settings(PrefetchPolicy::WaitComplete) };
    let mut rig = controller(gated.clone(), settings, Arc::new(SystemClock::new()));
    rig.prefetch("r", &prompt, None).unwrap();
    tick_until(&mut rig, |rig, _| rig.host().available() == HOST_PAGES - 6);
    gated.gets.await_caller();
    let (closed, close) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(rig);
        closed.send(()).unwrap();
    });
    close.recv_timeout(Duration::from_secs(60)).expect("closing ends at its deadline");
    // the get in flight may still write into the host pool: the backend keeps it until the call returns
    assert_eq!(gated.registered(), 1);
    gated.open(10);
    gated.await_forgotten();
}

#[test]
fn reads_that_measure_the_tier_are_waited_for_no_longer_than_computing_what_they_bring() {
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 16, 6);
    // (clock time the reads took before the scheduler asks for the request, whether it stops waiting)
    for (reading, stops) in [(Duration::from_secs(4), false), (Duration::from_secs(8), true)] {
        let gated = Arc::new(Gated::new(memory(&store, 0, 1)));
        let clock = Arc::new(ManualClock::new());
        // a page computes in 1 s; the tier's read rate is unknown, so the hit of 6 pages is fetched whole
        let mut settings = by_cost(PrefetchPolicy::WaitComplete, 1.0, PAGE as f64);
        settings.priors.storage_read_bytes_per_s = None;
        let mut rig = controller(gated.clone(), settings, clock.clone());
        rig.prefetch("r", &prompt, None).unwrap();
        tick_until(&mut rig, |rig, _| rig.host().available() == HOST_PAGES - 6);
        gated.gets.await_caller();
        clock.advance(reading);
        // wanted: the reads are expected to take as long again as they have, against 6 s to compute the hit
        rig.finish_prefetch("r");
        if stops {
            let done = prefetch_result(&mut rig, "r");
            assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::RecomputeFaster, 0));
            assert_eq!(done.explanation.plan.map(|plan| plan.reason), Some(hicache_core::cost::PlanReason::Unmeasured));
            gated.open(10);
            tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
        } else {
            let tick = rig.tick(&mut SingleRank).unwrap();
            assert!(tick.prefetches.is_empty(), "still waiting for the reads");
            gated.open(10);
            let done = prefetch_result(&mut rig, "r");
            assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::Complete, 6));
            assert_eq!(host_bytes(&rig, &done.host_pages), expected);
        }
        assert_eq!(rig.host().available(), HOST_PAGES - if stops { 0 } else { 6 });
        rig.host().check_invariants().unwrap();
    }
}

#[test]
fn reads_reserved_while_the_query_ran_are_kept_when_too_few_more_pages_fit() {
    // the agreed part was reserved from a nearly full pool (as many pages as the threshold) while the query ran;
    // when the whole hit is known and no more pages fit, those reads are resolved, never dropped with their pages
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let store = MemoryStore::new();
    let (prompt, expected) = seed_storage(&store, 19, 6);
    let gated = Arc::new(Gated::with_query_gate(memory(&store, 0, 1)));
    let mut rig = controller(gated.clone(), settings(PrefetchPolicy::WaitComplete), Arc::new(SystemClock::new()));
    gated.open(100);
    let owned = fill_host_pool(&mut rig, &mut device, 2);
    rig.prefetch("r", &prompt, None).unwrap();
    // one batch of two pages answered: the two free pages are reserved for it and read
    gated.open_queries(1);
    tick_until(&mut rig, |rig, _| rig.prefetch_progress("r") == Some(2 * PAGE));
    assert_eq!(rig.host().available(), 0);
    gated.open_queries(10);
    rig.finish_prefetch("r");
    let done = prefetch_result(&mut rig, "r");
    assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::HostPoolFull, 2));
    let page_bytes = rig.engine().host_map().page_bytes();
    assert_eq!(host_bytes(&rig, &done.host_pages), expected[..2 * page_bytes]);
    rig.evict_host(&done.host_pages).unwrap();
    tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
    assert_eq!(rig.host().available(), 2, "every reserved page came back");
    assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0);
    rig.host().check_invariants().unwrap();
    rig.evict_host(&owned).unwrap();
}

#[test]
fn a_pool_with_fewer_free_pages_than_the_threshold_reserves_nothing_while_the_query_runs() {
    // the agreed part reaches the threshold while the query runs, but the one free page does not: nothing is
    // reserved then, and the whole hit ends with nothing reserved, as it does when the query ends before a tick
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let store = MemoryStore::new();
    let (prompt, _) = seed_storage(&store, 20, 6);
    let gated = Arc::new(Gated::with_query_gate(memory(&store, 0, 1)));
    let _open = OpenGates(gated.clone());
    let mut rig = controller(gated.clone(), settings(PrefetchPolicy::WaitComplete), Arc::new(SystemClock::new()));
    gated.open(100);
    let owned = fill_host_pool(&mut rig, &mut device, 1);
    rig.prefetch("r", &prompt, None).unwrap();
    // the first batch of two pages is answered and the query waits before its second: every tick now sees the
    // agreed two pages
    gated.open_queries(1);
    gated.queries.as_ref().expect("a query gate").await_held_caller();
    for _ in 0..3 {
        let report = rig.tick(&mut SingleRank).unwrap();
        assert!(report.prefetches.is_empty());
    }
    assert_eq!(rig.host().available(), 1, "a read shorter than the threshold was reserved");
    gated.open_queries(10);
    let done = prefetch_result(&mut rig, "r");
    assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::HostPoolFull, 0));
    assert_eq!((done.explanation.tp_min_hit_tokens, done.explanation.reserved_tokens), (6 * PAGE, 0));
    assert_eq!(rig.host().available(), 1);
    assert_eq!(rig.prefetch_capacity().unwrap().occupied(), 0);
    rig.host().check_invariants().unwrap();
    rig.evict_host(&owned).unwrap();
}

/// A rig of a trailing-window pool's rank (a window of 2 pages) over a storage whose existence checks wait at a
/// gate, and a prompt of 8 pages it holds (`seed`'s).
fn trailing_window_rig(seed: u32, clock: Arc<dyn Clock>) -> (Rig, Arc<Gated>, Vec<u32>) {
    let store = MemoryStore::new();
    let (prompt, _) = seed_storage(&store, seed, 8);
    let gated = Arc::new(Gated::with_query_gate(memory(&store, 0, 1)));
    let trailing = hicache_core::controller::Trailing { window: std::num::NonZeroUsize::new(2).unwrap(), pool: true };
    let settings = StorageSettings { trailing: Some(trailing), ..settings(PrefetchPolicy::WaitComplete) };
    (controller(gated.clone(), settings, clock), gated, prompt)
}

/// A trailing-window pool's hit query asks storage for every page, a batch per call; a prefetch aborted while the
/// query runs stops it before its next batch (as the query of a model without a window stops).
#[test]
fn an_aborted_trailing_window_query_asks_no_further_batch() {
    let (mut rig, gated, prompt) = trailing_window_rig(23, Arc::new(SystemClock::new()));
    let _open = OpenGates(gated.clone());
    rig.prefetch("r", &prompt, None).unwrap();
    // the query's first page waits at the gate (storage is asked a page at a time within a batch of 2)
    let gate = gated.queries.as_ref().expect("a query gate");
    gate.await_caller();
    assert!(rig.abort_prefetch("r"));
    const OPENED: usize = 100;
    gated.open_queries(OPENED);
    let done = prefetch_result(&mut rig, "r");
    assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::Aborted, 0));
    // the one query thread takes its jobs in order: once a later query has ended, so has the aborted one
    rig.prefetch("later", &tokens(24, 2), None).unwrap();
    prefetch_result(&mut rig, "later");
    tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
    let asked = OPENED - *gate.allowed.lock().unwrap();
    assert_eq!(asked, 2 + 2, "the aborted query's first batch of 2 pages (not all 8), then the later query's 2");
}

/// A trailing-window pool's query answers whole at its end; while it runs, each batch it asks shows progress, so a
/// slow query whose every batch comes within the read deadline is not taken for a stuck one, however long it runs.
#[test]
fn a_slow_trailing_window_query_that_progresses_is_not_stalled() {
    let clock = Arc::new(ManualClock::new());
    let (mut rig, gated, prompt) = trailing_window_rig(25, clock.clone());
    let _open = OpenGates(gated.clone());
    gated.open(100);
    let gate = gated.queries.as_ref().expect("a query gate");
    // the query waits at the gate for a batch's first page, every page let through before it taken
    let await_next_batch = || {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(*gate.allowed.lock().unwrap() == 0 && gate.waiting.load(Ordering::SeqCst) == 1) {
            assert!(Instant::now() < deadline, "the query did not reach its next batch");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    rig.prefetch("r", &prompt, None).unwrap();
    // four batches of two pages, 20 s apart: 80 s in all, against a read deadline of 30 s
    for batch in 0..4 {
        await_next_batch();
        for _ in 0..3 {
            assert!(rig.tick(&mut SingleRank).unwrap().prefetches.is_empty(), "batch {batch}");
        }
        clock.advance(Duration::from_secs(20));
        gated.open_queries(2);
    }
    rig.finish_prefetch("r");
    let done = prefetch_result(&mut rig, "r");
    assert_eq!((done.explanation.stop, done.host_pages.len()), (PrefetchStop::Complete, 8));
    rig.evict_host(&done.host_pages).unwrap();
    tick_until(&mut rig, |rig, _| rig.prefetches_in_flight() == 0);
}
