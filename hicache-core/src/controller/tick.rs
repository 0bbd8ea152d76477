//! The scheduler's tick: the one point where TP ranks agree on everything that can differ between them
//! (docs/sglang.md#tp, #fixed-16).
//!
//! The tick's collective has a fixed shape whatever the local state: two counters (write acks, backup acks), the
//! rates of the cost model and [`StorageSettings::tick_slots`](super::StorageSettings::tick_slots) prefetch slots of
//! seven values, all reduced with one MIN (a MAX is a MIN of the negation). Every rank enters it once per tick, so no
//! rank can skip a collective another enters.
//!
//! A tick runs in phases and calls nothing back. [`begin_tick`](CacheController::begin_tick) reduces, takes the acks
//! and steps each prefetch in its slot. When a prefetch's reservation needs more free host pages than the pool has,
//! the tick pauses ([`TickProgress::NeedsHostPages`]): the caller evicts host pages (the tree: least recently used
//! host-only nodes) and hands the tick back with [`resume_tick`](CacheController::resume_tick), which reserves what
//! fits and goes on with the next slots. Every rank pauses at the same prefetch, since every decision before it
//! came from reduced values.

use super::prefetch::{Prefetch, Reservation, Reserve, Stage, Tracked};
use super::tier::{Pool, StorageTier};
use super::{Ack, BackupReport, CacheController, PrefetchDone};
use crate::collective::{Collective, ReduceOp};
use crate::config::PrefetchPolicy;
use crate::controller::OpId;
use crate::cost::{ENCODED, Rates};
use crate::error::Error;
use crate::transfer::TransferEngine;

/// Values per prefetch slot in the tick's collective.
const SLOT_VALUES: usize = 7;
/// Values before the slots: completed writes, completed backups, then the rates of the cost model (each negated, so
/// the MIN is the slowest rank's).
const HEADER: usize = 2 + ENCODED;

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

/// How far a tick got.
#[derive(Debug)]
pub enum TickProgress<E> {
    /// The tick is done: everything it decided.
    Done(TickReport<E>),
    /// A prefetch's reservation needs more free host pages than the pool has ([`PausedTick::pages`]): evict what
    /// can go, then [`resume_tick`](CacheController::resume_tick).
    NeedsHostPages(PausedTick<E>),
}

/// A tick waiting for free host pages.
#[derive(Debug)]
pub struct PausedTick<E> {
    report: TickReport<E>,
    /// The prefetches still to step, with their reduced slots.
    rest: std::vec::IntoIter<(OpId, Slot)>,
    waiting: Box<Waiting>,
    pages: usize,
}

impl<E> PausedTick<E> {
    /// Host pages the waiting reservation lacks.
    pub fn pages(&self) -> usize {
        self.pages
    }
}

/// The prefetch whose reservation paused the tick.
#[derive(Debug)]
struct Waiting {
    op: OpId,
    prefetch: Prefetch,
    reservation: Reservation,
}

/// What a prefetch's step at a tick led to.
#[expect(clippy::large_enum_variant, reason = "a step's value, moved once and matched at once")]
enum Step {
    /// Its result, when it has one now.
    Decided(Option<PrefetchDone>),
    /// Its reservation lacks this many free host pages.
    Short(Box<Waiting>, usize),
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
    /// The scheduler's tick without host eviction: a pause for host pages resumes at once, and the reservation
    /// takes what is free.
    ///
    /// # Errors
    ///
    /// As [`begin_tick`](Self::begin_tick).
    pub fn tick(&mut self, collective: &mut dyn Collective) -> Result<TickReport<E::Event>, Error> {
        self.tick_with(collective, &mut |_, _| {})
    }

    /// The scheduler's tick for a caller that frees host pages itself: each pause calls `evict_host(self, pages)`
    /// before the tick resumes (SGLang's `evict_host` and retry).
    ///
    /// # Errors
    ///
    /// As [`begin_tick`](Self::begin_tick).
    pub fn tick_with(
        &mut self,
        collective: &mut dyn Collective,
        evict_host: &mut dyn FnMut(&mut Self, usize),
    ) -> Result<TickReport<E::Event>, Error> {
        let mut progress = self.begin_tick(collective)?;
        loop {
            match progress {
                TickProgress::Done(report) => return Ok(report),
                TickProgress::NeedsHostPages(paused) => {
                    evict_host(self, paused.pages());
                    progress = self.resume_tick(paused)?;
                }
            }
        }
    }

