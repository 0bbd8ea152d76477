//! A **mock** of 3FS's USRBIO library (`libhf3fs_api_shared.so`), for hicache's 3FS tests on machines without 3FS.
//!
//! It exports the C symbols hicache's 3FS backend calls, with the real library's structures and return conventions,
//! and does the I/O itself with `pread`/`pwrite` on plain files, one worker thread per ring. It is built as a library
//! of the real one's file name so that the backend loads it through the same path (`HF3FS_LIB_DIR`), and it says
//! what it is through one extra symbol, `hicache_usrbio_mock`, that the real library does not have.
//!
//! What it checks as the real one does: a mount point is a directory holding `3fs-virt/iovs/`; a wrapped iov must
//! have been published there as a symlink named by its id's hex digits to a file of at least its size (3FS's agent
//! maps the memory through it); an I/O's buffer lies wholly inside the iov given; its direction matches the ring's;
//! its file descriptor was registered; a ring holds at most `entries` I/Os between preparation and reaping. What it
//! does not do: RDMA, a separate agent process, `io_depth` batching, priorities, NUMA placement.

use std::collections::{HashSet, VecDeque};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

/// `struct hf3fs_iov`: shared memory the I/Os read into and write from.
#[repr(C)]
pub struct hf3fs_iov {
    /// First byte of the memory.
    pub base: *mut u8,
    /// The library's handle; null for a wrapped iov.
    pub iovh: *mut c_void,
    /// The iov's id (its shared memory's name in the mount's `3fs-virt/iovs/`).
    pub id: [u8; 16],
    /// The mount point, NUL-terminated.
    pub mount_point: [c_char; 256],
    /// Bytes.
    pub size: usize,
    /// Block size (0: one block).
    pub block_size: usize,
    /// NUMA node (-1: none).
    pub numa: c_int,
}

/// `struct hf3fs_ior`: a ring of I/O requests, reads or writes.
#[repr(C)]
pub struct hf3fs_ior {
    /// The ring's own memory (unused by the mock).
    pub iov: hf3fs_iov,
    /// The library's handle.
    pub iorh: *mut c_void,
    /// The mount point, NUL-terminated.
    pub mount_point: [c_char; 256],
    /// Whether the ring reads.
    pub for_read: bool,
    /// I/Os per batch the agent waits for (not modelled).
    pub io_depth: c_int,
    /// Priority (not modelled).
    pub priority: c_int,
    /// Batching timeout (not modelled).
    pub timeout: c_int,
    /// `HF3FS_IOR_*` flags (not modelled).
    pub flags: u64,
}

/// `struct hf3fs_cqe`: one completed I/O.
#[repr(C)]
pub struct hf3fs_cqe {
    /// The index `hf3fs_prep_io` returned.
    pub index: i32,
    /// Zero.
    pub reserved: i32,
    /// Bytes moved, or `-errno`.
    pub result: i64,
    /// The caller's pointer given to `hf3fs_prep_io`.
    pub userdata: *const c_void,
}

