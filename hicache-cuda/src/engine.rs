//! The CUDA transfer engine: the core's `TransferEngine` on a GPU, so the controller runs unchanged there.
//!
//! Host writes run on a write stream, layer loads on a load stream; each waits on a start event recorded on the
//! caller's stream (the engine's own, or an engine's stream it was given), so a transfer starts only after the work
//! the caller submitted before it. A transfer's index arrays live in stream-ordered device memory from the engine's
//! own pool (which keeps freed memory for the next transfer), freed on the same stream after the kernel, so they
//! outlive it without the CPU waiting. Completion events are queried without blocking and waited on.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg as _};
use hicache_core::DeviceSlot;
use hicache_core::Error;
use hicache_core::config::IoBackend;
use hicache_core::host_memory::HostMemory;
use hicache_core::host_pool::HostPageId;
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::transfer::{DeviceLayoutMap, TransferEngine, TransferEvent};

use crate::device::Device;
use crate::driver::{self, BulkDirection, DeviceBuffer, IndexPool, PinnedBuffer, driver};
use crate::kernels::TransferKernel;
use crate::pool::DevicePool;
use crate::stream::StreamHandle;

/// How the kernel is launched: its grid is at most `blocks` blocks of `threads` threads (SGLang's block quota), so
/// transfers leave most SMs to the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    /// Most blocks of one launch.
    pub blocks: u32,
    /// Threads per block (a multiple of 32).
    pub threads: u32,
}

impl Default for LaunchShape {
    fn default() -> Self {
        Self { blocks: 64, threads: 512 }
    }
}

/// Which kernel moves the items the copy engine does not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKernel {
    /// Warps load and store through registers: any GPU, any item size ([`LaunchShape`] sets its grid).
    Warp,
    /// Hopper's Tensor Memory Accelerator moves items through shared memory (sm_90 and later, items a multiple of
    /// 16 bytes, 16-byte aligned pools; the warp kernel otherwise): one warp per block, `LaunchShape::blocks` of
    /// them at most, each block a single SM's worth of shared memory ([`TmaShape`]).
    Tma,
}

/// The TMA kernel's shared memory per block and its largest piece of an item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaShape {
    /// Dynamic shared memory of one block, at most (capped by the device's per-block limit).
    pub shared_bytes: usize,
    /// Items longer than this are moved in pieces (a piece is also at most half a lane's share of the block).
    pub max_piece: usize,
}

impl Default for TmaShape {
    fn default() -> Self {
        Self { shared_bytes: 192 << 10, max_piece: 1 << 20 }
    }
}

/// Events that keep their completion time (cudarc's default disables timing, which is cheaper): the start events and
/// a load's last layer, whose difference is the load's duration on the device.
const TIMED: cudarc::driver::sys::CUevent_flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;

/// A completion event of the CUDA engine.
#[derive(Clone, Debug)]
pub struct CudaTransferEvent {
    event: Arc<CudaEvent>,
}

impl CudaTransferEvent {
    /// Makes `stream` wait for this transfer without blocking the CPU: work queued on `stream` after this call runs
    /// once the transfer is done.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] from the driver.
    pub fn make_wait(&self, stream: StreamHandle) -> Result<(), Error> {
        driver::wait_on(stream, &self.event).map_err(driver("make a stream wait for a transfer"))
    }
}

/// The forward pass's wait for layer `layer` of the consumer's load, on the GPU: `stream` (the model's) waits on the
/// layer's event, and the CPU goes on (SGLang's `wait_until` hook). Nothing to wait for without a consumer.
///
/// # Errors
///
/// [`Error::Device`] from the driver.
pub fn wait_layer_on(
    counter: &hicache_core::transfer::LayerDoneCounter<CudaTransferEvent>,
    layer: usize,
    stream: StreamHandle,
) -> Result<(), Error> {
    match counter.consumer_event(layer) {
        Some(event) => event.make_wait(stream),
        None => Ok(()),
    }
}

impl TransferEvent for CudaTransferEvent {
    fn is_complete(&self) -> bool {
        self.event.is_complete()
    }

    fn seconds_since(&self, start: &Self) -> Option<f64> {
        // both events are timed where the engine records them so (start events, a load's last layer): others
        // answer CUDA_ERROR_INVALID_HANDLE
        start.event.elapsed_ms(&self.event).ok().map(|ms| f64::from(ms) / 1e3)
    }

