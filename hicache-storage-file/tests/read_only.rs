//! Read-only opens (what inspection commands use): nothing is created, changed or removed.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use hicache_core::Error;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FailureKind, GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, put, random_keys, random_pages};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

fn namespace() -> StorageNamespace {
    StorageNamespace::single_rank(
        "ro",
        KvGeometry::mha(2, 2, 8, KvDtype::Bf16).expect("geometry"),
        HostLayout::PageFirst,
        4,
    )
}

const PAGE: usize = 512;

fn read_only(dir: &Path, format: FileFormat) -> Result<FileStorage, Error> {
    let config = FileConfig { read_only: true, direct_io: true, segment_threshold: 0, ..FileConfig::new(dir, format) };
    FileStorage::open(config, &namespace())
}

/// Every path under `dir`, sorted.
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(next) = stack.pop() {
        for entry in std::fs::read_dir(&next).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path.clone());
            }
            found.push(path);
        }
    }
    found.sort();
    found
}

#[test]
fn a_missing_directory_is_an_error_naming_it_and_is_not_created() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("does/not/exist");
    let error = read_only(&missing, FileFormat::Native).unwrap_err();
    assert!(matches!(error, Error::InvalidArgument { field: "dir", .. }), "{error}");
    assert!(error.to_string().contains("does/not/exist"), "{error}");
    assert!(tree(dir.path()).is_empty(), "nothing was created");
}

#[test]
fn an_empty_directory_reads_as_empty_and_stays_empty() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let storage = read_only(dir.path(), format).unwrap();
        assert_eq!(storage.list().unwrap(), [], "{format:?}");
        let keys = random_keys(3);
        assert_eq!(storage.batch_exists(&keys).unwrap(), 0);
        let (outcomes, _) = fetch(&storage, &keys, PAGE, 0);
        assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Miss), "{outcomes:?}");
        assert!(tree(dir.path()).is_empty(), "{format:?}: {:?}", tree(dir.path()));
    }
}

#[test]
fn writes_removals_and_clears_are_refused_and_damage_is_left_in_place() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let keys = random_keys(3);
        let pages = random_pages(3, PAGE);
        let writer =
            FileStorage::open(FileConfig { segment_threshold: 0, ..FileConfig::new(dir.path(), format) }, &namespace())
                .unwrap();
        assert!(put(&writer, &keys[..2], &pages[..2]).iter().all(|outcome| *outcome == SetOutcome::Stored));
        OpenOptions::new().write(true).open(writer.page_path(&keys[1])).unwrap().set_len(100).unwrap();
        let before = tree(dir.path());

        let storage = read_only(dir.path(), format).unwrap();
        let mut listed: Vec<_> = storage.list().unwrap().into_iter().map(|(key, _)| key).collect();
        listed.sort();
        // in SGLang's layout a file of another length is not this namespace's page
        let mut expected = if format == FileFormat::Native { keys[..2].to_vec() } else { keys[..1].to_vec() };
        expected.sort();
        assert_eq!(listed, expected, "{format:?}");
        let outcomes = put(&storage, &keys[2..], &pages[2..]);
        assert!(
            matches!(&outcomes[0], SetOutcome::Failed(failure) if failure.kind == FailureKind::Rejected
                && failure.message.contains("read-only")),
            "{format:?}: {outcomes:?}"
        );
        assert!(storage.remove(&keys[..1]).unwrap_err().to_string().contains("read-only"));
        assert!(storage.clear().unwrap_err().to_string().contains("read-only"));
        let (outcomes, buffers) = fetch(&storage, &keys[..2], PAGE, 0);
        assert_eq!((&outcomes[0], &buffers[0]), (&GetOutcome::Hit, &pages[0]), "{format:?}");
        let damaged = if format == FileFormat::Native { FailureKind::Corrupt } else { FailureKind::SizeMismatch };
        assert!(
            matches!(&outcomes[1], GetOutcome::Failed(failure) if failure.kind == damaged),
            "{format:?}: {outcomes:?}"
        );
        assert_eq!(tree(dir.path()), before, "{format:?}: the read-only backend changed the directory");
    }
}
