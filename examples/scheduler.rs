//! The engine's side of the examples: its scheduler loop around the tree, the same on any transfer engine.
//!
//! For each request it:
//!
//! 1. matches the prompt against the tree (device and host hits);
//! 2. prefetches from storage what may lie beyond the host hit, ticking until the prefetch is done;
//! 3. loads the host part back to the device into slots from its own allocator (evicting if the pool is full), and
//!    runs the forward pass layer by layer, each layer as soon as its load has landed;
//! 4. prefills the rest into fresh slots, inserts the whole prompt, and unlocks it;
//! 5. ticks the cache once per step: writes to the host are acked and go on to storage.
//!
//! Halfway, the device and host tiers are emptied (as if other work had pushed the conversations out): the next turns
//! come back from storage. Every byte that comes back is checked against the KV the engine wrote.
//!
//! After each request the example waits for its backups to storage (an engine would go on at once): a host page is
//! pinned until its backup is done, so otherwise how much reaches the host, and then storage, would depend on how
//! fast the storage thread runs, and so would what the example prints.

use std::error::Error;
use std::sync::Arc;

use hicache_core::DeviceSlot;
use hicache_core::HiCacheBuilder;
use hicache_core::collective::SingleRank;
use hicache_core::config::{HiCacheConfig, PrefetchPolicy};
use hicache_core::controller::PrefetchStart;
use hicache_core::device_slots::{DeviceSlotAllocator, PagedSlots};
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::transfer::TransferEngine;
use hicache_core::tree::{HiRadixTree, PrefetchCheck};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

/// Tokens per page.
pub(crate) const PAGE: usize = 16;
/// Device pages.
pub(crate) const DEVICE_PAGES: usize = 96;
/// Host pages.
pub(crate) const HOST_PAGES: usize = 192;
const CLIENTS: u32 = 8;
const TURNS: usize = 6;
const TURN_TOKENS: usize = 80;

/// How the engine reaches the bytes of its device pool: it writes each prefill's KV there, and the example checks
/// what comes back. Offsets are the device map's (`item_offset`), whatever the pool's allocation.
pub(crate) trait DeviceKv: TransferEngine {
    /// Writes `bytes` at `offset`.
    fn write_kv(&self, offset: usize, bytes: &[u8]) -> Result<(), Box<dyn Error>>;
    /// Reads `len` bytes at `offset`.
    fn read_kv(&self, offset: usize, len: usize) -> Result<Vec<u8>, Box<dyn Error>>;
}

/// The model the examples serve: 4 layers, 2 KV heads of 64 dims, bf16.
pub(crate) fn geometry() -> Result<KvGeometry, Box<dyn Error>> {
    Ok(KvGeometry::mha(4, 2, 64, KvDtype::Bf16)?)
}

/// The cache over an engine's pools, with its L3.
pub(crate) struct Cache<E: TransferEngine> {
    pub(crate) tree: HiRadixTree<E>,
    pub(crate) storage: Arc<dyn StorageBackend>,
    /// Where the file tier keeps its pages (removed when the cache goes).
    _dir: tempfile::TempDir,
}

/// The cache over `engine`: L3 the file tier in a temporary directory, for this model's namespace; SGLang's defaults
/// at this page size, but prefetches that run to completion (SGLang's default, `best_effort`, stops a prefetch at the
/// first check, which an engine makes when it schedules the request). One entry point, [`HiCacheBuilder`], makes the
/// tree, its controller and the storage tier, sized from the engine's pools.
pub(crate) fn cache_over<E: TransferEngine>(engine: E) -> Result<Cache<E>, Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let namespace = StorageNamespace::single_rank("example-model", geometry()?, HostLayout::PageFirst, PAGE);
    let storage: Arc<dyn StorageBackend> =
        Arc::new(FileStorage::open(FileConfig::new(dir.path(), FileFormat::Native), &namespace)?);
    let config = HiCacheConfig {
        page_size: PAGE,
        mem_layout: HostLayout::PageFirst,
        prefetch_policy: PrefetchPolicy::WaitComplete,
        ..HiCacheConfig::default()
    };
    let tree = HiCacheBuilder::new(config, engine).with_storage(storage.clone()).build()?;
    Ok(Cache { tree, storage, _dir: dir })
}

