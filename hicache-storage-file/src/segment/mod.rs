//! Small pages appended to segment files, found through an index every process rebuilds from the segments.
//!
//! A namespace's segments live in `{namespace folder}/segments/`, named `{creation ns:020}-{writer:016x}` so that
//! names sort oldest first; each is a data file (`.seg`, the pages) and an index file (`.idx`, the records, see
//! `record.rs`). Each process appends only to segments it created, one at a time: a batch's pages go to the data
//! file at an offset reserved under a lock (threads of one process write side by side; processes never share a
//! file), and once they are written, a record naming them (keys and checksums) is appended to the index file. A
//! writer with `O_DIRECT` allocates its data file ahead of its writes, since a direct write that lengthens a file
//! waits for the file system.
//!
//! Every process keeps an index (key → segment, offset, checksum) in memory. It is built from the index files when
//! the backend opens (recovery: a torn or damaged record ends what is taken from its index file, and a record whose
//! pages lie past the end of its data file is skipped), and brought up to date (new segments, records appended
//! since, segments gone) whenever a lookup misses, and whenever another process removed, cleared or evicted pages
//! (a shared count, one `pread` per call, says so). A read checks each page's checksum, which binds the namespace
//! digest and the key, so a torn or foreign page is never returned. A removal is a record of removed keys, stamped,
//! so every process applies it against the copies written before it.
//!
//! Reads of a prefix in the order it was written are read ahead, a window of the segment at a time (`ahead.rs`): with
//! `O_DIRECT`, into this process's own memory by threads of the store's (`window.rs`), and pages in a window that
//! arrived are copied from it; without, into the page cache, dropped from it behind the walk.
//!
//! With a capacity, the bytes of the namespace's segments are counted in the account every process shares
//! (`account.rs`); a writer that would pass the capacity removes whole segments, oldest first, down to 90%, then
//! compacts: pages of the removed segments that this process read since they were written are written again, so a
//! page in use outlives its segment (and the pages nobody read go with it).

mod ahead;
mod behind;
mod io;
pub(crate) mod record;
mod window;

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use hicache_core::hash::PageKey;
use hicache_core::storage::{
    FailureKind, GetOutcome, PageFailure, PageSegments, PageSegmentsMut, SetOutcome, segments_len, size_mismatch,
};

use rustc_hash::FxHashMap;

use self::ahead::ReadAhead;
use self::behind::{Behind, Flight};
use self::io::{MAX_BUFFERS, Op, Submitter};
use self::record::{ALIGN, Header, Kind};
use self::window::{Served, Windows};
use crate::account::SharedAccount;
use crate::threads::Threads;

/// The folder of a namespace's segments, inside its namespace folder.
pub(crate) const FOLDER: &str = "segments";
/// The most bytes one read takes: a batch's pages, however contiguous, are read in several operations at once, and
/// each operation's pages are checked while the next are read.
const READ_SPLIT_BYTES: usize = 128 << 10;
/// Bytes of pages whose checksums are computed on several threads (below it, handing the work over costs more).
const PARALLEL_CHECK_BYTES: usize = 2 << 20;
/// A segment's data file (its pages) and index file (its records) end with these.
const DATA: &str = ".seg";
const RECORDS: &str = ".idx";
/// The windows read ahead (with `O_DIRECT`) hold at most this many times the read-ahead in all.
const WINDOW_BUDGET: u64 = 8;
/// Bytes of index file read at a time when scanning.
const SCAN_BYTES: usize = 1 << 20;

/// Settings of a segment store.
#[derive(Clone, Debug)]
pub(crate) struct SegmentSettings {
    /// The namespace folder (segments go in its [`FOLDER`]).
    pub(crate) root: PathBuf,
    /// The storage directory: folders are made below it, never it.
    pub(crate) base: PathBuf,
    /// The namespace digest, bound into every checksum.
    pub(crate) digest: Vec<u8>,
    pub(crate) page_bytes: usize,
    /// Bytes after which a writer starts a new segment.
    pub(crate) segment_bytes: u64,
    pub(crate) direct_io: bool,
    pub(crate) io_uring: bool,
    /// Bytes read ahead of a batch that continues a forward walk through a segment (0: none).
    pub(crate) read_ahead: u64,
    /// Bytes of batches written behind (`behind.rs`) at most (a batch of more than half of it is written in place);
    /// 0 writes every batch in place.
    pub(crate) write_behind: u64,
    /// With `O_DIRECT`: bytes the data file is allocated ahead of the writes (0: none).
    pub(crate) preallocate: u64,
    /// The most bytes of pages one write of a batch carries (0: one write per batch).
    pub(crate) write_split: u64,
    pub(crate) read_only: bool,
    pub(crate) capacity_bytes: Option<u64>,
    /// The capacity account's file (with a capacity and writes).
    pub(crate) account: Option<PathBuf>,
    /// The file whose count every removal, clear and eviction raises (outside the namespace folder, which a clear
    /// removes).
    pub(crate) changes: PathBuf,
}

/// Where a key stands, with the stamp of the record that said so.
#[derive(Clone, Copy, Debug)]
enum Slot {
    /// A page at `offset` of segment `segment`; `read`: this process read it since it was written.
    Page { segment: u32, offset: u64, checksum: u64, stamp: u64, read: bool },
    /// Removed.
    Removed { stamp: u64 },
}

impl Slot {
    fn stamp(&self) -> u64 {
        match *self {
            Slot::Page { stamp, .. } | Slot::Removed { stamp } => stamp,
        }
    }
}

/// One segment as this process knows it.
#[derive(Debug)]
struct Segment {
    /// Its name, without extension.
    name: String,
    /// Its data file.
    path: PathBuf,
    /// Read handles, opened on first use (buffered, and `O_DIRECT`).
    buffered: OnceLock<Arc<File>>,
    direct: OnceLock<Arc<File>>,
    /// Bytes of its index file whose records were taken into the index.
    scanned: u64,
    /// This process writes it (its records go into the index as they are written, never by scanning).
    own: bool,
    /// Pages of it the index points at.
    pages: usize,
    /// Where the pages its records name end in the data file.
    data_end: u64,
}

impl Segment {
    fn new(name: String, path: PathBuf, own: bool) -> Self {
        Self { name, path, buffered: OnceLock::new(), direct: OnceLock::new(), scanned: 0, own, pages: 0, data_end: 0 }
    }

    /// A read handle, opened now if needed.
    fn handle(&self, direct: bool) -> std::io::Result<Arc<File>> {
        let cell = if direct { &self.direct } else { &self.buffered };
        if let Some(file) = cell.get() {
            return Ok(file.clone());
        }
        let mut options = OpenOptions::new();
        options.read(true);
        if direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = Arc::new(options.open(&self.path)?);
        Ok(cell.get_or_init(|| file).clone())
    }
}

/// The index: every key this process knows of, and the segments.
#[derive(Debug, Default)]
struct Index {
    /// Keyed by page keys, which are hashes already: a fast hasher is enough.
    keys: FxHashMap<PageKey, Slot>,
    segments: HashMap<u32, Segment>,
    by_name: BTreeMap<String, u32>,
    next_id: u32,
}

impl Index {
    fn add_segment(&mut self, segment: Segment) -> u32 {
        let id = self.next_id;
        self.next_id += 1;
        self.by_name.insert(segment.name.clone(), id);
        self.segments.insert(id, segment);
        id
    }

    /// Records `slot` for `key` unless the index holds a later record of it.
    fn put(&mut self, key: PageKey, slot: Slot) {
        if let Some(old) = self.keys.get(&key) {
            if old.stamp() >= slot.stamp() {
                return;
            }
            if let Slot::Page { segment, .. } = *old
                && let Some(segment) = self.segments.get_mut(&segment)
            {
                segment.pages -= 1;
            }
        }
        if let Slot::Page { segment, .. } = slot
            && let Some(segment) = self.segments.get_mut(&segment)
        {
            segment.pages += 1;
        }
        self.keys.insert(key, slot);
    }

