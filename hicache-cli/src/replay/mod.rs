//! `hicache replay`: SGLang's multi-turn chat benchmark simulated at the cache level, through the real tree,
//! controller, transfer engine and storage tier, with every loaded byte checked.
//!
//! The default needs no flag, no GPU and no service: the CPU engine and the file tier in a temporary directory, a
//! small model geometry, and pools smaller than the working set (device < host < all conversations), so the device,
//! the host and storage all serve hits. Model compute is not run; a compute model turns uncached tokens into a
//! prefill time for the TTFT estimate.
//!
//! A hybrid model (`--hybrid`) keeps sidecar pools beside its KV whose entries every page needs (a sparse-attention
//! indexer, a draft model's KV). Each pool is held by ranks of its own, one per TP rank, with pools of the pool's
//! geometry, in lockstep with the KV's ranks: every decision that can differ between them (a storage hit, the pages
//! fetched, an ack) goes through the tick's one MIN, so each pool's tree makes the same moves on every path (device,
//! host, storage) and a prefix is used only as far as every pool holds it. Storage keeps each pool's entries in the
//! pool's own namespace under the KV pages' keys, as SGLang's stores do. A sliding-window model (`--hybrid swa`)
//! keeps its sliding layers' KV in a pool that a prefix needs only in its window: the trees know where the window's
//! entries are held and end matches there, the pool's ranks store and read only the windows at nodes' ends, and
//! every rank agrees on a length every rank's storage can restore ([`hicache_core::controller::Trailing`]). A
//! linear-attention model (`--hybrid mamba`) keeps a state, a window of one page, only where a request's compute ended.

mod device;
mod kv;
mod processes;
mod rank;
mod report;
mod socket_group;
mod workload;

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, ValueEnum};
use hicache_core::HiCacheBuilder;
use hicache_core::collective::{Collective, InProcessGroup, SingleRank};
use hicache_core::config::{HiCacheConfig, MAX_SECONDS, PrefetchPolicy, WritePolicy};
use hicache_core::controller::Trailing;
use hicache_core::extra_config::UnifiedAgreements;
use hicache_core::extra_config::throttled;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::host_memory::{HostAllocation, HostMemory};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::{EntryObject, StorageNamespace, sglang_mooncake_objects};
use hicache_core::storage::groups::HitPolicy;
use hicache_core::storage::l3_layout::{self, L3Layout};
use hicache_core::storage::{FaultPlan, FaultyStorage, MemoryStorage, MemoryStore, StorageBackend};
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap};

use crate::backends::{self, BackendName, BackendOptions, FileFormatArg, OptionalBackend};
use crate::exit::Usage;
use crate::metrics::Metrics;

/// The transfer engine (`--engine`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum EngineName {
    /// Copies between plain memory buffers standing in for the GPU (no GPU needed).
    Cpu,
    /// The GPU (cargo feature `cuda`).
    Cuda,
}

