//! `cargo xtask nixl`: what the NIXL backend needs to build and to test, on a fresh machine.
//!
//! * Building: nixl-sys runs bindgen, which needs libclang; installed from Debian's `libclang-dev` (as root) when the
//!   machine lacks it.
//! * Testing: the real NIXL library, from the `nixl-cu12` wheel on PyPI (no GPU needed for the POSIX plugin),
//!   downloaded with pip and unpacked under `target/nixl/`. The tests find it there, or through
//!   `$HICACHE_NIXL_LIB_DIR`, which [`prepare`] returns for the test commands.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::run_program;

/// The wheel and version the tests run against (nixl-sys 1.5.2 is built for the 1.5 C API).
const WHEEL: &str = "nixl-cu12==1.5.1";
/// Where it is unpacked, under the workspace root.
const UNPACK_DIR: &str = "target/nixl";

/// Makes sure libclang is installed and the NIXL library unpacked; returns the folder holding `libnixl_capi.so`.
pub(crate) fn prepare() -> anyhow::Result<PathBuf> {
    ensure_libclang()?;
    if let Some(dir) = find_library(Path::new(UNPACK_DIR), 4) {
        return Ok(std::fs::canonicalize(&dir).unwrap_or(dir));
    }
    let wheels = Path::new(UNPACK_DIR).join("wheel");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    // the wheel holds Python bindings for one Python, but the C libraries are the same in every one: ask for a fixed
    // tag, whatever Python this machine has
    let wheels_arg = wheels.to_str().context("target/nixl is not UTF-8")?;
    run_program(
        "python3",
        &[
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_28_x86_64",
            "--disable-pip-version-check",
            "-d",
            wheels_arg,
            WHEEL,
        ],
        &[],
    )?;
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .find(|path| path.extension().is_some_and(|extension| extension == "whl"))
        .with_context(|| format!("pip left no wheel in {}", wheels.display()))?;
    let unpacked = Path::new(UNPACK_DIR).join("lib");
    // only the native libraries (about half the wheel), keeping their permission bits
    let unzip = "import os, sys, zipfile\n\
        wheel, out = sys.argv[1], sys.argv[2]\n\
        with zipfile.ZipFile(wheel) as archive:\n\
        \x20   for member in archive.infolist():\n\
        \x20       if '.libs/' in member.filename and not member.is_dir():\n\
        \x20           path = archive.extract(member, out)\n\
        \x20           os.chmod(path, (member.external_attr >> 16) or 0o644)\n";
    run_program(
        "python3",
        &["-c", unzip, wheel.to_str().context("wheel path is not UTF-8")?, unpacked.to_str().context("not UTF-8")?],
        &[],
    )?;
    let dir = find_library(&unpacked, 3).with_context(|| format!("no libnixl_capi.so in {}", wheel.display()))?;
    // the unpacked libraries are all that is used
    std::fs::remove_dir_all(&wheels).with_context(|| format!("removing {}", wheels.display()))?;
    Ok(std::fs::canonicalize(&dir).unwrap_or(dir))
}

/// The folder under `dir` (at most `depth` levels down) that holds `libnixl_capi.so`.
fn find_library(dir: &Path, depth: usize) -> Option<PathBuf> {
    if dir.join("libnixl_capi.so").is_file() {
        return Some(dir.to_path_buf());
    }
    if depth == 0 {
        return None;
    }
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).ok()?.filter_map(|entry| entry.ok().map(|entry| entry.path())).collect();
    entries.sort();
    entries.into_iter().filter(|path| path.is_dir()).find_map(|path| find_library(&path, depth - 1))
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

fn ensure_libclang() -> anyhow::Result<()> {
    if has_libclang() {
        return Ok(());
    }
    let is_root = Command::new("id").arg("-u").output().is_ok_and(|output| output.stdout.starts_with(b"0\n"));
    if !is_root {
        bail!("nixl-sys needs libclang to build (bindgen); install Debian's libclang-dev, or set LIBCLANG_PATH");
    }
    let install = ["install", "-y", "-q", "--no-install-recommends", "libclang-dev"];
    let env = [("DEBIAN_FRONTEND", "noninteractive")];
    if run_program("apt-get", &install, &env).is_err() {
        // a fresh machine may have no package lists yet
        run_program("apt-get", &["update", "-q"], &env)?;
        run_program("apt-get", &install, &env)?;
    }
    if !has_libclang() {
        bail!("libclang-dev is installed but no libclang*.so was found; set LIBCLANG_PATH");
    }
    Ok(())
}
