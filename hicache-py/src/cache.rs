//! The whole cache for a PyTorch engine (`hicache._native.Cache`, wrapped by `hicache.Cache`): the tree, its
//! controller, the host pool and a storage tier over the engine's own device KV tensors, on the CPU engine (CPU
//! tensors) or, with the `cuda` feature, the CUDA engine (CUDA tensors).
//!
//! The engine lends its per-layer K and V tensors (or MLA latent tensors) by address; the cache keeps the slot
//! allocator of that pool ([`PagedSlots`]): the engine asks it for the slots of new tokens ([`Cache::alloc`]), and
//! evictions and inserts give slots back to it. A load back to the device returns a [`Load`] whose `wait_layer`
//! makes the engine wait for one layer: on the GPU its stream waits on the layer's event (the CPU goes on); on the
//! CPU engine copies happen when submitted, so the wait returns at once.
//!
//! Like the storage backend's, the methods that take addresses are the private half of the package:
//! `hicache.cache` passes them the addresses of slot tensors it has checked (contiguous, int64, on the CPU); the
//! values are checked here. Slots go back to Python as the bytes of an int64 array. Token ids come as [`Tokens`]
//! (converted once, for a request's several calls) or as Python lists of ints (converted at each call; pyo3 names
//! the argument of one that is not in `[0, 2^32)`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use hicache_core::DeviceSlot;
use hicache_core::collective::SingleRank;
use hicache_core::config::HiCacheConfig;
use hicache_core::controller::PrefetchHead;
use hicache_core::device_slots::{DeviceSlotAllocator, PagedSlots};
use hicache_core::geometry::KvGeometry;
use hicache_core::host_memory::HostMemory;
use hicache_core::layout::HostLayoutMap;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::transfer::{
    Completion, CpuEngine, CpuEvent, DeviceLayoutMap, DeviceRegions, LayerDoneCounter, TransferEngine, TransferEvent,
};
use hicache_core::tree::NodeId;
use hicache_core::tree::{HiRadixTree, PrefetchCheck};
use hicache_core::{Error, HiCacheBuilder};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyList};
use serde::Deserialize;

use crate::backend::PySettings;
use crate::guard;

/// How long `alloc` waits for device → host copies to be acked before it gives up (they take milliseconds).
const ACK_DEADLINE: Duration = Duration::from_secs(60);

/// What the Python side says of the engine's device KV.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KvDescription {
    geometry: KvGeometry,
    /// Token slots of each tensor.
    slots: usize,
    /// `cpu`, or the CUDA device's ordinal.
    cuda_device: Option<usize>,
    /// The tensors' first bytes, in the device map's order (layer 0's K, layer 0's V, ...; one latent per layer).
    addresses: Vec<usize>,
    /// The engine's compute stream (a `CUstream`), which backups wait for; 0 for the default stream.
    #[serde(default)]
    #[cfg_attr(not(feature = "cuda"), expect(dead_code, reason = "the CPU engine's copies happen when submitted"))]
    stream: usize,
}

/// The engine's CPU tensors, as the CPU engine's device regions.
#[derive(Debug)]
struct TensorRegions {
    addresses: Vec<usize>,
    len: usize,
}

impl DeviceRegions for TensorRegions {
    fn region(&mut self, index: usize) -> &mut [u8] {
        // SAFETY: `hicache.cache` checked each tensor (CPU, contiguous, `len` bytes); the `Cache` keeps the tensors
        // alive (`keepalive`) as long as the engine that holds these regions, and the CPU engine reaches them only
        // under its device lock, during the calls of the thread that owns the cache, so no other reference of the
        // engine's is made meanwhile (the Python engine does not run while it is inside a cache call).
        unsafe { std::slice::from_raw_parts_mut(self.addresses[index] as *mut u8, self.len) }
    }
}

/// What differs between the engines a Python engine can lend tensors to.
trait Engine: TransferEngine + 'static {
    /// Makes the engine wait for `event` (one layer's load): the stream `stream` on the GPU, the thread on the CPU.
    fn wait_event(event: &Self::Event, stream: usize) -> Result<(), Error>;
}

impl Engine for CpuEngine {
    fn wait_event(event: &CpuEvent, _stream: usize) -> Result<(), Error> {
        event.wait()
    }
}

#[cfg(feature = "cuda")]
impl Engine for hicache_cuda::CudaEngine {
    fn wait_event(event: &hicache_cuda::CudaTransferEvent, stream: usize) -> Result<(), Error> {
        // SAFETY: the stream is torch's current stream, alive while the caller runs on it.
        event.make_wait(unsafe { hicache_cuda::StreamHandle::from_raw(stream as *mut std::ffi::c_void) })
    }
}