/// Arguments of `hicache replay`.
#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    /// Clients, each holding one multi-turn conversation.
    #[arg(long, default_value_t = 48, value_name = "N")]
    clients: usize,
    /// Rounds (turns) per client.
    #[arg(long, default_value_t = 4, value_name = "N")]
    rounds: usize,
    /// New user tokens per round (each prompt re-sends the whole history before them).
    #[arg(long, default_value_t = 512, value_name = "N")]
    request_length: usize,
    /// Answer tokens per round.
    #[arg(long, default_value_t = 64, value_name = "N")]
    output_length: usize,
    /// Tokens of a system prompt shared by every client (0: none).
    #[arg(long, default_value_t = 0, value_name = "N")]
    system_prompt: usize,
    /// Mean first-round arrivals per second of simulated time (Poisson).
    #[arg(long, default_value_t = 16.0, value_name = "R")]
    request_rate: f64,
    /// Requests per batch.
    #[arg(long, default_value_t = 8, value_name = "N")]
    max_parallel: usize,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1, value_name = "N")]
    seed: u64,
    /// Tokens per page.
    #[arg(long, default_value_t = 32, value_name = "N")]
    page_size: usize,
    /// Model layers.
    #[arg(long, default_value_t = 8, value_name = "N")]
    layers: usize,
    /// KV heads of the model (split over TP ranks; replicated when fewer than ranks).
    #[arg(long, default_value_t = 2, value_name = "N")]
    kv_heads: usize,
    /// Head dimension (bf16).
    #[arg(long, default_value_t = 64, value_name = "N")]
    head_dim: usize,
    /// A hybrid model: sidecar pools beside the KV, each held by ranks of its own in lockstep with the KV's, every
    /// byte a request needs of every pool checked (of a sliding window's, the window). The MLA kinds use DeepSeek's latent (512 + 64, bf16) instead of --kv-heads and
    /// --head-dim.
    #[arg(long, value_enum, value_name = "KIND")]
    hybrid: Option<HybridArg>,
    /// The sliding window of `--hybrid swa`, in tokens (gpt-oss: 128); storage keeps the window's pages
    /// (rounded up to whole pages) at each node's end.
    #[arg(long, default_value_t = 128, value_name = "TOKENS")]
    swa_window: usize,
    /// Host pool layout (default: layer-first; page-first with `--backend mooncake`, as SGLang forces, so each page
    /// part moves to and from the store in place).
    #[arg(long, value_enum)]
    layout: Option<LayoutArg>,
    /// KV heads per head group of the page-unified layout: each rank's pages are cut into its heads / N groups
    /// (default: one group of all the rank's heads).
    #[arg(long, value_name = "N", requires = "layout")]
    head_group: Option<usize>,
    /// Store each page as the chunks of SGLang's unified L3 key scheme (needs --layout page-unified): keys that name
    /// a layer range of a head group, never the rank, so replays of any --tp-size share one store. --head-group and
    /// --layer-partition are the fleet's agreements on the chunks.
    #[arg(long, requires = "layout")]
    unified_keys: bool,
    /// Layers per chunk of the unified key scheme (default: all of them, one layer chunk).
    #[arg(long, value_name = "N", requires = "unified_keys")]
    layer_partition: Option<usize>,
    /// Device pool size in tokens.
    #[arg(long, default_value_t = 16_384, value_name = "N")]
    device_tokens: usize,
    /// Host pool size in tokens (must exceed the device pool).
    #[arg(long, default_value_t = 32_768, value_name = "N")]
    host_tokens: usize,
    /// Allocate each rank's host pool in a new file of this shared-memory directory (a tmpfs such as /dev/shm), as
    /// a deployment whose storage agent maps the pool does (3FS); the file is removed at the end. Default: private
    /// anonymous memory.
    #[arg(long, value_name = "DIR")]
    host_shm: Option<PathBuf>,
    /// Storage tier (the file tier's files in a temporary directory unless --dir is given; 3FS's data files too),
    /// or none: device and host only.
    #[arg(long, value_parser = backends::optional_backend_parser(), default_value = "file")]
    backend: OptionalBackend,
    /// Directory of the file tier (default: a temporary directory, removed at the end).
    #[arg(long, value_name = "PATH")]
    dir: Option<PathBuf>,
    /// File layout of the file tier.
    #[arg(long, value_enum, default_value_t = FileFormatArg::Native)]
    format: FileFormatArg,
    /// Bytes of page files the file tier may hold (per rank's namespace, across processes sharing the directory);
    /// least recently used pages go first. Default: no limit.
    #[arg(long, value_name = "BYTES")]
    capacity_bytes: Option<u64>,
    #[command(flatten)]
    network: crate::backends::NetworkArgs,
    /// Transfer engine.
    #[arg(long, value_enum, default_value_t = EngineName::Cpu)]
    engine: EngineName,
    /// When nodes are backed up to the host (and on to storage).
    #[arg(long, value_enum, default_value_t = WritePolicyArg::WriteThrough)]
    write_policy: WritePolicyArg,
    /// When a prefetch stops. The default waits for it: a replay has no model compute for a prefetch to overlap
    /// with, so SGLang's best_effort would cut every prefetch off at once and measure nothing of storage.
    #[arg(long, value_enum, default_value_t = PrefetchPolicyArg::WaitComplete)]
    prefetch_policy: PrefetchPolicyArg,
    /// Fewest tokens worth prefetching (SGLang: 256).
    #[arg(long, default_value_t = 256, value_name = "N")]
    prefetch_threshold: usize,
    /// Seconds a prefetch may go without progress (its storage stuck) before it stops with what arrived, under
    /// every policy; `stalled` in the stop reasons.
    #[arg(long, default_value_t = 30.0, value_name = "S")]
    storage_read_deadline: f64,
    /// Compute model: prefill throughput in tokens per second. The default, 25 000, is an 8B-parameter model on
    /// one H100: 2 × 8e9 FLOP per token at about 40% of the 989 TFLOP/s bf16 peak.
    #[arg(long, default_value_t = 25_000.0, value_name = "R")]
    prefill_tokens_per_s: f64,
    /// Compute model: milliseconds per decode step (simulated time between batches only).
    #[arg(long, default_value_t = 10.0, value_name = "MS")]
    decode_ms_per_token: f64,
    /// Wait after each batch until its backups to storage are done: the run no longer depends on how fast the
    /// storage threads get CPU time (for comparisons; it slows the replay down).
    #[arg(long)]
    sync_storage: bool,
    /// Fault injection: the probability that each page a storage get or set handles fails (each rank draws its own).
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    fault_fail_rate: f64,
    /// Fault injection: the probability that each page a storage get finds is reported corrupt instead (as a
    /// checksumming backend reports a damaged page).
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    fault_corrupt_rate: f64,
    /// Fault injection: microseconds added to every storage call.
    #[arg(long, default_value_t = 0, value_name = "US")]
    fault_latency_us: u64,
    /// Fault injection: a storage get takes at least the time its bytes need at this many MB/s (10^6 bytes): a slow
    /// tier. 0: no cap.
    #[arg(long, default_value_t = 0, value_name = "MBPS")]
    fault_read_mbps: u64,
    /// Fetch every storage hit whole, as SGLang does, instead of only as far as bringing it is faster than computing
    /// it (the cost plan, which takes the compute model's rate as the engine's).
    #[arg(long)]
    fetch_whole_hits: bool,
    /// Never split a storage hit. By default the engine computes a hit's head while storage reads its tail when the
    /// cost plan finds that faster (a chunked prefill meeting the reads in the middle).
    #[arg(long)]
    no_split: bool,
    /// Compute a split hit's head only, then wait for its tail. By default the engine computes on from the front
    /// while storage reads the hit from its end, and takes the pages read once its compute reaches them (Cake's
    /// bidirectional prefill): no request waits on storage longer than computing would take.
    #[arg(long)]
    no_meet: bool,
    /// Fault injection: the probability that a storage call hangs for --fault-hang-ms and then fails as timed out.
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    fault_hang_rate: f64,
    /// Fault injection: how long a hanging storage call hangs, in milliseconds.
    #[arg(long, default_value_t = 100, value_name = "MS")]
    fault_hang_ms: u64,
    /// Fault injection: seed of the random faults (rank r uses seed + r).
    #[arg(long, default_value_t = 1, value_name = "N")]
    fault_seed: u64,
    /// Tensor-parallel ranks, run as threads in this process (or as processes with --processes); the report says
    /// whether they stayed in lockstep.
    #[arg(long, default_value_t = 1, value_name = "N")]
    tp_size: usize,
    /// Pipeline stages, each holding a run of layers split as SGLang splits them (the last stages take one more when
    /// they do not divide evenly), each with --tp-size ranks: --tp-size × --pp-size ranks in all, in lockstep.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pp_size: usize,
    /// Run each TP rank as a process of its own, as a served model does: with `--engine cuda` one GPU per rank
    /// (rank r on GPU r) agreeing through NCCL, with the CPU engine through a local socket. Needs a storage tier the
    /// processes share (not `memory`).
    #[arg(long)]
    processes: bool,
    /// Internal (set by --processes for each rank it starts): this process's rank.
    #[arg(long, hide = true, value_name = "R")]
    process_rank: Option<usize>,
    /// Internal (set by --processes): the folder where the ranks meet and leave their outcomes.
    #[arg(long, hide = true, value_name = "PATH")]
    process_dir: Option<PathBuf>,
    /// Internal (set by --processes): the launcher's temporary storage folder, removed by a rank stopped by a signal.
    #[arg(long, hide = true, value_name = "PATH")]
    process_temp: Option<PathBuf>,
    /// Serve Prometheus metrics at this address while the replay runs (`GET /metrics`; port 0 picks one, and the
    /// address is printed on stderr).
    #[arg(long, value_name = "HOST:PORT")]
    metrics_addr: Option<String>,
    /// Print one JSON object (fields in docs/replay.md).
    #[arg(long)]
    json: bool,
}

/// Host layouts by name; each one's help is its dimensions as the core describes them ([`HostLayout::dims`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayoutArg {
    LayerFirst,
    PageFirst,
    PageFirstDirect,
    PageUnified,
}

impl ValueEnum for LayoutArg {
    fn value_variants<'a>() -> &'a [Self] {
        &[Self::LayerFirst, Self::PageFirst, Self::PageFirstDirect, Self::PageUnified]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let name = match self {
            Self::LayerFirst => "layer-first",
            Self::PageFirst => "page-first",
            Self::PageFirstDirect => "page-first-direct",
            Self::PageUnified => "page-unified",
        };
        Some(clap::builder::PossibleValue::new(name).help(host_layout(*self).dims()))
    }
}