    fn wait(&self) -> Result<(), Error> {
        // a failed transfer poisons the context: every later call reports the error too
        self.event.synchronize().map_err(driver("wait for a transfer"))
    }
}

/// The engine: the device pool, the pinned host pool, the kernel and the streams.
#[derive(Debug)]
pub struct CudaEngine {
    device: Device,
    kernel: TransferKernel,
    device_map: DeviceLayoutMap,
    host_map: HostLayoutMap,
    device_pool: Arc<DevicePool>,
    host_pool: Arc<PinnedBuffer>,
    caller: Caller,
    write_stream: Arc<CudaStream>,
    load_stream: Arc<CudaStream>,
    shape: LaunchShape,
    copy_kernel: CopyKernel,
    tma_shape: TmaShape,
    io_backend: IoBackend,
    auto_min_run: AutoMinRun,
    /// Whether copy-engine runs go out as one `cuMemcpyBatchAsync` (batch, and auto on CUDA 13 drivers).
    batched: bool,
    /// Where transfers' index arrays are allocated.
    index_pool: IndexPool,
}

/// The stream transfers are ordered after: the engine's own, or one an inference engine lent.
#[derive(Debug)]
enum Caller {
    Own(Arc<CudaStream>),
    Lent(StreamHandle),
}

/// A run of consecutive tokens that is contiguous in both pools for every layer and part: one copy-engine copy per
/// layer and part.
#[derive(Clone, Copy, Debug)]
struct Run {
    host_token: u32,
    slot: DeviceSlot,
    tokens: usize,
}

/// How one transfer is split: runs for the copy engine, the rest for the kernel.
#[derive(Debug, Default)]
struct Plan {
    runs: Vec<Run>,
    kernel_host: Vec<u32>,
    kernel_slots: Vec<DeviceSlot>,
}

/// Runs shorter than this go to the kernel under `auto` where the driver cannot batch copies (one `cuMemcpyAsync`
/// costs a few microseconds of engine time; 128 KiB pieces reached 23 GB/s on the H200, long ones the PCIe limit).
pub const DEFAULT_AUTO_MIN_RUN: usize = 1 << 20;

/// The shortest run (bytes of one layer and part) that `auto` gives the copy engine, per direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AutoMinRun {
    /// Host writes (device → host).
    pub write: usize,
    /// Loads (host → device).
    pub load: usize,
}

impl AutoMinRun {
    /// The same threshold both ways.
    pub const fn uniform(bytes: usize) -> Self {
        Self { write: bytes, load: bytes }
    }

    /// What the H200 measurements favour (the default): 1 MiB both ways, batched or not. Batching shorter runs
    /// raised scattered page-64 loads to 0.94–0.97 of bulk (kernel: 0.89–0.91), but the first layer of an
    /// 8192-token load then landed after 4.4 ms (page 64: 256 copies per layer) to 14.6 ms (page 16: 1024 copies
    /// per layer) instead of 0.9 ms; by that growth with the copy count, the driver spends ~0.45 µs of the calling
    /// thread per copy. Layer-by-layer overlap is worth more than the last 5%. Host writes: the kernel's 0.93–0.945
    /// beats batched 128 KiB pieces (0.78–0.83).
    pub const MEASURED: Self = Self::uniform(DEFAULT_AUTO_MIN_RUN);
}

impl Default for AutoMinRun {
    fn default() -> Self {
        Self::MEASURED
    }
}

impl CudaEngine {
    /// An engine over a new zeroed device pool of `device_map` and pinned host pool of `host_map` on `device`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the maps' geometries differ; [`Error::Device`] when memory, the kernel or the
    /// streams cannot be had.
    pub fn new(device: &Device, device_map: DeviceLayoutMap, host_map: HostLayoutMap) -> Result<Self, Error> {
        let device_pool = DeviceBuffer::zeroed(device, device_map.total_bytes())?;
        Self::with_device_pool(device, device_map, host_map, device_pool)
    }

