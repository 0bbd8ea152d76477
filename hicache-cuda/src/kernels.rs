//! The transfer kernels, compiled at run time by NVRTC to a cubin for the GPU's own architecture, and cached on disk.
//!
//! The warp kernel moves items (one token × one layer × K or V) between the device pool (`[layer][part][slot][item]`)
//! and the host pool in any of the four host layouts, in either direction; under `page_unified` with several head
//! groups the unit is a row (one head group's share of an item), as the layout keeps each group's rows apart. A warp
//! per two units at a time, 16-byte
//! accesses with up to eight loads in flight per lane when the addresses and the item size allow, 8-byte or
//! single-byte otherwise. Items are numbered token-fastest, so neighbouring warps touch neighbouring slots of one
//! layer. The host pool is read and written through its device mapping (pinned, mapped memory), so the SMs drive PCIe
//! directly; a grid-stride loop lets a small, fixed number of blocks (the "block quota") cover any transfer, leaving
//! the other SMs to the model. The TMA kernel (sm_90 and later) moves the same items with the bulk-copy unit through
//! shared memory; [`TmaPlan`] sizes its rings. On the H200 it is no faster (`docs/gpu.md`), so it is opt-in.

use std::hash::{Hash as _, Hasher as _};
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, sys};
use cudarc::nvrtc::{Ptx, result as nvrtc, sys as nvrtc_sys};
use hicache_core::Error;

use crate::device::Device;
use crate::driver::driver;

/// The kernel's source.
pub(crate) const SOURCE: &str = r#"
struct Shape {
    const unsigned long long* device_bases; unsigned char* host_base;
    const unsigned int* host_tokens; const unsigned int* device_slots;
    unsigned long long tokens; unsigned long long first_layer; unsigned long long parts; unsigned long long groups;
    unsigned long long item_bytes; unsigned long long device_slot_count; unsigned long long host_token_count;
    unsigned long long host_pages; unsigned long long page_size; unsigned long long total_layers;
    unsigned int layout; unsigned int to_device;
};

// The source and destination of unit `item` (token-fastest numbering): one row of `item_bytes`, head group `group`
// of an item of `groups` rows (one group: the whole item).
__device__ __forceinline__ void locate(const Shape& s, unsigned long long item,
                                       const unsigned char** src, unsigned char** dst)
{
    const unsigned long long t = item % s.tokens;
    const unsigned long long rest = item / s.tokens;
    const unsigned long long group = rest % s.groups;
    const unsigned long long part = (rest / s.groups) % s.parts;
    const unsigned long long layer = s.first_layer + rest / s.groups / s.parts;
    const unsigned long long slot = s.device_slots[t];
    const unsigned long long token = s.host_tokens[t];
    // the device pool: one region per (layer, part), each [slot][item], through the table of their bases; an item's
    // head groups side by side
    unsigned char* const d = (unsigned char*)s.device_bases[layer * s.parts + part]
        + (slot * s.groups + group) * s.item_bytes;
    const unsigned long long page = token / s.page_size;
    const unsigned long long in_page = token % s.page_size;
    unsigned long long h;
    if (s.layout == 0) {
        h = ((part * s.total_layers + layer) * s.host_token_count + token) * s.item_bytes;
    } else if (s.layout == 1) {
        h = ((part * s.host_token_count + token) * s.total_layers + layer) * s.item_bytes;
    } else if (s.layout == 2) {
        h = (((part * s.host_pages + page) * s.total_layers + layer) * s.page_size + in_page) * s.item_bytes;
    } else {
        // page_unified: [page][group][layer][part][token in page][row]
        h = ((((page * s.groups + group) * s.total_layers + layer) * s.parts + part) * s.page_size + in_page)
            * s.item_bytes;
    }
    *src = s.to_device ? s.host_base + h : d;
    *dst = s.to_device ? d : s.host_base + h;
}

