//! The local file storage tier: one file per page, in SGLang's layout or in hicache's checksummed native layout, or
//! small native pages appended to segment files.
//!
//! * **SGLang layout** ([`FileFormat::Sglang`]): `{dir}/{hash}_{model}_{tp_rank}_{tp_size}.bin` (MHA) or
//!   `{dir}/{hash}_{model}.bin` (MLA), `/` in the model replaced by `-`, with `_{pp_size}_{pp_rank}` after either
//!   when there are pipeline stages, raw flat page bytes: what SGLang's `HiCacheFile` reads and writes
//!   (docs/sglang.md#file-backend), so both can share a directory.
//! * **Native layout** ([`FileFormat::Native`]): `{dir}/hicache-v1/{namespace digest}/{first two hex}/{hash}.page`,
//!   the page bytes followed by a footer (magic, version, XXH3-64 of the namespace digest, the key and the page; 16
//!   bytes, or a 4 KiB block for pages of whole 4 KiB blocks, so that `O_DIRECT` can read and write the file). The
//!   namespace digest covers dtype, layout, page size and TP/PP geometry; the two-hex shard keeps directories small.
//! * **Native segments**, for pages below [`FileConfig::segment_threshold`] (1 MiB by default), where creating a
//!   file per page costs more than writing the page: `{dir}/hicache-v1/{namespace digest}/segments/`, each batch's
//!   pages appended to a data file and then named by a checksummed record in an index file beside it; every process
//!   rebuilds its index of pages from the records (see `segment/mod.rs`). A namespace that holds pages in one
//!   native layout keeps it whatever the threshold says later.
//!
//! The file-per-page layouts write a temporary file in the same directory and rename it, so a reader never sees a partial page
//! under its real name, and two writers of one key (in two processes, containers or hosts) each rename a whole file.
//! Reads check the length (and, natively, the checksum): a short, torn or damaged native page, or another key's, is
//! reported as [`FailureKind::Corrupt`] and removed; an SGLang-layout file of another length is a
//! [`FailureKind::SizeMismatch`] and stays (SGLang's names cannot tell namespaces of other dtypes or geometries
//! apart, so it may be another deployment's page). Something other than a regular file at a page path is reported
//! and left alone, never read (a FIFO would block). None of these is an error of the batch. A put that finds a page
//! already there checks it: intact, it is present; a damaged native page is replaced. Batches run on
//! [`FileConfig::io_threads`] threads started with the backend, reading straight into and writing straight from the
//! caller's segments.
//! `clear` and `list` touch this namespace's files only (SGLang's `clear` removes the whole directory); in the
//! SGLang layout only files directly in the directory whose names match the namespace exactly and whose length is
//! this namespace's page, never below it.
// io_uring needs `unsafe` to hand the kernel buffers; only `segment/io.rs` may
#![deny(unsafe_code)]

mod account;
mod index;
mod page_file;
mod segment;
mod threads;
mod tier;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use hicache_core::Error;
use hicache_core::hash::PageKey;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{
    FailureKind, GetOutcome, PageFailure, PageSegments, PageSegmentsMut, SetOutcome, StatsRecorder, StorageBackend,
    StorageStats, check_batch, segments_len, size_mismatch,
};

pub use tier::{DEFAULT_DIR, DIR_ENV, FILE_TIER};

/// Which file layout to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FileFormat {
    /// SGLang 0.5.2's `HiCacheFile` names and raw bytes.
    Sglang,
    /// hicache's namespaced, checksummed pages.
    #[default]
    Native,
}

/// The most I/O threads a file backend starts (more only contend for the same disk).
pub const MAX_IO_THREADS: usize = 256;

