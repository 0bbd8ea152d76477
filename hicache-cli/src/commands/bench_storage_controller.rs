//! `hicache bench storage --via controller`: pages written to storage by the controller's backup thread and read
//! back by its query and fetch threads, in place in a CPU engine's host pool, next to the same backend called
//! directly on the same host pages in the same run.
//!
//! Both paths move the same bytes between the same pool pages and the same backend; the controller's also pays for
//! its hit query (an existence check per batch), its thread hand-offs and the scheduler's ticks. Each round writes
//! under fresh keys (removed at the round's end, outside the timings) and measures both paths back to back,
//! alternating which goes first, so neither always finds a cold or a warm page cache. The rates reported are the best
//! round's; the ratios are the median of the rounds' paired ratios, which a disk that is slow for a while (file
//! creation on a journaling file system varies several-fold here) moves far less than a ratio of two best rounds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use hicache_core::collective::SingleRank;
use hicache_core::config::PrefetchPolicy;
use hicache_core::controller::{CacheController, PageBackup, PrefetchStart, PrefetchStop, StorageSettings};
use hicache_core::hash::{PageKey, PartialPage, page_keys};
use hicache_core::host_memory::HostMemory;
use hicache_core::host_pool::HostPageId;
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, StorageBackend};
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap, TransferEngine};
use hicache_core::tree::NodeId;
use hicache_core::{HiCacheBuilder, HiCacheConfig};
use serde::Serialize;

/// What to measure.
pub(super) struct ControllerBench {
    pub(super) pages: usize,
    pub(super) batch: usize,
    pub(super) rounds: usize,
}

/// The result of `bench storage --via controller`.
#[derive(Debug, Serialize)]
pub(super) struct ControllerFigure {
    pub(super) backend: String,
    pub(super) via: &'static str,
    pub(super) pages: usize,
    pub(super) page_bytes: usize,
    /// Backups by the controller's backup thread (best round).
    pub(super) set_gbps: f64,
    /// `batch_set` called directly on the same host pages (best round).
    pub(super) direct_set_gbps: f64,
    /// The median over rounds of the round's controller / direct backup rate (each round measures both paths
    /// back to back, so the ratio is paired: a disk that is slow for a while slows both).
    pub(super) set_ratio: f64,
    /// Prefetches by the controller's query and fetch threads (best round).
    pub(super) get_gbps: f64,
    /// `batch_get` called directly into host pages (best round).
    pub(super) direct_get_gbps: f64,
    /// The median over rounds of the round's controller / direct prefetch rate.
    pub(super) get_ratio: f64,
    /// Bytes the backend copied through an intermediate buffer, over the whole run.
    pub(super) staging_bytes: u64,
    /// Every round's figures, in GB/s: [set, direct set, get, direct get], and whether the controller went first.
    pub(super) rounds: Vec<RoundFigure>,
}

/// One round of `bench storage --via controller`.
#[derive(Debug, Default, Serialize)]
pub(super) struct RoundFigure {
    pub(super) controller_first: bool,
    pub(super) set_gbps: f64,
    pub(super) direct_set_gbps: f64,
    pub(super) get_gbps: f64,
    pub(super) direct_get_gbps: f64,
}

/// Device pages at a time while the source pages are filled.
const FILL_CHUNK: usize = 16;

