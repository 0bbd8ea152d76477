//! Every call into the CUDA driver that hicache makes itself, behind the types that own what it allocates
//! ([`DeviceBuffer`], [`PinnedBuffer`], [`IndexPool`]: released when dropped) and small functions whose contracts
//! say what memory a queued copy touches. The rest of the crate goes through cudarc's safe API (contexts, streams,
//! events, modules, launches) and these; NVRTC (`kernels.rs`) and NCCL (`collective.rs`) are other libraries, each
//! in its own module. A failed call keeps the driver's `CUresult` ([`DriverError`]) as the core error's cause.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result, sys};
use hicache_core::Error;
use hicache_core::host_memory::HostMemory;

use crate::device::Device;
use crate::stream::StreamHandle;

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

    /// One contiguous `cuMemcpyAsync` of `bytes` between the start of this pool and the start of `scratch`, the
    /// way `direction` says, queued on `stream` (the caller waits for it): the reference a transfer benchmark
    /// measures against. The whole pool is leased for writing while the copy is queued, so no storage thread holds
    /// a page of it then.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `bytes` runs past either buffer; [`Error::PageState`] when a page is lent;
    /// the driver's errors.
    pub(crate) fn bulk_copy(
        &self,
        scratch: &DeviceBuffer,
        bytes: usize,
        direction: BulkDirection,
        stream: StreamHandle,
    ) -> Result<(), Error> {
        if bytes > scratch.len() || bytes > self.len() {
            return Err(Error::InvalidArgument {
                field: "bytes",
                reason: format!("{bytes} bytes, the device buffer has {} and the pool {}", scratch.len(), self.len()),
            });
        }
        let _lease = self.memory.lend_write(&self.memory.all_pages())?;
        self.context.bind_to_thread().map_err(driver("bind the context"))?;
        let (to, from) = match direction {
            BulkDirection::DeviceToHost => (self.device, scratch.pointer()),
            BulkDirection::HostToDevice => (scratch.pointer(), self.device),
        };
        // SAFETY: both ranges are inside their allocations (checked above); the host pool is registered and mapped
        // in this context, and leased: no thread reaches its bytes while the lease is held.
        unsafe { sys::cuMemcpyAsync(to, from, bytes, stream.as_raw().cast()) }.result().map_err(driver("bulk copy"))
    }
}

/// Which way [`CudaEngine::bulk_copy`](crate::CudaEngine::bulk_copy) copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BulkDirection {
    /// From the device buffer into the host pool.
    DeviceToHost,
    /// From the host pool into the device buffer.
    HostToDevice,
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

/// The engine's own stream-ordered memory pool for index arrays. It keeps what is freed (release threshold: all)
/// instead of handing it back to the driver whenever a stream synchronises, as the device's default pool does
/// (threshold 0), so a transfer's allocation maps no fresh memory; private, so the process's default pool keeps its
/// settings.
#[derive(Debug)]
pub(crate) struct IndexPool {
    context: Arc<cudarc::driver::CudaContext>,
    pool: sys::CUmemoryPool,
}

// SAFETY: a memory pool handle may be used from any thread of its context (the driver synchronises it).
unsafe impl Send for IndexPool {}
// SAFETY: as Send.
unsafe impl Sync for IndexPool {}

impl IndexPool {
    pub(crate) fn new(device: &Device) -> Result<Self, Error> {
        let context = device.context().clone();
        context.bind_to_thread().map_err(driver("bind the context"))?;
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: i32::try_from(context.ordinal()).unwrap_or(i32::MAX),
            },
            win32SecurityAttributes: std::ptr::null_mut(),
            maxSize: 0,
            usage: 0,
            reserved: [0; 54],
        };
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `props` describes device memory of this context's GPU; the driver writes the new pool's handle.
        unsafe { sys::cuMemPoolCreate(&mut pool, &props) }.result().map_err(driver("create the index memory pool"))?;
        let pool = Self { context, pool };
        let mut keep = u64::MAX;
        // SAFETY: the attribute takes a u64, which `keep` is, and the pool was just created.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut keep).cast(),
            )
        }
        .result()
        .map_err(driver("keep the index pool's memory"))?;
        Ok(pool)
    }

    /// Frees `pointer` (from [`alloc`](Self::alloc)) in stream order on `stream`.
    ///
    /// # Safety
    ///
    /// `pointer` came from `alloc` and is freed once, after the last work that uses it is queued on `stream`.
    pub(crate) unsafe fn free(pointer: u64, stream: &CudaStream) -> Result<(), result::DriverError> {
        // SAFETY: as this function's contract.
        unsafe { result::free_async(pointer, stream.cu_stream()) }
    }

    /// `bytes` from the pool, in stream order on `stream` (freed with [`free`](Self::free)).
    pub(crate) fn alloc(&self, bytes: usize, stream: &CudaStream) -> Result<u64, Error> {
        let mut pointer: sys::CUdeviceptr = 0;
        // SAFETY: the pool is alive and of this stream's GPU; the driver writes the allocation's address.
        unsafe { sys::cuMemAllocFromPoolAsync(&mut pointer, bytes, self.pool, stream.cu_stream()) }
            .result()
            .map_err(driver("allocate the index arrays"))?;
        Ok(pointer)
    }
}

