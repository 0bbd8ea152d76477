//! Prefetch from storage and the scheduler's tick: the one point where TP ranks agree on everything that can differ
//! between them (docs/sglang.md#prefetch to #release, #tp; fixes #fixed-1, #fixed-2, #fixed-16 and #fixed-18).
//!
//! A prefetch goes through these steps, each decided at a tick from values reduced over the TP group, so every rank
//! changes its allocator in the same way at the same tick:
//!
//! 1. [`prefetch`](CacheController::prefetch) queues a hit query. No host memory is reserved yet (SGLang reserves
//!    the whole prompt before it knows the hit, and may evict L2 for it: docs/sglang.md#fixed-18).
//! 2. While the queries run, each tick reserves host pages for the leading hit every rank has found so far (the TP
//!    minimum of the pages found), once it reaches the threshold, from pages free now (only when the pages reserved
//!    reach the threshold too), and the fetch thread starts reading them: a long hit is read while its later batches are still being asked for. When every rank's query
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
//! A prefetch is a [`Tracked`]: what it was asked for and how far it got ([`Prefetch`]), and its [`Stage`], which
//! each step at a tick takes by value and gives back changed: querying → fetching → draining, or straight to
//! draining when it ends with nothing reserved. Why it stopped is decided in one place,
//! [`Prefetch::stop_reason`]. The tick itself, with its collective, is in `tick.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::CacheController;
use super::outcome::{PrefetchExplanation, PrefetchStop, StorageFailure};
use super::storage::{PrefetchShared, Workers};
use crate::config::PrefetchPolicy;
use crate::controller::OpId;
use crate::error::Error;
use crate::hash::PageKey;
use crate::host_pool::HostPageId;
use crate::transfer::TransferEngine;

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

/// A pending prefetch whose reads run from the end of what it reserved, for an engine that meets them (config
/// `prefetch_meet`): tokens relative to the prefetch's own ([`CacheController::prefetch_meeting`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meeting {
    /// Tokens at the start that are not read: the reads cover the `read_tokens` after them (a split's head is read
    /// too, so none where the plan split).
    pub head_tokens: usize,
    /// Where the plan expects the compute to meet the reads: the head a split would have left to the engine (0 when
    /// it did not split). An engine that computes in passes can make this its first.
    pub planned_head_tokens: usize,
    /// Tokens of the reserved pages, read from their end backwards.
    pub read_tokens: usize,
    /// Tokens this rank has read so far, at the end of the reserved ones.
    pub arrived_tokens: usize,
    /// The time this rank's reads of the prefetch took, up to the one that brought the last of them: the reads'
    /// own time, without their wait behind other prefetches' reads (zero before any arrived). An engine that looks
    /// at the reads only now and then, or a simulation, learns from it how far its compute had come when they
    /// arrived.
    pub arrived_after: Duration,
    /// When this rank's first read of the prefetch started (`None` while its reads wait behind other prefetches').
    pub reads_started: Option<Instant>,
}

impl Meeting {
    /// Whether an engine that has computed the prefetch's first `computed` tokens has met the reads, once `arrived`
    /// tokens at the end are read (every rank's count, the minimum): nothing between its compute and the reads is
    /// missing.
    pub fn met(&self, computed: usize, arrived: usize) -> bool {
        computed >= self.unread(arrived)
    }

    /// The tokens from the prefetch's start up to the first of those read once `arrived` tokens at the end are: what
    /// an engine computes to meet them.
    pub fn unread(&self, arrived: usize) -> usize {
        self.head_tokens + self.read_tokens - arrived.min(self.read_tokens)
    }
}

/// A prefetch whose result is known on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefetchDone {
    /// The request.
    pub request_id: String,
    /// Tokens at the start of the prefetch's tokens that were not fetched because the engine computes them (a
    /// split plan's head, and where the engine met the reads everything before the pages read from the end): the
    /// fetched pages follow them.
    pub head_tokens: usize,
    /// Host pages holding the fetched tokens, in order, in the backup state; the caller owns them now (insert them
    /// into the tree, or give them back with [`CacheController::evict_host`]).
    pub host_pages: Vec<HostPageId>,
    /// Their page keys.
    pub keys: Vec<PageKey>,
    /// With a [trailing window](super::Trailing): the first of `host_pages` whose entries of the trailing-window
    /// pools were read (those of the hit's last `window` pages only; the same on every rank); 0 without.
    pub trailing_from: usize,
    /// Everything about how it went.
    pub explanation: PrefetchExplanation,
}

/// Host pages a prefetch reserved, in order, and the keys they are read under.
#[derive(Debug, Default)]
pub(super) struct Reads {
    pub(super) pages: Vec<HostPageId>,
    pub(super) keys: Vec<PageKey>,
}

