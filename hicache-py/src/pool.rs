//! SGLang's host pool as hicache sees it: its geometry and layout (from the pool object's attributes), its one
//! buffer, and which bytes of that buffer make up each page.
//!
//! SGLang's host pools (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`) keep their KV in one tensor, `kv_buffer`,
//! laid out as hicache's host layouts are (`[2][layer][slot][item]` for `layer_first`, `[2][slot][layer][item]` for
//! `page_first`, `[2][page][layer][token][item]` for `page_first_direct`, `[page][head group][layer][2][token][item
//! / head groups]` for `page_unified` with its `head_group_num`; MLA without the 2), so
//! [`HostLayoutMap`] gives the same segments as SGLang's `get_page_buffer_meta` (the Python tests check both).

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::{HostLayout, HostLayoutMap};
use serde::Deserialize;

use crate::config::{ConfigError, PoolExpectation};

/// What the Python side reads off the host pool object.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PoolDescription {
    /// `mha` or `mla`.
    pub(crate) kind: String,
    pub(crate) layout: String,
    /// torch's name of the element type (`bfloat16`, ...).
    pub(crate) dtype: String,
    pub(crate) itemsize: usize,
    pub(crate) layer_num: usize,
    pub(crate) page_size: usize,
    /// Token slots.
    pub(crate) size: usize,
    pub(crate) head_num: Option<usize>,
    /// `page_unified`'s head groups per page (SGLang's `head_group_num`; absent: one).
    #[serde(default)]
    pub(crate) head_group_num: Option<usize>,
    /// The model's index of the pool's first layer (its pipeline stage's; absent: 0).
    #[serde(default)]
    #[cfg_attr(not(feature = "python"), expect(dead_code, reason = "the stage is the Python face's to open"))]
    pub(crate) start_layer: Option<usize>,
    pub(crate) head_dim: Option<usize>,
    pub(crate) v_head_dim: Option<usize>,
    pub(crate) kv_lora_rank: Option<usize>,
    pub(crate) qk_rope_head_dim: Option<usize>,
    pub(crate) kv_cache_dim: Option<usize>,
    /// The buffer's first byte and length.
    pub(crate) address: usize,
    pub(crate) nbytes: usize,
}

/// A host pool's buffer and byte map.
#[derive(Debug)]
pub(crate) struct HostPool {
    pub(crate) map: HostLayoutMap,
    pub(crate) address: usize,
}

/// A pool that hicache cannot serve, or that differs from the config; raised as `ValueError` naming the attribute.
fn refuse(what: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::value(format!("host pool {what}"), reason)
}

impl HostPool {
    /// Checks the description against itself and the config's expectation.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] naming the pool attribute (or the config key `pool.…`) at fault.
    pub(crate) fn new(pool: &PoolDescription, expect: &PoolExpectation) -> Result<Self, ConfigError> {
        check_expectation(pool, expect)?;
        let dtype = match pool.dtype.as_str() {
            "bfloat16" => KvDtype::Bf16,
            "float16" => KvDtype::F16,
            "float32" => KvDtype::F32,
            "float8_e5m2" => KvDtype::Fp8E5m2,
            // SGLang stores FP8 caches as uint8; only the byte count matters here
            "float8_e4m3fn" | "uint8" | "int8" => KvDtype::Fp8E4m3,
            other => return Err(refuse("dtype", format!("{other} is not a KV cache dtype hicache stores"))),
        };
        if dtype.bytes() != pool.itemsize {
            return Err(refuse(
                "dtype",
                format!("{} has {} bytes per element, not {}", pool.dtype, pool.itemsize, dtype.bytes()),
            ));
        }
        let layout = match pool.layout.as_str() {
            "layer_first" => HostLayout::LayerFirst,
            "page_first" => HostLayout::PageFirst,
            "page_first_direct" => HostLayout::PageFirstDirect,
            "page_unified" => HostLayout::PageUnified,
            other => {
                return Err(refuse(
                    "layout",
                    format!("{other} is not served (layer_first, page_first, page_first_direct, page_unified are)"),
                ));
            }
        };
        let need = |value: Option<usize>, name: &str| value.ok_or_else(|| refuse(name, "missing"));
        let geometry = match pool.kind.as_str() {
            "mha" => {
                let (heads, head_dim) = (need(pool.head_num, "head_num")?, need(pool.head_dim, "head_dim")?);
                if pool.v_head_dim.is_some_and(|v_head_dim| v_head_dim != head_dim) {
                    return Err(refuse(
                        "v_head_dim",
                        format!(
                            "{:?} differs from head_dim {head_dim}: K and V of other widths are not served",
                            pool.v_head_dim
                        ),
                    ));
                }
                KvGeometry::mha(pool.layer_num, heads, head_dim, dtype)
            }
            "mla" => {
                let (rank, rope) =
                    (need(pool.kv_lora_rank, "kv_lora_rank")?, need(pool.qk_rope_head_dim, "qk_rope_head_dim")?);
                if pool.kv_cache_dim.is_some_and(|dim| dim != rank + rope) {
                    return Err(refuse(
                        "kv_cache_dim",
                        format!(
                            "{:?} is not kv_lora_rank + qk_rope_head_dim = {} (packed rows are not served)",
                            pool.kv_cache_dim,
                            rank + rope
                        ),
                    ));
                }
                KvGeometry::mla(pool.layer_num, rank, rope, dtype)
            }
            other => return Err(refuse("kind", format!("{other}: a pool of MHA or MLA KV is needed"))),
        }
        .map_err(|error| refuse("geometry", error.to_string()))?;
        if pool.page_size == 0 || !pool.size.is_multiple_of(pool.page_size) {
            return Err(refuse("size", format!("{} token slots are not whole pages of {}", pool.size, pool.page_size)));
        }
        let map = HostLayoutMap::new(geometry, layout, pool.page_size, pool.size / pool.page_size)
            .map_err(|error| refuse("size", error.to_string()))?
            .with_head_groups(pool.head_group_num.unwrap_or(1))
            .map_err(|error| refuse("head_group_num", error.to_string()))?;
        if map.total_bytes() != pool.nbytes {
            return Err(refuse(
                "kv_buffer",
                format!(
                    "holds {} bytes, but {} slots of this geometry take {}",
                    pool.nbytes,
                    pool.size,
                    map.total_bytes()
                ),
            ));
        }
        Ok(Self { map, address: pool.address })
    }

