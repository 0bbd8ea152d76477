//! Faults around the NIXL backend with the real POSIX plugin: damaged, removed and replaced page files, a vanished
//! directory, crashed writers, injected failures, bad configuration.

mod common;

use std::path::Path;

use hicache_core::Error;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::PageKey;
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FailureKind, FaultPlan, FaultyStorage, GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, put, random_keys, random_pages};
use hicache_storage_nixl::{NixlConfig, NixlStorage, PluginChoice};

/// 4 KiB pages: 2 layers × K/V × 2 heads × 32 × bf16 = 512 bytes a token, 8 tokens.
fn namespace(model: &str) -> StorageNamespace {
    StorageNamespace {
        tp_rank: 1,
        tp_size: 2,
        ..StorageNamespace::single_rank(
            model,
            KvGeometry::mha(2, 2, 32, KvDtype::Bf16).expect("geometry"),
            HostLayout::PageFirst,
            8,
        )
    }
}

const PAGE: usize = 4096;

/// A POSIX backend over `dir`.
fn open(dir: &Path, namespace: &StorageNamespace) -> NixlStorage {
    NixlStorage::open(common::config(dir), namespace).expect("the NIXL backend opens")
}

fn is_failure(outcome: &GetOutcome, kind: FailureKind) -> bool {
    matches!(outcome, GetOutcome::Failed(failure) if failure.kind == kind)
}

#[test]
fn pages_are_named_as_sglang_names_them_and_hold_raw_flat_pages() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path(), &namespace("org/model"));
    let keys = random_keys(2);
    let pages = random_pages(2, PAGE);
    assert!(put(&storage, &keys, &pages).iter().all(SetOutcome::is_stored));
    // SGLang's HiCacheNixl (after PR #10969): `{dir}/{key}_{model with / as -}_{tp_rank}_{tp_size}`, raw bytes
    let path = dir.path().join(format!("{}_org-model_1_2", keys[0]));
    assert_eq!(std::fs::read(&path).unwrap(), pages[0]);
    // and a page SGLang wrote is read
    let foreign_key = random_keys(1)[0];
    let foreign = random_pages(1, PAGE).remove(0);
    std::fs::write(dir.path().join(format!("{foreign_key}_org-model_1_2")), &foreign).unwrap();
    let (outcomes, buffers) = fetch(&storage, &[foreign_key], PAGE, 0);
    assert_eq!(outcomes, [GetOutcome::Hit]);
    assert_eq!(buffers[0], foreign);
    let names: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|entry| entry.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(names.len(), 3, "only the pages, no temporary files left: {names:?}");
}

#[test]
fn damaged_pages_fail_alone_are_removed_and_can_be_written_again() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path(), &namespace("m"));
    let keys = random_keys(4);
    let pages = random_pages(4, PAGE);
    put(&storage, &keys, &pages);
    // read once so every descriptor is cached, then truncate one page in place and grow another
    assert!(fetch(&storage, &keys, PAGE, 0).0.iter().all(|outcome| *outcome == GetOutcome::Hit));
    std::fs::OpenOptions::new().write(true).open(storage.page_path(&keys[1])).unwrap().set_len(1000).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(storage.page_path(&keys[3]))
        .unwrap()
        .set_len(PAGE as u64 + 1)
        .unwrap();
    assert_eq!(storage.batch_exists(&keys).unwrap(), 1, "a file of the wrong size is no page");
    let (outcomes, buffers) = fetch(&storage, &keys, PAGE, 0xAA);
    assert_eq!(outcomes[0], GetOutcome::Hit);
    assert!(is_failure(&outcomes[1], FailureKind::Corrupt), "{:?}", outcomes[1]);
    assert_eq!(outcomes[2], GetOutcome::Hit);
    assert!(is_failure(&outcomes[3], FailureKind::Corrupt), "{:?}", outcomes[3]);
    assert_eq!((&buffers[0], &buffers[2]), (&pages[0], &pages[2]), "the other pages arrive whole");
    assert!(!storage.page_path(&keys[1]).exists() && !storage.page_path(&keys[3]).exists(), "damaged files removed");
    assert_eq!(put(&storage, &keys, &pages)[1], SetOutcome::Stored);
    let (outcomes, buffers) = fetch(&storage, &keys, PAGE, 0);
    assert!(outcomes.iter().all(|outcome| *outcome == GetOutcome::Hit));
    assert_eq!(buffers, pages);
}

#[test]
fn a_page_removed_or_replaced_behind_an_open_descriptor_is_seen() {
    let dir = tempfile::tempdir().unwrap();
    let reader = open(dir.path(), &namespace("m"));
    let other = open(dir.path(), &namespace("m"));
    let keys = random_keys(2);
    let first = random_pages(2, PAGE);
    put(&reader, &keys, &first);
    assert_eq!(fetch(&reader, &keys, PAGE, 0).1, first, "descriptors now cached by the reader");
    // another process removes one page and writes other bytes under the second key
    assert_eq!(other.remove(&keys[..1]).unwrap(), 1);
    let replacement = random_pages(1, PAGE).remove(0);
    std::fs::write(dir.path().join("replacement"), &replacement).unwrap();
    std::fs::rename(dir.path().join("replacement"), reader.page_path(&keys[1])).unwrap();
    let (outcomes, buffers) = fetch(&reader, &keys, PAGE, 0);
    assert_eq!(outcomes, [GetOutcome::Miss, GetOutcome::Hit]);
    assert_eq!(buffers[1], replacement, "the file now at the path, not the one the descriptor had open");
}

