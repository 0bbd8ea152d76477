//! The KV bytes a replay writes and checks: every item is a function of its token's page key (the whole prefix up
//! to that page), its place in the page, the layer and the part. A prefill writes them; every load is checked
//! against them, so a page that came back from the wrong slot, the wrong host page or the wrong storage object
//! (another prefix, another rank, another layer) shows.

use hicache_core::geometry::KvGeometry;
use hicache_core::hash::PageKey;
use hicache_core::ops::DeviceSlot;
use hicache_core::transfer::DeviceLayoutMap;

/// The seed of a token in a partial last page (never cached, so never checked).
const PARTIAL: [u8; 32] = [0xa5; 32];

/// Fills `out` with the bytes of one item.
fn derive(key: &[u8; 32], offset: usize, layer: usize, part: usize, out: &mut [u8]) {
    let mut state = u64::from_le_bytes(key[..8].try_into().expect("8 bytes"))
        ^ u64::from_le_bytes(key[8..16].try_into().expect("8 bytes")).rotate_left(17)
        ^ ((offset as u64) << 40 | (layer as u64) << 8 | part as u64);
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
    map: DeviceLayoutMap,
    geometry: KvGeometry,
    page_size: usize,
}

impl KvPattern {
    pub(crate) fn new(map: DeviceLayoutMap, page_size: usize) -> Self {
        Self { geometry: *map.geometry(), map, page_size }
    }

    fn seed<'k>(&self, keys: &'k [PageKey], position: usize) -> &'k [u8; 32] {
        keys.get(position / self.page_size).map_or(&PARTIAL, PageKey::as_bytes)
    }

    /// Writes the KV of tokens at `positions` (of a sequence whose page keys are `keys`) into `slots`, all layers.
    pub(crate) fn fill(&self, device: &mut [u8], keys: &[PageKey], first: usize, slots: &[DeviceSlot]) {
        let item = self.geometry.item_bytes();
        for (index, &slot) in slots.iter().enumerate() {
            let position = first + index;
            let seed = self.seed(keys, position);
            for layer in 0..self.geometry.layers {
                for &part in self.geometry.parts() {
                    let at = self.map.item_offset(slot as usize, layer, part);
                    derive(seed, position % self.page_size, layer, part.index(), &mut device[at..at + item]);
                }
            }
        }
    }

    /// Checks layer `layer` of the tokens at `first..` in `slots`; returns the bytes checked.
    pub(crate) fn check_layer(
        &self,
        device: &[u8],
        keys: &[PageKey],
        first: usize,
        slots: &[DeviceSlot],
        layer: usize,
    ) -> Result<u64, Mismatch> {
        let item = self.geometry.item_bytes();
        let mut expected = vec![0u8; item];
        for (index, &slot) in slots.iter().enumerate() {
            let position = first + index;
            let seed = self.seed(keys, position);
            for &part in self.geometry.parts() {
                derive(seed, position % self.page_size, layer, part.index(), &mut expected);
                let at = self.map.item_offset(slot as usize, layer, part);
                if device[at..at + item] != expected[..] {
                    return Err(Mismatch { position, slot, layer });
                }
            }
        }
        Ok((slots.len() * item * self.geometry.parts().len()) as u64)
    }
}
