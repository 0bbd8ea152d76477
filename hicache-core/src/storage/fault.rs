//! Fault injection around any backend: latency, a failing call, partial batches, corrupted bytes, a key evicted
//! between `batch_exists` and `batch_get`, a hang until a deadline, and random per-page failures and detected
//! corruptions at given rates (seeded, for runs such as `hicache replay --fault-*`).
//!
//! The plan can be changed while the backend is in use ([`FaultyStorage::set_plan`]), and a hang can be released
//! early ([`FaultyStorage::release_hangs`]), so tests of the controller can script failures at exact points.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{
    FailureKind, GetOutcome, PageFailure, PageSegments, PageSegmentsMut, SetOutcome, StorageBackend, StorageStats,
};
use crate::error::Error;
use crate::hash::PageKey;
use crate::namespace::StorageNamespace;

/// Which faults to inject. Every field off by default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Delay added to every call.
    pub latency: Option<Duration>,
    /// The n-th call (1-based, counting every call) fails as a whole with [`Error::Storage`].
    pub fail_call: Option<u64>,
    /// Batch gets and sets pass only their first `n` pages to the backend; the rest fail as injected.
    pub partial_batch: Option<usize>,
    /// The n-th page (1-based, counting every hit) that a get returns has one byte flipped, silently.
    pub corrupt_hit: Option<u64>,
    /// After a `batch_exists` that found pages, the first of them is removed from the backend.
    pub evict_after_exists: bool,
    /// Every call blocks until this instant (or until released), then fails with [`Error::Timeout`].
    pub hang_until: Option<Instant>,
    /// Each page of a get or a set fails (as injected) with this probability, in parts per million.
    pub page_failure_ppm: u32,
    /// Each page a get found is reported [`FailureKind::Corrupt`] instead (as a backend that checksums its pages
    /// reports a damaged one) with this probability, in parts per million; its bytes are not handed over as a hit.
    pub corruption_ppm: u32,
    /// Each call hangs for [`hang_for`](Self::hang_for) and then fails with [`Error::Timeout`] with this probability,
    /// in parts per million (a mount that stops answering for a while).
    pub hang_ppm: u32,
    /// How long a call drawn by [`hang_ppm`](Self::hang_ppm) hangs.
    pub hang_for: Duration,
    /// Seed of the random draws of the rates above.
    pub seed: u64,
    /// A get takes at least the time its hit pages' bytes need at this many bytes per second (a slow tier);
    /// 0 for no cap.
    pub read_bytes_per_s: u64,
}

/// What a [`FaultyStorage`] injected so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FaultCounts {
    /// Calls that failed or timed out as a whole.
    pub failed_calls: u64,
    /// Pages failed by [`FaultPlan::partial_batch`] or [`FaultPlan::page_failure_ppm`].
    pub failed_pages: u64,
    /// Pages reported corrupt by [`FaultPlan::corruption_ppm`].
    pub corrupt_pages: u64,
}

/// A backend wrapped with a [`FaultPlan`].
#[derive(Debug)]
pub struct FaultyStorage<S> {
    inner: S,
    plan: Mutex<FaultPlan>,
    released: Condvar,
    calls: AtomicU64,
    hits: AtomicU64,
    /// Random draws made so far (the draw's index feeds the generator, so draws are reproducible per seed).
    draws: AtomicU64,
    failed_calls: AtomicU64,
    failed_pages: AtomicU64,
    corrupt_pages: AtomicU64,
}

impl<S: StorageBackend> FaultyStorage<S> {
    /// Wraps `inner` with `plan`.
    pub fn new(inner: S, plan: FaultPlan) -> Self {
        Self {
            inner,
            plan: Mutex::new(plan),
            released: Condvar::new(),
            calls: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            draws: AtomicU64::new(0),
            failed_calls: AtomicU64::new(0),
            failed_pages: AtomicU64::new(0),
            corrupt_pages: AtomicU64::new(0),
        }
    }

    /// What was injected so far.
    pub fn injected(&self) -> FaultCounts {
        FaultCounts {
            failed_calls: self.failed_calls.load(Ordering::Relaxed),
            failed_pages: self.failed_pages.load(Ordering::Relaxed),
            corrupt_pages: self.corrupt_pages.load(Ordering::Relaxed),
        }
    }

