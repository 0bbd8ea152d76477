//! Safe types over the USRBIO functions (the `sys` module, generated from the header): the library loaded once per
//! path, iovs (shared memory the agent reads and writes), rings of requests, and registered data files.
//!
//! The library is `libhf3fs_api_shared.so` from `$HF3FS_LIB_DIR`, else the loader's search path. A library that
//! exports `hicache_usrbio_mock` is the workspace's mock (`usrbio-mock/`): it is accepted, said so in the log and in
//! [`Library::mock`].

use std::ffi::{CStr, CString, c_char, c_void};
use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use hicache_core::Error;

use crate::sys;

/// The environment variable naming the folder of the library.
pub const LIB_DIR_ENV: &str = "HF3FS_LIB_DIR";
/// The library's file name.
pub const LIBRARY_NAME: &str = "libhf3fs_api_shared.so";

/// A loaded USRBIO library.
pub struct Library {
    api: sys::Usrbio,
    path: PathBuf,
    mock: Option<String>,
}

/// Libraries loaded so far; never unloaded.
static LOADED: Mutex<Vec<&'static Library>> = Mutex::new(Vec::new());

fn storage_error(message: String) -> Error {
    Error::storage("3fs", message)
}

fn errno_text(code: i32) -> String {
    std::io::Error::from_raw_os_error(code.abs()).to_string()
}

impl Library {
    /// Loads the library from `dir` (else `$HF3FS_LIB_DIR`, else the loader's search path), once per process.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] naming the path, the loader's reason and the variable.
    pub fn load(dir: Option<&Path>) -> Result<&'static Self, Error> {
        let dir = dir
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os(LIB_DIR_ENV).filter(|dir| !dir.is_empty()).map(PathBuf::from));
        let path = dir.map_or_else(|| PathBuf::from(LIBRARY_NAME), |dir| dir.join(LIBRARY_NAME));
        let mut loaded = LOADED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(library) = loaded.iter().find(|library| library.path == path) {
            return Ok(library);
        }
        // SAFETY: loading runs the library's initialisers; 3FS's library (and the mock) only set up logging there.
        let library = unsafe { libloading::Library::new(&path) }.map_err(|error| {
            storage_error(format!(
                "cannot load 3FS's USRBIO library {} ({error}): set {LIB_DIR_ENV} to the folder holding {LIBRARY_NAME} \
                 (a 3FS build installs it; hicache's tests use the mock built by `cargo xtask ci`)",
                path.display()
            ))
        })?;
        // SAFETY: the symbol, where present, is the mock's `const char *hicache_usrbio_mock(void)`.
        let mock = unsafe { library.get::<unsafe extern "C" fn() -> *const c_char>(b"hicache_usrbio_mock\0") }
            .ok()
            .map(|describe| {
                // SAFETY: the mock returns a static NUL-terminated string.
                unsafe { CStr::from_ptr(describe()) }.to_string_lossy().into_owned()
            });
        // SAFETY: the table's signatures are those of the API's header (`include/hicache_usrbio.h`).
        let api = unsafe { sys::Usrbio::from_library(library) }
            .map_err(|error| storage_error(format!("{} is not 3FS's USRBIO library: {error}", path.display())))?;
        if let Some(mock) = &mock {
            tracing::warn!(library = %path.display(), "3fs: using a MOCK of USRBIO: {mock}");
        }
        let library: &'static Self = Box::leak(Box::new(Self { api, path, mock }));
        loaded.push(library);
        Ok(library)
    }

    /// The library's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What the mock says it is, when this is the workspace's mock.
    pub fn mock(&self) -> Option<&str> {
        self.mock.as_deref()
    }

    /// The 3FS mount point holding `path`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming `file_path_prefix` when `path` is on no 3FS mount.
    pub fn mount_point(&self, path: &Path) -> Result<String, Error> {
        let text = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| Error::InvalidConfig {
            field: "file_path_prefix".into(),
            reason: "holds a NUL byte".into(),
        })?;
        let mut buffer = vec![0 as c_char; 4096];
        // SAFETY: the buffer holds 4096 bytes; the path is NUL-terminated.
        let length =
            unsafe { (self.api.hf3fs_extract_mount_point)(buffer.as_mut_ptr(), buffer.len() as i32, text.as_ptr()) };
        if length <= 0 || length as usize > buffer.len() {
            return Err(Error::InvalidConfig {
                field: "file_path_prefix".into(),
                reason: format!("{} is not on a 3FS mount (USRBIO found no mount point for it)", path.display()),
            });
        }
        // SAFETY: the library wrote a NUL-terminated string of `length` bytes with its NUL.
        Ok(unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_string_lossy().into_owned())
    }
}

