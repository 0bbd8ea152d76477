//! One entry point for an engine: the tree, its controller and its storage tier from one [`HiCacheConfig`] and the
//! engine's transfer engine (its pools), every size derived from them and every mismatch refused naming the field.
//!
//! ```
//! use hicache_core::config::HiCacheConfig;
//! use hicache_core::geometry::{KvDtype, KvGeometry};
//! use hicache_core::layout::{HostLayout, HostLayoutMap};
//! use hicache_core::transfer::{Completion, CpuEngine, DeviceLayoutMap};
//! use hicache_core::HiCacheBuilder;
//!
//! let geometry = KvGeometry::mha(2, 2, 64, KvDtype::Bf16).unwrap();
//! let engine = CpuEngine::new(
//!     DeviceLayoutMap::new(geometry, 64 * 16).unwrap(),
//!     HostLayoutMap::new(geometry, HostLayout::LayerFirst, 16, 128).unwrap(),
//!     Completion::Immediate,
//! )
//! .unwrap();
//! let config = HiCacheConfig { page_size: 16, ..HiCacheConfig::default() };
//! let tree = HiCacheBuilder::new(config, engine).build().unwrap();
//! assert_eq!(tree.page_size(), 16);
//!
//! // a config that disagrees with the engine's pools is refused, naming the field
//! let engine = CpuEngine::new(
//!     DeviceLayoutMap::new(geometry, 64 * 16).unwrap(),
//!     HostLayoutMap::new(geometry, HostLayout::LayerFirst, 16, 128).unwrap(),
//!     Completion::Immediate,
//! )
//! .unwrap();
//! let error = HiCacheBuilder::new(HiCacheConfig { page_size: 32, ..HiCacheConfig::default() }, engine)
//!     .build()
//!     .err()
//!     .unwrap();
//! assert!(error.to_string().contains("page_size"), "{error}");
//! ```

use std::sync::Arc;

use crate::config::HiCacheConfig;
use crate::controller::{CacheController, StorageSettings, Trailing};
use crate::error::Error;
use crate::rate_limit::{Clock, SystemClock};
use crate::storage::StorageBackend;
use crate::transfer::TransferEngine;
use crate::tree::{HiRadixTree, TreeSettings};

/// Builds a [`HiRadixTree`] over an engine from one config.
pub struct HiCacheBuilder<E: TransferEngine> {
    config: HiCacheConfig,
    engine: E,
    storage: Option<Arc<dyn StorageBackend>>,
    settings: Option<StorageSettings>,
    clock: Option<Arc<dyn Clock>>,
    tp_rank: usize,
    trailing: Option<Trailing>,
}

impl<E: TransferEngine> HiCacheBuilder<E> {
    /// A builder for `engine` (its device and host pools decide the sizes) with `config`.
    pub fn new(config: HiCacheConfig, engine: E) -> Self {
        Self { config, engine, storage: None, settings: None, clock: None, tp_rank: 0, trailing: None }
    }

    /// Adds a storage tier (L3).
    pub fn with_storage(mut self, storage: Arc<dyn StorageBackend>) -> Self {
        self.storage = Some(storage);
        self
    }

    /// Storage settings to use instead of those the config gives ([`StorageSettings::from_config`]): for a bench or
    /// a test that sets what no config knob reaches (the tick's slots, priors left unknown). Their page size must be
    /// the config's. A trailing window in them (`trailing`) is taken as [`with_trailing`](Self::with_trailing)
    /// takes one.
    pub fn with_storage_settings(mut self, settings: StorageSettings) -> Self {
        self.settings = Some(settings);
        self
    }

    /// The clock that times prefetches (default: the system's).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// This process's TP rank (spreads the ranks' storage batches, as SGLang's rank-dependent settings do).
    pub fn with_tp_rank(mut self, rank: usize) -> Self {
        self.tp_rank = rank;
        self
    }

    /// A hybrid model's trailing window as this rank sees it ([`Trailing`]): the tree's matches end only where the
    /// pools that a prefix needs at its end hold its last pages' entries ([`TreeSettings::trailing_window`]), and
    /// with a storage tier, what this rank stores and reads of them. A hit is then fetched whole: the storage
    /// settings' `by_cost`, `split` and `meet` are turned off.
    pub fn with_trailing(mut self, trailing: Trailing) -> Self {
        self.trailing = Some(trailing);
        self
    }

    /// The tree, its controller and (with a storage tier) the storage half.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the field when the config is invalid or disagrees with the engine's pools
    /// (`page_size`, `mem_layout`) or the storage backend's rank (`tp_rank`); [`Error::InvalidArgument`] naming the
    /// field when the backend was opened for other pages than the pools hold (`page_size`, `geometry`,
    /// `mem_layout`); the controller's and the storage settings' errors.
    pub fn build(self) -> Result<HiRadixTree<E>, Error> {
        let trailing_window = self.trailing.map(|trailing| trailing.window);
        let (controller, config) = self.assemble()?;
        let settings = TreeSettings {
            write_policy: config.write_policy,
            write_through_selective_threshold: config.write_through_selective_threshold,
            load_back_threshold: config.load_back_threshold,
            trailing_window,
        };
        Ok(HiRadixTree::new(controller, settings))
    }

