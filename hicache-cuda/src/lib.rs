//! The CUDA side of hicache: the GPU's device KV pool, the pinned host pool, the transfer kernel (compiled at run
//! time by NVRTC for the GPU's architecture) and the engine that implements the core's `TransferEngine`, so the
//! controller and the prefix tree run unchanged on a GPU.
//!
//! Built on cudarc with dynamic loading: the crate builds and its tests compile on machines without CUDA, and
//! opening a device there is an error that says what is missing. GPU tests are `#[ignore = "needs a CUDA GPU"]`; run
//! them on a GPU machine with `--include-ignored` (`docs/gpu.md` says how).

mod collective;
mod device;
mod driver;
mod engine;
mod kernels;
mod pool;
mod sizing;
mod stream;

pub use collective::{Bootstrap, NcclGroup, NcclSettings, nccl_present};
pub use device::{Device, driver_present, nvrtc_present};
pub use driver::{BulkDirection, DeviceBuffer, DriverError, PinnedBuffer};
pub use engine::{
    AutoMinRun, CopyKernel, CudaEngine, CudaTransferEvent, DEFAULT_AUTO_MIN_RUN, LaunchShape, TmaShape, wait_layer_on,
};
pub use kernels::{TmaPlan, TransferKernel};
pub use pool::DevicePool;
pub use sizing::{HOST_RESERVE_BYTES, available_memory, host_pool_tokens};
pub use stream::StreamHandle;