    /// Whether the next random draw falls below `ppm` parts per million (SplitMix64 of the seed and the draw's
    /// index).
    fn draw(&self, seed: u64, ppm: u32) -> bool {
        if ppm == 0 {
            return false;
        }
        let index = self.draws.fetch_add(1, Ordering::Relaxed);
        let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        z % 1_000_000 < u64::from(ppm)
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Replaces the plan; counts of calls and hits continue.
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.lock_plan() = plan;
        self.released.notify_all();
    }

    /// Ends every hang now: blocked calls fail with [`Error::Timeout`] at once, later calls do not hang.
    pub fn release_hangs(&self) {
        self.lock_plan().hang_until = None;
        self.released.notify_all();
    }

    /// Calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn lock_plan(&self) -> MutexGuard<'_, FaultPlan> {
        self.plan.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Applies the per-call faults: counts the call, sleeps, hangs, fails the n-th call. Returns the plan in force.
    fn enter(&self, operation: &'static str) -> Result<FaultPlan, Error> {
        let entered = self.enter_counted(operation);
        if entered.is_err() {
            self.failed_calls.fetch_add(1, Ordering::Relaxed);
        }
        entered
    }

    fn enter_counted(&self, operation: &'static str) -> Result<FaultPlan, Error> {
        // the plan is read before the call is counted, so a test that waits for the count and then changes the
        // plan knows which plan the call took
        let plan = self.lock_plan().clone();
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(latency) = plan.latency {
            std::thread::sleep(latency);
        }
        if plan.hang_until.is_some() {
            let started = Instant::now();
            let mut guard = self.lock_plan();
            while let Some(deadline) = guard.hang_until {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                guard = self
                    .released
                    .wait_timeout(guard, deadline - now)
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .0;
            }
            return Err(Error::Timeout {
                backend: self.inner.name().to_owned(),
                operation,
                waited_ms: started.elapsed().as_millis() as u64,
            });
        }
        if plan.hang_ppm > 0 && self.draw(plan.seed, plan.hang_ppm) {
            std::thread::sleep(plan.hang_for);
            return Err(Error::Timeout {
                backend: self.inner.name().to_owned(),
                operation,
                waited_ms: plan.hang_for.as_millis() as u64,
            });
        }
        if plan.fail_call == Some(call) {
            return Err(Error::storage(
                self.inner.name().to_owned(),
                format!("injected failure of call {call} ({operation})"),
            ));
        }
        Ok(plan)
    }
}

fn injected(reason: &str) -> PageFailure {
    PageFailure::new(FailureKind::Injected, reason)
}