/// Where a request's tokens came from.
#[derive(Default, Debug)]
struct Served {
    from_device: usize,
    from_host_or_storage: usize,
    computed: usize,
    checked_bytes: usize,
}

/// Runs the conversations through the tree; fails when a byte comes back wrong or a tier served nothing.
pub(crate) fn run<E: DeviceKv>(
    tree: &mut HiRadixTree<E>,
    slots: &mut PagedSlots,
    storage: &dyn StorageBackend,
) -> Result<(), Box<dyn Error>> {
    let mut total = Served::default();
    for turn in 0..TURNS {
        if turn == TURNS / 2 {
            push_everything_out(tree, slots)?;
        }
        for client in 0..CLIENTS {
            let prompt = conversation(client, turn);
            let served = serve(tree, slots, &prompt, &format!("c{client}t{turn}"))?;
            total.from_device += served.from_device;
            total.from_host_or_storage += served.from_host_or_storage;
            total.computed += served.computed;
            total.checked_bytes += served.checked_bytes;
        }
    }
    // let the last backups reach storage
    settle(tree)?;
    let stats = storage.stats();
    println!(
        "{} requests: {} tokens from the device, {} loaded back from the host or storage, {} computed; \
         {} bytes of cached KV checked",
        CLIENTS as usize * TURNS,
        total.from_device,
        total.from_host_or_storage,
        total.computed,
        total.checked_bytes
    );
    println!(
        "storage: {} pages written, {} pages read back ({} bytes)",
        stats.set_stored, stats.get_hits, stats.bytes_read
    );
    if stats.get_hits == 0 || total.from_device == 0 || total.from_host_or_storage == 0 {
        return Err("every tier should have served some tokens".into());
    }
    Ok(())
}

/// One request, as an engine's scheduler runs it.
fn serve<E: DeviceKv>(
    tree: &mut HiRadixTree<E>,
    slots: &mut PagedSlots,
    prompt: &[u32],
    id: &str,
) -> Result<Served, Box<dyn Error>> {
    // 1-2: match; fetch from storage what lies beyond the host hit (SGLang's prefetch), and wait for it
    let matched = tree.match_prefix(prompt);
    if matched.last_host_node == matched.last_node {
        let after = matched.device_slots.len() + matched.host_hit_length;
        if let PrefetchStart::Started(_) = tree.prefetch_from_storage(id, matched.last_host_node, &prompt[after..])? {
            // a scheduler would run other requests meanwhile; the prefetch's pages join the tree at a tick
            while tree.check_prefetch_progress(id) != PrefetchCheck::Ready {
                tree.tick(&mut SingleRank)?;
            }
        }
    }
    // 3: match again (the prefetch added host pages), load the host part back into slots of the engine's pool
    let matched = tree.match_prefix(prompt);
    let loaded = tree.load_back(matched.last_node, slots)?;
    let locked = if loaded.is_empty() { matched.last_device_node } else { matched.last_node };
    tree.inc_lock_ref(locked)?;
    let mut served = Served { from_device: matched.device_slots.len(), ..Served::default() };
    served.checked_bytes += check(tree.controller().engine(), prompt, 0, &matched.device_slots, None)?;
    if !loaded.is_empty() {
        let consumer = tree.start_loading()?;
        tree.layers().set_consumer(consumer);
        // the forward pass: each layer runs once its load event fired
        for layer in 0..tree.controller().engine().device_layout().geometry().layers {
            tree.layers().wait_until(layer)?;
            let start = matched.device_slots.len();
            served.checked_bytes += check(tree.controller().engine(), prompt, start, &loaded, Some(layer))?;
        }
        served.from_host_or_storage = loaded.len();
    }
    // 4: prefill the rest into fresh slots (evicting least recently used pages when the pool is full)
    let cached = matched.device_slots.len() + loaded.len();
    let pages = (prompt.len() - cached).div_ceil(PAGE);
    let fresh = match slots.alloc_pages(pages) {
        Some(fresh) => fresh,
        None => {
            tree.evict(pages * PAGE, slots)?;
            slots.alloc_pages(pages).ok_or("the device pool cannot hold the request")?
        }
    };
    write_kv(tree.controller().engine(), prompt, cached, &fresh)?;
    served.computed = prompt.len() - cached;
    let all: Vec<DeviceSlot> = [matched.device_slots.as_slice(), &loaded, &fresh].concat();
    let aligned = prompt.len() - prompt.len() % PAGE;
    tree.insert(&prompt[..aligned], &all[..aligned], slots)?;
    // the partial last page is not cached (SGLang drops it too): its slots go back to the engine's allocator
    slots.free(&all[aligned..])?;
    tree.dec_lock_ref(locked)?;
    // 5: one tick per step (and, for a run that does not depend on thread timing, the request's backups done)
    tree.tick(&mut SingleRank)?;
    settle(tree)?;
    Ok(served)
}

