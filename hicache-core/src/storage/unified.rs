//! Pages any topology can read: a rank's pages stored as the chunks of SGLang's unified key scheme
//! ([`crate::unified_keys`]), on any tier.
//!
//! Under the scheme a page is not one object but one per chunk the rank owns: a layer range of one head group, K and
//! V together, named `{page_hash}_{digest}_L{start}-{end}[_H{head_group_index}]` with model-global coordinates. The
//! `page_unified` host layout keeps each chunk one run of the page ([`HostLayoutMap::chunk_span`]), so the chunks of a
//! page are cuts of its one segment, moved in place.
//!
//! [`UnifiedStorage`] wraps the tier: each chunk is a page of its own, stored in the tier under the *chunk
//! namespace*, which is the same for every topology. That namespace's model is the scheme's digest, its geometry the
//! chunk's (its layers, `head_group` KV heads), with TP and PP of 1. The chunk's key in that namespace is the SHA-256
//! of its unified key string. A TP2 rank and a TP4 rank (or a pipeline stage) of one fleet therefore name a chunk
//! alike in every tier, and read what the other wrote. Chunks of one page differ in size only for a short last
//! layer chunk; each size gets its own chunk namespace.
//!
//! A page is present only when all its chunks are. A read that finds some chunks and misses others fails the page
//! (its destination then holds a mix), so a prefix never uses a page without all its layers and heads.

use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use super::{FailureKind, StorageStats, check_batch, segments_len, size_mismatch};
use super::{GetOutcome, PageFailure, PageSegments, PageSegmentsMut, SetOutcome, StatsRecorder, StorageBackend};
use crate::error::Error;
use crate::geometry::{Attention, KvGeometry};
use crate::hash::PageKey;
use crate::host_memory::MemoryRegion;
use crate::layout::{HostLayout, HostLayoutMap};
use crate::namespace::StorageNamespace;
use crate::unified_keys::UnifiedPlan;

/// Opens the tier for one chunk namespace.
pub type OpenTier<'a> = dyn Fn(&StorageNamespace) -> Result<Box<dyn StorageBackend>, Error> + 'a;

/// One chunk of a page: its key suffix, where it lies in the flat page, and which inner backend stores it.
#[derive(Clone, Debug)]
struct Chunk {
    suffix: String,
    offset: usize,
    len: usize,
    tier: usize,
}

/// A tier storing a rank's pages as unified-key chunks.
pub struct UnifiedStorage {
    namespace: StorageNamespace,
    chunks: Vec<Chunk>,
    /// One backend per chunk size (the chunk namespaces).
    tiers: Vec<Box<dyn StorageBackend>>,
    page_bytes: usize,
    stats: StatsRecorder,
}

impl std::fmt::Debug for UnifiedStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnifiedStorage").field("namespace", &self.namespace).field("chunks", &self.chunks).finish()
    }
}

impl UnifiedStorage {
    /// Stores the pages of `namespace` (a `page_unified` pool cut into the plan's head groups) as the chunks of
    /// `plan`, each chunk size in a tier that `open` opens for its chunk namespace.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming `mem_layout`, `head_group`, `page_size` or `layers` when the pool does not
    /// hold the plan's chunks as runs; the tier's errors.
    pub fn open(namespace: StorageNamespace, plan: &UnifiedPlan, open: &OpenTier<'_>) -> Result<Self, Error> {
        let namespace = namespace.validated()?;
        let bad = |field: &'static str, reason: String| Err(Error::InvalidArgument { field, reason });
        if namespace.layout != HostLayout::PageUnified {
            return bad(
                "mem_layout",
                format!("the unified key scheme stores page_unified pages, not {}", namespace.layout.name()),
            );
        }
        if namespace.head_groups != plan.head_ranges.len() {
            return bad(
                "head_group",
                format!(
                    "the plan cuts a page into {} head groups, the pool into {}",
                    plan.head_ranges.len(),
                    namespace.head_groups
                ),
            );
        }
        if plan.namespace.page_size != namespace.page_size as u64 {
            return bad(
                "page_size",
                format!("the plan's pages are {} tokens, the pool's {}", plan.namespace.page_size, namespace.page_size),
            );
        }
        let geometry = namespace.geometry;
        // the chunks must tile the page: layer ranges back to back over the pool's layers, a suffix per chunk
        let mut next = 0;
        for &(start, end) in &plan.layer_ranges {
            if start != next || end <= start {
                return bad("layers", format!("the plan's layer ranges {:?} do not tile the pool", plan.layer_ranges));
            }
            next = end;
        }
        if next != geometry.layers as u64 {
            return bad(
                "layers",
                format!("the plan's layer ranges do not end at the pool's {} layers", geometry.layers),
            );
        }
        if plan.suffixes.len() != plan.layer_ranges.len() * plan.head_ranges.len() {
            return bad(
                "layers",
                format!(
                    "{} key suffixes for {} layer ranges by {} head groups",
                    plan.suffixes.len(),
                    plan.layer_ranges.len(),
                    plan.head_ranges.len()
                ),
            );
        }
        let map = HostLayoutMap::new(geometry, namespace.layout, namespace.page_size, 1)?
            .with_head_groups(namespace.head_groups)?;
        let digest = plan.namespace.digest();
        let (mut chunks, mut sizes, mut tiers) = (Vec::new(), Vec::<usize>::new(), Vec::new());
        let groups = plan.head_ranges.len();
        for (index, suffix) in plan.suffixes.iter().enumerate() {
            let (start, end) = plan.layer_ranges[index / groups];
            let (offset, len) = map.chunk_span(start as usize..end as usize, index % groups)?;
            let tier = match sizes.iter().position(|&size| size == len) {
                Some(tier) => tier,
                None => {
                    let chunk_namespace =
                        chunk_namespace(&digest, &geometry, (end - start) as usize, groups, &namespace)?;
                    tiers.push(open(&chunk_namespace)?);
                    sizes.push(len);
                    sizes.len() - 1
                }
            };
            chunks.push(Chunk { suffix: suffix.clone(), offset, len, tier });
        }
        Ok(Self { page_bytes: map.page_bytes(), namespace, chunks, tiers, stats: StatsRecorder::default() })
    }

