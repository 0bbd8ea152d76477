//! Per-layer load events in a ring of producer slots, so the model can start on layer *i* while later layers still
//! load (SGLang's `LayerDoneCounter`, docs/sglang.md#operations).
//!
//! Each merged load takes the next slot and records one event per layer there; a batch's forward pass is the consumer
//! of one slot and waits for layer *i*'s event before using layer *i*. Three slots let the scheduler run one batch
//! ahead. SGLang asserts when a slot is reused before its last load finished (docs/sglang.md#fixed-17); here the caller
//! chooses to wait for it or to be told the slot is busy.

use super::TransferEvent;

/// What to do when the next slot's previous load has not finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotReuse {
    /// Wait for it.
    Wait,
    /// Report [`SlotBusy`] and change nothing.
    Refuse,
}

/// One slot of the ring: where a merged load records its per-layer events and which the forward pass consumes. Not
/// a device slot ([`DeviceSlot`](crate::device_slots::DeviceSlot), a token's place in the device pool): only the
/// ring hands these out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProducerSlot(usize);

impl ProducerSlot {
    /// The slot's place in the ring, `0..LayerDoneCounter::SLOTS`.
    pub fn index(self) -> usize {
        self.0
    }
}

impl std::fmt::Display for ProducerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "producer slot {}", self.0)
    }
}

/// The next producer slot still has a load in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotBusy {
    /// The slot.
    pub slot: ProducerSlot,
}

/// The ring of producer slots.
#[derive(Debug)]
pub struct LayerDoneCounter<E> {
    slots: Vec<Vec<E>>,
    producer: Option<usize>,
    consumer: Option<usize>,
}

impl<E: TransferEvent> LayerDoneCounter<E> {
    /// SGLang's number of slots.
    pub const SLOTS: usize = 3;

    /// A ring of [`Self::SLOTS`] empty slots.
    pub fn new() -> Self {
        Self { slots: (0..Self::SLOTS).map(|_| Vec::new()).collect(), producer: None, consumer: None }
    }

    /// Takes the next slot for a new load and clears it; `reuse` says what to do if its last load is in flight.
    ///
    /// # Errors
    ///
    /// [`SlotBusy`] with [`SlotReuse::Refuse`] when the slot's last event is not complete.
    pub(crate) fn begin_producer(&mut self, reuse: SlotReuse) -> Result<ProducerSlot, SlotBusy> {
        let slot = self.producer.map_or(0, |slot| (slot + 1) % self.slots.len());
        if let Some(last) = self.slots[slot].last()
            && !last.is_complete()
        {
            match reuse {
                SlotReuse::Refuse => return Err(SlotBusy { slot: ProducerSlot(slot) }),
                SlotReuse::Wait => {
                    // the slot is free once its last load ended, well or not (a failed load is reported where its
                    // ack is taken)
                    let _ = last.wait();
                }
            }
        }
        self.slots[slot].clear();
        self.producer = Some(slot);
        Ok(ProducerSlot(slot))
    }

    /// Records the load's per-layer events in `slot` (layer order; the last one finishes the load).
    ///
    pub(crate) fn set_layer_events(&mut self, slot: ProducerSlot, events: Vec<E>) {
        self.slots[slot.0] = events;
    }

    /// Makes `slot` the one the forward pass consumes; `None` when the batch loads nothing.
    pub fn set_consumer(&mut self, slot: Option<ProducerSlot>) {
        self.consumer = slot.map(ProducerSlot::index);
    }

    /// Blocks until layer `layer` of the consumer's load is in device memory; at once without a consumer, or when
    /// the load has fewer layers recorded.
    ///
    /// # Errors
    ///
    /// [`Error::Device`](crate::Error::Device) when the layer's load failed: its device bytes are unspecified and
    /// the forward pass must not use them.
    pub fn wait_until(&self, layer: usize) -> Result<(), crate::Error> {
        match self.consumer.and_then(|slot| self.slots[slot].get(layer)) {
            Some(event) => event.wait(),
            None => Ok(()),
        }
    }