/// Settings of a file backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileConfig {
    /// The directory holding the pages.
    pub dir: PathBuf,
    /// The file layout.
    pub format: FileFormat,
    /// Most threads one batch uses.
    pub io_threads: usize,
    /// Bytes of page files this namespace may hold, across every process sharing the directory; least recently
    /// used pages are removed beyond it (down to 90% when that frees whole pages, so a crowded directory is not
    /// counted at every write). `None`: no limit (SGLang's behaviour).
    pub capacity_bytes: Option<u64>,
    /// Read and write with `O_DIRECT`, bypassing the page cache, for pages whose segments are whole 4 KiB blocks at
    /// 4 KiB-aligned addresses (other pages go through the page cache). For stores larger than memory: the host
    /// pool already holds the hot pages, so caching them twice wastes memory.
    pub direct_io: bool,
    /// Open without creating or changing anything (for inspection): the directory must exist, puts, removals and
    /// clears are refused, and a damaged page is reported but left in place.
    pub read_only: bool,
    /// Native pages smaller than this many bytes are appended to segment files instead of one file each (0: never).
    /// A namespace that already holds pages in one layout keeps it.
    pub segment_threshold: usize,
    /// Bytes after which a writer starts a new segment file; with a capacity, at most an eighth of it, so eviction
    /// (by whole segments) frees a part of the capacity, not all of it.
    pub segment_bytes: u64,
    /// Submit segment reads and writes through io_uring when the kernel allows it (else `preadv`/`pwritev` on the
    /// I/O threads).
    pub io_uring: bool,
    /// Bytes of a segment read ahead (without waiting) of a batch that continues a forward walk through it, as a prefix
    /// read back a batch at a time does; 0 reads nothing ahead. With `direct_io`, windows are read with `O_DIRECT` into
    /// the backend's own memory (at most 8 times this many bytes in all) for batches shorter than this (or than 2 MiB,
    /// for a smaller window); without, into the page cache for batches under 2 MiB (there a longer batch reads faster
    /// on its own). At most [`MAX_READ_AHEAD_BYTES`].
    pub read_ahead_bytes: u64,
    /// Bytes of batches of segment pages written behind at most: a batch's pages are copied into the backend's
    /// memory and written by threads of its own while the caller goes on, so several batches are in flight at once,
    /// and batches that queue up are joined into one write (small pages: a batch in place leaves the disk idle
    /// between batches, and its write is short). A batch of more than half this many bytes is written in place (it
    /// keeps the disk busy on its own). This process reads the pages written behind at once; other processes once
    /// they are written, a batch's write later; a removal, clear or listing, [`StorageBackend::flush`] and dropping
    /// the backend wait for them. A page reported stored can be lost if the process dies (or the write fails)
    /// before it is written, never read torn: a cache's miss. Default [`DEFAULT_WRITE_BEHIND_BYTES`]; 0: every batch
    /// is written before the call returns, for callers that need other processes to find a page the moment it is
    /// reported stored. At most [`MAX_WRITE_BEHIND_BYTES`].
    pub write_behind_bytes: u64,
    /// With `direct_io`: bytes a segment's data file is allocated ahead of its writes (`fallocate`), a step at a
    /// time, since a direct write that makes a file longer waits for the file system to record the length; 0 lets
    /// every write lengthen the file. A killed writer leaves at most this much unused; a closed one gives it back.
    /// At most the segment's size counts.
    pub preallocate_bytes: u64,
    /// The most bytes of a batch's segment pages one write carries, for batches written in place (see
    /// [`FileConfig::write_behind_bytes`]; batches written behind are joined instead): a longer batch is written as
    /// several writes submitted together, so a disk that serves several requests at once is kept busy by one caller.
    /// 0: one write per batch.
    pub write_split_bytes: u64,
}

/// The default [`FileConfig::segment_threshold`]: pages below 1 MiB go to segments (creating a file per page costs
/// more than writing it below that size).
pub const DEFAULT_SEGMENT_THRESHOLD: usize = 1 << 20;
/// The default [`FileConfig::segment_bytes`].
pub const DEFAULT_SEGMENT_BYTES: u64 = 256 << 20;
/// The smallest [`FileConfig::segment_bytes`].
pub const MIN_SEGMENT_BYTES: u64 = 1 << 20;
/// The default [`FileConfig::read_ahead_bytes`].
pub const DEFAULT_READ_AHEAD_BYTES: u64 = 8 << 20;
/// The largest [`FileConfig::read_ahead_bytes`].
pub const MAX_READ_AHEAD_BYTES: u64 = 1 << 30;
/// The default [`FileConfig::write_behind_bytes`]: batches of up to 8 MiB (128 pages of 64 KiB) are written behind.
pub const DEFAULT_WRITE_BEHIND_BYTES: u64 = 16 << 20;
/// The largest [`FileConfig::write_behind_bytes`].
pub const MAX_WRITE_BEHIND_BYTES: u64 = 1 << 30;
/// The default [`FileConfig::preallocate_bytes`].
pub const DEFAULT_PREALLOCATE_BYTES: u64 = 16 << 20;
/// The largest [`FileConfig::preallocate_bytes`].
pub const MAX_PREALLOCATE_BYTES: u64 = 1 << 30;

impl FileConfig {
    /// `dir` if given, else `$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`, else `/tmp/hicache`, as SGLang.
    pub fn resolve_dir(dir: Option<&Path>) -> PathBuf {
        match dir {
            Some(dir) => dir.to_path_buf(),
            None => std::env::var_os(DIR_ENV).map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from),
        }
    }

    /// A config for `dir` in `format` with two I/O threads per core, between 2 and 16 (page-cache writes stall on
    /// page allocation; a second thread per core keeps the core busy meanwhile: measured 0.64–0.90 of raw write
    /// speed with one per core, 0.86–0.91 with two, on a two-core machine).
    pub fn new(dir: impl Into<PathBuf>, format: FileFormat) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Self {
            dir: dir.into(),
            format,
            io_threads: (2 * cores).clamp(2, 16),
            capacity_bytes: None,
            direct_io: false,
            read_only: false,
            segment_threshold: DEFAULT_SEGMENT_THRESHOLD,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            io_uring: true,
            read_ahead_bytes: DEFAULT_READ_AHEAD_BYTES,
            write_behind_bytes: DEFAULT_WRITE_BEHIND_BYTES,
            preallocate_bytes: DEFAULT_PREALLOCATE_BYTES,
            write_split_bytes: 0,
        }
    }
}

