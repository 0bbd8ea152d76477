//! Threads a backend starts, waited for when it goes.
//!
//! The tier's threads (its I/O pool, the threads writing behind and reading ahead) end on their own once whatever
//! feeds them is dropped. Left at that, a backend dropped is still ending on its threads a moment later: their
//! thread-local state is freed after the caller went on, a process exiting just then reports it as leaked, and a
//! caller that removes the directory next races threads that may still hold its files. [`Threads`] counts its
//! threads down as they end and joins them when it is dropped (after whatever feeds them stopped), so a backend
//! dropped has no thread left. The wait has a deadline ([`JOIN_WAIT`]); a thread not ended by then is left to end
//! on its own, with a warning. A thread that drops its own `Threads` (it held the last reference to their owner)
//! waits for the others only.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long dropping [`Threads`] waits for them to end.
pub(crate) const JOIN_WAIT: Duration = Duration::from_secs(30);

/// Threads started through [`Threads::spawn`], joined when this is dropped.
#[derive(Debug, Default)]
pub(crate) struct Threads {
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
    /// Starts a thread named `name` running `work`.
    pub(crate) fn spawn(&self, name: String, work: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        *self.running.count.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) += 1;
        let ending = Ending(self.running.clone());
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            let _ending = ending;
            work();
        })?;
        self.handles.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(handle);
        Ok(())
    }

    /// A thread pool of `threads` threads named `name-<index>`, started here.
    pub(crate) fn pool(&self, threads: usize, name: &str) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .spawn_handler(|thread| self.spawn(format!("{name}-{}", thread.index()), move || thread.run()))
            .build()
    }

    /// Waits (up to [`JOIN_WAIT`]) until every thread but the caller has ended, and joins them; whether they all
    /// had.
    fn join(&mut self) -> bool {
        let handles = std::mem::take(self.handles.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner()));
        let me = std::thread::current().id();
        let (own, others): (Vec<_>, Vec<_>) = handles.into_iter().partition(|handle| handle.thread().id() == me);
        let deadline = Instant::now() + JOIN_WAIT;
        let mut count = self.running.count.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        while *count > own.len() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                tracing::warn!(
                    threads = *count - own.len(),
                    seconds = JOIN_WAIT.as_secs(),
                    "threads of the file tier had not ended: they are left to end on their own"
                );
                return false;
            };
            count = self.running.ended.wait_timeout(count, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0;
        }
        drop(count);
        // each has returned from its work; joining waits for its thread-local state to be freed
        for handle in others {
            if handle.join().is_err() {
                tracing::warn!("a thread of the file tier panicked");
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
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc::channel;

    use super::*;

    /// Raised when a thread's thread-local value is freed, the last thing a thread does.
    static FREED: AtomicUsize = AtomicUsize::new(0);

    struct Local;

    impl Drop for Local {
        fn drop(&mut self) {
            FREED.fetch_add(1, Ordering::SeqCst);
        }
    }

    thread_local! {
        static LOCAL: Local = const { Local };
    }

    #[test]
    fn dropping_them_waits_until_each_thread_has_freed_its_thread_local_state() {
        let threads = Threads::default();
        let (jobs, queue) = channel::<()>();
        let queue = Arc::new(Mutex::new(queue));
        for index in 0..3 {
            let queue = queue.clone();
            threads
                .spawn(format!("test-{index}"), move || {
                    LOCAL.with(|_| ());
                    while queue.lock().unwrap().recv().is_ok() {}
                })
                .unwrap();
        }
        let pool = threads.pool(2, "test-pool").unwrap();
        pool.broadcast(|_| LOCAL.with(|_| ()));
        assert_eq!(FREED.load(Ordering::SeqCst), 0, "no thread has ended yet");
        // what feeds them stops first, as in the tier's owners
        drop(jobs);
        drop(pool);
        drop(threads);
        assert_eq!(FREED.load(Ordering::SeqCst), 5, "every thread's thread-local state is freed");
    }

    #[test]
    fn a_thread_dropping_its_own_threads_waits_for_the_others_only() {
        let threads = Threads::default();
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
    fn a_thread_that_panics_is_counted_as_ended() {
        let mut threads = Threads::default();
        threads.spawn("test-panics".into(), || panic!("a test panic (expected)")).unwrap();
        assert!(threads.join());
        assert_eq!(*threads.running.count.lock().unwrap(), 0);
    }
}
