//! The storage half's settings, records and I/O threads (docs/sglang.md#backup to #constants).
//!
//! Three threads per controller, each taking jobs in order from a channel:
//! * the **query** thread hashes a prefetch's tokens and asks storage which leading pages it holds
//!   ([`storage_hit_query_with`]), batch by batch with early exit, publishing each batch's hits as it is answered;
//!   it touches no host memory;
//! * the **fetch** thread reads the pages the scheduler reserved for a prefetch, a batch at a time, straight into
//!   host pages, and counts them only after their bytes are in host memory ([`Progress`]: data before count). A
//!   prefetch's pages may come in several jobs (the scheduler reserves the agreed leading hit while the query still
//!   runs); the thread stops at the first page that fails or when the scheduler terminates the prefetch, and after
//!   the prefetch's last job marks it *quiet*: it will not touch its host pages again, so the scheduler may free
//!   them;
//! * the **backup** thread writes host pages to storage a batch at a time, straight from host memory, recording
//!   every page's outcome and going on past a failed page (SGLang stops at the first failed batch and records
//!   nothing: docs/sglang.md#fixed-27), under an optional bandwidth cap.
//!
//! Zero copy: a batch's host pages are lent to the backend in place ([`HostMemory`]'s leases), for writing during a
//! fetch (the pages are *reserved*: nothing else reads or frees them until the prefetch is quiet) and for reading
//! during a backup (the pages are *pinned*: nothing writes or frees them until the backup is taken). The lease of a
//! fetched batch is returned before its tokens are counted, so a page that a load may read is never still being
//! written. The backend is told about the whole host pool once, when the threads start
//! ([`StorageBackend::register_host_memory`]), and told to forget it when they stop.
//!
//! The threads never touch the allocators: they report through shared records the scheduler reads at its tick.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use super::hit_query::storage_hit_query_with;
use super::outcome::{PageBackup, StorageFailure};
use crate::config::{HiCacheConfig, PrefetchPolicy};
use crate::controller::Progress;
use crate::cost::Priors;
use crate::error::Error;
use crate::hash::{PageHasher, PageKey};
use crate::host_memory::{HostMemory, MemoryRegion};
use crate::host_pool::HostPageId;
use crate::rate_limit::{Admission, Clock, SystemClock, TokenBucket};
use crate::storage::{GetOutcome, SetOutcome, StorageBackend};
use crate::threads::Threads;

/// How the storage half behaves: SGLang's knobs (all configurable here) and this rank's role.
#[derive(Clone, Debug, PartialEq)]
pub struct StorageSettings {
    /// Tokens per page.
    pub page_size: usize,
    /// Pages per storage call, for hit queries and I/O (SGLang: 128).
    pub batch_pages: usize,
    /// Fewest tokens worth prefetching: requests below it are not queried, hits below it are revoked.
    pub prefetch_threshold: usize,
    /// When a prefetch may stop.
    pub policy: PrefetchPolicy,
    /// `timeout` policy: base.
    pub timeout_base: Duration,
    /// `timeout` policy: added per 1024 tokens.
    pub timeout_per_ki_token: Duration,
    /// `timeout` policy: upper bound.
    pub timeout_max: Duration,
    /// How long a prefetch may go without progress before it stops with what arrived, under every policy.
    pub read_deadline: Duration,
    /// Tokens ongoing prefetches may hold in the host pool.
    pub capacity_tokens: u64,
    /// This rank does not write to storage (MLA ranks other than 0: the latent KV is the same on every rank).
    pub backup_skip: bool,
    /// Bandwidth cap of backups in bytes per second; 0 for none.
    pub write_bytes_per_s: u64,
    /// Prefetch operations reduced per tick (the fixed shape of the tick's collective); later ones wait a tick.
    pub tick_slots: usize,
    /// Fetch a hit only as far as bringing it is faster than computing it ([`crate::cost`]).
    pub by_cost: bool,
    /// The engine computes a split hit's head itself ([`crate::cost`]; only with `by_cost`).
    pub split: bool,
    /// The engine meets the reads: planned fetches are read from their end ([`HiCacheConfig::prefetch_meet`]).
    pub meet: bool,
    /// The rates assumed until measured.
    pub priors: Priors,
    /// A hybrid model's trailing window as this rank sees it ([`Trailing`]), `None` for a model without.
    pub trailing: Option<Trailing>,
}

