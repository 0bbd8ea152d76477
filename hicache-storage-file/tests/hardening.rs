//! What a shared directory can hold besides this namespace's intact pages: other namespaces' files in SGLang's
//! layout, damaged pages, pages copied onto other keys, directories and FIFOs at page paths, and paths that cannot
//! be checked. Nothing stored is lost, nothing blocks, and every page gets one answer.

use std::path::Path;
use std::time::{Duration, Instant};

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FailureKind, GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, put, random_keys, random_pages};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

/// 1 KiB pages: 1 layer × 1 head × 64 dims of bf16 × K and V × 4 tokens.
fn namespace(model: &str, dtype: KvDtype, page_size: usize) -> StorageNamespace {
    StorageNamespace::single_rank(
        model,
        KvGeometry::mha(1, 1, 64, dtype).expect("geometry"),
        HostLayout::LayerFirst,
        page_size,
    )
}

fn open(dir: &Path, format: FileFormat, namespace: &StorageNamespace) -> FileStorage {
    FileStorage::open(FileConfig { segment_threshold: 0, ..FileConfig::new(dir, format) }, namespace).expect("opens")
}

fn failed(outcome: &GetOutcome, kind: FailureKind) -> bool {
    matches!(outcome, GetOutcome::Failed(failure) if failure.kind == kind)
}

#[test]
fn sglang_layout_reads_and_clears_of_another_geometry_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let bf16 = namespace("m", KvDtype::Bf16, 4);
    let f32_64 = namespace("m", KvDtype::F32, 64);
    let mine = open(dir.path(), FileFormat::Sglang, &bf16);
    let other = open(dir.path(), FileFormat::Sglang, &f32_64);
    let keys = random_keys(3);
    let page = bf16.geometry.bytes_per_page(4);
    let pages = random_pages(3, page);
    assert!(put(&mine, &keys, &pages).iter().all(|outcome| *outcome == SetOutcome::Stored));
    // a native store and a stray folder below the SGLang directory
    let native = open(dir.path(), FileFormat::Native, &bf16);
    assert_eq!(put(&native, &keys[..1], &pages[..1]), [SetOutcome::Stored]);
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let nested = dir.path().join("sub").join(mine.page_path(&keys[0]).file_name().unwrap());
    std::fs::write(&nested, &pages[0]).unwrap();

    // the same file names, another page size: a mismatch per page, and nothing removed
    let other_page = f32_64.geometry.bytes_per_page(64);
    let (outcomes, _) = fetch(&other, &keys, other_page, 0);
    assert!(outcomes.iter().all(|outcome| failed(outcome, FailureKind::SizeMismatch)), "{outcomes:?}");
    // the names are the same, the lengths are not: another namespace's files are neither listed nor cleared
    assert_eq!(other.list().unwrap(), []);
    assert_eq!(other.clear().unwrap(), 0);
    assert_eq!(mine.batch_exists(&keys).unwrap(), 3);
    let (outcomes, buffers) = fetch(&mine, &keys, page, 0);
    assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit) && buffers == pages);
    assert_eq!(mine.clear().unwrap(), 3);
    assert!(nested.exists(), "clear never goes below the SGLang directory");
    assert_eq!(native.batch_exists(&keys[..1]).unwrap(), 1, "nor into the native tree");
    let (outcomes, buffers) = fetch(&native, &keys[..1], page, 0);
    assert_eq!((&outcomes[0], &buffers[0]), (&GetOutcome::Hit, &pages[0]));
}

#[test]
fn sglang_layout_listing_stays_in_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let bf16 = namespace("m", KvDtype::Bf16, 4);
    let mine = open(dir.path(), FileFormat::Sglang, &bf16);
    let keys = random_keys(2);
    let page = bf16.geometry.bytes_per_page(4);
    put(&mine, &keys[..1], &random_pages(1, page));
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::fs::write(dir.path().join("sub").join(mine.page_path(&keys[1]).file_name().unwrap()), vec![0u8; page])
        .unwrap();
    assert_eq!(mine.list().unwrap().iter().map(|(key, _)| *key).collect::<Vec<_>>(), keys[..1]);
}

#[test]
fn a_put_over_a_damaged_page_replaces_it_and_an_intact_one_is_present() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace("m", KvDtype::Bf16, 4);
    let storage = open(dir.path(), FileFormat::Native, &ns);
    let page = ns.geometry.bytes_per_page(4);
    let keys = random_keys(2);
    let pages = random_pages(2, page);
    put(&storage, &keys, &pages);
    let path = storage.page_path(&keys[0]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[page / 3] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    assert_eq!(put(&storage, &keys, &pages), [SetOutcome::Stored, SetOutcome::AlreadyPresent]);
    let (outcomes, buffers) = fetch(&storage, &keys, page, 0);
    assert_eq!(outcomes, [GetOutcome::Hit, GetOutcome::Hit]);
    assert_eq!(buffers, pages);
}

