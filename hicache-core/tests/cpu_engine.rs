//! The CPU transfer engine moves exactly the right bytes: backups fill host pages with their slots' items in the
//! flat page order of the layout, layer loads bring one layer back, nothing else is touched; held transfers leave
//! destinations alone until they complete; bad requests are refused whole.

use hicache_core::DeviceSlot;
use hicache_core::geometry::{Attention, KvDtype, KvGeometry, KvPart};
use hicache_core::host_pool::{HostPageAllocator, HostPageId};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use std::sync::Arc;

use hicache_core::host_memory::HostMemory;
use hicache_core::transfer::{
    Completion, CpuEngine, DeviceLayoutMap, DeviceRegions, Stream, TransferEngine, TransferEvent,
};
use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

const HOST_POISON: u8 = 0xaa;
const DEVICE_POISON: u8 = 0x55;

/// An item's bytes on the device, written out from the documented order `[layer][part][slot][item]`.
fn device_item(device: &[u8], geometry: &KvGeometry, slots: usize, slot: usize, layer: usize, part: KvPart) -> Vec<u8> {
    let item = geometry.item_bytes();
    let start = ((layer * geometry.parts().len() + part.index()) * slots + slot) * item;
    device[start..start + item].to_vec()
}

/// The flat page SGLang's generic storage path would store for these slots: `[part][layer][token][item]`, or
/// `[part][token][layer][item]` for `page_first` (docs/sglang.md#flat-pages), or SGLang's page block
/// `[head group][layer][part][token][item / head groups]` for `page_unified`, built straight from the device items.
fn expected_flat_page(device: &[u8], map: &HostLayoutMap, slots_total: usize, page_slots: &[DeviceSlot]) -> Vec<u8> {
    let geometry = map.geometry();
    let mut page = Vec::new();
    if map.layout() == HostLayout::PageUnified {
        let (groups, row) = (map.head_groups(), geometry.item_bytes() / map.head_groups());
        for group in 0..groups {
            for layer in 0..geometry.layers {
                for &part in geometry.parts() {
                    for &slot in page_slots {
                        let item = device_item(device, geometry, slots_total, slot as usize, layer, part);
                        page.extend_from_slice(&item[group * row..(group + 1) * row]);
                    }
                }
            }
        }
        return page;
    }
    for &part in geometry.parts() {
        let mut push = |slot: DeviceSlot, layer: usize| {
            page.extend(device_item(device, geometry, slots_total, slot as usize, layer, part));
        };
        if map.layout() == HostLayout::PageFirst {
            for &slot in page_slots {
                (0..geometry.layers).for_each(|layer| push(slot, layer));
            }
        } else {
            for layer in 0..geometry.layers {
                page_slots.iter().for_each(|&slot| push(slot, layer));
            }
        }
    }
    page
}

/// A host page's bytes, gathered through its segments.
fn host_page(host: &[u8], map: &HostLayoutMap, page: HostPageId) -> Vec<u8> {
    map.page_segments(page.index())
        .iter()
        .flat_map(|segment| host[segment.offset..segment.offset + segment.len].to_vec())
        .collect()
}

fn geometries() -> impl Strategy<Value = KvGeometry> {
    prop_oneof![
        (1usize..4, 1usize..5, 1usize..5).prop_map(|(l, h, d)| KvGeometry::mha(l, h, d, KvDtype::Bf16).unwrap()),
        (1usize..4, 1usize..5, 0usize..3).prop_map(|(l, r, p)| KvGeometry::mla(l, r, p, KvDtype::Fp8E4m3).unwrap()),
    ]
}

/// Device regions an engine owns: one buffer per layer and part.
#[derive(Debug)]
struct Regions(Vec<Vec<u8>>);

impl DeviceRegions for Regions {
    fn region(&mut self, index: usize) -> &mut [u8] {
        &mut self.0[index]
    }
}

