//! Prefetch from storage and the scheduler's tick: the one point where TP ranks agree on everything that can differ
//! between them (docs/sglang.md#prefetch to #release, #tp; fixes #fixed-1, #fixed-2, #fixed-16 and #fixed-18).
//!
//! A prefetch goes through these steps, each decided at a tick from values reduced over the TP group, so every rank
//! changes its allocator in the same way at the same tick:
//!
//! 1. [`prefetch`](CacheController::prefetch) queues a hit query. No host memory is reserved yet (SGLang reserves
//!    the whole prompt before it knows the hit, and may evict L2 for it: docs/sglang.md#fixed-18).
//! 2. While the queries run, each tick reserves host pages for the leading hit every rank has found so far (the TP
//!    minimum of the pages found), once it reaches the threshold, from pages free now, and the fetch thread starts
//!    reading them: a long hit is read while its later batches are still being asked for. When every rank's query
//!    is done, the TP minimum of the hit decides: below the threshold the prefetch is revoked (nothing was reserved
//!    then); otherwise host pages are reserved for the rest of the hit (evicting through the caller's callback when
//!    the pool is short; when even that leaves too few, the hit is cut to what fits) and the fetch thread reads them.
//! 3. The scheduler asks for the result with [`finish_prefetch`](CacheController::finish_prefetch). `best_effort`
//!    terminates the fetch at once; `wait_complete` waits until every rank's fetch is done; `timeout` waits until
//!    done or until any rank's limit passed. `best_effort` and `timeout` (at its limit) do not wait for a hit query
//!    still running either (its storage may hang): the part agreed so far is all the prefetch gets. When every
//!    rank's count is final, the TP minimum of the fetched tokens is the result: those pages go to the caller,
//!    already in the backup state.
//! 4. Pages past the minimum go back to the allocator when every rank's fetch thread is quiet (it will not touch them
//!    again): released by (operation, page range), exactly once, on the scheduler's thread (docs/sglang.md#fixed-1 and
//!    #fixed-2).
//!
//! The tick's collective has a fixed shape whatever the local state: two counters (write acks, backup acks) and
//! [`StorageSettings::tick_slots`](super::StorageSettings::tick_slots) prefetch slots of seven values, all reduced
//! with one MIN (a MAX is a MIN of the negation). Every rank enters it once per tick, so no rank can skip a
//! collective another enters (docs/sglang.md#fixed-16).

use std::sync::Arc;
use std::time::Duration;

use super::storage::{PrefetchExplanation, PrefetchShared, PrefetchStop};
use super::{Ack, BackupReport, CacheController};
use crate::collective::{Collective, ReduceOp};
use crate::config::PrefetchPolicy;
use crate::cost::{ENCODED, Hit, Plan, Rates, plan};
use crate::error::Error;
use crate::hash::PageKey;
use crate::host_pool::HostPageId;
use crate::ops::OpId;
use crate::transfer::TransferEngine;

/// Values per prefetch slot in the tick's collective.
const SLOT_VALUES: usize = 7;
/// Values before the slots: completed writes, completed backups, then the rates of the cost model (each negated, so
/// the MIN is the slowest rank's).
const HEADER: usize = 2 + ENCODED;

/// The answer of [`CacheController::prefetch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefetchStart {
    /// Queued; the result comes from a later tick.
    Started(OpId),
    /// Not started, and why.
    Refused(PrefetchStop),
}

/// What a pending prefetch leaves to the engine to compute before it asks for the result
/// ([`CacheController::prefetch_head`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchHead {
    /// The hit query runs and its plan may still split the hit: an engine that computes heads waits before it
    /// asks for the result (asking first rules a split out).
    NotPlanned,
    /// Nothing: the prefetch fetches from the start of its tokens (or there is no pending prefetch).
    Nothing,
    /// A split: the engine computes these first tokens of the prefetch's tokens and inserts their KV, then asks for
    /// the result.
    Compute(usize),
}

/// A prefetch whose result is known on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefetchDone {
    /// The request.
    pub request_id: String,
    /// Tokens at the start of the prefetch's tokens that were not fetched because the engine computes them (a
    /// split plan's head): the fetched pages follow them.
    pub head_tokens: usize,
    /// Host pages holding the fetched tokens, in order, in the backup state; the caller owns them now (insert them
    /// into the tree, or give them back with [`CacheController::evict_host`]).
    pub host_pages: Vec<HostPageId>,
    /// Their page keys.
    pub keys: Vec<PageKey>,
    /// Everything about how it went.
    pub explanation: PrefetchExplanation,
}

/// What a tick decided.
#[derive(Debug)]
pub struct TickReport<E> {
    /// Device → host writes acked on every rank; their host pages are synced now.
    pub write_acks: Vec<Ack<E>>,
    /// Backups to storage finished on every rank; their host pages are unpinned.
    pub backups: Vec<BackupReport>,
    /// Prefetches whose results are known.
    pub prefetches: Vec<PrefetchDone>,
}

