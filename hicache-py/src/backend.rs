//! The storage backend object behind `hicache.sglang.HiCacheStorage`: settings checked when SGLang constructs the
//! backend ([`Settings`]), a tier opened when SGLang registers its host pool ([`Backend`]), and page I/O straight
//! between that pool and the tier, with the GIL released.
//!
//! The methods that take addresses (`batch_get`, `batch_set`, `get_into`, `set_from`, `segments`) are the private
//! half of the package: `hicache.sglang` passes them the addresses of tensors it holds for the call (contiguous,
//! on the CPU, of the dtype and length it states). They are not for other callers.

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, RwLock};

use hicache_core::hash::PageKey;
use hicache_core::host_memory::MemoryRegion;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, PageSegments, PageSegmentsMut, StorageBackend};
use hicache_storage_file::FileConfig;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};
use serde::Deserialize;

use crate::config::{ConfigError, Settings};
use crate::guard;
use crate::pool::{HostPool, PoolDescription};
use crate::sidecar::Sidecar;

/// The extra config, read and checked (`hicache._native.Settings(json)`), before any host pool is known.
#[pyclass(frozen, module = "hicache._native", name = "Settings")]
pub(crate) struct PySettings {
    settings: Settings,
}

/// Which rank this is, from SGLang's `HiCacheStorageConfig`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RankDescription {
    model: String,
    tp_rank: usize,
    tp_size: usize,
    pp_rank: usize,
    pp_size: usize,
    /// SGLang's `is_mla_model`: every rank holds the same KV.
    is_mla: bool,
    /// Whether this rank writes to storage (MLA: one writer for all ranks).
    writer: bool,
}

#[pymethods]
impl PySettings {
    /// Reads the extra config (JSON text) and checks what can be checked before the host pool is known: the keys
    /// and their types, the backend's name, the file tier's directory (made when missing, as SGLang does, and
    /// written to once; with `read_only`, only found), Mooncake's settings.
    #[new]
    pub(crate) fn new(extra_config: &str) -> PyResult<Self> {
        guard::run(|| {
            let settings = Settings::parse(extra_config).map_err(guard::config_to_py)?;
            if settings.tier.is_named("file") {
                let file = FileConfig::from_fields(&settings.fields).map_err(guard::config_to_py)?;
                check_directory(&file.dir, file.read_only).map_err(guard::config_to_py)?;
            }
            Ok(Self { settings })
        })
    }