struct Setup {
    engine: CpuEngine,
    host_map: HostLayoutMap,
    slots_total: usize,
    pages: Vec<HostPageId>,
    slots: Vec<DeviceSlot>,
    device: Vec<u8>,
    rng: rand::rngs::StdRng,
}

fn setup(
    geometry: KvGeometry,
    layout: HostLayout,
    page_size: usize,
    host_pages: usize,
    seed: u64,
    completion: Completion,
) -> Setup {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let slots_total = host_pages * page_size + 3;
    // under page_unified, as many head groups as the seed picks among those that divide the heads
    let heads = match geometry.attention {
        Attention::Mha { kv_heads, .. } if layout == HostLayout::PageUnified => kv_heads,
        _ => 1,
    };
    let groups: Vec<usize> = (1..=heads).filter(|groups| heads.is_multiple_of(*groups)).collect();
    let host_map = HostLayoutMap::new(geometry, layout, page_size, host_pages)
        .and_then(|map| map.with_head_groups(groups[(seed >> 8) as usize % groups.len()]))
        .unwrap();
    let device_map = DeviceLayoutMap::new(geometry, slots_total).unwrap();
    // every other case over device regions the caller owns (per layer and part), the rest over the engine's own pool
    let engine = if seed.is_multiple_of(2) {
        CpuEngine::new(device_map, host_map, completion).unwrap()
    } else {
        let regions =
            Regions(vec![vec![0; slots_total * geometry.item_bytes()]; geometry.layers * geometry.parts().len()]);
        let host = Arc::new(HostMemory::anonymous(host_map).unwrap());
        CpuEngine::with_device_regions(device_map, Box::new(regions), host, completion).unwrap()
    };
    let device: Vec<u8> = (0..engine.device_map().total_bytes()).map(|_| rng.random()).collect();
    engine.with_device(|bytes| bytes.copy_from_slice(&device));
    engine.with_host(|bytes| bytes.fill(HOST_POISON));
    // a random subset of host pages, in random order, and as many whole pages of random distinct device slots
    let mut allocator = engine.host_memory().allocator().unwrap();
    let mut pages = allocator.alloc(host_pages).unwrap();
    pages.shuffle(&mut rng);
    pages.truncate(rng.random_range(1..=host_pages));
    let slots = random_slots(&mut rng, slots_total, page_size, pages.len());
    Setup { engine, host_map, slots_total, pages, slots, device, rng }
}

/// `pages` pages of distinct device slots out of `slots_total`: half the time scattered slot by slot, half the time
/// whole runs of consecutive slots in random order (as a paged allocator hands them out: the engine copies such a
/// page at once), aligned to pages or one slot off.
fn random_slots(rng: &mut rand::rngs::StdRng, slots_total: usize, page_size: usize, pages: usize) -> Vec<DeviceSlot> {
    if rng.random_bool(0.5) {
        let mut slots: Vec<DeviceSlot> = (0..slots_total as DeviceSlot).collect();
        slots.shuffle(rng);
        slots.truncate(pages * page_size);
        return slots;
    }
    let offset = rng.random_range(0..=1);
    let mut runs: Vec<usize> = (0..(slots_total - offset) / page_size).collect();
    runs.shuffle(rng);
    runs[..pages]
        .iter()
        .flat_map(|run| (0..page_size).map(move |at| (offset + run * page_size + at) as DeviceSlot))
        .collect()
}