/// What this library is, for a caller that asks: the real one has no such symbol.
#[unsafe(no_mangle)]
pub extern "C" fn hicache_usrbio_mock() -> *const c_char {
    c"hicache's USRBIO mock over plain files (not 3FS)".as_ptr()
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// File descriptors registered with `hf3fs_reg_fd`.
static REGISTERED: Mutex<Option<HashSet<c_int>>> = Mutex::new(None);

/// # Safety
///
/// `text` is null or a NUL-terminated string.
unsafe fn path_of(text: *const c_char) -> Option<PathBuf> {
    if text.is_null() {
        return None;
    }
    // SAFETY: the caller gives a NUL-terminated string.
    let text = unsafe { CStr::from_ptr(text) };
    let text = text.to_str().ok()?;
    (!text.is_empty()).then(|| PathBuf::from(text))
}

fn iovs_dir(mount: &Path) -> PathBuf {
    mount.join("3fs-virt/iovs")
}

/// A mount point as the calls that take one check it: a path (else `-EINVAL`) that holds `3fs-virt/iovs/` (else
/// `-ENOENT`), short enough for the structs' 256-byte field (else `-EINVAL`); the path and that field's bytes.
///
/// # Safety
///
/// `mount_point` is null or a NUL-terminated string.
unsafe fn mount_of(mount_point: *const c_char) -> Result<(PathBuf, [c_char; 256]), c_int> {
    // SAFETY: as this function's contract.
    let mount = unsafe { path_of(mount_point) }.ok_or(-libc::EINVAL)?;
    if !iovs_dir(&mount).is_dir() {
        return Err(-libc::ENOENT);
    }
    let bytes = mount.as_os_str().as_encoded_bytes();
    let mut field = [0 as c_char; 256];
    if bytes.len() >= field.len() {
        return Err(-libc::EINVAL);
    }
    for (slot, &byte) in field.iter_mut().zip(bytes) {
        *slot = byte as c_char;
    }
    Ok((mount, field))
}

fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The mount point holding `path`: the nearest ancestor (or itself) with a `3fs-virt` folder. Returns its length plus
/// one, copied into `mount_point` when it fits in `size` bytes; -1 when `path` is on no mount.
///
/// # Safety
///
/// `mount_point` is writable for `size` bytes; `path` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hf3fs_extract_mount_point(
    mount_point: *mut c_char,
    size: c_int,
    path: *const c_char,
) -> c_int {
    // SAFETY: the caller gives a NUL-terminated path.
    let Some(path) = (unsafe { path_of(path) }) else { return -1 };
    let mut candidate = std::fs::canonicalize(&path).ok().or_else(|| {
        let parent = path.parent()?;
        std::fs::canonicalize(parent).ok()
    });
    while let Some(dir) = candidate {
        if dir.join("3fs-virt").is_dir() {
            let bytes = dir.as_os_str().as_encoded_bytes();
            let needed = bytes.len() + 1;
            if !mount_point.is_null() && needed <= size.max(0) as usize {
                // SAFETY: the caller's buffer holds `size` bytes, at least `needed`.
                let target = unsafe { std::slice::from_raw_parts_mut(mount_point.cast::<u8>(), needed) };
                target[..bytes.len()].copy_from_slice(bytes);
                target[bytes.len()] = 0;
            }
            return c_int::try_from(needed).unwrap_or(-1);
        }
        candidate = dir.parent().map(Path::to_path_buf);
    }
    -1
}

/// The memory of an iov made by `hf3fs_iovcreate`.
struct Created {
    length: usize,
}

/// Makes an iov of `size` bytes of shared memory on `mount_point`. 0, or `-errno`.
///
/// # Safety
///
/// `iov` is writable; `mount_point` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hf3fs_iovcreate(
    iov: *mut hf3fs_iov,
    mount_point: *const c_char,
    size: usize,
    block_size: usize,
    numa: c_int,
) -> c_int {
    // SAFETY: the caller gives a NUL-terminated string.
    let (_, field) = match unsafe { mount_of(mount_point) } {
        Ok(mount) => mount,
        Err(code) => return code,
    };
    if iov.is_null() || size == 0 {
        return -libc::EINVAL;
    }
    // SAFETY: a new anonymous shared mapping; no existing memory is touched.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return -errno();
    }
    let mut id = [0u8; 16];
    // SAFETY: `id` is 16 writable bytes.
    if unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) } != 16 {
        id = [0x5a; 16];
    }
    // SAFETY: the caller's `iov` is writable.
    let iov = unsafe { &mut *iov };
    iov.mount_point = field;
    iov.base = base.cast();
    iov.iovh = Box::into_raw(Box::new(Created { length: size })).cast();
    iov.id = id;
    iov.size = size;
    iov.block_size = block_size;
    iov.numa = numa;
    0
}

/// Frees an iov made by `hf3fs_iovcreate`; a wrapped iov (null handle) is left alone.
///
/// # Safety
///
/// `iov` is null or an iov this library filled, with no I/O in flight on it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hf3fs_iovdestroy(iov: *mut hf3fs_iov) {
    if iov.is_null() {
        return;
    }
    // SAFETY: the caller's iov, filled by this library.
    let iov = unsafe { &mut *iov };
    if iov.iovh.is_null() {
        return;
    }
    // SAFETY: `iovh` was made by `Box::into_raw` in `hf3fs_iovcreate` and is freed once (cleared below).
    let created = unsafe { Box::from_raw(iov.iovh.cast::<Created>()) };
    // SAFETY: the mapping `hf3fs_iovcreate` made, of that length; no I/O uses it.
    unsafe { libc::munmap(iov.base.cast(), created.length) };
    iov.iovh = std::ptr::null_mut();
    iov.base = std::ptr::null_mut();
}

