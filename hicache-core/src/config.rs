//! Configuration: every knob, with SGLang's names where SGLang has them, and the constants it hard-codes made
//! configurable (docs/sglang.md#constants, #config).
//!
//! Read with [`HiCacheConfig::from_json`]: unknown fields are refused, every error names the field, and the
//! storage backend's extra config must be valid JSON (SGLang logs a parse error and carries on without it).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::Error;
pub use crate::extra_config::parse_size;
use crate::geometry::{Attention, KvGeometry};
use crate::layout::HostLayout;

/// When device pages are written to the host (and on to storage).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WritePolicy {
    /// Back up every inserted node at once (SGLang's server default).
    #[default]
    WriteThrough,
    /// Back up a node on its second hit.
    WriteThroughSelective,
    /// Back up only when the device copy is evicted (and then on to storage too, unlike SGLang 0.5.2).
    WriteBack,
}

/// How host↔device copies are issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoBackend {
    /// Gather/scatter kernels (SGLang's default).
    #[default]
    Kernel,
    /// One `cuMemcpyAsync` per contiguous run.
    Direct,
    /// `cuMemcpyBatchAsync` where the driver has it.
    Batch,
    /// Chosen per transfer from its run lengths.
    Auto,
}

/// The longest duration a config field may give (a day): longer ones are mistakes, and would overflow a
/// `Duration` where they are used.
pub const MAX_SECONDS: f64 = 86_400.0;

/// The largest prefill rate a config may give (tokens per second).
pub const MAX_TOKENS_PER_S: f64 = 1e9;

/// The largest transfer rate a config may give (GB/s).
pub const MAX_GBPS: f64 = 1e4;

/// When a prefetch from storage stops and the request runs with what arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefetchPolicy {
    /// At the first scheduling of the request.
    #[default]
    BestEffort,
    /// Only when every hit page has arrived.
    WaitComplete,
    /// When complete or when the timeout passes.
    Timeout,
}

macro_rules! display_as_serde_name {
    ($($kind:ty),*) => {$(
        impl fmt::Display for $kind {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match serde_json::to_value(self) {
                    Ok(serde_json::Value::String(name)) => f.write_str(&name),
                    _ => write!(f, "{self:?}"),
                }
            }
        }
    )*};
}
display_as_serde_name!(WritePolicy, IoBackend, PrefetchPolicy);

