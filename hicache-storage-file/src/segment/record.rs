//! One record of a segment's index file: what a batch wrote to the segment's data file (or which keys it removed).
//!
//! A segment is two files: `{name}.seg`, the pages, and `{name}.idx`, the records, back to back. A record (little-
//! endian) is:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `HCSG` |
//! | 4..8 | format version |
//! | 8..12 | kind: 0 pages, 1 removals |
//! | 12..16 | entries |
//! | 16..24 | bytes per page |
//! | 24..32 | where the pages start in the data file |
//! | 32..40 | bytes the pages take there: theirs, or rounded up to a 4 KiB block by a writer with `O_DIRECT` (so its next batch starts on one) |
//! | 40..48 | stamp: nanoseconds since the epoch, increasing within a writer (orders a removal against a write) |
//! | 48.. | per entry: the key (32 bytes) and the page's checksum (8 bytes): the XXH3-64 of the page seeded with the XXH3-64 of the namespace digest and the key |
//! | then | the XXH3-64 of the namespace digest and every byte of the record before it |
//!
//! A batch's pages are written to the data file first; only then is its record appended to the index file. So a
//! reader (or a process opening the namespace after a writer was killed) that finds a whole record finds whole pages
//! behind it; after a power loss a page may still be torn, and its checksum tells. A torn or damaged record ends
//! what a reader takes from the index file.

use std::hash::Hasher as _;

use hicache_core::hash::PageKey;
use twox_hash::XxHash3_64;

/// Alignment of each batch's pages in the data file, and the unit of `O_DIRECT` here.
pub(crate) const ALIGN: usize = crate::page_file::DIRECT_ALIGN;
const MAGIC: [u8; 4] = *b"HCSG";
const VERSION: u32 = 1;
/// The fixed part of a header.
pub(crate) const FIXED: usize = 48;
/// Bytes per entry.
pub(crate) const ENTRY: usize = 40;
/// The most entries one record holds (a batch larger than this is written as several records).
pub(crate) const MAX_ENTRIES: usize = 4096;

/// What a record says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Pages, in the data file.
    Pages,
    /// Keys removed: copies written before the stamp are gone.
    Removals,
}

impl Kind {
    fn code(self) -> u32 {
        match self {
            Self::Pages => 0,
            Self::Removals => 1,
        }
    }

    fn from_code(code: u32) -> Option<Self> {
        match code {
            0 => Some(Self::Pages),
            1 => Some(Self::Removals),
            _ => None,
        }
    }
}

/// A decoded header.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    pub(crate) page_bytes: u64,
    /// Where the pages start in the data file.
    pub(crate) data_at: u64,
    /// Bytes they take there.
    pub(crate) data_bytes: u64,
    pub(crate) stamp: u64,
    /// Keys with their page checksums (0 for removals).
    pub(crate) entries: Vec<(PageKey, u64)>,
}

/// Bytes a header of `entries` takes, checksum included.
pub(crate) fn header_len(entries: usize) -> usize {
    FIXED + entries * ENTRY + 8
}

