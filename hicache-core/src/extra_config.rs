//! The storage tier's settings, read from SGLang's extra config (`--hicache-storage-backend-extra-config`, a JSON
//! object, or a config's `storage_backend_extra_config`): which hicache tier, where it keeps its pages, and optionally
//! what the host pool must look like. The Python package opens its tier by them; [`HiCacheConfig`]'s validation
//! reads them the same way, so `hicache config check` refuses what the package would.
//!
//! [`HiCacheConfig`]: crate::config::HiCacheConfig
//!
//! Keys (every one optional):
//! - `backend`: the tier, by its name in the table of tiers this build links ([`tiers`]): `file` (the default),
//!   `memory` (this process only; for tests and measurements), `mooncake`, `3fs`, `nixl`;
//! - the tier's own keys, read by the tier's crate (the file tier's `dir`, `format`, `capacity`, ...; Mooncake's
//!   `master_server_address`, `protocol`, ...): see each crate;
//! - `throttle_read_gbps`: for measurements, every storage get takes at least its bytes' time at this rate (GB/s,
//!   10^9 bytes): a slow tier on a fast machine, any tier;
//! - `pool`: what the host pool SGLang registers must be (`page_size`, `layout`, `dtype`, `layer_num`, `head_num`,
//!   `head_dim`, `kv_lora_rank`, `qk_rope_head_dim`), checked at registration;
//! - `key_scheme: "unified"` (SGLang's `--hicache-storage-key-scheme unified`), with the fleet's agreements
//!   `head_group` and `layer_partition`: pages stored as the chunks of SGLang's unified key scheme, which any TP or PP
//!   topology reads ([`crate::storage::UnifiedStorage`]; the host pool must be `page_unified`). Any other
//!   `key_scheme` is the tier's own (Mooncake's `native` or `sglang`).
//!
//! SGLang's own keys for a dynamic backend (`backend_name`, `module_path`, `class_name`, `interface_v1`) and the ones
//! it consumes itself are accepted and ignored; any other key is refused by name.

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::namespace::StorageNamespace;
use crate::storage::l3_layout::L3Layout;
use crate::storage::tiers::{self, TierEntry, TierFields};
use crate::storage::{FaultPlan, FaultyStorage, StorageBackend, UnifiedStorage};
pub use crate::unified_keys::UnifiedAgreements;
use crate::unified_keys::UnifiedRank;

/// A bad extra config, naming the key (the tiers' settings share it).
pub use crate::storage::tiers::ConfigError;

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

