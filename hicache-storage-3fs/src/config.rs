//! The 3FS tier's settings, under SGLang's names: the JSON file at `$SGLANG_HICACHE_HF3FS_CONFIG_PATH` (or the same
//! object given directly), with SGLang's defaults.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hicache_core::Error;
use serde_json::{Map, Value};

/// SGLang's variable naming the JSON config file.
pub const CONFIG_ENV: &str = "SGLANG_HICACHE_HF3FS_CONFIG_PATH";

/// Settings of the 3FS tier.
#[derive(Clone, Debug, PartialEq)]
pub struct Hf3fsConfig {
    /// Data files are `{file_path_prefix}.{rank}.bin` (MLA: rank 0, shared by every rank).
    pub file_path_prefix: PathBuf,
    /// Bytes of each data file (preallocated, sparse where the file system allows).
    pub file_size: u64,
    /// Rings per direction, used in parallel (SGLang's clients).
    pub numjobs: usize,
    /// Requests per ring.
    pub entries: usize,
    /// Page metadata: `None` in this process (one host), or a Redis URL shared by hosts (`redis://host:port`).
    pub metadata_server_url: Option<String>,
    /// How long one ring's requests may take before the backend gives up on them (and refuses later calls).
    pub io_timeout: Duration,
    /// How long a metadata call may take (connecting included).
    pub metadata_timeout: Duration,
    /// The folder of `libhf3fs_api_shared.so`; `None`: `$HF3FS_LIB_DIR`, else the loader's search path.
    pub library_dir: Option<PathBuf>,
    /// Whether a read hashes each page's bytes against the checksum in its footer. Off, a page whose footer names its
    /// key and generation is taken unhashed, so bytes changed beneath the tier are served: for storage that checks
    /// its own data, and to measure what the check costs.
    pub verify_checksum: bool,
}

impl Hf3fsConfig {
    /// SGLang's defaults for data files at `file_path_prefix`: 1 TiB files, 16 rings of 8 requests, metadata in
    /// process; 30 s for I/O, 5 s for metadata calls.
    pub fn new(file_path_prefix: impl Into<PathBuf>) -> Self {
        Self {
            file_path_prefix: file_path_prefix.into(),
            file_size: 1 << 40,
            numjobs: 16,
            entries: 8,
            metadata_server_url: None,
            io_timeout: Duration::from_secs(30),
            metadata_timeout: Duration::from_secs(5),
            library_dir: None,
            verify_checksum: true,
        }
    }

    /// The settings SGLang would use: the JSON file at `$SGLANG_HICACHE_HF3FS_CONFIG_PATH`, else its defaults
    /// (`/data/hicache`).
    ///
    /// # Errors
    ///
    /// As [`from_file`](Self::from_file).
    pub fn from_env() -> Result<Self, Error> {
        match std::env::var_os(CONFIG_ENV).filter(|path| !path.is_empty()) {
            Some(path) => Self::from_file(Path::new(&path)),
            None => Ok(Self::new("/data/hicache")),
        }
    }

    /// Reads SGLang's JSON config file.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the file when it cannot be read or is not JSON, or the field that is wrong.
    pub fn from_file(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|error| Error::InvalidConfig {
            field: CONFIG_ENV.into(),
            reason: format!("cannot read {}: {error}", path.display()),
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|error| Error::InvalidConfig {
            field: CONFIG_ENV.into(),
            reason: format!("{} is not JSON: {error}", path.display()),
        })?;
        Self::from_json(&value)
    }

    /// Reads the settings from a JSON object with SGLang's keys (`file_path_prefix`, `file_size`, `numjobs`,
    /// `entries`, `metadata_server_url`) and hicache's (`io_timeout_s`, `metadata_timeout_s`, `library_dir`,
    /// `verify_checksum`).
    /// `file_path_prefix` is required; the rest default as in [`new`](Self::new). Sizes are bytes, or text such as
    /// `"64GiB"`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the key: an unknown key, a wrong type, a value out of range.
    pub fn from_json(value: &Value) -> Result<Self, Error> {
        let object = value.as_object().ok_or_else(|| invalid("hf3fs config", "must be a JSON object".into()))?;
        if let Some(key) = object.keys().find(|key| !KEYS.contains(&key.as_str())) {
            // quoted as written (an empty key, spaces, control characters): what is unknown is shown exactly
            return Err(invalid(&format!("{key:?}"), format!("unknown key; the keys are {}", KEYS.join(", "))));
        }
        let prefix = string(object, "file_path_prefix")?
            .ok_or_else(|| invalid("file_path_prefix", "is required (data files are {prefix}.{rank}.bin)".into()))?;
        let mut config = Self::new(prefix);
        if let Some(size) = size(object, "file_size")? {
            config.file_size = size;
        }
        if let Some(jobs) = count(object, "numjobs", 1024)? {
            config.numjobs = jobs;
        }
        if let Some(entries) = count(object, "entries", 65_536)? {
            config.entries = entries;
        }
        config.metadata_server_url = string(object, "metadata_server_url")?;
        if config.metadata_server_url.as_deref() == Some("") {
            return Err(invalid(
                "metadata_server_url",
                "is empty: leave it out for metadata in this process alone, or name a Redis (redis://host:port) that \
                 every process sharing the files uses"
                    .into(),
            ));
        }
        if let Some(url) = &config.metadata_server_url
            && !(url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("unix://"))
        {
            return Err(invalid(
                "metadata_server_url",
                format!(
                    "{url:?}: hicache keeps 3FS page metadata in Redis (redis://host:port); SGLang's HTTP metadata \
                     server is not spoken"
                ),
            ));
        }
        if let Some(seconds) = seconds(object, "io_timeout_s")? {
            config.io_timeout = seconds;
        }
        if let Some(seconds) = seconds(object, "metadata_timeout_s")? {
            config.metadata_timeout = seconds;
        }
        config.library_dir = string(object, "library_dir")?.map(PathBuf::from);
        match object.get("verify_checksum") {
            None | Some(Value::Null) => {}
            Some(Value::Bool(verify)) => config.verify_checksum = *verify,
            Some(other) => return Err(invalid("verify_checksum", format!("must be true or false, not {other}"))),
        }
        Ok(config)
    }
}