// One item by one warp, at the widest access its alignment allows.
__device__ __forceinline__ void copy_one(const unsigned char* src, unsigned char* dst, unsigned long long bytes,
                                         unsigned int lane)
{
    const unsigned long long alignment = (unsigned long long)src | (unsigned long long)dst | bytes;
    if ((alignment & 15) == 0) {
        for (unsigned long long o = lane * 16ull; o < bytes; o += 32 * 16) {
            *(uint4*)(dst + o) = *(const uint4*)(src + o);
        }
    } else if ((alignment & 7) == 0) {
        for (unsigned long long o = lane * 8ull; o < bytes; o += 32 * 8) {
            *(unsigned long long*)(dst + o) = *(const unsigned long long*)(src + o);
        }
    } else {
        for (unsigned long long o = lane; o < bytes; o += 32) {
            dst[o] = src[o];
        }
    }
}

extern "C" __global__ void hicache_transfer(
    const unsigned long long* device_bases, unsigned char* host_base,
    const unsigned int* host_tokens, const unsigned int* device_slots,
    unsigned long long tokens, unsigned int first_layer, unsigned int layer_count, unsigned int parts,
    unsigned int groups, unsigned long long item_bytes, unsigned long long device_slot_count,
    unsigned long long host_token_count, unsigned long long host_pages, unsigned long long page_size,
    unsigned int total_layers, unsigned int layout, unsigned int to_device)
{
    const Shape s = {device_bases, host_base, host_tokens, device_slots, tokens, first_layer, parts, groups,
                     item_bytes, device_slot_count, host_token_count, host_pages, page_size, total_layers, layout,
                     to_device};
    const unsigned long long items = tokens * layer_count * parts * groups;
    const unsigned int lane = threadIdx.x & 31;
    const unsigned long long warp = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const unsigned long long warps = ((unsigned long long)gridDim.x * blockDim.x) >> 5;
    // two items per warp at a time, up to four 16-byte loads each in flight per lane before any store: host reads
    // over PCIe are long, and small items (MLA's 1152 B) alone keep too few bytes in flight
    for (unsigned long long a = warp; a < items; a += 2 * warps) {
        const unsigned long long b = a + warps;
        const bool two = b < items;
        const unsigned char* sa; unsigned char* da;
        const unsigned char* sb = 0; unsigned char* db = 0;
        locate(s, a, &sa, &da);
        if (two) locate(s, b, &sb, &db);
        const unsigned long long alignment = (unsigned long long)sa | (unsigned long long)da | item_bytes
            | (unsigned long long)sb | (unsigned long long)db;
        if ((alignment & 15) != 0) {
            copy_one(sa, da, item_bytes, lane);
            if (two) copy_one(sb, db, item_bytes, lane);
            continue;
        }
        const uint4* __restrict__ fa = (const uint4*)sa;
        const uint4* __restrict__ fb = (const uint4*)sb;
        uint4* __restrict__ ta = (uint4*)da;
        uint4* __restrict__ tb = (uint4*)db;
        const unsigned long long chunks = item_bytes >> 4;
        for (unsigned long long c = lane; c < chunks; c += 4 * 32) {
            const bool h1 = c + 32 < chunks, h2 = c + 64 < chunks, h3 = c + 96 < chunks;
            uint4 a0 = fa[c], a1, a2, a3, b0, b1, b2, b3;
            if (h1) a1 = fa[c + 32];
            if (h2) a2 = fa[c + 64];
            if (h3) a3 = fa[c + 96];
            if (two) {
                b0 = fb[c];
                if (h1) b1 = fb[c + 32];
                if (h2) b2 = fb[c + 64];
                if (h3) b3 = fb[c + 96];
            }
            ta[c] = a0;
            if (h1) ta[c + 32] = a1;
            if (h2) ta[c + 64] = a2;
            if (h3) ta[c + 96] = a3;
            if (two) {
                tb[c] = b0;
                if (h1) tb[c + 32] = b1;
                if (h2) tb[c + 64] = b2;
                if (h3) tb[c + 96] = b3;
            }
        }
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned int shared_address(const void* pointer)
{
    return (unsigned int)__cvta_generic_to_shared(pointer);
}

// The source, destination and length of unit `unit`: piece `unit % pieces` of item `unit / pieces`.
__device__ __forceinline__ unsigned int locate_piece(const Shape& s, unsigned long long pieces,
                                                     unsigned int piece_bytes, unsigned long long unit,
                                                     const unsigned char** src, unsigned char** dst)
{
    const unsigned long long item = unit / pieces;
    const unsigned long long offset = (unit - item * pieces) * piece_bytes;
    locate(s, item, src, dst);
    *src += offset;
    *dst += offset;
    const unsigned long long left = s.item_bytes - offset;
    return left < piece_bytes ? (unsigned int)left : piece_bytes;
}

// Starts the bulk copy of `bytes` from global `src` into shared `slot`, completing on `barrier`.
__device__ __forceinline__ void bulk_load(unsigned int slot, const unsigned char* src, unsigned int bytes,
                                          unsigned int barrier)
{
    asm volatile("{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }"
                 :: "r"(barrier), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(slot), "l"(src), "r"(bytes), "r"(barrier) : "memory");
}

__device__ __forceinline__ void wait_barrier(unsigned int barrier, unsigned int parity)
{
    unsigned int done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(barrier), "r"(parity) : "memory");
    } while (!done);
}
#endif