#[derive(Debug)]
enum Stage {
    /// The hit query runs. `pages` hold the leading hit every rank has found so far (reserved once it reached the
    /// threshold) and are queued for the fetch thread already.
    Querying { pages: Vec<HostPageId>, keys: Vec<PageKey> },
    /// Host pages reserved; the fetch thread reads them.
    Fetching { pages: Vec<HostPageId>, keys: Vec<PageKey> },
    /// Result given; these pages return to the allocator when every rank's fetch thread is quiet.
    Draining { tail: Vec<HostPageId> },
}

#[derive(Debug)]
pub(super) struct PrefetchEntry {
    request_id: String,
    tokens: usize,
    started_at: Duration,
    shared: Arc<PrefetchShared>,
    stage: Stage,
    /// The scheduler asked for the result.
    wanted: bool,
    aborted: bool,
    /// Some rank's `timeout` limit had passed at the last tick.
    timed_out: bool,
    /// Some rank's prefetch had made no progress within the read deadline at the last tick.
    stalled: bool,
    /// This rank's progress (pages found plus tokens fetched) and when it last changed.
    progress_mark: (u64, Duration),
    /// Tokens counted against the prefetch capacity.
    admitted: u64,
    /// The host pool could not hold the whole hit: fewer pages were reserved.
    capped: bool,
    /// Tokens the request had before the prefetch's (device and host), and its prompt's: what a cost plan weighs.
    cached_tokens: usize,
    prompt_tokens: usize,
    /// The cost plan fetched less than the hit, or the scheduler stopped waiting for the rest because computing it
    /// was expected to be faster.
    cost_cut: bool,
    /// Pages at the hit's start that a split plan leaves to the engine: the reserved pages follow them.
    head_pages: usize,
    /// When the reads of the reserved pages were first queued.
    reads_queued_at: Option<Duration>,
    /// The scheduler stopped waiting for the hit query (its policy, or an abort): why; only the part agreed before
    /// is fetched.
    query_cut: Option<PrefetchStop>,
    explanation: PrefetchExplanation,
}

impl PrefetchEntry {
    /// Terminates the prefetch; reads already queued end with a last (empty) job, so it becomes quiet.
    pub(super) fn stop_for_reset(&mut self, workers: &super::storage::Workers) {
        self.shared.progress.terminate();
        if let Stage::Querying { pages, keys } = &mut self.stage
            && !pages.is_empty()
        {
            workers.fetch(self.shared.clone(), Vec::new(), Vec::new(), true);
            self.stage = Stage::Fetching { pages: std::mem::take(pages), keys: std::mem::take(keys) };
        }
    }

    /// Waits until the fetch thread is done with the host pages (at once when none were reserved).
    pub(super) fn wait_quiet(&self) {
        if matches!(self.stage, Stage::Fetching { .. } | Stage::Draining { .. }) {
            self.shared.quiet.wait();
        }
    }

    /// Holds only `tokens` (those of the reserved pages) against the prefetch capacity from now on, not the whole
    /// request's.
    fn hold_only(&mut self, capacity: &mut crate::rate_limit::PrefetchCapacity, tokens: u64) -> Result<(), Error> {
        capacity.release(self.admitted - tokens)?;
        self.admitted = tokens;
        Ok(())
    }

    fn in_collective(&self) -> bool {
        match self.stage {
            Stage::Querying { .. } | Stage::Draining { .. } => true,
            Stage::Fetching { .. } => self.wanted || self.aborted,
        }
    }
}

/// Queues the reads of `more` host pages, for the next keys the query found (positions after the head's pages and
/// `pages`), held by
/// operation `op` in the release ledger; `last` when no more reads of this prefetch follow (then `more` may be
/// empty: the job only marks the prefetch quiet once the earlier ones are done).
#[expect(clippy::too_many_arguments, reason = "the stage's two lists are borrowed apart from the entry")]
fn queue_reads(
    storage: &mut super::StorageHalf,
    op: OpId,
    shared: &Arc<PrefetchShared>,
    head: usize,
    pages: &mut Vec<HostPageId>,
    keys: &mut Vec<PageKey>,
    more: Vec<HostPageId>,
    last: bool,
) -> Result<(), Error> {
    let first = head + pages.len();
    let more_keys = shared.found_keys(first..first + more.len());
    storage.ledger.extend(op, more.clone())?;
    storage.workers.fetch(shared.clone(), more.clone(), more_keys.clone(), last);
    pages.extend(more);
    keys.extend(more_keys);
    Ok(())
}

/// One prefetch's values in the tick's collective, before and after the MIN.
#[derive(Clone, Copy, Debug)]
struct Slot {
    hit_ready: bool,
    hit_pages: i64,
    /// The fetched count will not grow: terminated, or the fetch thread is done.
    last: bool,
    fetched_tokens: i64,
    quiet: bool,
    /// The `timeout` limit has not passed here (reduced: on no rank).
    in_time: bool,
    /// The prefetch made no progress within the read deadline here (reduced: on some rank).
    stalled: bool,
    /// Microseconds since the reads of the reserved pages were queued (0 before; reduced: the rank that queued
    /// them last).
    reading_us: i64,
}