/// A hybrid model's trailing window (a Mamba state, a sliding window: sidecar pools a prefix needs only at its last
/// pages), as one rank of it sees it. Ranks of such a model run in lockstep (every pool's ranks make the same calls)
/// and store page groups under the same keys:
///
/// * a rank that holds pages every prefix needs (the KV, an all-pages sidecar) stores and reads every page;
/// * a rank that holds a trailing-window pool ([`pool`](Self::pool)) stores of each backed-up node only the held
///   entries among its last `window` pages, and reads of a hit of `n` pages only pages `n - window .. n`.
///
/// Which prefixes storage can restore is then a set, not a leading run: the ranks agree on the longest length in
/// every rank's set, in rounds of the tick's reduction (each rank proposes its longest length no longer than the
/// last round's result, until a round's result is what every rank proposed). A hit is fetched whole: not by cost,
/// not split, and not at all when the host pool cannot hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Trailing {
    /// Pages the window spans (the largest of the model's trailing-window pools).
    pub window: std::num::NonZeroUsize,
    /// This rank holds a trailing-window pool.
    pub pool: bool,
}

impl StorageSettings {
    /// Settings from a config, for pools of `host_tokens` and `device_tokens`, on rank `tp_rank` of an MLA model or
    /// not.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] from [`HiCacheConfig::validated`]; [`Error::InvalidArgument`] when the host pool is
    /// not larger than the device pool.
    pub fn from_config(
        config: &HiCacheConfig,
        host_tokens: usize,
        device_tokens: usize,
        mla: bool,
        tp_rank: usize,
    ) -> Result<Self, Error> {
        let config = config.clone().validated()?;
        let capacity = crate::rate_limit::PrefetchCapacity::for_pools(
            host_tokens as u64,
            device_tokens as u64,
            config.prefetch_capacity_fraction,
        )?;
        Ok(Self {
            page_size: config.page_size,
            batch_pages: config.storage_batch_pages,
            prefetch_threshold: config.effective_prefetch_threshold(),
            policy: config.prefetch_policy,
            timeout_base: Duration::from_secs_f64(config.prefetch_timeout_base_s),
            timeout_per_ki_token: Duration::from_secs_f64(config.prefetch_timeout_per_ki_token_s),
            timeout_max: Duration::from_secs_f64(config.prefetch_timeout_max_s),
            read_deadline: Duration::from_secs_f64(config.storage_read_deadline_s),
            capacity_tokens: capacity.limit(),
            backup_skip: mla && tp_rank != 0,
            write_bytes_per_s: config.storage_write_bytes_per_s,
            tick_slots: DEFAULT_TICK_SLOTS,
            by_cost: config.prefetch_by_cost,
            split: config.prefetch_split,
            meet: config.prefetch_meet,
            priors: Priors {
                storage_read_bytes_per_s: (config.prior_storage_read_gbps > 0.0)
                    .then_some(config.prior_storage_read_gbps * 1e9),
                storage_call_s: 0.0,
                load_bytes_per_s: config.prior_load_gbps * 1e9,
                prefill_tokens_per_s: (config.prior_prefill_tokens_per_s > 0.0)
                    .then_some(config.prior_prefill_tokens_per_s),
            },
            trailing: None,
        })
    }

    /// The `timeout` policy's limit for a prefetch of `tokens`: base + per-1K × tokens / 1024, capped.
    pub fn timeout(&self, tokens: usize) -> Duration {
        let extra = self.timeout_per_ki_token.as_secs_f64() * tokens as f64 / 1024.0;
        let extra = Duration::try_from_secs_f64(extra).unwrap_or(Duration::MAX);
        self.timeout_base.saturating_add(extra).min(self.timeout_max)
    }
}

