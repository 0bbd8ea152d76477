//! The controller's storage threads on NIXL: the host pool is registered once (not per batch), pages move straight
//! between it and the page files, and the registration ends with the controller.

mod common;

use std::sync::Arc;

use hicache_core::controller::{PageBackup, PrefetchStop};
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::testing::rig::{controller_over, prefetch_back, store_through};
use hicache_storage_nixl::NixlStorage;

/// Pages written and read, in batches of 3.
const PAGES: usize = 12;

#[test]
fn the_host_pool_is_registered_once_and_pages_move_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let geometry = KvGeometry::mha(2, 2, 32, KvDtype::Bf16).unwrap();
    let namespace = StorageNamespace::single_rank("nixl-controller", geometry, HostLayout::PageFirst, 8);
    let tokens: Vec<u32> = (0..(PAGES * 8) as u32).map(|token| token * 31 + 5).collect();

    let writer_storage = Arc::new(NixlStorage::open(common::config(dir.path()), &namespace).unwrap());
    let mut writer = controller_over(writer_storage.clone(), &namespace, 2 * PAGES + 8, 3, 1).unwrap();
    assert_eq!(writer_storage.usage().registered_pools, 1, "registered when the storage threads start");
    let (backup, expected) = store_through(&mut writer, &tokens);
    assert!(backup.pages.iter().all(|page| *page == PageBackup::Stored), "{:?}", backup.pages);
    let usage = writer_storage.usage();
    assert_eq!(usage.regions_registered, 1, "{PAGES} pages in batches of 3, one registration: {usage:?}");
    assert_eq!(usage.registered_regions, 0, "nothing outside the pool was registered: {usage:?}");
    drop(writer);
    assert_eq!(writer_storage.usage().registered_pools, 0, "the controller's end unregisters the pool");

    let reader_storage = Arc::new(NixlStorage::open(common::config(dir.path()), &namespace).unwrap());
    let mut reader = controller_over(reader_storage.clone(), &namespace, 2 * PAGES + 8, 3, 2).unwrap();
    let (done, got) = prefetch_back(&mut reader, &tokens);
    assert_eq!(done.explanation.stop, PrefetchStop::Complete);
    assert!(got == expected, "the pages read back differ");
    let usage = reader_storage.usage();
    assert_eq!((usage.regions_registered, usage.registered_regions), (1, 0), "{usage:?}");
    assert_eq!(reader_storage.stats().staging_bytes, 0);
}
