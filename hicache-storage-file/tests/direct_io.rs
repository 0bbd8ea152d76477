//! Direct I/O: pages in aligned host memory bypass the page cache, others fall back to it, and both kinds of
//! backend read each other's files.

use std::path::Path;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::PageKey;
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FailureKind, GetOutcome, PageSegments, PageSegmentsMut, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, put, random_keys, random_pages};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

/// 32 KiB pages (eight 4 KiB blocks).
const PAGE: usize = 32 << 10;

/// One page of host memory at a 4 KiB-aligned address, as a pinned host pool's pages are.
#[repr(C, align(4096))]
#[derive(Clone)]
struct AlignedPage([u8; PAGE]);

fn namespace() -> StorageNamespace {
    StorageNamespace::single_rank(
        "direct",
        KvGeometry::mha(1, 1, PAGE / 2, KvDtype::Fp8E4m3).expect("geometry"),
        HostLayout::PageFirst,
        1,
    )
}

fn open(dir: &Path, format: FileFormat, direct_io: bool) -> FileStorage {
    FileStorage::open(FileConfig { direct_io, segment_threshold: 0, ..FileConfig::new(dir, format) }, &namespace())
        .expect("opens")
}

fn aligned_copies(pages: &[Vec<u8>]) -> Vec<Box<AlignedPage>> {
    pages
        .iter()
        .map(|page| {
            let mut aligned = Box::new(AlignedPage([0; PAGE]));
            aligned.0.copy_from_slice(page);
            aligned
        })
        .collect()
}

fn put_aligned(storage: &FileStorage, keys: &[PageKey], pages: &[Box<AlignedPage>]) -> Vec<SetOutcome> {
    // each page as two aligned halves, as a page-first host page's K and V
    let sources: Vec<PageSegments<'_>> = pages.iter().map(|page| page.0.chunks(PAGE / 2).collect()).collect();
    storage.batch_set(keys, &sources).expect("batch_set")
}

fn fetch_aligned(storage: &FileStorage, keys: &[PageKey]) -> (Vec<GetOutcome>, Vec<Box<AlignedPage>>) {
    let mut pages: Vec<Box<AlignedPage>> = keys.iter().map(|_| Box::new(AlignedPage([0; PAGE]))).collect();
    let mut targets: Vec<PageSegmentsMut<'_>> =
        pages.iter_mut().map(|page| page.0.chunks_mut(PAGE / 2).collect()).collect();
    let outcomes = storage.batch_get(keys, &mut targets).expect("batch_get");
    drop(targets);
    (outcomes, pages)
}

#[test]
fn aligned_pages_bypass_the_page_cache_and_interoperate() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().expect("temporary directory");
        let direct = open(dir.path(), format, true);
        let buffered = open(dir.path(), format, false);
        let keys = random_keys(6);
        let pages = random_pages(6, PAGE);
        let aligned = aligned_copies(&pages);
        // direct writes, read back directly, through the page cache by a buffered backend, and into unaligned memory
        assert_eq!(put_aligned(&direct, &keys[..3], &aligned[..3]), vec![SetOutcome::Stored; 3]);
        assert_eq!(direct.direct_io_pages(), 3, "{format:?}");
        let (outcomes, read) = fetch_aligned(&direct, &keys[..3]);
        assert_eq!(outcomes, vec![GetOutcome::Hit; 3]);
        assert!(read.iter().zip(&pages).all(|(read, page)| read.0[..] == page[..]));
        assert_eq!(direct.direct_io_pages(), 6, "{format:?}");
        let (outcomes, read) = fetch(&buffered, &keys[..3], PAGE, 0);
        assert_eq!((outcomes, read), (vec![GetOutcome::Hit; 3], pages[..3].to_vec()));
        let (outcomes, read) = fetch(&direct, &keys[..3], PAGE, 0);
        assert_eq!((outcomes, read), (vec![GetOutcome::Hit; 3], pages[..3].to_vec()));
        assert_eq!(direct.direct_io_pages(), 6, "{format:?}: unaligned memory goes through the page cache");
        // buffered writes, read directly
        assert_eq!(put(&buffered, &keys[3..], &pages[3..]), vec![SetOutcome::Stored; 3]);
        let (outcomes, read) = fetch_aligned(&direct, &keys[3..]);
        assert_eq!(outcomes, vec![GetOutcome::Hit; 3]);
        assert!(read.iter().zip(&pages[3..]).all(|(read, page)| read.0[..] == page[..]));
    }
}

#[test]
fn direct_reads_still_detect_damage() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let direct = open(dir.path(), FileFormat::Native, true);
    let keys = random_keys(2);
    let aligned = aligned_copies(&random_pages(2, PAGE));
    put_aligned(&direct, &keys, &aligned);
    let path = direct.page_path(&keys[0]);
    let mut bytes = std::fs::read(&path).expect("page file");
    bytes[100] ^= 0x40;
    std::fs::write(&path, bytes).expect("rewrite");
    let (outcomes, _) = fetch_aligned(&direct, &keys);
    assert!(
        matches!(&outcomes[0], GetOutcome::Failed(failure) if failure.kind == FailureKind::Corrupt),
        "{outcomes:?}"
    );
    assert_eq!(outcomes[1], GetOutcome::Hit);
}
