//! The cache controller: moves pages between the device pool (L1) and the host pool (L2) on a transfer engine,
//! and keeps the acks the prefix tree collects (SGLang's `HiCacheController`, spec §5).
//!
//! * [`write`](CacheController::write) backs device slots up to newly allocated host pages at once (all layers, one
//!   transfer); the host pages are *protected* until the write is acked.
//! * [`load`](CacheController::load) allocates device slots for host pages and queues the copy;
//!   [`start_loading`](CacheController::start_loading) merges every queued load into one transfer with one event
//!   per layer, in a producer slot of the [`LayerDoneCounter`], and returns the slot for the forward pass.
//! * Acks are collected in submission order: [`completed_writes`](CacheController::completed_writes) counts the
//!   leading finished ones without blocking (the number TP ranks reduce with MIN), and
//!   [`take_write_acks`](CacheController::take_write_acks) takes that many. Host pages become *synced* when their
//!   copy is acked, not when it is enqueued (SGLang marks them at enqueue: §17 item 15).
//! * [`reset`](CacheController::reset) waits for every transfer in flight, then clears queues, acks, slots and both
//!   allocators and restarts the ids: nothing stale survives it (§17 item 14).
//!
//! Storage (L2↔L3) prefetch and backup, write policies and TP lockstep live beside this and are built on it.

mod hit_query;
mod release;

use std::collections::VecDeque;

use crate::error::Error;
use crate::host_pool::{HostPageAllocator, HostPageId};
use crate::ops::{CacheOperation, DeviceSlot, NodeId, OpIds};
use crate::transfer::{LayerDoneCounter, SlotBusy, SlotReuse, TransferEngine, TransferEvent};

pub use hit_query::{HitQuery, storage_hit_query};
pub use release::{Release, ReleaseLedger};

/// A finished (or finishing) transfer: its event and the tree nodes whose data it moved.
#[derive(Clone, Debug)]
pub struct Ack<E> {
    /// Fires when the transfer is done.
    pub finish: E,
    /// The tree nodes of the merged operations.
    pub node_ids: Vec<NodeId>,
    /// The host pages the transfer used.
    pub host_pages: Vec<HostPageId>,
}

/// The controller's L1↔L2 half.
#[derive(Debug)]
pub struct CacheController<E: TransferEngine> {
    engine: E,
    page_size: usize,
    host: HostPageAllocator,
    /// Device pages: a device page `d` is slots `[d·P, (d+1)·P)`.
    device: HostPageAllocator,
    ids: OpIds,
    load_queue: Vec<CacheOperation>,
    write_acks: VecDeque<Ack<E::Event>>,
    load_acks: VecDeque<Ack<E::Event>>,
    layers: LayerDoneCounter<E::Event>,
    layer_count: usize,
}

impl<E: TransferEngine> CacheController<E> {
    /// A controller over `engine`, with `host_pages` host pages and `device_pages` device pages of `page_size`
    /// tokens and `layers` layers.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for zero sizes, or a host pool not larger than the device pool (SGLang's
    /// protocol needs room on the host for everything on the device).
    pub fn new(
        engine: E,
        page_size: usize,
        host_pages: usize,
        device_pages: usize,
        layers: usize,
    ) -> Result<Self, Error> {
        if page_size == 0 || layers == 0 {
            return Err(Error::InvalidArgument {
                field: "page_size",
                reason: "page size and layers must be at least 1".into(),
            });
        }
        if host_pages <= device_pages {
            return Err(Error::InvalidArgument {
                field: "host_pages",
                reason: format!(
                    "the host pool ({host_pages} pages) must be larger than the device pool ({device_pages})"
                ),
            });
        }
        Ok(Self {
            engine,
            page_size,
            host: HostPageAllocator::new(host_pages)?,
            device: HostPageAllocator::new(device_pages)?,
            ids: OpIds::default(),
            load_queue: Vec::new(),
            write_acks: VecDeque::new(),
            load_acks: VecDeque::new(),
            layers: LayerDoneCounter::new(),
            layer_count: layers,
        })
    }

    /// The engine.
    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// The host allocator (states of host pages).
    pub fn host(&self) -> &HostPageAllocator {
        &self.host
    }

    /// The layer-done counter the forward pass consumes.
    pub fn layers(&mut self) -> &mut LayerDoneCounter<E::Event> {
        &mut self.layers
    }

