//! Writing behind: a batch's pages are copied into the store's own memory and written to the segment by threads of
//! the store's, so the caller goes on with its next batch while the disk takes this one.
//!
//! A batch written in place waits for its write, then for its record and index entries, before the next batch starts:
//! one write of a batch in flight at a time. For small pages (a batch of 128 pages of 4 KiB is 512 KiB) the disk then
//! idles between batches. Written behind, two batches are in flight at once and the caller only copies and checksums.
//! Batches that queue up while the disk is busy, one after another in a segment, are joined into one write (joined
//! until it carries [`MAX_JOINED_BYTES`], the last batch joined taking it past): a disk takes a long write faster than
//! the same bytes in many short ones, so the writes grow as the disk falls behind, as a raw stream's would be long.
//!
//! A page written behind is *pending* until its batch's data and record are written and the index holds it. This
//! process finds pending pages at once (reads copy them from the batch's buffer, checked against their checksums as
//! every read is); other processes find them once their record is written. A removal, a clear or a listing first
//! waits for every pending batch ([`Behind::flush`]), so they order after the writes as they would in place. A batch
//! whose write fails is dropped (its pages were reported stored and are then a miss, as an evicted page is), and a
//! process killed before its batches were written loses them: never a torn page, since a record is still written only
//! after its pages.
//!
//! The pending bytes never pass the budget (but for a batch larger than the budget, which goes alone): a batch that
//! would pass it waits (up to [`WAIT`]) for earlier batches, and the room it is admitted to is held for it until it
//! is sent, so callers on several threads do not pass the budget together.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use hicache_core::hash::PageKey;
use rustc_hash::FxHashMap;

use super::io::MAX_BUFFERS;
use super::record::Header;
use super::{Block, SegmentStore, Spare, WriterHandle};
use crate::threads::Threads;

/// Threads writing batches: two batches in flight keep the disk busy while one's record is written.
const WRITERS: usize = 2;
/// Bytes of batches queued one after another past which one write joins no more (the last batch joined may take it
/// past; a disk takes one long write faster than the same bytes in many short ones).
const MAX_JOINED_BYTES: u64 = 16 << 20;
/// The longest a batch waits for room under the budget, and a flush for the batches pending.
pub(crate) const WAIT: Duration = Duration::from_secs(60);

/// A batch written behind: its pages in the store's memory, where they go, and the record that names them.
pub(crate) struct Flight {
    pub(crate) buffer: Vec<Block>,
    pub(crate) header: Header,
    pub(crate) writer: WriterHandle,
}

impl std::fmt::Debug for Flight {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Flight")
            .field("segment", &self.writer.id)
            .field("data_at", &self.header.data_at)
            .field("pages", &self.header.entries.len())
            .finish()
    }
}

impl Flight {
    /// The bytes of the batch's `index`th page.
    pub(crate) fn page(&self, index: usize) -> &[u8] {
        let page_bytes = self.header.page_bytes as usize;
        &bytemuck::cast_slice::<Block, u8>(&self.buffer)[index * page_bytes..(index + 1) * page_bytes]
    }

    /// The data file's bytes it writes.
    pub(crate) fn data(&self) -> &[u8] {
        &bytemuck::cast_slice::<Block, u8>(&self.buffer)[..self.header.data_bytes as usize]
    }

    fn bytes(&self) -> u64 {
        self.header.data_bytes
    }

    /// Whether this batch is written right after `before` in the same segment.
    pub(crate) fn follows(&self, before: &Flight) -> bool {
        self.writer.id == before.writer.id && self.header.data_at == before.header.data_at + before.header.data_bytes
    }
}

/// The pages of `flights`.
pub(crate) fn pages_of(flights: &[Arc<Flight>]) -> usize {
    flights.iter().map(|flight| flight.header.entries.len()).sum()
}

#[derive(Default)]
struct Pending {
    /// Each pending page: its batch and its place in it.
    pages: FxHashMap<PageKey, (Arc<Flight>, usize)>,
    bytes: u64,
    flights: usize,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Pending")
            .field("pages", &self.pages.len())
            .field("bytes", &self.bytes)
            .field("flights", &self.flights)
            .finish()
    }
}

/// The batches pending, and the threads writing them.
#[derive(Debug)]
pub(crate) struct Behind {
    budget: u64,
    pending: Mutex<Pending>,
    /// Raised whenever a batch is done.
    done: Condvar,
    /// Pages pending (read without the lock, to skip the lookups when there are none).
    count: AtomicUsize,
    jobs: Mutex<Option<Sender<Arc<Flight>>>>,
    /// Pages handed to the writing threads so far.
    sent: AtomicU64,
    /// Writes made of them so far (batches queued one after another in a segment are joined).
    writes: AtomicU64,
    /// Buffers of batches written, kept for the next (within the budget).
    spare: Spare,
}