/// Why a prefetch may keep fewer pages than the hit, decided before its reads end.
#[derive(Clone, Debug)]
pub(super) enum Short {
    /// The scheduler stopped waiting for the hit query: only the part every rank had agreed on is read.
    Query(PrefetchStop),
    /// The cost plan fetches less than the hit, or the scheduler stopped waiting for the rest because computing it
    /// was expected to be faster.
    Cost,
    /// The host pool could not hold the whole hit.
    Capped,
}

/// Host pages reserved; the fetch thread reads them.
#[derive(Debug)]
pub(super) struct Fetching {
    pub(super) reads: Reads,
    pub(super) short: Option<Short>,
    /// Some rank's `timeout` limit had passed at the last tick.
    pub(super) past_limit: bool,
}

/// Where a prefetch is.
#[derive(Debug)]
pub(super) enum Stage {
    /// The hit query runs. The reads hold the leading hit every rank has found so far (reserved once it reached the
    /// threshold), queued for the fetch thread already.
    Querying(Reads),
    /// Host pages reserved; the fetch thread reads them.
    Fetching(Fetching),
    /// Result given; these pages return to the allocator when every rank's fetch thread is quiet.
    Draining(Vec<HostPageId>),
}

/// A prefetch: what was asked and how far it got, apart from its stage.
#[derive(Debug)]
pub(super) struct Prefetch {
    pub(super) request_id: String,
    pub(super) tokens: usize,
    pub(super) started_at: Duration,
    pub(super) shared: Arc<PrefetchShared>,
    /// The scheduler asked for the result.
    pub(super) wanted: bool,
    /// The engine's compute met the reads ([`CacheController::meet_prefetch`]).
    pub(super) met: bool,
    pub(super) aborted: bool,
    /// Some rank's prefetch had made no progress within the read deadline at a tick.
    pub(super) stalled: bool,
    /// This rank's progress (pages found plus tokens fetched) and when it last changed.
    pub(super) progress_mark: (u64, Duration),
    /// Tokens counted against the prefetch capacity.
    pub(super) admitted: u64,
    /// Tokens the request had before the prefetch's (device and host), and its prompt's: what a cost plan weighs.
    pub(super) cached_tokens: usize,
    pub(super) prompt_tokens: usize,
    /// Pages at the hit's start that a split plan leaves to the engine: the reserved pages follow them.
    pub(super) head_pages: usize,
    /// When the reads of the reserved pages were first queued.
    pub(super) reads_queued_at: Option<Duration>,
    /// With a trailing window: the length the last round of the ranks' agreement reduced to (`None` before the
    /// first), which every rank's next proposal stays within ([`Trailing`](super::Trailing)).
    pub(super) cap: Option<usize>,
    pub(super) explanation: PrefetchExplanation,
}

/// A prefetch and its stage, as the storage tier keeps it between ticks.
#[derive(Debug)]
pub(super) struct Tracked {
    pub(super) prefetch: Prefetch,
    pub(super) stage: Stage,
}

/// The point a prefetch's stop is decided at ([`Prefetch::stop_reason`]).
pub(super) enum End<'a> {
    /// Every rank's query is done; `enough`: the hit every rank found reaches the threshold.
    HitKnown { enough: bool },
    /// The scheduler stopped waiting for the hit query.
    QueryAbandoned,
    /// Every rank's count of fetched tokens is final.
    Counted {
        fetching: &'a Fetching,
        /// Every reserved page was kept.
        all: bool,
        /// A read failed on this rank.
        failed: bool,
        /// This rank fetched more than the TP minimum.
        above_minimum: bool,
    },
}