impl Slot {
    fn write(self, out: &mut [i64]) {
        out.copy_from_slice(&[
            i64::from(self.hit_ready),
            self.hit_pages,
            i64::from(self.last),
            self.fetched_tokens,
            i64::from(self.quiet),
            // one value for both deadlines, reduced with MIN: 2 in time, 1 stalled, 0 past the `timeout` limit
            if !self.in_time {
                0
            } else if self.stalled {
                1
            } else {
                2
            },
            self.reading_us,
        ]);
    }

    fn read(values: &[i64]) -> Self {
        Self {
            hit_ready: values[0] == 1,
            hit_pages: values[1],
            last: values[2] == 1,
            fetched_tokens: values[3],
            quiet: values[4] == 1,
            in_time: values[5] >= 1,
            stalled: values[5] == 1,
            reading_us: values[6],
        }
    }
}

impl<E: TransferEngine> CacheController<E> {
    /// Starts a prefetch of `tokens` (whole pages are asked for; a partial tail is dropped) for `request_id`, chained
    /// from `last_key`, the key of the last page the request has on the host.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the request already has a prefetch.
    pub fn prefetch(
        &mut self,
        request_id: &str,
        tokens: &[u32],
        last_key: Option<PageKey>,
    ) -> Result<PrefetchStart, Error> {
        self.prefetch_after(request_id, tokens, last_key, 0)
    }

    /// As [`prefetch`](Self::prefetch), for a request that has `cached_tokens` before `tokens` (on the device and
    /// the host): the cost plan weighs computing the hit after them ([`crate::cost`]).
    ///
    /// # Errors
    ///
    /// As [`prefetch`](Self::prefetch).
    pub fn prefetch_after(
        &mut self,
        request_id: &str,
        tokens: &[u32],
        last_key: Option<PageKey>,
        cached_tokens: usize,
    ) -> Result<PrefetchStart, Error> {
        let Some(storage) = &mut self.storage else { return Ok(PrefetchStart::Refused(PrefetchStop::NoStorage)) };
        if storage.requests.contains_key(request_id) {
            return Err(Error::InvalidArgument {
                field: "request_id",
                reason: format!("request {request_id} has a prefetch already"),
            });
        }
        let whole = tokens.len() - tokens.len() % self.page_size;
        if whole < storage.settings.prefetch_threshold {
            return Ok(PrefetchStart::Refused(PrefetchStop::BelowThreshold));
        }
        if !storage.capacity.try_admit(whole as u64) {
            return Ok(PrefetchStart::Refused(PrefetchStop::CapacityLimited));
        }
        let op = self.ids.next_id();
        let shared = Arc::new(PrefetchShared::default());
        storage.workers.query(shared.clone(), tokens[..whole].to_vec(), last_key);
        let started_at = storage.clock.now();
        let explanation = PrefetchExplanation {
            request_id: request_id.to_owned(),
            op,
            requested_tokens: whole,
            threshold: storage.settings.prefetch_threshold,
            local_hit_tokens: 0,
            tp_min_hit_tokens: 0,
            reserved_tokens: 0,
            local_fetched_tokens: 0,
            fetched_tokens: 0,
            elapsed: Duration::ZERO,
            stop: PrefetchStop::Revoked,
            error: None,
            plan: None,
            query_time: Duration::ZERO,
            read_time: Duration::ZERO,
        };
        storage.requests.insert(request_id.to_owned(), op);
        storage.prefetches.insert(
            op,
            PrefetchEntry {
                request_id: request_id.to_owned(),
                tokens: whole,
                started_at,
                shared,
                stage: Stage::Querying { pages: Vec::new(), keys: Vec::new() },
                wanted: false,
                aborted: false,
                timed_out: false,
                stalled: false,
                progress_mark: (0, started_at),
                admitted: whole as u64,
                capped: false,
                cached_tokens,
                prompt_tokens: cached_tokens + tokens.len(),
                cost_cut: false,
                head_pages: 0,
                reads_queued_at: None,
                query_cut: None,
                explanation,
            },
        );
        Ok(PrefetchStart::Started(op))
    }

    /// Whether `request_id` has a prefetch whose result is not known yet.
    pub fn prefetch_pending(&self, request_id: &str) -> bool {
        self.storage.as_ref().and_then(|storage| storage.requests.get(request_id)).is_some()
    }

    /// The scheduler wants `request_id` now: its prefetch stops as the policy allows, and the result comes from a
    /// tick. `best_effort` terminates the fetch at once. False when the request has no pending prefetch.
    pub fn finish_prefetch(&mut self, request_id: &str) -> bool {
        let best_effort =
            self.storage.as_ref().is_some_and(|storage| storage.settings.policy == PrefetchPolicy::BestEffort);
        let Some(entry) = self.prefetch_entry(request_id) else { return false };
        entry.wanted = true;
        if best_effort {
            entry.shared.progress.terminate();
        }
        true
    }

