//! A probe of threads' ends for tests of code that joins its threads: a thread-local value whose destructor, the
//! last thing a thread runs, is counted. A thread that called [`mark`] and has been joined counts in [`freed`];
//! one still ending does not yet.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The marked threads' thread-local values freed so far, in this process.
static FREED: AtomicUsize = AtomicUsize::new(0);

struct Marker;

impl Drop for Marker {
    fn drop(&mut self) {
        FREED.fetch_add(1, Ordering::SeqCst);
    }
}

thread_local! {
    static MARKER: Marker = const { Marker };
}

/// Marks the calling thread: its end is counted in [`freed`].
pub fn mark() {
    MARKER.with(|_| ());
}

/// How many marked threads have freed their thread-local state (a process-wide count: a test reading it should be
/// the only one in its binary that marks threads).
#[must_use]
pub fn freed() -> usize {
    FREED.load(Ordering::SeqCst)
}
