//! The cache controller: moves pages between the device pool (L1) and the host pool (L2) on a transfer engine,
//! and keeps the acks the prefix tree collects (SGLang's `HiCacheController`, docs/sglang.md#device-host).
//!
//! * [`write`](CacheController::write) backs device slots up to newly allocated host pages at once (all layers, one
//!   transfer); the host pages are *protected* until the write is acked.
//! * [`load`](CacheController::load) allocates device slots for host pages and queues the copy;
//!   [`start_loading`](CacheController::start_loading) merges every queued load into one transfer with one event
//!   per layer, in a producer slot of the [`LayerDoneCounter`], and returns the slot for the forward pass.
//! * Acks are collected in submission order: [`completed_writes`](CacheController::completed_writes) counts the
//!   leading finished ones without blocking (the number TP ranks reduce with MIN), and
//!   [`take_write_acks`](CacheController::take_write_acks) takes that many. Host pages become *synced* when their
//!   copy is acked, not when it is enqueued (SGLang marks them at enqueue: docs/sglang.md#fixed-15).
//! * [`reset`](CacheController::reset) waits for every transfer in flight, then clears queues, acks, slots and both
//!   allocators and restarts the ids: nothing stale survives it (docs/sglang.md#fixed-14).
//!
//!
//! With a storage tier ([`with_storage`](CacheController::with_storage)), a write given page keys goes on to storage
//! when it is acked, whatever the write policy (SGLang's `write_back` never reaches storage: docs/sglang.md#fixed-3);
//! its host pages stay *pinned* (not evictable) until the backup is done. The storage half is a type of its own
//! (`tier.rs`); prefetches are in `prefetch.rs` and `reserve.rs`, the per-tick TP reduction in `tick.rs`, the I/O
//! threads in `storage.rs`, and what the engine is told (the typed [`StorageFailure`]) in `outcome.rs`.

mod hit_query;
mod operation;
mod outcome;
mod prefetch;
mod progress;
mod release;
mod reserve;
mod storage;
mod tick;
mod tier;

use std::collections::VecDeque;
use std::sync::Arc;

use crate::cost::Rates;
use crate::device_slots::DeviceSlot;
use crate::error::Error;
use crate::hash::PageKey;
use crate::host_memory::{Access, HostMemory};
use crate::host_pool::{HostPageAllocator, HostPageId, PageState};
use crate::rate_limit::{Clock, PrefetchCapacity};
use crate::storage::StorageBackend;
use crate::transfer::{LayerDoneCounter, ProducerSlot, SlotBusy, SlotReuse, TransferEngine, TransferEvent};
use tier::{Pool, StorageTier};

pub use hit_query::{HitQuery, storage_hit_query, storage_hit_query_with};
pub use operation::{CacheOperation, NodeId, OpId, OpIds};
pub use outcome::{PageBackup, PrefetchExplanation, PrefetchStop, StorageFailure};
pub use prefetch::{Meeting, PrefetchDone, PrefetchHead, PrefetchStart};
pub use progress::{Progress, Terminated};
pub use release::{Release, ReleaseLedger};
pub use storage::{DEFAULT_TICK_SLOTS, StorageSettings, Trailing};
pub use tick::{PausedTick, TickProgress, TickReport};

fn lent_error(page: HostPageId, how: Access, operation: &'static str) -> Error {
    Error::PageState {
        page: page.to_string(),
        operation,
        expected: "not lent to a storage thread".into(),
        found: match how {
            Access::Write => "lent for writing (a fetch)".into(),
            Access::Read => "lent for reading (a backup)".into(),
        },
    }
}