    /// Aborts `request_id`'s prefetch: it stops at once and keeps nothing; its pages return at a tick. False when
    /// the request has no pending prefetch.
    pub fn abort_prefetch(&mut self, request_id: &str) -> bool {
        let Some(entry) = self.prefetch_entry(request_id) else { return false };
        entry.aborted = true;
        entry.shared.progress.terminate();
        true
    }

    fn prefetch_entry(&mut self, request_id: &str) -> Option<&mut PrefetchEntry> {
        let storage = self.storage.as_mut()?;
        let op = storage.requests.get(request_id)?;
        storage.prefetches.get_mut(op)
    }

    /// Tokens this rank has fetched so far for `request_id`'s pending prefetch.
    pub fn prefetch_progress(&self, request_id: &str) -> Option<usize> {
        let storage = self.storage.as_ref()?;
        let entry = storage.prefetches.get(storage.requests.get(request_id)?)?;
        Some(entry.shared.progress.completed() as usize)
    }

    /// What `request_id`'s pending prefetch leaves to the engine to compute first: see [`PrefetchHead`]. Only a
    /// controller whose settings allow a split, and a request the scheduler has not asked for, can answer other
    /// than `Nothing`.
    pub fn prefetch_head(&self, request_id: &str) -> PrefetchHead {
        let Some(storage) = self.storage.as_ref() else { return PrefetchHead::Nothing };
        let Some(entry) = storage.requests.get(request_id).and_then(|op| storage.prefetches.get(op)) else {
            return PrefetchHead::Nothing;
        };
        let undecided = matches!(&entry.stage, Stage::Querying { pages, .. } if pages.is_empty())
            && storage.settings.split
            && storage.settings.by_cost
            && !entry.wanted
            && !entry.aborted
            && !entry.shared.progress.is_terminated();
        if undecided {
            PrefetchHead::NotPlanned
        } else if entry.head_pages > 0 {
            PrefetchHead::Compute(entry.head_pages * self.page_size)
        } else {
            PrefetchHead::Nothing
        }
    }

    /// The read error that stopped this rank's fetch for `request_id`'s pending prefetch, once one has (the pages
    /// read before it stay fetched).
    pub fn prefetch_failure(&self, request_id: &str) -> Option<String> {
        let storage = self.storage.as_ref()?;
        let entry = storage.prefetches.get(storage.requests.get(request_id)?)?;
        entry.shared.failure.get().cloned()
    }

    /// Prefetches not finished, including those whose pages are still draining.
    pub fn prefetches_in_flight(&self) -> usize {
        self.storage.as_ref().map_or(0, |storage| storage.prefetches.len())
    }

    /// The scheduler's tick without host eviction: see [`tick_with`](Self::tick_with).
    ///
    /// # Errors
    ///
    /// As [`tick_with`](Self::tick_with).
    pub fn tick(&mut self, collective: &mut dyn Collective) -> Result<TickReport<E::Event>, Error> {
        self.tick_with(collective, &mut |_, _| {})
    }

