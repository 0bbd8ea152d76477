//! Page groups of hybrid models in the 3FS tier, through the USRBIO **mock**: each sidecar pool in a data file of its
//! own beside the KV's (SGLang's names), an entry damaged beneath the tier cuts the restorable prefix before its page,
//! and a Mamba state stays per rank where the KV is shared (MLA).

use std::sync::Arc;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::PageKey;
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::groups::{GroupStorage, HitPolicy, SidecarPool};
use hicache_core::storage::{PageSegments, PageSegmentsMut};
use hicache_core::testing::conformance::{random_keys, random_pages};
use hicache_storage_3fs::Hf3fsStorage;
use hicache_storage_3fs::testing::Mount;

const FILE_SIZE: u64 = 1 << 20;
const PAGES: usize = 6;
const MAMBA_BYTES: usize = 3000;
const INDEXER_BYTES: usize = 528;

fn namespace(mla: bool, tp_rank: usize) -> StorageNamespace {
    let geometry =
        if mla { KvGeometry::mla(2, 64, 16, KvDtype::Bf16) } else { KvGeometry::mha(2, 2, 16, KvDtype::Bf16) };
    StorageNamespace {
        tp_rank,
        tp_size: 2,
        ..StorageNamespace::single_rank("org/hybrid", geometry.unwrap(), HostLayout::PageFirst, 4)
    }
}

/// The KV of rank `tp_rank` with a Mamba state pool (window 1) and an indexer (every page), all in 3FS.
fn groups(mount: &Mount, mla: bool, tp_rank: usize) -> (GroupStorage, Vec<Arc<Hf3fsStorage>>) {
    let kv_namespace = namespace(mla, tp_rank);
    let open =
        |namespace: &StorageNamespace| Arc::new(Hf3fsStorage::open(mount.config(FILE_SIZE, None), namespace).unwrap());
    let kv = open(&kv_namespace);
    let mamba = open(&kv_namespace.sidecar("mamba", MAMBA_BYTES).unwrap());
    let indexer = open(&kv_namespace.sidecar("indexer", INDEXER_BYTES).unwrap());
    let pools = vec![
        SidecarPool { name: "mamba".into(), policy: HitPolicy::TrailingPages { window: 1 }, backend: mamba.clone() },
        SidecarPool { name: "indexer".into(), policy: HitPolicy::AllPages, backend: indexer.clone() },
    ];
    (GroupStorage::new(kv.clone(), pools).unwrap(), vec![kv, mamba, indexer])
}

/// Writes a run: its indexer entries, the Mamba state at pages 3 and 6 (node ends), then the KV.
fn write(groups: &GroupStorage, keys: &[PageKey], kv: &[Vec<u8>], mamba: &[Vec<u8>], indexer: &[Vec<u8>]) {
    let pages: Vec<PageSegments<'_>> = kv.iter().map(|page| vec![page.as_slice()]).collect();
    let states = vec![(2, vec![mamba[0].as_slice()]), (5, vec![mamba[1].as_slice()])];
    let entries = indexer.iter().enumerate().map(|(page, entry)| (page, vec![entry.as_slice()])).collect();
    let written = groups.set(keys, &pages, &[states, entries]).unwrap();
    assert_eq!(written.pages, keys.len());
}

/// Reads the prefix of `length` pages; the restored length, and what was read (KV, the state, the indexer entries).
fn read(groups: &GroupStorage, keys: &[PageKey], length: usize, bytes: usize) -> (usize, Vec<Vec<u8>>) {
    let mut kv = vec![vec![0u8; bytes]; length];
    let mut state = vec![vec![0u8; MAMBA_BYTES]; 1];
    let mut indexer = vec![vec![0u8; INDEXER_BYTES]; length];
    let restored = {
        let mut kv_pages: Vec<PageSegmentsMut<'_>> = kv.iter_mut().map(|page| vec![page.as_mut_slice()]).collect();
        let mut sidecars = vec![
            state.iter_mut().map(|entry| vec![entry.as_mut_slice()]).collect::<Vec<_>>(),
            indexer.iter_mut().map(|entry| vec![entry.as_mut_slice()]).collect::<Vec<_>>(),
        ];
        groups.get(keys, length, &mut kv_pages, &mut sidecars).unwrap()
    };
    (restored, kv.into_iter().chain(state).chain(indexer).collect())
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
    let keys = random_keys(PAGES);
    let (kv, mamba, indexer) =
        (random_pages(PAGES, bytes), random_pages(2, MAMBA_BYTES), random_pages(PAGES, INDEXER_BYTES));
    write(&groups, &keys, &kv, &mamba, &indexer);
    // a state at pages 3 and 6: those prefixes restore, the others do not
    assert_eq!(groups.query(&keys).unwrap().lengths, [3, 6]);
    let (restored, got) = read(&groups, &keys, PAGES, bytes);
    assert_eq!(restored, PAGES);
    assert_eq!(&got[..PAGES], kv.as_slice());
    assert_eq!(got[PAGES], mamba[1]);
    assert_eq!(&got[PAGES + 1..], indexer.as_slice());
    // another program changes a byte of the fifth page's indexer entry in its data file: the entry fails its
    // checksum, so no prefix that needs it restores; the one that ends at 3 (where a state is) still does
    let path = backends[2].data_file().to_path_buf();
    let mut file = std::fs::read(&path).unwrap();
    let at = file.windows(INDEXER_BYTES).position(|window| window == indexer[4].as_slice()).expect("the entry");
    file[at + 7] ^= 0x10;
    std::fs::write(&path, &file).unwrap();
    let (restored, _) = read(&groups, &keys, PAGES, bytes);
    // the read of 6 pages took the state at 6 only, so no shorter prefix is whole among what it read
    assert_eq!(restored, 0, "a KV page came back without its indexer entry");
    let (restored, got) = read(&groups, &keys, 3, bytes);
    assert_eq!(restored, 3);
    assert_eq!((&got[..3], &got[3], &got[4..]), (&kv[..3], &mamba[0], &indexer[..3]));
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
    let keys = random_keys(PAGES);
    let (kv, indexer) = (random_pages(PAGES, bytes), random_pages(PAGES, INDEXER_BYTES));
    let (states_of_first, states_of_second) = (random_pages(2, MAMBA_BYTES), random_pages(2, MAMBA_BYTES));
    write(&first, &keys, &kv, &states_of_first, &indexer);
    // the second rank finds the shared pages, but not a state of its own until it writes one
    assert_eq!(second.query(&keys).unwrap().lengths, Vec::<usize>::new());
    write(&second, &keys, &kv, &states_of_second, &indexer);
    let (restored, got) = read(&second, &keys, PAGES, bytes);
    assert_eq!((restored, &got[PAGES]), (PAGES, &states_of_second[1]));
    let (restored, got) = read(&first, &keys, PAGES, bytes);
    assert_eq!((restored, &got[PAGES]), (PAGES, &states_of_first[1]));
}
