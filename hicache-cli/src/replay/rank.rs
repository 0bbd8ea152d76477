//! One rank's scheduler loop: requests arrive in simulated time, are matched and prefetched on arrival, wait for
//! their prefetch, and run in batches — load-back, layer-by-layer check of every loaded byte, prefill of the rest,
//! decode, insert. Cache work is real and timed; model compute is the compute model's estimate.

use std::collections::BTreeMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash as _, Hasher as _};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use hicache_core::collective::{Collective, ReduceOp};
use hicache_core::controller::{PrefetchExplanation, PrefetchHead, PrefetchStart, PrefetchStop};
use hicache_core::cost::Rates;
use hicache_core::device_slots::{DeviceSlot, DeviceSlotAllocator};
use hicache_core::hash::{PageHasher, PartialPage};
use hicache_core::tree::{HiRadixTree, PrefetchCheck, TickSummary};

use super::device::ReplayEngine;
use super::kv::KvPattern;
use super::workload::Workload;
use crate::metrics::{DataPath, Metrics};

/// Per-round (or total) figures of one rank.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct Tally {
    pub(crate) requests: usize,
    pub(crate) prompt_tokens: usize,
    pub(crate) from_l1: usize,
    pub(crate) from_l2: usize,
    pub(crate) from_l3: usize,
    pub(crate) ttft_ms: Vec<f64>,
    /// Seconds spent loading back (one request's).
    pub(crate) load_s: f64,
}

impl Tally {
    fn add(&mut self, other: &Tally) {
        self.requests += other.requests;
        self.prompt_tokens += other.prompt_tokens;
        self.from_l1 += other.from_l1;
        self.from_l2 += other.from_l2;
        self.from_l3 += other.from_l3;
        self.ttft_ms.extend(&other.ttft_ms);
    }
}

/// Everything a rank measured.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct RankOutcome {
    pub(crate) rounds: Vec<Tally>,
    pub(crate) total: Tally,
    /// Pages moved per path.
    pub(crate) pages_device_to_host: u64,
    pub(crate) pages_host_to_device: u64,
    pub(crate) pages_host_to_storage: u64,
    pub(crate) pages_storage_to_host: u64,
    /// Pages touched by cache operations: matched (at arrival and at run), loaded, written, backed up, prefetched,
    /// evicted from the device, prefilled and inserted.
    pub(crate) page_ops: u64,
    pub(crate) stop_reasons: BTreeMap<String, usize>,
    pub(crate) verified_bytes: u64,
    pub(crate) mismatch: Option<String>,
    pub(crate) seconds: f64,
    /// A hash of every decision, to compare TP ranks.
    pub(crate) digest: u64,
    /// The tree's eviction counters.
    pub(crate) tree: hicache_core::tree::TreeStats,
    /// The engine's copies: items and the contiguous runs they merged into (engines that count them).
    pub(crate) copies: Option<hicache_core::transfer::CopyStats>,
    /// The storage backend's counters at the end, with a storage tier.
    pub(crate) storage: Option<hicache_core::storage::StorageStats>,
    /// With `--unified-keys`: the counters of the chunks themselves.
    pub(crate) chunks: Option<hicache_core::storage::StorageStats>,
    /// Pages whose backup to storage failed.
    pub(crate) pages_backup_failed: u64,
    /// Prefetches that ended with a storage error on this rank (their hit query or a read failed).
    pub(crate) prefetch_errors: u64,
    /// What the fault injection did, when asked for.
    pub(crate) injected: Option<hicache_core::storage::FaultCounts>,
    /// Prefetch plans by what they decided (`fetch_all`, `fetch_part`, `recompute_faster`, `unmeasured`).
    pub(crate) plans: BTreeMap<String, usize>,
    /// Tokens storage held for a request that the cost plan left to compute (all ranks agree on it).
    pub(crate) tokens_recomputed_by_plan: u64,
    /// Requests whose storage reads took longer than computing what they brought would have: the cost plan chose
    /// wrong for them (measured, not estimated: their read time against the compute model).
    pub(crate) slower_than_recompute: u64,
    /// Each request's storage hit as this rank saw it, against computing all of it and reading all of it (the
    /// report takes the slowest rank's times of each request).
    pub(crate) storage_hits: Vec<HitOutcome>,
    /// The rates the ranks agreed on at the end (the slowest rank's).
    pub(crate) agreed_rates: Option<AgreedRates>,
    /// With a state kept where requests ended (`--hybrid mamba`): the most pages holding a state on the device and
    /// on the host, after any batch; `None` for other models.
    pub(crate) states_peak: Option<(usize, usize)>,
    /// Controller ticks, and the time spent in them.
    pub(crate) ticks: u64,
    pub(crate) tick_ns: u64,
    /// Collectives entered, and the time spent in them (inside the ticks).
    pub(crate) collectives: u64,
    pub(crate) collective_ns: u64,
}

/// The cost model's rates, as the report gives them.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct AgreedRates {
    pub(crate) storage_read_gbps: Option<f64>,
    pub(crate) storage_call_us: f64,
    pub(crate) load_gbps: f64,
    pub(crate) prefill_tokens_per_s: Option<f64>,
}

impl From<hicache_core::cost::Rates> for AgreedRates {
    fn from(rates: hicache_core::cost::Rates) -> Self {
        Self {
            storage_read_gbps: rates.storage_read_bytes_per_s.map(|rate| rate / 1e9),
            storage_call_us: rates.storage_call_s * 1e6,
            load_gbps: rates.load_bytes_per_s / 1e9,
            prefill_tokens_per_s: rates.prefill_s_per_token.map(|seconds| 1.0 / seconds),
        }
    }
}

/// A collective that counts its calls and the time spent in them.
struct Timed<'a> {
    inner: &'a mut dyn Collective,
    calls: u64,
    nanos: u64,
}

