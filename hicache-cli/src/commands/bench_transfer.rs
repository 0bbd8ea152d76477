//! `hicache bench transfer`: device↔host transfer throughput of an engine, for each geometry × layout × direction ×
//! page size, next to a bulk copy of the same bytes measured in the same run.
//!
//! Pages are scattered, as in a pool after churn: a load reads a random set of host pages into a random set of
//! device pages. `load` is host → device, all layers one after another (the forward pass's per-layer loads);
//! `write` is device → host, all layers in one transfer. The reference (`bulk_gbps`) is one contiguous copy of
//! the same number of bytes between the same two buffers. The time until the first layer of a load is ready is
//! printed beside each load.

use std::time::Instant;

use anyhow::bail;
use clap::{Args, ValueEnum};
use hicache_core::geometry::{Attention, KvGeometry};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap, TransferEngine, TransferEvent};
use serde::Serialize;

use super::placement::{Placement, mean_run_bytes, place};
use crate::exit::Usage;
use crate::replay::EngineName;

/// Geometries by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum GeometryArg {
    /// Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128, bf16 (MHA).
    Llama31_8b,
    /// DeepSeek-V3: 61 layers, 576 × bf16 latent (MLA).
    DeepseekV3,
}

/// GPU io backends by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum IoBackendArg {
    /// The transfer kernel for every item.
    Kernel,
    /// One cuMemcpyAsync per run contiguous in both pools.
    Direct,
    /// Long runs to the copy engine, the rest to the kernel.
    Auto,
    /// Every run contiguous in both pools in one cuMemcpyBatchAsync (CUDA 13 drivers).
    Batch,
}

/// GPU transfer kernels by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum CopyKernelArg {
    /// Warps load and store through registers (any GPU).
    Warp,
    /// The Tensor Memory Accelerator through shared memory (sm_90 and later).
    Tma,
}

/// Arguments of `hicache bench transfer`.
#[derive(Debug, Args)]
pub(crate) struct BenchTransferArgs {
    /// Transfer engine.
    #[arg(long, value_enum, default_value_t = EngineName::Cpu)]
    engine: EngineName,
    /// Geometries to measure (repeatable; default both).
    #[arg(long, value_enum)]
    geometry: Vec<GeometryArg>,
    /// Tokens per transfer, and of the load whose first layer is timed (default: 8192 on the GPU; 1024 on the CPU
    /// engine, whose pools are plain memory of this machine: 1024 Llama tokens are 128 MiB per pool).
    #[arg(long, value_name = "N")]
    tokens: Option<usize>,
    /// Host layouts (repeatable; default all four).
    #[arg(long, value_enum, value_name = "LAYOUT")]
    layout: Vec<crate::replay::LayoutArg>,
    /// KV heads per head group of page-unified pages of MHA geometries (MLA's have one group); default: one group
    /// of all the heads.
    #[arg(long, value_name = "N")]
    head_group: Option<usize>,
    /// Page sizes (repeatable; default 1, 16 and 64).
    #[arg(long, value_name = "N")]
    page_size: Vec<usize>,
    /// Passes per figure; the best counts.
    #[arg(long, default_value_t = 3, value_name = "N")]
    rounds: usize,
    /// GPU: most thread blocks per transfer kernel (the block quota that leaves SMs to the model).
    #[arg(long, default_value_t = 64, value_name = "N")]
    blocks: u32,
    /// GPU: threads per block of the warp kernel (the TMA kernel's blocks are one warp).
    #[arg(long, default_value_t = 512, value_name = "N")]
    threads: u32,
    /// GPU: the kernels to measure (repeatable; default: the engine's default, the warp kernel).
    #[arg(long, value_enum)]
    kernel: Vec<CopyKernelArg>,
    /// GPU: how the device pool is allocated (repeatable, to compare in one run; default: slab): one slab, or one
    /// allocation per layer and part as an engine's K and V tensors.
    #[arg(long, value_enum)]
    device_pool: Vec<DevicePoolArg>,
    /// GPU: the TMA kernel's dynamic shared memory per block, at most (default 192 KiB).
    #[arg(long, value_name = "B")]
    tma_shared: Option<usize>,
    /// GPU: the TMA kernel's largest piece of an item (default: whole items up to half a lane's shared memory).
    #[arg(long, value_name = "B")]
    tma_piece: Option<usize>,
    /// GPU: how transfers are issued (repeatable; default all four): the kernel, one cuMemcpyAsync per contiguous
    /// run (direct), those runs in one cuMemcpyBatchAsync (batch, CUDA 13 drivers), or runs of at least
    /// --auto-min-run bytes to the copy engine and the rest to the kernel (auto).
    #[arg(long, value_enum)]
    io_backend: Vec<IoBackendArg>,
    /// GPU: the shortest run (bytes of one layer) `auto` gives the copy engine; writes, and loads unless
    /// --auto-min-run-load is given (default: 1 MiB).
    #[arg(long, value_name = "B")]
    auto_min_run: Option<usize>,
    /// GPU: the shortest run `auto` gives the copy engine on loads.
    #[arg(long, value_name = "B")]
    auto_min_run_load: Option<usize>,
    /// Where the transfer's pages lie: scattered at random over pools twice its size, contiguous (in order), or as
    /// the allocators of churned pools hand them out.
    #[arg(long, value_enum, default_value_t = Placement::Scattered)]
    placement: Placement,
    /// The same as --placement contiguous.
    #[arg(long, conflicts_with = "placement")]
    contiguous: bool,
    /// GPU: also measure Llama `layer_first` and `page_first` page-64 loads and writes at several block counts,
    /// to find the fewest blocks that reach 90% of bulk.
    #[arg(long)]
    sweep_blocks: bool,
    /// Print a JSON list of {geometry, layout, head_groups, io_backend, direction, page_size, item_bytes, gbps,
    /// bulk_gbps, ratio, first_layer_us}.
    #[arg(long)]
    json: bool,
}

