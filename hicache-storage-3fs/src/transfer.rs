//! Moving a batch's pages through the rings: planning each page's requests (in place from a registered host pool, or
//! through a ring's bounce iov), splitting the batch into chunks of at most `entries` requests, and running the
//! chunks on the rings in parallel, footers before bytes for writes and after them for reads.

use std::ffi::CStr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use hicache_core::Error;
use hicache_core::hash::PageKey;
use hicache_core::host_memory::MemoryRegion;
use hicache_core::storage::{FailureKind, GetOutcome, PageFailure, PageSegments, PageSegmentsMut, scatter};

use crate::Hf3fsStorage;
use crate::layout::{FOOTER_BYTES, Footer, checksum};
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
            let _ = self.footer_phase(lane, &chunk, &mut results, false)?;
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
        self.data_phase(lane, &chunk, &slots, registered, &mut results, read)?;
        if read {
            let checksums = self.footer_phase(lane, &chunk, &mut results, true)?;
            if let Some(bounce) = lane.bounce.as_mut() {
                let bytes = bounce.bytes_mut();
                for ((item, &slot), result) in chunk.iter_mut().zip(&slots).zip(&results) {
                    if let (None, Pages::Read(segments), Ok(())) = (&item.pieces, &mut item.pages, result) {
                        scatter(&bytes[slot * page_bytes..(slot + 1) * page_bytes], segments);
                        self.stats.record_staging(page_bytes);
                    }
                }
            }
            // the bytes as read (in place, or scattered from the bounce iov) against the checksum their writer put
            // in the footer
            for ((item, result), &wanted) in chunk.iter().zip(results.iter_mut()).zip(&checksums) {
                if let (Ok(()), Pages::Read(segments)) = (&*result, &item.pages) {
                    let found = checksum(segments.iter().map(|segment| &segment[..]));
                    if found != wanted {
                        *result = Err(failure(
                            FailureKind::Corrupt,
                            format!(
                                "page {} of {}: its bytes do not match its footer's checksum (changed beneath the \
                                 tier)",
                                item.page.index,
                                self.path.display()
                            ),
                        ));
                    }
                }
            }
        }
        Ok(chunk.iter().map(|item| item.position).zip(results).collect())
    }

    /// The pages' bytes, in place or through the bounce iov.
    fn data_phase(
        &self,
        lane: &mut Lane,
        chunk: &[Work<'_, '_>],
        slots: &[usize],
        registered: &[Registered],
        results: &mut [Result<(), PageFailure>],
        read: bool,
    ) -> Result<(), Stuck> {
        let page_bytes = self.space.page_bytes as usize;
        let what = if read { "read" } else { "write" };
        let mut expected: Vec<(usize, usize, u64)> = Vec::new();
        for (index, item) in chunk.iter().enumerate() {
            if results[index].is_err() {
                continue;
            }
            let base = self.layout.page_offset(item.page.index);
            let prepared = match &item.pieces {
                Some(pieces) => pieces.iter().try_for_each(|&(iov, address, len, within)| {
                    let offset = base + within as u64;
                    expected.push((index, len, offset));
                    // SAFETY: the piece lies in the registered iov (planned), in the caller's segments, which this
                    // call borrows until its requests complete.
                    unsafe {
                        lane.ring.prepare(
                            &registered[iov].iov,
                            address as *mut u8,
                            &self.file,
                            offset,
                            len,
                            expected.len() - 1,
                        )
                    }
                }),
                None => {
                    let bounce = lane.bounce.as_ref().expect("made for bounced pages");
                    expected.push((index, page_bytes, base));
                    // SAFETY: the slot lies in the lane's bounce iov, used by this lane alone.
                    unsafe {
                        let address = bounce.base().add(slots[index] * page_bytes);
                        lane.ring.prepare(bounce, address, &self.file, base, page_bytes, expected.len() - 1)
                    }
                }
            };
            if let Err(error) = prepared {
                results[index] = Err(failure(FailureKind::Io, error.to_string()));
            }
        }
        self.run_prepared(lane, &expected, results, what)
    }

    /// Runs the requests prepared on `lane` and checks each against what it was to move (`expected[tag]`: the
    /// page's position in the chunk, the length, the file offset). A ring that fails as a whole fails every page; a
    /// stuck one is returned.
    fn run_prepared(
        &self,
        lane: &mut Lane,
        expected: &[(usize, usize, u64)],
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
            let (index, len, offset) = expected[tag];
            if results[index].is_ok() {
                results[index] = checked(moved, len, what, offset);
            }
        }
        Ok(())
    }

    /// The pages' footers: written from, or read into and checked against, what the metadata handed out. Reads
    /// return each page's checksum from its footer (for the pages that passed).
    fn footer_phase(
        &self,
        lane: &mut Lane,
        chunk: &[Work<'_, '_>],
        results: &mut [Result<(), PageFailure>],
        read: bool,
    ) -> Result<Vec<u64>, Stuck> {
        let mut checksums = vec![0; chunk.len()];
        let mut expected: Vec<(usize, usize, u64)> = Vec::new();
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
            expected.push((index, FOOTER_BYTES, offset));
            // SAFETY: slot `index` of the lane's footer iov (it has one per entry; a chunk has at most `entries` pages).
            let prepared = unsafe {
                let address = lane.footers.base().add(index * FOOTER_BYTES);
                lane.ring.prepare(&lane.footers, address, &self.file, offset, FOOTER_BYTES, expected.len() - 1)
            };
            if let Err(error) = prepared {
                results[index] = Err(failure(FailureKind::Io, error.to_string()));
            }
        }
        self.run_prepared(lane, &expected, results, if read { "footer read" } else { "footer write" })?;
        if read {
            let bytes = lane.footers.bytes_mut();
            for (index, item) in chunk.iter().enumerate() {
                if results[index].is_err() {
                    continue;
                }
                let found = Footer::decode(&bytes[index * FOOTER_BYTES..(index + 1) * FOOTER_BYTES]);
                let wanted = Footer {
                    key: item.key,
                    namespace: self.digest,
                    generation: item.page.generation,
                    checksum: found.map_or(0, |footer| footer.checksum),
                };
                if let Some(footer) = found.filter(|footer| *footer == wanted) {
                    checksums[index] = footer.checksum;
                } else {
                    results[index] = Err(failure(
                        FailureKind::Corrupt,
                        format!(
                            "page {} of {} no longer holds this key (generation {} wanted, its footer says {}): \
                             reused by another writer",
                            item.page.index,
                            self.path.display(),
                            item.page.generation,
                            found.map_or_else(
                                || "nothing".to_owned(),
                                |footer| format!("generation {}", footer.generation)
                            )
                        ),
                    ));
                }
            }
        }
        Ok(checksums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
