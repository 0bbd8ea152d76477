//! A check every tier runs under the unified key scheme ([`crate::storage::UnifiedStorage`]): a TP2 deployment
//! writes pages, and TP1, TP4 and a two-stage pipeline read every page whole, each reader's bytes being what its own
//! `page_unified` pool would hold. The expected bytes come from a model of the KV (each byte a function of its page,
//! token, layer, K or V, the model's KV head and its place in the head), placed row by row through the layout map,
//! not from the chunk logic. A page missing one chunk is then never read.

use crate::geometry::{KvDtype, KvGeometry, KvPart};
use crate::hash::PageKey;
use crate::layout::{HostLayout, HostLayoutMap};
use crate::namespace::StorageNamespace;
use crate::storage::{FailureKind, GetOutcome, OpenTier, SetOutcome, StorageBackend, UnifiedStorage};
use crate::unified_keys::{UnifiedRank, plan};

const HEADS: usize = 8;
const HEAD_DIM: usize = 4;
const LAYERS: usize = 6;
const PAGE: usize = 3;
/// The fleet's agreements: two KV heads per chunk, four layers per chunk (the last chunk of two).
const HEAD_GROUP: u64 = 2;
const LAYER_PARTITION: u64 = 4;
/// Pages written.
pub const PAGES: u64 = 5;
/// Chunks of one page over the whole model: two layer chunks × four head groups.
pub const CHUNKS_PER_PAGE: u64 = 8;

/// One rank of a topology: TP rank and size, and its pipeline stage's layers.
#[derive(Clone, Copy, Debug)]
pub struct Rank {
    /// TP rank and size.
    pub tp: (usize, usize),
    /// The stage's layers, `start..end`.
    pub layers: (usize, usize),
}

/// What [`topologies_share_chunks`] saw: chunks read by each reader topology (all its ranks).
#[derive(Debug, Default)]
pub struct Shared {
    /// Chunks the TP2 writer stored.
    pub written: u64,
    /// Per reader topology (TP1, TP4, two stages), the chunks its ranks read.
    pub read: Vec<u64>,
}

/// The model of the KV: one byte of page `page`'s token, global layer, part, global head and byte within the head.
fn kv(page: u64, token: usize, layer: usize, part: KvPart, head: usize, byte: usize) -> u8 {
    let mixed = page.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ ((token as u64) << 40)
        ^ ((layer as u64) << 32)
        ^ ((part.index() as u64) << 28)
        ^ ((head as u64) << 16)
        ^ byte as u64;
    (mixed.wrapping_mul(0xff51_afd7_ed55_8ccd) >> 56) as u8
}

fn geometry(rank: Rank) -> KvGeometry {
    KvGeometry::mha(rank.layers.1 - rank.layers.0, HEADS / rank.tp.1, HEAD_DIM, KvDtype::Bf16).expect("a geometry")
}

/// The page this rank's `page_unified` pool holds for page `page`, placed row by row through the layout map.
pub fn expected_page(rank: Rank, page: u64) -> Vec<u8> {
    let geometry = geometry(rank);
    let local_heads = HEADS / rank.tp.1;
    let groups = local_heads / HEAD_GROUP as usize;
    let map = HostLayoutMap::new(geometry, HostLayout::PageUnified, PAGE, 1)
        .and_then(|map| map.with_head_groups(groups))
        .expect("a map");
    let mut bytes = vec![0u8; map.page_bytes()];
    let head_bytes = HEAD_DIM * 2;
    for token in 0..PAGE {
        for layer in 0..geometry.layers {
            for &part in geometry.parts() {
                for group in 0..groups {
                    let at = map.flat_row_offset(token, layer, part, group);
                    for (index, byte) in bytes[at..at + map.row_bytes()].iter_mut().enumerate() {
                        let head = rank.tp.0 * local_heads + group * HEAD_GROUP as usize + index / head_bytes;
                        *byte = kv(page, token, rank.layers.0 + layer, part, head, index % head_bytes);
                    }
                }
            }
        }
    }
    bytes
}

/// The storage of `rank` over the tier `open` opens.
///
/// # Panics
///
/// When the tier cannot be opened.
pub fn storage(rank: Rank, open: &OpenTier<'_>) -> UnifiedStorage {
    let geometry = geometry(rank);
    let groups = HEADS / rank.tp.1 / HEAD_GROUP as usize;
    let mut namespace = StorageNamespace::single_rank("org/Model", geometry, HostLayout::PageUnified, PAGE);
    (namespace.tp_rank, namespace.tp_size, namespace.head_groups) = (rank.tp.0, rank.tp.1, groups);
    let stage = (rank.layers.0 as u64, rank.layers.1 == LAYERS);
    let unified = UnifiedRank::of(&namespace, stage, Some(HEAD_GROUP), Some(LAYER_PARTITION));
    UnifiedStorage::open(namespace, &plan(&unified).expect("a plan"), open).expect("the tier opens")
}

