//! Which prefixes of a hybrid model's page groups can be restored, answered as SGLang 0.5.23's `HiCacheFile` answers
//! `batch_exists_v2`: golden answers made by SGLang's own code on files it would hold
//! (`tests/data/make_pool_groups_0_5_23.py` says how).

use std::collections::BTreeMap;

use hicache_core::storage::groups::{HitPolicy, PoolPresence, restorable};
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    sglang: String,
    cases: Vec<Case>,
    names: Vec<Names>,
}

/// The file names SGLang's `HiCacheFile` gives one page's entries in every pool, on one rank.
#[derive(Deserialize)]
struct Names {
    mla: bool,
    tp: (usize, usize),
    pp: (usize, usize),
    key: String,
    files: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Case {
    kv: Vec<bool>,
    pools: Vec<Pool>,
    kv_hit_pages: usize,
    pool_hit_pages: BTreeMap<String, usize>,
    restorable: Vec<usize>,
}

#[derive(Deserialize)]
struct Pool {
    name: String,
    policy: String,
    window: usize,
    held: Vec<bool>,
}

#[test]
fn restorable_prefixes_match_sglang_batch_exists_v2() {
    let golden: Golden =
        serde_json::from_str(include_str!("data/sglang_0_5_23_pool_groups.json")).expect("golden file parses");
    assert_eq!(golden.sglang, "0.5.23");
    assert!(golden.cases.len() >= 100);
    let mut with_gaps = 0;
    for (index, case) in golden.cases.iter().enumerate() {
        let pools: Vec<PoolPresence<'_>> = case
            .pools
            .iter()
            .map(|pool| PoolPresence {
                policy: match pool.policy.as_str() {
                    "all_pages" => HitPolicy::AllPages,
                    "trailing_pages" => HitPolicy::TrailingPages { window: pool.window },
                    other => panic!("case {index}: policy {other}"),
                },
                held: &pool.held,
            })
            .collect();
        let found = restorable(&case.kv, &pools);
        assert_eq!(found.lengths, case.restorable, "case {index}: restorable lengths");
        assert_eq!(found.longest(), case.kv_hit_pages, "case {index}: the hit");
        assert_eq!(found.longest(), found.lengths.last().copied().unwrap_or(0));
        // SGLang reports the KV pool's own boundary under `kv` when it is not 0, and each sidecar's likewise
        let mut reported = BTreeMap::new();
        if found.kv_pages > 0 {
            reported.insert("kv".to_owned(), found.kv_pages);
        }
        for (pool, pages) in case.pools.iter().zip(&found.pool_pages) {
            if let Some(pages) = pages {
                reported.insert(pool.name.clone(), *pages);
            }
        }
        assert_eq!(reported, case.pool_hit_pages, "case {index}: each pool's boundary");
        with_gaps += usize::from(found.lengths.len() != found.longest());
    }
    // the cases include sets that are not prefixes (a trailing window held at some boundaries only)
    assert!(with_gaps >= 10, "{with_gaps} cases with gaps");
}

/// A sidecar pool's namespace names its entries' files as `HiCacheFile` v2 does (`{key}.{pool}_{suffix}.bin`, with
/// a Mamba state's files per rank even for an MLA model), and the KV's as before.
#[test]
fn sidecar_file_names_match_sglang_hicache_file() {
    use hicache_core::geometry::{KvDtype, KvGeometry};
    use hicache_core::layout::HostLayout;
    use hicache_core::namespace::StorageNamespace;

    let golden: Golden =
        serde_json::from_str(include_str!("data/sglang_0_5_23_pool_groups.json")).expect("golden file parses");
    assert!(golden.names.iter().any(|names| names.mla) && golden.names.iter().any(|names| names.pp.1 > 1));
    for names in &golden.names {
        let geometry = if names.mla {
            KvGeometry::mla(2, 512, 64, KvDtype::Bf16).expect("geometry")
        } else {
            KvGeometry::mha(2, 2, 64, KvDtype::Bf16).expect("geometry")
        };
        let kv = StorageNamespace {
            tp_rank: names.tp.0,
            tp_size: names.tp.1,
            pp_rank: names.pp.0,
            pp_size: names.pp.1,
            ..StorageNamespace::single_rank("golden/model", geometry, HostLayout::PageFirst, 16)
        };
        let key: hicache_core::hash::PageKey = names.key.parse().expect("key");
        assert_eq!(names.files.len(), 5);
        for (pool, file) in &names.files {
            let namespace = if pool == "kv" { kv.clone() } else { kv.sidecar(pool, 4096).expect("sidecar") };
            assert_eq!(&format!("{}.bin", namespace.sglang_file_key(&key)), file, "pool {pool}");
        }
        // the KV's native objects are where they were before pools; each pool's are apart from them
        assert_ne!(kv.digest(), kv.sidecar("indexer", 4096).unwrap().digest());
        assert_ne!(kv.sidecar("indexer", 4096).unwrap().digest(), kv.sidecar("indexer", 8192).unwrap().digest());
    }
    let kv = StorageNamespace::single_rank(
        "m",
        KvGeometry::mha(2, 2, 64, KvDtype::Bf16).unwrap(),
        HostLayout::PageFirst,
        16,
    );
    for bad in ["", "kv", "Mamba", "a.b", "a/b"] {
        let error = kv.sidecar(bad, 1).unwrap_err().to_string();
        assert!(error.starts_with("pool:"), "{bad:?}: {error}");
    }
    assert!(kv.sidecar("mamba", 0).unwrap_err().to_string().starts_with("entry_bytes:"));
    // a sidecar pool's entry size is its objects' size
    assert_eq!(kv.sidecar("mamba", 12345).unwrap().page_bytes(), 12345);
    assert_eq!(kv.page_bytes(), kv.geometry.bytes_per_page(16));
}

mod group_storage {
    use std::sync::Arc;

