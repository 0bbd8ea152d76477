//! Two processes standing for two hosts (each its own metadata client, one Redis, one file set on the mock mount)
//! write and read the same keys at once, with pages reused all the time (the file holds fewer pages than the keys):
//! every page read back is its key's bytes or not a hit, never another key's.

use std::process::Command;
use std::time::{Duration, Instant};

use hicache_core::hash::{PageKey, page_key};
use hicache_core::storage::{GetOutcome, PageSegments, PageSegmentsMut, StorageBackend};
use hicache_core::testing::conformance::mha_namespace;
use hicache_storage_3fs::Hf3fsStorage;
use hicache_storage_3fs::testing::{Mount, RedisServer};

const ROLE: &str = "HICACHE_3FS_TWO_HOSTS";
const KEYS: u32 = 64;

/// A key's page: its bytes repeated, each repetition changed, so two keys' pages differ everywhere.
fn page_of(key: &PageKey, bytes: usize) -> Vec<u8> {
    (0..bytes).map(|at| key.as_bytes()[at % 32] ^ (at / 32) as u8).collect()
}

fn worker(url: &str, mount: &str, seed: u64) {
    let mut config = Mount::new().config(1 << 14, Some(url));
    config.file_path_prefix = std::path::Path::new(mount).join("hicache");
    let namespace = hicache_core::namespace::StorageNamespace { model: "two-hosts".into(), ..mha_namespace(0, 1) };
    let backend = Hf3fsStorage::open(config, &namespace).expect("opens");
    let bytes = backend.space().page_bytes as usize;
    assert!(backend.layout().num_pages < u64::from(KEYS) / 2, "pages must be reused");
    let mut state = seed | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut hits, mut others) = (0u64, 0u64);
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        let keys: Vec<PageKey> = (0..4).map(|_| page_key(None, &[(next() % u64::from(KEYS)) as u32])).collect();
        let pages: Vec<Vec<u8>> = keys.iter().map(|key| page_of(key, bytes)).collect();
        let sources: Vec<PageSegments<'_>> = pages.iter().map(|page| vec![page.as_slice()]).collect();
        backend.batch_set(&keys, &sources).expect("batch_set");
        let keys: Vec<PageKey> = (0..4).map(|_| page_key(None, &[(next() % u64::from(KEYS)) as u32])).collect();
        let mut buffers = vec![vec![0u8; bytes]; keys.len()];
        let mut targets: Vec<PageSegmentsMut<'_>> =
            buffers.iter_mut().map(|buffer| vec![buffer.as_mut_slice()]).collect();
        let outcomes = backend.batch_get(&keys, &mut targets).expect("batch_get");
        for ((key, outcome), buffer) in keys.iter().zip(outcomes).zip(&buffers) {
            if outcome == GetOutcome::Hit {
                assert!(*buffer == page_of(key, bytes), "a hit with bytes that are not its key's");
                hits += 1;
            } else {
                others += 1;
            }
        }
    }
    println!("worker {seed}: {hits} hits, {others} misses or refused");
    assert!(hits > 0, "no hit at all");
}

#[test]
fn two_hosts_sharing_redis_never_read_another_keys_bytes() {
    if let Ok(role) = std::env::var(ROLE) {
        let mut parts = role.splitn(3, ' ');
        let (seed, url, mount) = (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
        worker(url, mount, seed.parse().unwrap());
        return;
    }
    let (mount, redis) = (Mount::new(), RedisServer::start());
    let children: Vec<_> = (1..=2u64)
        .map(|seed| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "two_hosts_sharing_redis_never_read_another_keys_bytes", "--nocapture"])
                .env(ROLE, format!("{seed} {} {}", redis.url(), mount.path().display()))
                .spawn()
                .expect("starts a worker")
        })
        .collect();
    for child in children {
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "a worker failed");
    }
}
