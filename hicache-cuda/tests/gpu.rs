//! The CUDA engine against the CPU engine (the reference), on fresh random data with poisoned destinations: every
//! kernel (warp, TMA) × layout × MHA/MLA (and odd item sizes) × page size {1, 16, 64} × direction; the TMA kernel's
//! rings and pieces; per-layer events that order a consumer; transfers beside a busy kernel; the controller running
//! unchanged on the GPU; page-first host pools in shared memory, pinned in place. GPU tests are ignored unless run on a
//! GPU machine with `--include-ignored` (`docs/gpu.md`); the first test runs everywhere.

use hicache_core::config::IoBackend;
use hicache_core::controller::CacheController;
use hicache_core::device_slots::{DeviceSlotAllocator as _, PagedSlots};
use hicache_core::geometry::{KvDtype, KvGeometry, KvPart};
use std::sync::Arc;

use hicache_core::DeviceSlot;
use hicache_core::host_memory::{HostAllocation, HostMemory};
use hicache_core::host_pool::HostPageId;
use hicache_core::layout::{HostLayout, HostLayoutMap};
use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap, SlotReuse, TransferEngine, TransferEvent};
use hicache_core::tree::NodeId;
use hicache_cuda::{
    AutoMinRun, CopyKernel, CudaEngine, Device, DeviceBuffer, DevicePool, LaunchShape, StreamHandle, TmaShape,
    driver_present,
};
use rand::RngExt as _;
use rand::seq::SliceRandom as _;

const HOST_POISON: u8 = 0xab;
const DEVICE_POISON: u8 = 0xcd;

#[test]
fn opening_without_a_driver_is_a_clear_error() {
    if driver_present() {
        // a GPU machine: the tests below cover it
        return;
    }
    let error = Device::open(0).unwrap_err().to_string();
    assert!(error.contains("CUDA driver") && error.contains("cannot be loaded"), "{error}");
}

fn device() -> Device {
    Device::open(0).expect("a CUDA GPU")
}

/// A stream of the engine's own, made with its own CUDA bindings (cudarc here) in the GPU's primary context, as an
/// inference engine has one.
fn engine_stream(device: &Device) -> Arc<cudarc::driver::CudaStream> {
    cudarc::driver::CudaContext::new(device.ordinal()).unwrap().new_stream().unwrap()
}

/// The stream's driver handle, as hicache takes it.
fn handle(stream: &cudarc::driver::CudaStream) -> StreamHandle {
    // SAFETY: the stream is of the GPU's primary context and outlives every use the tests make of the handle
    unsafe { StreamHandle::from_raw(stream.cu_stream().cast()) }
}

/// The geometries checked: MHA and MLA items of 16-byte multiples, an 8-byte item, and an odd 6-byte one.
fn geometries() -> Vec<(&'static str, KvGeometry)> {
    vec![
        ("mha-512B", KvGeometry::mha(3, 2, 128, KvDtype::Bf16).unwrap()),
        ("mla-1152B", KvGeometry::mla(2, 512, 64, KvDtype::Bf16).unwrap()),
        ("mha-8B", KvGeometry::mha(2, 1, 4, KvDtype::Bf16).unwrap()),
        ("mha-6B", KvGeometry::mha(2, 1, 3, KvDtype::F16).unwrap()),
    ]
}

struct Pair {
    cuda: CudaEngine,
    cpu: CpuEngine,
    /// The CUDA engine's host pages, and the CPU engine's pages of the same indices.
    pages: Vec<HostPageId>,
    cpu_pages: Vec<HostPageId>,
    slots: Vec<DeviceSlot>,
    other_slots: Vec<DeviceSlot>,
}

