//! For tests (this crate's and the CLI's): a real `mooncake_master` on loopback ports, stopped by its PID when
//! dropped (and killed with the test process), and where the test libraries are.
//!
//! `cargo xtask mooncake` (part of `cargo xtask ci`) unpacks under `target/mooncake/`: the official
//! `mooncake-transfer-engine-non-cuda` wheel (`official/`: `mooncake_master` and the Python client), the
//! `tokenspeed-mooncake` wheel's `libmooncake_store.so` with CUDA's run-time library beside it (`store/`), and, on a
//! machine without the CUDA driver, a no-device stand-in for `libcuda.so.1` (`no-device-cuda-shim/`: every driver
//! function the library imports answers "no device"; TCP transfers never call them). Environment variables point
//! elsewhere: `HICACHE_MOONCAKE_MASTER_BIN`, `MOONCAKE_STORE_LIBRARY`, `HICACHE_MOONCAKE_PYTHONPATH`.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Once;
use std::time::Duration;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::testing::service::{LoopbackService, free_loopback_port};

use crate::{MooncakeConfig, MooncakeStorage};

/// The folder `cargo xtask mooncake` unpacks into.
pub fn unpack_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/mooncake")
}

fn needed(variable: &str, default: PathBuf) -> PathBuf {
    let path = std::env::var_os(variable).filter(|path| !path.is_empty()).map_or(default, PathBuf::from);
    assert!(
        path.exists(),
        "{} is needed for the Mooncake tests: run `cargo xtask mooncake` (downloads the wheels into target/mooncake) \
         or set {variable}",
        path.display()
    );
    path
}

/// The `mooncake_master` program.
pub fn master_program() -> PathBuf {
    needed("HICACHE_MOONCAKE_MASTER_BIN", unpack_dir().join("official/lib/mooncake/mooncake_master"))
}

/// The folder to put on `PYTHONPATH` for `import mooncake.store` (the official client).
pub fn python_path() -> PathBuf {
    needed("HICACHE_MOONCAKE_PYTHONPATH", unpack_dir().join("official/lib"))
}

/// `libmooncake_store.so`; on a machine without the CUDA driver, the no-device stand-in is loaded first, so the
/// library's need for `libcuda.so.1` is met by it.
pub fn store_library() -> PathBuf {
    static SHIM: Once = Once::new();
    SHIM.call_once(|| {
        let shim = unpack_dir().join("no-device-cuda-shim/libcuda.so.1");
        // SAFETY: loading the system's CUDA driver runs only its own initialisers.
        let has_driver = unsafe { libloading::Library::new("libcuda.so.1") }.is_ok();
        if !has_driver && shim.is_file() {
            // SAFETY: the stand-in has no initialisers; it stays loaded (its soname then satisfies the store
            // library's need for libcuda.so.1).
            match unsafe { libloading::Library::new(&shim) } {
                Ok(library) => std::mem::forget(library),
                Err(failure) => panic!("loading {}: {failure}", shim.display()),
            }
        }
    });
    needed(crate::sys::LIBRARY_ENV, unpack_dir().join("store/lib/mooncake/libmooncake_store.so"))
}

/// A config for a client of `master` on loopback that lends no memory (objects go to the cluster's holder), with
/// the test library and short waits.
pub fn config(master: &Master) -> MooncakeConfig {
    MooncakeConfig {
        local_hostname: "127.0.0.1".into(),
        global_segment_size: 0,
        local_buffer_size: 16 << 20,
        library: Some(store_library()),
        // the setup of a client lending memory takes seconds on a loaded machine
        connect_timeout: Duration::from_secs(10),
        lease_wait: Duration::from_secs(5),
        ..MooncakeConfig::new(master.address())
    }
}

/// A running `mooncake_master` on 127.0.0.1; stopped by its PID when dropped.
pub struct Master {
    service: Option<LoopbackService>,
    rpc_port: u16,
    metrics_port: u16,
    lease_ttl_ms: u64,
}

impl Master {
    /// Starts a master with a short read lease (500 ms), so removals after reads do not wait 10 s.
    ///
    /// # Panics
    ///
    /// When the program is missing or the master does not come up within 30 s.
    pub fn start() -> Self {
        Self::start_with_lease(500)
    }