/// Hybrid models by kind: the KV and the sidecar pools whose entries every page needs (SGLang's `all_pages`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum HybridArg {
    /// Sparse attention as DeepSeek V3.2's: MLA KV and an `indexer` pool (128 FP8 values and a 4-byte scale per
    /// token and layer).
    Dsa,
    /// An EAGLE draft model beside the MHA model: its one layer's KV (the model's heads) in a `draft` pool.
    Eagle,
    /// A multi-token-prediction layer beside MLA (DeepSeek, GLM): its one layer's latent in a `draft` pool.
    Mtp,
    /// Sliding-window attention as gpt-oss's: half the layers attend only to the last --swa-window tokens; the
    /// full layers' KV is the KV pool, the sliding layers' an `swa` pool that a prefix needs only in its window.
    Swa,
    /// Linear attention as Qwen3-Next's (gated delta net): three layers in four keep a recurrent state instead of KV,
    /// the fourth attends fully. The full layers' KV is the KV pool; the `mamba` pool holds a request's state (each
    /// linear layer's --head-dim² fp32 matrix per head, and its convolution's last 3 inputs), kept only where a
    /// request ended: a prefix is restorable only at a page whose state is held.
    Mamba,
}

impl HybridArg {
    /// Whether the model's KV is MLA's latent.
    fn mla(self) -> bool {
        matches!(self, Self::Dsa | Self::Mtp)
    }
}

/// DeepSeek's latent: its rank and its rope part, bf16.
const MLA_LATENT: (usize, usize) = (512, 64);
/// Inputs a linear-attention layer's short convolution keeps (Qwen3-Next's kernel of 4, less the current one).
const CONV_STATE_INPUTS: usize = 3;

/// The layers of a `--hybrid mamba` model that attend fully (one in four, as Qwen3-Next's); the others keep a state.
fn full_attention_layers(layers: usize) -> usize {
    layers / 4
}

/// The objects of one rank's `--hybrid mamba` state, as SGLang's Mooncake store cuts it: the recurrent (temporal)
/// state of every linear layer, each head a `head_dim`² fp32 matrix, and the convolution's state, its last
/// [`CONV_STATE_INPUTS`] inputs of the query, key and value channels in bf16.
fn mamba_state_objects(args: &ReplayArgs) -> Vec<EntryObject> {
    let linear = args.layers - full_attention_layers(args.layers);
    let (heads, dim) = (rank_heads(args), args.head_dim);
    let object = |name: &str, bytes: usize| EntryObject { name: name.to_owned(), bytes, per_rank: true };
    vec![
        object("temporal", linear * heads * dim * dim * 4),
        object("conv_0", linear * CONV_STATE_INPUTS * 3 * heads * dim * 2),
    ]
}

/// One sidecar pool of a `--hybrid` model as a rank holds it.
pub(crate) struct SidecarPreset {
    /// SGLang's name of the pool.
    pub(crate) name: &'static str,
    /// The pool's geometry: its entries are its pages.
    pub(crate) geometry: KvGeometry,
    /// What restoring a prefix needs of it.
    pub(crate) policy: HitPolicy,
    /// Its entry cut into objects as SGLang's Mooncake store cuts it, where the pool's name does not say
    /// ([`sglang_mooncake_objects`]).
    pub(crate) objects: Option<Vec<EntryObject>>,
}

/// The sidecar pools of the `--hybrid` model (none without one), in the order of their ranks.
pub(crate) fn sidecars(args: &ReplayArgs) -> anyhow::Result<Vec<SidecarPreset>> {
    let (latent, rope) = MLA_LATENT;
    let pool = match args.hybrid {
        None => return Ok(Vec::new()),
        Some(HybridArg::Dsa) => SidecarPreset {
            name: "indexer",
            // as a latent of one value per byte: 128 FP8 values and their 4-byte scale, the same on every rank
            geometry: KvGeometry::mla(args.layers, 128, 4, KvDtype::Fp8E4m3)?,
            policy: HitPolicy::AllPages,
            objects: None,
        },
        Some(HybridArg::Eagle) => SidecarPreset {
            name: "draft",
            geometry: KvGeometry::mha(1, rank_heads(args), args.head_dim, KvDtype::Bf16)?,
            policy: HitPolicy::AllPages,
            objects: None,
        },
        Some(HybridArg::Mtp) => SidecarPreset {
            name: "draft",
            geometry: KvGeometry::mla(1, latent, rope, KvDtype::Bf16)?,
            policy: HitPolicy::AllPages,
            objects: None,
        },
        Some(HybridArg::Swa) => SidecarPreset {
            name: "swa",
            geometry: KvGeometry::mha(args.layers / 2, rank_heads(args), args.head_dim, KvDtype::Bf16)?,
            policy: HitPolicy::TrailingPages { window: args.swa_window.div_ceil(args.page_size) },
            objects: None,
        },
        Some(HybridArg::Mamba) => {
            // a state is one entry of its own size, not so many bytes per token: the pool's geometry is of FP8
            // bytes, and one page of it (every linear layer's K and V halves) is exactly one state
            let objects = mamba_state_objects(args);
            let entry_bytes: usize = objects.iter().map(|object| object.bytes).sum();
            let linear = args.layers - full_attention_layers(args.layers);
            let per_layer = entry_bytes / linear;
            if !per_layer.is_multiple_of(2 * rank_heads(args) * args.page_size) {
                bail!(
                    "a layer's state of {per_layer} bytes on each rank does not split into pages of {} tokens \
                     (--page-size, --head-dim)",
                    args.page_size
                );
            }
            SidecarPreset {
                name: "mamba",
                geometry: KvGeometry::mha(
                    linear,
                    rank_heads(args),
                    per_layer / (2 * rank_heads(args) * args.page_size),
                    KvDtype::Fp8E4m3,
                )?,
                policy: HitPolicy::TrailingPages { window: 1 },
                objects: Some(objects),
            }
        }
    };
    Ok(vec![pool])
}

/// A rank's share of the model's KV heads (replicated when fewer than ranks).
fn rank_heads(args: &ReplayArgs) -> usize {
    (args.kv_heads / args.tp_size).max(1)
}

/// The model's trailing window in pages, when a sidecar pool needs only the last pages of a prefix.
fn trailing_window(args: &ReplayArgs) -> anyhow::Result<Option<NonZeroUsize>> {
    Ok(sidecars(args)?.iter().find_map(|pool| match pool.policy {
        HitPolicy::TrailingPages { window } => NonZeroUsize::new(window.max(1)),
        HitPolicy::AllPages => None,
    }))
}

