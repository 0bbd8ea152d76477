//! The L3 key layout a router outside the engine needs to find a deployment's pages in the store by itself (a KV-aware
//! router that sends a conversation to the replica whose store holds its prefix), in the JSON shape SGLang 0.5.23
//! serves at `GET /get_hicache_l3_cache_layout`:
//!
//! ```json
//! {"enabled": true, "backend": "mooncake", "page_size": 64,
//!  "hicache_object_layout": {"pools": [{"pool": "kv", "suffixes": ["_0_k"], "hit_policy": "all_pages"}],
//!                            "key_prefix": "org-Model", "is_mla_backend": true, "pp_rank": 0, "pp_size": 2}}
//! ```
//!
//! A page whose hash (64 hex digits) is `h` is in the store when, for every pool and every suffix, the object
//! `{key_prefix}_{h}{suffix}` is (`{h}{suffix}` when `key_prefix` is null): `all_pages` means every page of a prefix
//! needs all of them, `trailing_pages` (a hybrid model's Mamba state or sliding window) that only the prefix's last
//! `trailing_pages` pages do. A disabled layout says why in `reason`, with no pools. Each pipeline stage describes
//! its own layers (`pp_rank`); [`merge`] joins the stages as SGLang's `merge_l3_layouts` does, with `pp_rank` null.
//!
//! Where SGLang describes only MLA pools (an MHA key carries the TP rank, which one SGLang scheduler cannot list),
//! hicache lists every TP rank's suffixes: a page is in the store when every rank's objects are. Under the unified
//! key scheme the suffixes are those of SGLang's unified keys (`{h}_{digest}_L{start}-{end}_H{group}`, one per chunk
//! of the stage), and `objects` gives, for each, how the tier names the chunk: the object key is the tier's
//! `key_prefix` and `_`, the SHA-256 in hex of the chunk's unified key string, and each of the tier's suffixes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::groups::HitPolicy;
use super::tiers::{PageObjects, TierEntry, TierFields};
use super::unified::chunk_namespace;
use crate::error::Error;
use crate::namespace::{Sidecar, StorageNamespace};
use crate::unified_keys::{UnifiedAgreements, UnifiedRank, plan};

/// The layout, or why there is none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct L3Layout {
    /// Whether a router can find pages with it.
    pub enabled: bool,
    /// The tier's name.
    pub backend: Option<String>,
    /// Tokens per page.
    pub page_size: Option<usize>,
    /// The objects.
    pub hicache_object_layout: ObjectLayout,
    /// Why it is disabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The objects of a page, and the stage they belong to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ObjectLayout {
    /// The pools a page's objects belong to: the KV, then a hybrid model's sidecar pools.
    pub pools: Vec<PoolLayout>,
    /// The stage's key facts; absent in a layout disabled before any was known.
    #[serde(flatten)]
    pub stage: Option<StageKeys>,
}

/// One pool's objects of a page.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolLayout {
    /// The pool (`kv`, or a hybrid model's sidecar pool: `mamba`, `swa`, `indexer`, ...).
    pub pool: String,
    /// What follows the page hash in its object keys.
    pub suffixes: Vec<String>,
    /// `all_pages`: every page of a prefix needs every suffix; `trailing_pages`: only the last
    /// [`trailing_pages`](Self::trailing_pages) pages of the prefix do.
    pub hit_policy: String,
    /// Under the unified key scheme, per suffix, how the tier names that chunk's objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objects: Option<Vec<PageObjects>>,
    /// With `trailing_pages`: how many of the prefix's last pages need the pool's objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trailing_pages: Option<usize>,
}

/// What every key of a stage shares.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageKeys {
    /// What precedes `_` and the page hash (SGLang's backend tag and model); `None`: nothing.
    pub key_prefix: Option<String>,
    /// Whether the KV is MLA (the same on every TP rank).
    pub is_mla_backend: bool,
    /// The stage; `None` in a layout merged from several.
    pub pp_rank: Option<usize>,
    /// Pipeline stages.
    pub pp_size: usize,
    /// The unified key scheme's keyspace, when pages are stored under it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unified: Option<UnifiedKeys>,
}