    /// Starts a master whose read leases last `lease_ttl_ms`.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub fn start_with_lease(lease_ttl_ms: u64) -> Self {
        for _ in 0..5 {
            let (rpc_port, metrics_port) = (free_loopback_port(), free_loopback_port());
            let mut master = Self { service: None, rpc_port, metrics_port, lease_ttl_ms };
            if master.launch() {
                return master;
            }
        }
        panic!("mooncake_master did not come up on loopback (5 tries)");
    }

    /// `127.0.0.1:{rpc port}`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.rpc_port)
    }

    /// The master's PID.
    pub fn pid(&self) -> Option<u32> {
        self.service.as_ref().map(LoopbackService::pid)
    }

    /// The value of `name` on the master's metrics page (Prometheus text), `None` when it does not answer or has no
    /// such metric.
    pub fn metric(&self, name: &str) -> Option<f64> {
        use std::io::{Read, Write};
        let mut stream = TcpStream::connect(("127.0.0.1", self.metrics_port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(stream, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
        // the master keeps the connection open: read the headers, then the body's Content-Length
        let mut bytes = Vec::new();
        let mut chunk = [0u8; 65536];
        loop {
            let text = String::from_utf8_lossy(&bytes);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = head.lines().find_map(|line| {
                    let (key, value) = line.split_once(':')?;
                    key.eq_ignore_ascii_case("content-length").then(|| value.trim().parse::<usize>().ok())?
                })?;
                if body.len() >= length {
                    return body
                        .lines()
                        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok());
                }
            }
            let read = stream.read(&mut chunk).ok()?;
            if read == 0 {
                return None;
            }
            bytes.extend_from_slice(&chunk[..read]);
        }
    }

    /// Sends the master `signal`, named as `kill(1)` takes it (`STOP`, `CONT`, `KILL`); it stays this value's to
    /// reap.
    ///
    /// # Panics
    ///
    /// When it is not running or `kill` fails.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid().expect("the master runs").to_string();
        let status = Command::new("kill").args([&format!("-{signal}"), &pid]).status().expect("running kill");
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// Kills the master (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        self.service = None;
    }

    /// Starts it again on the same ports (after [`kill`](Self::kill)); its objects are gone.
    ///
    /// # Panics
    ///
    /// When it does not come up.
    pub fn restart(&mut self) {
        self.kill();
        assert!(self.launch(), "mooncake_master did not come back on {}", self.address());
    }

    fn launch(&mut self) -> bool {
        let mut command = Command::new(master_program());
        command.args([
            format!("--rpc_port={}", self.rpc_port),
            format!("--metrics_port={}", self.metrics_port),
            "--rpc_address=127.0.0.1".into(),
            "--metrics_host=127.0.0.1".into(),
            format!("--default_kv_lease_ttl={}", self.lease_ttl_ms),
        ]);
        let port = self.rpc_port;
        let answers = || TcpStream::connect(("127.0.0.1", port)).is_ok();
        self.service = LoopbackService::start(command, Duration::from_secs(30), answers)
            .unwrap_or_else(|error| panic!("starting mooncake_master: {error}"));
        self.service.is_some()
    }
}

/// A master and one client that lends the cluster its memory, as a dedicated store process does: objects live in the
/// segments of the clients that mount them and go when those clients go, so the backends a test opens (with
/// [`config`], lending nothing) may come and go while their objects stay.
pub struct Cluster {
    // dropped before the master
    holder: Option<MooncakeStorage>,
    master: Master,
    segment_bytes: u64,
}

impl Cluster {
    /// Bytes the holder lends.
    pub const SEGMENT_BYTES: u64 = 256 << 20;

    /// A master ([`Master::start`]) and its holder.
    ///
    /// # Panics
    ///
    /// When either does not come up.
    pub fn start() -> Self {
        Self::start_with_segment(Self::SEGMENT_BYTES)
    }

    /// A master and a holder lending `segment_bytes`.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub fn start_with_segment(segment_bytes: u64) -> Self {
        let master = Master::start();
        let holder = Self::holder(&master, segment_bytes);
        Self { holder: Some(holder), master, segment_bytes }
    }

    fn holder(master: &Master, segment_bytes: u64) -> MooncakeStorage {
        let namespace = StorageNamespace::single_rank(
            "segment-holder",
            KvGeometry::mha(1, 1, 8, KvDtype::Bf16).expect("valid geometry"),
            HostLayout::PageFirst,
            1,
        );
        let config = MooncakeConfig { global_segment_size: segment_bytes, ..config(master) };
        MooncakeStorage::open(config, &namespace).expect("the segment holder connects to the test master")
    }

    /// A config for a backend of this cluster.
    pub fn config(&self) -> MooncakeConfig {
        config(&self.master)
    }

    /// The master.
    pub fn master(&mut self) -> &mut Master {
        &mut self.master
    }

    /// Drops the holder: every object of the cluster goes with its segment.
    pub fn drop_holder(&mut self) {
        self.holder = None;
    }

    /// A new holder (after [`drop_holder`](Self::drop_holder), or to lend more memory).
    ///
    /// # Panics
    ///
    /// When it cannot connect.
    pub fn start_holder(&mut self) {
        self.holder = Some(Self::holder(&self.master, self.segment_bytes));
    }
}
