//! The device KV pool as the transfers see it: one region per layer and part (a K and a V tensor per layer, as SGLang's
//! `k_buffers`/`v_buffers`, vLLM's and candle's per-layer caches keep it), each `[slot][item]`, reached through a
//! table of their base addresses; hicache's one-slab pool (`[layer][part][slot][item]`) is the table whose regions
//! follow each other.
//!
//! Offsets given to [`DevicePool::write`] and [`DevicePool::read`] are the slab's (`DeviceLayoutMap::item_offset`),
//! whatever the regions are, so tests and set-up read and write every pool the same way.

use hicache_core::Error;
use hicache_core::transfer::DeviceLayoutMap;

use crate::device::Device;
use crate::driver::DeviceBuffer;

/// The regions of a device pool and their table on the device.
#[derive(Debug)]
pub struct DevicePool {
    /// One per (layer, part), layer-major.
    regions: Vec<DeviceBuffer>,
    /// Bytes of one region: the map's slots × item bytes.
    region_bytes: usize,
    /// Parts per layer (2 for MHA, 1 for MLA).
    parts: usize,
    /// The regions' base addresses, on the device, for the kernels.
    table: DeviceBuffer,
    /// The slab the regions lie in, when the pool is one.
    slab: Option<DeviceBuffer>,
}

impl DevicePool {
    /// A pool of one allocation laid out as `map` (`[layer][part][slot][item]`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `device_pool` when it is smaller than the map; the driver's.
    pub fn slab(device: &Device, map: &DeviceLayoutMap, slab: DeviceBuffer) -> Result<Self, Error> {
        if slab.len() < map.total_bytes() {
            return Err(Error::InvalidArgument {
                field: "device_pool",
                reason: format!("{} bytes, the map needs {}", slab.len(), map.total_bytes()),
            });
        }
        let region_bytes = region_bytes(map);
        let regions = (0..region_count(map))
            .map(|index| {
                // SAFETY: the region lies inside the slab (sized above), which the pool keeps for as long as the
                // region views live.
                unsafe { DeviceBuffer::borrowed(device, slab.pointer() + (index * region_bytes) as u64, region_bytes) }
            })
            .collect();
        Self::with_regions(device, map, regions, Some(slab))
    }

    /// A pool of one region per layer and part, in layer-major order (layer 0's K, layer 0's V, layer 1's K, ...; MLA:
    /// one per layer), each `[slot][item]` for the map's slots: an engine's per-layer tensors as
    /// [`DeviceBuffer::borrowed`] views, or allocations of hicache's.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `device_regions` when there are not layers × parts regions or one is
    /// smaller than the map's slots × item bytes; the driver's.
    pub fn per_layer(device: &Device, map: &DeviceLayoutMap, regions: Vec<DeviceBuffer>) -> Result<Self, Error> {
        let (wanted, bytes) = (region_count(map), region_bytes(map));
        if regions.len() != wanted {
            return Err(Error::InvalidArgument {
                field: "device_regions",
                reason: format!("{} regions given; the map has {wanted} (layers × parts)", regions.len()),
            });
        }
        if let Some((index, region)) = regions.iter().enumerate().find(|(_, region)| region.len() < bytes) {
            return Err(Error::InvalidArgument {
                field: "device_regions",
                reason: format!(
                    "region {index} is {} bytes; {} slots of {} bytes need {bytes}",
                    region.len(),
                    map.slots(),
                    map.geometry().item_bytes()
                ),
            });
        }
        Self::with_regions(device, map, regions, None)
    }

    /// A pool of separate zeroed allocations, one per layer and part (tests and benchmarks of per-layer pools).
    ///
    /// # Errors
    ///
    /// The driver's (out of memory).
    pub fn zeroed_per_layer(device: &Device, map: &DeviceLayoutMap) -> Result<Self, Error> {
        let regions = (0..region_count(map))
            .map(|_| DeviceBuffer::zeroed(device, region_bytes(map)))
            .collect::<Result<Vec<_>, _>>()?;
        Self::per_layer(device, map, regions)
    }

    fn with_regions(
        device: &Device,
        map: &DeviceLayoutMap,
        regions: Vec<DeviceBuffer>,
        slab: Option<DeviceBuffer>,
    ) -> Result<Self, Error> {
        let bases: Vec<u8> = regions.iter().flat_map(|region| region.pointer().to_le_bytes()).collect();
        let table = DeviceBuffer::zeroed(device, bases.len())?;
        table.write(0, &bases)?;
        Ok(Self { regions, region_bytes: region_bytes(map), parts: map.geometry().parts().len(), table, slab })
    }

    /// Whether the pool is one slab.
    pub fn is_slab(&self) -> bool {
        self.slab.is_some()
    }

    /// Bytes of the pool (all regions).
    pub fn len(&self) -> usize {
        self.regions.len() * self.region_bytes
    }

    /// Whether the pool is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The region of `layer` and part number `part` (its place in the geometry's parts: K 0, V 1; MLA's latent 0).
    ///
    /// # Panics
    ///
    /// When the layer or part is out of range (a caller bug).
    pub fn region(&self, layer: usize, part: usize) -> &DeviceBuffer {
        assert!(part < self.parts, "part {part} of a pool of {} parts per layer", self.parts);
        &self.regions[layer * self.parts + part]
    }

    /// The device address of the table of region bases (u64 each, layer-major).
    pub(crate) fn table_pointer(&self) -> u64 {
        self.table.pointer()
    }

    /// The device address of `slot`'s item (of `item_bytes`) of `layer` and part number `part`.
    pub(crate) fn address(&self, slot: usize, layer: usize, part: usize, item_bytes: usize) -> u64 {
        self.region(layer, part).pointer() + (slot * item_bytes) as u64
    }

    /// Whether every region starts on a 16-byte boundary.
    pub(crate) fn aligned_16(&self) -> bool {
        self.regions.iter().all(|region| region.pointer().is_multiple_of(16))
    }

    /// Copies `data` into the pool at slab offset `offset` (tests and set-up; synchronous).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] beyond the end; the driver's.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), Error> {
        self.pieces(offset, data.len(), |region, within, range| self.regions[region].write(within, &data[range]))
    }

    /// Copies the pool at slab offset `offset` into `out` (tests; synchronous).
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), Error> {
        let regions = &self.regions;
        let mut pieces = Vec::new();
        self.pieces(offset, out.len(), |region, within, range| {
            pieces.push((region, within, range));
            Ok(())
        })?;
        for (region, within, range) in pieces {
            regions[region].read(within, &mut out[range])?;
        }
        Ok(())
    }

    /// Splits `len` bytes at slab offset `offset` by region: (region, offset in it, range of the caller's bytes).
    fn pieces(
        &self,
        offset: usize,
        len: usize,
        mut each: impl FnMut(usize, usize, std::ops::Range<usize>) -> Result<(), Error>,
    ) -> Result<(), Error> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::InvalidArgument {
                field: "offset",
                reason: format!("{len} bytes at {offset} run past the device pool's {}", self.len()),
            });
        }
        let mut done = 0;
        while done < len {
            let at = offset + done;
            let (region, within) = (at / self.region_bytes, at % self.region_bytes);
            let take = (self.region_bytes - within).min(len - done);
            each(region, within, done..done + take)?;
            done += take;
        }
        Ok(())
    }
}

fn region_count(map: &DeviceLayoutMap) -> usize {
    map.geometry().layers * map.geometry().parts().len()
}

fn region_bytes(map: &DeviceLayoutMap) -> usize {
    map.slots() * map.geometry().item_bytes()
}