/// The pools of the replay's model: the KV and its sidecar pools.
fn pools(args: &ReplayArgs) -> usize {
    1 + args.hybrid.map_or(0, |_| 1)
}

/// Write policies by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
#[expect(clippy::enum_variant_names, reason = "SGLang's names for the policies")]
pub(crate) enum WritePolicyArg {
    /// Back up every inserted node at once.
    WriteThrough,
    /// Back up a node on its second hit.
    WriteThroughSelective,
    /// Back up only at device eviction (and on to storage).
    WriteBack,
}

/// Prefetch policies by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum PrefetchPolicyArg {
    /// Stop at the first scheduling of the request.
    BestEffort,
    /// Stop when every hit page has arrived.
    WaitComplete,
    /// Stop when complete or at the timeout.
    Timeout,
}

/// Where the ranks' storage lives.
enum SharedStorage {
    None,
    /// One store every rank of this process shares, and the throttle of its reads (`throttle_read_gbps`).
    Memory(Arc<MemoryStore>, Option<u64>),
    Backend {
        name: BackendName,
        options: Box<BackendOptions>,
        _temp: Option<crate::cleanup::TempFolder>,
    },
}

pub(crate) fn run(args: &ReplayArgs) -> anyhow::Result<()> {
    check(args)?;
    let storage = match args.backend.0 {
        None => SharedStorage::None,
        // not opened through the table: one store that every rank of this process shares
        Some(name) if name.is("memory") => {
            let settings = backends::settings(name, &backend_options(args))?;
            SharedStorage::Memory(MemoryStore::new(), settings.throttle_read_bytes_per_s)
        }
        Some(name) => {
            let temp = match &args.dir {
                None if ["file", "nixl", "3fs"].contains(&name.name())
                    && !args.network.sets_any(&["dir", "file_path_prefix"]) =>
                {
                    // removed at the end, on an error, and on SIGINT/SIGTERM/SIGHUP
                    Some(crate::cleanup::TempFolder::new("hicache-replay-")?)
                }
                _ => None,
            };
            let mut options = backend_options(args);
            options.dir = options.dir.or_else(|| temp.as_ref().map(|temp| temp.path().to_owned()));
            SharedStorage::Backend { name, options: Box::new(options), _temp: temp }
        }
    };
    if args.processes && args.process_rank.is_none() {
        return processes::launch(args, &storage);
    }
    let metrics = match &args.metrics_addr {
        Some(addr) => {
            let metrics = Arc::new(Metrics::new());
            crate::metrics::serve(addr, metrics.clone())?;
            Some(metrics)
        }
        None => None,
    };
    let metrics = metrics.as_deref();
    let requests = (args.clients * args.rounds) as u64;
    let bar = crate::progress::bar(requests, "replay: requests", args.json)?;
    // until the first request is done, the ranks build their pools and the workload
    bar.set_message("building the pools and the workload");
    let progress = |done: u64| {
        if bar.position() == 0 && done > 0 {
            bar.set_message("");
        }
        bar.set_position(done);
    };
    if let (Some(rank), Some(dir)) = (args.process_rank, &args.process_dir) {
        bar.finish_and_clear();
        return processes::run_rank(args, rank, dir, &storage);
    }
    let outcomes = if ranks(args) == 1 {
        vec![run_one(args, 0, &storage, RankGroup::Given(&mut SingleRank), &progress, metrics)?]
    } else {
        let groups = InProcessGroup::new(ranks(args), Duration::from_secs(60))?;
        std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|mut group| {
                    let (storage, progress) = (&storage, &progress);
                    scope.spawn(move || {
                        let rank = group.rank();
                        let progress = move |done| {
                            if rank == 0 {
                                progress(done);
                            }
                        };
                        run_one(
                            args,
                            rank,
                            storage,
                            RankGroup::Given(&mut group),
                            &progress,
                            metrics.filter(|_| rank == 0),
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|handle| handle.join().unwrap_or_else(|_| bail!("a rank panicked")))
                .collect::<anyhow::Result<Vec<_>>>()
        })?
    };
    bar.finish_and_clear();
    let description = describe(args, &storage);
    report::print(args, &description, &outcomes, l3_layout(args, &storage)?)
}

/// The L3 key layout of the replay's stages, merged, for routers; `None` without a storage tier.
fn l3_layout(args: &ReplayArgs, storage: &SharedStorage) -> anyhow::Result<Option<L3Layout>> {
    let (tier, fields) = match storage {
        SharedStorage::None => return Ok(None),
        SharedStorage::Memory(..) => (&hicache_core::storage::tiers::MEMORY, Default::default()),
        SharedStorage::Backend { name, options, .. } => (name.entry(), backends::settings(*name, options)?.fields),
    };
    let agreements = unified_agreements(args)?;
    let mut layouts = Vec::new();
    for stage in 0..args.pp_size {
        let namespace = rank_namespace(args, Place { tp_rank: 0, stage, pool: 0 })?;
        let (first_layer, _) = stage_layers(args.layers, args.pp_size, stage);
        let unified = agreements.map(|agreements| (agreements, backends::stage(&namespace, first_layer as u64)));
        let mut layout = L3Layout::describe(tier, &fields, &namespace, unified)?;
        for pool in 1..pools(args) {
            let sidecar = rank_namespace(args, Place { tp_rank: 0, stage, pool })?.sidecar.expect("a sidecar pool");
            let policy = sidecars(args)?[pool - 1].policy;
            layout.add_sidecar(tier, &fields, &namespace, &sidecar, policy)?;
        }
        layouts.push(Some(layout));
    }
    Ok(l3_layout::merge(&layouts))
}

/// The storage namespace of the rank at `place`: its stage's KV pages, or a sidecar pool's entries under their keys
/// (cut into objects as SGLang's Mooncake store cuts them, for its key schemes).
fn rank_namespace(args: &ReplayArgs, place: Place) -> anyhow::Result<StorageNamespace> {
    let geometry = geometry(args, place.stage)?;
    let mut namespace = StorageNamespace::single_rank("hicache-replay", geometry, layout(args), args.page_size);
    namespace.head_groups = head_groups(args, &geometry)?;
    namespace.tp_rank = place.tp_rank;
    namespace.tp_size = args.tp_size;
    namespace.pp_rank = place.stage;
    namespace.pp_size = args.pp_size;
    if place.pool == 0 {
        return Ok(namespace);
    }
    let sidecars = sidecars(args)?;
    let pool = &sidecars[place.pool - 1];
    let entry_bytes = pool.geometry.bytes_per_page(args.page_size);
    let objects = pool
        .objects
        .clone()
        .or_else(|| sglang_mooncake_objects(pool.name, geometry.is_mla(), entry_bytes))
        .unwrap_or_default();
    Ok(namespace.sidecar(pool.name, entry_bytes)?.with_entry_objects(objects)?)
}

/// How a rank agrees with the others.
pub(crate) enum RankGroup<'a> {
    /// A group made by the caller (one rank, threads, a socket).
    Given(&'a mut dyn Collective),
    /// NCCL on the rank's GPU, joined once the GPU is open.
    #[cfg(feature = "cuda")]
    Nccl(hicache_cuda::NcclSettings),
}

/// The most ranks (TP ranks × pipeline stages × pools) a replay runs, each a thread or a process with pools of its
/// own.
const MAX_RANKS: u64 = 256;

/// The ranks of the replay: --tp-size in each of --pp-size stages, for each pool of the model.
pub(crate) fn ranks(args: &ReplayArgs) -> usize {
    args.tp_size.saturating_mul(args.pp_size).saturating_mul(pools(args))
}

/// Where a rank sits: its TP rank within its stage, its stage and its pool. Of the ranks of one pool, rank r is TP
/// rank r mod --tp-size of stage r / --tp-size, so the ranks of stage 0 come first, as SGLang numbers them; the KV's
/// ranks come first, then each sidecar pool's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    /// The TP rank within the stage.
    pub(crate) tp_rank: usize,
    /// The pipeline stage.
    pub(crate) stage: usize,
    /// The pool: 0 for the KV, `n` for the n-th sidecar pool of a hybrid model.
    pub(crate) pool: usize,
}