/// Prefetch operations per tick unless configured otherwise.
pub const DEFAULT_TICK_SLOTS: usize = 32;

/// A flag the I/O threads set once and the scheduler reads or waits for.
#[derive(Debug, Default)]
pub(super) struct Latch {
    set: Mutex<bool>,
    changed: Condvar,
}

impl Latch {
    pub(super) fn set(&self) {
        *self.set.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = true;
        self.changed.notify_all();
    }

    pub(super) fn is_set(&self) -> bool {
        *self.set.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) fn wait(&self) {
        let mut set = self.set.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        while !*set {
            set = self.changed.wait(set).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

/// How this rank's query ended.
#[derive(Debug)]
pub(super) struct HitFound {
    /// Leading pages found: all of [`PrefetchShared::found`] (never fewer than were published during the query).
    pub(super) pages: usize,
    /// The storage error that ended the query early, if any.
    pub(super) error: Option<StorageFailure>,
    /// A trailing-window pool's rank: the lengths it can restore, ascending (its entries are held at some pages
    /// only); `None` where every length up to `pages` is (a leading run).
    pub(super) lengths: Option<Vec<usize>>,
    /// How long the query took.
    pub(super) elapsed: Duration,
}

impl HitFound {
    /// This rank's proposal in a round of the ranks' agreement on a trailing window's hit: the longest length it can
    /// restore that is no longer than `cap` (the last round's result).
    pub(super) fn proposal(&self, cap: usize) -> usize {
        match &self.lengths {
            Some(lengths) => lengths.iter().rev().copied().find(|&length| length <= cap).unwrap_or(0),
            None => self.pages.min(cap),
        }
    }
}

/// A prefetch as the I/O threads and the scheduler share it.
#[derive(Debug, Default)]
pub(super) struct PrefetchShared {
    /// Tokens fetched (bytes in host memory first), and the scheduler's terminate flag.
    pub(super) progress: Progress,
    /// Keys of the leading pages found so far, published batch by batch by the query thread; only ever grows.
    pub(super) found: Mutex<Vec<PageKey>>,
    /// Pages a trailing-window pool's query has asked storage about so far: it publishes its answer whole at its
    /// end, so this is what shows it progressing meanwhile (the read deadline watches it).
    pub(super) asked: std::sync::atomic::AtomicU64,
    /// Set once by the query thread when it is done.
    pub(super) hit: OnceLock<HitFound>,
    /// Set by the fetch thread when it is done with the host pages for good.
    pub(super) quiet: Latch,
    /// The read error that stopped the fetch, if any.
    pub(super) failure: OnceLock<StorageFailure>,
    /// Nanoseconds the fetch thread spent in storage reads for this prefetch.
    pub(super) read_ns: std::sync::atomic::AtomicU64,
    /// Tokens read and counted in `progress` so far, with the time spent in reads up to the one that brought the
    /// last of them (as `read_ns`): the two together, so a reader never pairs a count with an earlier batch's time.
    pub(super) arrivals: Mutex<(usize, Duration)>,
    /// When the fetch thread started the prefetch's first read.
    pub(super) reads_started: OnceLock<std::time::Instant>,
}

impl PrefetchShared {
    /// Leading pages the query found so far.
    pub(super) fn found_pages(&self) -> usize {
        self.found.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).len()
    }

    /// Keys of found pages `range` (the scheduler only asks for pages every rank found).
    pub(super) fn found_keys(&self, range: std::ops::Range<usize>) -> Vec<PageKey> {
        self.found.lock().unwrap_or_else(|poisoned| poisoned.into_inner())[range].to_vec()
    }
}

/// A backup as the backup thread and the scheduler share it.
#[derive(Debug)]
pub(super) struct BackupShared {
    pub(super) pages: Mutex<Vec<PageBackup>>,
    pub(super) cancel: std::sync::atomic::AtomicBool,
    pub(super) done: Latch,
}

impl BackupShared {
    pub(super) fn new(pages: usize) -> Self {
        Self {
            pages: Mutex::new(vec![PageBackup::Cancelled; pages]),
            cancel: std::sync::atomic::AtomicBool::new(false),
            done: Latch::default(),
        }
    }
}

struct QueryJob {
    shared: Arc<PrefetchShared>,
    tokens: Vec<u32>,
    last_key: Option<PageKey>,
}

struct FetchJob {
    shared: Arc<PrefetchShared>,
    pages: Vec<HostPageId>,
    keys: Vec<PageKey>,
    /// Leading pages counted without being read (a trailing-window pool's pages before the window).
    skip: usize,
    /// The prefetch's last job: the operation is quiet after it.
    last: bool,
}

struct BackupJob {
    shared: Arc<BackupShared>,
    pages: Vec<HostPageId>,
    keys: Vec<PageKey>,
    /// Where each page's outcome goes in the backup's record.
    positions: Vec<usize>,
}

/// The three I/O threads. Dropping this closes their channels and waits, up to the read deadline, for them to finish
/// the jobs queued and end (joined); a thread still inside a storage call then is left to end on its own (logged),
/// so a backend call that never returns cannot hang the process.
pub(super) struct Workers {
    query: Option<Sender<QueryJob>>,
    fetch: Option<Sender<FetchJob>>,
    backup: Option<Sender<BackupJob>>,
    /// Joined when dropped, after the senders (up to the read deadline: a thread stuck in a storage call is left).
    threads: Threads,
    reads: Arc<Mutex<Vec<ReadSample>>>,
}

/// The host pool told to the backend ([`StorageBackend::register_host_memory`]): the last of the I/O threads to
/// drop it tells the backend to forget the pool, so no call in flight uses the pool after that, and the pool stays
/// mapped until then.
struct Registration {
    storage: Arc<dyn StorageBackend>,
    region: MemoryRegion,
    _host: Arc<HostMemory>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.storage.unregister_host_memory(&self.region);
    }
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers").field("threads", &self.threads).finish()
    }
}

