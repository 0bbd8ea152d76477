//! Page groups of hybrid models in the 3FS tier, through the USRBIO **mock**: each sidecar pool in a data file of its
//! own beside the KV's (SGLang's names), an entry damaged beneath the tier cuts the restorable prefix before its page,
//! and a Mamba state stays per rank where the KV is shared (MLA).

use std::sync::Arc;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::groups::GroupStorage;
use hicache_core::testing::groups::{HybridRun, INDEXER_BYTES, STATE_BYTES, pools, read};
use hicache_storage_3fs::Hf3fsStorage;
use hicache_storage_3fs::testing::Mount;

const FILE_SIZE: u64 = 1 << 20;

fn namespace(mla: bool, tp_rank: usize) -> StorageNamespace {
    let geometry =
        if mla { KvGeometry::mla(2, 64, 16, KvDtype::Bf16) } else { KvGeometry::mha(2, 2, 16, KvDtype::Bf16) };
    StorageNamespace {
        tp_rank,
        tp_size: 2,
        ..StorageNamespace::single_rank("org/hybrid", geometry.unwrap(), HostLayout::PageFirst, 4)
    }
}

/// The groups of rank `tp_rank`, all in 3FS, and the backends of the KV, the state and the indexer.
fn groups(mount: &Mount, mla: bool, tp_rank: usize) -> (GroupStorage, [Arc<Hf3fsStorage>; 3]) {
    let kv_namespace = namespace(mla, tp_rank);
    let open =
        |namespace: &StorageNamespace| Arc::new(Hf3fsStorage::open(mount.config(FILE_SIZE, None), namespace).unwrap());
    let kv = open(&kv_namespace);
    let state = open(&kv_namespace.sidecar("mamba", STATE_BYTES).unwrap());
    let indexer = open(&kv_namespace.sidecar("indexer", INDEXER_BYTES).unwrap());
    let groups = GroupStorage::new(kv.clone(), pools(state.clone(), indexer.clone())).unwrap();
    (groups, [kv, state, indexer])
}

#[test]
fn groups_round_trip_in_files_of_their_own_and_a_damaged_entry_cuts_the_prefix() {
    let mount = Mount::new();
    let (groups, backends) = groups(&mount, false, 1);
    let names: Vec<String> = backends
        .iter()
        .map(|backend| backend.data_file().file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let prefix = mount.config(FILE_SIZE, None).file_path_prefix.file_name().unwrap().to_string_lossy().into_owned();
    assert_eq!(names, [format!("{prefix}.1.bin"), format!("{prefix}.1.bin.mamba"), format!("{prefix}.1.bin.indexer")]);
    let bytes = backends[0].space().page_bytes as usize;
    let run = HybridRun::new(6, bytes, &[3, 6]);
    assert_eq!(run.write(&groups), 6);
    // a state at pages 3 and 6: those prefixes restore, the others do not
    assert_eq!(groups.query(&run.keys).unwrap().lengths, [3, 6]);
    assert_eq!(read(&groups, &run.keys, 6, bytes), run.expected(6));
    // another program changes a byte of the fifth page's indexer entry in its data file: the entry fails its
    // checksum, so no prefix that needs it restores; the one that ends at 3 (where a state is) still does
    let path = backends[2].data_file().to_path_buf();
    let mut file = std::fs::read(&path).unwrap();
    let at = file.windows(INDEXER_BYTES).position(|window| window == run.entries[4].as_slice()).expect("the entry");
    file[at + 7] ^= 0x10;
    std::fs::write(&path, &file).unwrap();
    // the read of 6 pages took the state at 6 only, so no shorter prefix is whole among what it read
    assert_eq!(read(&groups, &run.keys, 6, bytes).restored, 0, "a KV page came back without its indexer entry");
    assert_eq!(read(&groups, &run.keys, 3, bytes), run.expected(3));
}

#[test]
fn a_mamba_state_is_per_rank_where_the_kv_is_shared() {
    let mount = Mount::new();
    let (first, first_files) = groups(&mount, true, 0);
    let (second, second_files) = groups(&mount, true, 1);
    // the latent and the indexer: one file for every rank; the state: a file per rank
    assert_eq!(first_files[0].data_file(), second_files[0].data_file());
    assert_eq!(first_files[2].data_file(), second_files[2].data_file());
    assert_ne!(first_files[1].data_file(), second_files[1].data_file());
    let bytes = first_files[0].space().page_bytes as usize;
    let run = HybridRun::new(6, bytes, &[3, 6]);
    assert_eq!(run.write(&first), 6);
    // the second rank finds the shared pages, but no state of its own until it writes one
    assert_eq!(second.query(&run.keys).unwrap().lengths, Vec::<usize>::new());
    let states = HybridRun { states: HybridRun::new(6, bytes, &[3, 6]).states, ..run.clone() };
    assert_eq!(states.write(&second), 6);
    assert_eq!(read(&second, &run.keys, 6, bytes), states.expected(6));
    assert_eq!(read(&first, &run.keys, 6, bytes), run.expected(6));
}
