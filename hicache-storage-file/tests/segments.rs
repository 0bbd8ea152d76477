//! Small native pages in segment files: recovery from torn and damaged records, what one process sees of another's
//! writes and removals, the capacity across processes with eviction by segment and compaction, read-only opens,
//! and a namespace keeping the layout it was written in.
//!
//! The capacity writers are this test binary re-run as child processes (the test notices the environment variable).

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PageKey, page_key};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FailureKind, GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, put, random_keys, random_pages};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

mod support;

const DIR_ENV: &str = "HICACHE_SEGMENT_WRITER_DIR";
const WRITER_ENV: &str = "HICACHE_SEGMENT_WRITER";
const CAPACITY_TEST: &str = "processes_sharing_segments_hold_one_capacity";
/// 4 KiB pages: 2 layers, 2 heads of 64, bf16, 4 tokens.
const PAGE: usize = 4096;
/// What one page written alone takes: the page in the data file, and its record (48 bytes, 40 per page, and an
/// 8-byte checksum) in the index file.
const RECORD: u64 = 4096 + 96;

fn namespace() -> StorageNamespace {
    StorageNamespace::single_rank(
        "segments/test",
        KvGeometry::mha(2, 2, 64, KvDtype::Bf16).expect("geometry"),
        HostLayout::PageFirst,
        4,
    )
}

fn open_with(dir: &Path, change: impl FnOnce(&mut FileConfig)) -> FileStorage {
    let mut config = FileConfig::new(dir, FileFormat::Native);
    change(&mut config);
    let storage = FileStorage::open(config, &namespace()).expect("opens");
    assert!(storage.uses_segments());
    storage
}

fn open(dir: &Path) -> FileStorage {
    open_with(dir, |_| {})
}

/// `put`, then waits until the pages are written: batches this small are written behind by default, and these tests
/// look at the files, or read through another backend, right after.
fn put_flushed(storage: &FileStorage, keys: &[PageKey], pages: &[Vec<u8>]) -> Vec<SetOutcome> {
    let outcomes = put(storage, keys, pages);
    storage.flush().expect("the pages written behind are written");
    outcomes
}

/// Writes `pages` in order, `batch` pages a call, each batch written before the next (a prefix as its writer
/// stores it): every page is stored.
fn put_in_batches(storage: &FileStorage, keys: &[PageKey], pages: &[Vec<u8>], batch: usize) {
    for (keys, pages) in keys.chunks(batch).zip(pages.chunks(batch)) {
        assert!(put_flushed(storage, keys, pages).iter().all(|outcome| *outcome == SetOutcome::Stored));
    }
}

/// The segments' data files, oldest first.
fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = support::files_under(dir, |path| path.extension().is_some_and(|extension| extension == "seg"));
    found.sort();
    found
}

/// Bytes of the segments: data and index files.
fn segment_bytes(dir: &Path) -> u64 {
    segment_files(dir)
        .iter()
        .map(|path| {
            std::fs::metadata(path).unwrap().len() + std::fs::metadata(path.with_extension("idx")).unwrap().len()
        })
        .sum()
}

#[test]
fn torn_and_damaged_records_never_return_a_wrong_page() {
    let dir = tempfile::tempdir().unwrap();
    let keys = random_keys(12);
    let pages = random_pages(12, PAGE);
    {
        let storage = open(dir.path());
        for batch in 0..3 {
            let range = batch * 4..batch * 4 + 4;
            assert!(
                put_flushed(&storage, &keys[range.clone()], &pages[range])
                    .iter()
                    .all(|outcome| *outcome == SetOutcome::Stored)
            );
        }
    }
    // three batches of 4 pages: 12 pages in the data file, three records of 216 bytes in the index file
    let [segment] = segment_files(dir.path()).try_into().expect("one segment");
    let data = OpenOptions::new().write(true).open(&segment).unwrap();
    let records = OpenOptions::new().write(true).open(segment.with_extension("idx")).unwrap();
    assert_eq!((data.metadata().unwrap().len(), records.metadata().unwrap().len()), (12 * 4096, 3 * 216));
    // a flipped byte in the second page, and the third batch's pages cut short
    data.write_all_at(&[!pages[1][100]], 4096 + 100).unwrap();
    data.set_len(11 * 4096).unwrap();
    let storage = open(dir.path());
    let (outcomes, buffers) = fetch(&storage, &keys, PAGE, 0);
    for (index, (outcome, buffer)) in outcomes.iter().zip(&buffers).enumerate() {
        match index {
            1 => assert!(
                matches!(outcome, GetOutcome::Failed(failure) if failure.kind == FailureKind::Corrupt),
                "{outcome:?}"
            ),
            8.. => assert_eq!(*outcome, GetOutcome::Miss, "page {index} of the torn record"),
            _ => {
                assert_eq!(*outcome, GetOutcome::Hit, "page {index}");
                assert!(*buffer == pages[index], "page {index} read wrong bytes");
            }
        }
    }
    // the damaged page is forgotten, so it is written again
    assert_eq!(storage.batch_exists(&keys).unwrap(), 1);
    assert_eq!(put_flushed(&storage, &keys[1..2], &pages[1..2]), [SetOutcome::Stored]);
    assert_eq!(storage.batch_exists(&keys).unwrap(), 8);
    // a damaged record ends what is taken from its index file: the records after it are not read
    drop(storage);
    records.write_all_at(&[0xff], 216 + 60).unwrap();
    let storage = open(dir.path());
    // page 1 was written again in another segment, later: that copy stands
    assert_eq!(storage.batch_exists(&keys).unwrap(), 4, "the first record's pages");
    let (outcomes, _) = fetch(&storage, &keys[4..8], PAGE, 0);
    assert_eq!(outcomes, vec![GetOutcome::Miss; 4]);
}

