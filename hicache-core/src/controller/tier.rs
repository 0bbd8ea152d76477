//! The controller's storage half as a type of its own: the tier's settings, I/O threads, prefetches, backups and the
//! pins backups hold, decided on the scheduler's thread against the host pool the controller lends it ([`Pool`]).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rustc_hash::FxHashMap as HashMap;

use super::outcome::{PageBackup, PrefetchExplanation, PrefetchStop};
use super::prefetch::{Prefetch, PrefetchStart, Reads, Stage, Tracked};
use super::release::ReleaseLedger;
use super::storage::{BackupShared, PrefetchShared, StorageSettings, Workers};
use super::{BackupReport, lent_error};
use crate::controller::{NodeId, OpId, OpIds};
use crate::cost::{CostModel, Rates};
use crate::error::Error;
use crate::hash::PageKey;
use crate::host_memory::{Access, HostMemory};
use crate::host_pool::{HostPageAllocator, HostPageId, PageState};
use crate::rate_limit::{Clock, PrefetchCapacity};
use crate::storage::StorageBackend;

/// The host pool as the storage tier's decisions see it: the controller's allocator, the memory its pages live in
/// (whose leases say which pages an I/O thread holds) and the page size in tokens.
pub(super) struct Pool<'a> {
    pub(super) host: &'a mut HostPageAllocator,
    pub(super) memory: &'a HostMemory,
    pub(super) page_size: usize,
}

impl Pool<'_> {
    /// Bytes of one host page.
    pub(super) fn page_bytes(&self) -> u64 {
        self.memory.page_bytes() as u64
    }

    /// Frees host pages, refusing (and freeing none) when one is still lent to a storage thread: a broken protocol
    /// shows as an error naming the page, never as a page reused under a read or a write.
    pub(super) fn free(&mut self, host_pages: &[HostPageId]) -> Result<(), Error> {
        unlent(self.memory, host_pages, "free")?;
        self.host.free(host_pages)
    }
}

/// Checks that no storage thread holds a lease on `host_pages` of `memory` (before a device→host write or a free).
pub(super) fn unlent(memory: &HostMemory, host_pages: &[HostPageId], operation: &'static str) -> Result<(), Error> {
    match memory.lent(host_pages) {
        None => Ok(()),
        Some((page, how)) => Err(lent_error(page, how, operation)),
    }
}

/// Checks that no storage thread is writing `host_pages` of `memory` (before a host→device load, which reads them).
pub(super) fn unlent_for_writing(
    memory: &HostMemory,
    host_pages: &[HostPageId],
    operation: &'static str,
) -> Result<(), Error> {
    match memory.lent_for_writing(host_pages) {
        None => Ok(()),
        Some(page) => Err(lent_error(page, Access::Write, operation)),
    }
}

#[derive(Debug)]
struct BackupEntry {
    op: OpId,
    node_ids: Vec<NodeId>,
    host_pages: Vec<HostPageId>,
    shared: Arc<BackupShared>,
}

/// The storage tier and everything in flight to or from it.
pub(super) struct StorageTier {
    pub(super) settings: StorageSettings,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) workers: Workers,
    pub(super) capacity: PrefetchCapacity,
    /// The pending prefetch of each request.
    pub(super) requests: HashMap<String, OpId>,
    pub(super) prefetches: BTreeMap<OpId, Tracked>,
    backups: VecDeque<BackupEntry>,
    pub(super) ledger: ReleaseLedger,
    /// Host pages backups to storage are reading, with how many backups read each.
    pins: HashMap<HostPageId, u32>,
    /// This rank's measured rates.
    pub(super) cost: CostModel,
    /// The rates every rank agreed on at the last tick (the slowest rank's): the only ones decisions use.
    pub(super) agreed: Rates,
}

impl std::fmt::Debug for StorageTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageTier")
            .field("settings", &self.settings)
            .field("prefetches", &self.prefetches.len())
            .field("backups", &self.backups.len())
            .finish_non_exhaustive()
    }
}