impl Prefetch {
    /// Why the prefetch stops at `end` under `policy`; `None` when it goes on (a hit that is known, reaches the
    /// threshold and was neither aborted nor cut off).
    pub(super) fn stop_reason(&self, policy: PrefetchPolicy, end: &End<'_>) -> Option<PrefetchStop> {
        if self.aborted {
            return Some(PrefetchStop::Aborted);
        }
        let past_wait = || {
            if self.stalled {
                PrefetchStop::Stalled
            } else if policy == PrefetchPolicy::BestEffort {
                PrefetchStop::CutOff
            } else {
                PrefetchStop::TimedOut
            }
        };
        Some(match *end {
            // taken by the scheduler before the hit was known: nothing more to wait for
            End::HitKnown { .. } if self.wanted && policy == PrefetchPolicy::BestEffort => PrefetchStop::CutOff,
            End::HitKnown { enough: false } => PrefetchStop::Revoked,
            End::HitKnown { enough: true } => return None,
            End::QueryAbandoned => past_wait(),
            End::Counted { all: false, failed: false, .. } if self.met => PrefetchStop::Met,
            End::Counted { fetching, all: true, .. } => match &fetching.short {
                Some(Short::Query(stop)) => stop.clone(),
                Some(Short::Cost) => PrefetchStop::RecomputeFaster,
                Some(Short::Capped) => PrefetchStop::HostPoolFull,
                None => PrefetchStop::Complete,
            },
            End::Counted { failed: true, .. } => PrefetchStop::Failed,
            End::Counted { fetching: Fetching { short: Some(Short::Cost), .. }, .. } => PrefetchStop::RecomputeFaster,
            End::Counted { above_minimum: true, .. } => PrefetchStop::TpMinimum,
            End::Counted { .. } if !self.stalled && policy == PrefetchPolicy::WaitComplete => PrefetchStop::CutOff,
            End::Counted { .. } => past_wait(),
        })
    }

    /// Holds only `tokens` (those of the reserved pages) against the prefetch capacity from now on, not the whole
    /// request's.
    pub(super) fn hold_only(
        &mut self,
        capacity: &mut crate::rate_limit::PrefetchCapacity,
        tokens: u64,
    ) -> Result<(), Error> {
        capacity.release(self.admitted - tokens)?;
        self.admitted = tokens;
        Ok(())
    }
}

impl Fetching {
    /// The scheduler stops waiting for the rest of the reads: computing what is missing is expected to be faster.
    pub(super) fn cut_by_cost(&mut self) {
        self.short = Some(Short::Cost);
    }
}

impl Tracked {
    /// Whether the prefetch takes a slot in the tick's collective: while it queries and drains, and once the
    /// scheduler asked for it while it fetches.
    pub(super) fn in_collective(&self) -> bool {
        match self.stage {
            Stage::Querying(_) | Stage::Draining(_) => true,
            Stage::Fetching(_) => self.prefetch.wanted || self.prefetch.aborted,
        }
    }

    /// Terminates the prefetch for a reset; reads already queued end with a last (empty) job. Returns what to wait
    /// on until the fetch thread is done with the host pages, `None` when none were reserved.
    pub(super) fn stop_for_reset(self, workers: &Workers) -> Option<Arc<PrefetchShared>> {
        let shared = self.prefetch.shared;
        shared.progress.terminate();
        match self.stage {
            Stage::Querying(reads) if reads.pages.is_empty() => None,
            Stage::Querying(_) => {
                workers.fetch(shared.clone(), Vec::new(), Vec::new(), 0, true);
                Some(shared)
            }
            Stage::Fetching(_) | Stage::Draining(_) => Some(shared),
        }
    }
}

/// A hit every rank knows, planned and waiting for host pages ([`StorageTier::reserve`]).
#[derive(Debug)]
pub(super) struct Reservation {
    pub(super) reads: Reads,
    /// Pages of the hit's start the engine computes (a split's head).
    pub(super) head: usize,
    /// Pages wanted beyond those reserved already; `None` when the prefetch stopped and only the reads under way
    /// are resolved.
    pub(super) wanted: Option<usize>,
    /// The plan fetches less than the hit.
    pub(super) cost_cut: bool,
}

