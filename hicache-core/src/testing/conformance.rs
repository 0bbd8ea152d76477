//! The storage conformance suite: the behaviour every backend must show, run by each backend crate's tests.
//!
//! A backend crate implements [`Harness`] (open a backend for a namespace; backends opened by one harness share the
//! same underlying storage, as processes sharing a directory or a cluster do) and expands
//! [`storage_conformance_tests!`](crate::storage_conformance_tests) to get one `#[test]` per check. Every check
//! writes fresh random pages under fresh random keys, so a backend that merely remembers earlier runs cannot pass.

use std::sync::Arc;

use rand::Rng as _;

use crate::error::Error;
use crate::geometry::{KvDtype, KvGeometry};
use crate::hash::{PageKey, page_key};
use crate::layout::HostLayout;
use crate::namespace::StorageNamespace;
use crate::storage::{FailureKind, GetOutcome, PageSegments, PageSegmentsMut, SetOutcome, StorageBackend};

/// Opens backends for the suite.
pub trait Harness: Send + Sync {
    /// A backend for `namespace`; all backends of one harness share the same underlying storage.
    fn open(&self, namespace: &StorageNamespace) -> Box<dyn StorageBackend>;
}

impl<F> Harness for F
where
    F: Fn(&StorageNamespace) -> Box<dyn StorageBackend> + Send + Sync,
{
    fn open(&self, namespace: &StorageNamespace) -> Box<dyn StorageBackend> {
        self(namespace)
    }
}

/// Expands to one `#[test]` per conformance check, each opening backends with the given [`Harness`] expression.
#[macro_export]
macro_rules! storage_conformance_tests {
    ($harness:expr) => {
        $crate::storage_conformance_tests_without_isolation!($harness);
        $crate::__storage_conformance_tests!($harness; namespaces_are_isolated_and_clear_is_scoped);
    };
}