    /// Allocates `pages` device pages and returns their slots, `page_size` per page (the engine's own allocator
    /// in a real deployment; here, for the CPU engine and replays).
    pub fn alloc_device(&mut self, pages: usize) -> Option<Vec<DeviceSlot>> {
        let pages = self.device.alloc(pages)?;
        Some(self.device_slots(&pages))
    }

    fn device_slots(&self, pages: &[HostPageId]) -> Vec<DeviceSlot> {
        pages
            .iter()
            .flat_map(|page| {
                (0..self.page_size).map(move |offset| (page.index() * self.page_size + offset) as DeviceSlot)
            })
            .collect()
    }

    /// The device pages of whole-page slot runs.
    fn device_pages(&self, slots: &[DeviceSlot]) -> Result<Vec<HostPageId>, Error> {
        if !slots.len().is_multiple_of(self.page_size) {
            return Err(Error::InvalidArgument {
                field: "device_slots",
                reason: format!("{} slots are not whole pages of {}", slots.len(), self.page_size),
            });
        }
        slots
            .chunks(self.page_size)
            .map(|page| {
                let first = page[0] as usize;
                let aligned = first.is_multiple_of(self.page_size)
                    && page.iter().enumerate().all(|(offset, &slot)| slot as usize == first + offset);
                if !aligned {
                    return Err(Error::InvalidArgument {
                        field: "device_slots",
                        reason: format!("slots {page:?} are not one aligned device page"),
                    });
                }
                self.device.page_id(first / self.page_size)
            })
            .collect()
    }

    /// Frees device slots (whole pages).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for slots that are not whole aligned pages; [`Error::DoubleFree`] for free ones.
    pub fn free_device(&mut self, slots: &[DeviceSlot]) -> Result<(), Error> {
        let pages = self.device_pages(slots)?;
        self.device.free(&pages)
    }

    /// Backs `device_slots` up to new host pages now (one all-layer transfer); `None` when the host pool is full.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for slots that are not whole pages; the engine's errors (nothing is allocated then).
    pub fn write(&mut self, device_slots: &[DeviceSlot], node_id: NodeId) -> Result<Option<Vec<HostPageId>>, Error> {
        if !device_slots.len().is_multiple_of(self.page_size) {
            return Err(Error::InvalidArgument {
                field: "device_slots",
                reason: format!("{} slots are not whole pages of {}", device_slots.len(), self.page_size),
            });
        }
        let Some(host_pages) = self.host.alloc(device_slots.len() / self.page_size) else { return Ok(None) };
        let start = self.engine.start_event();
        let finish = match self.engine.backup(device_slots, &host_pages, &start) {
            Ok(finish) => finish,
            Err(error) => {
                self.host.free(&host_pages)?;
                return Err(error);
            }
        };
        self.host.protect_write(&host_pages)?;
        self.ids.next_id();
        self.write_acks.push_back(Ack { finish, node_ids: vec![node_id], host_pages: host_pages.clone() });
        Ok(Some(host_pages))
    }