/// An iov: shared memory the agent moves bytes into and out of.
pub(crate) struct Iov {
    raw: Box<sys::hf3fs_iov>,
    library: &'static Library,
    created: bool,
}

// SAFETY: an iov is a description of memory (a pointer and a length); the memory it names is either its own (made by
// the library, freed on drop) or the caller's, kept mapped by the caller; threads reach its bytes only through I/Os.
unsafe impl Send for Iov {}
// SAFETY: as above; `&Iov` gives no access to the bytes.
unsafe impl Sync for Iov {}

impl Iov {
    /// New shared memory of `size` bytes on `mount`.
    pub(crate) fn create(library: &'static Library, mount: &CStr, size: usize) -> Result<Self, Error> {
        let mut raw = Box::new(sys::hf3fs_iov::default());
        // SAFETY: `raw` is a writable iov; the mount point is NUL-terminated.
        let code = unsafe { (library.api.hf3fs_iovcreate)(&mut *raw, mount.as_ptr(), size, 0, -1) };
        if code != 0 {
            return Err(storage_error(format!("hf3fs_iovcreate of {size} bytes: {}", errno_text(code))));
        }
        Ok(Self { raw, library, created: true })
    }

    /// The caller's memory, published as `/3fs-virt/iovs/{id}` on `mount`, wrapped as an iov.
    ///
    /// # Safety
    ///
    /// `base` stays mapped, readable and writable, for `size` bytes until the iov is dropped, and is the memory of the
    /// published shared-memory file.
    pub(crate) unsafe fn wrap(
        library: &'static Library,
        base: *mut u8,
        id: &[u8; 16],
        mount: &CStr,
        size: usize,
    ) -> Result<Self, Error> {
        let mut raw = Box::new(sys::hf3fs_iov::default());
        // SAFETY: `raw` is writable; the caller keeps `base` mapped; the id is 16 bytes.
        let code =
            unsafe { (library.api.hf3fs_iovwrap)(&mut *raw, base.cast(), id.as_ptr(), mount.as_ptr(), size, 0, -1) };
        if code != 0 {
            return Err(storage_error(format!("hf3fs_iovwrap of {size} bytes: {}", errno_text(code))));
        }
        Ok(Self { raw, library, created: false })
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.raw.base
    }

    pub(crate) fn size(&self) -> usize {
        self.raw.size
    }

    /// Whether `[address, address + len)` lies in the iov.
    pub(crate) fn contains(&self, address: usize, len: usize) -> bool {
        let base = self.raw.base as usize;
        address >= base && address.checked_add(len).is_some_and(|end| end <= base + self.raw.size)
    }

    /// The bytes of an iov this library made.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        assert!(self.created, "only an iov made by hf3fs_iovcreate is read as a slice");
        // SAFETY: the library made `size` bytes at `base` for this iov alone; `&mut self` excludes other users, and no
        // I/O is in flight on it between rings' calls (rings wait for every I/O they submit).
        unsafe { std::slice::from_raw_parts_mut(self.raw.base, self.raw.size) }
    }
}

impl Drop for Iov {
    fn drop(&mut self) {
        if self.created {
            // SAFETY: an iov this library made, with no I/O in flight (rings wait for theirs, and a ring that timed
            // out is leaked with its iovs).
            unsafe { (self.library.api.hf3fs_iovdestroy)(&mut *self.raw) };
        }
    }
}

/// A data file opened and registered for USRBIO.
pub(crate) struct DataFile {
    file: File,
    library: &'static Library,
}

impl DataFile {
    pub(crate) fn register(library: &'static Library, file: File, path: &Path) -> Result<Self, Error> {
        // SAFETY: the descriptor is open (owned by `file`) and is deregistered before it closes.
        let code = unsafe { (library.api.hf3fs_reg_fd)(file.as_raw_fd(), 0) };
        if code > 0 {
            return Err(storage_error(format!("hf3fs_reg_fd of {}: {}", path.display(), errno_text(code))));
        }
        Ok(Self { file, library })
    }

    pub(crate) fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }
}

impl Drop for DataFile {
    fn drop(&mut self) {
        // SAFETY: the descriptor registered in `register`, still open.
        unsafe { (self.library.api.hf3fs_dereg_fd)(self.file.as_raw_fd()) };
    }
}