    /// The unified key strings of a page's chunks, in the plan's order (layer-major, head-minor).
    pub fn chunk_keys(&self, key: &PageKey) -> Vec<String> {
        self.chunks.iter().map(|chunk| format!("{key}_{}", chunk.suffix)).collect()
    }

    /// The key a chunk is stored under in its chunk namespace: the SHA-256 of its unified key string.
    pub fn stored_key(chunk_key: &str) -> PageKey {
        PageKey::from_bytes(Sha256::digest(chunk_key.as_bytes()).into())
    }

    /// Counters of the chunks themselves (every chunk namespace's tier), where [`stats`](StorageBackend::stats)
    /// counts pages.
    pub fn chunk_stats(&self) -> StorageStats {
        let mut total = StorageStats::default();
        for tier in &self.tiers {
            total += tier.stats();
        }
        total
    }

    /// Per tier, the stored keys of `keys`' chunks, page-major.
    fn per_tier(&self, keys: &[PageKey]) -> Vec<Vec<PageKey>> {
        let mut out = vec![Vec::new(); self.tiers.len()];
        for key in keys {
            for chunk in &self.chunks {
                out[chunk.tier].push(Self::stored_key(&format!("{key}_{}", chunk.suffix)));
            }
        }
        out
    }
}

/// The namespace every topology stores one chunk size under: the scheme's digest as the model, the chunk's layers
/// and heads as the geometry, one rank.
pub(crate) fn chunk_namespace(
    digest: &str,
    geometry: &KvGeometry,
    layers: usize,
    groups: usize,
    namespace: &StorageNamespace,
) -> Result<StorageNamespace, Error> {
    let attention = match geometry.attention {
        Attention::Mha { kv_heads, head_dim } => Attention::Mha { kv_heads: kv_heads / groups, head_dim },
        mla @ Attention::Mla { .. } => mla,
    };
    let geometry = KvGeometry { layers, attention, dtype: geometry.dtype }.validated()?;
    let mut model = String::from(digest);
    let _ = write!(model, "{CHUNK_MODEL}{layers}");
    Ok(StorageNamespace::single_rank(model, geometry, HostLayout::PageUnified, namespace.page_size))
}

/// What follows the scheme's digest in a chunk namespace's model: `/chunk-L` and the chunk's layers.
const CHUNK_MODEL: &str = "/chunk-L";

/// For a chunk namespace of the unified key scheme, a name for it fit for a file name (`ukv1-…-chunk-L4`): a tier
/// whose files hold pages of one size keeps each chunk size apart with it. `None` for any other namespace.
pub fn chunk_namespace_tag(namespace: &StorageNamespace) -> Option<String> {
    let (digest, layers) = namespace.model.split_once(CHUNK_MODEL)?;
    let well_formed = digest.starts_with("ukv")
        && digest.bytes().all(|byte| byte.is_ascii_alphanumeric() || byte == b'-')
        && layers.parse::<usize>().is_ok_and(|layers| layers == namespace.geometry.layers);
    well_formed.then(|| format!("{digest}-chunk-L{layers}"))
}

