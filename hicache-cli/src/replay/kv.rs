//! The KV bytes a replay writes and checks: every item is a function of its token's page key (the whole prefix up
//! to that page), its place in the page, the layer and the part. A prefill writes them; every load is checked
//! against them, so a page that came back from the wrong slot, the wrong host page or the wrong storage object
//! (another prefix, another rank, another layer) shows.

use hicache_core::DeviceSlot;
use hicache_core::geometry::KvGeometry;
use hicache_core::hash::PageKey;
use hicache_core::transfer::DeviceLayoutMap;

use super::device::ReplayEngine;

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
    geometry: KvGeometry,
    page_size: usize,
}

impl KvPattern {
    pub(crate) fn new(map: DeviceLayoutMap, page_size: usize) -> Self {
        Self { geometry: *map.geometry(), page_size }
    }

    fn seed<'k>(&self, keys: &'k [PageKey], position: usize) -> &'k [u8; 32] {
        keys.get(position / self.page_size).map_or(&PARTIAL, PageKey::as_bytes)
    }

    /// Writes the KV of the tokens at `first..` (of a sequence whose page keys are `keys`) into `slots`, all layers.
    pub(crate) fn fill(
        &self,
        engine: &impl ReplayEngine,
        keys: &[PageKey],
        first: usize,
        slots: &[DeviceSlot],
    ) -> anyhow::Result<()> {
        let item = self.geometry.item_bytes();
        let mut data = vec![0u8; slots.len() * item];
        for layer in 0..self.geometry.layers {
            for &part in self.geometry.parts() {
                for (index, bytes) in data.chunks_mut(item).enumerate() {
                    let position = first + index;
                    derive(self.seed(keys, position), position % self.page_size, layer, part.index(), bytes);
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
                derive(self.seed(keys, position), position % self.page_size, layer, part.index(), &mut expected);
                if bytes != expected {
                    return Ok(Err(Mismatch { position, slot, layer }));
                }
            }
        }
        Ok(Ok((slots.len() * item * self.geometry.parts().len()) as u64))
    }
}
