//! A controller over a backend, for backend crates' tests of the path users take: pages written by the controller's
//! backup thread from a CPU engine's host pool and prefetched back into another controller's pool, in place.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::HiCacheBuilder;
use crate::collective::SingleRank;
use crate::config::{HiCacheConfig, PrefetchPolicy};
use crate::controller::NodeId;
use crate::controller::{BackupReport, CacheController, PrefetchDone, StorageSettings};
use crate::error::Error;
use crate::hash::{PartialPage, page_keys};
use crate::layout::HostLayoutMap;
use crate::namespace::StorageNamespace;
use crate::storage::StorageBackend;
use crate::transfer::{Completion, CpuEngine, DeviceLayoutMap, TransferEngine};

/// A controller over `storage` for `namespace` (its geometry, layout and page size), with `host_pages` host pages,
/// half as many device pages, storage batches of `batch_pages`, the `wait_complete` policy, and a device pool of
/// pseudo-random bytes that differ at every offset and for every `seed`.
///
/// # Errors
///
/// The controller's and the engine's errors (sizes that do not fit).
pub fn controller_over(
    storage: Arc<dyn StorageBackend>,
    namespace: &StorageNamespace,
    host_pages: usize,
    batch_pages: usize,
    seed: u64,
) -> Result<CacheController<CpuEngine>, Error> {
    let (geometry, page) = (namespace.geometry, namespace.page_size);
    let device_pages = (host_pages / 2).max(1);
    let device = DeviceLayoutMap::new(geometry, device_pages * page)?;
    let host = HostLayoutMap::new(geometry, namespace.layout, page, host_pages)?;
    let engine = CpuEngine::new(device, host, Completion::Immediate)?;
    engine.with_device(|bytes| {
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(seed).rotate_left(17) as u8;
        }
    });
    let settings = StorageSettings {
        page_size: page,
        batch_pages,
        prefetch_threshold: page,
        policy: PrefetchPolicy::WaitComplete,
        timeout_base: Duration::from_secs(20),
        timeout_per_ki_token: Duration::ZERO,
        timeout_max: Duration::from_secs(20),
        read_deadline: Duration::from_secs(30),
        capacity_tokens: ((host_pages - device_pages) * page) as u64,
        backup_skip: false,
        write_bytes_per_s: 0,
        tick_slots: 8,
        by_cost: false,
        split: false,
        meet: false,
        priors: crate::cost::Priors::UNKNOWN,
        trailing: None,
    };
    let config = HiCacheConfig { page_size: page, mem_layout: namespace.layout, ..HiCacheConfig::default() };
    HiCacheBuilder::new(config, engine)
        .with_storage(storage)
        .with_storage_settings(settings)
        .with_tp_rank(namespace.tp_rank)
        .build_controller()
}

/// Writes `tokens` (whole pages, at most the device pool; from its first pages) through the controller with their keys and waits for the
/// backup to storage; returns its report and the flat bytes of the host pages it read.
///
/// # Panics
///
/// When the pools are too small or the backup is not done after 20 s (a test failure).
pub fn store_through(controller: &mut CacheController<CpuEngine>, tokens: &[u32]) -> (BackupReport, Vec<u8>) {
    let page = controller.page_size();
    let keys = page_keys(tokens, page, None, PartialPage::Reject).expect("whole pages");
    // the first pages of the device pool
    let slots: Vec<crate::device_slots::DeviceSlot> =
        (0..(keys.len() * page) as crate::device_slots::DeviceSlot).collect();
    let pages = controller.write(&slots, NodeId(1), Some(&keys)).expect("write").expect("host pages");
    let report = tick_until(controller, |tick| tick.backups.into_iter().next());
    let bytes = controller.engine().host_memory().copy_pages_out(&pages).expect("the pages are not lent");
    (report, bytes)
}

/// Prefetches `tokens` and waits for the result; returns it and the flat bytes of the host pages it filled.
///
/// # Panics
///
/// When the prefetch is refused or not done after 20 s (a test failure).
pub fn prefetch_back(controller: &mut CacheController<CpuEngine>, tokens: &[u32]) -> (PrefetchDone, Vec<u8>) {
    controller.prefetch("rig", tokens, None).expect("prefetch");
    controller.finish_prefetch("rig");
    let done = tick_until(controller, |tick| tick.prefetches.into_iter().next());
    let bytes = controller.engine().host_memory().copy_pages_out(&done.host_pages).expect("the pages are not lent");
    (done, bytes)
}

fn tick_until<T>(
    controller: &mut CacheController<CpuEngine>,
    mut found: impl FnMut(crate::controller::TickReport<crate::transfer::CpuEvent>) -> Option<T>,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(value) = found(controller.tick(&mut SingleRank).expect("tick")) {
            return value;
        }
        assert!(Instant::now() < deadline, "not done after 20 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}
