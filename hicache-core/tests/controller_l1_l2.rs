//! The controller's device↔host half on the CPU engine, with transfers held in flight deterministically: acks only
//! after the copy, synced states only at the ack, producer slots that wait or report busy, a reset that quiesces,
//! and TP ranks that stay in step through one MIN per check.

use std::time::Duration;

use hicache_core::DeviceSlot;
use hicache_core::collective::{Collective, InProcessGroup, ReduceOp};
use hicache_core::controller::CacheController;
use hicache_core::device_slots::{DeviceSlotAllocator as _, PagedSlots};
use hicache_core::error::ErrorKind;
use hicache_core::geometry::{KvDtype, KvGeometry, KvPart};
use hicache_core::host_pool::PageState;
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::transfer::{
    Completion, CpuEngine, DeviceLayoutMap, ProducerSlot, SlotBusy, SlotReuse, Stream, TransferEvent,
};
use hicache_core::tree::NodeId;
use hicache_core::{HiCacheBuilder, HiCacheConfig};

const PAGE: usize = 2;
const LAYERS: usize = 3;
const DEVICE_PAGES: usize = 6;
const HOST_PAGES: usize = 8;

fn geometry() -> KvGeometry {
    KvGeometry::mha(LAYERS, 1, 4, KvDtype::Bf16).unwrap()
}

fn controller(completion: Completion) -> CacheController<CpuEngine> {
    let device = DeviceLayoutMap::new(geometry(), DEVICE_PAGES * PAGE).unwrap();
    let host = HostLayoutMap::new(geometry(), HostLayout::PageFirst, PAGE, HOST_PAGES).unwrap();
    let engine = CpuEngine::new(device, host, completion).unwrap();
    // every device byte distinct, so any misplaced copy shows
    engine.with_device(|bytes| {
        bytes.iter_mut().enumerate().for_each(|(index, byte)| *byte = (index * 7 + index / 251) as u8)
    });
    HiCacheBuilder::new(
        HiCacheConfig { page_size: PAGE, mem_layout: HostLayout::PageFirst, ..HiCacheConfig::default() },
        engine,
    )
    .build_controller()
    .unwrap()
}

fn item(controller: &CacheController<CpuEngine>, slot: DeviceSlot, layer: usize, part: KvPart) -> Vec<u8> {
    let map = controller.engine().device_map();
    let offset = map.item_offset(slot as usize, layer, part);
    controller.engine().with_device(|bytes| bytes[offset..offset + map.geometry().item_bytes()].to_vec())
}

/// Writes `count` device pages to the host, acks the write and drops the device copy: host pages in the backup state.
fn host_only_pages(
    controller: &mut CacheController<CpuEngine>,
    count: usize,
) -> Vec<hicache_core::host_pool::HostPageId> {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let slots = device.alloc_pages(count).unwrap();
    let pages = controller.write(&slots, NodeId(1), None).unwrap().unwrap();
    controller.engine().run_pending();
    controller.take_write_acks(1).unwrap();
    controller.evict_device(&pages).unwrap();
    device.free(&slots).unwrap();
    pages
}

#[test]
fn writes_are_acked_after_the_copy_and_only_then_synced() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let mut controller = controller(Completion::Manual);
    let slots = device.alloc_pages(2).unwrap();
    let pages = controller.write(&slots, NodeId(7), None).unwrap().unwrap();
    assert_eq!(controller.host().state(pages[0]).unwrap(), PageState::Protected);
    assert_eq!(controller.completed_writes(), 0, "held in flight");
    assert!(controller.engine().complete_next(Stream::Write));
    assert_eq!(controller.completed_writes(), 1);
    let acks = controller.take_write_acks(1).unwrap();
    assert_eq!(acks[0].node_ids, [NodeId(7)]);
    assert!(pages.iter().all(|&page| controller.host().state(page).unwrap() == PageState::Synced));
    // and the host holds the device's bytes: read them back through a load into fresh slots
    controller.evict_device(&pages).unwrap();
    device.free(&slots).unwrap();
    let originals: Vec<Vec<u8>> = slots.iter().map(|&slot| item(&controller, slot, 2, KvPart::V)).collect();
    let loaded = {
        let slots = device.alloc_pages(pages.len()).unwrap();
        controller.load(&pages, &slots, NodeId(8), None).unwrap();
        slots
    };
    controller.start_loading(SlotReuse::Refuse).unwrap().unwrap();
    controller.engine().run_pending();
    let count = controller.completed_loads();
    assert_eq!(controller.take_load_acks(count).unwrap().len(), 1);
    let after: Vec<Vec<u8>> = loaded.iter().map(|&slot| item(&controller, slot, 2, KvPart::V)).collect();
    assert_eq!(after, originals);
    assert!(pages.iter().all(|&page| controller.host().state(page).unwrap() == PageState::Synced));
}

