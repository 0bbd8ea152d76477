//! Settings of a Mooncake backend, from code, from SGLang's environment variables, or from a JSON object (SGLang's
//! `--hicache-storage-backend-extra-config`, or the file named by `MOONCAKE_CONFIG_PATH`).

use std::path::PathBuf;
use std::time::Duration;

use hicache_core::Error;
use hicache_core::config::parse_size;
use serde::Deserialize;

use crate::keys::{KeyScheme, SglangRelease};

/// SGLang's default segment each client contributes to the cluster: 4 GiB.
pub const DEFAULT_GLOBAL_SEGMENT_SIZE: u64 = 4 << 30;
/// SGLang's default client buffer: 16 MiB.
pub const DEFAULT_LOCAL_BUFFER_SIZE: u64 = 16 << 20;

/// Settings of a Mooncake backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MooncakeConfig {
    /// The master's `host:port` (SGLang's `MOONCAKE_MASTER`).
    pub master: String,
    /// The transfer engine's metadata server: `P2PHANDSHAKE` (no server), or an etcd or HTTP address.
    pub metadata_server: String,
    /// This host's name as the other clients reach it (SGLang's `LOCAL_HOSTNAME`, default `localhost`).
    pub local_hostname: String,
    /// `tcp` or `rdma`.
    pub protocol: String,
    /// The RDMA device(s), e.g. `mlx5_0`; empty lets Mooncake choose (SGLang's `auto`).
    pub device: String,
    /// Bytes of this process's memory that it lends to the cluster as a segment.
    pub global_segment_size: u64,
    /// Bytes of the client's own transfer buffer.
    pub local_buffer_size: u64,
    /// Replicas of each object.
    pub replicas: usize,
    /// How object keys are written.
    pub scheme: KeyScheme,
    /// `libmooncake_store.so`; `None`: `$MOONCAKE_STORE_LIBRARY`, else the loader's search path.
    pub library: Option<PathBuf>,
    /// How long opening may take: the master accepting a connection and the client's setup (Mooncake's own setup
    /// retries for minutes against a master that is stopped); also how long closing waits for the unmount.
    pub connect_timeout: Duration,
    /// How long a removal waits for readers' leases on an object to run out (Mooncake's default lease is 10 s).
    pub lease_wait: Duration,
    /// Whether puts ask the master to place the first replica in this client's own segment (Mooncake's
    /// `preferred_segments`); the master falls back to the other segments when this one is full. A page then
    /// this host writes and reads back stays on the host (Mooncake copies within its own segment), and crosses the
    /// network only to other hosts.
    pub prefer_local_segment: bool,
    /// Whether a read hashes each page against its checksum object (native keys). Off, a page is still taken only
    /// when all its objects, the checksum's too, are there; its bytes are trusted as they arrive.
    pub verify_checksum: bool,
}

impl MooncakeConfig {
    /// SGLang's defaults for a master at `master`: no metadata server (`P2PHANDSHAKE`), host `localhost`, TCP,
    /// a 4 GiB segment and a 16 MiB buffer, one replica, native keys; puts prefer this client's own segment.
    pub fn new(master: impl Into<String>) -> Self {
        Self {
            master: master.into(),
            metadata_server: "P2PHANDSHAKE".into(),
            local_hostname: "localhost".into(),
            protocol: "tcp".into(),
            device: String::new(),
            global_segment_size: DEFAULT_GLOBAL_SEGMENT_SIZE,
            local_buffer_size: DEFAULT_LOCAL_BUFFER_SIZE,
            replicas: 1,
            scheme: KeyScheme::Native,
            library: None,
            connect_timeout: Duration::from_secs(10),
            lease_wait: Duration::from_secs(11),
            prefer_local_segment: true,
            verify_checksum: true,
        }
    }

    /// From SGLang's environment variables: `MOONCAKE_MASTER` (required), `MOONCAKE_TE_META_DATA_SERVER`,
    /// `LOCAL_HOSTNAME`, `MOONCAKE_PROTOCOL`, `MOONCAKE_DEVICE`, `MOONCAKE_GLOBAL_SEGMENT_SIZE`,
    /// `MOONCAKE_LOCAL_BUFFER_SIZE`; or, when `MOONCAKE_CONFIG_PATH` names a JSON file, from that file
    /// ([`from_json`](Self::from_json)).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the variable (or the file and its field).
    pub fn from_env() -> Result<Self, Error> {
        Self::from_vars(|name| std::env::var(name).ok().filter(|value| !value.is_empty()))
    }

