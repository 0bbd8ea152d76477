//! Page groups of a hybrid model in the file tier: a backend per pool (the KV and its sidecar pools), each in its
//! own namespace of one directory. Real files: an entry damaged on the disk, a writer process killed between its
//! sidecar entries and its KV pages, and the `sglang` format's names for sidecar entries.
//!
//! The killed writer is this test binary re-run as a child process (the test notices the environment variable).

use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use hicache_core::error::Error;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::PageKey;
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::groups::{GroupStorage, HitPolicy, SidecarPool, needed};
use hicache_core::storage::{GetOutcome, PageSegments, PageSegmentsMut, SetOutcome, StorageBackend, StorageStats};
use hicache_core::testing::conformance::random_keys;
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

mod support;

const DIR_ENV: &str = "HICACHE_GROUP_WRITER_DIR";
const KEYS_ENV: &str = "HICACHE_GROUP_WRITER_KEYS";
const KILLED_TEST: &str = "a_writer_killed_between_sidecars_and_kv_leaves_no_group";
/// The sidecar pools: an indexer (every page) and a Mamba state (the last page of a prefix), with their entry sizes.
const SIDECARS: [(&str, usize, HitPolicy); 2] =
    [("indexer", 8192, HitPolicy::AllPages), ("mamba", 12288, HitPolicy::TrailingPages { window: 1 })];

fn kv_namespace() -> StorageNamespace {
    StorageNamespace {
        tp_rank: 1,
        tp_size: 2,
        ..StorageNamespace::single_rank(
            "groups/hybrid",
            KvGeometry::mha(2, 2, 64, KvDtype::Bf16).expect("geometry"),
            HostLayout::PageFirst,
            4,
        )
    }
}

/// The namespace of pool `pool` (0 the KV, then the sidecars).
fn namespace(pool: usize) -> StorageNamespace {
    match pool {
        0 => kv_namespace(),
        _ => kv_namespace().sidecar(SIDECARS[pool - 1].0, SIDECARS[pool - 1].1).expect("sidecar"),
    }
}

fn open_pool(dir: &Path, format: FileFormat, pool: usize) -> Arc<FileStorage> {
    // the indexer a file per entry, so a test can find one on the disk
    let config = FileConfig {
        segment_threshold: if pool == 1 { 0 } else { hicache_storage_file::DEFAULT_SEGMENT_THRESHOLD },
        ..FileConfig::new(dir, format)
    };
    Arc::new(FileStorage::open(config, &namespace(pool)).expect("opens"))
}

fn groups_over(kv: Arc<dyn StorageBackend>, sidecars: &[Arc<FileStorage>]) -> GroupStorage {
    let pools = SIDECARS
        .iter()
        .zip(sidecars)
        .map(|(&(name, _, policy), backend)| SidecarPool {
            name: name.to_owned(),
            policy,
            backend: backend.clone() as Arc<dyn StorageBackend>,
        })
        .collect();
    GroupStorage::new(kv, pools).expect("groups")
}

fn open(dir: &Path, format: FileFormat) -> GroupStorage {
    let sidecars: Vec<Arc<FileStorage>> = (1..=SIDECARS.len()).map(|pool| open_pool(dir, format, pool)).collect();
    groups_over(open_pool(dir, format, 0), &sidecars)
}

/// The bytes of `key`'s entry in `pool`.
fn entry(key: &PageKey, pool: usize) -> Vec<u8> {
    let seed = key.as_bytes();
    (0..namespace(pool).page_bytes()).map(|index| seed[index % 32] ^ (pool as u8 * 77) ^ (index as u8)).collect()
}

