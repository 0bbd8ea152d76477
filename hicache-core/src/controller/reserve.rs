//! The storage tier's decisions about one prefetch at a tick: reserving host pages for its hit (as far as every
//! rank agreed, as far as the cost plan goes, as far as the pool holds), giving up on its query, resolving its
//! result once every rank's count is final, and draining the pages past it.

use std::time::Duration;

use super::Release;
use super::outcome::PrefetchStop;
use super::prefetch::{End, Fetching, Prefetch, PrefetchDone, Reads, Reservation, Reserve, Short, Stage};
use super::tier::{Pool, StorageTier};
use crate::config::PrefetchPolicy;
use crate::controller::OpId;
use crate::cost::{Hit, Plan, plan};
use crate::error::Error;
use crate::hash::PageKey;
use crate::host_pool::HostPageId;

impl StorageTier {
    /// Queues the reads of `more` host pages into `reads`, for the next keys the query found (positions after the
    /// head's pages and those reserved), held by operation `op` in the release ledger; `last` when no more reads of
    /// this prefetch follow (then `more` may be empty: the job only marks the prefetch quiet once the earlier ones
    /// are done).
    fn queue_reads(
        &mut self,
        op: OpId,
        prefetch: &Prefetch,
        reads: &mut Reads,
        more: Vec<HostPageId>,
        last: bool,
    ) -> Result<(), Error> {
        let first = prefetch.head_pages + reads.pages.len();
        let mut more_keys = prefetch.shared.found_keys(first..first + more.len());
        if self.settings.meet {
            // an engine that meets the reads computes from the front: they run from the end (all of them are
            // queued here at once, when the whole hit is known), and the count is of pages at the end
            more_keys.reverse();
        }
        self.ledger.extend(op, more.clone())?;
        // a trailing-window pool reads only the window at the hit's end (every page is reserved in one job then)
        let skip = match self.settings.trailing {
            Some(trailing) if trailing.pool => more.len().saturating_sub(trailing.window.get()),
            _ => 0,
        };
        self.workers.fetch(prefetch.shared.clone(), more.clone(), more_keys.clone(), skip, last);
        reads.pages.extend(more);
        reads.keys.extend(more_keys);
        Ok(())
    }

    /// The query still runs on some rank: reserve host pages for the leading hit every rank has found so far
    /// (`agreed_pages`), once it reaches the threshold, from the pages free now (eviction waits until the whole hit
    /// is known), and queue their reads. Every rank sees the same minimum and the same allocator, so every rank
    /// reserves the same pages.
    pub(super) fn reserve_agreed(
        &mut self,
        op: OpId,
        prefetch: &mut Prefetch,
        mut reads: Reads,
        agreed_pages: usize,
        pool: &mut Pool<'_>,
    ) -> Result<Reads, Error> {
        // by cost: only what the plan for the hit found so far would fetch (reads queued now cannot be taken back);
        // a split waits for the whole hit (its tail is the hit's end), and so do reads from the end
        let planned = self.plan_for(prefetch, pool, agreed_pages, 0, 0);
        // with a trailing window the pages to read depend on where the whole hit ends
        if self.settings.meet
            || self.settings.trailing.is_some()
            || planned.is_some_and(|planned| planned.compute_head_pages > 0)
        {
            return Ok(reads);
        }
        let planned = planned.map(|planned| planned.fetch_pages);
        // only the scheduler's own state decides (the same on every rank), never a flag an I/O thread sees first
        let cut_off = prefetch.wanted && self.settings.policy == PrefetchPolicy::BestEffort;
        let threshold = self.settings.prefetch_threshold;
        if prefetch.aborted || cut_off || agreed_pages * pool.page_size < threshold {
            return Ok(reads);
        }
        let agreed_pages = planned.map_or(agreed_pages, |planned| planned.max(reads.pages.len()));
        if agreed_pages * pool.page_size < threshold {
            return Ok(reads);
        }
        let count = agreed_pages.saturating_sub(reads.pages.len()).min(pool.host.available());
        // reads start only once what they hold reaches the threshold: a pool with too few free pages waits for the
        // whole hit, which may make room by eviction or end with nothing reserved, never with reads too short to be
        // worth their fetch (whichever tick saw the query's progress first)
        if count == 0 || (reads.pages.len() + count) * pool.page_size < threshold {
            return Ok(reads);
        }
        let more = pool.host.alloc(count).expect("no more than available");
        self.queue_reads(op, prefetch, &mut reads, more, false)?;
        prefetch.reads_queued_at.get_or_insert(self.clock.now());
        prefetch.explanation.reserved_tokens = reads.pages.len() * pool.page_size;
        Ok(reads)
    }

