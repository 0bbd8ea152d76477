//! For tests (this crate's and the CLI's): a real `redis-server` on a loopback port, stopped by its PID when dropped
//! (and killed with the test process); a mock mount (a folder with `3fs-virt/iovs/`); where the USRBIO **mock** is.
//!
//! `cargo xtask ci` installs Debian's `redis-server` (as root) and builds the mock (`usrbio-mock/`, a library named as
//! the real one) into `target/usrbio-mock/`; `HICACHE_REDIS_SERVER_BIN` and `HF3FS_LIB_DIR` point elsewhere.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use hicache_core::testing::service::{LoopbackService, free_loopback_port};

use crate::Hf3fsConfig;
use crate::usrbio::{LIB_DIR_ENV, LIBRARY_NAME};

/// The folder holding the USRBIO mock: `$HF3FS_LIB_DIR`, else `target/usrbio-mock`, else `target/debug` (where cargo
/// builds it with the workspace).
///
/// # Panics
///
/// When no mock library is found there (a test set-up failure, naming how to build it).
pub fn mock_library_dir() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let candidates: Vec<PathBuf> = match std::env::var_os(LIB_DIR_ENV).filter(|dir| !dir.is_empty()) {
        Some(dir) => vec![PathBuf::from(dir)],
        None => vec![root.join("target/usrbio-mock"), root.join("target/debug")],
    };
    candidates.iter().find(|dir| dir.join(LIBRARY_NAME).is_file()).cloned().unwrap_or_else(|| {
        panic!(
            "the USRBIO mock ({LIBRARY_NAME}) is needed for the 3FS tests: run `cargo build -p hicache-usrbio-mock` (or \
             `cargo xtask ci`), or set {LIB_DIR_ENV}; looked in {candidates:?}"
        )
    })
}

/// A mock 3FS mount: a temporary folder with `3fs-virt/iovs/`, removed when dropped.
pub struct Mount {
    dir: tempfile::TempDir,
}

impl Mount {
    /// A new mount.
    ///
    /// # Panics
    ///
    /// When the folder cannot be made.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("a temporary folder");
        std::fs::create_dir_all(dir.path().join("3fs-virt/iovs")).expect("3fs-virt/iovs");
        Self { dir }
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Settings for data files `{mount}/hicache.{rank}.bin` of `file_size` bytes, small rings, the mock library and
    /// short deadlines; metadata in `url` (Redis) or in process.
    pub fn config(&self, file_size: u64, url: Option<&str>) -> Hf3fsConfig {
        Hf3fsConfig {
            file_size,
            numjobs: 2,
            entries: 8,
            metadata_server_url: url.map(str::to_owned),
            io_timeout: Duration::from_secs(10),
            metadata_timeout: Duration::from_secs(2),
            library_dir: Some(mock_library_dir()),
            ..Hf3fsConfig::new(self.dir.path().join("hicache"))
        }
    }
}

impl Default for Mount {
    fn default() -> Self {
        Self::new()
    }
}

/// The `redis-server` program: `$HICACHE_REDIS_SERVER_BIN`, else `redis-server` on the search path.
pub fn redis_program() -> PathBuf {
    std::env::var_os("HICACHE_REDIS_SERVER_BIN")
        .filter(|path| !path.is_empty())
        .map_or_else(|| PathBuf::from("redis-server"), PathBuf::from)
}

/// A `redis-server` on a loopback port, without persistence; stopped by its PID when dropped.
pub struct RedisServer {
    port: u16,
    service: Option<LoopbackService>,
}

impl RedisServer {
    /// Starts one on a free loopback port.
    ///
    /// # Panics
    ///
    /// When it cannot be started (naming how to install it).
    pub fn start() -> Self {
        for _ in 0..5 {
            let mut server = Self { port: free_loopback_port(), service: None };
            if server.launch() {
                return server;
            }
        }
        panic!("redis-server did not start on a loopback port")
    }

    /// Starts the server again on its port (after [`kill`](Self::kill)): empty, as a restarted Redis without
    /// persistence is.
    ///
    /// # Panics
    ///
    /// When it does not start.
    pub fn restart(&mut self) {
        self.kill();
        assert!(self.launch(), "redis-server did not start again on port {}", self.port);
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        self.service = None;
    }

    /// `redis://127.0.0.1:{port}`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A plain connection, for tests that look at Redis itself.
    ///
    /// # Panics
    ///
    /// When the server does not answer.
    pub fn connection(&self) -> redis::Connection {
        redis::Client::open(self.url()).and_then(|client| client.get_connection()).expect("connects to the test Redis")
    }

    fn launch(&mut self) -> bool {
        let mut command = Command::new(redis_program());
        command
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string(), "--save", "", "--appendonly", "no"])
            .args(["--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning"]);
        let url = self.url();
        let answers = || {
            redis::Client::open(url.as_str())
                .and_then(|client| client.get_connection_with_timeout(Duration::from_millis(200)))
                .and_then(|mut connection| redis::cmd("PING").query::<String>(&mut connection))
                .is_ok()
        };
        self.service = LoopbackService::start(command, Duration::from_secs(10), answers).unwrap_or_else(|error| {
            panic!(
                "starting {}: {error} (install Debian's redis-server, or run `cargo xtask ci`, or set \
                 HICACHE_REDIS_SERVER_BIN)",
                redis_program().display()
            )
        });
        self.service.is_some()
    }
}
