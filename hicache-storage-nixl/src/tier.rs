//! NIXL's entry in the table of tiers (`nixl`), and its settings: `dir` (else SGLang's
//! `SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR`, else `/tmp/hicache_storage`), `plugin` (`auto`, SGLang's choice, or a
//! plugin's name), `plugin_params` (text values over the plugin's defaults), `lib_dir`, `max_open_files` and
//! `max_registered_regions`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hicache_core::Error;
use hicache_core::extra_config::ConfigError;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::storage::tiers::{self, TierEntry, TierFields};
use serde::Deserialize;

use crate::{NixlConfig, NixlStorage, PluginChoice};

/// The keys, as the extra config gives them.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NixlSettings {
    dir: Option<PathBuf>,
    plugin: Option<String>,
    plugin_params: Option<BTreeMap<String, String>>,
    lib_dir: Option<PathBuf>,
    max_open_files: Option<usize>,
    max_registered_regions: Option<usize>,
}

impl NixlConfig {
    /// The config the tier's settings give ([`NIXL_TIER`]).
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the key: unknown, or of the wrong type. (Counts are checked when the tier opens.)
    pub fn from_fields(fields: &TierFields) -> Result<Self, ConfigError> {
        let settings: NixlSettings = tiers::read_fields(&NIXL_TIER, fields)?;
        let mut config = Self::new(Self::resolve_dir(settings.dir.as_deref().map(Path::new)));
        config.plugin = match settings.plugin.as_deref() {
            None | Some("auto") => PluginChoice::Auto,
            Some("") => return Err(ConfigError::value("plugin", "is empty; name a plugin or `auto`")),
            Some(name) => PluginChoice::Named(name.to_owned()),
        };
        config.plugin_params = settings.plugin_params.unwrap_or_default();
        config.lib_dir = settings.lib_dir;
        config.max_open_files = settings.max_open_files.unwrap_or(config.max_open_files);
        config.max_registered_regions = settings.max_registered_regions.unwrap_or(config.max_registered_regions);
        Ok(config)
    }
}

fn check(fields: &TierFields) -> Result<(), ConfigError> {
    NixlConfig::from_fields(fields).map(drop)
}

fn open(fields: &TierFields, namespace: &StorageNamespace) -> Result<Box<dyn StorageBackend>, Error> {
    let config = NixlConfig::from_fields(fields).map_err(tiers::config_error)?;
    Ok(Box::new(NixlStorage::open(config, namespace)?))
}

/// NIXL in the table of tiers.
pub const NIXL_TIER: TierEntry = TierEntry {
    name: "nixl",
    aliases: &[],
    about: "NIXL's storage plugins over files, one per page",
    keys: &["dir", "plugin", "plugin_params", "lib_dir", "max_open_files", "max_registered_regions"],
    check,
    open,
    objects: None,
};

inventory::submit!(NIXL_TIER);