/// Every check of [`storage_conformance_tests!`](crate::storage_conformance_tests) but the isolation of namespaces
/// with different models, for key schemes that by design cannot tell them apart (SGLang 0.5.2's Mooncake keys have no
/// model name); such a scheme's tests show the sharing instead.
#[macro_export]
macro_rules! storage_conformance_tests_without_isolation {
    ($harness:expr) => {
        $crate::__storage_conformance_tests!($harness;
            empty_backend_misses,
            set_then_get_round_trips,
            exists_counts_the_leading_run,
            existing_pages_are_not_rewritten,
            mixed_batches_report_each_page,
            wrong_sizes_fail_the_page_only,
            batch_length_mismatch_is_an_error,
            mla_ranks_share_pages,
            remove_deletes_only_named_pages,
            list_names_exactly_this_namespaces_pages,
            stats_count_operations,
            empty_batches_are_fine,
            concurrent_writers_and_readers_agree,
            duplicate_keys_in_one_batch
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __storage_conformance_tests {
    ($harness:expr; $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::testing::conformance::$check(&$harness);
            }
        )*
    };
}

/// A small MHA namespace (512-byte pages) with a random model name, so runs never see each other's pages.
pub fn mha_namespace(tp_rank: usize, tp_size: usize) -> StorageNamespace {
    StorageNamespace {
        tp_rank,
        tp_size,
        ..StorageNamespace::single_rank(
            format!("conformance/mha-{:08x}", rand::random::<u32>()),
            KvGeometry::mha(2, 2, 8, KvDtype::Bf16).expect("valid geometry"),
            HostLayout::PageFirst,
            4,
        )
    }
}

fn page_bytes(namespace: &StorageNamespace) -> usize {
    namespace.geometry.bytes_per_page(namespace.page_size)
}

/// `count` fresh random keys.
pub fn random_keys(count: usize) -> Vec<PageKey> {
    (0..count).map(|_| page_key(None, &[rand::random(), rand::random(), rand::random()])).collect()
}

/// `count` pages of fresh random bytes.
pub fn random_pages(count: usize, bytes: usize) -> Vec<Vec<u8>> {
    (0..count)
        .map(|_| {
            let mut page = vec![0u8; bytes];
            rand::rng().fill_bytes(&mut page);
            page
        })
        .collect()
}

/// Writes whole pages (one segment each); returns the outcomes.
pub fn put(backend: &dyn StorageBackend, keys: &[PageKey], pages: &[Vec<u8>]) -> Vec<SetOutcome> {
    let sources: Vec<PageSegments<'_>> = pages.iter().map(|page| vec![page.as_slice()]).collect();
    backend.batch_set(keys, &sources).expect("batch_set")
}

/// Reads pages into buffers of `bytes` filled with `fill`; returns outcomes and buffers.
pub fn fetch(
    backend: &dyn StorageBackend,
    keys: &[PageKey],
    bytes: usize,
    fill: u8,
) -> (Vec<GetOutcome>, Vec<Vec<u8>>) {
    let mut buffers = vec![vec![fill; bytes]; keys.len()];
    let mut targets: Vec<PageSegmentsMut<'_>> = buffers.iter_mut().map(|buffer| vec![buffer.as_mut_slice()]).collect();
    let outcomes = backend.batch_get(keys, &mut targets).expect("batch_get");
    drop(targets);
    (outcomes, buffers)
}

fn assert_all_stored(outcomes: &[SetOutcome]) {
    assert!(outcomes.iter().all(|outcome| *outcome == SetOutcome::Stored), "expected every page stored: {outcomes:?}");
}

/// A fresh namespace holds nothing: exists is 0, gets miss and leave the buffer alone.
pub fn empty_backend_misses(harness: &dyn Harness) {
    let namespace = mha_namespace(0, 1);
    let backend = harness.open(&namespace);
    let keys = random_keys(3);
    assert_eq!(backend.batch_exists(&keys).expect("batch_exists"), 0);
    assert!(!backend.exists(&keys[0]).expect("exists"));
    let (outcomes, buffers) = fetch(backend.as_ref(), &keys, page_bytes(&namespace), 0x5a);
    assert_eq!(outcomes, vec![GetOutcome::Miss; 3]);
    assert!(buffers.iter().flatten().all(|&byte| byte == 0x5a), "a miss must not touch the destination");
}

/// Pages written from scattered segments come back byte for byte into differently scattered segments.
pub fn set_then_get_round_trips(harness: &dyn Harness) {
    let namespace = mha_namespace(0, 1);
    let backend = harness.open(&namespace);
    let bytes = page_bytes(&namespace);
    let keys = random_keys(5);
    let pages = random_pages(5, bytes);
    // write each page as three uneven segments
    let cuts = [bytes / 7, bytes / 2 + 3];
    let sources: Vec<PageSegments<'_>> =
        pages.iter().map(|page| vec![&page[..cuts[0]], &page[cuts[0]..cuts[1]], &page[cuts[1]..]]).collect();
    assert_all_stored(&backend.batch_set(&keys, &sources).expect("batch_set"));
    // read into two halves
    let mut buffers = vec![vec![0u8; bytes]; keys.len()];
    let mut targets: Vec<PageSegmentsMut<'_>> = buffers
        .iter_mut()
        .map(|buffer| {
            let (head, tail) = buffer.split_at_mut(bytes / 2);
            vec![head, tail]
        })
        .collect();
    let outcomes = backend.batch_get(&keys, &mut targets).expect("batch_get");
    drop(targets);
    assert_eq!(outcomes, vec![GetOutcome::Hit; 5]);
    assert_eq!(buffers, pages, "pages must come back byte for byte");
    // and through the single-key helpers
    let mut one = vec![0u8; bytes];
    assert_eq!(backend.get(&keys[3], vec![one.as_mut_slice()]).expect("get"), GetOutcome::Hit);
    assert_eq!(one, pages[3]);
    let extra = random_keys(1);
    assert_eq!(backend.set(&extra[0], vec![pages[0].as_slice()]).expect("set"), SetOutcome::Stored);
    assert!(backend.exists(&extra[0]).expect("exists"));
}

/// `batch_exists` counts present keys from the start and stops at the first absent one; `batch_contains` answers
/// every key.
pub fn exists_counts_the_leading_run(harness: &dyn Harness) {
    let namespace = mha_namespace(0, 1);
    let backend = harness.open(&namespace);
    let keys = random_keys(6);
    let pages = random_pages(6, page_bytes(&namespace));
    let present = [0, 1, 2, 4, 5];
    let chosen: Vec<PageKey> = present.iter().map(|&index| keys[index]).collect();
    let chosen_pages: Vec<Vec<u8>> = present.iter().map(|&index| pages[index].clone()).collect();
    assert_all_stored(&put(backend.as_ref(), &chosen, &chosen_pages));
    assert_eq!(backend.batch_exists(&keys).expect("batch_exists"), 3);
    assert_eq!(backend.batch_exists(&keys[3..]).expect("batch_exists"), 0);
    assert_eq!(backend.batch_exists(&keys[4..]).expect("batch_exists"), 2);
    // every key answered, past the gap too
    let held = backend.batch_contains(&keys).expect("batch_contains");
    assert_eq!(held, [true, true, true, false, true, true]);
    assert_eq!(backend.batch_contains(&[]).expect("batch_contains"), Vec::<bool>::new());
    // a random subset of fresh keys, in a random order
    let fresh = random_keys(24);
    let stored: Vec<bool> = (0..fresh.len()).map(|_| rand::random::<bool>()).collect();
    let chosen: Vec<PageKey> = fresh.iter().zip(&stored).filter(|(_, stored)| **stored).map(|(key, _)| *key).collect();
    assert_all_stored(&put(backend.as_ref(), &chosen, &random_pages(chosen.len(), page_bytes(&namespace))));
    assert_eq!(backend.batch_contains(&fresh).expect("batch_contains"), stored);
}

/// Writing a key that is present reports it present and keeps the first bytes (keys name content).
pub fn existing_pages_are_not_rewritten(harness: &dyn Harness) {
    let namespace = mha_namespace(0, 1);
    let backend = harness.open(&namespace);
    let bytes = page_bytes(&namespace);
    let keys = random_keys(1);
    let pages = random_pages(2, bytes);
    assert_all_stored(&put(backend.as_ref(), &keys, &pages[..1]));
    assert_eq!(put(backend.as_ref(), &keys, &pages[1..]), [SetOutcome::AlreadyPresent]);
    let (outcomes, buffers) = fetch(backend.as_ref(), &keys, bytes, 0);
    assert_eq!(outcomes, [GetOutcome::Hit]);
    assert_eq!(buffers[0], pages[0]);
}

/// A batch of hits and misses reports each page; hits carry their bytes, misses leave theirs alone.
pub fn mixed_batches_report_each_page(harness: &dyn Harness) {
    let namespace = mha_namespace(0, 1);
    let backend = harness.open(&namespace);
    let bytes = page_bytes(&namespace);
    let keys = random_keys(6);
    let pages = random_pages(6, bytes);
    let present: Vec<usize> = (0..6).filter(|index| index % 2 == 1).collect();
    let chosen: Vec<PageKey> = present.iter().map(|&index| keys[index]).collect();
    let chosen_pages: Vec<Vec<u8>> = present.iter().map(|&index| pages[index].clone()).collect();
    assert_all_stored(&put(backend.as_ref(), &chosen, &chosen_pages));
    let (outcomes, buffers) = fetch(backend.as_ref(), &keys, bytes, 0xee);
    for (index, (outcome, buffer)) in outcomes.iter().zip(&buffers).enumerate() {
        if index % 2 == 1 {
            assert_eq!(*outcome, GetOutcome::Hit, "page {index}");
            assert_eq!(*buffer, pages[index], "page {index}");
        } else {
            assert_eq!(*outcome, GetOutcome::Miss, "page {index}");
            assert!(buffer.iter().all(|&byte| byte == 0xee), "page {index}: a miss must not touch the destination");
        }
    }
}

/// A page of the wrong size fails alone, names the sizes, and leaves stored pages intact.
pub fn wrong_sizes_fail_the_page_only(harness: &dyn Harness) {
    let namespace = mha_namespace(0, 1);
    let backend = harness.open(&namespace);
    let bytes = page_bytes(&namespace);
    let keys = random_keys(3);
    let pages = random_pages(3, bytes);
    let short = vec![1u8; bytes - 8];
    let outcomes = put(backend.as_ref(), &keys, &[pages[0].clone(), short, pages[2].clone()]);
    assert_eq!(outcomes[0], SetOutcome::Stored);
    assert!(
        matches!(&outcomes[1], SetOutcome::Failed(failure) if failure.kind == FailureKind::SizeMismatch),
        "{outcomes:?}"
    );
    assert_eq!(outcomes[2], SetOutcome::Stored);
    assert!(!backend.exists(&keys[1]).expect("exists"), "a refused page must not be stored");
    let mut large = vec![0u8; bytes + 8];
    let outcome = backend.get(&keys[0], vec![large.as_mut_slice()]).expect("get");
    assert!(
        matches!(&outcome, GetOutcome::Failed(failure) if failure.kind == FailureKind::SizeMismatch),
        "{outcome:?}"
    );
    let (outcomes, buffers) = fetch(backend.as_ref(), &keys[..1], bytes, 0);
    assert_eq!((outcomes[0].clone(), &buffers[0]), (GetOutcome::Hit, &pages[0]), "the stored page is intact");
}

/// Keys and pages of different lengths are refused as a whole, naming both counts, and nothing is stored.
pub fn batch_length_mismatch_is_an_error(harness: &dyn Harness) {
    let namespace = mha_namespace(0, 1);
    let backend = harness.open(&namespace);
    let keys = random_keys(3);
    let pages = random_pages(2, page_bytes(&namespace));
    let sources: Vec<PageSegments<'_>> = pages.iter().map(|page| vec![page.as_slice()]).collect();
    let error = backend.batch_set(&keys, &sources).expect_err("2 pages for 3 keys");
    assert!(matches!(&error, Error::InvalidArgument { field: "pages", .. }), "{error}");
    assert!(error.to_string().contains("2 pages for 3 keys"), "{error}");
    assert_eq!(backend.batch_exists(&keys).expect("batch_exists"), 0);
    let mut buffers = random_pages(2, page_bytes(&namespace));
    let mut targets: Vec<PageSegmentsMut<'_>> = buffers.iter_mut().map(|buffer| vec![buffer.as_mut_slice()]).collect();
    assert!(backend.batch_get(&keys, &mut targets).is_err());
}

/// Another model or TP rank sees nothing of this one's pages, and `clear` removes only this namespace's.
pub fn namespaces_are_isolated_and_clear_is_scoped(harness: &dyn Harness) {
    let rank0 = mha_namespace(0, 2);
    let rank1 = StorageNamespace { tp_rank: 1, ..rank0.clone() };
    let other_model = StorageNamespace { model: format!("{}-other", rank0.model), ..rank0.clone() };
    let backends = [harness.open(&rank0), harness.open(&rank1), harness.open(&other_model)];
    let keys = random_keys(4);
    let bytes = page_bytes(&rank0);
    let page_sets: Vec<Vec<Vec<u8>>> = (0..3).map(|_| random_pages(4, bytes)).collect();
    assert_eq!(backends[1].batch_exists(&keys).expect("batch_exists"), 0);
    for (backend, pages) in backends.iter().zip(&page_sets) {
        assert_eq!(backend.batch_exists(&keys).expect("batch_exists"), 0, "another namespace's pages leaked in");
        assert_all_stored(&put(backend.as_ref(), &keys, pages));
    }
    for (backend, pages) in backends.iter().zip(&page_sets) {
        let (outcomes, buffers) = fetch(backend.as_ref(), &keys, bytes, 0);
        assert_eq!(outcomes, vec![GetOutcome::Hit; 4]);
        assert_eq!(&buffers, pages, "each namespace reads its own bytes");
    }
    assert_eq!(backends[0].clear().expect("clear"), 4);
    assert_eq!(backends[0].batch_exists(&keys).expect("batch_exists"), 0);
    assert_eq!(backends[1].batch_exists(&keys).expect("batch_exists"), 4, "clear removed another rank's pages");
    assert_eq!(backends[2].batch_exists(&keys).expect("batch_exists"), 4, "clear removed another model's pages");
}

/// MLA pages are the same on every TP rank: one rank writes, every rank reads.
pub fn mla_ranks_share_pages(harness: &dyn Harness) {
    let writer = StorageNamespace {
        geometry: KvGeometry::mla(2, 12, 4, KvDtype::Bf16).expect("valid geometry"),
        ..mha_namespace(0, 4)
    };
    let reader = StorageNamespace { tp_rank: 3, ..writer.clone() };
    let bytes = page_bytes(&writer);
    let keys = random_keys(2);
    let pages = random_pages(2, bytes);
    assert_all_stored(&put(harness.open(&writer).as_ref(), &keys, &pages));
    let (outcomes, buffers) = fetch(harness.open(&reader).as_ref(), &keys, bytes, 0);
    assert_eq!(outcomes, vec![GetOutcome::Hit; 2]);
    assert_eq!(buffers, pages);
}

/// `remove` deletes the named pages of this namespace, counts them, and ignores absent ones.
pub fn remove_deletes_only_named_pages(harness: &dyn Harness) {
    let namespace = mha_namespace(0, 1);
    let backend = harness.open(&namespace);
    let keys = random_keys(4);
    assert_all_stored(&put(backend.as_ref(), &keys[..3], &random_pages(3, page_bytes(&namespace))));
    assert_eq!(backend.remove(&[keys[1], keys[3]]).expect("remove"), 1);
    assert_eq!(backend.batch_exists(&keys).expect("batch_exists"), 1);
    assert!(backend.exists(&keys[2]).expect("exists"));
    assert_eq!(backend.remove(&[keys[1]]).expect("remove"), 0);
}

/// `list` names every page of the namespace once, and no page of another (backends that cannot list say so).
pub fn list_names_exactly_this_namespaces_pages(harness: &dyn Harness) {
    let (ours, theirs) = (mha_namespace(0, 2), mha_namespace(1, 2));
    let (backend, other) = (harness.open(&ours), harness.open(&theirs));
    let keys = random_keys(3);
    assert_all_stored(&put(backend.as_ref(), &keys, &random_pages(3, page_bytes(&ours))));
    assert_all_stored(&put(other.as_ref(), &random_keys(2), &random_pages(2, page_bytes(&theirs))));
    let mut listed = match backend.list() {
        Ok(listed) => listed,
        Err(Error::Unsupported { .. }) => return,
        Err(error) => panic!("list: {error}"),
    };
    listed.sort_unstable();
    let mut expected = keys.clone();
    expected.sort_unstable();
    assert_eq!(listed.iter().map(|(key, _)| *key).collect::<Vec<_>>(), expected);
    assert!(listed.iter().all(|(_, bytes)| *bytes >= page_bytes(&ours) as u64), "{listed:?}");
    backend.remove(&keys[..1]).expect("remove");
    assert_eq!(backend.list().expect("list").len(), 2);
}

/// The counters follow the calls.
pub fn stats_count_operations(harness: &dyn Harness) {
    let namespace = mha_namespace(0, 1);
    let backend = harness.open(&namespace);
    let bytes = page_bytes(&namespace);
    let before = backend.stats();
    let keys = random_keys(4);
    let pages = random_pages(4, bytes);
    assert_all_stored(&put(backend.as_ref(), &keys[..3], &pages[..3]));
    assert_eq!(put(backend.as_ref(), &keys[..1], &pages[..1]), [SetOutcome::AlreadyPresent]);
    let (outcomes, _) = fetch(backend.as_ref(), &keys, bytes, 0);
    assert_eq!(outcomes.iter().filter(|outcome| **outcome == GetOutcome::Hit).count(), 3);
    assert_eq!(backend.batch_exists(&keys).expect("batch_exists"), 3);
    assert_eq!(backend.remove(&keys[..1]).expect("remove"), 1);
    let after = backend.stats();
    let bytes = bytes as u64;
    assert_eq!(after.set_stored - before.set_stored, 3);
    assert_eq!(after.set_present - before.set_present, 1);
    assert_eq!(after.bytes_written - before.bytes_written, 3 * bytes);
    assert_eq!(after.get_hits - before.get_hits, 3);
    assert_eq!(after.get_misses - before.get_misses, 1);
    assert_eq!(after.bytes_read - before.bytes_read, 3 * bytes);
    assert_eq!(after.exists_keys - before.exists_keys, 4);
    assert_eq!(after.exists_hits - before.exists_hits, 3);
    assert_eq!(after.removed - before.removed, 1);
}

/// Empty batches are valid and do nothing.
pub fn empty_batches_are_fine(harness: &dyn Harness) {
    let backend = harness.open(&mha_namespace(0, 1));
    assert_eq!(backend.batch_exists(&[]).expect("batch_exists"), 0);
    assert!(backend.batch_get(&[], &mut []).expect("batch_get").is_empty());
    assert!(backend.batch_set(&[], &[]).expect("batch_set").is_empty());
    assert_eq!(backend.remove(&[]).expect("remove"), 0);
}

/// Threads writing overlapping keys and reading them back all see whole, correct pages.
pub fn concurrent_writers_and_readers_agree(harness: &dyn Harness) {
    const THREADS: usize = 4;
    let namespace = mha_namespace(0, 1);
    let backend: Arc<dyn StorageBackend> = Arc::from(harness.open(&namespace));
    let bytes = page_bytes(&namespace);
    let keys = random_keys(16);
    // the content of a key is fixed (keys name content), so every writer of a key writes the same bytes
    let pages = Arc::new(random_pages(16, bytes));
    let workers: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (backend, keys, pages) = (backend.clone(), keys.clone(), pages.clone());
            std::thread::spawn(move || {
                let order: Vec<usize> =
                    (0..keys.len()).map(|index| (index * (thread + 1) + thread) % keys.len()).collect();
                for chunk in order.chunks(4) {
                    let chunk_keys: Vec<PageKey> = chunk.iter().map(|&index| keys[index]).collect();
                    let chunk_pages: Vec<Vec<u8>> = chunk.iter().map(|&index| pages[index].clone()).collect();
                    let outcomes = put(backend.as_ref(), &chunk_keys, &chunk_pages);
                    assert!(outcomes.iter().all(SetOutcome::is_stored), "{outcomes:?}");
                    let (outcomes, buffers) = fetch(backend.as_ref(), &chunk_keys, bytes, 0);
                    for ((outcome, buffer), &index) in outcomes.iter().zip(&buffers).zip(chunk) {
                        assert_eq!(*outcome, GetOutcome::Hit, "key {index}");
                        assert_eq!(*buffer, pages[index], "key {index} read torn or foreign bytes");
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("worker panicked");
    }
    assert_eq!(backend.batch_exists(&keys).expect("batch_exists"), keys.len());
}

/// A key repeated in one batch is written once and read into every slot that names it.
pub fn duplicate_keys_in_one_batch(harness: &dyn Harness) {
    let namespace = mha_namespace(0, 1);
    let backend = harness.open(&namespace);
    let bytes = page_bytes(&namespace);
    let keys = random_keys(1);
    let pages = random_pages(1, bytes);
    let outcomes = put(backend.as_ref(), &[keys[0], keys[0]], &[pages[0].clone(), pages[0].clone()]);
    assert!(outcomes.iter().all(SetOutcome::is_stored), "{outcomes:?}");
    assert_eq!(outcomes.iter().filter(|outcome| **outcome == SetOutcome::Stored).count(), 1, "{outcomes:?}");
    let (outcomes, buffers) = fetch(backend.as_ref(), &[keys[0], keys[0]], bytes, 0);
    assert_eq!(outcomes, vec![GetOutcome::Hit; 2]);
    assert!(buffers.iter().all(|buffer| *buffer == pages[0]));
}
