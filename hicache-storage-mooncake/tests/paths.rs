//! How bytes move: the controller's storage threads register the host pool once and move page-first pages in place;
//! pages whose parts are not contiguous (a `layer_first` pool) go through the staging buffer and are counted.

use std::sync::Arc;

use hicache_core::controller::{PageBackup, PrefetchStop};
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, PageSegments, PageSegmentsMut, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{random_keys, random_pages};
use hicache_core::testing::rig::{controller_over, prefetch_back, store_through};
use hicache_storage_mooncake::MooncakeStorage;
use hicache_storage_mooncake::testing::Cluster;

/// Pages written and read, in batches of 3.
const PAGES: usize = 12;

#[test]
fn the_controller_registers_its_pool_once_and_moves_pages_in_place() {
    for (layout, staged) in [(HostLayout::PageFirst, false), (HostLayout::LayerFirst, true)] {
        let cluster = Cluster::start();
        let geometry = KvGeometry::mha(2, 2, 32, KvDtype::Bf16).unwrap();
        let namespace = StorageNamespace::single_rank("mooncake-controller", geometry, layout, 8);
        let tokens: Vec<u32> = (0..(PAGES * 8) as u32).map(|token| token * 31 + 5).collect();

        let writer_storage = Arc::new(MooncakeStorage::open(cluster.config(), &namespace).unwrap());
        let mut writer = controller_over(writer_storage.clone(), &namespace, 2 * PAGES + 8, 3, 1).unwrap();
        assert_eq!(writer_storage.registered_regions(), 1, "registered when the storage threads start");
        let (backup, expected) = store_through(&mut writer, &tokens);
        assert!(backup.pages.iter().all(|page| *page == PageBackup::Stored), "{layout:?}: {:?}", backup.pages);
        drop(writer);
        assert_eq!(writer_storage.registered_regions(), 0, "the controller's end unregisters the pool");

        let reader_storage = Arc::new(MooncakeStorage::open(cluster.config(), &namespace).unwrap());
        let mut reader = controller_over(reader_storage.clone(), &namespace, 2 * PAGES + 8, 3, 2).unwrap();
        let (done, got) = prefetch_back(&mut reader, &tokens);
        assert_eq!(done.explanation.stop, PrefetchStop::Complete, "{layout:?}");
        assert!(got == expected, "{layout:?}: the pages read back differ");
        let page_bytes = geometry.bytes_per_page(8) as u64;
        for (storage, what) in [(&writer_storage, "written"), (&reader_storage, "read")] {
            let staging = storage.stats().staging_bytes;
            if staged {
                assert_eq!(staging, PAGES as u64 * page_bytes, "{layout:?}: every byte {what} is staged");
            } else {
                assert_eq!(staging, 0, "{layout:?}: page-first parts move in place when {what}");
            }
        }
    }
}

#[test]
fn parts_split_across_segments_round_trip() {
    let cluster = Cluster::start();
    let namespace = StorageNamespace::single_rank(
        "mooncake-segments",
        KvGeometry::mha(3, 2, 8, KvDtype::Bf16).unwrap(),
        HostLayout::LayerFirst,
        4,
    );
    let bytes = namespace.geometry.bytes_per_page(namespace.page_size);
    let backend = MooncakeStorage::open(cluster.config(), &namespace).unwrap();
    let keys = random_keys(5);
    let pages = random_pages(5, bytes);
    // uneven cuts, some inside a part and one across the K/V boundary
    let cuts = [0, 7, bytes / 2 - 3, bytes / 2 + 5, bytes - 1, bytes];
    let sources: Vec<PageSegments<'_>> =
        pages.iter().map(|page| cuts.windows(2).map(|pair| &page[pair[0]..pair[1]]).collect()).collect();
    assert_eq!(backend.batch_set(&keys, &sources).unwrap(), vec![SetOutcome::Stored; 5]);
    let mut buffers = vec![vec![0u8; bytes]; 5];
    let mut targets: Vec<PageSegmentsMut<'_>> = buffers
        .iter_mut()
        .map(|buffer| {
            let mut rest: &mut [u8] = buffer;
            let mut segments = Vec::new();
            for pair in cuts.windows(2) {
                let (head, tail) = rest.split_at_mut(pair[1] - pair[0]);
                segments.push(head);
                rest = tail;
            }
            segments
        })
        .collect();
    assert_eq!(backend.batch_get(&keys, &mut targets).unwrap(), vec![GetOutcome::Hit; 5]);
    assert_eq!(buffers, pages);
    assert_eq!(backend.stats().staging_bytes, 2 * 5 * bytes as u64, "both parts staged, written and read");
}

/// Pages a writer that lends a segment of its own puts, then drops (its segment and every object in it go): with
/// `prefer_local_segment` every object was in that segment, so a reader then misses every page; without it the
/// master spread them over both segments and some survive (all 64 objects of 32 pages landing in the writer's
/// segment by chance is a 2^-64 event).
#[test]
fn puts_prefer_the_writers_own_segment_when_asked() {
    let cluster = Cluster::start();
    let namespace = StorageNamespace::single_rank(
        "mooncake-placement",
        KvGeometry::mha(2, 2, 32, KvDtype::Bf16).unwrap(),
        HostLayout::PageFirst,
        8,
    );
    let bytes = namespace.geometry.bytes_per_page(namespace.page_size);
    let reader = MooncakeStorage::open(cluster.config(), &namespace).unwrap();
    assert_eq!(reader.preferred_segment(), None, "a client lending nothing prefers nothing");
    for prefer_local_segment in [true, false] {
        let config = hicache_storage_mooncake::MooncakeConfig {
            global_segment_size: 64 << 20,
            prefer_local_segment,
            ..cluster.config()
        };
        let writer = MooncakeStorage::open(config, &namespace).unwrap();
        assert_eq!(writer.preferred_segment().is_some(), prefer_local_segment, "{:?}", writer.preferred_segment());
        let keys = random_keys(32);
        let pages = random_pages(32, bytes);
        let sources: Vec<PageSegments<'_>> = pages.iter().map(|page| vec![page.as_slice()]).collect();
        assert_eq!(writer.batch_set(&keys, &sources).unwrap(), vec![SetOutcome::Stored; 32]);
        let read = |expect_all: bool| {
            let mut buffers = vec![vec![0u8; bytes]; 32];
            let mut targets: Vec<PageSegmentsMut<'_>> =
                buffers.iter_mut().map(|buffer| vec![buffer.as_mut_slice()]).collect();
            let outcomes = reader.batch_get(&keys, &mut targets).unwrap();
            for ((outcome, buffer), page) in outcomes.iter().zip(&buffers).zip(&pages) {
                match outcome {
                    GetOutcome::Hit => assert_eq!(buffer, page, "a hit with wrong bytes"),
                    other => assert!(!expect_all, "{other:?} while the writer is up"),
                }
            }
            outcomes
        };
        assert!(read(true).iter().all(|outcome| *outcome == GetOutcome::Hit));
        drop(writer);
        let after = read(false);
        let survivors = after.iter().filter(|outcome| **outcome != GetOutcome::Miss).count();
        if prefer_local_segment {
            assert_eq!(survivors, 0, "objects outside the writer's segment: {after:?}");
        } else {
            assert!(survivors > 0, "every object was in the writer's segment without asking for it");
        }
    }
}