#[test]
fn pools_that_are_full_say_so_and_allocate_nothing() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let mut controller = controller(Completion::Immediate);
    let slots = device.alloc_pages(DEVICE_PAGES).unwrap();
    assert!(device.alloc_pages(1).is_none());
    assert!(controller.write(&slots, NodeId(1), None).unwrap().is_some());
    assert_eq!(controller.host().available(), HOST_PAGES - DEVICE_PAGES);
    assert!(controller.write(&slots, NodeId(2), None).unwrap().is_none(), "6 more pages do not fit in 2");
    assert_eq!(controller.host().available(), HOST_PAGES - DEVICE_PAGES, "a refused write allocates nothing");
    let error = controller.write(&slots[..3], NodeId(3), None).unwrap_err().to_string();
    assert!(error.contains("3 slots are not whole pages of 2"), "{error}");
}

#[test]
fn a_fourth_load_waits_or_is_refused_never_asserts() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let mut controller = controller(Completion::Manual);
    let pages = host_only_pages(&mut controller, 4);
    for (round, page) in pages.iter().enumerate().take(3) {
        controller
            .load(std::slice::from_ref(page), &device.alloc_pages(1).unwrap(), NodeId(10 + round as u64), None)
            .unwrap();
        assert_eq!(ring(controller.start_loading(SlotReuse::Refuse).unwrap()), Ok(Some(round)));
    }
    controller.load(&pages[3..], &device.alloc_pages(pages[3..].len()).unwrap(), NodeId(13), None).unwrap();
    assert_eq!(ring(controller.start_loading(SlotReuse::Refuse).unwrap()), Err(0));
    assert_eq!(controller.outstanding(), (0, 1, 3), "the refused load stays queued");
    assert_eq!(ring(controller.start_loading(SlotReuse::Wait).unwrap()), Ok(Some(0)));
    assert_eq!(controller.completed_loads(), 1, "waiting finished the oldest load, and only it");
    assert_eq!(controller.start_loading(SlotReuse::Refuse).unwrap(), Ok(None), "nothing queued");
}

#[test]
fn the_forward_pass_waits_layer_by_layer() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let mut controller = controller(Completion::Manual);
    let pages = host_only_pages(&mut controller, 1);
    controller.load(&pages, &device.alloc_pages(pages.len()).unwrap(), NodeId(2), None).unwrap();
    let slot = controller.start_loading(SlotReuse::Refuse).unwrap().unwrap();
    controller.layers().set_consumer(slot);
    controller.layers().wait_until(0).unwrap();
    assert!(controller.layers().consumer_event(0).unwrap().is_complete());
    assert!(!controller.layers().consumer_event(1).unwrap().is_complete(), "layer 1 still loading");
    assert_eq!(controller.completed_loads(), 0);
}

#[test]
fn reset_quiesces_and_leaves_nothing_stale() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let mut controller = controller(Completion::Manual);
    let slots = device.alloc_pages(3).unwrap();
    let pages = controller.write(&slots[..4], NodeId(1), None).unwrap().unwrap();
    controller.write(&slots[4..], NodeId(2), None).unwrap().unwrap();
    assert_eq!(controller.engine().pending(), (2, 0));
    controller.reset();
    assert_eq!(controller.engine().pending(), (0, 0), "in-flight copies finished before the pools were cleared");
    assert_eq!(controller.outstanding(), (0, 0, 0));
    assert_eq!(controller.host().available(), HOST_PAGES);
    assert_eq!(controller.host().state(pages[0]).unwrap(), PageState::Idle);
    assert!(controller.take_write_acks(1).is_err(), "no ack of before the reset can be taken");
    // the device slots are the engine's: it empties its allocator with the flush
    assert_eq!(device.free_pages(), DEVICE_PAGES - 3);
    device.clear();
    assert_eq!(device.alloc_pages(DEVICE_PAGES).map(|slots| slots.len()), Some(DEVICE_PAGES * PAGE));
}

