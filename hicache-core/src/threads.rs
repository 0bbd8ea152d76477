//! Threads an owner starts, waited for when it goes.
//!
//! The controller's storage I/O threads and a storage tier's own threads end on their own once whatever feeds them
//! is dropped. Left at that, an owner dropped is still ending on its threads a moment later: what they hold (a
//! registration of the host pool, open files) is let go after the caller went on, their thread-local state is freed
//! after it, a process exiting just then reports that state as leaked, and a caller that removes a directory next
//! races threads that may still use it. [`Threads`] counts its threads down as they end and joins them when it is
//! dropped, which its owner does after whatever feeds them stopped, so an owner dropped has no thread left.
//!
//! Every wait has a deadline: a thread still running when it passes (one stuck in a call into a service) is left to
//! end on its own, with a warning naming it. A thread that drops its own `Threads` (it held the last reference to
//! their owner) waits for the others only.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Threads started through [`Threads::spawn`], joined when this is dropped (up to the deadline given to
/// [`Threads::new`]; threads still running then are named in a warning and left to end on their own).
#[derive(Debug)]
pub struct Threads {
    /// Whose threads they are, for the warnings ("the file tier").
    owner: &'static str,
    /// How long dropping waits for them to end.
    wait: Duration,
    handles: Mutex<Vec<JoinHandle<()>>>,
    running: Arc<Running>,
}

/// The threads not ended yet, and the condition raised whenever one ends.
#[derive(Debug, Default)]
struct Running {
    count: Mutex<usize>,
    ended: Condvar,
}

/// Counts its thread as ended when dropped: when the thread's work returns, or unwinds.
struct Ending(Arc<Running>);

impl Drop for Ending {
    fn drop(&mut self) {
        *self.0.count.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) -= 1;
        self.0.ended.notify_all();
    }
}

impl Threads {
    /// No threads yet; `owner` names them in warnings, and dropping waits up to `wait` for them.
    #[must_use]
    pub fn new(owner: &'static str, wait: Duration) -> Self {
        Self { owner, wait, handles: Mutex::new(Vec::new()), running: Arc::default() }
    }

    /// Starts a thread named `name` running `work`. Whatever `work` owns is dropped before the thread counts as
    /// ended.
    ///
    /// # Errors
    ///
    /// The system's error when it cannot start a thread.
    pub fn spawn(&self, name: String, work: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        *self.running.count.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) += 1;
        // counted from here: if the thread does not start, the closure (and this guard in it) is dropped here
        let ending = Ending(self.running.clone());
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            let _ending = ending;
            work();
        })?;
        self.handles.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(handle);
        Ok(())
    }

    /// Waits (up to the deadline given to [`Threads::new`]) until every thread but the caller has ended, and joins
    /// them; whether they all had. Threads still running at the deadline are named in a warning and left to end on
    /// their own.
    fn join(&mut self) -> bool {
        let handles = std::mem::take(self.handles.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()));
        let me = std::thread::current().id();
        let (own, others): (Vec<_>, Vec<_>) = handles.into_iter().partition(|handle| handle.thread().id() == me);
        let deadline = Instant::now() + self.wait;
        let mut count = self.running.count.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        while *count > own.len() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                drop(count);
                let running: Vec<&str> = others
                    .iter()
                    .filter(|handle| !handle.is_finished())
                    .map(|handle| handle.thread().name().unwrap_or("unnamed"))
                    .collect();
                tracing::warn!(
                    threads = ?running,
                    waited_ms = self.wait.as_millis() as u64,
                    "threads of {} had not ended: they are left to end on their own",
                    self.owner
                );
                return false;
            };
            count = self.running.ended.wait_timeout(count, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
        }
        drop(count);
        // each has returned from its work; joining waits for its thread-local state to be freed
        for handle in others {
            let name = handle.thread().name().map(str::to_owned);
            if handle.join().is_err() {
                tracing::warn!(thread = ?name, "a thread of {} panicked", self.owner);
            }
        }
        true
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        self.join();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;

    use super::*;
    use crate::testing::thread_ends;

    fn threads() -> Threads {
        Threads::new("a test", Duration::from_secs(30))
    }

    #[test]
    fn dropping_them_waits_until_each_thread_has_freed_its_thread_local_state() {
        let threads = threads();
        let (jobs, queue) = channel::<()>();
        let queue = Arc::new(Mutex::new(queue));
        for index in 0..3 {
            let queue = queue.clone();
            threads
                .spawn(format!("test-{index}"), move || {
                    thread_ends::mark();
                    while queue.lock().unwrap().recv().is_ok() {}
                })
                .unwrap();
        }
        jobs.send(()).unwrap();
        assert_eq!(thread_ends::freed(), 0, "no thread has ended yet");
        // what feeds them stops first, as in their owners
        drop(jobs);
        drop(threads);
        assert_eq!(thread_ends::freed(), 3, "every thread's thread-local state is freed");
    }

    #[test]
    fn what_a_thread_owns_is_dropped_before_dropping_them_returns() {
        let owned = Arc::new(());
        let threads = threads();
        let (jobs, queue) = channel::<()>();
        let theirs = owned.clone();
        threads
            .spawn("test-owner".into(), move || {
                let _theirs = theirs;
                while queue.recv().is_ok() {}
            })
            .unwrap();
        assert_eq!(Arc::strong_count(&owned), 2);
        drop(jobs);
        drop(threads);
        assert_eq!(Arc::strong_count(&owned), 1, "the thread's share went with it");
    }

    #[test]
    fn a_thread_dropping_its_own_threads_waits_for_the_others_only() {
        let threads = threads();
        let (stop, stopped) = channel::<()>();
        let (hand, handed) = channel::<Threads>();
        let (report, reported) = channel::<bool>();
        threads.spawn("test-other".into(), move || stopped.recv().unwrap_or(())).unwrap();
        threads
            .spawn("test-own".into(), move || {
                // the last reference goes on one of its own threads (waiting for itself would time out)
                let mut threads = handed.recv().unwrap();
                report.send(threads.join()).unwrap();
            })
            .unwrap();
        stop.send(()).unwrap();
        hand.send(threads).unwrap();
        assert!(reported.recv().unwrap(), "the other thread ended and was joined");
    }

    #[test]
    fn a_thread_still_running_at_the_deadline_is_left_and_reported() {
        let mut threads = Threads::new("a test", Duration::from_millis(50));
        let (stop, stopped) = channel::<()>();
        threads.spawn("test-stuck".into(), move || stopped.recv().unwrap_or(())).unwrap();
        assert!(!threads.join(), "the thread was still running");
        // it ends once let go, and is counted as ended
        stop.send(()).unwrap();
        let count = threads.running.count.lock().unwrap();
        let count = threads.running.ended.wait_timeout_while(count, Duration::from_secs(30), |count| *count > 0);
        assert_eq!(*count.unwrap().0, 0);
    }

    #[test]
    fn a_thread_that_panics_is_counted_as_ended() {
        let mut threads = threads();
        threads.spawn("test-panics".into(), || panic!("a test panic (expected)")).unwrap();
        assert!(threads.join());
        assert_eq!(*threads.running.count.lock().unwrap(), 0);
    }
}
