//! The Redis metadata against the in-process one (the reference) under random operation sequences, each batch
//! operation one request to Redis (counted by Redis itself), and no page handed to two writers.

use std::collections::HashSet;

use hicache_core::storage::StorageBackend;
use hicache_core::testing::conformance::{fetch, mha_namespace, put, random_keys, random_pages};
use hicache_storage_3fs::Hf3fsStorage;
use hicache_storage_3fs::metadata::{LocalMetadata, Located, PageMetadata, RedisMetadata, Reservation, Space};
use hicache_storage_3fs::testing::{Mount, RedisServer};
use proptest::prelude::*;

/// Calls of one command Redis has served (`INFO commandstats`).
fn calls(redis: &RedisServer, command: &str) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(&mut redis.connection()).unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// Requests of the metadata's kinds: its scripts, and `HMGET` for `exists` (which no script calls: Redis counts the
/// commands scripts call too).
fn requests(redis: &RedisServer) -> u64 {
    calls(redis, "evalsha") + calls(redis, "hmget")
}

#[test]
fn each_batch_operation_is_one_request_to_redis() {
    let redis = RedisServer::start();
    let metadata = RedisMetadata::connect(&redis.url()).unwrap();
    let space = Space { id: "/mnt/3fs/round-trips.0.bin".into(), num_pages: 1000, page_bytes: 4096 };
    let keys: Vec<String> = (0..100).map(|key| format!("ns/{key:064x}")).collect();
    metadata.counts(&space).unwrap();
    let (before, trips) = (requests(&redis), metadata.round_trips());
    let reserved = metadata.reserve(&space, &keys).unwrap();
    let written: Vec<(String, Located)> = keys
        .iter()
        .zip(&reserved)
        .map(|(key, reservation)| match reservation {
            Reservation::Page(page) => (key.clone(), *page),
            other => panic!("{other:?}"),
        })
        .collect();
    metadata.confirm(&space, &written[..60], &written[60..].iter().map(|(_, page)| *page).collect::<Vec<_>>()).unwrap();
    assert_eq!(metadata.locate(&space, &keys).unwrap().iter().flatten().count(), 60);
    assert_eq!(metadata.exists(&space, &keys).unwrap().iter().filter(|&&found| found).count(), 60);
    assert_eq!(metadata.delete(&space, &keys[..10]).unwrap(), 10);
    assert_eq!(requests(&redis) - before, 5, "five batch operations of 100 keys");
    assert_eq!(metadata.round_trips() - trips, 5);

    // through the backend: a set is two requests (reserve, confirm), a get and an exists one each
    let mount = Mount::new();
    let backend = Hf3fsStorage::open(mount.config(1 << 20, Some(&redis.url())), &mha_namespace(0, 1)).unwrap();
    let bytes = backend.space().page_bytes as usize;
    let (keys, pages) = (random_keys(16), random_pages(16, bytes));
    let before = requests(&redis);
    put(&backend, &keys, &pages);
    assert_eq!(requests(&redis) - before, 2);
    let (_, read) = fetch(&backend, &keys, bytes, 0);
    assert_eq!(read, pages);
    assert_eq!(backend.batch_exists(&keys).unwrap(), 16);
    assert_eq!(requests(&redis) - before, 4);
}

#[derive(Clone, Debug)]
enum Op {
    Reserve(Vec<usize>),
    /// Confirms the pending reservations picked by the mask (bit i: the i-th pending one), releases the rest.
    Settle(u32),
    Locate(Vec<usize>),
    Exists(Vec<usize>),
    Delete(Vec<usize>),
}

fn op() -> impl Strategy<Value = Op> {
    let keys = || proptest::collection::vec(0usize..12, 1..6);
    prop_oneof![
        3 => keys().prop_map(Op::Reserve),
        2 => any::<u32>().prop_map(Op::Settle),
        2 => keys().prop_map(Op::Locate),
        1 => keys().prop_map(Op::Exists),
        1 => keys().prop_map(Op::Delete),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn redis_answers_as_the_in_process_reference_and_never_hands_a_page_to_two_writers(
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        thread_local! {
            static REDIS: (RedisServer, RedisMetadata) = {
                let server = RedisServer::start();
                let metadata = RedisMetadata::connect(&server.url()).unwrap();
                (server, metadata)
            };
        }
        REDIS.with(|(_, redis)| -> Result<(), TestCaseError> {
            let local = LocalMetadata::new();
            let space = Space { id: format!("/proptest/{:016x}.bin", rand::random::<u64>()), num_pages: 5, page_bytes: 64 };
            let name = |key: &usize| format!("ns/{key}");
            let mut pending: Vec<(String, Located)> = Vec::new();
            for op in ops {
                match op {
                    Op::Reserve(keys) => {
                        let keys: Vec<String> = keys.iter().map(name).collect();
                        let answer = local.reserve(&space, &keys).unwrap();
                        prop_assert_eq!(&redis.reserve(&space, &keys).unwrap(), &answer);
                        for (key, reservation) in keys.iter().zip(answer) {
                            if let Reservation::Page(page) = reservation {
                                pending.push((key.clone(), page));
                            }
                        }
                        let held: HashSet<u64> = pending.iter().map(|(_, page)| page.index).collect();
                        prop_assert_eq!(held.len(), pending.len(), "a page reserved twice: {:?}", pending);
                    }
                    Op::Settle(mask) => {
                        let (written, released): (Vec<_>, Vec<_>) =
                            pending.drain(..).enumerate().partition(|(index, _)| mask >> (index % 32) & 1 == 1);
                        let written: Vec<(String, Located)> = written.into_iter().map(|(_, item)| item).collect();
                        let released: Vec<Located> = released.into_iter().map(|(_, (_, page))| page).collect();
                        local.confirm(&space, &written, &released).unwrap();
                        redis.confirm(&space, &written, &released).unwrap();
                    }
                    Op::Locate(keys) => {
                        let keys: Vec<String> = keys.iter().map(name).collect();
                        prop_assert_eq!(redis.locate(&space, &keys).unwrap(), local.locate(&space, &keys).unwrap());
                    }
                    Op::Exists(keys) => {
                        let keys: Vec<String> = keys.iter().map(name).collect();
                        prop_assert_eq!(redis.exists(&space, &keys).unwrap(), local.exists(&space, &keys).unwrap());
                    }
                    Op::Delete(keys) => {
                        let keys: Vec<String> = keys.iter().map(name).collect();
                        prop_assert_eq!(redis.delete(&space, &keys).unwrap(), local.delete(&space, &keys).unwrap());
                    }
                }
                prop_assert_eq!(redis.counts(&space).unwrap(), local.counts(&space).unwrap());
                // every stored key has a page of its own, and no stored page is reserved
                let everyone: Vec<String> = (0..12).map(|key| name(&key)).collect();
                let stored: Vec<Located> = local.locate(&space, &everyone).unwrap().into_iter().flatten().collect();
                redis.locate(&space, &everyone).unwrap();
                let pages: HashSet<u64> = stored.iter().map(|page| page.index).collect();
                prop_assert_eq!(pages.len(), stored.len(), "two keys on one page");
                prop_assert!(pending.iter().all(|(_, page)| !pages.contains(&page.index)), "a stored page is reserved");
            }
            Ok(())
        })?;
    }
}