proptest! {
    #[test]
    fn backup_writes_flat_pages_and_nothing_else(
        geometry in geometries(), layout in prop::sample::select(HostLayout::ALL.to_vec()),
        page_size in 1usize..5, host_pages in 1usize..6, seed in any::<u64>(),
    ) {
        let Setup { mut engine, host_map, slots_total, pages, slots, device, .. } =
            setup(geometry, layout, page_size, host_pages, seed, Completion::Immediate);
        let start = engine.start_event().unwrap();
        let done = engine.write_to_host(&slots, &pages, &start).unwrap();
        prop_assert!(done.is_complete());
        let host = engine.with_host(|bytes| bytes.to_vec());
        for (page, page_slots) in pages.iter().zip(slots.chunks(page_size)) {
            prop_assert_eq!(host_page(&host, &host_map, *page), expected_flat_page(&device, &host_map, slots_total, page_slots));
        }
        // every byte outside the written pages keeps its poison
        let mut written = vec![false; host.len()];
        for page in &pages {
            for segment in host_map.page_segments(page.index()) {
                written[segment.offset..segment.offset + segment.len].fill(true);
            }
        }
        prop_assert!(host.iter().zip(&written).all(|(&byte, &mine)| mine || byte == HOST_POISON));
        prop_assert_eq!(engine.with_device(|bytes| bytes.to_vec()), device, "a write to the host leaves the device alone");
    }

    #[test]
    fn layer_loads_bring_back_one_layer_at_a_time(
        geometry in geometries(), layout in prop::sample::select(HostLayout::ALL.to_vec()),
        page_size in 1usize..5, host_pages in 1usize..6, seed in any::<u64>(),
    ) {
        let Setup { mut engine, slots_total, pages, slots, device, mut rng, .. } =
            setup(geometry, layout, page_size, host_pages, seed, Completion::Immediate);
        let start = engine.start_event().unwrap();
        engine.write_to_host(&slots, &pages, &start).unwrap();
        engine.with_device(|bytes| bytes.fill(DEVICE_POISON));
        // load into other slots than the ones backed up
        let targets = random_slots(&mut rng, slots_total, page_size, pages.len());
        for layer in 0..geometry.layers {
            let start = engine.start_event().unwrap();
            let done = engine.load_layer(layer, &pages, &targets, &start).unwrap();
            prop_assert!(done.is_complete());
            let now = engine.with_device(|bytes| bytes.to_vec());
            for (&from, &to) in slots.iter().zip(&targets) {
                for &part in geometry.parts() {
                    for seen in 0..geometry.layers {
                        let item = device_item(&now, &geometry, slots_total, to as usize, seen, part);
                        if seen <= layer {
                            prop_assert_eq!(item, device_item(&device, &geometry, slots_total, from as usize, seen, part));
                        } else {
                            prop_assert!(item.iter().all(|&byte| byte == DEVICE_POISON), "layer {} loaded early", seen);
                        }
                    }
                }
            }
        }
        let now = engine.with_device(|bytes| bytes.to_vec());
        let untouched = (0..slots_total as DeviceSlot).filter(|slot| !targets.contains(slot));
        for slot in untouched {
            for layer in 0..geometry.layers {
                for &part in geometry.parts() {
                    prop_assert!(device_item(&now, &geometry, slots_total, slot as usize, layer, part).iter().all(|&byte| byte == DEVICE_POISON));
                }
            }
        }
    }
}