/// Wraps memory the caller published in the mount's `3fs-virt/iovs/` (a symlink named by the hex digits of `id` to
/// a shared-memory file of at least `size` bytes). 0, or `-errno`.
///
/// # Safety
///
/// `iov` is writable; `id` points to 16 bytes; `mount_point` is a NUL-terminated string; `base` stays mapped for
/// `size` bytes while the iov is used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hf3fs_iovwrap(
    iov: *mut hf3fs_iov,
    base: *mut c_void,
    id: *const u8,
    mount_point: *const c_char,
    size: usize,
    block_size: usize,
    numa: c_int,
) -> c_int {
    // SAFETY: the caller gives a NUL-terminated string.
    let (mount, field) = match unsafe { mount_of(mount_point) } {
        Ok(mount) => mount,
        Err(code) => return code,
    };
    if iov.is_null() || base.is_null() || id.is_null() {
        return -libc::EINVAL;
    }
    let mut name = [0u8; 16];
    // SAFETY: the caller's id is 16 bytes.
    name.copy_from_slice(unsafe { std::slice::from_raw_parts(id, 16) });
    let link = iovs_dir(&mount).join(hex(&name));
    match std::fs::metadata(&link) {
        Ok(target) if target.is_file() && target.len() >= size as u64 => {}
        Ok(_) => return -libc::EINVAL,
        Err(_) => return -libc::ENOENT,
    }
    // SAFETY: the caller's `iov` is writable.
    let iov = unsafe { &mut *iov };
    iov.mount_point = field;
    iov.base = base.cast();
    iov.iovh = std::ptr::null_mut();
    iov.id = name;
    iov.size = size;
    iov.block_size = block_size;
    iov.numa = numa;
    0
}

/// One prepared I/O.
struct Io {
    index: i32,
    read: bool,
    address: usize,
    fd: c_int,
    offset: u64,
    len: usize,
    userdata: usize,
}

#[derive(Default)]
struct RingState {
    prepared: Vec<Io>,
    submitted: VecDeque<Io>,
    done: VecDeque<(i32, i64, usize)>,
    /// Prepared, submitted, running or done but not reaped.
    held: usize,
    next_index: i32,
    stop: bool,
}

struct Ring {
    entries: usize,
    for_read: bool,
    state: Mutex<RingState>,
    changed: Condvar,
}

struct RingHandle {
    ring: Arc<Ring>,
    worker: Option<JoinHandle<()>>,
}

