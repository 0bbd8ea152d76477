//! `cargo xtask nixl`: what the NIXL backend needs to build and to test, on a fresh machine.
//!
//! * Building: nixl-sys runs bindgen, which needs libclang; installed from Debian's `libclang-dev` (as root) when the
//!   machine lacks it.
//! * Testing: the real NIXL library, from the `nixl-cu12` wheel on PyPI (no GPU needed for the POSIX plugin),
//!   downloaded with pip and unpacked under `target/nixl/`. The tests find it there, or through
//!   `$HICACHE_NIXL_LIB_DIR`, which [`prepare`] returns for the test commands.

use anyhow::{Context, bail};
use std::path::{Path, PathBuf};

use crate::wheel::{Wheel, fetch, find_file};

/// The wheel and version the tests run against (nixl-sys 1.5.2 is built for the 1.5 C API).
const WHEEL: &str = "nixl-cu12==1.5.1";
/// Where it is unpacked, under the workspace root.
const UNPACK_DIR: &str = "target/nixl";
/// The library the backend loads.
const LIBRARY: &str = "libnixl_capi.so";

/// Makes sure libclang is installed and the NIXL library unpacked; returns the folder holding `libnixl_capi.so`.
pub(crate) fn prepare() -> anyhow::Result<PathBuf> {
    ensure_libclang()?;
    let dir = Path::new(UNPACK_DIR);
    if let Some(found) = find_file(dir, LIBRARY, 4) {
        return Ok(std::fs::canonicalize(&found).unwrap_or(found));
    }
    // the wheel holds Python bindings for one Python, but the C libraries are the same in every one
    let wheel = Wheel {
        spec: WHEEL,
        python: "3.11",
        platforms: &["manylinux_2_28_x86_64"],
        // only the native libraries (about half the wheel)
        keep: &[".libs/"],
        skip: &[],
    };
    let unpacked = fetch(&wheel, dir)?;
    let found = find_file(&unpacked, LIBRARY, 3).with_context(|| format!("no {LIBRARY} in {WHEEL}"))?;
    Ok(std::fs::canonicalize(&found).unwrap_or(found))
}

/// Whether bindgen will find libclang: `$LIBCLANG_PATH`, or a `libclang*.so` where Debian's packages put it.
fn has_libclang() -> bool {
    if std::env::var_os("LIBCLANG_PATH").is_some() {
        return true;
    }
    let mut dirs: Vec<PathBuf> =
        vec!["/usr/lib/x86_64-linux-gnu".into(), "/usr/lib/aarch64-linux-gnu".into(), "/usr/lib".into()];
    if let Ok(entries) = std::fs::read_dir("/usr/lib") {
        dirs.extend(
            entries
                .filter_map(|entry| entry.ok().map(|entry| entry.path()))
                .filter(|path| path.file_name().is_some_and(|name| name.to_string_lossy().starts_with("llvm-")))
                .map(|path| path.join("lib")),
        );
    }
    dirs.iter().any(|dir| {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.filter_map(Result::ok).any(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                name.starts_with("libclang") && name.contains(".so") && !name.starts_with("libclang-cpp")
            })
        })
    })
}

/// Installs libclang (Debian's `libclang-dev`, as root) where bindgen would not find one.
pub(crate) fn ensure_libclang() -> anyhow::Result<()> {
    if has_libclang() {
        return Ok(());
    }
    crate::apt_install(&["libclang-dev"], "bindgen needs libclang (or LIBCLANG_PATH)")?;
    if !has_libclang() {
        bail!("libclang-dev is installed but no libclang*.so was found; set LIBCLANG_PATH");
    }
    Ok(())
}
