//! The crate's error type: one enum, each message naming the value at fault and what was expected.

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
    },
    /// The device (GPU driver, compiler or kernel) failed.
    #[error("device: {operation}: {message}")]
    Device {
        /// What was being done.
        operation: &'static str,
        /// The driver's or compiler's message.
        message: String,
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
        assert_eq!(Error::Device { operation: "transfer", message: "failed".into() }.kind(), ErrorKind::Device);
        assert_eq!(Error::Internal("x".into()).kind(), ErrorKind::Internal);
    }
}
