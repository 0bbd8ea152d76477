//! The storage hit query of a prefetch: how many leading pages of a prompt storage holds (docs/sglang.md#prefetch).
//!
//! Keys are chained from the last page already on the host and asked for `batch_pages` at a time; the query stops
//! at the first batch that is not a full hit, so a cold prompt costs one round trip and a long hit ⌈n / batch⌉.
//! Keys are hashed batch by batch, so a miss early on does not pay for hashing the whole prompt.

use crate::error::Error;
use crate::hash::{PageHasher, PageKey, PartialPage};
use crate::storage::StorageBackend;

/// What storage holds of a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HitQuery {
    /// Keys of the leading pages present, in order.
    pub keys: Vec<PageKey>,
    /// Tokens those pages hold (`keys.len() × page_size`).
    pub hit_tokens: usize,
    /// `batch_exists` calls made.
    pub round_trips: usize,
}

/// Asks `storage` for the leading pages of `tokens` (whole pages; a tail shorter than a page is not asked for),
/// chained from `last_key`, `batch_pages` pages per call.
///
/// # Errors
///
/// [`Error::InvalidArgument`] for a zero page size or batch; the storage's errors.
pub fn storage_hit_query(
    storage: &dyn StorageBackend,
    hasher: &mut PageHasher,
    tokens: &[u32],
    page_size: usize,
    last_key: Option<PageKey>,
    batch_pages: usize,
) -> Result<HitQuery, Error> {
    storage_hit_query_with(storage, hasher, tokens, page_size, last_key, batch_pages, &mut |_| true)
}

/// [`storage_hit_query`], telling `found` the keys of each batch's leading hits as soon as that batch is answered
/// (so a caller can start reading them while later batches are asked for); `found` returning false ends the query
/// there, with the hits so far.
///
/// # Errors
///
/// As [`storage_hit_query`].
pub fn storage_hit_query_with(
    storage: &dyn StorageBackend,
    hasher: &mut PageHasher,
    tokens: &[u32],
    page_size: usize,
    last_key: Option<PageKey>,
    batch_pages: usize,
    found: &mut dyn FnMut(&[PageKey]) -> bool,
) -> Result<HitQuery, Error> {
    if batch_pages == 0 {
        return Err(Error::InvalidArgument { field: "storage_batch_pages", reason: "must be at least 1".into() });
    }
    let whole = &tokens[..tokens.len() - tokens.len() % page_size.max(1)];
    let mut query = HitQuery { keys: Vec::new(), hit_tokens: 0, round_trips: 0 };
    let mut last = last_key;
    for batch in whole.chunks(page_size.max(1) * batch_pages) {
        let keys = hasher.page_keys(batch, page_size, last, PartialPage::Reject)?;
        // a backend answering more than it was asked is not trusted beyond the batch
        let hits = storage.batch_exists(&keys)?.min(keys.len());
        query.round_trips += 1;
        query.keys.extend_from_slice(&keys[..hits]);
        query.hit_tokens += hits * page_size;
        let go_on = found(&keys[..hits]);
        if hits < keys.len() || !go_on {
            break;
        }
        last = keys.last().copied();
    }
    Ok(query)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{KvDtype, KvGeometry};
    use crate::hash::page_keys;
    use crate::layout::HostLayout;
    use crate::namespace::StorageNamespace;
    use crate::storage::{FaultPlan, FaultyStorage, MemoryStorage, PageSegments};

    const PAGE: usize = 4;

    fn storage() -> FaultyStorage<MemoryStorage> {
        let namespace = StorageNamespace::single_rank(
            "q",
            KvGeometry::mha(1, 1, 1, KvDtype::Bf16).unwrap(),
            HostLayout::PageFirst,
            PAGE,
        );
        FaultyStorage::new(MemoryStorage::new(&namespace), FaultPlan::default())
    }

    fn store(storage: &dyn StorageBackend, keys: &[PageKey]) {
        let page = [0u8; 4 * PAGE];
        let pages: Vec<PageSegments<'_>> = keys.iter().map(|_| vec![&page[..]]).collect();
        storage.batch_set(keys, &pages).unwrap();
    }

    #[test]
    fn stops_at_the_first_partial_batch_with_one_round_trip_per_batch() {
        let storage = storage();
        let tokens: Vec<u32> = (0..40 * PAGE as u32 + 3).collect();
        let prior = crate::hash::page_key(None, &[9]);
        let keys = page_keys(&tokens[..40 * PAGE], PAGE, Some(prior), PartialPage::Reject).unwrap();
        store(&storage, &keys[..25]);
        let query = storage_hit_query(&storage, &mut PageHasher::new(), &tokens, PAGE, Some(prior), 8).unwrap();
        assert_eq!(query.keys, keys[..25]);
        assert_eq!(query.hit_tokens, 25 * PAGE);
        assert_eq!(query.round_trips, 4, "batches of 8: 8, 16, 24 full, the 4th has 1 of 8");
        assert_eq!(storage.calls(), 1 + 4);
        // without the prior the chain differs: nothing is found, in one round trip
        let cold = storage_hit_query(&storage, &mut PageHasher::new(), &tokens, PAGE, None, 8).unwrap();
        assert_eq!((cold.hit_tokens, cold.round_trips), (0, 1));
    }

    #[test]
    fn each_batch_is_reported_as_it_is_answered_and_the_caller_may_end_the_query() {
        let storage = storage();
        let tokens: Vec<u32> = (0..20 * PAGE as u32).collect();
        let keys = page_keys(&tokens, PAGE, None, PartialPage::Reject).unwrap();
        store(&storage, &keys[..13]);
        let mut reported = Vec::new();
        let query = storage_hit_query_with(&storage, &mut PageHasher::new(), &tokens, PAGE, None, 4, &mut |found| {
            reported.push(found.to_vec());
            true
        })
        .unwrap();
        let batches: Vec<Vec<PageKey>> =
            vec![keys[..4].to_vec(), keys[4..8].to_vec(), keys[8..12].to_vec(), keys[12..13].to_vec()];
        assert_eq!(reported, batches);
        assert_eq!((query.keys.as_slice(), query.round_trips), (&keys[..13], 4));
        // ended by the caller after the second batch: the hits so far, no further round trip
        let calls = storage.calls();
        let mut batches_seen = 0;
        let query = storage_hit_query_with(&storage, &mut PageHasher::new(), &tokens, PAGE, None, 4, &mut |_| {
            batches_seen += 1;
            batches_seen < 2
        })
        .unwrap();
        assert_eq!((query.keys.as_slice(), query.round_trips), (&keys[..8], 2));
        assert_eq!(storage.calls(), calls + 2);
    }

    #[test]
    fn a_full_hit_and_a_storage_failure() {
        let storage = storage();
        let tokens: Vec<u32> = (0..16 * PAGE as u32).collect();
        let keys = page_keys(&tokens, PAGE, None, PartialPage::Reject).unwrap();
        store(&storage, &keys);
        let query = storage_hit_query(&storage, &mut PageHasher::new(), &tokens, PAGE, None, 8).unwrap();
        assert_eq!((query.hit_tokens, query.round_trips), (16 * PAGE, 2));
        storage.set_plan(FaultPlan { fail_call: Some(storage.calls() + 2), ..FaultPlan::default() });
        assert!(storage_hit_query(&storage, &mut PageHasher::new(), &tokens, PAGE, None, 8).is_err());
        assert!(storage_hit_query(&storage, &mut PageHasher::new(), &tokens, PAGE, None, 0).is_err());
    }
}