/// One engine's tree and what goes with it.
struct Inner<E: Engine> {
    tree: HiRadixTree<E>,
    slots: PagedSlots,
    storage: Option<Arc<dyn StorageBackend>>,
    page_size: usize,
    /// Nodes locked by loads not yet inserted or released, by handle.
    locked: HashMap<u64, NodeId>,
    next_handle: u64,
}

/// A match: device slots and host tokens.
type Matched = (Vec<DeviceSlot>, usize);

impl<E: Engine> Inner<E> {
    fn new(tree: HiRadixTree<E>, storage: Option<Arc<dyn StorageBackend>>) -> Result<Self, Error> {
        let map = tree.controller().engine().device_layout();
        let page_size = tree.page_size();
        let slots = PagedSlots::new(map.slots() / page_size, page_size)?;
        Ok(Self { tree, slots, storage, page_size, locked: HashMap::new(), next_handle: 1 })
    }

    fn match_prefix(&mut self, tokens: &[u32]) -> Matched {
        let matched = self.tree.match_prefix(tokens);
        (matched.device_slots, matched.host_hit_length)
    }

    /// Starts a prefetch of what lies beyond the device and host hit; whether one started.
    fn prefetch(&mut self, request: &str, tokens: &[u32]) -> Result<bool, Error> {
        let matched = self.tree.match_prefix(tokens);
        if matched.last_host_node != matched.last_node || self.storage.is_none() {
            return Ok(false);
        }
        let after = matched.device_slots.len() + matched.host_hit_length;
        let start = self.tree.prefetch_from_storage(request, matched.last_host_node, &tokens[after..])?;
        Ok(matches!(start, hicache_core::controller::PrefetchStart::Started(_)))
    }

    /// Ticks until `request`'s prefetch plan is known, or until `deadline`: the tokens at the start of the prefetch
    /// that the engine computes itself (a split's head; 0: none, or no plan by the deadline).
    fn plan_prefetch(&mut self, request: &str, deadline: Instant) -> Result<usize, Error> {
        loop {
            match self.tree.prefetch_head(request) {
                PrefetchHead::Compute(head) => return Ok(head),
                PrefetchHead::Nothing => return Ok(0),
                PrefetchHead::NotPlanned if Instant::now() >= deadline => return Ok(0),
                PrefetchHead::NotPlanned => {}
            }
            self.tree.tick(&mut SingleRank)?;
            std::thread::yield_now();
        }
    }

    /// For an engine that meets the reads: the tokens at the start of `request`'s prefetch not read yet (the engine
    /// meets the reads once it has computed them) and where the plan expects it to meet them; `None` when the reads
    /// are not (or no longer) under way. Ticks once first, so the reads' progress and results land.
    fn prefetch_meeting(&mut self, request: &str) -> Result<Option<(usize, usize)>, Error> {
        self.tree.tick(&mut SingleRank)?;
        Ok(self
            .tree
            .prefetch_meeting(request)
            .map(|meeting| (meeting.unread(meeting.arrived_tokens), meeting.planned_head_tokens)))
    }