/// Runs the benchmark on `backend`, whose namespace is `namespace` (one token per page).
pub(super) fn run(
    bench: &ControllerBench,
    backend: Arc<dyn StorageBackend>,
    namespace: &StorageNamespace,
    progress: &indicatif::ProgressBar,
) -> anyhow::Result<ControllerFigure> {
    let geometry = namespace.geometry;
    let page_bytes = geometry.bytes_per_page(1);
    let device_pages = bench.pages.min(FILL_CHUNK);
    // the source pages, the destinations of a prefetch, and one spare (the host pool is larger than the device's)
    let host_pages = 2 * bench.pages + 1;
    let device_map = DeviceLayoutMap::new(geometry, device_pages)?;
    let host_map = HostLayoutMap::new(geometry, HostLayout::PageFirst, 1, host_pages)?;
    let engine = CpuEngine::new(device_map, host_map, Completion::Immediate)?;
    let settings = StorageSettings {
        page_size: 1,
        batch_pages: bench.batch,
        prefetch_threshold: 1,
        policy: PrefetchPolicy::WaitComplete,
        timeout_base: Duration::from_secs(3600),
        timeout_per_ki_token: Duration::ZERO,
        timeout_max: Duration::from_secs(3600),
        read_deadline: Duration::from_secs(30),
        capacity_tokens: host_pages as u64,
        backup_skip: false,
        write_bytes_per_s: 0,
        tick_slots: 1,
        by_cost: false,
        split: false,
        meet: false,
        priors: hicache_core::cost::Priors::UNKNOWN,
        trailing: None,
    };
    let config = HiCacheConfig { page_size: 1, mem_layout: HostLayout::PageFirst, ..HiCacheConfig::default() };
    let mut controller = HiCacheBuilder::new(config, engine)
        .with_storage(backend.clone())
        .with_storage_settings(settings)
        .build_controller()?;
    progress.set_message("filling the host pool");
    let sources = fill_sources(&mut controller, bench.pages)?;
    let memory = controller.engine().host_memory();
    let expected = memory.copy_pages_out(&sources)?;
    // pages the controller never hands out (its allocator is the memory's): the direct path's own
    let spare: Vec<HostPageId> =
        memory.all_pages().into_iter().filter(|page| !sources.contains(page)).take(bench.pages).collect();

    let mut rounds = Vec::with_capacity(bench.rounds);
    for round in 0..bench.rounds {
        progress.set_message(format!("round {round}: backups, then prefetches"));
        let direct_keys = keys(&tokens(round, 0, bench.pages))?;
        let controller_tokens = tokens(round, 1, bench.pages);
        let controller_keys = keys(&controller_tokens)?;
        // alternate which path meets the page cache first
        let order = if round % 2 == 0 { [false, true] } else { [true, false] };
        let mut figure = RoundFigure { controller_first: order[0], ..RoundFigure::default() };
        for via_controller in order {
            rustix::fs::sync();
            let started = Instant::now();
            if via_controller {
                backup(&mut controller, &sources, controller_keys.clone())?;
                figure.set_gbps = gbps(bench.pages * page_bytes, started);
            } else {
                direct_set(backend.as_ref(), &memory, &sources, &direct_keys, bench.batch)?;
                figure.direct_set_gbps = gbps(bench.pages * page_bytes, started);
            }
        }
        rustix::fs::sync();
        for via_controller in order {
            if via_controller {
                let started = Instant::now();
                let fetched = prefetch(&mut controller, &format!("bench-{round}"), &controller_tokens)?;
                figure.get_gbps = gbps(bench.pages * page_bytes, started);
                ensure!(memory.copy_pages_out(&fetched)? == expected, "the controller fetched bytes that differ");
                controller.evict_host(&fetched)?;
            } else {
                // no leftovers of an earlier read
                memory.lend_write(&spare)?.pages_mut().iter_mut().flatten().for_each(|segment| segment.fill(0));
                let started = Instant::now();
                direct_get(backend.as_ref(), &memory, &spare, &direct_keys, bench.batch)?;
                figure.direct_get_gbps = gbps(bench.pages * page_bytes, started);
                ensure!(memory.copy_pages_out(&spare)? == expected, "{} returned bytes that differ", backend.name());
            }
        }
        // the round's pages go, so a run holds at most two sets (on tmpfs they are memory)
        backend.remove(&direct_keys)?;
        backend.remove(&controller_keys)?;
        rounds.push(figure);
        progress.inc(1);
    }
    let best = |figure: fn(&RoundFigure) -> f64| rounds.iter().map(figure).fold(0.0, f64::max);
    let (set, direct_set) = (best(|round| round.set_gbps), best(|round| round.direct_set_gbps));
    let (get, direct_get) = (best(|round| round.get_gbps), best(|round| round.direct_get_gbps));
    Ok(ControllerFigure {
        backend: backend.name().to_owned(),
        via: "controller",
        pages: bench.pages,
        page_bytes,
        set_gbps: set,
        direct_set_gbps: direct_set,
        set_ratio: median(rounds.iter().map(|round| round.set_gbps / round.direct_set_gbps).collect()),
        get_gbps: get,
        direct_get_gbps: direct_get,
        get_ratio: median(rounds.iter().map(|round| round.get_gbps / round.direct_get_gbps).collect()),
        staging_bytes: backend.stats().staging_bytes,
        rounds,
    })
}

/// The median (the mean of the middle two for an even count).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    if values.len() % 2 == 1 { values[middle] } else { (values[middle - 1] + values[middle]) / 2.0 }
}

