//! A Mooncake Store client: one handle of the C API, set up against a master, with checked batch calls.
//!
//! Buffers are passed as raw addresses; the unsafe contract of each call (what memory it may touch, and until when)
//! is stated once here, and [`crate::MooncakeStorage`] derives every address from the segments of the call it serves.
//!
//! Mooncake's calls wait for a master that stopped answering until its own RPC deadline (about 8 s for a master that
//! is gone, 30 s for one that is stopped), and retry on every call. The client bounds what that costs:
//! * **Outages.** A call that the master did not answer (`RPC_FAIL`, `RPC_TIMEOUT`, for the call or any object)
//!   marks the master down; from then on every call fails at once, naming the master and how long ago it stopped
//!   answering, and one probe at a time (a one-key `batch_is_exist` on a thread of its own, at most every
//!   [`PROBE_INTERVAL`]) asks the master again. The first answer ends the outage. Only calls already in flight
//!   when the master went away wait for Mooncake's deadline; the backups and prefetches queued behind them do not.
//! * **Open.** The master must accept a connection, and the client's setup must end, within the connect timeout
//!   (a master stopped with SIGSTOP still accepts connections, and Mooncake's setup then waits for minutes). A setup
//!   still running at the deadline is left to end on its own thread, which destroys what it made.
//! * **Close.** Destroying the client unmounts its segment at the master; it runs on a thread of its own, waited for
//!   up to the connect timeout, and is left to end in the background after that (a process that exits then does
//!   not wait for a master that is gone).

use std::ffi::{CString, c_char, c_int, c_void};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::mpsc::{RecvTimeoutError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::sys::{self, Api, ReplicateConfig, code};

/// How often a master that stopped answering is asked again (at most one probe in flight).
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_millis(500);

/// The key a probe asks about (any key does: the answer, not the object, is what counts).
const PROBE_KEY: &str = "hicache-master-probe";

/// The library's handle; destroyed when its last holder drops (the client, or a probe still waiting on the master).
struct Handle {
    api: &'static Api,
    raw: sys::Handle,
    /// Told when the handle is destroyed, for [`Client::close`].
    destroyed: Mutex<Option<std::sync::mpsc::SyncSender<()>>>,
}

// SAFETY: a Mooncake client serves calls from many threads at once (SGLang calls one from its backup and prefetch
// threads together; the C API wraps a client whose operations lock what they share), and the handle is only an
// address of that client.
unsafe impl Send for Handle {}
// SAFETY: as for Send: the C API is safe to call concurrently on one handle.
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and this is its last use (every holder shares this one value); destroying
        // unmounts the client's segment.
        unsafe { (self.api.destroy)(self.raw) };
        if let Some(sender) = self.destroyed.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take() {
            let _ = sender.send(());
        }
    }
}

/// Why calls fail at once: the master stopped answering.
struct Outage {
    since: Instant,
    why: String,
    probing: bool,
    probed_at: Instant,
}

/// One client handle.
pub(crate) struct Client {
    /// `None` only while dropping.
    handle: Option<Arc<Handle>>,
    master: String,
    /// This client's own segment, asked for first by puts; `None`: the master places replicas as it likes.
    preferred_segment: Option<CString>,
    /// `Some` while the master does not answer.
    outage: Arc<Mutex<Option<Outage>>>,
    /// How long dropping waits for the client's destruction.
    close_wait: Duration,
}

/// What [`Client::connect`] needs.
pub(crate) struct Setup<'a> {
    pub(crate) local_hostname: &'a str,
    pub(crate) metadata_server: &'a str,
    pub(crate) global_segment_size: u64,
    pub(crate) local_buffer_size: u64,
    pub(crate) protocol: &'a str,
    pub(crate) device: &'a str,
    pub(crate) master: &'a str,
    pub(crate) connect_timeout: Duration,
    pub(crate) prefer_local_segment: bool,
}

fn c_string(field: &str, text: &str) -> Result<CString, String> {
    CString::new(text).map_err(|_| format!("{field} {text:?} holds a NUL byte"))
}

