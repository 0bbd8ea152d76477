//! `hicache bench transfer --engine cuda`: the CUDA engine's kernel next to one bulk pinned `cuMemcpyAsync` of the
//! same bytes, measured on the same streams in the same run.

use std::time::Instant;

use anyhow::Context as _;
use hicache_core::geometry::KvGeometry;
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::transfer::{DeviceLayoutMap, TransferEngine, TransferEvent};
use hicache_cuda::{BulkDirection, CopyKernel, CudaEngine, Device, LaunchShape, TmaShape};

use hicache_core::config::IoBackend;

use super::bench_transfer::{CopyKernelArg, IoBackendArg, TransferFigure};

/// How one GPU measurement runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) tokens: usize,
    pub(crate) rounds: usize,
    pub(crate) blocks: u32,
    pub(crate) threads: u32,
    pub(crate) backend: IoBackendArg,
    /// The kernel; `None`: the engine's default.
    pub(crate) kernel: Option<CopyKernelArg>,
    /// One slab, or an allocation per layer and part.
    pub(crate) device_pool: super::bench_transfer::DevicePoolArg,
    pub(crate) tma_shared: Option<usize>,
    pub(crate) tma_piece: Option<usize>,
    pub(crate) auto_min_run: super::bench_transfer::AutoMinRunArgs,
    pub(crate) placement: super::placement::Placement,
    /// Head groups per host page (page_unified).
    pub(crate) head_groups: usize,
}

