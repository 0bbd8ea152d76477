//! The storage tier's settings, read from SGLang's extra config (`--hicache-storage-backend-extra-config`, a JSON
//! object, or a config's `storage_backend_extra_config`): which hicache tier, where it keeps its pages, and optionally
//! what the host pool must look like. The Python package opens its tier by them; [`HiCacheConfig`]'s validation
//! reads them for the tiers named here, so `hicache config check` refuses what the package would.
//!
//! [`HiCacheConfig`]: crate::config::HiCacheConfig
//!
//! Keys (every one optional):
//! - `backend`: `file` (default), `memory` (this process only; for tests and measurements) or `mooncake`;
//! - file tier: `dir` (else SGLang's `SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`, else SGLang's `file_storage_path`,
//!   else `/tmp/hicache`), `format` (`native`: hicache's namespaced, checksummed pages, the default; `sglang`: the
//!   names and raw bytes of SGLang's own `HiCacheFile`, so both read one directory), `capacity` (bytes, or text such
//!   as `"200gb"`; least recently used pages are removed beyond it), `io_threads`, `direct_io`;
//! - Mooncake: SGLang's Mooncake keys (`master_server_address`, `protocol`, ...; see the Mooncake crate);
//! - `throttle_read_gbps`: for measurements, every storage get takes at least its bytes' time at this rate (GB/s,
//!   10^9 bytes): a slow tier on a fast machine, any tier;
//! - `pool`: what the host pool SGLang registers must be (`page_size`, `layout`, `dtype`, `layer_num`, `head_num`,
//!   `head_dim`, `kv_lora_rank`, `qk_rope_head_dim`), checked at registration.
//!
//! SGLang's own keys for a dynamic backend (`backend_name`, `module_path`, `class_name`, `interface_v1`) and the ones
//! it consumes itself are accepted and ignored; any other key is refused by name.

use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// The environment variable SGLang reads for the file tier's directory.
pub const DIR_ENV: &str = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR";

/// SGLang's default directory of the file tier.
pub const DEFAULT_DIR: &str = "/tmp/hicache";

/// A bad extra config, naming the key.
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

/// Bytes from `4294967296`, `4gb`, `4 GiB`, `512MB`, `16mib`, `64k`: units are powers of 1024, as Mooncake's own
/// parser reads them.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed.find(|c: char| !c.is_ascii_digit()).unwrap_or(trimmed.len());
    let (digits, unit) = trimmed.split_at(split);
    let number: u64 = digits.parse().map_err(|_| format!("{text:?} is not a size (bytes, or e.g. 4gb, 512mb)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => return Err(format!("{text:?}: unknown unit {other:?} (b, kb, mb, gb, tb)")),
    };
    number.checked_mul(1 << shift).ok_or_else(|| format!("{text:?} overflows 64 bits"))
}

/// A config's extra config for `tier` (as [`crate::config::StorageBackendKind::extra_config_tier`] names it): its
/// fields, with `backend` set to the tier, as [`Settings::parse`] takes them.
///
/// # Errors
///
/// [`ConfigError`] naming `backend` when the extra config names another tier.
pub fn tier_fields(tier: &str, extra: Option<&Value>) -> Result<Value, ConfigError> {
    let mut fields = match extra {
        Some(Value::Object(fields)) => fields.clone(),
        _ => Map::new(),
    };
    if fields.get("backend").is_some_and(|backend| backend.as_str() != Some(tier)) {
        return Err(ConfigError::value("backend", format!("differs from storage_backend ({tier})")));
    }
    fields.insert("backend".into(), tier.into());
    Ok(Value::Object(fields))
}

/// Keys SGLang reads itself; accepted, never used here.
const SGLANG_KEYS: [&str; 9] = [
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
    "tp_lcm_size",
];

/// The storage tier and its settings.
#[derive(Debug)]
pub enum Tier {
    /// In this process's memory.
    Memory,
    /// Local (or shared) files.
    File(FileSettings),
    /// Mooncake Store: the remaining keys, read by the Mooncake crate.
    Mooncake(Value),
}

impl Tier {
    /// The tiers by name, for messages.
    pub const NAMES: &'static str = "file, memory, mooncake";
}

/// The file tier's settings.
#[derive(Debug)]
pub struct FileSettings {
    /// The directory of the pages.
    pub dir: PathBuf,
    /// SGLang's file names and raw bytes instead of hicache's native pages.
    pub sglang_format: bool,
    /// Bytes of pages the namespace may keep in the directory.
    pub capacity_bytes: Option<u64>,
    /// Threads per batch; the tier's default when `None`.
    pub io_threads: Option<usize>,
    /// `O_DIRECT` reads and writes where the memory is aligned.
    pub direct_io: bool,
}

