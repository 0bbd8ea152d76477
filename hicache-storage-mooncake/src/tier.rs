//! Mooncake Store's entry in the table of tiers (`mooncake`): its settings are SGLang's Mooncake keys of the extra
//! config, or SGLang's Mooncake variables when the extra config names none ([`MooncakeConfig::from_fields`]).

use hicache_core::Error;
use hicache_core::extra_config::ConfigError;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::storage::tiers::{self, PageObjects, TierEntry, TierFields};

use crate::keys::KeyRenderer;
use crate::{MooncakeConfig, MooncakeStorage};

fn check(fields: &TierFields) -> Result<(), ConfigError> {
    MooncakeConfig::from_fields(fields).map(drop).map_err(tiers::setting_error)
}

fn open(fields: &TierFields, namespace: &StorageNamespace) -> Result<Box<dyn StorageBackend>, Error> {
    Ok(Box::new(MooncakeStorage::open(MooncakeConfig::from_fields(fields)?, namespace)?))
}

/// The names of a namespace's objects under the settings' key scheme (nothing is opened).
fn objects(fields: &TierFields, namespace: &StorageNamespace) -> Result<PageObjects, Error> {
    let config = MooncakeConfig::from_fields(fields)?;
    Ok(KeyRenderer::new(&config.scheme, namespace)?.page_objects())
}

/// Mooncake Store in the table of tiers.
pub const MOONCAKE_TIER: TierEntry = TierEntry {
    name: "mooncake",
    aliases: &[],
    about: "Mooncake Store (a master and the clients' lent segments)",
    keys: &[
        "master_server_address",
        "protocol",
        "device_name",
        "global_segment_size",
        "local_buffer_size",
        "metadata_server",
        "local_hostname",
        "replica_num",
        "key_scheme",
        "sglang_release",
        "extra_backend_tag",
        "library",
        "connect_timeout_ms",
        "lease_wait_ms",
        "prefer_local_segment",
    ],
    check,
    open,
    objects: Some(objects),
};

inventory::submit!(MOONCAKE_TIER);