    /// An engine sized from a config: a device pool of `device_tokens` (whole pages), a host pool of the config's
    /// `hicache_ratio` or `hicache_size` in the config's `mem_layout`, the config's `io_backend`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the field when the host pool would not exceed the device pool or would not
    /// fit in this machine's available memory (less SGLang's 10 GiB reserve), or the io backend is `batch`;
    /// [`Error::InvalidArgument`] naming `device_tokens` when the GPU lacks the memory; the device's errors.
    pub fn for_config(
        device: &Device,
        geometry: hicache_core::geometry::KvGeometry,
        device_tokens: usize,
        config: &hicache_core::config::HiCacheConfig,
    ) -> Result<Self, Error> {
        let config = config.clone().validated()?;
        let page = config.page_size;
        let device_tokens = device_tokens - device_tokens % page;
        let device_map = DeviceLayoutMap::new(geometry, device_tokens)?;
        let (free, _) = device.context().mem_get_info().map_err(driver("query the GPU's free memory"))?;
        if device_map.total_bytes() > free {
            return Err(Error::InvalidArgument {
                field: "device_tokens",
                reason: format!(
                    "{device_tokens} tokens need {:.1} GB of GPU memory; {:.1} GB is free",
                    device_map.total_bytes() as f64 / 1e9,
                    free as f64 / 1e9
                ),
            });
        }
        let host_tokens = crate::sizing::host_pool_tokens(
            &config,
            device_tokens,
            geometry.bytes_per_token(),
            crate::sizing::available_memory()?,
        )?;
        let host_map = HostLayoutMap::new(geometry, config.mem_layout, page, host_tokens / page)?
            .with_head_groups(config.head_groups(&geometry)?)?;
        let mut engine = Self::new(device, device_map, host_map)?;
        engine
            .set_io_backend(config.io_backend, None)
            .map_err(|error| Error::InvalidConfig { field: "io_backend".into(), reason: error.to_string() })?;
        Ok(engine)
    }

    /// An engine over an existing device pool (see [`DeviceBuffer::borrowed`]) and a new anonymous host pool.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), and [`Error::InvalidArgument`] when the pool is smaller than the map.
    pub fn with_device_pool(
        device: &Device,
        device_map: DeviceLayoutMap,
        host_map: HostLayoutMap,
        device_pool: DeviceBuffer,
    ) -> Result<Self, Error> {
        Self::with_pools(device, device_map, device_pool, Arc::new(HostMemory::anonymous(host_map)?))
    }

    /// An engine over an existing device pool and the caller's host memory (in shared memory, say), which it pins in
    /// place.
    ///
    /// # Errors
    ///
    /// As [`with_device_pool`](Self::with_device_pool).
    pub fn with_pools(
        device: &Device,
        device_map: DeviceLayoutMap,
        device_pool: DeviceBuffer,
        host: Arc<HostMemory>,
    ) -> Result<Self, Error> {
        let device_pool = DevicePool::slab(device, &device_map, device_pool)?;
        Self::with_device_regions(device, device_map, device_pool, host)
    }

    /// An engine over a device pool of any regions ([`DevicePool::per_layer`]: an engine's K and V tensor per layer)
    /// and the caller's host memory, which it pins in place.
    ///
    /// # Errors
    ///
    /// As [`with_device_pool`](Self::with_device_pool), and [`Error::InvalidArgument`] naming `device_regions` when
    /// the pool is not the map's size.
    pub fn with_device_regions(
        device: &Device,
        device_map: DeviceLayoutMap,
        device_pool: DevicePool,
        host: Arc<HostMemory>,
    ) -> Result<Self, Error> {
        let host_map = *host.map();
        if device_map.geometry() != host_map.geometry() {
            return Err(Error::InvalidArgument {
                field: "host_map",
                reason: "its geometry differs from the device pool's".into(),
            });
        }
        if device_pool.len() != device_map.total_bytes() {
            return Err(Error::InvalidArgument {
                field: "device_regions",
                reason: format!("{} bytes of regions, the map needs {}", device_pool.len(), device_map.total_bytes()),
            });
        }
        let host_pool = PinnedBuffer::register(device, host)?;
        let kernel = TransferKernel::load(device)?;
        let context = device.context();
        let caller = context.new_stream().map_err(driver("create a stream"))?;
        let write_stream = context.new_stream().map_err(driver("create a stream"))?;
        let load_stream = context.new_stream().map_err(driver("create a stream"))?;
        Ok(Self {
            device: device.clone(),
            copy_kernel: CopyKernel::Warp,
            kernel,
            device_map,
            host_map,
            device_pool: Arc::new(device_pool),
            host_pool: Arc::new(host_pool),
            caller: Caller::Own(caller),
            write_stream,
            load_stream,
            shape: LaunchShape::default(),
            tma_shape: TmaShape::default(),
            io_backend: IoBackend::Kernel,
            auto_min_run: AutoMinRun::uniform(DEFAULT_AUTO_MIN_RUN),
            batched: false,
            index_pool: IndexPool::new(device)?,
        })
    }