/// Something [`cut`] can split at a byte offset.
trait Piece: Sized {
    fn length(&self) -> usize;
    fn split(self, at: usize) -> (Self, Self);
}

impl Piece for &[u8] {
    fn length(&self) -> usize {
        self.len()
    }
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at(at)
    }
}

impl Piece for &mut [u8] {
    fn length(&self) -> usize {
        self.len()
    }
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at_mut(at)
    }
}

/// The segments of a page cut into the chunks' ranges (which tile the page): per chunk, in the chunks' order, its
/// pieces of the segments.
fn cut<S: Piece>(segments: Vec<S>, chunks: &[Chunk]) -> Vec<Vec<S>> {
    let mut order: Vec<usize> = (0..chunks.len()).collect();
    order.sort_unstable_by_key(|&index| chunks[index].offset);
    let mut out: Vec<Vec<S>> = chunks.iter().map(|_| Vec::new()).collect();
    let mut segments = segments.into_iter();
    let mut current: Option<S> = None;
    for index in order {
        let mut left = chunks[index].len;
        while left > 0 {
            let piece = match current.take() {
                Some(piece) => piece,
                None => segments.next().expect("the chunks tile the page, which the segments hold whole"),
            };
            if piece.length() <= left {
                left -= piece.length();
                out[index].push(piece);
            } else {
                let (head, tail) = piece.split(left);
                out[index].push(head);
                current = Some(tail);
                left = 0;
            }
        }
    }
    out
}

impl StorageBackend for UnifiedStorage {
    fn name(&self) -> &str {
        self.tiers.first().map_or("unified", |tier| tier.name())
    }

    fn namespace(&self) -> Option<&StorageNamespace> {
        Some(&self.namespace)
    }

    fn batch_exists(&self, keys: &[PageKey]) -> Result<usize, Error> {
        let mut present = keys.len();
        for ((tier, stored), chunks) in self.tiers.iter().zip(self.per_tier(keys)).zip(self.chunks_per_tier()) {
            if present == 0 {
                break;
            }
            // each tier's keys are page-major: its first n pages are whole when its first n × chunks keys are there
            present = present.min(tier.batch_exists(&stored[..present * chunks])? / chunks);
        }
        self.stats.record_exists(keys.len(), present);
        Ok(present)
    }

