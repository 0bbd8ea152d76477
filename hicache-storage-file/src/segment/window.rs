//! Windows of segments read ahead into this process's own memory, for a store that reads with `O_DIRECT`.
//!
//! `ahead.rs` decides which ranges of a segment a forward walk will want next; here those ranges are read by two
//! threads of the store's own, with `O_DIRECT`, into buffers of the store's, while the walk's batches go on. A batch
//! whose pages lie in a window that arrived copies them from it (and checks each page's checksum, as any read does),
//! instead of waiting for the disk once per batch. Through the page cache (the kernel's read-ahead, asked for with
//! `fadvise`) the same walk also costs the kernel's page bookkeeping, and it fills the page cache that `O_DIRECT` was
//! chosen to keep out of: on a disk that read 4–9 GB/s, 4 KiB pages read at 3.8–4.5 GB/s (median 4.2) through
//! these windows, 3.5–3.8 (3.7) through the page cache, and 3.3–4.2 (3.6) with no read-ahead (5 runs each).
//!
//! A window is read once and dropped when the walk has passed it, or, oldest first, to make room for another: the
//! windows held never pass a budget of bytes. Its segment's file handle is part of its identity, so a window never
//! serves another file's bytes, and every page it serves is checked against the checksum its record gave. A batch
//! waits for a window still being read for at most [`WAIT`], then reads its pages directly.

use std::fs::File;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::record::ALIGN;
use super::{Block, Spare, read_at_most};
use crate::threads::Threads;

/// Threads reading windows: a walk asks for its next window while the one before may still be read, and two reads
/// in flight keep the disk busy between them.
const READERS: usize = 2;
/// The longest a batch waits for a window being read before it reads its pages itself.
pub(crate) const WAIT: Duration = Duration::from_secs(5);

/// Where a window's read stands.
enum State {
    Reading,
    /// The bytes read from the window's start (fewer than asked only where the file ended).
    Ready(Arc<Vec<Block>>, usize),
    Failed,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            State::Reading => f.write_str("Reading"),
            State::Ready(_, valid) => write!(f, "Ready({valid} bytes)"),
            State::Failed => f.write_str("Failed"),
        }
    }
}

/// A range of a segment read ahead.
#[derive(Debug)]
pub(crate) struct Window {
    segment: u32,
    file: Arc<File>,
    /// The first byte (block-aligned) and the end asked for.
    from: u64,
    to: u64,
    state: Mutex<State>,
    arrived: Condvar,
}

impl Window {
    /// Waits up to `deadline` for the read; the bytes of `[offset, offset + len)` of the segment, if it brought
    /// them.
    fn bytes(&self, deadline: Instant) -> Option<(Arc<Vec<Block>>, usize)> {
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        loop {
            match &*state {
                State::Ready(buffer, valid) => return Some((buffer.clone(), *valid)),
                State::Failed => return None,
                State::Reading => {
                    let left = deadline.checked_duration_since(Instant::now())?;
                    state = self.arrived.wait_timeout(state, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
                }
            }
        }
    }

    /// Whether it is the window of `[offset, offset + len)` of `segment` read through `file`.
    pub(crate) fn holds(&self, segment: u32, file: &Arc<File>, offset: u64, len: u64) -> bool {
        self.segment == segment && Arc::ptr_eq(&self.file, file) && self.from <= offset && offset + len <= self.to
    }

    fn bytes_asked(&self) -> u64 {
        self.to - self.from
    }

    /// Its buffer, when nothing else holds the window or the buffer any more.
    fn into_buffer(self: Arc<Self>) -> Option<Vec<Block>> {
        let window = Arc::into_inner(self)?;
        match window.state.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner()) {
            State::Ready(buffer, _) => Arc::into_inner(buffer),
            State::Reading | State::Failed => None,
        }
    }
}

/// The bytes of one page, served from a window: the buffer and where the page starts in it.
pub(crate) struct Served {
    pub(crate) buffer: Arc<Vec<Block>>,
    pub(crate) start: usize,
}

