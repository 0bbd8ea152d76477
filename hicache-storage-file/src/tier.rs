//! The file tier's entry in the table of tiers (`file`), and its settings as SGLang's extra config and the CLI's flags
//! give them: `dir` (else SGLang's `SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`, else SGLang's `file_storage_path`, else
//! `/tmp/hicache`), `format` (`native`: hicache's namespaced, checksummed pages, the default; `sglang`: the names and
//! raw bytes of SGLang's own `HiCacheFile`, so both read one directory), `capacity` (bytes, or text such as
//! `"200gb"`; least recently used pages are removed beyond it), `io_threads`, `direct_io`, `read_only`, and for small
//! native pages `segment_threshold` (pages below it go to segment files; 0 never), `segment_bytes` (the size of one
//! segment file), `io_uring` (submit segment I/O through io_uring where the kernel allows), `read_ahead` (bytes of
//! a segment read ahead of a batch that continues a forward walk through it; 0 none), `write_behind` (bytes of
//! batches copied and written by the tier's own threads while the caller goes on; 16 MiB by default, a batch of
//! more than half of it written in place; 0 none),
//! `preallocate` (with `direct_io`, bytes a segment's data file is allocated ahead of its writes; 0 none) and
//! `write_split` (the most bytes of a batch's pages one write carries; 0, the default, one write per batch).

use std::path::PathBuf;

use hicache_core::Error;
use hicache_core::config::parse_size;
use hicache_core::extra_config::ConfigError;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::storage::tiers::{self, TierEntry, TierFields};
use serde::Deserialize;
use serde_json::Value;

use crate::{
    FileConfig, FileFormat, FileStorage, MAX_IO_THREADS, MAX_PREALLOCATE_BYTES, MAX_READ_AHEAD_BYTES,
    MAX_WRITE_BEHIND_BYTES, MIN_SEGMENT_BYTES,
};

/// The environment variable SGLang reads for the directory.
pub const DIR_ENV: &str = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR";

/// SGLang's default directory.
pub const DEFAULT_DIR: &str = "/tmp/hicache";

/// The keys, as the extra config gives them.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    dir: Option<String>,
    file_storage_path: Option<String>,
    format: Option<String>,
    capacity: Option<Value>,
    io_threads: Option<usize>,
    direct_io: Option<bool>,
    read_only: Option<bool>,
    segment_threshold: Option<Value>,
    segment_bytes: Option<Value>,
    io_uring: Option<bool>,
    read_ahead: Option<Value>,
    write_behind: Option<Value>,
    preallocate: Option<Value>,
    write_split: Option<Value>,
}

/// A size in bytes, as a number or as text such as `"200gb"`, for the key `key`.
fn size(key: &str, value: Option<Value>) -> Result<Option<u64>, ConfigError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(number)) => number
            .as_u64()
            .map(Some)
            .ok_or_else(|| ConfigError::value(key, format!("{number} is not a whole number of bytes"))),
        Some(Value::String(text)) => parse_size(&text).map(Some).map_err(|reason| ConfigError::value(key, reason)),
        Some(other) => Err(ConfigError {
            key: key.into(),
            reason: format!("bytes or a size such as \"200gb\" is needed, found {other}"),
            wrong_type: true,
        }),
    }
}

/// [`size`], refused above `largest` bytes (`what` names the setting in the error).
fn size_at_most(key: &str, value: Option<Value>, largest: u64, what: &str) -> Result<Option<u64>, ConfigError> {
    match size(key, value)? {
        Some(bytes) if bytes > largest => {
            Err(ConfigError::value(key, format!("{bytes} is above the largest {what}, {largest} bytes")))
        }
        bytes => Ok(bytes),
    }
}

