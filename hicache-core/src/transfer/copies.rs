//! How the CPU engine cuts a transfer into copies: the spans of a page that are contiguous in the device pool, the
//! host pool and the flat page alike ([`spans`]), copies into a page's segments merged while both sides continue
//! ([`SegmentCopy`]), and the same merge counted as the runs a GPU's copy engine would get ([`Runs`]).

use super::DeviceLayoutMap;
use crate::device_slots::DeviceSlot;
use crate::geometry::KvPart;
use crate::layout::HostLayoutMap;

/// Where flat page byte `flat` lies among a page's segments: (segment, offset in it). Every segment of a page has
/// the same length in every layout (one per part and layer, one per part, or one), and no row straddles two.
pub(super) fn locate<S: AsRef<[u8]>>(segments: &[S], flat: usize) -> (usize, usize) {
    let len = segments[0].as_ref().len();
    (flat / len, flat % len)
}

/// Rows of one page, layer, part and head group that are contiguous in the device pool, the host pool and the flat
/// page alike (a row is an item where the host pool has one head group: [`HostLayoutMap::row_bytes`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    pub(super) device: usize,
    pub(super) host: usize,
    pub(super) flat: usize,
    pub(super) items: usize,
}

/// The rows of host page `page` (device slots `page_slots`) for one layer, part and head group, as spans contiguous
/// on every side: the whole page at once where its slots are consecutive and the host layout keeps its tokens next
/// to each other (`layer_first`, `page_first_direct`, `page_unified` of one head group, `page_first` of one layer),
/// else row by row. Every offset is affine in the token within a page (for one layer, part and group), so equal
/// strides at the ends mean equal strides throughout. A device item holds its head groups side by side.
pub(super) fn spans(
    device_map: DeviceLayoutMap,
    host_map: HostLayoutMap,
    page: usize,
    page_slots: &[DeviceSlot],
    (layer, part, group): (usize, KvPart, usize),
) -> impl Iterator<Item = Span> {
    let first = page * host_map.page_size();
    let item = host_map.row_bytes();
    let at = move |offset: usize, slot: DeviceSlot| Span {
        device: device_map.item_offset(slot as usize, layer, part) + group * item,
        host: host_map.row_offset(first + offset, layer, part, group),
        flat: host_map.flat_row_offset(offset, layer, part, group),
        items: 1,
    };
    let last = page_slots.len().saturating_sub(1);
    let head = page_slots.first().map(|&slot| at(0, slot));
    // one span when the slots are consecutive and the items continue on every side
    let span = head.filter(|head| {
        last > 0 && page_slots.windows(2).all(|pair| pair[1] == pair[0] + 1) && {
            let tail = at(last, page_slots[last]);
            let length = last * item;
            [(tail.device, head.device), (tail.host, head.host), (tail.flat, head.flat)]
                .iter()
                .all(|&(end, start)| end.wrapping_sub(start) == length)
        }
    });
    let (singles, span) = match span {
        Some(head) => (0..0, Some(Span { items: page_slots.len(), ..head })),
        None => (0..page_slots.len(), None),
    };
    span.into_iter().chain(singles.map(move |offset| at(offset, page_slots[offset])))
}

/// Item copies between the device pool and one lease's page segments, merged while both sides continue where the
/// last item ended (consecutive slots of one segment); `copy(device offset, (page, flat offset), len)` does each.
pub(super) struct SegmentCopy {
    item: usize,
    segment: usize,
    device: usize,
    page: usize,
    flat: usize,
    len: usize,
}

impl SegmentCopy {
    /// Copies of `item`-byte items into or out of segments of `segment` bytes each.
    pub(super) fn new(item: usize, segment: usize) -> Self {
        Self { item, segment, device: 0, page: 0, flat: 0, len: 0 }
    }

    /// Adds the `len` bytes at `device` and at `flat` of page `page` (whole items, inside one segment).
    pub(super) fn push(
        &mut self,
        device: usize,
        page: usize,
        flat: usize,
        len: usize,
        copy: &mut dyn FnMut(usize, (usize, usize), usize),
    ) {
        debug_assert!(len.is_multiple_of(self.item) && flat % self.segment + len <= self.segment);
        let continues = self.len > 0
            && device == self.device + self.len
            && page == self.page
            && flat == self.flat + self.len
            // the run stays inside one segment: segment boundaries fall on multiples of the segment length
            && !flat.is_multiple_of(self.segment);
        if continues {
            self.len += len;
            return;
        }
        self.flush(copy);
        (self.device, self.page, self.flat, self.len) = (device, page, flat, len);
    }

    pub(super) fn flush(&mut self, copy: &mut dyn FnMut(usize, (usize, usize), usize)) {
        if self.len > 0 {
            copy(self.device, (self.page, self.flat), self.len);
            self.len = 0;
        }
    }
}

/// Item copies counted as the runs (one `memcpy` each) they merge into where both sides continue where the last
/// item ended in the pools' own offsets (consecutive slots of a page in `layer_first`, say): what a GPU's copy
/// engine would get per copy.
pub(super) struct Runs {
    item: usize,
    from: usize,
    to: usize,
    len: usize,
    /// Items pushed and runs counted so far.
    pub(super) items: u64,
    pub(super) runs: u64,
}

impl Runs {
    pub(super) fn new(item: usize) -> Self {
        Self { item, from: 0, to: 0, len: 0, items: 0, runs: 0 }
    }

    /// Adds `items` items contiguous on both sides, from `from` to `to`.
    pub(super) fn push(&mut self, from: usize, to: usize, items: usize) {
        self.items += items as u64;
        if self.len > 0 && from == self.from + self.len && to == self.to + self.len {
            self.len += items * self.item;
            return;
        }
        self.finish();
        (self.from, self.to, self.len) = (from, to, items * self.item);
    }

    pub(super) fn finish(&mut self) {
        if self.len > 0 {
            self.len = 0;
            self.runs += 1;
        }
    }
}
