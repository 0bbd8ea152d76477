//! Damaged files, leftovers of crashed writers, hostile model names, scoped clearing, capacity and faults.

use std::fs::{File, OpenOptions};
use std::path::Path;
use std::time::{Duration, SystemTime};

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::PageKey;
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FailureKind, FaultPlan, FaultyStorage, GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, put, random_keys, random_pages};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

fn namespace(model: &str) -> StorageNamespace {
    StorageNamespace {
        tp_rank: 1,
        tp_size: 2,
        ..StorageNamespace::single_rank(
            model,
            KvGeometry::mha(2, 2, 8, KvDtype::Bf16).expect("geometry"),
            HostLayout::PageFirst,
            4,
        )
    }
}

const PAGE: usize = 512;

fn open(dir: &Path, format: FileFormat, model: &str) -> FileStorage {
    FileStorage::open(FileConfig { segment_threshold: 0, ..FileConfig::new(dir, format) }, &namespace(model))
        .expect("opens")
}

fn is_corrupt(outcome: &GetOutcome) -> bool {
    matches!(outcome, GetOutcome::Failed(failure) if failure.kind == FailureKind::Corrupt)
}

#[test]
fn damaged_pages_fail_alone_native_ones_are_removed_and_sglang_ones_of_another_size_stay() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let storage = open(dir.path(), format, "m");
        let keys = random_keys(4);
        let pages = random_pages(4, PAGE);
        assert!(put(&storage, &keys, &pages).iter().all(|outcome| *outcome == SetOutcome::Stored));
        // page 0 truncated, page 2 grown by a byte
        OpenOptions::new().write(true).open(storage.page_path(&keys[0])).unwrap().set_len(100).unwrap();
        let grown = storage.page_path(&keys[2]);
        let length = std::fs::metadata(&grown).unwrap().len();
        OpenOptions::new().write(true).open(&grown).unwrap().set_len(length + 1).unwrap();
        let (outcomes, buffers) = fetch(&storage, &keys, PAGE, 0);
        assert_eq!((&outcomes[1], &outcomes[3]), (&GetOutcome::Hit, &GetOutcome::Hit), "{format:?}");
        assert_eq!((&buffers[1], &buffers[3]), (&pages[1], &pages[3]));
        match format {
            FileFormat::Native => {
                // the namespace is in the path: a page of the wrong length is damaged, removed and written again
                assert!(is_corrupt(&outcomes[0]) && is_corrupt(&outcomes[2]), "{outcomes:?}");
                assert!(!storage.page_path(&keys[0]).exists() && !grown.exists(), "damaged files go");
                assert_eq!(put(&storage, &keys[..1], &pages[..1]), [SetOutcome::Stored]);
                let (outcomes, buffers) = fetch(&storage, &keys[..1], PAGE, 0);
                assert_eq!((&outcomes[0], &buffers[0]), (&GetOutcome::Hit, &pages[0]));
            }
            FileFormat::Sglang => {
                // SGLang's names cannot tell namespaces of other sizes apart: it may be another's page, so it stays
                let mismatch = |outcome: &GetOutcome| matches!(outcome, GetOutcome::Failed(failure) if failure.kind == FailureKind::SizeMismatch);
                assert!(mismatch(&outcomes[0]) && mismatch(&outcomes[2]), "{outcomes:?}");
                assert_eq!(std::fs::metadata(storage.page_path(&keys[0])).unwrap().len(), 100, "left in place");
                assert!(matches!(&put(&storage, &keys[..1], &pages[..1])[0],
                    SetOutcome::Failed(failure) if failure.kind == FailureKind::SizeMismatch));
                assert_eq!(std::fs::metadata(storage.page_path(&keys[0])).unwrap().len(), 100, "not overwritten");
                assert!(!storage.exists(&keys[0]).unwrap(), "a page of another size is no page of this namespace");
            }
        }
    }
}

#[test]
fn native_pages_detect_flipped_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path(), FileFormat::Native, "m");
    let keys = random_keys(2);
    let pages = random_pages(2, PAGE);
    put(&storage, &keys, &pages);
    let path = storage.page_path(&keys[1]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[PAGE / 2] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    let (outcomes, _) = fetch(&storage, &keys, PAGE, 0);
    assert_eq!(outcomes[0], GetOutcome::Hit);
    assert!(is_corrupt(&outcomes[1]), "{outcomes:?}");
    // a file that is not a hicache page at all
    std::fs::write(storage.page_path(&keys[1]), vec![0u8; PAGE + 16]).unwrap();
    let (outcomes, _) = fetch(&storage, &keys[1..], PAGE, 0);
    assert!(
        matches!(&outcomes[0], GetOutcome::Failed(failure) if failure.message.contains("bad magic")),
        "{outcomes:?}"
    );
}

#[test]
fn a_crashed_writers_temporary_file_is_no_page_and_clear_removes_it() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let storage = open(dir.path(), format, "m");
        let keys = random_keys(1);
        let path = storage.page_path(&keys[0]);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let name = path.file_name().unwrap().to_str().unwrap();
        let temporary = path.with_file_name(format!(".{name}.tmp-00000000deadbeef"));
        std::fs::write(&temporary, vec![7u8; 100]).unwrap();
        assert!(!storage.exists(&keys[0]).unwrap());
        assert_eq!(fetch(&storage, &keys, PAGE, 0).0, [GetOutcome::Miss]);
        assert_eq!(storage.clear().unwrap(), 0, "{format:?}: a temporary file is not a page");
        assert!(!temporary.exists(), "{format:?}: clear removes it anyway");
    }
}

