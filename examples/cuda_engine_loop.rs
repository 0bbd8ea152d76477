//! The engine loop of `engine_loop.rs` on the GPU, with the KV cache as an engine keeps it: a K and a V tensor per
//! layer, allocated by the engine and lent to hicache as a table of regions ([`DevicePool::per_layer`]).
//!
//! Needs a CUDA GPU (run by hand: `cargo run --release --example cuda_engine_loop`); the results of a run are in
//! docs/gpu.md.

#[path = "scheduler.rs"]
mod scheduler;

use std::error::Error;
use std::sync::Arc;

use hicache_core::device_slots::PagedSlots;
use hicache_core::host_memory::HostMemory;
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::transfer::DeviceLayoutMap;
use hicache_cuda::{CudaEngine, Device, DeviceBuffer, DevicePool};
use scheduler::{DEVICE_PAGES, DeviceKv, HOST_PAGES, PAGE};

impl DeviceKv for CudaEngine {
    fn write_kv(&self, offset: usize, bytes: &[u8]) -> Result<(), Box<dyn Error>> {
        Ok(self.device_pool().write(offset, bytes)?)
    }

    fn read_kv(&self, offset: usize, len: usize) -> Result<Vec<u8>, Box<dyn Error>> {
        let mut bytes = vec![0u8; len];
        self.device_pool().read(offset, &mut bytes)?;
        Ok(bytes)
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let device = Device::open(0)?;
    let geometry = scheduler::geometry()?;
    let map = DeviceLayoutMap::new(geometry, DEVICE_PAGES * PAGE)?;
    // the engine's KV cache: layer 0's K, layer 0's V, layer 1's K, ... each [slot][item]
    let tensors = (0..geometry.layers * geometry.parts().len())
        .map(|_| DeviceBuffer::zeroed(&device, map.slots() * geometry.item_bytes()))
        .collect::<Result<Vec<_>, _>>()?;
    let views = tensors
        .iter()
        .map(|tensor| {
            // SAFETY: each view is one of the engine's tensors in this device's context, sized for the map's slots;
            // the tensors are declared before the tree, so they outlive the engine and every transfer it submits,
            // and the loop below writes a slot only when no transfer in flight uses it.
            unsafe { DeviceBuffer::borrowed(&device, tensor.pointer(), tensor.len()) }
        })
        .collect();
    let pool = DevicePool::per_layer(&device, &map, views)?;
    let host = Arc::new(HostMemory::anonymous(HostLayoutMap::new(geometry, HostLayout::PageFirst, PAGE, HOST_PAGES)?)?);
    let engine = CudaEngine::with_device_regions(&device, map, pool, host)?;
    let mut slots = PagedSlots::new(DEVICE_PAGES, PAGE)?;
    let mut cache = scheduler::cache_over(engine)?;
    scheduler::run(&mut cache.tree, &mut slots, cache.storage.as_ref())?;
    println!("on {} with the KV cache in {} per-layer tensors", device.name()?, tensors.len());
    Ok(())
}