/// Age past which a temporary page file is a killed writer's leftover (a live writer's is seconds old): removed
/// when a backend opens.
pub const STALE_TEMPORARY_AGE: std::time::Duration = std::time::Duration::from_secs(600);

/// A file backend for one namespace.
///
/// Dropping it waits until the pages written behind are written (up to 60 s) and then until every thread it started
/// has ended (up to 30 s more; a thread still running then is left to end on its own, with a warning): once it is
/// dropped, no thread of its own still runs or holds its files.
#[derive(Debug)]
pub struct FileStorage {
    /// The namespace it serves.
    namespace: StorageNamespace,
    config: FileConfig,
    /// Where this namespace's files live (the directory itself, or the native namespace folder).
    root: PathBuf,
    /// SGLang layout: what follows `{hash}_` in a file name, before `.bin`.
    /// What follows the page hash in the `sglang` format's file names (`_{suffix}`, `.{pool}_{suffix}`).
    sglang_tail: String,
    /// Page and footer sizes, and whether to use direct I/O.
    shape: page_file::FileShape,
    /// The namespace digest, bound into every native page's checksum with the page's key.
    digest: String,
    /// With a capacity: the pages held and their recency.
    index: Option<Mutex<index::LruIndex>>,
    /// With a capacity (and writes): the account every process sharing the directory keeps.
    account: Option<account::SharedAccount>,
    /// Pages read or written with `O_DIRECT`.
    direct_pages: AtomicU64,
    /// Small native pages: the segment files that hold them (instead of a file per page).
    segments: Option<std::sync::Arc<segment::SegmentStore>>,
    stats: StatsRecorder,
    /// `io_threads` threads, started once, that every batch's pages are spread over (the controller's query, fetch
    /// and backup threads share them).
    pool: rayon::ThreadPool,
    /// The pool's threads, joined once the pool (declared before) has been dropped.
    #[expect(dead_code, reason = "held for its Drop, which joins the threads")]
    threads: threads::Threads,
}