    /// [`from_env`](Self::from_env) over any source of variables.
    ///
    /// # Errors
    ///
    /// As [`from_env`](Self::from_env).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        if let Some(path) = var("MOONCAKE_CONFIG_PATH") {
            let text = std::fs::read_to_string(&path).map_err(|error| Error::InvalidConfig {
                field: "MOONCAKE_CONFIG_PATH".into(),
                reason: format!("reading {path}: {error}"),
            })?;
            let value: serde_json::Value = serde_json::from_str(&text).map_err(|error| Error::InvalidConfig {
                field: "MOONCAKE_CONFIG_PATH".into(),
                reason: format!("{path} is not JSON: {error}"),
            })?;
            return Self::from_json(&value).map_err(|error| match error {
                Error::InvalidConfig { field, reason } => {
                    Error::InvalidConfig { field: format!("{path}: {field}"), reason }
                }
                other => other,
            });
        }
        let master = var("MOONCAKE_MASTER").ok_or_else(|| Error::InvalidConfig {
            field: "MOONCAKE_MASTER".into(),
            reason: "the Mooncake master's host:port is required (or MOONCAKE_CONFIG_PATH, or \
                     master_server_address in the extra config)"
                .into(),
        })?;
        let mut config = Self::new(master);
        let size = |name: &str, default: u64| -> Result<u64, Error> {
            var(name).map_or(Ok(default), |text| {
                parse_size(&text).map_err(|reason| Error::InvalidConfig { field: name.into(), reason })
            })
        };
        config.global_segment_size = size("MOONCAKE_GLOBAL_SEGMENT_SIZE", config.global_segment_size)?;
        config.local_buffer_size = size("MOONCAKE_LOCAL_BUFFER_SIZE", config.local_buffer_size)?;
        if let Some(server) = var("MOONCAKE_TE_META_DATA_SERVER") {
            config.metadata_server = server;
        }
        if let Some(host) = var("LOCAL_HOSTNAME") {
            config.local_hostname = host;
        }
        if let Some(protocol) = var("MOONCAKE_PROTOCOL") {
            config.protocol = protocol;
        }
        if let Some(device) = var("MOONCAKE_DEVICE") {
            config.device = if device == "auto" { String::new() } else { device };
        }
        config.validated().map_err(|error| rename_field(error, "MOONCAKE_PROTOCOL"))
    }

    /// From SGLang's extra config as its Mooncake backend reads it: [`from_json`](Self::from_json), with the master
    /// from `MOONCAKE_MASTER` when the object names none.
    ///
    /// # Errors
    ///
    /// As [`from_json`](Self::from_json).
    pub fn from_extra_config(value: &serde_json::Value) -> Result<Self, Error> {
        let mut value = value.clone();
        if let Some(fields) = value.as_object_mut()
            && !fields.contains_key("master_server_address")
            && let Ok(master) = std::env::var("MOONCAKE_MASTER")
        {
            fields.insert("master_server_address".into(), master.into());
        }
        Self::from_json(&value)
    }

    /// From a JSON object with SGLang's names (`master_server_address` required; `local_hostname`,
    /// `metadata_server`, `global_segment_size`, `local_buffer_size`, `protocol`, `device_name`; sizes as bytes or
    /// text such as `"4gb"`) and hicache's (`replica_num`, `key_scheme`: `native` or `sglang`, `sglang_release`:
    /// `0.5.2` or `0.5.23` (default), `extra_backend_tag`, `library`, `connect_timeout_ms`, `lease_wait_ms`,
    /// `prefer_local_segment` and `verify_checksum`: `true` (default) or `false`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the field, including unknown ones.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, Error> {
        let fields: JsonConfig = hicache_core::config::from_named_fields(value, "mooncake")?;
        let invalid = |field: &str, reason: String| Error::InvalidConfig { field: field.into(), reason };
        let master = fields
            .master_server_address
            .ok_or_else(|| invalid("master_server_address", "the Mooncake master's host:port is required".into()))?;
        let mut config = Self::new(master);
        if let Some(size) = fields.global_segment_size {
            config.global_segment_size = size.bytes().map_err(|reason| invalid("global_segment_size", reason))?;
        }
        if let Some(size) = fields.local_buffer_size {
            config.local_buffer_size = size.bytes().map_err(|reason| invalid("local_buffer_size", reason))?;
        }
        config.metadata_server = fields.metadata_server.unwrap_or(config.metadata_server);
        config.local_hostname = fields.local_hostname.unwrap_or(config.local_hostname);
        config.protocol = fields.protocol.unwrap_or(config.protocol);
        config.device =
            fields.device_name.map(|device| if device == "auto" { String::new() } else { device }).unwrap_or_default();
        config.replicas = fields.replica_num.unwrap_or(config.replicas);
        config.library = fields.library;
        if let Some(ms) = fields.connect_timeout_ms {
            config.connect_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = fields.lease_wait_ms {
            config.lease_wait = Duration::from_millis(ms);
        }
        config.prefer_local_segment = fields.prefer_local_segment.unwrap_or(config.prefer_local_segment);
        config.verify_checksum = fields.verify_checksum.unwrap_or(config.verify_checksum);
        config.scheme = key_scheme(fields.key_scheme, fields.sglang_release, fields.extra_backend_tag)?;
        config.validated()
    }

    /// From the settings the table of tiers gives ([`crate::MOONCAKE_TIER`]): [`from_extra_config`](Self::from_extra_config),
    /// or, when they name nothing but the key scheme (`key_scheme`, `sglang_release`, `extra_backend_tag`),
    /// [`from_env`](Self::from_env) with that scheme, as SGLang takes its variables when the extra config has no
    /// Mooncake keys.
    ///
    /// # Errors
    ///
    /// As [`from_json`](Self::from_json) and [`from_env`](Self::from_env).
    pub fn from_fields(fields: &serde_json::Map<String, serde_json::Value>) -> Result<Self, Error> {
        if fields.keys().any(|key| !SCHEME_KEYS.contains(&key.as_str())) {
            return Self::from_extra_config(&serde_json::Value::Object(fields.clone()));
        }
        let text = |key: &str| -> Result<Option<String>, Error> {
            match fields.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(text)) => Ok(Some(text.clone())),
                Some(other) => Err(Error::InvalidConfig {
                    field: key.into(),
                    reason: format!("invalid type: {other}, expected a string"),
                }),
            }
        };
        let mut config = Self::from_env()?;
        match (text("key_scheme")?, &mut config.scheme) {
            // no scheme named: the environment's sglang scheme takes the release and tag given
            (None, KeyScheme::Sglang { release, tag }) => {
                if let Some(text) = text("sglang_release")? {
                    *release = SglangRelease::parse(&text).map_err(|error| Error::InvalidConfig {
                        field: "sglang_release".into(),
                        reason: error.to_string(),
                    })?;
                }
                if let Some(text) = text("extra_backend_tag")? {
                    *tag = Some(text);
                }
            }
            (scheme, _) => {
                config.scheme = key_scheme(scheme, text("sglang_release")?, text("extra_backend_tag")?)?;
            }
        }
        Ok(config)
    }

    /// Checks the fields.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the field.
    pub fn validated(self) -> Result<Self, Error> {
        let invalid = |field: &str, reason: String| Err(Error::InvalidConfig { field: field.into(), reason });
        if !matches!(self.protocol.as_str(), "tcp" | "rdma") {
            return invalid("protocol", format!("{:?}; expected tcp or rdma", self.protocol));
        }
        if self.master.rsplit_once(':').is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err()) {
            return invalid("master_server_address", format!("{:?} is not host:port", self.master));
        }
        if self.replicas == 0 {
            return invalid("replica_num", "must be at least 1".into());
        }
        if self.local_buffer_size == 0 {
            return invalid("local_buffer_size", "must be above 0".into());
        }
        if self.global_segment_size != 0 && self.global_segment_size < MIN_SEGMENT_SIZE {
            return invalid(
                "global_segment_size",
                format!(
                    "{} bytes: a segment is 0 (lend nothing) or at least {MIN_SEGMENT_SIZE} bytes (16 MiB, Mooncake's \
                     least)",
                    self.global_segment_size
                ),
            );
        }
        if let Some(memory) = physical_memory() {
            for (field, bytes) in
                [("global_segment_size", self.global_segment_size), ("local_buffer_size", self.local_buffer_size)]
            {
                if bytes > memory {
                    return invalid(
                        field,
                        format!("{bytes} bytes is more than this machine's memory ({memory} bytes)"),
                    );
                }
            }
        }
        if self.connect_timeout.is_zero() || self.connect_timeout > MAX_WAIT {
            let ms = self.connect_timeout.as_millis();
            return invalid("connect_timeout_ms", format!("{ms} must be in [1, {}] (a day)", MAX_WAIT.as_millis()));
        }
        if self.lease_wait > MAX_WAIT {
            let ms = self.lease_wait.as_millis();
            return invalid("lease_wait_ms", format!("{ms} must be in [0, {}] (a day)", MAX_WAIT.as_millis()));
        }
        Ok(self)
    }
}