#[derive(Clone)]
struct Io {
    storage: Arc<dyn StorageBackend>,
    host: Arc<HostMemory>,
    page_size: usize,
    batch_pages: usize,
    trailing: Option<Trailing>,
    reads: Arc<Mutex<Vec<ReadSample>>>,
    _registration: Arc<Registration>,
}

/// Storage calls an I/O thread made for a prefetch: how many, the bytes they brought (0 for a hit query's
/// existence checks, which measure a call's fixed cost) and their time.
#[derive(Clone, Copy, Debug)]
pub(super) struct ReadSample {
    pub(super) calls: usize,
    pub(super) bytes: u64,
    pub(super) elapsed: Duration,
}

impl Workers {
    pub(super) fn start(
        storage: Arc<dyn StorageBackend>,
        host: Arc<HostMemory>,
        settings: &StorageSettings,
    ) -> Result<Self, Error> {
        let region = host.region();
        storage.register_host_memory(&region)?;
        let registration = Arc::new(Registration { storage: storage.clone(), region, _host: host.clone() });
        let reads = Arc::new(Mutex::new(Vec::new()));
        let io = Io {
            storage,
            host,
            page_size: settings.page_size,
            batch_pages: settings.batch_pages,
            trailing: settings.trailing,
            reads: reads.clone(),
            _registration: registration,
        };
        let (query, query_jobs) = channel();
        let (fetch, fetch_jobs) = channel();
        let (backup, backup_jobs) = channel();
        let bucket = match settings.write_bytes_per_s {
            0 => None,
            rate => Some(TokenBucket::new(rate, rate, SystemClock::new().now())?),
        };
        // on failure, dropping `workers` stops the threads started (no job was sent yet) and, with the last of them,
        // the registration
        let workers = Self {
            query: Some(query),
            fetch: Some(fetch),
            backup: Some(backup),
            threads: Threads::new("the controller's storage I/O", settings.read_deadline),
            reads,
        };
        let spawn = |name: &str, work: Box<dyn FnOnce() + Send>| {
            workers
                .threads
                .spawn(name.into(), work)
                .map_err(|error| Error::Internal(format!("cannot start the {name} thread: {error}")))
        };
        spawn(
            "hicache-query",
            Box::new({
                let io = io.clone();
                move || run_queries(&io, query_jobs)
            }),
        )?;
        spawn(
            "hicache-fetch",
            Box::new({
                let io = io.clone();
                move || run_fetches(&io, fetch_jobs)
            }),
        )?;
        spawn("hicache-backup", Box::new(move || run_backups(&io, backup_jobs, bucket)))?;
        Ok(workers)
    }