/// Both engines over the same random device bytes and poisoned hosts, with a scattered set of pages and slots; the
/// GPU's device pool one slab or, with `per_layer`, a separate allocation per layer and part (an engine's tensors).
fn pair_of(
    device: &Device,
    geometry: KvGeometry,
    (layout, head_groups): (HostLayout, usize),
    page: usize,
    pages: usize,
    per_layer: bool,
) -> Pair {
    let device_pages = 2 * pages;
    let device_map = DeviceLayoutMap::new(geometry, device_pages * page).unwrap();
    let host_map =
        HostLayoutMap::new(geometry, layout, page, 2 * pages).unwrap().with_head_groups(head_groups).unwrap();
    // the page-first pools live in shared memory, pinned in place, as a 3FS deployment has them
    let allocation = match layout {
        HostLayout::PageFirst => HostAllocation::shared_memory(),
        _ => HostAllocation::Anonymous,
    };
    let host = Arc::new(HostMemory::new(host_map, &allocation).unwrap());
    let cuda = if per_layer {
        let regions = DevicePool::zeroed_per_layer(device, &device_map).unwrap();
        assert!(!regions.is_slab());
        CudaEngine::with_device_regions(device, device_map, regions, host).unwrap()
    } else {
        let device_pool = DeviceBuffer::zeroed(device, device_map.total_bytes()).unwrap();
        CudaEngine::with_pools(device, device_map, device_pool, host).unwrap()
    };
    let cpu = CpuEngine::new(device_map, host_map, Completion::Immediate).unwrap();
    let mut rng = rand::rng();
    let mut bytes = vec![0u8; device_map.total_bytes()];
    rng.fill(&mut bytes[..]);
    cuda.device_pool().write(0, &bytes).unwrap();
    cpu.with_device(|device| device.copy_from_slice(&bytes));
    cuda.host_memory().with_all_mut(|host| host.fill(HOST_POISON));
    cpu.with_host(|host| host.fill(HOST_POISON));
    let mut all: Vec<usize> = (0..2 * pages).collect();
    all.shuffle(&mut rng);
    let mut order: Vec<usize> = (0..device_pages).collect();
    order.shuffle(&mut rng);
    let slots_of = |device_pages: &[usize]| -> Vec<DeviceSlot> {
        device_pages.iter().flat_map(|&d| (0..page).map(move |offset| (d * page + offset) as DeviceSlot)).collect()
    };
    let slots = slots_of(&order[..pages]);
    order.shuffle(&mut rng);
    let other_slots = slots_of(&order[..pages]);
    let of = |memory: Arc<HostMemory>| -> Vec<HostPageId> {
        let ids = memory.all_pages();
        all[..pages].iter().map(|&index| ids[index]).collect()
    };
    let (pages, cpu_pages) = (of(cuda.host_memory()), of(cpu.host_memory()));
    Pair { cuda, cpu, pages, cpu_pages, slots, other_slots }
}

fn pair(device: &Device, geometry: KvGeometry, layout: HostLayout, page: usize, pages: usize) -> Pair {
    pair_of(device, geometry, (layout, 1), page, pages, false)
}

fn host_bytes(pair: &Pair) -> (Vec<u8>, Vec<u8>) {
    let memory = pair.cuda.host_memory();
    let gpu = memory.with_all_mut(|host| host.to_vec());
    if let Some(path) = memory.region().shared_memory() {
        // the shared-memory file another process would map holds the same bytes
        assert!(std::fs::read(path).unwrap() == gpu, "the pinned pool and its shared-memory file differ");
    }
    (gpu, pair.cpu.with_host(|host| host.to_vec()))
}

fn device_bytes(pair: &Pair) -> (Vec<u8>, Vec<u8>) {
    let mut gpu = vec![0u8; pair.cuda.device_pool().len()];
    pair.cuda.device_pool().read(0, &mut gpu).unwrap();
    (gpu, pair.cpu.with_device(|device| device.to_vec()))
}

