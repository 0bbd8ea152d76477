//! The sidecar pools of hybrid models behind SGLang's `*_v2` storage calls: a Mamba state, a sliding window's KV, a
//! sparse-attention indexer, a draft model's KV, each kept under the KV pages' keys in a namespace of its own
//! ([`StorageNamespace::sidecar`]), and queried with the KV as page groups ([`GroupStorage`]): a prefix counts only
//! where every pool holds what restoring it needs.
//!
//! Entries move straight between the host pool and the tier where the pool tells where a page's bytes are
//! (`get_page_buffer_meta` of a page-first pool, whose segments follow the flat page's order), else through a flat
//! page per entry, as SGLang's own `HiCacheFile` moves them (`get_into`, `set_from` take both).

use std::sync::{Arc, RwLock};

use hicache_core::namespace::EntryObject;
use hicache_core::storage::groups::{GroupStorage, HitPolicy, SidecarPool};
use hicache_core::storage::{GetOutcome, PageSegments, PageSegmentsMut, StorageBackend};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::backend::{Backend, PySettings, parse_keys};
use crate::guard;

/// One sidecar pool of a rank, in the tier its KV is in (`Settings.open_sidecar`).
#[pyclass(frozen, module = "hicache._native")]
pub(crate) struct Sidecar {
    /// `None` once closed.
    storage: RwLock<Option<Arc<dyn StorageBackend>>>,
    /// The pool as its namespace names it: its name, entry size and objects.
    entry: hicache_core::namespace::Sidecar,
    writer: bool,
}

/// Opens the sidecar pool `pool` (entries of `entry_bytes`) of the rank `kv` serves, in the same tier. `objects`:
/// how SGLang's Mooncake store cuts an entry into objects (name, bytes, whether the key carries the TP rank), where
/// the host pool says.
pub(crate) fn open(
    settings: &PySettings,
    py: Python<'_>,
    kv: &Backend,
    pool: &str,
    entry_bytes: usize,
    writer: bool,
    objects: Option<Vec<(String, usize, bool)>>,
) -> PyResult<Sidecar> {
    let mut namespace = kv.namespace.sidecar(pool, entry_bytes).map_err(guard::to_py)?;
    if let Some(objects) = objects {
        let objects =
            objects.into_iter().map(|(name, bytes, per_rank)| EntryObject { name, bytes, per_rank }).collect();
        namespace = namespace.with_entry_objects(objects).map_err(guard::to_py)?;
    }
    let storage: Arc<dyn StorageBackend> = Arc::from(py.detach(|| settings.open_sidecar_rank(&namespace))?);
    let entry = namespace.sidecar.expect("a sidecar pool's namespace");
    Ok(Sidecar { storage: RwLock::new(Some(storage)), entry, writer })
}

impl Sidecar {
    /// The pool as its namespace names it.
    pub(crate) fn entry(&self) -> &hicache_core::namespace::Sidecar {
        &self.entry
    }

    fn current(&self) -> PyResult<Arc<dyn StorageBackend>> {
        let storage = self.storage.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        storage
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err(format!("hicache: sidecar pool `{}` is closed", self.entry.pool)))
    }

    /// Checks that the buffers are `per_entry` segments per key, none overlapping another, each key's adding up to
    /// one whole entry.
    fn check_entries(&self, keys: usize, addresses: &[usize], lengths: &[usize], per_entry: usize) -> PyResult<()> {
        let bad = |reason: String| {
            Err(PyValueError::new_err(format!("hicache: sidecar pool `{}`: {reason}", self.entry.pool)))
        };
        if per_entry == 0 || addresses.len() != keys * per_entry || lengths.len() != addresses.len() {
            return bad(format!(
                "{keys} keys of {per_entry} segments each, but {} addresses and {} lengths",
                addresses.len(),
                lengths.len()
            ));
        }
        if let Some(at) =
            lengths.chunks(per_entry).position(|entry| entry.iter().sum::<usize>() != self.entry.entry_bytes)
        {
            let given: usize = lengths[at * per_entry..][..per_entry].iter().sum();
            return bad(format!("entry {at} is given {given} bytes, not one entry of {}", self.entry.entry_bytes));
        }
        let mut ranges: Vec<(usize, usize)> = addresses.iter().copied().zip(lengths.iter().copied()).collect();
        ranges.sort_unstable();
        if ranges.windows(2).any(|pair| pair[0].0 + pair[0].1 > pair[1].0) {
            return bad("two entry buffers overlap".to_owned());
        }
        Ok(())
    }
}

#[pymethods]
impl Sidecar {
    /// The pool's name (`mamba`, `swa`, `indexer`, ...).
    #[getter]
    fn pool(&self) -> &str {
        &self.entry.pool
    }

    /// Bytes of one entry.
    #[getter]
    fn entry_bytes(&self) -> usize {
        self.entry.entry_bytes
    }

    /// Whether this rank writes the pool's entries.
    #[getter]
    fn writer(&self) -> bool {
        self.writer
    }

    /// How many of `keys`, from the first, have an entry.
    fn batch_exists(&self, py: Python<'_>, keys: &Bound<'_, PyList>) -> PyResult<usize> {
        guard::run(|| {
            let storage = self.current()?;
            let keys = parse_keys(keys)?;
            py.detach(|| storage.batch_exists(&keys)).map_err(guard::to_py)
        })
    }