impl Served {
    pub(crate) fn page(&self, len: usize) -> &[u8] {
        &bytemuck::cast_slice::<Block, u8>(&self.buffer)[self.start..self.start + len]
    }
}

/// The windows held, and the thread that reads them.
#[derive(Debug)]
pub(crate) struct Windows {
    held: Mutex<Vec<Arc<Window>>>,
    budget: u64,
    spare: Arc<Spare>,
    /// The readers' queue; the threads end when this is dropped.
    jobs: Mutex<Option<Sender<Arc<Window>>>>,
    /// The readers, joined once their queue is closed.
    #[expect(dead_code, reason = "held for its Drop, which joins the threads")]
    threads: Threads,
}

impl Windows {
    /// Windows of at most `budget` bytes in all, read by a thread started now.
    pub(crate) fn start(budget: u64) -> std::io::Result<Self> {
        // (made first, so dropped last: should a thread fail to start, the queue closes before the readers started
        // are joined)
        let threads = crate::threads::threads();
        let (jobs, queue) = channel();
        let queue = Arc::new(Mutex::new(queue));
        let spare = Arc::new(Spare::default());
        for _ in 0..READERS {
            let (queue, spare) = (queue.clone(), spare.clone());
            threads.spawn("hicache-read-ahead".into(), move || read_windows(&queue, &spare))?;
        }
        Ok(Self { held: Mutex::new(Vec::new()), budget, spare, jobs: Mutex::new(Some(jobs)), threads })
    }

    /// Reads `[from, to)` of `segment` (through `file`, opened with `O_DIRECT`) ahead, unless that would pass the
    /// budget.
    pub(crate) fn fetch(&self, segment: u32, file: Arc<File>, from: u64, to: u64) {
        let from = from - from % ALIGN as u64;
        if to <= from {
            return;
        }
        let asked = to - from;
        if asked > self.budget {
            return;
        }
        let mut held = self.held.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // the oldest go first: a walk that stopped half way, or whose segment is gone, never releases its window
        let mut in_use: u64 = held.iter().map(|window| window.bytes_asked()).sum();
        let mut dropped = 0;
        while in_use + asked > self.budget && dropped < held.len() {
            in_use -= held[dropped].bytes_asked();
            dropped += 1;
        }
        self.spare.keep(held.drain(..dropped).filter_map(Window::into_buffer), self.budget);
        let window =
            Arc::new(Window { segment, file, from, to, state: Mutex::new(State::Reading), arrived: Condvar::new() });
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .as_ref()
            .is_some_and(|jobs| jobs.send(window.clone()).is_ok());
        if sent {
            held.push(window);
        }
    }

    /// The window holding `[offset, offset + len)` of `segment` read through `file`, if one does.
    pub(crate) fn find(&self, segment: u32, file: &Arc<File>, offset: u64, len: u64) -> Option<Arc<Window>> {
        let held = self.held.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        held.iter().find(|window| window.holds(segment, file, offset, len)).cloned()
    }

    /// The bytes of `[offset, offset + len)` from `window`, waiting for its read up to `deadline`; `None` when the
    /// read failed, came short of the page, or is still running at the deadline.
    pub(crate) fn serve(window: &Window, offset: u64, len: usize, deadline: Instant) -> Option<Served> {
        let (buffer, valid) = window.bytes(deadline)?;
        let start = (offset - window.from) as usize;
        (start + len <= valid).then_some(Served { buffer, start })
    }

    /// Drops the windows of `segment` that lie inside `[from, to)`.
    pub(crate) fn release(&self, segment: u32, from: u64, to: u64) {
        let mut held = self.held.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (gone, kept) = std::mem::take(&mut *held)
            .into_iter()
            .partition(|window| window.segment == segment && from <= window.from && window.to <= to);
        *held = kept;
        drop(held);
        self.spare.keep(gone.into_iter().filter_map(Window::into_buffer), self.budget);
    }