    /// The scheduler's tick: one fixed-shape collective, then everything it decided: write acks (their storage
    /// backups start), finished backups, prefetch hits (host pages reserved, evicting through `evict_host(self,
    /// pages)` when the pool is short, as SGLang's `evict_host` and retry), prefetch results, drained pages.
    ///
    /// # Errors
    ///
    /// The collective's errors (the group is broken then, and nothing was changed); allocator errors (bugs).
    pub fn tick_with(
        &mut self,
        collective: &mut dyn Collective,
        evict_host: &mut dyn FnMut(&mut Self, usize),
    ) -> Result<TickReport<E::Event>, Error> {
        let slots = self.storage.as_ref().map_or(0, |storage| storage.settings.tick_slots);
        let mut values = vec![0i64; HEADER + slots * SLOT_VALUES];
        values[0] = self.completed_writes() as i64;
        let mut ops = Vec::new();
        if let Some(storage) = &mut self.storage {
            values[1] = storage.backups.iter().take_while(|backup| backup.shared.done.is_set()).count() as i64;
            for read in storage.workers.take_reads() {
                storage.cost.observe_read(read.calls, read.bytes, read.elapsed);
            }
            for (value, rate) in values[2..HEADER].iter_mut().zip(storage.cost.rates().encode()) {
                *value = -rate;
            }
            let now = storage.clock.now();
            for (op, entry) in storage.prefetches.iter_mut().filter(|(_, entry)| entry.in_collective()).take(slots) {
                if entry.timed_out && entry.wanted {
                    entry.shared.progress.terminate();
                }
                let limit = storage.settings.timeout(entry.tokens);
                let quiet = entry.shared.quiet.is_set();
                let terminated = entry.shared.progress.is_terminated();
                // a prefetch whose storage I/O goes on without progress for the read deadline is stuck (a hung
                // mount): it stops under every policy, wait_complete included
                let progress = entry.shared.found_pages() as u64 + entry.shared.progress.completed();
                if progress != entry.progress_mark.0 {
                    entry.progress_mark = (progress, now);
                }
                let waiting_on_storage = matches!(entry.stage, Stage::Querying { .. } | Stage::Fetching { .. });
                let stalled = waiting_on_storage
                    && !quiet
                    && !terminated
                    && now.saturating_sub(entry.progress_mark.1) > storage.settings.read_deadline;
                // before the query ends, the pages found so far (a lower bound of the hit: they only grow)
                let hit = entry.shared.hit.get();
                let slot = Slot {
                    hit_ready: hit.is_some(),
                    hit_pages: hit.map_or_else(|| entry.shared.found_pages(), |hit| hit.pages) as i64,
                    last: quiet || terminated,
                    fetched_tokens: entry.shared.progress.completed() as i64,
                    quiet,
                    in_time: !(storage.settings.policy == PrefetchPolicy::Timeout
                        && entry.wanted
                        && now.saturating_sub(entry.started_at) > limit),
                    stalled,
                    reading_us: entry
                        .reads_queued_at
                        .map_or(0, |queued| now.saturating_sub(queued).as_micros().min(i64::MAX as u128) as i64),
                };
                slot.write(&mut values[HEADER + ops.len() * SLOT_VALUES..][..SLOT_VALUES]);
                ops.push(*op);
            }
        }
        collective.all_reduce(&mut values, ReduceOp::Min)?;
        tracing::trace!(writes = values[0], backups = values[1], prefetch_slots = ops.len(), "tick reduced");

        if let Some(storage) = &mut self.storage {
            let slowest: [i64; ENCODED] = std::array::from_fn(|index| -values[2 + index]);
            storage.agreed = Rates::decode(&slowest, storage.settings.batch_pages);
        }
        let mut report = TickReport { write_acks: Vec::new(), backups: Vec::new(), prefetches: Vec::new() };
        report.write_acks = self.take_write_acks(values[0] as usize)?;
        report.backups = self.take_backups(values[1] as usize)?;
        for (index, op) in ops.into_iter().enumerate() {
            let slot = Slot::read(&values[HEADER + index * SLOT_VALUES..][..SLOT_VALUES]);
            let storage = self.storage.as_mut().expect("slots only with storage");
            let policy = storage.settings.policy;
            let mut entry = storage.prefetches.remove(&op).expect("slots name live prefetches");
            // a query the scheduler no longer waits for (its storage may hang): best_effort stops when the request
            // is taken, timeout at its limit on any rank, an abort at once
            entry.stalled |= slot.stalled;
            let stop_waiting = entry.aborted
                || entry.stalled
                || (entry.wanted && (policy == PrefetchPolicy::BestEffort || !slot.in_time));
            let done = match entry.stage {
                Stage::Querying { .. } if slot.hit_ready => {
                    self.reserve(op, &mut entry, slot.hit_pages as usize, evict_host)?
                }
                Stage::Querying { .. } if stop_waiting => self.stop_querying(&mut entry, slot.hit_pages as usize)?,
                Stage::Querying { .. } => {
                    self.reserve_agreed(op, &mut entry, slot.hit_pages as usize)?;
                    None
                }
                Stage::Fetching { ref pages, .. } => {
                    entry.timed_out = !slot.in_time;
                    if !slot.last && self.waiting_costs_more(&entry, pages.len(), slot) {
                        // every rank sees the same reduced count and rates: every rank stops here
                        entry.cost_cut = true;
                        entry.shared.progress.terminate();
                    }
                    if entry.stalled {
                        // reads already queued end with their last job; the ones stuck hold their pages until
                        // they return (the tail is freed only when the fetch thread is quiet)
                        entry.shared.progress.terminate();
                    }
                    if slot.last { self.resolve(&mut entry, slot)? } else { None }
                }
                Stage::Draining { .. } if slot.quiet => {
                    self.drain(&mut entry)?;
                    None
                }
                Stage::Draining { .. } => None,
            };
            report.prefetches.extend(done);
            let storage = self.storage.as_mut().expect("checked above");
            if matches!(&entry.stage, Stage::Draining { tail } if tail.is_empty()) {
                // retired: nothing of it is left in the host pool
                storage.capacity.release(entry.admitted)?;
            } else {
                storage.prefetches.insert(op, entry);
            }
        }
        Ok(report)
    }