/// Writes the groups of `keys`, the Mamba state at the prefix lengths `boundaries`.
fn write(groups: &GroupStorage, keys: &[PageKey], boundaries: &[usize]) -> Result<usize, Error> {
    let kv_pages: Vec<Vec<u8>> = keys.iter().map(|key| entry(key, 0)).collect();
    let indexer: Vec<(usize, Vec<u8>)> = (0..keys.len()).map(|page| (page, entry(&keys[page], 1))).collect();
    let state: Vec<(usize, Vec<u8>)> =
        boundaries.iter().map(|&length| (length - 1, entry(&keys[length - 1], 2))).collect();
    let kv: Vec<PageSegments<'_>> = kv_pages.iter().map(|page| vec![page.as_slice()]).collect();
    let sidecars: Vec<Vec<(usize, PageSegments<'_>)>> = [&indexer, &state]
        .iter()
        .map(|entries| entries.iter().map(|(page, bytes)| (*page, vec![bytes.as_slice()])).collect())
        .collect();
    groups.set(keys, &kv, &sidecars).map(|write| write.pages)
}

/// Reads the prefix of `length` pages, checks every byte of the restored prefix in every pool, and returns its
/// length.
fn read(groups: &GroupStorage, keys: &[PageKey], length: usize) -> usize {
    let policies = [HitPolicy::AllPages, SIDECARS[0].2, SIDECARS[1].2];
    let mut buffers: Vec<Vec<Vec<u8>>> = (0..3)
        .map(|pool| vec![vec![0u8; namespace(pool).page_bytes()]; needed(policies[pool], length).len()])
        .collect();
    let (kv, sidecars) = buffers.split_first_mut().unwrap();
    let mut kv: Vec<PageSegmentsMut<'_>> = kv.iter_mut().map(|page| vec![page.as_mut_slice()]).collect();
    let mut sidecars: Vec<Vec<PageSegmentsMut<'_>>> =
        sidecars.iter_mut().map(|pages| pages.iter_mut().map(|page| vec![page.as_mut_slice()]).collect()).collect();
    let restored = groups.get(keys, length, &mut kv, &mut sidecars).expect("get");
    drop((kv, sidecars));
    for (pool, policy) in policies.iter().enumerate() {
        let read = needed(*policy, length);
        for page in needed(*policy, restored) {
            assert!(buffers[pool][page - read.start] == entry(&keys[page], pool), "pool {pool}, page {page}");
        }
    }
    restored
}

/// Files under `dir` whose names start with `prefix`.
fn files_named(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    support::files_under(dir, |path| {
        path.file_name().and_then(|name| name.to_str()).is_some_and(|name| name.starts_with(prefix))
    })
}

/// Groups round trip in both formats; in the native one an indexer entry damaged on the disk fails its checksum,
/// and the prefix ends before its page.
#[test]
fn groups_round_trip_and_a_damaged_entry_cuts_the_prefix() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let groups = open(dir.path(), format);
        let keys = random_keys(8);
        assert_eq!(write(&groups, &keys, &[3, 6, 8]).unwrap(), 8);
        assert_eq!(groups.query(&keys).unwrap().lengths, [3, 6, 8], "{format:?}");
        assert_eq!(read(&groups, &keys, 8), 8);
        assert_eq!(read(&groups, &keys, 6), 6);
        if format == FileFormat::Native {
            let [damaged] = files_named(dir.path(), &keys[4].to_string()[..])
                .into_iter()
                .filter(|path| path.extension().is_some_and(|extension| extension == "page"))
                .collect::<Vec<_>>()
                .try_into()
                .expect("one indexer file of page 4");
            let file = std::fs::OpenOptions::new().read(true).write(true).open(&damaged).unwrap();
            let mut byte = [0u8];
            file.read_exact_at(&mut byte, 100).unwrap();
            file.write_all_at(&[!byte[0]], 100).unwrap();
            assert_eq!(read(&groups, &keys, 8), 0, "the indexer's page 4 is damaged");
            assert_eq!(read(&groups, &keys, 3), 3);
            // the damaged entry was forgotten: the query no longer counts past it
            assert_eq!(groups.query(&keys).unwrap().lengths, [3]);
        }
    }
}