impl FileConfig {
    /// The config the tier's settings give ([`FILE_TIER`]), with SGLang's order for the directory: `dir`, then
    /// `$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`, then `file_storage_path`, then `/tmp/hicache`.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the key: unknown, of the wrong type, or out of its range.
    pub fn from_fields(fields: &TierFields) -> Result<Self, ConfigError> {
        let settings: FileSettings = tiers::read_fields(&FILE_TIER, fields)?;
        let dir = settings
            .dir
            .or_else(|| std::env::var(DIR_ENV).ok().filter(|dir| !dir.is_empty()))
            .or(settings.file_storage_path)
            .unwrap_or_else(|| DEFAULT_DIR.into());
        let format = match settings.format.as_deref() {
            None | Some("native") => FileFormat::Native,
            Some("sglang") => FileFormat::Sglang,
            Some(other) => {
                return Err(ConfigError::value("format", format!("{other:?}: the formats are native, sglang")));
            }
        };
        let mut config = Self::new(PathBuf::from(dir), format);
        config.capacity_bytes = size("capacity", settings.capacity)?;
        if let Some(threshold) = size("segment_threshold", settings.segment_threshold)? {
            config.segment_threshold = usize::try_from(threshold)
                .map_err(|_| ConfigError::value("segment_threshold", format!("{threshold} is too large")))?;
        }
        if let Some(bytes) = size("segment_bytes", settings.segment_bytes)? {
            if bytes < MIN_SEGMENT_BYTES {
                return Err(ConfigError::value(
                    "segment_bytes",
                    format!("{bytes} is below the smallest segment, {MIN_SEGMENT_BYTES} bytes"),
                ));
            }
            config.segment_bytes = bytes;
        }
        config.io_uring = settings.io_uring.unwrap_or(true);
        if let Some(bytes) = size_at_most("read_ahead", settings.read_ahead, MAX_READ_AHEAD_BYTES, "read-ahead")? {
            config.read_ahead_bytes = bytes;
        }
        if let Some(bytes) =
            size_at_most("write_behind", settings.write_behind, MAX_WRITE_BEHIND_BYTES, "write-behind")?
        {
            config.write_behind_bytes = bytes;
        }
        if let Some(bytes) = size_at_most("preallocate", settings.preallocate, MAX_PREALLOCATE_BYTES, "preallocation")?
        {
            config.preallocate_bytes = bytes;
        }
        if let Some(bytes) = size("write_split", settings.write_split)? {
            config.write_split_bytes = bytes;
        }
        if let Some(threads) = settings.io_threads {
            if !(1..=MAX_IO_THREADS).contains(&threads) {
                return Err(ConfigError::value("io_threads", format!("{threads} is not in 1..={MAX_IO_THREADS}")));
            }
            config.io_threads = threads;
        }
        config.direct_io = settings.direct_io.unwrap_or(false);
        config.read_only = settings.read_only.unwrap_or(false);
        Ok(config)
    }
}

fn check(fields: &TierFields) -> Result<(), ConfigError> {
    FileConfig::from_fields(fields).map(drop)
}

fn open(fields: &TierFields, namespace: &StorageNamespace) -> Result<Box<dyn StorageBackend>, Error> {
    let config = FileConfig::from_fields(fields).map_err(tiers::config_error)?;
    Ok(Box::new(FileStorage::open(config, namespace)?))
}

/// The file tier in the table of tiers.
pub const FILE_TIER: TierEntry = TierEntry {
    name: "file",
    aliases: &[],
    about: "local (or shared) files: a file per page, or small pages appended to segment files",
    keys: &[
        "dir",
        "file_storage_path",
        "format",
        "capacity",
        "io_threads",
        "direct_io",
        "read_only",
        "segment_threshold",
        "segment_bytes",
        "io_uring",
        "read_ahead",
        "write_behind",
        "preallocate",
        "write_split",
    ],
    check,
    open,
    objects: None,
};

inventory::submit!(FILE_TIER);

#[cfg(test)]
mod tests {
    use hicache_core::extra_config::Settings;

    use super::*;

    fn error(json: &str) -> String {
        Settings::parse(json).unwrap_err().to_string()
    }

    fn config(json: &str) -> FileConfig {
        let settings = Settings::parse(json).unwrap();
        assert_eq!(settings.tier.name, "file");
        FileConfig::from_fields(&settings.fields).unwrap()
    }