#[test]
fn a_vanished_directory_fails_pages_not_the_process_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("pages");
    let storage = open(&root, &namespace("m"));
    let keys = random_keys(3);
    let pages = random_pages(3, PAGE);
    put(&storage, &keys[..1], &pages[..1]);
    std::fs::remove_dir_all(&root).unwrap();
    let outcomes = put(&storage, &keys, &pages);
    assert!(
        outcomes
            .iter()
            .all(|outcome| matches!(outcome, SetOutcome::Failed(failure) if failure.kind == FailureKind::Io)),
        "{outcomes:?}"
    );
    assert_eq!(fetch(&storage, &keys, PAGE, 0).0, [GetOutcome::Miss, GetOutcome::Miss, GetOutcome::Miss]);
    assert!(storage.clear().is_err(), "listing a missing directory is an error of the call");
    std::fs::create_dir_all(&root).unwrap();
    assert!(put(&storage, &keys, &pages).iter().all(|outcome| *outcome == SetOutcome::Stored));
    assert_eq!(fetch(&storage, &keys, PAGE, 0).1, pages);
}

#[test]
fn a_crashed_writers_temporary_file_is_no_page_and_clear_removes_it() {
    let dir = tempfile::tempdir().unwrap();
    let storage = open(dir.path(), &namespace("m"));
    let keys = random_keys(2);
    put(&storage, &keys[..1], &random_pages(1, PAGE));
    // what a writer killed before its rename leaves: a partial temporary file of the page
    let temporary = dir.path().join(format!("{}_m_1_2.tmp.999999.7", keys[1]));
    std::fs::write(&temporary, vec![1u8; 100]).unwrap();
    let foreign = dir.path().join(format!("{}_other_1_2", keys[1]));
    std::fs::write(&foreign, vec![2u8; PAGE]).unwrap();
    assert_eq!(storage.batch_exists(&keys[1..]).unwrap(), 0);
    assert_eq!(storage.list().unwrap().len(), 1);
    assert_eq!(storage.clear().unwrap(), 1, "one page of this namespace");
    assert!(!temporary.exists(), "the crashed writer's leftover went with it");
    assert!(foreign.exists(), "another model's page stays (SGLang's clear removes every file)");
}

#[test]
fn faults_injected_around_the_nixl_backend() {
    let dir = tempfile::tempdir().unwrap();
    let keys = random_keys(4);
    let pages = random_pages(4, PAGE);
    let storage = FaultyStorage::new(
        open(dir.path(), &namespace("m")),
        FaultPlan { partial_batch: Some(2), ..FaultPlan::default() },
    );
    let outcomes = put(&storage, &keys, &pages);
    assert_eq!(&outcomes[..2], [SetOutcome::Stored, SetOutcome::Stored]);
    assert!(matches!(&outcomes[2], SetOutcome::Failed(failure) if failure.kind == FailureKind::Injected));
    assert_eq!(storage.inner().batch_exists(&keys).unwrap(), 2, "unattempted pages were not written");
    storage.set_plan(FaultPlan { evict_after_exists: true, ..FaultPlan::default() });
    assert_eq!(storage.batch_exists(&keys).unwrap(), 2);
    let (outcomes, buffers) = fetch(&storage, &keys[..2], PAGE, 0);
    assert_eq!(outcomes, [GetOutcome::Miss, GetOutcome::Hit]);
    assert_eq!(buffers[1], pages[1]);
}

#[test]
fn bad_configuration_is_refused_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let refuse = |config: NixlConfig| NixlStorage::open(config, &namespace("m")).expect_err("refused");
    let unknown = refuse(NixlConfig { plugin: PluginChoice::Named("NOPE".into()), ..common::config(dir.path()) });
    assert!(
        matches!(&unknown, Error::InvalidArgument { field: "plugin", reason } if reason.contains("POSIX")),
        "{unknown}"
    );
    let mut config = common::config(dir.path());
    config.plugin_params.insert("use_magic".into(), "true".into());
    let parameter = refuse(config);
    assert!(
        matches!(&parameter, Error::InvalidArgument { field: "plugin_params", reason } if reason.contains("use_magic") && reason.contains("use_uring")),
        "{parameter}"
    );
    for plugin in ["OBJ", "UCX"] {
        let other = refuse(NixlConfig { plugin: PluginChoice::Named(plugin.into()), ..common::config(dir.path()) });
        assert!(matches!(other, Error::Unsupported { .. }), "{plugin}: {other}");
    }
    let bound = refuse(NixlConfig { max_open_files: 0, ..common::config(dir.path()) });
    assert!(matches!(bound, Error::InvalidArgument { field: "max_open_files", .. }), "{bound}");
    let missing =
        refuse(NixlConfig { lib_dir: Some(Path::new("/nonexistent/nixl").into()), ..common::config(dir.path()) });
    assert!(missing.to_string().contains("/nonexistent/nixl/libnixl_capi.so"), "{missing}");
    // a parameter the plugin has is taken
    let mut config = common::config(dir.path());
    config.plugin_params.insert("use_aio".into(), "true".into());
    let storage = NixlStorage::open(config, &namespace("m")).unwrap();
    let keys: Vec<PageKey> = random_keys(3);
    let pages = random_pages(3, PAGE);
    put(&storage, &keys, &pages);
    assert_eq!(fetch(&storage, &keys, PAGE, 0).1, pages);
}

#[test]
fn auto_picks_the_first_file_plugin_this_nixl_has() {
    let dir = tempfile::tempdir().unwrap();
    let config = NixlConfig { plugin: PluginChoice::Auto, ..common::config(dir.path()) };
    let storage = NixlStorage::open(config, &namespace("m")).unwrap();
    // the wheel has no 3FS plugin; POSIX comes next in SGLang's order
    assert_eq!(storage.usage().plugin, "POSIX");
}