    /// Ticks until `request`'s prefetch has joined the tree (true), or until `deadline` (false).
    fn wait_prefetch(&mut self, request: &str, deadline: Instant) -> Result<bool, Error> {
        loop {
            if self.tree.check_prefetch_progress(request) == PrefetchCheck::Ready {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            self.tree.tick(&mut SingleRank)?;
            std::thread::yield_now();
        }
    }

    /// Matches `tokens` and queues the load of the host part back into slots of the pool ([`start`](Self::start)
    /// submits it); the prefix's nodes stay locked under the returned handle until it is inserted or released.
    fn load(&mut self, tokens: &[u32]) -> Result<(u64, Vec<DeviceSlot>, usize), Error> {
        let matched = self.tree.match_prefix(tokens);
        let loaded = self.tree.load_back(matched.last_node, &mut self.slots)?;
        let locked = if loaded.is_empty() { matched.last_device_node } else { matched.last_node };
        self.tree.inc_lock_ref(locked)?;
        let handle = self.next_handle;
        self.next_handle += 1;
        self.locked.insert(handle, locked);
        let count = loaded.len();
        Ok((handle, [matched.device_slots, loaded].concat(), count))
    }

    /// Submits every queued load, layer by layer, as one batch; its per-layer events (none when nothing was queued).
    fn start(&mut self) -> Result<Vec<E::Event>, Error> {
        let consumer = self.tree.start_loading()?;
        let layers = self.tree.layers();
        layers.set_consumer(consumer);
        Ok(if consumer.is_some() { consumer_events(layers) } else { Vec::new() })
    }

    /// Slots for `tokens` new tokens, in whole pages, evicting least recently used pages when the pool is short. A
    /// page is evicted only once its copy on the host is acked, so when eviction frees too little while writes to
    /// the host are in flight, this ticks until they are acked (within `ACK_DEADLINE`) and evicts again.
    fn alloc(&mut self, tokens: usize) -> Result<Vec<DeviceSlot>, Error> {
        let pages = tokens.div_ceil(self.page_size);
        let deadline = Instant::now() + ACK_DEADLINE;
        loop {
            if let Some(slots) = self.slots.alloc_pages(pages) {
                return Ok(slots);
            }
            self.tree.evict(pages * self.page_size, &mut self.slots)?;
            if let Some(slots) = self.slots.alloc_pages(pages) {
                return Ok(slots);
            }
            let writes = self.tree.controller().outstanding().0;
            if writes == 0 {
                break;
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    backend: "host".into(),
                    operation: "alloc (waiting for writes to the host to be acked)",
                    waited_ms: ACK_DEADLINE.as_millis() as u64,
                });
            }
            self.tree.tick(&mut SingleRank)?;
            std::thread::yield_now();
        }
        Err(Error::InvalidArgument {
            field: "tokens",
            reason: format!(
                "{tokens} tokens need {pages} pages; {} of the device pool's {} are free after eviction (the rest \
                 are locked by requests in flight)",
                self.slots.free_pages(),
                self.slots.capacity()
            ),
        })
    }

    /// Inserts `tokens` with their slots (whole pages are cached; the slots beyond them go back to the pool), then
    /// unlocks `handle`'s prefix. Returns the tokens that were already on the device.
    fn insert(&mut self, handle: Option<u64>, tokens: &[u32], slots: &[DeviceSlot]) -> Result<usize, Error> {
        if slots.len() < tokens.len() || !slots.len().is_multiple_of(self.page_size) {
            return Err(Error::InvalidArgument {
                field: "slots",
                reason: format!(
                    "{} slots for {} tokens: give every slot of the request, whole pages of {}",
                    slots.len(),
                    tokens.len(),
                    self.page_size
                ),
            });
        }
        let node = handle.map(|handle| self.take_handle(handle)).transpose()?;
        let aligned = tokens.len() - tokens.len() % self.page_size;
        let inserted = self.tree.insert(&tokens[..aligned], &slots[..aligned], &mut self.slots);
        let freed = inserted.is_ok().then(|| self.slots.free(&slots[aligned..]));
        if let Some(node) = node {
            self.tree.dec_lock_ref(node)?;
        }
        freed.transpose()?;
        inserted
    }

    /// Slots of the device pool.
    fn pool_slots(&self) -> usize {
        self.tree.controller().engine().device_layout().slots()
    }

    fn take_handle(&mut self, handle: u64) -> Result<NodeId, Error> {
        self.locked.remove(&handle).ok_or_else(|| Error::InvalidArgument {
            field: "load",
            reason: format!("load {handle} was already inserted or released, or is from before a reset"),
        })
    }

    /// Unlocks `handle`'s prefix without inserting (a request dropped), and gives back `slots` (its new ones).
    fn release(&mut self, handle: u64, slots: &[DeviceSlot]) -> Result<(), Error> {
        let node = self.take_handle(handle)?;
        self.tree.dec_lock_ref(node)?;
        self.slots.free(slots)
    }

    fn reset(&mut self) {
        self.tree.reset();
        self.slots.clear();
        self.locked.clear();
    }

    fn stats(&self) -> serde_json::Value {
        let (evictable, protected) = self.tree.device_tokens();
        serde_json::json!({
            "tree": self.tree.stats(),
            "device_free_pages": self.slots.free_pages(),
            "device_pages": self.slots.capacity(),
            "device_evictable_tokens": evictable,
            "device_locked_tokens": protected,
            "host_free_pages": self.tree.controller().host().available(),
            "host_pages": self.tree.controller().host().capacity(),
            "storage": self.storage.as_ref().map(|storage| storage.stats()),
        })
    }
}

/// The consumer's per-layer events.
fn consumer_events<V: TransferEvent>(layers: &LayerDoneCounter<V>) -> Vec<V> {
    (0..).map_while(|layer| layers.consumer_event(layer).cloned()).collect()
}

/// The tree on one of the engines.
enum Tree {
    Cpu(Box<Inner<CpuEngine>>),
    #[cfg(feature = "cuda")]
    Cuda(Box<Inner<hicache_cuda::CudaEngine>>),
}

/// Runs `$body` with `$inner` the tree's `Inner`, whichever engine it is on.
macro_rules! each {
    ($tree:expr, $inner:ident => $body:expr) => {
        match $tree {
            Tree::Cpu($inner) => $body,
            #[cfg(feature = "cuda")]
            Tree::Cuda($inner) => $body,
        }
    };
}

/// Per-layer events of a load, on one of the engines.
enum Events {
    Cpu(Vec<CpuEvent>),
    #[cfg(feature = "cuda")]
    Cuda(Vec<hicache_cuda::CudaTransferEvent>),
}