    pub(super) fn query(&self, shared: Arc<PrefetchShared>, tokens: Vec<u32>, last_key: Option<PageKey>) {
        send(&self.query, QueryJob { shared, tokens, last_key });
    }

    /// Queues the reads of `pages` (positions after those of earlier jobs of the same prefetch), the first `skip`
    /// of them counted without a read; `last` when no more jobs of this prefetch follow.
    pub(super) fn fetch(
        &self,
        shared: Arc<PrefetchShared>,
        pages: Vec<HostPageId>,
        keys: Vec<PageKey>,
        skip: usize,
        last: bool,
    ) {
        send(&self.fetch, FetchJob { shared, pages, keys, skip, last });
    }

    /// Queues the writes of `pages` under `keys`, each page's outcome recorded at its place in `positions`.
    pub(super) fn backup(
        &self,
        shared: Arc<BackupShared>,
        pages: Vec<HostPageId>,
        keys: Vec<PageKey>,
        positions: Vec<usize>,
    ) {
        send(&self.backup, BackupJob { shared, pages, keys, positions });
    }

    /// The reads the fetch thread made since the last call.
    pub(super) fn take_reads(&self) -> Vec<ReadSample> {
        std::mem::take(&mut *self.reads.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }
}

fn send<T>(sender: &Option<Sender<T>>, job: T) {
    // the threads only end when the senders are dropped, and every job catches its own panics
    sender.as_ref().expect("workers are running").send(job).expect("the I/O thread is running");
}

impl Drop for Workers {
    fn drop(&mut self) {
        // the threads end once their queues close; `threads`, dropped next, waits for them (each lets its share of
        // the registration go before it counts as ended, so the last one tells the backend to forget the pool)
        self.query.take();
        self.fetch.take();
        self.backup.take();
    }
}

/// Runs `job`, turning a panic (a bug in a backend) into an [`Error::Internal`], so the thread lives on (SGLang's
/// prefetch thread dies on an uncaught `IOError` and no prefetch completes again: docs/sglang.md#fixed-11).
fn guarded<T>(job: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)) {
        Ok(result) => result,
        Err(panic) => Err(Error::Internal(format!(
            "storage backend panicked: {}",
            panic.downcast_ref::<&str>().copied().or(panic.downcast_ref::<String>().map(String::as_str)).unwrap_or("?")
        ))),
    }
}