impl Client {
    /// Checks that the master answers, then creates a client and sets it up (mounting its segment), all within
    /// `setup.connect_timeout`.
    pub(crate) fn connect(api: &'static Api, setup: &Setup<'_>) -> Result<Self, String> {
        let started = Instant::now();
        probe_master(setup.master, setup.connect_timeout)?;
        let strings = [
            c_string("local_hostname", setup.local_hostname)?,
            c_string("metadata_server", setup.metadata_server)?,
            c_string("protocol", setup.protocol)?,
            c_string("device_name", setup.device)?,
            c_string("master_server_address", setup.master)?,
        ];
        let (segment, buffer) = (setup.global_segment_size, setup.local_buffer_size);
        let (sender, receiver) = sync_channel(1);
        std::thread::Builder::new()
            .name("hicache-mooncake-setup".into())
            .spawn(move || {
                // SAFETY: create takes no arguments and returns a new handle or null.
                let raw = unsafe { (api.create)() };
                if raw.is_null() {
                    let _ = sender.send(None);
                    return;
                }
                let handle = Handle { api, raw, destroyed: Mutex::new(None) };
                // SAFETY: the handle is live; the strings are NUL-terminated and owned by this thread for the call
                // (the C API keeps no pointer to them after it returns).
                let status = unsafe {
                    (api.setup)(
                        raw,
                        strings[0].as_ptr(),
                        strings[1].as_ptr(),
                        segment,
                        buffer,
                        strings[2].as_ptr(),
                        strings[3].as_ptr(),
                        strings[4].as_ptr(),
                    )
                };
                // nobody waits any more (the open gave up): the handle is destroyed here, with the message
                let _ = sender.send(Some((handle, status)));
            })
            .map_err(|error| format!("starting the Mooncake setup thread: {error}"))?;
        let left = setup.connect_timeout.saturating_sub(started.elapsed());
        let (handle, status) = match receiver.recv_timeout(left) {
            Ok(Some(made)) => made,
            Ok(None) => return Err("mooncake_store_create returned no client".into()),
            Err(RecvTimeoutError::Timeout) => {
                return Err(format!(
                    "the Mooncake master at {} accepts connections but did not set up a client within {} ms (a \
                     stopped or overloaded master; connect_timeout_ms)",
                    setup.master,
                    setup.connect_timeout.as_millis()
                ));
            }
            Err(RecvTimeoutError::Disconnected) => return Err("the Mooncake setup thread ended early".into()),
        };
        let mut client = Self {
            handle: Some(Arc::new(handle)),
            master: setup.master.to_owned(),
            preferred_segment: None,
            outage: Arc::default(),
            close_wait: setup.connect_timeout,
        };
        if status != 0 {
            return Err(format!(
                "setting up a client of the master at {} failed: {} (segment {} bytes, buffer {} bytes, protocol {})",
                setup.master,
                sys::code_name(status.into()),
                setup.global_segment_size,
                setup.local_buffer_size,
                setup.protocol
            ));
        }
        if setup.prefer_local_segment {
            client.preferred_segment = client.segment_name();
        }
        Ok(client)
    }