    /// Bytes of the windows held.
    #[cfg(test)]
    pub(crate) fn held_bytes(&self) -> u64 {
        self.held.lock().unwrap().iter().map(|window| window.bytes_asked()).sum()
    }
}

impl Drop for Windows {
    fn drop(&mut self) {
        // the readers end once their queue is empty and closed (and are joined as `threads` is dropped)
        self.jobs.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
    }
}

fn read_windows(queue: &Mutex<Receiver<Arc<Window>>>, spare: &Spare) {
    loop {
        let next = queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).recv();
        let Ok(window) = next else { return };
        let len = (window.to - window.from) as usize;
        let asked = len.next_multiple_of(ALIGN);
        let mut buffer = spare.take(asked / ALIGN);
        let bytes = bytemuck::cast_slice_mut::<Block, u8>(&mut buffer);
        let state = match read_at_most(&window.file, &mut bytes[..asked], window.from) {
            Ok(read) => State::Ready(Arc::new(buffer), read.min(len)),
            Err(error) => {
                let segment = window.segment;
                tracing::debug!(%error, segment, "reading a segment ahead failed; its pages are read when asked");
                State::Failed
            }
        };
        *window.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = state;
        window.arrived.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    const BLOCK: u64 = ALIGN as u64;

    /// A file of `blocks` blocks, each filled with its number.
    fn file(blocks: u64) -> (tempfile::NamedTempFile, Arc<File>) {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        for block in 0..blocks {
            file.write_all(&[block as u8; ALIGN]).unwrap();
        }
        let reader = Arc::new(File::open(file.path()).unwrap());
        (file, reader)
    }

    fn deadline() -> Instant {
        Instant::now() + WAIT
    }

    /// A window serves the file's own bytes at any offset inside it, never past the end of the file, and only
    /// through the handle it was read with.
    #[test]
    fn a_window_serves_the_bytes_it_read() {
        let (_file, reader) = file(6);
        let windows = Windows::start(1 << 20).unwrap();
        // asked from inside a block: the window starts at the block
        windows.fetch(3, reader.clone(), BLOCK + 100, 8 * BLOCK);
        let window = windows.find(3, &reader, 2 * BLOCK, BLOCK).expect("a window holds block 2");
        for block in 1..6u64 {
            let served = Windows::serve(&window, block * BLOCK + 8, 100, deadline()).expect("inside the file");
            assert!(served.page(100).iter().all(|&byte| byte == block as u8), "block {block}");
        }
        // the file ends at 6 blocks: a page past it is not served
        assert!(Windows::serve(&window, 6 * BLOCK, 16, deadline()).is_none());
        assert!(Windows::serve(&window, 6 * BLOCK - 8, 16, deadline()).is_none());
        assert!(windows.find(3, &reader, 0, 16).is_none(), "before the window");
        assert!(windows.find(4, &reader, 2 * BLOCK, 16).is_none(), "another segment");
        let other = Arc::new(File::open(_file.path()).unwrap());
        assert!(windows.find(3, &other, 2 * BLOCK, 16).is_none(), "another handle of the segment");
    }

    /// The windows held never pass the budget: the oldest go first, a range larger than the budget is not read,
    /// and a release drops the windows inside it.
    #[test]
    fn windows_stay_within_the_budget() {
        let (_file, reader) = file(16);
        let windows = Windows::start(4 * BLOCK).unwrap();
        windows.fetch(1, reader.clone(), 0, 2 * BLOCK);
        windows.fetch(1, reader.clone(), 2 * BLOCK, 4 * BLOCK);
        assert_eq!(windows.held_bytes(), 4 * BLOCK);
        windows.fetch(1, reader.clone(), 4 * BLOCK, 5 * BLOCK);
        assert_eq!(windows.held_bytes(), 3 * BLOCK);
        assert!(windows.find(1, &reader, 0, 16).is_none(), "the oldest went");
        assert!(windows.find(1, &reader, 4 * BLOCK, 16).is_some());
        windows.fetch(1, reader.clone(), 5 * BLOCK, 10 * BLOCK);
        assert!(windows.find(1, &reader, 5 * BLOCK, 16).is_none(), "more than the budget is not read ahead");
        assert_eq!(windows.held_bytes(), 3 * BLOCK);
        windows.release(1, 0, 4 * BLOCK);
        assert_eq!(windows.held_bytes(), BLOCK);
        assert!(windows.find(1, &reader, 4 * BLOCK, 16).is_some(), "past the release");
    }

    /// A window whose read fails serves nothing, and the batch reads its pages itself.
    #[test]
    fn a_failed_read_serves_nothing() {
        let file = tempfile::NamedTempFile::new().unwrap();
        // a handle that cannot read
        let writer = Arc::new(std::fs::OpenOptions::new().write(true).open(file.path()).unwrap());
        let windows = Windows::start(1 << 20).unwrap();
        windows.fetch(0, writer.clone(), 0, BLOCK);
        let window = windows.find(0, &writer, 0, 16).expect("asked for");
        assert!(Windows::serve(&window, 0, 16, deadline()).is_none());
    }

    /// What a test does to the windows of two segments (files of 12 blocks, each block's bytes its number and the
    /// file's).
    #[derive(Clone, Debug)]
    enum Step {
        Fetch { segment: u32, from: u64, to: u64 },
        Serve { segment: u32, offset: u64, len: u64 },
        Release { segment: u32, from: u64, to: u64 },
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        let range = (0u64..14 * BLOCK, 1u64..6 * BLOCK).prop_map(|(from, len)| (from, from + len));
        prop_oneof![
            (0u32..2, range.clone()).prop_map(|(segment, (from, to))| Step::Fetch { segment, from, to }),
            (0u32..2, 0u64..13 * BLOCK, 1u64..2 * BLOCK).prop_map(|(segment, offset, len)| Step::Serve {
                segment,
                offset,
                len
            }),
            (0u32..2, range).prop_map(|(segment, (from, to))| Step::Release { segment, from, to }),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]

        /// Whatever is fetched, served and released: the windows held never pass the budget, and whatever a window
        /// serves is the file's own bytes at that offset (never past its end, never another file's).
        #[test]
        fn windows_hold_the_budget_and_serve_only_the_files_bytes(steps in proptest::collection::vec(step(), 1..40)) {
            let files: Vec<(tempfile::NamedTempFile, Arc<File>)> = (0..2)
                .map(|segment| {
                    let mut file = tempfile::NamedTempFile::new().unwrap();
                    for block in 0..12u8 {
                        file.write_all(&[block ^ (segment * 0x80); ALIGN]).unwrap();
                    }
                    let reader = Arc::new(File::open(file.path()).unwrap());
                    (file, reader)
                })
                .collect();
            let budget = 6 * BLOCK;
            let windows = Windows::start(budget).unwrap();
            for step in steps {
                match step {
                    Step::Fetch { segment, from, to } => windows.fetch(segment, files[segment as usize].1.clone(), from, to),
                    Step::Serve { segment, offset, len } => {
                        let file = &files[segment as usize].1;
                        if let Some(window) = windows.find(segment, file, offset, len) {
                            proptest::prop_assert!(window.holds(segment, file, offset, len));
                            let other = &files[1 - segment as usize].1;
                            proptest::prop_assert!(!window.holds(segment, other, offset, len));
                            if let Some(served) = Windows::serve(&window, offset, len as usize, deadline()) {
                                proptest::prop_assert!(offset + len <= 12 * BLOCK, "served past the file's end");
                                for (at, &byte) in served.page(len as usize).iter().enumerate() {
                                    let block = ((offset + at as u64) / BLOCK) as u8;
                                    proptest::prop_assert_eq!(byte, block ^ (segment as u8 * 0x80));
                                }
                            } else {
                                proptest::prop_assert!(offset + len > 12 * BLOCK, "a read inside the file failed");
                            }
                        }
                    }
                    Step::Release { segment, from, to } => windows.release(segment, from, to),
                }
                proptest::prop_assert!(windows.held_bytes() <= budget);
            }
        }
    }
}