#[test]
fn a_page_copied_onto_another_key_or_namespace_is_not_a_hit() {
    let dir = tempfile::tempdir().unwrap();
    let one = namespace("model-a", KvDtype::Bf16, 4);
    let two = namespace("model-b", KvDtype::Bf16, 4);
    let a = open(dir.path(), FileFormat::Native, &one);
    let b = open(dir.path(), FileFormat::Native, &two);
    let page = one.geometry.bytes_per_page(4);
    let keys = random_keys(2);
    let pages = random_pages(2, page);
    put(&a, &keys, &pages);
    // key 0's file over key 1's path, and into the other model's namespace under key 0
    std::fs::copy(a.page_path(&keys[0]), a.page_path(&keys[1])).unwrap();
    std::fs::create_dir_all(b.page_path(&keys[0]).parent().unwrap()).unwrap();
    std::fs::copy(a.page_path(&keys[0]), b.page_path(&keys[0])).unwrap();
    let (outcomes, _) = fetch(&a, &keys, page, 0);
    assert_eq!(outcomes[0], GetOutcome::Hit);
    assert!(failed(&outcomes[1], FailureKind::Corrupt), "{outcomes:?}");
    let (outcomes, _) = fetch(&b, &keys[..1], page, 0);
    assert!(failed(&outcomes[0], FailureKind::Corrupt), "{outcomes:?}");
}

#[test]
fn a_directory_or_a_fifo_at_a_page_path_is_reported_never_read_and_never_stops_a_batch() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let ns = namespace("m", KvDtype::Bf16, 4);
        let storage = open(dir.path(), format, &ns);
        let page = ns.geometry.bytes_per_page(4);
        let keys = random_keys(3);
        let pages = random_pages(3, page);
        let (directory, fifo) = (storage.page_path(&keys[0]), storage.page_path(&keys[1]));
        std::fs::create_dir_all(&directory).unwrap();
        std::fs::create_dir_all(fifo.parent().unwrap()).unwrap();
        let fifo_name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path
        assert_eq!(unsafe { libc::mkfifo(fifo_name.as_ptr(), 0o600) }, 0);
        let started = Instant::now();
        let outcomes = put(&storage, &keys, &pages);
        assert!(matches!(&outcomes[0], SetOutcome::Failed(failure) if failure.message.contains("a directory")));
        assert!(matches!(&outcomes[1], SetOutcome::Failed(failure) if failure.message.contains("a FIFO")));
        assert_eq!(outcomes[2], SetOutcome::Stored, "{format:?}: the batch goes on");
        let (outcomes, buffers) = fetch(&storage, &keys, page, 0);
        assert!(failed(&outcomes[0], FailureKind::Io) && failed(&outcomes[1], FailureKind::Io), "{outcomes:?}");
        assert_eq!((&outcomes[2], &buffers[2]), (&GetOutcome::Hit, &pages[2]));
        assert_eq!(storage.batch_exists(&keys).unwrap(), 0, "not pages");
        assert!(started.elapsed() < Duration::from_secs(5), "{format:?}: something blocked");
        assert!(directory.is_dir() && fifo.exists(), "{format:?}: left in place");
        // removing all three: the directory cannot go as a page, and does not stop the others
        let error = storage.remove(&[keys[0], keys[2]]).unwrap_err().to_string();
        assert!(error.contains("removing"), "{error}");
        assert_eq!(storage.batch_exists(&keys[2..]).unwrap(), 0, "{format:?}: the page after it was removed");
    }
}

#[test]
fn a_path_that_cannot_be_checked_is_an_error_for_exists_and_get_alike() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace("m", KvDtype::Bf16, 4);
    let storage = open(dir.path(), FileFormat::Native, &ns);
    let page = ns.geometry.bytes_per_page(4);
    let keys = random_keys(1);
    // a regular file where the page's shard folder should be: checking the page fails with ENOTDIR
    let shard = storage.page_path(&keys[0]).parent().unwrap().to_path_buf();
    std::fs::create_dir_all(shard.parent().unwrap()).unwrap();
    std::fs::write(&shard, b"in the way").unwrap();
    let error = storage.batch_exists(&keys).unwrap_err().to_string();
    assert!(error.contains("Not a directory"), "{error}");
    let (outcomes, _) = fetch(&storage, &keys, page, 0);
    assert!(failed(&outcomes[0], FailureKind::Io), "{outcomes:?}");
}