/// The per-layer events of one batch of loads, set when the batch is started (every load queued since the last
/// start shares them: the batch's layer `i` is every one of its loads' layer `i`).
type Batch = Arc<OnceLock<Events>>;

/// The cache (`hicache._native.Cache`).
#[pyclass(frozen, module = "hicache._native", name = "Cache")]
pub(crate) struct Cache {
    /// `None` once closed.
    tree: Mutex<Option<Tree>>,
    /// The batch loads join until it is started.
    batch: Mutex<Batch>,
    closed: Arc<AtomicBool>,
    page_size: usize,
    layers: usize,
    /// The engine's tensors, kept alive while the engine uses them.
    _keepalive: Py<PyAny>,
}

/// A load back to the device (`hicache._native.Load`): the prefix's slots, and the per-layer waits.
#[pyclass(frozen, module = "hicache._native", name = "Load")]
pub(crate) struct Load {
    handle: u64,
    slots: Vec<DeviceSlot>,
    loaded: usize,
    events: Batch,
    closed: Arc<AtomicBool>,
}

fn closed_error() -> PyErr {
    PyValueError::new_err("hicache: the cache is closed")
}

/// Token ids converted once (`hicache._native.Tokens`): a request's match, load and insert take them without
/// converting a Python list again at each call.
#[pyclass(frozen, module = "hicache._native", name = "Tokens")]
pub(crate) struct Tokens {
    ids: Arc<[u32]>,
}

#[pymethods]
impl Tokens {
    /// The ids of a sequence of ints, each in `[0, 2^32)`.
    #[new]
    fn new(ids: Vec<u32>) -> Self {
        Self { ids: ids.into() }
    }

    /// The ids of a contiguous array of `length` integers of `width` bytes (4 or 8) at `address`.
    ///
    /// The address is the data of a live CPU tensor that `hicache.cache` checked (dtype, contiguity); each value is
    /// checked here.
    #[staticmethod]
    fn from_address(py: Python<'_>, address: usize, length: usize, width: usize) -> PyResult<Self> {
        if length == 0 {
            return Ok(Self { ids: Arc::from([]) });
        }
        let ids = py.detach(|| match width {
            // SAFETY: the method's contract (a checked int32 tensor of `length` elements).
            4 => Ok(unsafe { std::slice::from_raw_parts(address as *const u32, length) }.into()),
            // SAFETY: as above, int64.
            8 => unsafe { std::slice::from_raw_parts(address as *const i64, length) }
                .iter()
                .map(|&id| u32::try_from(id).map_err(|_| id))
                .collect::<Result<Arc<[u32]>, i64>>()
                .map_err(|id| PyValueError::new_err(format!("hicache: tokens: id {id} is not in [0, 2^32)"))),
            other => Err(PyValueError::new_err(format!("hicache: tokens: {other}-byte ids (4 or 8)"))),
        })?;
        Ok(Self { ids })
    }

    fn __len__(&self) -> usize {
        self.ids.len()
    }

    fn __repr__(&self) -> String {
        format!("Tokens(<{} ids>)", self.ids.len())
    }
}

/// Token ids from [`Tokens`] (shared, not copied), a list (read item by item: a third of pyo3's generic sequence
/// conversion) or any sequence of ints.
fn token_ids(tokens: &Bound<'_, PyAny>) -> PyResult<Arc<[u32]>> {
    if let Ok(tokens) = tokens.cast::<Tokens>() {
        return Ok(tokens.get().ids.clone());
    }
    if let Ok(list) = tokens.cast::<PyList>() {
        return list.iter().map(|id| id.extract::<u32>()).collect();
    }
    Ok(tokens.extract::<Vec<u32>>()?.into())
}

/// The slots of a contiguous int64 tensor of `length` elements at `address`, each checked to be a slot of a pool
/// of `pool` slots (named `slots` in the error).
///
/// # Safety
///
/// `address` is the data of a live, contiguous 8-byte integer array of at least `length` elements, not written
/// during the call.
unsafe fn read_slots(address: usize, length: usize, pool: usize) -> Result<Vec<DeviceSlot>, Error> {
    if length == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the function's contract.
    let values = unsafe { std::slice::from_raw_parts(address as *const i64, length) };
    values
        .iter()
        .map(|&slot| match usize::try_from(slot) {
            Ok(index) if index < pool => Ok(index as DeviceSlot),
            _ => {
                Err(Error::InvalidArgument { field: "slots", reason: format!("{slot} is out of range ({pool} slots)") })
            }
        })
        .collect()
}

