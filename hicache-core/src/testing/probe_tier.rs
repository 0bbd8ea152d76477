//! A tier registered only for tests (`probe`): memory pages under its own name, with one setting, so tests show that a
//! tier registered in one place reaches every face that picks tiers by name (the CLI's `--backend`, the Python
//! package's extra config) and that its settings are read strictly.

use serde::Deserialize;

use crate::error::Error;
use crate::extra_config::ConfigError;
use crate::hash::PageKey;
use crate::host_memory::MemoryRegion;
use crate::namespace::StorageNamespace;
use crate::storage::tiers::{self, TierEntry, TierFields};
use crate::storage::{
    GetOutcome, MemoryStorage, PageSegments, PageSegmentsMut, SetOutcome, StorageBackend, StorageStats,
};

/// The probe tier's settings.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProbeSettings {
    /// Any text; only checked to be text.
    #[expect(dead_code, reason = "read to check its type")]
    label: Option<String>,
}

fn check(fields: &TierFields) -> Result<(), ConfigError> {
    tiers::read_fields::<ProbeSettings>(&PROBE, fields).map(drop)
}

fn open(fields: &TierFields, namespace: &StorageNamespace) -> Result<Box<dyn StorageBackend>, Error> {
    check(fields).map_err(tiers::config_error)?;
    Ok(Box::new(Probe(MemoryStorage::new(namespace))))
}

/// The tier's entry.
pub const PROBE: TierEntry = TierEntry {
    name: "probe",
    aliases: &["probe-alias"],
    about: "memory pages under another name (tests only)",
    keys: &["label"],
    check,
    open,
    objects: None,
};

inventory::submit!(PROBE);

/// Memory storage named `probe`.
struct Probe(MemoryStorage);

impl StorageBackend for Probe {
    fn name(&self) -> &str {
        "probe"
    }

    fn namespace(&self) -> Option<&StorageNamespace> {
        self.0.namespace()
    }

    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
        self.0.batch_exists(keys)
    }

    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
        self.0.batch_get(keys, pages)
    }

    fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
        self.0.batch_set(keys, pages)
    }

    fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
        self.0.remove(keys)
    }

    fn register_host_memory(&self, region: &MemoryRegion) -> Result<(), Error> {
        self.0.register_host_memory(region)
    }

    fn list(&self) -> Result<Vec<(PageKey, u64)>, Error> {
        self.0.list()
    }

    fn clear(&self) -> Result<u64, Error> {
        self.0.clear()
    }

    fn stats(&self) -> StorageStats {
        self.0.stats()
    }
}