    /// Takes a record of segment `id` into the index.
    fn apply(&mut self, id: u32, header: &Header) {
        match header.kind {
            Kind::Pages => {
                if let Some(segment) = self.segments.get_mut(&id) {
                    segment.data_end = segment.data_end.max(header.data_at + header.data_bytes);
                }
                for (index, &(key, checksum)) in header.entries.iter().enumerate() {
                    let offset = header.data_at + index as u64 * header.page_bytes;
                    self.put(key, Slot::Page { segment: id, offset, checksum, stamp: header.stamp, read: false });
                }
            }
            Kind::Removals => {
                for &(key, _) in &header.entries {
                    self.put(key, Slot::Removed { stamp: header.stamp });
                }
            }
        }
    }

    /// Forgets segment `id` and the pages in it.
    fn drop_segment(&mut self, id: u32) -> Option<Segment> {
        let segment = self.segments.remove(&id)?;
        self.by_name.remove(&segment.name);
        if segment.pages > 0 {
            self.keys.retain(|_, slot| !matches!(slot, Slot::Page { segment, .. } if *segment == id));
        }
        Some(segment)
    }

    /// Forgets a page that failed its check, unless a later record replaced it meanwhile.
    fn forget(&mut self, key: &PageKey, stamp: u64) {
        if let Some(&Slot::Page { segment, stamp: held, .. }) = self.keys.get(key)
            && held == stamp
        {
            self.keys.remove(key);
            if let Some(segment) = self.segments.get_mut(&segment) {
                segment.pages -= 1;
            }
        }
    }

    fn page(&self, key: &PageKey) -> Option<(u32, u64, u64, u64)> {
        match self.keys.get(key) {
            Some(&Slot::Page { segment, offset, checksum, stamp, .. }) => Some((segment, offset, checksum, stamp)),
            _ => None,
        }
    }

    fn live_pages(&self) -> usize {
        self.segments.values().map(|segment| segment.pages).sum()
    }
}

/// The segment this process appends to.
#[derive(Debug)]
struct Writer {
    /// The segment and its files, as each append holds them.
    files: WriterHandle,
    /// Where the next batch's pages go in the data file.
    end: u64,
    /// How far the data file is allocated (with `O_DIRECT`, ahead of `end`).
    allocated: u64,
}

/// The segments in the folder (name, data file length, index file length), and index files without a data file.
type Listing = (Vec<(String, u64, u64)>, Vec<String>);

/// A namespace's pages in segment files.
#[derive(Debug)]
pub(crate) struct SegmentStore {
    settings: SegmentSettings,
    dir: PathBuf,
    index: RwLock<Index>,
    /// Held while the index is brought up to date (one refresh at a time).
    refreshing: Mutex<()>,
    writer: Mutex<Option<Writer>>,
    submitter: Submitter,
    /// The walks through segments that batches of reads make, and the windows read ahead of them.
    ahead: ReadAhead,
    /// With `O_DIRECT` and read-ahead: the windows read ahead into this process's memory (`window.rs`); without,
    /// windows are asked of the page cache.
    windows: Option<Windows>,
    /// With a write-behind budget: the batches written behind (`behind.rs`).
    behind: OnceLock<Arc<Behind>>,
    /// The threads writing behind, joined once [`Behind::close`] let them end (as the store is dropped).
    behind_threads: Threads,
    account: Option<SharedAccount>,
    /// The last stamp given.
    stamp: AtomicU64,
    /// This writer's part of its segments' names.
    writer_tag: u64,
    /// Pages read or written with `O_DIRECT`.
    direct_pages: AtomicU64,
    /// Pages served from windows read ahead.
    read_ahead_pages: AtomicU64,
    /// Held with the account's file lock, which the threads of one process share.
    accounting: Mutex<()>,
    /// The count of removals, clears and evictions, and the one the index was last brought up to date at.
    changes: Changes,
    seen_changes: AtomicU64,
    /// Segments removed under the capacity, and pages written again from them.
    evicted: AtomicU64,
    compacted: AtomicU64,
}

/// Zeros for a record's padding, in a block `O_DIRECT` can take.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(4096))]
struct Block([u8; ALIGN]);
static ZEROS: Block = Block([0; ALIGN]);

/// `len` bytes (rounded up to a block) of zeroed memory starting at a block boundary, as `O_DIRECT` needs (asked of
/// the allocator zeroed: a large buffer comes as fresh pages, not written over by this thread).
fn aligned_buffer(len: usize) -> Vec<Block> {
    bytemuck::allocation::zeroed_vec(len.div_ceil(ALIGN))
}

/// Buffers of block-aligned memory given back (windows read ahead and dropped, batches written behind), kept for the
/// next: zeroing a new one takes about as long as the disk takes to fill or drain it.
#[derive(Default)]
struct Spare {
    buffers: Mutex<Vec<Vec<Block>>>,
}

impl std::fmt::Debug for Spare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let buffers = self.buffers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        f.debug_struct("Spare").field("buffers", &buffers.len()).finish()
    }
}

impl Spare {
    /// A buffer of at least `blocks` blocks (a former one's bytes, or zeros).
    fn take(&self, blocks: usize) -> Vec<Block> {
        let mut buffers = self.buffers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match buffers.iter().position(|buffer| buffer.len() >= blocks) {
            Some(index) => buffers.swap_remove(index),
            None => {
                drop(buffers);
                aligned_buffer(blocks * ALIGN)
            }
        }
    }

    /// Keeps `given`, up to `budget` bytes of buffers kept.
    fn keep(&self, given: impl IntoIterator<Item = Vec<Block>>, budget: u64) {
        let mut buffers = self.buffers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for buffer in given {
            let kept: usize = buffers.iter().map(Vec::len).sum();
            if ((kept + buffer.len()) * ALIGN) as u64 <= budget {
                buffers.push(buffer);
            }
        }
    }
}

/// Copies a page's bytes (`source`) into its segments, one after another.
fn scatter(segments: &mut PageSegmentsMut<'_>, source: &[u8]) {
    let mut at = 0;
    for segment in segments.iter_mut() {
        segment.copy_from_slice(&source[at..at + segment.len()]);
        at += segment.len();
    }
}

fn failure(kind: FailureKind, message: String) -> PageFailure {
    PageFailure::new(kind, message)
}

impl SegmentStore {
    /// Opens the segments of a namespace, reading every record header into the index.
    pub(crate) fn open(settings: SegmentSettings) -> std::io::Result<Arc<Self>> {
        let dir = settings.root.join(FOLDER);
        let account = match (&settings.account, settings.read_only) {
            (Some(path), false) => {
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                Some(SharedAccount::open(path)?)
            }
            _ => None,
        };
        let settings_changes = (settings.changes.clone(), settings.base.clone(), !settings.read_only);
        let store = Self {
            submitter: Submitter::new(settings.io_uring),
            ahead: if settings.direct_io {
                ReadAhead::into_windows(settings.read_ahead)
            } else {
                ReadAhead::new(settings.read_ahead)
            },
            windows: match (settings.direct_io, settings.read_ahead) {
                (true, bytes) if bytes > 0 => Some(Windows::start(bytes.saturating_mul(WINDOW_BUDGET))?),
                _ => None,
            },
            behind: OnceLock::new(),
            behind_threads: crate::threads::threads(),
            settings,
            dir,
            index: RwLock::new(Index::default()),
            refreshing: Mutex::new(()),
            writer: Mutex::new(None),
            account,
            stamp: AtomicU64::new(0),
            writer_tag: rand::random(),
            direct_pages: AtomicU64::new(0),
            read_ahead_pages: AtomicU64::new(0),
            accounting: Mutex::new(()),
            changes: Changes::new(settings_changes),
            seen_changes: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            compacted: AtomicU64::new(0),
        };
        store.catch_up(true)?;
        if let Some(account) = &store.account {
            // the directory as it is now, counted under the lock, is the account every process starts from
            let locked = account.lock()?;
            locked.set(store.disk_bytes()?)?;
        }
        let store = Arc::new(store);
        if store.settings.write_behind > 0 && !store.settings.read_only {
            let behind = Behind::start(Arc::downgrade(&store), store.settings.write_behind, &store.behind_threads)?;
            let _ = store.behind.set(behind);
        }
        Ok(store)
    }

