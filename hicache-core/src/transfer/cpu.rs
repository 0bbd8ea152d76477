//! The CPU transfer engine: real copies between a device pool and a host pool held in plain memory.
//!
//! Two streams, as on the GPU: host writes run in order on the write stream, layer loads in order on the load stream.
//! In [`Completion::Immediate`] mode a copy happens when it is submitted. In [`Completion::Manual`] mode it happens
//! only when a test lets it ([`CpuEngine::complete_next`], [`CpuEngine::run_pending`]) or someone waits on its event,
//! so tests can hold transfers in flight deterministically: until then the destination keeps its old bytes, and a
//! reader that forgot to wait sees them.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use super::copies::{Runs, SegmentCopy, locate, spans};
use super::{DeviceLayoutMap, TransferEngine, TransferEvent};
use crate::device_slots::DeviceSlot;
use crate::error::Error;
use crate::host_memory::HostMemory;
use crate::host_pool::HostPageId;
use crate::layout::HostLayoutMap;

/// When submitted copies happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// At submission.
    Immediate,
    /// When stepped, run, or waited for.
    Manual,
}

/// A stream of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// Device → host writes.
    Write = 0,
    /// Host → device layer loads.
    Load = 1,
}

#[derive(Debug)]
enum Work {
    Write { slots: Vec<DeviceSlot>, pages: Vec<HostPageId> },
    LoadLayer { layer: usize, pages: Vec<HostPageId>, slots: Vec<DeviceSlot> },
}

#[derive(Debug)]
struct Job {
    seq: u64,
    after: Option<(Stream, u64)>,
    work: Work,
}

#[derive(Debug)]
struct State {
    device_map: DeviceLayoutMap,
    host_map: HostLayoutMap,
    memory: Arc<Memory>,
    queues: [VecDeque<Job>; 2],
    /// Per stream: the last sequence number submitted, and the last completed.
    submitted: [u64; 2],
    completed: [u64; 2],
    /// Per stream: jobs that are to fail (tests: [`CpuEngine::fail_next`]) and jobs that failed, by sequence number.
    doomed: [std::collections::BTreeSet<u64>; 2],
    failed: [std::collections::BTreeSet<u64>; 2],
    /// Scratch bitmap for duplicate checks, all zero between calls.
    seen: Vec<u64>,
    stats: CopyStats,
}

/// What the engine has copied: items, and the contiguous runs (one `memcpy` each) they merged into, per direction.
/// Items per run is what a GPU's copy engine would get per copy from the same pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CopyStats {
    /// Items written to host (device → host).
    pub write_items: u64,
    /// Runs they merged into.
    pub write_runs: u64,
    /// Items loaded (host → device).
    pub load_items: u64,
    /// Runs they merged into.
    pub load_runs: u64,
}

impl State {
    /// Runs `stream`'s jobs up to and including `seq`, each after its dependency.
    fn run_until(&mut self, stream: Stream, seq: u64) {
        while self.completed[stream as usize] < seq {
            let Some(job) = self.queues[stream as usize].pop_front() else { break };
            if let Some((other, after)) = job.after {
                self.run_until(other, after);
            }
            if self.doomed[stream as usize].remove(&job.seq) {
                // a failed copy moves nothing (a real one may have moved part of it: the bytes are unspecified)
                self.failed[stream as usize].insert(job.seq);
            } else {
                self.execute(&job.work);
            }
            self.completed[stream as usize] = job.seq;
        }
    }