    fn api(&self) -> &'static Api {
        self.handle.as_ref().expect("live until dropped").api
    }

    fn raw(&self) -> sys::Handle {
        self.handle.as_ref().expect("live until dropped").raw
    }

    /// `Ok` unless the master is down: then `call` fails at once (and a probe is started when none ran lately).
    fn admit(&self, call: &str) -> Result<(), String> {
        let mut outage = self.outage.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(down) = outage.as_mut() else { return Ok(()) };
        if !down.probing && down.probed_at.elapsed() >= PROBE_INTERVAL {
            down.probing = true;
            let handle = self.handle.clone().expect("live until dropped");
            let shared = self.outage.clone();
            let spawned = std::thread::Builder::new().name("hicache-mooncake-probe".into()).spawn(move || {
                let answered = probe(&handle);
                let mut outage = shared.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                if answered {
                    *outage = None;
                } else if let Some(down) = outage.as_mut() {
                    down.probing = false;
                    down.probed_at = Instant::now();
                }
            });
            if spawned.is_err() {
                down.probing = false;
            }
        }
        Err(format!(
            "{call} at the master {} not tried: the master stopped answering {:.1} s ago ({}); calls fail at once \
             until it answers again",
            self.master,
            down.since.elapsed().as_secs_f64(),
            down.why
        ))
    }

    /// Marks the master down when `status` (of `call`, or one of its objects) says it did not answer.
    fn observe(&self, call: &str, status: i64) {
        if matches!(status, code::RPC_FAIL | code::RPC_TIMEOUT) {
            let mut outage = self.outage.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if outage.is_none() {
                tracing::warn!(master = %self.master, call, status = %sys::code_name(status), "the Mooncake master \
                    stopped answering: calls fail at once until it answers again");
                let now = Instant::now();
                *outage = Some(Outage {
                    since: now,
                    why: format!("{call}: {}", sys::code_name(status)),
                    probing: false,
                    probed_at: now,
                });
            }
        }
    }

    /// The name of the segment this client lends (its host name, with the transfer engine's port under
    /// `P2PHANDSHAKE`), as the master knows it; `None` (logged) when the library cannot say.
    fn segment_name(&self) -> Option<CString> {
        let mut buffer = vec![0u8; 512];
        // SAFETY: the handle is live and set up; the buffer holds `buffer.len()` bytes, which the call fills with a
        // NUL-terminated name or leaves alone when the name does not fit.
        let status = unsafe { (self.api().get_hostname)(self.raw(), buffer.as_mut_ptr().cast(), buffer.len()) };
        let name = (status == 0).then(|| std::ffi::CStr::from_bytes_until_nul(&buffer).ok()).flatten();
        match name {
            Some(name) if !name.is_empty() => Some(name.to_owned()),
            _ => {
                tracing::warn!(
                    status = %sys::code_name(status.into()),
                    "the Mooncake client does not say its segment's name: puts go where the master places them"
                );
                None
            }
        }
    }

    /// The segment puts ask for first, if any.
    pub(crate) fn preferred_segment(&self) -> Option<&std::ffi::CStr> {
        self.preferred_segment.as_deref()
    }

    /// Registers `[address, address + len)` for transfers.
    ///
    /// # Safety
    ///
    /// The memory stays mapped until [`unregister`](Self::unregister) is called with the same address.
    pub(crate) unsafe fn register(&self, address: usize, len: usize) -> Result<(), String> {
        // SAFETY: the handle is live; the caller keeps the memory mapped while it is registered.
        let status = unsafe { (self.api().register_buffer)(self.raw(), address as *mut c_void, len) };
        if status == 0 {
            Ok(())
        } else {
            Err(format!("registering {len} bytes at {address:#x}: {}", sys::code_name(status.into())))
        }
    }

    /// Forgets a registration.
    pub(crate) fn unregister(&self, address: usize) {
        // SAFETY: the handle is live; unregistering an address only drops Mooncake's record of it.
        let status = unsafe { (self.api().unregister_buffer)(self.raw(), address as *mut c_void) };
        if status != 0 {
            tracing::warn!(address, status = %sys::code_name(status.into()), "unregistering host memory");
        }
    }

    /// Per key: present (1), absent (0) or an error code (negative).
    pub(crate) fn batch_is_exist(&self, keys: &[CString]) -> Result<Vec<i64>, String> {
        self.admit("batch_is_exist")?;
        let pointers = key_pointers(keys);
        let mut results: Vec<c_int> = vec![0; keys.len()];
        // SAFETY: the handle is live; `pointers` holds one NUL-terminated key per entry, alive for the call, and
        // `results` has room for one int per key.
        let status =
            unsafe { (self.api().batch_is_exist)(self.raw(), pointers.as_ptr(), keys.len(), results.as_mut_ptr()) };
        self.check("batch_is_exist", status)?;
        Ok(self.observe_each("batch_is_exist", results.into_iter().map(i64::from).collect()))
    }

    /// Writes object `i` from `sizes[i]` bytes at `buffers[i]`; per key 0 or an error code.
    ///
    /// # Safety
    ///
    /// Each `[buffers[i], buffers[i] + sizes[i])` is readable and not written until the call returns; after a
    /// failure that `sys::is_settled_failure` does not settle, the transfer may still read it later.
    pub(crate) unsafe fn batch_put_from(
        &self,
        keys: &[CString],
        buffers: &[usize],
        sizes: &[usize],
        replicas: usize,
    ) -> Result<Vec<i64>, String> {
        self.admit("batch_put_from")?;
        let pointers = key_pointers(keys);
        let buffers: Vec<*mut c_void> = buffers.iter().map(|&address| address as *mut c_void).collect();
        let preferred: Vec<*const c_char> = self.preferred_segment.iter().map(|name| name.as_ptr()).collect();
        let config = ReplicateConfig {
            replica_num: replicas,
            with_soft_pin: 0,
            with_hard_pin: 0,
            preferred_segments: if preferred.is_empty() { std::ptr::null() } else { preferred.as_ptr() },
            preferred_segments_count: preferred.len(),
        };
        let mut results: Vec<c_int> = vec![0; keys.len()];
        let started = Instant::now();
        // SAFETY: the handle is live; keys, buffers, sizes and results have one entry per key and outlive the call;
        // the caller vouches for the buffers' memory; `config` and the segment name it points to outlive the call.
        let status = unsafe {
            (self.api().batch_put_from)(
                self.raw(),
                pointers.as_ptr(),
                buffers.as_ptr(),
                sizes.as_ptr(),
                keys.len(),
                &config,
                results.as_mut_ptr(),
            )
        };
        if let Some(unsettled) = unsettled(status, started.elapsed(), keys.len()) {
            return Ok(unsettled);
        }
        self.check("batch_put_from", status)?;
        Ok(self.observe_each("batch_put_from", results.into_iter().map(i64::from).collect()))
    }

    /// Reads object `i` into `sizes[i]` bytes at `buffers[i]`; per key the bytes read or an error code.
    ///
    /// # Safety
    ///
    /// Each `[buffers[i], buffers[i] + sizes[i])` is writable and neither read nor written by anyone else until the
    /// call returns; after a failure that `sys::is_settled_failure` does not settle, the transfer may still write
    /// it later.
    pub(crate) unsafe fn batch_get_into(
        &self,
        keys: &[CString],
        buffers: &[usize],
        sizes: &[usize],
    ) -> Result<Vec<i64>, String> {
        self.admit("batch_get_into")?;
        let pointers = key_pointers(keys);
        let buffers: Vec<*mut c_void> = buffers.iter().map(|&address| address as *mut c_void).collect();
        let mut results: Vec<i64> = vec![0; keys.len()];
        let started = Instant::now();
        // SAFETY: the handle is live; keys, buffers, sizes and results have one entry per key and outlive the call;
        // the caller vouches for the buffers' memory.
        let status = unsafe {
            (self.api().batch_get_into)(
                self.raw(),
                pointers.as_ptr(),
                buffers.as_ptr(),
                sizes.as_ptr(),
                keys.len(),
                results.as_mut_ptr(),
            )
        };
        if let Some(unsettled) = unsettled(status, started.elapsed(), keys.len()) {
            return Ok(unsettled);
        }
        self.check("batch_get_into", status)?;
        Ok(self.observe_each("batch_get_into", results))
    }

    /// Removes one object: 0, or an error code (`OBJECT_NOT_FOUND`, `OBJECT_HAS_LEASE`, ...).
    pub(crate) fn remove(&self, key: &CString) -> Result<i64, String> {
        self.admit("remove")?;
        // SAFETY: the handle is live and the key NUL-terminated for the call; no force, so readers holding a lease
        // keep the object.
        let status = i64::from(unsafe { (self.api().remove)(self.raw(), key.as_ptr(), 0) });
        self.observe("remove", status);
        Ok(status)
    }

    /// Removes every object whose key matches `pattern`, with `force` also those under a read lease; the number
    /// removed.
    pub(crate) fn remove_by_regex(&self, pattern: &str, force: bool) -> Result<u64, String> {
        self.admit("remove_by_regex")?;
        let pattern = c_string("pattern", pattern)?;
        // SAFETY: the handle is live and the pattern NUL-terminated for the call.
        let removed = unsafe { (self.api().remove_by_regex)(self.raw(), pattern.as_ptr(), c_int::from(force)) };
        self.observe("remove_by_regex", removed);
        u64::try_from(removed)
            .map_err(|_| format!("remove_by_regex at the master {} failed: {}", self.master, sys::code_name(removed)))
    }

    /// Whether the client and the master are well.
    pub(crate) fn health_check(&self) -> Result<(), String> {
        self.admit("health_check")?;
        // SAFETY: the handle is live.
        let status = unsafe { (self.api().health_check)(self.raw()) };
        self.check("health_check", status)
    }

    /// The per-object statuses of `call`, after marking the master down when one says it did not answer.
    fn observe_each(&self, call: &str, statuses: Vec<i64>) -> Vec<i64> {
        for &status in &statuses {
            self.observe(call, status);
        }
        statuses
    }

    fn check(&self, call: &str, status: c_int) -> Result<(), String> {
        self.observe(call, status.into());
        if status == 0 {
            Ok(())
        } else {
            Err(format!("{call} at the master {} failed: {}", self.master, sys::code_name(status.into())))
        }
    }
}