// The same transfer through the Tensor Memory Accelerator (sm_90 and later): each lane of a one-warp block owns a
// ring of `depth` shared-memory slots of `piece_bytes` and keeps up to `depth - 1` bulk copies from the source in
// flight, each completing on the slot's mbarrier, then writes each slot out with a bulk copy to the destination.
// The copy unit, not the SM's load path, issues the requests (on the H200's PCIe no faster than the warp kernel, and
// needing more blocks for the same rate: docs/gpu.md; reported faster over NVLink-C2C). Units are item pieces
// (items longer than a slot are cut into pieces); neighbouring lanes take neighbouring units (token-fastest), so
// neighbouring tokens of a page are read together. Needs 16-byte aligned pools and pieces that are multiples of
// 16 bytes (the host checks); the dynamic shared memory is 32 * depth * (piece_bytes + 20) bytes: the slots, then
// each slot's mbarrier, destination and length.
extern "C" __global__ void __launch_bounds__(32) hicache_transfer_tma(
    const unsigned long long* device_bases, unsigned char* host_base,
    const unsigned int* host_tokens, const unsigned int* device_slots,
    unsigned long long tokens, unsigned int first_layer, unsigned int layer_count, unsigned int parts,
    unsigned int groups, unsigned long long item_bytes, unsigned long long device_slot_count,
    unsigned long long host_token_count, unsigned long long host_pages, unsigned long long page_size,
    unsigned int total_layers, unsigned int layout, unsigned int to_device, unsigned int piece_bytes,
    unsigned int depth)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char ring[];
    const Shape s = {device_bases, host_base, host_tokens, device_slots, tokens, first_layer, parts, groups,
                     item_bytes, device_slot_count, host_token_count, host_pages, page_size, total_layers, layout,
                     to_device};
    const unsigned int lane = threadIdx.x & 31;
    const unsigned long long pieces = (item_bytes + piece_bytes - 1) / piece_bytes;
    const unsigned long long units = tokens * layer_count * parts * groups * pieces;
    const unsigned long long first = (unsigned long long)blockIdx.x * 32 + lane;
    const unsigned long long stride = (unsigned long long)gridDim.x * 32;
    const unsigned long long count = first < units ? (units - first - 1) / stride + 1 : 0;
    unsigned char* slots = ring + (unsigned long long)lane * depth * piece_bytes;
    unsigned long long* barriers = (unsigned long long*)(ring + 32ull * depth * piece_bytes) + lane * depth;
    unsigned char** targets = (unsigned char**)(ring + 32ull * depth * (piece_bytes + 8)) + lane * depth;
    unsigned int* lengths = (unsigned int*)(ring + 32ull * depth * (piece_bytes + 16)) + lane * depth;
    for (unsigned int k = 0; k < depth; ++k) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(shared_address(barriers + k)) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    const unsigned long long ahead = count < depth ? count : depth;
    for (unsigned long long i = 0; i < ahead; ++i) {
        const unsigned char* src;
        lengths[i] = locate_piece(s, pieces, piece_bytes, first + i * stride, &src, &targets[i]);
        bulk_load(shared_address(slots + i * piece_bytes), src, lengths[i], shared_address(barriers + i));
    }
    for (unsigned long long i = 0; i < count; ++i) {
        const unsigned int slot = (unsigned int)(i % depth);
        wait_barrier(shared_address(barriers + slot), (unsigned int)((i / depth) & 1));
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(targets[slot]), "r"(shared_address(slots + (unsigned long long)slot * piece_bytes)),
                        "r"(lengths[slot]) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        // refill the previous unit's slot, whose write-out was committed one unit ago
        const unsigned long long next = i - 1 + depth;
        if (i >= 1 && next < count) {
            const unsigned int free = (unsigned int)((i - 1) % depth);
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            const unsigned char* src;
            lengths[free] = locate_piece(s, pieces, piece_bytes, first + next * stride, &src, &targets[free]);
            bulk_load(shared_address(slots + (unsigned long long)free * piece_bytes), src, lengths[free],
                      shared_address(barriers + free));
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#else
    __trap();
#endif
}
"#;

/// Shared-memory bytes of one TMA slot beyond its data: the mbarrier (8), the destination (8), the length (4).
const TMA_SLOT_OVERHEAD: usize = 20;

/// Most slots in one lane's ring.
const TMA_MAX_DEPTH: usize = 8;

/// How the TMA kernel cuts items into pieces and how deep each lane's ring is, for one item size and a block's
/// shared-memory budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaPlan {
    /// Bytes of one piece (a multiple of 16); an item's last piece may be shorter.
    pub piece_bytes: u32,
    /// Slots per lane (at least 2: one being written out while the next loads).
    pub depth: u32,
    /// Dynamic shared memory of one block: `32 * depth * (piece_bytes + 20)`.
    pub shared_bytes: u32,
}