impl Collective for Timed<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce(&mut self, values: &mut [i64], op: ReduceOp) -> Result<(), hicache_core::Error> {
        let started = Instant::now();
        let result = self.inner.all_reduce(values, op);
        self.calls += 1;
        self.nanos += started.elapsed().as_nanos() as u64;
        result
    }

    fn barrier(&mut self) -> Result<(), hicache_core::Error> {
        let started = Instant::now();
        let result = self.inner.barrier();
        self.calls += 1;
        self.nanos += started.elapsed().as_nanos() as u64;
        result
    }
}

/// One controller tick, timed.
fn tick<E: ReplayEngine>(
    tree: &mut HiRadixTree<E>,
    collective: &mut Timed<'_>,
    outcome: &mut RankOutcome,
) -> anyhow::Result<hicache_core::tree::TickSummary> {
    let started = Instant::now();
    let summary = tree.tick(collective)?;
    outcome.ticks += 1;
    outcome.tick_ns += started.elapsed().as_nanos() as u64;
    Ok(summary)
}

/// How long the replay waits for its writes and backups to finish (each backup is bounded by the tier's own
/// deadlines; this bounds them all together).
const DRAIN_DEADLINE: Duration = Duration::from_secs(600);

/// Ticks (counted and timed as the loop's own) until every write and backup is done and every ack taken, each
/// tick's summary absorbed.
fn drain<E: ReplayEngine>(
    tree: &mut HiRadixTree<E>,
    collective: &mut Timed<'_>,
    outcome: &mut RankOutcome,
    waiting: &mut [Waiting],
    digest: &mut DefaultHasher,
    page: (usize, u64, Option<usize>),
    metrics: Option<&Metrics>,
) -> anyhow::Result<()> {
    let mut last = Instant::now();
    tree.drain(collective, Instant::now() + DRAIN_DEADLINE, &mut |summary| {
        outcome.ticks += 1;
        outcome.tick_ns += last.elapsed().as_nanos() as u64;
        absorb(summary, outcome, waiting, digest, page, metrics);
        last = Instant::now();
    })?;
    Ok(())
}

/// The replay's knobs that the loop needs.
#[derive(Clone, Debug)]
pub(crate) struct LoopSpec {
    pub(crate) max_parallel: usize,
    pub(crate) prefill_tokens_per_s: f64,
    pub(crate) decode_ms_per_token: f64,
    /// Wait after each batch until its backups to storage are done (deterministic runs, for comparisons).
    pub(crate) sync_storage: bool,
    /// The engine computes a split hit's head while storage reads its tail (config `prefetch_split`).
    pub(crate) split: bool,
    /// The engine computes from the front while storage reads from the end, and takes the pages read once its
    /// compute meets them (config `prefetch_meet`; with `split`).
    pub(crate) meet: bool,
    /// The model's index of this rank's first KV head (the KV bytes are a function of the global head).
    pub(crate) first_head: usize,
    /// The model's index of this rank's first layer (its pipeline stage's first).
    pub(crate) first_layer: usize,
    /// The pool this rank holds: 0 for the KV, `n` for the n-th sidecar pool of a hybrid model.
    pub(crate) pool: usize,
    /// The pages of a trailing window, when this rank's pool is needed only there (a sliding window's KV): its
    /// ranks read and check only the window at the end of what a request gets.
    pub(crate) window: Option<usize>,
    /// The model keeps its trailing-window entries only where a request's compute ended (a Mamba state), not at
    /// every page it computed (a sliding window's KV): every rank's tree is told so at each insert.
    pub(crate) state_at_end: bool,
}

/// On a state pool's rank, the page whose entry a compute of `end` tokens (whole pages) leaves: its last.
fn state_page(spec: &LoopSpec, end: usize, page: usize) -> Option<usize> {
    (spec.state_at_end && spec.window.is_some()).then(|| (end / page).saturating_sub(1))
}

/// Inserts `tokens` (whole pages) into the tree with the pages at whose end the engine holds the trailing-window
/// entries: all of them for a sliding window's KV, the last for a state kept where the compute ended.
fn insert<E: ReplayEngine>(
    tree: &mut HiRadixTree<E>,
    tokens: &[u32],
    slots: &[DeviceSlot],
    device: &mut dyn DeviceSlotAllocator,
    spec: &LoopSpec,
) -> anyhow::Result<()> {
    if !spec.state_at_end {
        tree.insert(tokens, slots, device)?;
        return Ok(());
    }
    let mut held = vec![false; tokens.len() / tree.page_size()];
    if let Some(last) = held.last_mut() {
        *last = true;
    }
    tree.insert_with_trailing(tokens, slots, device, &held)?;
    Ok(())
}

struct Waiting {
    client: usize,
    round: usize,
    id: String,
    prefetch_wait: Duration,
    prefetched_tokens: usize,
    matched_pages: u64,
    /// A split's head, once computed: tokens computed and the compute model's seconds for them.
    head: Option<(usize, f64)>,
    /// When the head's compute would end in wall-clock time: the tail's reads run beside it (in real time, as in a
    /// serving engine, whose compute takes that long), so the request asks for them only then.
    head_ends: Option<Instant>,
    /// Every rank's head has ended ([`settle_heads`]): the request asks for its tail.
    head_ended: bool,
    /// An engine that meets the reads: when it started computing the prefetch's tokens from the front (once their
    /// reads from the end were under way).
    meet_started: Option<Instant>,
    /// Every rank's compute met the reads ([`settle_meetings`]): the tokens to compute (those before the pages read,
    /// every rank's) and the compute model's seconds for what the engine had computed by then.
    meet_at: Option<(usize, f64)>,
    /// The request met its reads and waits for the result.
    met: bool,
    /// For an engine that meets the reads: each count of tokens read from the end that every rank saw (their
    /// minimum), with what the engine had computed when the last of them arrived (the latest rank's).
    arrivals: Vec<(usize, usize)>,
    /// What storage held for the request, once its prefetch ended.
    storage_hit: Option<StorageHit>,
}

