//! The controller's storage threads on the file tier: pages move in place between the host pool and page files, and
//! because the pool is page-aligned, the pages of every layout whose page segments are whole 4 KiB blocks take the
//! direct I/O path, both ways.

use std::sync::Arc;

use hicache_core::controller::{PageBackup, PrefetchStop};
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::testing::rig::{controller_over, prefetch_back, store_through};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

const PAGE: usize = 16;
const PAGES: usize = 6;

#[test]
fn pool_pages_take_the_direct_path_both_ways_in_every_layout() {
    // 2 layers × 1 head × 128 dims × 2 bytes = 256 B items: a page part of 16 tokens is 4 KiB per layer
    let geometry = KvGeometry::mha(2, 1, 128, KvDtype::Bf16).unwrap();
    for layout in HostLayout::ALL {
        for format in [FileFormat::Native, FileFormat::Sglang] {
            let dir = tempfile::tempdir().unwrap();
            let namespace = StorageNamespace::single_rank("direct-pool", geometry, layout, PAGE);
            let open = || {
                let config = FileConfig { direct_io: true, ..FileConfig::new(dir.path(), format) };
                Arc::new(FileStorage::open(config, &namespace).unwrap())
            };
            let what = format!("{layout:?} {format:?}");
            let tokens: Vec<u32> = (0..(PAGES * PAGE) as u32).map(|token| token ^ 0x5a5a).collect();

            let writer_storage = open();
            let mut writer = controller_over(writer_storage.clone(), &namespace, 2 * PAGES + 4, 4, 1).unwrap();
            let (backup, expected) = store_through(&mut writer, &tokens);
            assert!(backup.pages.iter().all(|page| *page == PageBackup::Stored), "{what}: {:?}", backup.pages);
            // (pages written behind are counted once written)
            writer_storage.flush().unwrap();
            assert_eq!(writer_storage.direct_io_pages(), PAGES as u64, "{what}: writes bypass the page cache");

            let reader_storage = open();
            let mut reader = controller_over(reader_storage.clone(), &namespace, 2 * PAGES + 4, 4, 2).unwrap();
            let (done, got) = prefetch_back(&mut reader, &tokens);
            assert_eq!(done.explanation.stop, PrefetchStop::Complete, "{what}");
            assert_eq!(reader_storage.direct_io_pages(), PAGES as u64, "{what}: reads bypass the page cache");
            assert!(got == expected, "{what}: the pages read back differ");
            assert_eq!(reader_storage.stats().staging_bytes + writer_storage.stats().staging_bytes, 0, "{what}");
        }
    }
}