    fn batch_get(&self, keys: &[PageKey], pages: &mut [PageSegmentsMut<'_>]) -> Result<Vec<GetOutcome>, Error> {
        check_batch(keys.len(), pages.len())?;
        let mut outcomes: Vec<Option<GetOutcome>> = vec![None; keys.len()];
        let mut cuts: Vec<Vec<Vec<&mut [u8]>>> = Vec::with_capacity(keys.len());
        for (page, segments) in pages.iter_mut().enumerate() {
            let len = segments_len(segments);
            if len == self.page_bytes {
                cuts.push(cut(segments.iter_mut().map(|segment| &mut **segment).collect(), &self.chunks));
            } else {
                outcomes[page] = Some(GetOutcome::Failed(size_mismatch(len, self.page_bytes)));
                cuts.push(Vec::new());
            }
        }
        // per page: chunks found, missed, and the first failure
        let mut found = vec![(0usize, 0usize, None::<PageFailure>); keys.len()];
        let mut by_tier: Vec<(Vec<PageKey>, Vec<PageSegmentsMut<'_>>, Vec<usize>)> =
            self.tiers.iter().map(|_| (Vec::new(), Vec::new(), Vec::new())).collect();
        for (page, (key, chunks)) in keys.iter().zip(cuts).enumerate() {
            for (index, pieces) in chunks.into_iter().enumerate() {
                let (stored, segments, owners) = &mut by_tier[self.chunks[index].tier];
                stored.push(Self::stored_key(&format!("{key}_{}", self.chunks[index].suffix)));
                segments.push(pieces);
                owners.push(page);
            }
        }
        for (tier, (stored, mut segments, owners)) in self.tiers.iter().zip(by_tier) {
            if stored.is_empty() {
                continue;
            }
            for (outcome, page) in tier.batch_get(&stored, &mut segments)?.into_iter().zip(owners) {
                let entry = &mut found[page];
                match outcome {
                    GetOutcome::Hit => entry.0 += 1,
                    GetOutcome::Miss => entry.1 += 1,
                    GetOutcome::Failed(failure) => {
                        entry.2.get_or_insert(failure);
                    }
                }
            }
        }
        let per_page = self.chunks.len();
        let outcomes: Vec<GetOutcome> = outcomes
            .into_iter()
            .zip(found)
            .map(|(refused, (hits, misses, failure))| match (refused, failure) {
                (Some(refused), _) => refused,
                (None, Some(failure)) => GetOutcome::Failed(failure),
                (None, None) if hits == per_page => GetOutcome::Hit,
                (None, None) if misses == per_page => GetOutcome::Miss,
                (None, None) => GetOutcome::Failed(PageFailure::new(
                    FailureKind::Corrupt,
                    format!("{hits} of the page's {per_page} chunks are stored; a page is read whole or not at all"),
                )),
            })
            .collect();
        self.stats.record_get(&outcomes, |_| self.page_bytes);
        Ok(outcomes)
    }

    fn batch_set(&self, keys: &[PageKey], pages: &[PageSegments<'_>]) -> Result<Vec<SetOutcome>, Error> {
        check_batch(keys.len(), pages.len())?;
        let mut refused: Vec<Option<SetOutcome>> = vec![None; keys.len()];
        let mut by_tier: Vec<(Vec<PageKey>, Vec<PageSegments<'_>>, Vec<usize>)> =
            self.tiers.iter().map(|_| (Vec::new(), Vec::new(), Vec::new())).collect();
        for (page, (key, segments)) in keys.iter().zip(pages).enumerate() {
            let len = segments_len(segments);
            if len != self.page_bytes {
                refused[page] = Some(SetOutcome::Failed(size_mismatch(len, self.page_bytes)));
                continue;
            }
            for (index, pieces) in cut(segments.clone(), &self.chunks).into_iter().enumerate() {
                let (stored, segments, owners) = &mut by_tier[self.chunks[index].tier];
                stored.push(Self::stored_key(&format!("{key}_{}", self.chunks[index].suffix)));
                segments.push(pieces);
                owners.push(page);
            }
        }
        // per page: chunks newly stored, and the first failure
        let mut written = vec![(0usize, None::<PageFailure>); keys.len()];
        for (tier, (stored, segments, owners)) in self.tiers.iter().zip(by_tier) {
            if stored.is_empty() {
                continue;
            }
            for (outcome, page) in tier.batch_set(&stored, &segments)?.into_iter().zip(owners) {
                match outcome {
                    SetOutcome::Stored => written[page].0 += 1,
                    SetOutcome::AlreadyPresent => {}
                    SetOutcome::Failed(failure) => {
                        written[page].1.get_or_insert(failure);
                    }
                }
            }
        }
        let outcomes: Vec<SetOutcome> = refused
            .into_iter()
            .zip(written)
            .map(|(refused, (stored, failure))| match (refused, failure) {
                (Some(refused), _) => refused,
                (None, Some(failure)) => SetOutcome::Failed(failure),
                (None, None) if stored > 0 => SetOutcome::Stored,
                (None, None) => SetOutcome::AlreadyPresent,
            })
            .collect();
        self.stats.record_set(&outcomes, |_| self.page_bytes);
        Ok(outcomes)
    }

    /// Removes the pages' chunks; returns how many pages' worth of chunks were present (whole pages).
    fn remove(&self, keys: &[PageKey]) -> Result<usize, Error> {
        let mut removed = 0;
        for (tier, stored) in self.tiers.iter().zip(self.per_tier(keys)) {
            removed += tier.remove(&stored)?;
        }
        // whole pages' worth of chunks
        let pages = removed / self.chunks.len();
        self.stats.record_removed(pages as u64);
        Ok(pages)
    }

    /// Removes every chunk of the chunk namespaces: every rank's and every topology's of this keyspace.
    fn clear(&self) -> Result<u64, Error> {
        let mut removed = 0;
        for tier in &self.tiers {
            removed += tier.clear()?;
        }
        Ok(removed / self.chunks.len() as u64)
    }

    fn flush(&self) -> Result<(), Error> {
        self.tiers.iter().try_for_each(|tier| tier.flush())
    }

    fn stats(&self) -> StorageStats {
        let mut stats = self.stats.snapshot();
        stats.staging_bytes = self.tiers.iter().map(|tier| tier.stats().staging_bytes).sum();
        stats
    }

    fn register_host_memory(&self, region: &MemoryRegion) -> Result<(), Error> {
        for (index, tier) in self.tiers.iter().enumerate() {
            if let Err(error) = tier.register_host_memory(region) {
                self.tiers[..index].iter().for_each(|tier| tier.unregister_host_memory(region));
                return Err(error);
            }
        }
        Ok(())
    }

    fn unregister_host_memory(&self, region: &MemoryRegion) {
        self.tiers.iter().for_each(|tier| tier.unregister_host_memory(region));
    }
}

impl UnifiedStorage {
    /// Chunks of one page in each tier.
    fn chunks_per_tier(&self) -> Vec<usize> {
        (0..self.tiers.len()).map(|tier| self.chunks.iter().filter(|chunk| chunk.tier == tier).count()).collect()
    }
}