    /// Allocates device slots for `host_pages` (backed-up pages) and queues their load; `None` when the device pool
    /// is full.
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] when a host page is not backed up (nothing is allocated then).
    pub fn load(
        &mut self,
        host_pages: &[HostPageId],
        node_id: NodeId,
        priority: Option<i64>,
    ) -> Result<Option<Vec<DeviceSlot>>, Error> {
        self.host.expect_state(host_pages, "load", crate::host_pool::PageState::Backup)?;
        let Some(device_pages) = self.device.alloc(host_pages.len()) else { return Ok(None) };
        let slots = self.device_slots(&device_pages);
        self.host.protect_load(host_pages)?;
        let id = self.ids.next_id();
        let op = CacheOperation::new(id, host_pages.to_vec(), slots.clone(), self.page_size, node_id, priority)?;
        self.load_queue.push(op);
        Ok(Some(slots))
    }

    /// Starts every queued load as one transfer, one event per layer, in the next producer slot; returns the slot
    /// for [`LayerDoneCounter::set_consumer`], or `None` when nothing was queued.
    ///
    /// # Errors
    ///
    /// `Ok(Err(SlotBusy))` with [`SlotReuse::Refuse`] when the next slot's last load is still in flight (the
    /// queue is kept); `Err` for the engine's errors.
    pub fn start_loading(&mut self, reuse: SlotReuse) -> Result<Result<Option<usize>, SlotBusy>, Error> {
        if self.load_queue.is_empty() {
            return Ok(Ok(None));
        }
        let slot = match self.layers.begin_producer(reuse) {
            Ok(slot) => slot,
            Err(busy) => return Ok(Err(busy)),
        };
        let op = CacheOperation::merge(std::mem::take(&mut self.load_queue)).expect("the queue is not empty");
        let start = self.engine.start_event();
        let mut events = Vec::with_capacity(self.layer_count);
        for layer in 0..self.layer_count {
            events.push(self.engine.load_layer(layer, &op.host_pages, &op.device_slots, &start)?);
        }
        let finish = events.last().expect("at least one layer").clone();
        self.layers.set_layer_events(slot, events);
        self.load_acks.push_back(Ack { finish, node_ids: op.node_ids, host_pages: op.host_pages });
        Ok(Ok(Some(slot)))
    }

    /// Writes whose transfer is done, counted from the oldest and stopping at the first still in flight.
    pub fn completed_writes(&self) -> usize {
        self.write_acks.iter().take_while(|ack| ack.finish.is_complete()).count()
    }

    /// Loads whose transfer is done, counted from the oldest and stopping at the first still in flight.
    pub fn completed_loads(&self) -> usize {
        self.load_acks.iter().take_while(|ack| ack.finish.is_complete()).count()
    }

    /// Takes the `count` oldest write acks (after a TP MIN of [`completed_writes`](Self::completed_writes)); their
    /// host pages become synced. An ack another rank finished first is waited for.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] when more acks are asked for than were submitted.
    pub fn take_write_acks(&mut self, count: usize) -> Result<Vec<Ack<E::Event>>, Error> {
        let acks = Self::take(&mut self.write_acks, count, "write")?;
        for ack in &acks {
            self.host.complete_io(&ack.host_pages)?;
        }
        Ok(acks)
    }

    /// Takes the `count` oldest load acks; their host pages become synced (host and device hold the same data).
    ///
    /// # Errors
    ///
    /// As [`take_write_acks`](Self::take_write_acks).
    pub fn take_load_acks(&mut self, count: usize) -> Result<Vec<Ack<E::Event>>, Error> {
        let acks = Self::take(&mut self.load_acks, count, "load")?;
        for ack in &acks {
            self.host.complete_io(&ack.host_pages)?;
        }
        Ok(acks)
    }

    fn take(queue: &mut VecDeque<Ack<E::Event>>, count: usize, kind: &str) -> Result<Vec<Ack<E::Event>>, Error> {
        if count > queue.len() {
            return Err(Error::Internal(format!("{count} {kind} acks asked for, {} submitted", queue.len())));
        }
        let acks: Vec<Ack<E::Event>> = queue.drain(..count).collect();
        for ack in &acks {
            ack.finish.wait();
        }
        Ok(acks)
    }

    /// Drops the device copy of synced pages: frees the slots; the host pages become the only copy above storage.
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] when a host page is not synced; slot errors as [`free_device`](Self::free_device).
    pub fn evict_device(&mut self, device_slots: &[DeviceSlot], host_pages: &[HostPageId]) -> Result<(), Error> {
        self.host.expect_state(host_pages, "evict_device", crate::host_pool::PageState::Synced)?;
        self.free_device(device_slots)?;
        self.host.update_backup(host_pages)
    }

    /// Frees host pages that are backed up and no longer on the device.
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] when a page is not in the backup state (nothing is freed then).
    pub fn evict_host(&mut self, host_pages: &[HostPageId]) -> Result<(), Error> {
        self.host.expect_state(host_pages, "evict_host", crate::host_pool::PageState::Backup)?;
        self.host.free(host_pages)
    }

    /// Waits for every transfer in flight, then clears queues, acks, producer slots and both allocators, and
    /// restarts operation ids.
    pub fn reset(&mut self) {
        for ack in self.write_acks.iter().chain(&self.load_acks) {
            ack.finish.wait();
        }
        self.layers.reset();
        self.write_acks.clear();
        self.load_acks.clear();
        self.load_queue.clear();
        self.host.clear();
        self.device.clear();
        self.ids.reset();
    }

    /// Transfers in flight or unacked: (writes, loads queued, loads started).
    pub fn outstanding(&self) -> (usize, usize, usize) {
        (self.write_acks.len(), self.load_queue.len(), self.load_acks.len())
    }
}