impl Ring {
    fn work(&self) {
        let mut state = lock(&self.state);
        loop {
            if let Some(io) = state.submitted.pop_front() {
                drop(state);
                let result = perform(&io);
                state = lock(&self.state);
                state.done.push_back((io.index, result, io.userdata));
                self.changed.notify_all();
            } else if state.stop {
                return;
            } else {
                state = self.changed.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        }
    }
}

/// Moves the I/O's bytes; the bytes moved (fewer at the end of the file) or `-errno`.
fn perform(io: &Io) -> i64 {
    let mut done = 0usize;
    while done < io.len {
        let address = (io.address + done) as *mut c_void;
        let offset = libc::off_t::try_from(io.offset + done as u64).unwrap_or(libc::off_t::MAX);
        let moved = if io.read {
            // SAFETY: `hf3fs_prep_io` checked that the range lies in the iov, whose memory the caller keeps mapped
            // until the I/O is reaped.
            unsafe { libc::pread(io.fd, address, io.len - done, offset) }
        } else {
            // SAFETY: as above.
            unsafe { libc::pwrite(io.fd, address, io.len - done, offset) }
        };
        match moved {
            0 => break,
            moved if moved > 0 => done += moved as usize,
            _ if errno() == libc::EINTR => {}
            _ => return -i64::from(errno()),
        }
    }
    done as i64
}

/// Makes a ring of `entries` I/Os, reads or writes, on `mount_point`. 0, or `-errno`.
///
/// # Safety
///
/// `ior` is writable; `mount_point` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hf3fs_iorcreate4(
    ior: *mut hf3fs_ior,
    mount_point: *const c_char,
    entries: c_int,
    for_read: bool,
    io_depth: c_int,
    timeout: c_int,
    numa: c_int,
    flags: u64,
) -> c_int {
    // SAFETY: the caller gives a NUL-terminated string.
    let (_, field) = match unsafe { mount_of(mount_point) } {
        Ok(mount) => mount,
        Err(code) => return code,
    };
    if ior.is_null() || entries <= 0 || timeout < 0 {
        return -libc::EINVAL;
    }
    let ring = Arc::new(Ring {
        entries: entries as usize,
        for_read,
        state: Mutex::new(RingState::default()),
        changed: Condvar::new(),
    });
    let worker = {
        let ring = Arc::clone(&ring);
        match std::thread::Builder::new().name("usrbio-mock".into()).spawn(move || ring.work()) {
            Ok(worker) => worker,
            Err(_) => return -libc::EAGAIN,
        }
    };
    // SAFETY: the caller's `ior` is writable; a zeroed ior is valid (null pointers, zero numbers).
    let ior = unsafe {
        ior.write(std::mem::zeroed());
        &mut *ior
    };
    ior.mount_point = field;
    ior.iorh = Box::into_raw(Box::new(RingHandle { ring, worker: Some(worker) })).cast();
    ior.for_read = for_read;
    ior.io_depth = io_depth;
    ior.timeout = timeout;
    ior.iov.numa = numa;
    ior.flags = flags;
    0
}

fn stop(handle: &mut RingHandle) {
    lock(&handle.ring.state).stop = true;
    handle.ring.changed.notify_all();
    if let Some(worker) = handle.worker.take() {
        let _ = worker.join();
    }
}

/// Frees a ring after finishing the I/Os submitted to it.
///
/// # Safety
///
/// `ior` is null or a ring this library made, used by no other thread now.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hf3fs_iordestroy(ior: *mut hf3fs_ior) {
    if ior.is_null() {
        return;
    }
    // SAFETY: the caller's ring.
    let ior = unsafe { &mut *ior };
    if ior.iorh.is_null() {
        return;
    }
    // SAFETY: `iorh` was made by `Box::into_raw` in `hf3fs_iorcreate4` and is freed once (cleared below).
    let mut handle = unsafe { Box::from_raw(ior.iorh.cast::<RingHandle>()) };
    stop(&mut handle);
    ior.iorh = std::ptr::null_mut();
}

/// Registers a file descriptor for I/O: 0, or an errno (positive) when it is not open.
#[unsafe(no_mangle)]
pub extern "C" fn hf3fs_reg_fd(fd: c_int, _flags: u64) -> c_int {
    // SAFETY: F_GETFD only asks whether the descriptor is open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return libc::EBADF;
    }
    let mut registered = lock(&REGISTERED);
    if !registered.get_or_insert_with(HashSet::new).insert(fd) {
        return libc::EINVAL;
    }
    0
}

/// Forgets a registered file descriptor.
#[unsafe(no_mangle)]
pub extern "C" fn hf3fs_dereg_fd(fd: c_int) {
    if let Some(registered) = lock(&REGISTERED).as_mut() {
        registered.remove(&fd);
    }
}

/// # Safety
///
/// `ior` is null or a ring this library made.
unsafe fn ring_of<'a>(ior: *const hf3fs_ior) -> Option<&'a Ring> {
    if ior.is_null() {
        return None;
    }
    // SAFETY: the caller's ring.
    let handle = unsafe { (*ior).iorh.cast::<RingHandle>() };
    if handle.is_null() {
        return None;
    }
    // SAFETY: made by `hf3fs_iorcreate4`, alive until `hf3fs_iordestroy`.
    Some(unsafe { &(*handle).ring })
}