/// Ticks until every write to the host is acked and every backup to storage is done; an error after a minute.
fn settle<E: DeviceKv>(tree: &mut HiRadixTree<E>) -> Result<(), Box<dyn Error>> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    Ok(tree.drain(&mut SingleRank, deadline, &mut |_| {})?)
}

/// Evicts every unlocked page from the device and the host (once their backups to storage are done).
fn push_everything_out<E: DeviceKv>(tree: &mut HiRadixTree<E>, slots: &mut PagedSlots) -> Result<(), Box<dyn Error>> {
    settle(tree)?;
    tree.evict(DEVICE_PAGES * PAGE, slots)?;
    tree.evict_host(HOST_PAGES * PAGE)?;
    Ok(())
}

/// Client `client`'s prompt at `turn`: the whole conversation so far, `TURN_TOKENS` more per turn.
fn conversation(client: u32, turn: usize) -> Vec<u32> {
    (0..(turn + 1) * TURN_TOKENS).map(|position| client * 100_000 + position as u32).collect()
}

/// The KV of one token at one layer and part, as the model would compute it (a stand-in: a function of the token and
/// its position, so a misplaced byte shows).
fn kv_item(token: u32, position: usize, layer: usize, part: usize, bytes: usize) -> Vec<u8> {
    let mixed = (u64::from(token) << 20) ^ ((position as u64) << 8) ^ ((layer as u64) << 4) ^ part as u64;
    let seed = (mixed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8;
    (0..bytes).map(|offset| seed ^ offset as u8).collect()
}

/// Writes the KV of `prompt[start..]` into `slots` (the prefill).
fn write_kv<E: DeviceKv>(engine: &E, prompt: &[u32], start: usize, slots: &[DeviceSlot]) -> Result<(), Box<dyn Error>> {
    let map = engine.device_layout();
    let geometry = map.geometry();
    for (index, &slot) in slots.iter().enumerate().take(prompt.len() - start) {
        let position = start + index;
        for layer in 0..geometry.layers {
            for (part_index, &part) in geometry.parts().iter().enumerate() {
                let item = kv_item(prompt[position], position, layer, part_index, geometry.item_bytes());
                engine.write_kv(map.item_offset(slot as usize, layer, part), &item)?;
            }
        }
    }
    Ok(())
}

/// Checks the KV in `slots` of `prompt[start..]` (one layer, or all); returns the bytes checked.
fn check<E: DeviceKv>(
    engine: &E,
    prompt: &[u32],
    start: usize,
    slots: &[DeviceSlot],
    layer: Option<usize>,
) -> Result<usize, Box<dyn Error>> {
    let map = engine.device_layout();
    let geometry = map.geometry();
    let layers: Vec<usize> = layer.map_or_else(|| (0..geometry.layers).collect(), |layer| vec![layer]);
    let mut checked = 0;
    for (index, &slot) in slots.iter().enumerate() {
        let position = start + index;
        for &layer in &layers {
            for (part_index, &part) in geometry.parts().iter().enumerate() {
                let found = engine.read_kv(map.item_offset(slot as usize, layer, part), geometry.item_bytes())?;
                if found != kv_item(prompt[position], position, layer, part_index, geometry.item_bytes()) {
                    return Err(format!("token {position}, layer {layer}: wrong KV in slot {slot}").into());
                }
                checked += found.len();
            }
        }
    }
    Ok(checked)
}