    /// The query still runs on some rank: reserve host pages for the leading hit every rank has found so far
    /// (`agreed_pages`), once it reaches the threshold, from the pages free now (eviction waits until the whole hit
    /// is known), and queue their reads. Every rank sees the same minimum and the same allocator, so every rank
    /// reserves the same pages.
    fn reserve_agreed(&mut self, op: OpId, entry: &mut PrefetchEntry, agreed_pages: usize) -> Result<(), Error> {
        // by cost: only what the plan for the hit found so far would fetch (reads queued now cannot be taken back);
        // a split waits for the whole hit (its tail is the hit's end)
        let planned = self.plan_for(entry, agreed_pages, 0, 0);
        if planned.is_some_and(|planned| planned.compute_head_pages > 0) {
            return Ok(());
        }
        let planned = planned.map(|planned| planned.fetch_pages);
        let storage = self.storage.as_mut().expect("storage");
        let Stage::Querying { pages, keys } = &mut entry.stage else {
            unreachable!("reserve_agreed is called on querying prefetches")
        };
        // only the scheduler's own state decides (the same on every rank), never a flag an I/O thread sees first
        let cut_off = entry.wanted && storage.settings.policy == PrefetchPolicy::BestEffort;
        if entry.aborted || cut_off || agreed_pages * self.page_size < storage.settings.prefetch_threshold {
            return Ok(());
        }
        let agreed_pages = planned.map_or(agreed_pages, |planned| planned.max(pages.len()));
        if agreed_pages * self.page_size < storage.settings.prefetch_threshold {
            return Ok(());
        }
        let count = agreed_pages.saturating_sub(pages.len()).min(self.host.available());
        if count == 0 {
            return Ok(());
        }
        let more = self.host.alloc(count).expect("no more than available");
        queue_reads(storage, op, &entry.shared, 0, pages, keys, more, false)?;
        entry.reads_queued_at.get_or_insert(storage.clock.now());
        entry.explanation.reserved_tokens = pages.len() * self.page_size;
        Ok(())
    }

    /// The scheduler stops waiting for the hit query: what every rank agreed on so far (`agreed_pages`) is all the
    /// prefetch gets; reads of it already queued end with a last job and are resolved when they stop.
    fn stop_querying(&mut self, entry: &mut PrefetchEntry, agreed_pages: usize) -> Result<Option<PrefetchDone>, Error> {
        let storage = self.storage.as_mut().expect("storage");
        let stop = if entry.aborted {
            PrefetchStop::Aborted
        } else if entry.stalled {
            PrefetchStop::Stalled
        } else if storage.settings.policy == PrefetchPolicy::BestEffort {
            PrefetchStop::CutOff
        } else {
            PrefetchStop::TimedOut
        };
        entry.shared.progress.terminate();
        entry.explanation.local_hit_tokens = entry.shared.found_pages() * self.page_size;
        entry.explanation.tp_min_hit_tokens = agreed_pages * self.page_size;
        let Stage::Querying { mut pages, mut keys } =
            std::mem::replace(&mut entry.stage, Stage::Querying { pages: Vec::new(), keys: Vec::new() })
        else {
            unreachable!("stop_querying is called on querying prefetches")
        };
        if pages.is_empty() {
            entry.explanation.stop = stop;
            return Ok(Some(self.finish_entry(entry, Vec::new(), Vec::new())));
        }
        queue_reads(storage, entry.explanation.op, &entry.shared, 0, &mut pages, &mut keys, Vec::new(), true)?;
        entry.hold_only(&mut storage.capacity, (pages.len() * self.page_size) as u64)?;
        entry.query_cut = Some(stop);
        entry.stage = Stage::Fetching { pages, keys };
        Ok(None)
    }

    /// The hit is known on every rank: revoke, or reserve host pages for the rest of it (as many as the pool can
    /// hold after eviction) and queue the prefetch's last reads.
    fn reserve(
        &mut self,
        op: OpId,
        entry: &mut PrefetchEntry,
        hit_pages: usize,
        evict_host: &mut dyn FnMut(&mut Self, usize),
    ) -> Result<Option<PrefetchDone>, Error> {
        let found = entry.shared.hit.get().expect("ready on this rank too");
        entry.explanation.local_hit_tokens = found.pages * self.page_size;
        entry.explanation.error.clone_from(&found.error);
        entry.explanation.tp_min_hit_tokens = hit_pages * self.page_size;
        let Stage::Querying { mut pages, mut keys } =
            std::mem::replace(&mut entry.stage, Stage::Querying { pages: Vec::new(), keys: Vec::new() })
        else {
            unreachable!("reserve is called on querying prefetches")
        };
        let threshold = self.storage.as_ref().expect("storage").settings.prefetch_threshold;
        let policy = self.storage.as_ref().expect("storage").settings.policy;
        let stop = if entry.aborted {
            Some(PrefetchStop::Aborted)
        } else if entry.wanted && policy == PrefetchPolicy::BestEffort {
            // taken by the scheduler before the hit was known: nothing more to wait for
            Some(PrefetchStop::CutOff)
        } else if hit_pages * self.page_size < threshold {
            Some(PrefetchStop::Revoked)
        } else {
            None
        };
        let more = match stop {
            Some(stop) if pages.is_empty() => {
                entry.explanation.stop = stop;
                return Ok(Some(self.finish_entry(entry, Vec::new(), Vec::new())));
            }
            // reads of the agreed hit are under way (so it reached the threshold): what arrives is resolved
            Some(_) => Vec::new(),
            None => {
                // a split's head (the hit's first pages) is the engine's: the reads start after it
                let (head, planned) = self.plan_hit(entry, hit_pages, pages.len());
                if planned * self.page_size < threshold && pages.is_empty() {
                    entry.explanation.stop = PrefetchStop::RecomputeFaster;
                    return Ok(Some(self.finish_entry(entry, Vec::new(), Vec::new())));
                }
                let wanted = planned - pages.len();
                if self.host.available() < wanted {
                    let short = wanted - self.host.available();
                    evict_host(self, short);
                }
                let count = wanted.min(self.host.available());
                if (pages.len() + count) * self.page_size < threshold {
                    // nothing reserved yet (the agreed part would have reached the threshold), and too few fit
                    entry.explanation.stop = PrefetchStop::HostPoolFull;
                    return Ok(Some(self.finish_entry(entry, Vec::new(), Vec::new())));
                }
                entry.capped = count < wanted;
                entry.head_pages = head;
                self.host.alloc(count).expect("no more than available")
            }
        };
        let storage = self.storage.as_mut().expect("storage");
        queue_reads(storage, op, &entry.shared, entry.head_pages, &mut pages, &mut keys, more, true)?;
        entry.reads_queued_at.get_or_insert(storage.clock.now());
        entry.hold_only(&mut storage.capacity, (pages.len() * self.page_size) as u64)?;
        entry.explanation.reserved_tokens = pages.len() * self.page_size;
        entry.stage = Stage::Fetching { pages, keys };
        Ok(None)
    }

