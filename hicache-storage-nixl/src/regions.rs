//! Host memory registered with NIXL, kept between calls.
//!
//! NIXL moves host memory only inside registered ranges, each transfer piece within one range. SGLang registers the
//! buffers of every call again and never deregisters them (docs/sglang.md#fixed-5). Here a host pool the backend is
//! told about ([`StorageBackend::register_host_memory`](hicache_core::storage::StorageBackend::register_host_memory):
//! the controller's whole pool) is registered once and stays registered until it is unregistered; pieces inside it
//! register nothing. Memory outside every told region (a caller's own buffers) is registered by range, and a range
//! stays registered while it is among the `capacity` most recently used, so a reused buffer is registered once. A range
//! no longer used is deregistered when it falls out of the cache, or at the latest when the backend drops; a range in
//! use by a transfer is never deregistered under it (the transfer holds it).
//!
//! Registering does not touch the memory (POSIX records the range; GDS pins it), and a transfer only reaches memory
//! that its own pieces name, which the caller keeps alive for the call. So a range whose memory the caller has since
//! freed is harmless until it falls out of the cache.

use std::sync::Arc;

use nixl_sys::{MemType, NixlError, RegistrationHandle};

use crate::agent::{NixlAgent, Region};

/// A registered range `[start, end)`.
#[derive(Debug)]
pub(crate) struct Registered {
    start: usize,
    end: usize,
    _handle: RegistrationHandle,
}

/// Host pools told about, registered until unregistered, and recently used other ranges, most recent last.
#[derive(Debug)]
pub(crate) struct RegionCache {
    pools: Vec<Arc<Registered>>,
    ranges: Vec<Arc<Registered>>,
    capacity: usize,
    registrations: u64,
}

impl RegionCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { pools: Vec::new(), ranges: Vec::new(), capacity: capacity.max(1), registrations: 0 }
    }

    /// Registers a host pool `[start, start + len)` until [`unregister_pool`](Self::unregister_pool); a pool already
    /// registered is not registered again.
    pub(crate) fn register_pool(&mut self, agent: &NixlAgent, start: usize, len: usize) -> Result<(), NixlError> {
        if self.pools.iter().any(|pool| pool.start == start && pool.end == start + len) {
            return Ok(());
        }
        let region = Region { address: start, len, mem_type: MemType::Dram, device: 0 };
        let handle = agent.register(&region)?;
        self.registrations += 1;
        self.pools.push(Arc::new(Registered { start, end: start + len, _handle: handle }));
        Ok(())
    }

    /// Forgets a host pool; its registration ends once no transfer holds it.
    pub(crate) fn unregister_pool(&mut self, start: usize, len: usize) {
        self.pools.retain(|pool| !(pool.start == start && pool.end == start + len));
    }

    /// Host pools registered now.
    pub(crate) fn pools(&self) -> usize {
        self.pools.len()
    }

    /// Ranges registered so far (a figure for tests and reports: it stops growing once buffers are reused).
    pub(crate) fn registrations(&self) -> u64 {
        self.registrations
    }

    /// Ranges now registered.
    pub(crate) fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Makes every span (`address`, `len`) lie inside one registered range, registering the maximal runs of
    /// adjacent spans that are not; returns the ranges covering them, to hold until the transfer is done.
    pub(crate) fn cover(
        &mut self,
        agent: &NixlAgent,
        spans: &mut [(usize, usize)],
    ) -> Result<Vec<Arc<Registered>>, NixlError> {
        let runs = merge_runs(spans);
        let mut held = Vec::with_capacity(runs.len());
        for (start, end) in runs {
            if let Some(pool) = self.pools.iter().find(|pool| pool.start <= start && end <= pool.end) {
                held.push(Arc::clone(pool));
                continue;
            }
            let found = self.ranges.iter().rposition(|range| range.start <= start && end <= range.end);
            let range = match found {
                Some(index) => self.ranges.remove(index),
                None => {
                    let region = Region { address: start, len: end - start, mem_type: MemType::Dram, device: 0 };
                    let handle = agent.register(&region)?;
                    self.registrations += 1;
                    Arc::new(Registered { start, end, _handle: handle })
                }
            };
            self.ranges.push(Arc::clone(&range));
            held.push(range);
        }
        self.evict();
        Ok(held)
    }

    /// Drops the least recently used ranges beyond the capacity that no transfer holds.
    fn evict(&mut self) {
        let mut excess = self.ranges.len().saturating_sub(self.capacity);
        self.ranges.retain(|range| {
            if excess > 0 && Arc::strong_count(range) == 1 {
                excess -= 1;
                false
            } else {
                true
            }
        });
    }
}

/// The maximal runs `[start, end)` of overlapping or adjacent spans (`address`, `len`), in address order; empty spans
/// are ignored. Sorts `spans`.
pub(crate) fn merge_runs(spans: &mut [(usize, usize)]) -> Vec<(usize, usize)> {
    spans.sort_unstable();
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &(address, len) in spans.iter().filter(|(_, len)| *len > 0) {
        match runs.last_mut() {
            Some((_, end)) if address <= *end => *end = (*end).max(address + len),
            _ => runs.push((address, address + len)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::merge_runs;

    proptest! {
        /// Runs are disjoint, not adjacent, in order; each span lies in one run; every run byte is in some span.
        #[test]
        fn runs_cover_exactly_the_spans(mut spans in prop::collection::vec((0usize..200, 0usize..20), 0..30)) {
            let runs = merge_runs(&mut spans);
            for pair in runs.windows(2) {
                prop_assert!(pair[0].1 < pair[1].0, "runs {:?} touch or overlap", pair);
            }
            for &(address, len) in spans.iter().filter(|(_, len)| *len > 0) {
                prop_assert!(runs.iter().any(|&(start, end)| start <= address && address + len <= end));
            }
            for &(start, end) in &runs {
                for byte in start..end {
                    prop_assert!(spans.iter().any(|&(address, len)| address <= byte && byte < address + len));
                }
            }
        }
    }
}