/// A prefix read back batch by batch, in the order it was written, is read ahead (through the page cache, and with
/// `O_DIRECT` into the backend's own windows): every page comes back whole, also one damaged on the disk after the
/// window holding it was asked for (the checksum catches it, or the window read it before the damage), and one
/// written again meanwhile by another backend (its new copy).
#[test]
fn pages_read_back_in_order_through_the_read_ahead_window_are_whole() {
    for direct_io in [false, true] {
        read_back_in_order(direct_io);
    }
}

fn read_back_in_order(direct_io: bool) {
    const PAGES: usize = 256;
    const BATCH: usize = 8;
    let dir = tempfile::tempdir().unwrap();
    let keys = random_keys(PAGES);
    let pages = random_pages(PAGES, PAGE);
    let writer = open(dir.path());
    put_in_batches(&writer, &keys, &pages, BATCH);
    let [segment] = segment_files(dir.path()).try_into().expect("one segment");
    let data = OpenOptions::new().write(true).open(&segment).unwrap();
    // a window of 8 batches
    let reader = open_with(dir.path(), |config| {
        config.read_ahead_bytes = (8 * BATCH * PAGE) as u64;
        config.direct_io = direct_io;
    });
    let (damaged, rewritten) = (100, 150);
    let mut rewritten_page = pages[rewritten].clone();
    rewritten_page.reverse();
    for batch in 0..PAGES / BATCH {
        if batch == 10 {
            // the window reaches past both pages by now
            data.write_all_at(&[!pages[damaged][7]], (damaged * PAGE + 7) as u64).unwrap();
            data.sync_data().unwrap();
            assert_eq!(writer.remove(&keys[rewritten..=rewritten]).unwrap(), 1);
            assert_eq!(
                put_flushed(&writer, &keys[rewritten..=rewritten], &[rewritten_page.clone()]),
                [SetOutcome::Stored]
            );
        }
        let range = batch * BATCH..(batch + 1) * BATCH;
        let (outcomes, buffers) = fetch(&reader, &keys[range.clone()], PAGE, 0);
        for ((index, outcome), buffer) in range.zip(outcomes).zip(buffers) {
            let corrupt = matches!(outcome, GetOutcome::Failed(ref failure) if failure.kind == FailureKind::Corrupt);
            if index == damaged && (corrupt || !direct_io) {
                assert!(corrupt, "{outcome:?}");
                continue;
            }
            assert_eq!(outcome, GetOutcome::Hit, "page {index}");
            let expected = if index == rewritten { &rewritten_page } else { &pages[index] };
            assert!(buffer == *expected, "page {index} read wrong bytes (direct I/O: {direct_io})");
        }
    }
    // with O_DIRECT, the walk's pages after its first batches came from the windows
    let read_ahead = reader.pages_read_ahead();
    if direct_io {
        assert!(read_ahead >= (PAGES - 4 * BATCH) as u64, "{read_ahead} pages from windows");
    } else {
        assert_eq!(read_ahead, 0);
    }
}

