//! Page keys as SGLang computes them (`hicache.page_keys`, `hicache.namespace_seed`).

use std::str::FromStr;

use hicache_core::hash::{PageHasher, PageKey, PartialPage, namespace_seed as seed};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

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