/// Mooncake's smallest segment (its allocator refuses less).
const MIN_SEGMENT_SIZE: u64 = 16 << 20;

/// The longest wait a field may name.
const MAX_WAIT: Duration = Duration::from_secs(86_400);

/// This machine's physical memory in bytes, when the system says.
fn physical_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The keys of the key scheme, which come with the extra config or beside the environment's settings.
const SCHEME_KEYS: [&str; 3] = ["key_scheme", "sglang_release", "extra_backend_tag"];

/// The key scheme of `key_scheme` (`native`, the default, or `sglang`), with its release and tag.
fn key_scheme(scheme: Option<String>, release: Option<String>, tag: Option<String>) -> Result<KeyScheme, Error> {
    let invalid = |field: &str, reason: String| Error::InvalidConfig { field: field.into(), reason };
    match scheme.as_deref() {
        None | Some("native") => {
            if release.is_some() || tag.is_some() {
                return Err(invalid(
                    "key_scheme",
                    "sglang_release and extra_backend_tag apply to the sglang key scheme only".into(),
                ));
            }
            Ok(KeyScheme::Native)
        }
        Some("sglang") => Ok(KeyScheme::Sglang {
            release: match release.as_deref() {
                None => SglangRelease::V0_5_23,
                Some(text) => {
                    SglangRelease::parse(text).map_err(|error| invalid("sglang_release", error.to_string()))?
                }
            },
            tag,
        }),
        Some(other) => Err(invalid("key_scheme", format!("{other:?}; expected native or sglang"))),
    }
}

