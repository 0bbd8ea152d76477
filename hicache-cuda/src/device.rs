//! The GPU: driver and compiler presence, the context, and the two pools' memory.
//!
//! Everything here goes through cudarc with dynamic loading, so the crate builds and its unit tests run on machines
//! without CUDA; opening a device there is an [`Error::Device`] naming what is missing, never a panic (cudarc panics
//! when a library or symbol is missing, so presence is checked first).

use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};
use hicache_core::Error;
use hicache_core::host_memory::HostMemory;

/// A CUDA driver call's failure: the `CUresult` code and its name. It is the [`Error::cause`] of the device errors
/// driver calls produce, so an engine can tell out-of-memory (2) from an illegal address (700) without cudarc:
/// `error.cause().and_then(|cause| cause.downcast_ref::<DriverError>())`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("CUDA driver error {code} ({name})")]
pub struct DriverError {
    /// The `CUresult` value.
    pub code: u32,
    /// Its name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
    pub name: String,
}

impl From<result::DriverError> for DriverError {
    fn from(error: result::DriverError) -> Self {
        // the enum's own name: no driver call (cuGetErrorName) needed, so this works where the driver is gone
        Self { code: error.0 as u32, name: format!("{:?}", error.0) }
    }
}

/// Turns a driver error into the core's error, the driver's code kept as its cause.
pub(crate) fn driver(operation: &'static str) -> impl FnOnce(result::DriverError) -> Error {
    move |error| driver_error(operation, String::new(), error)
}

/// A device error for `operation` (`detail` before the driver's words, if any) caused by `error`.
pub(crate) fn driver_error(operation: &'static str, detail: String, error: result::DriverError) -> Error {
    let error = DriverError::from(error);
    let message = if detail.is_empty() { error.name.clone() } else { format!("{detail}: {}", error.name) };
    Error::device_caused(operation, message, hicache_core::Cause::new(error))
}

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

/// Device memory of the KV pool: one allocation, laid out as the core's `DeviceLayoutMap` (`[layer][part][slot]
/// [item]`).
#[derive(Debug)]
pub struct DeviceBuffer {
    context: Arc<CudaContext>,
    pointer: sys::CUdeviceptr,
    bytes: usize,
    owned: bool,
}

// SAFETY: the buffer is a device address owned by this value (or, for a borrowed one, by the caller for its whole
// life); using it from another thread only needs the context bound there, which every method does.
unsafe impl Send for DeviceBuffer {}
// SAFETY: as Send; methods take `&self` only to read the address and size.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `bytes` of device memory, zeroed.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the GPU lacks the memory (the message says how much was asked for).
    pub fn zeroed(device: &Device, bytes: usize) -> Result<Self, Error> {
        let context = device.context().clone();
        context.bind_to_thread().map_err(driver("bind the context"))?;
        // SAFETY: a plain allocation of `bytes`; the pointer is freed once, in Drop.
        let pointer = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|error| driver_error("allocate the device pool", format!("{bytes} bytes"), error))?;
        // SAFETY: `pointer` is `bytes` long, just allocated.
        unsafe { result::memset_d8_sync(pointer, 0, bytes) }.map_err(driver("zero the device pool"))?;
        Ok(Self { context, pointer, bytes, owned: true })
    }

    /// A pool over device memory owned by someone else (an engine's KV tensors, say).
    ///
    /// # Safety
    ///
    /// `pointer` must be a device allocation of at least `bytes` in `device`'s context, laid out as the core's
    /// `DeviceLayoutMap` for the geometry it is used with, and stay allocated, and not be freed or reallocated,
    /// for as long as this value and every transfer submitted on it live. The owner may write it concurrently only
    /// at slots no transfer in flight uses.
    pub unsafe fn borrowed(device: &Device, pointer: u64, bytes: usize) -> Self {
        Self { context: device.context().clone(), pointer, bytes, owned: false }
    }

    /// The device address.
    pub fn pointer(&self) -> u64 {
        self.pointer
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copies `data` to the buffer at `offset` (tests and set-up; synchronous).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] beyond the end; the driver's.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), Error> {
        self.check(offset, data.len())?;
        self.context.bind_to_thread().map_err(driver("bind the context"))?;
        // SAFETY: the range is inside the allocation (checked above); the source is a live slice.
        unsafe { result::memcpy_htod_sync(self.pointer + offset as u64, data) }.map_err(driver("copy to the device"))
    }

    /// Copies the buffer at `offset` into `out` (tests; synchronous).
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), Error> {
        self.check(offset, out.len())?;
        self.context.bind_to_thread().map_err(driver("bind the context"))?;
        // SAFETY: as `write`, the other way.
        unsafe { result::memcpy_dtoh_sync(out, self.pointer + offset as u64) }.map_err(driver("copy from the device"))
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), Error> {
        if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(Error::InvalidArgument {
                field: "offset",
                reason: format!("{len} bytes at {offset} run past the device pool's {}", self.bytes),
            });
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.owned && self.context.bind_to_thread().is_ok() {
            // SAFETY: allocated by `zeroed` and freed only here; transfers keep the engine (and so this) alive.
            let _ = unsafe { result::free_sync(self.pointer) };
        }
    }
}

