//! Page groups of hybrid models in Mooncake, against a real `mooncake_master`: a Mamba state pool and an indexer
//! pool beside the KV, each entry one object of its pool's namespace; an indexer entry evicted between the query and
//! the read cuts the restored prefix before its page, and a KV page is never handed back without its group. Under
//! SGLang 0.5.23's keys a state entry is one object per buffer of its host pool, and one missing is no state.
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

/// Under SGLang 0.5.23's keys a Mamba state entry is its host pool's buffers, one object each, of unequal sizes:
/// each object is named as SGLang names it and holds its own bytes of the entry, whether the caller's memory holds a
/// part in one piece (put and read in place) or cut across pieces (staged); a state missing one of its objects is no
/// state, and the prefix that needs it is not restorable.
#[test]
fn sglang_keys_cut_a_state_into_its_buffers_objects_and_a_missing_one_is_no_state() {
    use hicache_core::hash::PageKey;
    use hicache_core::namespace::EntryObject;
    use hicache_core::storage::{GetOutcome, SetOutcome};
    use hicache_storage_mooncake::{KeyScheme, MooncakeConfig, SglangRelease};

    let cluster = Cluster::start();
    let kv_namespace = StorageNamespace {
        tp_rank: 1,
        tp_size: 2,
        ..StorageNamespace::single_rank(
            "org/hybrid",
            KvGeometry::mha(2, 2, 16, KvDtype::Bf16).unwrap(),
            HostLayout::PageFirst,
            4,
        )
    };
    let config = MooncakeConfig {
        scheme: KeyScheme::Sglang { release: SglangRelease::V0_5_23, tag: Some("t".into()) },
        ..cluster.config()
    };
    let object = |name: &str, bytes| EntryObject { name: name.into(), bytes, per_rank: true };
    let objects = vec![object("temporal", 2000), object("conv_0", 904), object("conv_1", 96)];
    let state_namespace =
        kv_namespace.sidecar("mamba", STATE_BYTES).unwrap().with_entry_objects(objects.clone()).unwrap();
    let state = Arc::new(MooncakeStorage::open(config.clone(), &state_namespace).unwrap());
    let key = PageKey::from_bytes([7; 32]);
    let names: Vec<String> =
        ["temporal", "conv_0", "conv_1"].iter().map(|name| format!("t_org-hybrid_{key}_1_{name}")).collect();
    assert_eq!(state.object_keys(&key), names);

    // random bytes, given as pieces cut where no object starts or ends (every object staged), then read back both
    // whole (in place) and cut elsewhere
    let entries: Vec<Vec<u8>> = (0..3).map(|_| (0..STATE_BYTES).map(|_| rand::random::<u8>()).collect()).collect();
    let keys = [key, PageKey::from_bytes([8; 32]), PageKey::from_bytes([9; 32])];
    let cut = |entry: &[u8], at: usize| -> Vec<Vec<u8>> { vec![entry[..at].to_vec(), entry[at..].to_vec()] };
    let first = cut(&entries[0], 1000);
    let pieces: Vec<Vec<&[u8]>> =
        vec![first.iter().map(Vec::as_slice).collect(), vec![entries[1].as_slice()], vec![entries[2].as_slice()]];
    assert_eq!(state.batch_set(&keys, &pieces).unwrap(), [SetOutcome::Stored, SetOutcome::Stored, SetOutcome::Stored]);
    // the first two are read back (the third stays unread: a read leases the objects it finds for a while, and a
    // leased object cannot be removed)
    for at in [STATE_BYTES, 2950] {
        let mut buffers: Vec<Vec<u8>> = keys[..2].iter().flat_map(|_| cut(&vec![0; STATE_BYTES], at)).collect();
        let (one, two) = buffers.split_at_mut(2);
        let mut pages: Vec<Vec<&mut [u8]>> =
            vec![one.iter_mut().map(Vec::as_mut_slice).collect(), two.iter_mut().map(Vec::as_mut_slice).collect()];
        assert_eq!(state.batch_get(&keys[..2], &mut pages).unwrap(), [GetOutcome::Hit, GetOutcome::Hit]);
        for (index, entry) in entries[..2].iter().enumerate() {
            assert_eq!(&buffers[2 * index..2 * index + 2].concat(), entry, "entry {index} read cut at {at}");
        }
    }

    // the third entry's conv_1 object goes: that entry is no state
    state.replace_object(&state.object_keys(&keys[2])[2], None).unwrap();
    assert_eq!(state.batch_contains(&keys).unwrap(), [true, true, false]);

    // in a group: the state written at page 6 loses its temporal buffer's object, so 6 is no longer restorable
    // and 3 still is
    let indexer_namespace = kv_namespace.sidecar("indexer", INDEXER_BYTES).unwrap();
    let indexer: Arc<dyn StorageBackend> =
        Arc::new(MooncakeStorage::open(cluster.config(), &indexer_namespace).unwrap());
    let kv: Arc<dyn StorageBackend> = Arc::new(MooncakeStorage::open(config, &kv_namespace).unwrap());
    let groups = GroupStorage::new(kv, pools(state.clone(), indexer)).unwrap();
    let bytes = kv_namespace.page_bytes();
    let run = HybridRun::new(6, bytes, &[3, 6]);
    assert_eq!(run.write(&groups), 6);
    // removed before anything asks for it (a query or a read leases the objects it finds for a while)
    state.replace_object(&state.object_keys(&run.keys[5])[0], None).unwrap();
    assert_eq!(groups.query(&run.keys).unwrap().lengths, [3]);
    assert_eq!(read(&groups, &run.keys, 6, bytes).restored, 0, "a prefix came back without its whole state");
    assert_eq!(read(&groups, &run.keys, 3, bytes), run.expected(3));
}