/// How a request's storage hit went on one rank, in seconds.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct HitOutcome {
    pub(crate) request: String,
    /// Spent on the hit: waiting for its reads beside the compute of a head or up to a meeting, then computing what
    /// storage did not bring.
    pub(crate) spent_s: f64,
    /// Computing all of it.
    pub(crate) recompute_s: f64,
    /// Reading all of it (`None` when not known: see [`StorageHit::read_s`]).
    pub(crate) fetch_whole_s: Option<f64>,
}

/// A prefetch's hit, against the two ways of serving it without a plan: computing all of it, and reading all of it.
#[derive(Clone, Copy, Debug)]
struct StorageHit {
    /// Tokens storage held (every rank's).
    tokens: usize,
    /// Tokens the prefetch brought (every rank's).
    fetched: usize,
    /// Tokens a whole read could have brought: all of them, or what the host pool had room for when it was full.
    readable: usize,
    /// Seconds reading the `readable` tokens would have taken: the reads this rank made, as long as they took, and
    /// the rest at the rates the plan agreed on (the reads' own rate while the plan's is unknown); not known when
    /// neither is (the first reads of a run, met by the compute before any arrived).
    read_s: Option<f64>,
}

/// For an engine that meets the reads: how far each request's compute from the front and its reads from the end
/// have come, every rank's (a MIN over the ranks, so every rank decides at the same step); a request whose compute
/// reached the pages read gets its meeting point. The engine's compute runs in wall-clock time at the compute
/// model's rate from when the reads started, and stops at the end of what is read (it has computed everything then).
fn settle_meetings<E: ReplayEngine>(
    tree: &HiRadixTree<E>,
    waiting: &mut [Waiting],
    spec: &LoopSpec,
    collective: &mut dyn Collective,
) -> anyhow::Result<()> {
    let now = Instant::now();
    let mut meetings = Vec::new();
    let mut values = Vec::new();
    for (index, request) in waiting.iter().enumerate() {
        let (Some(started), None, false) = (request.meet_started, request.meet_at, request.met) else { continue };
        let meeting = tree.prefetch_meeting(&request.id).context("a started meeting has its reads")?;
        let end = meeting.unread(0);
        let tokens_in = |time: Duration| ((time.as_secs_f64() * spec.prefill_tokens_per_s) as usize).min(end);
        // what the engine had computed when the last read arrived, in the reads' own time, negated: the MIN below
        // makes it every rank's latest
        let arrived_by = tokens_in(meeting.arrived_after);
        // the compute runs from when the engine started it and the reads started (the replay charges a read its own
        // time, not its wait behind other requests' reads, and so it does the compute beside it)
        let computed =
            meeting.reads_started.map_or(0, |reads| tokens_in(now.saturating_duration_since(started.max(reads))));
        values.extend([computed as i64, meeting.arrived_tokens as i64, -(arrived_by as i64)]);
        meetings.push((index, meeting));
    }
    if meetings.is_empty() {
        return Ok(());
    }
    if collective.world_size() > 1 {
        collective.all_reduce(&mut values, ReduceOp::Min)?;
    }
    for ((index, meeting), agreed) in meetings.into_iter().zip(values.chunks(3)) {
        let (computed, arrived, arrived_by) = (agreed[0] as usize, agreed[1] as usize, -agreed[2] as usize);
        let request = &mut waiting[index];
        if request.arrivals.last().is_none_or(|&(seen, _)| arrived > seen) {
            request.arrivals.push((arrived, arrived_by));
        }
        if meeting.met(computed, arrived) {
            // the meeting came when the compute first reached pages that had arrived, not when the loop looked (it
            // looks between requests, and their copies take wall-clock time a serving engine's compute would not
            // wait for): of the counts seen, the one the compute met earliest
            let (tokens, arrived) = request
                .arrivals
                .iter()
                .map(|&(arrived, seen_at)| (seen_at.max(meeting.unread(arrived)), arrived))
                .chain([(meeting.unread(0), 0)])
                .min()
                .expect("the chain has an element");
            request.meet_at = Some((meeting.unread(arrived), tokens as f64 / spec.prefill_tokens_per_s));
        }
    }
    Ok(())
}

/// Marks the split heads whose compute has ended in wall-clock time on every rank (a MIN over the ranks, so every
/// rank's scheduler asks for a tail at the same step, as the controller's lockstep needs). The requests with a head
/// still computing are the same on every rank, in the same order.
fn settle_heads(waiting: &mut [Waiting], collective: &mut dyn Collective) -> anyhow::Result<()> {
    let computing: Vec<usize> =
        (0..waiting.len()).filter(|&index| waiting[index].head_ends.is_some() && !waiting[index].head_ended).collect();
    if computing.is_empty() {
        return Ok(());
    }
    let now = Instant::now();
    let mut ended: Vec<i64> =
        computing.iter().map(|&index| i64::from(waiting[index].head_ends.is_some_and(|ends| now >= ends))).collect();
    if collective.world_size() > 1 {
        collective.all_reduce(&mut ended, ReduceOp::Min)?;
    }
    for (index, ended) in computing.into_iter().zip(ended) {
        waiting[index].head_ended = ended == 1;
    }
    Ok(())
}