impl TmaPlan {
    /// The plan for items of `item_bytes` in `shared_budget` bytes per block, pieces at most `max_piece` bytes;
    /// `None` when the TMA cannot move such items (not a multiple of 16 bytes) or the budget holds no two slots.
    pub fn new(item_bytes: usize, shared_budget: usize, max_piece: usize) -> Option<Self> {
        if item_bytes == 0 || !item_bytes.is_multiple_of(16) {
            return None;
        }
        let per_lane = shared_budget / 32;
        let cap = ((per_lane / 2).saturating_sub(TMA_SLOT_OVERHEAD)).min(max_piece) / 16 * 16;
        if cap == 0 {
            return None;
        }
        let pieces = item_bytes.div_ceil(cap);
        let piece = item_bytes.div_ceil(pieces).next_multiple_of(16);
        let depth = (per_lane / (piece + TMA_SLOT_OVERHEAD)).min(TMA_MAX_DEPTH);
        Some(Self {
            piece_bytes: u32::try_from(piece).ok()?,
            depth: depth as u32,
            shared_bytes: u32::try_from(32 * depth * (piece + TMA_SLOT_OVERHEAD)).ok()?,
        })
    }
}

/// The compiled kernels, loaded in a context: the warp kernel (any GPU) and, from sm_90, the TMA kernel.
#[derive(Debug, Clone)]
pub struct TransferKernel {
    _module: Arc<CudaModule>,
    function: CudaFunction,
    tma: Option<CudaFunction>,
    /// Dynamic shared memory a block of the TMA kernel may take (0 without it).
    tma_shared_limit: usize,
}