impl Place {
    pub(crate) fn of(args: &ReplayArgs, rank: usize) -> Self {
        let per_pool = args.tp_size * args.pp_size;
        let (pool, rank) = (rank / per_pool, rank % per_pool);
        Self { tp_rank: rank % args.tp_size, stage: rank / args.tp_size, pool }
    }
}

/// The first layer and the number of layers of pipeline stage `stage` of `stages` over `layers` layers, as SGLang's
/// `get_pp_indices` splits them: `layers / stages` each, and one more for each of the last `layers % stages` stages.
pub(crate) fn stage_layers(layers: usize, stages: usize, stage: usize) -> (usize, usize) {
    let (base, remainder) = (layers / stages, layers % stages);
    let plain = stages - remainder;
    if stage >= plain { (stage * (base + 1) - plain, base + 1) } else { (stage * base, base) }
}

fn check(args: &ReplayArgs) -> anyhow::Result<()> {
    let usage = |message: String| -> anyhow::Result<()> { Err(Usage(message).into()) };
    if !(args.storage_read_deadline > 0.0 && args.storage_read_deadline <= MAX_SECONDS) {
        return usage(format!(
            "--storage-read-deadline {:?} must be a number of seconds in (0, {MAX_SECONDS}] (a day)",
            args.storage_read_deadline
        ));
    }
    if args.engine == EngineName::Cuda && !cfg!(feature = "cuda") {
        return usage(
            "the cuda engine is not compiled into this hicache; rebuild with `cargo build --release -p hicache-cli \
             --features cuda`"
                .into(),
        );
    }
    for (name, value) in [
        ("--clients", args.clients),
        ("--rounds", args.rounds),
        ("--request-length", args.request_length),
        ("--max-parallel", args.max_parallel),
        ("--page-size", args.page_size),
        ("--layers", args.layers),
        ("--kv-heads", args.kv_heads),
        ("--head-dim", args.head_dim),
        ("--tp-size", args.tp_size),
        ("--pp-size", args.pp_size),
    ] {
        if value == 0 {
            return usage(format!("{name} must be at least 1"));
        }
    }
    if args.processes {
        if args.backend.0.is_some_and(|name| name.is("memory")) {
            return usage(
                "--processes needs a storage tier the processes share: --backend file, nixl, mooncake, 3fs or none \
                 (memory lives in one process)"
                    .into(),
            );
        }
        if args.metrics_addr.is_some() {
            return usage("--metrics-addr is not served with --processes".into());
        }
    } else if args.process_rank.is_some() || args.process_dir.is_some() || args.process_temp.is_some() {
        return usage("--process-rank and --process-dir are set by --processes for the ranks it starts".into());
    }
    // (a tier's settings are read where it is opened)
    if args.backend.0.is_none() {
        crate::backends::check_options(None, args.format, &args.network)?;
    }
    if let Some(rank) = args.process_rank
        && rank >= ranks(args)
    {
        return usage(format!(
            "--process-rank {rank} is not a rank of --tp-size {} × --pp-size {} × {} pools",
            args.tp_size,
            args.pp_size,
            pools(args)
        ));
    }
    if args.process_rank.is_some() != args.process_dir.is_some() {
        return usage("--process-rank and --process-dir come together (set by --processes)".into());
    }
    for (name, value, range) in [
        (
            if args.hybrid.is_some() { "--tp-size × --pp-size × pools" } else { "--tp-size × --pp-size" },
            ranks(args) as u64,
            1..=MAX_RANKS,
        ),
        ("--max-parallel", args.max_parallel as u64, 1..=1 << 20),
        ("--fault-latency-us", args.fault_latency_us, 0..=60_000_000),
        ("--fault-hang-ms", args.fault_hang_ms, 0..=600_000),
        ("--fault-read-mbps", args.fault_read_mbps, 0..=100_000_000),
    ] {
        if !range.contains(&value) {
            return usage(format!("{name} {value} is not in [{}, {}]", range.start(), range.end()));
        }
    }
    if args.decode_ms_per_token > MAX_SECONDS * 1e3 {
        return usage(format!("--decode-ms-per-token {} is more than a day", args.decode_ms_per_token));
    }
    for (name, rate) in [
        ("--fault-fail-rate", args.fault_fail_rate),
        ("--fault-corrupt-rate", args.fault_corrupt_rate),
        ("--fault-hang-rate", args.fault_hang_rate),
    ] {
        if !(0.0..=1.0).contains(&rate) {
            return usage(format!("{name} {rate} must be a probability between 0 and 1"));
        }
    }
    if !(args.request_rate > 0.0 && args.request_rate.is_finite()) {
        return usage(format!("--request-rate {} must be a positive number", args.request_rate));
    }
    if !(args.prefill_tokens_per_s > 0.0 && args.prefill_tokens_per_s.is_finite()) {
        return usage(format!("--prefill-tokens-per-s {} must be a positive number", args.prefill_tokens_per_s));
    }
    if !(args.decode_ms_per_token >= 0.0 && args.decode_ms_per_token.is_finite()) {
        return usage(format!("--decode-ms-per-token {} must be a number ≥ 0", args.decode_ms_per_token));
    }
    if args.device_tokens < args.page_size || args.host_tokens <= args.device_tokens {
        return usage(format!(
            "--host-tokens {} must exceed --device-tokens {}, which must hold a page of {}",
            args.host_tokens, args.device_tokens, args.page_size
        ));
    }
    if args.kv_heads > args.tp_size && !args.kv_heads.is_multiple_of(args.tp_size) {
        return usage(format!("--kv-heads {} cannot be split over --tp-size {}", args.kv_heads, args.tp_size));
    }
    if args.pp_size > args.layers {
        return usage(format!("--pp-size {} has more stages than --layers {}", args.pp_size, args.layers));
    }
    if let Some(hybrid) = args.hybrid {
        let hybrid = crate::value_name(&hybrid);
        if args.pp_size > 1 {
            return usage(format!("--hybrid {hybrid} runs one pipeline stage, not --pp-size {}", args.pp_size));
        }
        if args.unified_keys {
            return usage(format!("--hybrid {hybrid}: the unified key scheme keeps no sidecar pools"));
        }
        if args.hybrid == Some(HybridArg::Swa) && (args.layers < 2 || args.swa_window == 0) {
            return usage(format!(
                "--hybrid {hybrid} needs --layers of 2 or more (half of them sliding) and a --swa-window of 1 or more \
                 tokens, not {} and {}",
                args.layers, args.swa_window
            ));
        }
        if args.hybrid == Some(HybridArg::Mamba) && full_attention_layers(args.layers) == 0 {
            return usage(format!(
                "--hybrid {hybrid} needs --layers of 4 or more (one in four attending fully), not {}",
                args.layers
            ));
        }
    }
    // the last stage holds the most layers
    let geometry = geometry(args, args.pp_size - 1)
        .map_err(|error| Usage(format!("--layers, --kv-heads, --head-dim: {error}")))?;
    let sidecars =
        sidecars(args).map_err(|error| Usage(format!("--hybrid, --layers, --kv-heads, --head-dim: {error}")))?;
    // each rank holds its pools and its copy of the workload (every conversation's tokens, as u32); with a hybrid
    // model, the ranks of one TP rank and stage hold the KV's pools and each sidecar pool's between them
    let pools = crate::memory::product(&[(args.device_tokens as u64).saturating_add(args.host_tokens as u64), {
        let sidecars: usize = sidecars.iter().map(|pool| pool.geometry.bytes_per_token()).sum();
        (geometry.bytes_per_token() + sidecars).div_ceil(self::pools(args)) as u64
    }]);
    let conversation = (args.request_length as u64)
        .checked_add(args.output_length as u64)
        .and_then(|round| round.checked_mul(args.rounds as u64))
        .and_then(|rounds| rounds.checked_add(args.system_prompt as u64));
    let workload = conversation.and_then(|tokens| crate::memory::product(&[tokens, args.clients as u64, 4]));
    let per_rank = pools.zip(workload).and_then(|(pools, workload)| pools.checked_add(workload));
    crate::memory::require(
        per_rank.and_then(|bytes| bytes.checked_mul(ranks(args) as u64)),
        "--clients, --rounds, --request-length, --output-length, --system-prompt, --device-tokens, --host-tokens, \
         --layers, --kv-heads, --head-dim, --tp-size, --pp-size",
    )?;
    Ok(())
}