    /// Launches with at most `shape.blocks` blocks of `shape.threads` threads.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for zero blocks or threads that are not a positive multiple of 32 up to 1024.
    pub fn set_launch_shape(&mut self, shape: LaunchShape) -> Result<(), Error> {
        if shape.blocks == 0 || shape.threads == 0 || shape.threads > 1024 || !shape.threads.is_multiple_of(32) {
            return Err(Error::InvalidArgument {
                field: "launch_shape",
                reason: format!("{shape:?}: blocks ≥ 1, threads a multiple of 32 in [32, 1024]"),
            });
        }
        self.shape = shape;
        Ok(())
    }

    /// Which kernel moves items ([`CopyKernel::Warp`] by default).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `Tma` on a GPU before sm_90.
    pub fn set_copy_kernel(&mut self, kernel: CopyKernel) -> Result<(), Error> {
        if kernel == CopyKernel::Tma && self.kernel.tma().is_none() {
            let (major, minor) = self.device.compute_capability()?;
            return Err(Error::InvalidArgument {
                field: "copy_kernel",
                reason: format!("the TMA kernel needs sm_90 or later; this GPU is sm_{major}{minor}; use warp"),
            });
        }
        self.copy_kernel = kernel;
        Ok(())
    }

    /// The kernel that moves items.
    pub fn copy_kernel(&self) -> CopyKernel {
        self.copy_kernel
    }

    /// The TMA kernel's shared memory per block and largest piece.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when no two slots of 16 bytes per lane fit (`shared_bytes` below 2304) or
    /// `max_piece` is below 16.
    pub fn set_tma_shape(&mut self, shape: TmaShape) -> Result<(), Error> {
        if crate::kernels::TmaPlan::new(16, shape.shared_bytes, shape.max_piece).is_none() {
            return Err(Error::InvalidArgument {
                field: "tma_shape",
                reason: format!("{shape:?}: shared_bytes ≥ 2304 (two 16-byte slots per lane), max_piece ≥ 16"),
            });
        }
        self.tma_shape = shape;
        Ok(())
    }

    /// How transfers are issued: `kernel` (every item by the kernel), `direct` (one `cuMemcpyAsync` per maximal run
    /// contiguous in both pools, as SGLang's direct backend, after sorting by host token), `batch` (the same runs in
    /// one `cuMemcpyBatchAsync`; CUDA 13 drivers), or `auto` (runs of at least `auto_min_run` bytes to the copy
    /// engine, batched where the driver can, the rest to the kernel; `None`: [`AutoMinRun::MEASURED`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `batch` on a driver older than CUDA 13, or a zero threshold.
    pub fn set_io_backend(&mut self, backend: IoBackend, auto_min_run: Option<AutoMinRun>) -> Result<(), Error> {
        let version = driver::driver_version().map_err(driver("read the driver version"))?;
        let can_batch = version >= 13000;
        if backend == IoBackend::Batch && !can_batch {
            return Err(Error::InvalidArgument {
                field: "io_backend",
                reason: format!(
                    "batch needs cuMemcpyBatchAsync_v2, in CUDA 13 drivers; this driver is CUDA {}.{}; use kernel, \
                     direct or auto",
                    version / 1000,
                    version % 1000 / 10
                ),
            });
        }
        if backend != IoBackend::Kernel && self.host_map.head_groups() > 1 {
            return Err(Error::InvalidArgument {
                field: "io_backend",
                reason: format!(
                    "{backend}: the copy engine would move page_unified's {} head groups row by row ({} B each); use \
                     kernel",
                    self.host_map.head_groups(),
                    self.host_map.row_bytes()
                ),
            });
        }
        let batched = can_batch && matches!(backend, IoBackend::Batch | IoBackend::Auto);
        let auto_min_run = auto_min_run.unwrap_or_default();
        if auto_min_run.write == 0 || auto_min_run.load == 0 {
            return Err(Error::InvalidArgument { field: "auto_min_run", reason: "must be at least 1 byte".into() });
        }
        (self.io_backend, self.auto_min_run, self.batched) = (backend, auto_min_run, batched);
        Ok(())
    }

