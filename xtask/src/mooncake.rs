//! `cargo xtask mooncake`: what the Mooncake backend's tests need on a fresh machine, and a master to try it with.
//!
//! * `libibverbs1` and `ibverbs-providers` from Debian (as root): the Mooncake libraries link them even for TCP.
//! * The official `mooncake-transfer-engine-non-cuda` wheel, unpacked under `target/mooncake/official/lib`: the
//!   `mooncake_master` program and the official Python client (`mooncake.store`), which the tests use as the writer
//!   SGLang would be.
//! * `libmooncake_store.so` (Mooncake's C API) from the `tokenspeed-mooncake` wheel, with the CUDA run-time library
//!   it links (`nvidia-cuda-runtime`, where its run path looks for it), under `target/mooncake/store/lib`.
//! * On a machine without the CUDA driver, a no-device stand-in for `libcuda.so.1` compiled with the system's C
//!   compiler (`target/mooncake/no-device-cuda-shim`): every driver function the store library imports returns
//!   `CUDA_ERROR_NO_DEVICE`; TCP transfers of host memory never call them.
//!
//! With no argument after it, the command then runs a master on 127.0.0.1 in the foreground and prints how to point
//! hicache at it; Ctrl-C stops it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::run_program;
use crate::wheel::{Wheel, fetch};

const UNPACK_DIR: &str = "target/mooncake";
const OFFICIAL: &str = "mooncake-transfer-engine-non-cuda==0.3.13.post1";
const STORE: &str = "tokenspeed-mooncake==0.3.13.post20261027";
/// The CUDA run-time the store library was built against (13), in the release of the H200 machines' CUDA 13.0.
const CUDART: &str = "nvidia-cuda-runtime==13.0.96";

/// Paths the tests and the CLI need.
pub(crate) struct Prepared {
    /// `mooncake_master`.
    pub(crate) master: PathBuf,
    /// `libmooncake_store.so`.
    pub(crate) library: PathBuf,
    /// The folder holding the no-device `libcuda.so.1`, where the machine has no CUDA driver.
    pub(crate) shim_dir: Option<PathBuf>,
}

/// Installs and unpacks what is missing; returns where things are.
pub(crate) fn prepare() -> anyhow::Result<Prepared> {
    ensure_verbs()?;
    let root = Path::new(UNPACK_DIR);
    let python = python_version()?;
    let arch = std::env::consts::ARCH;
    let platforms =
        [format!("manylinux_2_28_{arch}"), format!("manylinux2014_{arch}"), format!("manylinux_2_17_{arch}")];
    let platforms: Vec<&str> = platforms.iter().map(String::as_str).collect();
    let official = root.join("official");
    let master = official.join("lib/mooncake/mooncake_master");
    if !master.is_file() {
        let _ = std::fs::remove_dir_all(&official);
        fetch(
            &Wheel {
                spec: OFFICIAL,
                python: &python,
                platforms: &platforms,
                keep: &["mooncake/", "mooncake_transfer_engine_non_cuda.libs/"],
                // benchmarks and tools the tests do not run
                skip: &["transfer_engine_bench", "mooncake_client", ".dist-info"],
            },
            &official,
        )?;
    }
    let store = root.join("store");
    let library = store.join("lib/mooncake/libmooncake_store.so");
    let cudart = store.join("lib/nvidia/cu13/lib/libcudart.so.13");
    if !library.is_file() || !cudart.is_file() {
        let _ = std::fs::remove_dir_all(&store);
        fetch(
            &Wheel {
                spec: STORE,
                python: &python,
                platforms: &platforms,
                keep: &["mooncake/libmooncake_store.so", "tokenspeed_mooncake.libs/"],
                skip: &[],
            },
            &store,
        )?;
        // beside the store library's run path `$ORIGIN/../nvidia/cu13/lib`
        fetch(
            &Wheel { spec: CUDART, python: &python, platforms: &platforms, keep: &["libcudart.so."], skip: &[] },
            &store,
        )?;
    }
    for path in [&master, &library, &cudart] {
        if !path.is_file() {
            bail!("{} is missing after unpacking the Mooncake wheels", path.display());
        }
    }
    let shim_dir = if has_cuda_driver() { None } else { Some(build_shim(root, &library)?) };
    let absolute = |path: &Path| std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    Ok(Prepared { master: absolute(&master), library: absolute(&library), shim_dir: shim_dir.as_deref().map(absolute) })
}