    /// The scheduler stops waiting for the hit query: what every rank agreed on so far (`agreed_pages`) is all the
    /// prefetch gets; reads of it already queued end with a last job and are resolved when they stop.
    pub(super) fn stop_querying(
        &mut self,
        op: OpId,
        prefetch: &mut Prefetch,
        mut reads: Reads,
        agreed_pages: usize,
        pool: &Pool<'_>,
    ) -> Result<(Stage, Option<PrefetchDone>), Error> {
        let stop = prefetch.stop_reason(self.settings.policy, &End::QueryAbandoned).expect("an abandoned query stops");
        prefetch.shared.progress.terminate();
        prefetch.explanation.local_hit_tokens = prefetch.shared.found_pages() * pool.page_size;
        prefetch.explanation.tp_min_hit_tokens = agreed_pages * pool.page_size;
        if reads.pages.is_empty() {
            return Ok(self.end_empty(prefetch, pool, stop));
        }
        self.queue_reads(op, prefetch, &mut reads, Vec::new(), true)?;
        prefetch.hold_only(&mut self.capacity, (reads.pages.len() * pool.page_size) as u64)?;
        Ok((Stage::Fetching(Fetching { reads, short: Some(Short::Query(stop)), past_limit: false }), None))
    }

    /// The hit is known on every rank (`hit_pages`): revoke, or plan it and reserve host pages for the rest of it,
    /// which may first need more free pages than the pool has ([`Reserve::Short`]).
    pub(super) fn reserve(
        &mut self,
        op: OpId,
        prefetch: &mut Prefetch,
        reads: Reads,
        hit_pages: usize,
        pool: &mut Pool<'_>,
    ) -> Result<Reserve, Error> {
        let found = prefetch.shared.hit.get().expect("ready on this rank too");
        prefetch.explanation.local_hit_tokens = found.pages * pool.page_size;
        prefetch.explanation.error.clone_from(&found.error);
        prefetch.explanation.tp_min_hit_tokens = hit_pages * pool.page_size;
        let threshold = self.settings.prefetch_threshold;
        let end = End::HitKnown { enough: hit_pages * pool.page_size >= threshold };
        if let Some(stop) = prefetch.stop_reason(self.settings.policy, &end) {
            if reads.pages.is_empty() {
                let (stage, done) = self.end_empty(prefetch, pool, stop);
                return Ok(Reserve::Decided(stage, done));
            }
            // reads of the agreed hit are under way (so it reached the threshold): what arrives is resolved
            let reservation = Reservation { reads, head: prefetch.head_pages, wanted: None, cost_cut: false };
            let (stage, done) = self.finish_reservation(op, prefetch, reservation, pool)?;
            return Ok(Reserve::Decided(stage, done));
        }
        // a split's head (the hit's first pages) is the engine's: the reads start after it
        let (head, planned, cost_cut) = self.plan_hit(prefetch, pool, hit_pages, reads.pages.len());
        if planned * pool.page_size < threshold && reads.pages.is_empty() {
            let (stage, done) = self.end_empty(prefetch, pool, PrefetchStop::RecomputeFaster);
            return Ok(Reserve::Decided(stage, done));
        }
        let wanted = planned - reads.pages.len();
        let reservation = Reservation { reads, head, wanted: Some(wanted), cost_cut };
        if pool.host.available() < wanted {
            return Ok(Reserve::Short(reservation, wanted - pool.host.available()));
        }
        let (stage, done) = self.finish_reservation(op, prefetch, reservation, pool)?;
        Ok(Reserve::Decided(stage, done))
    }

