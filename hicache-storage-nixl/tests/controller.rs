//! The controller's storage threads on NIXL: the host pool is registered once (not per batch), pages move straight
//! between it and the page files, and the registration ends with the controller.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use hicache_core::collective::SingleRank;
use hicache_core::config::PrefetchPolicy;
use hicache_core::controller::{CacheController, PageBackup, PrefetchStop, StorageSettings};
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PartialPage, page_keys};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::ops::NodeId;
use hicache_core::rate_limit::SystemClock;
use hicache_core::storage::StorageBackend;
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap, TransferEngine};
use hicache_storage_nixl::NixlStorage;

const PAGE: usize = 8;
const LAYERS: usize = 2;
const DEVICE_PAGES: usize = 16;
const HOST_PAGES: usize = 40;
const PAGES: usize = 12;

fn geometry() -> KvGeometry {
    KvGeometry::mha(LAYERS, 2, 32, KvDtype::Bf16).unwrap()
}

fn namespace() -> StorageNamespace {
    StorageNamespace::single_rank("nixl-controller", geometry(), HostLayout::PageFirst, PAGE)
}

fn controller(storage: Arc<NixlStorage>, seed: u64) -> CacheController<CpuEngine> {
    let device = DeviceLayoutMap::new(geometry(), DEVICE_PAGES * PAGE).unwrap();
    let host = HostLayoutMap::new(geometry(), HostLayout::PageFirst, PAGE, HOST_PAGES).unwrap();
    let engine = CpuEngine::new(device, host, Completion::Immediate).unwrap();
    // a different byte at every offset and for every seed
    engine.with_device(|bytes| {
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(seed).rotate_left(17) as u8;
        }
    });
    let settings = StorageSettings {
        page_size: PAGE,
        batch_pages: 3,
        prefetch_threshold: PAGE,
        policy: PrefetchPolicy::WaitComplete,
        timeout_base: Duration::from_secs(5),
        timeout_per_ki_token: Duration::ZERO,
        timeout_max: Duration::from_secs(5),
        capacity_tokens: ((HOST_PAGES - DEVICE_PAGES) * PAGE) as u64,
        backup_skip: false,
        write_bytes_per_s: 0,
        tick_slots: 8,
    };
    CacheController::new(engine, PAGE, HOST_PAGES, DEVICE_PAGES, LAYERS)
        .unwrap()
        .with_storage(storage, settings, Arc::new(SystemClock::new()))
        .unwrap()
}

fn indices(pages: &[hicache_core::host_pool::HostPageId]) -> Vec<usize> {
    pages.iter().map(|page| page.index()).collect()
}

#[test]
fn the_host_pool_is_registered_once_and_pages_move_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..(PAGES * PAGE) as u32).map(|token| token * 31 + 5).collect();
    let keys = page_keys(&tokens, PAGE, None, PartialPage::Reject).unwrap();

    let writer_storage = Arc::new(NixlStorage::open(common::config(dir.path()), &namespace()).unwrap());
    let mut writer = controller(writer_storage.clone(), 1);
    assert_eq!(writer_storage.usage().registered_pools, 1, "registered when the storage threads start");
    let slots = writer.alloc_device(PAGES).unwrap();
    let pages = writer.write(&slots, NodeId(1), Some(&keys)).unwrap().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let backup = loop {
        if let Some(backup) = writer.tick(&mut SingleRank).unwrap().backups.into_iter().next() {
            break backup;
        }
        assert!(Instant::now() < deadline, "backup not done");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert!(backup.pages.iter().all(|page| *page == PageBackup::Stored), "{:?}", backup.pages);
    let expected = writer.engine().host_memory().copy_pages_out(&indices(&pages)).unwrap();
    let usage = writer_storage.usage();
    assert_eq!(usage.regions_registered, 1, "{PAGES} pages in batches of 3, one registration: {usage:?}");
    assert_eq!(usage.registered_regions, 0, "nothing outside the pool was registered: {usage:?}");
    drop(writer);
    assert_eq!(writer_storage.usage().registered_pools, 0, "the controller's end unregisters the pool");

    let reader_storage = Arc::new(NixlStorage::open(common::config(dir.path()), &namespace()).unwrap());
    let mut reader = controller(reader_storage.clone(), 2);
    reader.prefetch("r", &tokens, None).unwrap();
    reader.finish_prefetch("r");
    let deadline = Instant::now() + Duration::from_secs(20);
    let done = loop {
        if let Some(done) = reader.tick(&mut SingleRank).unwrap().prefetches.into_iter().next() {
            break done;
        }
        assert!(Instant::now() < deadline, "prefetch not done");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(done.explanation.stop, PrefetchStop::Complete);
    assert_eq!(reader.engine().host_memory().copy_pages_out(&indices(&done.host_pages)).unwrap(), expected);
    let usage = reader_storage.usage();
    assert_eq!((usage.regions_registered, usage.registered_regions), (1, 0), "{usage:?}");
    assert_eq!(reader_storage.stats().staging_bytes, 0);
}