/// Write and load figures of one geometry, layout, page size, io backend and block quota on GPU 0.
pub(crate) fn measure(
    name: &'static str,
    geometry: KvGeometry,
    layout: HostLayout,
    page: usize,
    shape: &Shape,
) -> anyhow::Result<Vec<TransferFigure>> {
    let Shape {
        tokens,
        rounds,
        blocks,
        threads,
        backend,
        kernel,
        device_pool,
        tma_shared,
        tma_piece,
        auto_min_run,
        placement,
        head_groups,
    } = *shape;
    let device = Device::open(0)?;
    let pages = tokens / page;
    let device_pages = 2 * pages;
    let device_map = DeviceLayoutMap::new(geometry, device_pages * page)?;
    let host_map = HostLayoutMap::new(geometry, layout, page, 2 * pages)?.with_head_groups(head_groups)?;
    let mut engine = match device_pool {
        super::bench_transfer::DevicePoolArg::Slab => CudaEngine::new(&device, device_map, host_map)?,
        super::bench_transfer::DevicePoolArg::PerLayer => CudaEngine::with_device_regions(
            &device,
            device_map,
            hicache_cuda::DevicePool::zeroed_per_layer(&device, &device_map)?,
            std::sync::Arc::new(hicache_core::host_memory::HostMemory::anonymous(host_map)?),
        )?,
    };
    engine.set_launch_shape(LaunchShape { blocks, threads })?;
    match kernel {
        Some(CopyKernelArg::Warp) => engine.set_copy_kernel(CopyKernel::Warp)?,
        Some(CopyKernelArg::Tma) => engine.set_copy_kernel(CopyKernel::Tma)?,
        None => {}
    }
    let defaults = TmaShape::default();
    engine.set_tma_shape(TmaShape {
        shared_bytes: tma_shared.unwrap_or(defaults.shared_bytes),
        max_piece: tma_piece.unwrap_or(defaults.max_piece),
    })?;
    let kernel_name = match engine.copy_kernel() {
        CopyKernel::Warp => "warp",
        CopyKernel::Tma => "tma",
    };
    let (io_backend, io_name) = match backend {
        IoBackendArg::Kernel => (IoBackend::Kernel, "kernel"),
        IoBackendArg::Direct => (IoBackend::Direct, "direct"),
        IoBackendArg::Auto => (IoBackend::Auto, "auto"),
        IoBackendArg::Batch => (IoBackend::Batch, "batch"),
    };
    let auto_min_run = match auto_min_run {
        (None, None) => None,
        (write, load) => Some(hicache_cuda::AutoMinRun {
            write: write.unwrap_or(hicache_cuda::DEFAULT_AUTO_MIN_RUN),
            load: load.unwrap_or(hicache_cuda::DEFAULT_AUTO_MIN_RUN),
        }),
    };
    engine.set_io_backend(io_backend, auto_min_run)?;
    let (host_pages, slots) =
        super::placement::place(placement, pages, engine.host_memory().allocator()?, page, &mut rand::rng())?;
    let host_pages = &host_pages[..];
    let run_bytes = super::placement::mean_run_bytes(&engine.host_map(), &engine.device_map(), host_pages, &slots);
    let bytes = tokens * geometry.bytes_per_token();
    let mut best = [0f64; 2];
    let mut first_layer = f64::MAX;
    let mut submit = f64::MAX;
    for round in 0..=rounds {
        let start = engine.start_event()?;
        let began = Instant::now();
        engine.write_to_host(&slots, host_pages, &start)?.wait()?;
        let write = bytes as f64 / began.elapsed().as_secs_f64() / 1e9;
        let start = engine.start_event()?;
        let began = Instant::now();
        let events = engine.load_layers(geometry.layers, host_pages, &slots, &start)?;
        let submitted = began.elapsed().as_secs_f64() * 1e6;
        events[0].wait()?;
        let layer_zero = began.elapsed().as_secs_f64() * 1e6;
        events.last().context("at least one layer")?.wait()?;
        let load = bytes as f64 / began.elapsed().as_secs_f64() / 1e9;
        // the first round warms up (kernel load, page tables) and does not count
        if round > 0 {
            best = [best[0].max(write), best[1].max(load)];
            first_layer = first_layer.min(layer_zero);
            submit = submit.min(submitted);
        }
    }
    let bulk = bulk_gbps(&engine, bytes, rounds)?;
    let figure = |direction, gbps: f64, bulk: f64, first_layer_us: Option<f64>| TransferFigure {
        geometry: name,
        layout: layout.name().to_owned(),
        head_groups,
        io_backend: io_name,
        direction,
        page_size: page,
        item_bytes: geometry.item_bytes(),
        gbps,
        bulk_gbps: bulk,
        ratio: gbps / bulk,
        first_layer_us,
        submit_us: first_layer_us.map(|_| submit),
        placement: super::bench_transfer::placement_name(placement),
        run_bytes,
        blocks: Some(blocks),
        kernel: (backend != IoBackendArg::Direct && backend != IoBackendArg::Batch).then_some(kernel_name),
        device_pool: Some(match device_pool {
            super::bench_transfer::DevicePoolArg::Slab => "slab",
            super::bench_transfer::DevicePoolArg::PerLayer => "per-layer",
        }),
    };
    Ok(vec![figure("write", best[0], bulk[0], None), figure("load", best[1], bulk[1], Some(first_layer))])
}

/// One contiguous `cuMemcpyAsync` of `bytes` between the pinned host pool and one device allocation of that size
/// (the pool may be regions per layer), each way: [device → host, host → device] GB/s, best of `rounds`.
fn bulk_gbps(engine: &CudaEngine, bytes: usize, rounds: usize) -> anyhow::Result<[f64; 2]> {
    let scratch = hicache_cuda::DeviceBuffer::zeroed(engine.device(), bytes)?;
    let mut best = [0f64; 2];
    for round in 0..=rounds {
        for (index, direction) in [BulkDirection::DeviceToHost, BulkDirection::HostToDevice].into_iter().enumerate() {
            let began = Instant::now();
            engine.bulk_copy(&scratch, bytes, direction).context("bulk copy")?;
            if round > 0 {
                best[index] = best[index].max(bytes as f64 / began.elapsed().as_secs_f64() / 1e9);
            }
        }
    }
    Ok(best)
}
