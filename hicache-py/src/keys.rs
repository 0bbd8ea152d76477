//! Page keys as SGLang computes them (`hicache.page_keys`, `hicache.namespace_seed`), and SGLang's unified L3 key
//! scheme (`hicache.unified_plan`).

use std::str::FromStr;

use hicache_core::hash::{PageHasher, PageKey, PartialPage, namespace_seed as seed};
use hicache_core::storage::l3_layout::{self, L3Layout};
use hicache_core::unified_keys::{UnifiedRank, plan};
use pyo3::exceptions::PyNotImplementedError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::guard;

/// The chained keys of `tokens` in pages of `page_size`, as 64 lowercase hex digits each: byte-identical to SGLang's
/// `get_hash_str` page by page (ids of 2^32 or more hashed as SGLang 0.5.20 and later do). `prior` is the key of the
/// page before the first one (or a namespace seed); a trailing partial page is refused, as SGLang never stores one.
#[pyfunction]
#[pyo3(signature = (tokens, page_size, prior = None))]
pub(crate) fn page_keys(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    page_size: usize,
    prior: Option<&str>,
) -> PyResult<Vec<String>> {
    guard::run(|| {
        let tokens: Vec<i64> = tokens.extract().map_err(|error| {
            PyValueError::new_err(format!("hicache: tokens: a sequence of ints is needed: {error}"))
        })?;
        if let Some(at) = tokens.iter().position(|&token| token < 0) {
            return Err(PyValueError::new_err(format!("hicache: tokens[{at}]: {} is negative", tokens[at])));
        }
        if page_size == 0 {
            return Err(PyValueError::new_err("hicache: page_size: must be at least 1"));
        }
        let prior = prior
            .map(|text| {
                PageKey::from_str(text).map_err(|error| PyValueError::new_err(format!("hicache: prior: {error}")))
            })
            .transpose()?;
        let wide: Vec<u64> = tokens.iter().map(|&token| token as u64).collect();
        let keys = py
            .detach(|| PageHasher::new().page_keys_wide(&wide, page_size, prior, PartialPage::Reject))
            .map_err(guard::to_py)?;
        Ok(keys.iter().map(PageKey::to_hex).collect())
    })
}

/// The prior of a request's first page when it has an `extra_key` (a LoRA adapter, say) or a `cache_salt` (SGLang
/// 0.5.20 and later); `None` when it has neither, so such requests keep the keys they always had.
#[pyfunction]
#[pyo3(signature = (extra_key = None, cache_salt = None))]
pub(crate) fn namespace_seed(extra_key: Option<&str>, cache_salt: Option<&str>) -> PyResult<Option<String>> {
    guard::run(|| Ok(seed(extra_key, cache_salt).map(|key| key.to_hex())))
}

/// SGLang's `merge_l3_layouts`: the L3 layouts of several schedulers (JSON of a list, `null` for one that gave
/// none) as one (JSON; `null` when none gave one). Raises `ValueError` naming what is not a layout.
#[pyfunction]
pub(crate) fn merge_l3_layouts(layouts: &str) -> PyResult<String> {
    guard::run(|| {
        let layouts: Vec<Option<L3Layout>> = serde_json::from_str(layouts)
            .map_err(|error| PyValueError::new_err(format!("hicache: L3 layouts: {error}")))?;
        serde_json::to_string(&l3_layout::merge(&layouts)).map_err(|error| PyValueError::new_err(error.to_string()))
    })
}

/// One rank's plan under SGLang's unified L3 key scheme (`rank`: JSON of the arguments of SGLang's
/// `plan_unified_kv`): a dict of `digest`, `suffixes` (one per chunk the rank owns, layer-major), `layer_ranges` and
/// `head_ranges` (local to the rank's pool) and `encoded` (the namespace's MessagePack, hex, which the digest
/// hashes). Raises `ValueError` where SGLang does, and `NotImplementedError` where SGLang does.
#[pyfunction]
pub(crate) fn unified_plan<'py>(py: Python<'py>, rank: &str) -> PyResult<Bound<'py, PyDict>> {
    guard::run(|| {
        let rank: UnifiedRank = serde_json::from_str(rank)
            .map_err(|error| PyValueError::new_err(format!("hicache: unified key scheme rank: {error}")))?;
        let planned = plan(&rank).map_err(|error| match error.kind() {
            hicache_core::ErrorKind::Unsupported => PyNotImplementedError::new_err(format!("hicache: {error}")),
            _ => guard::to_py(error),
        })?;
        let out = PyDict::new(py);
        out.set_item("digest", planned.namespace.digest())?;
        out.set_item("encoded", hex::encode(planned.namespace.encode()))?;
        out.set_item("suffixes", planned.suffixes)?;
        out.set_item("layer_ranges", planned.layer_ranges)?;
        out.set_item("head_ranges", planned.head_ranges)?;
        Ok(out)
    })
}