    /// Makes start events come from `stream` (an inference engine's compute stream), so transfers wait for its work.
    /// The stream must stay alive until another is set or the engine is dropped ([`StreamHandle::from_raw`]).
    pub fn set_caller_stream(&mut self, stream: StreamHandle) {
        self.caller = Caller::Lent(stream);
    }

    /// The GPU.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device pool.
    pub fn device_pool(&self) -> &DevicePool {
        &self.device_pool
    }

    /// The pinned host pool.
    pub fn host_pool(&self) -> &PinnedBuffer {
        &self.host_pool
    }

    /// The device pool's map.
    pub fn device_map(&self) -> DeviceLayoutMap {
        self.device_map
    }

    /// The host pool's map.
    pub fn host_map(&self) -> HostLayoutMap {
        self.host_map
    }

    /// The write and load streams (to time transfers, or to wait on them); they live as long as the engine.
    pub fn streams(&self) -> (StreamHandle, StreamHandle) {
        // the engine's own streams, of its device's primary context, alive while the engine is
        let handle = |stream: &CudaStream| StreamHandle::from_raw_unchecked(stream.cu_stream());
        (handle(&self.write_stream), handle(&self.load_stream))
    }

    /// One contiguous copy of `bytes` between the start of the pinned host pool and `scratch`, the way `direction`
    /// says, on the load stream, waited for: the bulk `cuMemcpyAsync` a transfer benchmark compares the engine's
    /// kernels with. The pool is leased for writing while the copy is queued; the caller has no transfer of this
    /// engine in flight (one would be waited for with the copy).
    ///
    /// # Errors
    ///
    /// As [`PinnedBuffer`]'s bounds and leases; [`Error::Device`] when the copy or the driver failed.
    pub fn bulk_copy(&self, scratch: &DeviceBuffer, bytes: usize, direction: BulkDirection) -> Result<(), Error> {
        let (_, load) = self.streams();
        self.host_pool.bulk_copy(scratch, bytes, direction, load)?;
        self.synchronize()
    }

    /// Waits until every transfer queued so far has finished (both streams).
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when a transfer failed or the driver did.
    pub fn synchronize(&self) -> Result<(), Error> {
        self.write_stream.synchronize().map_err(driver("wait for the write stream"))?;
        self.load_stream.synchronize().map_err(driver("wait for the load stream"))
    }

    fn check(&self, slots: &[DeviceSlot], pages: &[HostPageId]) -> Result<Vec<u32>, Error> {
        let page_size = self.host_map.page_size();
        if pages.len().checked_mul(page_size) != Some(slots.len()) {
            return Err(Error::InvalidArgument {
                field: "slots",
                reason: format!("{} device slots for {} host pages of {page_size} tokens", slots.len(), pages.len()),
            });
        }
        if let Some(&slot) = slots.iter().find(|&&slot| slot as usize >= self.device_map.slots()) {
            return Err(Error::InvalidArgument {
                field: "slots",
                reason: format!("device slot {slot} out of range ({} slots)", self.device_map.slots()),
            });
        }
        self.host_pool.memory().check_pages(pages)?;
        for (field, indices, bound) in [
            ("pages", pages.iter().map(|page| page.index()).collect::<Vec<_>>(), self.host_map.pages()),
            ("slots", slots.iter().map(|&slot| slot as usize).collect(), self.device_map.slots()),
        ] {
            let mut seen = vec![0u64; bound.div_ceil(64)];
            for index in indices {
                let (word, bit) = (index / 64, 1u64 << (index % 64));
                if seen[word] & bit != 0 {
                    return Err(Error::InvalidArgument { field, reason: format!("{index} is listed twice") });
                }
                seen[word] |= bit;
            }
        }
        Ok(pages
            .iter()
            .flat_map(|page| (0..page_size).map(move |offset| (page.index() * page_size + offset) as u32))
            .collect())
    }

    /// Uploads a transfer's index arrays (host tokens, then device slots) into stream-ordered memory on `stream`,
    /// after making the stream wait for `after`; `None` for an empty transfer.
    fn upload(
        &self,
        stream: &Arc<CudaStream>,
        host_tokens: &[u32],
        slots: &[DeviceSlot],
        after: &CudaTransferEvent,
    ) -> Result<Option<u64>, Error> {
        stream.wait(&after.event).map_err(driver("order the transfer after the caller"))?;
        if host_tokens.is_empty() {
            return Ok(None);
        }
        let mut indices = Vec::with_capacity(2 * host_tokens.len());
        indices.extend_from_slice(host_tokens);
        indices.extend_from_slice(slots);
        // a stream-ordered allocation on this stream, freed on it (by `release`) after the kernels that read it, so
        // it lives exactly as long as they need it
        let index = self.index_pool.alloc(indices.len() * 4, stream)?;
        // SAFETY: `index` was just allocated for `indices.len()` u32s.
        unsafe { driver::upload_async(index, &indices, stream) }.map_err(driver("upload the indices"))?;
        Ok(Some(index))
    }

