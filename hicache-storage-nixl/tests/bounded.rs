//! Bounded use of descriptors and registrations, where SGLang leaked one of each per file per transfer. Alone in its
//! binary: it counts the process's open descriptors.

mod common;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{random_keys, random_pages};
use hicache_storage_nixl::{NixlConfig, NixlStorage};

const PAGE: usize = 4096;

fn namespace() -> StorageNamespace {
    StorageNamespace::single_rank(
        "m",
        KvGeometry::mha(2, 2, 32, KvDtype::Bf16).expect("geometry"),
        HostLayout::PageFirst,
        8,
    )
}

/// Descriptors this process has open.
fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn descriptors_and_registrations_stay_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let config = NixlConfig { max_open_files: 8, ..common::config(dir.path()) };
    let storage = NixlStorage::open(config, &namespace()).unwrap();
    let before = open_descriptors();
    let keys = random_keys(64);
    let pages = random_pages(64, PAGE);
    // one reused buffer of the caller's own, outside any host pool told to the backend: registered once, kept
    let mut staging = vec![0u8; 16 * PAGE];
    for _ in 0..3 {
        for (batch_keys, batch_pages) in keys.chunks(16).zip(pages.chunks(16)) {
            staging[..batch_pages.len() * PAGE].copy_from_slice(&batch_pages.concat());
            let sources: Vec<Vec<&[u8]>> = staging.chunks(PAGE).map(|page| vec![page]).collect();
            assert!(storage.batch_set(batch_keys, &sources).unwrap().iter().all(SetOutcome::is_stored));
            let mut destinations: Vec<Vec<&mut [u8]>> = staging.chunks_mut(PAGE).map(|page| vec![page]).collect();
            let outcomes = storage.batch_get(batch_keys, &mut destinations).unwrap();
            assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit));
            assert_eq!(staging, batch_pages.concat());
        }
    }
    let usage = storage.usage();
    assert_eq!(usage.plugin, "POSIX");
    assert!(usage.open_files <= 8, "{usage:?}");
    assert!(open_descriptors() <= before + 8 + 2, "descriptors grow with the bound, not the pages: {usage:?}");
    assert_eq!(usage.regions_registered, 1, "one reused buffer, registered once: {usage:?}");
    assert!(usage.files_opened >= 64 * 2, "reads reopened files the bound had closed: {usage:?}");
    drop(storage);
    assert!(open_descriptors() <= before, "dropping the backend closes its files");
}