#[test]
fn eviction_checks_states() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let mut controller = controller(Completion::Immediate);
    let slots = device.alloc_pages(1).unwrap();
    let pages = controller.write(&slots, NodeId(1), None).unwrap().unwrap();
    let error = controller.evict_device(&pages).unwrap_err().to_string();
    assert!(error.contains("expected synced, found protected"), "unacked writes cannot be evicted: {error}");
    assert!(controller.evict_host(&pages).is_err());
    controller.take_write_acks(controller.completed_writes()).unwrap();
    controller.evict_device(&pages).unwrap();
    device.free(&slots).unwrap();
    controller.evict_host(&pages).unwrap();
    assert!(controller.evict_host(&pages).is_err(), "twice");
    assert!(device.free(&slots).is_err(), "the slots were given back once");
}

/// Each rank's copies finish at different times; every check, each rank counts its finished writes and all take the MIN
/// — entered unconditionally, every tick, whatever the local state (docs/sglang.md#fixed-16). The allocators end equal.
#[test]
fn tp_ranks_stay_in_step_through_one_min_per_check() {
    const RANKS: usize = 4;
    let groups = InProcessGroup::new(RANKS, Duration::from_secs(30)).unwrap();
    let threads: Vec<_> = groups
        .into_iter()
        .map(|mut group| {
            std::thread::spawn(move || {
                let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
                let mut controller = controller(Completion::Manual);
                let mut taken = Vec::new();
                for tick in 0..12usize {
                    if tick < 4 {
                        let slots = device.alloc_pages(1).unwrap();
                        controller.write(&slots, NodeId(tick as u64), None).unwrap().unwrap();
                    }
                    // rank r finishes one copy on ticks where (tick + r) % 3 != 0
                    if (tick + group.rank()) % 3 != 0 {
                        controller.engine().complete_next(Stream::Write);
                    }
                    let mut counts = [controller.completed_writes() as i64];
                    group.all_reduce(&mut counts, ReduceOp::Min).unwrap();
                    for ack in controller.take_write_acks(counts[0] as usize).unwrap() {
                        taken.push((tick, ack.node_ids[0]));
                    }
                }
                controller.engine().run_pending();
                let mut counts = [controller.completed_writes() as i64];
                group.all_reduce(&mut counts, ReduceOp::Min).unwrap();
                controller.take_write_acks(counts[0] as usize).unwrap();
                (taken, controller.host().states().to_vec())
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|thread| thread.join().unwrap()).collect();
    for result in &results[1..] {
        assert_eq!(result, &results[0], "ranks diverged");
    }
    assert!(results[0].1.iter().filter(|&&state| state == PageState::Synced).count() == 4);
}

/// What the ack state machine test does next.
#[derive(Clone, Debug)]
enum Step {
    Write(usize),
    Load,
    StartLoading,
    Complete(Stream),
    TakeWrites,
    TakeLoads,
    EvictHost,
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        (1usize..3).prop_map(Step::Write),
        Just(Step::Load),
        Just(Step::StartLoading),
        Just(Step::Complete(Stream::Write)),
        Just(Step::Complete(Stream::Load)),
        Just(Step::TakeWrites),
        Just(Step::TakeLoads),
        Just(Step::EvictHost),
    ]
}

/// Items of a page or of a run of pages, as the test recorded them at write time.
type Items = Vec<Vec<u8>>;
/// An unacked write: device slots, host pages, the items written.
type Written = (Vec<DeviceSlot>, Vec<hicache_core::host_pool::HostPageId>, Items);
/// A loaded page: first device slot, host page, the items it must hold.
type Loaded = (DeviceSlot, hicache_core::host_pool::HostPageId, Items);

/// The items of `slots`, all layers and parts, in order.
fn items(controller: &CacheController<CpuEngine>, slots: &[DeviceSlot]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for &slot in slots {
        for layer in 0..LAYERS {
            for &part in geometry().parts() {
                out.push(item(controller, slot, layer, part));
            }
        }
    }
    out
}

proptest::proptest! {
    /// Random writes, loads, completions and ack takes against a model of the two FIFO streams: acks are counted
    /// only after their copy, taken in order, host states follow (protected until the ack, synced after), and every
    /// loaded byte is the byte that was written.
    #[test]
    fn acks_follow_the_copies(steps in proptest::collection::vec(step(), 1..60)) {
        let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
        use hicache_core::host_pool::HostPageId;
        let mut controller = controller(Completion::Manual);
        // the model
        let (mut writes_submitted, mut writes_done, mut writes_taken) = (0usize, 0usize, 0usize);
        let (mut load_jobs_submitted, mut load_jobs_done) = (0usize, 0usize);
        let mut load_acks: std::collections::VecDeque<usize> = Default::default(); // last job seq of each load
        let mut queued_loads = 0usize;
        let mut writes: std::collections::VecDeque<Written> = Default::default();
        let mut host_only: Vec<(HostPageId, Items)> = Vec::new();
        let mut loading: std::collections::VecDeque<Vec<Loaded>> = Default::default();
        let mut queued: Vec<Loaded> = Vec::new();
        for step in steps {
            match step {
                Step::Write(pages) => {
                    let Some(slots) = device.alloc_pages(pages) else { continue };
                    let expected = items(&controller, &slots);
                    match controller.write(&slots, NodeId(1), None).unwrap() {
                        Some(host) => {
                            writes_submitted += 1;
                            writes.push_back((slots, host, expected));
                        }
                        None => device.free(&slots).unwrap(),
                    }
                }
                Step::Load => {
                    let Some((page, expected)) = host_only.pop() else { continue };
                    match device.alloc_pages(1) {
                        Some(slots) => {
                            controller.load(&[page], &slots, NodeId(2), None).unwrap();
                            queued.push((slots[0], page, expected));
                            queued_loads += 1;
                        }
                        None => host_only.push((page, expected)),
                    }
                }
                Step::StartLoading => {
                    if let Ok(Some(_)) = controller.start_loading(SlotReuse::Wait).unwrap() {
                        // waiting for a busy slot finishes that slot's load (and the jobs before it)
                        let ack_seq = load_jobs_submitted + LAYERS;
                        if load_acks.len() >= 3 {
                            let oldest = load_acks[load_acks.len() - 3];
                            load_jobs_done = load_jobs_done.max(oldest);
                        }
                        load_jobs_submitted = ack_seq;
                        load_acks.push_back(ack_seq);
                        loading.push_back(std::mem::take(&mut queued));
                        queued_loads = 0;
                    }
                }
                Step::Complete(stream) => {
                    let progressed = controller.engine().complete_next(stream);
                    match stream {
                        Stream::Write => {
                            proptest::prop_assert_eq!(progressed, writes_done < writes_submitted);
                            writes_done = (writes_done + 1).min(writes_submitted);
                        }
                        Stream::Load => {
                            proptest::prop_assert_eq!(progressed, load_jobs_done < load_jobs_submitted);
                            load_jobs_done = (load_jobs_done + 1).min(load_jobs_submitted);
                        }
                    }
                }
                Step::TakeWrites => {
                    let count = controller.completed_writes();
                    for ack in controller.take_write_acks(count).unwrap() {
                        let (slots, host, expected) = writes.pop_front().unwrap();
                        proptest::prop_assert_eq!(&ack.host_pages, &host);
                        controller.evict_device(&host).unwrap();
                        device.free(&slots).unwrap();
                        let per_page = expected.len() / host.len();
                        for (index, page) in host.into_iter().enumerate() {
                            host_only.push((page, expected[index * per_page..(index + 1) * per_page].to_vec()));
                        }
                        writes_taken += 1;
                    }
                }
                Step::TakeLoads => {
                    let count = controller.completed_loads();
                    proptest::prop_assert_eq!(count, load_acks.iter().take_while(|&&seq| seq <= load_jobs_done).count());
                    for _ in controller.take_load_acks(count).unwrap() {
                        load_acks.pop_front();
                        for (slot, page, expected) in loading.pop_front().unwrap() {
                            let mut slots = vec![slot];
                            slots.extend((1..PAGE as u32).map(|offset| slot + offset));
                            proptest::prop_assert_eq!(&items(&controller, &slots), &expected, "loaded bytes");
                            controller.evict_device(&[page]).unwrap();
                            device.free(&slots).unwrap();
                            host_only.push((page, expected));
                        }
                    }
                }
                Step::EvictHost => {
                    if let Some((page, _)) = host_only.pop() {
                        controller.evict_host(&[page]).unwrap();
                    }
                }
            }
            let expected_completed = writes_done.min(writes_submitted).saturating_sub(writes_taken);
            proptest::prop_assert_eq!(controller.completed_writes(), expected_completed);
            for (_, host, _) in &writes {
                for &page in host {
                    proptest::prop_assert_eq!(controller.host().state(page).unwrap(), PageState::Protected);
                }
            }
            proptest::prop_assert_eq!(controller.outstanding().1, queued_loads);
            controller.host().check_invariants().unwrap();
        }
    }
}

/// A write whose transfer fails is acked as failed: its host pages are freed, never synced, and never go on to
/// storage; the next write is unaffected.
#[test]
fn a_failed_write_never_marks_its_pages_synced() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let mut controller = controller(Completion::Manual);
    let failing = device.alloc_pages(2).unwrap();
    let good = device.alloc_pages(1).unwrap();
    let failed_pages = controller.write(&failing, NodeId(1), None).unwrap().unwrap();
    let good_pages = controller.write(&good, NodeId(2), None).unwrap().unwrap();
    controller.engine().fail_next(Stream::Write);
    controller.engine().run_pending();
    assert_eq!(controller.completed_writes(), 2, "a failed copy is finished too");
    let acks = controller.take_write_acks(2).unwrap();
    let failure = acks[0].failed.as_ref().expect("the first write failed");
    assert_eq!(failure.kind(), ErrorKind::Device, "{failure}");
    assert!(failure.to_string().contains("failed"), "{failure}");
    assert_eq!(acks[0].storage_op, None);
    for page in &failed_pages {
        assert_eq!(controller.host().state(*page).unwrap(), PageState::Idle, "a failed write's page is freed");
    }
    assert_eq!(acks[1].failed, None);
    assert_eq!(controller.host().state(good_pages[0]).unwrap(), PageState::Synced);
    assert_eq!(controller.host().available(), HOST_PAGES - 1);
    controller.host().check_invariants().unwrap();
}

/// A load whose transfer fails: the forward pass's wait on the layer is an error, and so is taking its ack (the
/// device copy is unspecified; the engine must not use it).
#[test]
fn a_failed_load_is_an_error_for_the_forward_pass_and_the_ack() {
    let mut device = PagedSlots::new(DEVICE_PAGES, PAGE).unwrap();
    let mut controller = controller(Completion::Manual);
    let pages = host_only_pages(&mut controller, 1);
    controller.load(&pages, &device.alloc_pages(1).unwrap(), NodeId(2), None).unwrap();
    controller.engine().fail_next(Stream::Load);
    let slot = controller.start_loading(SlotReuse::Refuse).unwrap().unwrap();
    controller.layers().set_consumer(slot);
    let error = controller.layers().wait_until(0).unwrap_err();
    assert!(error.to_string().contains("failed"), "{error}");
    controller.engine().run_pending();
    let error = controller.take_load_acks(controller.completed_loads()).unwrap_err();
    assert!(error.to_string().contains("load of nodes"), "{error}");
}

/// A load's start as ring indices: the producer slot it took, or the busy slot it was refused.
fn ring(started: Result<Option<ProducerSlot>, SlotBusy>) -> Result<Option<usize>, usize> {
    started.map(|slot| slot.map(ProducerSlot::index)).map_err(|busy| busy.slot.index())
}
