//! The KV bytes a replay writes and checks: every KV head of every item is a function of its token's page key (the
//! whole prefix up to that page), its place in the page, the model's index of the layer, the part, the model's
//! index of the head and the pool (the KV, or a hybrid model's sidecar pool). A prefill writes them; every load is
//! checked against them, so a page that came back from the wrong slot, the wrong host page or the wrong storage
//! object (another prefix, another rank's heads, another stage's layers, another pool) shows, and replays of
//! different TP and PP sizes agree on every head's bytes.

use hicache_core::DeviceSlot;
use hicache_core::geometry::{Attention, KvGeometry, KvPart};
use hicache_core::hash::PageKey;
use hicache_core::transfer::DeviceLayoutMap;

use super::device::ReplayEngine;

/// The seed of a token in a partial last page (never cached, so never checked).
const PARTIAL: [u8; 32] = [0xa5; 32];

/// Where one head's bytes are: the token's place in its page, the layer, the part, the model's head index and the
/// pool (0 for the KV).
#[derive(Clone, Copy)]
struct Place {
    offset: usize,
    layer: usize,
    part: usize,
    head: usize,
    pool: usize,
}

/// Fills `out` with the bytes of one item, head by head (`head_bytes` each; the heads from `first_head` on).
fn derive(key: &[u8; 32], place: Place, head_bytes: usize, out: &mut [u8]) {
    for (index, head) in out.chunks_mut(head_bytes).enumerate() {
        derive_head(key, Place { head: place.head + index, ..place }, head);
    }
}

/// Fills `out` with the bytes of one head.
fn derive_head(key: &[u8; 32], place: Place, out: &mut [u8]) {
    let Place { offset, layer, part, head, pool } = place;
    let mut state = u64::from_le_bytes(key[..8].try_into().expect("8 bytes"))
        ^ u64::from_le_bytes(key[8..16].try_into().expect("8 bytes")).rotate_left(17)
        ^ ((offset as u64) << 40 | (head as u64) << 24 | (layer as u64) << 8 | part as u64)
        ^ (pool as u64).rotate_right(4);
    for chunk in out.chunks_mut(8) {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut mixed = state;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        mixed ^= mixed >> 31;
        chunk.copy_from_slice(&mixed.to_le_bytes()[..chunk.len()]);
    }
}

/// A mismatch between the device and the expected bytes.
#[derive(Debug)]
pub(crate) struct Mismatch {
    pub(crate) position: usize,
    pub(crate) slot: DeviceSlot,
    pub(crate) layer: usize,
}

/// The byte pattern of one replay's geometry.
#[derive(Clone, Copy, Debug)]
pub(crate) struct KvPattern {
    geometry: KvGeometry,
    page_size: usize,
    /// The model's index of the pool's first KV head.
    first_head: usize,
    /// The model's index of the pool's first layer (its pipeline stage's first).
    first_layer: usize,
    /// Which pool this is: 0 for the KV, `n` for the n-th sidecar pool of a hybrid model.
    pool: usize,
    /// Bytes of one head of an item (MLA: the whole latent).
    head_bytes: usize,
}

impl KvPattern {
    /// The pattern of pool `pool` (0: the KV) of `map`'s geometry whose first head and first layer are the model's
    /// `first`.
    pub(crate) fn new(
        map: DeviceLayoutMap,
        page_size: usize,
        (first_head, first_layer): (usize, usize),
        pool: usize,
    ) -> Self {
        let geometry = *map.geometry();
        let head_bytes = match geometry.attention {
            Attention::Mha { head_dim, .. } => head_dim * geometry.dtype.bytes(),
            Attention::Mla { .. } => geometry.item_bytes(),
        };
        Self { geometry, page_size, first_head, first_layer, pool, head_bytes }
    }

    fn place(&self, position: usize, layer: usize, part: KvPart) -> Place {
        Place {
            offset: position % self.page_size,
            layer: self.first_layer + layer,
            part: part.index(),
            head: self.first_head,
            pool: self.pool,
        }
    }

    fn seed<'k>(&self, keys: &'k [PageKey], position: usize) -> &'k [u8; 32] {
        keys.get(position / self.page_size).map_or(&PARTIAL, PageKey::as_bytes)
    }

    /// Writes the KV of the tokens at `first..` (of a sequence whose page keys are `keys`) into `slots`, all layers.
    /// With `only_page` (a state kept where the compute ended), only that page's entry is written and the others'
    /// bytes are zeros, which no check takes for an entry.
    pub(crate) fn fill(
        &self,
        engine: &impl ReplayEngine,
        keys: &[PageKey],
        first: usize,
        slots: &[DeviceSlot],
        only_page: Option<usize>,
    ) -> anyhow::Result<()> {
        let item = self.geometry.item_bytes();
        let mut data = vec![0u8; slots.len() * item];
        for layer in 0..self.geometry.layers {
            for &part in self.geometry.parts() {
                for (index, bytes) in data.chunks_mut(item).enumerate() {
                    let position = first + index;
                    if only_page.is_some_and(|page| position / self.page_size != page) {
                        continue;
                    }
                    derive(self.seed(keys, position), self.place(position, layer, part), self.head_bytes, bytes);
                }
                engine.write_items(layer, part, slots, &data)?;
            }
        }
        engine.finish_writes()
    }

    /// Checks layer `layer` of the tokens at `first..` in `slots`; returns the bytes checked.
    pub(crate) fn check_layer(
        &self,
        engine: &impl ReplayEngine,
        keys: &[PageKey],
        first: usize,
        slots: &[DeviceSlot],
        layer: usize,
    ) -> anyhow::Result<Result<u64, Mismatch>> {
        let item = self.geometry.item_bytes();
        let mut expected = vec![0u8; item];
        let mut found = vec![0u8; slots.len() * item];
        for &part in self.geometry.parts() {
            engine.read_items(layer, part, slots, &mut found)?;
            for (index, (&slot, bytes)) in slots.iter().zip(found.chunks(item)).enumerate() {
                let position = first + index;
                derive(self.seed(keys, position), self.place(position, layer, part), self.head_bytes, &mut expected);
                if bytes != expected {
                    return Ok(Err(Mismatch { position, slot, layer }));
                }
            }
        }
        Ok(Ok((slots.len() * item * self.geometry.parts().len()) as u64))
    }
}
