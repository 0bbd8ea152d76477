//! Host pool layouts: where each item of each page lives in the host buffer, and a page's bytes for storage I/O.
//!
//! Four layouts, as SGLang's host pool (docs/sglang.md#host-layouts), with `S` host token slots, `L` layers, `P`
//! tokens per page and items of `I` bytes (MHA has parts K and V; MLA has one latent part):
//!
//! | layout | dims (MHA; MLA drops the 2) | page part contiguous |
//! |---|---|---|
//! | `layer_first` | `[2][L][S][I]` | no: one run of `P·I` per layer |
//! | `page_first` | `[2][S][L][I]` | yes: `P·L·I` bytes |
//! | `page_first_direct` | `[2][S/P][L][P][I]` | yes: `L·P·I` bytes |
//! | `page_unified` | `[S/P][G][L][2][P][I/G]` | the whole page, K and V together: `2·L·P·I` bytes |
//!
//! `page_unified` (SGLang 0.5.23's `PageUnifiedLayout`) cuts each item into `G` *head groups* of `I/G` bytes (`G`
//! divides the rank's KV heads; MLA has one group) and puts the axes a storage chunk is cut along, head group then
//! layer, outside the token axis: any layer range of one head group of a page is then one contiguous run
//! ([`chunk_span`](HostLayoutMap::chunk_span)), which is what the unified key scheme stores as one object
//! ([`crate::unified_keys`]). With `G > 1` an item is `G` runs, so copies move *rows* (one token × layer × part ×
//! head group; [`row_offset`](HostLayoutMap::row_offset)); every other layout has one group, and a row is an item.
//!
//! The **flat page** is what generic storage I/O stores under a key (SGLang's `get_flat_data_page`): `[2][L][P][I]` for
//! `layer_first` and `page_first_direct`, `[2][P][L][I]` for `page_first`, the page block itself for `page_unified`.
//! The same key therefore holds different byte orders under different layouts, which is why the native key namespace
//! includes the layout (docs/sglang.md#fixed-10). A page's [`segments`](HostLayoutMap::page_segments) are the ranges of
//! the host buffer whose concatenation, in order, is the flat page: one range per part for `page_first` and
//! `page_first_direct` (zero-copy), one for the whole page for `page_unified`, one per part and layer for
//! `layer_first`.

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::geometry::{Attention, KvGeometry, KvPart};

/// Order of the host pool buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostLayout {
    /// `[2][layer][token][item]`: SGLang's default; each layer's tokens are contiguous.
    #[default]
    LayerFirst,
    /// `[2][token][layer][item]`: each page's K (and V) is one contiguous blob.
    PageFirst,
    /// `[2][page][layer][token in page][item]`: a page's layer is contiguous, and so is each page's K (and V).
    PageFirstDirect,
    /// `[page][head group][layer][2][token in page][head in group × head dim]`: a page is one contiguous block, K and V
    /// together, and each layer range of one head group inside it is one run.
    PageUnified,
}

impl HostLayout {
    /// Every layout.
    pub const ALL: [Self; 4] = [Self::LayerFirst, Self::PageFirst, Self::PageFirstDirect, Self::PageUnified];

    /// SGLang's name for the layout (`--hicache-mem-layout`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::LayerFirst => "layer_first",
            Self::PageFirst => "page_first",
            Self::PageFirstDirect => "page_first_direct",
            Self::PageUnified => "page_unified",
        }
    }

    /// The buffer's dimensions, outermost first (`part` is K and V for MHA; MLA has one part): the one description
    /// of each layout that the CLI's help and the docs repeat.
    pub const fn dims(self) -> &'static str {
        match self {
            Self::LayerFirst => "[part][layer][slot][item]",
            Self::PageFirst => "[part][slot][layer][item]",
            Self::PageFirstDirect => "[part][page][layer][token in page][item]",
            Self::PageUnified => "[page][head group][layer][part][token in page][item / head groups]",
        }
    }
}

/// One contiguous range of the host buffer that belongs to a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageSegment {
    /// Byte offset in the host buffer.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// The byte map of one host pool: geometry, layout, page size, number of pages and head groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostLayoutMap {
    geometry: KvGeometry,
    layout: HostLayout,
    page_size: usize,
    pages: usize,
    head_groups: usize,
}