/// The unified key scheme's keyspace of a layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnifiedKeys {
    /// The namespace digest every key holds (`ukv1-…`).
    pub digest: String,
    /// KV heads per chunk.
    pub head_group: u64,
    /// Layers per chunk.
    pub layer_partition: u64,
    /// How a chunk's unified key string becomes its name in the tier: `sha256`, in hex.
    pub object_key: String,
}

const INCONSISTENT: &str = "Inconsistent HiCache L3 layouts across schedulers";

impl L3Layout {
    /// A disabled layout (SGLang's `disabled_l3_layout`).
    pub fn disabled(reason: impl Into<String>, backend: Option<&str>, page_size: Option<usize>) -> Self {
        Self {
            enabled: false,
            backend: backend.map(str::to_owned),
            page_size,
            hicache_object_layout: ObjectLayout { pools: Vec::new(), stage: None },
            reason: Some(reason.into()),
        }
    }

    /// The layout of the stage of `namespace` (every TP rank of it) on `tier` with `fields`; under the unified key
    /// scheme (`unified`: the fleet's agreements, and the stage's first layer and whether it is the last), the
    /// stage's chunks.
    ///
    /// # Errors
    ///
    /// The namespace's and the unified plan's refusals, naming the field; the tier's refusal of its settings.
    pub fn describe(
        tier: &TierEntry,
        fields: &TierFields,
        namespace: &StorageNamespace,
        unified: Option<(UnifiedAgreements, (u64, bool))>,
    ) -> Result<Self, Error> {
        let namespace = namespace.clone().validated()?;
        let page_size = namespace.page_size;
        let Some(objects) = tier.objects else {
            return Ok(Self::disabled(
                format!(
                    "the {} tier's objects are not found by name outside hicache (a router looks pages up in Mooncake)",
                    tier.name
                ),
                Some(tier.name),
                Some(page_size),
            ));
        };
        let ranks: Vec<StorageNamespace> =
            (0..namespace.tp_size).map(|tp_rank| StorageNamespace { tp_rank, ..namespace.clone() }).collect();
        let mut stage = StageKeys {
            key_prefix: None,
            is_mla_backend: namespace.geometry.is_mla(),
            pp_rank: Some(namespace.pp_rank),
            pp_size: namespace.pp_size,
            unified: None,
        };
        let mut suffixes: Vec<String> = Vec::new();
        let pool = match unified {
            None => {
                for rank in &ranks {
                    let page = objects(fields, rank)?;
                    stage.key_prefix = page.key_prefix;
                    for suffix in page.suffixes {
                        if !suffixes.contains(&suffix) {
                            suffixes.push(suffix);
                        }
                    }
                }
                PoolLayout {
                    pool: "kv".into(),
                    suffixes,
                    hit_policy: "all_pages".into(),
                    objects: None,
                    trailing_pages: None,
                }
            }
            Some((agreements, start)) => {
                let plans = ranks
                    .iter()
                    .map(|rank| plan(&UnifiedRank::of(rank, start, agreements.head_group, agreements.layer_partition)))
                    .collect::<Result<Vec<_>, Error>>()?;
                let first = &plans[0];
                let digest = first.namespace.digest();
                let mut chunk_objects = Vec::new();
                // layer-major, then the ranks in order and each rank's head groups
                for (index, &(begin, end)) in first.layer_ranges.iter().enumerate() {
                    for rank_plan in &plans {
                        let groups = rank_plan.head_ranges.len();
                        for group in 0..groups {
                            let suffix = format!("_{}", rank_plan.suffixes[index * groups + group]);
                            if suffixes.contains(&suffix) {
                                continue;
                            }
                            let layers = (end - begin) as usize;
                            let chunk = chunk_namespace(&digest, &namespace.geometry, layers, groups, &namespace)?;
                            chunk_objects.push(objects(fields, &chunk)?);
                            suffixes.push(suffix);
                        }
                    }
                }
                stage.unified = Some(UnifiedKeys {
                    digest,
                    head_group: first.namespace.head_group,
                    layer_partition: first.namespace.layer_partition,
                    object_key: "sha256".into(),
                });
                PoolLayout {
                    pool: "kv".into(),
                    suffixes,
                    hit_policy: "all_pages".into(),
                    objects: Some(chunk_objects),
                    trailing_pages: None,
                }
            }
        };
        Ok(Self {
            enabled: true,
            backend: Some(tier.name.to_owned()),
            page_size: Some(page_size),
            hicache_object_layout: ObjectLayout { pools: vec![pool], stage: Some(stage) },
            reason: None,
        })
    }

