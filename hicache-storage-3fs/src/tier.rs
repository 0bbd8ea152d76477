//! 3FS's entry in the table of tiers (`3fs`, or SGLang's `hf3fs`): its settings are SGLang's 3FS keys of the extra
//! config ([`Hf3fsConfig::from_json`]), or, when the extra config names none, the file at
//! `$SGLANG_HICACHE_HF3FS_CONFIG_PATH`, else SGLang's defaults ([`Hf3fsConfig::from_env`]).

use hicache_core::Error;
use hicache_core::extra_config::ConfigError;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::storage::tiers::{self, TierEntry, TierFields};
use serde_json::Value;

use crate::{Hf3fsConfig, Hf3fsStorage};

impl Hf3fsConfig {
    /// From the settings the table of tiers gives ([`HF3FS_TIER`]): [`from_json`](Self::from_json), or
    /// [`from_env`](Self::from_env) when they are empty.
    ///
    /// # Errors
    ///
    /// As [`from_json`](Self::from_json) and [`from_env`](Self::from_env).
    pub fn from_fields(fields: &TierFields) -> Result<Self, Error> {
        if fields.is_empty() { Self::from_env() } else { Self::from_json(&Value::Object(fields.clone())) }
    }
}

fn check(fields: &TierFields) -> Result<(), ConfigError> {
    Hf3fsConfig::from_fields(fields).map(drop).map_err(tiers::setting_error)
}

fn open(fields: &TierFields, namespace: &StorageNamespace) -> Result<Box<dyn StorageBackend>, Error> {
    Ok(Box::new(Hf3fsStorage::open(Hf3fsConfig::from_fields(fields)?, namespace)?))
}

/// 3FS in the table of tiers.
pub const HF3FS_TIER: TierEntry = TierEntry {
    name: "3fs",
    aliases: &["hf3fs"],
    about: "DeepSeek 3FS through its USRBIO library, page metadata in process or in Redis",
    keys: &crate::config::KEYS,
    check,
    open,
    objects: None,
};

inventory::submit!(HF3FS_TIER);