    /// The cost plan, with the rates every rank agreed on, for `pages` of `entry`'s hit after its head (a split's), the
    /// first `arrived` of them in host memory already, fetching at least `at_least`; `None` when not prefetching by
    /// cost. A split is weighed only while the scheduler has not asked for the request (the engine computes the head
    /// before it does).
    fn plan_for(&self, entry: &PrefetchEntry, pages: usize, arrived: usize, at_least: usize) -> Option<Plan> {
        let storage = self.storage.as_ref().expect("storage");
        let cached_tokens = entry.cached_tokens + entry.head_pages * self.page_size;
        let hit = Hit {
            cached_tokens,
            pages,
            page_tokens: self.page_size,
            page_bytes: self.memory.page_bytes() as u64,
            prompt_tokens: entry.prompt_tokens.max(cached_tokens + pages * self.page_size),
            arrived_pages: arrived,
            split: storage.settings.split && !entry.wanted && entry.head_pages == 0,
        };
        storage.settings.by_cost.then(|| plan(&storage.agreed, &hit, at_least))
    }

    /// The pages of a hit of `hit_pages` (every rank's) the engine computes (a split's head) and the pages after them
    /// to fetch, `reserved` of them already on their way: none and all of them, or as the cost plan says (recorded
    /// in the explanation) when prefetching by cost.
    fn plan_hit(&self, entry: &mut PrefetchEntry, hit_pages: usize, reserved: usize) -> (usize, usize) {
        let Some(planned) = self.plan_for(entry, hit_pages, 0, reserved) else { return (0, hit_pages) };
        entry.explanation.plan = Some(planned);
        entry.cost_cut = planned.compute_head_pages + planned.fetch_pages < hit_pages;
        (planned.compute_head_pages, planned.fetch_pages)
    }

    /// Whether the scheduler, wanting the request now, should stop waiting for the rest of its `reserved` pages
    /// (`slot`: every rank's count of fetched tokens and time spent reading): keeping what arrived and computing the
    /// rest is expected to be faster than waiting for the rest. The rest is expected when the reads of all the
    /// reserved pages, at the agreed rates, would end after they were queued; once that time is past, as late again
    /// as they already are (a read just overdue is about to end, a stalled one ever further off), but no later than a
    /// whole read of the pages not arrived from now. While the tier's read rate is still unknown (the reads that
    /// measure it), as long again as they have taken: the scheduler waits for them about as long as computing the
    /// pages still missing takes, and no more.
    fn waiting_costs_more(&self, entry: &PrefetchEntry, reserved: usize, slot: Slot) -> bool {
        let storage = self.storage.as_ref().expect("storage");
        if !storage.settings.by_cost || !entry.wanted || entry.aborted || entry.shared.progress.is_terminated() {
            return false;
        }
        let rates = &storage.agreed;
        if rates.prefill_s_per_token.is_none() {
            return false;
        }
        let page_bytes = self.memory.page_bytes() as u64;
        let arrived = (slot.fetched_tokens as usize / self.page_size).min(reserved);
        let reading = slot.reading_us as f64 / 1e6;
        let planned = rates.fetch_s(reserved, page_bytes);
        let rest = if rates.storage_read_bytes_per_s.is_none() {
            reading
        } else if reading < planned {
            planned - reading
        } else {
            (reading - planned).min(rates.fetch_s(reserved - arrived, page_bytes))
        };
        let from = entry.cached_tokens + entry.head_pages * self.page_size;
        let prompt = entry.prompt_tokens.max(from + reserved * self.page_size);
        let after =
            |pages: usize| rates.load_s(pages, page_bytes).max(rates.compute_s(from + pages * self.page_size, prompt));
        after(arrived) < rest + after(reserved)
    }