    /// Waits until every batch written behind is written (at once when none is pending).
    pub(crate) fn flush(&self) -> std::io::Result<()> {
        self.behind.get().map_or(Ok(()), |behind| behind.flush())
    }

    /// Whether batches go through io_uring.
    pub(crate) fn uses_io_uring(&self) -> bool {
        self.submitter.uses_io_uring()
    }

    /// Pages served from windows read ahead.
    pub(crate) fn pages_read_ahead(&self) -> u64 {
        self.read_ahead_pages.load(Ordering::Relaxed)
    }

    /// Pages written behind (`behind.rs`).
    pub(crate) fn pages_written_behind(&self) -> u64 {
        self.behind.get().map_or(0, |behind| behind.pages_sent())
    }

    /// Pages read or written with `O_DIRECT`.
    pub(crate) fn direct_pages(&self) -> u64 {
        self.direct_pages.load(Ordering::Relaxed)
    }

    /// Segments this process removed under the capacity, and the pages of theirs it wrote again.
    pub(crate) fn evictions(&self) -> (u64, u64) {
        (self.evicted.load(Ordering::Relaxed), self.compacted.load(Ordering::Relaxed))
    }

    /// Pages held (as this process knows them) and the bytes of the segments.
    pub(crate) fn usage(&self) -> std::io::Result<(usize, u64)> {
        self.flush()?;
        Ok((self.read_index().live_pages(), self.disk_bytes()?))
    }

