//! The crate's error type: one enum, each message naming the value at fault and what was expected, with a
//! [`kind`](Error::kind) to match on and, for storage and device failures, the lower-level error behind it
//! ([`Cause`]: an `std::io::Error`, a driver's error code).

use std::fmt;
use std::sync::Arc;

/// Errors of `hicache-core`. Expected outcomes (a miss, a partial batch, a revoked prefetch) are values, not errors.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A token in a token list is not an integer in `[0, 2^32)`.
    #[error("token {position} ({text:?}): {reason}")]
    InvalidToken {
        /// 1-based position of the token.
        position: usize,
        /// The token as written.
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A token list could not be read at all.
    #[error("token list: {reason}")]
    InvalidTokenList {
        /// What is wrong.
        reason: String,
    },
    /// A page key is not 64 hex digits.
    #[error("invalid page key {text:?}: {reason}")]
    InvalidKey {
        /// The key as given (shortened).
        text: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A token sequence is not a whole number of pages and partial pages were refused.
    #[error("{tokens} tokens are not a whole number of pages of {page_size} tokens ({} left over)", tokens % page_size)]
    PartialPage {
        /// Tokens given.
        tokens: usize,
        /// Tokens per page.
        page_size: usize,
    },
    /// An argument is out of its domain.
    #[error("{field}: {reason}")]
    InvalidArgument {
        /// The argument or field.
        field: &'static str,
        /// What is wrong and what was expected.
        reason: String,
    },
    /// A configuration value is invalid.
    #[error("config field `{field}`: {reason}")]
    InvalidConfig {
        /// Path of the field (`a.b`).
        field: String,
        /// What is wrong and the allowed values.
        reason: String,
    },
    /// A node id that names no node of the tree: its node was removed, or it was handed out before a reset (ids are
    /// never reused).
    #[error("node {node} is not in the tree (removed, or from before a reset)")]
    UnknownNode {
        /// The id.
        node: u64,
    },
    /// A host page was freed while idle, or listed twice in one call.
    #[error("double free of host {page}")]
    DoubleFree {
        /// The page.
        page: String,
    },
    /// A host page id of another pool (or out of range) was given to this pool.
    #[error("host {page} does not belong to pool {pool}")]
    ForeignPage {
        /// The page.
        page: String,
        /// This pool's id.
        pool: u32,
    },
    /// A host page is not in a state the operation accepts.
    #[error("{operation} on {page}: expected {expected}, found {found}")]
    PageState {
        /// The page.
        page: String,
        /// The operation attempted.
        operation: &'static str,
        /// Accepted states.
        expected: String,
        /// The page's state.
        found: String,
    },
    /// A storage backend failed as a whole (not one page: those are per-page outcomes).
    #[error("storage backend {backend}: {message}")]
    Storage {
        /// Backend name.
        backend: String,
        /// The backend's message.
        message: String,
        /// The error behind it, where there is one (an `std::io::Error` for a file system's refusal).
        source: Option<Cause>,
    },
    /// The device (GPU driver, compiler or kernel) failed.
    #[error("device: {operation}: {message}")]
    Device {
        /// What was being done.
        operation: &'static str,
        /// The driver's or compiler's message.
        message: String,
        /// The error behind it, where there is one (`hicache_cuda::DriverError` with the driver's code).
        source: Option<Cause>,
    },
    /// The backend does not offer this operation.
    #[error("storage backend {backend} cannot {operation}")]
    Unsupported {
        /// The backend's name.
        backend: String,
        /// What was asked.
        operation: &'static str,
    },
    /// A call did not finish before its deadline: a storage call, or a collective some rank never entered.
    #[error("{backend}: {operation} timed out after {waited_ms} ms")]
    Timeout {
        /// What timed out: the storage backend's name, or the collective group (naming the missing ranks where
        /// known).
        backend: String,
        /// The call.
        operation: &'static str,
        /// How long it waited.
        waited_ms: u64,
    },
    /// TP ranks entered different collectives in one round, or the group broke earlier: the ranks are out of step.
    #[error("collective out of step at rank {rank}: {reason}")]
    CollectiveMismatch {
        /// The rank reporting.
        rank: usize,
        /// What differed.
        reason: String,
    },
    /// An internal invariant was found broken (a bug in hicache).
    #[error("internal invariant broken: {0}")]
    Internal(String),
}

/// The lower-level error behind an [`Error`] or a page's failure: an `std::io::Error` (its `kind()` and
/// `raw_os_error()` tell ENOSPC from EIO), a device driver's error, ... Cloning shares it; two are equal when they are
/// the same error or say the same thing.
#[derive(Clone)]
pub struct Cause(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl Cause {
    /// Wraps `error`.
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(error))
    }

    /// The error as a `T`, when it is one.
    pub fn downcast_ref<T: std::error::Error + 'static>(&self) -> Option<&T> {
        self.0.downcast_ref::<T>()
    }

    /// The error as an `std::io::Error`, when it is one.
    pub fn io(&self) -> Option<&std::io::Error> {
        self.downcast_ref()
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for Cause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for Cause {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for Cause {}

impl From<std::io::Error> for Cause {
    fn from(error: std::io::Error) -> Self {
        Self::new(error)
    }
}

impl Error {
    /// A storage failure of `backend` with no lower-level error behind it.
    pub fn storage(backend: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Storage { backend: backend.into(), message: message.into(), source: None }
    }

    /// A storage failure of `backend` caused by `source` (its message is part of `message` or not, as the caller
    /// words it; the error itself stays reachable through [`cause`](Self::cause) and `std::error::Error::source`).
    pub fn storage_caused(backend: impl Into<String>, message: impl Into<String>, source: impl Into<Cause>) -> Self {
        Self::Storage { backend: backend.into(), message: message.into(), source: Some(source.into()) }
    }

    /// A device failure with no lower-level error behind it.
    pub fn device(operation: &'static str, message: impl Into<String>) -> Self {
        Self::Device { operation, message: message.into(), source: None }
    }

    /// A device failure caused by `source` (a driver's error).
    pub fn device_caused(operation: &'static str, message: impl Into<String>, source: impl Into<Cause>) -> Self {
        Self::Device { operation, message: message.into(), source: Some(source.into()) }
    }

    /// The lower-level error behind a storage or device failure, if any.
    pub fn cause(&self) -> Option<&Cause> {
        match self {
            Self::Storage { source, .. } | Self::Device { source, .. } => source.as_ref(),
            _ => None,
        }
    }

    /// The `std::io::Error` behind a storage failure, if that is what caused it.
    pub fn io_error(&self) -> Option<&std::io::Error> {
        self.cause().and_then(Cause::io)
    }
}

/// `text` cut to `shown` characters (with an ellipsis), so an error never carries a whole input.
pub(crate) fn shorten(text: &str, shown: usize) -> String {
    match text.char_indices().nth(shown) {
        None => text.to_owned(),
        Some((cut, _)) => format!("{}…", &text[..cut]),
    }
}

/// What kind of failure an [`Error`] is, for an engine to match on (as `std::io::ErrorKind`): whether to fix its
/// input, retry, fall back to recomputing, or stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller's input is wrong (tokens, keys, arguments, a configuration): fix it; retrying changes nothing.
    InvalidInput,
    /// A handle names nothing any more (a node removed, or from before a reset).
    NotFound,
    /// The call broke a state rule of the pools (a double free, a page of another pool, a page in the wrong state):
    /// a caller bug.
    InvalidState,
    /// The storage tier failed as a whole (its pages are misses; recompute).
    Storage,
    /// The device (GPU driver, compiler, kernel) failed; its copies are unspecified.
    Device,
    /// The backend does not offer the operation.
    Unsupported,
    /// A call or a collective did not finish in time.
    TimedOut,
    /// TP ranks entered different collectives: they are out of step.
    Collective,
    /// An invariant of hicache broke (a bug in hicache).
    Internal,
}

impl Error {
    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::InvalidToken { .. }
            | Self::InvalidTokenList { .. }
            | Self::InvalidKey { .. }
            | Self::PartialPage { .. }
            | Self::InvalidArgument { .. }
            | Self::InvalidConfig { .. } => ErrorKind::InvalidInput,
            Self::UnknownNode { .. } => ErrorKind::NotFound,
            Self::DoubleFree { .. } | Self::ForeignPage { .. } | Self::PageState { .. } => ErrorKind::InvalidState,
            Self::Storage { .. } => ErrorKind::Storage,
            Self::Device { .. } => ErrorKind::Device,
            Self::Unsupported { .. } => ErrorKind::Unsupported,
            Self::Timeout { .. } => ErrorKind::TimedOut,
            Self::CollectiveMismatch { .. } => ErrorKind::Collective,
            Self::Internal(_) => ErrorKind::Internal,
        }
    }
}