    #[test]
    fn every_key_of_the_file_tier_is_read() {
        let file = config(
            r#"{"backend_name": "hicache", "module_path": "hicache.sglang", "class_name": "HiCacheStorage",
                "interface_v1": 1, "backend": "file", "dir": "/data/kv", "format": "sglang", "capacity": "2gb",
                "io_threads": 3, "direct_io": true, "read_only": true, "segment_threshold": "64kb",
                "segment_bytes": 8388608, "io_uring": false, "read_ahead": "1mb", "write_behind": "8mb",
                "pool": {"page_size": 64}}"#,
        );
        assert_eq!((file.segment_threshold, file.segment_bytes, file.io_uring), (64 << 10, 8 << 20, false));
        assert_eq!((file.read_ahead_bytes, file.write_behind_bytes), (1 << 20, 8 << 20));
        assert_eq!(file.dir, PathBuf::from("/data/kv"));
        assert_eq!(file.format, FileFormat::Sglang);
        assert!(file.direct_io && file.read_only);
        assert_eq!((file.capacity_bytes, file.io_threads), (Some(2 << 30), 3));
        // the file tier is the default
        let file = config(r#"{"dir": "/d", "capacity": 4096}"#);
        assert_eq!((file.format, file.capacity_bytes, file.direct_io), (FileFormat::Native, Some(4096), false));
        assert_eq!(
            (file.segment_threshold, file.segment_bytes, file.io_uring),
            (crate::DEFAULT_SEGMENT_THRESHOLD, crate::DEFAULT_SEGMENT_BYTES, true)
        );
        assert_eq!(file.read_ahead_bytes, crate::DEFAULT_READ_AHEAD_BYTES);
        assert_eq!(config(r#"{"read_ahead": 0}"#).read_ahead_bytes, 0);
        assert_eq!(config(r#"{"write_behind": "4mb"}"#).write_behind_bytes, 4 << 20);
        assert_eq!(config("{}").write_behind_bytes, crate::DEFAULT_WRITE_BEHIND_BYTES);
        assert_eq!(config(r#"{"preallocate": "64mb"}"#).preallocate_bytes, 64 << 20);
        assert_eq!(config(r#"{"preallocate": 0}"#).preallocate_bytes, 0);
        assert_eq!(config("{}").preallocate_bytes, crate::DEFAULT_PREALLOCATE_BYTES);
        assert_eq!(config(r#"{"write_split": "2mb"}"#).write_split_bytes, 2 << 20);
        assert_eq!(config("{}").write_split_bytes, 0);
    }

    #[test]
    fn errors_name_the_key() {
        assert!(error(r#"{"capacty": 1}"#).contains("key `capacty`: unknown key for the file tier (it takes: dir,"));
        assert!(error(r#"{"": 6}"#).contains(r#"key `""`: unknown key"#));
        assert!(error(r#"{"dir": 1}"#).contains("key `dir`: invalid type"));
        assert!(error(r#"{"format": "zip"}"#).contains("key `format`"));
        assert!(error(r#"{"capacity": "1 parsec"}"#).contains("key `capacity`"));
        assert!(error(r#"{"capacity": [1]}"#).contains("key `capacity`"));
        assert!(error(r#"{"io_threads": 0}"#).contains("key `io_threads`: 0 is not in 1..=256"));
        assert!(error(r#"{"io_threads": 100000}"#).contains("key `io_threads`"));
        assert!(
            error(r#"{"segment_bytes": 4096}"#).contains("key `segment_bytes`: 4096 is below the smallest segment")
        );
        assert!(error(r#"{"segment_threshold": "lots"}"#).contains("key `segment_threshold`"));
        assert!(error(r#"{"segment_threshold": -1}"#).contains("key `segment_threshold`"));
        assert!(error(r#"{"io_uring": "yes"}"#).contains("key `io_uring`: invalid type"));
        assert!(error(r#"{"read_ahead": "2tb"}"#).contains("key `read_ahead`: 2199023255552 is above the largest"));
        assert!(error(r#"{"read_ahead": true}"#).contains("key `read_ahead`"));
        assert!(error(r#"{"write_behind": "2gb"}"#).contains("key `write_behind`: 2147483648 is above the largest"));
        assert!(error(r#"{"write_behind": -1}"#).contains("key `write_behind`"));
        assert!(error(r#"{"preallocate": "2gb"}"#).contains("key `preallocate`: 2147483648 is above the largest"));
        let wrong_type = |json: &str| Settings::parse(json).unwrap_err().wrong_type;
        assert!(wrong_type(r#"{"io_threads": "4"}"#) && wrong_type(r#"{"capacity": [1]}"#));
        assert!(!wrong_type(r#"{"io_threads": 0}"#));
    }

    #[test]
    fn the_table_opens_the_file_tier() {
        let dir = tempfile::tempdir().unwrap();
        let namespace = hicache_core::testing::conformance::mha_namespace(0, 1);
        let json = serde_json::json!({"backend": "file", "dir": dir.path()}).to_string();
        let storage = Settings::parse(&json).unwrap().open(&namespace).unwrap();
        assert_eq!((storage.name(), storage.namespace()), ("file", Some(&namespace)));
        assert!(tiers::find("FILE").is_some_and(|entry| entry.keys == FILE_TIER.keys));
    }
}