impl HostLayoutMap {
    /// A map for `pages` pages of `page_size` tokens, with one head group.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the page size or page count is zero or the buffer size overflows.
    pub fn new(geometry: KvGeometry, layout: HostLayout, page_size: usize, pages: usize) -> Result<Self, Error> {
        let geometry = geometry.validated()?;
        if page_size == 0 {
            return Err(Error::InvalidArgument { field: "page_size", reason: "must be at least 1".into() });
        }
        if pages == 0 {
            return Err(Error::InvalidArgument { field: "pages", reason: "must be at least 1".into() });
        }
        pages
            .checked_mul(page_size)
            .and_then(|tokens| tokens.checked_mul(geometry.bytes_per_token()))
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or_else(|| Error::InvalidArgument {
                field: "pages",
                reason: format!("{pages} pages of {page_size} tokens overflow the address space"),
            })?;
        Ok(Self { geometry, layout, page_size, pages, head_groups: 1 })
    }

    /// The same map with each page cut into `head_groups` groups of KV heads (`page_unified` only; SGLang's
    /// `head_group_num`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `head_groups` when it is zero, does not divide the rank's KV heads, is
    /// above 1 for MLA (which has no head axis), or is above 1 for a layout other than `page_unified`.
    pub fn with_head_groups(self, head_groups: usize) -> Result<Self, Error> {
        let bad = |reason: String| Err(Error::InvalidArgument { field: "head_groups", reason });
        if head_groups == 0 {
            return bad("must be at least 1".into());
        }
        if head_groups > 1 && self.layout != HostLayout::PageUnified {
            return bad(format!("{head_groups} head groups need the page_unified layout, not {}", self.layout.name()));
        }
        match self.geometry.attention {
            Attention::Mla { .. } if head_groups > 1 => {
                return bad(format!("{head_groups} head groups, but MLA's latent has no head axis"));
            }
            Attention::Mha { kv_heads, .. } if !kv_heads.is_multiple_of(head_groups) => {
                return bad(format!("{head_groups} must divide this rank's {kv_heads} KV heads"));
            }
            _ => {}
        }
        Ok(Self { head_groups, ..self })
    }

    /// The geometry.
    pub const fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// The layout.
    pub const fn layout(&self) -> HostLayout {
        self.layout
    }

    /// Tokens per page.
    pub const fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages in the pool.
    pub const fn pages(&self) -> usize {
        self.pages
    }

    /// Head groups each item is cut into (1 but for `page_unified` with several).
    pub const fn head_groups(&self) -> usize {
        self.head_groups
    }

    /// Bytes of one row: one token × layer × part × head group, the unit a copy moves (an item when there is one
    /// head group).
    pub const fn row_bytes(&self) -> usize {
        self.geometry.item_bytes() / self.head_groups
    }

    /// Token slots in the pool.
    pub const fn tokens(&self) -> usize {
        self.pages * self.page_size
    }

    /// Size of the whole host buffer.
    pub const fn total_bytes(&self) -> usize {
        self.tokens() * self.geometry.bytes_per_token()
    }

    /// Bytes of one page (the flat page's length).
    pub const fn page_bytes(&self) -> usize {
        self.geometry.bytes_per_page(self.page_size)
    }

    /// Byte offset of one item: host token slot `token`, layer `layer`, part `part`. With several head groups the
    /// item is not contiguous and this is its first row ([`row_offset`](Self::row_offset) gives each).
    ///
    /// # Panics
    ///
    /// When the token, layer or part is out of range for this pool (a caller bug).
    pub fn item_offset(&self, token: usize, layer: usize, part: KvPart) -> usize {
        self.row_offset(token, layer, part, 0)
    }

    /// Byte offset of one row: host token slot `token`, layer `layer`, part `part`, head group `group`.
    ///
    /// # Panics
    ///
    /// When the token, layer, part or group is out of range for this pool (a caller bug).
    pub fn row_offset(&self, token: usize, layer: usize, part: KvPart, group: usize) -> usize {
        assert!(token < self.tokens(), "token slot {token} out of range ({} slots)", self.tokens());
        let (page, slot) = (token / self.page_size, token % self.page_size);
        match self.layout {
            HostLayout::PageUnified => page * self.page_bytes() + self.flat_row_offset(slot, layer, part, group),
            _ => {
                self.check(layer, part, group);
                let (slots, layers, item) = (self.tokens(), self.geometry.layers, self.geometry.item_bytes());
                let part = part.index();
                let items = match self.layout {
                    HostLayout::LayerFirst => (part * layers + layer) * slots + token,
                    HostLayout::PageFirst => (part * slots + token) * layers + layer,
                    _ => ((part * self.pages + page) * layers + layer) * self.page_size + slot,
                };
                items * item
            }
        }
    }

