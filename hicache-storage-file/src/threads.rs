//! The tier's threads (its I/O pool, the threads writing behind and reading ahead), started through
//! [`hicache_core::threads::Threads`]: each owner drops what feeds its threads first, and its `Threads` then waits for
//! them, so a backend dropped has no thread left (a process exiting right after reports no thread-local state as
//! leaked, and a caller removing the directory next races none of them).

use std::time::Duration;

pub(crate) use hicache_core::threads::Threads;

/// How long dropping a backend's [`Threads`] waits for them to end.
const JOIN_WAIT: Duration = Duration::from_secs(30);

/// No threads yet, waited for up to [`JOIN_WAIT`] when dropped.
pub(crate) fn threads() -> Threads {
    Threads::new("the file tier", JOIN_WAIT)
}

/// A thread pool of `count` threads named `name-<index>`, started through `threads`.
pub(crate) fn pool(
    threads: &Threads,
    count: usize,
    name: &str,
) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(count)
        .spawn_handler(|thread| threads.spawn(format!("{name}-{}", thread.index()), move || thread.run()))
        .build()
}

#[cfg(test)]
mod tests {
    use hicache_core::testing::thread_ends;

    use super::*;

    #[test]
    fn dropping_a_pool_then_its_threads_leaves_no_pool_thread_running() {
        let threads = threads();
        let pool = pool(&threads, 3, "test-pool").unwrap();
        pool.broadcast(|_| thread_ends::mark());
        assert_eq!(thread_ends::freed(), 0, "no thread has ended yet");
        // the pool first, as in the tier's owners
        drop(pool);
        drop(threads);
        assert_eq!(thread_ends::freed(), 3, "every pool thread's thread-local state is freed");
    }
}
