//! The storage (L3) trait: page objects by key, batched, read into and written from caller-provided host memory.
//!
//! A page is given as a list of byte segments whose concatenation is the flat page ([`crate::layout`]): one segment
//! per part for the page-first layouts, so the bytes move straight between the host pool and the backend. Each
//! backend instance serves one [`StorageNamespace`] and renders its own key
//! strings from the page keys.
//!
//! Outcomes are per page ([`GetOutcome`], [`SetOutcome`]); `Err` is for a failure of the whole call. SGLang's
//! `batch_set` returns one bool for the batch and its `batch_get` a list or an int depending on the backend
//! (docs/sglang.md#storage-interface); here every backend answers the same way.

mod fault;
pub mod groups;
pub mod l3_layout;
mod memory;
pub mod replaceable;
mod stats;
pub mod tiers;
mod unified;

use std::fmt;
use std::sync::Arc;

pub use fault::{FaultCounts, FaultPlan, FaultyStorage};
pub use memory::{MemoryStorage, MemoryStore};
pub use stats::{StatsRecorder, StorageStats};
pub use unified::{OpenTier, UnifiedStorage, chunk_namespace_tag};

use crate::error::{Cause, Error};
use crate::hash::PageKey;
use crate::host_memory::MemoryRegion;
use crate::namespace::StorageNamespace;

/// Destination of one page: segments whose concatenation receives the page.
pub type PageSegmentsMut<'a> = Vec<&'a mut [u8]>;

/// Source of one page: segments whose concatenation is the page.
pub type PageSegments<'a> = Vec<&'a [u8]>;

/// Why one page failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// An I/O error.
    Io,
    /// The stored bytes failed an integrity check (short, torn or checksum mismatch); the object is treated as absent.
    Corrupt,
    /// The caller's buffer is not the stored page's size.
    SizeMismatch,
    /// The page did not complete in time.
    Timeout,
    /// Refused by the backend (full, rejected, unavailable).
    Rejected,
    /// Injected by [`FaultyStorage`].
    Injected,
}

/// One page's failure, with the backend's message and, where there is one, the error behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageFailure {
    /// The kind of failure.
    pub kind: FailureKind,
    /// What happened, with the numbers needed to act on it.
    pub message: String,
    /// The lower-level error (an `std::io::Error` for a file system's refusal: ENOSPC, EIO, ...).
    pub source: Option<Cause>,
}

impl PageFailure {
    /// A failure of `kind`.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into(), source: None }
    }

    /// A failure of `kind` caused by `source`.
    pub fn caused(kind: FailureKind, message: impl Into<String>, source: impl Into<Cause>) -> Self {
        Self { kind, message: message.into(), source: Some(source.into()) }
    }

    /// The `std::io::Error` behind it, if that is what caused it.
    pub fn io_error(&self) -> Option<&std::io::Error> {
        self.source.as_ref().and_then(Cause::io)
    }
}

impl fmt::Display for PageFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

/// Outcome of reading one page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GetOutcome {
    /// The page's bytes are in the destination.
    Hit,
    /// No such page; the destination is untouched.
    Miss,
    /// The read failed; the destination's contents are unspecified.
    Failed(PageFailure),
}

/// Outcome of writing one page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SetOutcome {
    /// The page was written.
    Stored,
    /// A page with this key was already stored (keys name content, so it was not rewritten).
    AlreadyPresent,
    /// The write failed; whatever was stored under the key before is unchanged.
    Failed(PageFailure),
}

impl SetOutcome {
    /// Whether the page is in storage after the call.
    pub fn is_stored(&self) -> bool {
        matches!(self, Self::Stored | Self::AlreadyPresent)
    }
}

/// A storage tier for pages.
///
/// Every method may be called from several threads at once. Within one call, keys may repeat.
pub trait StorageBackend: Send + Sync {
    /// Short name of the backend (`memory`, `file`, ...).
    fn name(&self) -> &str;

    /// The namespace this instance serves (model, geometry, layout, page size, ranks), so a controller refuses a
    /// backend opened for other pages than its pools hold ([`CacheController::with_storage`]); `None` for a backend
    /// that keeps no namespace (a test double). Every backend of this workspace returns its own.
    ///
    /// [`CacheController::with_storage`]: crate::controller::CacheController::with_storage
    fn namespace(&self) -> Option<&StorageNamespace> {
        None
    }

    /// The number of keys present, counted from the first key and stopping at the first absent one.
    ///
    /// # Errors
    ///
    /// A failure of the whole call.
    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error>;

