//! Page groups of hybrid models in the NIXL tier, through the real NIXL library (POSIX plugin): each sidecar pool's
//! entry a file named as SGLang's NIXL backend names a pool's whole page, a damaged entry (the wrong size) cuts the
//! restored prefix before its page, and a pool's entries are cleared with its namespace only.

mod common;

use std::sync::Arc;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::PageKey;
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::storage::groups::GroupStorage;
use hicache_core::testing::groups::{HybridRun, INDEXER_BYTES, STATE_BYTES, pools, read};
use hicache_storage_nixl::NixlStorage;

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
    let state = open(&kv_namespace.sidecar("mamba", STATE_BYTES).unwrap());
    let indexer = open(&kv_namespace.sidecar("indexer", INDEXER_BYTES).unwrap());
    let kv = open(&kv_namespace);
    let groups = GroupStorage::new(kv.clone(), pools(state, indexer.clone())).unwrap();
    let bytes = kv_namespace.page_bytes();
    let run = HybridRun::new(6, bytes, &[3, 6]);
    assert_eq!(run.write(&groups), 6);
    // SGLang's NIXL names: the MLA latent shared by the ranks, the state per rank, the indexer as the latent
    let name = |key: &PageKey, tail: &str| dir.path().join(format!("{key}{tail}"));
    assert!(name(&run.keys[0], "_org-hybrid").is_file());
    assert!(name(&run.keys[2], "_org-hybrid_1_2_mamba").is_file());
    assert!(name(&run.keys[0], "_org-hybrid_indexer").is_file());
    assert_eq!(groups.query(&run.keys).unwrap().lengths, [3, 6]);
    assert_eq!(read(&groups, &run.keys, 6, bytes), run.expected(6));
    // the fifth page's indexer entry cut short beneath the tier: no prefix that needs it is restored, the one
    // ending at 3 is
    std::fs::File::options().write(true).open(name(&run.keys[4], "_org-hybrid_indexer")).unwrap().set_len(7).unwrap();
    assert_eq!(read(&groups, &run.keys, 6, bytes).restored, 0, "a KV page came back without its indexer entry");
    assert_eq!(read(&groups, &run.keys, 3, bytes), run.expected(3));
    // clearing a pool removes its entries only
    assert_eq!(indexer.clear().unwrap(), 5, "the damaged entry went when it was found");
    assert_eq!(kv.batch_exists(&run.keys).unwrap(), 6);
    assert!(name(&run.keys[2], "_org-hybrid_1_2_mamba").is_file());
}
