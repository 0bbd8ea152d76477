//! The host pool's memory (L2), and page leases: the only way to reach its bytes from more than one thread.
//!
//! [`HostMemory`] owns the bytes of a host pool, laid out by a [`HostLayoutMap`]: a page-aligned anonymous mapping,
//! or a file in shared memory (`/dev/shm`) that another process can map (3FS's agent wraps the same bytes as its I/O
//! buffer; see [`HostAllocation`]). The GPU engine pins the same mapping in place, so one set of bytes serves the
//! device's copies, the storage tier's reads and writes, and a backend's registration.
//!
//! Three kinds of users touch a page's bytes: the transfer engine (a backup writes a page, a load reads it), the
//! storage tier's backup thread (reads the pages it writes to storage) and its fetch thread (writes the pages it reads
//! from storage). Each asks for a **lease** on the pages it is about to touch:
//! * a [`ReadLease`] lends the pages' segments as `&[u8]`; several read leases may cover a page at once (a page may
//!   be loaded to the device while it is backed up to storage);
//! * a [`WriteLease`] lends them as `&mut [u8]` and excludes every other lease on those pages.
//!
//! A lease on a page that conflicts is refused with the page named ([`HostMemory::lend_read`],
//! [`HostMemory::lend_write`]), or waited for (`HostMemory::lend_read_waiting` and its write twin, which the CPU
//! engine uses as a DMA engine would: its copy happens when the memory is free). The controller's page states
//! already keep these users apart (a page being fetched is reserved, a page being backed up is pinned); the leases
//! make that protocol checkable: a bug in it becomes a refused lease naming the page instead of a data race, and the
//! tests check the protocol against them. Leases are per batch: the fetch thread returns a batch's lease before it
//! counts the batch's tokens, so a page a load may read (counted) is never still lent for a write.
//!
//! Bytes a lease does not cover are never turned into references, so threads working on different pages never
//! alias. The GPU's own copies are not Rust accesses; the controller holds the pages they use in the `protected`
//! state until their event completes, and refuses to start one on a page lent to storage.

#![expect(unsafe_code, reason = "the host pool's bytes are shared between threads through leases; SAFETY below")]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use memmap2::MmapMut;

use crate::error::Error;
use crate::host_pool::{HostPageAllocator, HostPageId};
use crate::layout::HostLayoutMap;
use crate::sync::{Condvar, Mutex, MutexGuard};

/// Where a host pool's bytes are allocated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum HostAllocation {
    /// Private anonymous memory (page-aligned, zeroed).
    #[default]
    Anonymous,
    /// A new file in the shared-memory directory `dir` (normally `/dev/shm`), mapped shared: another process (a
    /// storage agent) can map the same bytes by its path. The file is filled once at creation, so a directory too
    /// small for the pool fails then (`ENOSPC`) rather than with a bus error later; it is removed when the pool
    /// drops.
    SharedMemory {
        /// The directory (a tmpfs).
        dir: PathBuf,
    },
}

impl HostAllocation {
    /// Shared memory in `/dev/shm`.
    pub fn shared_memory() -> Self {
        Self::SharedMemory { dir: PathBuf::from("/dev/shm") }
    }
}

/// A range of host memory a storage backend may be told about once ([`crate::storage::StorageBackend::register_host_memory`]),
/// so that it can register it with its transport (NIXL, Mooncake) or map it (3FS) instead of doing so per call.
/// It describes memory; it grants no access to it: bytes move only through the segments of each call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryRegion {
    address: usize,
    len: usize,
    shared_memory: Option<PathBuf>,
}

impl MemoryRegion {
    /// A region of `len` bytes at `address`, mapped from the shared-memory file `shared_memory` if any.
    ///
    /// # Safety
    ///
    /// The memory stays mapped, readable and writable from `address` for `len` bytes until every backend told about
    /// it has been told to forget it ([`crate::storage::StorageBackend::unregister_host_memory`]).
    pub unsafe fn from_raw_parts(address: *const u8, len: usize, shared_memory: Option<PathBuf>) -> Self {
        Self { address: address as usize, len, shared_memory }
    }

