//! Read-ahead for sequential reads of a segment: which ranges to read ahead, and when to drop them.
//!
//! A returning conversation's pages are read back in the order they were written, a batch at a time, and a
//! segment holds a writer's batches side by side: the reads of one prefix walk forward through a segment. Each such
//! batch, read on its own, waits for the disk once per batch and leaves it idle while the pages are checked and
//! handed back. Like the kernel's read-ahead for a file read sequentially, a batch that continues a forward walk
//! has the next window of the segment read (in large requests, without waiting for them), and the batches that
//! follow take what arrived meanwhile. A batch that continues no walk (random access) starts none, and nothing is
//! read ahead past the pages the segment's records name. What the walk has passed is dropped behind it.
//!
//! The plans say where the window is; the store reads it into its own memory when it reads with `O_DIRECT`
//! (`window.rs`), and otherwise asks the kernel to read it into the page cache, dropping it from there behind the
//! walk (on a disk that reads 7 GB/s, the page cache's bookkeeping made 4 KiB pages read at 0.43 of the disk through
//! the window, slower than with no read-ahead: 0.61).
//!
//! A long batch reads nothing ahead (and ends the walk it continues, dropping its window): its own reads go out
//! together and keep the disk busy most of the time. Through the page cache a batch of [`STEP`] bytes is long (on
//! that disk, 32 KiB pages, in batches of 4 MiB, read at 0.47 of the disk through the page cache's window and 0.81
//! without it). Into the store's own windows only a batch of the whole window or more is long: reading the next
//! window costs no more than reading the batch, and batches of 4 MiB read on their own leave the disk idle while
//! each is checked and the next is asked for (32 KiB pages read at 0.74–0.83 of the disk on their own on two disks,
//! and at 0.86–1.15 with the 8 MiB window on one of them).

use std::sync::Mutex;

/// The most walks followed at once (one per prefix being read back; the least recently continued goes first).
const STREAMS: usize = 32;
/// The most bytes asked for at once.
const STEP: u64 = 2 << 20;

/// A forward walk through one segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stream {
    segment: u32,
    /// Where the last batch ended.
    next: u64,
    /// The window asked for and not yet dropped: `[from, ahead)`.
    from: u64,
    ahead: u64,
    /// When it was last continued (a count of plans).
    used: u64,
}

/// What to do for one batch's reads of a segment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Pages inside `[from, to)` were asked for ahead: read them from the page cache.
    pub(crate) cached: (u64, u64),
    /// Ask the kernel to read `[from, to)` ahead.
    pub(crate) fetch: Option<(u64, u64)>,
    /// `[from, to)` was read: drop it from the page cache.
    pub(crate) release: Option<(u64, u64)>,
}

/// The walks followed, and the window.
#[derive(Debug)]
pub(crate) struct ReadAhead {
    window: u64,
    /// Batches of at least this many bytes read on their own.
    long: u64,
    streams: Mutex<(Vec<Stream>, u64)>,
}

impl ReadAhead {
    /// Reads `window` bytes ahead of each walk, into the page cache; 0 reads nothing ahead.
    pub(crate) fn new(window: u64) -> Self {
        Self { window, long: STEP, streams: Mutex::new((Vec::new(), 0)) }
    }

    /// Reads `window` bytes ahead of each walk into the store's own windows, for batches shorter than the window.
    pub(crate) fn into_windows(window: u64) -> Self {
        Self { long: window.max(STEP), ..Self::new(window) }
    }

    /// How far a walk goes between two requests: a step of the window, at most [`STEP`].
    fn step(&self) -> u64 {
        (self.window / 2).clamp(1, STEP)
    }