    /// Begins the scheduler's tick: one fixed-shape collective, then everything it decided: write acks (their
    /// storage backups start), finished backups, prefetch hits (host pages reserved), prefetch results, drained
    /// pages. It pauses when a reservation needs host pages the pool lacks ([`TickProgress`]).
    ///
    /// # Errors
    ///
    /// The collective's errors (the group is broken then, and nothing was changed); allocator errors (bugs).
    pub fn begin_tick(&mut self, collective: &mut dyn Collective) -> Result<TickProgress<E::Event>, Error> {
        let slots = self.storage.as_ref().map_or(0, |storage| storage.settings.tick_slots);
        let mut values = vec![0i64; HEADER + slots * SLOT_VALUES];
        values[0] = self.completed_writes() as i64;
        let ops = match &mut self.storage {
            Some(storage) => storage.write_tick_values(&mut values),
            None => Vec::new(),
        };
        collective.all_reduce(&mut values, ReduceOp::Min)?;
        tracing::trace!(writes = values[0], backups = values[1], prefetch_slots = ops.len(), "tick reduced");

        if let Some(storage) = &mut self.storage {
            let slowest: [i64; ENCODED] = std::array::from_fn(|index| -values[2 + index]);
            storage.agreed = Rates::decode(&slowest, storage.settings.batch_pages);
        }
        let report = TickReport {
            write_acks: self.take_write_acks(values[0] as usize)?,
            backups: self.take_backups(values[1] as usize)?,
            prefetches: Vec::new(),
        };
        let slots: Vec<(OpId, Slot)> = ops
            .into_iter()
            .enumerate()
            .map(|(index, op)| (op, Slot::read(&values[HEADER + index * SLOT_VALUES..][..SLOT_VALUES])))
            .collect();
        self.step_prefetches(report, slots.into_iter())
    }

    /// Resumes a tick that paused for host pages: the waiting reservation takes what is free now, and the tick goes
    /// on with the next prefetches.
    ///
    /// # Errors
    ///
    /// As [`begin_tick`](Self::begin_tick); [`Error::Internal`] for a tick this controller did not pause.
    pub fn resume_tick(&mut self, paused: PausedTick<E::Event>) -> Result<TickProgress<E::Event>, Error> {
        let PausedTick { mut report, rest, waiting, .. } = paused;
        let Waiting { op, mut prefetch, reservation } = *waiting;
        let Some(storage) = &mut self.storage else {
            return Err(Error::Internal("a tick resumed on a controller without storage".into()));
        };
        let mut pool = Pool { host: &mut self.host, memory: &self.memory, page_size: self.page_size };
        let (stage, done) = storage.finish_reservation(op, &mut prefetch, reservation, &mut pool)?;
        report.prefetches.extend(done);
        storage.keep(op, Tracked { prefetch, stage })?;
        self.step_prefetches(report, rest)
    }

    /// Steps the prefetches of `slots` in order, pausing at a reservation short of host pages.
    fn step_prefetches(
        &mut self,
        mut report: TickReport<E::Event>,
        mut slots: std::vec::IntoIter<(OpId, Slot)>,
    ) -> Result<TickProgress<E::Event>, Error> {
        let Some(storage) = &mut self.storage else { return Ok(TickProgress::Done(report)) };
        let mut pool = Pool { host: &mut self.host, memory: &self.memory, page_size: self.page_size };
        while let Some((op, slot)) = slots.next() {
            match storage.step(op, slot, &mut pool)? {
                Step::Decided(done) => report.prefetches.extend(done),
                Step::Short(waiting, pages) => {
                    return Ok(TickProgress::NeedsHostPages(PausedTick { report, rest: slots, waiting, pages }));
                }
            }
        }
        Ok(TickProgress::Done(report))
    }
}

impl StorageTier {
    /// Writes this rank's side of the tick's collective after the write count: finished backups, rates, and a slot
    /// for each of the first prefetches that take part; returns those prefetches.
    fn write_tick_values(&mut self, values: &mut [i64]) -> Vec<OpId> {
        values[1] = self.completed_backups() as i64;
        for read in self.workers.take_reads() {
            self.cost.observe_read(read.calls, read.bytes, read.elapsed);
        }
        for (value, rate) in values[2..HEADER].iter_mut().zip(self.cost.rates().encode()) {
            *value = -rate;
        }
        let now = self.clock.now();
        let mut ops = Vec::new();
        let slots = self.settings.tick_slots;
        for (op, tracked) in self.prefetches.iter_mut().filter(|(_, tracked)| tracked.in_collective()).take(slots) {
            let prefetch = &mut tracked.prefetch;
            if matches!(&tracked.stage, Stage::Fetching(fetching) if fetching.past_limit) && prefetch.wanted {
                prefetch.shared.progress.terminate();
            }
            let limit = self.settings.timeout(prefetch.tokens);
            let quiet = prefetch.shared.quiet.is_set();
            let terminated = prefetch.shared.progress.is_terminated();
            // a prefetch whose storage I/O goes on without progress for the read deadline is stuck (a hung mount):
            // it stops under every policy, wait_complete included
            let progress = prefetch.shared.found_pages() as u64
                + prefetch.shared.asked.load(std::sync::atomic::Ordering::Relaxed)
                + prefetch.shared.progress.completed();
            if progress != prefetch.progress_mark.0 {
                prefetch.progress_mark = (progress, now);
            }
            let waiting_on_storage = matches!(tracked.stage, Stage::Querying(_) | Stage::Fetching(_));
            let stalled = waiting_on_storage
                && !quiet
                && !terminated
                && now.saturating_sub(prefetch.progress_mark.1) > self.settings.read_deadline;
            // before the query ends, the pages found so far (a lower bound of the hit: they only grow)
            let hit = prefetch.shared.hit.get();
            let hit_pages = match hit {
                // with a trailing window, the ranks agree in rounds: each proposes a length it can restore
                Some(hit) if self.settings.trailing.is_some() => hit.proposal(prefetch.cap.unwrap_or(usize::MAX)),
                Some(hit) => hit.pages,
                None => prefetch.shared.found_pages(),
            };
            let slot = Slot {
                hit_ready: hit.is_some(),
                hit_pages: hit_pages as i64,
                last: quiet || terminated,
                fetched_tokens: prefetch.shared.progress.completed() as i64,
                quiet,
                in_time: !(self.settings.policy == PrefetchPolicy::Timeout
                    && prefetch.wanted
                    && now.saturating_sub(prefetch.started_at) > limit),
                stalled,
                reading_us: prefetch
                    .reads_queued_at
                    .map_or(0, |queued| now.saturating_sub(queued).as_micros().min(i64::MAX as u128) as i64),
            };
            slot.write(&mut values[HEADER + ops.len() * SLOT_VALUES..][..SLOT_VALUES]);
            ops.push(*op);
        }
        ops
    }