/// Runs the workload on one rank's tree.
pub(crate) fn run_rank<E: ReplayEngine>(
    tree: &mut HiRadixTree<E>,
    device: &mut dyn DeviceSlotAllocator,
    workload: &mut Workload,
    spec: &LoopSpec,
    collective: &mut dyn Collective,
    progress: &dyn Fn(u64),
    metrics: Option<&Metrics>,
) -> anyhow::Result<RankOutcome> {
    let page = tree.page_size();
    let page_bytes = (tree.controller().engine().pool_map().geometry().bytes_per_token() * page) as u64;
    let pattern =
        KvPattern::new(tree.controller().engine().pool_map(), page, (spec.first_head, spec.first_layer), spec.pool);
    let layers = pattern_layers(tree);
    let mut hasher = PageHasher::new();
    let mut outcome = RankOutcome {
        rounds: vec![Tally::default(); workload.spec.rounds],
        states_peak: spec.state_at_end.then_some((0, 0)),
        ..RankOutcome::default()
    };
    let mut digest = DefaultHasher::new();
    // arrivals in simulated time: (time, client, round), earliest first
    let mut arrivals: Vec<(f64, usize, usize)> =
        workload.first_arrivals.iter().enumerate().map(|(client, &at)| (at, client, 0)).collect();
    let mut waiting: Vec<Waiting> = Vec::new();
    let mut now = 0.0f64;
    let started = Instant::now();
    let mut done = 0u64;
    let mut idle_ticks = 0u64;
    let collective = &mut Timed { inner: collective, calls: 0, nanos: 0 };
    loop {
        arrivals.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        while arrivals.first().is_some_and(|arrival| arrival.0 <= now) {
            let (_, client, round) = arrivals.remove(0);
            let request = admit(tree, workload, client, round)?;
            outcome.page_ops += request.matched_pages;
            waiting.push(request);
        }
        if waiting.is_empty() {
            match arrivals.first() {
                Some(arrival) => {
                    now = arrival.0;
                    continue;
                }
                None => break,
            }
        }
        settle_heads(&mut waiting, collective)?;
        if spec.meet {
            settle_meetings(tree, &mut waiting, spec, collective)?;
        }
        for request in waiting.iter_mut().take(spec.max_parallel * 2) {
            let head = request.head;
            ask_for(tree, device, workload, spec, &pattern, layers, &mut hasher, request, &mut outcome)?;
            if let (None, Some((tokens, seconds))) = (head, request.head) {
                // the engine computed the head now: its time passes, for the reads beside it too
                now += seconds;
                request.head_ends = Some(Instant::now() + Duration::from_secs_f64(seconds));
                (request.client, request.round, tokens).hash(&mut digest);
            }
        }
        let summary = tick(tree, collective, &mut outcome)?;
        absorb(&summary, &mut outcome, &mut waiting, &mut digest, (page, page_bytes, spec.window), metrics);
        if collective.world_size() > 1 {
            tree.controller().host().states().hash(&mut digest);
        }
        // the batch: waiting requests in arrival order whose prefetch is over
        let mut batch = Vec::new();
        let mut index = 0;
        while index < waiting.len() && batch.len() < spec.max_parallel {
            let asked = !spec.split
                || match tree.prefetch_head(&waiting[index].id) {
                    PrefetchHead::NotPlanned => false,
                    // an engine that meets the reads asks once it met them, or when there are none to meet
                    _ if spec.meet => waiting[index].met || tree.prefetch_meeting(&waiting[index].id).is_none(),
                    PrefetchHead::Compute(_) => waiting[index].head_ended,
                    PrefetchHead::Nothing => true,
                };
            if asked && tree.check_prefetch_progress(&waiting[index].id) == PrefetchCheck::Ready {
                batch.push(waiting.remove(index));
            } else {
                index += 1;
            }
        }
        if batch.is_empty() {
            idle_ticks += 1;
            if idle_ticks.is_multiple_of(64) {
                std::thread::sleep(Duration::from_micros(50));
            }
            continue;
        }
        let mut step_compute = 0.0;
        let mut ran = Vec::new();
        for request in batch {
            match run_request(tree, device, workload, spec, &pattern, layers, &mut hasher, &request, &mut outcome)? {
                Some((tally, compute_s)) => {
                    if let Some(metrics) = metrics {
                        metrics.request(tally.prompt_tokens, tally.from_l1, tally.from_l2, tally.from_l3);
                        metrics.moved(
                            DataPath::HostToDevice,
                            ((tally.from_l2 + tally.from_l3) / page) as u64 * page_bytes,
                        );
                        metrics.load(((tally.from_l2 + tally.from_l3) / page) as u64 * page_bytes, tally.load_s);
                    }
                    step_compute += compute_s;
                    (request.client, request.round, tally.from_l1, tally.from_l2, tally.from_l3).hash(&mut digest);
                    outcome.rounds[request.round].add(&tally);
                    ran.push(request);
                }
                None => waiting.insert(0, request),
            }
            if spec.meet {
                // the reads of the requests still waiting are seen between these requests' copies too
                settle_meetings(tree, &mut waiting, spec, collective)?;
            }
        }
        if ran.is_empty() {
            if tree.is_idle() {
                bail!(
                    "the device pool cannot hold the next request (its prompt and answer are {} tokens)",
                    workload.with_answer(waiting[0].client, waiting[0].round).len()
                );
            }
            continue;
        }
        if let Some((most_device, most_host)) = &mut outcome.states_peak {
            let (device, host) = tree.trailing_held();
            (*most_device, *most_host) = ((*most_device).max(device), (*most_host).max(host));
        }
        if spec.sync_storage {
            // every rank has the same backups queued, so every rank loops the same number of ticks
            drain(tree, collective, &mut outcome, &mut waiting, &mut digest, (page, page_bytes, spec.window), metrics)?;
        }
        now += step_compute + spec.decode_ms_per_token * workload.spec.output_length as f64 / 1000.0;
        for request in ran {
            done += 1;
            progress(done);
            if request.round + 1 < workload.spec.rounds {
                arrivals.push((now + workload.think_time(), request.client, request.round + 1));
            }
        }
    }
    // wind down: every backup to storage finished, every ack taken (the same condition on every rank)
    drain(tree, collective, &mut outcome, &mut waiting, &mut digest, (page, page_bytes, spec.window), metrics)?;
    outcome.seconds = started.elapsed().as_secs_f64();
    (outcome.collectives, outcome.collective_ns) = (collective.calls, collective.nanos);
    for round in outcome.rounds.clone() {
        outcome.total.add(&round);
    }
    outcome.page_ops += outcome.pages_device_to_host
        + outcome.pages_host_to_device
        + outcome.pages_host_to_storage
        + outcome.pages_storage_to_host;
    outcome.digest = digest.finish();
    outcome.tree = tree.stats().clone();
    outcome.agreed_rates = tree.controller().agreed_rates().map(AgreedRates::from);
    outcome.copies = tree.controller().engine().copies();
    Ok(outcome)
}