/// A finished (or finishing) transfer: its event and the tree nodes whose data it moved.
#[derive(Clone, Debug)]
pub struct Ack<E> {
    /// Fires when the transfer is done.
    pub finish: E,
    /// The tree nodes of the merged operations.
    pub node_ids: Vec<NodeId>,
    /// The host pages the transfer used.
    pub host_pages: Vec<HostPageId>,
    /// The backup to storage this write started when it was acked, if it had keys and there is a storage tier.
    pub storage_op: Option<OpId>,
    /// Why the transfer failed, when it did (a write: its host pages were freed, never marked synced).
    pub failed: Option<Error>,
    /// The events of a load's layers before the last (`finish`); empty for a write. A load failed if any did.
    pub layer_events: Vec<E>,
    /// A load's start event, kept where the engine times its loads: with `finish`, how long the load took.
    pub start: Option<E>,
}

/// A backup to storage finished on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct BackupReport {
    /// The operation.
    pub op: OpId,
    /// The tree nodes whose pages it wrote.
    pub node_ids: Vec<NodeId>,
    /// The host pages (unpinned now).
    pub host_pages: Vec<HostPageId>,
    /// Each page's outcome on this rank.
    pub pages: Vec<PageBackup>,
}

#[derive(Debug)]
struct PendingWrite<E> {
    ack: Ack<E>,
    keys: Option<Vec<PageKey>>,
    /// Per page, whether the trailing-window pools' entries are held (empty: every page's are).
    trailing: Vec<bool>,
}

/// The controller's L1↔L2 half.
#[derive(Debug)]
pub struct CacheController<E: TransferEngine> {
    engine: E,
    /// The engine's host memory, whose leases the controller checks before it starts a transfer or frees a page.
    memory: Arc<HostMemory>,
    page_size: usize,
    host: HostPageAllocator,
    ids: OpIds,
    load_queue: Vec<CacheOperation>,
    write_acks: VecDeque<PendingWrite<E::Event>>,
    load_acks: VecDeque<Ack<E::Event>>,
    layers: LayerDoneCounter<E::Event>,
    layer_count: usize,
    storage: Option<StorageTier>,
}