/// The GPU device pool's allocation (`--device-pool`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum DevicePoolArg {
    /// One allocation, `[layer][part][slot][item]`.
    Slab,
    /// One allocation per layer and part, reached through a table of their addresses.
    PerLayer,
}

/// One line of `bench transfer`.
#[derive(Debug, Serialize)]
pub(crate) struct TransferFigure {
    pub(crate) geometry: &'static str,
    pub(crate) layout: String,
    /// Head groups per host page (above 1 only under page_unified).
    pub(crate) head_groups: usize,
    pub(crate) io_backend: &'static str,
    pub(crate) direction: &'static str,
    pub(crate) page_size: usize,
    pub(crate) item_bytes: usize,
    pub(crate) gbps: f64,
    pub(crate) bulk_gbps: f64,
    pub(crate) ratio: f64,
    /// Loads: microseconds until layer 0 is ready.
    pub(crate) first_layer_us: Option<f64>,
    /// GPU loads: microseconds the calling thread spent submitting every layer (best pass).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) submit_us: Option<f64>,
    /// Where the pages lay: scattered, contiguous or churned.
    pub(crate) placement: &'static str,
    /// Mean bytes of one copy contiguous in both pools (per layer and part).
    pub(crate) run_bytes: f64,
    /// GPU: most thread blocks of the kernel.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) blocks: Option<u32>,
    /// GPU: the kernel that moved what the copy engine did not (`warp` or `tma`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) kernel: Option<&'static str>,
    /// GPU: the device pool's allocation (`slab` or `per-layer`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) device_pool: Option<&'static str>,
}

/// The placement's name in figures.
pub(crate) fn placement_name(placement: Placement) -> &'static str {
    match placement {
        Placement::Scattered => "scattered",
        Placement::Contiguous => "contiguous",
        Placement::Churned => "churned",
    }
}

fn placement(args: &BenchTransferArgs) -> Placement {
    if args.contiguous { Placement::Contiguous } else { args.placement }
}

/// The `auto` thresholds given on the command line, as (write, load); `None` each: the engine's defaults.
#[cfg(feature = "cuda")]
pub(crate) type AutoMinRunArgs = (Option<usize>, Option<usize>);

#[cfg(feature = "cuda")]
fn auto_min_run(args: &BenchTransferArgs) -> AutoMinRunArgs {
    (args.auto_min_run, args.auto_min_run_load.or(args.auto_min_run))
}

/// The kernels to measure: those named, else the engine's choice (`None`).
#[cfg(feature = "cuda")]
fn kernels(args: &BenchTransferArgs) -> Vec<Option<CopyKernelArg>> {
    if args.kernel.is_empty() { vec![None] } else { args.kernel.iter().copied().map(Some).collect() }
}

/// The GPU measurement's settings from the command line (kernel and io backend: the engine's defaults).
#[cfg(feature = "cuda")]
fn cuda_shape(args: &BenchTransferArgs, tokens: usize) -> super::bench_transfer_cuda::Shape {
    super::bench_transfer_cuda::Shape {
        tokens,
        rounds: args.rounds,
        blocks: args.blocks,
        threads: args.threads,
        backend: IoBackendArg::Kernel,
        kernel: None,
        device_pool: DevicePoolArg::Slab,
        tma_shared: args.tma_shared,
        tma_piece: args.tma_piece,
        auto_min_run: auto_min_run(args),
        placement: placement(args),
        head_groups: 1,
    }
}

