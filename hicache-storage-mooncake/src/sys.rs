//! The Mooncake Store C API (`store_c.h` of Mooncake's `mooncake-store`), declared here from its public description
//! and loaded at run time, so hicache builds and runs without Mooncake installed until this backend is opened.
//!
//! Every function returns a status and catches C++ exceptions; `char *` arguments are not kept after a call returns.
//! Negative statuses are Mooncake's error codes (`code_name`).

use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The environment variable naming the library (`libmooncake_store.so`).
pub(crate) const LIBRARY_ENV: &str = "MOONCAKE_STORE_LIBRARY";

/// The library's file name, looked up on the loader's search path when no path is given.
pub(crate) const LIBRARY_NAME: &str = "libmooncake_store.so";

/// `mooncake_replicate_config`: replicas of each object and where they may go.
#[repr(C)]
pub(crate) struct ReplicateConfig {
    pub(crate) replica_num: usize,
    pub(crate) with_soft_pin: c_int,
    pub(crate) with_hard_pin: c_int,
    pub(crate) preferred_segments: *const *const c_char,
    pub(crate) preferred_segments_count: usize,
}

/// An opaque store handle (`mooncake_store_t`).
pub(crate) type Handle = *mut c_void;

/// The functions hicache calls, resolved from one loaded library.
pub(crate) struct Api {
    pub(crate) create: unsafe extern "C" fn() -> Handle,
    pub(crate) destroy: unsafe extern "C" fn(Handle),
    pub(crate) setup: unsafe extern "C" fn(
        Handle,
        *const c_char,
        *const c_char,
        u64,
        u64,
        *const c_char,
        *const c_char,
        *const c_char,
    ) -> c_int,
    pub(crate) health_check: unsafe extern "C" fn(Handle) -> c_int,
    pub(crate) get_hostname: unsafe extern "C" fn(Handle, *mut c_char, usize) -> c_int,
    pub(crate) register_buffer: unsafe extern "C" fn(Handle, *mut c_void, usize) -> c_int,
    pub(crate) unregister_buffer: unsafe extern "C" fn(Handle, *mut c_void) -> c_int,
    pub(crate) batch_put_from: unsafe extern "C" fn(
        Handle,
        *const *const c_char,
        *const *mut c_void,
        *const usize,
        usize,
        *const ReplicateConfig,
        *mut c_int,
    ) -> c_int,
    pub(crate) batch_get_into:
        unsafe extern "C" fn(Handle, *const *const c_char, *const *mut c_void, *const usize, usize, *mut i64) -> c_int,
    pub(crate) batch_is_exist: unsafe extern "C" fn(Handle, *const *const c_char, usize, *mut c_int) -> c_int,
    pub(crate) remove: unsafe extern "C" fn(Handle, *const c_char, c_int) -> c_int,
    pub(crate) remove_by_regex: unsafe extern "C" fn(Handle, *const c_char, c_int) -> i64,
}

/// Libraries loaded so far, by path; never unloaded (their C++ statics live for the rest of the process).
static LOADED: Mutex<Vec<(PathBuf, &'static Api)>> = Mutex::new(Vec::new());

/// Where the library is looked for: `configured`, else `$MOONCAKE_STORE_LIBRARY`, else the loader's search path.
pub(crate) fn resolve_library(configured: Option<&Path>) -> PathBuf {
    configured
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(LIBRARY_ENV).filter(|path| !path.is_empty()).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(LIBRARY_NAME))
}