    use hicache_core::geometry::{KvDtype, KvGeometry};
    use hicache_core::hash::PageKey;
    use hicache_core::layout::HostLayout;
    use hicache_core::namespace::StorageNamespace;
    use hicache_core::storage::groups::{GroupStorage, HitPolicy, SidecarPool, agreed_prefix, needed, restorable};
    use hicache_core::storage::{FaultPlan, FaultyStorage, MemoryStorage, PageSegments, StorageBackend};
    use hicache_core::testing::conformance::random_keys;
    use proptest::prelude::*;

    /// The KV pool and three sidecars: an indexer (every page), a Mamba state (the last page of a prefix) and a
    /// sliding window of 2 pages; each sidecar in its own namespace beside the KV's, with entries of its own size.
    const POOLS: [(&str, usize); 4] = [("kv", 0), ("indexer", 128), ("mamba", 384), ("swa", 64)];

    fn policy(pool: usize) -> HitPolicy {
        match pool {
            1 => HitPolicy::AllPages,
            2 => HitPolicy::TrailingPages { window: 1 },
            _ => HitPolicy::TrailingPages { window: 2 },
        }
    }

    fn namespace(pool: usize) -> StorageNamespace {
        let kv = StorageNamespace::single_rank(
            "groups/model",
            KvGeometry::mha(1, 4, 16, KvDtype::Bf16).expect("geometry"),
            HostLayout::PageFirst,
            2,
        );
        match pool {
            0 => kv,
            _ => kv.sidecar(POOLS[pool].0, POOLS[pool].1).expect("sidecar"),
        }
    }

    fn page_bytes(pool: usize) -> usize {
        namespace(pool).page_bytes()
    }

    /// The bytes of `key`'s entry in `pool`, written `version` times: each write of a test has its own.
    fn entry(key: &PageKey, pool: usize, version: u8) -> Vec<u8> {
        let seed = key.as_bytes();
        (0..page_bytes(pool)).map(|index| seed[index % 32] ^ (pool as u8 * 31) ^ version ^ (index as u8)).collect()
    }

    /// One rank's pools: each backend wrapped so a test can inject faults.
    struct Rank {
        backends: Vec<Arc<FaultyStorage<MemoryStorage>>>,
        groups: GroupStorage,
    }

    fn rank() -> Rank {
        let backends: Vec<Arc<FaultyStorage<MemoryStorage>>> = (0..POOLS.len())
            .map(|pool| Arc::new(FaultyStorage::new(MemoryStorage::new(&namespace(pool)), FaultPlan::default())))
            .collect();
        let sidecars = (1..POOLS.len())
            .map(|pool| SidecarPool {
                name: POOLS[pool].0.to_owned(),
                policy: policy(pool),
                backend: backends[pool].clone() as Arc<dyn StorageBackend>,
            })
            .collect();
        let groups = GroupStorage::new(backends[0].clone(), sidecars).expect("groups");
        Rank { backends, groups }
    }