#[test]
fn writers_name_their_temporary_files_at_random_and_remove_only_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace("m", KvDtype::Bf16, 4);
    let storage = open(dir.path(), FileFormat::Native, &ns);
    let page = ns.geometry.bytes_per_page(4);
    let keys = random_keys(1);
    // another writer's temporary file of the same page, named as a PID-based scheme would
    let path = storage.page_path(&keys[0]);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let theirs = path.with_file_name(format!(".{}.tmp-1-0", path.file_name().unwrap().to_str().unwrap()));
    std::fs::write(&theirs, b"half written").unwrap();
    assert_eq!(put(&storage, &keys, &random_pages(1, page)), [SetOutcome::Stored]);
    assert!(theirs.exists(), "another writer's temporary file is never touched");
    let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.starts_with('.') && !name.ends_with(".tmp-1-0"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_directory_removed_under_a_writer_is_not_made_again() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("cache");
    let ns = namespace("m", KvDtype::Bf16, 4);
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let storage = open(&dir, format, &ns);
        let page = ns.geometry.bytes_per_page(4);
        let keys = random_keys(2);
        let pages = random_pages(2, page);
        assert_eq!(put(&storage, &keys[..1], &pages[..1]), [SetOutcome::Stored]);
        // a `clear` of everything, or a process removing its temporary directory while its I/O threads still write
        std::fs::remove_dir_all(&dir).unwrap();
        let outcomes = put(&storage, &keys[1..], &pages[1..]);
        assert!(matches!(&outcomes[0], SetOutcome::Failed(failure) if failure.kind == FailureKind::Io), "{outcomes:?}");
        // the file system's own error is kept, for an engine to tell a vanished directory from a full disk
        let SetOutcome::Failed(failure) = &outcomes[0] else { unreachable!() };
        let io = failure.io_error().unwrap_or_else(|| panic!("{format:?}: no io::Error behind {failure}"));
        assert_eq!(io.raw_os_error(), Some(libc::ENOENT), "{format:?}: {io}");
        assert!(!dir.exists(), "{format:?}: the write made the removed directory again");
    }
}

#[test]
fn a_directory_that_cannot_be_made_fails_the_open_with_the_os_error() {
    let parent = tempfile::tempdir().unwrap();
    let file = parent.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let ns = namespace("m", KvDtype::Bf16, 4);
    let error = FileStorage::open(
        FileConfig { segment_threshold: 0, ..FileConfig::new(file.join("cache"), FileFormat::Native) },
        &ns,
    )
    .unwrap_err();
    assert_eq!(error.kind(), hicache_core::ErrorKind::Storage, "{error}");
    assert!(error.to_string().contains("a-file"), "names the path: {error}");
    let io = error.io_error().unwrap_or_else(|| panic!("no io::Error behind {error}"));
    assert_eq!(io.raw_os_error(), Some(libc::ENOTDIR), "{io}");
    assert_eq!(std::fs::read(&file).unwrap(), b"not a directory", "the file in the way is left alone");
}

#[test]
fn a_killed_writers_old_temporary_files_are_removed_at_open_and_fresh_ones_stay() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let ns = namespace("m", KvDtype::Bf16, 4);
        let keys = random_keys(2);
        let storage = open(dir.path(), format, &ns);
        let temporary = |key| {
            let path = storage.page_path(key);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            path.with_file_name(format!(".{}.tmp-00000000000000ff", path.file_name().unwrap().to_str().unwrap()))
        };
        let (old, fresh) = (temporary(&keys[0]), temporary(&keys[1]));
        std::fs::write(&old, b"half").unwrap();
        std::fs::write(&fresh, b"half").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&old)
            .unwrap()
            .set_modified(std::time::SystemTime::now() - hicache_storage_file::STALE_TEMPORARY_AGE * 2)
            .unwrap();
        // another namespace's old temporary file in the same directory is not ours to remove
        let other = open(dir.path(), format, &namespace("other", KvDtype::Bf16, 4));
        let foreign = {
            let path = other.page_path(&keys[0]);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            path.with_file_name(format!(".{}.tmp-00000000000000ff", path.file_name().unwrap().to_str().unwrap()))
        };
        std::fs::write(&foreign, b"half").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&foreign)
            .unwrap()
            .set_modified(std::time::SystemTime::now() - hicache_storage_file::STALE_TEMPORARY_AGE * 2)
            .unwrap();
        drop(open(dir.path(), format, &ns));
        assert!(!old.exists(), "{format:?}: the stale temporary file stays");
        assert!(fresh.exists() && foreign.exists(), "{format:?}: a live writer's or another namespace's went");
    }
}

#[test]
fn listing_while_pages_come_and_go_never_fails() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let ns = namespace("m", KvDtype::Bf16, 4);
        let storage = open(dir.path(), format, &ns);
        let page = ns.geometry.bytes_per_page(4);
        let keys = random_keys(64);
        let pages = random_pages(64, page);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let mut failure = None;
        std::thread::scope(|scope| {
            // another writer puts and removes pages (and so files and shard folders appear and vanish) meanwhile
            scope.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    put(&storage, &keys, &pages);
                    let _ = storage.remove(&keys);
                }
            });
            let started = Instant::now();
            let mut listings = 0;
            // a failure is kept, not raised here: the writer must be stopped first
            while failure.is_none() && (listings < 300 || started.elapsed() < Duration::from_millis(500)) {
                match storage.list() {
                    Ok(listed) if listed.len() <= keys.len() => {}
                    Ok(listed) => failure = Some(format!("{} pages listed", listed.len())),
                    Err(error) => failure = Some(error.to_string()),
                }
                listings += 1;
                if started.elapsed() > Duration::from_secs(5) {
                    break;
                }
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        assert_eq!(failure, None, "{format:?}: listing while pages come and go");
    }
}