#[test]
fn held_transfers_leave_destinations_alone_until_they_complete() {
    let geometry = KvGeometry::mha(3, 1, 4, KvDtype::Bf16).unwrap();
    let Setup { mut engine, slots_total, pages, slots, device, .. } =
        setup(geometry, HostLayout::PageFirst, 2, 4, 7, Completion::Manual);
    let (pages, slots) = (&pages[..1], &slots[..2]);
    let targets: Vec<DeviceSlot> =
        (0..slots_total as DeviceSlot).filter(|slot| !slots.contains(slot)).take(2).collect();
    let start = engine.start_event().unwrap();
    assert!(start.is_complete(), "the caller's CPU work is done when it asks");
    let backup = engine.write_to_host(slots, pages, &start).unwrap();
    assert!(!backup.is_complete());
    assert!(engine.with_host(|bytes| bytes.iter().all(|&byte| byte == HOST_POISON)), "held: nothing written yet");
    // poison the load targets (the backed-up slots stay as they are: their owner keeps them locked meanwhile)
    let device_map = engine.device_map();
    engine.with_device(|bytes| {
        for &slot in &targets {
            for layer in 0..geometry.layers {
                for &part in geometry.parts() {
                    let offset = device_map.item_offset(slot as usize, layer, part);
                    bytes[offset..offset + geometry.item_bytes()].fill(DEVICE_POISON);
                }
            }
        }
    });
    // loads ordered after the backup: completing the first load runs the backup first
    let loads: Vec<_> = (0..3).map(|layer| engine.load_layer(layer, pages, &targets, &backup).unwrap()).collect();
    assert_eq!(engine.pending(), (1, 3));
    assert!(engine.complete_next(Stream::Load));
    assert!(backup.is_complete() && loads[0].is_complete() && !loads[1].is_complete());
    let now = engine.with_device(|bytes| bytes.to_vec());
    let item = |bytes: &[u8], slot: DeviceSlot, layer: usize| {
        device_item(bytes, &geometry, slots_total, slot as usize, layer, KvPart::V)
    };
    assert_eq!(item(&now, targets[1], 0), item(&device, slots[1], 0), "layer 0 arrived");
    assert!(item(&now, targets[1], 1).iter().all(|&byte| byte == DEVICE_POISON), "layer 1 is still in flight");
    // waiting on the last layer completes everything before it on that stream
    loads[2].wait().unwrap();
    assert!(loads.iter().all(TransferEvent::is_complete));
    assert_eq!(engine.pending(), (0, 0));
    assert_eq!(item(&engine.with_device(|bytes| bytes.to_vec()), targets[0], 2), item(&device, slots[0], 2));
    assert!(!engine.complete_next(Stream::Write));
}

#[test]
fn bad_requests_are_refused_whole() {
    let geometry = KvGeometry::mla(2, 4, 0, KvDtype::Bf16).unwrap();
    let Setup { mut engine, pages, slots, .. } =
        setup(geometry, HostLayout::LayerFirst, 2, 3, 9, Completion::Immediate);
    let start = engine.start_event().unwrap();
    let message = |result: Result<_, hicache_core::Error>| result.map(|_| ()).unwrap_err().to_string();
    assert!(
        message(engine.write_to_host(&slots[..1], &pages[..1], &start))
            .contains("1 device slots for 1 host pages of 2 tokens")
    );
    assert!(message(engine.write_to_host(&[0, 999], &pages[..1], &start)).contains("device slot 999 out of range"));
    assert!(message(engine.write_to_host(&[0, 1, 2, 3], &[pages[0], pages[0]], &start)).contains("listed twice"));
    assert!(message(engine.load_layer(0, &pages[..1], &[1, 1], &start)).contains("device slot 1 is listed twice"));
    assert!(message(engine.load_layer(2, &pages[..1], &[0, 1], &start)).starts_with("layer: 2 out of range"));
    let other = setup(geometry, HostLayout::LayerFirst, 2, 3, 10, Completion::Immediate);
    let mut other_engine = other.engine;
    let foreign = other_engine.start_event().unwrap();
    assert!(message(engine.write_to_host(&[0, 1], &pages[..1], &foreign)).contains("another engine"));
    let big_pool = HostPageAllocator::new(10).unwrap().alloc(10).unwrap();
    assert!(
        message(engine.write_to_host(&[0, 1], &big_pool[9..], &start)).contains("is not a page of this host memory")
    );
    assert!(engine.with_host(|bytes| bytes.iter().all(|&byte| byte == HOST_POISON)), "nothing was copied");
    let mla_map =
        HostLayoutMap::new(KvGeometry::mha(2, 1, 4, KvDtype::Bf16).unwrap(), HostLayout::LayerFirst, 2, 3).unwrap();
    assert!(CpuEngine::new(DeviceLayoutMap::new(geometry, 8).unwrap(), mla_map, Completion::Manual).is_err());
}