/// What the registered host pool must be; each field checked when given.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[expect(missing_docs, reason = "SGLang's host pool attributes of the same names")]
pub struct PoolExpectation {
    pub page_size: Option<usize>,
    pub layout: Option<String>,
    pub dtype: Option<String>,
    pub layer_num: Option<usize>,
    pub head_num: Option<usize>,
    pub head_dim: Option<usize>,
    pub kv_lora_rank: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
}

/// Everything the extra config says.
#[derive(Debug)]
pub struct Settings {
    /// The storage tier and its settings.
    pub tier: Tier,
    /// What the host pool must be.
    pub pool: PoolExpectation,
    /// Storage gets held to this many bytes per second (measurements); `None`: not held.
    pub throttle_read_bytes_per_s: Option<u64>,
}

impl Settings {
    /// Reads the extra config (JSON text of an object; `null` for none).
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the key: unknown, of the wrong type, or out of its domain.
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(json)
            .map_err(|error| ConfigError::value("extra_config", format!("not JSON: {error}")))?;
        let mut fields = match value {
            Value::Null => Map::new(),
            Value::Object(fields) => fields,
            other => {
                return Err(ConfigError {
                    key: "extra_config".into(),
                    reason: format!("must be an object, found {other}"),
                    wrong_type: true,
                });
            }
        };
        for key in SGLANG_KEYS {
            fields.remove(key);
        }
        let backend: Option<String> = take(&mut fields, "backend")?;
        let pool = take::<PoolExpectation>(&mut fields, "pool")?.unwrap_or_default();
        let throttle_read_bytes_per_s = match take::<f64>(&mut fields, "throttle_read_gbps")? {
            None => None,
            Some(gbps) if gbps > 0.0 && gbps <= 1e4 => Some((gbps * 1e9) as u64),
            Some(gbps) => {
                return Err(ConfigError::value(
                    "throttle_read_gbps",
                    format!("{gbps} is not a rate in (0, 10000] GB/s"),
                ));
            }
        };
        let tier = match backend.as_deref().unwrap_or("file") {
            "memory" => Tier::Memory,
            "file" => Tier::File(file_settings(&mut fields)?),
            "mooncake" => {
                return Ok(Self { tier: Tier::Mooncake(Value::Object(fields)), pool, throttle_read_bytes_per_s });
            }
            other => {
                return Err(ConfigError::value(
                    "backend",
                    format!("{other:?} is not a hicache storage backend in this build ({})", Tier::NAMES),
                ));
            }
        };
        if let Some(key) = fields.keys().next() {
            // an empty key is named as JSON spells it (found by the fuzz target)
            return Err(ConfigError::value(
                if key.is_empty() { "\"\"" } else { key.as_str() },
                format!(
                    "unknown key for the {} backend (it takes: {})",
                    backend.as_deref().unwrap_or("file"),
                    match tier {
                        Tier::File(_) => {
                            "dir, file_storage_path, format, capacity, io_threads, direct_io, throttle_read_gbps, pool"
                        }
                        _ => "throttle_read_gbps, pool",
                    }
                ),
            ));
        }
        Ok(Self { tier, pool, throttle_read_bytes_per_s })
    }
}

fn file_settings(fields: &mut Map<String, Value>) -> Result<FileSettings, ConfigError> {
    let dir: Option<String> = take(fields, "dir")?;
    let sglang_path: Option<String> = take(fields, "file_storage_path")?;
    // an explicit `dir` first; then SGLang's own order: its variable over its `file_storage_path`
    let dir = dir
        .or_else(|| std::env::var(DIR_ENV).ok().filter(|dir| !dir.is_empty()))
        .or(sglang_path)
        .unwrap_or_else(|| DEFAULT_DIR.into());
    let sglang_format = match take::<String>(fields, "format")?.as_deref() {
        None | Some("native") => false,
        Some("sglang") => true,
        Some(other) => return Err(ConfigError::value("format", format!("{other:?}: the formats are native, sglang"))),
    };
    let capacity_bytes = match take::<Value>(fields, "capacity")? {
        None | Some(Value::Null) => None,
        Some(Value::Number(number)) => Some(
            number
                .as_u64()
                .ok_or_else(|| ConfigError::value("capacity", format!("{number} is not a whole number of bytes")))?,
        ),
        Some(Value::String(text)) => Some(parse_size(&text).map_err(|reason| ConfigError::value("capacity", reason))?),
        Some(other) => {
            return Err(ConfigError {
                key: "capacity".into(),
                reason: format!("bytes or a size such as \"200gb\" is needed, found {other}"),
                wrong_type: true,
            });
        }
    };
    let io_threads: Option<usize> = take(fields, "io_threads")?;
    if io_threads == Some(0) {
        return Err(ConfigError::value("io_threads", "must be at least 1"));
    }
    let direct_io = take::<bool>(fields, "direct_io")?.unwrap_or(false);
    Ok(FileSettings { dir: PathBuf::from(dir), sglang_format, capacity_bytes, io_threads, direct_io })
}