impl StorageTier {
    /// Starts the I/O threads over `memory` and tells the backend about it once.
    pub(super) fn start(
        storage: Arc<dyn StorageBackend>,
        memory: Arc<HostMemory>,
        settings: StorageSettings,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, Error> {
        let workers = Workers::start(storage, memory, &settings)?;
        let cost = CostModel::new(settings.priors, settings.batch_pages);
        // until the first tick, the priors (the same config on every rank)
        let agreed = cost.rates();
        Ok(Self {
            cost,
            agreed,
            capacity: PrefetchCapacity::with_limit(settings.capacity_tokens),
            settings,
            clock,
            workers,
            requests: HashMap::default(),
            prefetches: BTreeMap::new(),
            backups: VecDeque::new(),
            ledger: ReleaseLedger::new(),
            pins: HashMap::default(),
        })
    }

    /// Starts a backup of `host_pages` (synced or backed up in `host`) under `keys` and pins the pages until it is
    /// taken; returns its operation id, from `ids`. MLA ranks other than 0 skip the write and finish at once; a
    /// trailing-window pool's rank writes only the pages among the last `window` whose entries `trailing` says are
    /// held (one flag per page; empty: every page is), and records the rest as skipped.
    pub(super) fn backup(
        &mut self,
        host: &HostPageAllocator,
        ids: &mut OpIds,
        host_pages: &[HostPageId],
        keys: Vec<PageKey>,
        node_ids: Vec<NodeId>,
        trailing: &[bool],
    ) -> Result<OpId, Error> {
        if keys.len() != host_pages.len() {
            return Err(Error::InvalidArgument {
                field: "keys",
                reason: format!("{} keys for {} host pages", keys.len(), host_pages.len()),
            });
        }
        for &page in host_pages {
            let state = host.state(page)?;
            if !matches!(state, PageState::Synced | PageState::Backup) {
                return Err(Error::PageState {
                    page: page.to_string(),
                    operation: "backup_to_storage",
                    expected: "synced or backup".into(),
                    found: state.to_string(),
                });
            }
        }
        let op = ids.next_id();
        let shared = Arc::new(BackupShared::new(host_pages.len()));
        let written: Vec<usize> = match self.settings.trailing {
            _ if self.settings.backup_skip => Vec::new(),
            Some(window) if window.pool => {
                let from = host_pages.len().saturating_sub(window.window.get());
                (from..host_pages.len()).filter(|&page| trailing.get(page).copied().unwrap_or(true)).collect()
            }
            _ => (0..host_pages.len()).collect(),
        };
        if written.is_empty() {
            *shared.pages.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) =
                vec![PageBackup::Skipped; host_pages.len()];
            shared.done.set();
        } else {
            if written.len() < host_pages.len() {
                let mut recorded = shared.pages.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                for (page, outcome) in recorded.iter_mut().enumerate() {
                    // `written` is ascending
                    if written.binary_search(&page).is_err() {
                        *outcome = PageBackup::Skipped;
                    }
                }
            }
            let pages = written.iter().map(|&page| host_pages[page]).collect();
            let keys = written.iter().map(|&page| keys[page]).collect();
            self.workers.backup(shared.clone(), pages, keys, written);
        }
        for &page in host_pages {
            *self.pins.entry(page).or_default() += 1;
        }
        self.backups.push_back(BackupEntry { op, node_ids, host_pages: host_pages.to_vec(), shared });
        Ok(op)
    }

    /// Backups that are done, counted from the oldest and stopping at the first still running.
    pub(super) fn completed_backups(&self) -> usize {
        self.backups.iter().take_while(|backup| backup.shared.done.is_set()).count()
    }

    /// Backups submitted and not yet taken.
    pub(super) fn backups_in_flight(&self) -> usize {
        self.backups.len()
    }

