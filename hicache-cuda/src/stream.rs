//! CUDA streams as an engine lends them: the driver's handle (`CUstream`) behind a small newtype, so an engine need
//! not share hicache's CUDA bindings (or use Rust's at all) to order its kernels against hicache's transfers.

use std::ffi::c_void;

use cudarc::driver::sys;

/// A CUDA stream named by its driver handle (`CUstream`): an engine's compute stream lent to hicache
/// ([`CudaEngine::set_caller_stream`](crate::CudaEngine::set_caller_stream),
/// [`CudaTransferEvent::make_wait`](crate::CudaTransferEvent::make_wait), [`wait_layer_on`](crate::wait_layer_on)),
/// or one of hicache's own streams handed out ([`CudaEngine::streams`](crate::CudaEngine::streams)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamHandle(usize);

impl StreamHandle {
    /// The stream whose driver handle is `raw` (PyTorch's `torch.cuda.current_stream().cuda_stream`, cudarc's
    /// `CudaStream::cu_stream()`, a C++ engine's `cudaStream_t`). A null handle is the context's legacy default
    /// stream.
    ///
    /// # Safety
    ///
    /// `raw` is a stream of the primary context of the GPU hicache's engine runs on, and it stays alive as long as
    /// hicache may use it: for a caller stream, until another is set or the engine is dropped; for a wait, until
    /// the call returns.
    pub unsafe fn from_raw(raw: *mut c_void) -> Self {
        Self(raw as usize)
    }

    /// The driver handle.
    pub fn as_raw(self) -> *mut c_void {
        self.0 as *mut c_void
    }

    /// A handle of one of hicache's own streams (alive while the engine that made it is).
    pub(crate) fn from_raw_unchecked(raw: sys::CUstream) -> Self {
        Self(raw as usize)
    }

    pub(crate) fn cu_stream(self) -> sys::CUstream {
        self.0 as sys::CUstream
    }
}
