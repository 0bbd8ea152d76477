//! Moving a batch's pages through the rings: planning each page's requests (in place from a registered host pool, or
//! through a ring's bounce iov), splitting the batch into chunks of at most `entries` requests, and running the
//! chunks on the rings in parallel, footers before bytes for writes and after them for reads.

use std::ffi::CStr;
use std::hash::Hasher as _;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use hicache_core::Error;
use hicache_core::hash::PageKey;
use hicache_core::host_memory::MemoryRegion;
use hicache_core::storage::{FailureKind, GetOutcome, PageFailure, PageSegments, PageSegmentsMut};

use crate::Hf3fsStorage;
use crate::layout::{FOOTER_BYTES, Footer, checksum, checksum_hasher};
use crate::metadata::Located;
use crate::usrbio::{Iov, Library, Ring, Stuck};

/// A host pool in shared memory, published on the mount and wrapped as an iov.
pub(crate) struct Registered {
    region: MemoryRegion,
    iov: Iov,
    link: PathBuf,
}

impl Registered {
    /// Publishes `region` (a symlink `{mount}/3fs-virt/iovs/{id}` to its shared-memory file, as 3FS's agent maps
    /// iovs) and wraps it; `None` when the region has no shared-memory file.
    pub(crate) fn publish(
        library: &'static Library,
        mount: &CStr,
        region: &MemoryRegion,
    ) -> Result<Option<Self>, Error> {
        let Some(shared) = region.shared_memory() else { return Ok(None) };
        let mut id = [0u8; 16];
        // SAFETY: `id` is 16 writable bytes.
        if unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) } != 16 {
            return Err(Error::storage("3fs", "no random bytes for an iov id"));
        }
        let hex: String = id.iter().map(|byte| format!("{byte:02x}")).collect();
        let link = PathBuf::from(mount.to_string_lossy().into_owned()).join("3fs-virt/iovs").join(hex);
        std::os::unix::fs::symlink(shared, &link).map_err(|error| Error::Storage {
            backend: "3fs".into(),
            message: format!("publishing the host pool as {}: {error}", link.display()),
            source: Some(error.into()),
        })?;
        // SAFETY: the region's memory is the mapping of `shared`, kept mapped by the caller until it unregisters the
        // region, which drops this iov.
        match unsafe { Iov::wrap(library, region.address() as *mut u8, &id, mount, region.len()) } {
            Ok(iov) => Ok(Some(Self { region: region.clone(), iov, link })),
            Err(error) => {
                let _ = std::fs::remove_file(&link);
                Err(error)
            }
        }
    }

    pub(crate) fn region(&self) -> &MemoryRegion {
        &self.region
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.link);
    }
}

/// A ring with its footer iov and, once needed, its bounce iov.
pub(crate) struct Lane {
    pub(crate) ring: Ring,
    footers: Iov,
    bounce: Option<Iov>,
    entries: usize,
}

impl Lane {
    pub(crate) fn create(library: &'static Library, mount: &CStr, entries: usize, read: bool) -> Result<Self, Error> {
        Ok(Self {
            footers: Iov::create(library, mount, entries * FOOTER_BYTES)?,
            ring: Ring::create(library, mount, entries, read)?,
            bounce: None,
            entries,
        })
    }

    /// Footer slot `index`, whose read has completed.
    fn footer(&self, index: usize) -> &[u8] {
        assert!((index + 1) * FOOTER_BYTES <= self.footers.size(), "footer slot {index} out of the iov");
        // SAFETY: within the iov (checked above); the slot's read has completed and nothing writes it while its
        // chunk runs.
        unsafe { std::slice::from_raw_parts(self.footers.base().add(index * FOOTER_BYTES), FOOTER_BYTES) }
    }

    /// Bounce slot `slot` (of `page_bytes`), whose read has completed.
    fn bounced(&self, slot: usize, page_bytes: usize) -> &[u8] {
        let bounce = self.bounce.as_ref().expect("made for bounced pages");
        assert!((slot + 1) * page_bytes <= bounce.size(), "bounce slot {slot} out of the iov");
        // SAFETY: within the iov (checked above); the slot's read has completed and nothing writes it while its
        // chunk runs, so the bytes are not written while borrowed.
        unsafe { std::slice::from_raw_parts(bounce.base().add(slot * page_bytes), page_bytes) }
    }
}