/// A write of every layer, then a layer-by-layer load into other slots of a poisoned device pool, on both engines:
/// the bytes must match.
fn check_round_trip(pair: &mut Pair, what: &str) {
    let geometry = *pair.cuda.device_map().geometry();
    // write: device → host, all layers
    let start = pair.cuda.start_event().unwrap();
    pair.cuda.write_to_host(&pair.slots, &pair.pages, &start).unwrap().wait().unwrap();
    let start = pair.cpu.start_event().unwrap();
    pair.cpu.write_to_host(&pair.slots, &pair.cpu_pages, &start).unwrap().wait().unwrap();
    let (gpu, cpu) = host_bytes(pair);
    assert!(gpu == cpu, "{what}: write differs from the CPU engine");
    assert!(gpu.iter().any(|&byte| byte != HOST_POISON), "{what}: nothing was written");
    // load: host → device, every layer (one launch, or one per layer with copy-engine runs or the TMA kernel), into
    // other slots of a poisoned device pool
    let poison = vec![DEVICE_POISON; pair.cuda.device_pool().len()];
    pair.cuda.device_pool().write(0, &poison).unwrap();
    pair.cpu.with_device(|bytes| bytes.fill(DEVICE_POISON));
    let start = pair.cuda.start_event().unwrap();
    let events = pair.cuda.load_layers(geometry.layers, &pair.pages, &pair.other_slots, &start).unwrap();
    assert_eq!(events.len(), geometry.layers);
    // the last event means the whole load
    events.last().unwrap().wait().unwrap();
    assert!(events.iter().all(TransferEvent::is_complete), "{what}: the last layer done before another");
    let start = pair.cpu.start_event().unwrap();
    for layer in 0..geometry.layers {
        pair.cpu.load_layer(layer, &pair.cpu_pages, &pair.other_slots, &start).unwrap();
    }
    let (gpu, cpu) = device_bytes(pair);
    assert!(gpu == cpu, "{what}: load differs from the CPU engine");
}

