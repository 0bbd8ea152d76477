//! The GPU: driver and compiler presence, and the context (the pools' memory is in `driver.rs`).
//!
//! Everything here goes through cudarc with dynamic loading, so the crate builds and its unit tests run on machines
//! without CUDA; opening a device there is an [`Error::Device`] naming what is missing, never a panic (cudarc panics
//! when a library or symbol is missing, so presence is checked first).

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use hicache_core::Error;

use crate::driver::driver;

/// Whether the CUDA driver library can be loaded here.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library and reports whether that worked.
    unsafe { sys::is_culib_present() }
}

/// Whether NVRTC (the run-time compiler) can be loaded here.
pub fn nvrtc_present() -> bool {
    // SAFETY: as `driver_present`, for the NVRTC library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// One GPU: its primary context (shared with any other user of the GPU in the process, such as PyTorch).
#[derive(Debug, Clone)]
pub struct Device {
    context: Arc<CudaContext>,
}

impl Device {
    /// Opens GPU `ordinal`.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the driver or NVRTC cannot be loaded, there is no such GPU, or the context fails.
    pub fn open(ordinal: usize) -> Result<Self, Error> {
        if !driver_present() {
            return Err(Error::device(
                "open",
                "the CUDA driver (libcuda.so) cannot be loaded: no NVIDIA driver on this machine",
            ));
        }
        if !nvrtc_present() {
            return Err(Error::device(
                "open",
                "NVRTC (libnvrtc.so) cannot be loaded: add the CUDA toolkit's lib directory to \
                          LD_LIBRARY_PATH",
            ));
        }
        let count = CudaContext::device_count().map_err(driver("count devices"))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::device("open", format!("GPU {ordinal} asked for, {count} present")));
        }
        let context = CudaContext::new(ordinal).map_err(driver("create the context"))?;
        // the engine orders its streams with its own events; cudarc's per-allocation tracking would add more
        // SAFETY: no cudarc allocation of this context exists yet whose tracking could be left half-done.
        unsafe { context.disable_event_tracking() };
        Ok(Self { context })
    }

    /// The context (the GPU's primary context, which an engine's own CUDA code shares).
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.context.ordinal()
    }

    /// Waits until all work on the GPU in this context has finished.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when some of it failed, or the driver did.
    pub fn synchronize(&self) -> Result<(), Error> {
        self.context.synchronize().map_err(driver("synchronise the device"))
    }

    /// The GPU's name.
    ///
    /// # Errors
    ///
    /// The driver's.
    pub fn name(&self) -> Result<String, Error> {
        self.context.name().map_err(driver("name"))
    }

    /// Compute capability (major, minor).
    ///
    /// # Errors
    ///
    /// The driver's.
    pub fn compute_capability(&self) -> Result<(i32, i32), Error> {
        self.context.compute_capability().map_err(driver("compute capability"))
    }

    /// Multiprocessors.
    ///
    /// # Errors
    ///
    /// The driver's.
    pub fn multiprocessors(&self) -> Result<usize, Error> {
        self.context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map(|count| count as usize)
            .map_err(driver("multiprocessor count"))
    }
}
