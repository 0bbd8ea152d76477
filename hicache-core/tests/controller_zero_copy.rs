//! The storage threads work in the host pool in place, under leases: a page lent for a backup cannot be written or
//! freed until the lease returns; a page lent for a fetch is not readable until its fetch is counted; the backend is
//! told about the host pool once and sees segments inside it; no byte is staged.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use hicache_core::collective::SingleRank;
use hicache_core::config::PrefetchPolicy;
use hicache_core::controller::{CacheController, PageBackup, StorageSettings};
use hicache_core::device_slots::{DeviceSlotAllocator as _, PagedSlots};
use hicache_core::error::Error;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PageKey, PartialPage, page_keys};
use hicache_core::host_memory::{Access, MemoryRegion};
use hicache_core::host_pool::HostPageId;
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{
    GetOutcome, MemoryStorage, MemoryStore, PageSegments, PageSegmentsMut, SetOutcome, StorageBackend, StorageStats,
};
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap, TransferEngine};
use hicache_core::tree::NodeId;
use hicache_core::{HiCacheBuilder, HiCacheConfig};
use rand::RngExt as _;

const PAGE: usize = 4;
const LAYERS: usize = 2;
const DEVICE_PAGES: usize = 8;
const HOST_PAGES: usize = 24;

fn geometry() -> KvGeometry {
    KvGeometry::mha(LAYERS, 1, 4, KvDtype::Bf16).unwrap()
}

/// Which calls wait at the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    Gets,
    Sets,
}

#[derive(Debug, Default)]
struct GateState {
    /// Calls let through so far, and calls waiting now.
    allowed: usize,
    waiting: usize,
}

/// A backend over the in-memory one whose gets or sets wait until let through, one call per `open`; it records the
/// regions it is told about and checks that every segment it is given lies in one.
#[derive(Debug)]
struct Recording {
    inner: MemoryStorage,
    gate: Option<Gate>,
    state: Mutex<GateState>,
    changed: Condvar,
    regions: Mutex<Vec<MemoryRegion>>,
    registrations: Mutex<usize>,
    outside: Mutex<usize>,
}

impl Recording {
    fn new(inner: MemoryStorage, gate: Option<Gate>) -> Self {
        Self {
            inner,
            gate,
            state: Mutex::default(),
            changed: Condvar::new(),
            regions: Mutex::default(),
            registrations: Mutex::new(0),
            outside: Mutex::new(0),
        }
    }

    fn pass(&self, gate: Gate) {
        if self.gate != Some(gate) {
            return;
        }
        let mut state = self.state.lock().unwrap();
        state.waiting += 1;
        self.changed.notify_all();
        while state.allowed == 0 {
            state = self.changed.wait(state).unwrap();
        }
        state.allowed -= 1;
        state.waiting -= 1;
    }

    fn open(&self) {
        self.state.lock().unwrap().allowed += 1;
        self.changed.notify_all();
    }

    fn wait_for_a_waiting_call(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut state = self.state.lock().unwrap();
        while state.waiting == 0 {
            assert!(Instant::now() < deadline, "no call reached the gate");
            state = self.changed.wait_timeout(state, Duration::from_millis(10)).unwrap().0;
        }
    }

    fn check_inside<'a>(&self, segments: impl Iterator<Item = (usize, usize)> + 'a) {
        let regions = self.regions.lock().unwrap();
        let outside =
            segments.filter(|&(address, len)| !regions.iter().any(|region| region.contains(address, len))).count();
        *self.outside.lock().unwrap() += outside;
    }
}