    /// Reads pages into the caller's segments; one outcome per key.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `pages` does not have one entry per key, or a failure of the whole call.
    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error>;

    /// Writes pages from the caller's segments; one outcome per key.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `pages` does not have one entry per key, or a failure of the whole call.
    fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error>;

    /// Removes pages of this namespace; returns how many were present.
    ///
    /// # Errors
    ///
    /// A failure of the whole call.
    fn remove(&self, keys: &[PageKey]) -> Result<usize, Error>;

    /// Removes every page of this namespace, and nothing else; returns how many were removed.
    ///
    /// # Errors
    ///
    /// A failure of the whole call.
    fn clear(&self) -> Result<u64, Error>;

    /// Counters since the backend was opened.
    fn stats(&self) -> StorageStats;

    /// Tells the backend, once, about host memory that the segments of later calls will lie in (a host pool), so it
    /// can register it with its transport or map it, instead of per call. Segments outside every registered region
    /// must still work (the backend registers or copies them as it would without this call). The default does
    /// nothing.
    ///
    /// The caller keeps the memory mapped until it calls [`unregister_host_memory`](Self::unregister_host_memory)
    /// with the same region (the controller does when its I/O threads stop); the region grants no access by itself:
    /// bytes move only through each call's segments.
    ///
    /// # Errors
    ///
    /// A failure to register; the backend is then as before the call.
    fn register_host_memory(&self, region: &MemoryRegion) -> Result<(), Error> {
        let _ = region;
        Ok(())
    }

    /// Forgets a region told with [`register_host_memory`](Self::register_host_memory); no call in flight uses it.
    /// The default does nothing.
    fn unregister_host_memory(&self, region: &MemoryRegion) {
        let _ = region;
    }

    /// Every page of this namespace with its stored size in bytes, in no particular order.
    ///
    /// # Errors
    ///
    /// [`Error::Unsupported`] when the backend cannot enumerate its pages (the default); a failure of the call.
    fn list(&self) -> Result<Vec<(PageKey, u64)>, Error> {
        Err(Error::Unsupported { backend: self.name().to_owned(), operation: "list its pages" })
    }

    /// Waits until every page a [`batch_set`](Self::batch_set) reported stored is written where other processes
    /// find it: a backend that writes behind (its calls return before the bytes are written) drains its writes;
    /// the others (the default) return at once.
    ///
    /// # Errors
    ///
    /// A failure of the call (such as its deadline passing).
    fn flush(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Whether one page is present.
    ///
    /// # Errors
    ///
    /// As [`batch_exists`](Self::batch_exists).
    fn exists(&self, key: &PageKey) -> Result<bool, Error> {
        Ok(self.batch_exists(std::slice::from_ref(key))? == 1)
    }

    /// Whether each of `keys` is present: every key answered, not only a leading run (a sliding window's or a
    /// state's entries are held at some pages only). In one call where the backend can; the default asks
    /// [`exists`](Self::exists) key by key.
    ///
    /// # Errors
    ///
    /// As [`batch_exists`](Self::batch_exists).
    fn batch_contains(&self, keys: &[PageKey]) -> Result<Vec<bool>, Error> {
        keys.iter().map(|key| self.exists(key)).collect()
    }

    /// Reads one page.
    ///
    /// # Errors
    ///
    /// As [`batch_get`](Self::batch_get).
    fn get(&self, key: &PageKey, page: PageSegmentsMut<'_>) -> Result<GetOutcome, Error> {
        single(self.name(), self.batch_get(std::slice::from_ref(key), &mut [page])?)
    }

    /// Writes one page.
    ///
    /// # Errors
    ///
    /// As [`batch_set`](Self::batch_set).
    fn set(&self, key: &PageKey, page: PageSegments<'_>) -> Result<SetOutcome, Error> {
        single(self.name(), self.batch_set(std::slice::from_ref(key), &[page])?)
    }
}

/// A boxed or shared backend is a backend (so wrappers such as [`FaultyStorage`] take one chosen at run time, and a
/// caller may keep a handle on the backend it gives a controller).
macro_rules! forward_backend {
    ($($pointer:ident),*) => {$(
        impl<T: StorageBackend + ?Sized> StorageBackend for $pointer<T> {
            fn name(&self) -> &str {
                (**self).name()
            }

            fn namespace(&self) -> Option<&StorageNamespace> {
                (**self).namespace()
            }

            fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
                (**self).batch_exists(keys)
            }

            fn batch_contains(&self, keys: &[PageKey]) -> Result<Vec<bool>, Error> {
                (**self).batch_contains(keys)
            }

            fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
                (**self).batch_get(keys, pages)
            }

            fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
                (**self).batch_set(keys, pages)
            }

            fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
                (**self).remove(keys)
            }