fn pattern_layers<E: ReplayEngine>(tree: &HiRadixTree<E>) -> usize {
    tree.controller().engine().pool_map().geometry().layers
}

/// A request arrives: match its prompt, and prefetch what storage may hold beyond the match.
fn admit<E: ReplayEngine>(
    tree: &mut HiRadixTree<E>,
    workload: &Workload,
    client: usize,
    round: usize,
) -> anyhow::Result<Waiting> {
    let id = format!("c{client}r{round}");
    let prompt = workload.prompt(client, round);
    let matched = tree.match_prefix(prompt);
    if tree.controller().has_storage() && matched.last_host_node == matched.last_node {
        let after = matched.device_slots.len() + matched.host_hit_length;
        // a refused prefetch (too short, capacity) leaves nothing to wait for
        let _: PrefetchStart = tree.prefetch_from_storage(&id, matched.last_host_node, &prompt[after..])?;
    }
    let matched_pages = ((matched.device_slots.len() + matched.host_hit_length) / tree.page_size()) as u64;
    Ok(Waiting {
        client,
        round,
        id,
        prefetch_wait: Duration::ZERO,
        prefetched_tokens: 0,
        matched_pages,
        head: None,
        head_ends: None,
        head_ended: false,
        meet_started: None,
        meet_at: None,
        met: false,
        arrivals: Vec::new(),
        storage_hit: None,
    })
}

/// The scheduler asks for `request` (its prefetch stops as the policy says, the result comes at a tick). An engine
/// that splits hits asks only once the plan is known, and computes a split's head first ([`compute_head`]).
#[expect(clippy::too_many_arguments, reason = "the loop's state, passed apart to keep the borrows disjoint")]
fn ask_for<E: ReplayEngine>(
    tree: &mut HiRadixTree<E>,
    device: &mut dyn DeviceSlotAllocator,
    workload: &Workload,
    spec: &LoopSpec,
    pattern: &KvPattern,
    layers: usize,
    hasher: &mut PageHasher,
    request: &mut Waiting,
    outcome: &mut RankOutcome,
) -> anyhow::Result<()> {
    if spec.split {
        match tree.prefetch_head(&request.id) {
            PrefetchHead::NotPlanned => return Ok(()),
            _ if spec.meet && request.met => return Ok(()),
            _ if spec.meet && tree.prefetch_meeting(&request.id).is_some() => {
                // the engine computes from the front while the reads run from the end; once it met them (every
                // rank: `settle_meetings`), it inserts what it computed up to the pages read and takes those
                request.meet_started.get_or_insert_with(Instant::now);
                let Some((tokens, seconds)) = request.meet_at else { return Ok(()) };
                if compute_head(tree, device, workload, spec, pattern, layers, hasher, request, tokens, outcome)? {
                    // the time is the compute's up to the meeting, past what it kept when the reads came late
                    request.head = request.head.map(|(computed, _)| (computed, seconds));
                    request.met = tree.meet_prefetch(&request.id);
                    anyhow::ensure!(request.met, "request {}: its reads could not be met", request.id);
                }
                return Ok(());
            }
            PrefetchHead::Compute(head)
                if request.head.is_none()
                    && !compute_head(
                        tree, device, workload, spec, pattern, layers, hasher, request, head, outcome,
                    )? =>
            {
                return Ok(());
            }
            // the head's compute has not ended yet (in wall-clock time): the tail's reads go on beside it
            PrefetchHead::Compute(_) if request.head.is_some() && !request.head_ended => return Ok(()),
            _ => {}
        }
    }
    tree.check_prefetch_progress(&request.id);
    Ok(())
}

/// A split's head: computes the `head` tokens of the request's prompt after those its prefetch hangs from, and
/// inserts their KV into the tree, while storage reads the tail. False when the device has no room for it now (the
/// scheduler tries again at its next step).
#[expect(clippy::too_many_arguments, reason = "the loop's state, passed apart to keep the borrows disjoint")]
fn compute_head<E: ReplayEngine>(
    tree: &mut HiRadixTree<E>,
    device: &mut dyn DeviceSlotAllocator,
    workload: &Workload,
    spec: &LoopSpec,
    pattern: &KvPattern,
    layers: usize,
    hasher: &mut PageHasher,
    request: &mut Waiting,
    head: usize,
    outcome: &mut RankOutcome,
) -> anyhow::Result<bool> {
    let page = tree.page_size();
    let upto = request.matched_pages as usize * page + head;
    let tokens = &workload.prompt(request.client, request.round)[..upto];
    let keys = hasher.page_keys(tokens, page, None, PartialPage::Drop)?;
    let matched = tree.match_prefix(tokens);
    let loaded = tree.load_back(matched.last_node, device)?;
    let locked = if loaded.is_empty() { matched.last_device_node } else { matched.last_node };
    tree.inc_lock_ref(locked)?;
    if !loaded.is_empty() {
        let consumer = tree.start_loading()?;
        tree.layers().set_consumer(consumer);
        for layer in 0..layers {
            tree.layers().wait_until(layer)?;
        }
        outcome.pages_host_to_device += (loaded.len() / page) as u64;
    }
    let cached = matched.device_slots.len() + loaded.len();
    let new_pages = (upto - cached) / page;
    let mut fresh = device.alloc_pages(new_pages);
    if fresh.is_none() {
        let freed = tree.evict(new_pages * page, device)?;
        outcome.page_ops += (freed / page) as u64;
        fresh = device.alloc_pages(new_pages);
    }
    let Some(fresh) = fresh else {
        tree.dec_lock_ref(locked)?;
        return Ok(false);
    };
    pattern.fill(tree.controller().engine(), &keys, cached, &fresh, state_page(spec, upto, page))?;
    let mut slots = matched.device_slots.clone();
    slots.extend(&loaded);
    slots.extend(&fresh);
    insert(tree, tokens, &slots, device, spec)?;
    tree.dec_lock_ref(locked)?;
    outcome.page_ops += ((cached + upto) / page + new_pages) as u64;
    let computed = upto - cached;
    let seconds = computed as f64 / spec.prefill_tokens_per_s;
    if computed > 0 {
        tree.observe_prefill(computed, cached, Duration::from_secs_f64(seconds));
    }
    request.head = Some((computed, seconds));
    Ok(true)
}

