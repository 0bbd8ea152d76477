//! `hicache bench controller`: the controller's own cost per operation, on the CPU engine with in-memory storage
//! and pages small enough that copies cost next to nothing.
//!
//! A steady mix, as a scheduler issues it: each request writes a page with its key (the write is acked at a tick and
//! goes on to storage), drops the device copy, loads a host page back to the device through a producer slot, and
//! prefetches an earlier request's page from storage; a tick runs every step. Operations counted: `write`,
//! `evict_device`, `load`, `start_loading`, `take_load_acks`, `prefetch`, `finish_prefetch`, `evict_host` and
//! `tick`. The time includes everything, the I/O threads' hand-offs too, until the last prefetch is drained.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, bail};
use clap::Args;
use hicache_core::collective::SingleRank;
use hicache_core::config::PrefetchPolicy;
use hicache_core::controller::{DEFAULT_TICK_SLOTS, PrefetchStart, StorageSettings};
use hicache_core::device_slots::{DeviceSlotAllocator as _, PagedSlots};
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PageHasher, PartialPage};
use hicache_core::host_pool::HostPageId;
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::MemoryStorage;
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap, SlotReuse};
use hicache_core::tree::NodeId;
use hicache_core::{HiCacheBuilder, HiCacheConfig};
use serde::Serialize;

/// Arguments of `hicache bench controller`.
#[derive(Debug, Args)]
pub(crate) struct BenchControllerArgs {
    /// Print JSON: {ops, us_per_op, seconds, requests, prefetched_pages}.
    #[arg(long)]
    json: bool,
    /// Controller operations to run (at least).
    #[arg(long, default_value_t = 10_000, value_name = "N")]
    ops: usize,
    /// Tokens per page.
    #[arg(long, default_value_t = 16, value_name = "N")]
    page_size: usize,
}

/// The figure of `bench controller`.
#[derive(Debug, Serialize)]
struct ControllerFigure {
    /// Controller operations run.
    ops: usize,
    /// Wall time per operation, microseconds.
    us_per_op: f64,
    /// Wall time of the run.
    seconds: f64,
    /// Requests simulated.
    requests: usize,
    /// Pages that came back from storage.
    prefetched_pages: usize,
}

const DEVICE_PAGES: usize = 256;
const HOST_PAGES: usize = 1024;