/// With `O_DIRECT`, batches of 2 MiB and more that are shorter than the window (here 2 MiB in a 4 MiB window) are
/// read ahead into the backend's own windows and come back whole; through the page cache they read on their own.
#[test]
fn long_batches_shorter_than_the_window_are_read_ahead_with_direct_io() {
    const PAGES: usize = 4096;
    const BATCH: usize = 512;
    let dir = tempfile::tempdir().unwrap();
    let keys = random_keys(PAGES);
    let pages = random_pages(PAGES, PAGE);
    let writer = open(dir.path());
    put_in_batches(&writer, &keys, &pages, BATCH);
    for direct_io in [false, true] {
        let reader = open_with(dir.path(), |config| {
            config.read_ahead_bytes = (2 * BATCH * PAGE) as u64;
            config.direct_io = direct_io;
        });
        for batch in 0..PAGES / BATCH {
            let range = batch * BATCH..(batch + 1) * BATCH;
            let (outcomes, buffers) = fetch(&reader, &keys[range.clone()], PAGE, 0);
            for ((index, outcome), buffer) in range.zip(outcomes).zip(buffers) {
                assert_eq!(outcome, GetOutcome::Hit, "page {index} (direct I/O: {direct_io})");
                assert!(buffer == pages[index], "page {index} read wrong bytes (direct I/O: {direct_io})");
            }
        }
        let read_ahead = reader.pages_read_ahead();
        if direct_io {
            // the walk's first two batches are read on their own, the rest come from windows (but for a window
            // that took longer than its deadline to arrive, whose batch reads its pages itself)
            assert!(read_ahead >= (PAGES - 4 * BATCH) as u64, "{read_ahead} pages from windows");
        } else {
            assert_eq!(read_ahead, 0);
        }
    }
}

#[test]
fn one_backend_sees_what_another_wrote_removed_and_cleared() {
    let dir = tempfile::tempdir().unwrap();
    let (writer, reader) = (open(dir.path()), open(dir.path()));
    let keys = random_keys(6);
    let pages = random_pages(6, PAGE);
    put_flushed(&writer, &keys[..4], &pages[..4]);
    // a miss looks at the segments again
    let (outcomes, buffers) = fetch(&reader, &keys[..4], PAGE, 0);
    assert_eq!(outcomes, vec![GetOutcome::Hit; 4]);
    assert_eq!(buffers, pages[..4]);
    // a removal is seen at once, though the reader holds the page in its index
    assert_eq!(writer.remove(&keys[1..2]).unwrap(), 1);
    assert_eq!(reader.batch_exists(&keys).unwrap(), 1);
    assert_eq!(fetch(&reader, &keys[1..2], PAGE, 0).0, [GetOutcome::Miss]);
    // written again after its removal, it is there again
    put_flushed(&reader, &keys[1..2], &pages[1..2]);
    assert_eq!(writer.batch_exists(&keys).unwrap(), 4);
    let mut listed: Vec<PageKey> = writer.list().unwrap().into_iter().map(|(key, _)| key).collect();
    listed.sort_unstable();
    let mut expected = keys[..4].to_vec();
    expected.sort_unstable();
    assert_eq!(listed, expected);
    // a clear by one is a clear for both, and the writer goes on in a new segment
    assert_eq!(reader.clear().unwrap(), 4);
    assert_eq!(writer.batch_exists(&keys).unwrap(), 0);
    assert_eq!(put_flushed(&writer, &keys[4..], &pages[4..]), vec![SetOutcome::Stored; 2]);
    let (outcomes, buffers) = fetch(&reader, &keys[4..], PAGE, 0);
    assert_eq!(outcomes, vec![GetOutcome::Hit; 2]);
    assert_eq!(buffers, pages[4..]);
    assert_eq!(segment_files(dir.path()).len(), 1);
}

#[test]
fn a_read_only_open_reads_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let keys = random_keys(3);
    let pages = random_pages(3, PAGE);
    put(&open(dir.path()), &keys, &pages);
    let before = segment_bytes(dir.path());
    let reader = open_with(dir.path(), |config| config.read_only = true);
    let (outcomes, buffers) = fetch(&reader, &keys, PAGE, 0);
    assert_eq!((outcomes, buffers), (vec![GetOutcome::Hit; 3], pages.clone()));
    assert!(
        matches!(&put(&reader, &keys[..1], &pages[..1])[0], SetOutcome::Failed(failure) if failure.kind == FailureKind::Rejected)
    );
    assert!(reader.remove(&keys).is_err() && reader.clear().is_err());
    assert_eq!(segment_bytes(dir.path()), before);
}