impl TransferKernel {
    /// Compiles (or takes from the cache) and loads the kernel for `device`.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] with NVRTC's log when compilation fails, or the driver's message when loading does.
    pub fn load(device: &Device) -> Result<Self, Error> {
        let (major, minor) = device.compute_capability()?;
        let arch = format!("sm_{major}{minor}");
        let cubin = match cache_path(&arch) {
            Some(path) => match std::fs::read(&path) {
                Ok(cubin) if !cubin.is_empty() => cubin,
                _ => {
                    let cubin = compile(SOURCE, &arch)?;
                    if let Some(dir) = path.parent() {
                        // a cache that cannot be written only costs a compile next time
                        let _ = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, &cubin));
                    }
                    cubin
                }
            },
            None => compile(SOURCE, &arch)?,
        };
        let module = device.context().load_module(Ptx::from_binary(cubin)).map_err(driver("load the kernel"))?;
        let function = module.load_function("hicache_transfer").map_err(driver("find the kernel"))?;
        let (tma, tma_shared_limit) = if major >= 9 {
            let tma = module.load_function("hicache_transfer_tma").map_err(driver("find the TMA kernel"))?;
            let limit = device
                .context()
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
                .map_err(driver("shared memory per block"))?;
            let limit = usize::try_from(limit).unwrap_or(0);
            tma.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                i32::try_from(limit).unwrap_or(i32::MAX),
            )
            .map_err(driver("raise the TMA kernel's shared memory"))?;
            (Some(tma), limit)
        } else {
            (None, 0)
        };
        Ok(Self { _module: module, function, tma, tma_shared_limit })
    }

    pub(crate) fn function(&self) -> &CudaFunction {
        &self.function
    }

    /// The TMA kernel and the most dynamic shared memory one of its blocks may take; `None` before sm_90.
    pub(crate) fn tma(&self) -> Option<(&CudaFunction, usize)> {
        self.tma.as_ref().map(|function| (function, self.tma_shared_limit))
    }

    /// Compiles another kernel the same way (NVRTC, a cubin for the GPU's architecture; not cached) and returns
    /// `name` from it: the GPU tests' helper kernels (feature `testing`: it hands out a cudarc type).
    ///
    /// # Errors
    ///
    /// As [`load`](Self::load).
    #[cfg(feature = "testing")]
    pub fn load_extra(device: &Device, source: &str, name: &str) -> Result<CudaFunction, Error> {
        let (major, minor) = device.compute_capability()?;
        let cubin = compile(source, &format!("sm_{major}{minor}"))?;
        let module = device.context().load_module(Ptx::from_binary(cubin)).map_err(driver("load a kernel"))?;
        module.load_function(name).map_err(driver("find a kernel"))
    }
}

