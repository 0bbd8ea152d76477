//! Batched positioned reads and writes: submitted together through io_uring where the kernel allows it, else run
//! on the backend's I/O threads with `preadv`/`pwritev`.
//!
//! A ring is taken from a small pool for one batch (each batch is one call, and the controller's threads call
//! concurrently), filled with every operation that fits, and waited on until all have completed; the buffers stay
//! borrowed for the whole call, so no operation outlives them. A short transfer is finished with `preadv`/`pwritev`
//! (a read that reaches the end of the file is [`io::ErrorKind::UnexpectedEof`]).
#![allow(unsafe_code)]

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::AsRawFd as _;
use std::sync::Mutex;

use io_uring::{IoUring, opcode, types};

/// Submission queue entries per ring: the most operations in flight for one batch.
const DEPTH: u32 = 256;
/// The most buffers one operation takes (the kernel's `IOV_MAX`).
pub(crate) const MAX_BUFFERS: usize = 1024;

/// One positioned transfer of several buffers.
#[derive(Debug)]
pub(crate) enum Op<'a> {
    Read { file: &'a File, offset: u64, buffers: Vec<IoSliceMut<'a>> },
    Write { file: &'a File, offset: u64, buffers: Vec<IoSlice<'a>> },
}

impl Op<'_> {
    fn len(&self) -> usize {
        match self {
            Op::Read { buffers, .. } => buffers.iter().map(|buffer| buffer.len()).sum(),
            Op::Write { buffers, .. } => buffers.iter().map(|buffer| buffer.len()).sum(),
        }
    }

    /// Moves what is left after the first `done` bytes with plain system calls.
    fn finish(&mut self, mut done: usize) -> io::Result<()> {
        let total = self.len();
        while done < total {
            let moved = match self {
                Op::Read { file, offset, buffers } => {
                    let mut rest = buffers.as_mut_slice();
                    IoSliceMut::advance_slices(&mut rest, done);
                    rustix::io::preadv(file, rest, *offset + done as u64)
                }
                Op::Write { file, offset, buffers } => {
                    let mut rest = buffers.as_mut_slice();
                    IoSlice::advance_slices(&mut rest, done);
                    rustix::io::pwritev(file, rest, *offset + done as u64)
                }
            };
            match moved {
                Ok(0) if matches!(self, Op::Read { .. }) => {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file ends before the page"));
                }
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "the file system took no bytes")),
                Ok(moved) => done += moved,
                Err(rustix::io::Errno::INTR) => {}
                Err(error) => return Err(error.into()),
            }
        }
        Ok(())
    }
}

/// Runs batches of operations.
pub(crate) struct Submitter {
    /// Idle rings, or `None` when io_uring is off or the kernel refused it.
    rings: Option<Mutex<Vec<IoUring>>>,
}

impl std::fmt::Debug for Submitter {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Submitter").field("io_uring", &self.uses_io_uring()).finish()
    }
}

impl Submitter {
    /// Uses io_uring when `wanted` and the kernel sets up a ring (it may be disabled, or filtered in a container);
    /// otherwise system calls on the I/O threads.
    pub(crate) fn new(wanted: bool) -> Self {
        let rings = wanted
            .then(|| match new_ring() {
                Ok(ring) => Some(Mutex::new(vec![ring])),
                Err(error) => {
                    tracing::warn!(%error, "io_uring is not available: the file tier reads and writes segments with \
                                            preadv and pwritev");
                    None
                }
            })
            .flatten();
        Self { rings }
    }

    /// Whether batches go through io_uring.
    pub(crate) fn uses_io_uring(&self) -> bool {
        self.rings.is_some()
    }