    fn read_index(&self) -> std::sync::RwLockReadGuard<'_, Index> {
        // every change of the index is one call that leaves it consistent, so a poisoned lock's data is sound
        self.index.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write_index(&self) -> std::sync::RwLockWriteGuard<'_, Index> {
        self.index.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A stamp later than every one this process gave.
    fn next_stamp(&self) -> u64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos() as u64);
        let mut last = self.stamp.load(Ordering::Relaxed);
        loop {
            let next = now.max(last + 1);
            match self.stamp.compare_exchange_weak(last, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return next,
                Err(current) => last = current,
            }
        }
    }

    /// The segments in the folder, oldest first: name, data file length, index file length. Index files without
    /// a data file (left by an eviction or clear that stopped between the two removals) are listed apart.
    fn list_segments(&self) -> std::io::Result<Listing> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), Vec::new())),
            Err(error) => return Err(error),
        };
        let mut data = BTreeMap::new();
        let mut records = BTreeMap::new();
        for entry in entries {
            let entry = entry?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
            let (stem, into) = match (name.strip_suffix(DATA), name.strip_suffix(RECORDS)) {
                (Some(stem), _) => (stem.to_owned(), &mut data),
                (_, Some(stem)) => (stem.to_owned(), &mut records),
                _ => continue,
            };
            match entry.metadata() {
                Ok(metadata) if metadata.is_file() => {
                    into.insert(stem, metadata.len());
                }
                Ok(_) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(error),
            }
        }
        let orphans = records.keys().filter(|stem| !data.contains_key(*stem)).cloned().collect();
        let segments = data
            .into_iter()
            .map(|(stem, length)| {
                let records = records.get(&stem).copied().unwrap_or(0);
                (stem, length, records)
            })
            .collect();
        Ok((segments, orphans))
    }

    /// Bytes the namespace's segments take.
    fn disk_bytes(&self) -> std::io::Result<u64> {
        Ok(self.list_segments()?.0.iter().map(|(_, data, records)| data + records).sum())
    }

    /// Removes segment `name`: its data file, then its index file.
    fn remove_segment(&self, name: &str) -> std::io::Result<()> {
        for extension in [DATA, RECORDS] {
            match std::fs::remove_file(self.dir.join(format!("{name}{extension}"))) {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => return Err(error),
                _ => {}
            }
        }
        Ok(())
    }

    /// Brings the index up to date when another backend removed, cleared or evicted pages since it last was (one
    /// read of the count), or always with `always`.
    fn catch_up(&self, always: bool) -> std::io::Result<()> {
        let count = self.changes.read();
        if always || count != self.seen_changes.load(Ordering::Acquire) {
            self.refresh()?;
            self.seen_changes.store(count, Ordering::Release);
        }
        Ok(())
    }

    /// Brings the index up to date with the folder: new segments and records appended since are read, segments
    /// removed (by another process's eviction or clear) are forgotten.
    pub(crate) fn refresh(&self) -> std::io::Result<()> {
        let _refreshing = self.refreshing.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (listed, _) = self.list_segments()?;
        // what to read, outside the index's lock: (id if known, name, from, length)
        let mut work = Vec::new();
        let gone: Vec<u32> = {
            let index = self.read_index();
            for (name, _, length) in &listed {
                match index.by_name.get(name).map(|id| (*id, &index.segments[id])) {
                    Some((_, segment)) if segment.own || segment.scanned >= *length => {}
                    Some((id, segment)) => work.push((Some(id), name.clone(), segment.scanned, *length)),
                    None => work.push((None, name.clone(), 0, *length)),
                }
            }
            let listed: std::collections::HashSet<&str> = listed.iter().map(|(name, _, _)| name.as_str()).collect();
            index.by_name.iter().filter(|(name, _)| !listed.contains(name.as_str())).map(|(_, id)| *id).collect()
        };
        let mut read = Vec::new();
        for (id, name, from, length) in work {
            let path = self.dir.join(format!("{name}{DATA}"));
            let opened =
                File::open(&path).and_then(|data| Ok((data, File::open(self.dir.join(format!("{name}{RECORDS}")))?)));
            let (data, records) = match opened {
                Ok(files) => files,
                // removed since it was listed
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                Err(error) => return Err(error),
            };
            // the data file's length as it is now, not as listed: it is taken after the index file's, so every
            // record listed has its pages within it (pages are written before their record)
            let (headers, scanned) = self.scan(&records, from, length, data.metadata()?.len())?;
            read.push((id, name, path, data, headers, scanned));
        }
        let mut index = self.write_index();
        for id in gone {
            index.drop_segment(id);
        }
        for (id, name, path, file, headers, scanned) in read {
            let id = id.unwrap_or_else(|| {
                let segment = Segment::new(name, path, false);
                let _ = segment.buffered.set(Arc::new(file));
                index.add_segment(segment)
            });
            for header in &headers {
                index.apply(id, header);
            }
            if let Some(segment) = index.segments.get_mut(&id) {
                segment.scanned = scanned;
            }
        }
        Ok(())
    }

    /// Reads the records of an index file from `from` up to `length`, dropping those whose pages lie past the end
    /// of the data file (`data_length`); returns them and where reading stopped (the end, or a record that is torn,
    /// damaged or being written).
    fn scan(&self, records: &File, from: u64, length: u64, data_length: u64) -> std::io::Result<(Vec<Header>, u64)> {
        let page_bytes = self.settings.page_bytes;
        let mut headers = Vec::new();
        let mut offset = from;
        let mut buffer = vec![0u8; SCAN_BYTES.max(record::header_len(record::MAX_ENTRIES))];
        'chunks: while offset + record::FIXED as u64 <= length {
            let wanted = buffer.len().min((length - offset) as usize);
            let got = read_at_most(records, &mut buffer[..wanted], offset)?;
            let mut at = 0;
            loop {
                let rest = &buffer[at..got];
                let record::Peek::Header(header_len) = record::peek(rest) else {
                    // not a record, or the start of one cut by the chunk
                    if rest.len() >= record::FIXED || at == 0 {
                        break 'chunks;
                    }
                    break;
                };
                if header_len > rest.len() {
                    if at == 0 {
                        break 'chunks;
                    }
                    break;
                }
                let Some(header) = record::decode(&self.settings.digest, &rest[..header_len], page_bytes) else {
                    break 'chunks;
                };
                // pages are written before their record: pages past the data file's end were damaged since
                if header.data_at + header.data_bytes <= data_length {
                    headers.push(header);
                }
                at += header_len;
            }
            offset += at as u64;
        }
        Ok((headers, offset))
    }

    /// How many of `keys`, from the first, are held.
    pub(crate) fn exists(&self, keys: &[PageKey]) -> std::io::Result<usize> {
        self.catch_up(false)?;
        let leading =
            |index: &Index| keys.iter().take_while(|key| self.pending(key) || index.page(key).is_some()).count();
        let hits = leading(&self.read_index());
        if hits == keys.len() {
            return Ok(hits);
        }
        self.refresh()?;
        Ok(leading(&self.read_index()))
    }

    /// Whether each of `keys` is held (the index caught up with other writers first).
    pub(crate) fn contains(&self, keys: &[PageKey]) -> std::io::Result<Vec<bool>> {
        self.catch_up(false)?;
        let look = |index: &Index| {
            keys.iter().map(|key| self.pending(key) || index.page(key).is_some()).collect::<Vec<bool>>()
        };
        let held = look(&self.read_index());
        if held.iter().all(|&held| held) {
            return Ok(held);
        }
        self.refresh()?;
        Ok(look(&self.read_index()))
    }

    /// Whether `key` is in a batch written behind and not yet written.
    fn pending(&self, key: &PageKey) -> bool {
        self.behind.get().is_some_and(|behind| behind.holds(key))
    }

    /// Reads `keys` into `pages`: pages written behind and not yet written from their batch's buffer, the others
    /// from the segments (a page is looked for among those pending first: once it is no longer pending, the index
    /// holds it).
    pub(crate) fn get(
        &self,
        keys: &[PageKey],
        pages: &mut [PageSegmentsMut<'_>],
        pool: &rayon::ThreadPool,
    ) -> Vec<GetOutcome> {
        let flights = self.behind.get().map(|behind| behind.find(keys)).unwrap_or_default();
        if flights.iter().all(Option::is_none) {
            return self.get_stored(keys, pages, pool);
        }
        let page_bytes = self.settings.page_bytes;
        let mut outcomes: Vec<Option<GetOutcome>> = vec![None; keys.len()];
        let (mut rest_keys, mut rest_pages, mut rest_at) = (Vec::new(), Vec::new(), Vec::new());
        for (page, flight) in flights.into_iter().enumerate() {
            let Some((flight, index)) = flight else {
                rest_keys.push(keys[page]);
                rest_pages.push(std::mem::take(&mut pages[page]));
                rest_at.push(page);
                continue;
            };
            let length = segments_len(&pages[page]);
            if length != page_bytes {
                outcomes[page] = Some(GetOutcome::Failed(size_mismatch(length, page_bytes)));
                continue;
            }
            let source = flight.page(index);
            let (_, checksum) = flight.header.entries[index];
            // (the store's own memory: checked as every page read is)
            if record::page_checksum(&self.settings.digest, &keys[page], &[source]) != checksum {
                outcomes[page] = Some(GetOutcome::Failed(failure(
                    FailureKind::Corrupt,
                    format!("{}: page {} written behind failed its checksum", self.dir.display(), keys[page]),
                )));
                continue;
            }
            scatter(&mut pages[page], source);
            outcomes[page] = Some(GetOutcome::Hit);
        }
        if !rest_keys.is_empty() {
            let read = self.get_stored(&rest_keys, &mut rest_pages, pool);
            for ((page, segments), outcome) in rest_at.into_iter().zip(rest_pages).zip(read) {
                pages[page] = segments;
                outcomes[page] = Some(outcome);
            }
        }
        outcomes.into_iter().map(|outcome| outcome.expect("every page has an outcome")).collect()
    }

    /// Reads `keys` into `pages` (each already checked to be a page long) from the segments.
    fn get_stored(
        &self,
        keys: &[PageKey],
        pages: &mut [PageSegmentsMut<'_>],
        pool: &rayon::ThreadPool,
    ) -> Vec<GetOutcome> {
        let page_bytes = self.settings.page_bytes;
        if let Err(error) = self.catch_up(false) {
            let message = format!("{}: reading the segments: {error}", self.dir.display());
            return keys.iter().map(|_| GetOutcome::Failed(failure(FailureKind::Io, message.clone()))).collect();
        }
        let look = |index: &Index| keys.iter().map(|key| index.page(key)).collect::<Vec<_>>();
        let mut found = look(&self.read_index());
        if found.iter().zip(pages.iter()).any(|(slot, page)| slot.is_none() && segments_len(page) == page_bytes) {
            if let Err(error) = self.refresh() {
                let message = format!("{}: reading the segments: {error}", self.dir.display());
                return keys.iter().map(|_| GetOutcome::Failed(failure(FailureKind::Io, message.clone()))).collect();
            }
            found = look(&self.read_index());
        }
        let mut outcomes: Vec<Option<GetOutcome>> = found
            .iter()
            .zip(pages.iter())
            .map(|(slot, page)| match segments_len(page) {
                length if length != page_bytes => Some(GetOutcome::Failed(size_mismatch(length, page_bytes))),
                _ => slot.is_none().then_some(GetOutcome::Miss),
            })
            .collect();
        // (segment, offset, page index, direct) of each page to read, in file order
        let mut reads: Vec<(u32, u64, usize, bool)> = Vec::new();
        for (index, slot) in found.iter().enumerate() {
            if let (Some((segment, offset, _, _)), None) = (*slot, &outcomes[index]) {
                // a page another writer packed off a block boundary goes through the page cache
                let direct = self.direct_fits(&pages[index]) && offset.is_multiple_of(ALIGN as u64);
                reads.push((segment, offset, index, direct));
            }
        }
        reads.sort_unstable();
        // the read-ahead of each segment read: its pages in the window read ahead come from the page cache
        let mut plans: Vec<(u32, ahead::Plan)> = Vec::new();
        {
            let index = self.read_index();
            for run in reads.chunk_by(|first, second| first.0 == second.0) {
                let segment = run[0].0;
                let data_end = index.segments.get(&segment).map_or(0, |held| held.data_end);
                let end = run[run.len() - 1].1 + page_bytes as u64;
                plans.push((segment, self.ahead.plan(segment, run[0].1, end, data_end)));
            }
        }
        if self.windows.is_none() {
            for read in &mut reads {
                let plan = plans.iter().find(|(segment, _)| *segment == read.0).map(|(_, plan)| plan.cached);
                if let Some((from, to)) = plan
                    && from <= read.1
                    && read.1 + page_bytes as u64 <= to
                {
                    read.3 = false;
                }
            }
            reads.sort_unstable();
        }
        // handles of the segments read, held for the call (an evicted segment stays readable through them)
        let mut handles: FxHashMap<(u32, bool), Arc<File>> = FxHashMap::default();
        {
            let index = self.read_index();
            for &(segment, _, page, direct) in &reads {
                // windows read ahead are read, and found, through the segment's direct handle
                if self.windows.is_some()
                    && !handles.contains_key(&(segment, true))
                    && let Some(Ok(file)) = index.segments.get(&segment).map(|held| held.handle(true))
                {
                    handles.insert((segment, true), file);
                }
                if handles.contains_key(&(segment, direct)) {
                    continue;
                }
                match index.segments.get(&segment).map(|held| held.handle(direct)) {
                    Some(Ok(file)) => {
                        handles.insert((segment, direct), file);
                    }
                    Some(Err(error)) if error.kind() == std::io::ErrorKind::NotFound => {
                        outcomes[page] = Some(GetOutcome::Miss)
                    }
                    None => outcomes[page] = Some(GetOutcome::Miss),
                    Some(Err(error)) => {
                        outcomes[page] = Some(GetOutcome::Failed(PageFailure::caused(
                            FailureKind::Io,
                            format!("opening segment {segment} of {}: {error}", self.dir.display()),
                            error,
                        )))
                    }
                }
            }
        }
        // pages in a window read ahead are copied from it; the others are read now
        let served = self.serve_from_windows(&mut reads, &handles, page_bytes);
        // the caller's buffers, taken out one page at a time in file order
        let slice_counts: Vec<usize> = pages.iter().map(Vec::len).collect();
        let mut buffers: Vec<Option<&mut PageSegmentsMut<'_>>> = pages.iter_mut().map(Some).collect();
        let mut ops: Vec<Op<'_>> = Vec::new();
        // the pages of each operation
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut last: Option<(u32, bool, u64)> = None;
        for &(segment, offset, page, direct) in &reads {
            let Some(file) = handles.get(&(segment, direct)) else { continue };
            let Some(segments) = buffers[page].take() else { continue };
            let slices = segments.iter_mut().map(|segment| IoSliceMut::new(segment));
            let joins = last == Some((segment, direct, offset))
                && members.last().is_some_and(|pages| pages.len() * page_bytes < READ_SPLIT_BYTES)
                && matches!(ops.last(), Some(Op::Read { buffers, .. }) if buffers.len() + slices.len() <= MAX_BUFFERS);
            if joins {
                if let Some(Op::Read { buffers, .. }) = ops.last_mut() {
                    buffers.extend(slices);
                }
                members.last_mut().expect("an operation per member list").push(page);
            } else {
                ops.push(Op::Read { file, offset, buffers: slices.collect() });
                members.push(vec![page]);
            }
            last = Some((segment, direct, offset + page_bytes as u64));
            if direct {
                self.direct_pages.fetch_add(1, Ordering::Relaxed);
            }
        }
        // each page read is checked against the checksum its record gave, as its operation completes (while the
        // others are still being read)
        let mut intact: Vec<Option<bool>> = vec![None; keys.len()];
        let check = |done: &[usize], ops: &[Op<'_>]| {
            // each completed page: (page, where its segments start in `slices`)
            let mut slices: Vec<&[u8]> = Vec::new();
            let mut work: Vec<(usize, usize)> = Vec::new();
            for &op in done {
                let Op::Read { buffers, .. } = &ops[op] else { continue };
                let mut start = slices.len();
                for &page in &members[op] {
                    work.push((page, start));
                    start += slice_counts[page];
                }
                slices.extend(buffers.iter().map(|slice| &**slice));
            }
            let verdict = |&(page, start): &(usize, usize)| {
                let (_, _, checksum, _) = found[page].expect("a page read was found");
                let segments = &slices[start..start + slice_counts[page]];
                (page, record::page_checksum(&self.settings.digest, &keys[page], segments) == checksum)
            };
            let verdicts = checksums_on(pool, &work, page_bytes, verdict);
            for (page, whole) in verdicts {
                intact[page] = Some(whole);
            }
        };
        let advise = |fetch: bool| {
            if let Some(windows) = &self.windows {
                // (what the walk passed is dropped once its pages are copied out, so its buffers are kept for reuse)
                for (segment, plan) in &plans {
                    if let (true, Some((from, to)), Some(file)) = (fetch, plan.fetch, handles.get(&(*segment, true))) {
                        windows.fetch(*segment, file.clone(), from, to);
                    }
                }
                return;
            }
            for (segment, plan) in &plans {
                let range = if fetch { plan.fetch } else { plan.release };
                let file = handles.get(&(*segment, false)).or_else(|| handles.get(&(*segment, true)));
                if let (Some((from, to)), Some(file)) = (range, file) {
                    let advice = if fetch { rustix::fs::Advice::WillNeed } else { rustix::fs::Advice::DontNeed };
                    // advice only: the kernel may take it or not
                    let _ = rustix::fs::fadvise(&**file, from, std::num::NonZeroU64::new(to - from), advice);
                }
            }
        };
        // the window ahead is asked for once this batch's reads are queued before it
        let results = self.submitter.run_with(&mut ops, pool, || advise(true), check);
        advise(false);
        drop(ops);
        // pages served from windows are copied out and checked
        let mut copies: Vec<(usize, &mut PageSegmentsMut<'_>, Served)> = served
            .into_iter()
            .filter_map(|(page, bytes)| buffers[page].take().map(|segments| (page, segments, bytes)))
            .collect();
        // each page is checked in the window, then copied out of it (from the cache the check brought it into); a
        // page failing its checksum is not copied
        let copy_out = |(page, segments, bytes): &mut (usize, &mut PageSegmentsMut<'_>, Served)| {
            let source = bytes.page(page_bytes);
            let (_, _, checksum, _) = found[*page].expect("a page served was found");
            let whole = record::page_checksum(&self.settings.digest, &keys[*page], &[source]) == checksum;
            if whole {
                scatter(segments, source);
            }
            (*page, whole)
        };
        // (on the caller's thread: handing a 512 KiB batch's copies to the pool gained nothing on two cores)
        for (page, whole) in copies.iter_mut().map(copy_out) {
            intact[page] = Some(whole);
        }
        drop(copies);
        if let Some(windows) = &self.windows {
            for (segment, plan) in &plans {
                if let Some((from, to)) = plan.release {
                    windows.release(*segment, from, to);
                }
            }
        }
        drop(buffers);
        for (result, pages_of) in results.into_iter().zip(&members) {
            if let Err(error) = result {
                for &page in pages_of {
                    outcomes[page] = Some(GetOutcome::Failed(if error.kind() == std::io::ErrorKind::UnexpectedEof {
                        failure(
                            FailureKind::Corrupt,
                            format!("{}: the segment ends inside the page (torn)", self.dir.display()),
                        )
                    } else {
                        PageFailure::caused(
                            FailureKind::Io,
                            format!("{}: {error}", self.dir.display()),
                            std::io::Error::new(error.kind(), error.to_string()),
                        )
                    }));
                }
            }
        }
        let checked: Vec<(usize, bool)> =
            intact.iter().enumerate().filter_map(|(page, intact)| intact.map(|intact| (page, intact))).collect();
        let mut index = None;
        for (page, intact) in checked {
            if intact {
                outcomes[page] = Some(GetOutcome::Hit);
                continue;
            }
            outcomes[page] = Some(GetOutcome::Failed(failure(
                FailureKind::Corrupt,
                format!("{}: page {} failed its checksum (torn or damaged)", self.dir.display(), keys[page]),
            )));
        }
        for (page, outcome) in outcomes.iter().enumerate() {
            let Some((_, _, _, stamp)) = found[page] else { continue };
            let index = index.get_or_insert_with(|| self.write_index());
            match outcome {
                Some(GetOutcome::Hit) => {
                    if let Some(Slot::Page { read, stamp: held, .. }) = index.keys.get_mut(&keys[page])
                        && *held == stamp
                    {
                        *read = true;
                    }
                }
                // a torn or damaged page is as good as absent
                Some(GetOutcome::Failed(PageFailure { kind: FailureKind::Corrupt, .. }) | GetOutcome::Miss) => {
                    index.forget(&keys[page], stamp)
                }
                _ => {}
            }
        }
        outcomes.into_iter().map(|outcome| outcome.expect("every page has an outcome")).collect()
    }

    /// Takes out of `reads` the pages that a window read ahead holds (waiting up to [`window::WAIT`] for one still
    /// being read), with their bytes.
    fn serve_from_windows(
        &self,
        reads: &mut Vec<(u32, u64, usize, bool)>,
        handles: &FxHashMap<(u32, bool), Arc<File>>,
        page_bytes: usize,
    ) -> Vec<(usize, Served)> {
        let Some(windows) = &self.windows else { return Vec::new() };
        let deadline = std::time::Instant::now() + window::WAIT;
        let mut served = Vec::new();
        // the window of the page before: a batch's pages mostly share one
        let mut last: Option<Arc<window::Window>> = None;
        reads.retain(|&(segment, offset, page, _)| {
            let Some(file) = handles.get(&(segment, true)) else { return true };
            let window = match last.as_ref().filter(|window| window.holds(segment, file, offset, page_bytes as u64)) {
                Some(window) => window.clone(),
                None => match windows.find(segment, file, offset, page_bytes as u64) {
                    Some(window) => window,
                    None => return true,
                },
            };
            let bytes = Windows::serve(&window, offset, page_bytes, deadline);
            last = Some(window);
            match bytes {
                Some(bytes) => {
                    served.push((page, bytes));
                    false
                }
                None => true,
            }
        });
        self.direct_pages.fetch_add(served.len() as u64, Ordering::Relaxed);
        self.read_ahead_pages.fetch_add(served.len() as u64, Ordering::Relaxed);
        served
    }

    /// Whether a page's segments can go to the disk with `O_DIRECT`.
    fn direct_fits<S: AsRef<[u8]>>(&self, page: &[S]) -> bool {
        self.settings.direct_io
            && self.settings.page_bytes.is_multiple_of(ALIGN)
            && page.iter().all(|segment| {
                let segment = segment.as_ref();
                segment.as_ptr().align_offset(ALIGN) == 0 && segment.len().is_multiple_of(ALIGN)
            })
    }

    /// Writes the pages not held yet; a key repeated in the batch is written once.
    pub(crate) fn set(
        &self,
        keys: &[PageKey],
        pages: &[PageSegments<'_>],
        pool: &rayon::ThreadPool,
    ) -> Vec<SetOutcome> {
        let mut outcomes: Vec<Option<SetOutcome>> = vec![None; keys.len()];
        {
            let index = self.read_index();
            let mut seen = rustc_hash::FxHashSet::default();
            for (page, key) in keys.iter().enumerate() {
                let length = segments_len(&pages[page]);
                if length != self.settings.page_bytes {
                    outcomes[page] = Some(SetOutcome::Failed(size_mismatch(length, self.settings.page_bytes)));
                } else if self.pending(key) || index.page(key).is_some() || !seen.insert(*key) {
                    outcomes[page] = Some(SetOutcome::AlreadyPresent);
                }
            }
        }
        let todo: Vec<usize> = (0..keys.len()).filter(|&page| outcomes[page].is_none()).collect();
        // records of at most MAX_ENTRIES pages
        for chunk in todo.chunks(record::MAX_ENTRIES) {
            let result = self.append_pages(keys, pages, chunk, pool);
            for &page in chunk {
                outcomes[page] = Some(match &result {
                    Ok(()) => SetOutcome::Stored,
                    Err(error) => SetOutcome::Failed(PageFailure::caused(
                        FailureKind::Io,
                        format!("{}: {error}", self.dir.display()),
                        std::io::Error::new(error.kind(), error.to_string()),
                    )),
                });
            }
        }
        outcomes.into_iter().map(|outcome| outcome.expect("every page has an outcome")).collect()
    }

    /// Appends one record of the pages `chunk` names and takes it into the index.
    fn append_pages(
        &self,
        keys: &[PageKey],
        pages: &[PageSegments<'_>],
        chunk: &[usize],
        pool: &rayon::ThreadPool,
    ) -> std::io::Result<()> {
        let page_bytes = self.settings.page_bytes;
        // a direct writer keeps every batch on a block boundary; others pack them
        let aligned = self.settings.direct_io && page_bytes.is_multiple_of(ALIGN);
        let data_bytes = record::data_bytes(Kind::Pages, chunk.len(), page_bytes, aligned) as u64;
        if let Some(behind) = self.behind.get().filter(|behind| behind.takes(data_bytes)) {
            return self.append_behind(behind, keys, pages, chunk, pool);
        }
        let direct = chunk.iter().all(|&page| self.direct_fits(&pages[page]));
        let (writer, offset) = self.reserve(data_bytes, record::header_len(chunk.len()) as u64, false, pool)?;
        let file = if direct { writer.direct.as_ref().unwrap_or(&writer.buffered) } else { &writer.buffered };
        let direct = direct && writer.direct.is_some();
        // the pages, split where an operation would take too many buffers or bytes
        let mut ops = Vec::new();
        let mut at = offset;
        let mut buffers: Vec<IoSlice<'_>> = Vec::new();
        let mut start = at;
        let split = self.settings.write_split;
        for &page in chunk {
            let full = buffers.len() + pages[page].len() > MAX_BUFFERS - 1
                || (split > 0 && at - start + page_bytes as u64 > split);
            if full && !buffers.is_empty() {
                ops.push(Op::Write { file, offset: start, buffers: std::mem::take(&mut buffers) });
                start = at;
            }
            buffers.extend(pages[page].iter().map(|segment| IoSlice::new(segment)));
            at += page_bytes as u64;
        }
        let padding = (offset + data_bytes - at) as usize;
        if padding > 0 {
            buffers.push(IoSlice::new(&ZEROS.0[..padding]));
        }
        ops.push(Op::Write { file, offset: start, buffers });
        // the checksums are computed while the pages are written
        let mut entries = Vec::new();
        let checksums = || {
            let checksum =
                |&page: &usize| (keys[page], record::page_checksum(&self.settings.digest, &keys[page], &pages[page]));
            entries = checksums_on(pool, chunk, page_bytes, checksum);
            // the index grows (rehashing every key, now and then) while the pages are written, not after
            self.write_index().keys.reserve(chunk.len());
        };
        let written = self
            .submitter
            .run_with(&mut ops, pool, checksums, |_, _| {})
            .into_iter()
            .collect::<std::io::Result<Vec<()>>>();
        drop(ops);
        // then the record that names them
        let header = self.header(Kind::Pages, entries, offset, data_bytes);
        let written = written.and_then(|_| self.append_record(&writer, &header));
        if let Err(error) = written {
            // later batches go to a new segment
            self.retire(writer.id);
            return Err(error);
        }
        if direct {
            self.direct_pages.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        self.write_index().apply(writer.id, &header);
        Ok(())
    }

    /// [`Self::append_pages`] written behind: the pages are copied into a batch of the store's and handed to its
    /// writing threads (`behind.rs`).
    fn append_behind(
        &self,
        behind: &Behind,
        keys: &[PageKey],
        pages: &[PageSegments<'_>],
        chunk: &[usize],
        pool: &rayon::ThreadPool,
    ) -> std::io::Result<()> {
        let page_bytes = self.settings.page_bytes;
        // the batch's own buffer is block-aligned: with `O_DIRECT`, every batch is written directly
        let aligned = self.settings.direct_io && page_bytes.is_multiple_of(ALIGN);
        let data_bytes = record::data_bytes(Kind::Pages, chunk.len(), page_bytes, aligned);
        let admitted = behind.admit(data_bytes as u64)?;
        let mut buffer = behind.buffer(data_bytes.div_ceil(ALIGN));
        {
            let bytes = bytemuck::cast_slice_mut::<Block, u8>(&mut buffer);
            let mut at = 0;
            for &page in chunk {
                for segment in &pages[page] {
                    bytes[at..at + segment.len()].copy_from_slice(segment);
                    at += segment.len();
                }
            }
            // a batch's padding is zeros, as in place
            bytes[at..data_bytes].fill(0);
        }
        let copied = bytemuck::cast_slice::<Block, u8>(&buffer);
        let checksum = |&(index, page): &(usize, usize)| {
            let bytes = &copied[index * page_bytes..(index + 1) * page_bytes];
            (keys[page], record::page_checksum(&self.settings.digest, &keys[page], &[bytes]))
        };
        let numbered: Vec<(usize, usize)> = chunk.iter().copied().enumerate().collect();
        let entries = checksums_on(pool, &numbered, page_bytes, checksum);
        let (writer, offset) = self.reserve(data_bytes as u64, record::header_len(chunk.len()) as u64, true, pool)?;
        let header = self.header(Kind::Pages, entries, offset, data_bytes as u64);
        behind.send(admitted, Flight { buffer, header, writer })
    }

    /// Writes batches written behind that follow each other in one segment (`flights`, in the order of their
    /// places): their pages in one write, then their records, then takes them into the index (before their pages
    /// stop being pending, so a reader that looks among the pending pages first always finds them somewhere).
    fn write_flights(&self, flights: &[Arc<Flight>]) -> std::io::Result<()> {
        let Some(first) = flights.first() else { return Ok(()) };
        let writer = &first.writer;
        debug_assert!(
            flights.windows(2).all(|pair| pair[1].follows(&pair[0])),
            "batches written together that do not follow each other"
        );
        // (a batch packed off block boundaries, of pages that are not whole blocks, goes through the page cache)
        let aligned = |bytes: u64| bytes.is_multiple_of(ALIGN as u64);
        let direct = writer.direct.is_some()
            && self.settings.direct_io
            && flights.iter().all(|flight| aligned(flight.header.data_at) && aligned(flight.header.data_bytes));
        let file = if direct { writer.direct.as_ref().unwrap_or(&writer.buffered) } else { &writer.buffered };
        let buffers = flights.iter().map(|flight| IoSlice::new(flight.data())).collect();
        let mut op = Op::Write { file, offset: first.header.data_at, buffers };
        let written = self
            .submitter
            .run_one(&mut op)
            .and_then(|()| flights.iter().try_for_each(|flight| self.append_record(writer, &flight.header)));
        if let Err(error) = written {
            self.retire(writer.id);
            return Err(error);
        }
        if direct {
            self.direct_pages.fetch_add(behind::pages_of(flights) as u64, Ordering::Relaxed);
        }
        let mut index = self.write_index();
        for flight in flights {
            index.apply(writer.id, &flight.header);
        }
        Ok(())
    }

    /// A header for `entries`, stamped now.
    fn header(&self, kind: Kind, entries: Vec<(PageKey, u64)>, data_at: u64, data_bytes: u64) -> Header {
        Header {
            kind,
            page_bytes: self.settings.page_bytes as u64,
            data_at,
            data_bytes,
            stamp: self.next_stamp(),
            entries,
        }
    }

    /// Appends a record to the index file of the writer's segment.
    fn append_record(&self, writer: &WriterHandle, header: &Header) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        let mut bytes = vec![0u8; record::header_len(header.entries.len())];
        record::encode(&self.settings.digest, header, &mut bytes);
        let mut records = writer.records.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (file, end) = &mut *records;
        file.write_all_at(&bytes, *end)?;
        *end += bytes.len() as u64;
        Ok(())
    }

    /// Reserves `data_bytes` at the end of this process's segment's data file (starting a new segment when it is
    /// full, removed, or there is none), after making room for them and a record of `record_bytes` under the
    /// capacity; for a batch written `behind`.
    fn reserve(
        &self,
        data_bytes: u64,
        record_bytes: u64,
        behind: bool,
        pool: &rayon::ThreadPool,
    ) -> std::io::Result<(WriterHandle, u64)> {
        self.make_room(data_bytes + record_bytes, pool)?;
        let mut writer = self.writer.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let usable = match writer.as_ref() {
            Some(current) => {
                let full = current.end > 0 && current.end + data_bytes > self.settings.segment_bytes;
                // removed by another process's eviction or clear: appends would go nowhere
                let removed = current.files.buffered.metadata().map_or(true, |metadata| metadata.nlink() == 0);
                !(full || removed)
            }
            None => false,
        };
        if !usable {
            *writer = Some(self.new_segment()?);
        }
        let current = writer.as_mut().expect("a writer");
        let offset = current.end;
        current.end += data_bytes;
        if current.files.direct.is_some() && self.settings.preallocate > 0 && current.end > current.allocated {
            // a direct write that makes the file longer waits for the file system to allocate and to record the
            // length: the data file is allocated ahead instead, a step at a time (measured 1.3-1.7x faster for
            // 512 KiB batches on ext4); a file system that cannot allocate ahead just takes the slower writes
            let target =
                current.end.max((current.allocated + self.settings.preallocate).min(self.settings.segment_bytes));
            if rustix::fs::fallocate(&*current.files.buffered, rustix::fs::FallocateFlags::empty(), 0, target).is_ok() {
                current.allocated = target;
            }
        }
        if behind && self.settings.capacity_bytes.is_some() && current.end > current.allocated {
            // a batch written behind counts in its data file's length from now on, not from its write: a recount of
            // the segments (by any process, after an eviction) sees it while it is pending, so the capacity is passed
            // by no more than the batches being written in place at that moment
            current.files.buffered.set_len(current.end)?;
            current.allocated = current.end;
        }
        Ok((current.files.clone(), offset))
    }

    /// Stops appending to segment `id` (after a failed write).
    fn retire(&self, id: u32) {
        let mut writer = self.writer.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if writer.as_ref().is_some_and(|current| current.files.id == id) {
            *writer = None;
        }
    }

    /// Creates a segment for this process to append to: its data file, then its index file.
    fn new_segment(&self) -> std::io::Result<Writer> {
        let name = format!("{:020}-{:016x}", self.next_stamp(), self.writer_tag);
        let path = self.dir.join(format!("{name}{DATA}"));
        let open = |path: &PathBuf, direct: bool| {
            let mut options = OpenOptions::new();
            options.read(true).write(true);
            if direct {
                options.custom_flags(libc::O_DIRECT);
            } else {
                options.create_new(true);
            }
            options.open(path)
        };
        let buffered = match open(&path, false) {
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                crate::page_file::make_dirs_below(&self.settings.base, &self.dir)?;
                open(&path, false)?
            }
            opened => opened?,
        };
        let records = open(&self.dir.join(format!("{name}{RECORDS}")), false)?;
        let direct = if self.settings.direct_io && self.settings.page_bytes.is_multiple_of(ALIGN) {
            Some(Arc::new(open(&path, true)?))
        } else {
            None
        };
        let buffered = Arc::new(buffered);
        let segment = Segment::new(name, path, true);
        let _ = segment.buffered.set(buffered.clone());
        if let Some(direct) = &direct {
            let _ = segment.direct.set(direct.clone());
        }
        let id = self.write_index().add_segment(segment);
        let files = WriterHandle { id, buffered, direct, records: Arc::new(Mutex::new((records, 0))) };
        Ok(Writer { files, end: 0, allocated: 0 })
    }

    /// Under the capacity, makes room for `bytes` more: when the segments would pass it, removes whole segments,
    /// oldest first, down to 90% of it, then writes again the pages of theirs this process read (compaction: the
    /// pages in use outlive their segment, the others go with it).
    fn make_room(&self, bytes: u64, pool: &rayon::ThreadPool) -> std::io::Result<()> {
        let (Some(capacity), Some(account)) = (self.settings.capacity_bytes, &self.account) else { return Ok(()) };
        let mut kept = Vec::new();
        {
            // the file lock excludes other processes; this one, the threads of this process (which share the lock)
            let _threads = self.accounting.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let locked = account.lock()?;
            let mut total = match locked.bytes()? {
                Some(total) => total,
                None => self.disk_bytes()?,
            };
            if total + bytes > capacity {
                let (listed, orphans) = self.list_segments()?;
                for orphan in orphans {
                    self.remove_segment(&orphan)?;
                }
                total = listed.iter().map(|(_, data, records)| data + records).sum();
                let low = (capacity - capacity / 10).max(bytes);
                let mut victims = Vec::new();
                for (name, data, records) in listed {
                    if total + bytes <= low {
                        break;
                    }
                    // under the account's lock, so no other process counts a segment removed here; a reader that
                    // has the file open keeps reading it
                    self.remove_segment(&name)?;
                    total -= data + records;
                    victims.push(name);
                }
                self.evicted.fetch_add(victims.len() as u64, Ordering::Relaxed);
                if !victims.is_empty() {
                    // other processes let go of the removed files (their disk space is freed once none has them open)
                    self.changes.raise()?;
                }
                let mut index = self.write_index();
                for name in victims {
                    let Some(&id) = index.by_name.get(&name) else { continue };
                    let hot: Vec<(PageKey, u64, u64)> = index
                        .keys
                        .iter()
                        .filter_map(|(key, slot)| match *slot {
                            Slot::Page { segment, offset, checksum, read: true, .. } if segment == id => {
                                Some((*key, offset, checksum))
                            }
                            _ => None,
                        })
                        .collect();
                    if let Some(segment) = index.drop_segment(id)
                        && !hot.is_empty()
                    {
                        kept.push((segment, hot));
                    }
                }
            }
            locked.set(total + bytes)?;
        }
        for (segment, hot) in kept {
            self.compact(&segment, &hot, pool);
        }
        Ok(())
    }

    /// Writes again the pages `hot` (key, offset, checksum) of a removed segment, read through the handle this
    /// process still holds; a page that cannot be read whole is left to go.
    fn compact(&self, segment: &Segment, hot: &[(PageKey, u64, u64)], pool: &rayon::ThreadPool) {
        let Some(file) = segment.buffered.get().or_else(|| segment.direct.get()).cloned() else { return };
        let page_bytes = self.settings.page_bytes;
        for chunk in hot.chunks(128) {
            let mut blocks = aligned_buffer(chunk.len() * page_bytes);
            let bytes = &mut bytemuck::cast_slice_mut::<Block, u8>(&mut blocks)[..chunk.len() * page_bytes];
            let mut keys = Vec::new();
            let mut offsets = Vec::new();
            for (slot, (key, offset, checksum)) in chunk.iter().enumerate() {
                let page = &mut bytes[slot * page_bytes..(slot + 1) * page_bytes];
                let whole = read_at_most(&file, page, *offset).is_ok_and(|read| read == page_bytes)
                    && record::page_checksum(&self.settings.digest, key, &[&*page]) == *checksum;
                if whole {
                    keys.push(*key);
                    offsets.push(slot * page_bytes);
                }
            }
            let pages: Vec<PageSegments<'_>> =
                offsets.iter().map(|&offset| vec![&bytes[offset..offset + page_bytes]]).collect();
            let stored = self.set(&keys, &pages, pool);
            self.compacted.fetch_add(
                stored.iter().filter(|outcome| **outcome == SetOutcome::Stored).count() as u64,
                Ordering::Relaxed,
            );
        }
    }

    /// Removes `keys` for every process: a record of them is appended. Returns how many were held.
    pub(crate) fn remove(&self, keys: &[PageKey], pool: &rayon::ThreadPool) -> std::io::Result<usize> {
        // (after the pages written behind, which it may name)
        self.flush()?;
        self.catch_up(false)?;
        let held_now = |index: &Index| {
            let mut seen = rustc_hash::FxHashSet::default();
            keys.iter().filter(|key| index.page(key).is_some() && seen.insert(**key)).copied().collect::<Vec<_>>()
        };
        let mut held = held_now(&self.read_index());
        if held.len() < keys.len() {
            // pages another process wrote since this one last looked are removed too
            self.refresh()?;
            held = held_now(&self.read_index());
        }
        for chunk in held.chunks(record::MAX_ENTRIES) {
            let (writer, _) = self.reserve(0, record::header_len(chunk.len()) as u64, false, pool)?;
            let header = self.header(Kind::Removals, chunk.iter().map(|key| (*key, 0)).collect(), 0, 0);
            if let Err(error) = self.append_record(&writer, &header) {
                self.retire(writer.id);
                return Err(error);
            }
            self.write_index().apply(writer.id, &header);
        }
        if !held.is_empty() {
            self.changes.raise()?;
        }
        Ok(held.len())
    }

    /// Removes every segment of the namespace; returns how many pages they held.
    pub(crate) fn clear(&self) -> std::io::Result<u64> {
        self.flush()?;
        self.refresh()?;
        let mut writer = self.writer.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let pages = self.read_index().live_pages() as u64;
        let (listed, orphans) = self.list_segments()?;
        for name in listed.into_iter().map(|(name, _, _)| name).chain(orphans) {
            self.remove_segment(&name)?;
        }
        *writer = None;
        *self.write_index() = Index::default();
        let _ = std::fs::remove_dir(&self.dir);
        self.changes.raise()?;
        if let Some(account) = &self.account {
            let locked = account.lock()?;
            locked.set(self.disk_bytes()?)?;
        }
        Ok(pages)
    }

    /// The pages held.
    pub(crate) fn list(&self) -> std::io::Result<Vec<(PageKey, u64)>> {
        self.flush()?;
        self.refresh()?;
        let index = self.read_index();
        Ok(index
            .keys
            .iter()
            .filter_map(|(key, slot)| {
                matches!(slot, Slot::Page { .. }).then_some((*key, self.settings.page_bytes as u64))
            })
            .collect())
    }
}

impl Drop for SegmentStore {
    fn drop(&mut self) {
        // (the backend flushed before it let go of the store; a batch still queued is dropped by its thread, and the
        // threads are joined as `behind_threads` is dropped)
        if let Some(behind) = self.behind.get() {
            behind.close();
        }
        // the data file's unused allocated tail goes back
        let writer = self.writer.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(writer) = writer
            && writer.allocated > writer.end
        {
            let _ = writer.files.buffered.set_len(writer.end);
        }
    }
}

/// The writer's segment as one append holds it.
#[derive(Clone, Debug)]
struct WriterHandle {
    id: u32,
    buffered: Arc<File>,
    direct: Option<Arc<File>>,
    /// The index file, and where its next record goes (records are appended under its lock, so the file has no
    /// gaps).
    records: Arc<Mutex<(File, u64)>>,
}

/// A count in a small file, raised under a file lock by every removal, clear and eviction; read with one `pread`.
#[derive(Debug)]
struct Changes {
    path: PathBuf,
    /// The storage directory, below which the file's folder may be made.
    base: PathBuf,
    /// Opened for writing (not for a read-only backend).
    writable: bool,
    file: OnceLock<File>,
}

impl Changes {
    fn new((path, base, writable): (PathBuf, PathBuf, bool)) -> Self {
        Self { path, base, writable, file: OnceLock::new() }
    }

    /// The file, opened (and with `create`, made) on first use; `None` while it does not exist.
    fn file(&self, create: bool) -> std::io::Result<Option<&File>> {
        if let Some(file) = self.file.get() {
            return Ok(Some(file));
        }
        let create = create && self.writable;
        let open =
            || OpenOptions::new().read(true).write(self.writable).create(create).truncate(false).open(&self.path);
        let file = match open() {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound && create => {
                if let Some(parent) = self.path.parent() {
                    crate::page_file::make_dirs_below(&self.base, parent)?;
                }
                open()?
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(error),
        };
        Ok(Some(self.file.get_or_init(|| file)))
    }

    /// The count (0 before the first change; a read that fails counts as a change, so the caller looks again).
    fn read(&self) -> u64 {
        let mut bytes = [0u8; 8];
        match self.file(false) {
            Ok(Some(file)) => match read_at_most(file, &mut bytes, 0) {
                Ok(8) => u64::from_le_bytes(bytes),
                Ok(_) => 0,
                Err(_) => rand::random(),
            },
            Ok(None) => 0,
            Err(_) => rand::random(),
        }
    }

    /// Raises the count.
    fn raise(&self) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        let Some(file) = self.file(true)? else { return Ok(()) };
        file.lock()?;
        let mut bytes = [0u8; 8];
        let result = read_at_most(file, &mut bytes, 0).and_then(|read| {
            let count = if read == 8 { u64::from_le_bytes(bytes) } else { 0 };
            file.write_all_at(&(count + 1).to_le_bytes(), 0)
        });
        let _ = file.unlock();
        result
    }
}

/// `checksum` of each of `items` (one page of `page_bytes` each), on the backend's I/O threads when there are
/// enough bytes to be worth handing over.
fn checksums_on<T: Sync, R: Send>(
    pool: &rayon::ThreadPool,
    items: &[T],
    page_bytes: usize,
    checksum: impl Fn(&T) -> R + Sync + Send,
) -> Vec<R> {
    use rayon::prelude::*;
    if items.len() * page_bytes >= PARALLEL_CHECK_BYTES {
        pool.install(|| items.par_iter().map(checksum).collect())
    } else {
        items.iter().map(checksum).collect()
    }
}

/// Reads up to `buffer.len()` bytes at `offset`; fewer only at the end of the file.
fn read_at_most(file: &File, buffer: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt as _;
    let mut done = 0;
    while done < buffer.len() {
        match file.read_at(&mut buffer[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(read) => done += read,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(done)
}