/// `$HICACHE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/hicache`, else `~/.cache/hicache`; the file is named by the
/// architecture and a hash of the source.
fn cache_path(arch: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("HICACHE_KERNEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|dir| PathBuf::from(dir).join("hicache")))
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/hicache")))?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    SOURCE.hash(&mut hasher);
    Some(dir.join(format!("transfer-{arch}-{:016x}.cubin", hasher.finish())))
}

/// NVRTC: the source to a cubin for `arch` (a cubin, not PTX: PTX from an NVRTC newer than the driver would not load).
fn compile(source: &str, arch: &str) -> Result<Vec<u8>, Error> {
    let failed = |message: String| Error::device("compile a kernel", message);
    let source = std::ffi::CString::new(source).map_err(|_| failed("the source contains a NUL byte".into()))?;
    let program = nvrtc::create_program(&source, None).map_err(|error| failed(format!("{error:?}")))?;
    let options = [format!("--gpu-architecture={arch}"), "--std=c++17".to_owned()];
    // SAFETY: `program` was just created and is destroyed below, once; the options are valid C strings.
    let compiled = unsafe { nvrtc::compile_program(program, &options) };
    let result = match compiled {
        Err(error) => {
            // SAFETY: the program exists; the log is a NUL-terminated string the call returns owned.
            let log = unsafe { nvrtc::get_program_log(program) }
                .map(|log| log.iter().map(|&byte| byte as u8 as char).collect::<String>())
                .unwrap_or_default();
            Err(failed(format!("{error:?}: {}", log.trim_end_matches('\0'))))
        }
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: the program compiled; the driver writes the cubin's size, then the cubin into a buffer that big.
            let sized = unsafe { nvrtc_sys::nvrtcGetCUBINSize(program, &mut size) };
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` holds `size` bytes, as NVRTC asked.
            let got = unsafe { nvrtc_sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast()) };
            match (sized, got) {
                (nvrtc_sys::nvrtcResult::NVRTC_SUCCESS, nvrtc_sys::nvrtcResult::NVRTC_SUCCESS) => Ok(cubin),
                other => Err(failed(format!("getting the cubin: {other:?}"))),
            }
        }
    };
    // SAFETY: created above and not used after this.
    let _ = unsafe { nvrtc::destroy_program(program) };
    result
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// A plan's pieces are 16-byte multiples that cover the item exactly (none empty), its ring has at least two
        /// slots, and it fits the budget.
        #[test]
        fn tma_plans_cover_items_within_the_budget(
            vectors in 1usize..4096,
            budget in 0usize..(256 << 10),
            max_piece in 0usize..(64 << 10),
        ) {
            let item = vectors * 16;
            let Some(plan) = TmaPlan::new(item, budget, max_piece) else {
                // refused only when no two slots of 16 bytes fit, or pieces may not be 16 bytes
                prop_assert!(budget / 32 / 2 < 16 + TMA_SLOT_OVERHEAD || max_piece < 16);
                return Ok(());
            };
            let piece = plan.piece_bytes as usize;
            prop_assert!(piece > 0 && piece.is_multiple_of(16) && piece <= max_piece);
            // the kernel's piece count: every piece starts inside the item
            let pieces = item.div_ceil(piece);
            prop_assert!((pieces - 1) * piece < item && pieces * piece >= item);
            prop_assert!(plan.depth >= 2 && plan.depth as usize <= TMA_MAX_DEPTH);
            prop_assert_eq!(plan.shared_bytes as usize, 32 * plan.depth as usize * (piece + TMA_SLOT_OVERHEAD));
            prop_assert!(plan.shared_bytes as usize <= budget);
        }
    }

    /// The kernels compile for every architecture the engine may meet, the TMA kernel's inline PTX included (NVRTC
    /// needs no GPU). `cargo xtask ci` provides NVRTC and sets `HICACHE_REQUIRE_NVRTC`, which makes its absence a
    /// failure.
    #[test]
    fn the_kernels_compile_for_every_architecture() {
        if !crate::nvrtc_present() {
            assert!(
                std::env::var_os("HICACHE_REQUIRE_NVRTC").is_none(),
                "HICACHE_REQUIRE_NVRTC is set but NVRTC cannot be loaded (LD_LIBRARY_PATH)"
            );
            eprintln!("NVRTC is not installed here: not compiled (cargo xtask ci provides it)");
            return;
        }
        for arch in ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"] {
            let cubin = compile(SOURCE, arch).unwrap_or_else(|error| panic!("{arch}: {error}"));
            // an ELF image with both entry points
            assert_eq!(&cubin[..4], b"\x7fELF", "{arch}");
            for name in ["hicache_transfer", "hicache_transfer_tma"] {
                assert!(cubin.windows(name.len()).any(|window| window == name.as_bytes()), "{arch}: {name}");
            }
        }
    }

    #[test]
    fn tma_plans_for_the_benchmark_geometries() {
        // DeepSeek-V3's 1152 B and Llama's 2 KiB items stay whole in 192 KiB; 8 KiB items are cut in three
        let deepseek = TmaPlan::new(1152, 192 << 10, usize::MAX).expect("a plan");
        assert_eq!((deepseek.piece_bytes, deepseek.depth), (1152, 5));
        let llama = TmaPlan::new(2048, 192 << 10, usize::MAX).expect("a plan");
        assert_eq!((llama.piece_bytes, llama.depth), (2048, 2));
        let wide = TmaPlan::new(8192, 192 << 10, usize::MAX).expect("a plan");
        assert_eq!((wide.piece_bytes, wide.depth), (2736, 2));
        assert_eq!(TmaPlan::new(1000, 192 << 10, usize::MAX), None, "not a multiple of 16");
        assert_eq!(TmaPlan::new(1152, 192 << 10, 512).map(|plan| plan.piece_bytes), Some(384));
    }
}