    fn execute(&mut self, work: &Work) {
        let page_size = self.host_map.page_size();
        let geometry = *self.device_map.geometry();
        let (device_map, host_map) = (self.device_map, self.host_map);
        // the copy unit: an item, or one head group's row of it
        let (item, groups) = (host_map.row_bytes(), host_map.head_groups());
        let mut runs = Runs::new(item);
        let mut device = lock(&self.memory.device);
        let device = &mut *device;
        let host = &self.memory.host;
        match work {
            Work::Write { slots, pages } => {
                // like a DMA engine, the copy waits until no storage thread holds these pages
                let mut lease = host.lend_write_waiting(pages).expect("pages checked when submitted");
                let mut host_pages = lease.pages_mut();
                let mut copy = SegmentCopy::new(item, host_pages.first().map_or(item, |page| page[0].len()));
                let mut write = |from: usize, (index, flat): (usize, usize), len: usize| {
                    let (segment, at) = locate(&host_pages[index], flat);
                    device.read(from, &mut host_pages[index][segment][at..at + len]);
                };
                // layer and part outermost: consecutive pages of one layer merge into one run (`layer_first`)
                for layer in 0..geometry.layers {
                    for (&part, group) in geometry.parts().iter().flat_map(|part| (0..groups).map(move |g| (part, g))) {
                        for (index, (page, page_slots)) in pages.iter().zip(slots.chunks(page_size)).enumerate() {
                            for span in spans(device_map, host_map, page.index(), page_slots, (layer, part, group)) {
                                runs.push(span.device, span.host, span.items);
                                copy.push(span.device, index, span.flat, span.items * item, &mut write);
                            }
                        }
                    }
                }
                copy.flush(&mut write);
                runs.finish();
                self.stats.write_items += runs.items / groups as u64;
                self.stats.write_runs += runs.runs;
            }
            Work::LoadLayer { layer, pages, slots } => {
                let lease = host.lend_read_waiting(pages).expect("pages checked when submitted");
                let host_pages = lease.pages();
                let mut copy = SegmentCopy::new(item, host_pages.first().map_or(item, |page| page[0].len()));
                let mut read = |to: usize, (index, flat): (usize, usize), len: usize| {
                    let (segment, at) = locate(&host_pages[index], flat);
                    device.write(to, &host_pages[index][segment][at..at + len]);
                };
                for (&part, group) in geometry.parts().iter().flat_map(|part| (0..groups).map(move |g| (part, g))) {
                    for (index, (page, page_slots)) in pages.iter().zip(slots.chunks(page_size)).enumerate() {
                        for span in spans(device_map, host_map, page.index(), page_slots, (*layer, part, group)) {
                            runs.push(span.host, span.device, span.items);
                            copy.push(span.device, index, span.flat, span.items * item, &mut read);
                        }
                    }
                }
                copy.flush(&mut read);
                runs.finish();
                self.stats.load_items += runs.items / groups as u64;
                self.stats.load_runs += runs.runs;
            }
        }
    }
}

/// The pools' bytes: the device pool behind its own lock (the forward pass reads it while copies run), the host
/// pool lent page by page ([`HostMemory`]), so the storage tier's threads work on other pages meanwhile. Order: the
/// engine's state, then the device, then a lease.
#[derive(Debug)]
struct Memory {
    device: Mutex<DeviceBytes>,
    host: Arc<HostMemory>,
}

/// Device memory an engine owns and lends to the CPU engine: one region per layer and part, in the device map's
/// order (layer 0's K, layer 0's V, layer 1's K, ...; one latent region per layer for MLA), each `[slot][item]`, as
/// an engine keeps its per-layer K and V tensors in host memory (a PyTorch engine on the CPU, say).
pub trait DeviceRegions: Send + std::fmt::Debug {
    /// Region `index`, `slots × item_bytes` long. Called only under the engine's device lock, while it copies.
    fn region(&mut self, index: usize) -> &mut [u8];
}

/// The device pool's bytes: the engine's own buffer, or regions lent to it.
#[derive(Debug)]
enum DeviceBytes {
    Owned(Vec<u8>),
    Lent { regions: Box<dyn DeviceRegions>, region_len: usize },
}

