//! A prefetch's [`Progress`]: the tokens the fetch thread has brought into host memory, counted only after their bytes
//! are there, and a terminate flag the scheduler sets: after termination no increment succeeds, so the count it read
//! is final.

use std::fmt;

use crate::sync::{AtomicU64, Ordering};

/// A completed-token counter with a terminate flag, shared by an I/O worker and the scheduler.
///
/// The worker calls `increment` after the pages' bytes are in host memory; the increment is a release, and
/// `terminate` and [`completed`](Self::completed) are acquires, so a reader that sees `n` completed tokens also sees
/// their bytes. Once terminated, no increment succeeds: the count read at termination is final. One word holds both,
/// so the flag and the count change together.
#[derive(Default)]
pub struct Progress {
    /// Bit 63: terminated. Bits 0–62: completed tokens.
    word: AtomicU64,
}

const TERMINATED: u64 = 1 << 63;

/// An increment refused because the operation was terminated first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Terminated {
    /// The final count.
    pub completed: u64,
}

impl Progress {
    /// Adds `tokens` unless terminated; returns the new count.
    ///
    /// # Errors
    ///
    /// [`Terminated`] with the final count when the operation was terminated before this increment.
    ///
    /// # Panics
    ///
    /// When the count would reach 2^63 tokens (a caller bug).
    pub(crate) fn increment(&self, tokens: u64) -> Result<u64, Terminated> {
        let mut current = self.word.load(Ordering::Relaxed);
        loop {
            if current & TERMINATED != 0 {
                return Err(Terminated { completed: current & !TERMINATED });
            }
            let next = current.checked_add(tokens).filter(|next| next & TERMINATED == 0).expect("token count overflow");
            match self.word.compare_exchange_weak(current, next, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return Ok(next),
                Err(actual) => current = actual,
            }
        }
    }

    /// Marks the operation terminated and returns the final count.
    pub(crate) fn terminate(&self) -> u64 {
        self.word.fetch_or(TERMINATED, Ordering::AcqRel) & !TERMINATED
    }

    /// Tokens completed so far.
    pub fn completed(&self) -> u64 {
        self.word.load(Ordering::Acquire) & !TERMINATED
    }

    /// Whether [`terminate`](Self::terminate) was called.
    pub(crate) fn is_terminated(&self) -> bool {
        self.word.load(Ordering::Acquire) & TERMINATED != 0
    }
}

impl fmt::Debug for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Progress")
            .field("completed", &self.completed())
            .field("terminated", &self.is_terminated())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn increments_after_terminate_fail_with_the_final_count() {
        let progress = Progress::default();
        assert_eq!(progress.increment(64), Ok(64));
        assert_eq!(progress.increment(64), Ok(128));
        assert_eq!(progress.terminate(), 128);
        assert_eq!(progress.increment(64), Err(Terminated { completed: 128 }));
        assert!(progress.is_terminated());
        assert_eq!(progress.completed(), 128);
        assert_eq!(progress.terminate(), 128, "terminating twice keeps the count");
    }
}

#[cfg(all(test, loom))]
#[expect(unsafe_code, reason = "loom's UnsafeCell stands for the host page the worker writes and the scheduler reads")]
mod loom_tests {
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    use super::*;

    /// Data written before it is counted: a scheduler that terminates and reads `n` completed pages must see every one
    /// of those pages' bytes, whichever way the worker's writes and increments interleave with the termination.
    #[test]
    fn terminated_count_covers_only_written_pages() {
        loom::model(|| {
            let progress = Arc::new(Progress::default());
            let pages = Arc::new([UnsafeCell::new(0u8), UnsafeCell::new(0u8)]);
            let worker = {
                let (progress, pages) = (progress.clone(), pages.clone());
                loom::thread::spawn(move || {
                    for (index, page) in pages.iter().enumerate() {
                        page.with_mut(|byte| {
                            // SAFETY: the scheduler reads page `index` only after the count includes it, and the
                            // count includes it only after this write (the increment below); loom checks exactly this.
                            unsafe { *byte = index as u8 + 1 }
                        });
                        if progress.increment(1).is_err() {
                            break;
                        }
                    }
                })
            };
            let completed = progress.terminate() as usize;
            for (index, page) in pages.iter().take(completed).enumerate() {
                // SAFETY: as above: page `index` is counted, so its write happened before and no write follows.
                page.with(|byte| assert_eq!(unsafe { *byte }, index as u8 + 1));
            }
            worker.join().unwrap();
            assert_eq!(progress.completed() as usize, completed, "nothing counted after termination");
        });
    }
}