fn gbps(bytes: usize, started: Instant) -> f64 {
    bytes as f64 / started.elapsed().as_secs_f64().max(1e-9) / 1e9
}

/// One page per token, distinct per round and path.
fn tokens(round: usize, path: u32, pages: usize) -> Vec<u32> {
    let salt = std::process::id().rotate_left(8) ^ ((round as u32) << 1 | path);
    (0..pages as u32).map(|page| page.wrapping_mul(2_654_435_761) ^ salt).collect()
}

fn keys(tokens: &[u32]) -> anyhow::Result<Vec<PageKey>> {
    Ok(page_keys(tokens, 1, None, PartialPage::Reject)?)
}

/// Writes `pages` host pages from the device pool (pseudo-random bytes, a chunk of device pages at a time) and
/// leaves them backed up (host only), as pages a request left behind.
fn fill_sources(controller: &mut CacheController<CpuEngine>, pages: usize) -> anyhow::Result<Vec<HostPageId>> {
    let mut sources = Vec::with_capacity(pages);
    // one stream of bytes over every chunk, so no two source pages are alike
    let mut state = super::bench_storage::FILL_SEED;
    while sources.len() < pages {
        let count = (pages - sources.len()).min(FILL_CHUNK);
        controller.engine().with_device(|bytes| super::bench_storage::fill(bytes, &mut state));
        // the first pages of the device pool, written over each chunk
        let slots: Vec<u32> = (0..(count * controller.page_size()) as u32).collect();
        let written = controller.write(&slots, NodeId(1), None)?.context("host pages for the sources")?;
        controller.take_all_write_acks()?;
        controller.evict_device(&written)?;
        sources.extend(written);
    }
    Ok(sources)
}

fn backup(
    controller: &mut CacheController<CpuEngine>,
    sources: &[HostPageId],
    keys: Vec<PageKey>,
) -> anyhow::Result<()> {
    controller.backup_to_storage(sources, keys, Vec::new())?;
    let report = controller.take_backups(1)?.pop().context("a backup report")?;
    if let Some(failed) = report.pages.iter().find(|page| **page != PageBackup::Stored) {
        bail!("the controller's backup did not store a page: {failed:?}");
    }
    Ok(())
}

fn prefetch(
    controller: &mut CacheController<CpuEngine>,
    request: &str,
    tokens: &[u32],
) -> anyhow::Result<Vec<HostPageId>> {
    match controller.prefetch(request, tokens, None)? {
        PrefetchStart::Started(_) => {}
        refused => bail!("the controller refused the prefetch: {refused:?}"),
    }
    controller.finish_prefetch(request);
    loop {
        let report = controller.tick(&mut SingleRank)?;
        if let Some(done) = report.prefetches.into_iter().next() {
            if done.explanation.stop != PrefetchStop::Complete || done.host_pages.len() != tokens.len() {
                bail!("the prefetch stopped early: {:?}", done.explanation);
            }
            return Ok(done.host_pages);
        }
        std::thread::sleep(Duration::from_micros(500));
    }
}

fn direct_set(
    backend: &dyn StorageBackend,
    memory: &HostMemory,
    pages: &[HostPageId],
    keys: &[PageKey],
    batch: usize,
) -> anyhow::Result<()> {
    for (pages, keys) in pages.chunks(batch).zip(keys.chunks(batch)) {
        let lease = memory.lend_read(pages)?;
        let outcomes = backend.batch_set(keys, &lease.pages())?;
        if let Some(failed) = outcomes.iter().find(|outcome| !outcome.is_stored()) {
            bail!("{}: a page was not stored: {failed:?}", backend.name());
        }
    }
    Ok(())
}

fn direct_get(
    backend: &dyn StorageBackend,
    memory: &HostMemory,
    pages: &[HostPageId],
    keys: &[PageKey],
    batch: usize,
) -> anyhow::Result<()> {
    for (pages, keys) in pages.chunks(batch).zip(keys.chunks(batch)) {
        let mut lease = memory.lend_write(pages)?;
        let outcomes = backend.batch_get(keys, &mut lease.pages_mut())?;
        if let Some(missed) = outcomes.iter().find(|outcome| **outcome != GetOutcome::Hit) {
            bail!("{}: a page written in this run did not read back: {missed:?}", backend.name());
        }
    }
    Ok(())
}