/// A page's bytes in the caller's memory.
pub(crate) enum Pages<'a, 'b> {
    Read(&'a mut PageSegmentsMut<'b>),
    Write(&'a PageSegments<'b>),
}

/// One page of a batch to move.
pub(crate) struct Work<'a, 'b> {
    position: usize,
    key: PageKey,
    page: Located,
    pages: Pages<'a, 'b>,
    /// In-place requests: (registered iov, address, length, offset in the page); `None`: through the bounce iov.
    pieces: Option<Vec<(usize, usize, usize, usize)>>,
}

impl<'a, 'b> Work<'a, 'b> {
    pub(crate) fn read(position: usize, key: PageKey, page: Located, pages: &'a mut PageSegmentsMut<'b>) -> Self {
        Self { position, key, page, pages: Pages::Read(pages), pieces: None }
    }

    pub(crate) fn write(position: usize, key: PageKey, page: Located, pages: &'a PageSegments<'b>) -> Self {
        Self { position, key, page, pages: Pages::Write(pages), pieces: None }
    }

    fn segments(&self) -> Vec<(usize, usize)> {
        match &self.pages {
            Pages::Read(segments) => {
                segments.iter().map(|segment| (segment.as_ptr() as usize, segment.len())).collect()
            }
            Pages::Write(segments) => {
                segments.iter().map(|segment| (segment.as_ptr() as usize, segment.len())).collect()
            }
        }
    }

    /// Plans in-place requests when every segment lies in a registered iov (adjacent segments merged).
    fn plan(&mut self, registered: &[Registered], entries: usize) {
        let mut pieces: Vec<(usize, usize, usize, usize)> = Vec::new();
        let mut within = 0;
        for (address, len) in self.segments() {
            if len == 0 {
                continue;
            }
            let Some(iov) = registered.iter().position(|held| held.iov.contains(address, len)) else {
                return;
            };
            match pieces.last_mut() {
                Some(last) if last.0 == iov && last.1 + last.2 == address => last.2 += len,
                _ => pieces.push((iov, address, len, within)),
            }
            within += len;
        }
        if pieces.len() <= entries {
            self.pieces = Some(pieces);
        }
    }

    fn requests(&self) -> usize {
        self.pieces.as_ref().map_or(1, Vec::len)
    }
}

/// Copies `bytes` into the segments in order and, when `hash`, hashes them in the same pass, a cache-sized block at a
/// time (so the hash reads what the copy is about to read anyway); the checksum a footer would hold of them.
fn scatter_hashed(bytes: &[u8], segments: &mut [&mut [u8]], hash: bool) -> Option<u64> {
    const BLOCK: usize = 64 << 10;
    assert_eq!(bytes.len(), hicache_core::storage::segments_len(segments), "scatter: length mismatch");
    if !hash {
        hicache_core::storage::scatter(bytes, segments);
        return None;
    }
    let mut hasher = checksum_hasher();
    let mut rest = bytes;
    for segment in segments.iter_mut() {
        let (head, tail) = rest.split_at(segment.len());
        for (from, to) in head.chunks(BLOCK).zip(segment.chunks_mut(BLOCK)) {
            hasher.write(from);
            to.copy_from_slice(from);
        }
        rest = tail;
    }
    Some(hasher.finish())
}

/// One request on a ring: the page's position in its chunk, the bytes to move, the file offset, and whether it is
/// the page's footer.
#[derive(Clone, Copy)]
struct Request {
    index: usize,
    len: usize,
    offset: u64,
    footer: bool,
}

/// Per page of a batch (by position), whether it moved.
type PageResults = Vec<(usize, Result<(), PageFailure>)>;

fn failure(kind: FailureKind, message: String) -> PageFailure {
    PageFailure::new(kind, message)
}