pub(crate) fn run(args: &BenchTransferArgs) -> anyhow::Result<()> {
    #[cfg(not(feature = "cuda"))]
    if args.engine == EngineName::Cuda {
        bail!(Usage(
            "the cuda engine is not compiled into this hicache; rebuild with `cargo build --release -p hicache-cli \
             --features cuda`"
                .into()
        ));
    }
    let tokens = args.tokens.unwrap_or(if args.engine == EngineName::Cuda { 8192 } else { 1024 });
    if tokens == 0 || args.rounds == 0 {
        bail!(Usage("--tokens and --rounds must be at least 1".into()));
    }
    let geometries = if args.geometry.is_empty() {
        vec![GeometryArg::Llama31_8b, GeometryArg::DeepseekV3]
    } else {
        args.geometry.clone()
    };
    let page_sizes = if args.page_size.is_empty() { vec![1, 16, 64] } else { args.page_size.clone() };
    if let Some(bad) = page_sizes.iter().find(|&&page| page == 0 || !tokens.is_multiple_of(page)) {
        bail!(Usage(format!("--page-size {bad} must be at least 1 and divide --tokens {tokens}")));
    }
    let mut figures = Vec::new();
    let progress = crate::progress::counter("bench transfer: cases", args.json)?;
    for &geometry_arg in &geometries {
        let (name, geometry) = match geometry_arg {
            GeometryArg::Llama31_8b => ("llama-3.1-8b", KvGeometry::llama31_8b()),
            GeometryArg::DeepseekV3 => ("deepseek-v3", KvGeometry::deepseek_v3()),
        };
        let layouts: Vec<HostLayout> = if args.layout.is_empty() {
            HostLayout::ALL.to_vec()
        } else {
            args.layout.iter().map(|&layout| crate::replay::host_layout(layout)).collect()
        };
        for layout in layouts {
            for &page in &page_sizes {
                progress.set_message(format!("{name} {} page {page}", layout.name()));
                progress.inc(1);
                match args.engine {
                    EngineName::Cpu => figures.extend(measure(
                        name,
                        geometry,
                        (layout, head_groups(&geometry, layout, args.head_group)?),
                        page,
                        tokens,
                        args.rounds,
                        placement(args),
                    )?),
                    #[cfg(feature = "cuda")]
                    EngineName::Cuda => {
                        let backends = if args.io_backend.is_empty() {
                            vec![IoBackendArg::Kernel, IoBackendArg::Direct, IoBackendArg::Auto, IoBackendArg::Batch]
                        } else {
                            args.io_backend.clone()
                        };
                        let pools = if args.device_pool.is_empty() {
                            vec![DevicePoolArg::Slab]
                        } else {
                            args.device_pool.clone()
                        };
                        for backend in backends {
                            for kernel in kernels(args) {
                                for &device_pool in &pools {
                                    let shape = super::bench_transfer_cuda::Shape {
                                        backend,
                                        kernel,
                                        device_pool,
                                        head_groups: head_groups(&geometry, layout, args.head_group)?,
                                        ..cuda_shape(args, tokens)
                                    };
                                    figures.extend(super::bench_transfer_cuda::measure(
                                        name, geometry, layout, page, &shape,
                                    )?);
                                }
                            }
                        }
                    }
                    #[cfg(not(feature = "cuda"))]
                    EngineName::Cuda => unreachable!("refused above"),
                }
            }
        }
    }
    #[cfg(feature = "cuda")]
    if args.sweep_blocks && args.engine == EngineName::Cuda {
        for kernel in kernels(args) {
            for (name, geometry) in
                [("llama-3.1-8b", KvGeometry::llama31_8b()), ("deepseek-v3", KvGeometry::deepseek_v3())]
            {
                for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
                    for blocks in [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 132, 264] {
                        let shape = super::bench_transfer_cuda::Shape {
                            blocks,
                            backend: IoBackendArg::Kernel,
                            kernel,
                            ..cuda_shape(args, tokens)
                        };
                        figures.extend(super::bench_transfer_cuda::measure(name, geometry, layout, 64, &shape)?);
                    }
                }
            }
        }
    }
    progress.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&figures)?);
        return Ok(());
    }
    println!(
        "geometry      layout             engine  direction  page   item B   run KiB     GB/s   bulk GB/s  ratio  layer 0 / \
         blocks kernel"
    );
    for figure in &figures {
        println!(
            "{:<13} {:<18} {:<7} {:<10} {:>4} {:>8} {:>9.1} {:>8.2} {:>11.2} {:>6.2}  {}",
            figure.geometry,
            // page_unified with several head groups: `page_unified/4`
            if figure.head_groups > 1 {
                format!("{}/{}", figure.layout, figure.head_groups)
            } else {
                figure.layout.clone()
            },
            figure.io_backend,
            figure.direction,
            figure.page_size,
            figure.item_bytes,
            figure.run_bytes / 1024.0,
            figure.gbps,
            figure.bulk_gbps,
            figure.ratio,
            figure.first_layer_us.map_or_else(String::new, |us| format!("{us:.0} µs"))
                + &figure.blocks.map_or_else(String::new, |blocks| format!(" / {blocks}"))
                + &figure.kernel.map_or_else(String::new, |kernel| format!(" {kernel}"))
                + &figure.device_pool.map_or_else(String::new, |pool| format!(" {pool}"))
        );
    }
    Ok(())
}

