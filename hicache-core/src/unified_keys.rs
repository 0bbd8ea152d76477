//! SGLang's unified L3 key scheme (its `--hicache-storage-key-scheme unified`, SGLang 0.5.23), byte for byte: keys
//! that name what an object holds, never who wrote it, so deployments of any TP or PP topology find each other's
//! pages.
//!
//! A key is `{page_hash}_{digest}_L{start}-{end}[_H{head_group_index}]`: one page's rectangle of a layer range by a
//! kv-head range, K and V together. The digest is `ukv1-` and the first 16 hex digits of the SHA-256 of the
//! namespace's identity ([`UnifiedNamespace`]: model, logical dtype, page size, head and layer grid, object byte
//! order) encoded as MessagePack the way SGLang's `msgspec` encodes its struct: a map of the fields, in declaration
//! order, each integer and string in its shortest form. Any difference in identity is another digest, so it misses
//! rather than collides.
//!
//! Two fleet-wide agreements fix the chunk boundaries: `head_group` (kv heads per chunk) and `layer_partition`
//! (layers per chunk). Left unset, each is this rank's own shard, which shares only with the same topology. A rank
//! owns the cross product of its layer chunks and head groups, layer-major ([`plan`]). Every refusal of SGLang's
//! `plan_unified_kv` is refused here too, naming the field; context parallelism and one kv head per rank without
//! `head_group` are [`Error::Unsupported`], as SGLang raises `NotImplementedError` for them.

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::Error;
use crate::geometry::{Attention, KvDtype};
use crate::namespace::StorageNamespace;

/// Version of the namespace's encoding; every key changes with it.
pub const SCHEMA_VERSION: u64 = 1;

/// The byte order SGLang's `page_unified` host layout stores objects in (the namespace's default `object_layout`).
pub const PAGE_UNIFIED_OBJECT_LAYOUT: &str = "page-unified-v1";

/// The identity of one shared keyspace: everything that must match for two deployments' KV bytes to be
/// interchangeable (SGLang's `KVCacheNamespace`, fields in its order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnifiedNamespace {
    /// The served model.
    pub model_id: String,
    /// The logical dtype (`bfloat16`, `float8_e4m3fn`: fp8 variants never share a keyspace).
    pub dtype: String,
    /// Tokens per page.
    pub page_size: u64,
    /// MLA-family pools: every attention-TP rank holds the same KV, and there is no head axis.
    pub rank_replicated: bool,
    /// KV heads of the model (0 when replicated).
    pub total_kv_heads: u64,
    /// Layers per chunk; 0: each rank's own layer range.
    pub layer_partition: u64,
    /// KV heads per chunk (0 when replicated).
    pub head_group: u64,
    /// The byte order of stored objects.
    pub object_layout: String,
}

impl UnifiedNamespace {
    /// The MessagePack encoding the digest hashes (as `msgspec.msgpack.encode` of SGLang's struct).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(192);
        let write = |out: &mut Vec<u8>, key: &str| rmp::encode::write_str(out, key).expect("a Vec takes every write");
        rmp::encode::write_map_len(&mut out, 9).expect("a Vec takes every write");
        for (key, value) in [
            ("schema_version", Field::Uint(SCHEMA_VERSION)),
            ("model_id", Field::Text(&self.model_id)),
            ("dtype", Field::Text(&self.dtype)),
            ("page_size", Field::Uint(self.page_size)),
            ("rank_replicated", Field::Bool(self.rank_replicated)),
            ("total_kv_heads", Field::Uint(self.total_kv_heads)),
            ("layer_partition", Field::Uint(self.layer_partition)),
            ("head_group", Field::Uint(self.head_group)),
            ("object_layout", Field::Text(&self.object_layout)),
        ] {
            write(&mut out, key);
            match value {
                Field::Uint(number) => {
                    rmp::encode::write_uint(&mut out, number).expect("a Vec takes every write");
                }
                Field::Text(text) => write(&mut out, text),
                Field::Bool(flag) => rmp::encode::write_bool(&mut out, flag).expect("a Vec takes every write"),
            }
        }
        out
    }

    /// The key prefix: `ukv1-` and 16 hex digits of the encoding's SHA-256.
    pub fn digest(&self) -> String {
        let hash = Sha256::digest(self.encode());
        format!("ukv{SCHEMA_VERSION}-{}", &hex::encode(hash)[..16])
    }

    /// SGLang's `_validate_grid`.
    fn validate(&self) -> Result<(), Error> {
        if self.page_size == 0 {
            return Err(invalid("page_size", "must be positive".into()));
        }
        if self.model_id.is_empty() {
            return Err(invalid(
                "model_id",
                "must not be empty: an empty id would merge models into one keyspace".into(),
            ));
        }
        if self.rank_replicated {
            return Ok(());
        }
        if self.head_group == 0 || self.total_kv_heads == 0 {
            return Err(invalid(
                "head_group",
                "a sharded namespace needs positive total_kv_heads and head_group".into(),
            ));
        }
        if !self.total_kv_heads.is_multiple_of(self.head_group) {
            return Err(invalid(
                "head_group",
                format!("{} must divide total_kv_heads {}", self.head_group, self.total_kv_heads),
            ));
        }
        Ok(())
    }
}