    /// The first byte's address.
    pub fn address(&self) -> usize {
        self.address
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shared-memory file the region is mapped from (its start is the file's start).
    pub fn shared_memory(&self) -> Option<&Path> {
        self.shared_memory.as_deref()
    }

    /// Whether `[address, address + len)` lies inside the region.
    pub fn contains(&self, address: usize, len: usize) -> bool {
        address >= self.address && address.checked_add(len).is_some_and(|end| end <= self.address + self.len)
    }
}

/// How a lease uses its pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Reads them (shared).
    Read,
    /// Writes them (exclusive).
    Write,
}

/// A page's lease count: readers, or [`WRITER`].
const WRITER: u32 = u32::MAX;

#[derive(Debug)]
struct LeaseTable {
    /// Per page: 0 (free), the number of read leases, or [`WRITER`].
    pages: Mutex<Vec<u32>>,
    returned: Condvar,
}

/// Where the mapping came from; kept only to unmap (and remove the file) on drop.
#[derive(Debug)]
enum Backing {
    Mapped(#[expect(dead_code, reason = "held for its Drop: the mapping lives as long as the pool")] MmapMut),
    Shared { _map: MmapMut, path: PathBuf },
}

/// The bytes of one host pool, lent page by page. See the module documentation.
#[derive(Debug)]
pub struct HostMemory {
    /// The pool the page ids of this memory belong to ([`allocator`](Self::allocator) hands them out).
    pool: u32,
    base: NonNull<u8>,
    map: HostLayoutMap,
    leases: LeaseTable,
    backing: Backing,
}

// SAFETY: the mapping is owned by this value and lives until it drops; its bytes are reached only through leases,
// whose table (behind a mutex) gives a page to one writer or to readers at a time, so sharing the value between
// threads shares no unsynchronised access.
unsafe impl Send for HostMemory {}
// SAFETY: as Send.
unsafe impl Sync for HostMemory {}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // the table is only changed by whole loops that cannot panic halfway (plain integer updates)
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl HostMemory {
    /// Zeroed host memory for the pool `map`, allocated as `allocation` says.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] (field `host_allocation`) when the memory cannot be mapped or the shared-memory file
    /// cannot be created or filled; the message names the size and the path.
    pub fn new(map: HostLayoutMap, allocation: &HostAllocation) -> Result<Self, Error> {
        let bytes = map.total_bytes();
        let refuse = |what: String| Error::InvalidArgument { field: "host_allocation", reason: what };
        let (mut mapping, backing_path) = match allocation {
            HostAllocation::Anonymous => (
                MmapMut::map_anon(bytes).map_err(|error| {
                    refuse(format!("cannot map {bytes} bytes ({:.2} GB): {error}", bytes as f64 / 1e9))
                })?,
                None,
            ),
            HostAllocation::SharedMemory { dir } => {
                let (file, path) = create_shared_file(dir, bytes).map_err(refuse)?;
                // SAFETY: the file was created by us with O_EXCL under a random name and is never truncated while
                // mapped; other processes that map it (a storage agent) do so to share these bytes, which is the
                // purpose of the allocation.
                let mapping = unsafe { MmapMut::map_mut(&file) }.map_err(|error| {
                    let _ = std::fs::remove_file(&path);
                    refuse(format!("cannot map {}: {error}", path.display()))
                })?;
                (mapping, Some(path))
            }
        };
        let base = NonNull::new(mapping.as_mut_ptr()).ok_or_else(|| refuse("the mapping is at address 0".into()))?;
        let backing = match backing_path {
            None => Backing::Mapped(mapping),
            Some(path) => Backing::Shared { _map: mapping, path },
        };
        Ok(Self {
            pool: crate::host_pool::next_pool(),
            base,
            map,
            leases: LeaseTable { pages: Mutex::new(vec![0; map.pages()]), returned: Condvar::new() },
            backing,
        })
    }

    /// Zeroed anonymous host memory for `map`.
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn anonymous(map: HostLayoutMap) -> Result<Self, Error> {
        Self::new(map, &HostAllocation::Anonymous)
    }

    /// The pool's byte map.
    pub fn map(&self) -> &HostLayoutMap {
        &self.map
    }

    /// An allocator of this memory's pages, all idle: the page ids it hands out are the ones this memory's leases
    /// (and the engines over it) take; ids of any other pool are refused.
    ///
    /// # Errors
    ///
    /// As [`HostPageAllocator::new`].
    pub fn allocator(&self) -> Result<HostPageAllocator, Error> {
        self.allocator_of(self.map.pages())
    }

    /// An allocator of this memory's first `pages` pages (a controller that uses part of the pool).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] (field `host_pages`) when the memory holds fewer pages.
    pub(crate) fn allocator_of(&self, pages: usize) -> Result<HostPageAllocator, Error> {
        if pages > self.map.pages() {
            return Err(Error::InvalidArgument {
                field: "host_pages",
                reason: format!("{pages} pages, the engine's host memory holds {}", self.map.pages()),
            });
        }
        HostPageAllocator::for_pool(self.pool, pages)
    }

    /// Every page of the pool, in order: for a caller that leases the whole pool (a bulk copy, a fill).
    pub fn all_pages(&self) -> Vec<HostPageId> {
        self.ids(0..self.map.pages())
    }

    /// The ids of this pool's pages at `indices`.
    fn ids(&self, indices: impl IntoIterator<Item = usize>) -> Vec<HostPageId> {
        indices.into_iter().map(|index| HostPageId::new(self.pool, index)).collect()
    }

    /// Checks that every one of `pages` is a page of this pool: one of [`allocator`](Self::allocator)'s ids, in
    /// range.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] (field `pages`) naming the first page of another pool or out of range.
    pub fn check_pages(&self, pages: &[HostPageId]) -> Result<(), Error> {
        let refuse = |reason: String| Err(Error::InvalidArgument { field: "pages", reason });
        match pages.iter().find(|page| page.pool() != self.pool || page.index() >= self.map.pages()) {
            Some(page) if page.pool() != self.pool => {
                refuse(format!("host {page} is not a page of this host memory (pool {})", self.pool))
            }
            Some(page) => refuse(format!("host page {} out of range ({} pages)", page.index(), self.map.pages())),
            None => Ok(()),
        }
    }

    /// Bytes of one flat page.
    pub fn page_bytes(&self) -> usize {
        self.map.page_bytes()
    }

    /// The whole pool as a region to tell storage backends about (address, length, shared-memory file).
    pub fn region(&self) -> MemoryRegion {
        let shared_memory = match &self.backing {
            Backing::Mapped(_) => None,
            Backing::Shared { path, .. } => Some(path.clone()),
        };
        MemoryRegion { address: self.base.as_ptr() as usize, len: self.map.total_bytes(), shared_memory }
    }

    /// The first byte, for an engine that pins the pool or gives it to a device (the GPU engine's
    /// `cuMemHostRegister`). Reaching the bytes through it is the caller's `unsafe`, under the controller's page states.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Lends `pages` for reading, or refuses when one is lent for writing (naming it). Pages may repeat.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a page of another pool or out of range; [`Error::PageState`] for a page lent
    /// for writing.
    pub fn lend_read(&self, pages: &[HostPageId]) -> Result<ReadLease<'_>, Error> {
        Ok(ReadLease { memory: self, pages: self.lend(pages, Access::Read, false)? })
    }

