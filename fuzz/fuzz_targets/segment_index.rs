//! Fuzz target: a segment's index file damaged anywhere (bytes overwritten from any offset, the file cut or grown)
//! never makes the file tier panic, and every page it still returns is the page written under that key.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::hash::{PageKey, page_key};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, StorageBackend};
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};
use libfuzzer_sys::fuzz_target;

const PAGES: u32 = 6;

fn namespace() -> StorageNamespace {
    StorageNamespace::single_rank(
        "fuzz/segments",
        KvGeometry::mha(1, 1, 16, KvDtype::Bf16).expect("geometry"),
        HostLayout::PageFirst,
        2,
    )
}

fn page(index: u32) -> Vec<u8> {
    (0..namespace().geometry.bytes_per_page(2)).map(|byte| (byte as u32 * 31 + index) as u8).collect()
}

fn key(index: u32) -> PageKey {
    page_key(None, &[index])
}

/// A directory with pages written in two batches and a removal, and its index file's bytes.
fn written() -> &'static (tempfile::TempDir, PathBuf, Vec<u8>) {
    static WRITTEN: OnceLock<(tempfile::TempDir, PathBuf, Vec<u8>)> = OnceLock::new();
    WRITTEN.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temporary directory");
        let storage = FileStorage::open(FileConfig::new(dir.path(), FileFormat::Native), &namespace()).expect("opens");
        for batch in [0..3, 3..PAGES] {
            let keys: Vec<PageKey> = batch.clone().map(key).collect();
            let pages: Vec<Vec<u8>> = batch.map(page).collect();
            let segments: Vec<Vec<&[u8]>> = pages.iter().map(|page| vec![&page[..]]).collect();
            storage.batch_set(&keys, &segments).expect("writes");
        }
        storage.remove(&[key(1)]).expect("removes");
        drop(storage);
        let mut index = None;
        for entry in walk(dir.path()) {
            if entry.extension().is_some_and(|extension| extension == "idx") {
                index = Some(entry);
            }
        }
        let index = index.expect("an index file");
        let bytes = std::fs::read(&index).expect("reads");
        (dir, index, bytes)
    })
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(walk(&path));
        } else {
            found.push(path);
        }
    }
    found
}

fuzz_target!(|data: &[u8]| {
    let (dir, index, original) = written();
    let Some((&[high, low], patch)) = data.split_first_chunk::<2>() else { return };
    // the patch overwrites the index file from an offset, growing it if it runs past the end
    let at = usize::from(u16::from_be_bytes([high, low])) % (original.len() + 1);
    // (an empty patch cuts the file there)
    let mut damaged = original[..at].to_vec();
    damaged.extend_from_slice(patch);
    if !patch.is_empty() && at + patch.len() < original.len() {
        damaged.extend_from_slice(&original[at + patch.len()..]);
    }
    std::fs::write(index, &damaged).expect("writes the index file");
    let storage = FileStorage::open(FileConfig::new(dir.path(), FileFormat::Native), &namespace()).expect("opens");
    let listed = storage.list().expect("lists");
    let mut keys: Vec<PageKey> = (0..PAGES).map(key).collect();
    keys.extend(listed.iter().map(|(key, _)| *key));
    let bytes = page(0).len();
    let mut buffers: Vec<Vec<u8>> = keys.iter().map(|_| vec![0; bytes]).collect();
    let mut segments: Vec<Vec<&mut [u8]>> = buffers.iter_mut().map(|page| vec![&mut page[..]]).collect();
    let outcomes = storage.batch_get(&keys, &mut segments).expect("reads");
    for ((key, outcome), buffer) in keys.iter().zip(&outcomes).zip(&buffers) {
        if *outcome == GetOutcome::Hit {
            let index = (0..PAGES).find(|index| self::key(*index) == *key).expect("a hit is a page that was written");
            assert!(*buffer == page(index), "page {index} read back with other bytes");
        }
    }
    drop(storage);
    std::fs::write(index, original).expect("restores the index file");
});
