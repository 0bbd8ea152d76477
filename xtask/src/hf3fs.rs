//! What the 3FS tests need on a fresh machine: Debian's `redis-server` (installed as root when missing; the tests
//! start their own servers on loopback ports and stop them by PID) and the USRBIO **mock** library, built from
//! `hicache-storage-3fs/usrbio-mock` and copied to `target/usrbio-mock/` under the real library's file name.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use crate::run_program;

/// Where the tests find things.
pub(crate) struct Prepared {
    /// The `redis-server` program.
    pub(crate) redis_server: PathBuf,
    /// The folder holding the mock `libhf3fs_api_shared.so`.
    pub(crate) mock_dir: PathBuf,
}

fn find_redis_server() -> Option<PathBuf> {
    find_program("redis-server")
}

/// `program` on `PATH` or in the system's folders for programs.
pub(crate) fn find_program(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/usr/local/bin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// The across-hosts tests (hicache-cli/tests/hosts.rs) make network namespaces (`ip`), cap links (`tc`) and drop
/// packets (`nft`): installs what is missing.
pub(crate) fn network_tools() -> anyhow::Result<()> {
    let mut missing: Vec<&str> = [("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")]
        .into_iter()
        .filter(|(program, _)| find_program(program).is_none())
        .map(|(_, package)| package)
        .collect();
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    crate::apt_install(&missing, "the across-hosts tests make network namespaces and impair their links")
}

pub(crate) fn prepare() -> anyhow::Result<Prepared> {
    let redis_server = match find_redis_server() {
        Some(found) => found,
        None => {
            crate::apt_install(&["redis-server"], "the 3FS tests need a real Redis")?;
            find_redis_server().context("redis-server is installed but not found")?
        }
    };
    run_program("cargo", &["build", "-p", "hicache-usrbio-mock", "--locked"], &[])?;
    let built = Path::new("target/debug/libhf3fs_api_shared.so");
    if !built.is_file() {
        bail!("cargo built no {}", built.display());
    }
    let mock_dir = Path::new("target/usrbio-mock");
    std::fs::create_dir_all(mock_dir).with_context(|| format!("making {}", mock_dir.display()))?;
    std::fs::copy(built, mock_dir.join("libhf3fs_api_shared.so")).context("copying the USRBIO mock")?;
    Ok(Prepared { redis_server, mock_dir: std::fs::canonicalize(mock_dir)? })
}