/// One field's value in the encoding.
enum Field<'a> {
    Uint(u64),
    Text(&'a str),
    Bool(bool),
}

/// The fleet's agreements on the chunks of the unified key scheme (`None`: each rank's own heads or layers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnifiedAgreements {
    /// KV heads per chunk.
    pub head_group: Option<u64>,
    /// Layers per chunk.
    pub layer_partition: Option<u64>,
}

/// One rank of a deployment, and the fleet's agreements (the arguments of SGLang's `plan_unified_kv`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnifiedRank {
    /// The served model.
    pub model_id: String,
    /// The logical dtype of the KV cache.
    pub dtype: String,
    /// Tokens per page.
    pub page_size: u64,
    /// MLA-family pools (the KV is the same on every attention-TP rank).
    pub rank_replicated: bool,
    /// KV heads this rank holds.
    pub local_kv_heads: u64,
    /// This rank's attention-TP rank.
    pub attn_tp_rank: u64,
    /// Attention-TP ranks.
    pub attn_tp_size: u64,
    /// Attention context-parallel ranks (only 1 is supported).
    pub attn_cp_size: u64,
    /// First layer of this rank's pipeline stage.
    pub start_layer: u64,
    /// The layer after this stage's last.
    pub end_layer: u64,
    /// Whether this is the last pipeline stage (the only one whose layer range may end off the grid).
    pub is_final_stage: bool,
    /// The fleet's kv heads per chunk; `None`: this rank's own heads.
    #[serde(default)]
    pub head_group: Option<u64>,
    /// The fleet's layers per chunk; `None` or 0: this stage's own range.
    #[serde(default)]
    pub layer_partition: Option<u64>,
}

impl UnifiedRank {
    /// The rank that serves `namespace` (a stage of its pipeline holding layers from `start_layer`, the last stage
    /// when `is_final_stage`), under the fleet's agreements: the model is the namespace's, the dtype its logical name
    /// (`bfloat16`), MLA is rank-replicated, no context parallelism.
    pub fn of(
        namespace: &StorageNamespace,
        (start_layer, is_final_stage): (u64, bool),
        head_group: Option<u64>,
        layer_partition: Option<u64>,
    ) -> Self {
        let geometry = namespace.geometry;
        let (rank_replicated, local_kv_heads) = match geometry.attention {
            Attention::Mha { kv_heads, .. } => (false, kv_heads as u64),
            Attention::Mla { .. } => (true, 1),
        };
        Self {
            model_id: namespace.model.clone(),
            dtype: logical_dtype(geometry.dtype).into(),
            page_size: namespace.page_size as u64,
            rank_replicated,
            local_kv_heads,
            attn_tp_rank: namespace.tp_rank as u64,
            attn_tp_size: namespace.tp_size as u64,
            attn_cp_size: 1,
            start_layer,
            end_layer: start_layer + geometry.layers as u64,
            is_final_stage,
            head_group,
            layer_partition,
        }
    }
}

/// torch's name of a KV dtype, as the namespace records it (`torch.bfloat16` → `bfloat16`).
pub const fn logical_dtype(dtype: KvDtype) -> &'static str {
    match dtype {
        KvDtype::Bf16 => "bfloat16",
        KvDtype::F16 => "float16",
        KvDtype::F32 => "float32",
        KvDtype::Fp8E4m3 => "float8_e4m3fn",
        KvDtype::Fp8E5m2 => "float8_e5m2",
    }
}

/// One rank's objects: the namespace, one key suffix per chunk it owns, and where each chunk's bytes sit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnifiedPlan {
    /// The keyspace.
    pub namespace: UnifiedNamespace,
    /// One suffix per chunk, layer-major and head-minor: entry `i · head_ranges.len() + j` names
    /// `(layer_ranges[i], head_ranges[j])`.
    pub suffixes: Vec<String>,
    /// Layer ranges, local to this rank's pool.
    pub layer_ranges: Vec<(u64, u64)>,
    /// Head ranges, local to this rank's pool (`[(0, 1)]` when replicated).
    pub head_ranges: Vec<(u64, u64)>,
}

impl UnifiedPlan {
    /// The keys of one page: `{page_hash}_{suffix}` for each chunk, in the plan's order.
    pub fn page_keys(&self, page_hash: &str) -> Vec<String> {
        self.suffixes.iter().map(|suffix| format!("{page_hash}_{suffix}")).collect()
    }
}