    /// Writes the groups of `keys` with the trailing pools' entries at the prefix lengths `boundaries` (the pages
    /// ending each: a state as a node boundary offloads it).
    fn write(rank: &Rank, keys: &[PageKey], boundaries: &[usize], version: u8) -> usize {
        let kv_pages: Vec<Vec<u8>> = keys.iter().map(|key| entry(key, 0, version)).collect();
        let mut owned: Vec<Vec<(usize, Vec<u8>)>> = Vec::new();
        for pool in 1..POOLS.len() {
            let mut pages: Vec<usize> = match policy(pool) {
                HitPolicy::AllPages => (0..keys.len()).collect(),
                policy => boundaries.iter().flat_map(|&length| needed(policy, length)).collect(),
            };
            pages.sort_unstable();
            pages.dedup();
            owned.push(pages.into_iter().map(|page| (page, entry(&keys[page], pool, version))).collect());
        }
        let kv: Vec<PageSegments<'_>> = kv_pages.iter().map(|page| vec![page.as_slice()]).collect();
        let sidecars: Vec<Vec<(usize, PageSegments<'_>)>> = owned
            .iter()
            .map(|entries| entries.iter().map(|(page, bytes)| (*page, vec![bytes.as_slice()])).collect())
            .collect();
        rank.groups.set(keys, &kv, &sidecars).expect("set").pages
    }

    /// Reads the prefix of `length` pages and checks every byte of every entry of the restored prefix against what
    /// was written (`version`); returns the restored length.
    fn read(rank: &Rank, keys: &[PageKey], length: usize, version: u8) -> usize {
        let mut buffers: Vec<Vec<Vec<u8>>> = (0..POOLS.len())
            .map(|pool| {
                let count = if pool == 0 { length } else { needed(policy(pool), length).len() };
                vec![vec![0u8; page_bytes(pool)]; count]
            })
            .collect();
        let (kv, sidecars) = buffers.split_first_mut().expect("pools");
        let mut kv: Vec<Vec<&mut [u8]>> = kv.iter_mut().map(|page| vec![page.as_mut_slice()]).collect();
        let mut sidecar_pages: Vec<Vec<Vec<&mut [u8]>>> =
            sidecars.iter_mut().map(|pages| pages.iter_mut().map(|page| vec![page.as_mut_slice()]).collect()).collect();
        let restored = rank.groups.get(keys, length, &mut kv, &mut sidecar_pages).expect("get");
        drop((kv, sidecar_pages));
        assert!(restored <= length);
        if restored > 0 {
            for page in 0..restored {
                assert!(buffers[0][page] == entry(&keys[page], 0, version), "kv page {page} of {restored}");
            }
            for pool in 1..POOLS.len() {
                let read = needed(policy(pool), length);
                for page in needed(policy(pool), restored) {
                    assert!(
                        buffers[pool][page - read.start] == entry(&keys[page], pool, version),
                        "{} entry of page {page}, restoring {restored}",
                        POOLS[pool].0
                    );
                }
            }
        }
        restored
    }

    /// A run of 10 pages with states offloaded at 4 and 8 pages: 4 and 8 are restorable, and read back whole.
    #[test]
    fn groups_round_trip_with_every_pool() {
        let rank = rank();
        let keys = random_keys(10);
        assert_eq!(write(&rank, &keys, &[4, 8], 1), 10);
        let found = rank.groups.query(&keys).unwrap();
        assert_eq!(found.lengths, [4, 8]);
        assert_eq!(read(&rank, &keys, 8, 1), 8);
        assert_eq!(read(&rank, &keys, 4, 1), 4);
        // a length that is not restorable restores nothing
        assert_eq!(read(&rank, &keys, 6, 1), 0);
    }

    /// The faults behind SGLang's silent wrong outputs after load-back, each a miss at its page.
    #[test]
    fn a_missing_corrupt_or_evicted_sidecar_entry_cuts_the_prefix() {
        // an indexer entry missing at page 5: the KV pages past it are not restorable
        let rank = rank();
        let keys = random_keys(10);
        write(&rank, &keys, &[4, 8, 10], 1);
        rank.backends[1].inner().remove(&keys[5..6]).unwrap();
        assert_eq!(rank.groups.query(&keys).unwrap().lengths, [4]);
        assert_eq!(read(&rank, &keys, 4, 1), 4);
        // a state entry reported damaged (a checksummed backend) on read: the prefix it ends is not restored
        let rank = self::rank();
        write(&rank, &keys, &[4, 8], 1);
        rank.backends[2].set_plan(FaultPlan { corruption_ppm: 1_000_000, ..FaultPlan::default() });
        assert_eq!(read(&rank, &keys, 8, 1), 0);
        rank.backends[2].set_plan(FaultPlan::default());
        assert_eq!(read(&rank, &keys, 8, 1), 8);
        // a sliding-window entry evicted between the query and the read
        let found = rank.groups.query(&keys).unwrap();
        assert_eq!(found.longest(), 8);
        rank.backends[3].inner().remove(&keys[6..7]).unwrap();
        assert_eq!(read(&rank, &keys, 8, 1), 0, "the window of 8 lost its page 6");
        assert_eq!(rank.groups.query(&keys).unwrap().lengths, [4]);
        assert_eq!(read(&rank, &keys, 4, 1), 4);
    }

    /// A writer that stops halfway: sidecar entries written and the KV not (the KV call fails), or an indexer write
    /// failing part way (the KV is not written past it). No KV page is ever restorable without its group.
    #[test]
    fn a_writer_stopped_halfway_leaves_no_kv_page_without_its_group() {
        let keys = random_keys(8);
        let rank = rank();
        // every call to the KV backend fails from now on: the sidecars are written, the KV is not
        rank.backends[0].set_plan(FaultPlan { fail_call: Some(rank.backends[0].calls() + 1), ..FaultPlan::default() });
        assert!(write_result(&rank, &keys).is_err());
        rank.backends[0].set_plan(FaultPlan::default());
        assert_eq!(rank.groups.query(&keys).unwrap().longest(), 0);
        // the indexer takes only the first 3 entries of its batch: the KV stops at page 3
        let rank = self::rank();
        rank.backends[1].set_plan(FaultPlan { partial_batch: Some(3), ..FaultPlan::default() });
        assert_eq!(write(&rank, &keys, &[2, 3, 8], 1), 3);
        rank.backends[1].set_plan(FaultPlan::default());
        assert_eq!(rank.backends[0].inner().batch_exists(&keys).unwrap(), 3, "no KV page past the indexer's");
        assert_eq!(rank.groups.query(&keys).unwrap().lengths, [2, 3]);
        assert_eq!(read(&rank, &keys, 3, 1), 3);
    }

    fn write_result(rank: &Rank, keys: &[PageKey]) -> Result<usize, hicache_core::error::Error> {
        let kv_pages: Vec<Vec<u8>> = keys.iter().map(|key| entry(key, 0, 1)).collect();
        let kv: Vec<PageSegments<'_>> = kv_pages.iter().map(|page| vec![page.as_slice()]).collect();
        let owned: Vec<Vec<(usize, Vec<u8>)>> = (1..POOLS.len())
            .map(|pool| (0..keys.len()).map(|page| (page, entry(&keys[page], pool, 1))).collect())
            .collect();
        let sidecars: Vec<Vec<(usize, PageSegments<'_>)>> = owned
            .iter()
            .map(|entries| entries.iter().map(|(page, bytes)| (*page, vec![bytes.as_slice()])).collect())
            .collect();
        rank.groups.set(keys, &kv, &sidecars).map(|write| write.pages)
    }

    /// Two tensor-parallel ranks holding their states at different boundaries agree on one length both restore.
    #[test]
    fn ranks_with_different_windows_agree_on_one_length() {
        let keys = random_keys(12);
        let (first, second) = (rank(), rank());
        write(&first, &keys, &[4, 8, 12], 1);
        write(&second, &keys, &[4, 6, 12], 1);
        // the first rank's state at 12 is evicted: it can restore 4 and 8, the second 4, 6 and 12
        first.backends[2].inner().remove(&keys[11..12]).unwrap();
        let (a, b) = (first.groups.query(&keys).unwrap(), second.groups.query(&keys).unwrap());
        assert_eq!((a.lengths.as_slice(), b.lengths.as_slice()), (&[4, 8][..], &[4, 6, 12][..]));
        let agreed = agreed_prefix(&[&a.lengths, &b.lengths], keys.len());
        assert_eq!(agreed, 4, "the least of the longest (8, 12) is not restorable on the second rank");
        assert_eq!((read(&first, &keys, agreed, 1), read(&second, &keys, agreed, 1)), (4, 4));
    }

    #[test]
    fn pools_must_be_named_once_and_kept_apart() {
        let memory = |pool: usize| Arc::new(MemoryStorage::new(&namespace(pool))) as Arc<dyn StorageBackend>;
        let pool = |name: &str, backend| SidecarPool { name: name.to_owned(), policy: HitPolicy::AllPages, backend };
        let error = GroupStorage::new(memory(0), vec![pool("kv", memory(1))]).unwrap_err().to_string();
        assert!(error.contains("sidecars") && error.contains("\"kv\""), "{error}");
        let error = GroupStorage::new(memory(0), vec![pool("a", memory(1)), pool("a", memory(2))]).unwrap_err();
        assert!(error.to_string().contains("given twice"), "{error}");
        let error = GroupStorage::new(memory(0), vec![pool("indexer", memory(0))]).unwrap_err().to_string();
        assert!(error.contains("`kv` and `indexer`") && error.contains("same namespace"), "{error}");
    }

    /// What the test does to one rank's pools.
    #[derive(Clone, Debug)]
    enum Step {
        /// Writes run `run`'s groups (version `version`) with states at these boundaries.
        Write { run: usize, boundaries: Vec<usize> },
        /// Removes the entry of page `page` of run `run` from pool `pool`.
        Evict { run: usize, pool: usize, page: usize },
        /// Queries run `run`, evicts `pool`'s entry of a page of the longest prefix, then reads it.
        EvictBetween { run: usize, pool: usize, page: usize },
        /// Reads run `run`'s longest restorable prefix with `pool`'s reads reported damaged.
        Corrupt { run: usize, pool: usize },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0usize..3, prop::collection::vec(1usize..=10, 0..4))
                .prop_map(|(run, boundaries)| Step::Write { run, boundaries }),
            (0usize..3, 0usize..4, 0usize..10).prop_map(|(run, pool, page)| Step::Evict { run, pool, page }),
            (0usize..3, 0usize..4, 0usize..10).prop_map(|(run, pool, page)| Step::EvictBetween { run, pool, page }),
            (0usize..3, 1usize..4).prop_map(|(run, pool)| Step::Corrupt { run, pool }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// For random writes, evictions and faults per pool, against a model of which entries each pool holds:
        /// every query answers the model's restorable lengths, and every read restores a prefix that is complete,
        /// byte for byte, in every pool (the checks of `read`), and never one the model cannot restore.
        #[test]
        fn every_restored_prefix_is_complete_in_every_pool(steps in prop::collection::vec(step(), 1..24)) {
            let rank = rank();
            let runs: Vec<Vec<PageKey>> = (0..3).map(|_| random_keys(10)).collect();
            // per run, per pool, per page: whether the pool holds the entry
            let mut held = vec![vec![vec![false; 10]; POOLS.len()]; 3];
            let model = |held: &Vec<Vec<bool>>| {
                let presence: Vec<hicache_core::storage::groups::PoolPresence<'_>> = (1..POOLS.len())
                    .map(|pool| hicache_core::storage::groups::PoolPresence { policy: policy(pool), held: &held[pool] })
                    .collect();
                restorable(&held[0], &presence)
            };
            for step in steps {
                match step {
                    Step::Write { run, boundaries } => {
                        let written = write(&rank, &runs[run], &boundaries, 1);
                        prop_assert_eq!(written, 10);
                        for (pool, pool_held) in held[run].iter_mut().enumerate() {
                            let pages: Vec<usize> = match pool {
                                0 | 1 => (0..10).collect(),
                                _ => boundaries.iter().flat_map(|&length| needed(policy(pool), length)).collect(),
                            };
                            for page in pages {
                                pool_held[page] = true;
                            }
                        }
                    }
                    Step::Evict { run, pool, page } => {
                        rank.backends[pool].inner().remove(&runs[run][page..=page]).unwrap();
                        held[run][pool][page] = false;
                    }
                    Step::EvictBetween { run, pool, page } => {
                        let found = rank.groups.query(&runs[run]).unwrap();
                        let longest = found.longest();
                        rank.backends[pool].inner().remove(&runs[run][page..=page]).unwrap();
                        held[run][pool][page] = false;
                        let restored = read(&rank, &runs[run], longest, 1);
                        prop_assert!(restored == 0 || model(&held[run]).lengths.contains(&restored));
                    }
                    Step::Corrupt { run, pool } => {
                        let longest = rank.groups.query(&runs[run]).unwrap().longest();
                        rank.backends[pool].set_plan(FaultPlan { corruption_ppm: 1_000_000, ..FaultPlan::default() });
                        let restored = read(&rank, &runs[run], longest, 1);
                        rank.backends[pool].set_plan(FaultPlan::default());
                        // every pool holds an entry a prefix needs, so a damaged one restores none
                        prop_assert_eq!(restored, 0);
                    }
                }
                for run in 0..3 {
                    let found = rank.groups.query(&runs[run]).unwrap();
                    let expected = model(&held[run]);
                    prop_assert_eq!(&found.lengths, &expected.lengths, "run {}", run);
                    let longest = found.longest();
                    prop_assert_eq!(read(&rank, &runs[run], longest, 1), longest);
                }
            }
        }
    }
}
