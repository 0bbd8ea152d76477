//! Where a page lives in a data file, and the footer that says which key and generation wrote it.
//!
//! A data file of `file_size` bytes holds `num_pages` pages: page `i` at `i × page_bytes` (SGLang's layout), then,
//! from the first 4 KiB boundary after the last page, one 64-byte footer per page. A writer writes a page's footer
//! (its key, namespace and the generation the metadata handed out) before its bytes; a reader reads the bytes first
//! and the footer after them, and takes the page only when the footer names the key and generation it was given. A
//! page that another writer took over while it was being read then fails the check (its new footer was written
//! before its new bytes, so a footer read after the bytes sees it), and a reader never takes another key's bytes.
//! The footer also holds a checksum of the page's bytes (XXH3-64): bytes changed beneath the tier (another program
//! writing the file, a torn write, a bad disk) fail as `Corrupt` and count as a miss, never as a hit.

use std::hash::Hasher as _;

use hicache_core::hash::PageKey;

/// Bytes of one footer.
pub const FOOTER_BYTES: usize = 64;

/// (`v1` footers, without a checksum, read as no footer: their pages miss and are written again.)
const MAGIC: [u8; 8] = *b"HCF3FSv2";
const ALIGN: u64 = 4096;

/// The pages and footers of one data file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileLayout {
    /// Bytes of one page.
    pub page_bytes: u64,
    /// Pages the file holds.
    pub num_pages: u64,
    /// Offset of page 0's footer.
    pub footer_base: u64,
}

impl FileLayout {
    /// The most pages of `page_bytes` (and their footers) a file of `file_size` bytes holds; `None` when not one.
    pub fn for_file(file_size: u64, page_bytes: u64) -> Option<Self> {
        if page_bytes == 0 {
            return None;
        }
        let footer_base = |pages: u64| (pages * page_bytes).div_ceil(ALIGN) * ALIGN;
        let fits = |pages: u64| footer_base(pages) + pages * FOOTER_BYTES as u64 <= file_size;
        let mut num_pages = file_size / (page_bytes + FOOTER_BYTES as u64);
        while num_pages > 0 && !fits(num_pages) {
            num_pages -= 1;
        }
        (num_pages > 0).then(|| Self { page_bytes, num_pages, footer_base: footer_base(num_pages) })
    }

    /// Offset of page `index`.
    pub fn page_offset(&self, index: u64) -> u64 {
        index * self.page_bytes
    }

    /// Offset of page `index`'s footer.
    pub fn footer_offset(&self, index: u64) -> u64 {
        self.footer_base + index * FOOTER_BYTES as u64
    }

    /// Bytes the layout uses (pages and footers).
    pub fn used_bytes(&self) -> u64 {
        self.footer_base + self.num_pages * FOOTER_BYTES as u64
    }
}

/// What a footer records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footer {
    /// The page's key.
    pub key: PageKey,
    /// The namespace digest of the writer (8 bytes of SHA-256 of its descriptor).
    pub namespace: [u8; 8],
    /// The generation the metadata gave the writer.
    pub generation: u64,
    /// XXH3-64 of the page's bytes.
    pub checksum: u64,
}

impl Footer {
    /// The footer's bytes: magic, generation (little-endian), namespace digest, key, checksum (little-endian).
    pub fn encode(&self) -> [u8; FOOTER_BYTES] {
        let mut bytes = [0u8; FOOTER_BYTES];
        bytes[..8].copy_from_slice(&MAGIC);
        bytes[8..16].copy_from_slice(&self.generation.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.namespace);
        bytes[24..56].copy_from_slice(self.key.as_bytes());
        bytes[56..].copy_from_slice(&self.checksum.to_le_bytes());
        bytes
    }

    /// Reads a footer; `None` for bytes that are not one (never written, or damaged).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != FOOTER_BYTES || bytes[..8] != MAGIC {
            return None;
        }
        Some(Self {
            generation: u64::from_le_bytes(bytes[8..16].try_into().ok()?),
            namespace: bytes[16..24].try_into().ok()?,
            key: PageKey::from_bytes(bytes[24..56].try_into().ok()?),
            checksum: u64::from_le_bytes(bytes[56..].try_into().ok()?),
        })
    }
}

/// The hash behind a footer's checksum (XXH3-64, seed 0), fed a page's bytes in order.
pub fn checksum_hasher() -> twox_hash::XxHash3_64 {
    twox_hash::XxHash3_64::with_seed(0)
}

/// The checksum a footer holds of a page whose bytes are `segments`, in order.
pub fn checksum<'a>(segments: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut hasher = checksum_hasher();
    for segment in segments {
        hasher.write(segment);
    }
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn pages_and_footers_fit_the_file_and_never_overlap(file_size in 0u64..1 << 34, page_bytes in 1u64..1 << 24) {
            match FileLayout::for_file(file_size, page_bytes) {
                None => prop_assert!(file_size < page_bytes + FOOTER_BYTES as u64 || file_size < 4096 + FOOTER_BYTES as u64),
                Some(layout) => {
                    prop_assert!(layout.used_bytes() <= file_size);
                    prop_assert!(layout.page_offset(layout.num_pages) <= layout.footer_base);
                    prop_assert_eq!(layout.footer_base % 4096, 0);
                    // one more page would not fit
                    let more = layout.num_pages + 1;
                    let base = (more * page_bytes).div_ceil(4096) * 4096;
                    prop_assert!(base + more * FOOTER_BYTES as u64 > file_size);
                }
            }
        }

        #[test]
        fn footers_round_trip(
            key in any::<[u8; 32]>(), namespace in any::<[u8; 8]>(), generation in any::<u64>(), checksum in any::<u64>(),
        ) {
            let footer = Footer { key: PageKey::from_bytes(key), namespace, generation, checksum };
            prop_assert_eq!(Footer::decode(&footer.encode()), Some(footer));
        }
    }

    #[test]
    fn what_is_not_a_footer_is_refused() {
        assert_eq!(Footer::decode(&[0u8; FOOTER_BYTES]), None);
        let mut bytes =
            Footer { key: PageKey::from_bytes([7; 32]), namespace: [1; 8], generation: 3, checksum: 9 }.encode();
        bytes[..8].copy_from_slice(b"HCF3FSv1");
        assert_eq!(Footer::decode(&bytes), None, "a footer of the format before checksums");
        bytes[0] ^= 1;
        assert_eq!(Footer::decode(&bytes), None);
        assert_eq!(Footer::decode(&bytes[..32]), None);
    }

    #[test]
    fn a_sglang_sized_file_holds_pages_at_sglang_offsets() {
        // 1 GiB of 8 MiB pages: 127 pages (SGLang's 128 minus room for the footers)
        let layout = FileLayout::for_file(1 << 30, 8 << 20).expect("fits");
        assert_eq!(layout.num_pages, 127);
        assert_eq!(layout.page_offset(5), 5 * (8 << 20));
        assert_eq!(layout.footer_offset(1) - layout.footer_offset(0), 64);
    }
}