fn run_queries(io: &Io, jobs: Receiver<QueryJob>) {
    let mut hasher = PageHasher::new();
    for job in jobs {
        let shared = &job.shared;
        let started = std::time::Instant::now();
        // a trailing-window pool's rank answers with the lengths it can restore; a query not run or failed restores
        // nothing (its set may lack lengths it has)
        let pool_window = io.trailing.filter(|trailing| trailing.pool).map(|trailing| trailing.window.get());
        let nothing = || pool_window.map(|_| Vec::new());
        let (error, lengths) = if shared.progress.is_terminated() {
            (None, nothing())
        } else {
            let mut publish = |keys: &[PageKey]| {
                shared.found.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).extend_from_slice(keys);
                !shared.progress.is_terminated()
            };
            let query = guarded(|| match pool_window {
                Some(window) => trailing_query(io, &mut hasher, &job, window, &mut publish).map(Some),
                None => storage_hit_query_with(
                    &*io.storage,
                    &mut hasher,
                    &job.tokens,
                    io.page_size,
                    job.last_key,
                    io.batch_pages,
                    &mut publish,
                )
                .map(|_| None),
            });
            match query {
                Ok(lengths) => (None, lengths),
                Err(error) => (Some(StorageFailure::Call(error)), nothing()),
            }
        };
        let pages = shared.found_pages();
        let elapsed = started.elapsed();
        if error.is_none() && !job.tokens.is_empty() {
            // the query asks batch by batch until a batch is not all there
            let asked = job.tokens.len() / io.page_size;
            let calls = (pages / io.batch_pages + 1).min(asked.div_ceil(io.batch_pages));
            let sample = ReadSample { calls, bytes: 0, elapsed };
            io.reads.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(sample);
        }
        if let Some(error) = &error {
            tracing::warn!(backend = io.storage.name(), %error, pages, "storage hit query failed; the hit ends there");
        }
        let _ = shared.hit.set(HitFound { pages, error, elapsed, lengths });
    }
}

/// A trailing-window pool's hit query: which pages of `job`'s tokens storage holds an entry for (every page is
/// asked, a batch per call), and so which lengths it can restore: those whose last `window` pages it holds (pages
/// before the prefetch's start count as held: the tree's prefix the prefetch continues ends where they are).
/// Publishes the keys of the pages up to the longest such length; returns the lengths, ascending.
fn trailing_query(
    io: &Io,
    hasher: &mut PageHasher,
    job: &QueryJob,
    window: usize,
    publish: &mut dyn FnMut(&[PageKey]) -> bool,
) -> Result<Vec<usize>, Error> {
    let keys = hasher.page_keys(&job.tokens, io.page_size, job.last_key, crate::hash::PartialPage::Drop)?;
    let mut held = Vec::with_capacity(keys.len());
    for batch in keys.chunks(io.batch_pages) {
        if job.shared.progress.is_terminated() {
            // the prefetch was stopped (aborted, reset): a query not run to its end restores nothing
            return Ok(Vec::new());
        }
        let answers = io.storage.batch_contains(batch)?;
        if answers.len() != batch.len() {
            return Err(Error::storage(
                io.storage.name(),
                format!("{} answers for {} keys", answers.len(), batch.len()),
            ));
        }
        held.extend(answers);
        job.shared.asked.fetch_add(batch.len() as u64, std::sync::atomic::Ordering::Relaxed);
    }
    let lengths: Vec<usize> = (1..=keys.len())
        .filter(|&length| held[length.saturating_sub(window)..length].iter().all(|&held| held))
        .collect();
    let longest = lengths.last().copied().unwrap_or(0);
    publish(&keys[..longest]);
    Ok(lengths)
}