pub(crate) fn run(args: &BenchControllerArgs) -> anyhow::Result<()> {
    if args.ops == 0 || args.page_size == 0 {
        bail!(crate::exit::Usage("--ops and --page-size must be at least 1".into()));
    }
    let page = args.page_size;
    let geometry = KvGeometry::mha(1, 1, 8, KvDtype::Bf16)?;
    let engine = CpuEngine::new(
        DeviceLayoutMap::new(geometry, DEVICE_PAGES * page)?,
        HostLayoutMap::new(geometry, HostLayout::PageFirst, page, HOST_PAGES)?,
        Completion::Immediate,
    )?;
    let namespace = StorageNamespace::single_rank("bench-controller", geometry, HostLayout::PageFirst, page);
    let settings = StorageSettings {
        page_size: page,
        batch_pages: 128,
        prefetch_threshold: page,
        policy: PrefetchPolicy::WaitComplete,
        timeout_base: std::time::Duration::from_secs(3),
        timeout_per_ki_token: std::time::Duration::ZERO,
        timeout_max: std::time::Duration::from_secs(3),
        read_deadline: std::time::Duration::from_secs(30),
        capacity_tokens: ((HOST_PAGES - DEVICE_PAGES) * page) as u64,
        backup_skip: false,
        write_bytes_per_s: 0,
        tick_slots: DEFAULT_TICK_SLOTS,
        by_cost: false,
        split: false,
        meet: false,
        priors: hicache_core::cost::Priors::UNKNOWN,
        trailing: None,
    };
    let config = HiCacheConfig { page_size: page, mem_layout: HostLayout::PageFirst, ..HiCacheConfig::default() };
    let mut controller = HiCacheBuilder::new(config, engine)
        .with_storage(Arc::new(MemoryStorage::new(&namespace)))
        .with_storage_settings(settings)
        .build_controller()?;
    let mut hasher = PageHasher::new();
    let mut ops = 0;
    let mut requests = 0;
    let mut prefetched_pages = 0;
    // host pages holding the only copy above storage (evictable), oldest first
    let mut host_only: std::collections::VecDeque<HostPageId> = std::collections::VecDeque::new();
    let mut writes: std::collections::VecDeque<Vec<u32>> = std::collections::VecDeque::new();
    // the engine's device slots, as an engine keeps them beside the controller
    let mut device = PagedSlots::new(DEVICE_PAGES, page)?;
    let started = Instant::now();
    while ops < args.ops || controller.prefetches_in_flight() > 0 || controller.backups_in_flight() > 0 {
        if ops < args.ops {
            requests += 1;
            let tokens: Vec<u32> = (0..page as u32).map(|token| requests as u32 * 7919 + token).collect();
            let key = hasher.page_keys(&tokens, page, None, PartialPage::Reject)?;
            // a full host pool (pages pinned by backups still running) holds the write back, as it would a scheduler
            if controller.host().available() > 16
                && let Some(slots) = device.alloc_pages(1)
            {
                controller.write(&slots, NodeId(requests as u64), Some(&key))?.context("host pool full")?;
                writes.push_back(slots);
                ops += 1;
            }
            // load the oldest host-only page back, as a returning request would
            if let Some(page_id) = host_only.pop_front()
                && !controller.is_pinned(&[page_id])
            {
                if let Some(slots) = device.alloc_pages(1) {
                    controller.load(&[page_id], &slots, NodeId(0), None)?;
                    controller.start_loading(SlotReuse::Wait)?.ok().context("producer slot")?;
                    let done = controller.completed_loads();
                    controller.take_load_acks(done)?;
                    controller.evict_device(&[page_id])?;
                    device.free(&slots)?;
                    ops += 4;
                }
                host_only.push_back(page_id);
            }
            // prefetch an earlier request's page from storage
            if requests > 64 {
                let earlier = (requests - 64) as u32;
                let tokens: Vec<u32> = (0..page as u32).map(|token| earlier * 7919 + token).collect();
                let id = requests.to_string();
                if let PrefetchStart::Started(_) = controller.prefetch(&id, &tokens, None)? {
                    controller.finish_prefetch(&id);
                    ops += 2;
                }
            }
        }
        let report = controller.tick(&mut SingleRank)?;
        ops += 1;
        for ack in &report.write_acks {
            let slots = writes.pop_front().context("an ack for no write")?;
            controller.evict_device(&ack.host_pages)?;
            device.free(&slots)?;
            host_only.extend(&ack.host_pages);
            ops += 1;
        }
        for done in report.prefetches {
            prefetched_pages += done.host_pages.len();
            controller.evict_host(&done.host_pages)?;
            ops += 1;
        }
        // keep the host pool from filling: drop the oldest unpinned host-only pages
        while controller.host().available() < 64 {
            let Some(victim) = host_only.iter().position(|&page_id| !controller.is_pinned(&[page_id])) else { break };
            let page_id = host_only.remove(victim).expect("found");
            controller.evict_host(&[page_id])?;
            ops += 1;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let figure = ControllerFigure { ops, us_per_op: seconds * 1e6 / ops as f64, seconds, requests, prefetched_pages };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&figure)?);
    } else {
        println!(
            "controller: {} ops in {:.3} s: {:.2} µs per op ({} requests, {} pages prefetched from storage)",
            figure.ops, figure.seconds, figure.us_per_op, figure.requests, figure.prefetched_pages
        );
    }
    Ok(())
}