/// The keys of the settings object (the tier's entry in the table of tiers lists the same).
pub(crate) const KEYS: [&str; 9] = [
    "file_path_prefix",
    "file_size",
    "numjobs",
    "entries",
    "metadata_server_url",
    "io_timeout_s",
    "metadata_timeout_s",
    "library_dir",
    "verify_checksum",
];

fn invalid(key: &str, reason: String) -> Error {
    Error::InvalidConfig { field: key.into(), reason }
}

fn string(object: &Map<String, Value>, key: &str) -> Result<Option<String>, Error> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        Some(other) => Err(invalid(key, format!("must be a string, not {other}"))),
    }
}

fn size(object: &Map<String, Value>, key: &str) -> Result<Option<u64>, Error> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(number)) => number
            .as_u64()
            .filter(|&bytes| bytes > 0)
            .map(Some)
            .ok_or_else(|| invalid(key, format!("must be a positive whole number of bytes, not {number}"))),
        Some(Value::String(text)) => hicache_core::config::parse_size(text)
            .ok()
            .filter(|&bytes| bytes > 0)
            .map(Some)
            .ok_or_else(|| invalid(key, format!("{text:?} is not a size (bytes, or such as \"64GiB\")"))),
        Some(other) => Err(invalid(key, format!("must be a number of bytes, not {other}"))),
    }
}

fn count(object: &Map<String, Value>, key: &str, most: u64) -> Result<Option<usize>, Error> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(number)) => number
            .as_u64()
            .filter(|&count| (1..=most).contains(&count))
            .map(|count| Some(count as usize))
            .ok_or_else(|| invalid(key, format!("must be a whole number from 1 to {most}, not {number}"))),
        Some(other) => Err(invalid(key, format!("must be a number, not {other}"))),
    }
}

fn seconds(object: &Map<String, Value>, key: &str) -> Result<Option<Duration>, Error> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(number)) => number
            .as_f64()
            .filter(|seconds| seconds.is_finite() && *seconds > 0.0 && *seconds <= 86_400.0)
            .map(|seconds| Some(Duration::from_secs_f64(seconds)))
            .ok_or_else(|| invalid(key, format!("must be seconds in (0, 86400], not {number}"))),
        Some(other) => Err(invalid(key, format!("must be a number of seconds, not {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn sglang_keys_are_read_with_its_defaults() {
        let config = Hf3fsConfig::from_json(&json!({
            "file_path_prefix": "/mnt/3fs/hicache", "file_size": 1_073_741_824u64, "numjobs": 2, "entries": 8,
            "metadata_server_url": "redis://127.0.0.1:6379"
        }))
        .expect("valid");
        assert_eq!(config.file_path_prefix, PathBuf::from("/mnt/3fs/hicache"));
        assert_eq!((config.file_size, config.numjobs, config.entries), (1 << 30, 2, 8));
        assert_eq!(config.metadata_server_url.as_deref(), Some("redis://127.0.0.1:6379"));
        let defaults = Hf3fsConfig::from_json(&json!({"file_path_prefix": "/d/h", "file_size": "2GiB"})).unwrap();
        assert_eq!((defaults.file_size, defaults.numjobs, defaults.entries), (2 << 30, 16, 8));
        assert_eq!(defaults.metadata_server_url, None);
        assert!(defaults.verify_checksum, "reads are checked unless told otherwise");
        let unchecked = Hf3fsConfig::from_json(&json!({"file_path_prefix": "/d/h", "verify_checksum": false})).unwrap();
        assert!(!unchecked.verify_checksum);
    }

    #[test]
    fn every_error_names_its_key() {
        for (config, key) in [
            (json!({"file_path_prefix": "/p", "file_sise": 1}), "\"file_sise\""),
            (json!({"file_path_prefix": "/p", "": 3}), "\"\""),
            (json!({"file_path_prefix": "/p", " numjobs": 3}), "\" numjobs\""),
            (json!({"file_size": 1}), "file_path_prefix"),
            (json!({"file_path_prefix": 3}), "file_path_prefix"),
            (json!({"file_path_prefix": "/p", "file_size": 0}), "file_size"),
            (json!({"file_path_prefix": "/p", "file_size": "lots"}), "file_size"),
            (json!({"file_path_prefix": "/p", "numjobs": 0}), "numjobs"),
            (json!({"file_path_prefix": "/p", "entries": -1}), "entries"),
            (json!({"file_path_prefix": "/p", "metadata_server_url": "http://h:18000"}), "metadata_server_url"),
            (json!({"file_path_prefix": "/p", "metadata_server_url": ""}), "metadata_server_url"),
            (json!({"file_path_prefix": "/p", "io_timeout_s": 0}), "io_timeout_s"),
            (json!({"file_path_prefix": "/p", "verify_checksum": "no"}), "verify_checksum"),
        ] {
            let error = Hf3fsConfig::from_json(&config).expect_err(&config.to_string());
            assert!(matches!(&error, Error::InvalidConfig { field, .. } if field == key), "{config}: {error}");
        }
    }
}
