//! The native part of the `hicache` Python package (`hicache._native`): SGLang's page keys, storage backends over
//! hicache's tiers that SGLang's HiCache controller drives through `hicache.sglang.HiCacheStorage`, and the whole
//! cache over a PyTorch engine's KV tensors (`hicache.Cache`).
//!
//! No Rust panic reaches Python as `PanicException` (every entry point runs in `guard::run`), and page bytes move
//! with the GIL released.
//!
//! Without the `python` feature only the parts that need no Python are built ([`config`], and the host pool's byte
//! map): for Rust tests and the fuzz targets, which have no Python to link.

pub mod config;

// The tiers' crates register themselves in the table of tiers (`hicache_core::storage::tiers`); naming each one here
// links it in.
#[cfg(feature = "3fs")]
use hicache_storage_3fs as _;
use hicache_storage_file as _;
#[cfg(feature = "mooncake")]
use hicache_storage_mooncake as _;
#[cfg(feature = "nixl")]
use hicache_storage_nixl as _;
#[cfg_attr(all(not(feature = "python"), not(test)), expect(dead_code, reason = "used by the Python module"))]
mod pool;

#[cfg(feature = "python")]
mod backend;
#[cfg(feature = "python")]
mod cache;
#[cfg(feature = "python")]
mod guard;
#[cfg(feature = "python")]
mod keys;

/// The sidecar pools of hybrid models (SGLang's `*_v2` calls).
#[cfg(feature = "python")]
mod sidecar;

#[cfg(feature = "python")]
use pyo3::prelude::*;

/// The module `hicache._native`.
#[cfg(feature = "python")]
#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    module.add("BACKENDS", config::tier_names())?;
    module.add_function(wrap_pyfunction!(keys::page_keys, module)?)?;
    module.add_function(wrap_pyfunction!(keys::namespace_seed, module)?)?;
    module.add_function(wrap_pyfunction!(keys::unified_plan, module)?)?;
    module.add_function(wrap_pyfunction!(keys::merge_l3_layouts, module)?)?;
    module.add_function(wrap_pyfunction!(panic_is_caught, module)?)?;
    module.add_class::<backend::PySettings>()?;
    module.add_class::<backend::Backend>()?;
    module.add_class::<sidecar::Sidecar>()?;
    module.add_class::<cache::Cache>()?;
    module.add_class::<cache::Load>()?;
    module.add_class::<cache::Tokens>()?;
    module.add("CUDA", cfg!(feature = "cuda"))?;
    Ok(())
}

/// Panics inside the guard every entry point uses, so a test can see the panic arrive as `RuntimeError`.
#[cfg(feature = "python")]
#[pyfunction]
fn panic_is_caught() -> PyResult<()> {
    guard::run(|| panic!("raised on purpose by hicache._native.panic_is_caught"))
}
