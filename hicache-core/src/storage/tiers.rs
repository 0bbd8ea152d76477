//! The table of storage tiers: every tier a build links registers one [`TierEntry`] (its name, its strict settings
//! reader and its `open`), and both faces that pick a tier by name read this one table: the CLI's `--backend` and the
//! Python package's extra config. A tier is added in its own crate, by one `inventory::submit!`; a face reaches it by
//! linking that crate.
//!
//! A tier's settings are a JSON object, the same one SGLang's `--hicache-storage-backend-extra-config` gives (less the
//! keys every tier shares, which [`crate::extra_config`] takes first). Each tier reads them strictly: an unknown key,
//! a wrong type or a value out of range is refused, naming the key.

use std::fmt;

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::{MemoryStorage, StorageBackend};
use crate::error::Error;
use crate::namespace::StorageNamespace;

/// A bad setting of a tier, or of the extra config around it, naming the key.
#[derive(Debug)]
pub struct ConfigError {
    /// The key (`pool.head_num` for nested ones).
    pub key: String,
    /// What is wrong and what is expected.
    pub reason: String,
    /// The value has the wrong type (raised as `TypeError`; else `ValueError`).
    pub wrong_type: bool,
}

impl ConfigError {
    /// An error of the value of `key` (not of its type).
    pub fn value(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self { key: key.into(), reason: reason.into(), wrong_type: false }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "hicache extra_config key `{}`: {}", self.key, self.reason)
    }
}

/// A tier's settings: the keys of the extra config meant for it.
pub type TierFields = Map<String, Value>;

/// A tier's `open`: its settings and the namespace to a backend.
pub type OpenTier = fn(&TierFields, &StorageNamespace) -> Result<Box<dyn StorageBackend>, Error>;

/// How a tier names the objects of one page of a namespace.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PageObjects {
    /// What precedes `_` and the page hash in every object key; `None`: the key starts with the hash.
    pub key_prefix: Option<String>,
    /// What follows the page hash, one per object.
    pub suffixes: Vec<String>,
}

/// A tier's description of how it names a namespace's objects ([`TierEntry::objects`]).
pub type DescribeObjects = fn(&TierFields, &StorageNamespace) -> Result<PageObjects, Error>;

/// One storage tier a build can open by name.
#[derive(Debug)]
pub struct TierEntry {
    /// The name faces take (`file`, `mooncake`, `3fs`, ...).
    pub name: &'static str,
    /// Other names taken for it (SGLang's `hf3fs`).
    pub aliases: &'static [&'static str],
    /// One line on what it is, for `--help`.
    pub about: &'static str,
    /// The keys its settings take, for messages.
    pub keys: &'static [&'static str],
    /// Reads the settings, strictly, without opening anything; what the settings leave out may come from the
    /// tier's environment variables, which are read too.
    pub check: fn(&TierFields) -> Result<(), ConfigError>,
    /// Opens the tier for one namespace.
    pub open: OpenTier,
    /// How the tier names a namespace's objects, for routers that look pages up in the store themselves
    /// ([`super::l3_layout`]); `None` for a tier whose objects are not found by name outside hicache.
    pub objects: Option<DescribeObjects>,
}

inventory::collect!(TierEntry);

impl TierEntry {
    /// Whether `name` names this tier (its name or an alias, ASCII case ignored).
    pub fn is_named(&self, name: &str) -> bool {
        self.name.eq_ignore_ascii_case(name) || self.aliases.iter().any(|alias| alias.eq_ignore_ascii_case(name))
    }

    /// Reads the settings, naming the key at fault.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the key.
    pub fn check(&self, fields: &TierFields) -> Result<(), ConfigError> {
        (self.check)(fields)
    }

    /// Opens the tier for `namespace` with `fields`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the key, or the tier's failure to open.
    pub fn open(&self, fields: &TierFields, namespace: &StorageNamespace) -> Result<Box<dyn StorageBackend>, Error> {
        (self.open)(fields, namespace)
    }
}