    /// Lends `pages` for writing, or refuses when one is lent at all (naming it).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a page of another pool, out of range or listed twice; [`Error::PageState`] for
    /// a page lent.
    pub fn lend_write(&self, pages: &[HostPageId]) -> Result<WriteLease<'_>, Error> {
        Ok(WriteLease { memory: self, pages: self.lend(pages, Access::Write, false)? })
    }

    /// As [`lend_read`](Self::lend_read), waiting for conflicting leases to return instead of refusing (a lease the
    /// calling thread holds itself never returns: the caller must not hold one on these pages).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a page of another pool or out of range.
    pub(crate) fn lend_read_waiting(&self, pages: &[HostPageId]) -> Result<ReadLease<'_>, Error> {
        Ok(ReadLease { memory: self, pages: self.lend(pages, Access::Read, true)? })
    }

    /// As [`lend_write`](Self::lend_write), waiting for conflicting leases to return instead of refusing (the caller
    /// must not hold a lease on these pages itself).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a page of another pool, out of range or listed twice.
    pub fn lend_write_waiting(&self, pages: &[HostPageId]) -> Result<WriteLease<'_>, Error> {
        Ok(WriteLease { memory: self, pages: self.lend(pages, Access::Write, true)? })
    }

    /// The first of `pages` lent now, and how; pages of another pool or out of range are never lent.
    pub fn lent(&self, pages: &[HostPageId]) -> Option<(HostPageId, Access)> {
        let table = lock(&self.leases.pages);
        pages.iter().find_map(|&page| match self.slot(&table, page) {
            Some(0) | None => None,
            Some(WRITER) => Some((page, Access::Write)),
            Some(_) => Some((page, Access::Read)),
        })
    }

    /// The first of `pages` lent for writing now.
    pub fn lent_for_writing(&self, pages: &[HostPageId]) -> Option<HostPageId> {
        let table = lock(&self.leases.pages);
        pages.iter().copied().find(|&page| self.slot(&table, page) == Some(WRITER))
    }

    /// `page`'s entry in the lease table, when it is a page of this pool.
    fn slot(&self, table: &[u32], page: HostPageId) -> Option<u32> {
        (page.pool() == self.pool).then(|| table.get(page.index()).copied()).flatten()
    }

    /// Runs `f` on the whole pool's bytes, once no lease is out on any page (and none is granted meanwhile); the
    /// calling thread must hold no lease.
    pub fn with_all_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        let _lease = self.lend_write_waiting(&self.all_pages()).expect("every page is in range and listed once");
        // SAFETY: the write lease covers every page, and the pages tile the buffer (layout invariant), so no other
        // reference to any byte of the pool exists until the lease drops at the end of this call.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr(), self.map.total_bytes()) };
        f(bytes)
    }

    /// Copies `pages` out in flat page order (a read lease for the copy).
    ///
    /// # Errors
    ///
    /// As [`lend_read`](Self::lend_read).
    pub fn copy_pages_out(&self, pages: &[HostPageId]) -> Result<Vec<u8>, Error> {
        let lease = self.lend_read(pages)?;
        Ok(lease.pages().iter().flat_map(|segments| segments.concat()).collect())
    }

    /// Lends `pages` (checked against the pool) and returns their indices, which the lease keeps.
    fn lend(&self, pages: &[HostPageId], access: Access, wait: bool) -> Result<Vec<usize>, Error> {
        self.check_pages(pages)?;
        let pages: Vec<usize> = pages.iter().map(|page| page.index()).collect();
        if access == Access::Write {
            let mut sorted = pages.to_vec();
            sorted.sort_unstable();
            if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
                return Err(Error::InvalidArgument {
                    field: "pages",
                    reason: format!("host page {} is listed twice for one write", pair[0]),
                });
            }
        }
        let mut table = lock(&self.leases.pages);
        loop {
            let conflict = pages.iter().copied().find(|&page| match access {
                Access::Read => table[page] >= WRITER - 1,
                Access::Write => table[page] != 0,
            });
            match conflict {
                None => break,
                Some(page) if !wait => {
                    return Err(Error::PageState {
                        page: format!("host page {page}"),
                        operation: match access {
                            Access::Read => "lend for reading",
                            Access::Write => "lend for writing",
                        },
                        expected: match access {
                            Access::Read => "not lent for writing".into(),
                            Access::Write => "not lent".into(),
                        },
                        found: if table[page] == WRITER {
                            "lent for writing".into()
                        } else {
                            format!("lent for reading ({} leases)", table[page])
                        },
                    });
                }
                Some(_) => table = self.leases.returned.wait(table).unwrap_or_else(|poisoned| poisoned.into_inner()),
            }
        }
        for &page in &pages {
            table[page] = match access {
                Access::Read => table[page] + 1,
                Access::Write => WRITER,
            };
        }
        Ok(pages)
    }

    fn give_back(&self, pages: &[usize], access: Access) {
        let mut table = lock(&self.leases.pages);
        for &page in pages {
            table[page] = match access {
                Access::Read => table[page] - 1,
                Access::Write => 0,
            };
        }
        drop(table);
        self.leases.returned.notify_all();
    }

    /// The segments of `page` as raw ranges (offset, length) of the pool.
    fn segments(&self, page: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.map.page_segments(page).into_iter().map(|segment| (segment.offset, segment.len))
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if let Backing::Shared { path, .. } = &self.backing {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Creates a file of `bytes` in `dir` under a new random name, filled with zeros.
fn create_shared_file(dir: &Path, bytes: usize) -> Result<(File, PathBuf), String> {
    use std::hash::{BuildHasher as _, Hasher as _};
    use std::io::Write as _;
    for _ in 0..16 {
        // RandomState is seeded from the OS's random source per process and varies per instance
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u128(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos(),
        );
        let path = dir.join(format!("hicache-host-pool-{:016x}", hasher.finish()));
        let mut file = match std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(error) => return Err(format!("cannot create {} in shared memory: {error}", path.display())),
        };
        let zeros = vec![0u8; (1 << 20).min(bytes.max(1))];
        let mut left = bytes;
        while left > 0 {
            let chunk = left.min(zeros.len());
            if let Err(error) = file.write_all(&zeros[..chunk]) {
                let _ = std::fs::remove_file(&path);
                return Err(format!(
                    "cannot fill {} with {bytes} bytes ({:.2} GB): {error}",
                    path.display(),
                    bytes as f64 / 1e9
                ));
            }
            left -= chunk;
        }
        return Ok((file, path));
    }
    Err(format!("no free name for a host pool file in {}", dir.display()))
}

/// Pages lent for reading; returned when dropped.
#[derive(Debug)]
pub struct ReadLease<'a> {
    memory: &'a HostMemory,
    pages: Vec<usize>,
}

