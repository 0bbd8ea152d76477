//! Host pool layouts: where each item of each page lives in the host buffer, and a page's bytes for storage I/O.
//!
//! Three layouts, as SGLang's host pool (docs/sglang.md#host-layouts), with `S` host token slots, `L` layers, `P`
//! tokens per page and items of `I` bytes (MHA has parts K and V; MLA has one latent part):
//!
//! | layout | dims (MHA; MLA drops the leading 2) | page part contiguous |
//! |---|---|---|
//! | `layer_first` | `[2][L][S][I]` | no: one run of `P·I` per layer |
//! | `page_first` | `[2][S][L][I]` | yes: `P·L·I` bytes |
//! | `page_first_direct` | `[2][S/P][L][P][I]` | yes: `L·P·I` bytes |
//!
//! The **flat page** is what generic storage I/O stores under a key (SGLang's `get_flat_data_page`): `[2][L][P][I]` for
//! `layer_first` and `page_first_direct`, `[2][P][L][I]` for `page_first`. The same key therefore holds different byte
//! orders under different layouts, which is why the native key namespace includes the layout (docs/sglang.md#fixed-10).
//! A page's [`segments`](HostLayoutMap::page_segments) are the ranges of the host buffer whose concatenation, in order,
//! is the flat page: one range per part for the page-first layouts (zero-copy), one per part and layer for
//! `layer_first`.

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::geometry::{KvGeometry, KvPart};

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
}

impl HostLayout {
    /// Every layout.
    pub const ALL: [Self; 3] = [Self::LayerFirst, Self::PageFirst, Self::PageFirstDirect];

    /// SGLang's name for the layout (`--hicache-mem-layout`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::LayerFirst => "layer_first",
            Self::PageFirst => "page_first",
            Self::PageFirstDirect => "page_first_direct",
        }
    }

    /// The buffer's dimensions, outermost first (`part` is K and V for MHA; MLA has one part): the one description
    /// of each layout that the CLI's help and the docs repeat.
    pub const fn dims(self) -> &'static str {
        match self {
            Self::LayerFirst => "[part][layer][slot][item]",
            Self::PageFirst => "[part][slot][layer][item]",
            Self::PageFirstDirect => "[part][page][layer][token in page][item]",
        }
    }

    /// Whether each part of a page is one contiguous range of the host buffer.
    pub const fn page_part_is_contiguous(self) -> bool {
        !matches!(self, Self::LayerFirst)
    }
}

/// One contiguous range of the host buffer that belongs to a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageSegment {
    /// Which part of the page the bytes belong to.
    pub part: KvPart,
    /// Byte offset in the host buffer.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// The byte map of one host pool: geometry, layout, page size and number of pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostLayoutMap {
    geometry: KvGeometry,
    layout: HostLayout,
    page_size: usize,
    pages: usize,
}

impl HostLayoutMap {
    /// A map for `pages` pages of `page_size` tokens.
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
        Ok(Self { geometry, layout, page_size, pages })
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

    /// Byte offset of one item: host token slot `token`, layer `layer`, part `part`.
    ///
    /// # Panics
    ///
    /// When the token, layer or part is out of range for this pool (a caller bug).
    pub fn item_offset(&self, token: usize, layer: usize, part: KvPart) -> usize {
        assert!(token < self.tokens(), "token slot {token} out of range ({} slots)", self.tokens());
        assert!(layer < self.geometry.layers, "layer {layer} out of range ({} layers)", self.geometry.layers);
        assert!(self.geometry.parts().contains(&part), "part {part:?} is not in a {:?} pool", self.geometry.attention);
        let (slots, layers, item) = (self.tokens(), self.geometry.layers, self.geometry.item_bytes());
        let part = part.index();
        let items = match self.layout {
            HostLayout::LayerFirst => (part * layers + layer) * slots + token,
            HostLayout::PageFirst => (part * slots + token) * layers + layer,
            HostLayout::PageFirstDirect => {
                let (page, slot) = (token / self.page_size, token % self.page_size);
                ((part * self.pages + page) * layers + layer) * self.page_size + slot
            }
        };
        items * item
    }