    /// Byte offset of an item inside the flat page (the generic storage order of this layout); with several head
    /// groups, of its first row.
    ///
    /// # Panics
    ///
    /// When the token, layer or part is out of range.
    pub fn flat_offset(&self, token_in_page: usize, layer: usize, part: KvPart) -> usize {
        self.flat_row_offset(token_in_page, layer, part, 0)
    }

    /// Byte offset of a row inside the flat page.
    ///
    /// # Panics
    ///
    /// When the token, layer, part or group is out of range.
    pub fn flat_row_offset(&self, token_in_page: usize, layer: usize, part: KvPart, group: usize) -> usize {
        assert!(token_in_page < self.page_size, "token {token_in_page} out of a page of {}", self.page_size);
        self.check(layer, part, group);
        let (layers, item, page_size) = (self.geometry.layers, self.geometry.item_bytes(), self.page_size);
        let parts = self.geometry.parts().len();
        let part = part.index();
        match self.layout {
            HostLayout::LayerFirst | HostLayout::PageFirstDirect => {
                ((part * layers + layer) * page_size + token_in_page) * item
            }
            HostLayout::PageFirst => ((part * page_size + token_in_page) * layers + layer) * item,
            HostLayout::PageUnified => {
                (((group * layers + layer) * parts + part) * page_size + token_in_page) * self.row_bytes()
            }
        }
    }

    fn check(&self, layer: usize, part: KvPart, group: usize) {
        assert!(layer < self.geometry.layers, "layer {layer} out of range ({} layers)", self.geometry.layers);
        assert!(self.geometry.parts().contains(&part), "part {part:?} is not in a {:?} pool", self.geometry.attention);
        assert!(group < self.head_groups, "head group {group} out of range ({} groups)", self.head_groups);
    }

    /// Where one storage chunk of the unified key scheme lies in a `page_unified` flat page: the local layers
    /// `layers` of head group `group`, as `(offset, len)` (SGLang's `PageUnifiedLayout.chunk_span`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `mem_layout` for another layout (its chunks are not runs), `layers` for an
    /// empty range or one past the pool's layers, `head_group` for a group out of range.
    pub fn chunk_span(&self, layers: std::ops::Range<usize>, group: usize) -> Result<(usize, usize), Error> {
        if self.layout != HostLayout::PageUnified {
            return Err(Error::InvalidArgument {
                field: "mem_layout",
                reason: format!("{} pages hold no chunk as one run; use page_unified", self.layout.name()),
            });
        }
        if layers.is_empty() || layers.end > self.geometry.layers {
            return Err(Error::InvalidArgument {
                field: "layers",
                reason: format!("{layers:?} is not a non-empty range of the pool's {} layers", self.geometry.layers),
            });
        }
        if group >= self.head_groups {
            return Err(Error::InvalidArgument {
                field: "head_group",
                reason: format!("{group} is outside the pool's {} head groups", self.head_groups),
            });
        }
        let layer_bytes = self.geometry.parts().len() * self.page_size * self.row_bytes();
        Ok(((group * self.geometry.layers + layers.start) * layer_bytes, layers.len() * layer_bytes))
    }

    /// The ranges of the host buffer that make up page `page`, in flat page order.
    ///
    /// # Panics
    ///
    /// When `page` is out of range.
    pub fn page_segments(&self, page: usize) -> Vec<PageSegment> {
        assert!(page < self.pages, "page {page} out of range ({} pages)", self.pages);
        let first = page * self.page_size;
        let (layers, item) = (self.geometry.layers, self.geometry.item_bytes());
        let parts = self.geometry.parts();
        match self.layout {
            HostLayout::LayerFirst => parts
                .iter()
                .flat_map(|&part| {
                    (0..layers).map(move |layer| PageSegment {
                        offset: self.item_offset(first, layer, part),
                        len: self.page_size * item,
                    })
                })
                .collect(),
            HostLayout::PageFirst | HostLayout::PageFirstDirect => parts
                .iter()
                .map(|&part| PageSegment {
                    offset: self.item_offset(first, 0, part),
                    len: self.page_size * layers * item,
                })
                .collect(),
            HostLayout::PageUnified => vec![PageSegment { offset: page * self.page_bytes(), len: self.page_bytes() }],
        }
    }