impl Client {
    /// Destroys the client, which stops its transfers and unmounts its segment, and waits for that up to `wait`;
    /// whether it ended.
    pub(crate) fn close(mut self, wait: Duration) -> bool {
        self.handle.take().is_none_or(|handle| destroy_within(handle, wait))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let Some(handle) = self.handle.take() else { return };
        if !destroy_within(handle, self.close_wait) {
            tracing::warn!(
                master = %self.master,
                waited_ms = self.close_wait.as_millis() as u64,
                "closing the Mooncake client (unmounting its segment) did not end in time; it goes on in the background"
            );
        }
    }
}

/// Gives up this holder of `handle` on a thread of its own and waits up to `wait` for the handle's destruction
/// (a probe still waiting on the master holds it too: the last holder destroys it); whether it ended. A thread that
/// cannot start drops the handle here, with the closure.
fn destroy_within(handle: Arc<Handle>, wait: Duration) -> bool {
    let (sender, receiver) = sync_channel(1);
    *handle.destroyed.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(sender);
    let _ = std::thread::Builder::new().name("hicache-mooncake-close".into()).spawn(move || drop(handle));
    receiver.recv_timeout(wait).is_ok()
}

/// Whether the master answers a one-key `batch_is_exist` on `handle`.
fn probe(handle: &Handle) -> bool {
    let key = CString::new(PROBE_KEY).expect("no NUL");
    let pointers = [key.as_ptr()];
    let mut result: c_int = 0;
    // SAFETY: the handle is live (held by this probe); one NUL-terminated key and room for one result, alive for
    // the call.
    let status = unsafe { (handle.api.batch_is_exist)(handle.raw, pointers.as_ptr(), 1, &mut result) };
    status == 0 && result >= 0
}

