//! A directory in SGLang 0.5.2's HiCacheFile layout is read by hicache, and what hicache writes is read by SGLang's
//! reader: both sides played by `tests/data/sglang_file_layout.py`, which follows HiCacheFile's naming and I/O.

use std::path::Path;
use std::process::Command;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PartialPage, page_keys};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, put};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

const PAGE_SIZE: usize = 4;
const PAGES: usize = 12;

fn namespace(mla: bool) -> StorageNamespace {
    let geometry = if mla {
        KvGeometry::mla(3, 32, 8, KvDtype::Bf16).expect("geometry")
    } else {
        KvGeometry::mha(3, 2, 16, KvDtype::Bf16).expect("geometry")
    };
    StorageNamespace {
        tp_rank: 1,
        tp_size: 4,
        ..StorageNamespace::single_rank("Qwen/Qwen3-8B", geometry, HostLayout::LayerFirst, PAGE_SIZE)
    }
}

/// The script's pages: keys chained over tokens `1000 p + j`, bytes `(p·131 + i·7 + (i >> 8)) & 0xff`.
fn expected(page_bytes: usize) -> (Vec<hicache_core::hash::PageKey>, Vec<Vec<u8>>) {
    let tokens: Vec<u32> = (0..PAGES as u32).flat_map(|p| (0..PAGE_SIZE as u32).map(move |j| 1000 * p + j)).collect();
    let keys = page_keys(&tokens, PAGE_SIZE, None, PartialPage::Reject).expect("keys");
    let pages =
        (0..PAGES).map(|p| (0..page_bytes).map(|i| ((p * 131 + i * 7 + (i >> 8)) & 0xff) as u8).collect()).collect();
    (keys, pages)
}

fn script(command: &str, dir: &Path, namespace: &StorageNamespace) {
    let page_bytes = namespace.geometry.bytes_per_page(PAGE_SIZE);
    let output = Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/sglang_file_layout.py"))
        .arg(command)
        .arg(dir)
        .arg(&namespace.model)
        .arg(namespace.tp_rank.to_string())
        .arg(namespace.tp_size.to_string())
        .arg(if namespace.geometry.is_mla() { "1" } else { "0" })
        .arg(PAGE_SIZE.to_string())
        .arg(page_bytes.to_string())
        .arg(PAGES.to_string())
        .output()
        .expect("python3 runs (the machines this project tests on have it)");
    assert!(output.status.success(), "{command}: {}", String::from_utf8_lossy(&output.stderr));
}

#[test]
fn hicache_reads_a_directory_sglang_wrote() {
    for mla in [false, true] {
        let dir = tempfile::tempdir().expect("temporary directory");
        let namespace = namespace(mla);
        script("write", dir.path(), &namespace);
        let storage = FileStorage::open(FileConfig::new(dir.path(), FileFormat::Sglang), &namespace).expect("opens");
        let page_bytes = namespace.geometry.bytes_per_page(PAGE_SIZE);
        let (keys, pages) = expected(page_bytes);
        assert_eq!(storage.batch_exists(&keys).expect("batch_exists"), PAGES, "mla {mla}");
        let (outcomes, buffers) = fetch(&storage, &keys, page_bytes, 0);
        assert_eq!(outcomes, vec![GetOutcome::Hit; PAGES], "mla {mla}");
        assert_eq!(buffers, pages, "mla {mla}");
    }
}

#[test]
fn sglang_reads_what_hicache_wrote() {
    for mla in [false, true] {
        let dir = tempfile::tempdir().expect("temporary directory");
        let namespace = namespace(mla);
        let storage = FileStorage::open(FileConfig::new(dir.path(), FileFormat::Sglang), &namespace).expect("opens");
        let (keys, pages) = expected(namespace.geometry.bytes_per_page(PAGE_SIZE));
        assert_eq!(put(&storage, &keys, &pages), vec![SetOutcome::Stored; PAGES]);
        script("check", dir.path(), &namespace);
        // nothing but the page files: no side files SGLang would trip over
        assert_eq!(std::fs::read_dir(dir.path()).expect("listing").count(), PAGES);
    }
}