impl DeviceBytes {
    /// Calls `copy(region bytes)` for each piece of `offset..offset + len` (a run of consecutive slots may continue
    /// from one region into the next in the map's order).
    fn pieces(&mut self, offset: usize, len: usize, mut copy: impl FnMut(&mut [u8], usize)) {
        match self {
            Self::Owned(bytes) => copy(&mut bytes[offset..offset + len], 0),
            Self::Lent { regions, region_len } => {
                let mut done = 0;
                while done < len {
                    let (index, at) = ((offset + done) / *region_len, (offset + done) % *region_len);
                    let piece = (len - done).min(*region_len - at);
                    copy(&mut regions.region(index)[at..at + piece], done);
                    done += piece;
                }
            }
        }
    }

    /// Copies `offset..offset + out.len()` into `out`.
    fn read(&mut self, offset: usize, out: &mut [u8]) {
        self.pieces(offset, out.len(), |piece, at| out[at..at + piece.len()].copy_from_slice(piece));
    }

    /// Copies `data` to `offset..`.
    fn write(&mut self, offset: usize, data: &[u8]) {
        self.pieces(offset, data.len(), |piece, at| piece.copy_from_slice(&data[at..at + piece.len()]));
    }
}

/// The CPU engine.
#[derive(Debug)]
pub struct CpuEngine {
    state: Arc<Mutex<State>>,
    completion: Completion,
}

/// An event of the CPU engine: a position on one of its streams (or none, for work already done).
#[derive(Clone, Debug)]
pub struct CpuEvent {
    state: Arc<Mutex<State>>,
    position: Option<(Stream, u64)>,
}

fn lock<T>(state: &Mutex<T>) -> MutexGuard<'_, T> {
    // every job runs to completion under the lock before its position is recorded, so a poisoned state is only ever
    // one whose last copy panicked midway: its bytes are as unspecified as an interrupted DMA's, its counters sound
    state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl TransferEvent for CpuEvent {
    fn is_complete(&self) -> bool {
        self.position.is_none_or(|(stream, seq)| lock(&self.state).completed[stream as usize] >= seq)
    }

    fn wait(&self) -> Result<(), Error> {
        if let Some((stream, seq)) = self.position {
            let mut state = lock(&self.state);
            state.run_until(stream, seq);
            if state.failed[stream as usize].contains(&seq) {
                return Err(Error::device(
                    "transfer",
                    format!("the {stream:?} stream's copy {seq} failed (injected by fail_next)"),
                ));
            }
        }
        Ok(())
    }
}

impl CpuEngine {
    /// An engine over a zeroed device pool of `device_map` and host pool of `host_map` (same geometry).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the two maps' geometries differ.
    pub fn new(device_map: DeviceLayoutMap, host_map: HostLayoutMap, completion: Completion) -> Result<Self, Error> {
        Self::with_host_memory(device_map, Arc::new(HostMemory::anonymous(host_map)?), completion)
    }

    /// An engine over a zeroed device pool of `device_map` and the caller's host memory (allocated as the caller
    /// chose: in shared memory, say).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the two pools' geometries differ.
    pub fn with_host_memory(
        device_map: DeviceLayoutMap,
        host: Arc<HostMemory>,
        completion: Completion,
    ) -> Result<Self, Error> {
        Self::over(device_map, DeviceBytes::Owned(vec![0; device_map.total_bytes()]), host, completion)
    }

    /// An engine over the caller's device regions ([`DeviceRegions`]: its per-layer K and V buffers) and host memory.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `device_regions` when a region is not `slots × item_bytes` long, or
    /// `host_map` when the two pools' geometries differ.
    pub fn with_device_regions(
        device_map: DeviceLayoutMap,
        mut regions: Box<dyn DeviceRegions>,
        host: Arc<HostMemory>,
        completion: Completion,
    ) -> Result<Self, Error> {
        let geometry = device_map.geometry();
        let region_len = device_map.slots() * geometry.item_bytes();
        for index in 0..geometry.layers * geometry.parts().len() {
            let len = regions.region(index).len();
            if len != region_len {
                return Err(Error::InvalidArgument {
                    field: "device_regions",
                    reason: format!("region {index} is {len} bytes; {} slots need {region_len}", device_map.slots()),
                });
            }
        }
        Self::over(device_map, DeviceBytes::Lent { regions, region_len }, host, completion)
    }

