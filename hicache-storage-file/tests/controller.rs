//! The controller's storage threads on the file tier: pages move in place between the host pool and page files, and
//! because the pool is page-aligned, whole-block pages of every layout whose page segments are whole blocks take the
//! direct I/O path, both ways.

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
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

const PAGE: usize = 16;
const DEVICE_PAGES: usize = 8;
const HOST_PAGES: usize = 20;
const PAGES: usize = 6;

/// 2 layers × 1 head × 128 dims × 2 bytes = 256 B items: a page part of 16 tokens is 4 KiB per layer.
fn geometry() -> KvGeometry {
    KvGeometry::mha(2, 1, 128, KvDtype::Bf16).unwrap()
}

fn controller(storage: Arc<FileStorage>, layout: HostLayout) -> CacheController<CpuEngine> {
    let device = DeviceLayoutMap::new(geometry(), DEVICE_PAGES * PAGE).unwrap();
    let host = HostLayoutMap::new(geometry(), layout, PAGE, HOST_PAGES).unwrap();
    let engine = CpuEngine::new(device, host, Completion::Immediate).unwrap();
    engine.with_device(|bytes| {
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = (index as u64).wrapping_mul(0x2545_f491_4f6c_dd1d).rotate_left(23) as u8;
        }
    });
    let settings = StorageSettings {
        page_size: PAGE,
        batch_pages: 4,
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
    CacheController::new(engine, PAGE, HOST_PAGES, DEVICE_PAGES, 2)
        .unwrap()
        .with_storage(storage, settings, Arc::new(SystemClock::new()))
        .unwrap()
}

fn indices(pages: &[hicache_core::host_pool::HostPageId]) -> Vec<usize> {
    pages.iter().map(|page| page.index()).collect()
}

fn tick_until<T>(
    rig: &mut CacheController<CpuEngine>,
    mut found: impl FnMut(&mut CacheController<CpuEngine>) -> Option<T>,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(value) = found(rig) {
            return value;
        }
        assert!(Instant::now() < deadline, "not done after 20 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn pool_pages_take_the_direct_path_both_ways_in_every_layout() {
    for layout in HostLayout::ALL {
        for format in [FileFormat::Native, FileFormat::Sglang] {
            let dir = tempfile::tempdir().unwrap();
            let namespace = StorageNamespace::single_rank("direct-pool", geometry(), layout, PAGE);
            let open = || {
                let config = FileConfig { direct_io: true, ..FileConfig::new(dir.path(), format) };
                Arc::new(FileStorage::open(config, &namespace).unwrap())
            };
            let what = format!("{layout:?} {format:?}");
            let tokens: Vec<u32> = (0..(PAGES * PAGE) as u32).map(|token| token ^ 0x5a5a).collect();
            let keys = page_keys(&tokens, PAGE, None, PartialPage::Reject).unwrap();

            let writer_storage = open();
            let mut writer = controller(writer_storage.clone(), layout);
            let slots = writer.alloc_device(PAGES).unwrap();
            let pages = writer.write(&slots, NodeId(1), Some(&keys)).unwrap().unwrap();
            let backup = tick_until(&mut writer, |rig| rig.tick(&mut SingleRank).unwrap().backups.into_iter().next());
            assert!(backup.pages.iter().all(|page| *page == PageBackup::Stored), "{what}: {:?}", backup.pages);
            assert_eq!(writer_storage.direct_io_pages(), PAGES as u64, "{what}: writes bypass the page cache");
            let expected = writer.engine().host_memory().copy_pages_out(&indices(&pages)).unwrap();

            let reader_storage = open();
            let mut reader = controller(reader_storage.clone(), layout);
            reader.prefetch("r", &tokens, None).unwrap();
            reader.finish_prefetch("r");
            let done = tick_until(&mut reader, |rig| rig.tick(&mut SingleRank).unwrap().prefetches.into_iter().next());
            assert_eq!(done.explanation.stop, PrefetchStop::Complete, "{what}");
            assert_eq!(reader_storage.direct_io_pages(), PAGES as u64, "{what}: reads bypass the page cache");
            let got = reader.engine().host_memory().copy_pages_out(&indices(&done.host_pages)).unwrap();
            assert!(got == expected, "{what}: the pages read back differ");
            assert_eq!(reader_storage.stats().staging_bytes + writer_storage.stats().staging_bytes, 0, "{what}");
        }
    }
}