    /// The pages of `indices` (SGLang's `host_indices`: `count` pages of `page_size` token slots each), checking that
    /// each page's slots are one whole, aligned page of this pool.
    ///
    /// # Errors
    ///
    /// What is wrong with which page, as text.
    pub(crate) fn pages_of(&self, indices: &[i64], count: usize) -> Result<Vec<usize>, String> {
        let page_size = self.map.page_size();
        if indices.len() != count * page_size {
            return Err(format!("{} slots for {count} pages of {page_size}", indices.len()));
        }
        (0..count)
            .map(|at| {
                let slots = &indices[at * page_size..(at + 1) * page_size];
                let first = slots[0];
                let whole = first >= 0
                    && (first as usize).is_multiple_of(page_size)
                    && (first as usize) < self.map.tokens()
                    && slots.iter().zip(first..).all(|(&slot, expected)| slot == expected);
                if whole {
                    Ok(first as usize / page_size)
                } else {
                    Err(format!(
                        "page {at}: slots {first}.. are not one whole page of this pool ({} slots, pages of {page_size})",
                        self.map.tokens()
                    ))
                }
            })
            .collect()
    }

    /// The address and length of each segment of `page`, in flat page order.
    pub(crate) fn segments(&self, page: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.map.page_segments(page).into_iter().map(|segment| (self.address + segment.offset, segment.len))
    }
}