/// Every tier this build links, by name.
pub fn all() -> Vec<&'static TierEntry> {
    let mut entries: Vec<&'static TierEntry> = inventory::iter::<TierEntry>.into_iter().collect();
    entries.sort_by_key(|entry| entry.name);
    entries
}

/// The tier named `name` (or one of its aliases), if this build links it.
pub fn find(name: &str) -> Option<&'static TierEntry> {
    inventory::iter::<TierEntry>.into_iter().find(|entry| entry.is_named(name))
}

/// The names of every tier this build links, for messages (`file, memory, mooncake`).
pub fn names() -> String {
    all().iter().map(|entry| entry.name).collect::<Vec<_>>().join(", ")
}

/// The tier named `name`, or an error naming `key` that lists the tiers this build has.
///
/// # Errors
///
/// [`ConfigError`] naming `key` when no linked tier has that name.
pub fn lookup(key: &str, name: &str) -> Result<&'static TierEntry, ConfigError> {
    find(name).ok_or_else(|| {
        ConfigError::value(key, format!("{name:?} is not a hicache storage tier of this build ({})", names()))
    })
}

/// Reads `fields` as `T`, a tier's settings with `#[serde(deny_unknown_fields)]`, naming the key at fault
/// (`capacity`, `pool.head_num`); an unknown key's error lists what `tier` takes.
///
/// # Errors
///
/// [`ConfigError`] naming the key.
pub fn read_fields<T: DeserializeOwned>(tier: &TierEntry, fields: &TierFields) -> Result<T, ConfigError> {
    let mut track = serde_path_to_error::Track::new();
    let value = Value::Object(fields.clone());
    let deserializer = serde_path_to_error::Deserializer::new(value, &mut track);
    T::deserialize(deserializer).map_err(|error| {
        let path = track.path().to_string();
        let reason = error.to_string();
        let unknown = reason.starts_with("unknown field");
        let key = match (path.as_str(), unknown) {
            // the path stops at the unknown key's parent: the key is the first one the tier does not take
            (_, true) => fields.keys().find(|key| !tier.keys.contains(&key.as_str())).cloned().unwrap_or(path.clone()),
            ("." | "", false) => tier.name.to_owned(),
            (path, false) => path.to_owned(),
        };
        let key = if key.is_empty() { "\"\"".to_owned() } else { key };
        let reason = if unknown {
            match tier.keys {
                [] => format!("unknown key for the {} tier (it takes none)", tier.name),
                keys => format!("unknown key for the {} tier (it takes: {})", tier.name, keys.join(", ")),
            }
        } else {
            reason
        };
        ConfigError { key, wrong_type: error.to_string().starts_with("invalid type"), reason }
    })
}

/// A [`ConfigError`] as the crate's error, for a tier's `open`.
pub fn config_error(error: ConfigError) -> Error {
    Error::InvalidConfig { field: error.key, reason: error.reason }
}

/// A tier's settings error as a [`ConfigError`], for a tier's `check`: [`Error::InvalidConfig`] keeps its field;
/// any other error is put on `backend`.
pub fn setting_error(error: Error) -> ConfigError {
    match error {
        Error::InvalidConfig { field, reason } => {
            ConfigError { key: field, wrong_type: reason.starts_with("invalid type"), reason }
        }
        other => ConfigError::value("backend", other.to_string()),
    }
}

/// The memory tier takes no settings.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct MemorySettings {}

fn memory_check(fields: &TierFields) -> Result<(), ConfigError> {
    read_fields::<MemorySettings>(&MEMORY, fields).map(drop)
}

fn memory_open(fields: &TierFields, namespace: &StorageNamespace) -> Result<Box<dyn StorageBackend>, Error> {
    memory_check(fields).map_err(config_error)?;
    Ok(Box::new(MemoryStorage::new(namespace)))
}

/// The in-process memory tier (tests and measurements): pages live as long as the backend.
pub const MEMORY: TierEntry = TierEntry {
    name: "memory",
    aliases: &[],
    about: "in this process's memory (tests and measurements)",
    keys: &[],
    check: memory_check,
    open: memory_open,
    objects: None,
};

inventory::submit!(MEMORY);