    /// The storage tier's name.
    #[getter]
    fn backend(&self) -> &'static str {
        self.settings.tier.name
    }

    /// Opens the tier for one rank (JSON of [`RankDescription`]) over one host pool (JSON of [`PoolDescription`])
    /// and registers the pool's buffer with it. `keepalive` is the pool's buffer tensor: held until the backend
    /// is dropped, so the memory cannot go away under it.
    fn open(&self, py: Python<'_>, rank: &str, pool: &str, keepalive: Py<PyAny>) -> PyResult<Backend> {
        guard::run(|| {
            let rank: RankDescription = serde_json::from_str(rank)
                .map_err(|error| PyValueError::new_err(format!("hicache: storage config: {error}")))?;
            let description: PoolDescription = serde_json::from_str(pool)
                .map_err(|error| PyValueError::new_err(format!("hicache: host pool: {error}")))?;
            let pool = HostPool::new(&description, &self.settings.pool).map_err(guard::config_to_py)?;
            if rank.is_mla != pool.map.geometry().is_mla() {
                return Err(guard::config_to_py(ConfigError::value(
                    "is_mla_model",
                    format!("the storage config says {}, but the host pool holds {} KV", rank.is_mla, description.kind),
                )));
            }
            let namespace = StorageNamespace {
                model: rank.model,
                geometry: *pool.map.geometry(),
                layout: pool.map.layout(),
                head_groups: pool.map.head_groups(),
                page_size: pool.map.page_size(),
                tp_rank: rank.tp_rank,
                tp_size: rank.tp_size,
                pp_rank: rank.pp_rank,
                pp_size: rank.pp_size,
                sidecar: None,
            };
            // SGLang's stage: the pool's first layer, the last stage or not; the chunks' names hold absolute layers, so
            // a later stage that does not say where it starts would name its chunks as the first stage's
            if self.settings.unified.is_some() && rank.pp_size > 1 && description.start_layer.is_none() {
                return Err(guard::config_to_py(ConfigError::value(
                    "start_layer",
                    "the host pool of a pipeline stage does not say its first layer, which the unified key scheme \
                     names its chunks by"
                        .to_owned(),
                )));
            }
            let stage = (description.start_layer.unwrap_or(0) as u64, rank.pp_rank + 1 == rank.pp_size);
            let layout = self.settings.l3_layout(&namespace, stage).map_err(guard::to_py)?;
            let l3_layout = serde_json::to_string(&layout).map_err(|error| PyValueError::new_err(error.to_string()))?;
            let storage: Arc<dyn StorageBackend> = Arc::from(py.detach(|| self.open_rank(&namespace, stage))?);
            // SAFETY: the buffer is `keepalive`'s, which `Open` holds until after it unregisters the region.
            let region =
                unsafe { MemoryRegion::from_raw_parts(pool.address as *const u8, pool.map.total_bytes(), None) };
            storage.register_host_memory(&region).map_err(guard::to_py)?;
            let page_bytes = pool.map.page_bytes();
            let name = storage.name().to_owned();
            Ok(Backend {
                open: RwLock::new(Some(Arc::new(Open { storage, pool, region, _keepalive: keepalive }))),
                name,
                page_bytes,
                writer: rank.writer,
                l3_layout,
                namespace,
                stage,
            })
        })
    }

    /// Opens the sidecar pool `pool` of a hybrid model (entries of `entry_bytes`) for the rank `kv` serves, in the
    /// same tier; `writer`: whether this rank writes the pool's entries; `objects`: how SGLang's Mooncake store cuts
    /// an entry into objects, per object its name, bytes and whether its key carries the TP rank (`None`: not known;
    /// the Mooncake tier under SGLang's keys then refuses the pool).
    #[pyo3(signature = (kv, pool, entry_bytes, writer, objects=None))]
    fn open_sidecar(
        &self,
        py: Python<'_>,
        kv: PyRef<'_, Backend>,
        pool: &str,
        entry_bytes: usize,
        writer: bool,
        objects: Option<Vec<(String, usize, bool)>>,
    ) -> PyResult<Sidecar> {
        guard::run(|| crate::sidecar::open(self, py, &kv, pool, entry_bytes, writer, objects))
    }

    /// The key layout of `kv`'s stage ([`Backend::l3_layout`]) with a hybrid model's sidecar pools after the KV: per
    /// pool the pool opened by `open_sidecar`, its hit policy (`all_pages` or `trailing_pages`) and, for
    /// `trailing_pages`, its window in pages. JSON in the shape of SGLang's `describe_l3_object_layout`.
    fn l3_layout_with_sidecars(
        &self,
        kv: PyRef<'_, Backend>,
        pools: Vec<(PyRef<'_, Sidecar>, String, usize)>,
    ) -> PyResult<String> {
        guard::run(|| {
            let mut sidecars = Vec::with_capacity(pools.len());
            for (sidecar, policy, window) in pools {
                let entry = sidecar.entry().clone();
                let policy = crate::sidecar::hit_policy(&policy, window, || format!("sidecar pool {}", entry.pool))?;
                sidecars.push((entry, policy));
            }
            let layout =
                self.settings.l3_layout_with_sidecars(&kv.namespace, kv.stage, &sidecars).map_err(guard::to_py)?;
            serde_json::to_string(&layout).map_err(|error| PyValueError::new_err(error.to_string()))
        })
    }
}

impl PySettings {
    /// Opens the tier for a sidecar pool's namespace: its entries are whole objects, never cut into the unified key
    /// scheme's chunks of layers and head groups, so that scheme refuses them (naming `key_scheme`).
    pub(crate) fn open_sidecar_rank(&self, namespace: &StorageNamespace) -> PyResult<Box<dyn StorageBackend>> {
        if self.settings.unified.is_some() {
            return Err(guard::config_to_py(ConfigError::value(
                "key_scheme",
                "the unified key scheme names chunks of KV pages; hybrid models' sidecar pools are not kept under it"
                    .to_owned(),
            )));
        }
        self.settings.open(namespace).map_err(guard::to_py)
    }