impl Behind {
    /// Writes behind for `store` with at most `budget` bytes pending, on threads started now through `threads`.
    pub(crate) fn start(store: Weak<SegmentStore>, budget: u64, threads: &Threads) -> std::io::Result<Arc<Self>> {
        let (jobs, queue) = channel();
        let behind = Arc::new(Self {
            budget,
            pending: Mutex::new(Pending::default()),
            done: Condvar::new(),
            count: AtomicUsize::new(0),
            jobs: Mutex::new(Some(jobs)),
            sent: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            spare: Spare::default(),
        });
        let queue = Arc::new(Mutex::new(queue));
        for _ in 0..WRITERS {
            let (store, theirs, queue) = (store.clone(), behind.clone(), queue.clone());
            if let Err(error) =
                threads.spawn("hicache-write-behind".into(), move || write_flights(&store, &theirs, &queue))
            {
                // the threads started end, and `threads` joins them when it goes
                behind.close();
                return Err(error);
            }
        }
        Ok(behind)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether a batch of `bytes` is written behind: when two of them fit under the budget. A longer batch is
    /// written in place, as it keeps the disk busy on its own for longer than copying it would save.
    pub(crate) fn takes(&self, bytes: u64) -> bool {
        bytes.saturating_mul(2) <= self.budget
    }

    /// A buffer of at least `blocks` blocks, reused where one is spare (its bytes are a former batch's).
    pub(crate) fn buffer(&self, blocks: usize) -> Vec<Block> {
        self.spare.take(blocks)
    }

    /// Waits (up to [`WAIT`]) until a batch of `bytes` fits under the budget (at once when nothing is pending),
    /// and holds its room, and its place among the batches a flush waits for, until it is sent or given up.
    pub(crate) fn admit(&self, bytes: u64) -> std::io::Result<Admitted<'_>> {
        let deadline = Instant::now() + WAIT;
        let mut pending = self.lock();
        while pending.flights > 0 && pending.bytes + bytes > self.budget {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Err(timed_out("waiting for room among the pages written behind"));
            };
            pending = self.done.wait_timeout(pending, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
        }
        pending.bytes += bytes;
        pending.flights += 1;
        Ok(Admitted { behind: self, bytes, sent: false })
    }

    /// Makes the batch's pages pending and hands it to a writing thread (its room was held by `admitted`, of the
    /// batch's bytes).
    pub(crate) fn send(&self, mut admitted: Admitted<'_>, flight: Flight) -> std::io::Result<()> {
        assert_eq!(admitted.bytes, flight.bytes(), "a batch sent in the room of another size");
        admitted.sent = true;
        let flight = Arc::new(flight);
        {
            let mut pending = self.lock();
            for (index, (key, _)) in flight.header.entries.iter().enumerate() {
                pending.pages.insert(*key, (flight.clone(), index));
            }
            self.count.store(pending.pages.len(), Ordering::Release);
        }
        self.sent.fetch_add(flight.header.entries.len() as u64, Ordering::Relaxed);
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .as_ref()
            .is_some_and(|jobs| jobs.send(flight.clone()).is_ok());
        if !sent {
            self.finish(flight);
            return Err(std::io::Error::other("the threads writing behind have stopped"));
        }
        Ok(())
    }

    /// The batch and place of each of `keys` that is pending (`None` for the others); empty when none is.
    pub(crate) fn find(&self, keys: &[PageKey]) -> Vec<Option<(Arc<Flight>, usize)>> {
        if self.count.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let pending = self.lock();
        keys.iter().map(|key| pending.pages.get(key).cloned()).collect()
    }

    /// Whether `key` is pending.
    pub(crate) fn holds(&self, key: &PageKey) -> bool {
        self.count.load(Ordering::Acquire) > 0 && self.lock().pages.contains_key(key)
    }

    /// Pages handed to the writing threads so far.
    pub(crate) fn pages_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Writes of batches written behind made so far.
    #[cfg(test)]
    pub(crate) fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Waits (up to [`WAIT`]) until no batch is pending.
    pub(crate) fn flush(&self) -> std::io::Result<()> {
        let deadline = Instant::now() + WAIT;
        let mut pending = self.lock();
        while pending.flights > 0 {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return Err(timed_out("waiting for the pages written behind"));
            };
            pending = self.done.wait_timeout(pending, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
        }
        Ok(())
    }

    /// Stops the writing threads once the batches queued are done.
    pub(crate) fn close(&self) {
        self.jobs.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
    }

