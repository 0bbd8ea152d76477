//! A Mooncake Store client: one handle of the C API, set up against a master, with checked batch calls.
//!
//! Buffers are passed as raw addresses; the unsafe contract of each call (what memory it may touch, and until when)
//! is stated once here, and [`crate::MooncakeStorage`] derives every address from the segments of the call it serves.

use std::ffi::{CString, c_char, c_int, c_void};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::sys::{self, Api, Handle, ReplicateConfig};

/// One client handle.
pub(crate) struct Client {
    api: &'static Api,
    handle: Handle,
    master: String,
    /// This client's own segment, asked for first by puts; `None`: the master places replicas as it likes.
    preferred_segment: Option<CString>,
}

// SAFETY: a Mooncake client serves calls from many threads at once (SGLang calls one from its backup and prefetch
// threads together; the C API wraps a client whose operations lock what they share), and the handle is only an
// address of that client.
unsafe impl Send for Client {}
// SAFETY: as for Send: every method takes `&self` and the C API is safe to call concurrently on one handle.
unsafe impl Sync for Client {}

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
    /// Checks that the master answers, then creates a client and sets it up (mounting its segment).
    pub(crate) fn connect(api: &'static Api, setup: &Setup<'_>) -> Result<Self, String> {
        probe_master(setup.master, setup.connect_timeout)?;
        let strings = [
            c_string("local_hostname", setup.local_hostname)?,
            c_string("metadata_server", setup.metadata_server)?,
            c_string("protocol", setup.protocol)?,
            c_string("device_name", setup.device)?,
            c_string("master_server_address", setup.master)?,
        ];
        // SAFETY: create takes no arguments and returns a new handle or null.
        let handle = unsafe { (api.create)() };
        if handle.is_null() {
            return Err("mooncake_store_create returned no client".into());
        }
        let mut client = Self { api, handle, master: setup.master.to_owned(), preferred_segment: None };
        // SAFETY: the handle is live; the strings are NUL-terminated and outlive the call (the C API keeps no
        // pointer to them after it returns).
        let status = unsafe {
            (api.setup)(
                handle,
                strings[0].as_ptr(),
                strings[1].as_ptr(),
                setup.global_segment_size,
                setup.local_buffer_size,
                strings[2].as_ptr(),
                strings[3].as_ptr(),
                strings[4].as_ptr(),
            )
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

    /// The name of the segment this client lends (its host name, with the transfer engine's port under
    /// `P2PHANDSHAKE`), as the master knows it; `None` (logged) when the library cannot say.
    fn segment_name(&self) -> Option<CString> {
        let mut buffer = vec![0u8; 512];
        // SAFETY: the handle is live and set up; the buffer holds `buffer.len()` bytes, which the call fills with a
        // NUL-terminated name or leaves alone when the name does not fit.
        let status = unsafe { (self.api.get_hostname)(self.handle, buffer.as_mut_ptr().cast(), buffer.len()) };
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

    /// The master's address, for messages.
    pub(crate) fn master(&self) -> &str {
        &self.master
    }

    /// Registers `[address, address + len)` for transfers.
    ///
    /// # Safety
    ///
    /// The memory stays mapped until [`unregister`](Self::unregister) is called with the same address.
    pub(crate) unsafe fn register(&self, address: usize, len: usize) -> Result<(), String> {
        // SAFETY: the handle is live; the caller keeps the memory mapped while it is registered.
        let status = unsafe { (self.api.register_buffer)(self.handle, address as *mut c_void, len) };
        if status == 0 {
            Ok(())
        } else {
            Err(format!("registering {len} bytes at {address:#x}: {}", sys::code_name(status.into())))
        }
    }

    /// Forgets a registration.
    pub(crate) fn unregister(&self, address: usize) {
        // SAFETY: the handle is live; unregistering an address only drops Mooncake's record of it.
        let status = unsafe { (self.api.unregister_buffer)(self.handle, address as *mut c_void) };
        if status != 0 {
            tracing::warn!(address, status = %sys::code_name(status.into()), "unregistering host memory");
        }
    }

    /// Per key: present (1), absent (0) or an error code (negative).
    pub(crate) fn batch_is_exist(&self, keys: &[CString]) -> Result<Vec<i64>, String> {
        let pointers = key_pointers(keys);
        let mut results: Vec<c_int> = vec![0; keys.len()];
        // SAFETY: the handle is live; `pointers` holds one NUL-terminated key per entry, alive for the call, and
        // `results` has room for one int per key.
        let status =
            unsafe { (self.api.batch_is_exist)(self.handle, pointers.as_ptr(), keys.len(), results.as_mut_ptr()) };
        self.check("batch_is_exist", status)?;
        Ok(results.into_iter().map(i64::from).collect())
    }

    /// Writes object `i` from `sizes[i]` bytes at `buffers[i]`; per key 0 or an error code.
    ///
    /// # Safety
    ///
    /// Each `[buffers[i], buffers[i] + sizes[i])` is readable and not written until the call returns; after a
    /// failure that [`sys::is_settled_failure`] does not settle, the transfer may still read it later.
    pub(crate) unsafe fn batch_put_from(
        &self,
        keys: &[CString],
        buffers: &[usize],
        sizes: &[usize],
        replicas: usize,
    ) -> Result<Vec<i64>, String> {
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
        // SAFETY: the handle is live; keys, buffers, sizes and results have one entry per key and outlive the call;
        // the caller vouches for the buffers' memory; `config` and the segment name it points to outlive the call.
        let status = unsafe {
            (self.api.batch_put_from)(
                self.handle,
                pointers.as_ptr(),
                buffers.as_ptr(),
                sizes.as_ptr(),
                keys.len(),
                &config,
                results.as_mut_ptr(),
            )
        };
        self.check("batch_put_from", status)?;
        Ok(results.into_iter().map(i64::from).collect())
    }

    /// Reads object `i` into `sizes[i]` bytes at `buffers[i]`; per key the bytes read or an error code.
    ///
    /// # Safety
    ///
    /// Each `[buffers[i], buffers[i] + sizes[i])` is writable and neither read nor written by anyone else until the
    /// call returns; after a failure that [`sys::is_settled_failure`] does not settle, the transfer may still write
    /// it later.
    pub(crate) unsafe fn batch_get_into(
        &self,
        keys: &[CString],
        buffers: &[usize],
        sizes: &[usize],
    ) -> Result<Vec<i64>, String> {
        let pointers = key_pointers(keys);
        let buffers: Vec<*mut c_void> = buffers.iter().map(|&address| address as *mut c_void).collect();
        let mut results: Vec<i64> = vec![0; keys.len()];
        // SAFETY: the handle is live; keys, buffers, sizes and results have one entry per key and outlive the call;
        // the caller vouches for the buffers' memory.
        let status = unsafe {
            (self.api.batch_get_into)(
                self.handle,
                pointers.as_ptr(),
                buffers.as_ptr(),
                sizes.as_ptr(),
                keys.len(),
                results.as_mut_ptr(),
            )
        };
        self.check("batch_get_into", status)?;
        Ok(results)
    }

    /// Removes one object: 0, or an error code (`OBJECT_NOT_FOUND`, `OBJECT_HAS_LEASE`, ...).
    pub(crate) fn remove(&self, key: &CString) -> i64 {
        // SAFETY: the handle is live and the key NUL-terminated for the call; no force, so readers holding a lease
        // keep the object.
        i64::from(unsafe { (self.api.remove)(self.handle, key.as_ptr(), 0) })
    }

    /// Removes every object whose key matches `pattern`, with `force` also those under a read lease; the number
    /// removed.
    pub(crate) fn remove_by_regex(&self, pattern: &str, force: bool) -> Result<u64, String> {
        let pattern = c_string("pattern", pattern)?;
        // SAFETY: the handle is live and the pattern NUL-terminated for the call.
        let removed = unsafe { (self.api.remove_by_regex)(self.handle, pattern.as_ptr(), c_int::from(force)) };
        u64::try_from(removed)
            .map_err(|_| format!("remove_by_regex at the master {} failed: {}", self.master, sys::code_name(removed)))
    }

    /// Whether the client and the master are well.
    pub(crate) fn health_check(&self) -> Result<(), String> {
        // SAFETY: the handle is live.
        let status = unsafe { (self.api.health_check)(self.handle) };
        self.check("health_check", status)
    }

    fn check(&self, call: &str, status: c_int) -> Result<(), String> {
        if status == 0 {
            Ok(())
        } else {
            Err(format!("{call} at the master {} failed: {}", self.master, sys::code_name(status.into())))
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // SAFETY: the handle is live and this is its last use; destroying unmounts the client's segment.
        unsafe { (self.api.destroy)(self.handle) };
    }
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
    let mut last = None;
    for address in &addresses {
        match TcpStream::connect_timeout(address, timeout) {
            Ok(_) => return Ok(()),
            Err(error) => last = Some(error),
        }
    }
    Err(format!(
        "the Mooncake master at {master} does not answer ({}; waited {} ms); start one (`cargo xtask mooncake` runs \
         one on loopback) or set MOONCAKE_MASTER / master_server_address",
        last.map_or_else(|| "no address".to_owned(), |error| error.to_string()),
        timeout.as_millis()
    ))
}
