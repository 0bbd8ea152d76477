//! Page metadata: which key lives at which page of a data file, with LRU reuse of pages (SGLang's operations
//! `reserve_and_allocate_page_indices`, `confirm_write`, `get_page_indices`, `exists`, `delete_keys`, `clear`).
//!
//! Every operation takes a whole batch and is atomic: [`LocalMetadata`] under one lock (one process), and
//! [`RedisMetadata`] as one Lua script per batch (one round trip), so processes on several hosts share one file set.
//!
//! * A **space** is one data file: its pages are handed out to the keys of every namespace writing to it. Every call
//!   names the space's page count and page size; the first call records them and a call with others is refused
//!   naming both (two deployments that disagree on a file's geometry never share it).
//! * **Reserve** answers per key: already present (the LRU is touched), a page to write with a fresh generation, or
//!   none (every page is being written). A page comes from the free list, else from pages never used, else from the
//!   least recently used key, which loses its page there and then (readers holding that page's old generation fail
//!   their footer check). Each reservation bumps the page's generation.
//! * **Confirm** publishes written pages and frees the pages of failed writes; a reservation that is no longer the
//!   page's current one is ignored. When two writers raced on one key, the first to confirm wins and the other's page
//!   is freed (SGLang kept the last and leaked the first).
//! * **Locate** gives each key's page and generation and touches the LRU; **exists** does not touch it.
//! * A reservation is held until confirmed or released: a writer that dies between the two leaves its pages reserved
//!   until the space is cleared (counted in [`SpaceCounts::reserved`]).

mod local;
mod redis;

pub use local::LocalMetadata;
pub use redis::RedisMetadata;

use hicache_core::Error;

/// One data file's pages, as every metadata call names them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Space {
    /// The file (its absolute path): the metadata's name for the space.
    pub id: String,
    /// Pages in the file.
    pub num_pages: u64,
    /// Bytes per page.
    pub page_bytes: u64,
}

/// A page and the generation it was handed out with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Located {
    /// Page index in the file.
    pub index: u64,
    /// The page's generation when it was given to the writer.
    pub generation: u64,
}

impl Located {
    /// The metadata's text form, `index:generation`.
    pub(crate) fn render(&self) -> String {
        format!("{}:{}", self.index, self.generation)
    }

    /// Reads `index:generation`.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let (index, generation) = text.split_once(':')?;
        Some(Self { index: index.parse().ok()?, generation: generation.parse().ok()? })
    }
}

/// What reserving a key gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// The key is stored already; write nothing.
    Present,
    /// Write the page here, then confirm it.
    Page(Located),
    /// No page can be had: every page of the space is reserved by writers.
    Full,
}

/// Counts of one space's pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpaceCounts {
    /// Pages holding a confirmed key.
    pub stored: u64,
    /// Pages reserved by writers, not confirmed yet.
    pub reserved: u64,
}

/// Where page metadata lives; every method is one atomic operation on a batch.
pub trait PageMetadata: Send + Sync {
    /// What it is, for messages: `in-process`, or the Redis URL.
    fn describe(&self) -> String;

    /// Reserves a page for each key not stored yet.
    ///
    /// # Errors
    ///
    /// A space recorded with another geometry ([`Error::InvalidConfig`] naming both); the service failing.
    fn reserve(&self, space: &Space, keys: &[String]) -> Result<Vec<Reservation>, Error>;

    /// Publishes `written` (key, page) and frees `released` pages.
    ///
    /// # Errors
    ///
    /// As [`reserve`](Self::reserve).
    fn confirm(&self, space: &Space, written: &[(String, Located)], released: &[Located]) -> Result<(), Error>;

    /// Each key's page, touching the LRU of those found.
    ///
    /// # Errors
    ///
    /// As [`reserve`](Self::reserve).
    fn locate(&self, space: &Space, keys: &[String]) -> Result<Vec<Option<Located>>, Error>;

    /// Whether each key is stored (the LRU is left alone).
    ///
    /// # Errors
    ///
    /// The service failing.
    fn exists(&self, space: &Space, keys: &[String]) -> Result<Vec<bool>, Error>;

    /// Forgets the keys and frees their pages; returns how many were stored.
    ///
    /// # Errors
    ///
    /// The service failing.
    fn delete(&self, space: &Space, keys: &[String]) -> Result<usize, Error>;

    /// Forgets every key starting with `prefix` and frees their pages; returns how many there were.
    ///
    /// # Errors
    ///
    /// The service failing.
    fn clear(&self, space: &Space, prefix: &str) -> Result<u64, Error>;

    /// Every key starting with `prefix`.
    ///
    /// # Errors
    ///
    /// The service failing.
    fn list(&self, space: &Space, prefix: &str) -> Result<Vec<String>, Error>;

    /// Counts of the space's pages.
    ///
    /// # Errors
    ///
    /// The service failing.
    fn counts(&self, space: &Space) -> Result<SpaceCounts, Error>;

    /// Requests sent to the service so far (one per operation for Redis; 0 in process).
    fn round_trips(&self) -> u64;
}

/// The error for a space recorded with another geometry.
pub(crate) fn mismatch(space: &Space, pages: u64, page_bytes: u64) -> Error {
    Error::InvalidConfig {
        field: "file_size".into(),
        reason: format!(
            "{} is recorded in the page metadata as {pages} pages of {page_bytes} bytes, but this process sees {} \
             pages of {} bytes (another model, page size or file_size): give it its own file_path_prefix",
            space.id, space.num_pages, space.page_bytes
        ),
    }
}