    /// Takes the `count` oldest backups, waiting for those not done, and unpins their pages.
    pub(super) fn take_backups(&mut self, count: usize) -> Result<Vec<BackupReport>, Error> {
        if count > self.backups.len() {
            return Err(Error::Internal(format!("{count} backups asked for, {} submitted", self.backups.len())));
        }
        let mut reports = Vec::with_capacity(count);
        for backup in self.backups.drain(..count) {
            backup.shared.done.wait();
            for page in &backup.host_pages {
                if let Some(pins) = self.pins.get_mut(page) {
                    *pins -= 1;
                    if *pins == 0 {
                        self.pins.remove(page);
                    }
                }
            }
            let pages =
                std::mem::take(&mut *backup.shared.pages.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
            reports.push(BackupReport {
                op: backup.op,
                node_ids: backup.node_ids,
                host_pages: backup.host_pages,
                pages,
            });
        }
        Ok(reports)
    }

    /// The first of `host_pages` a backup is reading, if any.
    pub(super) fn pinned(&self, host_pages: &[HostPageId]) -> Option<HostPageId> {
        host_pages.iter().copied().find(|page| self.pins.contains_key(page))
    }

    /// Stops every prefetch and backup, waits until the I/O threads are done with host memory, and forgets them all.
    pub(super) fn reset(&mut self) {
        let prefetches = std::mem::take(&mut self.prefetches);
        let quiet: Vec<_> =
            prefetches.into_values().filter_map(|tracked| tracked.stop_for_reset(&self.workers)).collect();
        for backup in &self.backups {
            backup.shared.cancel.store(true, std::sync::atomic::Ordering::Release);
        }
        for shared in quiet {
            shared.quiet.wait();
        }
        for backup in &self.backups {
            backup.shared.done.wait();
        }
        self.requests.clear();
        self.backups.clear();
        self.ledger = ReleaseLedger::new();
        self.pins.clear();
        self.capacity = PrefetchCapacity::with_limit(self.settings.capacity_tokens);
    }
}

impl StorageTier {
    /// Queues the hit query of a prefetch of `tokens` (whole pages) for `request_id`, out of a request of
    /// `request_tokens` after `cached_tokens`.
    pub(super) fn start_prefetch(
        &mut self,
        ids: &mut OpIds,
        request_id: &str,
        tokens: &[u32],
        last_key: Option<PageKey>,
        cached_tokens: usize,
        request_tokens: usize,
    ) -> Result<PrefetchStart, Error> {
        if self.requests.contains_key(request_id) {
            return Err(Error::InvalidArgument {
                field: "request_id",
                reason: format!("request {request_id} has a prefetch already"),
            });
        }
        let whole = tokens.len();
        if whole < self.settings.prefetch_threshold {
            return Ok(PrefetchStart::Refused(PrefetchStop::BelowThreshold));
        }
        if !self.capacity.try_admit(whole as u64) {
            return Ok(PrefetchStart::Refused(PrefetchStop::CapacityLimited));
        }
        let op = ids.next_id();
        let shared = Arc::new(PrefetchShared::default());
        self.workers.query(shared.clone(), tokens.to_vec(), last_key);
        let started_at = self.clock.now();
        let explanation = PrefetchExplanation {
            request_id: request_id.to_owned(),
            op,
            requested_tokens: whole,
            threshold: self.settings.prefetch_threshold,
            local_hit_tokens: 0,
            tp_min_hit_tokens: 0,
            reserved_tokens: 0,
            local_fetched_tokens: 0,
            fetched_tokens: 0,
            elapsed: Duration::ZERO,
            stop: PrefetchStop::Revoked,
            error: None,
            plan: None,
            query_time: Duration::ZERO,
            read_time: Duration::ZERO,
        };
        self.requests.insert(request_id.to_owned(), op);
        let prefetch = Prefetch {
            request_id: request_id.to_owned(),
            tokens: whole,
            started_at,
            shared,
            wanted: false,
            met: false,
            aborted: false,
            stalled: false,
            progress_mark: (0, started_at),
            admitted: whole as u64,
            cached_tokens,
            prompt_tokens: cached_tokens + request_tokens,
            head_pages: 0,
            cap: None,
            reads_queued_at: None,
            explanation,
        };
        self.prefetches.insert(op, Tracked { prefetch, stage: Stage::Querying(Reads::default()) });
        Ok(PrefetchStart::Started(op))
    }

    pub(super) fn tracked(&self, request_id: &str) -> Option<&Tracked> {
        self.prefetches.get(self.requests.get(request_id)?)
    }

    pub(super) fn prefetch_mut(&mut self, request_id: &str) -> Option<&mut Prefetch> {
        let op = self.requests.get(request_id)?;
        self.prefetches.get_mut(op).map(|tracked| &mut tracked.prefetch)
    }
}