/// Runs one request; `None` when the device pool has no room for it now (it waits for the next step).
#[expect(clippy::too_many_arguments, reason = "the loop's state, passed apart to keep the borrows disjoint")]
fn run_request<E: ReplayEngine>(
    tree: &mut HiRadixTree<E>,
    device: &mut dyn DeviceSlotAllocator,
    workload: &Workload,
    spec: &LoopSpec,
    pattern: &KvPattern,
    layers: usize,
    hasher: &mut PageHasher,
    request: &Waiting,
    outcome: &mut RankOutcome,
) -> anyhow::Result<Option<(Tally, f64)>> {
    let page = tree.page_size();
    let started = Instant::now();
    let prompt = workload.prompt(request.client, request.round);
    let sequence = workload.with_answer(request.client, request.round);
    let keys = hasher.page_keys(sequence, page, None, PartialPage::Drop)?;
    let matched = tree.match_prefix(prompt);
    let loaded = tree.load_back(matched.last_node, device)?;
    let locked = if loaded.is_empty() { matched.last_device_node } else { matched.last_node };
    tree.inc_lock_ref(locked)?;
    // without a load, the device part as far as it is usable (with a trailing window, where its window is held)
    let device_slots =
        if loaded.is_empty() { &matched.device_slots[..matched.device_usable] } else { &matched.device_slots[..] };
    let device_hit = device_slots.len();
    let cached = device_hit + loaded.len();
    // a trailing-window pool holds only the window before the end: the rest is not checked
    let checked_from = spec.window.map_or(0, |window| (cached / page).saturating_sub(window) * page);
    let new_pages = (sequence.len() - cached).div_ceil(page);
    let mut fresh = device.alloc_pages(new_pages);
    if fresh.is_none() {
        let freed = tree.evict(new_pages * page, device)?;
        outcome.page_ops += (freed / page) as u64;
        fresh = device.alloc_pages(new_pages);
    }
    let mut checking = Duration::ZERO;
    let load_started = Instant::now();
    if !loaded.is_empty() {
        let consumer = tree.start_loading()?;
        tree.layers().set_consumer(consumer);
        outcome.pages_host_to_device += (loaded.len() / page) as u64;
        // the forward pass: layer by layer, each checked as soon as its load event fired
        for layer in 0..layers {
            tree.layers().wait_until(layer)?;
            let check = Instant::now();
            let from = checked_from.max(device_hit);
            let engine = tree.controller().engine();
            let checked = pattern.check_layer(engine, &keys, from, &loaded[from - device_hit..], layer)?;
            record_check(outcome, checked, "loaded", request);
            checking += check.elapsed();
        }
    }
    let load_s = load_started.elapsed().saturating_sub(checking).as_secs_f64();
    let check = Instant::now();
    let mut checked = Ok(0);
    for layer in 0..layers {
        let from = checked_from.min(device_hit);
        match pattern.check_layer(tree.controller().engine(), &keys, from, &device_slots[from..], layer)? {
            Ok(bytes) => checked = checked.map(|total| total + bytes),
            Err(mismatch) => {
                checked = Err(mismatch);
                break;
            }
        }
    }
    record_check(outcome, checked, "device-resident", request);
    checking += check.elapsed();
    let Some(fresh) = fresh else {
        tree.dec_lock_ref(locked)?;
        return Ok(None);
    };
    // prefill and decode: the KV of every new token, then the whole sequence goes into the tree
    let before_prefill = started.elapsed();
    let aligned = sequence.len() - sequence.len() % page;
    pattern.fill(tree.controller().engine(), &keys, cached, &fresh, state_page(spec, aligned, page))?;
    let mut slots = device_slots.to_vec();
    slots.extend(&loaded);
    slots.extend(&fresh);
    insert(tree, &sequence[..aligned], &slots[..aligned], device, spec)?;
    if slots.len() > aligned {
        device.free(&slots[aligned..])?;
    }
    tree.dec_lock_ref(locked)?;
    // the run's match, the prefill's pages, and the insert of the whole sequence
    outcome.page_ops += ((cached + fresh.len() + aligned) / page) as u64;

    let from_l3 = request.prefetched_tokens.min(loaded.len());
    // a split's head is on the device because the request computed it (beside the tail's reads), not a hit
    let (head_tokens, head_s) = request.head.unwrap_or((0, 0.0));
    let waited = request.prefetch_wait.max(Duration::from_secs_f64(head_s));
    let uncached = prompt.len() - cached.min(prompt.len());
    let compute_s = uncached as f64 / spec.prefill_tokens_per_s;
    // the engine tells the cache what its compute and loads cost (the cost model's measurements)
    if uncached > 0 {
        tree.observe_prefill(uncached, cached, Duration::from_secs_f64(compute_s));
    }
    // (an engine that times its loads on the device reports them through the controller)
    if !loaded.is_empty() && !hicache_core::transfer::TransferEngine::times_loads(tree.controller().engine()) {
        let bytes = (tree.controller().engine().pool_map().geometry().bytes_per_token() * loaded.len()) as u64;
        tree.observe_load(bytes, Duration::from_secs_f64(load_s));
    }
    // the storage reads this request waited for (beside its head's compute), against computing what they brought
    if from_l3 > 0
        && request.prefetch_wait.as_secs_f64().max(head_s) > (head_tokens + from_l3) as f64 / spec.prefill_tokens_per_s
    {
        outcome.slower_than_recompute += 1;
    }
    // the whole storage hit: the time this request spent on it (waiting for reads beside its head's or meeting's
    // compute, then computing what storage did not bring), against computing all of it and against reading all of
    // it (the loads to the device run beside the prefill either way, and are left out of all three)
    if let Some(hit) = request.storage_hit.filter(|hit| hit.tokens > 0) {
        let rate = spec.prefill_tokens_per_s;
        // pages the prefetch brought that the host evicted before the request ran are counted as brought: the host
        // tier's capacity lost them, whatever was decided
        let rest = hit.tokens.saturating_sub(head_tokens + hit.fetched);
        let spent_s = request.prefetch_wait.as_secs_f64().max(head_s) + rest as f64 / rate;
        let recompute_s = hit.tokens as f64 / rate;
        let fetch_whole_s = hit.read_s.map(|read_s| read_s + hit.tokens.saturating_sub(hit.readable) as f64 / rate);
        let request = request.id.clone();
        outcome.storage_hits.push(HitOutcome { request, spent_s, recompute_s, fetch_whole_s });
    }
    // up to the prefill: matching, load-back and the layer waits; the byte check is the replay's, not the cache's
    // the load runs beside the prefill layer by layer (as the layer waits let a GPU engine run it): only what it
    // takes beyond the prefill counts
    let load = Duration::from_secs_f64(load_s);
    let compute = Duration::from_secs_f64(compute_s);
    let cache_time =
        waited + before_prefill.saturating_sub(checking).saturating_sub(load) + load.saturating_sub(compute);
    let tally = Tally {
        requests: 1,
        prompt_tokens: prompt.len(),
        from_l1: device_hit.saturating_sub(head_tokens).min(prompt.len()),
        from_l2: loaded.len() - from_l3,
        from_l3,
        ttft_ms: vec![cache_time.as_secs_f64() * 1000.0 + compute_s * 1000.0],
        load_s,
    };
    Ok(Some((tally, compute_s)))
}