    /// Ends a batch (written or not): its pages are no longer pending, and its buffer is kept for the next.
    fn finish(&self, flight: Arc<Flight>) {
        let mut pending = self.lock();
        for (key, _) in &flight.header.entries {
            if pending.pages.get(key).is_some_and(|(held, _)| Arc::ptr_eq(held, &flight)) {
                pending.pages.remove(key);
            }
        }
        pending.bytes -= flight.bytes();
        pending.flights -= 1;
        self.count.store(pending.pages.len(), Ordering::Release);
        drop(pending);
        self.spare.keep(Arc::into_inner(flight).map(|flight| flight.buffer), self.budget);
        self.done.notify_all();
    }
}

/// A batch's room under the budget, held from [`Behind::admit`] until the batch is sent; given back if it is not.
pub(crate) struct Admitted<'a> {
    behind: &'a Behind,
    bytes: u64,
    sent: bool,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if self.sent {
            return;
        }
        let mut pending = self.behind.lock();
        pending.bytes -= self.bytes;
        pending.flights -= 1;
        drop(pending);
        self.behind.done.notify_all();
    }
}

fn timed_out(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{what} for {} s", WAIT.as_secs()))
}

fn write_flights(store: &Weak<SegmentStore>, behind: &Behind, queue: &Mutex<Receiver<Arc<Flight>>>) {
    loop {
        let flights = {
            let queue = queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let Ok(first) = queue.recv() else { return };
            // and every batch queued behind it, up to the most one write joins
            let mut flights = vec![first];
            let mut bytes = flights[0].bytes();
            while bytes < MAX_JOINED_BYTES && flights.len() < MAX_BUFFERS {
                let Ok(next) = queue.try_recv() else { break };
                bytes += next.bytes();
                flights.push(next);
            }
            flights
        };
        // each run of batches that follow each other in a segment is written as one write
        let mut flights = flights.into_iter().peekable();
        while let Some(first) = flights.next() {
            let mut run = vec![first];
            while let Some(next) = flights.next_if(|next| next.follows(run.last().expect("a batch"))) {
                run.push(next);
            }
            behind.writes.fetch_add(1, Ordering::Relaxed);
            match store.upgrade() {
                Some(store) => {
                    if let Err(error) = store.write_flights(&run) {
                        tracing::warn!(%error, pages = pages_of(&run),
                                       "batches written behind failed: their pages are not stored");
                    }
                }
                None => tracing::warn!(
                    pages = pages_of(&run),
                    "batches written behind were dropped with their backend: their pages are not stored"
                ),
            }
            run.into_iter().for_each(|flight| behind.finish(flight));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use hicache_core::hash::page_key;
    use hicache_core::storage::{GetOutcome, PageSegments, PageSegmentsMut, SetOutcome};

    use super::super::{SegmentSettings, SegmentStore};

    const PAGE: usize = 4096;

    fn store(dir: &Path, write_behind: u64) -> std::sync::Arc<SegmentStore> {
        SegmentStore::open(SegmentSettings {
            root: dir.join("ns"),
            base: dir.to_path_buf(),
            digest: b"digest".to_vec(),
            page_bytes: PAGE,
            segment_bytes: 64 << 20,
            direct_io: false,
            io_uring: true,
            read_ahead: 0,
            write_behind,
            preallocate: 0,
            write_split: 0,
            read_only: false,
            capacity_bytes: None,
            account: None,
            changes: dir.join(".changes"),
        })
        .unwrap()
    }

    fn pages(first: u32, count: u32) -> (Vec<hicache_core::hash::PageKey>, Vec<Vec<u8>>) {
        let keys = (first..first + count).map(|index| page_key(None, &[index, 0xbe])).collect();
        let pages = (first..first + count).map(|index| vec![index as u8 ^ 0x3c; PAGE]).collect();
        (keys, pages)
    }

    /// Sets `pages` under `keys` in batches of `batch`, each stored whole.
    fn set_all(store: &SegmentStore, keys: &[hicache_core::hash::PageKey], pages: &[Vec<u8>], batch: usize) {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for (keys, pages) in keys.chunks(batch).zip(pages.chunks(batch)) {
            let slices: Vec<PageSegments<'_>> = pages.iter().map(|page| vec![&page[..]]).collect();
            assert!(store.set(keys, &slices, &pool).iter().all(SetOutcome::is_stored));
        }
    }

    fn read(
        store: &SegmentStore,
        keys: &[hicache_core::hash::PageKey],
        pool: &rayon::ThreadPool,
    ) -> (Vec<GetOutcome>, Vec<Vec<u8>>) {
        let mut buffers = vec![vec![0u8; PAGE]; keys.len()];
        let mut segments: Vec<PageSegmentsMut<'_>> = buffers.iter_mut().map(|page| vec![&mut page[..]]).collect();
        let outcomes = store.get(keys, &mut segments, pool);
        drop(segments);
        (outcomes, buffers)
    }

    /// Room under the budget is held from admission until the batch is sent, and given back when it is not; a batch
    /// larger than the budget is admitted when nothing else is pending.
    #[test]
    fn room_is_held_from_admission_and_given_back() {
        let threads = crate::threads::threads();
        let behind = super::Behind::start(std::sync::Weak::new(), 100, &threads).unwrap();
        let held = |behind: &super::Behind| {
            let pending = behind.lock();
            (pending.bytes, pending.flights)
        };
        let first = behind.admit(60).unwrap();
        assert_eq!(held(&behind), (60, 1));
        drop(first);
        assert_eq!(held(&behind), (0, 0));
        behind.flush().unwrap();
        let large = behind.admit(500).unwrap();
        assert_eq!(held(&behind), (500, 1));
        drop(large);
        assert_eq!(held(&behind), (0, 0));
        // its threads end (and `threads` joins them)
        behind.close();
    }

    /// While a batch cannot be written (its index file held here), its pages are pending: the writer reads them from
    /// the batch, counts them as held and does not write them twice; another store does not find them until they
    /// are written, and a flush waits for that.
    #[test]
    fn pages_pending_are_read_from_their_batch() {
        let dir = tempfile::tempdir().unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let writer = store(dir.path(), 1 << 20);
        let other = store(dir.path(), 0);
        let (first_keys, first_pages) = pages(0, 4);
        set_all(&writer, &first_keys, &first_pages, 4);
        writer.flush().unwrap();
        let handle = writer.writer.lock().unwrap().as_ref().unwrap().files.clone();
        let (keys, pages) = pages(4, 6);
        let slices: Vec<PageSegments<'_>> = pages.iter().map(|page| vec![&page[..]]).collect();
        {
            let _records = handle.records.lock().unwrap();
            assert!(writer.set(&keys, &slices, &pool).iter().all(SetOutcome::is_stored));
            let behind = writer.behind.get().unwrap();
            assert!(
                keys.iter().all(|key| behind.holds(key)),
                "the batch is pending while its record cannot be written"
            );
            let (outcomes, buffers) = read(&writer, &keys, &pool);
            assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit), "{outcomes:?}");
            assert!(buffers == pages);
            let (outcomes, buffers) = read(&writer, &[first_keys[1], keys[2]], &pool);
            assert_eq!(outcomes, [GetOutcome::Hit, GetOutcome::Hit]);
            assert!(buffers[0] == first_pages[1] && buffers[1] == pages[2], "written and pending pages in one batch");
            assert_eq!(writer.exists(&keys).unwrap(), keys.len());
            assert!(
                writer
                    .set(&keys[..2], &slices[..2], &pool)
                    .iter()
                    .all(|outcome| *outcome == SetOutcome::AlreadyPresent)
            );
            assert_eq!(other.exists(&keys).unwrap(), 0, "another store finds a page before its record");
        }
        writer.flush().unwrap();
        assert!(!writer.behind.get().unwrap().holds(&keys[0]));
        let (outcomes, buffers) = read(&other, &keys, &pool);
        assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit), "{outcomes:?}");
        assert!(buffers == pages);
        assert_eq!(writer.pages_written_behind(), 10);
    }

    /// Batches queued while the writing threads are held up go to the disk in one write: with both threads held
    /// (each by a batch of its own) while six batches are set, at most three writes are made, whatever the order the
    /// threads took them in, and every page reads back whole in another store.
    #[test]
    fn batches_queued_behind_each_other_are_written_together() {
        let dir = tempfile::tempdir().unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let writer = store(dir.path(), 16 << 20);
        let other = store(dir.path(), 0);
        let (first_keys, first_pages) = pages(0, 1);
        set_all(&writer, &first_keys, &first_pages, 1);
        writer.flush().unwrap();
        let behind = writer.behind.get().unwrap();
        let before = behind.writes();
        let handle = writer.writer.lock().unwrap().as_ref().unwrap().files.clone();
        let (keys, pages) = pages(1, 6 * 5);
        {
            let _records = handle.records.lock().unwrap();
            set_all(&writer, &keys, &pages, 5);
        }
        writer.flush().unwrap();
        let writes = behind.writes() - before;
        assert!((1..=3).contains(&writes), "6 batches queued behind each other took {writes} writes");
        let (outcomes, buffers) = read(&other, &keys, &pool);
        assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit), "{outcomes:?}");
        assert!(buffers == pages);
    }
}
