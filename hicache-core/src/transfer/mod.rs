//! Device↔host transfers: what the controller needs from a device, and the device pool's byte map.
//!
//! A [`TransferEngine`] copies whole pages between the device KV pool (L1) and the host pool (L2): a **host write**
//! copies every layer of some device slots into host pages (device → host), a **layer load** copies one layer of
//! host pages into device slots (host → device), so the model can use layer *i* while later layers are still in
//! flight. Each returns a [`TransferEvent`] that can be queried without blocking and waited on. A **start event**,
//! recorded on the caller's stream before a transfer is submitted, orders the transfer after the caller's earlier
//! work (the KV a host write reads was written by earlier kernels; the slots a load writes were freed by earlier ones).
//!
//! Slots and pages pair up in order: host page `i` ↔ device slots `[i·P, (i+1)·P)`. The CPU engine
//! ([`CpuEngine`]) does real copies between plain memory buffers: it is the embedded default (no GPU) and the
//! reference the CUDA engine is tested against.

mod copies;
mod cpu;
mod layer_counter;

pub use cpu::{Completion, CopyStats, CpuEngine, CpuEvent, DeviceRegions, Stream};
pub use layer_counter::{LayerDoneCounter, ProducerSlot, SlotBusy, SlotReuse};

use crate::device_slots::DeviceSlot;
use crate::error::Error;
use crate::geometry::{KvGeometry, KvPart};
use crate::host_pool::HostPageId;

/// Completion of a submitted transfer (or of the caller's work, for a start event).
pub trait TransferEvent: Clone + Send + Sync + std::fmt::Debug {
    /// Whether the work is done (or failed), without blocking.
    fn is_complete(&self) -> bool;

    /// Blocks until the work is done.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the transfer failed: the bytes it was to move are unspecified, and the controller never
    /// treats its pages as copied.
    fn wait(&self) -> Result<(), Error>;

    /// Seconds from `start`'s completion to this event's, both complete, where the engine times its events (see
    /// [`TransferEngine::times_loads`]); `None` where it does not.
    fn seconds_since(&self, start: &Self) -> Option<f64> {
        let _ = start;
        None
    }
}

/// Moves pages between the device pool and the host pool.
pub trait TransferEngine: Send {
    /// The engine's completion event.
    type Event: TransferEvent;

    /// The host pool's memory, which the storage tier's I/O threads lend pages of
    /// ([`HostMemory`](crate::host_memory::HostMemory)). The engine's own copies use the same bytes.
    fn host_memory(&self) -> std::sync::Arc<crate::host_memory::HostMemory>;

    /// The device pool's map (geometry and slots), whatever its allocation.
    fn device_layout(&self) -> DeviceLayoutMap;

    /// Whether a load's duration can be read from its events: the start event and the last layer's event of
    /// [`load_layers`](Self::load_layers) give it through [`TransferEvent::seconds_since`]. The controller then reports
    /// every load to the cost model itself (the engine's loads need no timing by the caller); otherwise the caller
    /// reports them ([`CacheController::observe_load`](crate::controller::CacheController::observe_load)) or the
    /// model keeps the config's prior.
    fn times_loads(&self) -> bool {
        false
    }

    /// An event recorded on the caller's stream now: a transfer given it as `after` starts only once the caller's
    /// work submitted before it is done.
    ///
    /// # Errors
    ///
    /// [`Error::Device`] when the device cannot record it.
    fn start_event(&mut self) -> Result<Self::Event, Error>;

    /// Copies every layer of `slots` into `pages` (device → host), after `after`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the slots are not `page_size` per page or a slot or page is out of range;
    /// nothing is copied then.
    fn write_to_host(
        &mut self,
        slots: &[DeviceSlot],
        pages: &[HostPageId],
        after: &Self::Event,
    ) -> Result<Self::Event, Error>;

    /// Copies layer `layer` of `pages` into `slots` (host → device), after `after`.
    ///
    /// # Errors
    ///
    /// As [`write_to_host`](Self::write_to_host), and for a layer out of range.
    fn load_layer(
        &mut self,
        layer: usize,
        pages: &[HostPageId],
        slots: &[DeviceSlot],
        after: &Self::Event,
    ) -> Result<Self::Event, Error>;

    /// Loads layers `0..layers` of `pages` into `slots`, in layer order, one event per layer (what a producer slot
    /// of the forward pass needs): event `i` completes once layer `i` is loaded (not necessarily the layers before
    /// it), the last one once every layer is. The default calls [`load_layer`](Self::load_layer) per layer; an engine that can
    /// share work between the layers (checking and uploading the indices once) overrides it.
    ///
    /// # Errors
    ///
    /// As [`load_layer`](Self::load_layer); layers already submitted stay submitted.
    fn load_layers(
        &mut self,
        layers: usize,
        pages: &[HostPageId],
        slots: &[DeviceSlot],
        after: &Self::Event,
    ) -> Result<Vec<Self::Event>, Error> {
        (0..layers).map(|layer| self.load_layer(layer, pages, slots, after)).collect()
    }
}

/// The device pool's byte map: SGLang's device KV pool keeps, per layer, a K and a V buffer (MHA) or one latent
/// buffer (MLA) of `slots` items each; here they are laid out one after another, `[layer][part][slot][item]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLayoutMap {
    geometry: KvGeometry,
    slots: usize,
}

impl DeviceLayoutMap {
    /// A map of `slots` token slots.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `slots` is zero, does not fit a [`DeviceSlot`], or the size overflows.
    pub fn new(geometry: KvGeometry, slots: usize) -> Result<Self, Error> {
        let geometry = geometry.validated()?;
        if slots == 0 || DeviceSlot::try_from(slots - 1).is_err() {
            return Err(Error::InvalidArgument { field: "slots", reason: format!("{slots} is not in [1, 2^32]") });
        }
        slots.checked_mul(geometry.bytes_per_token()).filter(|&bytes| bytes <= isize::MAX as usize).ok_or_else(
            || Error::InvalidArgument { field: "slots", reason: format!("{slots} slots overflow the address space") },
        )?;
        Ok(Self { geometry, slots })
    }

    /// The geometry.
    pub const fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// Token slots.
    pub const fn slots(&self) -> usize {
        self.slots
    }

    /// Size of the whole pool.
    pub const fn total_bytes(&self) -> usize {
        self.slots * self.geometry.bytes_per_token()
    }

    /// Byte offset of one item.
    ///
    /// # Panics
    ///
    /// When the slot, layer or part is out of range (a caller bug).
    pub fn item_offset(&self, slot: usize, layer: usize, part: KvPart) -> usize {
        assert!(slot < self.slots, "device slot {slot} out of range ({} slots)", self.slots);
        assert!(layer < self.geometry.layers, "layer {layer} out of range ({} layers)", self.geometry.layers);
        let parts = self.geometry.parts();
        assert!(parts.contains(&part), "part {part:?} is not in a {:?} pool", self.geometry.attention);
        ((layer * parts.len() + part.index()) * self.slots + slot) * self.geometry.item_bytes()
    }
}