impl ReadLease<'_> {
    /// The lent pages, in order.
    pub fn page_ids(&self) -> Vec<HostPageId> {
        self.memory.ids(self.pages.iter().copied())
    }

    /// Each lent page's segments, in flat page order (what storage I/O takes).
    pub fn pages(&self) -> Vec<Vec<&[u8]>> {
        (0..self.pages.len()).map(|index| self.page(index)).collect()
    }

    /// The segments of the `index`-th lent page.
    ///
    /// # Panics
    ///
    /// When `index` is not below the number of lent pages.
    pub fn page(&self, index: usize) -> Vec<&[u8]> {
        let base = self.memory.base.as_ptr();
        self.memory
            .segments(self.pages[index])
            .map(|(offset, len)| {
                // SAFETY: the range is a segment of a page this lease holds for reading (in the mapping: the map's
                // segments lie inside `total_bytes`), so while the lease lives no write lease, and so no `&mut`, covers
                // these bytes; the lease outlives the returned slice (its lifetime is tied to `&self`).
                unsafe { std::slice::from_raw_parts(base.add(offset), len) }
            })
            .collect()
    }
}

impl Drop for ReadLease<'_> {
    fn drop(&mut self) {
        self.memory.give_back(&self.pages, Access::Read);
    }
}

/// Pages lent for writing (and reading), exclusively; returned when dropped.
#[derive(Debug)]
pub struct WriteLease<'a> {
    memory: &'a HostMemory,
    pages: Vec<usize>,
}