/// What a known hit leads to.
#[expect(clippy::large_enum_variant, reason = "a step's value, moved once and matched at once")]
pub(super) enum Reserve {
    /// The next stage, and the result when the prefetch ended here.
    Decided(Stage, Option<PrefetchDone>),
    /// The host pool has too few free pages for the reservation: this many more are wanted.
    Short(Reservation, usize),
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
        let whole = tokens.len() - tokens.len() % self.page_size;
        storage.start_prefetch(&mut self.ids, request_id, &tokens[..whole], last_key, cached_tokens, tokens.len())
    }

    /// Whether `request_id` has a prefetch whose result is not known yet.
    pub fn prefetch_pending(&self, request_id: &str) -> bool {
        self.storage.as_ref().is_some_and(|storage| storage.requests.contains_key(request_id))
    }

    /// The scheduler wants `request_id` now: its prefetch stops as the policy allows, and the result comes from a
    /// tick. `best_effort` terminates the fetch at once. False when the request has no pending prefetch.
    pub fn finish_prefetch(&mut self, request_id: &str) -> bool {
        let Some(storage) = &mut self.storage else { return false };
        let best_effort = storage.settings.policy == PrefetchPolicy::BestEffort;
        let Some(prefetch) = storage.prefetch_mut(request_id) else { return false };
        prefetch.wanted = true;
        if best_effort {
            prefetch.shared.progress.terminate();
        }
        true
    }

    /// The engine's compute has met `request_id`'s reads ([`prefetch_meeting`](Self::prefetch_meeting)): the
    /// prefetch stops at once, whatever the policy, and its result at a tick is the pages read at the end (every
    /// rank's count, at least what the engine saw), after a head the engine has computed. Every rank calls it at the
    /// same point of its schedule (the engine decides from values reduced over the ranks). False when the request has
    /// no prefetch whose reads it could meet.
    pub fn meet_prefetch(&mut self, request_id: &str) -> bool {
        if self.prefetch_meeting(request_id).is_none() {
            return false;
        }
        let Some(prefetch) = self.storage.as_mut().and_then(|storage| storage.prefetch_mut(request_id)) else {
            return false;
        };
        prefetch.wanted = true;
        prefetch.met = true;
        prefetch.shared.progress.terminate();
        true
    }

    /// Where the reads of `request_id`'s pending prefetch are, for an engine that meets them (config
    /// `prefetch_meet`): `Some` once its pages are reserved and read from their end, until the scheduler asks for
    /// it. The engine computes from the prefetch's first token; once its compute and the reads every rank has done
    /// meet ([`Meeting::met`]), it calls [`meet_prefetch`](Self::meet_prefetch).
    pub fn prefetch_meeting(&self, request_id: &str) -> Option<Meeting> {
        let storage = self.storage.as_ref().filter(|storage| storage.settings.meet)?;
        let Tracked { prefetch, stage } = storage.tracked(request_id)?;
        let Stage::Fetching(fetching) = stage else { return None };
        if prefetch.wanted || prefetch.aborted || fetching.reads.pages.is_empty() {
            return None;
        }
        let (arrived_tokens, arrived_after) =
            *prefetch.shared.arrivals.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let planned_head_pages = prefetch.explanation.plan.map_or(0, |plan| plan.compute_head_pages);
        Some(Meeting {
            head_tokens: prefetch.head_pages * self.page_size,
            planned_head_tokens: planned_head_pages * self.page_size,
            read_tokens: fetching.reads.pages.len() * self.page_size,
            arrived_tokens,
            arrived_after,
            reads_started: prefetch.shared.reads_started.get().copied(),
        })
    }

    /// Aborts `request_id`'s prefetch: it stops at once and keeps nothing; its pages return at a tick. False when
    /// the request has no pending prefetch.
    pub fn abort_prefetch(&mut self, request_id: &str) -> bool {
        let Some(prefetch) = self.storage.as_mut().and_then(|storage| storage.prefetch_mut(request_id)) else {
            return false;
        };
        prefetch.aborted = true;
        prefetch.shared.progress.terminate();
        true
    }

    /// Tokens this rank has fetched so far for `request_id`'s pending prefetch.
    pub fn prefetch_progress(&self, request_id: &str) -> Option<usize> {
        let tracked = self.storage.as_ref()?.tracked(request_id)?;
        Some(tracked.prefetch.shared.progress.completed() as usize)
    }

    /// What `request_id`'s pending prefetch leaves to the engine to compute first: see [`PrefetchHead`]. Only a
    /// controller whose settings allow a split, and a request the scheduler has not asked for, can answer other
    /// than `Nothing`.
    pub fn prefetch_head(&self, request_id: &str) -> PrefetchHead {
        let Some(storage) = self.storage.as_ref() else { return PrefetchHead::Nothing };
        let Some(Tracked { prefetch, stage }) = storage.tracked(request_id) else { return PrefetchHead::Nothing };
        let undecided = matches!(stage, Stage::Querying(reads) if reads.pages.is_empty())
            && storage.settings.split
            && storage.settings.by_cost
            && !prefetch.wanted
            && !prefetch.aborted
            && !prefetch.shared.progress.is_terminated();
        if undecided {
            PrefetchHead::NotPlanned
        } else if prefetch.head_pages > 0 {
            PrefetchHead::Compute(prefetch.head_pages * self.page_size)
        } else {
            PrefetchHead::Nothing
        }
    }

    /// The read error that stopped this rank's fetch for `request_id`'s pending prefetch, once one has (the pages
    /// read before it stay fetched).
    pub fn prefetch_failure(&self, request_id: &str) -> Option<StorageFailure> {
        self.storage.as_ref()?.tracked(request_id)?.prefetch.shared.failure.get().cloned()
    }

    /// Prefetches not finished, including those whose pages are still draining.
    pub fn prefetches_in_flight(&self) -> usize {
        self.storage.as_ref().map_or(0, |storage| storage.prefetches.len())
    }
}