    /// Steps prefetch `op` by its reduced `slot`: its stage is taken and a new one given back (or the prefetch
    /// retired), unless its reservation lacks host pages.
    fn step(&mut self, op: OpId, slot: Slot, pool: &mut Pool<'_>) -> Result<Step, Error> {
        let Some(Tracked { mut prefetch, stage }) = self.prefetches.remove(&op) else {
            return Err(Error::Internal(format!("tick slot for prefetch {} which is gone", op.0)));
        };
        let policy = self.settings.policy;
        // a query the scheduler no longer waits for (its storage may hang): best_effort stops when the request is
        // taken, timeout at its limit on any rank, an abort at once
        prefetch.stalled |= slot.stalled;
        let stop_waiting = prefetch.aborted
            || prefetch.stalled
            || (prefetch.wanted && (policy == PrefetchPolicy::BestEffort || !slot.in_time));
        let hit_pages = slot.hit_pages as usize;
        // with a trailing window, every rank's query is done and the proposals reduced to `hit_pages`: it is the
        // agreed hit once a round reduces to what the last one did (every rank can restore it), or to 0
        let another_round = self.settings.trailing.is_some()
            && matches!(stage, Stage::Querying(_))
            && slot.hit_ready
            && !prefetch.aborted
            && hit_pages > 0
            && prefetch.cap != Some(hit_pages);
        if another_round {
            prefetch.cap = Some(hit_pages);
        }
        let (stage, done) = match stage {
            Stage::Querying(reads) if another_round => (Stage::Querying(reads), None),
            Stage::Querying(reads) if slot.hit_ready => {
                match self.reserve(op, &mut prefetch, reads, hit_pages, pool)? {
                    Reserve::Decided(stage, done) => (stage, done),
                    Reserve::Short(reservation, pages) => {
                        return Ok(Step::Short(Box::new(Waiting { op, prefetch, reservation }), pages));
                    }
                }
            }
            Stage::Querying(reads) if stop_waiting => self.stop_querying(op, &mut prefetch, reads, hit_pages, pool)?,
            Stage::Querying(reads) => {
                (Stage::Querying(self.reserve_agreed(op, &mut prefetch, reads, hit_pages, pool)?), None)
            }
            Stage::Fetching(mut fetching) => {
                fetching.past_limit = !slot.in_time;
                let reading = slot.reading_us as f64 / 1e6;
                let reserved = fetching.reads.pages.len();
                if !slot.last
                    && self.waiting_costs_more(&prefetch, pool, reserved, slot.fetched_tokens as usize, reading)
                {
                    // every rank sees the same reduced count and rates: every rank stops here
                    fetching.cut_by_cost();
                    prefetch.shared.progress.terminate();
                }
                if prefetch.stalled {
                    // reads already queued end with their last job; the ones stuck hold their pages until they
                    // return (the tail is freed only when the fetch thread is quiet)
                    prefetch.shared.progress.terminate();
                }
                if slot.last {
                    self.resolve(&mut prefetch, fetching, slot.fetched_tokens as usize, slot.quiet, pool)?
                } else {
                    (Stage::Fetching(fetching), None)
                }
            }
            Stage::Draining(tail) if slot.quiet => (Stage::Draining(self.drain(&prefetch, tail, pool)?), None),
            Stage::Draining(tail) => (Stage::Draining(tail), None),
        };
        self.keep(op, Tracked { prefetch, stage })?;
        Ok(Step::Decided(done))
    }

    /// Keeps a prefetch for later ticks, or retires it when nothing of it is left in the host pool.
    fn keep(&mut self, op: OpId, tracked: Tracked) -> Result<(), Error> {
        if matches!(&tracked.stage, Stage::Draining(tail) if tail.is_empty()) {
            self.capacity.release(tracked.prefetch.admitted)?;
        } else {
            self.prefetches.insert(op, tracked);
        }
        Ok(())
    }
}