impl StorageBackend for Recording {
    fn name(&self) -> &str {
        "recording"
    }

    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
        self.inner.batch_exists(keys)
    }

    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
        self.check_inside(pages.iter().flatten().map(|segment| (segment.as_ptr() as usize, segment.len())));
        self.pass(Gate::Gets);
        self.inner.batch_get(keys, pages)
    }

    fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
        self.check_inside(pages.iter().flatten().map(|segment| (segment.as_ptr() as usize, segment.len())));
        self.pass(Gate::Sets);
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

    fn register_host_memory(&self, region: &MemoryRegion) -> Result<(), Error> {
        *self.registrations.lock().unwrap() += 1;
        self.regions.lock().unwrap().push(region.clone());
        Ok(())
    }

    fn unregister_host_memory(&self, region: &MemoryRegion) {
        self.regions.lock().unwrap().retain(|known| known != region);
    }
}

fn settings() -> StorageSettings {
    StorageSettings {
        page_size: PAGE,
        batch_pages: 2,
        prefetch_threshold: PAGE,
        policy: PrefetchPolicy::WaitComplete,
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

type Rig = CacheController<CpuEngine>;

fn controller(storage: Arc<dyn StorageBackend>) -> Rig {
    let device = DeviceLayoutMap::new(geometry(), DEVICE_PAGES * PAGE).unwrap();
    let host = HostLayoutMap::new(geometry(), HostLayout::LayerFirst, PAGE, HOST_PAGES).unwrap();
    let engine = CpuEngine::new(device, host, Completion::Immediate).unwrap();
    engine.with_device(|bytes| rand::rng().fill(bytes));
    HiCacheBuilder::new(
        HiCacheConfig { page_size: PAGE, mem_layout: HostLayout::LayerFirst, ..HiCacheConfig::default() },
        engine,
    )
    .with_storage(storage)
    .with_storage_settings(settings())
    .build_controller()
    .unwrap()
}

fn namespace() -> StorageNamespace {
    StorageNamespace::single_rank("zero-copy-test", geometry(), HostLayout::LayerFirst, PAGE)
}

fn tokens(seed: u32, pages: usize) -> Vec<u32> {
    (0..(pages * PAGE) as u32).map(|index| seed.wrapping_mul(7_919).wrapping_add(index)).collect()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not after 10 s");
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn a_page_lent_for_a_backup_is_neither_written_nor_freed_until_the_lease_returns() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let store = MemoryStore::new();
    let storage = Arc::new(Recording::new(MemoryStorage::shared(store.clone(), &namespace()), Some(Gate::Sets)));
    let mut rig = controller(storage.clone());
    let keys = page_keys(&tokens(1, 2), PAGE, None, PartialPage::Reject).unwrap();
    let slots = device.alloc_pages(2).unwrap();
    let pages = rig.write(&slots, NodeId(1), Some(&keys)).unwrap().unwrap();
    let backed_up = rig.engine().host_memory().copy_pages_out(&pages).unwrap();
    rig.tick(&mut SingleRank).unwrap(); // the write's ack: the backup to storage starts
    storage.wait_for_a_waiting_call();

    let memory = rig.engine().host_memory();
    assert_eq!(memory.lent(&pages).map(|(_, how)| how), Some(Access::Read));
    let refused = memory.lend_write(&pages).unwrap_err().to_string();
    assert!(refused.contains("lent for reading"), "{refused}");
    // the device copy may go (the host copy stays), but the host page may not be freed
    rig.evict_device(&pages).unwrap();
    device.free(&slots).unwrap();
    assert!(rig.evict_host(&pages).is_err(), "freed under a backup");
    // a writer that waits (as the CPU engine's copies do) gets the page only after the backup returned it
    let (granted, seen) = std::sync::mpsc::channel();
    let writer = std::thread::spawn({
        let memory = memory.clone();
        let first = pages[0];
        move || {
            let mut lease = memory.lend_write_waiting(&[first]).unwrap();
            granted.send(()).unwrap();
            lease.pages_mut()[0][0][0] ^= 0xff;
        }
    });
    assert!(seen.recv_timeout(Duration::from_millis(50)).is_err(), "written while lent for a backup");
    storage.open();
    seen.recv_timeout(Duration::from_secs(10)).expect("granted once the backup returned the lease");
    writer.join().unwrap();
    wait_until("backup taken", || {
        rig.tick(&mut SingleRank)
            .unwrap()
            .backups
            .iter()
            .any(|backup| backup.pages == vec![PageBackup::Stored, PageBackup::Stored])
    });
    rig.evict_host(&pages).unwrap();
    assert_eq!(*storage.outside.lock().unwrap(), 0, "every segment was inside the registered host pool");
    // what storage holds is what the pool held while lent, not what was written after
    let mut got = vec![0u8; backed_up.len()];
    let mut segments: Vec<Vec<&mut [u8]>> = got.chunks_mut(backed_up.len() / 2).map(|page| vec![page]).collect();
    assert_eq!(storage.batch_get(&keys, &mut segments).unwrap(), [GetOutcome::Hit, GetOutcome::Hit]);
    assert_eq!(got, backed_up);
    assert_eq!(*storage.outside.lock().unwrap(), 2, "a buffer of the test's own is outside it");
}

#[test]
fn a_page_lent_for_a_fetch_is_not_readable_until_its_fetch_is_counted() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let store = MemoryStore::new();
    let prompt = tokens(2, 4);
    let expected = {
        let mut writer = controller(Arc::new(MemoryStorage::shared(store.clone(), &namespace())));
        let keys = page_keys(&prompt, PAGE, None, PartialPage::Reject).unwrap();
        let slots = device.alloc_pages(4).unwrap();
        let pages = writer.write(&slots, NodeId(1), Some(&keys)).unwrap().unwrap();
        wait_until("stored", || !writer.tick(&mut SingleRank).unwrap().backups.is_empty());
        writer.engine().host_memory().copy_pages_out(&pages).unwrap()
    };
    let storage = Arc::new(Recording::new(MemoryStorage::shared(store, &namespace()), Some(Gate::Gets)));
    let mut rig = controller(storage.clone());
    rig.prefetch("r", &prompt, None).unwrap();
    wait_until("the fetch reached storage", || {
        rig.tick(&mut SingleRank).unwrap();
        storage.state.lock().unwrap().waiting > 0
    });
    let memory = rig.engine().host_memory();
    let all = memory.all_pages();
    assert_eq!(all.len(), HOST_PAGES);
    let lent: Vec<HostPageId> = all.iter().copied().filter(|&page| memory.lent(&[page]).is_some()).collect();
    assert_eq!(lent.len(), 2, "one batch of two pages is lent");
    assert!(lent.iter().all(|&page| memory.lent_for_writing(&[page]) == Some(page)));
    assert_eq!(rig.prefetch_progress("r"), Some(0));
    let refused = memory.lend_read(&lent).unwrap_err().to_string();
    assert!(refused.contains("lent for writing"), "{refused}");
    // the first batch arrives: once counted, its pages are readable and hold the stored bytes
    storage.open();
    wait_until("first batch counted", || rig.prefetch_progress("r") >= Some(2 * PAGE));
    let page_bytes = expected.len() / 4;
    assert_eq!(memory.copy_pages_out(&lent).unwrap(), expected[..2 * page_bytes]);
    storage.open();
    rig.finish_prefetch("r");
    let done = loop {
        let report = rig.tick(&mut SingleRank).unwrap();
        if let Some(done) = report.prefetches.into_iter().next() {
            break done;
        }
        std::thread::sleep(Duration::from_micros(200));
    };
    assert_eq!(memory.copy_pages_out(&done.host_pages).unwrap(), expected);
    assert_eq!(*storage.registrations.lock().unwrap(), 1, "the host pool is registered once");
    assert_eq!(*storage.outside.lock().unwrap(), 0, "every segment was inside the registered host pool");
    assert_eq!(storage.stats().staging_bytes, 0);
    drop(rig);
    assert!(storage.regions.lock().unwrap().is_empty(), "the controller's end unregisters the pool");
}
