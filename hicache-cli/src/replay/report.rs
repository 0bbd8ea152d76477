//! The replay's report: per round and in total, as text or as one JSON object (fields in `docs/replay.md`).

use std::collections::BTreeMap;

use anyhow::bail;
use hicache_core::storage::groups::HitPolicy;
use hicache_core::storage::l3_layout::L3Layout;
use serde::Serialize;

use super::ReplayArgs;
use super::rank::{RankOutcome, Tally};

/// One round's (or the whole run's) figures.
#[derive(Debug, Serialize)]
struct RoundReport {
    round: Option<usize>,
    requests: usize,
    prompt_tokens: usize,
    hit_rate: f64,
    tokens_from_l1: usize,
    tokens_from_l2: usize,
    tokens_from_l3: usize,
    ttft_p50_ms: f64,
    ttft_p90_ms: f64,
}

/// Bytes per path (rank 0's pools).
#[derive(Debug, Serialize)]
struct Paths<T> {
    device_to_host: T,
    host_to_device: T,
    host_to_storage: T,
    storage_to_host: T,
}

/// Mean bytes per contiguous copy, per direction between device and host.
#[derive(Debug, Serialize)]
struct CopySizes {
    device_to_host: f64,
    host_to_device: f64,
}

/// Chunks of the unified key scheme, all ranks.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct ChunkCounts {
    /// Chunks read (hits).
    read: u64,
    /// Chunks written that were not stored before.
    stored: u64,
    /// Chunks written that were stored already.
    already_stored: u64,
}

/// Storage failures over all ranks.
#[derive(Debug, Serialize)]
struct StorageFailures {
    backup_pages_failed: u64,
    prefetch_errors: u64,
}

/// A sidecar pool of a hybrid model.
#[derive(Debug, Serialize)]
struct SidecarParameters {
    pool: &'static str,
    entry_bytes: u64,
    /// SGLang's hit policy of the pool: `all_pages`, or `trailing_pages` (only the window at a prefix's end).
    hit_policy: &'static str,
    /// The window's pages, for `trailing_pages`.
    #[serde(skip_serializing_if = "Option::is_none")]
    window_pages: Option<usize>,
}