/// A config's extra config for `tier` (its `storage_backend`): its fields, with `backend` set to the tier's name, as
/// [`Settings::parse`] takes them.
///
/// # Errors
///
/// [`ConfigError`] naming `backend` when the extra config names another tier.
pub fn tier_fields(tier: &TierEntry, extra: Option<&Value>) -> Result<Value, ConfigError> {
    let mut fields = match extra {
        Some(Value::Object(fields)) => fields.clone(),
        _ => Map::new(),
    };
    if fields.get("backend").is_some_and(|backend| !backend.as_str().is_some_and(|name| tier.is_named(name))) {
        return Err(ConfigError::value("backend", format!("differs from storage_backend ({})", tier.name)));
    }
    fields.insert("backend".into(), tier.name.into());
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

/// The tier an extra config names when it names none.
pub const DEFAULT_TIER: &str = "file";

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

/// The keys of an extra config that are not the tier's own: its name, the host pool it expects, the throttle.
#[derive(Debug, Default)]
pub struct Shared {
    /// `backend`: the tier's name, if given.
    pub backend: Option<String>,
    /// What the host pool must be.
    pub pool: PoolExpectation,
    /// Storage gets held to this many bytes per second (measurements); `None`: not held.
    pub throttle_read_bytes_per_s: Option<u64>,
    /// `key_scheme: "unified"`: the fleet's agreements on the chunks.
    pub unified: Option<UnifiedAgreements>,
}

/// Takes the keys every tier shares out of an extra config's `fields` (SGLang's own keys are dropped), leaving the
/// tier's own.
///
/// # Errors
///
/// [`ConfigError`] naming the shared key that is of the wrong type or out of its domain.
pub fn take_shared(fields: &mut Map<String, Value>) -> Result<Shared, ConfigError> {
    for key in SGLANG_KEYS {
        fields.remove(key);
    }
    let backend: Option<String> = take(fields, "backend")?;
    let pool = take::<PoolExpectation>(fields, "pool")?.unwrap_or_default();
    let throttle_read_bytes_per_s = match take::<f64>(fields, "throttle_read_gbps")? {
        None => None,
        Some(gbps) if gbps > 0.0 && gbps <= 1e4 => Some((gbps * 1e9) as u64),
        Some(gbps) => {
            return Err(ConfigError::value("throttle_read_gbps", format!("{gbps} is not a rate in (0, 10000] GB/s")));
        }
    };
    let unified_scheme = fields.get("key_scheme").and_then(Value::as_str) == Some("unified");
    if unified_scheme {
        fields.remove("key_scheme");
    }
    let agreements = UnifiedAgreements {
        head_group: take::<u64>(fields, "head_group")?,
        layer_partition: take::<u64>(fields, "layer_partition")?,
    };
    for (key, value) in [("head_group", agreements.head_group), ("layer_partition", agreements.layer_partition)] {
        if value == Some(0) {
            return Err(ConfigError::value(key, "must be at least 1 (or absent: each rank's own)".to_owned()));
        }
        if value.is_some() && !unified_scheme {
            return Err(ConfigError::value(key, "an agreement of key_scheme \"unified\", which is not set".to_owned()));
        }
    }
    let unified = unified_scheme.then_some(agreements);
    Ok(Shared { backend, pool, throttle_read_bytes_per_s, unified })
}

/// `storage` held to `throttle_read_bytes_per_s` when one is given (the extra config's `throttle_read_gbps`).
pub fn throttled(storage: Box<dyn StorageBackend>, throttle_read_bytes_per_s: Option<u64>) -> Box<dyn StorageBackend> {
    match throttle_read_bytes_per_s {
        Some(read_bytes_per_s) => {
            Box::new(FaultyStorage::new(storage, FaultPlan { read_bytes_per_s, ..Default::default() }))
        }
        None => storage,
    }
}

/// Everything the extra config says.
#[derive(Debug)]
pub struct Settings {
    /// The storage tier, from the table of those this build links ([`tiers`]).
    pub tier: &'static TierEntry,
    /// The tier's own keys, read by it (checked by [`Settings::parse`]).
    pub fields: TierFields,
    /// What the host pool must be.
    pub pool: PoolExpectation,
    /// Storage gets held to this many bytes per second (measurements); `None`: not held.
    pub throttle_read_bytes_per_s: Option<u64>,
    /// `key_scheme: "unified"`: pages stored as unified-key chunks, with these agreements.
    pub unified: Option<UnifiedAgreements>,
}

impl Settings {
    /// Reads the extra config (JSON text of an object; `null` for none): the keys every tier shares, then the
    /// named tier's own keys, read by the tier ([`TierEntry::check`]).
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the key: unknown, of the wrong type, or out of its domain; `backend` when it names no
    /// tier of this build.
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
        let Shared { backend, pool, throttle_read_bytes_per_s, unified } = take_shared(&mut fields)?;
        let tier = tiers::lookup("backend", backend.as_deref().unwrap_or(DEFAULT_TIER))?;
        tier.check(&fields)?;
        Ok(Self { tier, fields, pool, throttle_read_bytes_per_s, unified })
    }

    /// Opens the tier for `namespace`, held to the throttle when one is set.
    ///
    /// # Errors
    ///
    /// The tier's failure to open ([`TierEntry::open`]).
    pub fn open(&self, namespace: &StorageNamespace) -> Result<Box<dyn StorageBackend>, crate::Error> {
        Ok(throttled(self.tier.open(&self.fields, namespace)?, self.throttle_read_bytes_per_s))
    }

    /// Opens the tier for the rank of `namespace`, whose pipeline stage holds layers from `stage.0` (the last stage
    /// when `stage.1`): under `key_scheme: "unified"` as [`UnifiedStorage`] over the tier, else as
    /// [`open`](Self::open).
    ///
    /// # Errors
    ///
    /// The unified plan's refusals (naming the agreement or the pool's field at fault); the tier's failure to open.
    pub fn open_rank(
        &self,
        namespace: &StorageNamespace,
        stage: (u64, bool),
    ) -> Result<Box<dyn StorageBackend>, crate::Error> {
        let Some(agreements) = self.unified else { return self.open(namespace) };
        let rank = UnifiedRank::of(namespace, stage, agreements.head_group, agreements.layer_partition);
        let plan = crate::unified_keys::plan(&rank)?;
        Ok(Box::new(UnifiedStorage::open(namespace.clone(), &plan, &|chunk: &StorageNamespace| self.open(chunk))?))
    }

    /// The L3 key layout of the stage of `namespace` (as [`open_rank`](Self::open_rank) takes it), for routers
    /// ([`L3Layout::describe`]); nothing is opened.
    ///
    /// # Errors
    ///
    /// As [`L3Layout::describe`].
    pub fn l3_layout(&self, namespace: &StorageNamespace, stage: (u64, bool)) -> Result<L3Layout, crate::Error> {
        L3Layout::describe(self.tier, &self.fields, namespace, self.unified.map(|agreements| (agreements, stage)))
    }

    /// [`l3_layout`](Self::l3_layout) with a hybrid model's sidecar pools (name, entry size, hit policy) after the
    /// KV ([`L3Layout::add_sidecar`]).
    ///
    /// # Errors
    ///
    /// As [`L3Layout::describe`] and [`L3Layout::add_sidecar`].
    pub fn l3_layout_with_sidecars(
        &self,
        namespace: &StorageNamespace,
        stage: (u64, bool),
        sidecars: &[(crate::namespace::Sidecar, crate::storage::groups::HitPolicy)],
    ) -> Result<L3Layout, crate::Error> {
        let mut layout = self.l3_layout(namespace, stage)?;
        for (sidecar, policy) in sidecars {
            layout.add_sidecar(self.tier, &self.fields, namespace, sidecar, *policy)?;
        }
        Ok(layout)
    }
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
    fn the_shared_keys_are_read_and_the_rest_go_to_the_tier() {
        let settings = Settings::parse(
            r#"{"backend_name": "hicache", "module_path": "hicache.sglang", "class_name": "HiCacheStorage",
                "interface_v1": 1, "backend": "probe", "label": "a", "pool": {"page_size": 64, "layout": "page_first"}}"#,
        )
        .unwrap();
        assert_eq!(settings.tier.name, "probe");
        assert_eq!(Value::Object(settings.fields), serde_json::json!({"label": "a"}));
        assert_eq!((settings.pool.page_size, settings.pool.layout.as_deref()), (Some(64), Some("page_first")));
        assert!(Settings::parse(r#"{"backend": "memory"}"#).unwrap().fields.is_empty());
    }

    #[test]
    fn any_tier_can_be_throttled_for_measurements() {
        for backend in ["memory", "probe"] {
            let json = format!(r#"{{"backend": "{backend}", "throttle_read_gbps": 2.5}}"#);
            assert_eq!(Settings::parse(&json).unwrap().throttle_read_bytes_per_s, Some(2_500_000_000), "{backend}");
        }
        assert_eq!(Settings::parse(r#"{"backend": "memory"}"#).unwrap().throttle_read_bytes_per_s, None);
        for bad in ["0", "-1", "1e5"] {
            let text = error(&format!(r#"{{"backend": "memory", "throttle_read_gbps": {bad}}}"#));
            assert!(text.starts_with("hicache extra_config key `throttle_read_gbps`"), "{bad}: {text}");
        }
        assert!(error(r#"{"throttle_read_gbps": "fast"}"#).contains("throttle_read_gbps"));
    }

    #[test]
    fn errors_name_the_key_and_say_whether_it_is_the_type() {
        let wrong_type = |json: &str| Settings::parse(json).unwrap_err().wrong_type;
        let unknown = error(r#"{"backend": "s3"}"#);
        assert!(unknown.contains("key `backend`: \"s3\" is not a hicache storage tier of this build ("), "{unknown}");
        assert!(unknown.contains("memory") && unknown.contains("probe"), "{unknown}");
        assert!(error(r#"{"backend": "memory", "dir": "/d"}"#).contains("key `dir`: unknown key for the memory tier"));
        assert!(error(r#"{"backend": "memory", "": 6}"#).contains(r#"key `""`: unknown key"#));
        assert!(error(r#"{"backend": "probe", "label": 1}"#).contains("key `label`: invalid type"));
        assert!(error(r#"{"pool": {"head_num": "8"}}"#).contains("key `pool.head_num`"));
        let pool = error(r#"{"pool": {"heads": 8}}"#);
        assert!(pool.contains("key `pool.heads`: unknown field `heads`"), "{pool}");
        assert!(error("[1]").contains("key `extra_config`: must be an object"));
        assert!(error("{").contains("key `extra_config`: not JSON"));
        assert!(wrong_type(r#"{"backend": "probe", "label": 1}"#) && wrong_type("[1]"));
        assert!(!wrong_type(r#"{"backend": "s3"}"#) && !wrong_type(r#"{"backend": "memory", "x": 1}"#));
    }

    #[test]
    fn the_named_tier_is_opened_for_the_namespace() {
        let namespace = crate::testing::conformance::mha_namespace(1, 2);
        for (json, name) in [(r#"{"backend": "memory"}"#, "memory"), (r#"{"backend": "probe", "label": "x"}"#, "probe")]
        {
            let storage = Settings::parse(json).unwrap().open(&namespace).unwrap();
            assert_eq!((storage.name(), storage.namespace()), (name, Some(&namespace)), "{json}");
        }
    }

    #[test]
    fn the_unified_key_scheme_and_its_agreements_are_shared_keys() {
        let unified =
            Settings::parse(r#"{"backend": "memory", "key_scheme": "unified", "head_group": 2, "layer_partition": 8}"#)
                .unwrap();
        assert_eq!(unified.unified, Some(UnifiedAgreements { head_group: Some(2), layer_partition: Some(8) }));
        assert!(unified.fields.is_empty(), "{:?}", unified.fields);
        let bare = Settings::parse(r#"{"backend": "memory", "key_scheme": "unified"}"#).unwrap();
        assert_eq!(bare.unified, Some(UnifiedAgreements::default()));
        assert_eq!(Settings::parse(r#"{"backend": "memory"}"#).unwrap().unified, None);
        // another scheme is the tier's own key (Mooncake's), refused here by a tier that has none
        assert!(error(r#"{"backend": "memory", "key_scheme": "sglang"}"#).contains("key `key_scheme`: unknown key"));
        let orphan = error(r#"{"backend": "memory", "head_group": 2}"#);
        assert!(orphan.contains("key `head_group`") && orphan.contains("key_scheme"), "{orphan}");
        assert!(error(r#"{"key_scheme": "unified", "layer_partition": 0}"#).contains("key `layer_partition`"));
        assert!(error(r#"{"key_scheme": "unified", "head_group": "2"}"#).contains("key `head_group`: invalid type"));
    }

    #[test]
    fn a_rank_under_the_unified_scheme_stores_its_pages_as_chunks() {
        use crate::geometry::{KvDtype, KvGeometry};
        use crate::layout::HostLayout;
        let namespace = StorageNamespace {
            tp_rank: 1,
            tp_size: 2,
            head_groups: 2,
            ..StorageNamespace::single_rank(
                "m",
                KvGeometry::mha(2, 2, 8, KvDtype::Bf16).unwrap(),
                HostLayout::PageUnified,
                4,
            )
        };
        let key = crate::hash::PageKey::from_bytes([7; 32]);
        let page: Vec<u8> = (0..2 * 2 * 2 * 4 * 8 * 2).map(|byte| byte as u8).collect();
        let json = r#"{"backend": "memory", "key_scheme": "unified", "head_group": 1}"#;
        let storage = Settings::parse(json).unwrap().open_rank(&namespace, (0, true)).unwrap();
        assert_eq!(storage.namespace(), Some(&namespace));
        assert!(storage.set(&key, vec![&page[..]]).unwrap().is_stored());
        let mut back = vec![0u8; page.len()];
        assert_eq!(storage.get(&key, vec![&mut back[..]]).unwrap(), crate::storage::GetOutcome::Hit);
        assert_eq!(back, page);
        // rank 1 of 2 owns head groups 2 and 3 of the model's four; its page is two chunks
        assert_eq!(storage.stats().set_stored, 1);
        // a pool that is not page_unified is refused by name; without the scheme the tier opens as it is
        let first = StorageNamespace { layout: HostLayout::PageFirst, head_groups: 1, ..namespace.clone() };
        let Err(error) = Settings::parse(json).unwrap().open_rank(&first, (0, true)) else { panic!("opened") };
        let error = error.to_string();
        assert!(error.contains("mem_layout"), "{error}");
        let plain = Settings::parse(r#"{"backend": "memory"}"#).unwrap().open_rank(&first, (0, true)).unwrap();
        assert_eq!(plain.namespace(), Some(&first));
    }
}
