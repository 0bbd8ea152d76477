//! hicache inside an inference engine's scheduler loop, on the CPU engine (no GPU needed), with the file tier as L3.
//!
//! The engine owns its device KV pool and the allocator of its slots ([`PagedSlots`] here; an engine's own block
//! manager implements `DeviceSlotAllocator`) and lends the allocator to the tree for load-backs, evictions and
//! inserts; the loop itself is in `scheduler.rs` (shared with `cuda_engine_loop.rs`).
//!
//! `cargo run --example engine_loop`

#[path = "scheduler.rs"]
mod scheduler;

use std::error::Error;
use std::sync::Arc;

use hicache_core::HiCacheBuilder;
use hicache_core::config::{HiCacheConfig, PrefetchPolicy};
use hicache_core::device_slots::PagedSlots;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};
use scheduler::{DEVICE_PAGES, DeviceKv, HOST_PAGES, PAGE};

impl DeviceKv for CpuEngine {
    fn map(&self) -> DeviceLayoutMap {
        self.device_map()
    }

    fn write_kv(&self, offset: usize, bytes: &[u8]) -> Result<(), Box<dyn Error>> {
        self.with_device(|device| device[offset..offset + bytes.len()].copy_from_slice(bytes));
        Ok(())
    }

    fn read_kv(&self, offset: usize, len: usize) -> Result<Vec<u8>, Box<dyn Error>> {
        Ok(self.with_device(|device| device[offset..offset + len].to_vec()))
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    // the model (4 layers, 2 KV heads of 64 dims, bf16) and the engine's pools
    let geometry = KvGeometry::mha(4, 2, 64, KvDtype::Bf16)?;
    let engine = CpuEngine::new(
        DeviceLayoutMap::new(geometry, DEVICE_PAGES * PAGE)?,
        HostLayoutMap::new(geometry, HostLayout::PageFirst, PAGE, HOST_PAGES)?,
        Completion::Immediate,
    )?;
    let mut slots = PagedSlots::new(DEVICE_PAGES, PAGE)?;

    // L3: the file tier in a temporary directory, for this model's namespace
    let dir = tempfile::tempdir()?;
    let namespace = StorageNamespace::single_rank("example-model", geometry, HostLayout::PageFirst, PAGE);
    let storage: Arc<dyn StorageBackend> =
        Arc::new(FileStorage::open(FileConfig::new(dir.path(), FileFormat::Native), &namespace)?);

    // the cache: SGLang's defaults at this page size, but prefetches that run to completion (SGLang's default,
    // `best_effort`, stops a prefetch at the first check, which an engine makes when it schedules the request)
    let config = HiCacheConfig {
        page_size: PAGE,
        mem_layout: HostLayout::PageFirst,
        prefetch_policy: PrefetchPolicy::WaitComplete,
        ..HiCacheConfig::default()
    };
    // one entry point: the tree, its controller and the storage tier, sized from the engine's pools
    let mut tree = HiCacheBuilder::new(config, engine).with_storage(storage.clone()).build()?;
    scheduler::run(&mut tree, &mut slots, storage.as_ref())
}