/// A ring that did not finish in time: its I/Os may still move bytes.
#[derive(Debug)]
pub(crate) struct Stuck {
    pub(crate) waited: Duration,
    pub(crate) outstanding: usize,
}

/// A ring of requests in one direction.
pub(crate) struct Ring {
    raw: Box<sys::hf3fs_ior>,
    library: &'static Library,
    read: bool,
    prepared: usize,
}

// SAFETY: a ring is used by one thread at a time (`&mut self` for every request); its handle may move between threads
// (USRBIO allows preparing and reaping on different threads, one at a time each).
unsafe impl Send for Ring {}

impl Ring {
    pub(crate) fn create(library: &'static Library, mount: &CStr, entries: usize, read: bool) -> Result<Self, Error> {
        let mut raw = Box::new(sys::hf3fs_ior::default());
        let count = i32::try_from(entries)
            .map_err(|_| Error::InvalidConfig { field: "entries".into(), reason: format!("{entries} is too many") })?;
        // SAFETY: `raw` is writable; the mount point is NUL-terminated. io_depth 0: process requests as they come.
        let code = unsafe { (library.api.hf3fs_iorcreate4)(&mut *raw, mount.as_ptr(), count, read, 0, 0, -1, 0) };
        if code != 0 {
            return Err(storage_error(format!(
                "hf3fs_iorcreate4 ({entries} entries, {}): {}",
                if read { "reads" } else { "writes" },
                errno_text(code)
            )));
        }
        Ok(Self { raw, library, read, prepared: 0 })
    }

    /// Prepares one request of `len` bytes at `address` (inside `iov`) and `offset` of `file`; `tag` comes back
    /// with its completion.
    ///
    /// # Safety
    ///
    /// `[address, address + len)` lies in `iov` and stays valid (and, for a read, unused by anything else) until the
    /// request completes; `iov` outlives the request.
    pub(crate) unsafe fn prepare(
        &mut self,
        iov: &Iov,
        address: *mut u8,
        file: &DataFile,
        offset: u64,
        len: usize,
        tag: usize,
    ) -> Result<(), Error> {
        // SAFETY: the caller's range lies in `iov`; the ring is used by this thread alone (`&mut self`).
        let code = unsafe {
            (self.library.api.hf3fs_prep_io)(
                &*self.raw,
                &*iov.raw,
                self.read,
                address.cast::<c_void>(),
                file.fd(),
                offset as usize,
                len as u64,
                tag as *const c_void,
            )
        };
        if code < 0 {
            return Err(storage_error(format!("hf3fs_prep_io of {len} bytes at {offset}: {}", errno_text(code))));
        }
        self.prepared += 1;
        Ok(())
    }

    /// Submits the prepared requests and waits for all of them until `deadline`; per request its tag and result
    /// (bytes moved or `-errno`).
    pub(crate) fn run(&mut self, deadline: Instant) -> Result<Result<Vec<(usize, i64)>, Stuck>, Error> {
        let count = self.submit()?;
        Ok(self.reap(count, count, Instant::now(), deadline))
    }

    /// Submits the prepared requests; how many.
    pub(crate) fn submit(&mut self) -> Result<usize, Error> {
        let count = std::mem::take(&mut self.prepared);
        if count == 0 {
            return Ok(0);
        }
        // SAFETY: the ring, used by this thread alone.
        let code = unsafe { (self.library.api.hf3fs_submit_ios)(&*self.raw) };
        if code < 0 {
            return Err(storage_error(format!("hf3fs_submit_ios: {}", errno_text(code))));
        }
        Ok(count)
    }