#[test]
fn a_namespace_keeps_the_layout_it_was_written_in() {
    let dir = tempfile::tempdir().unwrap();
    let keys = random_keys(2);
    let pages = random_pages(2, PAGE);
    let per_file = FileConfig { segment_threshold: 0, ..FileConfig::new(dir.path(), FileFormat::Native) };
    let storage = FileStorage::open(per_file, &namespace()).unwrap();
    assert!(!storage.uses_segments());
    put(&storage, &keys, &pages);
    // the default threshold would choose segments, but the page files are there: they are read, not hidden
    let storage = FileStorage::open(FileConfig::new(dir.path(), FileFormat::Native), &namespace()).unwrap();
    assert!(!storage.uses_segments());
    assert_eq!(fetch(&storage, &keys, PAGE, 0), (vec![GetOutcome::Hit; 2], pages));
    let error = FileStorage::open(
        FileConfig { segment_bytes: 4096, ..FileConfig::new(dir.path(), FileFormat::Native) },
        &namespace(),
    )
    .unwrap_err();
    assert!(error.to_string().starts_with("segment_bytes: 4096 is below the smallest segment"), "{error}");
}

#[test]
fn a_page_read_recently_is_compacted_out_of_an_evicted_segment() {
    let dir = tempfile::tempdir().unwrap();
    // 64 one-page records; segments of an eighth of it, 8 records each
    let storage = open_with(dir.path(), |config| config.capacity_bytes = Some(64 * RECORD));
    let keys = random_keys(96);
    let pages = random_pages(96, PAGE);
    for index in 0..64 {
        put_flushed(&storage, &keys[index..=index], &pages[index..=index]);
    }
    assert_eq!(segment_bytes(dir.path()), 64 * RECORD);
    assert_eq!(storage.segment_evictions(), Some((0, 0)));
    // the oldest page is read: it outlives its segment
    assert_eq!(fetch(&storage, &keys[..1], PAGE, 0).0, [GetOutcome::Hit]);
    put_flushed(&storage, &keys[64..65], &pages[64..65]);
    let (evicted, compacted) = storage.segment_evictions().unwrap();
    assert!(evicted >= 1 && compacted == 1, "{evicted} segments evicted, {compacted} pages compacted");
    assert!(segment_bytes(dir.path()) <= 64 * RECORD);
    assert_eq!(
        fetch(&storage, &keys[..2], PAGE, 0),
        (vec![GetOutcome::Hit, GetOutcome::Miss], vec![pages[0].clone(), vec![0; PAGE]])
    );
    // another process opening the directory finds the same pages
    let other = open_with(dir.path(), |config| config.capacity_bytes = Some(64 * RECORD));
    let held: Vec<bool> = keys[..65].iter().map(|key| other.exists(key).unwrap()).collect();
    assert!(held[0] && !held[1] && held[64], "{held:?}");
}

/// The child: writes 200 pages of its own, one per call.
fn write_pages(dir: &Path, writer: u32) {
    let storage = open_with(dir, |config| config.capacity_bytes = Some(64 * RECORD));
    for index in 0..200 {
        let key = page_key(None, &[writer, index]);
        assert_eq!(put(&storage, &[key], &[vec![writer as u8; PAGE]]), [SetOutcome::Stored], "writer {writer}");
    }
}

#[test]
fn processes_sharing_segments_hold_one_capacity() {
    if let (Some(dir), Ok(writer)) = (std::env::var_os(DIR_ENV), std::env::var(WRITER_ENV)) {
        write_pages(Path::new(&dir), writer.parse().expect("writer number"));
        return;
    }
    const WRITERS: u64 = 4;
    let dir = tempfile::tempdir().unwrap();
    let children: Vec<_> = (0..WRITERS)
        .map(|writer| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", CAPACITY_TEST, "--test-threads=1"])
                .env(DIR_ENV, dir.path())
                .env(WRITER_ENV, writer.to_string())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut child in children {
        assert!(child.wait().unwrap().success(), "a writer failed");
    }
    // each writer counts its record before writing it, and an eviction counts the files as they are: the writers'
    // records in flight at that moment are the most the capacity can be passed by
    let held = segment_bytes(dir.path());
    assert!(held <= (64 + WRITERS) * RECORD, "{held} bytes of segments for a capacity of {}", 64 * RECORD);
    assert!(held >= 64 * RECORD / 2, "only {held} bytes left");
    let reader = open(dir.path());
    let pages = reader.list().unwrap();
    // (as many pages as those bytes hold: one more per writer's record in flight)
    assert!(!pages.is_empty() && pages.len() as u64 <= 64 + WRITERS, "{} pages", pages.len());
    let keys: Vec<PageKey> = pages.iter().map(|(key, _)| *key).collect();
    let (outcomes, buffers) = fetch(&reader, &keys, PAGE, 0);
    assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit));
    // every page is all one writer's byte
    assert!(buffers.iter().all(|page| page.iter().all(|byte| *byte == page[0] && u64::from(*byte) < WRITERS)));
}

