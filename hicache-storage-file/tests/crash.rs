//! kill -9 during writes, and two processes writing the same keys: afterwards every page reads back whole and
//! correct, or as a miss, or as a detected corruption; never as a hit with wrong bytes.
//!
//! The writers are this test binary re-run as a child process (the test notices the environment variable and
//! writes until it is killed).

use std::io::PipeWriter;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PageKey, page_key};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FailureKind, GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, put};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

mod support;

const DIR_ENV: &str = "HICACHE_CRASH_WRITER_DIR";
const FORMAT_ENV: &str = "HICACHE_CRASH_WRITER_FORMAT";
/// Set for a writer that writes behind (its batches copied and written by the backend's threads).
const BEHIND_ENV: &str = "HICACHE_CRASH_WRITER_BEHIND";
const TEST_NAME: &str = "writers_killed_mid_write_leave_only_whole_pages";
/// 256 KiB pages: long enough writes that a kill often lands inside one.
const PAGE_SIZE: usize = 8;
const BATCH: u32 = 8;

fn namespace() -> StorageNamespace {
    StorageNamespace::single_rank(
        "crash/test",
        KvGeometry::mha(8, 8, 128, KvDtype::Bf16).expect("geometry"),
        HostLayout::PageFirst,
        PAGE_SIZE,
    )
}

fn page_bytes() -> usize {
    namespace().geometry.bytes_per_page(PAGE_SIZE)
}

fn key(index: u32) -> PageKey {
    page_key(None, &[index, 0x00c0_ffee])
}

/// The only correct content of page `index`: a fixed pseudo-random page with the index stamped into its first and
/// last words. Cheap to make (a copy), so the writer spends its time writing, where a kill can tear a page.
fn content(index: u32) -> Vec<u8> {
    static BASE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let base = BASE.get_or_init(|| {
        (0..page_bytes() as u64 / 8).flat_map(|word| word.wrapping_mul(0xff51_afd7_ed55_8ccd).to_le_bytes()).collect()
    });
    let mut page = base.clone();
    let stamp = index.to_le_bytes();
    let end = page.len();
    page[..4].copy_from_slice(&stamp);
    page[end - 4..].copy_from_slice(&stamp);
    page
}

fn open(dir: &Path, format: FileFormat) -> FileStorage {
    FileStorage::open(FileConfig::new(dir, format), &namespace()).expect("opens")
}

fn format_name(format: FileFormat) -> &'static str {
    match format {
        FileFormat::Native => "native",
        FileFormat::Sglang => "sglang",
    }
}

/// The child: writes pages 0, 1, 2, ... in batches until killed.
fn write_forever(dir: &Path, format: FileFormat) -> ! {
    let behind = if std::env::var_os(BEHIND_ENV).is_some() { 1 << 20 } else { 0 };
    let config = FileConfig { write_behind_bytes: behind, ..FileConfig::new(dir, format) };
    let storage = FileStorage::open(config, &namespace()).expect("opens");
    let mut next = 0u32;
    loop {
        let keys: Vec<PageKey> = (next..next + BATCH).map(key).collect();
        let pages: Vec<Vec<u8>> = (next..next + BATCH).map(content).collect();
        // another writer of the same keys must never make a write fail (the parent sees this writer exit)
        if let Some(failed) =
            put(&storage, &keys, &pages).iter().find(|outcome| matches!(outcome, SetOutcome::Failed(_)))
        {
            eprintln!("writer: {failed:?}");
            std::process::exit(3);
        }
        next += BATCH;
    }
}

/// How a writer process is started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isolation {
    /// A plain child process.
    Process,
    /// A child in a PID namespace of its own (`unshare --pid`), where it is PID 1 like every other such writer: as
    /// containers sharing a directory are.
    PidNamespace,
}

/// Starts a writer whose standard output is `ends`: every process of the writer (in a PID namespace, `unshare` and
/// the writer inside it) holds it open until it exits.
fn spawn_writer(dir: &Path, format: FileFormat, isolation: Isolation, behind: bool, ends: &PipeWriter) -> Child {
    let test_binary = std::env::current_exe().expect("test binary");
    let mut command = match isolation {
        Isolation::Process => Command::new(test_binary),
        Isolation::PidNamespace => {
            // --kill-child: the writer dies with its `unshare` parent, which is what the test kills
            let mut command = Command::new("unshare");
            command.args(["--pid", "--fork", "--kill-child", "--"]).arg(test_binary);
            command
        }
    };
    command
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
        .env(DIR_ENV, dir)
        .env(FORMAT_ENV, format_name(format));
    if behind {
        command.env(BEHIND_ENV, "1");
    }
    command.stdout(Stdio::from(ends.try_clone().expect("pipe duplicated")));
    command.spawn().expect("child writer starts")
}

/// Pages the writers have stored so far: page files (one per page), or the pages a reader finds in the segments.
fn stored_pages(dir: &Path, format: FileFormat) -> usize {
    if format == FileFormat::Native {
        let config = FileConfig { read_only: true, ..FileConfig::new(dir, format) };
        let storage = FileStorage::open(config, &namespace()).expect("opens read-only");
        assert!(storage.uses_segments(), "pages of {} bytes go to segments", page_bytes());
        return storage.list().expect("lists").len();
    }
    page_files(dir)
}

fn page_files(dir: &Path) -> usize {
    support::files_under(dir, |path| !path.file_name().is_some_and(|name| name.to_string_lossy().starts_with('.')))
        .len()
}

/// Writer processes, killed when dropped: a failing check must not leave writers filling the disk.
struct Writers(Vec<Child>);