/// This rank's plan, as SGLang's `plan_unified_kv` makes it.
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the field where SGLang raises `ValueError`; [`Error::Unsupported`] where it raises
/// `NotImplementedError` (context parallelism; one kv head per rank over several ranks without `head_group`).
pub fn plan(rank: &UnifiedRank) -> Result<UnifiedPlan, Error> {
    if rank.attn_cp_size > 1 {
        return Err(Error::Unsupported {
            backend: "unified key scheme".into(),
            operation: "attention context parallelism (ranks hold parts of a page)",
        });
    }
    if rank.start_layer >= rank.end_layer {
        return Err(invalid("end_layer", format!("[{}, {}) is no layer range", rank.start_layer, rank.end_layer)));
    }
    let total_kv_heads = if rank.rank_replicated { 0 } else { rank.local_kv_heads * rank.attn_tp_size };
    let head_group = resolve_head_group(rank, total_kv_heads)?;
    let namespace = UnifiedNamespace {
        model_id: rank.model_id.clone(),
        dtype: rank.dtype.clone(),
        page_size: rank.page_size,
        rank_replicated: rank.rank_replicated,
        total_kv_heads,
        layer_partition: rank.layer_partition.unwrap_or(0),
        head_group,
        object_layout: PAGE_UNIFIED_OBJECT_LAYOUT.into(),
    };
    namespace.validate()?;
    let (coords, layer_ranges) = layer_chunks(&namespace, rank)?;
    let digest = namespace.digest();
    if rank.rank_replicated {
        let suffixes = coords.iter().map(|coord| format!("{digest}_{coord}")).collect();
        return Ok(UnifiedPlan { namespace, suffixes, layer_ranges, head_ranges: vec![(0, 1)] });
    }
    if !rank.local_kv_heads.is_multiple_of(head_group) {
        return Err(invalid(
            "head_group",
            format!("this rank's {} kv heads do not tile head_group {head_group}", rank.local_kv_heads),
        ));
    }
    let groups = rank.local_kv_heads / head_group;
    let first = rank.attn_tp_rank * groups;
    let suffixes = coords
        .iter()
        .flat_map(|coord| (0..groups).map(move |group| (coord, first + group)))
        .map(|(coord, index)| format!("{digest}_{coord}_H{index}"))
        .collect();
    let head_ranges = (0..groups).map(|group| (group * head_group, (group + 1) * head_group)).collect();
    Ok(UnifiedPlan { namespace, suffixes, layer_ranges, head_ranges })
}

/// SGLang's `_resolve_head_group`.
fn resolve_head_group(rank: &UnifiedRank, total_kv_heads: u64) -> Result<u64, Error> {
    if rank.rank_replicated {
        return Ok(0);
    }
    let local = rank.local_kv_heads;
    let Some(head_group) = rank.head_group else {
        if local == 1 && rank.attn_tp_size > 1 {
            // one head per rank could as well be kv heads replicated over the ranks, which would race on one key
            return Err(Error::Unsupported {
                backend: "unified key scheme".into(),
                operation: "one kv head per rank without head_group (it may be replicated heads)",
            });
        }
        if local != total_kv_heads {
            tracing::warn!(
                local,
                total_kv_heads,
                attn_tp_size = rank.attn_tp_size,
                "unified key scheme without head_group: keyed to this rank's heads, so it shares objects only with \
                 deployments of the same attention-TP size"
            );
        }
        return Ok(local);
    };
    if head_group == 0 {
        return Err(invalid("head_group", "must be positive".into()));
    }
    if !local.is_multiple_of(head_group) || head_group > local {
        return Err(invalid(
            "head_group",
            format!(
                "{head_group} must divide this rank's {local} kv heads (as a fleet grid: total_kv_heads \
                 {total_kv_heads} / lcm of the fleet's attention-TP sizes)"
            ),
        ));
    }
    Ok(head_group)
}

/// Layer chunks: their absolute coordinates (`L0-8`) and their pool-local ranges.
type LayerChunks = (Vec<String>, Vec<(u64, u64)>);

/// SGLang's `_layer_chunks`: the absolute layer coordinates and their pool-local ranges.
fn layer_chunks(namespace: &UnifiedNamespace, rank: &UnifiedRank) -> Result<LayerChunks, Error> {
    let (start, end) = (rank.start_layer, rank.end_layer);
    let partition = namespace.layer_partition;
    if partition == 0 {
        return Ok((vec![format!("L{start}-{end}")], vec![(0, end - start)]));
    }
    if !start.is_multiple_of(partition) {
        return Err(invalid(
            "layer_partition",
            format!("this rank's layers [{start}, {end}) do not start on a multiple of {partition}"),
        ));
    }
    if !end.is_multiple_of(partition) && !rank.is_final_stage {
        return Err(invalid(
            "layer_partition",
            format!("this rank's layers [{start}, {end}) end off the grid of {partition}, and only the last stage may"),
        ));
    }
    let bounds: Vec<(u64, u64)> =
        (start..end).step_by(partition as usize).map(|first| (first, (first + partition).min(end))).collect();
    let coords = bounds.iter().map(|(first, last)| format!("L{first}-{last}")).collect();
    let ranges = bounds.iter().map(|(first, last)| (first - start, last - start)).collect();
    Ok((coords, ranges))
}

fn invalid(field: &str, reason: String) -> Error {
    Error::InvalidConfig { field: format!("unified key scheme: {field}"), reason }
}