    /// Reserves what the pool can hold of `reservation` (nothing more when the prefetch stopped) and queues the
    /// prefetch's last reads; a hit of which too few pages fit ends here. The tick calls it again after it made
    /// what room it could for a [`Reserve::Short`].
    pub(super) fn finish_reservation(
        &mut self,
        op: OpId,
        prefetch: &mut Prefetch,
        reservation: Reservation,
        pool: &mut Pool<'_>,
    ) -> Result<(Stage, Option<PrefetchDone>), Error> {
        let Reservation { mut reads, head, wanted, cost_cut } = reservation;
        let mut short = cost_cut.then_some(Short::Cost);
        let mut more = Vec::new();
        if let Some(wanted) = wanted {
            let count = wanted.min(pool.host.available());
            if reads.pages.is_empty() && count * pool.page_size < self.settings.prefetch_threshold {
                // nothing reserved yet, and too few fit (pages reserved while the query ran are being read: they
                // are resolved below whatever their number, never dropped with their reads under way)
                return Ok(self.end_empty(prefetch, pool, PrefetchStop::HostPoolFull));
            }
            if count < wanted && self.settings.trailing.is_some() {
                // a shorter prefix would not end where the trailing window was agreed: all or nothing
                return Ok(self.end_empty(prefetch, pool, PrefetchStop::HostPoolFull));
            }
            if count < wanted && short.is_none() {
                short = Some(Short::Capped);
            }
            prefetch.head_pages = head;
            more = pool.host.alloc(count).expect("no more than available");
        }
        self.queue_reads(op, prefetch, &mut reads, more, true)?;
        prefetch.reads_queued_at.get_or_insert(self.clock.now());
        prefetch.hold_only(&mut self.capacity, (reads.pages.len() * pool.page_size) as u64)?;
        prefetch.explanation.reserved_tokens = reads.pages.len() * pool.page_size;
        Ok((Stage::Fetching(Fetching { reads, short, past_limit: false }), None))
    }

    /// The cost plan, with the rates every rank agreed on, for `pages` of the prefetch's hit after its head (a
    /// split's), the first `arrived` of them in host memory already, fetching at least `at_least`; `None` when not
    /// prefetching by cost. A split is weighed only while the scheduler has not asked for the request (the engine
    /// computes the head before it does).
    fn plan_for(
        &self,
        prefetch: &Prefetch,
        pool: &Pool<'_>,
        pages: usize,
        arrived: usize,
        at_least: usize,
    ) -> Option<Plan> {
        let cached_tokens = prefetch.cached_tokens + prefetch.head_pages * pool.page_size;
        let hit = Hit {
            cached_tokens,
            pages,
            page_tokens: pool.page_size,
            page_bytes: pool.page_bytes(),
            prompt_tokens: prefetch.prompt_tokens.max(cached_tokens + pages * pool.page_size),
            arrived_pages: arrived,
            split: self.settings.split && !prefetch.wanted && prefetch.head_pages == 0,
            min_fetch_pages: self.settings.prefetch_threshold.div_ceil(pool.page_size),
        };
        self.settings.by_cost.then(|| plan(&self.agreed, &hit, at_least))
    }