    /// Waits until `deadline` for at least `least` of the `outstanding` submitted requests to complete, and reaps
    /// every completion there is (at most `outstanding`); per request its tag and result (bytes moved or `-errno`).
    /// Requests still running at the deadline are `Stuck` (`waited` counts from `started`).
    pub(crate) fn reap(
        &mut self,
        outstanding: usize,
        least: usize,
        started: Instant,
        deadline: Instant,
    ) -> Result<Vec<(usize, i64)>, Stuck> {
        let least = least.min(outstanding);
        let mut done = Vec::with_capacity(outstanding);
        let mut completions = vec![sys::hf3fs_cqe::default(); outstanding];
        while done.len() < least {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Stuck { waited: started.elapsed(), outstanding: outstanding - done.len() });
            }
            let at = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default() + left;
            let timeout = sys::timespec { tv_sec: at.as_secs() as _, tv_nsec: at.subsec_nanos() as _ };
            let room = (outstanding - done.len()) as i32;
            let wanted = (least - done.len()) as i32;
            // SAFETY: `completions` has room for `room` entries; the timespec lives through the call.
            let reaped = unsafe {
                (self.library.api.hf3fs_wait_for_ios)(&*self.raw, completions.as_mut_ptr(), room, wanted, &timeout)
            };
            if reaped == -libc::ETIMEDOUT {
                continue;
            }
            if reaped < 0 {
                // the requests may still be in flight: as good as stuck
                tracing::error!("3fs: hf3fs_wait_for_ios: {}", errno_text(reaped));
                return Err(Stuck { waited: started.elapsed(), outstanding: outstanding - done.len() });
            }
            done.extend(completions[..reaped as usize].iter().map(|cqe| (cqe.userdata as usize, cqe.result)));
        }
        Ok(done)
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: the ring this library made; every request it was given has completed (a ring that timed out is
        // leaked instead of dropped).
        unsafe { (self.library.api.hf3fs_iordestroy)(&mut *self.raw) };
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;

    use super::*;
    use crate::testing::{Mount, mock_library_dir};

    #[test]
    fn a_missing_library_names_the_variable_and_the_path() {
        let empty = tempfile::tempdir().unwrap();
        let error = Library::load(Some(empty.path())).err().expect("no library there");
        let text = error.to_string();
        assert!(text.contains(LIB_DIR_ENV) && text.contains(&empty.path().display().to_string()), "{text}");
    }

    /// The mock refuses what the real library refuses: a request outside its iov, a file descriptor not registered,
    /// a request of the wrong direction, more requests than the ring's entries; and it says it is a mock.
    #[test]
    fn the_mock_checks_requests_as_the_real_library() {
        let library = Library::load(Some(&mock_library_dir())).unwrap();
        assert!(library.mock().is_some_and(|text| text.contains("mock")));
        let mount = Mount::new();
        let mount_point = CString::new(library.mount_point(&mount.path().join("file.bin")).unwrap()).unwrap();
        assert_eq!(mount_point.to_str().unwrap(), std::fs::canonicalize(mount.path()).unwrap().to_str().unwrap());
        let elsewhere = tempfile::tempdir().unwrap();
        assert!(library.mount_point(elsewhere.path()).is_err());
        let path = mount.path().join("data.bin");
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.set_len(1 << 16).unwrap();
        let unregistered =
            std::fs::OpenOptions::new().read(true).write(true).open(&path).map(|file| DataFile { file, library });
        let file = DataFile::register(library, file, &path).unwrap();
        let iov = Iov::create(library, &mount_point, 4096).unwrap();
        let mut ring = Ring::create(library, &mount_point, 2, false).unwrap();
        // SAFETY: every range below either lies in `iov` or is refused by the library before any I/O.
        unsafe {
            assert!(ring.prepare(&iov, iov.base().add(4000), &file, 0, 200, 0).is_err(), "past the iov's end");
            assert!(ring.prepare(&iov, iov.base(), &unregistered.unwrap(), 0, 64, 0).is_err(), "not registered");
            ring.prepare(&iov, iov.base(), &file, 0, 64, 0).unwrap();
            ring.prepare(&iov, iov.base().add(64), &file, 64, 64, 1).unwrap();
            assert!(ring.prepare(&iov, iov.base().add(128), &file, 128, 64, 2).is_err(), "a third of two entries");
        }
        let done = ring.run(Instant::now() + Duration::from_secs(5)).unwrap().unwrap();
        let mut done: Vec<(usize, i64)> = done;
        done.sort_unstable();
        assert_eq!(done, vec![(0, 64), (1, 64)]);
        let mut reader = Ring::create(library, &mount_point, 2, true).unwrap();
        // SAFETY: a write request on a read ring is refused before any I/O.
        assert!(unsafe { reader.prepare(&iov, iov.base(), &file, 0, 64, 0) }.is_ok(), "a read on a read ring");
        let mut writer = Ring::create(library, &mount_point, 2, false).unwrap();
        writer.read = true;
        // SAFETY: as above.
        assert!(unsafe { writer.prepare(&iov, iov.base(), &file, 0, 64, 0) }.is_err(), "a read on a write ring");
        writer.read = false;
        reader.run(Instant::now() + Duration::from_secs(5)).unwrap().unwrap();
    }
}