/// Loads the library at `path` (a bare file name goes through the loader's search path) once per process.
///
/// # Errors
///
/// A message naming the path, the loader's reason and where to get a library.
pub(crate) fn load(path: &Path) -> Result<&'static Api, String> {
    let mut loaded = LOADED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, api)) = loaded.iter().find(|(done, _)| done == path) {
        return Ok(api);
    }
    let how = "set MOONCAKE_STORE_LIBRARY to a libmooncake_store.so: a Mooncake build with -DWITH_STORE_C_SHARED=ON, \
               or the one in the tokenspeed-mooncake wheel on PyPI (`cargo xtask mooncake` unpacks it under \
               target/mooncake)";
    // SAFETY: loading runs the library's initialisers: Mooncake's own and those of the libraries it needs (glog,
    // gflags, its transfer engine), which only set up their static state. The handle is never closed (below), so no
    // function pointer taken from it can dangle.
    let library = unsafe { libloading::Library::new(path) }
        .map_err(|failure| format!("loading the Mooncake Store library {}: {failure}; {how}", path.display()))?;
    let missing = |name: &str, failure: libloading::Error| {
        format!("{} has no {name} ({failure}); it is not a Mooncake Store C API library; {how}", path.display())
    };
    macro_rules! symbol {
        ($name:literal) => {
            // SAFETY: the symbol is looked up by its C name and given the type `store_c.h` declares for it (the
            // field's type in `Api`); the library stays loaded for the rest of the process.
            *unsafe { library.get(concat!($name, "\0").as_bytes()) }.map_err(|failure| missing($name, failure))?
        };
    }
    let api = Api {
        create: symbol!("mooncake_store_create"),
        destroy: symbol!("mooncake_store_destroy"),
        setup: symbol!("mooncake_store_setup"),
        health_check: symbol!("mooncake_store_health_check"),
        get_hostname: symbol!("mooncake_store_get_hostname"),
        register_buffer: symbol!("mooncake_store_register_buffer"),
        unregister_buffer: symbol!("mooncake_store_unregister_buffer"),
        batch_put_from: symbol!("mooncake_store_batch_put_from"),
        batch_get_into: symbol!("mooncake_store_batch_get_into"),
        batch_is_exist: symbol!("mooncake_store_batch_is_exist"),
        remove: symbol!("mooncake_store_remove"),
        remove_by_regex: symbol!("mooncake_store_remove_by_regex"),
    };
    std::mem::forget(library);
    let api: &'static Api = Box::leak(Box::new(api));
    loaded.push((path.to_path_buf(), api));
    Ok(api)
}

/// Mooncake's error codes that hicache treats apart.
pub(crate) mod code {
    /// No space left in the cluster's segments (eviction could not make room).
    pub(crate) const NO_AVAILABLE_HANDLE: i64 = -200;
    /// An argument was refused before any transfer (for a read: the buffer is smaller than the object).
    pub(crate) const INVALID_PARAMS: i64 = -600;
    /// The object's replica is still being written.
    pub(crate) const REPLICA_IS_NOT_READY: i64 = -703;
    /// No such object.
    pub(crate) const OBJECT_NOT_FOUND: i64 = -704;
    /// The object exists already.
    pub(crate) const OBJECT_ALREADY_EXISTS: i64 = -705;
    /// The object was read less than the lease time ago (10 s by default); a removal without force is refused.
    pub(crate) const OBJECT_HAS_LEASE: i64 = -706;
    /// The lease ran out while the object was read.
    pub(crate) const LEASE_EXPIRED: i64 = -707;
    /// A transfer of the call failed (a peer died, a link went down), or did not end by Mooncake's transfer deadline.
    pub(crate) const TRANSFER_FAIL: i64 = -800;
    /// The master did not answer.
    pub(crate) const RPC_FAIL: i64 = -900;
    /// The master did not answer in time.
    pub(crate) const RPC_TIMEOUT: i64 = -901;
    /// The tenant's quota is used up.
    pub(crate) const TENANT_QUOTA_EXCEEDED: i64 = -1700;
}

/// Mooncake's deadline for a call's transfers (`transfer_task.cpp`: 60 s from the operation's start, in 0.3.12 and
/// since). Its wait ends in one of two ways: every transfer of the call reached a final state (completed, failed,
/// cancelled), or the deadline passed with some still running. Only the second leaves a transfer that may still
/// touch the caller's memory, so a `TRANSFER_FAIL` that came back well before the deadline is settled (a dead peer
/// fails its transfers at once). The margin covers the two clocks.
pub(crate) const TRANSFER_DEADLINE_SETTLES_BEFORE: std::time::Duration = std::time::Duration::from_secs(50);