fn record_check(outcome: &mut RankOutcome, checked: Result<u64, super::kv::Mismatch>, what: &str, request: &Waiting) {
    match checked {
        Ok(bytes) => outcome.verified_bytes += bytes,
        Err(mismatch) => {
            outcome.mismatch.get_or_insert_with(|| {
                format!(
                    "request {}: {what} token {} in device slot {} differs at layer {}",
                    request.id, mismatch.position, mismatch.slot, mismatch.layer
                )
            });
        }
    }
}

/// What a tick did: counters, prefetch results attributed to their waiting requests, the lockstep digest, metrics.
/// `window`: the trailing window of this rank's pool, which its prefetches read only at the hit's end.
fn absorb(
    summary: &TickSummary,
    outcome: &mut RankOutcome,
    waiting: &mut [Waiting],
    digest: &mut DefaultHasher,
    (page, page_bytes, window): (usize, u64, Option<usize>),
    metrics: Option<&Metrics>,
) {
    outcome.pages_device_to_host += summary.pages_written as u64;
    outcome.pages_host_to_storage += summary.pages_backed_up as u64;
    outcome.pages_backup_failed += summary.pages_backup_failed as u64;
    if let Some(metrics) = metrics {
        record_tick(metrics, summary, page, page_bytes);
    }
    for (explanation, new_tokens) in &summary.prefetches {
        *outcome.stop_reasons.entry(stop_name(explanation).to_owned()).or_default() += 1;
        if let Some(plan) = &explanation.plan {
            *outcome.plans.entry(plan.reason.name().to_owned()).or_default() += 1;
        }
        let planned = explanation.plan.is_some();
        if planned
            && matches!(explanation.stop, PrefetchStop::RecomputeFaster | PrefetchStop::Met | PrefetchStop::Complete)
        {
            // what the plan left to compute (a split's head beside the tail's reads, a cut tail, all of it), or
            // what the engine computed before it met the reads
            outcome.tokens_recomputed_by_plan +=
                explanation.tp_min_hit_tokens.saturating_sub(explanation.fetched_tokens) as u64;
        }
        outcome.prefetch_errors += u64::from(explanation.error.is_some());
        let fetched = explanation.fetched_tokens / page;
        outcome.pages_storage_to_host += match window {
            // of a hit's reserved pages, only the window at its end was read
            Some(window) => fetched.saturating_sub((explanation.reserved_tokens / page).saturating_sub(window)),
            None => fetched,
        } as u64;
        if let Some(request) = waiting.iter_mut().find(|request| request.id == explanation.request_id) {
            // the storage reads of a prefetch that brought pages are on the request's critical path (unless the
            // engine met them: its compute up to the meeting is); the hit query overlaps the request's time in the
            // queue (as a revoked prefetch's does)
            if explanation.fetched_tokens > 0 && !request.met {
                request.prefetch_wait = explanation.read_time;
            }
            request.prefetched_tokens = *new_tokens;
            request.storage_hit = Some(storage_hit(explanation, page, page_bytes));
        }
        explanation.fetched_tokens.hash(digest);
    }
}

/// A prefetch's hit and what reading all of it would have taken.
fn storage_hit(explanation: &PrefetchExplanation, page: usize, page_bytes: u64) -> StorageHit {
    let readable = match explanation.stop {
        PrefetchStop::HostPoolFull => explanation.reserved_tokens.min(explanation.tp_min_hit_tokens),
        _ => explanation.tp_min_hit_tokens,
    };
    let pages = (readable / page, explanation.local_fetched_tokens / page);
    let rates = explanation.plan.as_ref().map(|plan| &plan.rates);
    let read_s = whole_read_s(rates, pages, explanation.read_time.as_secs_f64(), page_bytes);
    StorageHit { tokens: explanation.tp_min_hit_tokens, fetched: explanation.fetched_tokens, readable, read_s }
}

