//! The NIXL storage tier: page files moved to and from host memory by NIXL's file plugins (POSIX, GDS_MT, GDS, 3FS).
//!
//! SGLang's `HiCacheNixl` (docs/sglang.md#nixl-backend), with its bugs fixed (docs/sglang.md#fixed-5 and #fixed-22):
//!
//! * **Names.** `{dir}/{hash}_{model}_{tp_rank}_{tp_size}` (MHA) or `{dir}/{hash}_{model}` (MLA), `/` in the model
//!   replaced by `-`, raw flat pages: what SGLang's NIXL backend writes since it took the namespace into its names
//!   (SGLang PR #10969; 0.5.2 wrote `{dir}/{hash}` for every rank and model, so TP ranks overwrote each other).
//!   A hybrid model's sidecar pool ([`StorageNamespace::sidecar`]) keeps an entry per file, named as SGLang's NIXL
//!   backend names a pool's whole page: the KV's name (a Mamba state's per rank even for MLA) and `_{pool}`.
//!   `$SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR`, default `/tmp/hicache_storage`, as SGLang.
//! * **One agent per backend**, named `hicache_nixl_{pid}_{n}`; the plugin is SGLang's `auto` choice (the first of
//!   3FS, POSIX, GDS_MT, GDS that this NIXL has and that starts) or the one named in [`NixlConfig::plugin`], with
//!   [`NixlConfig::plugin_params`] over its defaults (a parameter the plugin lacks is an error naming it).
//! * **Registrations kept**: host memory is registered once per buffer (`regions.rs`), page files are opened and
//!   registered once and kept open up to [`NixlConfig::max_open_files`] (`files.rs`); SGLang registered and opened
//!   on every transfer and never released either.
//! * **A batch is one transfer request**, its completion waited for with a backoff that overshoots by at most ~6%
//!   (SGLang polls with a 100 µs sleep). When the request fails, each page is tried alone, so one bad page fails
//!   alone, with NIXL's status in its message.
//! * **Writes are atomic**: a page is written to a temporary file beside it and renamed, so a reader (this process,
//!   another one, or SGLang) never sees a partial page under its name; SGLang's manager creates the file empty
//!   first. A file of the wrong size is no page: `exists` says so, `get` reports it corrupt and removes it.
//! * `clear` removes this namespace's pages and temporary files only (SGLang's NIXL backend had no `clear`; its later
//!   one removes every file under the directory). `list` names this namespace's pages.
//!
//! The object plugin (OBJ, pages as objects in a bucket) is a different data path and is refused with
//! [`Error::Unsupported`]. NIXL's library is loaded at run time ([`library`]).

mod agent;
mod files;
pub mod library;
mod regions;
mod tier;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub use agent::{AUTO_PLUGINS, PluginChoice};
use hicache_core::Error;
use hicache_core::hash::PageKey;
use hicache_core::host_memory::MemoryRegion;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{
    FailureKind, GetOutcome, PageFailure, PageSegments, PageSegmentsMut, SetOutcome, StatsRecorder, StorageBackend,
    StorageStats, check_batch, segments_len, size_mismatch,
};
pub use library::LIB_DIR_ENV;
use nixl_sys::XferOp;
pub use tier::NIXL_TIER;

use crate::agent::{NixlAgent, Piece, storage};
use crate::files::{FileCache, OpenPage};
use crate::regions::RegionCache;

/// The environment variable SGLang reads for the directory.
pub const DIR_ENV: &str = "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR";

/// SGLang's default directory.
pub const DEFAULT_DIR: &str = "/tmp/hicache_storage";

/// Settings of a NIXL backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NixlConfig {
    /// The directory holding the page files.
    pub dir: PathBuf,
    /// The plugin that moves the bytes.
    pub plugin: PluginChoice,
    /// Plugin parameters over its defaults (POSIX: `use_uring`, `use_aio`, `use_posix_aio`, `kernel_queue_size`,
    /// `ios_pool_size`).
    pub plugin_params: BTreeMap<String, String>,
    /// The folder holding `libnixl_capi.so`; `None`: `$HICACHE_NIXL_LIB_DIR`, else the loader's search path.
    pub lib_dir: Option<PathBuf>,
    /// Page files kept open and registered.
    pub max_open_files: usize,
    /// Host memory ranges kept registered.
    pub max_registered_regions: usize,
}