    /// The event of layer `layer` of the consumer's load, for an engine that makes a stream wait on it instead of
    /// the CPU.
    pub fn consumer_event(&self, layer: usize) -> Option<&E> {
        self.consumer.and_then(|slot| self.slots[slot].get(layer))
    }

    /// Whether any slot's load is in flight.
    pub fn busy(&self) -> bool {
        self.slots.iter().any(|events| events.last().is_some_and(|event| !event.is_complete()))
    }

    /// Waits for every load in flight, then forgets all slots: a clean quiesce (SGLang's reset only forgets).
    pub fn reset(&mut self) {
        for events in &self.slots {
            if let Some(last) = events.last() {
                // a quiesce: a failed load is as finished as a good one
                let _ = last.wait();
            }
        }
        self.slots.iter_mut().for_each(Vec::clear);
        self.producer = None;
        self.consumer = None;
    }
}

impl<E: TransferEvent> Default for LayerDoneCounter<E> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{KvDtype, KvGeometry};
    use crate::layout::{HostLayout, HostLayoutMap};
    use crate::transfer::{Completion, CpuEngine, CpuEvent, DeviceLayoutMap, TransferEngine};

    const LAYERS: usize = 4;

    fn engine() -> CpuEngine {
        let geometry = KvGeometry::mha(LAYERS, 1, 2, KvDtype::Bf16).unwrap();
        let host = HostLayoutMap::new(geometry, HostLayout::LayerFirst, 1, 8).unwrap();
        CpuEngine::new(DeviceLayoutMap::new(geometry, 8).unwrap(), host, Completion::Manual).unwrap()
    }

    fn load_all_layers(engine: &mut CpuEngine, page: usize) -> Vec<CpuEvent> {
        let pages = engine.host_memory().allocator().unwrap().alloc(8).unwrap();
        let start = engine.start_event().unwrap();
        (0..LAYERS)
            .map(|layer| engine.load_layer(layer, &pages[page..=page], &[page as u32], &start).unwrap())
            .collect()
    }

    #[test]
    fn a_fourth_load_waits_for_or_refuses_the_oldest_slot() {
        let mut engine = engine();
        let mut counter = LayerDoneCounter::new();
        for expected in 0..3 {
            let slot = counter.begin_producer(SlotReuse::Refuse).unwrap();
            assert_eq!(slot, ProducerSlot(expected));
            let events = load_all_layers(&mut engine, expected);
            counter.set_layer_events(slot, events);
        }
        assert!(counter.busy());
        // SGLang asserts here; hicache reports or waits
        assert_eq!(counter.begin_producer(SlotReuse::Refuse), Err(SlotBusy { slot: ProducerSlot(0) }));
        assert_eq!(engine.pending(), (0, 12), "refusing changed nothing");
        assert_eq!(counter.begin_producer(SlotReuse::Wait), Ok(ProducerSlot(0)));
        assert_eq!(engine.pending(), (0, 8), "waiting completed slot 0's load, and only it");
    }

    #[test]
    fn the_consumer_waits_layer_by_layer() {
        let mut engine = engine();
        let mut counter = LayerDoneCounter::new();
        counter.wait_until(3).unwrap(); // no consumer: returns at once
        let slot = counter.begin_producer(SlotReuse::Refuse).unwrap();
        let events = load_all_layers(&mut engine, 0);
        counter.set_layer_events(slot, events.clone());
        counter.set_consumer(Some(slot));
        counter.wait_until(1).unwrap();
        let done: Vec<bool> = events.iter().map(TransferEvent::is_complete).collect();
        assert_eq!(done, [true, true, false, false]);
        assert!(counter.consumer_event(2).is_some_and(|event| !event.is_complete()));
        counter.reset();
        assert!(events.iter().all(TransferEvent::is_complete), "reset quiesces");
        assert!(!counter.busy());
        assert_eq!(counter.begin_producer(SlotReuse::Refuse), Ok(ProducerSlot(0)), "and starts the ring again");
    }
}
