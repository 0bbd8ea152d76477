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
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join("redis-server"))
        .find(|candidate| candidate.is_file())
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