/// The KV geometry of a rank of pipeline stage `stage`: its share of the heads (MLA: the whole latent), its stage's
/// layers.
pub(crate) fn geometry(args: &ReplayArgs, stage: usize) -> anyhow::Result<KvGeometry> {
    let (_, layers) = stage_layers(args.layers, args.pp_size, stage);
    if args.hybrid.is_some_and(HybridArg::mla) {
        let (latent, rope) = MLA_LATENT;
        return Ok(KvGeometry::mla(layers, latent, rope, KvDtype::Bf16)?);
    }
    // a sliding-window model's KV pool holds its full layers (the sliding ones are the `swa` pool)
    // (a linear-attention model's: its full layers, one in four)
    let layers = match args.hybrid {
        Some(HybridArg::Swa) => layers - layers / 2,
        Some(HybridArg::Mamba) => full_attention_layers(layers),
        _ => layers,
    };
    Ok(KvGeometry::mha(layers, rank_heads(args), args.head_dim, KvDtype::Bf16)?)
}

/// The geometry of the pool a rank at `place` holds: its stage's KV, or a sidecar pool's.
fn pool_geometry(args: &ReplayArgs, place: Place) -> anyhow::Result<KvGeometry> {
    if place.pool == 0 {
        return geometry(args, place.stage);
    }
    Ok(sidecars(args)?[place.pool - 1].geometry)
}

/// What the flags say about the storage tier.
fn backend_options(args: &ReplayArgs) -> BackendOptions {
    BackendOptions {
        dir: args.dir.clone(),
        format: args.format,
        direct_io: false,
        io_threads: None,
        nixl_plugin: None,
        nixl_params: Vec::new(),
        read_only: false,
        capacity_bytes: args.capacity_bytes,
        network: args.network.clone(),
        config_extra: None,
    }
}

/// The `--layout` the replay runs with: as given, else page-first for Mooncake (as SGLang forces), else layer-first.
fn layout_arg(args: &ReplayArgs) -> LayoutArg {
    match (args.layout, args.backend.0) {
        (Some(layout), _) => layout,
        (None, Some(name)) if name.is("mooncake") => LayoutArg::PageFirst,
        (None, _) => LayoutArg::LayerFirst,
    }
}

fn layout(args: &ReplayArgs) -> HostLayout {
    host_layout(layout_arg(args))
}

/// The layout a `--layout` value names.
pub(crate) fn host_layout(layout: LayoutArg) -> HostLayout {
    match layout {
        LayoutArg::LayerFirst => HostLayout::LayerFirst,
        LayoutArg::PageFirst => HostLayout::PageFirst,
        LayoutArg::PageFirstDirect => HostLayout::PageFirstDirect,
        LayoutArg::PageUnified => HostLayout::PageUnified,
    }
}

/// The head groups of each host page: `--head-group` under page-unified, checked against the rank's heads.
/// Without `--head-group`, the unified key scheme's agreement of the extra config.
fn head_groups(args: &ReplayArgs, geometry: &KvGeometry) -> anyhow::Result<usize> {
    if args.head_group.is_some() && layout(args) != HostLayout::PageUnified {
        bail!(Usage(format!("--head-group cuts page-unified pages only, not {}", layout(args).name())));
    }
    let config = HiCacheConfig { mem_layout: layout(args), head_group: head_group(args)?, ..HiCacheConfig::default() };
    config.head_groups(geometry).map_err(|error| Usage(format!("--head-group: {error}")).into())
}

/// KV heads per head group: `--head-group`, else the unified key scheme's agreement of the extra config.
fn head_group(args: &ReplayArgs) -> anyhow::Result<Option<usize>> {
    let agreed = unified_agreements(args)?.and_then(|agreements| agreements.head_group).map(|group| group as usize);
    Ok(args.head_group.or(agreed))
}