    /// Splits a transfer between the copy engine and the kernel by the io backend (and, under `auto`, the
    /// direction's threshold).
    fn plan(&self, host_tokens: &[u32], slots: &[DeviceSlot], to_device: bool) -> Plan {
        if self.io_backend == IoBackend::Kernel {
            return Plan { runs: Vec::new(), kernel_host: host_tokens.to_vec(), kernel_slots: slots.to_vec() };
        }
        let item = self.device_map.geometry().item_bytes();
        let mut pairs: Vec<(u32, DeviceSlot)> = host_tokens.iter().copied().zip(slots.iter().copied()).collect();
        pairs.sort_unstable();
        // contiguity at layer 0 of the first part holds for every layer and part in every layout (the offsets are
        // affine in the token with the same stride for each)
        let first_part = self.device_map.geometry().parts()[0];
        let host = |token: u32| self.host_map.item_offset(token as usize, 0, first_part);
        let min_run = if to_device { self.auto_min_run.load } else { self.auto_min_run.write };
        let mut plan = Plan::default();
        let mut start = 0;
        for end in 1..=pairs.len() {
            let continues = end < pairs.len() && {
                let (previous, next) = (pairs[end - 1], pairs[end]);
                next.1 == previous.1 + 1 && host(next.0) == host(previous.0) + item
            };
            if continues {
                continue;
            }
            let tokens = end - start;
            if matches!(self.io_backend, IoBackend::Direct | IoBackend::Batch) || tokens * item >= min_run {
                plan.runs.push(Run { host_token: pairs[start].0, slot: pairs[start].1, tokens });
            } else {
                plan.kernel_host.extend(pairs[start..end].iter().map(|pair| pair.0));
                plan.kernel_slots.extend(pairs[start..end].iter().map(|pair| pair.1));
            }
            start = end;
        }
        plan
    }

    /// Queues the copy-engine part of a transfer: each run, for each of `layers` and each part; one
    /// `cuMemcpyAsync` each, or all of them in one `cuMemcpyBatchAsync` (`batch`, and `auto` on CUDA 13 drivers).
    fn copy_runs(
        &self,
        stream: &Arc<CudaStream>,
        runs: &[Run],
        layers: std::ops::Range<usize>,
        to_device: bool,
    ) -> Result<(), Error> {
        let geometry = self.device_map.geometry();
        let item = geometry.item_bytes();
        let parts = geometry.parts().len();
        let mut copies = Vec::with_capacity(runs.len() * layers.len() * parts);
        for layer in layers {
            for &part in geometry.parts() {
                for run in runs {
                    let device = self.device_pool.address(run.slot as usize, layer, part.index(), item);
                    let host = self.host_pool.device_pointer()
                        + self.host_map.item_offset(run.host_token as usize, layer, part) as u64;
                    let (to, from) = if to_device { (device, host) } else { (host, device) };
                    copies.push((to, from, run.tokens * item));
                }
            }
        }
        if self.batched {
            // SAFETY: as for the copies below; the driver is CUDA 13 or later (checked when the backend was chosen).
            return unsafe { driver::copy_batch_async(stream, &copies) }.map_err(driver("queue a batch of copies"));
        }
        for (to, from, bytes) in copies {
            // SAFETY: both ranges lie inside the pools (the run's tokens and slots were range-checked, and a run is
            // contiguous in both); the pools outlive the copy (the engine keeps them).
            unsafe { driver::copy_async(to, from, bytes, stream) }.map_err(driver("copy a run"))?;
        }
        Ok(())
    }

    /// Frees index arrays after everything queued on `stream` so far.
    fn release(stream: &Arc<CudaStream>, index: Option<u64>) -> Result<(), Error> {
        if let Some(index) = index {
            // SAFETY: allocated by `upload` on this stream and freed once, in stream order after its kernels.
            unsafe { IndexPool::free(index, stream) }.map_err(driver("free the index arrays"))?;
        }
        Ok(())
    }