/// Slots as the bytes of an int64 array (read in place with `torch.frombuffer`).
fn slot_bytes<'py>(py: Python<'py>, slots: &[DeviceSlot]) -> Bound<'py, PyByteArray> {
    let bytes: Vec<u8> = slots.iter().flat_map(|&slot| i64::from(slot).to_ne_bytes()).collect();
    PyByteArray::new(py, &bytes)
}

fn deadline(timeout_s: f64, field: &str) -> PyResult<Instant> {
    if !(timeout_s.is_finite() && (0.0..=86_400.0).contains(&timeout_s)) {
        return Err(PyValueError::new_err(format!("hicache: {field}: {timeout_s} is not in [0, 86400] seconds")));
    }
    Ok(Instant::now() + Duration::from_secs_f64(timeout_s))
}

impl Cache {
    fn with<T: Send>(&self, py: Python<'_>, body: impl Send + FnOnce(&mut Tree) -> Result<T, Error>) -> PyResult<T> {
        guard::run(|| {
            py.detach(|| {
                let mut tree = lock(&self.tree);
                let tree = tree.as_mut().ok_or_else(closed_error)?;
                body(tree).map_err(guard::to_py)
            })
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Builds the tree over `engine`, with the config's storage tier.
fn build<E: Engine>(
    config: HiCacheConfig,
    engine: E,
    storage: Option<Arc<dyn StorageBackend>>,
) -> Result<Inner<E>, Error> {
    let mut builder = HiCacheBuilder::new(config, engine);
    if let Some(storage) = &storage {
        builder = builder.with_storage(storage.clone());
    }
    Inner::new(builder.build()?, storage)
}

/// The `head_group` agreement of the config's extra config, under `key_scheme: "unified"`.
fn unified_head_group(config: &HiCacheConfig) -> PyResult<Option<usize>> {
    let Some(name) = &config.storage_backend else { return Ok(None) };
    let tier = hicache_core::storage::tiers::lookup("storage_backend", name).map_err(guard::config_to_py)?;
    let fields = hicache_core::extra_config::tier_fields(tier, config.storage_backend_extra_config.as_ref())
        .map_err(guard::config_to_py)?;
    let settings = hicache_core::extra_config::Settings::parse(&fields.to_string()).map_err(guard::config_to_py)?;
    Ok(settings.unified.and_then(|agreements| agreements.head_group).map(|group| group as usize))
}

/// The storage tier the config names (`storage_backend`, with SGLang's extra config keys in
/// `storage_backend_extra_config`), opened for this model's namespace.
fn open_storage(config: &HiCacheConfig, namespace: &StorageNamespace) -> PyResult<Option<Arc<dyn StorageBackend>>> {
    let Some(name) = &config.storage_backend else { return Ok(None) };
    // (a name no linked tier has, or a `backend` key naming another tier, was refused when the config was validated)
    let tier = hicache_core::storage::tiers::lookup("storage_backend", name).map_err(guard::config_to_py)?;
    let fields = hicache_core::extra_config::tier_fields(tier, config.storage_backend_extra_config.as_ref())
        .map_err(guard::config_to_py)?;
    let settings = PySettings::new(&fields.to_string())?;
    // one process holds every layer: the last (and only) stage
    Ok(Some(Arc::from(settings.open_rank(namespace, (0, true))?)))
}

#[pymethods]
impl Cache {
    /// The cache over the engine's device KV (`kv`: JSON of [`KvDescription`]), from `config` (JSON of
    /// `HiCacheConfig`'s fields); `keepalive` holds the engine's tensors.
    #[new]
    fn new(py: Python<'_>, config: &str, kv: &str, keepalive: Py<PyAny>) -> PyResult<Self> {
        guard::run(|| {
            let mut config = HiCacheConfig::from_json(config).map_err(guard::to_py)?;
            // a page_unified pool cut by the unified key scheme's agreement when the config names no head_group
            if config.head_group.is_none() {
                config.head_group = unified_head_group(&config)?;
            }
            let kv: KvDescription =
                serde_json::from_str(kv).map_err(|error| PyValueError::new_err(format!("hicache: kv: {error}")))?;
            let geometry = kv.geometry.validated().map_err(guard::to_py)?;
            let page_size = config.page_size;
            if kv.slots < page_size {
                return Err(PyValueError::new_err(format!(
                    "hicache: kv: {} slots hold no whole page of {page_size}",
                    kv.slots
                )));
            }
            // whole pages of the tensors; a tail shorter than a page is never used
            let device_map = DeviceLayoutMap::new(geometry, kv.slots - kv.slots % page_size).map_err(guard::to_py)?;
            let host_tokens =
                config.host_pool_tokens(device_map.slots(), geometry.bytes_per_token()).map_err(guard::to_py)?;
            let head_groups = config.head_groups(&geometry).map_err(guard::to_py)?;
            let host_map = HostLayoutMap::new(geometry, config.mem_layout, page_size, host_tokens / page_size)
                .and_then(|map| map.with_head_groups(head_groups))
                .map_err(guard::to_py)?;
            let model = config.model_name.clone().unwrap_or_else(|| "default".into());
            let namespace = StorageNamespace {
                head_groups,
                ..StorageNamespace::single_rank(model, geometry, config.mem_layout, page_size)
            };
            let storage = py.detach(|| open_storage(&config, &namespace))?;
            let host = Arc::new(HostMemory::anonymous(host_map).map_err(guard::to_py)?);
            let tree = match kv.cuda_device {
                None => {
                    let regions =
                        TensorRegions { addresses: kv.addresses, len: device_map.slots() * geometry.item_bytes() };
                    let engine =
                        CpuEngine::with_device_regions(device_map, Box::new(regions), host, Completion::Immediate)
                            .map_err(guard::to_py)?;
                    Tree::Cpu(Box::new(build(config, engine, storage).map_err(guard::to_py)?))
                }
                #[cfg(feature = "cuda")]
                Some(ordinal) => Tree::Cuda(Box::new(cuda_tree(config, ordinal, &kv, device_map, host, storage)?)),
                #[cfg(not(feature = "cuda"))]
                Some(_) => {
                    return Err(PyValueError::new_err(
                        "hicache: kv: CUDA tensors, but this build of hicache has no CUDA engine (build it with the \
                         `cuda` feature)",
                    ));
                }
            };
            Ok(Self {
                tree: Mutex::new(Some(tree)),
                batch: Mutex::new(Arc::new(OnceLock::new())),
                closed: Arc::new(AtomicBool::new(false)),
                page_size,
                layers: geometry.layers,
                _keepalive: keepalive,
            })
        })
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.page_size
    }

    /// Whether the cache runs on the CUDA engine.
    #[getter]
    fn on_cuda(&self) -> PyResult<bool> {
        let tree = lock(&self.tree);
        match tree.as_ref().ok_or_else(closed_error)? {
            Tree::Cpu(_) => Ok(false),
            #[cfg(feature = "cuda")]
            Tree::Cuda(_) => Ok(true),
        }
    }

    /// The matched prefix of the tokens: its device slots (int32 bytes) and the tokens after them on the host.
    fn match_prefix<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyByteArray>, usize)> {
        let tokens = token_ids(tokens)?;
        let (slots, host) = self.with(py, |tree| Ok(each!(tree, inner => inner.match_prefix(&tokens))))?;
        Ok((slot_bytes(py, &slots), host))
    }

    /// Starts a prefetch from storage of what lies beyond the device and host hit of the tokens; whether one
    /// started (not without storage, for a rest below the threshold, or while one runs for the request).
    fn prefetch(&self, py: Python<'_>, request: &str, tokens: &Bound<'_, PyAny>) -> PyResult<bool> {
        let tokens = token_ids(tokens)?;
        self.with(py, |tree| each!(tree, inner => inner.prefetch(request, &tokens)))
    }

    /// The engine computed `tokens` after a prefix of `prefix` tokens in `seconds`: its prefill, which the cache
    /// weighs against bringing pages from storage (until it is told, a storage hit is read to measure the tier).
    fn observe_prefill(&self, py: Python<'_>, tokens: usize, prefix: usize, seconds: f64) -> PyResult<()> {
        let elapsed = std::time::Duration::try_from_secs_f64(seconds)
            .map_err(|_| PyValueError::new_err(format!("hicache: `seconds` {seconds} is not a duration")))?;
        self.with(py, |tree| {
            each!(tree, inner => inner.tree.observe_prefill(tokens, prefix, elapsed));
            Ok(())
        })
    }

    /// Waits (ticking) until `request`'s prefetch plan is known; returns the tokens at its start that the engine
    /// computes itself (a split, config `prefetch_split`), 0 for none (or no plan by the timeout).
    fn plan_prefetch(&self, py: Python<'_>, request: &str, timeout_s: f64) -> PyResult<usize> {
        let deadline = deadline(timeout_s, "timeout")?;
        self.with(py, |tree| each!(tree, inner => inner.plan_prefetch(request, deadline)))
    }

    /// For an engine that meets the reads (config `prefetch_meet`): `(unread, planned)` while `request`'s reads run
    /// from the end, `None` otherwise. `unread`: the tokens from the prefetch's start up to the first read (the engine
    /// computes up to there, then calls `meet_prefetch`); `planned`: where the plan expects the two to meet.
    fn prefetch_meeting(&self, py: Python<'_>, request: &str) -> PyResult<Option<(usize, usize)>> {
        self.with(py, |tree| each!(tree, inner => inner.prefetch_meeting(request)))
    }

    /// The engine computed (and inserted) `request`'s tokens up to the pages read from the end: the reads stop, and
    /// the pages read join the tree below its compute at the next tick. False when its reads are not under way.
    fn meet_prefetch(&self, py: Python<'_>, request: &str) -> PyResult<bool> {
        self.with(py, |tree| Ok(each!(tree, inner => inner.tree.meet_prefetch(request))))
    }

    /// Waits (ticking) until `request`'s prefetch has joined the tree: true, or false at the timeout.
    fn wait_prefetch(&self, py: Python<'_>, request: &str, timeout_s: f64) -> PyResult<bool> {
        let deadline = deadline(timeout_s, "timeout")?;
        self.with(py, |tree| each!(tree, inner => inner.wait_prefetch(request, deadline)))
    }

    /// Queues the load of what of the tokens' prefix is on the host back to the device; `start_load` submits it
    /// (so the engine can first put what its forward pass needs on the device, ahead of the copies).
    fn load(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<Load> {
        let tokens = token_ids(tokens)?;
        let (handle, slots, loaded) = self.with(py, |tree| each!(tree, inner => inner.load(&tokens)))?;
        let events = lock(&self.batch).clone();
        Ok(Load { handle, slots, loaded, events, closed: self.closed.clone() })
    }

    /// Submits every load queued since the last start, layer by layer, on hicache's streams.
    fn start_load(&self, py: Python<'_>) -> PyResult<()> {
        let mut batch = lock(&self.batch);
        let events = self.with(py, |tree| {
            Ok(match tree {
                Tree::Cpu(inner) => Events::Cpu(inner.start()?),
                #[cfg(feature = "cuda")]
                Tree::Cuda(inner) => Events::Cuda(inner.start()?),
            })
        })?;
        let _ = batch.set(events);
        *batch = Arc::new(OnceLock::new());
        Ok(())
    }

    /// Slots (int64 bytes) for `tokens` new tokens, in whole pages; evicts when the pool is short.
    fn alloc<'py>(&self, py: Python<'py>, tokens: usize) -> PyResult<Bound<'py, PyByteArray>> {
        let slots = self.with(py, |tree| each!(tree, inner => inner.alloc(tokens)))?;
        Ok(slot_bytes(py, &slots))
    }

    /// Inserts the tokens with their slots (an int64 array: address, length), whole pages cached, the other slots
    /// given back; unlocks `load`'s prefix. Returns the tokens that were on the device already.
    #[pyo3(signature = (load, tokens, slots, slot_count))]
    fn insert(
        &self,
        py: Python<'_>,
        load: Option<PyRef<'_, Load>>,
        tokens: &Bound<'_, PyAny>,
        slots: usize,
        slot_count: usize,
    ) -> PyResult<usize> {
        let tokens = token_ids(tokens)?;
        let handle = load.map(|load| load.handle);
        self.with(py, |tree| {
            each!(tree, inner => {
                // SAFETY: the module's contract: a checked int64 tensor, alive for the call.
                let slots = unsafe { read_slots(slots, slot_count, inner.pool_slots()) }?;
                inner.insert(handle, &tokens, &slots)
            })
        })
    }

    /// Unlocks `load`'s prefix without inserting, and gives back `slots` (int64: address, length).
    fn release(&self, py: Python<'_>, load: PyRef<'_, Load>, slots: usize, slot_count: usize) -> PyResult<()> {
        let handle = load.handle;
        self.with(py, |tree| {
            each!(tree, inner => {
                // SAFETY: as in `insert`.
                let slots = unsafe { read_slots(slots, slot_count, inner.pool_slots()) }?;
                inner.release(handle, &slots)
            })
        })
    }

    /// One scheduler step: acks, backups to storage, finished prefetches. Returns counters of what it did.
    fn tick(&self, py: Python<'_>) -> PyResult<HashMap<&'static str, usize>> {
        let summary = self.with(py, |tree| each!(tree, inner => inner.tree.tick(&mut SingleRank)))?;
        Ok(HashMap::from([
            ("writes_acked", summary.writes_acked),
            ("writes_failed", summary.writes_failed),
            ("loads_acked", summary.loads_acked),
            ("pages_backed_up", summary.pages_backed_up),
            ("pages_backup_failed", summary.pages_backup_failed),
            ("prefetches", summary.prefetches.len()),
        ]))
    }

    /// Evicts at least `tokens` device tokens (least recently used first); returns the tokens evicted.
    fn evict(&self, py: Python<'_>, tokens: usize) -> PyResult<usize> {
        self.with(py, |tree| each!(tree, inner => inner.tree.evict(tokens, &mut inner.slots)))
    }

    /// Evicts at least `tokens` host tokens that storage (or the device) still holds; returns the tokens evicted.
    fn evict_host(&self, py: Python<'_>, tokens: usize) -> PyResult<usize> {
        self.with(py, |tree| each!(tree, inner => inner.tree.evict_host(tokens)))
    }

    /// Ticks until every host write is acked and every backup to storage done; `TimeoutError` at the timeout.
    fn drain(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let deadline = deadline(timeout_s, "timeout")?;
        self.with(py, |tree| each!(tree, inner => inner.tree.drain(&mut SingleRank, deadline, &mut |_| {})))
    }

    /// Empties the device and host tiers (storage keeps its pages); loads not yet inserted are forgotten.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |tree| {
            each!(tree, inner => inner.reset());
            Ok(())
        })
    }