/// The host pool's memory ([`HostMemory`], allocated by the core: anonymous or in shared memory) page-locked in
/// place with `cuMemHostRegister`: portable and mapped into the device's address space, and *not* write-combined,
/// because the storage tier's threads read it. Registering in place (rather than allocating with `cuMemHostAlloc`)
/// is what lets one set of bytes be the GPU's copy source and destination, the storage backends' registered
/// buffer, and a shared-memory file another process maps (3FS's agent). Unregistered when dropped, before the
/// memory can be unmapped (this value holds it).
///
/// It gives no access to the bytes: they are reached only through the [`HostMemory`]'s page leases, which exclude a
/// reader and a writer of the same page (and the transfers wait for the leases). There is no safe raw write or read:
///
/// ```compile_fail
/// fn poke(pinned: &hicache_cuda::PinnedBuffer) {
///     pinned.write(0, &[1u8]);
/// }
/// ```
#[derive(Debug)]
pub struct PinnedBuffer {
    context: Arc<CudaContext>,
    memory: Arc<HostMemory>,
    device: sys::CUdeviceptr,
}

impl PinnedBuffer {
    /// Pins `memory` and maps it for the device.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the machine cannot pin that much (the message says how much was asked for).
    pub fn register(device: &Device, memory: Arc<HostMemory>) -> Result<Self, Error> {
        let context = device.context().clone();
        context.bind_to_thread().map_err(driver("bind the context"))?;
        let bytes = memory.map().total_bytes();
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the range is the whole mapping of `memory` (page-aligned, `bytes` long), which this value keeps
        // alive (an `Arc`) until Drop unregisters it; registering only pins and maps the pages.
        unsafe { sys::cuMemHostRegister_v2(memory.as_ptr().cast(), bytes, flags) }.result().map_err(|error| {
            driver_error("pin the host pool", format!("{bytes} bytes ({:.1} GB)", bytes as f64 / 1e9), error)
        })?;
        let mut mapped: sys::CUdeviceptr = 0;
        // SAFETY: the range was registered with DEVICEMAP in this context just above; the driver writes the address.
        let got = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut mapped, memory.as_ptr().cast(), 0) }.result();
        if let Err(error) = got {
            // SAFETY: registered above and not yet shared.
            let _ = unsafe { sys::cuMemHostUnregister(memory.as_ptr().cast()) };
            return Err(driver("map the host pool")(error));
        }
        Ok(Self { context, memory, device: mapped })
    }

    /// The address kernels use.
    pub fn device_pointer(&self) -> u64 {
        self.device
    }

    /// The memory pinned: its bytes are reached through its leases.
    pub fn memory(&self) -> &Arc<HostMemory> {
        &self.memory
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.memory.map().total_bytes()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: registered by `register` and unregistered only here; the engine that copies through the device
            // pointer holds this value, so no copy is in flight.
            let _ = unsafe { sys::cuMemHostUnregister(self.memory.as_ptr().cast()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_error_keeps_its_code_as_the_cause_without_a_driver() {
        let failed = result::DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let error = driver_error("allocate the device pool", "1024 bytes".into(), failed);
        assert_eq!(error.kind(), hicache_core::ErrorKind::Device);
        assert_eq!(error.to_string(), "device: allocate the device pool: 1024 bytes: CUDA_ERROR_OUT_OF_MEMORY");
        let cause = error.cause().and_then(|cause| cause.downcast_ref::<DriverError>()).expect("the driver's error");
        assert_eq!(cause.code, 2, "CUDA_ERROR_OUT_OF_MEMORY is 2 in cuda.h");
        assert_eq!(cause.name, "CUDA_ERROR_OUT_OF_MEMORY");
        let illegal = driver("synchronise")(result::DriverError(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
        assert_eq!(illegal.cause().and_then(|cause| cause.downcast_ref::<DriverError>()).map(|d| d.code), Some(700));
    }
}