fn rename_field(error: Error, protocol_var: &str) -> Error {
    match error {
        Error::InvalidConfig { field, reason } => {
            let field = match field.as_str() {
                "protocol" => protocol_var.to_owned(),
                "master_server_address" => "MOONCAKE_MASTER".to_owned(),
                "global_segment_size" => "MOONCAKE_GLOBAL_SEGMENT_SIZE".to_owned(),
                "local_buffer_size" => "MOONCAKE_LOCAL_BUFFER_SIZE".to_owned(),
                _ => field,
            };
            Error::InvalidConfig { field, reason }
        }
        other => other,
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonConfig {
    master_server_address: Option<String>,
    local_hostname: Option<String>,
    metadata_server: Option<String>,
    global_segment_size: Option<Size>,
    local_buffer_size: Option<Size>,
    protocol: Option<String>,
    device_name: Option<String>,
    replica_num: Option<usize>,
    key_scheme: Option<String>,
    sglang_release: Option<String>,
    extra_backend_tag: Option<String>,
    library: Option<PathBuf>,
    connect_timeout_ms: Option<u64>,
    lease_wait_ms: Option<u64>,
    prefer_local_segment: Option<bool>,
    verify_checksum: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Text(String),
}

impl Size {
    fn bytes(self) -> Result<u64, String> {
        match self {
            Self::Bytes(bytes) => Ok(bytes),
            Self::Text(text) => parse_size(&text),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn from_sglang_variables() {
        let vars: HashMap<&str, &str> = [
            ("MOONCAKE_MASTER", "10.0.0.1:50051"),
            ("MOONCAKE_PROTOCOL", "rdma"),
            ("MOONCAKE_DEVICE", "mlx5_0"),
            ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "8gb"),
            ("LOCAL_HOSTNAME", "10.0.0.2"),
        ]
        .into();
        let config = MooncakeConfig::from_vars(|name| vars.get(name).map(|value| (*value).to_owned())).unwrap();
        assert_eq!(config.master, "10.0.0.1:50051");
        assert_eq!((config.protocol.as_str(), config.device.as_str()), ("rdma", "mlx5_0"));
        assert_eq!(config.global_segment_size, 8 << 30);
        assert_eq!(config.local_buffer_size, DEFAULT_LOCAL_BUFFER_SIZE);
        assert_eq!(config.local_hostname, "10.0.0.2");
        let missing = MooncakeConfig::from_vars(|_| None).unwrap_err();
        assert!(missing.to_string().contains("MOONCAKE_MASTER"), "{missing}");
        let bad = MooncakeConfig::from_vars(|name| match name {
            "MOONCAKE_MASTER" => Some("h:1".into()),
            "MOONCAKE_PROTOCOL" => Some("udp".into()),
            _ => None,
        })
        .unwrap_err();
        assert!(bad.to_string().contains("MOONCAKE_PROTOCOL"), "{bad}");
    }

    #[test]
    fn from_extra_config() {
        let value = serde_json::json!({
            "master_server_address": "127.0.0.1:50051",
            "global_segment_size": "1gb",
            "device_name": "auto",
            "key_scheme": "sglang",
            "extra_backend_tag": "blue",
        });
        let config = MooncakeConfig::from_json(&value).unwrap();
        assert_eq!(config.global_segment_size, 1 << 30);
        assert_eq!(config.device, "");
        assert_eq!(config.scheme, KeyScheme::Sglang { release: SglangRelease::V0_5_23, tag: Some("blue".into()) });
        assert!(config.prefer_local_segment, "the default");
        let zero = serde_json::json!({"master_server_address": "h:1", "global_segment_size": 0, "lease_wait_ms": 0});
        assert_eq!(MooncakeConfig::from_json(&zero).unwrap().global_segment_size, 0, "lending nothing is allowed");
        let value = serde_json::json!({"master_server_address": "h:1", "prefer_local_segment": false});
        assert!(!MooncakeConfig::from_json(&value).unwrap().prefer_local_segment);
        assert!(config.verify_checksum, "the default");
        let value = serde_json::json!({"master_server_address": "h:1", "verify_checksum": false});
        assert!(!MooncakeConfig::from_json(&value).unwrap().verify_checksum);
        for (bad, field) in [
            (
                serde_json::json!({"master_server_address": "h:1", "prefer_local_segment": "yes"}),
                "prefer_local_segment",
            ),
            (serde_json::json!({"master_server_address": "h:1", "verify_checksum": 1}), "verify_checksum"),
            (serde_json::json!({"master_server_address": "h:1", "replicas": 2}), "replicas"),
            (serde_json::json!({"global_segment_size": 1}), "master_server_address"),
            (serde_json::json!({"master_server_address": "nohost"}), "master_server_address"),
            (
                serde_json::json!({"master_server_address": "h:1", "key_scheme": "sglang", "sglang_release": "0.4"}),
                "0.4",
            ),
            (serde_json::json!({"master_server_address": "h:1", "sglang_release": "0.5.2"}), "key_scheme"),
            (serde_json::json!({"master_server_address": "h:1", "local_buffer_size": "lots"}), "local_buffer_size"),
            // Mooncake's allocator refuses a segment under 16 MiB; more than the machine has cannot be lent
            (serde_json::json!({"master_server_address": "h:1", "global_segment_size": "8mb"}), "at least 16777216"),
            (serde_json::json!({"master_server_address": "h:1", "global_segment_size": "1000000tb"}), "memory"),
            (serde_json::json!({"master_server_address": "h:1", "local_buffer_size": "900tb"}), "local_buffer_size"),
            (serde_json::json!({"master_server_address": "h:1", "connect_timeout_ms": 0}), "connect_timeout_ms"),
            (serde_json::json!({"master_server_address": "h:1", "lease_wait_ms": 1e12 as u64}), "lease_wait_ms"),
        ] {
            let error = MooncakeConfig::from_json(&bad).unwrap_err().to_string();
            assert!(error.contains(field), "{bad}: {error}");
        }
    }

    #[test]
    fn from_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mooncake.json");
        std::fs::write(&path, r#"{"master_server_address": "127.0.0.1:7", "protocol": "tcp"}"#).unwrap();
        let path_text = path.to_str().unwrap().to_owned();
        let config =
            MooncakeConfig::from_vars(|name| (name == "MOONCAKE_CONFIG_PATH").then(|| path_text.clone())).unwrap();
        assert_eq!(config.master, "127.0.0.1:7");
        std::fs::write(&path, r#"{"master_server_address": "127.0.0.1:7", "protocl": "tcp"}"#).unwrap();
        let error = MooncakeConfig::from_vars(|name| (name == "MOONCAKE_CONFIG_PATH").then(|| path_text.clone()))
            .unwrap_err()
            .to_string();
        assert!(error.contains("protocl") && error.contains("mooncake.json"), "{error}");
    }
}