fn run_fetches(io: &Io, jobs: Receiver<FetchJob>) {
    for job in jobs {
        let shared = &job.shared;
        let skip = job.skip.min(job.pages.len());
        // pages of a trailing-window pool before the window: nothing to read, counted as they are
        if skip > 0 && shared.progress.increment((skip * io.page_size) as u64).is_err() {
            if job.last {
                shared.quiet.set();
            }
            continue;
        }
        for (pages, keys) in job.pages[skip..].chunks(io.batch_pages).zip(job.keys[skip..].chunks(io.batch_pages)) {
            // a failure in an earlier job of the prefetch ends the later ones too: counted pages stay a prefix
            if shared.progress.is_terminated() || shared.failure.get().is_some() {
                break;
            }
            // the lease ends with this block: the batch's pages are returned before their tokens are counted
            let started = std::time::Instant::now();
            let _ = shared.reads_started.set(started);
            let (arrived, failure) = match io.host.lend_write(pages) {
                Ok(mut lease) => match guarded(|| io.storage.batch_get(keys, &mut lease.pages_mut())) {
                    Ok(outcomes) => {
                        let arrived = outcomes.iter().take_while(|outcome| **outcome == GetOutcome::Hit).count();
                        let key = keys.get(arrived).copied();
                        let failure = outcomes.get(arrived).zip(key).and_then(|(outcome, key)| match outcome {
                            GetOutcome::Miss => Some(StorageFailure::Gone { key }),
                            GetOutcome::Failed(failure) => Some(StorageFailure::Page { key, failure: failure.clone() }),
                            GetOutcome::Hit => None,
                        });
                        (arrived.min(pages.len()), failure)
                    }
                    Err(error) => (0, Some(StorageFailure::Call(error))),
                },
                Err(error) => (0, Some(StorageFailure::Call(error))),
            };
            let elapsed = started.elapsed();
            let read_ns = shared.read_ns.fetch_add(elapsed.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed)
                + elapsed.as_nanos() as u64;
            if arrived > 0 {
                let bytes = (arrived * io.host.page_bytes()) as u64;
                let sample = ReadSample { calls: 1, bytes, elapsed };
                io.reads.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(sample);
            }
            if arrived > 0 {
                let Ok(completed) = shared.progress.increment((arrived * io.page_size) as u64) else { break };
                *shared.arrivals.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) =
                    (completed as usize, Duration::from_nanos(read_ns));
            }
            if let Some(failure) = failure {
                tracing::warn!(backend = io.storage.name(), %failure, "prefetch read failed; the prefetch stops there");
                let _ = shared.failure.set(failure);
                break;
            }
        }
        if job.last {
            shared.quiet.set();
        }
    }
}

fn run_backups(io: &Io, jobs: Receiver<BackupJob>, mut bucket: Option<TokenBucket>) {
    let page_bytes = io.host.page_bytes();
    let clock = SystemClock::new();
    for job in jobs {
        let mut outcomes = Vec::with_capacity(job.pages.len());
        for (pages, keys) in job.pages.chunks(io.batch_pages).zip(job.keys.chunks(io.batch_pages)) {
            if job.shared.cancel.load(std::sync::atomic::Ordering::Acquire) {
                break;
            }
            if let Some(bucket) = &mut bucket {
                while let Admission::Wait(wait) = bucket.try_acquire((pages.len() * page_bytes) as u64, clock.now()) {
                    std::thread::sleep(wait);
                }
            }
            let result = match io.host.lend_read(pages) {
                Ok(lease) => guarded(|| io.storage.batch_set(keys, &lease.pages())),
                Err(error) => Err(error),
            };
            match result {
                Ok(results) => outcomes.extend(results.into_iter().zip(keys).map(|(outcome, &key)| match outcome {
                    SetOutcome::Stored | SetOutcome::AlreadyPresent => PageBackup::Stored,
                    SetOutcome::Failed(failure) => PageBackup::Failed(StorageFailure::Page { key, failure }),
                })),
                Err(error) => {
                    outcomes.extend(pages.iter().map(|_| PageBackup::Failed(StorageFailure::Call(error.clone()))));
                }
            }
        }
        let failed = outcomes.iter().filter(|outcome| matches!(outcome, PageBackup::Failed(_))).count();
        if failed > 0 {
            tracing::warn!(
                backend = io.storage.name(),
                failed,
                pages = job.pages.len(),
                "backup to storage: pages failed"
            );
        }
        tracing::debug!(backend = io.storage.name(), pages = job.pages.len(), failed, "backup to storage done");
        let mut recorded = job.shared.pages.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for (&position, outcome) in job.positions.iter().zip(outcomes) {
            recorded[position] = outcome;
        }
        drop(recorded);
        job.shared.done.set();
    }
}
