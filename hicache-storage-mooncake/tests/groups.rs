//! Page groups of hybrid models in Mooncake, against a real `mooncake_master`: a Mamba state pool and an indexer
//! pool beside the KV, each entry one object of its pool's namespace; an indexer entry evicted between the query and
//! the read cuts the restored prefix before its page, and a KV page is never handed back without its group.
//!
//! The test starts its own master on loopback ports and stops it by its PID at the end.

use std::sync::Arc;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::storage::groups::GroupStorage;
use hicache_core::testing::groups::{HybridRun, INDEXER_BYTES, STATE_BYTES, pools, read};
use hicache_storage_mooncake::MooncakeStorage;
use hicache_storage_mooncake::testing::Cluster;

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
    let state = open(&kv_namespace.sidecar("mamba", STATE_BYTES).unwrap());
    let kv = open(&kv_namespace);
    let groups = GroupStorage::new(kv.clone(), pools(state, indexer.clone())).unwrap();
    let bytes = kv_namespace.page_bytes();
    // states at the ends of nodes of 3 and 6 pages
    let run = HybridRun::new(6, bytes, &[3, 6]);
    assert_eq!(run.write(&groups), 6);
    assert_eq!(groups.query(&run.keys).unwrap().lengths, [3, 6]);
    assert_eq!(read(&groups, &run.keys, 6, bytes), run.expected(6));
    // the fifth page's indexer entry goes between the query and the read: no prefix that needs it is restored, the
    // one ending at 3 still is, and a query now tells so
    assert_eq!(indexer.remove(&run.keys[4..5]).unwrap(), 1);
    assert_eq!(read(&groups, &run.keys, 6, bytes).restored, 0, "a KV page came back without its indexer entry");
    assert_eq!(groups.query(&run.keys).unwrap().lengths, [3]);
    assert_eq!(read(&groups, &run.keys, 3, bytes), run.expected(3));
    // the KV pages themselves are all still there: only the group is incomplete
    assert_eq!(kv.batch_exists(&run.keys).unwrap(), 6);
}