/// `bytes` rounded up to a whole block.
pub(crate) fn round_up(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// Bytes a batch of `entries` pages of `page_bytes` takes in the data file (none for removals); `aligned`: rounded
/// up to a whole block, so that the next batch starts on one (for `O_DIRECT`).
pub(crate) fn data_bytes(kind: Kind, entries: usize, page_bytes: usize, aligned: bool) -> usize {
    match (kind, aligned) {
        (Kind::Pages, true) => round_up(entries * page_bytes),
        (Kind::Pages, false) => entries * page_bytes,
        (Kind::Removals, _) => 0,
    }
}

/// The checksum of a page: the XXH3-64 of its bytes (its segments, one after another), seeded with the XXH3-64 of
/// the namespace digest and the key, so that a page copied under another key or namespace fails it.
pub(crate) fn page_checksum<S: AsRef<[u8]>>(digest: &[u8], key: &PageKey, page: &[S]) -> u64 {
    let seed = key_seed(digest, key);
    match page {
        // one pass over the page, without the streaming hasher's buffer
        [only] => XxHash3_64::oneshot_with_seed(seed, only.as_ref()),
        _ => {
            let mut hasher = XxHash3_64::with_seed(seed);
            for segment in page {
                hasher.write(segment.as_ref());
            }
            hasher.finish()
        }
    }
}

/// The XXH3-64 of the namespace digest and the key, one after the other: in one pass over a copy on the stack
/// where they fit (the streaming hasher allocates its buffer, once per page read or written).
fn key_seed(digest: &[u8], key: &PageKey) -> u64 {
    const STACK: usize = 128;
    let length = digest.len() + key.as_bytes().len();
    if length > STACK {
        let mut binding = XxHash3_64::with_seed(0);
        binding.write(digest);
        binding.write(key.as_bytes());
        return binding.finish();
    }
    let mut bytes = [0u8; STACK];
    bytes[..digest.len()].copy_from_slice(digest);
    bytes[digest.len()..length].copy_from_slice(key.as_bytes());
    XxHash3_64::oneshot_with_seed(0, &bytes[..length])
}

fn header_checksum(digest: &[u8], bytes: &[u8]) -> u64 {
    let mut hasher = XxHash3_64::with_seed(0);
    hasher.write(digest);
    hasher.write(bytes);
    hasher.finish()
}

/// Encodes a header into `out` ([`header_len`] bytes).
pub(crate) fn encode(digest: &[u8], header: &Header, out: &mut [u8]) {
    let count = header.entries.len();
    let end = FIXED + count * ENTRY;
    out[..4].copy_from_slice(&MAGIC);
    out[4..8].copy_from_slice(&VERSION.to_le_bytes());
    out[8..12].copy_from_slice(&header.kind.code().to_le_bytes());
    out[12..16].copy_from_slice(&(count as u32).to_le_bytes());
    out[16..24].copy_from_slice(&header.page_bytes.to_le_bytes());
    out[24..32].copy_from_slice(&header.data_at.to_le_bytes());
    out[32..40].copy_from_slice(&header.data_bytes.to_le_bytes());
    out[40..48].copy_from_slice(&header.stamp.to_le_bytes());
    for (index, (key, checksum)) in header.entries.iter().enumerate() {
        let at = FIXED + index * ENTRY;
        out[at..at + 32].copy_from_slice(key.as_bytes());
        out[at + 32..at + ENTRY].copy_from_slice(&checksum.to_le_bytes());
    }
    let checksum = header_checksum(digest, &out[..end]);
    out[end..end + 8].copy_from_slice(&checksum.to_le_bytes());
}

/// What the start of a record says before its entries are read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Peek {
    /// A header of this many bytes (checksum included) starts here: read that much and [`decode`] it.
    Header(usize),
    /// No header: zeros (the end, or a record still being written) or something else.
    Nothing,
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Looks at the first [`FIXED`] bytes of a record.
pub(crate) fn peek(fixed: &[u8]) -> Peek {
    if fixed.len() < FIXED || fixed[..4] != MAGIC || u32_at(fixed, 4) != VERSION {
        return Peek::Nothing;
    }
    let count = u32_at(fixed, 12) as usize;
    if count > MAX_ENTRIES {
        return Peek::Nothing;
    }
    Peek::Header(header_len(count))
}

/// Decodes a whole header (`bytes` is [`Peek::Header`]'s length), checking its checksum and that its lengths agree
/// with `page_bytes`; `None` when it is torn, damaged or another geometry's.
pub(crate) fn decode(digest: &[u8], bytes: &[u8], page_bytes: usize) -> Option<Header> {
    let Peek::Header(length) = peek(bytes) else { return None };
    if bytes.len() < length {
        return None;
    }
    let end = length - 8;
    if u64_at(bytes, end) != header_checksum(digest, &bytes[..end]) {
        return None;
    }
    let kind = Kind::from_code(u32_at(bytes, 8))?;
    let count = u32_at(bytes, 12) as usize;
    let header = Header {
        kind,
        page_bytes: u64_at(bytes, 16),
        data_at: u64_at(bytes, 24),
        data_bytes: u64_at(bytes, 32),
        stamp: u64_at(bytes, 40),
        entries: (0..count)
            .map(|index| {
                let at = FIXED + index * ENTRY;
                let key = PageKey::from_bytes(bytes[at..at + 32].try_into().expect("32 bytes"));
                (key, u64_at(bytes, at + 32))
            })
            .collect(),
    };
    let agrees = header.page_bytes == page_bytes as u64
        && [true, false]
            .iter()
            .any(|&aligned| header.data_bytes == data_bytes(kind, count, page_bytes, aligned) as u64);
    agrees.then_some(header)
}

#[cfg(test)]
mod tests {
    use hicache_core::hash::page_key;
    use proptest::prelude::*;

    use super::*;

    fn header(kind: Kind, keys: usize, page_bytes: usize, stamp: u64, data_at: u64) -> Header {
        let entries: Vec<(PageKey, u64)> =
            (0..keys).map(|index| (page_key(None, &[index as u32]), index as u64 * 7)).collect();
        Header {
            kind,
            page_bytes: page_bytes as u64,
            data_at,
            data_bytes: data_bytes(kind, keys, page_bytes, data_at.is_multiple_of(2)) as u64,
            stamp,
            entries,
        }
    }

    proptest! {
        /// Every header decodes to itself; any one byte changed, any shorter read, or another digest or page size
        /// does not decode.
        #[test]
        fn headers_round_trip_and_any_damage_is_refused(
            kind in prop_oneof![Just(Kind::Pages), Just(Kind::Removals)],
            keys in 0usize..200,
            page_bytes in 1usize..300_000,
            stamp: u64,
            block: u32,
            flip in any::<prop::sample::Index>(),
            bit in 0u8..8,
        ) {
            let header = header(kind, keys, page_bytes, stamp, u64::from(block) * ALIGN as u64);
            let mut bytes = vec![0u8; header_len(keys)];
            encode(b"digest", &header, &mut bytes);
            let length = header_len(keys);
            prop_assert_eq!(peek(&bytes[..FIXED]), Peek::Header(length));
            prop_assert_eq!(decode(b"digest", &bytes[..length], page_bytes), Some(header));
            prop_assert!(decode(b"other", &bytes[..length], page_bytes).is_none());
            prop_assert!(decode(b"digest", &bytes[..length], page_bytes + 1).is_none());
            prop_assert!(decode(b"digest", &bytes[..length - 1], page_bytes).is_none());
            let at = flip.index(length);
            bytes[at] ^= 1 << bit;
            prop_assert!(decode(b"digest", &bytes[..length], page_bytes).is_none(), "byte {} changed", at);
        }
    }

    #[test]
    fn a_page_checksum_is_the_same_in_one_segment_or_several_and_binds_the_key() {
        let page: Vec<u8> = (0..10_000u32).map(|index| index as u8).collect();
        let key = page_key(None, &[1]);
        let whole = page_checksum(b"digest", &key, &[&page[..]]);
        assert_eq!(page_checksum(b"digest", &key, &[&page[..3], &page[3..4096], &page[4096..]]), whole);
        assert_ne!(page_checksum(b"digest", &page_key(None, &[2]), &[&page[..]]), whole);
        assert_ne!(page_checksum(b"other", &key, &[&page[..]]), whole);
    }

    /// Checksums already on disk stay valid: values the format gave for a short and a long namespace digest.
    #[test]
    fn page_checksums_keep_their_values() {
        let page: Vec<u8> = (0..4096u32).map(|index| (index * 7) as u8).collect();
        let key = page_key(None, &[1]);
        let long = [0x5au8; 100];
        assert_eq!(page_checksum(b"digest", &key, &[&page[..]]), 5810354236767671065);
        assert_eq!(page_checksum(&long, &key, &[&page[..]]), 3397458321241486804);
        assert_eq!(page_checksum(&long, &key, &[&page[..100], &page[100..]]), 3397458321241486804);
    }

    #[test]
    fn batches_of_direct_writers_take_whole_blocks_of_the_data_file() {
        assert_eq!(data_bytes(Kind::Pages, 128, 4096, true), 128 * 4096);
        assert_eq!(data_bytes(Kind::Pages, 3, 512, true), ALIGN);
        assert_eq!(data_bytes(Kind::Pages, 3, 512, false), 3 * 512);
        assert_eq!(data_bytes(Kind::Removals, 2, 4096, true), 0);
        assert_eq!(peek(&[0u8; FIXED]), Peek::Nothing);
    }
}