    /// Launches the kernel for `tokens` tokens of `layers` on `stream`, reading the indices at `index`.
    fn launch(
        &self,
        stream: &Arc<CudaStream>,
        index: Option<u64>,
        tokens: usize,
        layers: std::ops::Range<usize>,
        to_device: bool,
    ) -> Result<(), Error> {
        let Some(index) = index else { return Ok(()) };
        let geometry = self.device_map.geometry();
        // the kernel's unit: an item, or one head group's row of it
        let (row, groups) = (self.host_map.row_bytes(), self.host_map.head_groups());
        let items = tokens * layers.len() * geometry.parts().len() * groups;
        let tma = self.tma_launch(items);
        let (function, config) = match tma {
            Some((function, plan)) => {
                let units = items * row.div_ceil(plan.piece_bytes as usize);
                let blocks = units.div_ceil(32).clamp(1, self.shape.blocks as usize) as u32;
                let config = LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (32, 1, 1),
                    shared_mem_bytes: plan.shared_bytes,
                };
                (function, config)
            }
            None => {
                let warps_per_block = (self.shape.threads / 32) as usize;
                let blocks = items.div_ceil(warps_per_block).clamp(1, self.shape.blocks as usize) as u32;
                let config = LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (self.shape.threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                (self.kernel.function(), config)
            }
        };
        let layout: u32 = match self.host_map.layout() {
            HostLayout::LayerFirst => 0,
            HostLayout::PageFirst => 1,
            HostLayout::PageFirstDirect => 2,
            HostLayout::PageUnified => 3,
        };
        let (device_bases, host_base) = (self.device_pool.table_pointer(), self.host_pool.device_pointer());
        let (host_index, slot_index) = (index, index + 4 * tokens as u64);
        let (tokens, first, count) = (tokens as u64, layers.start as u32, layers.len() as u32);
        let (parts, groups) = (geometry.parts().len() as u32, groups as u32);
        let item = row as u64;
        let (slot_count, token_count) = (self.device_map.slots() as u64, self.host_map.tokens() as u64);
        let (pages, page_size) = (self.host_map.pages() as u64, self.host_map.page_size() as u64);
        let total_layers = geometry.layers as u32;
        let direction = u32::from(to_device);
        let (piece, depth) = tma.map_or((0, 0), |(_, plan)| (plan.piece_bytes, plan.depth));
        let mut launch = stream.launch_builder(function);
        launch
            .arg(&device_bases)
            .arg(&host_base)
            .arg(&host_index)
            .arg(&slot_index)
            .arg(&tokens)
            .arg(&first)
            .arg(&count)
            .arg(&parts)
            .arg(&groups)
            .arg(&item)
            .arg(&slot_count)
            .arg(&token_count)
            .arg(&pages)
            .arg(&page_size)
            .arg(&total_layers)
            .arg(&layout)
            .arg(&direction);
        if tma.is_some() {
            launch.arg(&piece).arg(&depth);
        }
        // SAFETY: the arguments match the kernel's signature in order and type; every offset the kernel forms is
        // inside the pools (slots and host tokens were range-checked against the maps the pools were sized by); the
        // pools outlive the kernel (the engine keeps them), and the indices are freed after it in stream order.
        unsafe { launch.launch(config) }.map_err(driver("launch the transfer kernel"))?;
        Ok(())
    }

    /// The TMA kernel and its plan when it moves this engine's items: chosen, present, the items a multiple of 16
    /// bytes and both pools 16-byte aligned (a borrowed device pool may not be).
    fn tma_launch(&self, items: usize) -> Option<(&CudaFunction, crate::kernels::TmaPlan)> {
        if self.copy_kernel != CopyKernel::Tma || items == 0 {
            return None;
        }
        let (function, limit) = self.kernel.tma()?;
        let aligned = self.device_pool.aligned_16() && self.host_pool.device_pointer().is_multiple_of(16);
        let budget = self.tma_shape.shared_bytes.min(limit);
        let plan = crate::kernels::TmaPlan::new(self.host_map.row_bytes(), budget, self.tma_shape.max_piece)?;
        aligned.then_some((function, plan))
    }

    fn record(stream: &Arc<CudaStream>) -> Result<CudaTransferEvent, Error> {
        let event = stream.record_event(None).map_err(driver("record the transfer's event"))?;
        Ok(CudaTransferEvent { event: Arc::new(event) })
    }