/// Every knob of hicache. Defaults are SGLang 0.5.2's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HiCacheConfig {
    /// Tokens per page (`--page-size`).
    pub page_size: usize,
    /// Host pool tokens = device pool tokens × ratio (`--hicache-ratio`); must exceed 1.
    pub hicache_ratio: f64,
    /// Host pool size in GB of 10^9 bytes; overrides the ratio when above 0 (`--hicache-size`).
    pub hicache_size: u64,
    /// Write policy (`--hicache-write-policy`).
    pub write_policy: WritePolicy,
    /// Host↔device copy method (`--hicache-io-backend`).
    pub io_backend: IoBackend,
    /// Host pool layout (`--hicache-mem-layout`).
    pub mem_layout: HostLayout,
    /// KV heads per head group of the `page_unified` layout: each page is cut into this rank's KV heads / this many
    /// groups, each with its own layer runs (the `head_group` of SGLang's unified key scheme, a fleet-wide
    /// agreement). Unset: one group of all the rank's heads.
    pub head_group: Option<usize>,
    /// Storage tier, if any (`--hicache-storage-backend`): a name (or alias) in the table of tiers this build links
    /// ([`crate::storage::tiers`]): `file`, `mooncake`, `hf3fs` (or `3fs`), `nixl`, `memory`.
    pub storage_backend: Option<String>,
    /// Prefetch stop policy (`--hicache-storage-prefetch-policy`).
    pub prefetch_policy: PrefetchPolicy,
    /// Backend-specific settings (`--hicache-storage-backend-extra-config`): a JSON object, or a string holding one.
    pub storage_backend_extra_config: Option<serde_json::Value>,
    /// Served model name, used in storage keys.
    pub model_name: Option<String>,
    /// Fewest tokens worth prefetching from storage (SGLang: 256; the controller uses max(this, page size)).
    pub prefetch_threshold: usize,
    /// Prefetch timeout for the `timeout` policy: base seconds (SGLang 0.5.2: 3 s, fixed).
    pub prefetch_timeout_base_s: f64,
    /// Prefetch timeout: seconds added per 1024 tokens (SGLang 0.5.2: 0).
    pub prefetch_timeout_per_ki_token_s: f64,
    /// Prefetch timeout: upper bound in seconds.
    pub prefetch_timeout_max_s: f64,
    /// Seconds a prefetch may go without progress (its storage reads or hit query stuck, as on a hung mount) before
    /// it stops with what arrived, under every policy (SGLang has none: `wait_complete` waits forever).
    pub storage_read_deadline_s: f64,
    /// Pages per storage batch, for hit queries and I/O (SGLang: 128).
    pub storage_batch_pages: usize,
    /// Share of (host − device) tokens that ongoing prefetches may hold (SGLang: 0.8).
    pub prefetch_capacity_fraction: f64,
    /// Fewest host tokens worth loading back to the device (SGLang: 10).
    pub load_back_threshold: usize,
    /// Hits before `write_through_selective` backs a node up (SGLang: 2).
    pub write_through_selective_threshold: u32,
    /// L3 bandwidth cap in bytes per second for backups; 0 for none.
    pub storage_write_bytes_per_s: u64,
    /// The file tier's capacity: bytes of page files one namespace may hold in its directory, across every process
    /// sharing it (least recently used pages go first; SGLang's file backend `max_size`); 0 for none.
    pub storage_capacity_bytes: u64,
    /// Fetch only what is faster to bring than to compute: a storage hit is fetched as far as the expected time to
    /// first token is lowest, by measured rates (the `cost` module); off: every hit is fetched whole, as SGLang does.
    /// The plan needs the engine's compute rate and the tier's read rate: until both are known (reported, or given
    /// by the priors below), hits are fetched whole, or with `prefetch_split` their last quarter beside the compute
    /// of the rest.
    pub prefetch_by_cost: bool,
    /// The engine computes a storage hit's head itself while its tail is fetched, when the cost plan finds that
    /// faster (a *split*: the `cost` module). Only for an engine that does so: it asks
    /// `HiRadixTree::prefetch_head` for the head and inserts its KV before it asks for the prefetch's result. Needs
    /// `prefetch_by_cost`.
    pub prefetch_split: bool,
    /// The engine *meets* the reads (Cake, arXiv 2410.03065): a planned fetch, a split's head included, is read from
    /// its last page backwards while the engine computes from the front, and the engine takes the result as soon as its
    /// compute reaches the pages read (`HiRadixTree::prefetch_meeting`, `HiRadixTree::meet_prefetch`). No request then
    /// waits on storage longer than computing would take, however slow a read turns out. Only for an engine that does
    /// so; needs `prefetch_split`.
    pub prefetch_meet: bool,
    /// The engine's prefill tokens per second (with no prefix) assumed until it reports its own; 0: unknown.
    pub prior_prefill_tokens_per_s: f64,
    /// Storage → host GB/s (10^9 bytes) assumed until reads are measured; 0: unknown (hits are read to measure the
    /// tier until a read is measured: see `prefetch_by_cost`).
    pub prior_storage_read_gbps: f64,
    /// Host → device GB/s assumed until loads are measured.
    pub prior_load_gbps: f64,
}

