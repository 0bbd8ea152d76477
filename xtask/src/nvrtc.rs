//! `cargo xtask nvrtc`: NVRTC (CUDA's run-time compiler) for the test that compiles the transfer kernels for every
//! GPU architecture, on machines without a GPU or a CUDA toolkit. From the `nvidia-cuda-nvrtc` wheel on PyPI, the
//! release of the H200 machines' CUDA 13.0, unpacked under `target/nvrtc/`.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::wheel::{Wheel, fetch, find_file};

const UNPACK_DIR: &str = "target/nvrtc";
/// The library cudarc loads (`libnvrtc.so.{major}`).
const LIBRARY: &str = "libnvrtc.so.13";

/// Makes sure NVRTC is unpacked; returns the folder holding it.
pub(crate) fn prepare() -> anyhow::Result<PathBuf> {
    let dir = Path::new(UNPACK_DIR);
    if let Some(found) = find_file(dir, LIBRARY, 5) {
        return Ok(std::fs::canonicalize(&found).unwrap_or(found));
    }
    let arch = std::env::consts::ARCH;
    let platforms =
        [format!("manylinux2014_{arch}"), format!("manylinux_2_17_{arch}"), format!("manylinux_2_28_{arch}")];
    let platforms: Vec<&str> = platforms.iter().map(String::as_str).collect();
    let wheel = Wheel {
        spec: "nvidia-cuda-nvrtc==13.0.88",
        python: "3.11",
        platforms: &platforms,
        // the compiler and its built-ins, not the alternative builds beside them
        keep: &["/lib/"],
        skip: &[".alt."],
    };
    let unpacked = fetch(&wheel, dir)?;
    let found = find_file(&unpacked, LIBRARY, 4).with_context(|| format!("no {LIBRARY} in {}", wheel.spec))?;
    Ok(std::fs::canonicalize(&found).unwrap_or(found))
}
