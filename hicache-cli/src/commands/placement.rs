//! Where a benchmark's transfer finds its pages: scattered at random over the pools, contiguous, or as a churned
//! pool's allocator hands them out (requests of 256–4096 tokens allocated and freed at random, then the transfer's
//! requests allocated in the pool that leaves).

use clap::ValueEnum;
use hicache_core::DeviceSlot;
use hicache_core::host_pool::{HostPageAllocator, HostPageId};
use hicache_core::layout::HostLayoutMap;
use hicache_core::transfer::DeviceLayoutMap;
use rand::seq::SliceRandom as _;
use rand::{Rng, RngExt as _};

/// How the transfer's pages lie in the pools (`--placement`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Placement {
    /// Pages at random over pools twice the transfer (the worst case for copy runs).
    Scattered,
    /// Pages in order (a request's pages kept together in a fresh pool).
    Contiguous,
    /// Pages from the allocators of pools churned by random requests (what a running cache hands out).
    Churned,
}

/// `pages` host pages from `host` (the engine's host memory's allocator, all idle) and as many whole device pages
/// (as slots) of a device pool as large as the host pool, pages of `page` tokens, placed as asked.
pub(crate) fn place(
    placement: Placement,
    pages: usize,
    mut host: HostPageAllocator,
    page: usize,
    rng: &mut impl Rng,
) -> anyhow::Result<(Vec<HostPageId>, Vec<DeviceSlot>)> {
    let pool_pages = host.capacity();
    let mut device = HostPageAllocator::new(pool_pages)?;
    let (host_pages, device_pages) = match placement {
        Placement::Scattered | Placement::Contiguous => {
            let mut all_host = host.alloc(pool_pages).expect("a fresh pool");
            let mut all_device = device.alloc(pool_pages).expect("a fresh pool");
            if placement == Placement::Scattered {
                all_host.shuffle(rng);
                all_device.shuffle(rng);
            }
            (all_host[..pages].to_vec(), all_device[..pages].to_vec())
        }
        Placement::Churned => churned(&mut host, &mut device, pages, page, rng),
    };
    let slots = device_pages
        .iter()
        .flat_map(|device_page| (0..page).map(move |offset| (device_page.index() * page + offset) as DeviceSlot))
        .collect();
    Ok((host_pages, slots))
}

/// Churns both allocators with requests of 256–4096 tokens (allocated in both pools at once, freed at random, the
/// pools kept between a third and nine tenths full), then allocates requests until `pages` pages are had.
fn churned(
    host: &mut HostPageAllocator,
    device: &mut HostPageAllocator,
    pages: usize,
    page: usize,
    rng: &mut impl Rng,
) -> (Vec<HostPageId>, Vec<HostPageId>) {
    let capacity = host.capacity();
    let request = |rng: &mut dyn rand::Rng| rng.random_range(256usize..=4096).div_ceil(page).max(1);
    let mut live: Vec<(Vec<HostPageId>, Vec<HostPageId>)> = Vec::new();
    for _ in 0..4 * capacity.div_ceil(4).max(64) {
        let used = capacity - host.available();
        let grow = used < capacity / 3 || (used < capacity * 9 / 10 && rng.random_bool(0.5));
        if grow {
            let size = request(rng).min(host.available()).min(device.available());
            if size > 0 {
                let taken = (host.alloc(size).expect("counted"), device.alloc(size).expect("counted"));
                live.push(taken);
                continue;
            }
        }
        if !live.is_empty() {
            let (host_pages, device_pages) = live.swap_remove(rng.random_range(0..live.len()));
            host.free(&host_pages).expect("live pages");
            device.free(&device_pages).expect("live pages");
        }
    }
    // room for the transfer: free random requests until it fits
    while host.available() < pages || device.available() < pages {
        let (host_pages, device_pages) = live.swap_remove(rng.random_range(0..live.len()));
        host.free(&host_pages).expect("live pages");
        device.free(&device_pages).expect("live pages");
    }
    let (mut host_pages, mut device_pages) = (Vec::with_capacity(pages), Vec::with_capacity(pages));
    while host_pages.len() < pages {
        let size = request(rng).min(pages - host_pages.len());
        host_pages.extend(host.alloc(size).expect("room made above"));
        device_pages.extend(device.alloc(size).expect("room made above"));
    }
    (host_pages, device_pages)
}

/// Mean bytes of one copy contiguous in both pools, per layer and part, for the transfer's pages (what a copy
/// engine gets per copy; the GPU engine's `direct`, `batch` and `auto` merge runs the same way).
pub(crate) fn mean_run_bytes(
    host_map: &HostLayoutMap,
    device_map: &DeviceLayoutMap,
    host_pages: &[HostPageId],
    slots: &[DeviceSlot],
) -> f64 {
    if host_map.head_groups() > 1 {
        // a device item holds its groups side by side, the host pool each group's rows apart: every row is a run
        return host_map.row_bytes() as f64;
    }
    let page = host_map.page_size();
    let geometry = device_map.geometry();
    let item = geometry.item_bytes();
    let part = geometry.parts()[0];
    let mut pairs: Vec<(usize, usize)> = host_pages
        .iter()
        .flat_map(|host_page| (0..page).map(move |offset| host_page.index() * page + offset))
        .zip(slots.iter().map(|&slot| slot as usize))
        .collect();
    pairs.sort_unstable();
    let runs = 1 + pairs
        .windows(2)
        .filter(|pair| {
            let ((host_a, slot_a), (host_b, slot_b)) = (pair[0], pair[1]);
            !(slot_b == slot_a + 1
                && host_map.item_offset(host_b, 0, part) == host_map.item_offset(host_a, 0, part) + item)
        })
        .count();
    (pairs.len() * item) as f64 / runs as f64
}

#[cfg(test)]
mod tests {
    use hicache_core::geometry::{KvDtype, KvGeometry};
    use hicache_core::layout::HostLayout;

    use super::*;

    #[test]
    fn every_placement_gives_distinct_whole_pages_and_contiguous_ones_one_run() {
        let geometry = KvGeometry::mha(2, 1, 8, KvDtype::Bf16).unwrap();
        let (page, pages) = (4, 64);
        let host_map = HostLayoutMap::new(geometry, HostLayout::LayerFirst, page, 2 * pages).unwrap();
        let device_map = DeviceLayoutMap::new(geometry, 2 * pages * page).unwrap();
        let mut rng = rand::rng();
        for placement in [Placement::Scattered, Placement::Contiguous, Placement::Churned] {
            let allocator = HostPageAllocator::new(2 * pages).unwrap();
            let (host, slots) = place(placement, pages, allocator, page, &mut rng).unwrap();
            assert_eq!((host.len(), slots.len()), (pages, pages * page), "{placement:?}");
            let mut distinct: Vec<usize> = host.iter().map(|page| page.index()).collect();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), pages, "{placement:?}: host pages repeat");
            let mut slot_set = slots.clone();
            slot_set.sort_unstable();
            slot_set.dedup();
            assert_eq!(slot_set.len(), slots.len(), "{placement:?}: slots repeat");
            assert!(
                slots.chunks(page).all(|chunk| (chunk[0] as usize).is_multiple_of(page)),
                "{placement:?}: whole pages"
            );
            let run = mean_run_bytes(&host_map, &device_map, &host, &slots);
            let total = (pages * page * geometry.item_bytes()) as f64;
            if placement == Placement::Contiguous {
                assert_eq!(run, total, "one run per layer and part");
            }
            assert!(run >= (page * geometry.item_bytes()) as f64 && run <= total, "{placement:?}: {run}");
        }
    }
}