    /// A batch reads `[start, end)` (the first and last byte of its pages) of segment `segment`, whose records
    /// name pages up to `data_end`.
    pub(crate) fn plan(&self, segment: u32, start: u64, end: u64, data_end: u64) -> Plan {
        if self.window == 0 || end <= start {
            return Plan::default();
        }
        let mut guard = self.streams.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (streams, clock) = &mut *guard;
        *clock += 1;
        // a batch continues a walk when it starts where the walk is (a window behind it, for batches of one walk
        // read by several threads that finish out of order, up to where the walk's window ends)
        let continued = streams.iter().position(|stream| {
            stream.segment == segment && start + self.window >= stream.next && start <= stream.ahead.max(stream.next)
        });
        if end - start >= self.long {
            // a long batch reads on its own: the walk it continues ends, and its window is dropped
            let ended = continued.map(|index| streams.swap_remove(index));
            let release = ended.filter(|stream| stream.from < stream.ahead).map(|stream| (stream.from, stream.ahead));
            return Plan { release, ..Plan::default() };
        }
        let Some(index) = continued else {
            if streams.len() == STREAMS
                && let Some(oldest) = (0..streams.len()).min_by_key(|&index| streams[index].used)
            {
                streams.swap_remove(oldest);
            }
            streams.push(Stream { segment, next: end, from: end, ahead: end, used: *clock });
            return Plan::default();
        };
        let stream = streams[index];
        let mut plan = Plan { cached: (stream.from, stream.ahead), fetch: None, release: None };
        streams[index].used = *clock;
        if end <= stream.next {
            // a batch of the walk that finished late, or a read behind it: nothing new to ask for
            return plan;
        }
        let next = end;
        // the next window is asked for once the walk is half way through the one asked for, leaving out what
        // another walk through the segment holds
        let reach = next.saturating_add(self.window).min(data_end);
        let (mut from, mut ahead) = (stream.from, stream.ahead);
        if ahead <= start {
            // the walk jumped past its window: drop the window and start a new one where the batch ends
            if from < ahead {
                plan.release = Some((from, ahead));
            }
            (from, ahead) = (next, next);
        }
        let base = ahead.max(next);
        if ahead + self.step() <= next.saturating_add(self.window) && reach > base {
            let (mut first, mut last) = (base, reach);
            let others: Vec<&Stream> = streams
                .iter()
                .enumerate()
                .filter(|&(other, s)| other != index && s.segment == segment)
                .map(|(_, s)| s)
                .collect();
            while let Some(held) = others.iter().find(|held| held.from <= first && first < held.ahead) {
                first = held.ahead;
            }
            for held in &others {
                if first < held.from && held.from < last {
                    last = held.from;
                }
            }
            if first < last {
                plan.fetch = Some((first, last));
                ahead = last;
            }
        }
        // what the walk left behind, dropped a half window at a time
        let behind = start.min(ahead);
        if plan.release.is_none() && behind >= from.saturating_add(self.step()) {
            plan.release = Some((from, behind));
            from = behind;
        }
        let stream = &mut streams[index];
        stream.next = next;
        stream.from = from;
        stream.ahead = ahead;
        plan
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const PAGE: u64 = 4096;
    const BATCH: u64 = 128 * PAGE;

    /// A walk through a segment a batch at a time: from its second batch on, every batch but the ones the walk
    /// starts with is read from the window, the window never passes the data, and what is dropped lies behind.
    #[test]
    fn a_forward_walk_is_read_ahead_and_dropped_behind() {
        let window = 8 * BATCH;
        let ahead = ReadAhead::new(window);
        let data_end = 100 * BATCH;
        let mut fetched = Vec::new();
        let mut released = Vec::new();
        let mut from_cache = 0;
        for batch in 0..100 {
            let (start, end) = (batch * BATCH, (batch + 1) * BATCH);
            let plan = ahead.plan(7, start, end, data_end);
            if plan.cached.0 <= start && end <= plan.cached.1 {
                from_cache += 1;
                // what the batch reads from the cache was asked for by an earlier batch
                assert!(fetched.iter().any(|&(from, to)| from <= start && end <= to), "batch {batch}");
            }
            if let Some((from, to)) = plan.fetch {
                assert!(from < to && to <= data_end && from >= end, "batch {batch}: fetch {from}..{to}");
                fetched.push((from, to));
            }
            if let Some((from, to)) = plan.release {
                assert!(to <= start, "batch {batch}: released {from}..{to} ahead of the walk");
                released.push((from, to));
            }
        }
        assert_eq!(from_cache, 98, "the first two batches go to the disk, the rest come from the window");
        assert!(released.len() > 10);
    }

    /// A walk whose batches grow to a step or more stops reading ahead and drops its window; short batches start
    /// a walk again.
    #[test]
    fn long_batches_read_on_their_own() {
        let ahead = ReadAhead::new(8 * BATCH);
        let data_end = 100 * BATCH;
        for batch in 0..4 {
            ahead.plan(2, batch * BATCH, (batch + 1) * BATCH, data_end);
        }
        let window = held(&ahead, 2);
        assert_eq!(window.len(), 1);
        assert!(window[0].0 < window[0].1, "the walk holds a window: {window:?}");
        let long = STEP.div_ceil(BATCH);
        let plan = ahead.plan(2, 4 * BATCH, (4 + long) * BATCH, data_end);
        assert_eq!(plan, Plan { release: Some(window[0]), ..Plan::default() });
        assert!(held(&ahead, 2).is_empty(), "the walk ended");
        let plan = ahead.plan(2, (4 + long) * BATCH, (8 + long) * BATCH, data_end);
        assert_eq!(plan, Plan::default(), "a long batch starts no walk");
        assert!(held(&ahead, 2).is_empty());
        for batch in 20..23 {
            ahead.plan(2, batch * BATCH, (batch + 1) * BATCH, data_end);
        }
        assert_eq!(held(&ahead, 2).len(), 1, "short batches walk again");
    }

    /// Into the store's own windows, batches of half the window (4 MiB of an 8 MiB window: 128 pages of 32 KiB) are
    /// read ahead from the walk's third batch on, where through the page cache they read on their own; a batch of
    /// the whole window reads on its own either way.
    #[test]
    fn batches_shorter_than_the_window_read_ahead_into_windows() {
        let (window, batch) = (16 * BATCH, 8 * BATCH);
        let data_end = 100 * batch;
        let walk = |ahead: &ReadAhead, segment: u32| {
            let mut from_window = 0;
            for index in 0..100 {
                let (start, end) = (index * batch, (index + 1) * batch);
                let plan = ahead.plan(segment, start, end, data_end);
                if plan.cached.0 <= start && end <= plan.cached.1 {
                    from_window += 1;
                }
            }
            from_window
        };
        assert_eq!(walk(&ReadAhead::into_windows(window), 4), 98);
        assert_eq!(walk(&ReadAhead::new(window), 4), 0);
        let ahead = ReadAhead::into_windows(window);
        for index in 0..4 {
            ahead.plan(5, index * batch, (index + 1) * batch, data_end);
        }
        let held_before = held(&ahead, 5);
        assert_eq!(held_before.len(), 1);
        let plan = ahead.plan(5, 4 * batch, 4 * batch + window, data_end);
        assert_eq!(plan, Plan { release: Some(held_before[0]), ..Plan::default() }, "a window's batch is long");
    }

    /// Random reads start no read-ahead.
    #[test]
    fn random_reads_fetch_nothing() {
        let ahead = ReadAhead::new(8 * BATCH);
        for batch in [50u64, 3, 90, 17, 60, 1, 33, 75] {
            let plan = ahead.plan(1, batch * BATCH, (batch + 1) * BATCH, 100 * BATCH);
            assert_eq!(plan.fetch, None, "batch {batch}");
        }
    }

    /// The windows the walks through `segment` hold now.
    fn held(ahead: &ReadAhead, segment: u32) -> Vec<(u64, u64)> {
        let streams = ahead.streams.lock().unwrap();
        streams.0.iter().filter(|stream| stream.segment == segment).map(|stream| (stream.from, stream.ahead)).collect()
    }

    /// Asks for `[from, to)` of a segment whose walks hold `held`: true when no walk holds any of it.
    fn disjoint((from, to): (u64, u64), held: &[(u64, u64)]) -> bool {
        !held.iter().any(|&(held_from, held_to)| from < held_to && held_from < to)
    }

    /// Two walks through one segment, the second close behind the first: the second asks only for what the
    /// first does not hold.
    #[test]
    fn a_walk_behind_another_asks_only_for_what_it_lacks() {
        let ahead = ReadAhead::new(8 * BATCH);
        let data_end = 100 * BATCH;
        let mut total = 0;
        let mut read = |batch: u64| {
            let before = held(&ahead, 3);
            let plan = ahead.plan(3, batch * BATCH, (batch + 1) * BATCH, data_end);
            if let Some(fetch) = plan.fetch {
                assert!(disjoint(fetch, &before), "batch {batch}: {fetch:?} is held: {before:?}");
                total += fetch.1 - fetch.0;
            }
        };
        // the first walk is 20 batches in when the second starts at 10; with windows of 8 batches the second
        // walk's window reaches into the first's
        for batch in 0..20 {
            read(batch);
        }
        for batch in 0..30 {
            read(10 + batch);
            read(20 + batch);
        }
        // the second walk asks again for what the first dropped behind it, no more
        assert!(total <= data_end + 20 * BATCH, "{total} bytes asked for of {data_end}");
    }

    proptest! {
        /// Whatever the reads, across segments: a fetch lies inside the data and past where the batch started,
        /// no walk holds what it asks for, and a release lies behind where the batch starts. The walks followed
        /// stay bounded.
        #[test]
        fn fetches_stay_in_the_data_and_releases_behind(
            reads in prop::collection::vec((0u32..3, 0u64..64, 1u64..6), 1..200),
            window_batches in 0u64..6,
            into_windows: bool,
        ) {
            let window = window_batches * BATCH;
            let ahead = if into_windows { ReadAhead::into_windows(window) } else { ReadAhead::new(window) };
            let data_end = 60 * BATCH;
            for (segment, first, count) in reads {
                let (start, end) = (first * BATCH, (first + count) * BATCH);
                let before = held(&ahead, segment);
                let plan = ahead.plan(segment, start, end, data_end);
                if let Some((from, to)) = plan.release {
                    // a long batch drops the whole window of the walk it ends
                    let long = end - start >= ahead.long;
                    prop_assert!((to <= start || long) && from < to, "released {from}..{to} for a batch from {start}");
                }
                if end - start >= ahead.long {
                    prop_assert_eq!((plan.cached, plan.fetch), ((0, 0), None), "a long batch reads on its own");
                }
                if let Some((from, to)) = plan.fetch {
                    prop_assert!(from < to && to <= data_end && from > start, "fetched {from}..{to} for {start}..{end}");
                    prop_assert!(disjoint((from, to), &before), "{from}..{to} is held: {before:?}");
                }
                prop_assert!(ahead.streams.lock().unwrap().0.len() <= STREAMS);
            }
        }
    }
}