/// Prepares one I/O of `len` bytes between `ptr` (inside `iov`) and `fd` at `off`. Its index, or `-errno`.
///
/// # Safety
///
/// `ior` is a ring this library made and `iov` an iov it filled; one thread prepares on a ring at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hf3fs_prep_io(
    ior: *const hf3fs_ior,
    iov: *const hf3fs_iov,
    read: bool,
    ptr: *mut c_void,
    fd: c_int,
    off: usize,
    len: u64,
    userdata: *const c_void,
) -> c_int {
    // SAFETY: the caller's ring.
    let Some(ring) = (unsafe { ring_of(ior) }) else { return -libc::EINVAL };
    if iov.is_null() || read != ring.for_read {
        return -libc::EINVAL;
    }
    // SAFETY: the caller's iov.
    let (base, size) = unsafe { ((*iov).base as usize, (*iov).size) };
    let (address, len) = (ptr as usize, len as usize);
    if address < base || address.checked_add(len).is_none_or(|end| end > base + size) {
        return -libc::EINVAL;
    }
    if !lock(&REGISTERED).as_ref().is_some_and(|registered| registered.contains(&fd)) {
        return -libc::EBADF;
    }
    let mut state = lock(&ring.state);
    if state.held >= ring.entries {
        return -libc::EAGAIN;
    }
    let index = state.next_index;
    state.next_index = state.next_index.wrapping_add(1) & i32::MAX;
    state.held += 1;
    state.prepared.push(Io { index, read, address, fd, offset: off as u64, len, userdata: userdata as usize });
    index
}

/// Hands the prepared I/Os to the worker. 0, or `-errno`.
///
/// # Safety
///
/// `ior` is a ring this library made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hf3fs_submit_ios(ior: *const hf3fs_ior) -> c_int {
    // SAFETY: the caller's ring.
    let Some(ring) = (unsafe { ring_of(ior) }) else { return -libc::EINVAL };
    let mut state = lock(&ring.state);
    let prepared = std::mem::take(&mut state.prepared);
    state.submitted.extend(prepared);
    ring.changed.notify_all();
    0
}

/// Waits for at least `min_results` completed I/Os (or until `abs_timeout`, `CLOCK_REALTIME`, if given) and reaps
/// up to `cqec` of them into `cqes`. The count reaped, or `-ETIMEDOUT` when none completed in time.
///
/// # Safety
///
/// `ior` is a ring this library made; `cqes` is writable for `cqec` entries; `abs_timeout` is null or readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn hf3fs_wait_for_ios(
    ior: *const hf3fs_ior,
    cqes: *mut hf3fs_cqe,
    cqec: c_int,
    min_results: c_int,
    abs_timeout: *const libc::timespec,
) -> c_int {
    // SAFETY: the caller's ring.
    let Some(ring) = (unsafe { ring_of(ior) }) else { return -libc::EINVAL };
    if cqes.is_null() || cqec <= 0 {
        return -libc::EINVAL;
    }
    let deadline = (!abs_timeout.is_null()).then(|| {
        // SAFETY: the caller's timespec.
        let at = unsafe { *abs_timeout };
        SystemTime::UNIX_EPOCH + Duration::new(at.tv_sec.max(0) as u64, at.tv_nsec.clamp(0, 999_999_999) as u32)
    });
    let wanted = (min_results.max(0) as usize).min(cqec as usize);
    let mut state = lock(&ring.state);
    while state.done.len() < wanted {
        let wait = match deadline {
            None => None,
            Some(deadline) => match deadline.duration_since(SystemTime::now()) {
                Ok(left) if !left.is_zero() => Some(left),
                _ => break,
            },
        };
        state = match wait {
            None => ring.changed.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner()),
            Some(left) => ring.changed.wait_timeout(state, left).unwrap_or_else(|poisoned| poisoned.into_inner()).0,
        };
    }
    let count = state.done.len().min(cqec as usize);
    if count == 0 && wanted > 0 {
        return -libc::ETIMEDOUT;
    }
    for slot in 0..count {
        let (index, result, userdata) = state.done.pop_front().expect("counted above");
        // SAFETY: `slot < cqec`, within the caller's array.
        unsafe { cqes.add(slot).write(hf3fs_cqe { index, reserved: 0, result, userdata: userdata as *const c_void }) };
    }
    state.held -= count;
    count as c_int
}