/// The `sglang` format names a sidecar entry as SGLang's `HiCacheFile` v2 does: `{key}.{pool}_{model}_{rank}_{size}`.
#[test]
fn sglang_format_names_sidecar_entries_as_hicache_file() {
    let dir = tempfile::tempdir().unwrap();
    let groups = open(dir.path(), FileFormat::Sglang);
    let keys = random_keys(2);
    write(&groups, &keys, &[2]).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| !name.starts_with('.'))
        .collect();
    names.sort();
    let mut expected = vec![
        format!("{}_groups-hybrid_1_2.bin", keys[0]),
        format!("{}_groups-hybrid_1_2.bin", keys[1]),
        format!("{}.indexer_groups-hybrid_1_2.bin", keys[0]),
        format!("{}.indexer_groups-hybrid_1_2.bin", keys[1]),
        format!("{}.mamba_groups-hybrid_1_2.bin", keys[1]),
    ];
    expected.sort();
    assert_eq!(names, expected);
    // raw entries, as SGLang writes them
    let state = std::fs::read(dir.path().join(format!("{}.mamba_groups-hybrid_1_2.bin", keys[1]))).unwrap();
    assert!(state == entry(&keys[1], 2));
    // and the KV backend does not take a sidecar's files for its own pages
    assert_eq!(open_pool(dir.path(), FileFormat::Sglang, 0).list().unwrap().len(), 2);
}

/// A KV backend that kills its process when asked to write: the writer stops with its sidecar entries written and
/// none of its KV pages.
struct KilledOnWrite(Arc<FileStorage>);

impl StorageBackend for KilledOnWrite {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn namespace(&self) -> Option<&StorageNamespace> {
        self.0.namespace()
    }

    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
        self.0.batch_exists(keys)
    }

    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
        self.0.batch_get(keys, pages)
    }

    fn batch_set(&self, _: &[PageKey], _: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
        // `kill -9` of this process: it dies while waiting for `kill`, and nothing of it runs after
        let killed = Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
        unreachable!("kill -9 of this process returned: {killed:?}")
    }

    fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
        self.0.remove(keys)
    }

    fn clear(&self) -> Result<u64, Error> {
        self.0.clear()
    }

    fn stats(&self) -> StorageStats {
        self.0.stats()
    }
}

#[test]
fn a_writer_killed_between_sidecars_and_kv_leaves_no_group() {
    let keys_of = |text: &str| -> Vec<PageKey> { text.split(',').map(|key| key.parse().expect("key")).collect() };
    if let (Some(dir), Ok(keys)) = (std::env::var_os(DIR_ENV), std::env::var(KEYS_ENV)) {
        let dir = Path::new(&dir);
        let sidecars: Vec<Arc<FileStorage>> =
            (1..=SIDECARS.len()).map(|pool| open_pool(dir, FileFormat::Native, pool)).collect();
        let groups = groups_over(Arc::new(KilledOnWrite(open_pool(dir, FileFormat::Native, 0))), &sidecars);
        let _ = write(&groups, &keys_of(&keys), &[4, 6]);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let groups = open(dir.path(), FileFormat::Native);
    // the first 4 pages' groups are written whole; the writer then dies writing all 6
    let keys = random_keys(6);
    assert_eq!(write(&groups, &keys[..4], &[2, 4]).unwrap(), 4);
    // closed: its pages written behind are written before another process looks
    drop(groups);
    let listed: Vec<String> = keys.iter().map(ToString::to_string).collect();
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", KILLED_TEST, "--test-threads=1"])
        .env(DIR_ENV, dir.path())
        .env(KEYS_ENV, listed.join(","))
        .status()
        .unwrap();
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(status.signal(), Some(9), "the writer was killed: {status:?}");
    // its sidecar entries are there, its KV pages past the fourth are not: no group past 4 is restorable
    let groups = open(dir.path(), FileFormat::Native);
    let indexer = open_pool(dir.path(), FileFormat::Native, 1);
    assert_eq!(indexer.batch_exists(&keys).unwrap(), 6, "the killed writer's indexer entries");
    assert_eq!(groups.query(&keys).unwrap().lengths, [2, 4]);
    assert_eq!(read(&groups, &keys, 4), 4);
    assert_eq!(read(&groups, &keys, 6), 0, "the KV of pages 5 and 6 was never written");
}