#[cfg(test)]
mod kind_tests {
    use super::*;

    #[test]
    fn kinds_sort_errors_by_what_a_caller_does_about_them() {
        let bad = Error::InvalidArgument { field: "device_slots", reason: "3 slots".into() };
        assert_eq!(bad.kind(), ErrorKind::InvalidInput);
        assert_eq!(Error::UnknownNode { node: 7 }.kind(), ErrorKind::NotFound);
        assert_eq!(Error::DoubleFree { page: "page 1".into() }.kind(), ErrorKind::InvalidState);
        let timeout = Error::Timeout { backend: "3fs".into(), operation: "a metadata call", waited_ms: 5 };
        assert_eq!(timeout.kind(), ErrorKind::TimedOut);
        assert_eq!(Error::device("transfer", "failed").kind(), ErrorKind::Device);
        assert_eq!(Error::Internal("x".into()).kind(), ErrorKind::Internal);
    }
}

#[cfg(test)]
mod cause_tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn an_io_error_behind_a_storage_failure_is_reachable_with_its_os_code() {
        let full = std::io::Error::from_raw_os_error(libc_enospc());
        let error = Error::storage_caused("file", "writing page 3", full);
        assert_eq!(error.kind(), ErrorKind::Storage);
        let io = error.io_error().expect("the io::Error is kept");
        assert_eq!(io.raw_os_error(), Some(libc_enospc()));
        assert_eq!(io.kind(), std::io::ErrorKind::StorageFull);
        // the standard chain reaches it too, for reporters that walk `source()`
        let source = error.source().expect("a source");
        assert_eq!(source.to_string(), std::io::Error::from_raw_os_error(libc_enospc()).to_string());
        assert!(Error::storage("file", "no source").cause().is_none());
        assert!(Error::InvalidArgument { field: "x", reason: "y".into() }.io_error().is_none());
        // equal when they say the same thing; a clone shares the same error
        assert_eq!(error.clone(), error);
        assert_ne!(error, Error::storage_caused("file", "writing page 3", std::io::Error::other("EIO")));
    }

    #[test]
    fn a_cause_downcasts_to_the_error_it_wraps() {
        #[derive(Debug, thiserror::Error)]
        #[error("driver error {code}")]
        struct Driver {
            code: u32,
        }
        let error = Error::device_caused("copy", "failed", Cause::new(Driver { code: 700 }));
        assert_eq!(error.cause().and_then(Cause::downcast_ref::<Driver>).map(|driver| driver.code), Some(700));
        assert!(error.io_error().is_none());
    }

    /// ENOSPC on Linux (hicache-core links no libc crate).
    fn libc_enospc() -> i32 {
        28
    }
}