    /// Counters and occupancy, as JSON.
    fn stats(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |tree| Ok(each!(tree, inner => inner.stats()).to_string()))
    }

    /// Closes the cache: its backups are abandoned, later calls raise `ValueError`.
    fn close(&self, py: Python<'_>) {
        self.closed.store(true, Ordering::Release);
        let tree = lock(&self.tree).take();
        py.detach(move || drop(tree));
    }

    /// Layers of the model.
    #[getter]
    fn layers(&self) -> usize {
        self.layers
    }
}

#[pymethods]
impl Load {
    /// The prefix's device slots (int64 bytes): those that were on the device, then those loaded.
    fn slots<'py>(&self, py: Python<'py>) -> Bound<'py, PyByteArray> {
        slot_bytes(py, &self.slots)
    }

    /// Tokens loaded back from the host.
    #[getter]
    fn loaded(&self) -> usize {
        self.loaded
    }

    /// Makes the engine wait until layer `layer` is loaded: on the GPU, `stream` (a `CUstream`) waits for it and the
    /// CPU goes on; on the CPU engine it is loaded already.
    fn wait_layer(&self, py: Python<'_>, layer: usize, stream: usize) -> PyResult<()> {
        guard::run(|| {
            if self.closed.load(Ordering::Acquire) {
                return Err(closed_error());
            }
            match self.events.get() {
                None if self.loaded == 0 => Ok(()),
                None => Err(PyValueError::new_err("hicache: load: not started (Cache.start_load)")),
                Some(Events::Cpu(events)) => match events.get(layer) {
                    Some(event) => py.detach(|| CpuEngine::wait_event(event, stream)).map_err(guard::to_py),
                    None => check_layer(layer, events.len()),
                },
                #[cfg(feature = "cuda")]
                Some(Events::Cuda(events)) => match events.get(layer) {
                    Some(event) => hicache_cuda::CudaEngine::wait_event(event, stream).map_err(guard::to_py),
                    None => check_layer(layer, events.len()),
                },
            }
        })
    }

    /// The number of layers the load waits can name (0 before it is started or when nothing was loaded).
    #[getter]
    fn layers(&self) -> usize {
        match self.events.get() {
            None => 0,
            Some(Events::Cpu(events)) => events.len(),
            #[cfg(feature = "cuda")]
            Some(Events::Cuda(events)) => events.len(),
        }
    }
}