    /// Adds a hybrid model's sidecar pool `sidecar` (its name, entry size and, for tiers under SGLang's keys, how an
    /// entry is cut into objects; restored as `policy` says) beside the KV of `kv`'s stage: every TP rank's objects
    /// of the pool's namespace ([`StorageNamespace::sidecar`]; a Mamba state's are per rank even for MLA, an
    /// indexer's are not). A disabled layout stays as it is; under the unified
    /// key scheme, which keeps no sidecar pools, the layout is disabled saying so.
    ///
    /// # Errors
    ///
    /// The namespace's refusal of the pool (naming `pool`, `entry_bytes` or `objects`); the tier's refusal of its
    /// settings or of the pool.
    pub fn add_sidecar(
        &mut self,
        tier: &TierEntry,
        fields: &TierFields,
        kv: &StorageNamespace,
        sidecar: &Sidecar,
        policy: HitPolicy,
    ) -> Result<(), Error> {
        let Some(objects) = tier.objects.filter(|_| self.enabled) else { return Ok(()) };
        if self.hicache_object_layout.stage.as_ref().is_some_and(|stage| stage.unified.is_some()) {
            *self = self.unavailable("the unified key scheme keeps no sidecar pools of hybrid models");
            return Ok(());
        }
        let mut suffixes: Vec<String> = Vec::new();
        for tp_rank in 0..kv.tp_size {
            let rank = StorageNamespace { tp_rank, sidecar: Some(sidecar.clone()), ..kv.clone() }.validated()?;
            for suffix in objects(fields, &rank)?.suffixes {
                if !suffixes.contains(&suffix) {
                    suffixes.push(suffix);
                }
            }
        }
        let trailing_pages = match policy {
            HitPolicy::AllPages => None,
            HitPolicy::TrailingPages { window } => Some(window.max(1)),
        };
        self.hicache_object_layout.pools.push(PoolLayout {
            pool: sidecar.pool.clone(),
            suffixes,
            hit_policy: policy.name().to_owned(),
            objects: None,
            trailing_pages,
        });
        Ok(())
    }

    fn pp_rank(&self) -> Option<usize> {
        self.hicache_object_layout.stage.as_ref().and_then(|stage| stage.pp_rank)
    }

    /// What must agree across pipeline stages: all but the pools and the stage.
    fn stage_independent(&self) -> Self {
        let mut layout = self.clone();
        layout.hicache_object_layout.pools.clear();
        if let Some(stage) = &mut layout.hicache_object_layout.stage {
            stage.pp_rank = None;
        }
        layout
    }

    /// This layout disabled for `reason`, its pools dropped.
    fn unavailable(&self, reason: &str) -> Self {
        let mut layout = self.clone();
        layout.enabled = false;
        layout.hicache_object_layout.pools.clear();
        layout.reason = Some(reason.to_owned());
        layout
    }
}