/// Removes `key` from `fields` and reads it as `T`; `None` when absent or null.
fn take<T: DeserializeOwned>(fields: &mut Map<String, Value>, key: &str) -> Result<Option<T>, ConfigError> {
    match fields.remove(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => {
            let mut track = serde_path_to_error::Track::new();
            let deserializer = serde_path_to_error::Deserializer::new(value, &mut track);
            T::deserialize(deserializer).map(Some).map_err(|error| {
                let path = track.path().to_string();
                let key = if path == "." || path.is_empty() { key.to_owned() } else { format!("{key}.{path}") };
                let reason = error.to_string();
                ConfigError { key, wrong_type: reason.starts_with("invalid type"), reason }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(json: &str) -> String {
        Settings::parse(json).unwrap_err().to_string()
    }

    #[test]
    fn every_key_of_the_file_tier_is_read() {
        let settings = Settings::parse(
            r#"{"backend_name": "hicache", "module_path": "hicache.sglang", "class_name": "HiCacheStorage",
                "interface_v1": 1, "backend": "file", "dir": "/data/kv", "format": "sglang", "capacity": "2gb",
                "io_threads": 3, "direct_io": true, "pool": {"page_size": 64, "layout": "page_first"}}"#,
        )
        .unwrap();
        let Tier::File(file) = settings.tier else { panic!("a file tier") };
        assert_eq!(file.dir, PathBuf::from("/data/kv"));
        assert!(file.sglang_format && file.direct_io);
        assert_eq!((file.capacity_bytes, file.io_threads), (Some(2 << 30), Some(3)));
        assert_eq!((settings.pool.page_size, settings.pool.layout.as_deref()), (Some(64), Some("page_first")));
        let Tier::File(file) = Settings::parse(r#"{"dir": "/d", "capacity": 4096}"#).unwrap().tier else { panic!() };
        assert_eq!((file.sglang_format, file.capacity_bytes), (false, Some(4096)));
    }

    #[test]
    fn any_tier_can_be_throttled_for_measurements() {
        for backend in ["file", "memory", "mooncake"] {
            let json = format!(r#"{{"backend": "{backend}", "throttle_read_gbps": 2.5}}"#);
            assert_eq!(Settings::parse(&json).unwrap().throttle_read_bytes_per_s, Some(2_500_000_000), "{backend}");
        }
        assert_eq!(Settings::parse("{}").unwrap().throttle_read_bytes_per_s, None);
        for bad in ["0", "-1", "1e5"] {
            let text = error(&format!(r#"{{"throttle_read_gbps": {bad}}}"#));
            assert!(text.starts_with("hicache extra_config key `throttle_read_gbps`"), "{bad}: {text}");
        }
        assert!(error(r#"{"throttle_read_gbps": "fast"}"#).contains("throttle_read_gbps"));
    }

    #[test]
    fn mooncake_keys_go_to_the_mooncake_tier_and_the_memory_tier_takes_none() {
        let settings =
            Settings::parse(r#"{"backend": "mooncake", "master_server_address": "10.0.0.1:50051"}"#).unwrap();
        let Tier::Mooncake(fields) = settings.tier else { panic!("a Mooncake tier") };
        assert_eq!(fields, serde_json::json!({"master_server_address": "10.0.0.1:50051"}));
        assert!(matches!(Settings::parse("null").unwrap().tier, Tier::File(_)));
        assert!(error(r#"{"backend": "memory", "dir": "/d"}"#).starts_with("hicache extra_config key `dir`: unknown"));
    }

    #[test]
    fn errors_name_the_key_and_say_whether_it_is_the_type() {
        let wrong_type = |json: &str| Settings::parse(json).unwrap_err().wrong_type;
        assert!(error(r#"{"backend": "s3"}"#).contains("key `backend`: \"s3\" is not"));
        assert!(error(r#"{"capacty": 1}"#).contains("key `capacty`: unknown key for the file backend"));
        assert!(error(r#"{"": 6}"#).contains(r#"key `""`: unknown key"#));
        assert!(error(r#"{"format": "zip"}"#).contains("key `format`"));
        assert!(error(r#"{"capacity": "1 parsec"}"#).contains("key `capacity`"));
        assert!(error(r#"{"io_threads": 0}"#).contains("key `io_threads`: must be at least 1"));
        assert!(error(r#"{"pool": {"head_num": "8"}}"#).contains("key `pool.head_num`"));
        assert!(
            error(r#"{"pool": {"heads": 8}}"#).contains("key `pool.heads`: unknown field `heads`"),
            "{}",
            error(r#"{"pool": {"heads": 8}}"#)
        );
        assert!(error("[1]").contains("key `extra_config`: must be an object"));
        assert!(error("{").contains("key `extra_config`: not JSON"));
        assert!(wrong_type(r#"{"io_threads": "4"}"#) && wrong_type(r#"{"capacity": [1]}"#) && wrong_type("[1]"));
        assert!(!wrong_type(r#"{"io_threads": 0}"#) && !wrong_type(r#"{"backend": "s3"}"#));
    }
}