/// The keys of pages `0..count`.
pub fn keys(count: u64) -> Vec<PageKey> {
    (0..count).map(|page| PageKey::from_bytes([page as u8 + 1; 32])).collect()
}

fn write(rank: Rank, pages: u64, open: &OpenTier<'_>) -> Vec<SetOutcome> {
    let pages: Vec<Vec<u8>> = (0..pages).map(|page| expected_page(rank, page)).collect();
    let segments: Vec<Vec<&[u8]>> = pages.iter().map(|page| vec![&page[..]]).collect();
    storage(rank, open).batch_set(&keys(pages.len() as u64), &segments).expect("the batch runs")
}

/// The ranks of a topology of `tp` ranks per stage.
pub fn topology(tp: usize, stages: &[(usize, usize)]) -> Vec<Rank> {
    stages.iter().flat_map(|&layers| (0..tp).map(move |rank| Rank { tp: (rank, tp), layers })).collect()
}

/// A TP2 deployment writes [`PAGES`] pages through `open`'s tier; TP1, TP4 and two pipeline stages (TP1 each) read
/// them back, every byte checked, and write them again (finding them stored). Then a page missing one chunk is a
/// failed read and ends the prefix.
///
/// # Panics
///
/// On any difference.
pub fn topologies_share_chunks(open: &OpenTier<'_>) -> Shared {
    let mut shared = Shared::default();
    for rank in topology(2, &[(0, LAYERS)]) {
        let outcomes = write(rank, PAGES, open);
        assert!(outcomes.iter().all(|outcome| *outcome == SetOutcome::Stored), "{rank:?}: {outcomes:?}");
    }
    shared.written = PAGES * CHUNKS_PER_PAGE;
    for readers in [topology(1, &[(0, LAYERS)]), topology(4, &[(0, LAYERS)]), topology(1, &[(0, 4), (4, LAYERS)])] {
        let mut chunks_read = 0;
        for rank in readers {
            let backend = storage(rank, open);
            assert_eq!(backend.batch_exists(&keys(PAGES)).expect("exists"), PAGES as usize, "{rank:?}");
            let len = expected_page(rank, 0).len();
            let mut buffers: Vec<Vec<u8>> = (0..PAGES).map(|_| vec![0xaa; len]).collect();
            let mut segments: Vec<Vec<&mut [u8]>> = buffers.iter_mut().map(|page| vec![&mut page[..]]).collect();
            let outcomes = backend.batch_get(&keys(PAGES), &mut segments).expect("the batch runs");
            assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit), "{rank:?}: {outcomes:?}");
            for (page, bytes) in buffers.iter().enumerate() {
                assert!(*bytes == expected_page(rank, page as u64), "{rank:?}: page {page} differs");
            }
            // what it writes back is there already: the same keys name the same bytes
            let again = write(rank, PAGES, open);
            assert!(again.iter().all(|outcome| *outcome == SetOutcome::AlreadyPresent), "{rank:?}: {again:?}");
            chunks_read += backend.chunk_stats().get_hits;
        }
        shared.read.push(chunks_read);
    }
    a_page_missing_one_chunk_is_never_read(open);
    shared
}

/// Page 1 loses the chunk of layers 4–6 of head group 1 (of TP1's four): the prefix ends before it, and reading it
/// fails while the pages around it are read.
fn a_page_missing_one_chunk_is_never_read(open: &OpenTier<'_>) {
    let rank = Rank { tp: (0, 1), layers: (0, LAYERS) };
    let backend = storage(rank, open);
    let chunk = backend.chunk_keys(&keys(PAGES)[1])[4 + 1].clone();
    assert!(chunk.ends_with("_L4-6_H1"), "{chunk}");
    let digest = chunk.split('_').nth(1).expect("a digest").to_owned();
    let short = KvGeometry::mha(2, HEAD_GROUP as usize, HEAD_DIM, KvDtype::Bf16).expect("a geometry");
    let namespace = StorageNamespace::single_rank(format!("{digest}/chunk-L2"), short, HostLayout::PageUnified, PAGE);
    assert_eq!(open(&namespace).expect("opens").remove(&[UnifiedStorage::stored_key(&chunk)]).expect("removes"), 1);
    assert_eq!(backend.batch_exists(&keys(3)).expect("exists"), 1, "the prefix ends before the incomplete page");
    let len = expected_page(rank, 0).len();
    let mut buffers: Vec<Vec<u8>> = (0..3).map(|_| vec![0; len]).collect();
    let mut segments: Vec<Vec<&mut [u8]>> = buffers.iter_mut().map(|page| vec![&mut page[..]]).collect();
    let outcomes = backend.batch_get(&keys(3), &mut segments).expect("the batch runs");
    assert_eq!(outcomes[0], GetOutcome::Hit);
    assert!(
        matches!(&outcomes[1], GetOutcome::Failed(failure) if failure.kind == FailureKind::Corrupt),
        "{outcomes:?}"
    );
    assert_eq!(outcomes[2], GetOutcome::Hit);
    assert_eq!(buffers[2], expected_page(rank, 2));
}