impl Drop for IndexPool {
    fn drop(&mut self) {
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: created by `new` and destroyed once; allocations still out are released by the driver when
            // they are freed (cuMemPoolDestroy's contract).
            let _ = unsafe { sys::cuMemPoolDestroy(self.pool) };
        }
    }
}

/// The driver's CUDA version, as 1000 × major + 10 × minor.
pub(crate) fn driver_version() -> Result<i32, result::DriverError> {
    let mut version = 0;
    // SAFETY: writes one int to the given address, which lives on this frame.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
    Ok(version)
}

/// Queues an upload of `values` to device memory at `to` on `stream` (the pageable source is staged before the call
/// returns).
///
/// # Safety
///
/// `[to, to + 4 × values.len())` is device memory that nothing else uses until the upload has run.
pub(crate) unsafe fn upload_async(to: u64, values: &[u32], stream: &CudaStream) -> Result<(), result::DriverError> {
    // SAFETY: as this function's contract.
    unsafe { result::memcpy_htod_async(to, values, stream.cu_stream()) }
}

/// Queues a copy of `bytes` from `from` to `to` (device or mapped pinned host addresses) on `stream`.
///
/// # Safety
///
/// Both ranges stay allocated until the copy has run, and nothing writes the source or touches the destination
/// meanwhile except work ordered with the copy on `stream`.
pub(crate) unsafe fn copy_async(
    to: u64,
    from: u64,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), result::DriverError> {
    // SAFETY: as this function's contract.
    unsafe { sys::cuMemcpyAsync(to, from, bytes, stream.cu_stream()) }.result()
}

/// Queues `(to, from, bytes)` copies as one `cuMemcpyBatchAsync_v2` on `stream`, in stream order.
///
/// # Safety
///
/// As [`copy_async`] for every copy; the driver is CUDA 13 or later (the symbol exists).
pub(crate) unsafe fn copy_batch_async(
    stream: &CudaStream,
    copies: &[(u64, u64, usize)],
) -> Result<(), result::DriverError> {
    if copies.is_empty() {
        return Ok(());
    }
    let mut to: Vec<sys::CUdeviceptr> = copies.iter().map(|copy| copy.0).collect();
    let mut from: Vec<sys::CUdeviceptr> = copies.iter().map(|copy| copy.1).collect();
    let mut sizes: Vec<usize> = copies.iter().map(|copy| copy.2).collect();
    // one attribute set for every copy: sources are read in stream order (they stay valid: the pools outlive it);
    // the location hints only matter for managed memory, which the pools are not
    let location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
    let mut attributes = [sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: location,
        dstLocHint: location,
        flags: 0,
    }];
    let mut first_copy = [0usize];
    // SAFETY: the three arrays hold `copies.len()` entries each and the attribute arrays one, all read during the
    // call; the ranges and the driver's version are the caller's to vouch for.
    unsafe {
        sys::cuMemcpyBatchAsync_v2(
            to.as_mut_ptr(),
            from.as_mut_ptr(),
            sizes.as_mut_ptr(),
            copies.len(),
            attributes.as_mut_ptr(),
            first_copy.as_mut_ptr(),
            1,
            stream.cu_stream(),
        )
    }
    .result()
}

/// Records `event` on a lent stream (its work so far is what the event waits for).
pub(crate) fn record_on(event: &CudaEvent, stream: StreamHandle) -> Result<(), result::DriverError> {
    event.context().bind_to_thread()?;
    // SAFETY: the event is alive (borrowed) and of the context just bound; the stream is alive and of the same
    // context (`StreamHandle::from_raw`'s contract). Recording only marks a point in the stream's work.
    unsafe { result::event::record(event.cu_event(), stream.cu_stream()) }
}

/// Makes a lent stream wait for `event` without blocking the CPU: its later work runs once the event has.
pub(crate) fn wait_on(stream: StreamHandle, event: &CudaEvent) -> Result<(), result::DriverError> {
    event.context().bind_to_thread()?;
    // SAFETY: as in `record_on`; waiting only orders the stream's later work after the event.
    unsafe {
        result::stream::wait_event(stream.cu_stream(), event.cu_event(), sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
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