impl WriteLease<'_> {
    /// The lent pages, in order.
    pub fn page_ids(&self) -> Vec<HostPageId> {
        self.memory.ids(self.pages.iter().copied())
    }

    /// Each lent page's segments, mutable, in flat page order (what storage reads land in).
    pub fn pages_mut(&mut self) -> Vec<Vec<&mut [u8]>> {
        let base = self.memory.base.as_ptr();
        let memory = self.memory;
        self.pages
            .iter()
            .map(|&page| {
                memory
                    .segments(page)
                    .map(|(offset, len)| {
                        // SAFETY: the range is a segment of a page this lease holds exclusively (no other lease, and
                        // so no other reference, covers it); pages of one lease are distinct (checked when lent) and
                        // segments of distinct pages are disjoint (the layout's tiling invariant), so the slices
                        // returned together never overlap; they borrow `self` mutably, so no second call aliases them.
                        unsafe { std::slice::from_raw_parts_mut(base.add(offset), len) }
                    })
                    .collect()
            })
            .collect()
    }
}

impl Drop for WriteLease<'_> {
    fn drop(&mut self) {
        self.memory.give_back(&self.pages, Access::Write);
    }
}

#[cfg(all(test, not(loom)))]
mod tests;

#[cfg(all(test, loom))]
mod loom_tests;