    /// An event that keeps the time it completed (start events and a load's last layer: the cost model's loads).
    fn record_timed(stream: &Arc<CudaStream>) -> Result<CudaTransferEvent, Error> {
        let event = stream.record_event(Some(TIMED)).map_err(driver("record the transfer's event"))?;
        Ok(CudaTransferEvent { event: Arc::new(event) })
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        // transfers still queued read and write both pools and their index arrays (which go with the engine):
        // they finish before anything is released; a failure is the driver's to report, and it is logged
        if let Err(error) = self.synchronize() {
            tracing::warn!(%error, "a transfer failed while the CUDA engine was dropped");
        }
    }
}

impl TransferEngine for CudaEngine {
    type Event = CudaTransferEvent;

    fn host_memory(&self) -> Arc<HostMemory> {
        self.host_pool.memory().clone()
    }

    fn device_layout(&self) -> DeviceLayoutMap {
        self.device_map
    }

    fn times_loads(&self) -> bool {
        true
    }

    fn start_event(&mut self) -> Result<CudaTransferEvent, Error> {
        let event = match &self.caller {
            Caller::Own(stream) => stream.record_event(Some(TIMED)).map_err(driver("record a start event"))?,
            &Caller::Lent(stream) => {
                let event = self.device.context().new_event(Some(TIMED)).map_err(driver("create a start event"))?;
                driver::record_on(&event, stream).map_err(driver("record a start event on the caller's stream"))?;
                event
            }
        };
        Ok(CudaTransferEvent { event: Arc::new(event) })
    }

    fn write_to_host(
        &mut self,
        slots: &[DeviceSlot],
        pages: &[HostPageId],
        after: &CudaTransferEvent,
    ) -> Result<CudaTransferEvent, Error> {
        let host_tokens = self.check(slots, pages)?;
        let plan = self.plan(&host_tokens, slots, false);
        let stream = self.write_stream.clone();
        let layers = 0..self.device_map.geometry().layers;
        let index = self.upload(&stream, &plan.kernel_host, &plan.kernel_slots, after)?;
        self.copy_runs(&stream, &plan.runs, layers.clone(), false)?;
        self.launch(&stream, index, plan.kernel_host.len(), layers, false)?;
        Self::release(&stream, index)?;
        Self::record(&stream)
    }

    fn load_layer(
        &mut self,
        layer: usize,
        pages: &[HostPageId],
        slots: &[DeviceSlot],
        after: &CudaTransferEvent,
    ) -> Result<CudaTransferEvent, Error> {
        let mut events = self.load_range(layer..layer + 1, pages, slots, after)?;
        Ok(events.pop().expect("one layer"))
    }

    fn load_layers(
        &mut self,
        layers: usize,
        pages: &[HostPageId],
        slots: &[DeviceSlot],
        after: &CudaTransferEvent,
    ) -> Result<Vec<CudaTransferEvent>, Error> {
        self.load_range(0..layers, pages, slots, after)
    }
}

impl CudaEngine {
    /// Loads `layers` one kernel and one event per layer, with the indices checked and uploaded once.
    fn load_range(
        &mut self,
        layers: std::ops::Range<usize>,
        pages: &[HostPageId],
        slots: &[DeviceSlot],
        after: &CudaTransferEvent,
    ) -> Result<Vec<CudaTransferEvent>, Error> {
        let host_tokens = self.check(slots, pages)?;
        let total = self.device_map.geometry().layers;
        if layers.end > total || layers.is_empty() {
            return Err(Error::InvalidArgument {
                field: "layer",
                reason: format!("layers {layers:?} out of range ({total} layers)"),
            });
        }
        let plan = self.plan(&host_tokens, slots, true);
        let stream = self.load_stream.clone();
        let index = self.upload(&stream, &plan.kernel_host, &plan.kernel_slots, after)?;
        let mut events = Vec::with_capacity(layers.len());
        let last = layers.end - 1;
        for layer in layers {
            self.copy_runs(&stream, &plan.runs, layer..layer + 1, true)?;
            self.launch(&stream, index, plan.kernel_host.len(), layer..layer + 1, true)?;
            events.push(if layer == last { Self::record_timed(&stream)? } else { Self::record(&stream)? });
        }
        Self::release(&stream, index)?;
        Ok(events)
    }
}