/// The head groups of a page of `geometry` under `layout`: the heads / `head_group` for an MHA page-unified pool, else
/// one.
fn head_groups(geometry: &KvGeometry, layout: HostLayout, head_group: Option<usize>) -> anyhow::Result<usize> {
    match (layout, geometry.attention, head_group) {
        (HostLayout::PageUnified, Attention::Mha { kv_heads, .. }, Some(group)) => {
            if group == 0 || !kv_heads.is_multiple_of(group) {
                bail!(Usage(format!("--head-group {group} does not divide the geometry's {kv_heads} KV heads")));
            }
            Ok(kv_heads / group)
        }
        _ => Ok(1),
    }
}

/// Load and write figures of one geometry, layout (with its head groups) and page size on the CPU engine.
fn measure(
    name: &'static str,
    geometry: KvGeometry,
    (layout, head_groups): (HostLayout, usize),
    page: usize,
    tokens: usize,
    rounds: usize,
    placement: Placement,
) -> anyhow::Result<Vec<TransferFigure>> {
    let pages = tokens / page;
    // the pools hold twice the transfer, so the pages can be scattered
    let device_pages = 2 * pages;
    let mut engine = CpuEngine::new(
        DeviceLayoutMap::new(geometry, device_pages * page)?,
        HostLayoutMap::new(geometry, layout, page, 2 * pages)?.with_head_groups(head_groups)?,
        Completion::Immediate,
    )?;
    engine.with_device(|bytes| bytes.iter_mut().enumerate().for_each(|(index, byte)| *byte = index as u8));
    let (host_pages, slots) = place(placement, pages, engine.host_memory().allocator()?, page, &mut rand::rng())?;
    let host_pages = &host_pages[..];
    let run_bytes = mean_run_bytes(&engine.host_map(), &engine.device_map(), host_pages, &slots);
    let bytes = (tokens * geometry.bytes_per_token()) as f64;
    let mut best = [0f64; 2];
    let mut first_layer = f64::MAX;
    for _ in 0..rounds {
        let start = engine.start_event()?;
        let began = Instant::now();
        engine.write_to_host(&slots, host_pages, &start)?.wait()?;
        best[0] = best[0].max(bytes / began.elapsed().as_secs_f64() / 1e9);
        let start = engine.start_event()?;
        let began = Instant::now();
        let mut last = None;
        for layer in 0..geometry.layers {
            let event = engine.load_layer(layer, host_pages, &slots, &start)?;
            if layer == 0 {
                event.wait()?;
                first_layer = first_layer.min(began.elapsed().as_secs_f64() * 1e6);
            }
            last = Some(event);
        }
        last.expect("at least one layer").wait()?;
        best[1] = best[1].max(bytes / began.elapsed().as_secs_f64() / 1e9);
    }
    let bulk = bulk_gbps(&engine, bytes as usize, rounds);
    let figure = |direction, gbps: f64, first_layer_us| TransferFigure {
        geometry: name,
        layout: layout.name().to_owned(),
        head_groups,
        io_backend: "cpu",
        direction,
        page_size: page,
        item_bytes: geometry.item_bytes(),
        gbps,
        bulk_gbps: bulk,
        ratio: gbps / bulk,
        first_layer_us,
        submit_us: None,
        placement: placement_name(placement),
        run_bytes,
        blocks: None,
        kernel: None,
        device_pool: None,
    };
    Ok(vec![figure("write", best[0], None), figure("load", best[1], Some(first_layer))])
}

/// One contiguous copy of `bytes` from the device buffer to the host buffer: the reference.
fn bulk_gbps(engine: &CpuEngine, bytes: usize, rounds: usize) -> f64 {
    let source: Vec<u8> = engine.with_device(|device| device[..bytes].to_vec());
    let mut best = 0f64;
    for _ in 0..rounds {
        engine.with_host(|host| {
            let began = Instant::now();
            host[..bytes].copy_from_slice(&source);
            std::hint::black_box(&host[..bytes]);
            best = best.max(bytes as f64 / began.elapsed().as_secs_f64() / 1e9);
        });
    }
    best
}