/// The layouts of several schedulers (ranks, stages) as one, as SGLang's `merge_l3_layouts`: those of one stage must
/// be equal, the stages must agree on all but their pools and be all there, and their pools are concatenated in
/// stage order, `pp_rank` null. `None` when no scheduler gave one (an engine that serves none).
pub fn merge(layouts: &[Option<L3Layout>]) -> Option<L3Layout> {
    if layouts.iter().all(Option::is_none) {
        return None;
    }
    let inconsistent = || Some(L3Layout::disabled(INCONSISTENT, None, None));
    let Some(layouts) = layouts.iter().cloned().collect::<Option<Vec<L3Layout>>>() else { return inconsistent() };
    let mut stages: BTreeMap<Option<usize>, &L3Layout> = BTreeMap::new();
    for layout in &layouts {
        if **stages.entry(layout.pp_rank()).or_insert(layout) != *layout {
            return inconsistent();
        }
    }
    if stages.contains_key(&None) {
        return if stages.len() == 1 { Some(layouts[0].clone()) } else { inconsistent() };
    }
    let ordered: Vec<&L3Layout> = stages.values().copied().collect();
    let first = ordered[0];
    let independent = first.stage_independent();
    if ordered[1..].iter().any(|stage| stage.stage_independent() != independent) {
        return inconsistent();
    }
    if !first.enabled {
        return Some(first.clone());
    }
    let pp_size = first.hicache_object_layout.stage.as_ref().map_or(1, |stage| stage.pp_size);
    if !stages.keys().copied().eq((0..pp_size).map(Some)) {
        return Some(first.unavailable("Incomplete pipeline-parallel stage layouts"));
    }
    if pp_size == 1 {
        return Some(first.clone());
    }
    let mut merged = first.clone();
    merged.hicache_object_layout.pools =
        ordered.iter().flat_map(|stage| stage.hicache_object_layout.pools.iter().cloned()).collect();
    if let Some(stage) = &mut merged.hicache_object_layout.stage {
        stage.pp_rank = None;
    }
    Some(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(name: &str, entry_bytes: usize) -> Sidecar {
        Sidecar { pool: name.into(), entry_bytes, objects: Vec::new() }
    }

    fn stage(pp_rank: usize, pp_size: usize, suffix: &str) -> L3Layout {
        L3Layout {
            enabled: true,
            backend: Some("mooncake".into()),
            page_size: Some(64),
            hicache_object_layout: ObjectLayout {
                pools: vec![PoolLayout {
                    pool: "kv".into(),
                    suffixes: vec![suffix.into()],
                    hit_policy: "all_pages".into(),
                    objects: None,
                    trailing_pages: None,
                }],
                stage: Some(StageKeys {
                    key_prefix: Some("org-Model".into()),
                    is_mla_backend: true,
                    pp_rank: Some(pp_rank),
                    pp_size,
                    unified: None,
                }),
            },
            reason: None,
        }
    }

    #[test]
    fn stages_are_joined_in_order_and_lose_their_rank() {
        let merged = merge(&[Some(stage(1, 2, "_1_k")), Some(stage(0, 2, "_0_k")), Some(stage(1, 2, "_1_k"))]);
        let json = serde_json::to_value(merged.unwrap()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "enabled": true, "backend": "mooncake", "page_size": 64,
                "hicache_object_layout": {
                    "pools": [
                        {"pool": "kv", "suffixes": ["_0_k"], "hit_policy": "all_pages"},
                        {"pool": "kv", "suffixes": ["_1_k"], "hit_policy": "all_pages"},
                    ],
                    "key_prefix": "org-Model", "is_mla_backend": true, "pp_rank": null, "pp_size": 2,
                },
            })
        );
    }

    #[test]
    fn disagreeing_or_missing_schedulers_disable_the_layout() {
        let inconsistent = |layouts: &[Option<L3Layout>]| merge(layouts).unwrap().reason.unwrap();
        // two schedulers of one stage that differ
        assert_eq!(inconsistent(&[Some(stage(0, 1, "_k")), Some(stage(0, 1, "_v"))]), INCONSISTENT);
        // a scheduler that gave none beside one that did
        assert_eq!(inconsistent(&[Some(stage(0, 1, "_k")), None]), INCONSISTENT);
        // stages that disagree on more than their pools
        let mut other = stage(1, 2, "_1_k");
        other.page_size = Some(32);
        assert_eq!(inconsistent(&[Some(stage(0, 2, "_0_k")), Some(other)]), INCONSISTENT);
        // a stage missing: disabled, the pools dropped, the rest kept
        let partial = merge(&[Some(stage(0, 3, "_0_k")), Some(stage(2, 3, "_2_k"))]).unwrap();
        assert_eq!(partial.reason.as_deref(), Some("Incomplete pipeline-parallel stage layouts"));
        assert!(!partial.enabled && partial.hicache_object_layout.pools.is_empty());
        assert_eq!(partial.hicache_object_layout.stage.unwrap().pp_rank, Some(0));
        assert_eq!(merge(&[None, None]), None);
        // one stage of one: itself
        assert_eq!(merge(&[Some(stage(0, 1, "_k"))]), Some(stage(0, 1, "_k")));
    }

    #[test]
    fn layouts_read_back_as_written() {
        for layout in [stage(1, 2, "_1_k"), L3Layout::disabled("why", None, None)] {
            let text = serde_json::to_string(&layout).unwrap();
            assert_eq!(serde_json::from_str::<L3Layout>(&text).unwrap(), layout, "{text}");
        }
    }

    /// A tier naming each page object after its namespace's digest, as Mooncake's native keys do.
    static BY_DIGEST: TierEntry = TierEntry {
        name: "by-digest",
        aliases: &[],
        about: "",
        keys: &[],
        check: |_| Ok(()),
        open: |_, _| Err(Error::Internal("not opened".into())),
        objects: Some(|_, namespace| {
            Ok(PageObjects { key_prefix: None, suffixes: vec![format!("_{}", namespace.digest())] })
        }),
    };

    /// A sidecar pool follows the KV with every TP rank's objects of its namespace: one set for an indexer of an
    /// MLA model (the same on every rank), one per rank for a Mamba state, with its policy and window.
    #[test]
    fn sidecar_pools_follow_the_kv_with_every_ranks_objects() {
        use crate::geometry::{KvDtype, KvGeometry};
        use crate::layout::HostLayout;
        let kv = StorageNamespace {
            tp_size: 2,
            ..StorageNamespace::single_rank(
                "org/Model",
                KvGeometry::mla(2, 512, 64, KvDtype::Bf16).unwrap(),
                HostLayout::PageFirst,
                16,
            )
        };
        let fields = TierFields::new();
        let mut layout = L3Layout::describe(&BY_DIGEST, &fields, &kv, None).unwrap();
        layout.add_sidecar(&BY_DIGEST, &fields, &kv, &pool("indexer", 528), HitPolicy::AllPages).unwrap();
        let mamba = pool("mamba", 3000);
        layout.add_sidecar(&BY_DIGEST, &fields, &kv, &mamba, HitPolicy::TrailingPages { window: 0 }).unwrap();
        let pools = &layout.hicache_object_layout.pools;
        let digest = |pool: &str, bytes: usize, rank: usize| {
            format!("_{}", StorageNamespace { tp_rank: rank, ..kv.clone() }.sidecar(pool, bytes).unwrap().digest())
        };
        assert_eq!(pools.len(), 3);
        assert_eq!(pools[0].suffixes, [format!("_{}", kv.digest())], "the latent is the same on both ranks");
        assert_eq!((pools[1].hit_policy.as_str(), pools[1].trailing_pages), ("all_pages", None));
        assert_eq!(pools[1].suffixes, [digest("indexer", 528, 0)]);
        assert_eq!((pools[2].hit_policy.as_str(), pools[2].trailing_pages), ("trailing_pages", Some(1)));
        assert_eq!(pools[2].suffixes, [digest("mamba", 3000, 0), digest("mamba", 3000, 1)]);
        assert_ne!(pools[2].suffixes[0], pools[2].suffixes[1], "a state is per rank");
        let json = serde_json::to_value(&layout).unwrap();
        assert_eq!(json["hicache_object_layout"]["pools"][2]["trailing_pages"], 1);
        assert!(json["hicache_object_layout"]["pools"][1].get("trailing_pages").is_none());
        // a bad pool is named; a disabled layout stays disabled
        let error = layout.add_sidecar(&BY_DIGEST, &fields, &kv, &pool("Bad", 1), HitPolicy::AllPages).unwrap_err();
        assert!(error.to_string().starts_with("pool:"), "{error}");
        let mut disabled = L3Layout::disabled("why", None, None);
        disabled.add_sidecar(&BY_DIGEST, &fields, &kv, &pool("mamba", 1), HitPolicy::AllPages).unwrap();
        assert_eq!(disabled, L3Layout::disabled("why", None, None));
    }

    #[test]
    fn a_disabled_layout_has_sglangs_shape() {
        let json = serde_json::to_value(L3Layout::disabled("why", Some("file"), Some(16))).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"enabled": false, "backend": "file", "page_size": 16,
                               "hicache_object_layout": {"pools": []}, "reason": "why"})
        );
    }
}