fn check_expectation(pool: &PoolDescription, expect: &PoolExpectation) -> Result<(), ConfigError> {
    let differ = |key: &str, found: String, said: String| {
        Err(ConfigError::value(format!("pool.{key}"), format!("the host pool has {found}, the config says {said}")))
    };
    let numbers = [
        ("page_size", Some(pool.page_size), expect.page_size),
        ("layer_num", Some(pool.layer_num), expect.layer_num),
        ("head_num", pool.head_num, expect.head_num),
        ("head_dim", pool.head_dim, expect.head_dim),
        ("kv_lora_rank", pool.kv_lora_rank, expect.kv_lora_rank),
        ("qk_rope_head_dim", pool.qk_rope_head_dim, expect.qk_rope_head_dim),
    ];
    for (key, found, said) in numbers {
        if let Some(said) = said
            && found != Some(said)
        {
            return differ(key, found.map_or_else(|| "none".into(), |found| found.to_string()), said.to_string());
        }
    }
    if let Some(layout) = &expect.layout
        && *layout != pool.layout
    {
        return differ("layout", pool.layout.clone(), layout.clone());
    }
    if let Some(dtype) = &expect.dtype
        && dtype.trim_start_matches("torch.") != pool.dtype
    {
        return differ("dtype", pool.dtype.clone(), dtype.clone());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn description(page_size: usize, pages: usize) -> PoolDescription {
        PoolDescription {
            kind: "mha".into(),
            layout: "page_first".into(),
            dtype: "bfloat16".into(),
            itemsize: 2,
            layer_num: 2,
            page_size,
            size: page_size * pages,
            head_num: Some(2),
            head_group_num: None,
            start_layer: None,
            head_dim: Some(8),
            v_head_dim: Some(8),
            kv_lora_rank: None,
            qk_rope_head_dim: None,
            kv_cache_dim: None,
            address: 1 << 20,
            // 2 parts × 2 layers × 2 heads × 8 dims × 2 bytes per token
            nbytes: page_size * pages * 128,
        }
    }

    /// What `pages_of` must answer, written the plain way.
    fn reference(indices: &[i64], count: usize, page_size: usize, tokens: usize) -> Option<Vec<usize>> {
        if indices.len() != count * page_size {
            return None;
        }
        let mut pages = Vec::new();
        for chunk in indices.chunks(page_size) {
            let first = chunk[0];
            if first < 0 || !(first as usize).is_multiple_of(page_size) || first as usize + page_size > tokens {
                return None;
            }
            if chunk.iter().enumerate().any(|(at, &slot)| slot != first + at as i64) {
                return None;
            }
            pages.push(first as usize / page_size);
        }
        Some(pages)
    }

    proptest! {
        #[test]
        fn pages_of_accepts_exactly_whole_aligned_pages(
            page_size in 1usize..6,
            pages in 1usize..12,
            chosen in proptest::collection::vec(0usize..14, 0..5),
            damage in proptest::option::of((0usize..30, -3i64..4)),
        ) {
            let pool = HostPool::new(&description(page_size, pages), &PoolExpectation::default()).unwrap();
            let mut indices: Vec<i64> = chosen
                .iter()
                .flat_map(|&page| (0..page_size).map(move |slot| (page * page_size + slot) as i64))
                .collect();
            if let Some((at, delta)) = damage
                && !indices.is_empty()
            {
                let at = at % indices.len();
                indices[at] += delta;
            }
            let expected = reference(&indices, chosen.len(), page_size, page_size * pages);
            prop_assert_eq!(pool.pages_of(&indices, chosen.len()).ok(), expected);
        }
    }

    #[test]
    fn segments_are_the_layout_maps() {
        let pool = HostPool::new(&description(4, 8), &PoolExpectation::default()).unwrap();
        // page_first: K of page 3 at slot 12, V after all K slots
        let segments: Vec<(usize, usize)> = pool.segments(3).collect();
        let token = 2 * 2 * 8 * 2; // one part of one token: layers × heads × dims × bytes
        assert_eq!(segments, [((1 << 20) + 12 * token, 4 * token), ((1 << 20) + (32 + 12) * token, 4 * token)]);
    }

    #[test]
    fn a_page_unified_page_is_one_block_of_its_head_groups() {
        let mut unified = description(4, 8);
        (unified.layout, unified.head_group_num) = ("page_unified".into(), Some(2));
        let pool = HostPool::new(&unified, &PoolExpectation::default()).unwrap();
        assert_eq!(pool.map.head_groups(), 2);
        // the page is SGLang's block, whole: 2 groups × 2 layers × K and V × 4 tokens × 1 head × 8 dims × 2 bytes
        let page = 2 * 2 * 2 * 4 * 8 * 2;
        assert_eq!(pool.segments(3).collect::<Vec<_>>(), [((1 << 20) + 3 * page, page)]);
        unified.head_group_num = Some(3);
        let error = HostPool::new(&unified, &PoolExpectation::default()).unwrap_err().to_string();
        assert!(error.contains("`host pool head_group_num`"), "{error}");
    }

    #[test]
    fn pools_that_cannot_be_served_name_the_attribute() {
        let error = |change: fn(&mut PoolDescription)| {
            let mut pool = description(4, 8);
            change(&mut pool);
            HostPool::new(&pool, &PoolExpectation::default()).unwrap_err().to_string()
        };
        assert!(error(|pool| pool.itemsize = 4).contains("`host pool dtype`"));
        assert!(error(|pool| pool.dtype = "int32".into()).contains("`host pool dtype`"));
        assert!(error(|pool| pool.layout = "page_head".into()).contains("`host pool layout`"));
        assert!(error(|pool| pool.v_head_dim = Some(16)).contains("`host pool v_head_dim`"));
        assert!(error(|pool| pool.nbytes += 1).contains("`host pool kv_buffer`"));
        assert!(error(|pool| pool.size += 1).contains("`host pool size`"));
        assert!(error(|pool| pool.head_num = None).contains("`host pool head_num`: missing"));
        assert!(error(|pool| pool.kind = "mamba".into()).contains("`host pool kind`"));
        let expect = PoolExpectation { head_dim: Some(128), ..PoolExpectation::default() };
        let mismatch = HostPool::new(&description(4, 8), &expect).unwrap_err().to_string();
        assert_eq!(mismatch, "hicache extra_config key `pool.head_dim`: the host pool has 8, the config says 128");
    }
}