impl NixlConfig {
    /// `dir` if given, else `$SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR`, else `/tmp/hicache_storage`, as SGLang.
    pub fn resolve_dir(dir: Option<&Path>) -> PathBuf {
        match dir {
            Some(dir) => dir.to_path_buf(),
            None => std::env::var_os(DIR_ENV).map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from),
        }
    }

    /// A config for `dir`: the `auto` plugin with its defaults, up to 4096 open files (a quarter of the process's
    /// descriptor limit if that is lower, at least 16) and 64 registered ranges.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            plugin: PluginChoice::Auto,
            plugin_params: BTreeMap::new(),
            lib_dir: None,
            max_open_files: default_open_files(),
            max_registered_regions: 64,
        }
    }
}

fn default_open_files() -> usize {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes only the struct it is given, which lives on this stack frame.
    let known = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    let quarter = if known { usize::try_from(limit.rlim_cur / 4).unwrap_or(usize::MAX) } else { 256 };
    quarter.clamp(16, 4096)
}

/// What the backend holds with NIXL now, and has opened or registered so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NixlUsage {
    /// The plugin in use.
    pub plugin: String,
    /// Page files open and registered now.
    pub open_files: usize,
    /// Page files opened and registered so far.
    pub files_opened: u64,
    /// Host pools registered now (told with `register_host_memory`).
    pub registered_pools: usize,
    /// Other host memory ranges registered now.
    pub registered_regions: usize,
    /// Host memory ranges (pools and others) registered so far.
    pub regions_registered: u64,
}

/// A NIXL backend for one namespace.
#[derive(Debug)]
pub struct NixlStorage {
    /// The namespace it serves.
    namespace: StorageNamespace,
    dir: PathBuf,
    /// What follows the hash in a page file's name.
    suffix: String,
    page_bytes: usize,
    files: Mutex<FileCache>,
    regions: Mutex<RegionCache>,
    stats: StatsRecorder,
    /// Dropped last: the registrations above are released through it.
    agent: NixlAgent,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A page of a batch that goes into the transfer.
struct Planned {
    index: usize,
    page: Arc<OpenPage>,
    /// Writes: the temporary file, renamed to the page's name once written.
    temporary: Option<PathBuf>,
}

impl NixlStorage {
    /// Loads NIXL, creates the agent and its plugin, and the directory if needed.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for an invalid namespace, a model name that cannot be part of a file name, a plugin
    /// or plugin parameter NIXL lacks, or a zero bound; [`Error::Unsupported`] for the object plugin;
    /// [`Error::Storage`] when the library cannot be loaded, no plugin starts, or the directory cannot be created.
    pub fn open(config: NixlConfig, namespace: &StorageNamespace) -> Result<Self, Error> {
        let namespace = namespace.clone().validated()?;
        namespace.file_name_model()?;
        for (field, value) in
            [("max_open_files", config.max_open_files), ("max_registered_regions", config.max_registered_regions)]
        {
            if value == 0 {
                return Err(Error::InvalidArgument { field, reason: "must be at least 1".into() });
            }
        }
        library::ensure_loaded(library::resolve_lib_dir(config.lib_dir.as_deref()).as_deref())?;
        std::fs::create_dir_all(&config.dir)
            .map_err(|error| storage(format!("creating {}: {error}", config.dir.display())))?;
        let agent = NixlAgent::new(&config.plugin, &config.plugin_params)?;
        // SGLang's file names; with pipeline stages they carry the stage, which SGLang's own NIXL backend leaves out
        // (its stages overwrite each other's pages), so only single-stage deployments share pages with it
        let suffix = namespace.sglang_nixl_tail();
        tracing::debug!(plugin = agent.plugin(), dir = %config.dir.display(), "nixl backend open");
        Ok(Self {
            namespace: namespace.clone(),
            dir: config.dir,
            suffix,
            page_bytes: namespace.page_bytes(),
            files: Mutex::new(FileCache::new(config.max_open_files)),
            regions: Mutex::new(RegionCache::new(config.max_registered_regions)),
            stats: StatsRecorder::default(),
            agent,
        })
    }