impl Drop for Writers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs `writers` child processes on one directory, kills them with SIGKILL once `pages` pages exist plus a
/// little, and checks every page that could have been written.
fn kill_and_verify(format: FileFormat, writers: usize, pages: usize, isolation: Isolation) {
    kill_and_verify_writers(format, writers, pages, isolation, false);
}

/// [`kill_and_verify`], the writers writing behind when `behind`.
fn kill_and_verify_writers(format: FileFormat, writers: usize, pages: usize, isolation: Isolation, behind: bool) {
    let dir = tempfile::tempdir().expect("temporary directory");
    // the writers' ends: their output pipe reads to its end once the last process holding it has exited
    let (mut output, ends) = std::io::pipe().expect("pipe");
    let mut guard = Writers((0..writers).map(|_| spawn_writer(dir.path(), format, isolation, behind, &ends)).collect());
    drop(ends);
    let (ended, all_ended) = mpsc::channel();
    std::thread::spawn(move || {
        // (read to the end, so that no writer ever waits on a full pipe)
        let _ = std::io::copy(&mut output, &mut std::io::sink());
        let _ = ended.send(());
    });
    let children = &mut guard.0;
    let started = Instant::now();
    while stored_pages(dir.path(), format) < pages && started.elapsed() < Duration::from_secs(60) {
        for child in children.iter_mut() {
            if let Some(status) = child.try_wait().expect("child status") {
                panic!("{format:?}: a writer exited by itself ({status})");
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // land the kill at an arbitrary point of a batch
    std::thread::sleep(Duration::from_micros(u64::from(rand_below(20_000))));
    for child in children.iter_mut() {
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
    }
    // a writer in a PID namespace dies after its `unshare` parent (killed by the kernel once the parent is gone):
    // wait until every writer process has exited, so nothing writes while the pages are checked
    all_ended.recv_timeout(Duration::from_secs(60)).expect("every writer process exited within 60 s of the kill");
    let written = stored_pages(dir.path(), format);
    assert!(written >= pages, "{format:?}: the writers wrote only {written} pages in 60 s");
    let storage = open(dir.path(), format);
    let upper = (written as u32 + 4 * BATCH).next_multiple_of(BATCH);
    let (mut hits, mut corrupt, mut checked) = (0, 0, 0);
    for first in (0..upper).step_by(BATCH as usize) {
        let keys: Vec<PageKey> = (first..first + BATCH).map(key).collect();
        let (outcomes, buffers) = fetch(&storage, &keys, page_bytes(), 0);
        for ((index, outcome), buffer) in (first..).zip(&outcomes).zip(&buffers) {
            checked += 1;
            match outcome {
                GetOutcome::Hit => {
                    assert!(*buffer == content(index), "{format:?}: page {index} read back with wrong bytes");
                    hits += 1;
                }
                GetOutcome::Miss => {}
                GetOutcome::Failed(failure) if failure.kind == FailureKind::Corrupt => corrupt += 1,
                GetOutcome::Failed(failure) => panic!("{format:?}: page {index}: {failure}"),
            }
        }
    }
    let how = if behind { " writing behind" } else { "" };
    eprintln!("{format:?}, {writers} writer(s){how} killed: {checked} pages checked, {hits} whole, {corrupt} damaged");
    assert!(hits >= pages, "{format:?}: only {hits} pages read back");
    // writes go through a temporary file and a rename, or a segment record whose header follows its pages: a killed
    // writer leaves no damaged page under a real name
    assert_eq!(corrupt, 0, "{format:?}: {corrupt} damaged pages under real names");
    assert!(storage.batch_exists(&[key(0)]).expect("exists") == 1);
}

fn rand_below(bound: u32) -> u32 {
    (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").subsec_nanos()) % bound
}

#[test]
fn writers_killed_mid_write_leave_only_whole_pages() {
    if let Some(dir) = std::env::var_os(DIR_ENV) {
        let format =
            if std::env::var(FORMAT_ENV).as_deref() == Ok("sglang") { FileFormat::Sglang } else { FileFormat::Native };
        write_forever(Path::new(&dir), format);
    }
    for format in [FileFormat::Native, FileFormat::Sglang] {
        for round in 0..3 {
            kill_and_verify(format, 1, 48 + 40 * round, Isolation::Process);
        }
    }
}

/// Writers whose batches are written behind lose the batches not yet written when killed, never a page's bytes.
#[test]
fn writers_writing_behind_killed_mid_write_leave_only_whole_pages() {
    for round in 0..3 {
        kill_and_verify_writers(FileFormat::Native, 1, 48 + 40 * round, Isolation::Process, true);
    }
    kill_and_verify_writers(FileFormat::Native, 3, 96, Isolation::Process, true);
}

#[test]
fn three_processes_writing_the_same_keys_never_tear_a_page() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        kill_and_verify(format, 3, 96, Isolation::Process);
    }
}

/// Whether this machine can start a process in a PID namespace of its own (root, and `unshare` from util-linux).
fn pid_namespaces_available() -> bool {
    Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "true"])
        .status()
        .is_ok_and(|status| status.success())
}

#[test]
fn writers_in_separate_pid_namespaces_never_tear_a_page() {
    if !pid_namespaces_available() {
        // every writer is PID 1 in its own namespace: the case a PID-based temporary name got wrong
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI must run this test: `unshare --pid --fork` does not work here (root and util-linux are needed)"
        );
        eprintln!("skipped: `unshare --pid --fork` does not work here (root and util-linux are needed)");
        return;
    }
    for format in [FileFormat::Native, FileFormat::Sglang] {
        for _ in 0..2 {
            kill_and_verify(format, 3, 96, Isolation::PidNamespace);
        }
    }
}