    /// Opens the tier for the rank of `namespace` (its stage's first layer, and whether it is the last stage): as
    /// unified-key chunks under `key_scheme: "unified"`.
    pub(crate) fn open_rank(
        &self,
        namespace: &StorageNamespace,
        stage: (u64, bool),
    ) -> PyResult<Box<dyn StorageBackend>> {
        self.settings.open_rank(namespace, stage).map_err(guard::to_py)
    }
}

/// Makes the directory when missing and writes a file there once, so a directory that cannot be used is an error
/// naming the key now, not failed pages later. A tier opened `read_only` changes nothing: its directory must exist.
fn check_directory(dir: &Path, read_only: bool) -> Result<(), ConfigError> {
    let bad = |reason: String| ConfigError::value("dir", format!("{}: {reason}", dir.display()));
    if read_only {
        return match std::fs::metadata(dir) {
            Ok(found) if found.is_dir() => Ok(()),
            Ok(_) => Err(bad("is not a directory (`read_only` opens an existing one)".to_owned())),
            Err(error) => Err(bad(format!("cannot be opened (`read_only` makes nothing): {error}"))),
        };
    }
    std::fs::create_dir_all(dir).map_err(|error| bad(format!("cannot be made: {error}")))?;
    let probe = dir.join(format!(".hicache-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|error| bad(format!("cannot be written: {error}")))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// A tier opened over one registered host pool.
pub(crate) struct Open {
    pub(crate) storage: Arc<dyn StorageBackend>,
    pool: HostPool,
    region: MemoryRegion,
    /// The host pool's buffer tensor.
    _keepalive: Py<PyAny>,
}

impl Open {
    /// The pool pages of SGLang's `host_indices` (`length` int64 at `address`) for `count` keys, each checked to be
    /// one whole, aligned page of the pool.
    ///
    /// # Safety
    ///
    /// As [`read_indices`].
    unsafe fn pages(&self, address: usize, length: usize, count: usize) -> PyResult<Vec<usize>> {
        // SAFETY: the function's contract.
        let indices = unsafe { read_indices(address, length) };
        self.pool.pages_of(&indices, count).map_err(host_indices_error)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.storage.unregister_host_memory(&self.region);
    }
}

/// A storage tier serving one rank's host pool (`Settings.open`).
#[pyclass(frozen, module = "hicache._native")]
pub(crate) struct Backend {
    /// `None` once closed; calls in flight keep their `Arc` until they return.
    open: RwLock<Option<Arc<Open>>>,
    name: String,
    page_bytes: usize,
    writer: bool,
    /// The L3 key layout of this rank's stage (every TP rank of it), JSON in SGLang's shape.
    l3_layout: String,
    /// The rank's namespace of KV pages, which its sidecar pools' namespaces derive from.
    pub(crate) namespace: StorageNamespace,
    /// The rank's stage: its first layer, and whether it is the last.
    stage: (u64, bool),
}

impl Backend {
    pub(crate) fn current(&self) -> PyResult<Arc<Open>> {
        let open = self.open.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        open.clone().ok_or_else(|| PyRuntimeError::new_err("hicache: the storage backend is closed"))
    }
}

#[pymethods]
impl Backend {
    /// The tier's name (`file`, `memory`, `mooncake`, ...).
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Bytes of one page.
    #[getter]
    fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Whether this rank writes pages (MLA ranks other than the writer skip writes: every rank holds the same KV).
    #[getter]
    fn writer(&self) -> bool {
        self.writer
    }

    /// The key layout a router outside the engine needs to find this stage's pages in the store (every TP rank's
    /// objects), JSON in the shape of SGLang's `describe_l3_object_layout`.
    #[getter]
    fn l3_layout(&self) -> &str {
        &self.l3_layout
    }

    /// How many of `keys`, from the first, are stored.
    fn batch_exists(&self, py: Python<'_>, keys: &Bound<'_, PyList>) -> PyResult<usize> {
        guard::run(|| {
            let open = self.current()?;
            let keys = parse_keys(keys)?;
            py.detach(|| open.storage.batch_exists(&keys)).map_err(guard::to_py)
        })
    }

    /// Reads pages into the host pool: `keys[i]` into the slots `indices[i × page_size ..][.. page_size]`, where
    /// `indices` is a contiguous int64 tensor of `length` elements at `address` (SGLang's `host_indices`). True for
    /// each page read whole.
    fn batch_get(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyList>,
        address: usize,
        length: usize,
    ) -> PyResult<Vec<bool>> {
        guard::run(|| {
            let open = self.current()?;
            let parsed = parse_keys(keys)?;
            // SAFETY: the caller's contract (module docs): a live contiguous int64 tensor of `length` elements.
            let pages = unsafe { open.pages(address, length, keys.len()) }?;
            let mut sorted = pages.clone();
            sorted.sort_unstable();
            if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
                return Err(host_indices_error(format!("host page {} is the destination of two keys", pair[0])));
            }
            let mut destinations: Vec<PageSegmentsMut<'_>> = pages
                .iter()
                .map(|&page| {
                    open.pool
                        .segments(page)
                        // SAFETY: the segments lie inside the registered pool buffer, which `open` keeps alive; the
                        // pages of this call are distinct (checked above), so no two slices overlap; SGLang never
                        // lets two transfers use one host page at once (the register contract of the pool).
                        .map(|(address, len)| unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) })
                        .collect()
                })
                .collect();
            let outcomes = py.detach(|| open.storage.batch_get(&parsed, &mut destinations)).map_err(guard::to_py)?;
            Ok(outcomes.iter().map(|outcome| matches!(outcome, GetOutcome::Hit)).collect())
        })
    }

    /// Writes pages from the host pool (`keys[i]` from the slots of page `i` of `indices`, as `batch_get`). True for
    /// each page stored (or already stored). A rank that is not the writer stores nothing and answers True.
    fn batch_set(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyList>,
        address: usize,
        length: usize,
    ) -> PyResult<Vec<bool>> {
        guard::run(|| {
            let open = self.current()?;
            let parsed = parse_keys(keys)?;
            // SAFETY: as in `batch_get`.
            let pages = unsafe { open.pages(address, length, keys.len()) }?;
            if !self.writer {
                return Ok(vec![true; keys.len()]);
            }
            let sources: Vec<PageSegments<'_>> = pages
                .iter()
                .map(|&page| {
                    open.pool
                        .segments(page)
                        // SAFETY: inside the registered pool buffer, kept alive by `open`; only read here.
                        .map(|(address, len)| unsafe { std::slice::from_raw_parts(address as *const u8, len) })
                        .collect()
                })
                .collect();
            let outcomes = py.detach(|| open.storage.batch_set(&parsed, &sources)).map_err(guard::to_py)?;
            Ok(outcomes.iter().map(|outcome| outcome.is_stored()).collect())
        })
    }

    /// Reads whole pages into caller buffers (SGLang's copy path): `keys[i]` into `lengths[i]` bytes at
    /// `addresses[i]`. True for each page read whole.
    fn get_into(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyList>,
        addresses: Vec<usize>,
        lengths: Vec<usize>,
    ) -> PyResult<Vec<bool>> {
        guard::run(|| {
            let open = self.current()?;
            let parsed = parse_keys(keys)?;
            check_buffers(keys.len(), &addresses, &lengths)?;
            let mut destinations: Vec<PageSegmentsMut<'_>> = addresses
                .iter()
                .zip(&lengths)
                // SAFETY: the caller's contract (module docs): live CPU tensors; they do not overlap (checked).
                .map(|(&address, &len)| vec![unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) }])
                .collect();
            let outcomes = py.detach(|| open.storage.batch_get(&parsed, &mut destinations)).map_err(guard::to_py)?;
            Ok(outcomes.iter().map(|outcome| matches!(outcome, GetOutcome::Hit)).collect())
        })
    }

    /// Writes whole pages from caller buffers (SGLang's copy path). True for each page stored.
    fn set_from(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyList>,
        addresses: Vec<usize>,
        lengths: Vec<usize>,
    ) -> PyResult<Vec<bool>> {
        guard::run(|| {
            let open = self.current()?;
            let parsed = parse_keys(keys)?;
            check_buffers(keys.len(), &addresses, &lengths)?;
            if !self.writer {
                return Ok(vec![true; keys.len()]);
            }
            let sources: Vec<PageSegments<'_>> = addresses
                .iter()
                .zip(&lengths)
                // SAFETY: the caller's contract (module docs): live CPU tensors, only read here.
                .map(|(&address, &len)| vec![unsafe { std::slice::from_raw_parts(address as *const u8, len) }])
                .collect();
            let outcomes = py.detach(|| open.storage.batch_set(&parsed, &sources)).map_err(guard::to_py)?;
            Ok(outcomes.iter().map(|outcome| outcome.is_stored()).collect())
        })
    }

    /// The (address, length) of each segment of each page of `indices`, in flat page order: what SGLang's
    /// `get_page_buffer_meta` gives for the same slots.
    fn segments(&self, address: usize, length: usize, pages: usize) -> PyResult<Vec<(usize, usize)>> {
        guard::run(|| {
            let open = self.current()?;
            // SAFETY: as in `batch_get`.
            let pages = unsafe { open.pages(address, length, pages) }?;
            Ok(pages.iter().flat_map(|&page| open.pool.segments(page).collect::<Vec<_>>()).collect())
        })
    }

    /// What SGLang's `batch_exists_v2` answers for the run `keys` with the sidecar pools `pools` ((pool, hit policy,
    /// window in pages) each): (KV pages held from the first, each pool's own boundary or None, every restorable
    /// length).
    fn query_groups(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyList>,
        pools: Vec<(PyRef<'_, Sidecar>, String, usize)>,
    ) -> PyResult<(usize, Vec<Option<usize>>, Vec<usize>)> {
        guard::run(|| crate::sidecar::query(py, self, keys, pools))
    }

    /// Removes every page of this rank's namespace (and nothing else); returns how many were removed.
    fn clear(&self, py: Python<'_>) -> PyResult<u64> {
        guard::run(|| {
            let open = self.current()?;
            py.detach(|| open.storage.clear()).map_err(guard::to_py)
        })
    }

    /// The tier's counters since it was opened (pages and bytes read and written, hits, misses, failures, ...).
    fn stats(&self) -> PyResult<HashMap<String, u64>> {
        guard::run(|| {
            let open = self.current()?;
            let value = serde_json::to_value(open.storage.stats())
                .map_err(|error| PyRuntimeError::new_err(format!("hicache: stats: {error}")))?;
            Ok(serde_json::from_value(value).unwrap_or_default())
        })
    }

    /// Closes the tier: later calls raise; calls in flight finish first, then the pool is unregistered.
    fn close(&self) {
        self.open.write().unwrap_or_else(std::sync::PoisonError::into_inner).take();
    }
}