    /// The file of a page.
    pub fn page_path(&self, key: &PageKey) -> PathBuf {
        self.dir.join(format!("{key}{}", self.suffix))
    }

    /// The plugin, and what is open and registered.
    pub fn usage(&self) -> NixlUsage {
        let files = self.lock_files();
        let regions = self.lock_regions();
        NixlUsage {
            plugin: self.agent.plugin().to_owned(),
            open_files: files.len(),
            files_opened: files.opened(),
            registered_pools: regions.pools(),
            registered_regions: regions.len(),
            regions_registered: regions.registrations(),
        }
    }

    fn lock_files(&self) -> MutexGuard<'_, FileCache> {
        // each update of the cache is one call that leaves it consistent, so a poisoned lock's data is sound
        self.files.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lock_regions(&self) -> MutexGuard<'_, RegionCache> {
        self.regions.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether `path` is a whole page file.
    fn is_page_file(&self, path: &Path) -> bool {
        std::fs::metadata(path).is_ok_and(|metadata| metadata.is_file() && metadata.len() == self.page_bytes as u64)
    }

    /// The page's open file for reading: `None` when absent, a failure when unusable.
    fn open_for_read(&self, key: &PageKey) -> Result<Option<Arc<OpenPage>>, PageFailure> {
        let path = self.page_path(key);
        let cached = self.lock_files().get(key);
        if let Some(page) = cached {
            if page.is_at(&path) {
                return Ok(Some(page));
            }
            self.lock_files().forget(key);
        }
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(PageFailure::new(FailureKind::Io, format!("{}: {error}", path.display()))),
        };
        let metadata = file
            .metadata()
            .map_err(|error| PageFailure::new(FailureKind::Io, format!("{}: {error}", path.display())))?;
        if !metadata.is_file() || metadata.len() != self.page_bytes as u64 {
            // a torn or foreign file is as good as absent; remove it (if the path still names it) so it is written again
            let same =
                std::fs::metadata(&path).is_ok_and(|now| (now.dev(), now.ino()) == (metadata.dev(), metadata.ino()));
            if same {
                let _ = std::fs::remove_file(&path);
            }
            return Err(PageFailure::new(
                FailureKind::Corrupt,
                format!(
                    "{}: {} of {} bytes, a page is {}",
                    path.display(),
                    if metadata.is_file() { "a file" } else { "not a file" },
                    metadata.len(),
                    self.page_bytes
                ),
            ));
        }
        let page = OpenPage::register(&self.agent, file, self.page_bytes).map_err(|(_, failure)| {
            PageFailure::new(FailureKind::Io, format!("registering {} with NIXL: {failure}", path.display()))
        })?;
        let page = Arc::new(page);
        self.lock_files().insert(*key, Arc::clone(&page));
        Ok(Some(page))
    }

    /// A new temporary file for `key`'s page, registered.
    fn create_for_write(&self, key: &PageKey) -> Result<(PathBuf, Arc<OpenPage>), PageFailure> {
        let unique = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let temporary = self.dir.join(format!("{key}{}.tmp.{}.{unique}", self.suffix, std::process::id()));
        let io = |error: std::io::Error| PageFailure::new(FailureKind::Io, format!("{}: {error}", temporary.display()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&temporary)
            .map_err(io)?;
        match OpenPage::register(&self.agent, file, self.page_bytes) {
            Ok(page) => Ok((temporary, Arc::new(page))),
            Err((file, failure)) => {
                drop(file);
                let _ = std::fs::remove_file(&temporary);
                Err(PageFailure::new(
                    FailureKind::Io,
                    format!("registering {} with NIXL: {failure}", temporary.display()),
                ))
            }
        }
    }

    /// Moves the planned pages (`pieces_of(index, fd)` gives a page's pieces) as one request; on failure, each page
    /// alone. Returns each planned page's result, in plan order.
    fn run(
        &self,
        operation: XferOp,
        plan: &[Planned],
        pieces_of: &dyn Fn(usize, i32) -> Vec<Piece>,
    ) -> Vec<Result<(), String>> {
        let per_page: Vec<Vec<Piece>> =
            plan.iter().map(|planned| pieces_of(planned.index, planned.page.fd())).collect();
        let mut spans: Vec<(usize, usize)> =
            per_page.iter().flatten().map(|piece| (piece.address, piece.len)).collect();
        let held = match self.lock_regions().cover(&self.agent, &mut spans) {
            Ok(held) => held,
            Err(failure) => {
                let message = format!("registering host memory with NIXL: {failure}");
                return plan.iter().map(|_| Err(message.clone())).collect();
            }
        };
        let all: Vec<Piece> = per_page.iter().flatten().copied().collect();
        let results = match self.agent.transfer(operation, &all) {
            Ok(()) => plan.iter().map(|_| Ok(())).collect(),
            Err(message) if plan.len() == 1 => vec![Err(message)],
            Err(message) => {
                tracing::debug!(%message, "nixl batch failed; trying each page alone");
                per_page.iter().map(|pieces| self.agent.transfer(operation, pieces)).collect()
            }
        };
        drop(held);
        results
    }
}

impl StorageBackend for NixlStorage {
    fn name(&self) -> &str {
        "nixl"
    }