    /// Every rank's count is final: the minimum is the result.
    fn resolve(&mut self, entry: &mut PrefetchEntry, slot: Slot) -> Result<Option<PrefetchDone>, Error> {
        if !(entry.wanted || entry.aborted) {
            return Ok(None);
        }
        let Stage::Fetching { pages, keys } =
            std::mem::replace(&mut entry.stage, Stage::Querying { pages: Vec::new(), keys: Vec::new() })
        else {
            unreachable!("resolve is called on fetching prefetches")
        };
        let kept = if entry.aborted { 0 } else { slot.fetched_tokens as usize / self.page_size };
        let local = entry.shared.progress.completed() as usize;
        let failure = entry.shared.failure.get().cloned();
        let policy = self.storage.as_ref().expect("storage").settings.policy;
        entry.explanation.local_fetched_tokens = local;
        entry.explanation.fetched_tokens = kept * self.page_size;
        entry.explanation.stop = if entry.aborted {
            PrefetchStop::Aborted
        } else if let Some(stop) = entry.query_cut.clone().filter(|_| kept == pages.len()) {
            stop
        } else if kept == pages.len() && entry.cost_cut {
            PrefetchStop::RecomputeFaster
        } else if kept == pages.len() && entry.capped {
            PrefetchStop::HostPoolFull
        } else if kept == pages.len() {
            PrefetchStop::Complete
        } else if failure.is_some() {
            PrefetchStop::Failed
        } else if entry.cost_cut {
            PrefetchStop::RecomputeFaster
        } else if local > kept * self.page_size {
            PrefetchStop::TpMinimum
        } else if entry.stalled {
            PrefetchStop::Stalled
        } else if policy == PrefetchPolicy::Timeout {
            PrefetchStop::TimedOut
        } else {
            PrefetchStop::CutOff
        };
        if failure.is_some() {
            entry.explanation.error = failure;
        }
        let op = entry.explanation.op;
        let storage = self.storage.as_mut().expect("storage");
        let given = storage.ledger.release(&super::Release { op, range: 0..kept })?;
        self.host.update_prefetch(&given)?;
        entry.stage = Stage::Draining { tail: pages[kept..].to_vec() };
        let done = self.finish_entry(entry, given, keys[..kept].to_vec());
        if slot.quiet {
            self.drain(entry)?;
        }
        Ok(Some(done))
    }

    /// Every rank's fetch thread is done with the pages: the tail goes back to the allocator.
    fn drain(&mut self, entry: &mut PrefetchEntry) -> Result<(), Error> {
        let Stage::Draining { tail } = std::mem::replace(&mut entry.stage, Stage::Draining { tail: Vec::new() }) else {
            unreachable!("drain is called on draining prefetches")
        };
        let storage = self.storage.as_mut().expect("storage");
        let start = entry.explanation.reserved_tokens / self.page_size - tail.len();
        let release = super::Release { op: entry.explanation.op, range: start..start + tail.len() };
        let pages = storage.ledger.release(&release)?;
        self.free_host(&pages)
    }

    fn finish_entry(&mut self, entry: &mut PrefetchEntry, pages: Vec<HostPageId>, keys: Vec<PageKey>) -> PrefetchDone {
        let storage = self.storage.as_mut().expect("storage");
        entry.explanation.elapsed = storage.clock.now().saturating_sub(entry.started_at);
        entry.explanation.query_time = entry.shared.hit.get().map_or(entry.explanation.elapsed, |hit| hit.elapsed);
        entry.explanation.read_time =
            Duration::from_nanos(entry.shared.read_ns.load(std::sync::atomic::Ordering::Relaxed));
        storage.requests.remove(&entry.request_id);
        let explanation = &entry.explanation;
        tracing::debug!(
            request = %explanation.request_id,
            stop = ?explanation.stop,
            requested = explanation.requested_tokens,
            hit = explanation.local_hit_tokens,
            tp_min_hit = explanation.tp_min_hit_tokens,
            fetched = explanation.fetched_tokens,
            elapsed_ms = explanation.elapsed.as_secs_f64() * 1e3,
            error = explanation.error.as_deref(),
            planned_pages = explanation.plan.map(|plan| plan.fetch_pages),
            plan = explanation.plan.map(|plan| plan.reason.name()),
            "prefetch finished"
        );
        if matches!(entry.stage, Stage::Querying { .. }) {
            // nothing was reserved
            entry.stage = Stage::Draining { tail: Vec::new() };
        }
        PrefetchDone {
            request_id: entry.request_id.clone(),
            head_tokens: entry.head_pages * self.page_size,
            host_pages: pages,
            keys,
            explanation: entry.explanation.clone(),
        }
    }
}
