//! The byte capacity holds across processes sharing a directory: several writers, each with the same capacity,
//! never leave more than it holds, and pages read recently outlive pages nobody read.
//!
//! The writers are this test binary re-run as child processes (the test notices the environment variable).

use std::path::Path;
use std::process::Command;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PageKey, page_key};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, put};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

const DIR_ENV: &str = "HICACHE_CAPACITY_WRITER_DIR";
const WRITER_ENV: &str = "HICACHE_CAPACITY_WRITER";
const TEST_NAME: &str = "processes_sharing_a_directory_hold_one_capacity";
/// 1 KiB pages.
const PAGE: usize = 1024;
const CAPACITY_PAGES: u64 = 50;

fn namespace() -> StorageNamespace {
    StorageNamespace::single_rank(
        "capacity",
        KvGeometry::mha(1, 1, 64, KvDtype::Bf16).expect("geometry"),
        HostLayout::PageFirst,
        4,
    )
}

fn open(dir: &Path, format: FileFormat) -> FileStorage {
    let file_bytes = (PAGE + if format == FileFormat::Native { 16 } else { 0 }) as u64;
    let config = FileConfig {
        capacity_bytes: Some(CAPACITY_PAGES * file_bytes),
        segment_threshold: 0,
        ..FileConfig::new(dir, format)
    };
    FileStorage::open(config, &namespace()).expect("opens")
}

fn key(writer: u32, index: u32) -> PageKey {
    page_key(None, &[writer, index])
}

/// The child: writes 120 pages of its own, one per call.
fn write_pages(dir: &Path, format: FileFormat, writer: u32) {
    let storage = open(dir, format);
    for index in 0..120 {
        let outcome = put(&storage, &[key(writer, index)], &[vec![writer as u8; PAGE]]);
        assert_eq!(outcome, [SetOutcome::Stored], "writer {writer}, page {index}");
    }
}

fn pages_in(dir: &Path) -> usize {
    let mut count = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.path().is_dir() {
                stack.push(entry.path());
            } else if !entry.file_name().to_string_lossy().starts_with('.') {
                count += 1;
            }
        }
    }
    count
}

#[test]
fn processes_sharing_a_directory_hold_one_capacity() {
    if let (Some(dir), Ok(writer)) = (std::env::var_os(DIR_ENV), std::env::var(WRITER_ENV)) {
        let (format, writer) = writer.split_once(':').expect("format:writer");
        let format = if format == "sglang" { FileFormat::Sglang } else { FileFormat::Native };
        write_pages(Path::new(&dir), format, writer.parse().expect("writer number"));
        return;
    }
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let name = if format == FileFormat::Native { "native" } else { "sglang" };
        let children: Vec<_> = (0..4)
            .map(|writer| {
                Command::new(std::env::current_exe().unwrap())
                    .args(["--exact", TEST_NAME, "--test-threads=1"])
                    .env(DIR_ENV, dir.path())
                    .env(WRITER_ENV, format!("{name}:{writer}"))
                    .spawn()
                    .unwrap()
            })
            .collect();
        for mut child in children {
            assert!(child.wait().unwrap().success(), "{format:?}: a writer failed");
        }
        let held = pages_in(dir.path());
        assert!(held as u64 <= CAPACITY_PAGES, "{format:?}: {held} pages for a capacity of {CAPACITY_PAGES}");
        assert!(held as u64 >= CAPACITY_PAGES * 8 / 10, "{format:?}: only {held} pages left");
        let storage = open(dir.path(), format);
        assert_eq!(storage.usage().map(|(pages, _)| pages), Some(held), "{format:?}: the account is the directory");
    }
}

#[test]
fn a_page_read_recently_outlives_one_nobody_read() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let writer = open(dir.path(), format);
        let keys: Vec<PageKey> = (0..CAPACITY_PAGES as u32).map(|index| key(9, index)).collect();
        for key in &keys {
            put(&writer, &[*key], &[vec![1u8; PAGE]]);
        }
        // file times come from a coarse clock, so pages written within a few milliseconds tie: space them a second
        // apart, oldest first, as pages written over a minute would be
        for (age, key) in (1..=keys.len() as u64).rev().zip(&keys) {
            std::fs::File::options()
                .write(true)
                .open(writer.page_path(key))
                .unwrap()
                .set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(age))
                .unwrap();
        }
        // another process (another backend here) reads the oldest page: its time is now the newest
        let reader = open(dir.path(), format);
        assert_eq!(fetch(&reader, &keys[..1], PAGE, 0).0, [GetOutcome::Hit]);
        drop(reader);
        put(&writer, &[key(9, 1000)], &[vec![2u8; PAGE]]);
        assert_eq!(writer.batch_exists(&keys[..1]).unwrap(), 1, "{format:?}: the page just read was evicted");
        assert_eq!(writer.batch_exists(&keys[1..2]).unwrap(), 0, "{format:?}: the least recent page stayed");
    }
}