    fn namespace(&self) -> Option<&StorageNamespace> {
        Some(&self.namespace)
    }

    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
        let hits = keys.iter().take_while(|key| self.is_page_file(&self.page_path(key))).count();
        self.stats.record_exists(keys.len(), hits);
        Ok(hits)
    }

    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
        check_batch(keys.len(), pages.len())?;
        let mut outcomes = vec![GetOutcome::Miss; keys.len()];
        let mut plan = Vec::new();
        for (index, key) in keys.iter().enumerate() {
            let given = segments_len(&pages[index]);
            if given != self.page_bytes {
                outcomes[index] = GetOutcome::Failed(size_mismatch(given, self.page_bytes));
                continue;
            }
            match self.open_for_read(key) {
                Ok(Some(page)) => plan.push(Planned { index, page, temporary: None }),
                Ok(None) => outcomes[index] = GetOutcome::Miss,
                Err(failure) => outcomes[index] = GetOutcome::Failed(failure),
            }
        }
        // the destinations as addresses: NIXL writes through them while `pages` stays mutably borrowed here
        let destinations: Vec<Vec<(usize, usize)>> = pages
            .iter_mut()
            .map(|segments| segments.iter_mut().map(|segment| (segment.as_mut_ptr() as usize, segment.len())).collect())
            .collect();
        let pieces_of = |index: usize, fd: i32| pieces(&destinations[index], fd);
        for (planned, result) in plan.iter().zip(self.run(XferOp::Read, &plan, &pieces_of)) {
            outcomes[planned.index] = match result {
                Ok(()) => GetOutcome::Hit,
                Err(message) => {
                    self.lock_files().forget(&keys[planned.index]);
                    GetOutcome::Failed(PageFailure::new(
                        FailureKind::Io,
                        format!("{}: {message}", self.page_path(&keys[planned.index]).display()),
                    ))
                }
            };
        }
        self.stats.record_get(&outcomes, |_| self.page_bytes);
        Ok(outcomes)
    }

    fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
        check_batch(keys.len(), pages.len())?;
        let mut outcomes = vec![SetOutcome::AlreadyPresent; keys.len()];
        let mut first: HashMap<PageKey, usize> = HashMap::new();
        let mut repeats = Vec::new();
        let mut plan = Vec::new();
        for (index, key) in keys.iter().enumerate() {
            let given = segments_len(&pages[index]);
            if given != self.page_bytes {
                outcomes[index] = SetOutcome::Failed(size_mismatch(given, self.page_bytes));
                continue;
            }
            if let Some(&earlier) = first.get(key) {
                repeats.push((index, earlier));
                continue;
            }
            first.insert(*key, index);
            if self.is_page_file(&self.page_path(key)) {
                // keys name content: a stored page is not written again
                continue;
            }
            match self.create_for_write(key) {
                Ok((temporary, page)) => plan.push(Planned { index, page, temporary: Some(temporary) }),
                Err(failure) => outcomes[index] = SetOutcome::Failed(failure),
            }
        }
        let sources: Vec<Vec<(usize, usize)>> = pages
            .iter()
            .map(|segments| segments.iter().map(|segment| (segment.as_ptr() as usize, segment.len())).collect())
            .collect();
        let pieces_of = |index: usize, fd: i32| pieces(&sources[index], fd);
        let results = self.run(XferOp::Write, &plan, &pieces_of);
        for (planned, result) in plan.into_iter().zip(results) {
            let key = keys[planned.index];
            let temporary = planned.temporary.expect("writes have a temporary file");
            let path = self.page_path(&key);
            let renamed = result.and_then(|()| {
                std::fs::rename(&temporary, &path).map_err(|error| format!("renaming into place: {error}"))
            });
            outcomes[planned.index] = match renamed {
                Ok(()) => {
                    // the descriptor now names the page file: keep it for reads (no transfer holds it any more)
                    if let Ok(page) = Arc::try_unwrap(planned.page) {
                        self.lock_files().insert(key, Arc::new(page.refreshed()));
                    }
                    SetOutcome::Stored
                }
                Err(message) => {
                    let _ = std::fs::remove_file(&temporary);
                    SetOutcome::Failed(PageFailure::new(FailureKind::Io, format!("{}: {message}", path.display())))
                }
            };
        }
        for (index, earlier) in repeats {
            outcomes[index] = match &outcomes[earlier] {
                SetOutcome::Stored | SetOutcome::AlreadyPresent => SetOutcome::AlreadyPresent,
                failed => failed.clone(),
            };
        }
        self.stats.record_set(&outcomes, |_| self.page_bytes);
        Ok(outcomes)
    }

    fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
        let mut removed = 0;
        for key in keys {
            self.lock_files().forget(key);
            let path = self.page_path(key);
            match std::fs::remove_file(&path) {
                Ok(()) => removed += 1,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(storage(format!("removing {}: {error}", path.display()))),
            }
        }
        self.stats.record_removed(removed as u64);
        Ok(removed)
    }

    fn clear(&self) -> Result<u64, Error> {
        let mut removed = 0;
        self.visit_own(&mut |path, name, _| {
            if std::fs::remove_file(path).is_ok() && !name.is_temporary {
                removed += 1;
            }
        })?;
        self.lock_files().clear();
        self.stats.record_removed(removed);
        Ok(removed)
    }

    fn stats(&self) -> StorageStats {
        self.stats.snapshot()
    }

    fn register_host_memory(&self, region: &MemoryRegion) -> Result<(), Error> {
        self.lock_regions().register_pool(&self.agent, region.address(), region.len()).map_err(|failure| {
            storage(format!("registering the host pool ({} bytes) with NIXL: {failure}", region.len()))
        })
    }

    fn unregister_host_memory(&self, region: &MemoryRegion) {
        self.lock_regions().unregister_pool(region.address(), region.len());
    }

    fn list(&self) -> Result<Vec<(PageKey, u64)>, Error> {
        let mut found = Vec::new();
        self.visit_own(&mut |_, name, bytes| {
            if !name.is_temporary {
                found.push((name.key, bytes));
            }
        })?;
        Ok(found)
    }
}

