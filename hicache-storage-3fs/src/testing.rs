//! For tests (this crate's and the CLI's): a real `redis-server` on a loopback port, stopped by its PID when dropped
//! (and killed with the test process); a mock mount (a folder with `3fs-virt/iovs/`); where the USRBIO **mock** is.
//!
//! `cargo xtask ci` installs Debian's `redis-server` (as root) and builds the mock (`usrbio-mock/`, a library named as
//! the real one) into `target/usrbio-mock/`; `HICACHE_REDIS_SERVER_BIN` and `HF3FS_LIB_DIR` point elsewhere.

use std::net::TcpListener;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
    child: Option<Child>,
}

impl RedisServer {
    /// Starts one on a free loopback port.
    ///
    /// # Panics
    ///
    /// When it cannot be started (naming how to install it).
    pub fn start() -> Self {
        for _ in 0..5 {
            let port =
                TcpListener::bind("127.0.0.1:0").and_then(|socket| socket.local_addr()).expect("a free port").port();
            let mut server = Self { port, child: None };
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
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
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
            .args(["--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; it asks the kernel to kill the server when the thread that started it
        // ends, so a test that dies without dropping the guard leaves no server behind.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command.spawn().unwrap_or_else(|error| {
            panic!(
                "starting {}: {error} (install Debian's redis-server, or run `cargo xtask ci`, or set \
                 HICACHE_REDIS_SERVER_BIN)",
                redis_program().display()
            )
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if child.try_wait().ok().flatten().is_some() {
                return false;
            }
            let answered = redis::Client::open(self.url())
                .and_then(|client| client.get_connection_with_timeout(Duration::from_millis(200)))
                .and_then(|mut connection| redis::cmd("PING").query::<String>(&mut connection));
            if answered.is_ok() {
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