/// `cargo xtask mooncake`: prepares, then runs a master in the foreground.
pub(crate) fn run(args: &[String]) -> anyhow::Result<()> {
    let port: u16 = match args {
        [] => 50051,
        [flag, port] if flag == "--port" => port.parse().with_context(|| format!("--port {port:?}"))?,
        _ => bail!("usage: cargo xtask mooncake [--port N]"),
    };
    let prepared = prepare()?;
    let library_path =
        prepared.shim_dir.as_ref().map(|dir| format!("LD_LIBRARY_PATH={} ", dir.display())).unwrap_or_default();
    println!(
        "mooncake_master on 127.0.0.1:{port} (Ctrl-C stops it). In another shell:\n\n  {library_path}\
         MOONCAKE_MASTER=127.0.0.1:{port} MOONCAKE_STORE_LIBRARY={} LOCAL_HOSTNAME=127.0.0.1 \\\n    \
         cargo run --release -p hicache-cli --features mooncake -- replay --backend mooncake\n",
        prepared.library.display()
    );
    let status = Command::new(&prepared.master)
        .args([
            format!("--rpc_port={port}"),
            format!("--metrics_port={}", port + 1),
            "--rpc_address=127.0.0.1".into(),
            "--metrics_host=127.0.0.1".into(),
        ])
        .status()
        .with_context(|| format!("starting {}", prepared.master.display()))?;
    if !status.success() {
        bail!("mooncake_master ended: {status} (is port {port} or {} taken? --port N picks others)", port + 1);
    }
    Ok(())
}

fn python_version() -> anyhow::Result<String> {
    let output = Command::new("python3")
        .args(["-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"])
        .output()
        .context("running python3 (pip downloads the Mooncake wheels)")?;
    Ok(String::from_utf8(output.stdout)?.trim().to_owned())
}

fn has_library(name: &str) -> bool {
    Command::new("ldconfig").arg("-p").output().is_ok_and(|output| {
        String::from_utf8_lossy(&output.stdout).lines().any(|line| line.trim_start().starts_with(name))
    })
}

fn has_cuda_driver() -> bool {
    has_library("libcuda.so.1 ")
}

fn ensure_verbs() -> anyhow::Result<()> {
    if has_library("libibverbs.so.1 ") && has_library("libmlx5.so.1 ") {
        return Ok(());
    }
    crate::apt_install(
        &["libibverbs1", "ibverbs-providers"],
        "the Mooncake libraries link libibverbs.so.1 and libmlx5.so.1",
    )
}

/// Compiles the no-device stand-in for `libcuda.so.1` from the driver functions `library` imports.
fn build_shim(root: &Path, library: &Path) -> anyhow::Result<PathBuf> {
    let dir = root.join("no-device-cuda-shim");
    let shim = dir.join("libcuda.so.1");
    if shim.is_file() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&dir)?;
    let output = Command::new("nm")
        .args(["-D", "--undefined-only"])
        .arg(library)
        .output()
        .context("running nm (binutils) to list the CUDA driver functions the store library imports")?;
    let mut source = String::from(
        "/* A no-device stand-in for the CUDA driver, for machines without one: every function answers\n   \
         CUDA_ERROR_NO_DEVICE (100). Built by `cargo xtask mooncake`. */\n",
    );
    let mut count = 0;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Some(symbol) = line.split_whitespace().last() else { continue };
        let is_driver = symbol.starts_with("cu") && symbol[2..].starts_with(|c: char| c.is_ascii_uppercase());
        if is_driver && !symbol.contains('@') {
            source.push_str(&format!("int {symbol}(void) {{ return 100; }}\n"));
            count += 1;
        }
    }
    if count == 0 {
        bail!("{} imports no CUDA driver function; the no-device stand-in is not needed", library.display());
    }
    let source_path = dir.join("no_device_cuda.c");
    std::fs::write(&source_path, source)?;
    let temporary = dir.join("libcuda.so.1.tmp");
    run_program(
        "cc",
        &[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            temporary.to_str().context("path not UTF-8")?,
            source_path.to_str().context("path not UTF-8")?,
        ],
        &[],
    )?;
    std::fs::rename(&temporary, &shim)?;
    Ok(dir)
}