/// The copy counts: pages contiguous in both pools merge into one run per layer and part in `layer_first`; the
/// same pages in another order, or `page_first` (whose device and host strides differ), do not.
#[test]
fn contiguous_pages_merge_into_one_copy_per_layer_and_part() {
    let geometry = KvGeometry::mha(3, 2, 4, KvDtype::Bf16).unwrap();
    let (page_size, pages) = (4, 6);
    for (layout, reversed, runs_per_layer_part) in [
        (HostLayout::LayerFirst, false, 1),
        (HostLayout::LayerFirst, true, pages),
        (HostLayout::PageFirst, false, pages * page_size),
    ] {
        let host_map = HostLayoutMap::new(geometry, layout, page_size, pages).unwrap();
        let mut engine =
            CpuEngine::new(DeviceLayoutMap::new(geometry, pages * page_size).unwrap(), host_map, Completion::Immediate)
                .unwrap();
        let mut host = engine.host_memory().allocator().unwrap().alloc(pages).unwrap();
        let mut slots: Vec<DeviceSlot> = (0..(pages * page_size) as DeviceSlot).collect();
        if reversed {
            host.reverse();
            slots = slots.chunks(page_size).rev().flatten().copied().collect();
        }
        let start = engine.start_event().unwrap();
        engine.write_to_host(&slots, &host, &start).unwrap().wait().unwrap();
        engine.load_layer(1, &host, &slots, &start).unwrap().wait().unwrap();
        let stats = engine.copy_stats();
        let parts = geometry.parts().len() as u64;
        let items = (pages * page_size) as u64 * parts;
        assert_eq!(stats.write_items, items * geometry.layers as u64, "{layout:?}");
        assert_eq!(stats.load_items, items, "{layout:?}");
        let expected = runs_per_layer_part as u64 * parts;
        assert_eq!(stats.load_runs, expected, "{layout:?} reversed {reversed}");
        assert_eq!(stats.write_runs, expected * geometry.layers as u64, "{layout:?} reversed {reversed}");
    }
}

#[test]
fn a_copy_into_a_page_lent_to_storage_waits_for_the_lease() {
    let geometry = KvGeometry::mha(2, 1, 4, KvDtype::Bf16).unwrap();
    let Setup { mut engine, host_map, slots_total, pages, slots, device, .. } =
        setup(geometry, HostLayout::LayerFirst, 2, 4, 11, Completion::Manual);
    let (pages, slots) = (&pages[..1], &slots[..2]);
    let memory = engine.host_memory();
    let start = engine.start_event().unwrap();
    let backup = engine.write_to_host(slots, pages, &start).unwrap();
    // a storage thread reads the page (a backup to storage of what it held before)
    let lease = memory.lend_read(&pages[..1]).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    let copier = std::thread::spawn(move || {
        backup.wait().unwrap();
        done.send(()).unwrap();
    });
    assert!(finished.recv_timeout(std::time::Duration::from_millis(50)).is_err(), "copied under a read lease");
    assert!(lease.page(0).iter().all(|segment| segment.iter().all(|&byte| byte == HOST_POISON)), "written under it");
    drop(lease);
    finished.recv_timeout(std::time::Duration::from_secs(10)).expect("the copy runs once the lease returns");
    copier.join().unwrap();
    let host = engine.with_host(|bytes| bytes.to_vec());
    assert_eq!(host_page(&host, &host_map, pages[0]), expected_flat_page(&device, &host_map, slots_total, slots));
}

#[test]
fn lent_regions_of_the_wrong_length_are_refused_by_name() {
    let geometry = KvGeometry::mha(2, 1, 4, KvDtype::Bf16).unwrap();
    let host_map = HostLayoutMap::new(geometry, HostLayout::PageFirst, 4, 2).unwrap();
    let device_map = DeviceLayoutMap::new(geometry, 8).unwrap();
    let mut regions = vec![vec![0; 8 * geometry.item_bytes()]; 4];
    regions[3].pop();
    let host = Arc::new(HostMemory::anonymous(host_map).unwrap());
    let error = CpuEngine::with_device_regions(device_map, Box::new(Regions(regions)), host, Completion::Immediate)
        .unwrap_err();
    assert!(error.to_string().contains("device_regions") && error.to_string().contains("region 3"), "{error}");
}