/// Whether a failed read or write with this code, from a call that took `took`, is known to have moved no bytes
/// after the call returned: the request was refused before any transfer was submitted, or after every transfer
/// reached its final state ([`TRANSFER_DEADLINE_SETTLES_BEFORE`]). Any other failure may leave a transfer in flight
/// that still reads or writes the caller's memory.
pub(crate) fn is_settled_failure(status: i64, took: std::time::Duration) -> bool {
    (status == code::TRANSFER_FAIL && took < TRANSFER_DEADLINE_SETTLES_BEFORE)
        || matches!(
            status,
            code::NO_AVAILABLE_HANDLE
                | code::INVALID_PARAMS
                | code::REPLICA_IS_NOT_READY
                | code::OBJECT_NOT_FOUND
                | code::OBJECT_ALREADY_EXISTS
                | code::LEASE_EXPIRED
                | code::RPC_FAIL
                | code::RPC_TIMEOUT
                | code::TENANT_QUOTA_EXCEEDED
        )
}

/// Mooncake's name of an error code (`types.h`), or `code N`.
pub(crate) fn code_name(status: i64) -> String {
    let name = match status {
        -1 => "INTERNAL_ERROR",
        -10 => "BUFFER_OVERFLOW",
        -100 => "SHARD_INDEX_OUT_OF_RANGE",
        -101 => "SEGMENT_NOT_FOUND",
        -102 => "SEGMENT_ALREADY_EXISTS",
        code::NO_AVAILABLE_HANDLE => "NO_AVAILABLE_HANDLE (no space in the cluster)",
        -300 => "INVALID_VERSION",
        -400 => "INVALID_KEY",
        -500 => "WRITE_FAIL",
        code::INVALID_PARAMS => "INVALID_PARAMS",
        -601 => "ILLEGAL_CLIENT",
        -700 => "INVALID_WRITE",
        -701 => "INVALID_READ",
        -702 => "INVALID_REPLICA",
        code::REPLICA_IS_NOT_READY => "REPLICA_IS_NOT_READY",
        code::OBJECT_NOT_FOUND => "OBJECT_NOT_FOUND",
        code::OBJECT_ALREADY_EXISTS => "OBJECT_ALREADY_EXISTS",
        code::OBJECT_HAS_LEASE => "OBJECT_HAS_LEASE",
        code::LEASE_EXPIRED => "LEASE_EXPIRED",
        -800 => "TRANSFER_FAIL",
        code::RPC_FAIL => "RPC_FAIL (the master did not answer)",
        code::RPC_TIMEOUT => "RPC_TIMEOUT",
        -1000 => "ETCD_OPERATION_ERROR",
        code::TENANT_QUOTA_EXCEEDED => "TENANT_QUOTA_EXCEEDED",
        _ => return format!("code {status}"),
    };
    format!("{name} ({status})")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_transfer_failure_is_settled_only_before_mooncakes_transfer_deadline() {
        let quick = Duration::from_millis(900);
        assert!(is_settled_failure(code::TRANSFER_FAIL, quick));
        assert!(!is_settled_failure(code::TRANSFER_FAIL, Duration::from_secs(61)));
        assert!(!is_settled_failure(code::TRANSFER_FAIL, TRANSFER_DEADLINE_SETTLES_BEFORE));
        assert!(is_settled_failure(code::OBJECT_NOT_FOUND, Duration::from_secs(61)));
        assert!(is_settled_failure(code::RPC_TIMEOUT, Duration::from_secs(31)));
        // a code hicache does not know may leave a transfer running, however soon it came back
        assert!(!is_settled_failure(-1, quick));
    }
}