impl FileStorage {
    /// Opens the directory for `namespace`, making the directory itself (not when read-only); the folders below it are
    /// made by the first write that needs them (or here, to probe `O_DIRECT`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an invalid namespace or a model name that cannot be a file name, and (field
    /// `dir`) for a read-only open of a directory that does not exist; [`Error::Storage`] when the directory cannot
    /// be created for the `O_DIRECT` probe.
    pub fn open(config: FileConfig, namespace: &StorageNamespace) -> Result<Self, Error> {
        let namespace = namespace.clone().validated()?;
        // the model goes into file names: checked here
        namespace.file_name_model()?;
        if !(1..=MAX_IO_THREADS).contains(&config.io_threads) {
            return Err(Error::InvalidArgument {
                field: "io_threads",
                reason: format!("{} is not in [1, {MAX_IO_THREADS}]", config.io_threads),
            });
        }
        let sglang_tail = namespace.sglang_file_tail();
        let digest = namespace.digest();
        let root = match config.format {
            FileFormat::Sglang => config.dir.clone(),
            FileFormat::Native => config.dir.join("hicache-v1").join(&digest),
        };
        if config.read_only {
            if !config.dir.is_dir() {
                return Err(Error::InvalidArgument {
                    field: "dir",
                    reason: format!("{} does not exist or is not a directory", config.dir.display()),
                });
            }
        } else {
            // the directory itself; the folders below it are made by the first write that needs them (so an open
            // that never writes leaves nothing behind, and a directory removed under a running writer stays removed)
            std::fs::create_dir_all(&config.dir)
                .map_err(|error| io_failure(format!("creating {}: {error}", config.dir.display()), error))?;
            if config.direct_io {
                // the probe below writes a file there
                std::fs::create_dir_all(&root)
                    .map_err(|error| io_failure(format!("creating {}: {error}", root.display()), error))?;
            }
        }
        let page_bytes = namespace.page_bytes();
        let shape = page_file::FileShape::new(page_bytes, config.format == FileFormat::Native, config.direct_io);
        let file_bytes = shape.file_bytes() as u64;
        if config.direct_io && !config.read_only {
            page_file::probe_direct(&root).map_err(|error| Error::InvalidArgument {
                field: "direct_io",
                reason: format!("the file system of {} does not take O_DIRECT: {error}", root.display()),
            })?;
        }
        if config.segment_bytes < MIN_SEGMENT_BYTES {
            return Err(Error::InvalidArgument {
                field: "segment_bytes",
                reason: format!("{} is below the smallest segment, {MIN_SEGMENT_BYTES} bytes", config.segment_bytes),
            });
        }
        let segmented = config.format == FileFormat::Native
            && page_file::chooses_segments(&root, page_bytes < config.segment_threshold)
                .map_err(|error| io_failure(format!("reading {}: {error}", root.display()), error))?;
        // the smallest unit the capacity must hold: a page file, or a segment record of one page
        let unit_bytes = if segmented {
            (segment::record::data_bytes(segment::record::Kind::Pages, 1, page_bytes, config.direct_io)
                + segment::record::header_len(1)) as u64
        } else {
            file_bytes
        };
        if let Some(capacity) = config.capacity_bytes
            && capacity < unit_bytes
        {
            return Err(Error::InvalidArgument {
                field: "capacity_bytes",
                reason: format!("{capacity} bytes cannot hold one page of {unit_bytes} bytes as stored"),
            });
        }
        let config_threads = config.io_threads;
        let threads = threads::threads();
        let pool = threads::pool(&threads, config_threads, "hicache-file")
            .map_err(|error| storage_error(format!("starting {config_threads} I/O threads: {error}")))?;
        let mut storage = Self {
            namespace: namespace.clone(),
            config,
            root,
            sglang_tail,
            shape,
            digest,
            index: None,
            account: None,
            direct_pages: AtomicU64::new(0),
            segments: None,
            stats: StatsRecorder::default(),
            pool,
            threads,
        };
        if segmented {
            let settings = segment::SegmentSettings {
                root: storage.root.clone(),
                base: storage.config.dir.clone(),
                digest: storage.digest.as_bytes().to_vec(),
                page_bytes,
                segment_bytes: storage
                    .config
                    .capacity_bytes
                    .map_or(storage.config.segment_bytes, |capacity| storage.config.segment_bytes.min(capacity / 8))
                    .max(unit_bytes),
                direct_io: storage.config.direct_io,
                io_uring: storage.config.io_uring,
                read_ahead: storage.config.read_ahead_bytes,
                write_behind: storage.config.write_behind_bytes,
                preallocate: storage.config.preallocate_bytes,
                write_split: storage.config.write_split_bytes,
                read_only: storage.config.read_only,
                capacity_bytes: storage.config.capacity_bytes,
                account: storage.config.capacity_bytes.map(|_| storage.account_path()),
                changes: storage.config.dir.join("hicache-v1").join(format!(".changes-{}", storage.digest)),
            };
            storage.segments = Some(segment::SegmentStore::open(settings).map_err(|error| {
                io_failure(format!("opening the segments of {}: {error}", storage.root.display()), error)
            })?);
            return Ok(storage);
        }
        if !storage.config.read_only {
            storage.remove_stale_temporaries()?;
        }
        if storage.config.capacity_bytes.is_some() {
            let index = storage.scan(None)?;
            if !storage.config.read_only {
                let path = storage.account_path();
                let account_error = |error: std::io::Error| io_failure(format!("{}: {error}", path.display()), error);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).map_err(account_error)?;
                }
                let account = account::SharedAccount::open(&path).map_err(account_error)?;
                // the directory as it is now, counted under the lock, is the account every process starts from
                account.lock().and_then(|locked| locked.set(index.total())).map_err(account_error)?;
                storage.account = Some(account);
            }
            storage.index = Some(Mutex::new(index));
        }
        Ok(storage)
    }

    /// The capacity account's file: beside the namespace's pages, outside the folders `clear` removes.
    fn account_path(&self) -> PathBuf {
        match self.config.format {
            FileFormat::Native => self.config.dir.join("hicache-v1").join(format!(".capacity-{}", self.digest)),
            FileFormat::Sglang => {
                self.config.dir.join(format!(".hicache-capacity-{}", self.sglang_tail.trim_start_matches('_')))
            }
        }
    }

    /// Runs `change(index, recounted)` on the capacity index under the shared account's lock, then records the
    /// index's total there. When the account does not hold what this process last recorded, another process changed
    /// the directory: the index is counted from the directory again first (`recounted`). Without a capacity, does
    /// nothing; read-only, changes the index alone.
    fn with_account(&self, change: impl FnOnce(&mut index::LruIndex, bool)) -> Result<(), Error> {
        let Some(mut index) = self.lock_index() else { return Ok(()) };
        let Some(account) = &self.account else {
            change(&mut index, false);
            return Ok(());
        };
        let error = |error: std::io::Error| io_failure(format!("the capacity account: {error}"), error);
        let locked = account.lock().map_err(error)?;
        let recounted = locked.bytes().map_err(error)? != Some(index.total());
        if recounted {
            *index = self.scan(Some(&index))?;
        }
        change(&mut index, recounted);
        locked.set(index.total()).map_err(error)
    }

    /// Removes this namespace's temporary files older than [`STALE_TEMPORARY_AGE`]: what writers killed mid-write
    /// left behind.
    fn remove_stale_temporaries(&self) -> Result<u64, Error> {
        let recurse = self.config.format == FileFormat::Native;
        page_file::remove_stale_temporaries(&self.root, recurse, &|name| self.is_page_name(name), STALE_TEMPORARY_AGE)
            .map_err(|error| io_failure(format!("removing stale temporary files: {error}"), error))
    }

    /// Rebuilds the capacity account from the directory: this namespace's page files, oldest first. File times come
    /// from a coarse clock (pages written within a few milliseconds tie), so ties go by `known`'s order, this
    /// process's exact record of the pages it wrote and read.
    fn scan(&self, known: Option<&index::LruIndex>) -> Result<index::LruIndex, Error> {
        let mut found = Vec::new();
        self.visit_own_files(&mut |modified, key, bytes| {
            let recency = known.and_then(|known| known.recency(&key)).unwrap_or(0);
            found.push((modified, recency, key, bytes));
        })?;
        found.sort_unstable();
        let mut index = index::LruIndex::default();
        for (_, _, key, bytes) in found {
            index.insert(key, bytes);
        }
        Ok(index)
    }

    /// Calls `visit(modified, key, bytes)` for each of this namespace's page files (temporary files are not pages).
    fn visit_own_files(&self, visit: &mut dyn FnMut(std::time::SystemTime, PageKey, u64)) -> Result<(), Error> {
        if !self.root.exists() {
            // a namespace nothing was written to yet (read-only opens do not create its folder)
            return Ok(());
        }
        // the SGLang layout's directory is shared with whatever else lives there: its own files only, never below it
        let recurse = self.config.format == FileFormat::Native;
        page_file::list_files(
            &self.root,
            recurse,
            &mut |path, bytes, modified| {
                let Some(name) = path.file_name().and_then(|name| name.to_str()) else { return };
                // in SGLang's layout a file of another length is another namespace's page under the same name
                let own =
                    self.is_page_name(name) && (self.config.format == FileFormat::Native || bytes == self.file_bytes());
                if let (true, Ok(key)) = (own, name[..64.min(name.len())].parse::<PageKey>()) {
                    visit(modified, key, bytes);
                }
            },
            &mut |folder, error| {
                tracing::warn!(
                    folder = %folder.display(),
                    %error,
                    "skipping a folder of this namespace that cannot be read: its pages are neither listed nor \
                     counted against the capacity"
                );
            },
        )
        .map_err(|error| io_failure(format!("scanning this namespace's pages: {error}"), error))
    }

    fn lock_index(&self) -> Option<MutexGuard<'_, index::LruIndex>> {
        // every update of the index is one call that leaves it consistent, so a poisoned lock's data is sound
        self.index.as_ref().map(|index| index.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    /// Pages read or written with `O_DIRECT` so far (the others went through the page cache).
    pub fn direct_io_pages(&self) -> u64 {
        self.direct_pages.load(Ordering::Relaxed) + self.segments.as_ref().map_or(0, |segments| segments.direct_pages())
    }

    /// Pages of segments written behind ([`FileConfig::write_behind_bytes`]) so far.
    pub fn pages_written_behind(&self) -> u64 {
        self.segments.as_ref().map_or(0, |segments| segments.pages_written_behind())
    }

    /// Pages read from windows of segments read ahead into this backend's memory (with `direct_io`) so far.
    pub fn pages_read_ahead(&self) -> u64 {
        self.segments.as_ref().map_or(0, |segments| segments.pages_read_ahead())
    }

    /// Pages and bytes this namespace holds, when it has a capacity (in segments: the pages this process knows of
    /// and the bytes of the segment files).
    pub fn usage(&self) -> Option<(usize, u64)> {
        if let Some(segments) = &self.segments {
            return self.config.capacity_bytes.and_then(|_| segments.usage().ok());
        }
        self.lock_index().map(|index| (index.len(), index.total()))
    }

    /// Whether this namespace's pages are appended to segment files (small native pages) rather than one file each.
    pub fn uses_segments(&self) -> bool {
        self.segments.is_some()
    }

    /// Whether segment reads and writes go through io_uring.
    pub fn uses_io_uring(&self) -> bool {
        self.segments.as_ref().is_some_and(|segments| segments.uses_io_uring())
    }

    /// In segments under a capacity: the segments this process removed, and the pages it wrote again from them
    /// because it had read them (compaction).
    pub fn segment_evictions(&self) -> Option<(u64, u64)> {
        self.segments.as_ref().map(|segments| segments.evictions())
    }

    /// The file of a page.
    pub fn page_path(&self, key: &PageKey) -> PathBuf {
        match self.config.format {
            FileFormat::Sglang => self.root.join(format!("{key}{}.bin", self.sglang_tail)),
            FileFormat::Native => {
                let hex = key.to_string();
                self.root.join(&hex[..2]).join(format!("{hex}.page"))
            }
        }
    }

    fn file_bytes(&self) -> u64 {
        self.shape.file_bytes() as u64
    }

    fn get_one(&self, key: &PageKey, page: &mut [&mut [u8]]) -> GetOutcome {
        if segments_len(page) != self.shape.page_bytes {
            return GetOutcome::Failed(size_mismatch(segments_len(page), self.shape.page_bytes));
        }
        let path = self.page_path(key);
        if self.shape.use_direct(page) {
            self.direct_pages.fetch_add(1, Ordering::Relaxed);
        }
        // with a capacity, a hit makes the page recent for every process: its modification time is the recency
        let touch = self.index.is_some() && !self.config.read_only;
        let outcome = match page_file::read(&path, page, self.shape, &self.binding(key), touch) {
            Ok(page_file::Read::Done) => GetOutcome::Hit,
            Ok(page_file::Read::Missing) => GetOutcome::Miss,
            Ok(page_file::Read::Corrupt(reason)) => {
                // a torn or damaged page is as good as absent; remove it so it is written again
                if !self.config.read_only {
                    let _ = std::fs::remove_file(&path);
                }
                GetOutcome::Failed(PageFailure::new(FailureKind::Corrupt, format!("{}: {reason}", path.display())))
            }
            Ok(page_file::Read::SizeMismatch(found)) => GetOutcome::Failed(PageFailure::new(
                FailureKind::SizeMismatch,
                format!(
                    "{}: {found} bytes, this namespace's pages are {} (another namespace's page? left in place)",
                    path.display(),
                    self.shape.file_bytes()
                ),
            )),
            Ok(page_file::Read::NotAFile(what)) => GetOutcome::Failed(PageFailure::new(
                FailureKind::Io,
                format!("{}: {what}, not a page file (left in place)", path.display()),
            )),
            Err(error) => {
                GetOutcome::Failed(PageFailure::caused(FailureKind::Io, format!("{}: {error}", path.display()), error))
            }
        };
        match outcome {
            GetOutcome::Hit => {
                if let Some(mut index) = self.lock_index() {
                    index.touch(key);
                }
            }
            // gone (another process removed it), or removed here as damaged: out of the account
            GetOutcome::Miss | GetOutcome::Failed(PageFailure { kind: FailureKind::Corrupt, .. }) => {
                let _ = self.with_account(|index, _| {
                    index.remove(key);
                });
            }
            GetOutcome::Failed(_) => {}
        }
        outcome
    }

    fn set_one(&self, key: &PageKey, page: &[&[u8]]) -> SetOutcome {
        if segments_len(page) != self.shape.page_bytes {
            return SetOutcome::Failed(size_mismatch(segments_len(page), self.shape.page_bytes));
        }
        if self.config.read_only {
            return SetOutcome::Failed(PageFailure::new(FailureKind::Rejected, self.read_only_message()));
        }
        let path = self.page_path(key);
        let binding = self.binding(key);
        match page_file::check(&path, self.shape, &binding) {
            Ok(page_file::Read::Missing) => {}
            Ok(page_file::Read::Done) => {
                if let Some(mut index) = self.lock_index() {
                    // present, perhaps written by another process: now held and recent
                    index.insert(*key, self.file_bytes());
                }
                return SetOutcome::AlreadyPresent;
            }
            // damaged, torn or another key's: replaced below (the rename swaps the whole file in)
            Ok(page_file::Read::Corrupt(_)) => {}
            Ok(page_file::Read::SizeMismatch(found)) => {
                return SetOutcome::Failed(PageFailure::new(
                    FailureKind::SizeMismatch,
                    format!(
                        "{}: {found} bytes are there, this namespace's pages are {} (another namespace's page? left \
                         in place)",
                        path.display(),
                        self.shape.file_bytes()
                    ),
                ));
            }
            Ok(page_file::Read::NotAFile(what)) => {
                return SetOutcome::Failed(PageFailure::new(
                    FailureKind::Io,
                    format!("{}: {what} is there, not a page file (left in place)", path.display()),
                ));
            }
            Err(error) => {
                return SetOutcome::Failed(PageFailure::caused(
                    FailureKind::Io,
                    format!("{}: {error}", path.display()),
                    error,
                ));
            }
        }
        if self.shape.use_direct(page) {
            self.direct_pages.fetch_add(1, Ordering::Relaxed);
        }
        if let Err(error) = page_file::write_atomic(&path, page, self.shape, &binding, &self.config.dir) {
            return SetOutcome::Failed(PageFailure::caused(
                FailureKind::Io,
                format!("{}: {error}", path.display()),
                error,
            ));
        }
        if let Some(capacity) = self.config.capacity_bytes {
            // down to 90% of the capacity when that frees whole pages, so a full directory is not counted per write
            let file_bytes = self.file_bytes();
            let low = capacity - capacity / 10 / file_bytes * file_bytes;
            let mut victims = Vec::new();
            let counted = self.with_account(|index, recounted| {
                if !recounted {
                    index.insert(*key, file_bytes);
                }
                if index.total() > capacity {
                    // recency is every process's: pages' modification times, which reads touch; count them now
                    if !recounted && let Ok(counted) = self.scan(Some(index)) {
                        *index = counted;
                    }
                    victims = index.evict_to(low, key);
                    // under the account's lock, so no other process counts a page removed here; a reader that has
                    // the file open keeps reading it
                    for victim in &victims {
                        let _ = std::fs::remove_file(self.page_path(victim));
                    }
                }
            });
            self.stats.record_removed(victims.len() as u64);
            if let Err(error) = counted {
                // the page is stored; only the account failed (it is counted again at the next write)
                return SetOutcome::Failed(PageFailure::new(
                    FailureKind::Io,
                    format!("{}: stored, but {error}", path.display()),
                ));
            }
        }
        SetOutcome::Stored
    }

    /// Runs `work` on every (key, item) pair on the backend's I/O threads (inline for one pair); the outcomes come
    /// back in key order.
    fn in_parallel<T: Send, O: Send>(
        &self,
        keys: &[PageKey],
        items: &mut [T],
        work: impl Fn(&PageKey, &mut T) -> O + Sync,
    ) -> Vec<O> {
        use rayon::prelude::*;
        if keys.len() <= 1 || self.config.io_threads == 1 {
            return keys.iter().zip(items).map(|(key, item)| work(key, item)).collect();
        }
        self.pool.install(|| keys.par_iter().zip(items.par_iter_mut()).map(|(key, item)| work(key, item)).collect())
    }

    /// What a native page's checksum covers besides the page: the namespace digest and the key.
    fn binding(&self, key: &PageKey) -> Vec<u8> {
        let mut binding = Vec::with_capacity(self.digest.len() + 32);
        binding.extend_from_slice(self.digest.as_bytes());
        binding.extend_from_slice(key.as_bytes());
        binding
    }

    fn read_only_message(&self) -> String {
        format!("{} was opened read-only", self.config.dir.display())
    }

    /// Whether `name` is a page file name of this namespace's layout (in its folder): `{64 hex}.page` natively,
    /// SGLang's exact name otherwise.
    fn is_page_name(&self, name: &str) -> bool {
        match self.config.format {
            FileFormat::Native => name.len() == 69 && name.ends_with(".page"),
            FileFormat::Sglang => self.is_own_sglang_file(name),
        }
    }

    /// Whether a file name in the SGLang directory belongs to this namespace: `{64 hex}{tail}.bin`, exactly (the
    /// tail starts with `_` for the KV and `.` for a sidecar pool, so the two never claim each other's files).
    fn is_own_sglang_file(&self, name: &str) -> bool {
        name.len() > 64
            && name.is_char_boundary(64)
            && name.as_bytes()[..64].iter().all(u8::is_ascii_hexdigit)
            && name[64..].strip_suffix(".bin") == Some(self.sglang_tail.as_str())
    }
}