/// A load of nothing has no events: every layer is ready; a layer beyond a load's is an error.
fn check_layer(layer: usize, layers: usize) -> PyResult<()> {
    if layers == 0 {
        return Ok(());
    }
    Err(PyValueError::new_err(format!("hicache: layer: {layer} out of range ({layers} layers)")))
}

#[cfg(feature = "cuda")]
fn cuda_tree(
    config: HiCacheConfig,
    ordinal: usize,
    kv: &KvDescription,
    device_map: DeviceLayoutMap,
    host: Arc<HostMemory>,
    storage: Option<Arc<dyn StorageBackend>>,
) -> PyResult<Inner<hicache_cuda::CudaEngine>> {
    use hicache_cuda::{CudaEngine, Device, DeviceBuffer, DevicePool, StreamHandle};
    let device = Device::open(ordinal).map_err(guard::to_py)?;
    let len = device_map.slots() * device_map.geometry().item_bytes();
    let views = kv
        .addresses
        .iter()
        // SAFETY: `hicache.cache` checked each tensor (on this GPU, contiguous, `len` bytes); the `Cache` keeps them
        // alive as long as the engine.
        .map(|&address| unsafe { DeviceBuffer::borrowed(&device, address as u64, len) })
        .collect();
    let pool = DevicePool::per_layer(&device, &device_map, views).map_err(guard::to_py)?;
    let mut engine = CudaEngine::with_device_regions(&device, device_map, pool, host).map_err(guard::to_py)?;
    engine.set_io_backend(config.io_backend, None).map_err(guard::to_py)?;
    // SAFETY: the engine's compute stream, which the Python engine keeps for the cache's life (documented).
    engine.set_caller_stream(unsafe { StreamHandle::from_raw(kv.stream as *mut std::ffi::c_void) });
    build(config, engine, storage).map_err(guard::to_py)
}