/// What one step of the property test does, through backend `0` or `1` (two processes sharing the directory).
#[derive(Clone, Debug)]
enum Step {
    Set(usize, Vec<u8>),
    Remove(usize, Vec<u8>),
    Clear(usize),
    /// The backend closes and opens again (a restart).
    Reopen(usize),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    let keys = proptest::collection::vec(0u8..12, 0..6);
    prop_oneof![
        4 => (0..2usize, keys.clone()).prop_map(|(backend, keys)| Step::Set(backend, keys)),
        2 => (0..2usize, keys).prop_map(|(backend, keys)| Step::Remove(backend, keys)),
        1 => (0..2usize).prop_map(Step::Clear),
        1 => (0..2usize).prop_map(Step::Reopen),
    ]
}

/// The only correct content of key `index`.
fn content(index: u8) -> Vec<u8> {
    (0..PAGE).map(|byte| (byte as u8).wrapping_mul(index.wrapping_add(3))).collect()
}

/// Pages written behind: the writer finds them at once (whether they are written yet or not), another process once
/// they are flushed, and a backend opened after the writer was dropped finds every one (dropping flushes).
#[test]
fn pages_written_behind_are_found_by_the_writer_at_once_and_by_others_once_flushed() {
    let dir = tempfile::tempdir().unwrap();
    // a budget of three batches: later batches wait for room
    let writer = open_with(dir.path(), |config| config.write_behind_bytes = 3 * 8 * PAGE as u64);
    let other = open(dir.path());
    let keys = random_keys(64);
    let pages = random_pages(64, PAGE);
    for (keys, pages) in keys.chunks(8).zip(pages.chunks(8)) {
        assert!(put(&writer, keys, pages).iter().all(SetOutcome::is_stored));
        // at once, written yet or not
        let (outcomes, buffers) = fetch(&writer, keys, PAGE, 0);
        assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit), "{outcomes:?}");
        assert!(buffers == pages, "the writer read other bytes");
        assert_eq!(writer.batch_exists(keys).unwrap(), keys.len());
        assert!(writer.batch_contains(keys).unwrap().iter().all(|&held| held));
        // a repeated page is not written again
        assert!(put(&writer, &keys[..1], &pages[..1])[0] == SetOutcome::AlreadyPresent);
    }
    assert_eq!(writer.pages_written_behind(), 64);
    writer.flush().unwrap();
    let (outcomes, buffers) = fetch(&other, &keys, PAGE, 0);
    assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit), "{outcomes:?}");
    assert!(buffers == pages, "another backend read other bytes");
    // more, then the writer goes: what it accepted is written
    let more_keys = random_keys(40);
    let more_pages = random_pages(40, PAGE);
    assert!(put(&writer, &more_keys, &more_pages).iter().all(SetOutcome::is_stored));
    drop(writer);
    let (outcomes, buffers) = fetch(&open(dir.path()), &more_keys, PAGE, 0);
    assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit), "{outcomes:?}");
    assert!(buffers == more_pages);
    // a removal through the writer orders after its writes
    let writer = open_with(dir.path(), |config| config.write_behind_bytes = 1 << 20);
    let last_keys = random_keys(8);
    assert!(put(&writer, &last_keys, &random_pages(8, PAGE)).iter().all(SetOutcome::is_stored));
    assert_eq!(writer.remove(&last_keys).unwrap(), 8);
    assert_eq!(other.batch_exists(&last_keys).unwrap(), 0);
    assert_eq!(writer.batch_exists(&last_keys).unwrap(), 0);
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: 128, ..Default::default() })]

    /// Against a model (the set of keys held): after every step, through either backend, every held key reads back
    /// its own bytes, every other key misses, `exists` counts the held run, `list` names the held keys, and
    /// `remove` and `clear` count what was held.
    #[test]
    fn two_backends_agree_with_a_model_through_writes_removals_clears_and_restarts(
        steps in proptest::collection::vec(step(), 1..24),
    ) {
        agree_with_model(steps, 0)?;
    }

    /// The same with backend 0 writing behind: it agrees with the model at once after each of its steps, and both
    /// agree once it has flushed.
    #[test]
    fn a_backend_writing_behind_agrees_with_the_model_and_with_another_once_flushed(
        steps in proptest::collection::vec(step(), 1..24),
    ) {
        agree_with_model(steps, 3 * PAGE as u64)?;
    }
}