/// What one request moved, checked against its length.
fn checked(result: i64, len: usize, what: &str, offset: u64) -> Result<(), PageFailure> {
    if result < 0 {
        let error = std::io::Error::from_raw_os_error((-result) as i32);
        let message = format!("{what} of {len} bytes at offset {offset}: {error}");
        return Err(PageFailure::caused(FailureKind::Io, message, error));
    }
    if result as usize != len {
        return Err(failure(FailureKind::Corrupt, format!("short {what}: {result} of {len} bytes at offset {offset}")));
    }
    Ok(())
}

impl Hf3fsStorage {
    /// Reads the pages; per page its outcome.
    pub(crate) fn transfer_reads(&self, work: Vec<Work<'_, '_>>) -> Vec<(usize, GetOutcome)> {
        self.transfer(work, true)
            .into_iter()
            .map(|(position, result)| (position, result.map_or_else(GetOutcome::Failed, |()| GetOutcome::Hit)))
            .collect()
    }

    /// Writes the pages; per page whether it was written.
    pub(crate) fn transfer_writes(&self, work: Vec<Work<'_, '_>>) -> PageResults {
        self.transfer(work, false)
    }

    fn transfer(&self, mut work: Vec<Work<'_, '_>>, read: bool) -> PageResults {
        if work.is_empty() {
            return Vec::new();
        }
        let registered = self.registered.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        for item in &mut work {
            item.plan(&registered, self.config.entries);
        }
        let mut chunks: Vec<Vec<Work<'_, '_>>> = Vec::new();
        let mut requests = 0;
        for item in work {
            if chunks.is_empty() || requests + item.requests() > self.config.entries {
                chunks.push(Vec::new());
                requests = 0;
            }
            requests += item.requests();
            chunks.last_mut().expect("pushed above").push(item);
        }
        let pool = if read { &self.readers } else { &self.writers };
        let run = |chunk: Vec<Work<'_, '_>>| {
            let mut lane = pool.take();
            let positions: Vec<usize> = chunk.iter().map(|item| item.position).collect();
            match self.run_chunk(&mut lane, chunk, &registered, read) {
                Ok(results) => {
                    pool.give_back(lane);
                    results
                }
                Err(stuck) => {
                    // requests may still move bytes: keep the lane's memory alive and never use it again
                    std::mem::forget(lane);
                    let why = format!(
                        "refusing calls: {} USRBIO requests did not complete within {} ms (io_timeout) and may \
                         still move bytes; reopen the backend",
                        stuck.outstanding,
                        stuck.waited.as_millis()
                    );
                    self.poison(why.clone());
                    positions
                        .into_iter()
                        .map(|position| (position, Err(failure(FailureKind::Timeout, why.clone()))))
                        .collect()
                }
            }
        };
        if chunks.len() == 1 {
            return run(chunks.pop().expect("one chunk"));
        }
        let threads = chunks.len().min(self.config.numjobs);
        let queue = Mutex::new(chunks);
        let results = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    loop {
                        let Some(chunk) = queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).pop() else {
                            break;
                        };
                        let done = run(chunk);
                        results.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).extend(done);
                    }
                });
            }
        });
        results.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// One chunk on one lane: for reads, bytes then footers; for writes, footers then bytes.
    fn run_chunk(
        &self,
        lane: &mut Lane,
        mut chunk: Vec<Work<'_, '_>>,
        registered: &[Registered],
        read: bool,
    ) -> Result<PageResults, Stuck> {
        let page_bytes = self.space.page_bytes as usize;
        let mut results: Vec<Result<(), PageFailure>> = vec![Ok(()); chunk.len()];
        let bounced = chunk.iter().filter(|item| item.pieces.is_none()).count();
        if bounced > 0 && lane.bounce.as_ref().is_none_or(|bounce| bounce.size() < bounced * page_bytes) {
            lane.bounce = None;
            match Iov::create(self.library, &self.mount, lane.entries * page_bytes) {
                Ok(bounce) => lane.bounce = Some(bounce),
                Err(error) => {
                    let why = failure(FailureKind::Io, format!("no bounce buffer: {error}"));
                    return Ok(chunk.iter().map(|item| (item.position, Err(why.clone()))).collect());
                }
            }
        }
        // the bounce slot of each page that goes through it
        let mut slots = vec![usize::MAX; chunk.len()];
        let mut next = 0;
        for (slot, item) in slots.iter_mut().zip(&chunk) {
            if item.pieces.is_none() {
                *slot = next;
                next += 1;
            }
        }
        if !read {
            // footers first, then (where bounced) the bytes gathered into the bounce iov
            self.write_footers(lane, &chunk, &mut results)?;
            if let Some(bounce) = lane.bounce.as_mut() {
                let bytes = bounce.bytes_mut();
                for (item, &slot) in chunk.iter().zip(&slots) {
                    if let (None, Pages::Write(segments)) = (&item.pieces, &item.pages) {
                        let target = &mut bytes[slot * page_bytes..(slot + 1) * page_bytes];
                        let mut at = 0;
                        for segment in segments.iter() {
                            target[at..at + segment.len()].copy_from_slice(segment);
                            at += segment.len();
                        }
                        self.stats.record_staging(page_bytes);
                    }
                }
            }
        }
        if read {
            self.read_chunk(lane, &mut chunk, &slots, registered, &mut results)?;
        } else {
            let mut requests = Vec::new();
            self.prepare_bytes(lane, &chunk, &slots, registered, &mut results, &mut requests);
            self.run_prepared(lane, &requests, &mut results, "write")?;
        }
        Ok(chunk.iter().map(|item| item.position).zip(results).collect())
    }

    /// Prepares the requests for the pages' bytes, in place or through the bounce iov, adding them to `requests`.
    fn prepare_bytes(
        &self,
        lane: &mut Lane,
        chunk: &[Work<'_, '_>],
        slots: &[usize],
        registered: &[Registered],
        results: &mut [Result<(), PageFailure>],
        requests: &mut Vec<Request>,
    ) {
        let page_bytes = self.space.page_bytes as usize;
        for (index, item) in chunk.iter().enumerate() {
            if results[index].is_err() {
                continue;
            }
            let base = self.layout.page_offset(item.page.index);
            let prepared = match &item.pieces {
                Some(pieces) => pieces.iter().try_for_each(|&(iov, address, len, within)| {
                    let offset = base + within as u64;
                    requests.push(Request { index, len, offset, footer: false });
                    // SAFETY: the piece lies in the registered iov (planned), in the caller's segments, which this
                    // call borrows until its requests complete.
                    unsafe {
                        lane.ring.prepare(
                            &registered[iov].iov,
                            address as *mut u8,
                            &self.file,
                            offset,
                            len,
                            requests.len() - 1,
                        )
                    }
                }),
                None => {
                    let bounce = lane.bounce.as_ref().expect("made for bounced pages");
                    requests.push(Request { index, len: page_bytes, offset: base, footer: false });
                    // SAFETY: the slot lies in the lane's bounce iov, used by this lane alone.
                    unsafe {
                        let address = bounce.base().add(slots[index] * page_bytes);
                        lane.ring.prepare(bounce, address, &self.file, base, page_bytes, requests.len() - 1)
                    }
                }
            };
            if let Err(error) = prepared {
                results[index] = Err(failure(FailureKind::Io, error.to_string()));
            }
        }
    }

    /// Reads a chunk page by page as its requests complete. Once all of a page's bytes are in, they are hashed (those
    /// that came through the bounce iov in the same pass that copies them to the caller) while the ring goes on with
    /// later pages, and its footer is read: a footer is always read after the bytes it vouches for. A page is taken
    /// when its footer names the key and generation located and, with `verify_checksum`, holds the hash of the bytes
    /// read; the bytes of a page not taken may have reached the caller's memory all the same (as they do in place).
    fn read_chunk(
        &self,
        lane: &mut Lane,
        chunk: &mut [Work<'_, '_>],
        slots: &[usize],
        registered: &[Registered],
        results: &mut [Result<(), PageFailure>],
    ) -> Result<(), Stuck> {
        let page_bytes = self.space.page_bytes as usize;
        let (started, mut requests) = (Instant::now(), Vec::new());
        let deadline = started + self.config.io_timeout;
        self.prepare_bytes(lane, chunk, slots, registered, results, &mut requests);
        let mut pending = vec![0usize; chunk.len()];
        for request in &requests {
            pending[request.index] += 1;
        }
        let mut hashes: Vec<Option<u64>> = vec![None; chunk.len()];
        let mut outstanding = Self::submit(lane, results, 0..chunk.len());
        while outstanding > 0 {
            let done = lane.ring.reap(outstanding, 1, started, deadline)?;
            outstanding -= done.len();
            let mut footers = Vec::new();
            for (tag, moved) in done {
                let Request { index, len, offset, footer } = requests[tag];
                if results[index].is_ok() {
                    results[index] = checked(moved, len, if footer { "footer read" } else { "read" }, offset);
                }
                if footer {
                    if results[index].is_ok() {
                        results[index] = self.take_page(lane, index, &chunk[index], hashes[index]);
                    }
                    continue;
                }
                pending[index] -= 1;
                if pending[index] > 0 || results[index].is_err() {
                    continue;
                }
                hashes[index] = match (&chunk[index].pieces, &mut chunk[index].pages) {
                    (Some(_), Pages::Read(segments)) => {
                        self.config.verify_checksum.then(|| checksum(segments.iter().map(|segment| &segment[..])))
                    }
                    (None, Pages::Read(segments)) => {
                        self.stats.record_staging(page_bytes);
                        scatter_hashed(lane.bounced(slots[index], page_bytes), segments, self.config.verify_checksum)
                    }
                    (_, Pages::Write(_)) => unreachable!("a read chunk holds reads"),
                };
                let offset = self.layout.footer_offset(chunk[index].page.index);
                requests.push(Request { index, len: FOOTER_BYTES, offset, footer: true });
                // SAFETY: slot `index` of the lane's footer iov (one per entry; a chunk has at most `entries` pages),
                // read into by this request alone.
                let prepared = unsafe {
                    let address = lane.footers.base().add(index * FOOTER_BYTES);
                    lane.ring.prepare(&lane.footers, address, &self.file, offset, FOOTER_BYTES, requests.len() - 1)
                };
                match prepared {
                    Ok(()) => footers.push(index),
                    Err(error) => results[index] = Err(failure(FailureKind::Io, error.to_string())),
                }
            }
            outstanding += Self::submit(lane, results, footers);
        }
        Ok(())
    }

    /// Submits what is prepared on `lane`; how many requests. When the ring refuses, `pages` (positions in the
    /// chunk) fail.
    fn submit(
        lane: &mut Lane,
        results: &mut [Result<(), PageFailure>],
        pages: impl IntoIterator<Item = usize>,
    ) -> usize {
        lane.ring.submit().unwrap_or_else(|error| {
            for index in pages {
                if results[index].is_ok() {
                    results[index] = Err(failure(FailureKind::Io, error.to_string()));
                }
            }
            0
        })
    }

    /// Whether a read page, its footer just read into slot `index` of the lane's footer iov, is taken: the footer
    /// must name the key and generation located and hold `hash`, the hash of the bytes read (`None`: not checked).
    fn take_page(&self, lane: &Lane, index: usize, item: &Work<'_, '_>, hash: Option<u64>) -> Result<(), PageFailure> {
        let found = Footer::decode(lane.footer(index));
        let wanted = Footer {
            key: item.key,
            namespace: self.digest,
            generation: item.page.generation,
            checksum: found.map_or(0, |footer| footer.checksum),
        };
        let Some(footer) = found.filter(|footer| *footer == wanted) else {
            return Err(failure(
                FailureKind::Corrupt,
                format!(
                    "page {} of {} no longer holds this key (generation {} wanted, its footer says {}): reused by \
                     another writer",
                    item.page.index,
                    self.path.display(),
                    item.page.generation,
                    found.map_or_else(|| "nothing".to_owned(), |footer| format!("generation {}", footer.generation))
                ),
            ));
        };
        if hash.is_some_and(|hash| hash != footer.checksum) {
            return Err(failure(
                FailureKind::Corrupt,
                format!(
                    "page {} of {}: its bytes do not match its footer's checksum (changed beneath the tier)",
                    item.page.index,
                    self.path.display()
                ),
            ));
        }
        Ok(())
    }

    /// Writes the pages' footers (key, namespace, generation located, checksum of the bytes to be written).
    fn write_footers(
        &self,
        lane: &mut Lane,
        chunk: &[Work<'_, '_>],
        results: &mut [Result<(), PageFailure>],
    ) -> Result<(), Stuck> {
        let mut requests = Vec::new();
        {
            let bytes = lane.footers.bytes_mut();
            for (index, item) in chunk.iter().enumerate() {
                if let (Ok(()), Pages::Write(segments)) = (&results[index], &item.pages) {
                    let checksum = checksum(segments.iter().map(|segment| &segment[..]));
                    let footer =
                        Footer { key: item.key, namespace: self.digest, generation: item.page.generation, checksum };
                    bytes[index * FOOTER_BYTES..(index + 1) * FOOTER_BYTES].copy_from_slice(&footer.encode());
                }
            }
        }
        for (index, item) in chunk.iter().enumerate() {
            if results[index].is_err() {
                continue;
            }
            let offset = self.layout.footer_offset(item.page.index);
            requests.push(Request { index, len: FOOTER_BYTES, offset, footer: true });
            // SAFETY: slot `index` of the lane's footer iov (it has one per entry; a chunk has at most `entries` pages).
            let prepared = unsafe {
                let address = lane.footers.base().add(index * FOOTER_BYTES);
                lane.ring.prepare(&lane.footers, address, &self.file, offset, FOOTER_BYTES, requests.len() - 1)
            };
            if let Err(error) = prepared {
                results[index] = Err(failure(FailureKind::Io, error.to_string()));
            }
        }
        self.run_prepared(lane, &requests, results, "footer write")
    }

    /// Runs the requests prepared on `lane` and checks each against what it was to move (`requests[tag]`: the
    /// page's position in the chunk, the length, the file offset). A ring that fails as a whole fails every page; a
    /// stuck one is returned.
    fn run_prepared(
        &self,
        lane: &mut Lane,
        requests: &[Request],
        results: &mut [Result<(), PageFailure>],
        what: &str,
    ) -> Result<(), Stuck> {
        let done = match lane.ring.run(Instant::now() + self.config.io_timeout) {
            Ok(done) => done?,
            Err(error) => {
                for result in results.iter_mut() {
                    *result = Err(failure(FailureKind::Io, error.to_string()));
                }
                return Ok(());
            }
        };
        for (tag, moved) in done {
            let Request { index, len, offset, .. } = requests[tag];
            if results[index].is_ok() {
                results[index] = checked(moved, len, what, offset);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn a_scatter_copies_every_byte_and_hashes_them_as_the_footer_would(
            bytes in proptest::collection::vec(any::<u8>(), 0..300_000),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
        ) {
            let mut cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(bytes.len() + 1)).collect();
            cuts.extend([0, bytes.len()]);
            cuts.sort_unstable();
            let mut buffer = vec![0xa5u8; bytes.len()];
            let mut segments: Vec<&mut [u8]> = Vec::new();
            let mut rest = buffer.as_mut_slice();
            for pair in cuts.windows(2) {
                let (head, tail) = rest.split_at_mut(pair[1] - pair[0]);
                segments.push(head);
                rest = tail;
            }
            prop_assert_eq!(scatter_hashed(&bytes, &mut segments, true), Some(checksum([bytes.as_slice()])));
            prop_assert_eq!(&buffer, &bytes);
            buffer.fill(0);
            let mut whole = [buffer.as_mut_slice()];
            prop_assert_eq!(scatter_hashed(&bytes, &mut whole, false), None);
            prop_assert_eq!(&buffer, &bytes);
        }
    }

    #[test]
    fn a_failed_request_keeps_the_errno_and_a_short_one_is_corrupt() {
        let full = checked(-28, 4096, "write", 8192).unwrap_err();
        assert_eq!(full.kind, FailureKind::Io);
        assert_eq!(full.io_error().and_then(std::io::Error::raw_os_error), Some(28), "ENOSPC: {full}");
        assert!(full.message.contains("write of 4096 bytes at offset 8192"), "{full}");
        let short = checked(100, 4096, "read", 0).unwrap_err();
        assert_eq!(short.kind, FailureKind::Corrupt);
        assert!(short.source.is_none());
        assert!(checked(4096, 4096, "read", 0).is_ok());
    }
}