    fn over(
        device_map: DeviceLayoutMap,
        device: DeviceBytes,
        host: Arc<HostMemory>,
        completion: Completion,
    ) -> Result<Self, Error> {
        let host_map = *host.map();
        if device_map.geometry() != host_map.geometry() {
            return Err(Error::InvalidArgument {
                field: "host_map",
                reason: format!(
                    "geometry {:?} differs from the device pool's {:?}",
                    host_map.geometry(),
                    device_map.geometry()
                ),
            });
        }
        let memory = Memory { device: Mutex::new(device), host };
        let state = State {
            memory: Arc::new(memory),
            device_map,
            host_map,
            queues: [VecDeque::new(), VecDeque::new()],
            submitted: [0; 2],
            completed: [0; 2],
            doomed: Default::default(),
            failed: Default::default(),
            seen: Vec::new(),
            stats: CopyStats::default(),
        };
        Ok(Self { state: Arc::new(Mutex::new(state)), completion })
    }

    /// Runs `f` on the device pool's bytes (`[layer][part][slot][item]`, see [`DeviceLayoutMap`]). Over lent
    /// regions, `f` works on a copy of them, written back after it returns (for tests; the engine that lent them
    /// reaches them directly).
    pub fn with_device<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let (memory, len) = {
            let state = lock(&self.state);
            (state.memory.clone(), state.device_map.total_bytes())
        };
        let mut device = lock(&memory.device);
        match &mut *device {
            DeviceBytes::Owned(bytes) => f(bytes),
            lent => {
                let mut copy = vec![0; len];
                lent.read(0, &mut copy);
                let result = f(&mut copy);
                lent.write(0, &copy);
                result
            }
        }
    }

    /// Runs `f` on the host pool's bytes (in the host layout, see [`HostLayoutMap`]), once no page is lent.
    pub fn with_host<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let memory = lock(&self.state).memory.clone();
        memory.host.with_all_mut(f)
    }

    /// The device pool's map.
    pub fn device_map(&self) -> DeviceLayoutMap {
        lock(&self.state).device_map
    }

    /// The host pool's map.
    pub fn host_map(&self) -> HostLayoutMap {
        lock(&self.state).host_map
    }

    /// Copies submitted and not yet done, per stream (write, load).
    pub fn pending(&self) -> (usize, usize) {
        let state = lock(&self.state);
        (state.queues[0].len(), state.queues[1].len())
    }

    /// Completes the oldest pending copy of `stream` (and what it waits for); false when none is pending.
    pub fn complete_next(&self, stream: Stream) -> bool {
        let mut state = lock(&self.state);
        match state.queues[stream as usize].front().map(|job| job.seq) {
            Some(seq) => {
                state.run_until(stream, seq);
                true
            }
            None => false,
        }
    }

    /// Makes the next copy of `stream` to run (the oldest pending one, else the next submitted) fail: it moves
    /// nothing and its event's [`wait`](TransferEvent::wait) is an error (tests of failed transfers).
    pub fn fail_next(&self, stream: Stream) {
        let mut state = lock(&self.state);
        let next = state.completed[stream as usize] + 1;
        state.doomed[stream as usize].insert(next);
    }

    /// What the engine has copied so far (completed copies only).
    pub fn copy_stats(&self) -> CopyStats {
        lock(&self.state).stats
    }

    /// Completes every pending copy.
    pub fn run_pending(&self) {
        let mut state = lock(&self.state);
        for stream in [Stream::Write, Stream::Load] {
            let last = state.submitted[stream as usize];
            state.run_until(stream, last);
        }
    }

    fn check(
        &self,
        state: &State,
        slots: &[DeviceSlot],
        pages: &[HostPageId],
        after: &CpuEvent,
    ) -> Result<Vec<HostPageId>, Error> {
        let page_size = state.host_map.page_size();
        if pages.len().checked_mul(page_size) != Some(slots.len()) {
            return Err(Error::InvalidArgument {
                field: "slots",
                reason: format!("{} device slots for {} host pages of {page_size} tokens", slots.len(), pages.len()),
            });
        }
        if let Some(&slot) = slots.iter().find(|&&slot| slot as usize >= state.device_map.slots()) {
            return Err(Error::InvalidArgument {
                field: "slots",
                reason: format!("device slot {slot} out of range ({} slots)", state.device_map.slots()),
            });
        }
        state.memory.host.check_pages(pages)?;
        if !Arc::ptr_eq(&self.state, &after.state) {
            return Err(Error::InvalidArgument { field: "after", reason: "an event of another engine".into() });
        }
        Ok(pages.to_vec())
    }

    fn submit(&self, mut state: MutexGuard<'_, State>, stream: Stream, work: Work, after: &CpuEvent) -> CpuEvent {
        state.submitted[stream as usize] += 1;
        let seq = state.submitted[stream as usize];
        state.queues[stream as usize].push_back(Job { seq, after: after.position, work });
        if self.completion == Completion::Immediate {
            state.run_until(stream, seq);
        }
        CpuEvent { state: self.state.clone(), position: Some((stream, seq)) }
    }
}

