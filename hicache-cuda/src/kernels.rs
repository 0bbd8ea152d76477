//! The transfer kernel, compiled at run time by NVRTC to a cubin for the GPU's own architecture, and cached on disk.
//!
//! One kernel moves items (one token × one layer × K or V) between the device pool (`[layer][part][slot][item]`) and
//! the host pool in any of the three host layouts, in either direction: a warp per item, 16-byte accesses when the
//! addresses and the item size allow, 8-byte or single-byte otherwise. Items are numbered token-fastest, so
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
extern "C" __global__ void hicache_transfer(
    unsigned char* device_base, unsigned char* host_base,
    const unsigned int* host_tokens, const unsigned int* device_slots,
    unsigned long long tokens, unsigned int first_layer, unsigned int layer_count, unsigned int parts,
    unsigned long long item_bytes, unsigned long long device_slot_count, unsigned long long host_token_count,
    unsigned long long host_pages, unsigned long long page_size, unsigned int total_layers,
    unsigned int layout, unsigned int to_device)
{
    const unsigned long long items = tokens * layer_count * parts;
    const unsigned int lane = threadIdx.x & 31;
    unsigned long long warp = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const unsigned long long warps = ((unsigned long long)gridDim.x * blockDim.x) >> 5;
    for (; warp < items; warp += warps) {
        const unsigned long long t = warp % tokens;
        const unsigned long long rest = warp / tokens;
        const unsigned long long part = rest % parts;
        const unsigned long long layer = first_layer + rest / parts;
        const unsigned long long slot = device_slots[t];
        const unsigned long long token = host_tokens[t];
        const unsigned long long d = ((layer * parts + part) * device_slot_count + slot) * item_bytes;
        unsigned long long h;
        if (layout == 0) {
            h = ((part * total_layers + layer) * host_token_count + token) * item_bytes;
        } else if (layout == 1) {
            h = ((part * host_token_count + token) * total_layers + layer) * item_bytes;
        } else {
            const unsigned long long page = token / page_size;
            const unsigned long long in_page = token % page_size;
            h = (((part * host_pages + page) * total_layers + layer) * page_size + in_page) * item_bytes;
        }
        const unsigned char* src = to_device ? host_base + h : device_base + d;
        unsigned char* dst = to_device ? device_base + d : host_base + h;
        const unsigned long long alignment = (unsigned long long)src | (unsigned long long)dst | item_bytes;
        if ((alignment & 15) == 0) {
            // four 16-byte loads in flight per lane before the stores: host reads over PCIe are long
            const uint4* __restrict__ from = (const uint4*)src;
            uint4* __restrict__ to = (uint4*)dst;
            const unsigned long long chunks = item_bytes >> 4;
            for (unsigned long long c = lane; c < chunks; c += 4 * 32) {
                uint4 v0 = from[c], v1, v2, v3;
                const bool h1 = c + 32 < chunks, h2 = c + 64 < chunks, h3 = c + 96 < chunks;
                if (h1) v1 = from[c + 32];
                if (h2) v2 = from[c + 64];
                if (h3) v3 = from[c + 96];
                to[c] = v0;
                if (h1) to[c + 32] = v1;
                if (h2) to[c + 64] = v2;
                if (h3) to[c + 96] = v3;
            }
        } else if ((alignment & 7) == 0) {
            for (unsigned long long o = lane * 8ull; o < item_bytes; o += 32 * 8) {
                *(unsigned long long*)(dst + o) = *(const unsigned long long*)(src + o);
            }
        } else {
            for (unsigned long long o = lane; o < item_bytes; o += 32) {
                dst[o] = src[o];
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
