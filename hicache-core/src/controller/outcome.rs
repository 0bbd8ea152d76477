//! What the storage half reports to the engine: why a prefetch stopped ([`PrefetchStop`]) and the whole story of one
//! ([`PrefetchExplanation`]), each page of a backup ([`PageBackup`]), and storage's failures kept typed
//! ([`StorageFailure`]) so an engine can tell a full disk from a timeout.

use std::time::Duration;

use crate::controller::OpId;
use crate::cost::Plan;
use crate::error::{Error, ErrorKind};
use crate::hash::PageKey;
use crate::storage::{FailureKind, PageFailure};

/// Why a prefetch stopped (or never started).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrefetchStop {
    /// The controller has no storage tier.
    NoStorage,
    /// The request's uncached tokens are fewer than the threshold: not worth a query.
    BelowThreshold,
    /// Ongoing prefetches hold their share of the host pool already.
    CapacityLimited,
    /// Storage holds fewer leading tokens than the threshold (TP minimum): nothing was fetched.
    Revoked,
    /// The host pool could not hold the hit, even after eviction.
    HostPoolFull,
    /// Every hit page arrived on every rank.
    Complete,
    /// Computing the pages was expected to be faster than bringing them ([`crate::cost`]): part or none of the hit
    /// was fetched (the plan in [`PrefetchExplanation::plan`] says why), or the scheduler stopped waiting for the
    /// rest.
    RecomputeFaster,
    /// `best_effort`: the scheduler took the request before every page arrived.
    CutOff,
    /// The engine's compute met the reads (config `prefetch_meet`): it had computed the pages before those read from
    /// the end, which are the result; the rest of the reads were not waited for.
    Met,
    /// `timeout`: the limit passed on some rank before every page arrived.
    TimedOut,
    /// The prefetch made no progress within the read deadline on some rank (its storage stuck): it stopped with what
    /// had arrived; pages a stuck read holds return to the pool when the read ends.
    Stalled,
    /// A read failed on this rank.
    Failed,
    /// Another rank fetched fewer pages (a failure or a cut-off there): the TP minimum is used.
    TpMinimum,
    /// The request was aborted; nothing is kept.
    Aborted,
}

/// What happened to one request's prefetch, for logs, metrics and tests.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefetchExplanation {
    /// The request.
    pub request_id: String,
    /// The operation.
    pub op: OpId,
    /// Whole-page tokens asked for.
    pub requested_tokens: usize,
    /// The threshold applied.
    pub threshold: usize,
    /// Leading tokens storage holds, as this rank's query found.
    pub local_hit_tokens: usize,
    /// The TP minimum of the hit (what was reserved and fetched against).
    pub tp_min_hit_tokens: usize,
    /// Tokens of host pages reserved.
    pub reserved_tokens: usize,
    /// Tokens this rank had fetched when the prefetch stopped.
    pub local_fetched_tokens: usize,
    /// Tokens kept: the TP minimum of the fetched tokens (0 when aborted or revoked).
    pub fetched_tokens: usize,
    /// From the call to `prefetch` until the result.
    pub elapsed: Duration,
    /// Why it stopped.
    pub stop: PrefetchStop,
    /// This rank's storage error, if one ended the query or the fetch.
    pub error: Option<StorageFailure>,
    /// The cost plan the hit was fetched by, when one was made: pages fetched and computed, why, the expected times
    /// of the plan, of fetching the whole hit and of computing it, and the rates it used.
    pub plan: Option<Plan>,
    /// This rank's hit query: from its start until it ended (or until the scheduler stopped waiting for it).
    pub query_time: Duration,
    /// This rank's storage reads of the pages this prefetch kept and those it dropped: the time spent in them.
    pub read_time: Duration,
}

/// Why storage let this rank down on a page, kept as the backend reported it (rendered to text only when logged),
/// so an engine can tell a full disk from a timeout: [`kind`](Self::kind), [`page_kind`](Self::page_kind),
/// [`io_error`](Self::io_error).
#[derive(Clone, Debug, PartialEq)]
pub enum StorageFailure {
    /// The backend's call failed as a whole (also a panic in the backend, as [`Error::Internal`], and a host page
    /// lease refused, as [`Error::PageState`]).
    Call(Error),
    /// The backend reported this page failed.
    Page {
        /// The page.
        key: PageKey,
        /// The backend's report.
        failure: PageFailure,
    },
    /// A page the hit query found was no longer in storage when it was read.
    Gone {
        /// The page.
        key: PageKey,
    },
}

impl StorageFailure {
    /// The kind of failure: the call's error kind, or [`ErrorKind::Storage`] for one page (its own kind is
    /// [`page_kind`](Self::page_kind)).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Call(error) => error.kind(),
            Self::Page { .. } | Self::Gone { .. } => ErrorKind::Storage,
        }
    }

    /// What went wrong with the page, when the backend reported one page.
    pub fn page_kind(&self) -> Option<FailureKind> {
        match self {
            Self::Page { failure, .. } => Some(failure.kind),
            Self::Call(_) | Self::Gone { .. } => None,
        }
    }

    /// The `std::io::Error` behind it (ENOSPC for a full disk, EIO, ...), where there is one.
    pub fn io_error(&self) -> Option<&std::io::Error> {
        match self {
            Self::Call(error) => error.io_error(),
            Self::Page { failure, .. } => failure.io_error(),
            Self::Gone { .. } => None,
        }
    }
}

impl std::fmt::Display for StorageFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Call(error) => write!(f, "{error}"),
            Self::Page { key, failure } => write!(f, "page {key}: {failure}"),
            Self::Gone { key } => write!(f, "page {key} was no longer in storage"),
        }
    }
}

/// Outcome of one page of a backup to storage, on this rank.
#[derive(Clone, Debug, PartialEq)]
pub enum PageBackup {
    /// Written, or already present.
    Stored,
    /// Not written by this rank (MLA: rank 0 writes).
    Skipped,
    /// The write failed.
    Failed(StorageFailure),
    /// Not attempted: the controller was reset first.
    Cancelled,
}