/// A file name of this namespace: a page, or a page's temporary file.
struct OwnName {
    key: PageKey,
    is_temporary: bool,
}

impl NixlStorage {
    /// Parses `{64 hex}{suffix}` (a page) or `{64 hex}{suffix}.tmp.…` (a temporary file of one).
    fn own_name(&self, name: &str) -> Option<OwnName> {
        let key = name.get(..64)?.parse::<PageKey>().ok()?;
        let rest = name[64..].strip_prefix(self.suffix.as_str())?;
        match rest {
            "" => Some(OwnName { key, is_temporary: false }),
            _ if rest.starts_with(".tmp.") => Some(OwnName { key, is_temporary: true }),
            _ => None,
        }
    }

    /// Calls `visit(path, name, bytes)` for each file of this namespace in the directory.
    fn visit_own(&self, visit: &mut dyn FnMut(&Path, OwnName, u64)) -> Result<(), Error> {
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|error| storage(format!("listing {}: {error}", self.dir.display())))?;
        for entry in entries {
            let entry = entry.map_err(|error| storage(format!("listing {}: {error}", self.dir.display())))?;
            let Some(name) = entry.file_name().to_str().and_then(|name| self.own_name(name)) else { continue };
            // a file removed meanwhile is simply not there
            let Ok(metadata) = entry.metadata() else { continue };
            if metadata.is_file() {
                visit(&entry.path(), name, metadata.len());
            }
        }
        Ok(())
    }
}