    /// Byte offset of an item inside the flat page (the generic storage order of this layout).
    ///
    /// # Panics
    ///
    /// When the token, layer or part is out of range.
    pub fn flat_offset(&self, token_in_page: usize, layer: usize, part: KvPart) -> usize {
        assert!(token_in_page < self.page_size, "token {token_in_page} out of a page of {}", self.page_size);
        assert!(layer < self.geometry.layers, "layer {layer} out of range ({} layers)", self.geometry.layers);
        let (layers, item, page_size) = (self.geometry.layers, self.geometry.item_bytes(), self.page_size);
        let part = part.index();
        let items = match self.layout {
            HostLayout::LayerFirst | HostLayout::PageFirstDirect => (part * layers + layer) * page_size + token_in_page,
            HostLayout::PageFirst => (part * page_size + token_in_page) * layers + layer,
        };
        items * item
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
                        part,
                        offset: self.item_offset(first, layer, part),
                        len: self.page_size * item,
                    })
                })
                .collect(),
            HostLayout::PageFirst | HostLayout::PageFirstDirect => parts
                .iter()
                .map(|&part| PageSegment {
                    part,
                    offset: self.item_offset(first, 0, part),
                    len: self.page_size * layers * item,
                })
                .collect(),
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
        (geometries(), prop::sample::select(HostLayout::ALL.to_vec()), 1usize..5, 1usize..5).prop_map(
            |(geometry, layout, page_size, pages)| HostLayoutMap::new(geometry, layout, page_size, pages).unwrap(),
        )
    }

    fn all_items(map: &HostLayoutMap) -> Vec<(usize, usize, KvPart)> {
        let mut items = Vec::new();
        for &part in map.geometry().parts() {
            for layer in 0..map.geometry().layers {
                for token in 0..map.tokens() {
                    items.push((token, layer, part));
                }
            }
        }
        items
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
        fn items_tile_the_buffer_exactly(map in maps()) {
            let item = map.geometry().item_bytes();
            let mut offsets: Vec<usize> =
                all_items(&map).into_iter().map(|(token, layer, part)| map.item_offset(token, layer, part)).collect();
            offsets.sort_unstable();
            // a bijection onto the item slots: unique, in bounds, never overlapping, nothing left over
            let expected: Vec<usize> = (0..map.total_bytes() / item).map(|index| index * item).collect();
            prop_assert_eq!(offsets, expected);
        }

        #[test]
        fn segments_concatenate_to_the_flat_page(map in maps()) {
            let item = map.geometry().item_bytes();
            for page in 0..map.pages() {
                let segments = map.page_segments(page);
                prop_assert_eq!(segments.iter().map(|segment| segment.len).sum::<usize>(), map.page_bytes());
                for token_in_page in 0..map.page_size() {
                    for layer in 0..map.geometry().layers {
                        for &part in map.geometry().parts() {
                            let flat = map.flat_offset(token_in_page, layer, part);
                            prop_assert!(flat + item <= map.page_bytes());
                            let token = page * map.page_size() + token_in_page;
                            prop_assert_eq!(host_offset_of_flat(&segments, flat), map.item_offset(token, layer, part));
                            // the whole item lies in one segment
                            prop_assert_eq!(host_offset_of_flat(&segments, flat + item - 1), map.item_offset(token, layer, part) + item - 1);
                        }
                    }
                }
                if map.layout().page_part_is_contiguous() {
                    prop_assert_eq!(segments.len(), map.geometry().parts().len());
                }
                let parts: Vec<KvPart> = segments.iter().map(|segment| segment.part).collect();
                let mut sorted = parts.clone();
                sorted.sort();
                prop_assert_eq!(parts, sorted, "flat order is part-major");
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