/// The page keys of a list of hex strings, read in place (no copy of the strings).
pub(crate) fn parse_keys(keys: &Bound<'_, PyList>) -> PyResult<Vec<PageKey>> {
    keys.iter()
        .enumerate()
        .map(|(at, key)| {
            let bad = |reason: String| PyValueError::new_err(format!("hicache: keys[{at}]: {reason}"));
            let key = key.cast_into::<PyString>().map_err(|_| bad("not a str".into()))?;
            let text = key.to_str().map_err(|error| bad(error.to_string()))?;
            PageKey::from_str(text).map_err(|error| bad(error.to_string()))
        })
        .collect()
}

fn host_indices_error(reason: String) -> PyErr {
    PyValueError::new_err(format!("hicache: host_indices: {reason}"))
}

/// Copies `length` int64 values from `address`.
///
/// # Safety
///
/// `address` is the data of a live, contiguous int64 array of at least `length` elements, not written during the call.
unsafe fn read_indices(address: usize, length: usize) -> Vec<i64> {
    if length == 0 {
        return Vec::new();
    }
    // SAFETY: the function's contract.
    unsafe { std::slice::from_raw_parts(address as *const i64, length) }.to_vec()
}

/// One buffer per key, none overlapping another.
pub(crate) fn check_buffers(keys: usize, addresses: &[usize], lengths: &[usize]) -> PyResult<()> {
    if addresses.len() != keys || lengths.len() != keys {
        return Err(PyValueError::new_err(format!(
            "hicache: {keys} keys but {} buffers of {} lengths",
            addresses.len(),
            lengths.len()
        )));
    }
    let mut ranges: Vec<(usize, usize)> = addresses.iter().copied().zip(lengths.iter().copied()).collect();
    ranges.sort_unstable();
    if ranges.windows(2).any(|pair| pair[0].0 + pair[0].1 > pair[1].0) {
        return Err(PyValueError::new_err("hicache: two page buffers overlap"));
    }
    Ok(())
}