/// The unified key scheme's agreements: by the flags (`--unified-keys`), else by the extra config's `key_scheme`;
/// `None` for keys of each rank.
fn unified_agreements(args: &ReplayArgs) -> anyhow::Result<Option<UnifiedAgreements>> {
    let Some(name) = args.backend.0 else {
        if args.unified_keys {
            bail!(Usage("--unified-keys stores pages on a storage tier; --backend none has none".into()));
        }
        return Ok(None);
    };
    if args.unified_keys {
        return Ok(Some(UnifiedAgreements {
            head_group: args.head_group.map(|group| group as u64),
            layer_partition: args.layer_partition.map(|layers| layers as u64),
        }));
    }
    // the flags' and the extra config's mistakes are usage errors, as without the scheme
    Ok(backends::settings(name, &backend_options(args))?.unified)
}

/// Builds one rank's engine, controller, storage and tree, and runs the workload on it.
fn run_one(
    args: &ReplayArgs,
    rank: usize,
    storage: &SharedStorage,
    group: RankGroup<'_>,
    progress: &dyn Fn(u64),
    metrics: Option<&Metrics>,
) -> anyhow::Result<rank::RankOutcome> {
    let geometry = pool_geometry(args, Place::of(args, rank))?;
    let page = args.page_size;
    let (device_pages, host_pages) = (args.device_tokens / page, args.host_tokens / page);
    let device_map = DeviceLayoutMap::new(geometry, device_pages * page)?;
    let host_map = HostLayoutMap::new(geometry, layout(args), page, host_pages)?
        .with_head_groups(head_groups(args, &geometry)?)?;
    let allocation = match &args.host_shm {
        Some(dir) => HostAllocation::SharedMemory { dir: dir.clone() },
        None => HostAllocation::Anonymous,
    };
    let host = Arc::new(HostMemory::new(host_map, &allocation).map_err(|error| match &args.host_shm {
        Some(_) => anyhow::Error::from(Usage(format!("--host-shm: {error}"))),
        None => error.into(),
    })?);
    match args.engine {
        EngineName::Cpu => {
            let engine = CpuEngine::with_host_memory(device_map, host, Completion::Immediate)?;
            match group {
                RankGroup::Given(collective) => run_on(engine, args, rank, storage, collective, progress, metrics),
                #[cfg(feature = "cuda")]
                RankGroup::Nccl(_) => bail!("NCCL needs the cuda engine"),
            }
        }
        #[cfg(feature = "cuda")]
        EngineName::Cuda => {
            // as processes, rank r drives GPU r; as threads, every rank shares GPU 0
            let device = hicache_cuda::Device::open(if args.process_rank.is_some() { rank } else { 0 })?;
            let device_pool = hicache_cuda::DeviceBuffer::zeroed(&device, device_map.total_bytes())?;
            let engine = hicache_cuda::CudaEngine::with_pools(&device, device_map, device_pool, host)?;
            match group {
                RankGroup::Given(collective) => run_on(engine, args, rank, storage, collective, progress, metrics),
                RankGroup::Nccl(settings) => {
                    let mut nccl = hicache_cuda::NcclGroup::join(&device, &settings)?;
                    run_on(engine, args, rank, storage, &mut nccl, progress, metrics)
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        EngineName::Cuda => unreachable!("refused before the ranks start"),
    }
}

/// Builds the controller, storage and tree over `engine`, and runs the workload on it.
fn run_on<E: device::ReplayEngine>(
    engine: E,
    args: &ReplayArgs,
    rank: usize,
    storage: &SharedStorage,
    collective: &mut dyn Collective,
    progress: &dyn Fn(u64),
    metrics: Option<&Metrics>,
) -> anyhow::Result<rank::RankOutcome> {
    let place = Place::of(args, rank);
    let (first_layer, _) = stage_layers(args.layers, args.pp_size, place.stage);
    let page = args.page_size;
    let device_pages = args.device_tokens / page;
    let namespace = rank_namespace(args, place)?;
    let open_tier = |namespace: &StorageNamespace| -> Result<Box<dyn StorageBackend>, hicache_core::Error> {
        match storage {
            SharedStorage::None => unreachable!("no tier is opened without one"),
            SharedStorage::Memory(store, throttle) => {
                Ok(throttled(Box::new(MemoryStorage::shared(store.clone(), namespace)), *throttle))
            }
            SharedStorage::Backend { name, options, .. } => {
                let settings = backends::settings(*name, options)
                    .map_err(|error| hicache_core::Error::storage(name.name(), format!("{error:#}")))?;
                backends::open_tier(*name, &settings, namespace)
            }
        }
    };
    let agreements = unified_agreements(args)?;
    let mut unified = None;
    let opened: Option<Box<dyn StorageBackend>> = match (storage, agreements) {
        (SharedStorage::None, _) => None,
        (_, Some(agreements)) => {
            if layout(args) != HostLayout::PageUnified {
                bail!(Usage(format!("the unified key scheme stores page-unified pages, not {}", layout(args).name())));
            }
            let stage = backends::stage(&namespace, first_layer as u64);
            let storage = Arc::new(backends::open_unified(&namespace, stage, agreements, &open_tier)?);
            unified = Some(storage.clone());
            Some(Box::new(storage))
        }
        (SharedStorage::Backend { name, options, .. }, None) => {
            Some(backends::open(*name, &namespace, first_layer as u64, options)?)
        }
        (SharedStorage::Memory(..), None) => Some(open_tier(&namespace)?),
    };
    // with fault injection, every storage call of this rank goes through the fault wrapper
    let (backend, faults): (Option<Arc<dyn StorageBackend>>, Option<Arc<Faulty>>) =
        match (opened, fault_plan(args, rank)) {
            (Some(opened), Some(plan)) => {
                let wrapped = Arc::new(FaultyStorage::new(opened, plan));
                (Some(wrapped.clone()), Some(wrapped))
            }
            (opened, _) => (opened.map(Arc::from), None),
        };
    let trailing = trailing_window(args)?;
    let config = HiCacheConfig {
        page_size: page,
        mem_layout: layout(args),
        head_group: head_group(args)?,
        write_policy: write_policy(args),
        prefetch_policy: match args.prefetch_policy {
            PrefetchPolicyArg::BestEffort => PrefetchPolicy::BestEffort,
            PrefetchPolicyArg::WaitComplete => PrefetchPolicy::WaitComplete,
            PrefetchPolicyArg::Timeout => PrefetchPolicy::Timeout,
        },
        prefetch_threshold: args.prefetch_threshold,
        storage_read_deadline_s: args.storage_read_deadline,
        // a trailing window's hit is fetched whole
        prefetch_by_cost: !args.fetch_whole_hits && trailing.is_none(),
        prefetch_split: !args.fetch_whole_hits && !args.no_split && trailing.is_none(),
        prefetch_meet: !args.fetch_whole_hits && !args.no_split && !args.no_meet && trailing.is_none(),
        ..HiCacheConfig::default()
    };
    let mut builder = HiCacheBuilder::new(config.clone(), engine).with_tp_rank(place.tp_rank);
    // the window pool's ranks store and read only windows; every rank's tree ends matches where they are held
    let window_pool = place.pool > 0 && trailing.is_some();
    if let Some(window) = trailing {
        builder = builder.with_trailing(Trailing { window, pool: window_pool });
    }
    if let Some(backend) = &backend {
        builder = builder.with_storage(backend.clone());
    }
    let mut tree = builder.build()?;
    let mut workload = workload::Workload::new(workload::WorkloadSpec {
        clients: args.clients,
        rounds: args.rounds,
        request_length: args.request_length,
        output_length: args.output_length,
        system_prompt: args.system_prompt,
        request_rate: args.request_rate,
        seed: args.seed,
    });
    if workload.longest().div_ceil(page) > device_pages {
        bail!(Usage(format!(
            "--device-tokens {} cannot hold one conversation of {} tokens",
            args.device_tokens,
            workload.longest()
        )));
    }
    let spec = rank::LoopSpec {
        max_parallel: args.max_parallel,
        prefill_tokens_per_s: args.prefill_tokens_per_s,
        decode_ms_per_token: args.decode_ms_per_token,
        sync_storage: args.sync_storage,
        split: config.prefetch_split,
        meet: config.prefetch_meet,
        // the heads are split over the ranks in order (each of too few heads held by several ranks); MLA's latent
        // is the same on every rank
        first_head: if geometry(args, place.stage)?.is_mla() {
            0
        } else {
            place.tp_rank * args.kv_heads / args.tp_size
        },
        first_layer,
        pool: place.pool,
        window: trailing.filter(|_| window_pool).map(NonZeroUsize::get),
        state_at_end: args.hybrid == Some(HybridArg::Mamba),
    };
    // the engine's allocator of device slots: the rank allocates its prefills from it and lends it to the tree
    let mut device = hicache_core::device_slots::PagedSlots::new(device_pages, page)?;
    let mut outcome = rank::run_rank(&mut tree, &mut device, &mut workload, &spec, collective, progress, metrics)?;
    outcome.storage = backend.map(|backend| backend.stats());
    outcome.chunks = unified.map(|unified| unified.chunk_stats());
    outcome.injected = faults.map(|faults| faults.injected());
    Ok(outcome)
}

/// A rank's backend behind the fault injection.
type Faulty = FaultyStorage<Box<dyn StorageBackend>>;

/// The fault plan of rank `rank`, when any `--fault-*` flag asks for faults.
fn fault_plan(args: &ReplayArgs, rank: usize) -> Option<FaultPlan> {
    let ppm = |rate: f64| (rate * 1e6).round() as u32;
    let plan = FaultPlan {
        latency: (args.fault_latency_us > 0).then(|| Duration::from_micros(args.fault_latency_us)),
        page_failure_ppm: ppm(args.fault_fail_rate),
        corruption_ppm: ppm(args.fault_corrupt_rate),
        hang_ppm: ppm(args.fault_hang_rate),
        hang_for: Duration::from_millis(args.fault_hang_ms),
        seed: args.fault_seed.wrapping_add(rank as u64),
        read_bytes_per_s: args.fault_read_mbps.saturating_mul(1_000_000),
        ..FaultPlan::default()
    };
    (plan != FaultPlan { seed: plan.seed, hang_for: plan.hang_for, ..FaultPlan::default() }).then_some(plan)
}

fn write_policy(args: &ReplayArgs) -> WritePolicy {
    match args.write_policy {
        WritePolicyArg::WriteThrough => WritePolicy::WriteThrough,
        WritePolicyArg::WriteThroughSelective => WritePolicy::WriteThroughSelective,
        WritePolicyArg::WriteBack => WritePolicy::WriteBack,
    }
}

fn describe(args: &ReplayArgs, storage: &SharedStorage) -> String {
    let tier = match storage {
        SharedStorage::None => "no storage tier".to_owned(),
        SharedStorage::Memory(..) => "memory tier".to_owned(),
        SharedStorage::Backend { name, options, _temp } => match name.name() {
            "file" => format!("file tier in {}", backends::dir_of(*name, options).display()),
            "nixl" => format!("NIXL tier in {}", backends::dir_of(*name, options).display()),
            other => format!("{other} tier"),
        },
    };
    format!(
        "{} clients × {} rounds, +{} tokens per prompt, {} answer tokens, page {}, {} engine, {tier}, TP {}{}",
        args.clients,
        args.rounds,
        args.request_length,
        args.output_length,
        args.page_size,
        match args.engine {
            EngineName::Cpu => "cpu",
            EngineName::Cuda => "cuda",
        },
        args.tp_size,
        if args.pp_size > 1 { format!(" × PP {}", args.pp_size) } else { String::new() }
    ) + &args.hybrid.map(|hybrid| format!(", hybrid {}", crate::value_name(&hybrid))).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::stage_layers;

    /// SGLang's `get_pp_indices` (without `SGLANG_PP_LAYER_PARTITION`), line for line.
    fn get_pp_indices(num_hidden_layers: usize, pp_rank: usize, pp_size: usize) -> (usize, usize) {
        let base_layers = num_hidden_layers / pp_size;
        let remainder = num_hidden_layers % pp_size;
        if pp_rank >= pp_size - remainder {
            let partitions_without_extra_layer = pp_size - remainder;
            let start_layer = pp_rank * (base_layers + 1) - partitions_without_extra_layer;
            (start_layer, start_layer + base_layers + 1)
        } else {
            let start_layer = pp_rank * base_layers;
            (start_layer, start_layer + base_layers)
        }
    }

    #[test]
    fn eight_layers_over_three_stages_give_the_last_two_stages_one_more() {
        let split: Vec<_> = (0..3).map(|stage| stage_layers(8, 3, stage)).collect();
        assert_eq!(split, [(0, 2), (2, 3), (5, 3)]);
    }

    proptest! {
        #[test]
        fn stages_split_layers_as_sglang_does_and_tile_them((layers, stages) in (1usize..200).prop_flat_map(|layers| {
            (Just(layers), 1..=layers)
        })) {
            let mut next = 0;
            for stage in 0..stages {
                let (first, count) = stage_layers(layers, stages, stage);
                prop_assert_eq!((first, first + count), get_pp_indices(layers, stage, stages));
                prop_assert!(first == next && count >= 1);
                next = first + count;
            }
            prop_assert_eq!(next, layers);
        }
    }
}