    /// Reads entries into caller buffers: `keys[i]` into the `per_entry` segments `i × per_entry ..` (`lengths[j]`
    /// bytes at `addresses[j]`; one whole entry in all, in the order of the pool's flat page). True for each entry
    /// read whole (checked against its checksum where the tier keeps one).
    #[pyo3(signature = (keys, addresses, lengths, per_entry = 1))]
    fn get_into(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyList>,
        addresses: Vec<usize>,
        lengths: Vec<usize>,
        per_entry: usize,
    ) -> PyResult<Vec<bool>> {
        guard::run(|| {
            let storage = self.current()?;
            let parsed = parse_keys(keys)?;
            self.check_entries(keys.len(), &addresses, &lengths, per_entry)?;
            let mut segments = addresses
                .iter()
                .zip(&lengths)
                // SAFETY: the caller's contract (module docs of `backend`): live CPU memory (tensors or a host pool's
                // pages) that no one else touches during the call; no two segments overlap (checked).
                .map(|(&address, &len)| unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) });
            let mut destinations: Vec<PageSegmentsMut<'_>> =
                (0..keys.len()).map(|_| segments.by_ref().take(per_entry).collect()).collect();
            let outcomes = py.detach(|| storage.batch_get(&parsed, &mut destinations)).map_err(guard::to_py)?;
            Ok(outcomes.iter().map(|outcome| matches!(outcome, GetOutcome::Hit)).collect())
        })
    }

    /// Writes entries from caller buffers (as `get_into`). True for each entry stored (or already stored). A rank
    /// that does not write the pool stores nothing and answers True.
    #[pyo3(signature = (keys, addresses, lengths, per_entry = 1))]
    fn set_from(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyList>,
        addresses: Vec<usize>,
        lengths: Vec<usize>,
        per_entry: usize,
    ) -> PyResult<Vec<bool>> {
        guard::run(|| {
            let storage = self.current()?;
            let parsed = parse_keys(keys)?;
            self.check_entries(keys.len(), &addresses, &lengths, per_entry)?;
            if !self.writer {
                return Ok(vec![true; keys.len()]);
            }
            let mut segments = addresses
                .iter()
                .zip(&lengths)
                // SAFETY: the caller's contract: live CPU memory, only read here.
                .map(|(&address, &len)| unsafe { std::slice::from_raw_parts(address as *const u8, len) });
            let sources: Vec<PageSegments<'_>> =
                (0..keys.len()).map(|_| segments.by_ref().take(per_entry).collect()).collect();
            let outcomes = py.detach(|| storage.batch_set(&parsed, &sources)).map_err(guard::to_py)?;
            Ok(outcomes.iter().map(|outcome| outcome.is_stored()).collect())
        })
    }

    /// Removes every entry of the pool's namespace; returns how many were removed.
    fn clear(&self, py: Python<'_>) -> PyResult<u64> {
        guard::run(|| {
            let storage = self.current()?;
            py.detach(|| storage.clear()).map_err(guard::to_py)
        })
    }

    /// Closes the pool: later calls raise.
    fn close(&self) {
        self.storage.write().unwrap_or_else(std::sync::PoisonError::into_inner).take();
    }
}

/// SGLang's hit policy `policy` (`all_pages`, or `trailing_pages` over `window` pages); a ValueError naming `what`
/// for another.
pub(crate) fn hit_policy(policy: &str, window: usize, what: impl FnOnce() -> String) -> PyResult<HitPolicy> {
    match policy {
        "all_pages" => Ok(HitPolicy::AllPages),
        "trailing_pages" => Ok(HitPolicy::TrailingPages { window: window.max(1) }),
        other => Err(PyValueError::new_err(format!(
            "hicache: {}: hit policy {other:?} is not served (all_pages, trailing_pages)",
            what()
        ))),
    }
}

/// What `batch_exists_v2` answers for the run `keys` of the KV pages `kv` serves and the sidecar pools `pools`
/// (each with its hit policy, `all_pages` or `trailing_pages`, and for `trailing_pages` its window in pages): the KV
/// pages held from the first, each pool's own boundary (`None` where it holds none), and every restorable length.
pub(crate) fn query(
    py: Python<'_>,
    kv: &Backend,
    keys: &Bound<'_, PyList>,
    pools: Vec<(PyRef<'_, Sidecar>, String, usize)>,
) -> PyResult<(usize, Vec<Option<usize>>, Vec<usize>)> {
    let open = kv.current()?;
    let parsed = parse_keys(keys)?;
    let mut sidecars = Vec::with_capacity(pools.len());
    for (at, (pool, policy, window)) in pools.iter().enumerate() {
        let policy = hit_policy(policy, *window, || format!("pool_transfers[{at}] ({})", pool.entry.pool))?;
        sidecars.push(SidecarPool { name: pool.entry.pool.clone(), policy, backend: pool.current()? });
    }
    let groups = GroupStorage::new(open.storage.clone(), sidecars).map_err(guard::to_py)?;
    let restorable = py.detach(|| groups.query(&parsed)).map_err(guard::to_py)?;
    Ok((restorable.kv_pages, restorable.pool_pages, restorable.lengths))
}