/// The kernels this GPU has: the warp kernel, and the TMA kernel from sm_90.
fn copy_kernels(device: &Device) -> Vec<CopyKernel> {
    let (major, _) = device.compute_capability().unwrap();
    if major >= 9 { vec![CopyKernel::Warp, CopyKernel::Tma] } else { vec![CopyKernel::Warp] }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_layout_geometry_page_size_and_direction_matches_the_cpu_engine() {
    let device = device();
    // auto with a small threshold, so that one transfer mixes copy-engine runs and kernel items
    // (and auto with its measured thresholds: copies batched on CUDA 13 drivers)
    let backends = [
        (IoBackend::Kernel, None),
        (IoBackend::Direct, None),
        (IoBackend::Auto, Some(AutoMinRun::uniform(4096))),
        (IoBackend::Auto, None),
        (IoBackend::Batch, None),
    ];
    for (name, geometry) in geometries() {
        for layout in HostLayout::ALL {
            for page in [1, 16, 64] {
                for (backend, min_run) in backends {
                    for kernel in copy_kernels(&device) {
                        // the copy-engine backends use no kernel
                        if matches!(backend, IoBackend::Direct | IoBackend::Batch) && kernel == CopyKernel::Tma {
                            continue;
                        }
                        for per_layer in [false, true] {
                            let pool = if per_layer { "per-layer" } else { "slab" };
                            let what = format!("{name} {} page {page} {backend} {kernel:?} {pool}", layout.name());
                            let mut pair = pair_of(&device, geometry, (layout, 1), page, 24, per_layer);
                            pair.cuda.set_io_backend(backend, min_run).unwrap();
                            pair.cuda.set_copy_kernel(kernel).unwrap();
                            check_round_trip(&mut pair, &what);
                        }
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn page_unified_head_groups_match_the_cpu_engine() {
    let device = device();
    let geometries = [
        // rows of 1 KiB, 512 B and 256 B; of 8 B (the kernel's narrow path); of 6 B (its byte path)
        ("mha-2KiB", KvGeometry::mha(3, 8, 128, KvDtype::Bf16).unwrap()),
        ("mha-32B", KvGeometry::mha(2, 4, 4, KvDtype::Bf16).unwrap()),
        ("mha-36B", KvGeometry::mha(2, 6, 3, KvDtype::F16).unwrap()),
    ];
    for (name, geometry) in geometries {
        let heads = match geometry.attention {
            hicache_core::geometry::Attention::Mha { kv_heads, .. } => kv_heads,
            hicache_core::geometry::Attention::Mla { .. } => unreachable!("MHA geometries"),
        };
        for groups in (2..=heads).filter(|groups| heads.is_multiple_of(*groups)) {
            for page in [1, 16] {
                for kernel in copy_kernels(&device) {
                    for per_layer in [false, true] {
                        let what = format!("{name} groups {groups} page {page} {kernel:?} per-layer {per_layer}");
                        let mut pair =
                            pair_of(&device, geometry, (HostLayout::PageUnified, groups), page, 24, per_layer);
                        pair.cuda.set_copy_kernel(kernel).unwrap();
                        check_round_trip(&mut pair, &what);
                        // the copy engine would move such pages row by row: refused by name
                        let error = pair.cuda.set_io_backend(IoBackend::Direct, None).unwrap_err().to_string();
                        assert!(error.contains("io_backend") && error.contains("head groups"), "{what}: {error}");
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_tma_kernel_wraps_its_rings_and_cuts_items_into_pieces() {
    let device = device();
    if !copy_kernels(&device).contains(&CopyKernel::Tma) {
        eprintln!("this GPU is before sm_90: no TMA kernel (its refusal is checked below)");
        let geometry = KvGeometry::mha(2, 2, 128, KvDtype::Bf16).unwrap();
        let mut pair = pair(&device, geometry, HostLayout::LayerFirst, 16, 4);
        let error = pair.cuda.set_copy_kernel(CopyKernel::Tma).unwrap_err();
        assert!(error.to_string().contains("copy_kernel"), "{error}");
        return;
    }
    let cases = [
        // whole items, deep rings, few blocks: each lane's ring wraps many times
        (TmaShape::default(), 1),
        (TmaShape::default(), 3),
        // pieces: 1152 B items in three, 512 B in two, 4 KiB in eleven (the last one shorter)
        (TmaShape { max_piece: 384, ..TmaShape::default() }, 2),
        // the smallest ring, two slots per lane
        (TmaShape { shared_bytes: 32 * 2 * (1168 + 20), max_piece: 1 << 20 }, 5),
    ];
    let geometries = [
        ("mha-512B", KvGeometry::mha(3, 2, 128, KvDtype::Bf16).unwrap()),
        ("mla-1152B", KvGeometry::mla(2, 512, 64, KvDtype::Bf16).unwrap()),
        ("mha-4KiB", KvGeometry::mha(2, 16, 128, KvDtype::Bf16).unwrap()),
    ];
    for (name, geometry) in geometries {
        for layout in HostLayout::ALL {
            for (shape, blocks) in cases {
                let what = format!("{name} {} {shape:?} blocks {blocks}", layout.name());
                let mut pair = pair(&device, geometry, layout, 16, 40);
                pair.cuda.set_copy_kernel(CopyKernel::Tma).unwrap();
                pair.cuda.set_tma_shape(shape).unwrap();
                pair.cuda.set_launch_shape(LaunchShape { blocks, threads: 512 }).unwrap();
                check_round_trip(&mut pair, &what);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_consumer_that_waits_on_layer_i_sees_layer_i_complete() {
    let device = device();
    // a large load, so that a consumer not ordered after it would see stale bytes; loaded in one launch (per-layer
    // counters) by the warp kernel, one launch per layer by the TMA kernel
    let geometry = KvGeometry::mha(8, 8, 128, KvDtype::Bf16).unwrap();
    let checker = hicache_cuda::TransferKernel::load_extra(
        &device,
        r#"extern "C" __global__ void count_poison(const unsigned char* layer, const unsigned int* slots,
                unsigned long long count, unsigned long long item, unsigned long long slot_count,
                unsigned long long* poisoned) {
            // K then V of each listed slot, in 16-byte words
            const unsigned long long words = item / 16, total = 2 * count * words;
            unsigned long long seen = 0;
            for (unsigned long long w = blockIdx.x * blockDim.x + threadIdx.x; w < total;
                 w += (unsigned long long)gridDim.x * blockDim.x) {
                const unsigned long long part = w / (count * words), rest = w % (count * words);
                const unsigned long long slot = slots[rest / words];
                const uint4 v = *(const uint4*)(layer + (part * slot_count + slot) * item + (rest % words) * 16);
                seen += v.x == 0xcdcdcdcdu && v.y == 0xcdcdcdcdu && v.z == 0xcdcdcdcdu && v.w == 0xcdcdcdcdu;
            }
            if (seen) atomicAdd(poisoned, seen);
        }"#,
        "count_poison",
    )
    .unwrap();
    assert_eq!(DEVICE_POISON, 0xcd, "the checker's poison word");
    for kernel in copy_kernels(&device) {
        let mut pair = pair(&device, geometry, HostLayout::LayerFirst, 16, 1024);
        pair.cuda.set_copy_kernel(kernel).unwrap();
        let start = pair.cuda.start_event().unwrap();
        pair.cuda.write_to_host(&pair.slots, &pair.pages, &start).unwrap().wait().unwrap();
        let start = pair.cpu.start_event().unwrap();
        pair.cpu.write_to_host(&pair.slots, &pair.cpu_pages, &start).unwrap();
        let poison = vec![DEVICE_POISON; pair.cuda.device_pool().len()];
        pair.cuda.device_pool().write(0, &poison).unwrap();
        pair.cpu.with_device(|bytes| bytes.fill(DEVICE_POISON));
        let start = pair.cpu.start_event().unwrap();
        for layer in 0..geometry.layers {
            pair.cpu.load_layer(layer, &pair.cpu_pages, &pair.other_slots, &start).unwrap();
        }
        let consumer = engine_stream(&device);
        // the consumer: a kernel that counts the 16-byte words of the loaded slots of one layer still poisoned
        let map = pair.cuda.device_map();
        let item = geometry.item_bytes() as u64;
        let slots: Vec<u32> = pair.other_slots.clone();
        let slot_list = hicache_cuda::DeviceBuffer::zeroed(&device, 4 * slots.len()).unwrap();
        slot_list.write(0, &slots.iter().flat_map(|slot| slot.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let poisoned = hicache_cuda::DeviceBuffer::zeroed(&device, 8 * geometry.layers).unwrap();
        let start = pair.cuda.start_event().unwrap();
        let events = pair.cuda.load_layers(geometry.layers, &pair.pages, &pair.other_slots, &start).unwrap();
        let layer_bytes = map.item_offset(0, 1, KvPart::K) - map.item_offset(0, 0, KvPart::K);
        let mut seen = vec![vec![0u8; layer_bytes]; geometry.layers];
        for (layer, event) in events.iter().enumerate() {
            // the consumer's stream waits on layer i's event, checks layer i at once on the GPU, then copies the
            // whole of it out (every slot, K and V), all asynchronously while later layers load
            event.make_wait(handle(&consumer)).unwrap();
            // a slab pool: the layer's K and V regions follow each other
            let base = pair.cuda.device_pool().region(layer, 0).pointer();
            let (list, count, slot_count) = (slot_list.pointer(), slots.len() as u64, map.slots() as u64);
            let out = poisoned.pointer() + 8 * layer as u64;
            let mut launch = consumer.launch_builder(&checker);
            for arg in [&base, &list, &count, &item, &slot_count, &out] {
                cudarc::driver::PushKernelArg::arg(&mut launch, arg);
            }
            let config =
                cudarc::driver::LaunchConfig { grid_dim: (264, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match `count_poison`; every address it forms is inside the pool (the slots are
            // the load's) or the result buffer.
            unsafe { launch.launch(config) }.unwrap();
            // SAFETY: `seen[layer]` outlives the copy (the stream is synchronised below); the source is inside the
            // pool.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut seen[layer], base, consumer.cu_stream()) }.unwrap();
        }
        consumer.synchronize().unwrap();
        let mut counts = vec![0u8; 8 * geometry.layers];
        poisoned.read(0, &mut counts).unwrap();
        for (layer, count) in counts.chunks(8).enumerate() {
            let count = u64::from_le_bytes(count.try_into().unwrap());
            assert_eq!(count, 0, "{kernel:?} layer {layer}: poisoned words seen right after the layer's event");
        }
        for (layer, seen) in seen.iter().enumerate() {
            let from = map.item_offset(0, layer, KvPart::K);
            let expected = pair.cpu.with_device(|device| device[from..from + layer_bytes].to_vec());
            assert!(*seen == expected, "{kernel:?} layer {layer}: the consumer read before the layer was loaded");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn transfers_beside_a_busy_kernel_stay_correct() {
    let device = device();
    let busy = spin_kernel(&device);
    let compute = engine_stream(&device);
    let out = hicache_cuda::DeviceBuffer::zeroed(&device, 4 * 132 * 4 * 1024).unwrap();
    let geometry = KvGeometry::mha(4, 8, 128, KvDtype::Bf16).unwrap();
    let mut pair = pair(&device, geometry, HostLayout::PageFirst, 16, 512);
    for _ in 0..3 {
        // every SM busy for a while on the compute stream
        let rounds: u64 = 2_000_000;
        let pointer = out.pointer();
        let mut launch = compute.launch_builder(&busy);
        cudarc::driver::PushKernelArg::arg(&mut launch, &pointer);
        cudarc::driver::PushKernelArg::arg(&mut launch, &rounds);
        let config =
            cudarc::driver::LaunchConfig { grid_dim: (4 * 132, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `out` holds one float per thread of this grid.
        unsafe { launch.launch(config) }.unwrap();
        let start = pair.cuda.start_event().unwrap();
        pair.cuda.write_to_host(&pair.slots, &pair.pages, &start).unwrap().wait().unwrap();
        let start = pair.cpu.start_event().unwrap();
        pair.cpu.write_to_host(&pair.slots, &pair.cpu_pages, &start).unwrap();
        let (gpu, cpu) = host_bytes(&pair);
        assert!(gpu == cpu, "write beside the busy kernel");
        compute.synchronize().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_engine_sized_from_a_config_and_one_that_does_not_fit() {
    let device = device();
    let geometry = KvGeometry::mha(4, 2, 64, KvDtype::Bf16).unwrap();
    let config = hicache_core::config::HiCacheConfig {
        page_size: 16,
        hicache_ratio: 3.0,
        mem_layout: HostLayout::LayerFirst,
        io_backend: IoBackend::Auto,
        ..hicache_core::config::HiCacheConfig::default()
    };
    let engine = CudaEngine::for_config(&device, geometry, 1000, &config).unwrap();
    assert_eq!(engine.device_map().slots(), 992, "whole pages");
    assert_eq!(engine.host_map().tokens(), 2976, "3 × the device pool");
    // 1 PB of host pool: refused, naming the field
    let huge = hicache_core::config::HiCacheConfig { hicache_size: 1_000_000, ..config.clone() };
    let error = CudaEngine::for_config(&device, geometry, 1000, &huge).unwrap_err().to_string();
    assert!(error.contains("hicache_size") && error.contains("GB available"), "{error}");
    // more device memory than the GPU has
    let error = CudaEngine::for_config(&device, geometry, 100_000_000, &config).unwrap_err().to_string();
    assert!(error.contains("device_tokens"), "{error}");
    // batch where the driver has cuMemcpyBatchAsync_v2 (CUDA 13), refused naming the field elsewhere
    let batch = hicache_core::config::HiCacheConfig { io_backend: IoBackend::Batch, ..config };
    match CudaEngine::for_config(&device, geometry, 1000, &batch) {
        Ok(engine) => assert_eq!(engine.device_map().slots(), 992),
        Err(error) => {
            assert!(error.to_string().contains("io_backend") && error.to_string().contains("CUDA 13"), "{error}")
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_controller_runs_unchanged_on_the_gpu() {
    let device = device();
    let geometry = KvGeometry::mha(4, 2, 64, KvDtype::Bf16).unwrap();
    let (page, device_pages, host_pages) = (16, 32, 64);
    let engine = CudaEngine::new(
        &device,
        DeviceLayoutMap::new(geometry, device_pages * page).unwrap(),
        HostLayoutMap::new(geometry, HostLayout::PageFirstDirect, page, host_pages).unwrap(),
    )
    .unwrap();
    let mut bytes = vec![0u8; engine.device_pool().len()];
    rand::rng().fill(&mut bytes[..]);
    engine.device_pool().write(0, &bytes).unwrap();
    let map = engine.device_map();
    let mut controller = CacheController::new(engine, page, host_pages, device_pages, geometry.layers).unwrap();
    // the engine's device slots
    let mut slots_of_engine = PagedSlots::new(device_pages, page).unwrap();
    let slots = slots_of_engine.alloc_pages(8).unwrap();
    let host = controller.write(&slots, NodeId(1), None).unwrap().unwrap();
    let acks = controller.take_all_write_acks().unwrap();
    assert_eq!(acks.len(), 1);
    controller.evict_device(&host).unwrap();
    slots_of_engine.free(&slots).unwrap();
    let loaded = slots_of_engine.alloc_pages(host.len()).unwrap();
    controller.load(&host, &loaded, NodeId(2), None).unwrap();
    let slot = controller.start_loading(SlotReuse::Wait).unwrap().unwrap();
    assert!(slot.is_some());
    controller.layers().set_consumer(slot);
    // the forward pass: the model's stream waits on each layer's event, the CPU does not
    let compute = engine_stream(&device);
    for layer in 0..geometry.layers {
        hicache_cuda::wait_layer_on(controller.layers(), layer, handle(&compute)).unwrap();
    }
    compute.synchronize().unwrap();
    assert!(controller.layers().consumer_event(geometry.layers - 1).unwrap().is_complete());
    let done = controller.completed_loads();
    controller.take_load_acks(done.max(1)).unwrap();
    // every item of every loaded slot equals the original slot's
    let item = geometry.item_bytes();
    let mut got = vec![0u8; controller.engine().device_pool().len()];
    controller.engine().device_pool().read(0, &mut got).unwrap();
    for (&from, &to) in slots.iter().zip(&loaded) {
        for layer in 0..geometry.layers {
            for &part in geometry.parts() {
                let (a, b) = (map.item_offset(from as usize, layer, part), map.item_offset(to as usize, layer, part));
                assert_eq!(got[b..b + item], bytes[a..a + item], "slot {from} → {to}, layer {layer}");
            }
        }
    }
}

/// A kernel that keeps the GPU busy for a while on the stream it is launched on.
fn spin_kernel(device: &Device) -> cudarc::driver::CudaFunction {
    hicache_cuda::TransferKernel::load_extra(
        device,
        r#"extern "C" __global__ void spin(float* out, unsigned long long rounds) {
            float x = threadIdx.x;
            for (unsigned long long i = 0; i < rounds; ++i) { x = x * 0.999999f + 0.5f; }
            out[blockIdx.x * blockDim.x + threadIdx.x] = x;
        }"#,
        "spin",
    )
    .unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_write_waits_for_the_work_on_a_lent_caller_stream() {
    let device = device();
    let spin = spin_kernel(&device);
    let geometry = KvGeometry::mha(4, 8, 128, KvDtype::Bf16).unwrap();
    let mut pair = pair(&device, geometry, HostLayout::PageFirst, 16, 256);
    let compute = engine_stream(&device);
    let scratch = DeviceBuffer::zeroed(&device, 4 * 132 * 1024).unwrap();
    let (pool_pointer, pool_bytes) = (pair.cuda.device_pool().region(0, 0).pointer(), pair.cuda.device_pool().len());
    assert!(pair.cuda.device_pool().is_slab(), "one region holds the whole pool");
    // first with the engine's own caller stream (the control: nothing orders the write after the compute stream),
    // then with the compute stream lent
    for (lent, fill) in [(false, 0x11u8), (true, 0x22), (true, 0x33)] {
        if lent {
            pair.cuda.set_caller_stream(handle(&compute));
        }
        // the engine's work on its stream: a long kernel, then it writes every byte of the KV pool
        let (pointer, rounds) = (scratch.pointer(), 4_000_000u64);
        let mut launch = compute.launch_builder(&spin);
        cudarc::driver::PushKernelArg::arg(&mut launch, &pointer);
        cudarc::driver::PushKernelArg::arg(&mut launch, &rounds);
        let config =
            cudarc::driver::LaunchConfig { grid_dim: (132, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `scratch` holds one float per thread of this grid.
        unsafe { launch.launch(config) }.unwrap();
        // SAFETY: the range is the engine's device pool; the write below reads it (ordered after this write only
        // when the stream is lent, which is what the test shows).
        unsafe { cudarc::driver::result::memset_d8_async(pool_pointer, fill, pool_bytes, compute.cu_stream()) }
            .unwrap();
        // with the stream lent, the start event is recorded on it: the write runs after the kernel and the fill
        let start = pair.cuda.start_event().unwrap();
        pair.cuda.write_to_host(&pair.slots, &pair.pages, &start).unwrap().wait().unwrap();
        let host = pair.cuda.host_memory();
        let (map, item) = (*host.map(), geometry.item_bytes());
        let stale = host.with_all_mut(|bytes| {
            let mut stale = 0;
            for page in &pair.pages {
                for token in page.first_token(16)..page.first_token(16) + 16 {
                    for (layer, part) in (0..geometry.layers).flat_map(|layer| [(layer, KvPart::K), (layer, KvPart::V)])
                    {
                        let at = map.item_offset(token, layer, part);
                        stale += usize::from(!bytes[at..at + item].iter().all(|&byte| byte == fill));
                    }
                }
            }
            stale
        });
        compute.synchronize().unwrap();
        if lent {
            assert_eq!(stale, 0, "items the write copied before the lent stream's fill");
        } else {
            eprintln!("control (caller stream not lent): {stale} items copied before the compute stream's fill");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn dropping_the_engine_waits_for_its_transfers() {
    let device = device();
    let geometry = KvGeometry::mha(8, 8, 128, KvDtype::Bf16).unwrap();
    let mut pair = pair(&device, geometry, HostLayout::LayerFirst, 16, 1024);
    let host = pair.cuda.host_memory();
    let start = pair.cuda.start_event().unwrap();
    let event = pair.cuda.write_to_host(&pair.slots, &pair.pages, &start).unwrap();
    let start = pair.cpu.start_event().unwrap();
    pair.cpu.write_to_host(&pair.slots, &pair.cpu_pages, &start).unwrap();
    let expected = pair.cpu.with_host(|bytes| bytes.to_vec());
    // dropped with the write (tens of MB) still in flight: the drop waits for it, then unpins the host pool
    drop(pair.cuda);
    assert!(event.is_complete(), "the write finished before the engine was gone");
    let got = host.with_all_mut(|bytes| bytes.to_vec());
    assert!(got == expected, "the host pool after the drop differs from the CPU engine's");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_controller_learns_the_load_rate_from_the_engines_timed_events() {
    use hicache_core::collective::SingleRank;
    use hicache_core::config::HiCacheConfig;
    use hicache_core::controller::StorageSettings;
    use hicache_core::namespace::StorageNamespace;
    use hicache_core::rate_limit::SystemClock;
    use hicache_core::storage::MemoryStorage;

    let device = device();
    let geometry = KvGeometry::mha(32, 8, 128, KvDtype::Bf16).unwrap();
    let (page, device_pages, host_pages) = (16, 256, 512);
    let engine = CudaEngine::new(
        &device,
        DeviceLayoutMap::new(geometry, device_pages * page).unwrap(),
        HostLayoutMap::new(geometry, HostLayout::PageFirst, page, host_pages).unwrap(),
    )
    .unwrap();
    assert!(engine.times_loads());
    // a prior far from any H200 (1 MB/s): the rate the plan takes after the load is the measured one
    let config = HiCacheConfig { page_size: page, prior_load_gbps: 0.001, ..HiCacheConfig::default() };
    let settings = StorageSettings::from_config(&config, host_pages * page, device_pages * page, false, 0).unwrap();
    let namespace = StorageNamespace::single_rank("m", geometry, HostLayout::PageFirst, page);
    let storage = Arc::new(MemoryStorage::new(&namespace));
    let mut controller = CacheController::new(engine, page, host_pages, device_pages, geometry.layers)
        .unwrap()
        .with_storage(storage, settings, Arc::new(SystemClock::new()))
        .unwrap();
    let prior = controller.agreed_rates().unwrap().load_bytes_per_s;
    let mut slots_of_engine = PagedSlots::new(device_pages, page).unwrap();
    let slots = slots_of_engine.alloc_pages(128).unwrap();
    let host = controller.write(&slots, NodeId(1), None).unwrap().unwrap();
    controller.take_all_write_acks().unwrap();
    controller.evict_device(&host).unwrap();
    slots_of_engine.free(&slots).unwrap();
    let loaded = slots_of_engine.alloc_pages(host.len()).unwrap();
    let wall = std::time::Instant::now();
    controller.load(&host, &loaded, NodeId(2), None).unwrap();
    controller.start_loading(SlotReuse::Wait).unwrap().unwrap();
    controller.engine().synchronize().unwrap();
    let wall = wall.elapsed().as_secs_f64();
    let done = controller.completed_loads();
    assert_eq!(done, 1);
    controller.take_load_acks(done).unwrap();
    controller.tick(&mut SingleRank).unwrap();
    let measured = controller.agreed_rates().unwrap().load_bytes_per_s;
    // the device's time for the load is within the wall time around it: the rate is at least bytes / wall
    let bytes = (host.len() * geometry.bytes_per_token() * page) as f64;
    assert!(measured != prior && measured >= bytes / wall, "prior {prior}, measured {measured}, {bytes} B in {wall} s");
    eprintln!(
        "load of {bytes} B timed on the device: {:.2} GB/s (wall time around it: {:.2} GB/s)",
        measured / 1e9,
        bytes / wall / 1e9
    );
}
