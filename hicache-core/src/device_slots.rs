//! The engine's allocator of device KV slots (SGLang's `token_to_kv_pool_allocator`), which hicache borrows.
//!
//! The engine owns its device pool and the allocator of its slots: it allocates the slots of each prefill itself,
//! and hands its allocator to the tree for the calls that take or give back slots — a load back to the device takes
//! slots for the loaded tokens, a device eviction and an insert that finds tokens already cached give slots back.
//! hicache never keeps slots of its own beyond the nodes' copies. Slots come in whole pages: `page_size` consecutive
//! slots starting at a multiple of `page_size`, as SGLang's paged allocator hands them out.
//!
//! [`PagedSlots`] is a paged allocator for engines that have none (the CPU engine, the replay, the examples and
//! tests); an engine with its own block manager implements [`DeviceSlotAllocator`] over it.
//!
//! ```
//! use hicache_core::device_slots::{DeviceSlotAllocator, PagedSlots};
//!
//! // a device pool of 4 pages of 16 tokens
//! let mut slots = PagedSlots::new(4, 16).unwrap();
//! let prefill = slots.alloc_pages(3).unwrap();
//! assert_eq!(prefill.len(), 48);
//! assert!(slots.alloc_pages(2).is_none(), "one page left");
//! // the tree gives slots back when it evicts; a second free of the same slots is refused
//! slots.free(&prefill[16..32]).unwrap();
//! assert!(slots.free(&prefill[16..32]).is_err());
//! assert_eq!(slots.free_pages(), 2);
//! ```

use crate::error::Error;
use crate::host_pool::{HostPageAllocator, HostPageId};

/// A device pool slot: one token of the device KV pool.
pub type DeviceSlot = u32;

/// An allocator of device slots in whole pages, owned by the engine and lent to the tree per call.
pub trait DeviceSlotAllocator {
    /// Tokens per page.
    fn page_size(&self) -> usize;

    /// Slots of `pages` free pages (`page_size` slots each, in page order), or `None` when fewer pages are free;
    /// nothing is taken then.
    fn alloc_pages(&mut self, pages: usize) -> Option<Vec<DeviceSlot>>;

    /// Gives back whole pages of slots.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for slots that are not whole aligned pages; [`Error::DoubleFree`] for slots that
    /// are free already. Nothing is freed then.
    fn free(&mut self, slots: &[DeviceSlot]) -> Result<(), Error>;

    /// Free pages.
    fn free_pages(&self) -> usize;
}

/// A paged allocator of a device pool of `pages` pages: page `d` is slots `[d·P, (d+1)·P)`.
#[derive(Debug)]
pub struct PagedSlots {
    pages: HostPageAllocator,
    page_size: usize,
}

impl PagedSlots {
    /// An allocator of `pages` pages of `page_size` slots, all free.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for zero sizes or more pages than the allocator can index.
    pub fn new(pages: usize, page_size: usize) -> Result<Self, Error> {
        if page_size == 0 {
            return Err(Error::InvalidArgument { field: "page_size", reason: "must be at least 1".into() });
        }
        Ok(Self { pages: HostPageAllocator::new(pages)?, page_size })
    }

    /// Pages in the pool.
    pub fn capacity(&self) -> usize {
        self.pages.capacity()
    }

    /// Frees every page (the engine's flush, with SGLang's `/flush_cache`).
    pub fn clear(&mut self) {
        self.pages.clear();
    }

    fn pages_of(&self, slots: &[DeviceSlot]) -> Result<Vec<HostPageId>, Error> {
        check_pages(slots, self.page_size)?;
        slots.chunks(self.page_size).map(|page| self.pages.page_id(page[0] as usize / self.page_size)).collect()
    }
}

impl DeviceSlotAllocator for PagedSlots {
    fn page_size(&self) -> usize {
        self.page_size
    }

    fn alloc_pages(&mut self, pages: usize) -> Option<Vec<DeviceSlot>> {
        let pages = self.pages.alloc(pages)?;
        let page_size = self.page_size;
        Some(
            pages
                .iter()
                .flat_map(|page| (0..page_size).map(move |offset| (page.index() * page_size + offset) as DeviceSlot))
                .collect(),
        )
    }

    fn free(&mut self, slots: &[DeviceSlot]) -> Result<(), Error> {
        let pages = self.pages_of(slots)?;
        self.pages.free(&pages)
    }

    fn free_pages(&self) -> usize {
        self.pages.available()
    }
}

/// Checks that `slots` are whole aligned pages of `page_size`.
///
/// # Errors
///
/// [`Error::InvalidArgument`] naming `device_slots` and the first page that is not one.
pub fn check_pages(slots: &[DeviceSlot], page_size: usize) -> Result<(), Error> {
    if !slots.len().is_multiple_of(page_size) {
        return Err(Error::InvalidArgument {
            field: "device_slots",
            reason: format!("{} slots are not whole pages of {page_size}", slots.len()),
        });
    }
    for page in slots.chunks(page_size) {
        let first = page[0] as usize;
        let aligned = first.is_multiple_of(page_size)
            && page.iter().enumerate().all(|(offset, &slot)| slot as usize == first + offset);
        if !aligned {
            return Err(Error::InvalidArgument {
                field: "device_slots",
                reason: format!("slots {page:?} are not one aligned device page"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Against a set model: allocations never overlap, frees give pages back, bad frees change nothing.
        #[test]
        fn pages_are_handed_out_once_and_refused_frees_change_nothing(
            steps in proptest::collection::vec((0usize..4, 0usize..6), 1..60),
        ) {
            let (pages, page_size) = (10, 4);
            let mut slots = PagedSlots::new(pages, page_size).unwrap();
            let mut held: Vec<Vec<DeviceSlot>> = Vec::new();
            for (action, count) in steps {
                match action {
                    0 | 1 => match slots.alloc_pages(count) {
                        Some(given) => {
                            prop_assert_eq!(given.len(), count * page_size);
                            check_pages(&given, page_size).unwrap();
                            for page in &held {
                                prop_assert!(page.iter().all(|slot| !given.contains(slot)), "handed out twice");
                            }
                            if !given.is_empty() {
                                held.push(given);
                            }
                        }
                        None => prop_assert!(count > slots.free_pages()),
                    },
                    2 if !held.is_empty() => {
                        let given = held.remove(count % held.len());
                        slots.free(&given).unwrap();
                        // a second free is refused and changes nothing
                        let free = slots.free_pages();
                        prop_assert!(slots.free(&given).is_err());
                        prop_assert_eq!(slots.free_pages(), free);
                    }
                    _ => {
                        // a misaligned run is refused
                        prop_assert!(slots.free(&[1, 2, 3, 4]).is_err());
                    }
                }
                let held_pages: usize = held.iter().map(|slots| slots.len() / page_size).sum();
                prop_assert_eq!(slots.free_pages() + held_pages, pages);
            }
        }
    }
}
