//! Page groups of hybrid models in the NIXL tier, through the real NIXL library (POSIX plugin): each sidecar pool's
//! entry a file named as SGLang's NIXL backend names a pool's whole page, a damaged entry (the wrong size) cuts the
//! restored prefix before its page, and a pool's entries are cleared with its namespace only.

mod common;

use std::sync::Arc;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::PageKey;
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::groups::{GroupStorage, HitPolicy, SidecarPool};
use hicache_core::storage::{PageSegments, PageSegmentsMut, StorageBackend};
use hicache_core::testing::conformance::{random_keys, random_pages};
use hicache_storage_nixl::NixlStorage;

const PAGES: usize = 6;
const MAMBA_BYTES: usize = 3000;
const INDEXER_BYTES: usize = 528;

/// What a read gave: the restored length, the KV pages, the state read, the indexer entries.
type Read = (usize, Vec<Vec<u8>>, Vec<u8>, Vec<Vec<u8>>);

/// Reads the prefix of `length` pages.
fn read(groups: &GroupStorage, keys: &[PageKey], length: usize, bytes: usize) -> Read {
    let mut kv = vec![vec![0u8; bytes]; length];
    let mut state = vec![0u8; MAMBA_BYTES];
    let mut entries = vec![vec![0u8; INDEXER_BYTES]; length];
    let restored = {
        let mut kv_pages: Vec<PageSegmentsMut<'_>> = kv.iter_mut().map(|page| vec![page.as_mut_slice()]).collect();
        let mut sidecars = vec![
            vec![vec![state.as_mut_slice()]],
            entries.iter_mut().map(|entry| vec![entry.as_mut_slice()]).collect::<Vec<_>>(),
        ];
        groups.get(keys, length, &mut kv_pages, &mut sidecars).unwrap()
    };
    (restored, kv, state, entries)
}

#[test]
fn groups_round_trip_under_sglangs_names_and_a_damaged_entry_cuts_the_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let kv_namespace = StorageNamespace {
        tp_size: 2,
        tp_rank: 1,
        ..StorageNamespace::single_rank(
            "org/hybrid",
            KvGeometry::mla(2, 64, 16, KvDtype::Bf16).unwrap(),
            HostLayout::PageFirst,
            4,
        )
    };
    let open = |namespace: &StorageNamespace| -> Arc<dyn StorageBackend> {
        Arc::new(NixlStorage::open(common::config(dir.path()), namespace).unwrap())
    };
    let mamba = open(&kv_namespace.sidecar("mamba", MAMBA_BYTES).unwrap());
    let indexer = open(&kv_namespace.sidecar("indexer", INDEXER_BYTES).unwrap());
    let kv_backend = open(&kv_namespace);
    let pools = vec![
        SidecarPool { name: "mamba".into(), policy: HitPolicy::TrailingPages { window: 1 }, backend: mamba.clone() },
        SidecarPool { name: "indexer".into(), policy: HitPolicy::AllPages, backend: indexer.clone() },
    ];
    let groups = GroupStorage::new(kv_backend.clone(), pools).unwrap();
    let bytes = kv_namespace.page_bytes();
    let keys = random_keys(PAGES);
    let (kv, states, entries) =
        (random_pages(PAGES, bytes), random_pages(2, MAMBA_BYTES), random_pages(PAGES, INDEXER_BYTES));
    let pages: Vec<PageSegments<'_>> = kv.iter().map(|page| vec![page.as_slice()]).collect();
    let sidecars = [
        vec![(2, vec![states[0].as_slice()]), (5, vec![states[1].as_slice()])],
        entries.iter().enumerate().map(|(page, entry)| (page, vec![entry.as_slice()])).collect(),
    ];
    assert_eq!(groups.set(&keys, &pages, &sidecars).unwrap().pages, PAGES);
    // SGLang's NIXL names: the MLA latent shared by the ranks, the state per rank, the indexer as the latent
    let name = |key: &PageKey, tail: &str| dir.path().join(format!("{key}{tail}"));
    assert!(name(&keys[0], "_org-hybrid").is_file());
    assert!(name(&keys[2], "_org-hybrid_1_2_mamba").is_file());
    assert!(name(&keys[0], "_org-hybrid_indexer").is_file());
    assert_eq!(groups.query(&keys).unwrap().lengths, [3, 6]);
    assert_eq!(read(&groups, &keys, PAGES, bytes), (PAGES, kv.clone(), states[1].clone(), entries.clone()));
    // the fifth page's indexer entry cut short beneath the tier: no prefix that needs it is restored, the one
    // ending at 3 is
    std::fs::File::options().write(true).open(name(&keys[4], "_org-hybrid_indexer")).unwrap().set_len(7).unwrap();
    assert_eq!(read(&groups, &keys, PAGES, bytes).0, 0, "a KV page came back without its indexer entry");
    let (restored, got_kv, state, got_entries) = read(&groups, &keys, 3, bytes);
    assert_eq!((restored, &got_kv[..], &state, &got_entries[..]), (3, &kv[..3], &states[0], &entries[..3]));
    // clearing a pool removes its entries only
    assert_eq!(indexer.clear().unwrap(), 5, "the damaged entry went when it was found");
    assert_eq!(kv_backend.batch_exists(&keys).unwrap(), PAGES);
    assert!(name(&keys[2], "_org-hybrid_1_2_mamba").is_file());
}