/// The model test of two backends sharing a directory, backend 0 writing behind with a budget of `write_behind`
/// bytes (0: in place).
fn agree_with_model(steps: Vec<Step>, write_behind: u64) -> Result<(), proptest::test_runner::TestCaseError> {
    {
        let dir = tempfile::tempdir().unwrap();
        let open_backend =
            |backend: usize| open_with(dir.path(), |config| config.write_behind_bytes = [write_behind, 0][backend]);
        let mut backends = [Some(open_backend(0)), Some(open_backend(1))];
        let mut held = std::collections::BTreeSet::new();
        let key = |index: u8| page_key(None, &[u32::from(index), 0x5e6]);
        for step in steps {
            match step {
                Step::Set(backend, indices) => {
                    let keys: Vec<PageKey> = indices.iter().map(|&index| key(index)).collect();
                    let pages: Vec<Vec<u8>> = indices.iter().map(|&index| content(index)).collect();
                    let outcomes = put(backends[backend].as_ref().unwrap(), &keys, &pages);
                    proptest::prop_assert!(outcomes.iter().all(SetOutcome::is_stored), "{:?}", outcomes);
                    held.extend(indices);
                }
                Step::Remove(backend, indices) => {
                    let keys: Vec<PageKey> = indices.iter().map(|&index| key(index)).collect();
                    let expected = indices
                        .iter()
                        .collect::<std::collections::BTreeSet<_>>()
                        .iter()
                        .filter(|index| held.contains(**index))
                        .count();
                    proptest::prop_assert_eq!(backends[backend].as_ref().unwrap().remove(&keys).unwrap(), expected);
                    for index in indices {
                        held.remove(&index);
                    }
                }
                Step::Clear(backend) => {
                    proptest::prop_assert_eq!(backends[backend].as_ref().unwrap().clear().unwrap(), held.len() as u64);
                    held.clear();
                }
                Step::Reopen(backend) => {
                    backends[backend] = None;
                    backends[backend] = Some(open_backend(backend));
                }
            }
            // the backend writing behind agrees at once; then both, once it flushed
            if let Some(writing) = &backends[0] {
                agrees(writing, &held)?;
                writing.flush().unwrap();
            }
            for backend in backends.iter().flatten() {
                agrees(backend, &held)?;
            }
        }
    }
    Ok(())
}

/// Every key held (in the model) reads back its own bytes, every other key misses, `exists` counts the held run,
/// `list` names the held keys.
fn agrees(
    backend: &FileStorage,
    held: &std::collections::BTreeSet<u8>,
) -> Result<(), proptest::test_runner::TestCaseError> {
    let key = |index: u8| page_key(None, &[u32::from(index), 0x5e6]);
    let all: Vec<u8> = (0..12).collect();
    let keys: Vec<PageKey> = all.iter().map(|&index| key(index)).collect();
    let (outcomes, buffers) = fetch(backend, &keys, PAGE, 0);
    for ((index, outcome), buffer) in all.iter().zip(&outcomes).zip(&buffers) {
        if held.contains(index) {
            proptest::prop_assert_eq!(outcome, &GetOutcome::Hit, "key {}", index);
            proptest::prop_assert!(*buffer == content(*index), "key {} read other bytes", index);
        } else {
            proptest::prop_assert_eq!(outcome, &GetOutcome::Miss, "key {}", index);
        }
    }
    let run = all.iter().take_while(|index| held.contains(*index)).count();
    proptest::prop_assert_eq!(backend.batch_exists(&keys).unwrap(), run);
    let mut listed: Vec<PageKey> = backend.list().unwrap().into_iter().map(|(key, _)| key).collect();
    listed.sort_unstable();
    let mut expected: Vec<PageKey> = held.iter().map(|&index| key(index)).collect();
    expected.sort_unstable();
    proptest::prop_assert_eq!(listed, expected);
    Ok(())
}