            fn clear(&self) -> Result<u64, Error> {
                (**self).clear()
            }

            fn stats(&self) -> StorageStats {
                (**self).stats()
            }

            fn register_host_memory(&self, region: &MemoryRegion) -> Result<(), Error> {
                (**self).register_host_memory(region)
            }

            fn unregister_host_memory(&self, region: &MemoryRegion) {
                (**self).unregister_host_memory(region);
            }

            fn list(&self) -> Result<Vec<(PageKey, u64)>, Error> {
                (**self).list()
            }

            fn flush(&self) -> Result<(), Error> {
                (**self).flush()
            }
        }
    )*};
}

forward_backend!(Box, Arc);

fn single<T>(backend: &str, outcomes: Vec<T>) -> Result<T, Error> {
    let count = outcomes.len();
    let mut outcomes = outcomes.into_iter();
    match (outcomes.next(), outcomes.next()) {
        (Some(outcome), None) => Ok(outcome),
        _ => Err(Error::storage(backend, format!("{count} outcomes for one key"))),
    }
}

/// Checks that a batch has one page per key.
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming both counts.
pub fn check_batch(keys: usize, pages: usize) -> Result<(), Error> {
    if keys == pages {
        Ok(())
    } else {
        Err(Error::InvalidArgument { field: "pages", reason: format!("{pages} pages for {keys} keys") })
    }
}

/// The failure of a page given in a buffer of another size than the namespace's pages (every backend words it so).
pub fn size_mismatch(given: usize, page_bytes: usize) -> PageFailure {
    PageFailure::new(
        FailureKind::SizeMismatch,
        format!("the buffer holds {given} bytes; a page of this namespace is {page_bytes} bytes"),
    )
}

/// A backend's refusal of every later call once a failure may have left I/O in flight into the caller's memory (a
/// transfer the library may still finish, a ring with requests out): from then on each call fails saying why, and
/// the backend must be reopened. The first reason is kept.
#[derive(Debug, Default)]
pub struct Poison(std::sync::Mutex<Option<String>>);

impl Poison {
    /// `Ok` while no failure poisoned the backend.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] of `backend` with the reason, once poisoned.
    pub fn check(&self, backend: &str) -> Result<(), Error> {
        match &*self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
            Some(why) => Err(Error::storage(backend, why.clone())),
            None => Ok(()),
        }
    }

    /// Refuses every later call for `why` (logged), unless an earlier reason already does.
    pub fn set(&self, backend: &str, why: String) {
        tracing::error!(backend, "refusing further calls: {why}");
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(why);
    }
}

/// Total length of a page given as segments.
pub fn segments_len<S: AsRef<[u8]>>(segments: &[S]) -> usize {
    segments.iter().map(|segment| segment.as_ref().len()).sum()
}

/// Copies `bytes` into the segments in order.
///
/// # Panics
///
/// When the lengths differ (check with [`segments_len`] first).
pub fn scatter(bytes: &[u8], segments: &mut [&mut [u8]]) {
    assert_eq!(bytes.len(), segments_len(segments), "scatter: length mismatch");
    let mut rest = bytes;
    for segment in segments.iter_mut() {
        let (head, tail) = rest.split_at(segment.len());
        segment.copy_from_slice(head);
        rest = tail;
    }
}

/// The concatenation of the segments.
pub fn gather(segments: &[&[u8]]) -> Vec<u8> {
    segments.concat()
}

#[cfg(test)]
mod poison_tests {
    use super::*;

    #[test]
    fn a_poisoned_backend_refuses_with_its_first_reason_and_sizes_are_worded_once() {
        let poison = Poison::default();
        assert!(poison.check("x").is_ok());
        poison.set("x", "a transfer may still run".into());
        poison.set("x", "a later reason".into());
        let error = poison.check("x").unwrap_err();
        assert_eq!(error.kind(), crate::ErrorKind::Storage);
        assert_eq!(error.to_string(), "storage backend x: a transfer may still run");
        let failure = size_mismatch(10, 64);
        assert_eq!(failure.kind, FailureKind::SizeMismatch);
        assert!(failure.message.contains("10 bytes") && failure.message.contains("64 bytes"), "{failure}");
    }
}