#[test]
fn hostile_model_names_stay_inside_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path(), FileFormat::Sglang, "../../etc/passwd");
    let keys = random_keys(1);
    let path = storage.page_path(&keys[0]);
    assert_eq!(path.parent().unwrap(), dir.path());
    assert!(path.file_name().unwrap().to_str().unwrap().ends_with("_..-..-etc-passwd_1_2.bin"), "{}", path.display());
    assert_eq!(put(&storage, &keys, &random_pages(1, PAGE)), [SetOutcome::Stored]);
    let error = FileStorage::open(
        FileConfig { segment_threshold: 0, ..FileConfig::new(dir.path(), FileFormat::Sglang) },
        &namespace("a\0b"),
    )
    .unwrap_err();
    assert!(error.to_string().starts_with("model:"), "{error}");
}

#[test]
fn clearing_the_sglang_directory_spares_other_namespaces_and_foreign_files() {
    let dir = tempfile::tempdir().unwrap();
    let mine = open(dir.path(), FileFormat::Sglang, "org/model");
    let other_model = open(dir.path(), FileFormat::Sglang, "org/model2");
    let other_rank = FileStorage::open(
        FileConfig { segment_threshold: 0, ..FileConfig::new(dir.path(), FileFormat::Sglang) },
        &StorageNamespace { tp_rank: 0, ..namespace("org/model") },
    )
    .unwrap();
    let keys = random_keys(3);
    let pages = random_pages(3, PAGE);
    for storage in [&mine, &other_model, &other_rank] {
        put(storage, &keys, &pages);
    }
    std::fs::write(dir.path().join("notes.txt"), "not a page").unwrap();
    assert_eq!(mine.clear().unwrap(), 3);
    assert_eq!(mine.batch_exists(&keys).unwrap(), 0);
    assert_eq!(other_model.batch_exists(&keys).unwrap(), 3);
    assert_eq!(other_rank.batch_exists(&keys).unwrap(), 3);
    assert!(dir.path().join("notes.txt").exists());
}

fn set_mtime(path: &Path, seconds_ago: u64) {
    let file = File::options().write(true).open(path).unwrap();
    file.set_modified(SystemTime::now() - Duration::from_secs(seconds_ago)).unwrap();
}

#[test]
fn capacity_evicts_least_recently_used_pages_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let file_bytes = (PAGE + 16) as u64;
    let config = FileConfig {
        capacity_bytes: Some(3 * file_bytes),
        segment_threshold: 0,
        ..FileConfig::new(dir.path(), FileFormat::Native)
    };
    let storage = FileStorage::open(config.clone(), &namespace("m")).unwrap();
    let keys = random_keys(6);
    let pages = random_pages(6, PAGE);
    // one page per call: within one batch the pages are written in parallel, in no defined recency order
    for index in 0..3 {
        put(&storage, &keys[index..=index], &pages[index..=index]);
    }
    assert_eq!(storage.usage(), Some((3, 3 * file_bytes)));
    // reading page 0 makes it recent, so page 1 is the least recently used
    assert_eq!(fetch(&storage, &keys[..1], PAGE, 0).0, [GetOutcome::Hit]);
    put(&storage, &keys[3..4], &pages[3..4]);
    let present: Vec<bool> = keys[..4].iter().map(|key| storage.exists(key).unwrap()).collect();
    assert_eq!(present, [true, false, true, true]);
    assert_eq!(storage.usage(), Some((3, 3 * file_bytes)));
    assert_eq!(storage.stats().removed, 1);

    // a restart rebuilds the account from the files, oldest modification first
    for (key, age) in [(keys[0], 30), (keys[2], 20), (keys[3], 10)] {
        set_mtime(&storage.page_path(&key), age);
    }
    drop(storage);
    let reopened = FileStorage::open(config, &namespace("m")).unwrap();
    assert_eq!(reopened.usage(), Some((3, 3 * file_bytes)));
    put(&reopened, &keys[4..6], &pages[4..6]);
    let present: Vec<bool> = keys.iter().map(|key| reopened.exists(key).unwrap()).collect();
    assert_eq!(present, [false, false, false, true, true, true]);
    let error = FileStorage::open(
        FileConfig {
            capacity_bytes: Some(10),
            segment_threshold: 0,
            ..FileConfig::new(dir.path(), FileFormat::Native)
        },
        &namespace("m"),
    )
    .unwrap_err();
    assert!(error.to_string().starts_with("capacity_bytes: 10 bytes cannot hold one page of"), "{error}");
}

#[test]
fn faults_injected_around_the_file_backend() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<PageKey> = random_keys(4);
    let pages = random_pages(4, PAGE);
    let storage = FaultyStorage::new(
        open(dir.path(), FileFormat::Native, "m"),
        FaultPlan { partial_batch: Some(2), ..FaultPlan::default() },
    );
    let outcomes = put(&storage, &keys, &pages);
    assert_eq!(&outcomes[..2], [SetOutcome::Stored, SetOutcome::Stored]);
    assert!(matches!(&outcomes[2], SetOutcome::Failed(failure) if failure.kind == FailureKind::Injected));
    assert_eq!(storage.inner().batch_exists(&keys).unwrap(), 2, "unattempted pages were not written");
    storage.set_plan(FaultPlan { evict_after_exists: true, ..FaultPlan::default() });
    assert_eq!(storage.batch_exists(&keys).unwrap(), 2);
    let (outcomes, buffers) = fetch(&storage, &keys[..2], PAGE, 0);
    assert_eq!(outcomes, [GetOutcome::Miss, GetOutcome::Hit]);
    assert_eq!(buffers[1], pages[1]);
}