impl<E: TransferEngine> CacheController<E> {
    /// A controller over `engine`, with `host_pages` host pages and a device pool of `device_pages` pages (the
    /// engine's; it allocates their slots itself: [`crate::device_slots`]) of `page_size` tokens and `layers`
    /// layers.
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
        let memory = engine.host_memory();
        Ok(Self {
            host: memory.allocator_of(host_pages)?,
            memory,
            engine,
            page_size,
            ids: OpIds::default(),
            load_queue: Vec::new(),
            write_acks: VecDeque::new(),
            load_acks: VecDeque::new(),
            layers: LayerDoneCounter::new(),
            layer_count: layers,
            storage: None,
        })
    }

    /// Adds a storage tier: starts its I/O threads, which the engine's [`host_memory`](TransferEngine::host_memory)
    /// lends host pages to in place, and tells the backend about that memory once. `clock` times prefetches (the
    /// `timeout` policy).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the settings' page size differs from the controller's, a batch is empty,
    /// the prefetch capacity is zero, or a trailing window comes with `by_cost`, `split` or `meet` (naming
    /// `trailing`); [`Error::Internal`] when a thread cannot start.
    pub fn with_storage(
        mut self,
        storage: Arc<dyn StorageBackend>,
        settings: StorageSettings,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, Error> {
        if settings.page_size != self.page_size {
            return Err(Error::InvalidArgument {
                field: "page_size",
                reason: format!("storage settings say {}, the controller {}", settings.page_size, self.page_size),
            });
        }
        if settings.batch_pages == 0 || settings.tick_slots == 0 {
            return Err(Error::InvalidArgument {
                field: "batch_pages",
                reason: "storage batches and tick slots must be at least 1".into(),
            });
        }
        if settings.trailing.is_some() && (settings.by_cost || settings.split || settings.meet) {
            // a shorter prefix than the agreed one need not end where a window is held: such a hit is read whole
            return Err(Error::InvalidArgument {
                field: "trailing",
                reason: "a trailing window's hits are fetched whole: by_cost, split and meet must be off".into(),
            });
        }
        if let Some(namespace) = storage.namespace() {
            namespace.check_pages(self.memory.map())?;
        }
        self.storage = Some(StorageTier::start(storage, self.memory.clone(), settings, clock)?);
        Ok(self)
    }

    /// The page size in tokens.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The engine computed `tokens` after a prefix of `prefix` tokens in `elapsed` (its prefill, for the cost model
    /// that decides how much of a storage hit to fetch: [`crate::cost`]). Without a storage tier nothing is kept.
    pub fn observe_prefill(&mut self, tokens: usize, prefix: usize, elapsed: std::time::Duration) {
        if let Some(storage) = &mut self.storage {
            storage.cost.observe_prefill(tokens, prefix, elapsed);
        }
    }

    /// A load of `bytes` from the host to the device took `elapsed` (for the cost model).
    pub fn observe_load(&mut self, bytes: u64, elapsed: std::time::Duration) {
        if let Some(storage) = &mut self.storage {
            storage.cost.observe_load(bytes, elapsed);
        }
    }

    /// The rates every TP rank agreed on at the last tick, which prefetch plans use; `None` without storage.
    pub fn agreed_rates(&self) -> Option<Rates> {
        self.storage.as_ref().map(|storage| storage.agreed)
    }

    /// Whether a storage tier is attached.
    pub fn has_storage(&self) -> bool {
        self.storage.is_some()
    }

    /// The trailing window of the storage tier's settings ([`StorageSettings::trailing`]), `None` without a tier or
    /// without a window.
    pub fn trailing(&self) -> Option<Trailing> {
        self.storage.as_ref().and_then(|storage| storage.settings.trailing)
    }

    /// The prefetch capacity account (tokens held by prefetches, and the limit).
    pub fn prefetch_capacity(&self) -> Option<&PrefetchCapacity> {
        self.storage.as_ref().map(|storage| &storage.capacity)
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

    /// Backs `device_slots` up to new host pages now (one all-layer transfer); `None` when the host pool is full.
    /// With `keys` (one per page) and a storage tier, the pages go on to storage once the write is acked.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for slots that are not whole pages or keys that are not one per page; the engine's
    /// errors (nothing is allocated then).
    pub fn write(
        &mut self,
        device_slots: &[DeviceSlot],
        node_id: NodeId,
        keys: Option<&[PageKey]>,
    ) -> Result<Option<Vec<HostPageId>>, Error> {
        self.write_held(device_slots, node_id, keys, &[])
    }

    /// [`write`](Self::write) of a node of a model with a [trailing window](Trailing): its backup to storage is
    /// [`backup_held`](Self::backup_held) with `trailing`.
    ///
    /// # Errors
    ///
    /// As [`write`](Self::write).
    pub fn write_held(
        &mut self,
        device_slots: &[DeviceSlot],
        node_id: NodeId,
        keys: Option<&[PageKey]>,
        trailing: &[bool],
    ) -> Result<Option<Vec<HostPageId>>, Error> {
        if !device_slots.len().is_multiple_of(self.page_size) {
            return Err(Error::InvalidArgument {
                field: "device_slots",
                reason: format!("{} slots are not whole pages of {}", device_slots.len(), self.page_size),
            });
        }
        if let Some(keys) = keys
            && keys.len() * self.page_size != device_slots.len()
        {
            return Err(Error::InvalidArgument {
                field: "keys",
                reason: format!("{} keys for {} pages", keys.len(), device_slots.len() / self.page_size),
            });
        }
        let Some(host_pages) = self.host.alloc(device_slots.len() / self.page_size) else { return Ok(None) };
        let submitted = tier::unlent(&self.memory, &host_pages, "write").and_then(|()| {
            let start = self.engine.start_event()?;
            self.engine.write_to_host(device_slots, &host_pages, &start)
        });
        let finish = match submitted {
            Ok(finish) => finish,
            Err(error) => {
                self.host.free(&host_pages)?;
                return Err(error);
            }
        };
        self.host.protect_write(&host_pages)?;
        self.ids.next_id();
        let ack = Ack {
            finish,
            node_ids: vec![node_id],
            host_pages: host_pages.clone(),
            storage_op: None,
            failed: None,
            layer_events: Vec::new(),
            start: None,
        };
        self.write_acks.push_back(PendingWrite {
            ack,
            keys: keys.map(<[PageKey]>::to_vec),
            trailing: trailing.to_vec(),
        });
        Ok(Some(host_pages))
    }

    /// Queues the load of `host_pages` (backed-up pages) into `device_slots`, slots the caller took from the engine's
    /// allocator (`page_size` per page, whole aligned pages, one page per host page).
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] when a host page is not backed up; [`Error::InvalidArgument`] for slots that are not one
    /// whole page per host page. Nothing is queued then.
    pub fn load(
        &mut self,
        host_pages: &[HostPageId],
        device_slots: &[DeviceSlot],
        node_id: NodeId,
        priority: Option<i64>,
    ) -> Result<(), Error> {
        crate::device_slots::check_pages(device_slots, self.page_size)?;
        if device_slots.len() != host_pages.len() * self.page_size {
            return Err(Error::InvalidArgument {
                field: "device_slots",
                reason: format!(
                    "{} slots for {} host pages of {}",
                    device_slots.len(),
                    host_pages.len(),
                    self.page_size
                ),
            });
        }
        self.host.expect_state(host_pages, "load", crate::host_pool::PageState::Backup)?;
        tier::unlent_for_writing(&self.memory, host_pages, "load")?;
        self.host.protect_load(host_pages)?;
        let id = self.ids.next_id();
        let op =
            CacheOperation::new(id, host_pages.to_vec(), device_slots.to_vec(), self.page_size, node_id, priority)?;
        self.load_queue.push(op);
        Ok(())
    }

    /// Starts every queued load as one transfer, one event per layer, in the next producer slot; returns the slot
    /// for [`LayerDoneCounter::set_consumer`], or `None` when nothing was queued.
    ///
    /// # Errors
    ///
    /// `Ok(Err(SlotBusy))` with [`SlotReuse::Refuse`] when the next slot's last load is still in flight (the
    /// queue is kept); `Err` for the engine's errors.
    pub fn start_loading(&mut self, reuse: SlotReuse) -> Result<Result<Option<ProducerSlot>, SlotBusy>, Error> {
        if self.load_queue.is_empty() {
            return Ok(Ok(None));
        }
        let slot = match self.layers.begin_producer(reuse) {
            Ok(slot) => slot,
            Err(busy) => return Ok(Err(busy)),
        };
        let op = CacheOperation::merge(std::mem::take(&mut self.load_queue)).expect("the queue is not empty");
        let start = self.engine.start_event()?;
        let events = self.engine.load_layers(self.layer_count, &op.host_pages, &op.device_slots, &start)?;
        let finish = events.last().expect("at least one layer").clone();
        let layer_events = events[..events.len() - 1].to_vec();
        self.layers.set_layer_events(slot, events);
        self.load_acks.push_back(Ack {
            finish,
            node_ids: op.node_ids,
            host_pages: op.host_pages,
            storage_op: None,
            failed: None,
            layer_events,
            start: self.engine.times_loads().then_some(start),
        });
        Ok(Ok(Some(slot)))
    }

    /// Writes whose transfer is done, counted from the oldest and stopping at the first still in flight.
    pub fn completed_writes(&self) -> usize {
        self.write_acks.iter().take_while(|write| write.ack.finish.is_complete()).count()
    }

    /// Loads whose transfer is done, counted from the oldest and stopping at the first still in flight.
    pub fn completed_loads(&self) -> usize {
        self.load_acks.iter().take_while(|ack| ack.finish.is_complete()).count()
    }

    /// Takes the `count` oldest write acks (after a TP MIN of [`completed_writes`](Self::completed_writes); the
    /// [`tick`](Self::tick) does both); their host pages become synced, and those written with keys start their
    /// backup to storage. An ack another rank finished first is waited for.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] when more acks are asked for than were submitted.
    pub fn take_write_acks(&mut self, count: usize) -> Result<Vec<Ack<E::Event>>, Error> {
        if count > self.write_acks.len() {
            return Err(Error::Internal(format!("{count} write acks asked for, {} submitted", self.write_acks.len())));
        }
        let writes: Vec<PendingWrite<E::Event>> = self.write_acks.drain(..count).collect();
        let mut acks = Vec::with_capacity(writes.len());
        for PendingWrite { mut ack, keys, trailing } in writes {
            if let Err(error) = ack.finish.wait() {
                // the host pages hold unspecified bytes: never synced, never backed up; they go back to the pool
                tracing::error!(nodes = ?ack.node_ids, "a device → host write failed: {error}");
                self.host.free(&ack.host_pages)?;
                ack.failed = Some(error);
                acks.push(ack);
                continue;
            }
            self.host.complete_io(&ack.host_pages)?;
            if let Some(keys) = keys {
                ack.storage_op = self.backup_held(&ack.host_pages, keys, ack.node_ids.clone(), &trailing)?;
            }
            acks.push(ack);
        }
        Ok(acks)
    }

    /// Waits for every write in flight and takes all acks: what `write_back` eviction needs before it drops the
    /// device copy. Every rank has the same writes queued, so the count needs no collective.
    ///
    /// # Errors
    ///
    /// As [`take_write_acks`](Self::take_write_acks).
    pub fn take_all_write_acks(&mut self) -> Result<Vec<Ack<E::Event>>, Error> {
        self.take_write_acks(self.write_acks.len())
    }

    /// Starts a backup of synced or backed-up host pages to storage and pins them until it is done; `None` without a
    /// storage tier. MLA ranks other than 0 skip the write and finish at once.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when there is not one key per page; [`Error::PageState`] for pages in other
    /// states.
    pub fn backup_to_storage(
        &mut self,
        host_pages: &[HostPageId],
        keys: Vec<PageKey>,
        node_ids: Vec<NodeId>,
    ) -> Result<Option<OpId>, Error> {
        self.backup_held(host_pages, keys, node_ids, &[])
    }

    /// [`backup_to_storage`](Self::backup_to_storage) of a node of a model with a [trailing window](Trailing):
    /// `trailing` says per page whether the trailing-window pools' entries at its end are held (a trailing-window
    /// pool's rank writes only those among the last `window` pages; empty: every page's are).
    ///
    /// # Errors
    ///
    /// As [`backup_to_storage`](Self::backup_to_storage).
    pub fn backup_held(
        &mut self,
        host_pages: &[HostPageId],
        keys: Vec<PageKey>,
        node_ids: Vec<NodeId>,
        trailing: &[bool],
    ) -> Result<Option<OpId>, Error> {
        let Some(storage) = &mut self.storage else { return Ok(None) };
        storage.backup(&self.host, &mut self.ids, host_pages, keys, node_ids, trailing).map(Some)
    }

    /// Backups to storage that are done, counted from the oldest and stopping at the first still running.
    pub fn completed_backups(&self) -> usize {
        self.storage.as_ref().map_or(0, StorageTier::completed_backups)
    }

    /// Takes the `count` oldest finished backups (after a TP MIN of [`completed_backups`](Self::completed_backups);
    /// the tick does both) and unpins their pages.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] when more are asked for than were submitted.
    pub fn take_backups(&mut self, count: usize) -> Result<Vec<BackupReport>, Error> {
        match &mut self.storage {
            Some(storage) => storage.take_backups(count),
            None if count == 0 => Ok(Vec::new()),
            None => Err(Error::Internal("no storage tier".into())),
        }
    }

    /// Backups to storage submitted and not yet taken.
    pub fn backups_in_flight(&self) -> usize {
        self.storage.as_ref().map_or(0, StorageTier::backups_in_flight)
    }

    /// Whether any of `host_pages` is being written to storage (and so cannot be evicted).
    pub fn is_pinned(&self, host_pages: &[HostPageId]) -> bool {
        self.storage.as_ref().is_some_and(|storage| storage.pinned(host_pages).is_some())
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
            // the engine timed the load on the device: the cost model learns the host → device rate from it
            if let Some(seconds) = ack.start.as_ref().and_then(|start| ack.finish.seconds_since(start)) {
                let bytes = (ack.host_pages.len() * self.memory.page_bytes()) as u64;
                self.observe_load(bytes, std::time::Duration::from_secs_f64(seconds));
            }
        }
        Ok(acks)
    }

    fn take(queue: &mut VecDeque<Ack<E::Event>>, count: usize, kind: &str) -> Result<Vec<Ack<E::Event>>, Error> {
        if count > queue.len() {
            return Err(Error::Internal(format!("{count} {kind} acks asked for, {} submitted", queue.len())));
        }
        let acks: Vec<Ack<E::Event>> = queue.drain(..count).collect();
        let mut failure = None;
        for ack in &acks {
            for event in ack.layer_events.iter().chain(std::iter::once(&ack.finish)) {
                if let Err(error) = event.wait() {
                    failure.get_or_insert(format!("the {kind} of nodes {:?} failed: {error}", ack.node_ids));
                }
            }
        }
        match failure {
            // their device copies are unspecified: the engine must not use them (a device fault; reset the cache)
            Some(message) => Err(Error::device("transfer", message)),
            None => Ok(acks),
        }
    }

    /// The device copy of synced pages was dropped (the caller gave its slots back to the engine's allocator): the
    /// host pages become the only copy above storage.
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] when a host page is not synced.
    pub fn evict_device(&mut self, host_pages: &[HostPageId]) -> Result<(), Error> {
        self.host.expect_state(host_pages, "evict_device", crate::host_pool::PageState::Synced)?;
        self.host.update_backup(host_pages)
    }

    /// Marks host pages synced again: their node got a fresh device copy (recomputed), so host and device agree.
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] for idle pages.
    pub fn host_resynced(&mut self, host_pages: &[HostPageId]) -> Result<(), Error> {
        self.host.update_synced(host_pages)
    }

    /// Frees host pages that are backed up and no longer on the device.
    ///
    /// # Errors
    ///
    /// [`Error::PageState`] when a page is not in the backup state or a backup to storage is reading it (nothing is
    /// freed then).
    pub fn evict_host(&mut self, host_pages: &[HostPageId]) -> Result<(), Error> {
        self.host.expect_state(host_pages, "evict_host", PageState::Backup)?;
        if let Some(page) = self.storage.as_ref().and_then(|storage| storage.pinned(host_pages)) {
            return Err(Error::PageState {
                page: page.to_string(),
                operation: "evict_host",
                expected: "not pinned by a backup to storage".into(),
                found: "pinned".into(),
            });
        }
        self.pool().free(host_pages)
    }

    /// The host pool as the storage tier's decisions see it.
    fn pool(&mut self) -> Pool<'_> {
        Pool { host: &mut self.host, memory: &self.memory, page_size: self.page_size }
    }

    /// Waits for every transfer in flight, stops every prefetch and backup and waits until the I/O threads are done
    /// with host memory, then clears queues, acks, producer slots, storage records and both allocators, and
    /// restarts operation ids. Storage keeps its pages.
    pub fn reset(&mut self) {
        // a quiesce: a failed transfer is as finished as a good one, and everything is cleared below
        for write in &self.write_acks {
            let _ = write.ack.finish.wait();
        }
        for ack in &self.load_acks {
            let _ = ack.finish.wait();
        }
        if let Some(storage) = &mut self.storage {
            storage.reset();
        }
        self.layers.reset();
        self.write_acks.clear();
        self.load_acks.clear();
        self.load_queue.clear();
        self.host.clear();
        self.ids.reset();
    }

    /// Transfers in flight or unacked: (writes, loads queued, loads started).
    pub fn outstanding(&self) -> (usize, usize, usize) {
        (self.write_acks.len(), self.load_queue.len(), self.load_acks.len())
    }
}
