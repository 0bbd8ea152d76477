//! The transfer kernel, compiled at run time by NVRTC to a cubin for the GPU's own architecture, and cached on disk.
//!
//! One kernel moves items (one token × one layer × K or V) between the device pool (`[layer][part][slot][item]`) and
//! the host pool in any of the three host layouts, in either direction: a warp per two items at a time, 16-byte
//! accesses with up to eight loads in flight per lane when the addresses and the item size allow, 8-byte or
//! single-byte otherwise. Items are numbered token-fastest, so
//! neighbouring warps touch neighbouring slots of one layer. The host pool is read and written through its device
//! mapping (pinned, mapped memory), so the SMs drive PCIe directly; a grid-stride loop lets a small, fixed number of
//! blocks (the "block quota") cover any transfer, leaving the other SMs to the model.

use std::hash::{Hash as _, Hasher as _};
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::{Ptx, result as nvrtc, sys as nvrtc_sys};
use hicache_core::Error;

use crate::device::{Device, driver};

/// The kernel's source.
pub(crate) const SOURCE: &str = r#"
struct Shape {
    unsigned char* device_base; unsigned char* host_base;
    const unsigned int* host_tokens; const unsigned int* device_slots;
    unsigned long long tokens; unsigned long long first_layer; unsigned long long parts;
    unsigned long long item_bytes; unsigned long long device_slot_count; unsigned long long host_token_count;
    unsigned long long host_pages; unsigned long long page_size; unsigned long long total_layers;
    unsigned int layout; unsigned int to_device;
};

// The source and destination of item `item` (token-fastest numbering).
__device__ __forceinline__ void locate(const Shape& s, unsigned long long item,
                                       const unsigned char** src, unsigned char** dst)
{
    const unsigned long long t = item % s.tokens;
    const unsigned long long rest = item / s.tokens;
    const unsigned long long part = rest % s.parts;
    const unsigned long long layer = s.first_layer + rest / s.parts;
    const unsigned long long slot = s.device_slots[t];
    const unsigned long long token = s.host_tokens[t];
    const unsigned long long d = ((layer * s.parts + part) * s.device_slot_count + slot) * s.item_bytes;
    unsigned long long h;
    if (s.layout == 0) {
        h = ((part * s.total_layers + layer) * s.host_token_count + token) * s.item_bytes;
    } else if (s.layout == 1) {
        h = ((part * s.host_token_count + token) * s.total_layers + layer) * s.item_bytes;
    } else {
        const unsigned long long page = token / s.page_size;
        const unsigned long long in_page = token % s.page_size;
        h = (((part * s.host_pages + page) * s.total_layers + layer) * s.page_size + in_page) * s.item_bytes;
    }
    *src = s.to_device ? s.host_base + h : s.device_base + d;
    *dst = s.to_device ? s.device_base + d : s.host_base + h;
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
    unsigned char* device_base, unsigned char* host_base,
    const unsigned int* host_tokens, const unsigned int* device_slots,
    unsigned long long tokens, unsigned int first_layer, unsigned int layer_count, unsigned int parts,
    unsigned long long item_bytes, unsigned long long device_slot_count, unsigned long long host_token_count,
    unsigned long long host_pages, unsigned long long page_size, unsigned int total_layers,
    unsigned int layout, unsigned int to_device)
{
    const Shape s = {device_base, host_base, host_tokens, device_slots, tokens, first_layer, parts, item_bytes,
                     device_slot_count, host_token_count, host_pages, page_size, total_layers, layout, to_device};
    const unsigned long long items = tokens * layer_count * parts;
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
"#;

/// The compiled kernel, loaded in a context.
#[derive(Debug, Clone)]
pub struct TransferKernel {
    _module: Arc<CudaModule>,
    function: CudaFunction,
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
        Ok(Self { _module: module, function })
    }

    pub(crate) fn function(&self) -> &CudaFunction {
        &self.function
    }

    /// Compiles another kernel the same way (NVRTC, a cubin for the GPU's architecture; not cached) and returns
    /// `name` from it: tests' and benchmarks' helper kernels.
    ///
    /// # Errors
    ///
    /// As [`load`](Self::load).
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
    let failed = |message: String| Error::Device { operation: "compile a kernel", message };
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