impl Default for HiCacheConfig {
    fn default() -> Self {
        Self {
            page_size: 1,
            hicache_ratio: 2.0,
            hicache_size: 0,
            write_policy: WritePolicy::WriteThrough,
            io_backend: IoBackend::Kernel,
            mem_layout: HostLayout::LayerFirst,
            head_group: None,
            storage_backend: None,
            prefetch_policy: PrefetchPolicy::BestEffort,
            storage_backend_extra_config: None,
            model_name: None,
            prefetch_threshold: 256,
            prefetch_timeout_base_s: 3.0,
            prefetch_timeout_per_ki_token_s: 0.0,
            prefetch_timeout_max_s: 3.0,
            storage_read_deadline_s: 30.0,
            storage_batch_pages: 128,
            prefetch_capacity_fraction: 0.8,
            load_back_threshold: 10,
            write_through_selective_threshold: 2,
            storage_write_bytes_per_s: 0,
            storage_capacity_bytes: 0,
            prefetch_by_cost: true,
            prefetch_split: false,
            prefetch_meet: false,
            prior_prefill_tokens_per_s: 0.0,
            prior_storage_read_gbps: 0.0,
            prior_load_gbps: 10.0,
        }
    }
}

impl HiCacheConfig {
    /// Reads and validates a config from JSON; absent fields take their defaults.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the field: syntax errors, unknown fields, wrong types, values out of range.
    pub fn from_json(text: &str) -> Result<Self, Error> {
        // serde would also read a struct from a JSON array, by position; a config names its fields
        if !text.trim_start().starts_with('{') {
            return Err(Error::InvalidConfig {
                field: "(document)".into(),
                reason: "a config is a JSON object of named fields".into(),
            });
        }
        let mut deserializer = serde_json::Deserializer::from_str(text);
        let config: Self = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
            let path = error.path().to_string();
            let inner = error.into_inner();
            let field = if path == "." { "(document)".to_owned() } else { path };
            Error::InvalidConfig { field, reason: inner.to_string() }
        })?;
        deserializer
            .end()
            .map_err(|error| Error::InvalidConfig { field: "(document)".into(), reason: error.to_string() })?;
        config.validated()
    }

    /// Head groups per host page for a pool of `geometry` (this rank's KV): the rank's KV heads / `head_group` under
    /// `page_unified`, else 1.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming `head_group` when it does not divide the rank's KV heads, or is given for MLA
    /// (whose latent has no head axis).
    pub fn head_groups(&self, geometry: &KvGeometry) -> Result<usize, Error> {
        let (Some(head_group), HostLayout::PageUnified) = (self.head_group, self.mem_layout) else {
            return Ok(1);
        };
        let bad = |reason: String| Err(Error::InvalidConfig { field: "head_group".into(), reason });
        match geometry.attention {
            Attention::Mla { .. } => bad(format!("{head_group}, but MLA's latent has no head axis; leave it unset")),
            Attention::Mha { kv_heads, .. } if head_group == 0 || !kv_heads.is_multiple_of(head_group) => {
                bad(format!("{head_group} does not divide this rank's {kv_heads} KV heads"))
            }
            Attention::Mha { kv_heads, .. } => Ok(kv_heads / head_group),
        }
    }

    /// Checks every value's range; parses a string-valued extra config into an object.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the first bad field and what it accepts.
    pub fn validated(mut self) -> Result<Self, Error> {
        let bad = |field: &str, reason: String| Err(Error::InvalidConfig { field: field.to_owned(), reason });
        if self.page_size == 0 {
            return bad("page_size", "must be at least 1".into());
        }
        if self.hicache_size == 0 && !(self.hicache_ratio > 1.0 && self.hicache_ratio.is_finite()) {
            return bad(
                "hicache_ratio",
                format!(
                    "{} must be a finite number above 1 (the host pool must be larger than the device pool)",
                    self.hicache_ratio
                ),
            );
        }
        for (field, value) in [
            ("prefetch_timeout_base_s", self.prefetch_timeout_base_s),
            ("prefetch_timeout_per_ki_token_s", self.prefetch_timeout_per_ki_token_s),
            ("prefetch_timeout_max_s", self.prefetch_timeout_max_s),
        ] {
            if !(0.0..=MAX_SECONDS).contains(&value) {
                return bad(field, format!("{value:?} must be a number of seconds in [0, {MAX_SECONDS}] (a day)"));
            }
        }
        if !(self.storage_read_deadline_s > 0.0 && self.storage_read_deadline_s <= MAX_SECONDS) {
            return bad(
                "storage_read_deadline_s",
                format!("{:?} must be a number of seconds in (0, {MAX_SECONDS}] (a day)", self.storage_read_deadline_s),
            );
        }
        if self.prefetch_timeout_max_s < self.prefetch_timeout_base_s {
            return bad(
                "prefetch_timeout_max_s",
                format!(
                    "{} is below prefetch_timeout_base_s {}",
                    self.prefetch_timeout_max_s, self.prefetch_timeout_base_s
                ),
            );
        }
        if !(0.0..=MAX_TOKENS_PER_S).contains(&self.prior_prefill_tokens_per_s) {
            return bad(
                "prior_prefill_tokens_per_s",
                format!("{:?} must be in [0, {MAX_TOKENS_PER_S}] (0: unknown)", self.prior_prefill_tokens_per_s),
            );
        }
        if !(0.0..=MAX_GBPS).contains(&self.prior_storage_read_gbps) {
            return bad(
                "prior_storage_read_gbps",
                format!("{:?} must be a rate in GB/s in [0, {MAX_GBPS}] (0: unknown)", self.prior_storage_read_gbps),
            );
        }
        if !(self.prior_load_gbps > 0.0 && self.prior_load_gbps <= MAX_GBPS) {
            return bad(
                "prior_load_gbps",
                format!("{:?} must be a rate in GB/s in (0, {MAX_GBPS}]", self.prior_load_gbps),
            );
        }
        if self.prefetch_split && !self.prefetch_by_cost {
            return bad("prefetch_split", "needs prefetch_by_cost: a split is a plan of the cost model".into());
        }
        if self.prefetch_meet && !self.prefetch_split {
            return bad("prefetch_meet", "needs prefetch_split: an engine that meets the reads computes heads".into());
        }
        if self.storage_batch_pages == 0 {
            return bad("storage_batch_pages", "must be at least 1".into());
        }
        if !(self.prefetch_capacity_fraction > 0.0 && self.prefetch_capacity_fraction <= 1.0) {
            return bad("prefetch_capacity_fraction", format!("{} is not in (0, 1]", self.prefetch_capacity_fraction));
        }
        if self.write_through_selective_threshold == 0 {
            return bad("write_through_selective_threshold", "must be at least 1".into());
        }
        if self.head_group == Some(0) {
            return bad(
                "head_group",
                "must be at least 1 KV head (or unset: one group of all the rank's heads)".into(),
            );
        }
        if self.mem_layout == HostLayout::PageFirst && self.io_backend == IoBackend::Direct {
            // SGLang silently falls back to layer_first; say so instead
            return bad(
                "mem_layout",
                "page_first cannot be used with io_backend direct; use layer_first or page_first_direct".into(),
            );
        }
        self.storage_backend_extra_config = match self.storage_backend_extra_config.take() {
            Some(serde_json::Value::String(text)) => {
                let value: serde_json::Value = serde_json::from_str(&text).map_err(|error| Error::InvalidConfig {
                    field: "storage_backend_extra_config".into(),
                    reason: format!("not valid JSON: {error}"),
                })?;
                Some(value)
            }
            other => other,
        };
        if let Some(value) = &self.storage_backend_extra_config
            && !value.is_object()
        {
            return bad("storage_backend_extra_config", format!("must be a JSON object, found {value}"));
        }
        self.check_extra_config()?;
        Ok(self)
    }

    /// The storage tier is one this build links, and its extra config is read as the Python package opens it:
    /// every key known to the tier and of its type.
    fn check_extra_config(&self) -> Result<(), Error> {
        let Some(name) = &self.storage_backend else { return Ok(()) };
        let tier = crate::storage::tiers::lookup("storage_backend", name)
            .map_err(|error| Error::InvalidConfig { field: error.key, reason: error.reason })?;
        let invalid = |error: crate::extra_config::ConfigError| Error::InvalidConfig {
            field: format!("storage_backend_extra_config.{}", error.key),
            reason: error.reason,
        };
        let fields =
            crate::extra_config::tier_fields(tier, self.storage_backend_extra_config.as_ref()).map_err(invalid)?;
        crate::extra_config::Settings::parse(&fields.to_string()).map_err(invalid)?;
        Ok(())
    }

    /// The threshold the controller applies: max(prefetch threshold, page size).
    pub fn effective_prefetch_threshold(&self) -> usize {
        self.prefetch_threshold.max(self.page_size)
    }

    /// Timeout of a prefetch of `tokens` tokens: base + per-1024-token × tokens / 1024, capped at the maximum.
    pub fn prefetch_timeout(&self, tokens: usize) -> std::time::Duration {
        let seconds = self.prefetch_timeout_base_s + self.prefetch_timeout_per_ki_token_s * tokens as f64 / 1024.0;
        std::time::Duration::from_secs_f64(seconds.min(self.prefetch_timeout_max_s))
    }

    /// The host pool size in tokens for a device pool of `device_tokens` tokens and `bytes_per_token` bytes each:
    /// `hicache_size` GB (10^9 bytes) when set, otherwise the ratio; rounded down to whole pages.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when the host pool would not be larger than the device pool.
    pub fn host_pool_tokens(&self, device_tokens: usize, bytes_per_token: usize) -> Result<usize, Error> {
        let tokens = if self.hicache_size > 0 {
            (self.hicache_size as u128 * 1_000_000_000 / bytes_per_token.max(1) as u128) as usize
        } else {
            (device_tokens as f64 * self.hicache_ratio) as usize
        };
        let tokens = tokens - tokens % self.page_size;
        if tokens <= device_tokens {
            let field = if self.hicache_size > 0 { "hicache_size" } else { "hicache_ratio" };
            return Err(Error::InvalidConfig {
                field: field.into(),
                reason: format!(
                    "gives a host pool of {tokens} tokens, not larger than the device pool of {device_tokens}"
                ),
            });
        }
        Ok(tokens)
    }
}