/// The settings a replay ran with, so a saved result reads on its own.
#[derive(Debug, Serialize)]
struct Parameters {
    clients: usize,
    rounds: usize,
    request_length: usize,
    output_length: usize,
    system_prompt: usize,
    request_rate: f64,
    max_parallel: usize,
    seed: u64,
    page_size: usize,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Bytes of one page on one rank (the KV's).
    page_bytes: u64,
    /// The hybrid model's kind (`--hybrid`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    hybrid: Option<String>,
    /// Its sidecar pools: each one's name and the bytes of its entry on one rank (a page's share of the pool).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    sidecars: Vec<SidecarParameters>,
    /// The sliding window of `--hybrid swa`, in tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    swa_window: Option<usize>,
    layout: String,
    device_tokens: usize,
    host_tokens: usize,
    backend: String,
    /// The file tier's directory (null: a temporary one, removed at the end).
    dir: Option<std::path::PathBuf>,
    format: String,
    /// The file tier's capacity in bytes (null: none).
    capacity_bytes: Option<u64>,
    engine: String,
    write_policy: String,
    prefetch_policy: String,
    prefetch_threshold: usize,
    /// Seconds a prefetch may go without progress before it stops (`stalled`).
    storage_read_deadline: f64,
    prefill_tokens_per_s: f64,
    decode_ms_per_token: f64,
    sync_storage: bool,
    tp_size: usize,
    pp_size: usize,
    fault_fail_rate: f64,
    fault_corrupt_rate: f64,
    fault_latency_us: u64,
    fault_hang_rate: f64,
    fault_hang_ms: u64,
    fault_seed: u64,
    fault_read_mbps: u64,
    fetch_whole_hits: bool,
    no_split: bool,
    no_meet: bool,
}

fn parameters(args: &ReplayArgs, page_bytes: u64, sidecars: Vec<SidecarParameters>) -> Parameters {
    Parameters {
        clients: args.clients,
        rounds: args.rounds,
        request_length: args.request_length,
        output_length: args.output_length,
        system_prompt: args.system_prompt,
        request_rate: args.request_rate,
        max_parallel: args.max_parallel,
        seed: args.seed,
        page_size: args.page_size,
        layers: args.layers,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        page_bytes,
        hybrid: args.hybrid.map(|hybrid| crate::value_name(&hybrid)),
        sidecars,
        swa_window: (args.hybrid == Some(super::HybridArg::Swa)).then_some(args.swa_window),
        layout: crate::value_name(&super::layout_arg(args)),
        device_tokens: args.device_tokens,
        host_tokens: args.host_tokens,
        backend: args.backend.name().to_owned(),
        dir: args.dir.clone(),
        format: crate::value_name(&args.format),
        capacity_bytes: args.capacity_bytes,
        engine: crate::value_name(&args.engine),
        write_policy: crate::value_name(&args.write_policy),
        prefetch_policy: crate::value_name(&args.prefetch_policy),
        prefetch_threshold: args.prefetch_threshold,
        storage_read_deadline: args.storage_read_deadline,
        prefill_tokens_per_s: args.prefill_tokens_per_s,
        decode_ms_per_token: args.decode_ms_per_token,
        sync_storage: args.sync_storage,
        tp_size: args.tp_size,
        pp_size: args.pp_size,
        fault_fail_rate: args.fault_fail_rate,
        fault_corrupt_rate: args.fault_corrupt_rate,
        fault_latency_us: args.fault_latency_us,
        fault_hang_rate: args.fault_hang_rate,
        fault_hang_ms: args.fault_hang_ms,
        fault_seed: args.fault_seed,
        fault_read_mbps: args.fault_read_mbps,
        fetch_whole_hits: args.fetch_whole_hits,
        no_split: args.no_split,
        no_meet: args.no_meet,
    }
}

#[derive(Debug, Serialize)]
struct Report {
    parameters: Parameters,
    hit_rate: f64,
    tokens_from_l1: usize,
    tokens_from_l2: usize,
    tokens_from_l3: usize,
    verified: bool,
    verified_bytes: u64,
    page_ops_per_s: f64,
    ttft_p50_ms: f64,
    ttft_p90_ms: f64,
    requests: usize,
    prompt_tokens: usize,
    seconds: f64,
    bytes: Paths<u64>,
    gbps: Paths<f64>,
    prefetch_stop_reasons: BTreeMap<String, usize>,
    /// What the cost plans decided, rank 0 (the same on every rank).
    prefetch_plans: PlanReport,
    /// Bytes the storage backends of all ranks copied through an intermediate buffer (0: every byte moved straight
    /// between the host pool and storage).
    staging_bytes: u64,
    /// What went wrong with storage, all ranks: pages whose backup failed, prefetches that ended with a storage
    /// error.
    storage_failures: StorageFailures,
    /// With `--fault-*`: what the injection did, all ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    faults_injected: Option<hicache_core::storage::FaultCounts>,
    /// Rank 0's storage backend counters, with a storage tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    storage: Option<hicache_core::storage::StorageStats>,
    /// With `--unified-keys`: the chunks of all ranks, read, newly stored, and found stored already (by a replay of
    /// this or another topology).
    #[serde(skip_serializing_if = "Option::is_none")]
    unified_chunks: Option<ChunkCounts>,
    tree: hicache_core::tree::TreeStats,
    /// With `--hybrid mamba`: the states the cache held at most, after any batch (rank 0; every rank's tree is the
    /// same), the size of the state pools a deployment needs for this workload's hits.
    #[serde(skip_serializing_if = "Option::is_none")]
    states_peak: Option<StatesPeak>,
    /// Mean bytes per contiguous copy (rank 0, CPU engine): what a GPU copy engine would get per copy from the same
    /// pages.
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes_per_copy: Option<CopySizes>,
    tp_size: usize,
    /// Pipeline stages, each of `tp_size` ranks.
    pp_size: usize,
    /// Whether each rank ran as a process of its own (`--processes`).
    processes: bool,
    lockstep: bool,
    /// Rank 0's digest of its decisions (the tree's host page states after every tick, every prefetch's fetched
    /// tokens, every request's sources), in hex: equal on every rank when `lockstep`, and equal across runs that
    /// decide the same.
    decision_digest: String,
    /// The collectives of the controller's ticks (rank 0, and the slowest rank's cost).
    collectives: CollectiveCost,
    rounds: Vec<RoundReport>,
    /// The key layout a router needs to find the replay's pages in the store (every stage, every rank), in
    /// SGLang's shape (`hicache store layout`); absent without a storage tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    l3_layout: Option<L3Layout>,
}

/// The states a `--hybrid mamba` run's cache held at most.
#[derive(Debug, Serialize)]
struct StatesPeak {
    /// Pages holding a state on the device, and on the host.
    device: usize,
    host: usize,
    /// Bytes of one state on one rank.
    state_bytes: u64,
}

/// What the cost plans decided and how they came out.
#[derive(Debug, Serialize)]
struct PlanReport {
    /// Plans by decision: `fetch_all`, `fetch_part`, `recompute_faster`, `split`, `unmeasured`.
    decisions: BTreeMap<String, usize>,
    /// Tokens storage held that were computed instead (split heads included).
    tokens_recomputed: u64,
    /// Requests whose storage reads took longer than computing the tokens they brought (all ranks).
    slower_than_recompute: u64,
    /// Requests whose storage hit took longer than reading all of it would have (each request's slowest rank).
    slower_than_fetch_whole: u64,
    /// Requests whose storage hit took longer than the better of computing and reading all of it (each request's
    /// slowest rank).
    slower_than_best: u64,
    /// The rates the ranks agreed on at the end of the run (the slowest rank's).
    #[serde(skip_serializing_if = "Option::is_none")]
    agreed_rates: Option<super::rank::AgreedRates>,
}

/// What the ranks' agreement cost per controller tick.
#[derive(Debug, Serialize)]
struct CollectiveCost {
    ticks: u64,
    /// Collectives per tick.
    per_tick: f64,
    /// Time in collectives per tick, rank 0.
    us_per_tick: f64,
    /// The whole tick, rank 0 (collectives included).
    tick_us: f64,
    /// Time in collectives per tick, the slowest rank.
    us_per_tick_max: f64,
}

fn collective_cost(outcomes: &[RankOutcome]) -> CollectiveCost {
    let per_tick = |outcome: &RankOutcome, value: u64| value as f64 / outcome.ticks.max(1) as f64;
    let first = &outcomes[0];
    CollectiveCost {
        ticks: first.ticks,
        per_tick: per_tick(first, first.collectives),
        us_per_tick: per_tick(first, first.collective_ns) / 1e3,
        tick_us: per_tick(first, first.tick_ns) / 1e3,
        us_per_tick_max: outcomes
            .iter()
            .map(|outcome| per_tick(outcome, outcome.collective_ns) / 1e3)
            .fold(0.0, f64::max),
    }
}

fn percentile(values: &[f64], fraction: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[((sorted.len() - 1) as f64 * fraction).round() as usize]
}

fn round_report(round: Option<usize>, tally: &Tally) -> RoundReport {
    let cached = tally.from_l1 + tally.from_l2 + tally.from_l3;
    RoundReport {
        round,
        requests: tally.requests,
        prompt_tokens: tally.prompt_tokens,
        hit_rate: if tally.prompt_tokens == 0 { 0.0 } else { cached as f64 / tally.prompt_tokens as f64 },
        tokens_from_l1: tally.from_l1,
        tokens_from_l2: tally.from_l2,
        tokens_from_l3: tally.from_l3,
        ttft_p50_ms: percentile(&tally.ttft_ms, 0.5),
        ttft_p90_ms: percentile(&tally.ttft_ms, 0.9),
    }
}

pub(super) fn print(
    args: &ReplayArgs,
    description: &str,
    outcomes: &[RankOutcome],
    l3_layout: Option<L3Layout>,
) -> anyhow::Result<()> {
    let first = &outcomes[0];
    let lockstep = outcomes.iter().all(|outcome| outcome.digest == first.digest);
    let page_bytes = (super::geometry(args, 0)?.bytes_per_token() * args.page_size) as u64;
    let sidecars: Vec<SidecarParameters> = super::sidecars(args)?
        .iter()
        .map(|pool| SidecarParameters {
            pool: pool.name,
            entry_bytes: pool.geometry.bytes_per_page(args.page_size) as u64,
            hit_policy: pool.policy.name(),
            window_pages: match pool.policy {
                HitPolicy::TrailingPages { window } => Some(window),
                HitPolicy::AllPages => None,
            },
        })
        .collect();
    // each pool's first rank (TP rank 0 of stage 0) moves its pool's pages: in lockstep with the KV's, those every
    // page needs move the same pages; a trailing window's only its windows to and from storage
    let per_pool = args.tp_size * args.pp_size;
    let pools = std::iter::once(page_bytes).chain(sidecars.iter().map(|pool| pool.entry_bytes));
    let mut bytes = Paths { device_to_host: 0, host_to_device: 0, host_to_storage: 0, storage_to_host: 0 };
    for (pool, entry_bytes) in pools.enumerate() {
        let outcome = &outcomes[pool * per_pool];
        bytes.device_to_host += outcome.pages_device_to_host * entry_bytes;
        bytes.host_to_device += outcome.pages_host_to_device * entry_bytes;
        bytes.host_to_storage += outcome.pages_host_to_storage * entry_bytes;
        bytes.storage_to_host += outcome.pages_storage_to_host * entry_bytes;
    }
    let rate = |bytes: u64| bytes as f64 / first.seconds.max(1e-9) / 1e9;
    let gbps = Paths {
        device_to_host: rate(bytes.device_to_host),
        host_to_device: rate(bytes.host_to_device),
        host_to_storage: rate(bytes.host_to_storage),
        storage_to_host: rate(bytes.storage_to_host),
    };
    let total = round_report(None, &first.total);
    let mismatch = outcomes.iter().find_map(|outcome| outcome.mismatch.clone());
    let (slower_than_fetch_whole, slower_than_best) = slower_than_either(outcomes);
    let state_bytes = sidecars.first().map(|pool| pool.entry_bytes);
    let report = Report {
        parameters: parameters(args, page_bytes, sidecars),
        hit_rate: total.hit_rate,
        tokens_from_l1: total.tokens_from_l1,
        tokens_from_l2: total.tokens_from_l2,
        tokens_from_l3: total.tokens_from_l3,
        verified: mismatch.is_none(),
        verified_bytes: outcomes.iter().map(|outcome| outcome.verified_bytes).sum(),
        page_ops_per_s: first.page_ops as f64 / first.seconds.max(1e-9),
        ttft_p50_ms: total.ttft_p50_ms,
        ttft_p90_ms: total.ttft_p90_ms,
        requests: total.requests,
        prompt_tokens: total.prompt_tokens,
        seconds: first.seconds,
        bytes,
        gbps,
        prefetch_stop_reasons: first.stop_reasons.clone(),
        prefetch_plans: PlanReport {
            decisions: first.plans.clone(),
            tokens_recomputed: first.tokens_recomputed_by_plan,
            slower_than_recompute: outcomes.iter().map(|outcome| outcome.slower_than_recompute).sum(),
            slower_than_fetch_whole,
            slower_than_best,
            agreed_rates: first.agreed_rates.clone(),
        },
        staging_bytes: outcomes.iter().filter_map(|outcome| outcome.storage).map(|stats| stats.staging_bytes).sum(),
        storage_failures: StorageFailures {
            backup_pages_failed: outcomes.iter().map(|outcome| outcome.pages_backup_failed).sum(),
            prefetch_errors: outcomes.iter().map(|outcome| outcome.prefetch_errors).sum(),
        },
        faults_injected: outcomes.iter().filter_map(|outcome| outcome.injected).reduce(|total, rank| {
            hicache_core::storage::FaultCounts {
                failed_calls: total.failed_calls + rank.failed_calls,
                failed_pages: total.failed_pages + rank.failed_pages,
                corrupt_pages: total.corrupt_pages + rank.corrupt_pages,
            }
        }),
        storage: first.storage,
        unified_chunks: outcomes.iter().filter_map(|outcome| outcome.chunks).fold(None, |total, stats| {
            let total = total.unwrap_or_default();
            Some(ChunkCounts {
                read: total.read + stats.get_hits,
                stored: total.stored + stats.set_stored,
                already_stored: total.already_stored + stats.set_present,
            })
        }),
        tree: first.tree.clone(),
        states_peak: first.states_peak.map(|(device, host)| StatesPeak {
            device,
            host,
            state_bytes: state_bytes.unwrap_or_default(),
        }),
        bytes_per_copy: {
            let item = super::geometry(args, 0)?.item_bytes() as f64;
            let per = |items: u64, runs: u64| items as f64 * item / runs.max(1) as f64;
            first.copies.map(|copies| CopySizes {
                device_to_host: per(copies.write_items, copies.write_runs),
                host_to_device: per(copies.load_items, copies.load_runs),
            })
        },
        tp_size: args.tp_size,
        pp_size: args.pp_size,
        processes: args.processes,
        lockstep,
        decision_digest: format!("{:016x}", first.digest),
        collectives: collective_cost(outcomes),
        rounds: first.rounds.iter().enumerate().map(|(index, tally)| round_report(Some(index), tally)).collect(),
        l3_layout,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_text(description, &report);
    }
    if let Some(mismatch) = mismatch {
        bail!("verification failed: {mismatch}");
    }
    if !lockstep {
        bail!("the ranks diverged: their decisions differ");
    }
    Ok(())
}

fn print_text(description: &str, report: &Report) {
    println!("hicache replay: {description}");
    println!();
    println!("round  requests  hit rate   from L1   from L2   from L3   TTFT p50   TTFT p90");
    let line = |name: String, round: &RoundReport| {
        println!(
            "{name:>5}  {:>8}  {:>7.1}%  {:>8}  {:>8}  {:>8}  {:>6.2} ms  {:>6.2} ms",
            round.requests,
            round.hit_rate * 100.0,
            round.tokens_from_l1,
            round.tokens_from_l2,
            round.tokens_from_l3,
            round.ttft_p50_ms,
            round.ttft_p90_ms
        );
    };
    for round in &report.rounds {
        line(round.round.unwrap_or_default().to_string(), round);
    }
    let total = RoundReport {
        round: None,
        requests: report.requests,
        prompt_tokens: report.prompt_tokens,
        hit_rate: report.hit_rate,
        tokens_from_l1: report.tokens_from_l1,
        tokens_from_l2: report.tokens_from_l2,
        tokens_from_l3: report.tokens_from_l3,
        ttft_p50_ms: report.ttft_p50_ms,
        ttft_p90_ms: report.ttft_p90_ms,
    };
    line("total".into(), &total);
    println!();
    let mb = |bytes: u64| bytes as f64 / 1e6;
    if !report.parameters.sidecars.is_empty() {
        let pools: Vec<String> = report.parameters.sidecars.iter().map(sidecar_text).collect();
        println!(
            "pools per page and rank: kv {} bytes, {}; each pool on ranks of its own, in lockstep with the kv's; \
             the bytes moved count every pool's",
            report.parameters.page_bytes,
            pools.join(", ")
        );
    }
    if let Some(states) = &report.states_peak {
        println!(
            "states held at most: {} on the device ({:.1} MB per rank), {} on the host ({:.1} MB per rank)",
            states.device,
            mb(states.device as u64 * states.state_bytes),
            states.host,
            mb(states.host as u64 * states.state_bytes)
        );
    }
    let by = if report.parameters.sidecars.is_empty() { "rank 0" } else { "TP rank 0 of each pool" };
    println!(
        "moved ({by}): device→host {:.1} MB, host→device {:.1} MB, host→storage {:.1} MB, storage→host {:.1} MB",
        mb(report.bytes.device_to_host),
        mb(report.bytes.host_to_device),
        mb(report.bytes.host_to_storage),
        mb(report.bytes.storage_to_host)
    );
    println!(
        "averaged over the run's {:.2} s: {:.2}, {:.2}, {:.2}, {:.2} GB/s",
        report.seconds,
        report.gbps.device_to_host,
        report.gbps.host_to_device,
        report.gbps.host_to_storage,
        report.gbps.storage_to_host
    );
    if report.storage.is_some() {
        println!("staged through intermediate buffers (all ranks): {} bytes", report.staging_bytes);
        println!(
            "storage failures (all ranks): {} pages not backed up, {} prefetches ended by a storage error",
            report.storage_failures.backup_pages_failed, report.storage_failures.prefetch_errors
        );
    }
    if let Some(faults) = &report.faults_injected {
        println!(
            "faults injected (all ranks): {} calls failed, {} pages failed, {} pages reported corrupt",
            faults.failed_calls, faults.failed_pages, faults.corrupt_pages
        );
    }
    if let Some(sizes) = &report.bytes_per_copy {
        println!(
            "bytes per contiguous copy (both pools): device→host {:.1} KiB, host→device {:.1} KiB",
            sizes.device_to_host / 1024.0,
            sizes.host_to_device / 1024.0
        );
    }
    let reasons: Vec<String> =
        report.prefetch_stop_reasons.iter().map(|(reason, count)| format!("{reason} {count}")).collect();
    println!("prefetches: {}", if reasons.is_empty() { "none".into() } else { reasons.join(", ") });
    if report.prefetch_stop_reasons.contains_key("not_in_storage")
        || report.prefetch_stop_reasons.contains_key("revoked")
    {
        println!(
            "  (not_in_storage: storage held none of the prompt, as for every first turn; revoked: it held fewer \
             tokens than the threshold)"
        );
    }
    let plans = &report.prefetch_plans;
    if !plans.decisions.is_empty() {
        let decisions: Vec<String> =
            plans.decisions.iter().map(|(decision, count)| format!("{decision} {count}")).collect();
        println!(
            "prefetch plans: {}; {} stored tokens computed instead; requests slower than recomputing {}, than \
             reading the whole hit {}, than the better of the two {}",
            decisions.join(", "),
            plans.tokens_recomputed,
            plans.slower_than_recompute,
            plans.slower_than_fetch_whole,
            plans.slower_than_best
        );
        if let Some(rates) = &plans.agreed_rates {
            println!(
                "  rates agreed: storage read {} + {:.0} µs per call, load {:.2} GB/s, prefill {}",
                rates.storage_read_gbps.map_or_else(|| "unknown".into(), |gbps| format!("{gbps:.3} GB/s")),
                rates.storage_call_us,
                rates.load_gbps,
                rates.prefill_tokens_per_s.map_or_else(|| "unknown".into(), |rate| format!("{rate:.0} tokens/s"))
            );
        }
    }
    println!(
        "evicted: {} tokens device → host, {} from the host, {} dropped from the device without a host copy",
        report.tree.device_evicted_tokens, report.tree.host_evicted_tokens, report.tree.dropped_tokens
    );
    if report.tree.write_refused_tokens > 0 {
        // one node can be refused at several attempts, so this may exceed the dropped tokens
        println!(
            "writes to the host refused by a full host pool: {} tokens, counted per attempt (a refused node stays on \
             the device; it is dropped only if evicted before a later write succeeds)",
            report.tree.write_refused_tokens
        );
    }
    println!("page operations: {:.0} per second", report.page_ops_per_s);
    if report.tp_size * report.pp_size > 1 {
        println!(
            "ranks: {} TP × {} PP ({}) in lockstep: {}",
            report.tp_size,
            report.pp_size,
            if report.processes { "processes" } else { "threads" },
            if report.lockstep { "yes" } else { "NO" }
        );
        let cost = &report.collectives;
        println!(
            "collectives: {:.1} per tick, {:.1} µs per tick of a {:.1} µs tick (rank 0; slowest rank {:.1} µs), {} ticks",
            cost.per_tick, cost.us_per_tick, cost.tick_us, cost.us_per_tick_max, cost.ticks
        );
    }
    println!(
        "verified: {} ({:.1} MB of loaded and cached KV checked byte for byte)",
        if report.verified { "yes" } else { "NO" },
        report.verified_bytes as f64 / 1e6
    );
}

/// Requests whose storage hit took longer than reading all of it, and than the better of reading and computing all
/// of it: a request waits for its slowest rank, so each request's times are the slowest rank's.
pub(super) fn slower_than_either(outcomes: &[super::rank::RankOutcome]) -> (u64, u64) {
    let mut hits: BTreeMap<&str, super::rank::HitOutcome> = BTreeMap::new();
    for hit in outcomes.iter().flat_map(|outcome| &outcome.storage_hits) {
        hits.entry(&hit.request)
            .and_modify(|slowest| {
                slowest.spent_s = slowest.spent_s.max(hit.spent_s);
                slowest.recompute_s = slowest.recompute_s.max(hit.recompute_s);
                // not known on one rank (its reads measured nothing): not known for the request
                slowest.fetch_whole_s = slowest.fetch_whole_s.zip(hit.fetch_whole_s).map(|(a, b)| a.max(b));
            })
            .or_insert_with(|| hit.clone());
    }
    let slower = |than: &dyn Fn(&super::rank::HitOutcome) -> f64| {
        hits.values().filter(|hit| hit.spent_s > than(hit)).count() as u64
    };
    let fetch_whole = |hit: &super::rank::HitOutcome| hit.fetch_whole_s.unwrap_or(f64::INFINITY);
    (slower(&fetch_whole), slower(&|hit| fetch_whole(hit).min(hit.recompute_s)))
}

/// A sidecar pool in the text report: its name, its entry's bytes, and a trailing window's pages.
fn sidecar_text(pool: &SidecarParameters) -> String {
    match pool.window_pages {
        Some(1) => format!("{} {} bytes (only at the last page of a prefix)", pool.pool, pool.entry_bytes),
        Some(window) => format!("{} {} bytes (only the last {window} pages of a prefix)", pool.pool, pool.entry_bytes),
        None => format!("{} {} bytes", pool.pool, pool.entry_bytes),
    }
}