impl<S: StorageBackend> StorageBackend for FaultyStorage<S> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn namespace(&self) -> Option<&StorageNamespace> {
        self.inner.namespace()
    }

    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
        let plan = self.enter("batch_exists")?;
        let hits = self.inner.batch_exists(keys)?;
        if plan.evict_after_exists && hits > 0 {
            self.inner.remove(&keys[..1])?;
        }
        Ok(hits)
    }

    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
        super::check_batch(keys.len(), pages.len())?;
        let started = Instant::now();
        let plan = self.enter("batch_get")?;
        let passed = plan.partial_batch.unwrap_or(keys.len()).min(keys.len());
        let mut outcomes = self.inner.batch_get(&keys[..passed], &mut pages[..passed])?;
        self.failed_pages.fetch_add((keys.len() - passed) as u64, Ordering::Relaxed);
        outcomes.resize(keys.len(), GetOutcome::Failed(injected("partial batch: page not attempted")));
        for (outcome, page) in outcomes.iter_mut().zip(pages.iter_mut()) {
            if *outcome == GetOutcome::Hit && self.draw(plan.seed, plan.page_failure_ppm) {
                self.failed_pages.fetch_add(1, Ordering::Relaxed);
                *outcome = GetOutcome::Failed(injected("random page failure"));
            } else if *outcome == GetOutcome::Hit && self.draw(plan.seed, plan.corruption_ppm) {
                self.corrupt_pages.fetch_add(1, Ordering::Relaxed);
                *outcome = GetOutcome::Failed(PageFailure::new(
                    FailureKind::Corrupt,
                    "injected: checksum mismatch".to_owned(),
                ));
            }
            if *outcome == GetOutcome::Hit {
                let hit = self.hits.fetch_add(1, Ordering::SeqCst) + 1;
                if plan.corrupt_hit == Some(hit)
                    && let Some(byte) = page.iter_mut().flat_map(|segment| segment.iter_mut()).next()
                {
                    *byte ^= 0xa5;
                }
            }
        }
        if plan.read_bytes_per_s > 0 {
            let bytes: usize = outcomes
                .iter()
                .zip(pages.iter())
                .filter(|(outcome, _)| **outcome == GetOutcome::Hit)
                .map(|(_, page)| page.iter().map(|segment| segment.len()).sum::<usize>())
                .sum();
            let floor = Duration::from_secs_f64(bytes as f64 / plan.read_bytes_per_s as f64);
            std::thread::sleep(floor.saturating_sub(started.elapsed()));
        }
        Ok(outcomes)
    }

    fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
        super::check_batch(keys.len(), pages.len())?;
        let plan = self.enter("batch_set")?;
        let passed = plan.partial_batch.unwrap_or(keys.len()).min(keys.len());
        // a page that fails at random is not written
        let mut written: Vec<usize> = Vec::with_capacity(passed);
        let mut outcomes = vec![SetOutcome::Failed(injected("partial batch: page not attempted")); keys.len()];
        for (index, outcome) in outcomes.iter_mut().enumerate().take(passed) {
            if self.draw(plan.seed, plan.page_failure_ppm) {
                *outcome = SetOutcome::Failed(injected("random page failure"));
            } else {
                written.push(index);
            }
        }
        self.failed_pages.fetch_add((keys.len() - written.len()) as u64, Ordering::Relaxed);
        let chosen_keys: Vec<PageKey> = written.iter().map(|&index| keys[index]).collect();
        let chosen_pages: Vec<PageSegments<'_>> = written.iter().map(|&index| pages[index].clone()).collect();
        let results = self.inner.batch_set(&chosen_keys, &chosen_pages)?;
        for (&index, result) in written.iter().zip(results) {
            outcomes[index] = result;
        }
        Ok(outcomes)
    }

    fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
        self.enter("remove")?;
        self.inner.remove(keys)
    }

    fn clear(&self) -> Result<u64, Error> {
        self.enter("clear")?;
        self.inner.clear()
    }

    fn stats(&self) -> StorageStats {
        self.inner.stats()
    }

    fn register_host_memory(&self, region: &crate::host_memory::MemoryRegion) -> Result<(), Error> {
        self.inner.register_host_memory(region)
    }

    fn unregister_host_memory(&self, region: &crate::host_memory::MemoryRegion) {
        self.inner.unregister_host_memory(region);
    }

    fn list(&self) -> Result<Vec<(PageKey, u64)>, Error> {
        self.enter("list")?;
        self.inner.list()
    }

    fn flush(&self) -> Result<(), Error> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::geometry::{KvDtype, KvGeometry};
    use crate::hash::page_keys;
    use crate::layout::HostLayout;
    use crate::namespace::StorageNamespace;
    use crate::storage::MemoryStorage;

    const PAGE: usize = 4;

    fn namespace() -> StorageNamespace {
        StorageNamespace::single_rank(
            "fault-test",
            KvGeometry::mha(1, 1, 1, KvDtype::Bf16).unwrap(),
            HostLayout::PageFirst,
            1,
        )
    }

    fn fresh_keys(count: usize) -> Vec<PageKey> {
        page_keys(&(0..count as u32).collect::<Vec<_>>(), 1, None, crate::hash::PartialPage::Reject).unwrap()
    }

    fn filled(plan: FaultPlan, count: usize) -> (FaultyStorage<MemoryStorage>, Vec<PageKey>) {
        let keys = fresh_keys(count);
        let memory = MemoryStorage::new(&namespace());
        let pages: Vec<[u8; PAGE]> = (0..count).map(|index| [index as u8; PAGE]).collect();
        let sources: Vec<PageSegments<'_>> = pages.iter().map(|page| vec![&page[..]]).collect();
        assert!(memory.batch_set(&keys, &sources).unwrap().iter().all(SetOutcome::is_stored));
        (FaultyStorage::new(memory, plan), keys)
    }

    fn read_all(storage: &dyn StorageBackend, keys: &[PageKey]) -> (Vec<GetOutcome>, Vec<[u8; PAGE]>) {
        let mut buffers = vec![[0u8; PAGE]; keys.len()];
        let mut pages: Vec<PageSegmentsMut<'_>> = buffers.iter_mut().map(|buffer| vec![&mut buffer[..]]).collect();
        let outcomes = storage.batch_get(keys, &mut pages).unwrap();
        drop(pages);
        (outcomes, buffers)
    }

    #[test]
    fn random_page_failures_and_corruptions_follow_their_rates_and_are_counted() {
        let plan = FaultPlan { page_failure_ppm: 300_000, corruption_ppm: 200_000, seed: 7, ..FaultPlan::default() };
        let (storage, keys) = filled(plan.clone(), 2000);
        let (outcomes, _) = read_all(&storage, &keys);
        let failed = outcomes
            .iter()
            .filter(|outcome| matches!(outcome, GetOutcome::Failed(failure) if failure.kind == FailureKind::Injected))
            .count();
        let corrupt = outcomes
            .iter()
            .filter(|outcome| matches!(outcome, GetOutcome::Failed(failure) if failure.kind == FailureKind::Corrupt))
            .count();
        // 30% fail; of the rest, 20% are reported corrupt (binomial, far inside these bounds)
        assert!((480..720).contains(&failed), "{failed} of 2000 failed");
        assert!((200..360).contains(&corrupt), "{corrupt} of 2000 corrupt");
        let counts = storage.injected();
        assert_eq!((counts.failed_pages, counts.corrupt_pages), (failed as u64, corrupt as u64));
        // the same seed draws the same faults
        let (again, _) = filled(plan, 2000);
        assert_eq!(read_all(&again, &keys).0, outcomes);

        // a set's randomly failed pages are not written
        let fresh = fresh_keys(2100)[2000..].to_vec();
        let pages: Vec<[u8; PAGE]> = fresh.iter().map(|_| [9u8; PAGE]).collect();
        let sources: Vec<PageSegments<'_>> = pages.iter().map(|page| vec![&page[..]]).collect();
        storage.set_plan(FaultPlan { page_failure_ppm: 500_000, seed: 3, ..FaultPlan::default() });
        let outcomes = storage.batch_set(&fresh, &sources).unwrap();
        for (key, outcome) in fresh.iter().zip(&outcomes) {
            assert_eq!(storage.inner().exists(key).unwrap(), outcome.is_stored(), "{outcome:?}");
        }
        assert!(outcomes.iter().any(SetOutcome::is_stored) && !outcomes.iter().all(SetOutcome::is_stored));
    }

    #[test]
    fn random_hangs_last_their_time_then_time_out() {
        let plan = FaultPlan { hang_ppm: 1_000_000, hang_for: Duration::from_millis(40), ..FaultPlan::default() };
        let (storage, keys) = filled(plan, 2);
        let started = Instant::now();
        let error = storage.batch_exists(&keys).unwrap_err();
        assert!(matches!(error, Error::Timeout { operation: "batch_exists", .. }), "{error}");
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert_eq!(storage.injected().failed_calls, 1);
        storage.set_plan(FaultPlan::default());
        assert_eq!(storage.batch_exists(&keys).unwrap(), 2);
    }

    #[test]
    fn a_read_cap_makes_a_get_take_its_bytes_time() {
        // 2 hit pages of 4 bytes at 256 bytes/s: at least 31.25 ms
        let (storage, keys) = filled(FaultPlan { read_bytes_per_s: 256, ..FaultPlan::default() }, 2);
        let started = Instant::now();
        let (outcomes, buffers) = read_all(&storage, &keys);
        assert!(started.elapsed() >= Duration::from_micros(31_250), "{:?}", started.elapsed());
        assert_eq!((outcomes, buffers), (vec![GetOutcome::Hit; 2], vec![[0u8; PAGE], [1u8; PAGE]]));
    }

    #[test]
    fn latency_delays_every_call() {
        let (storage, keys) = filled(FaultPlan { latency: Some(Duration::from_millis(30)), ..FaultPlan::default() }, 2);
        let started = Instant::now();
        assert_eq!(storage.batch_exists(&keys).unwrap(), 2);
        assert!(started.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn the_nth_call_fails_and_only_that_one() {
        let (storage, keys) = filled(FaultPlan { fail_call: Some(2), ..FaultPlan::default() }, 2);
        assert_eq!(storage.batch_exists(&keys).unwrap(), 2);
        let error = storage.batch_exists(&keys).unwrap_err().to_string();
        assert_eq!(error, "storage backend memory: injected failure of call 2 (batch_exists)");
        assert_eq!(storage.batch_exists(&keys).unwrap(), 2);
    }

    #[test]
    fn partial_batches_attempt_only_a_prefix() {
        let (storage, keys) = filled(FaultPlan { partial_batch: Some(2), ..FaultPlan::default() }, 4);
        let (outcomes, buffers) = read_all(&storage, &keys);
        assert_eq!(&outcomes[..2], &[GetOutcome::Hit, GetOutcome::Hit]);
        assert!(matches!(&outcomes[2], GetOutcome::Failed(failure) if failure.kind == FailureKind::Injected));
        assert_eq!(buffers[1], [1; PAGE]);
        assert_eq!(buffers[3], [0; PAGE], "an unattempted page is not written");
        let fresh = fresh_keys(6);
        let page = [9u8; PAGE];
        let outcomes = storage.batch_set(&fresh[4..6], &[vec![&page[..]], vec![&page[..]]]).unwrap();
        assert!(outcomes.iter().all(SetOutcome::is_stored), "two pages fit the partial batch");
        let outcomes =
            storage.batch_set(&fresh_keys(9)[6..9], &[vec![&page[..]], vec![&page[..]], vec![&page[..]]]).unwrap();
        assert!(matches!(outcomes[2], SetOutcome::Failed(_)));
        assert_eq!(storage.inner().batch_exists(&fresh_keys(9)[6..9]).unwrap(), 2);
    }

    #[test]
    fn corruption_flips_a_byte_of_the_chosen_hit() {
        let (storage, keys) = filled(FaultPlan { corrupt_hit: Some(3), ..FaultPlan::default() }, 4);
        let (outcomes, buffers) = read_all(&storage, &keys);
        assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit), "corruption is silent");
        assert_eq!(buffers[2][0], 2 ^ 0xa5);
        for (index, buffer) in buffers.iter().enumerate().filter(|(index, _)| *index != 2) {
            assert_eq!(*buffer, [index as u8; PAGE]);
        }
    }

    #[test]
    fn a_key_vanishes_between_exists_and_get() {
        let (storage, keys) = filled(FaultPlan { evict_after_exists: true, ..FaultPlan::default() }, 3);
        assert_eq!(storage.batch_exists(&keys).unwrap(), 3);
        let (outcomes, _) = read_all(&storage, &keys);
        assert_eq!(outcomes, [GetOutcome::Miss, GetOutcome::Hit, GetOutcome::Hit]);
    }

    #[test]
    fn hangs_last_until_the_deadline_or_a_release() {
        let deadline = Instant::now() + Duration::from_millis(50);
        let (storage, keys) = filled(FaultPlan { hang_until: Some(deadline), ..FaultPlan::default() }, 1);
        let error = storage.batch_exists(&keys).unwrap_err();
        assert!(Instant::now() >= deadline);
        assert!(matches!(error, Error::Timeout { operation: "batch_exists", .. }), "{error}");

        storage.set_plan(FaultPlan {
            hang_until: Some(Instant::now() + Duration::from_secs(600)),
            ..FaultPlan::default()
        });
        let storage = Arc::new(storage);
        let blocked = {
            let (storage, keys) = (storage.clone(), keys.clone());
            std::thread::spawn(move || storage.batch_exists(&keys))
        };
        while storage.calls() < 2 {
            std::thread::yield_now();
        }
        storage.release_hangs();
        assert!(matches!(blocked.join().unwrap(), Err(Error::Timeout { .. })));
        assert_eq!(storage.batch_exists(&keys).unwrap(), 1, "released: later calls go through");
    }
}