/// Reads a settings object of named fields as `T`; an error names the field at fault (`whole` when the object
/// itself is: not an object, or an unknown field with `deny_unknown_fields`, whose message names it).
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the field and serde's reason.
pub fn from_named_fields<T: serde::de::DeserializeOwned>(value: &serde_json::Value, whole: &str) -> Result<T, Error> {
    let mut track = serde_path_to_error::Track::new();
    let deserializer = serde_path_to_error::Deserializer::new(value, &mut track);
    T::deserialize(deserializer).map_err(|error| {
        let path = track.path().to_string();
        let field = if path == "." || path.is_empty() { whole.to_owned() } else { path };
        Error::InvalidConfig { field, reason: error.to_string() }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn defaults_are_sglang_values() {
        let config = HiCacheConfig::from_json("{}").unwrap();
        assert_eq!(config, HiCacheConfig::default());
        assert_eq!(config.effective_prefetch_threshold(), 256);
        assert_eq!(config.prefetch_timeout(100_000), std::time::Duration::from_secs(3));
        assert_eq!((config.storage_batch_pages, config.load_back_threshold), (128, 10));
    }

    #[test]
    fn sglang_names_and_values_are_read() {
        let config = HiCacheConfig::from_json(
            r#"{"page_size": 64, "write_policy": "write_back", "io_backend": "direct", "mem_layout": "page_first_direct",
                "storage_backend": "probe-alias", "prefetch_policy": "timeout",
                "storage_backend_extra_config": "{\"label\": \"127.0.0.1:50051\"}",
                "prefetch_timeout_base_s": 2, "prefetch_timeout_per_ki_token_s": 0.1, "prefetch_timeout_max_s": 30}"#,
        )
        .unwrap();
        assert_eq!(config.storage_backend.as_deref(), Some("probe-alias"));
        assert_eq!(config.storage_backend_extra_config.as_ref().unwrap()["label"], "127.0.0.1:50051");
        assert_eq!(config.effective_prefetch_threshold(), 256);
        let config = HiCacheConfig {
            prefetch_timeout_base_s: 2.0,
            prefetch_timeout_per_ki_token_s: 0.1,
            prefetch_timeout_max_s: 30.0,
            ..HiCacheConfig::default()
        };
        assert_eq!(config.prefetch_timeout(10_240), std::time::Duration::from_secs(3));
        assert_eq!(config.prefetch_timeout(1 << 30), std::time::Duration::from_secs(30));
    }

    #[test]
    fn errors_name_the_field_and_the_allowed_values() {
        let message = |text: &str| HiCacheConfig::from_json(text).unwrap_err().to_string();
        let policy = message(r#"{"write_policy": "write_sometimes"}"#);
        assert!(policy.starts_with("config field `write_policy`: unknown variant `write_sometimes`"), "{policy}");
        assert!(policy.contains("write_through_selective"), "{policy}");
        assert!(message(r#"{"page_sise": 4}"#).contains("unknown field `page_sise`"));
        assert!(message(r#"{"page_size": 0}"#).starts_with("config field `page_size`"));
        assert!(message(r#"{"page_size": -1}"#).starts_with("config field `page_size`"));
        assert!(message(r#"{"hicache_ratio": 0.5}"#).starts_with("config field `hicache_ratio`"));
        assert!(message(r#"{"prefetch_split": true, "prefetch_by_cost": false}"#).contains("`prefetch_split`: needs"));
        assert!(
            message(r#"{"prefetch_meet": true}"#).starts_with("config field `prefetch_meet`: needs prefetch_split")
        );
        assert!(HiCacheConfig::from_json(r#"{"prefetch_split": true, "prefetch_meet": true}"#).is_ok());
        assert!(
            message(r#"{"storage_backend_extra_config": "{oops"}"#)
                .contains("storage_backend_extra_config`: not valid JSON")
        );
        assert!(message(r#"{"storage_backend_extra_config": [1]}"#).contains("must be a JSON object"));
        // a tier's extra config is read as the Python package reads it: keys named, types checked
        let typed = message(r#"{"storage_backend": "probe", "storage_backend_extra_config": {"label": 1}}"#);
        assert!(typed.starts_with("config field `storage_backend_extra_config.label`: invalid type"), "{typed}");
        let unknown = message(r#"{"storage_backend": "memory", "storage_backend_extra_config": "{\"dir\": \"/d\"}"}"#);
        assert!(unknown.starts_with("config field `storage_backend_extra_config.dir`: unknown key"), "{unknown}");
        let other = message(r#"{"storage_backend": "probe", "storage_backend_extra_config": {"backend": "memory"}}"#);
        assert!(
            other.contains("`storage_backend_extra_config.backend`: differs from storage_backend (probe)"),
            "{other}"
        );
        let tier = message(r#"{"storage_backend": "s3"}"#);
        assert!(tier.starts_with("config field `storage_backend`: \"s3\" is not a hicache storage tier"), "{tier}");
        // what the tier takes passes, under its name or an alias
        for good in [
            r#"{"storage_backend": "probe", "storage_backend_extra_config": {"label": "x", "throttle_read_gbps": 2}}"#,
            r#"{"storage_backend": "probe-alias", "storage_backend_extra_config": {"backend": "probe"}}"#,
            r#"{"storage_backend": "memory", "storage_backend_extra_config": {"backend_name": "hicache"}}"#,
            r#"{"storage_backend_extra_config": {"anything": 1}}"#,
        ] {
            HiCacheConfig::from_json(good).unwrap_or_else(|error| panic!("{good}: {error}"));
        }
        assert!(message(r#"{"prefetch_timeout_max_s": 1}"#).contains("below prefetch_timeout_base_s"));
        // durations are bounded (a day): a huge one would overflow a `Duration` where it is used
        for field in [
            "prefetch_timeout_base_s",
            "prefetch_timeout_per_ki_token_s",
            "prefetch_timeout_max_s",
            "storage_read_deadline_s",
        ] {
            for value in ["1e300", "86401", "-1"] {
                // (the largest valid maximum beside it, so that no other check fires first)
                let max = if field == "prefetch_timeout_max_s" {
                    String::new()
                } else {
                    r#", "prefetch_timeout_max_s": 86400"#.into()
                };
                let text = message(&format!(r#"{{"{field}": {value}{max}}}"#));
                assert!(text.starts_with(&format!("config field `{field}`")), "{field} = {value}: {text}");
            }
        }
        let day = r#"{"prefetch_timeout_base_s": 86400, "prefetch_timeout_per_ki_token_s": 86400,
            "prefetch_timeout_max_s": 86400, "storage_read_deadline_s": 86400}"#;
        let config = HiCacheConfig::from_json(day).unwrap();
        let settings = crate::controller::StorageSettings::from_config(&config, 1 << 20, 1 << 10, false, 0).unwrap();
        assert_eq!(settings.timeout(usize::MAX), Duration::from_secs(86_400), "the longest prefetch is capped");
        assert!(
            message(r#"{"mem_layout": "page_first", "io_backend": "direct"}"#).starts_with("config field `mem_layout`")
        );
        assert!(message("{} {}").contains("(document)"));
        assert!(message("[").contains("(document)"));
    }

    /// Found by the config fuzz target: without serde_json's `float_roundtrip`, a ratio written out and read back
    /// came back one unit in the last place off; and a JSON array was read as a config, field by position.
    #[test]
    fn configs_survive_a_round_trip_and_arrays_are_refused() {
        let config = HiCacheConfig::from_json(
            r#"{"page_size": 555550, "hicache_ratio": 77777777777777777775577777777777555555777}"#,
        )
        .unwrap();
        let again = HiCacheConfig::from_json(&serde_json::to_string(&config).unwrap()).unwrap();
        assert_eq!(again, config);
        let error = HiCacheConfig::from_json("[555550,\n\n\t77777777777777777775577777777777555555777]").unwrap_err();
        assert_eq!(error.to_string(), "config field `(document)`: a config is a JSON object of named fields");
    }

    #[test]
    fn head_groups_divide_the_ranks_heads_under_page_unified_only() {
        let llama = KvGeometry::llama31_8b();
        let config = |text: &str| HiCacheConfig::from_json(text).unwrap();
        assert_eq!(config(r#"{"mem_layout": "page_unified", "head_group": 2}"#).head_groups(&llama).unwrap(), 4);
        assert_eq!(config(r#"{"mem_layout": "page_unified"}"#).head_groups(&llama).unwrap(), 1);
        // other layouts hold whole items: the agreement does not cut their pages
        assert_eq!(config(r#"{"mem_layout": "page_first", "head_group": 2}"#).head_groups(&llama).unwrap(), 1);
        let refused = |text: &str, geometry: &KvGeometry| config(text).head_groups(geometry).unwrap_err().to_string();
        assert!(refused(r#"{"mem_layout": "page_unified", "head_group": 3}"#, &llama).contains("`head_group`"));
        let mla = KvGeometry::deepseek_v3();
        assert!(refused(r#"{"mem_layout": "page_unified", "head_group": 1}"#, &mla).contains("no head axis"));
        let zero = HiCacheConfig::from_json(r#"{"head_group": 0}"#).unwrap_err().to_string();
        assert!(zero.starts_with("config field `head_group`"), "{zero}");
    }

    #[test]
    fn host_pool_size_follows_sglang() {
        let config = HiCacheConfig { page_size: 64, ..HiCacheConfig::default() };
        assert_eq!(config.host_pool_tokens(1000, 131_072).unwrap(), 1984);
        let sized = HiCacheConfig { hicache_size: 1, page_size: 64, ..HiCacheConfig::default() };
        // 1e9 / 131072 = 7629.39 → 7629 → 7616 whole pages
        assert_eq!(sized.host_pool_tokens(1000, 131_072).unwrap(), 7616);
        assert!(sized.host_pool_tokens(8000, 131_072).unwrap_err().to_string().contains("hicache_size"));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4294967296"), Ok(4 << 30));
        assert_eq!(parse_size("4gb"), Ok(4 << 30));
        assert_eq!(parse_size(" 16 MiB "), Ok(16 << 20));
        assert!(parse_size("4 parsecs").unwrap_err().contains("unknown unit"));
        assert!(parse_size("gb").is_err());
        assert!(parse_size("99999999999tb").unwrap_err().contains("overflows"));
    }
}