/// The first index listed twice, found with a bitmap kept in the state (cleared again before returning): O(n), no
/// allocation after the first call.
fn first_repeat(seen: &mut Vec<u64>, items: impl Iterator<Item = usize> + Clone) -> Option<usize> {
    let mut repeat = None;
    let mut marked = 0;
    for item in items.clone() {
        if seen.len() <= item / 64 {
            seen.resize(item / 64 + 1, 0);
        }
        let (word, bit) = (item / 64, 1u64 << (item % 64));
        if seen[word] & bit != 0 {
            repeat = Some(item);
            break;
        }
        seen[word] |= bit;
        marked += 1;
    }
    for item in items.take(marked) {
        seen[item / 64] &= !(1u64 << (item % 64));
    }
    repeat
}

impl TransferEngine for CpuEngine {
    type Event = CpuEvent;

    fn host_memory(&self) -> Arc<HostMemory> {
        lock(&self.state).memory.host.clone()
    }

    fn device_layout(&self) -> DeviceLayoutMap {
        self.device_map()
    }

    fn start_event(&mut self) -> Result<CpuEvent, Error> {
        // the caller's work on the CPU is done by the time it asks
        Ok(CpuEvent { state: self.state.clone(), position: None })
    }

    fn write_to_host(
        &mut self,
        slots: &[DeviceSlot],
        pages: &[HostPageId],
        after: &CpuEvent,
    ) -> Result<CpuEvent, Error> {
        let mut state = lock(&self.state);
        let pages = self.check(&state, slots, pages, after)?;
        if let Some(page) = first_repeat(&mut state.seen, pages.iter().map(|page| page.index())) {
            return Err(Error::InvalidArgument { field: "pages", reason: format!("host page {page} is listed twice") });
        }
        Ok(self.submit(state, Stream::Write, Work::Write { slots: slots.to_vec(), pages }, after))
    }

    fn load_layer(
        &mut self,
        layer: usize,
        pages: &[HostPageId],
        slots: &[DeviceSlot],
        after: &CpuEvent,
    ) -> Result<CpuEvent, Error> {
        let mut state = lock(&self.state);
        let pages = self.check(&state, slots, pages, after)?;
        if layer >= state.device_map.geometry().layers {
            return Err(Error::InvalidArgument {
                field: "layer",
                reason: format!("{layer} out of range ({} layers)", state.device_map.geometry().layers),
            });
        }
        if let Some(slot) = first_repeat(&mut state.seen, slots.iter().map(|&slot| slot as usize)) {
            return Err(Error::InvalidArgument {
                field: "slots",
                reason: format!("device slot {slot} is listed twice"),
            });
        }
        Ok(self.submit(state, Stream::Load, Work::LoadLayer { layer, pages, slots: slots.to_vec() }, after))
    }
}