impl Drop for FileStorage {
    fn drop(&mut self) {
        // the pages written behind are written before the backend goes (each wait has its deadline)
        if let Some(segments) = &self.segments
            && let Err(error) = segments.flush()
        {
            tracing::warn!(%error, dir = %self.root.display(), "pages written behind were not all written");
        }
    }
}

fn storage_error(message: String) -> Error {
    Error::storage("file", message)
}

/// A whole-call failure caused by `error`, which stays reachable ([`Error::io_error`]).
fn io_failure(message: String, error: std::io::Error) -> Error {
    Error::storage_caused("file", message, error)
}

impl StorageBackend for FileStorage {
    fn name(&self) -> &str {
        "file"
    }

    fn namespace(&self) -> Option<&StorageNamespace> {
        Some(&self.namespace)
    }

    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
        if let Some(segments) = &self.segments {
            let hits = segments.exists(keys).map_err(|error| {
                io_failure(format!("reading the segments of {}: {error}", self.root.display()), error)
            })?;
            self.stats.record_exists(keys.len(), hits);
            return Ok(hits);
        }
        // one thread: a stat costs about a microsecond, less than handing slices of keys to the I/O threads (three
        // to four times slower over 4096 keys on two cores)
        let mut hits = 0;
        for key in keys {
            let path = self.page_path(key);
            match std::fs::metadata(&path) {
                // a regular file of a page's length; anything else is no page of this namespace (a get would say why)
                Ok(metadata) if metadata.is_file() && metadata.len() == self.file_bytes() => hits += 1,
                Ok(_) => break,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => break,
                // the same answer a get would give: an error, not "absent"
                Err(error) => return Err(io_failure(format!("checking {}: {error}", path.display()), error)),
            }
        }
        self.stats.record_exists(keys.len(), hits);
        Ok(hits)
    }

    fn batch_contains(&self, keys: &[PageKey]) -> Result<Vec<bool>, Error> {
        let Some(segments) = &self.segments else {
            // a file per page: a stat each, as `batch_exists` does
            return keys.iter().map(|key| self.exists(key)).collect();
        };
        let held = segments
            .contains(keys)
            .map_err(|error| io_failure(format!("reading the segments of {}: {error}", self.root.display()), error))?;
        self.stats.record_exists(keys.len(), held.iter().filter(|&&held| held).count());
        Ok(held)
    }

    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
        check_batch(keys.len(), pages.len())?;
        let outcomes = match &self.segments {
            Some(segments) => segments.get(keys, pages, &self.pool),
            None => self.in_parallel(keys, pages, |key, page| self.get_one(key, page)),
        };
        self.stats.record_get(&outcomes, |_| self.shape.page_bytes);
        Ok(outcomes)
    }

    fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
        check_batch(keys.len(), pages.len())?;
        if let Some(segments) = &self.segments {
            let outcomes = if self.config.read_only {
                keys.iter()
                    .map(|_| SetOutcome::Failed(PageFailure::new(FailureKind::Rejected, self.read_only_message())))
                    .collect()
            } else {
                segments.set(keys, pages, &self.pool)
            };
            self.stats.record_set(&outcomes, |_| self.shape.page_bytes);
            return Ok(outcomes);
        }
        let mut sources: Vec<&PageSegments<'_>> = pages.iter().collect();
        let mut outcomes = self.in_parallel(keys, &mut sources, |key, page| self.set_one(key, page));
        // a key repeated in the batch may have been written by two threads, in either order: one write stored the
        // page, so the first occurrence reports it stored and the others present
        let written: HashSet<PageKey> = keys
            .iter()
            .zip(&outcomes)
            .filter(|(_, outcome)| **outcome == SetOutcome::Stored)
            .map(|(key, _)| *key)
            .collect();
        let mut reported = HashSet::new();
        for (key, outcome) in keys.iter().zip(outcomes.iter_mut()) {
            if outcome.is_stored() {
                *outcome = if written.contains(key) && reported.insert(*key) {
                    SetOutcome::Stored
                } else {
                    SetOutcome::AlreadyPresent
                };
            }
        }
        self.stats.record_set(&outcomes, |_| self.shape.page_bytes);
        Ok(outcomes)
    }

    fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
        if self.config.read_only {
            return Err(storage_error(self.read_only_message()));
        }
        if let Some(segments) = &self.segments {
            let removed = segments
                .remove(keys, &self.pool)
                .map_err(|error| io_failure(format!("removing pages of {}: {error}", self.root.display()), error))?;
            self.stats.record_removed(removed as u64);
            return Ok(removed);
        }
        let mut removed = 0;
        let mut failure = None;
        for key in keys {
            let path = self.page_path(key);
            match std::fs::remove_file(&path) {
                Ok(()) => removed += 1,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                // reported after the others are removed: one page that cannot go does not keep the rest
                Err(error) => {
                    failure.get_or_insert_with(|| io_failure(format!("removing {}: {error}", path.display()), error));
                }
            }
        }
        self.stats.record_removed(removed as u64);
        self.with_account(|index, _| {
            for key in keys {
                index.remove(key);
            }
        })?;
        match failure {
            Some(error) => Err(error),
            None => Ok(removed),
        }
    }

    fn clear(&self) -> Result<u64, Error> {
        if self.config.read_only {
            return Err(storage_error(self.read_only_message()));
        }
        if let Some(segments) = &self.segments {
            let removed = segments
                .clear()
                .map_err(|error| io_failure(format!("clearing {}: {error}", self.root.display()), error))?;
            // the namespace's folders go too when empty (itself, `hicache-v1`)
            if std::fs::remove_dir(&self.root).is_ok()
                && let Some(parent) = self.root.parent()
            {
                let _ = std::fs::remove_dir(parent);
            }
            self.stats.record_removed(removed);
            return Ok(removed);
        }
        let removed = match self.config.format {
            FileFormat::Native => page_file::remove_tree_files(&self.root, true, &|_, _| true).and_then(|removed| {
                // the namespace's folders go too when empty (its shard folders, itself, `hicache-v1`)
                page_file::remove_empty_dirs(&self.root)?;
                if std::fs::remove_dir(&self.root).is_ok()
                    && let Some(parent) = self.root.parent()
                {
                    let _ = std::fs::remove_dir(parent);
                }
                Ok(removed)
            }),
            FileFormat::Sglang => {
                // a file of another length is another namespace's page under the same name (SGLang's names do not
                // say the dtype or the geometry)
                let file_bytes = self.file_bytes();
                page_file::remove_tree_files(&self.root, false, &|name, length| {
                    self.is_own_sglang_file(name) && length.is_none_or(|length| length == file_bytes)
                })
            }
        }
        .map_err(|error| io_failure(format!("clearing {}: {error}", self.root.display()), error))?;
        // recorded as what the directory holds now (another process may have written meanwhile)
        self.with_account(|index, recounted| {
            if !recounted && let Ok(counted) = self.scan(Some(index)) {
                *index = counted;
            }
        })?;
        self.stats.record_removed(removed);
        Ok(removed)
    }

    fn stats(&self) -> StorageStats {
        self.stats.snapshot()
    }

    fn flush(&self) -> Result<(), Error> {
        self.segments.as_ref().map_or(Ok(()), |segments| {
            segments.flush().map_err(|error| {
                io_failure(format!("writing the pages of {} written behind: {error}", self.root.display()), error)
            })
        })
    }

    fn list(&self) -> Result<Vec<(PageKey, u64)>, Error> {
        if let Some(segments) = &self.segments {
            return segments.list().map_err(|error| {
                io_failure(format!("listing the segments of {}: {error}", self.root.display()), error)
            });
        }
        let mut pages = Vec::new();
        self.visit_own_files(&mut |_, key, bytes| pages.push((key, bytes)))?;
        Ok(pages)
    }
}