    /// The controller alone (with the storage half when a tier was given), checked as [`build`](Self::build) checks
    /// it: for a caller that drives the controller without a tree (a bench, a backend's test rig).
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build).
    pub fn build_controller(self) -> Result<CacheController<E>, Error> {
        self.assemble().map(|(controller, _)| controller)
    }

    /// The controller, and the validated config it was built from (the tree takes its settings from it).
    fn assemble(self) -> Result<(CacheController<E>, HiCacheConfig), Error> {
        let config = self.config.validated()?;
        let host = self.engine.host_memory();
        let host_map = *host.map();
        let device = self.engine.device_layout();
        let mismatch = |field: &str, reason: String| Err(Error::InvalidConfig { field: field.to_owned(), reason });
        if host_map.page_size() != config.page_size {
            return mismatch(
                "page_size",
                format!(
                    "{} tokens, but the engine's host pool has pages of {}",
                    config.page_size,
                    host_map.page_size()
                ),
            );
        }
        if host_map.layout() != config.mem_layout {
            return mismatch(
                "mem_layout",
                format!("{}, but the engine's host pool is {}", config.mem_layout.name(), host_map.layout().name()),
            );
        }
        let head_groups = config.head_groups(device.geometry())?;
        if host_map.head_groups() != head_groups {
            return mismatch(
                "head_group",
                format!(
                    "{} head groups per page, but the engine's host pool has {}",
                    head_groups,
                    host_map.head_groups()
                ),
            );
        }
        if !device.slots().is_multiple_of(config.page_size) {
            return mismatch(
                "page_size",
                format!(
                    "the engine's device pool of {} slots is not whole pages of {}",
                    device.slots(),
                    config.page_size
                ),
            );
        }
        let page = config.page_size;
        let (host_pages, device_pages) = (host_map.pages(), device.slots() / page);
        let layers = device.geometry().layers;
        let mla = device.geometry().is_mla();
        let mut controller = CacheController::new(self.engine, page, host_pages, device_pages, layers)?;
        if let Some(storage) = self.storage {
            if let Some(namespace) = storage.namespace()
                && namespace.tp_rank != self.tp_rank
            {
                return mismatch(
                    "tp_rank",
                    format!(
                        "{}, but the storage backend was opened for rank {} of {}",
                        self.tp_rank, namespace.tp_rank, namespace.tp_size
                    ),
                );
            }
            let mut settings = match self.settings {
                Some(settings) => settings,
                None => {
                    StorageSettings::from_config(&config, host_pages * page, device_pages * page, mla, self.tp_rank)?
                }
            };
            // a window given in the settings is the same as one given with `with_trailing`; two must agree
            let trailing = match (self.trailing, settings.trailing) {
                (Some(given), Some(set)) if given != set => {
                    return mismatch(
                        "trailing",
                        format!("the storage settings' {set:?}, but `with_trailing` gave {given:?}"),
                    );
                }
                (given, set) => given.or(set),
            };
            if let Some(trailing) = trailing {
                settings =
                    StorageSettings { trailing: Some(trailing), by_cost: false, split: false, meet: false, ..settings };
            }
            let clock = self.clock.unwrap_or_else(|| Arc::new(SystemClock::new()));
            controller = controller.with_storage(storage, settings, clock)?;
        }
        Ok((controller, config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{KvDtype, KvGeometry};
    use crate::layout::{HostLayout, HostLayoutMap};
    use crate::namespace::StorageNamespace;
    use crate::storage::MemoryStorage;
    use crate::transfer::{Completion, CpuEngine, DeviceLayoutMap};

    const PAGE: usize = 4;

    fn geometry() -> KvGeometry {
        KvGeometry::mha(2, 2, 8, KvDtype::Bf16).unwrap()
    }

    /// A CPU engine over fresh pools of `geometry()`: 8 device pages and 16 layer-first host pages of `PAGE`.
    fn engine() -> CpuEngine {
        CpuEngine::new(
            DeviceLayoutMap::new(geometry(), 8 * PAGE).unwrap(),
            HostLayoutMap::new(geometry(), HostLayout::LayerFirst, PAGE, 16).unwrap(),
            Completion::Immediate,
        )
        .unwrap()
    }

    /// A builder over fresh pools of `geometry()`, layer-first pages of `PAGE`, with a backend opened for
    /// `namespace`, on rank `rank`.
    fn build(namespace: &StorageNamespace, rank: usize) -> Result<HiRadixTree<CpuEngine>, Error> {
        let engine = engine();
        let config = HiCacheConfig { page_size: PAGE, mem_layout: HostLayout::LayerFirst, ..HiCacheConfig::default() };
        HiCacheBuilder::new(config, engine)
            .with_storage(Arc::new(MemoryStorage::new(namespace)))
            .with_tp_rank(rank)
            .build()
    }

    #[test]
    fn a_backend_opened_for_other_pages_is_refused_naming_the_field() {
        let matching = StorageNamespace::single_rank("m", geometry(), HostLayout::LayerFirst, PAGE);
        build(&matching, 0).unwrap();
        let other_geometry = KvGeometry::mha(2, 4, 8, KvDtype::Bf16).unwrap();
        let mut other_rank = matching.clone();
        (other_rank.tp_rank, other_rank.tp_size) = (1, 2);
        for (namespace, rank, field) in [
            (StorageNamespace::single_rank("m", geometry(), HostLayout::LayerFirst, 2 * PAGE), 0, "page_size"),
            (StorageNamespace::single_rank("m", other_geometry, HostLayout::LayerFirst, PAGE), 0, "geometry"),
            (StorageNamespace::single_rank("m", geometry(), HostLayout::PageFirst, PAGE), 0, "mem_layout"),
            (other_rank.clone(), 0, "tp_rank"),
        ] {
            let error = build(&namespace, rank).expect_err("a mismatch is refused").to_string();
            let named =
                error.starts_with(&format!("{field}: ")) || error.starts_with(&format!("config field `{field}`"));
            assert!(named, "{field}: {error}");
        }
        build(&other_rank, 1).unwrap();
    }

    /// A trailing window given in the storage settings alone is the tree's too (an insert must then say which pages
    /// hold its entries), and the settings' prefetch by cost is turned off for it as `with_trailing` does; a window
    /// given both ways must agree.
    #[test]
    fn a_trailing_window_in_the_storage_settings_is_the_trees() {
        use crate::controller::Trailing;
        use crate::device_slots::{DeviceSlotAllocator, PagedSlots};
        let namespace = StorageNamespace::single_rank("m", geometry(), HostLayout::LayerFirst, PAGE);
        let window = |pages| Trailing { window: std::num::NonZeroUsize::new(pages).unwrap(), pool: true };
        let builder = |settings_window: Option<Trailing>, given: Option<Trailing>| {
            let config = HiCacheConfig {
                page_size: PAGE,
                mem_layout: HostLayout::LayerFirst,
                prefetch_by_cost: true,
                ..HiCacheConfig::default()
            };
            let settings = StorageSettings::from_config(&config, 16 * PAGE, 8 * PAGE, false, 0).unwrap();
            assert!(settings.by_cost);
            let builder = HiCacheBuilder::new(config, engine())
                .with_storage(Arc::new(MemoryStorage::new(&namespace)))
                .with_storage_settings(StorageSettings { trailing: settings_window, ..settings });
            match given {
                Some(given) => builder.with_trailing(given),
                None => builder,
            }
        };
        let tokens: Vec<u32> = (0..2 * PAGE as u32).collect();
        for (settings_window, given, windowed) in
            [(None, None, false), (Some(window(2)), None, true), (None, Some(window(2)), true)]
        {
            let mut tree = builder(settings_window, given).build().unwrap();
            let mut device = PagedSlots::new(8, PAGE).unwrap();
            let slots = device.alloc_pages(2).unwrap();
            // one flag for two pages: an error naming `trailing` exactly when the tree has a window
            let inserted = tree.insert_with_trailing(&tokens, &slots, &mut device, &[true]);
            match inserted {
                Err(Error::InvalidArgument { field: "trailing", .. }) => assert!(windowed, "{settings_window:?}"),
                Ok(_) => assert!(!windowed, "{settings_window:?}"),
                Err(other) => panic!("{other}"),
            }
        }
        let error = builder(Some(window(3)), Some(window(2))).build().expect_err("two windows").to_string();
        assert!(error.starts_with("config field `trailing`"), "{error}");
        builder(Some(window(2)), Some(window(2))).build().unwrap();
        // a controller made without the builder refuses a window with prefetch by cost
        let config = HiCacheConfig { page_size: PAGE, prefetch_by_cost: true, ..HiCacheConfig::default() };
        let settings = StorageSettings::from_config(&config, 16 * PAGE, 8 * PAGE, false, 0).unwrap();
        let controller = CacheController::new(engine(), PAGE, 16, 8, geometry().layers).unwrap();
        let error = controller
            .with_storage(
                Arc::new(MemoryStorage::new(&namespace)),
                StorageSettings { trailing: Some(window(2)), ..settings },
                Arc::new(SystemClock::new()),
            )
            .expect_err("a window with prefetch by cost")
            .to_string();
        assert!(error.starts_with("trailing: "), "{error}");
    }
}
