//! Page groups of hybrid models in Mooncake, against a real `mooncake_master`: a Mamba state pool and an indexer
//! pool beside the KV, each entry one object of its pool's namespace; an indexer entry evicted between the query and
//! the read cuts the restored prefix before its page, and a KV page is never handed back without its group.
//!
//! The test starts its own master on loopback ports and stops it by its PID at the end.

use std::sync::Arc;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::PageKey;
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::groups::{GroupStorage, HitPolicy, SidecarPool};
use hicache_core::storage::{PageSegments, PageSegmentsMut, StorageBackend};
use hicache_core::testing::conformance::{random_keys, random_pages};
use hicache_storage_mooncake::MooncakeStorage;
use hicache_storage_mooncake::testing::Cluster;

const PAGES: usize = 6;
const MAMBA_BYTES: usize = 3000;
const INDEXER_BYTES: usize = 528;

#[test]
fn groups_round_trip_and_an_entry_evicted_after_the_query_cuts_the_prefix() {
    let cluster = Cluster::start();
    let kv_namespace = StorageNamespace::single_rank(
        "org/hybrid",
        KvGeometry::mha(2, 2, 16, KvDtype::Bf16).unwrap(),
        HostLayout::PageFirst,
        4,
    );
    let open = |namespace: &StorageNamespace| -> Arc<dyn StorageBackend> {
        Arc::new(MooncakeStorage::open(cluster.config(), namespace).expect("opens against the test master"))
    };
    let indexer = open(&kv_namespace.sidecar("indexer", INDEXER_BYTES).unwrap());
    let pools = vec![
        SidecarPool {
            name: "mamba".into(),
            policy: HitPolicy::TrailingPages { window: 1 },
            backend: open(&kv_namespace.sidecar("mamba", MAMBA_BYTES).unwrap()),
        },
        SidecarPool { name: "indexer".into(), policy: HitPolicy::AllPages, backend: indexer.clone() },
    ];
    let kv_backend = open(&kv_namespace);
    let groups = GroupStorage::new(kv_backend.clone(), pools).unwrap();
    let bytes = kv_namespace.page_bytes();
    let keys = random_keys(PAGES);
    let (kv, states, entries) =
        (random_pages(PAGES, bytes), random_pages(2, MAMBA_BYTES), random_pages(PAGES, INDEXER_BYTES));
    // the indexer for every page, the state at pages 3 and 6 (node ends), then the KV
    let pages: Vec<PageSegments<'_>> = kv.iter().map(|page| vec![page.as_slice()]).collect();
    let sidecars = [
        vec![(2, vec![states[0].as_slice()]), (5, vec![states[1].as_slice()])],
        entries.iter().enumerate().map(|(page, entry)| (page, vec![entry.as_slice()])).collect(),
    ];
    assert_eq!(groups.set(&keys, &pages, &sidecars).unwrap().pages, PAGES);
    assert_eq!(groups.query(&keys).unwrap().lengths, [3, 6]);
    assert_eq!(read(&groups, &keys, PAGES, bytes), (PAGES, kv.clone(), states[1].clone(), entries.clone()));
    // the fifth page's indexer entry goes between the query and the read: no prefix that needs it is restored, the
    // one ending at 3 still is, and a query now tells so
    assert_eq!(indexer.remove(&keys[4..5]).unwrap(), 1);
    assert_eq!(read(&groups, &keys, PAGES, bytes).0, 0, "a KV page came back without its indexer entry");
    assert_eq!(groups.query(&keys).unwrap().lengths, [3]);
    let (restored, got_kv, state, got_entries) = read(&groups, &keys, 3, bytes);
    assert_eq!((restored, &got_kv[..], &state, &got_entries[..]), (3, &kv[..3], &states[0], &entries[..3]));
    // the KV pages themselves are all still there: only the group is incomplete
    assert_eq!(kv_backend.batch_exists(&keys).unwrap(), PAGES);
}

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