/// A page's pieces: its segments, in order, against consecutive offsets of the file `fd`.
fn pieces(segments: &[(usize, usize)], fd: i32) -> Vec<Piece> {
    let mut offset = 0;
    segments
        .iter()
        .filter(|(_, len)| *len > 0)
        .map(|&(address, len)| {
            let piece = Piece { address, len, fd, offset };
            offset += len;
            piece
        })
        .collect()
}

#[cfg(test)]
extern crate self as hicache_storage_nixl;

#[cfg(test)]
#[path = "../tests/common/mod.rs"]
mod test_common;

#[cfg(test)]
mod tests {
    use hicache_core::geometry::{KvDtype, KvGeometry};
    use hicache_core::layout::HostLayout;
    use hicache_core::testing::conformance::{put, random_keys, random_pages};

    use super::*;

    /// A page file opened so that NIXL's transfer of it fails (a descriptor without the needed access).
    fn unusable(storage: &NixlStorage, path: &Path, writable: bool) -> Arc<OpenPage> {
        let file = std::fs::OpenOptions::new().read(!writable).write(writable).open(path).unwrap();
        Arc::new(OpenPage::register(&storage.agent, file, storage.page_bytes).map_err(|(_, failure)| failure).unwrap())
    }

    /// When the one request of a batch fails, each page is tried alone: the failing page fails, with NIXL's status,
    /// and the others move.
    #[test]
    fn a_failed_request_is_retried_page_by_page() {
        let dir = tempfile::tempdir().unwrap();
        let geometry = KvGeometry::mha(1, 1, 64, KvDtype::Bf16).unwrap();
        let namespace = StorageNamespace::single_rank("m", geometry, HostLayout::PageFirst, 16);
        let storage = NixlStorage::open(crate::test_common::config(dir.path()), &namespace).unwrap();
        let page_bytes = storage.page_bytes;
        let keys = random_keys(3);
        let pages = random_pages(3, page_bytes);
        put(&storage, &keys, &pages);

        let mut plan: Vec<Planned> = keys
            .iter()
            .enumerate()
            .map(|(index, key)| Planned { index, page: storage.open_for_read(key).unwrap().unwrap(), temporary: None })
            .collect();
        plan[1].page = unusable(&storage, &storage.page_path(&keys[1]), true);
        let mut buffers = vec![vec![0u8; page_bytes]; 3];
        let destinations: Vec<Vec<(usize, usize)>> =
            buffers.iter_mut().map(|buffer| vec![(buffer.as_mut_ptr() as usize, buffer.len())]).collect();
        let results = storage.run(XferOp::Read, &plan, &|index, fd| pieces(&destinations[index], fd));
        assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
        let message = results[1].as_ref().expect_err("a write-only descriptor cannot be read");
        assert!(message.contains("POSIX") && message.contains("read"), "{message}");
        assert_eq!((&buffers[0], &buffers[2]), (&pages[0], &pages[2]));

        // writes: a read-only temporary file fails alone
        let targets: Vec<PathBuf> = (0..3).map(|index| dir.path().join(format!("target{index}"))).collect();
        for target in &targets {
            std::fs::write(target, vec![0u8; page_bytes]).unwrap();
        }
        let plan: Vec<Planned> = targets
            .iter()
            .enumerate()
            .map(|(index, target)| Planned { index, page: unusable(&storage, target, index != 1), temporary: None })
            .collect();
        let sources: Vec<Vec<(usize, usize)>> =
            pages.iter().map(|page| vec![(page.as_ptr() as usize, page.len())]).collect();
        let results = storage.run(XferOp::Write, &plan, &|index, fd| pieces(&sources[index], fd));
        assert!(results[0].is_ok() && results[1].is_err() && results[2].is_ok(), "{results:?}");
        assert_eq!(std::fs::read(&targets[0]).unwrap(), pages[0]);
        assert_eq!(std::fs::read(&targets[2]).unwrap(), pages[2]);
    }
}
