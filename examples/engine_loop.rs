//! hicache inside an inference engine's scheduler loop, on the CPU engine (no GPU needed), with the file tier as L3.
//!
//! The engine owns its device KV pool and the allocator of its slots ([`PagedSlots`] here; an engine's own block
//! manager implements `DeviceSlotAllocator`) and lends the allocator to the tree for load-backs, evictions and
//! inserts; the loop itself is in `scheduler.rs` (shared with `cuda_engine_loop.rs`).
//!
//! `cargo run --example engine_loop`
#![forbid(unsafe_code)]

#[path = "scheduler.rs"]
mod scheduler;

use std::error::Error;

use hicache_core::device_slots::PagedSlots;
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap};
use scheduler::{DEVICE_PAGES, DeviceKv, HOST_PAGES, PAGE};

impl DeviceKv for CpuEngine {
    fn write_kv(&self, offset: usize, bytes: &[u8]) -> Result<(), Box<dyn Error>> {
        self.with_device(|device| device[offset..offset + bytes.len()].copy_from_slice(bytes));
        Ok(())
    }

    fn read_kv(&self, offset: usize, len: usize) -> Result<Vec<u8>, Box<dyn Error>> {
        Ok(self.with_device(|device| device[offset..offset + len].to_vec()))
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    // the engine's pools for the model, and the allocator of its device slots
    let geometry = scheduler::geometry()?;
    let engine = CpuEngine::new(
        DeviceLayoutMap::new(geometry, DEVICE_PAGES * PAGE)?,
        HostLayoutMap::new(geometry, HostLayout::PageFirst, PAGE, HOST_PAGES)?,
        Completion::Immediate,
    )?;
    let mut slots = PagedSlots::new(DEVICE_PAGES, PAGE)?;
    let mut cache = scheduler::cache_over(engine)?;
    scheduler::run(&mut cache.tree, &mut slots, cache.storage.as_ref())
}