    /// The pages of a hit of `hit_pages` (every rank's) the engine computes (a split's head), the pages after them
    /// to fetch, `reserved` of them already on their way, and whether that is less than the hit: none and all of
    /// them, or as the cost plan says (recorded in the explanation) when prefetching by cost.
    fn plan_hit(
        &self,
        prefetch: &mut Prefetch,
        pool: &Pool<'_>,
        hit_pages: usize,
        reserved: usize,
    ) -> (usize, usize, bool) {
        let Some(planned) = self.plan_for(prefetch, pool, hit_pages, 0, reserved) else {
            return (0, hit_pages, false);
        };
        prefetch.explanation.plan = Some(planned);
        let cost_cut = planned.compute_head_pages + planned.fetch_pages < hit_pages;
        if self.settings.meet {
            // an engine that meets the reads computes a split's head anyway: its pages are read too, from the end,
            // so reads faster than the plan expects meet the compute earlier (the head is only where it expects them
            // to meet)
            return (0, planned.compute_head_pages + planned.fetch_pages, cost_cut);
        }
        (planned.compute_head_pages, planned.fetch_pages, cost_cut)
    }

    /// Whether the scheduler, wanting the request now, should stop waiting for the rest of its `reserved` pages
    /// (`fetched_tokens` and `reading`: every rank's count of fetched tokens and seconds spent reading): keeping what
    /// arrived and computing the rest is expected to be faster than waiting for the rest. The rest is expected when
    /// the reads of all the reserved pages, at the agreed rates, would end after they were queued; once that time is
    /// past, as late again as they already are (a read just overdue is about to end, a stalled one ever further off),
    /// but no later than a whole read of the pages not arrived from now. While the tier's read rate is still unknown
    /// (the reads that measure it), as long again as they have taken: the scheduler waits for them about as long as
    /// computing the pages still missing takes, and no more.
    pub(super) fn waiting_costs_more(
        &self,
        prefetch: &Prefetch,
        pool: &Pool<'_>,
        reserved: usize,
        fetched_tokens: usize,
        reading: f64,
    ) -> bool {
        if !self.settings.by_cost || !prefetch.wanted || prefetch.aborted || prefetch.shared.progress.is_terminated() {
            return false;
        }
        let rates = &self.agreed;
        if rates.prefill_s_per_token.is_none() {
            return false;
        }
        let page_bytes = pool.page_bytes();
        let arrived = (fetched_tokens / pool.page_size).min(reserved);
        let planned = rates.fetch_s(reserved, page_bytes);
        let rest = if rates.storage_read_bytes_per_s.is_none() {
            reading
        } else if reading < planned {
            planned - reading
        } else {
            (reading - planned).min(rates.fetch_s(reserved - arrived, page_bytes))
        };
        let from = prefetch.cached_tokens + prefetch.head_pages * pool.page_size;
        let prompt = prefetch.prompt_tokens.max(from + reserved * pool.page_size);
        let after =
            |pages: usize| rates.load_s(pages, page_bytes).max(rates.compute_s(from + pages * pool.page_size, prompt));
        after(arrived) < rest + after(reserved)
    }

    /// Every rank's count is final (`fetched_tokens`, the minimum, is the result; `quiet`: every rank's fetch
    /// thread is done): the result goes to the scheduler once it asked for it, and the pages past it drain.
    pub(super) fn resolve(
        &mut self,
        prefetch: &mut Prefetch,
        fetching: Fetching,
        fetched_tokens: usize,
        quiet: bool,
        pool: &mut Pool<'_>,
    ) -> Result<(Stage, Option<PrefetchDone>), Error> {
        if !(prefetch.wanted || prefetch.aborted) {
            return Ok((Stage::Fetching(fetching), None));
        }
        let reserved = fetching.reads.pages.len();
        let kept = if prefetch.aborted { 0 } else { fetched_tokens / pool.page_size };
        let local = prefetch.shared.progress.completed() as usize;
        let failure = prefetch.shared.failure.get().cloned();
        prefetch.explanation.local_fetched_tokens = local;
        prefetch.explanation.fetched_tokens = kept * pool.page_size;
        let end = End::Counted {
            fetching: &fetching,
            all: kept == reserved,
            failed: failure.is_some(),
            above_minimum: local > kept * pool.page_size,
        };
        prefetch.explanation.stop = prefetch.stop_reason(self.settings.policy, &end).expect("a counted prefetch stops");
        if failure.is_some() {
            prefetch.explanation.error = failure;
        }
        let op = prefetch.explanation.op;
        let given = self.ledger.release(&Release { op, range: 0..kept })?;
        pool.host.update_prefetch(&given)?;
        let Reads { mut pages, mut keys } = fetching.reads;
        let tail = pages.split_off(kept);
        keys.truncate(kept);
        let done = self.finish(prefetch, pool, given, keys);
        let tail = if quiet { self.drain(prefetch, tail, pool)? } else { tail };
        Ok((Stage::Draining(tail), Some(done)))
    }

