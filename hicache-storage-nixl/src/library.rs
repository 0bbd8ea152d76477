//! Finding `libnixl_capi.so` at run time.
//!
//! nixl-sys is built with its `stub-api` feature: every NIXL call goes through a stub that `dlopen`s
//! `libnixl_capi.so` by name on first use and **aborts the process** when it cannot. So before the first call this
//! module makes sure the library is there, and answers with an error otherwise:
//!
//! * with a library directory (the config's, or `$HICACHE_NIXL_LIB_DIR`), it loads `{dir}/libnixl_capi.so` by path
//!   and keeps it loaded for the life of the process; the stub's later `dlopen("libnixl_capi.so")` finds it by its
//!   soname. The wheel's libraries find each other and their plugins through their own `$ORIGIN` run paths, so
//!   nothing else needs setting;
//! * without one, the dynamic loader's search path (`LD_LIBRARY_PATH`, the system's directories) decides.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use hicache_core::Error;

/// The environment variable naming the directory that holds `libnixl_capi.so` (in the `nixl-cu12` / `nixl-cu13`
/// wheels: `.nixl_cu12.mesonpy.libs`).
pub const LIB_DIR_ENV: &str = "HICACHE_NIXL_LIB_DIR";

/// The library nixl-sys's stubs load.
pub const CAPI_LIBRARY: &str = "libnixl_capi.so";

/// Directories already loaded from, so a second backend does not load again.
static LOADED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The library directory to use: `configured`, else `$HICACHE_NIXL_LIB_DIR` when set and not empty.
pub fn resolve_lib_dir(configured: Option<&Path>) -> Option<PathBuf> {
    configured
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(LIB_DIR_ENV).filter(|dir| !dir.is_empty()).map(PathBuf::from))
}

/// Makes NIXL callable: loads the C API library from `lib_dir` if given, then checks that the stubs can reach it.
///
/// # Errors
///
/// [`Error::Storage`] naming the path and the loader's message, or saying where the library was looked for.
pub fn ensure_loaded(lib_dir: Option<&Path>) -> Result<(), Error> {
    if let Some(dir) = lib_dir {
        let mut loaded = LOADED.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !loaded.iter().any(|done| done == dir) {
            let path = dir.join(CAPI_LIBRARY);
            if !path.is_file() {
                return Err(error(format!(
                    "{} does not exist; {LIB_DIR_ENV} (or the config's lib_dir) must name the folder of the nixl wheel \
                     that holds {CAPI_LIBRARY} (`.nixl_cu12.mesonpy.libs` in nixl-cu12)",
                    path.display()
                )));
            }
            // SAFETY: loading runs the library's initialisers; libnixl_capi.so and the libraries it needs are
            // NIXL's own, whose initialisers only set up their static state. The handle is never closed (below), so
            // no symbol the stubs resolve from it can dangle.
            let library = unsafe {
                libloading::os::unix::Library::open(Some(&path), libloading::os::unix::RTLD_NOW | libc::RTLD_GLOBAL)
            }
            .map_err(|failure| error(format!("loading {}: {failure}", path.display())))?;
            // the stubs call into it for the rest of the process
            std::mem::forget(library);
            loaded.push(dir.to_path_buf());
        }
    }
    if nixl_sys::is_stub() {
        return Err(error(format!(
            "{CAPI_LIBRARY} is not on the loader's search path; set {LIB_DIR_ENV} to the folder of the nixl wheel that \
             holds it (`pip download nixl-cu12`, unzip, then `.nixl_cu12.mesonpy.libs`), or add that folder to \
             LD_LIBRARY_PATH"
        )));
    }
    Ok(())
}

fn error(message: String) -> Error {
    Error::storage("nixl", message)
}