/// A whole call's failure that may leave transfers in flight, given to every object (so the caller handles it as
/// one); `None` for success or a settled failure.
fn unsettled(status: c_int, took: Duration, objects: usize) -> Option<Vec<i64>> {
    let status = i64::from(status);
    (status < 0 && !sys::is_settled_failure(status, took)).then(|| vec![status; objects])
}

fn key_pointers(keys: &[CString]) -> Vec<*const c_char> {
    keys.iter().map(|key| key.as_ptr()).collect()
}

/// Fails fast when nothing accepts connections at `master` (Mooncake's own setup retries for about 90 s).
fn probe_master(master: &str, timeout: Duration) -> Result<(), String> {
    let addresses: Vec<_> = master
        .to_socket_addrs()
        .map_err(|error| format!("the Mooncake master address {master:?} does not resolve: {error}"))?
        .collect();
    let started = Instant::now();
    let mut last = None;
    for address in &addresses {
        match TcpStream::connect_timeout(address, timeout) {
            Ok(_) => return Ok(()),
            Err(error) => last = Some(error),
        }
    }
    // say how long it waited only when it waited (a refused connection fails at once)
    let reason = match last {
        None => "no address".to_owned(),
        Some(error) if error.kind() == std::io::ErrorKind::TimedOut => {
            format!("no answer within {} ms", timeout.as_millis())
        }
        Some(error) => format!("{error}, after {} ms", started.elapsed().as_millis()),
    };
    Err(format!(
        "the Mooncake master at {master} does not answer ({reason}); start one (`cargo xtask mooncake` runs one on \
         loopback) or set MOONCAKE_MASTER / master_server_address"
    ))
}
