//! The replay's view of an engine's device pool: items of one layer and part, read and written for a list of slots
//! (the KV a prefill writes, the bytes a check reads), on the CPU engine or, with the `cuda` feature, on a GPU.

use hicache_core::DeviceSlot;
use hicache_core::geometry::KvPart;
use hicache_core::transfer::{CopyStats, CpuEngine, DeviceLayoutMap, TransferEngine};

/// A transfer engine whose device pool the replay can write (the model's prefill) and read (the byte checks).
pub(crate) trait ReplayEngine: TransferEngine {
    /// The device pool's byte map.
    fn pool_map(&self) -> DeviceLayoutMap;

    /// Copies the items of `slots` at `layer` and `part` into `out`, one after another in slot order.
    fn read_items(&self, layer: usize, part: KvPart, slots: &[DeviceSlot], out: &mut [u8]) -> anyhow::Result<()>;

    /// Writes `data` (items one after another in slot order) to `slots` at `layer` and `part`.
    fn write_items(&self, layer: usize, part: KvPart, slots: &[DeviceSlot], data: &[u8]) -> anyhow::Result<()>;

    /// Makes the writes so far visible to transfers queued next.
    fn finish_writes(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// The engine's copy counts, where it keeps them.
    fn copies(&self) -> Option<CopyStats> {
        None
    }
}

/// Maximal runs of consecutive slots: (index of the first in `slots`, first slot, length).
pub(crate) fn slot_runs(slots: &[DeviceSlot]) -> Vec<(usize, DeviceSlot, usize)> {
    let mut runs: Vec<(usize, DeviceSlot, usize)> = Vec::new();
    for (index, &slot) in slots.iter().enumerate() {
        match runs.last_mut() {
            Some((_, first, len)) if *first as usize + *len == slot as usize => *len += 1,
            _ => runs.push((index, slot, 1)),
        }
    }
    runs
}

impl ReplayEngine for CpuEngine {
    fn pool_map(&self) -> DeviceLayoutMap {
        self.device_map()
    }

    fn read_items(&self, layer: usize, part: KvPart, slots: &[DeviceSlot], out: &mut [u8]) -> anyhow::Result<()> {
        let map = self.device_map();
        let item = map.geometry().item_bytes();
        self.with_device(|device| {
            for (index, first, len) in slot_runs(slots) {
                let at = map.item_offset(first as usize, layer, part);
                out[index * item..(index + len) * item].copy_from_slice(&device[at..at + len * item]);
            }
        });
        Ok(())
    }

    fn write_items(&self, layer: usize, part: KvPart, slots: &[DeviceSlot], data: &[u8]) -> anyhow::Result<()> {
        let map = self.device_map();
        let item = map.geometry().item_bytes();
        self.with_device(|device| {
            for (index, first, len) in slot_runs(slots) {
                let at = map.item_offset(first as usize, layer, part);
                device[at..at + len * item].copy_from_slice(&data[index * item..(index + len) * item]);
            }
        });
        Ok(())
    }

    fn copies(&self) -> Option<CopyStats> {
        Some(self.copy_stats())
    }
}

#[cfg(feature = "cuda")]
impl ReplayEngine for hicache_cuda::CudaEngine {
    fn pool_map(&self) -> DeviceLayoutMap {
        self.device_map()
    }

    fn read_items(&self, layer: usize, part: KvPart, slots: &[DeviceSlot], out: &mut [u8]) -> anyhow::Result<()> {
        let map = self.device_map();
        let item = map.geometry().item_bytes();
        for (index, first, len) in slot_runs(slots) {
            let at = map.item_offset(first as usize, layer, part);
            self.device_pool().read(at, &mut out[index * item..(index + len) * item])?;
        }
        Ok(())
    }

    fn write_items(&self, layer: usize, part: KvPart, slots: &[DeviceSlot], data: &[u8]) -> anyhow::Result<()> {
        let map = self.device_map();
        let item = map.geometry().item_bytes();
        for (index, first, len) in slot_runs(slots) {
            let at = map.item_offset(first as usize, layer, part);
            self.device_pool().write(at, &data[index * item..(index + len) * item])?;
        }
        Ok(())
    }

    fn finish_writes(&self) -> anyhow::Result<()> {
        // a copy from pageable memory returns once staged; the transfers' streams must see it landed
        self.device().synchronize()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::slot_runs;

    #[test]
    fn slot_runs_are_maximal_and_keep_their_positions() {
        assert_eq!(slot_runs(&[4, 5, 6, 9, 10, 2]), [(0, 4, 3), (3, 9, 2), (5, 2, 1)]);
        assert!(slot_runs(&[]).is_empty());
    }
}