    /// Splits `buffer` (the whole host pool) into the segments of each page in `pages`, in order, without copying.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the buffer's length is not [`total_bytes`](Self::total_bytes), a page is out of
    /// range, or a page appears twice (two mutable views of the same bytes).
    pub fn split_pages_mut<'a>(&self, buffer: &'a mut [u8], pages: &[usize]) -> Result<Vec<Vec<&'a mut [u8]>>, Error> {
        if buffer.len() != self.total_bytes() {
            return Err(Error::InvalidArgument {
                field: "buffer",
                reason: format!("{} bytes, but the pool map covers {}", buffer.len(), self.total_bytes()),
            });
        }
        if let Some(&page) = pages.iter().find(|&&page| page >= self.pages) {
            return Err(Error::InvalidArgument {
                field: "pages",
                reason: format!("page {page} out of range ({} pages)", self.pages),
            });
        }
        // (offset, len, which page of the request, which segment of the page)
        let mut pieces: Vec<(usize, usize, usize, usize)> = pages
            .iter()
            .enumerate()
            .flat_map(|(slot, &page)| {
                self.page_segments(page)
                    .into_iter()
                    .enumerate()
                    .map(move |(index, segment)| (segment.offset, segment.len, slot, index))
            })
            .collect();
        pieces.sort_unstable();
        if let Some(pair) = pieces.windows(2).find(|pair| pair[0].0 + pair[0].1 > pair[1].0) {
            return Err(Error::InvalidArgument {
                field: "pages",
                reason: format!("page {} is listed more than once", pages[pair[1].2]),
            });
        }
        let mut out: Vec<Vec<Option<&'a mut [u8]>>> =
            pages.iter().map(|&page| (0..self.page_segments(page).len()).map(|_| None).collect()).collect();
        let mut rest = buffer;
        let mut consumed = 0;
        for (offset, len, slot, index) in pieces {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(offset - consumed);
            let (piece, tail) = tail.split_at_mut(len);
            out[slot][index] = Some(piece);
            rest = tail;
            consumed = offset + len;
        }
        Ok(out.into_iter().map(|segments| segments.into_iter().flatten().collect()).collect())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::geometry::{Attention, KvDtype};

    fn geometries() -> impl Strategy<Value = KvGeometry> {
        let mha = (1usize..5, 1usize..4, 1usize..5).prop_map(|(layers, kv_heads, head_dim)| {
            KvGeometry::mha(layers, kv_heads, head_dim, KvDtype::Bf16).unwrap()
        });
        let mla = (1usize..5, 1usize..6, 0usize..3).prop_map(|(layers, kv_lora_rank, rope_dim)| {
            KvGeometry::mla(layers, kv_lora_rank, rope_dim, KvDtype::Fp8E4m3).unwrap()
        });
        prop_oneof![mha, mla]
    }

    fn maps() -> impl Strategy<Value = HostLayoutMap> {
        (geometries(), prop::sample::select(HostLayout::ALL.to_vec()), 1usize..5, 1usize..5, 0usize..3).prop_map(
            |(geometry, layout, page_size, pages, groups)| {
                let map = HostLayoutMap::new(geometry, layout, page_size, pages).unwrap();
                // every head group count the map can take: a divisor of the KV heads, under page_unified
                let heads = match geometry.attention {
                    Attention::Mha { kv_heads, .. } if layout == HostLayout::PageUnified => kv_heads,
                    _ => 1,
                };
                let divisors: Vec<usize> = (1..=heads).filter(|g| heads.is_multiple_of(*g)).collect();
                map.with_head_groups(divisors[groups % divisors.len()]).unwrap()
            },
        )
    }

    /// Every row of the pool: (token, layer, part, head group).
    fn all_rows(map: &HostLayoutMap) -> Vec<(usize, usize, KvPart, usize)> {
        let mut rows = Vec::new();
        for &part in map.geometry().parts() {
            for layer in 0..map.geometry().layers {
                for token in 0..map.tokens() {
                    for group in 0..map.head_groups() {
                        rows.push((token, layer, part, group));
                    }
                }
            }
        }
        rows
    }

    /// Finds the host offset of flat page byte `flat` by walking the segments: the concatenation rule, stated directly.
    fn host_offset_of_flat(segments: &[PageSegment], mut flat: usize) -> usize {
        for segment in segments {
            if flat < segment.len {
                return segment.offset + flat;
            }
            flat -= segment.len;
        }
        panic!("flat offset beyond the page");
    }

    #[test]
    fn page_first_mha_matches_sglang_v_offset() {
        // SGLang: v_offset = layer_num * size * head_num * head_dim * itemsize; page i's K at i*P*layout_dim
        let geometry = KvGeometry::llama31_8b();
        let map = HostLayoutMap::new(geometry, HostLayout::PageFirst, 64, 10).unwrap();
        let segments = map.page_segments(3);
        let layout_dim = geometry.item_bytes() * geometry.layers;
        assert_eq!(segments[0].offset, 3 * 64 * layout_dim);
        assert_eq!(segments[1].offset - segments[0].offset, 32 * 640 * 2048);
        assert_eq!(segments[0].len, 4 << 20);
        assert!(matches!(geometry.attention, Attention::Mha { .. }));
    }

    #[test]
    fn split_refuses_duplicates_and_wrong_buffers() {
        let map =
            HostLayoutMap::new(KvGeometry::mha(2, 1, 4, KvDtype::Bf16).unwrap(), HostLayout::LayerFirst, 2, 3).unwrap();
        let mut buffer = vec![0u8; map.total_bytes()];
        let error = map.split_pages_mut(&mut buffer, &[1, 2, 1]).unwrap_err().to_string();
        assert!(error.contains("page 1 is listed more than once"), "{error}");
        assert!(map.split_pages_mut(&mut buffer, &[3]).unwrap_err().to_string().contains("page 3 out of range"));
        assert!(map.split_pages_mut(&mut buffer[1..], &[0]).is_err());
    }

    proptest! {
        #[test]
        fn rows_tile_the_buffer_exactly(map in maps()) {
            let row = map.row_bytes();
            let mut offsets: Vec<usize> = all_rows(&map)
                .into_iter()
                .map(|(token, layer, part, group)| map.row_offset(token, layer, part, group))
                .collect();
            offsets.sort_unstable();
            // a bijection onto the row slots: unique, in bounds, never overlapping, nothing left over
            let expected: Vec<usize> = (0..map.total_bytes() / row).map(|index| index * row).collect();
            prop_assert_eq!(offsets, expected);
        }

        #[test]
        fn a_chunk_is_the_run_of_its_rows(map in maps(), a in 0usize..8, b in 0usize..8, group in 0usize..8) {
            let layers = map.geometry().layers;
            let (start, end) = (a % layers, (a % layers) + 1 + b % (layers - a % layers));
            let group = group % map.head_groups();
            let Ok((offset, len)) = map.chunk_span(start..end, group) else {
                prop_assert_ne!(map.layout(), HostLayout::PageUnified);
                return Ok(());
            };
            // the chunk's rows, and nothing else, lie in its span of the flat page
            let mut inside: Vec<usize> = Vec::new();
            for (token, layer, part, row_group) in all_rows(&map).into_iter().filter(|row| row.0 < map.page_size()) {
                let at = map.flat_row_offset(token, layer, part, row_group);
                let ours = (start..end).contains(&layer) && row_group == group;
                prop_assert_eq!((offset..offset + len).contains(&at), ours);
                if ours {
                    inside.push(at);
                }
            }
            prop_assert_eq!(inside.len() * map.row_bytes(), len);
        }

        #[test]
        fn segments_concatenate_to_the_flat_page(map in maps()) {
            let row = map.row_bytes();
            for page in 0..map.pages() {
                let segments = map.page_segments(page);
                prop_assert_eq!(segments.iter().map(|segment| segment.len).sum::<usize>(), map.page_bytes());
                for (token, layer, part, group) in all_rows(&map) {
                    if token / map.page_size() != page {
                        continue;
                    }
                    let flat = map.flat_row_offset(token % map.page_size(), layer, part, group);
                    let host = map.row_offset(token, layer, part, group);
                    prop_assert!(flat + row <= map.page_bytes());
                    prop_assert_eq!(host_offset_of_flat(&segments, flat), host);
                    // the whole row lies in one segment
                    prop_assert_eq!(host_offset_of_flat(&segments, flat + row - 1), host + row - 1);
                }
                let expected = match map.layout() {
                    HostLayout::LayerFirst => map.geometry().parts().len() * map.geometry().layers,
                    HostLayout::PageFirst | HostLayout::PageFirstDirect => map.geometry().parts().len(),
                    HostLayout::PageUnified => 1,
                };
                prop_assert_eq!(segments.len(), expected);
            }
        }

        #[test]
        fn split_pages_gives_each_page_its_own_bytes(map in maps(), seed in any::<u64>()) {
            let mut buffer: Vec<u8> = (0..map.total_bytes()).map(|index| (index as u64 ^ seed) as u8).collect();
            let original = buffer.clone();
            let mut pages: Vec<usize> = (0..map.pages()).collect();
            pages.rotate_left((seed as usize) % map.pages());
            let expected: Vec<Vec<u8>> = pages
                .iter()
                .map(|&page| {
                    map.page_segments(page).iter().flat_map(|s| original[s.offset..s.offset + s.len].to_vec()).collect()
                })
                .collect();
            let split = map.split_pages_mut(&mut buffer, &pages).unwrap();
            for (segments, expected) in split.iter().zip(&expected) {
                prop_assert_eq!(&segments.concat(), expected);
            }
        }
    }
}