    /// Runs one operation (on the caller's thread: the I/O threads take no part).
    pub(crate) fn run_one(&self, op: &mut Op<'_>) -> io::Result<()> {
        if let Some(rings) = &self.rings {
            let ring = rings.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).pop();
            if let Some(mut ring) = ring.map_or_else(|| new_ring().ok(), Some) {
                let mut results = through_ring(&mut ring, std::slice::from_mut(op), || {}, &mut |_, _| {});
                rings.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(ring);
                return results.pop().unwrap_or(Ok(()));
            }
        }
        op.finish(0)
    }

    /// Runs every operation; each result says whether all of its bytes moved.
    #[cfg(test)]
    pub(crate) fn run(&self, ops: &mut [Op<'_>], pool: &rayon::ThreadPool) -> Vec<io::Result<()>> {
        self.run_with(ops, pool, || {}, |_, _| {})
    }

    /// [`Submitter::run`], doing `meanwhile` while the operations are in flight, and calling `done(indices, ops)` with
    /// the operations that moved all their bytes as they complete, a group at a time (while the others may still be
    /// in flight).
    pub(crate) fn run_with(
        &self,
        ops: &mut [Op<'_>],
        pool: &rayon::ThreadPool,
        meanwhile: impl FnOnce(),
        mut done: impl FnMut(&[usize], &[Op<'_>]),
    ) -> Vec<io::Result<()>> {
        if let Some(rings) = &self.rings {
            let ring = rings.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).pop();
            if let Some(mut ring) = ring.map_or_else(|| new_ring().ok(), Some) {
                let results = through_ring(&mut ring, ops, meanwhile, &mut done);
                rings.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(ring);
                return results;
            }
        }
        use rayon::prelude::*;
        let run = |ops: &mut [Op<'_>]| -> Vec<io::Result<()>> {
            if ops.len() <= 1 {
                return ops.iter_mut().map(|op| op.finish(0)).collect();
            }
            pool.install(|| ops.par_iter_mut().map(|op| op.finish(0)).collect())
        };
        meanwhile();
        let results = run(ops);
        let whole: Vec<usize> = (0..ops.len()).filter(|&index| results[index].is_ok()).collect();
        if !whole.is_empty() {
            done(&whole, ops);
        }
        results
    }
}

/// A ring whose completions wait for the next call into the kernel (no interrupt of the thread that submitted:
/// a batch's caller waits for its completions anyway).
fn new_ring() -> io::Result<IoUring> {
    IoUring::builder().setup_coop_taskrun().build(DEPTH).or_else(|_| IoUring::new(DEPTH))
}

/// The buffer list of `op` for the kernel, with buffers that follow each other in memory joined into one (the kernel
/// pins and maps each buffer on its own: a batch of small pages that lie side by side in a host pool moves as one
/// run, as a single large buffer would).
fn joined(op: &Op<'_>) -> Vec<libc::iovec> {
    let mut list: Vec<libc::iovec> = Vec::new();
    let mut push = |base: *mut libc::c_void, len: usize| match list.last_mut() {
        Some(last) if last.iov_base.wrapping_byte_add(last.iov_len) == base => last.iov_len += len,
        _ => list.push(libc::iovec { iov_base: base, iov_len: len }),
    };
    match op {
        Op::Read { buffers, .. } => {
            for buffer in buffers {
                push(buffer.as_ptr().cast_mut().cast(), buffer.len());
            }
        }
        Op::Write { buffers, .. } => {
            for buffer in buffers {
                push(buffer.as_ptr().cast_mut().cast(), buffer.len());
            }
        }
    }
    list
}

/// Submits `ops` through `ring`, at most [`DEPTH`] in flight, and waits for all of them.
fn through_ring(
    ring: &mut IoUring,
    ops: &mut [Op<'_>],
    meanwhile: impl FnOnce(),
    done: &mut dyn FnMut(&[usize], &[Op<'_>]),
) -> Vec<io::Result<()>> {
    let mut meanwhile = Some(meanwhile);
    // the kernel reads each list when the operation is submitted (and again if it is retried): kept until the end
    let lists: Vec<Vec<libc::iovec>> = ops.iter().map(joined).collect();
    let mut results: Vec<Option<io::Result<()>>> = (0..ops.len()).map(|_| None).collect();
    let mut moved = vec![0usize; ops.len()];
    let mut next = 0;
    let mut in_flight = 0usize;
    while next < ops.len() || in_flight > 0 {
        {
            let mut queue = ring.submission();
            while next < ops.len() && !queue.is_full() {
                let list = &lists[next];
                let entry = match &ops[next] {
                    Op::Read { file, offset, .. } => {
                        opcode::Readv::new(types::Fd(file.as_raw_fd()), list.as_ptr(), list.len() as u32)
                            .offset(*offset)
                            .build()
                    }
                    Op::Write { file, offset, .. } => {
                        opcode::Writev::new(types::Fd(file.as_raw_fd()), list.as_ptr(), list.len() as u32)
                            .offset(*offset)
                            .build()
                    }
                };
                // SAFETY: the entry points at the operation's joined buffer list (`lists`, kept for this whole call)
                // and at its buffers, which `ops` borrows for this whole call; the call returns only once every
                // submitted entry has completed
                if unsafe { queue.push(&entry.user_data(next as u64)) }.is_err() {
                    break;
                }
                next += 1;
                in_flight += 1;
            }
        }
        let submitted = match meanwhile.take() {
            // submitted first, then the work overlaps the transfers
            Some(work) => ring.submit().inspect(|_| work()),
            None => ring.submit_and_wait(1),
        };
        match submitted {
            Ok(_) => {}
            Err(error) if matches!(error.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
            Err(error) => {
                // nothing new can be submitted; entries already submitted are still waited for below, so their
                // buffers outlive them, and the rest fail with the error
                for result in results.iter_mut().skip(next) {
                    *result = Some(Err(io::Error::new(error.kind(), error.to_string())));
                }
                next = ops.len();
                if in_flight > 0 {
                    let _ = ring.submitter().submit_and_wait(in_flight);
                }
            }
        }
        let mut whole = Vec::new();
        for completion in ring.completion() {
            let index = completion.user_data() as usize;
            in_flight -= 1;
            let result = completion.result();
            results[index] = Some(if result < 0 {
                Err(io::Error::from_raw_os_error(-result))
            } else {
                moved[index] = result as usize;
                Ok(())
            });
            if moved[index] == ops[index].len() && result >= 0 {
                whole.push(index);
            }
        }
        if !whole.is_empty() {
            // the kernel is done with these operations' buffers (the others are not touched there)
            done(&whole, ops);
        }
    }
    // with no operations, the work is still done
    if let Some(work) = meanwhile.take() {
        work();
    }
    let mut finished_late = Vec::new();
    let results: Vec<io::Result<()>> = results
        .into_iter()
        .zip(ops.iter_mut().zip(moved))
        .enumerate()
        .map(|(index, (result, (op, moved)))| match result {
            Some(Ok(())) if moved < op.len() => {
                let finished = op.finish(moved);
                if finished.is_ok() {
                    finished_late.push(index);
                }
                finished
            }
            Some(result) => result,
            None => Err(io::Error::other("an io_uring operation never completed")),
        })
        .collect();
    if !finished_late.is_empty() {
        done(&finished_late, ops);
    }
    results
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn pool() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap()
    }

    /// Both ways write scattered buffers where they belong and read them back, and a read past the end is an
    /// error of its own operation only.
    #[test]
    fn both_ways_move_every_byte_and_report_each_operation() {
        for wanted in [true, false] {
            let submitter = Submitter::new(wanted);
            let mut file = tempfile::tempfile().unwrap();
            file.write_all(&[0u8; 64]).unwrap();
            let pieces: Vec<Vec<u8>> = (0..300u16).map(|index| vec![index as u8; 1 + index as usize % 7]).collect();
            let mut offset = 0u64;
            let mut ops = Vec::new();
            for group in pieces.chunks(3) {
                let buffers: Vec<IoSlice<'_>> = group.iter().map(|piece| IoSlice::new(piece)).collect();
                let length: usize = group.iter().map(Vec::len).sum();
                ops.push(Op::Write { file: &file, offset, buffers });
                offset += length as u64;
            }
            assert!(submitter.run(&mut ops, &pool()).iter().all(Result::is_ok), "io_uring {wanted}");
            let expected: Vec<u8> = pieces.concat();
            let mut back = vec![0u8; expected.len()];
            let mut past_end = [0u8; 8];
            let (first, second) = back.split_at_mut(expected.len() / 2);
            let mut ops = vec![
                Op::Read { file: &file, offset: 0, buffers: vec![IoSliceMut::new(first)] },
                Op::Read { file: &file, offset: (expected.len() / 2) as u64, buffers: vec![IoSliceMut::new(second)] },
                Op::Read {
                    file: &file,
                    offset: expected.len() as u64 - 4,
                    buffers: vec![IoSliceMut::new(&mut past_end)],
                },
            ];
            let results = submitter.run(&mut ops, &pool());
            assert!(results[0].is_ok() && results[1].is_ok());
            assert_eq!(results[2].as_ref().unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
            drop(ops);
            assert_eq!(back, expected, "io_uring {wanted}");
        }
    }
}