/// Seconds reading `readable` pages would take, once `read` of them took `read_s`: the rest at the plan's `rates` (at
/// the reads' own rate without a plan or while the tier's rate is unknown; `None` when nothing was read either).
fn whole_read_s(rates: Option<&Rates>, (readable, read): (usize, usize), read_s: f64, page_bytes: u64) -> Option<f64> {
    let read = read.min(readable);
    match rates.filter(|rates| rates.storage_read_bytes_per_s.is_some()) {
        _ if read == readable => Some(read_s),
        Some(rates) => Some(read_s + rates.fetch_s(readable, page_bytes) - rates.fetch_s(read, page_bytes)),
        None if read == 0 => None,
        None => Some(read_s * readable as f64 / read as f64),
    }
}

/// A tick's transfers and prefetch results, as metrics.
fn record_tick(metrics: &Metrics, summary: &TickSummary, page: usize, page_bytes: u64) {
    metrics.moved(DataPath::DeviceToHost, summary.pages_written as u64 * page_bytes);
    metrics.moved(DataPath::HostToStorage, summary.pages_backed_up as u64 * page_bytes);
    metrics.backed_up(summary.pages_backed_up * page);
    for (explanation, _) in &summary.prefetches {
        let bytes = (explanation.fetched_tokens / page) as u64 * page_bytes;
        metrics.moved(DataPath::StorageToHost, bytes);
        let unfulfilled = explanation.tp_min_hit_tokens.saturating_sub(explanation.fetched_tokens);
        let seconds = explanation.elapsed.as_secs_f64();
        metrics.prefetch(stop_name(explanation), explanation.fetched_tokens, unfulfilled, bytes, seconds);
    }
}

/// SGLang-style names of stop reasons, for reports; a revoked prefetch whose query found nothing on any rank is
/// `not_in_storage` (the prompt was never stored, the common case), one that found too little is `revoked`.
pub(crate) fn stop_name(explanation: &PrefetchExplanation) -> &'static str {
    match explanation.stop {
        PrefetchStop::Revoked if explanation.tp_min_hit_tokens == 0 => "not_in_storage",
        PrefetchStop::NoStorage => "no_storage",
        PrefetchStop::BelowThreshold => "below_threshold",
        PrefetchStop::CapacityLimited => "capacity_limited",
        PrefetchStop::Revoked => "revoked",
        PrefetchStop::HostPoolFull => "host_pool_full",
        PrefetchStop::Complete => "complete",
        PrefetchStop::RecomputeFaster => "recompute_faster",
        PrefetchStop::CutOff => "cut_off",
        PrefetchStop::Met => "met",
        PrefetchStop::TimedOut => "timed_out",
        PrefetchStop::Stalled => "stalled",
        PrefetchStop::Failed => "failed",
        PrefetchStop::TpMinimum => "tp_minimum",
        PrefetchStop::Aborted => "aborted",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(read_bytes_per_s: Option<f64>) -> Rates {
        Rates {
            storage_call_s: 0.001,
            storage_read_bytes_per_s: read_bytes_per_s,
            load_bytes_per_s: 1e9,
            prefill_s_per_token: Some(1e-4),
            prefill_s_per_token_per_prefix: 0.0,
            batch_pages: 2,
        }
    }

    #[test]
    fn a_whole_read_is_the_reads_made_and_the_rest_at_the_agreed_rates_or_their_own() {
        // 2 of 8 pages of 1000 bytes read in 10 ms; the rest at 1 ms a call of 2 pages and 1 MB/s: 8 pages are 4
        // calls and 8 ms of bytes, the 2 read 1 call and 2 ms
        let known = rates(Some(1e6));
        let whole = whole_read_s(Some(&known), (8, 2), 0.010, 1000).unwrap();
        assert!((whole - (0.010 + 0.012 - 0.003)).abs() < 1e-12, "{whole}");
        assert_eq!(whole_read_s(Some(&known), (8, 8), 0.010, 1000), Some(0.010), "all of it read: what it took");
        // the tier's rate not known, or no plan: the reads' own, per page; nothing read: not known
        let unknown = rates(None);
        assert_eq!(whole_read_s(Some(&unknown), (8, 2), 0.010, 1000), Some(0.040));
        assert_eq!(whole_read_s(None, (8, 2), 0.010, 1000), Some(0.040));
        assert_eq!(whole_read_s(Some(&unknown), (8, 0), 0.0, 1000), None);
        assert_eq!(whole_read_s(None, (0, 0), 0.0, 1000), Some(0.0), "nothing to read");
    }

    #[test]
    fn a_request_is_slower_than_either_way_as_its_slowest_rank_is() {
        let hit = |request: &str, spent_s: f64, recompute_s: f64, fetch_whole_s: Option<f64>| HitOutcome {
            request: request.to_owned(),
            spent_s,
            recompute_s,
            fetch_whole_s,
        };
        let ranks = [
            RankOutcome {
                storage_hits: vec![
                    hit("a", 1.0, 3.0, Some(2.0)),
                    hit("b", 1.0, 3.0, None),
                    hit("c", 2.0, 1.5, Some(5.0)),
                    hit("d", 1.0, 3.0, Some(0.5)),
                ],
                ..RankOutcome::default()
            },
            RankOutcome {
                storage_hits: vec![
                    // rank 1 spent longer on `a` than reading it whole takes
                    hit("a", 2.5, 3.0, Some(2.0)),
                    // a whole read known on one rank only is not known for the request
                    hit("b", 1.0, 3.0, Some(0.5)),
                    hit("c", 1.0, 1.5, Some(5.0)),
                    // rank 1's reads were slower: reading `d` whole would have waited for them
                    hit("d", 1.0, 3.0, Some(1.5)),
                ],
                ..RankOutcome::default()
            },
        ];
        // slower than reading whole: a; than the better of the two: a, and c (computing it takes 1.5 s)
        assert_eq!(super::super::report::slower_than_either(&ranks), (1, 2));
    }
}