    /// Every rank's fetch thread is done with the pages: the tail goes back to the allocator. Returns what is left
    /// to drain (nothing).
    pub(super) fn drain(
        &mut self,
        prefetch: &Prefetch,
        tail: Vec<HostPageId>,
        pool: &mut Pool<'_>,
    ) -> Result<Vec<HostPageId>, Error> {
        let start = prefetch.explanation.reserved_tokens / pool.page_size - tail.len();
        let release = Release { op: prefetch.explanation.op, range: start..start + tail.len() };
        let pages = self.ledger.release(&release)?;
        pool.free(&pages)?;
        Ok(Vec::new())
    }

    /// The prefetch ends at `stop` with no page reserved: its result, and nothing left to drain.
    fn end_empty(
        &mut self,
        prefetch: &mut Prefetch,
        pool: &Pool<'_>,
        stop: PrefetchStop,
    ) -> (Stage, Option<PrefetchDone>) {
        prefetch.explanation.stop = stop;
        (Stage::Draining(Vec::new()), Some(self.finish(prefetch, pool, Vec::new(), Vec::new())))
    }

    fn finish(
        &mut self,
        prefetch: &mut Prefetch,
        pool: &Pool<'_>,
        mut pages: Vec<HostPageId>,
        mut keys: Vec<PageKey>,
    ) -> PrefetchDone {
        let mut head_tokens = prefetch.head_pages * pool.page_size;
        if self.settings.meet && !pages.is_empty() {
            // read from the end: the pages kept are the reserved ones' last, and the engine computes those before
            pages.reverse();
            keys.reverse();
            head_tokens += prefetch.explanation.reserved_tokens - pages.len() * pool.page_size;
        }
        let explanation = &mut prefetch.explanation;
        explanation.elapsed = self.clock.now().saturating_sub(prefetch.started_at);
        explanation.query_time = prefetch.shared.hit.get().map_or(explanation.elapsed, |hit| hit.elapsed);
        explanation.read_time =
            Duration::from_nanos(prefetch.shared.read_ns.load(std::sync::atomic::Ordering::Relaxed));
        self.requests.remove(&prefetch.request_id);
        tracing::debug!(
            request = %explanation.request_id,
            stop = ?explanation.stop,
            requested = explanation.requested_tokens,
            hit = explanation.local_hit_tokens,
            tp_min_hit = explanation.tp_min_hit_tokens,
            fetched = explanation.fetched_tokens,
            elapsed_ms = explanation.elapsed.as_secs_f64() * 1e3,
            error = explanation.error.as_ref().map(tracing::field::display),
            planned_pages = explanation.plan.map(|plan| plan.fetch_pages),
            plan = explanation.plan.map(|plan| plan.reason.name()),
            "prefetch finished"
        );
        // a trailing window's entries were read for the hit's last pages only
        let trailing_from = self.settings.trailing.map_or(0, |trailing| {
            (prefetch.explanation.reserved_tokens / pool.page_size).saturating_sub(trailing.window.get())
        });
        PrefetchDone {
            request_id: prefetch.request_id.clone(),
            head_tokens,
            host_pages: pages,
            keys,
            trailing_from,
            explanation: prefetch.explanation.clone(),
        }
    }
}
