//! Pages stored as unified-key chunks in the memory tier are read by any topology of the fleet
//! ([`hicache_core::testing::unified`]: TP2 writes; TP1, TP4 and two pipeline stages read every byte; a page missing
//! one chunk is never read), and pools that do not hold the plan's chunks as runs are refused.

use hicache_core::ErrorKind;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{MemoryStorage, MemoryStore, StorageBackend, UnifiedStorage, chunk_namespace_tag};
use hicache_core::testing::unified::{CHUNKS_PER_PAGE, topologies_share_chunks};
use hicache_core::unified_keys::{UnifiedRank, plan};

#[test]
fn every_topology_reads_what_a_tp2_deployment_wrote() {
    let store = MemoryStore::new();
    let opened = std::sync::Mutex::new(Vec::new());
    let shared = topologies_share_chunks(&|namespace: &StorageNamespace| {
        opened.lock().unwrap().push(namespace.clone());
        Ok(Box::new(MemoryStorage::shared(store.clone(), namespace)) as Box<dyn StorageBackend>)
    });
    // every chunk the writers stored, read once by each other topology's ranks together
    assert_eq!(shared.read, vec![shared.written; 3]);
    // 5 pages of 8 chunks, less the one the last check removed; no reader added an object
    assert_eq!(store.len() as u64, shared.written - 1);
    assert_eq!(shared.written, 5 * CHUNKS_PER_PAGE);
    // two chunk namespaces, whoever opened them: four layers and two
    let mut tags: Vec<String> = opened.lock().unwrap().iter().filter_map(chunk_namespace_tag).collect();
    tags.sort();
    tags.dedup();
    assert_eq!(tags.len(), 2, "{tags:?}");
    assert!(tags[0].ends_with("-chunk-L2") && tags[1].ends_with("-chunk-L4"), "{tags:?}");
}

#[test]
fn only_chunk_namespaces_have_a_chunk_tag() {
    let geometry = KvGeometry::mha(4, 2, 4, KvDtype::Bf16).unwrap();
    let chunk = StorageNamespace::single_rank("ukv1-0123456789abcdef/chunk-L4", geometry, HostLayout::PageUnified, 3);
    assert_eq!(chunk_namespace_tag(&chunk).as_deref(), Some("ukv1-0123456789abcdef-chunk-L4"));
    for model in ["org/Model", "ukv1-0123456789abcdef/chunk-L5", "ukv1-../x/chunk-L4", "x/chunk-L4"] {
        let other = StorageNamespace { model: model.into(), ..chunk.clone() };
        assert_eq!(chunk_namespace_tag(&other), None, "{model}");
    }
}

#[test]
fn pools_that_do_not_hold_the_plans_chunks_as_runs_are_refused_by_name() {
    let store = MemoryStore::new();
    let geometry = KvGeometry::mha(6, 8, 4, KvDtype::Bf16).unwrap();
    let base = StorageNamespace::single_rank("org/Model", geometry, HostLayout::PageUnified, 3);
    let plan = plan(&UnifiedRank::of(&base, (0, true), Some(2), None)).unwrap();
    let open = |namespace: StorageNamespace| {
        let store = store.clone();
        UnifiedStorage::open(namespace, &plan, &move |chunk: &StorageNamespace| {
            Ok(Box::new(MemoryStorage::shared(store.clone(), chunk)) as Box<dyn StorageBackend>)
        })
    };
    let error = open(StorageNamespace { layout: HostLayout::PageFirst, ..base.clone() }).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidInput);
    assert!(error.to_string().contains("mem_layout"), "{error}");
    // one group per page where the plan has four
    assert!(open(base.clone()).unwrap_err().to_string().contains("head_group"));
    let other = StorageNamespace { page_size: 4, head_groups: 4, ..base.clone() };
    assert!(open(other).unwrap_err().to_string().contains("page_size"));
    assert!(open(StorageNamespace { head_groups: 4, ..base.clone() }).is_ok());
    // a plan made by hand that does not tile the page: a gap between layer ranges, a suffix too few
    let grouped = StorageNamespace { head_groups: 4, ..base };
    let mut gap = plan.clone();
    gap.layer_ranges = vec![(0, 2), (3, 6)];
    gap.suffixes = (0..8).map(|chunk| format!("x_{chunk}")).collect();
    let mut short = plan.clone();
    short.suffixes.pop();
    for bad in [gap, short] {
        let store = store.clone();
        let error = UnifiedStorage::open(grouped.clone(), &bad, &move |chunk: &StorageNamespace| {
            Ok(Box::new(MemoryStorage::shared(store.clone(), chunk)) as Box<dyn StorageBackend>)
        })
        .unwrap_err();
        assert!(error.to_string().contains("layers"), "{error}");
    }
}
