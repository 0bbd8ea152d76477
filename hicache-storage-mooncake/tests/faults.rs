//! Faults of the real thing: a master that does not answer at open, one stopped (SIGSTOP) before open, a master killed
//! mid-run and restarted, objects evicted between `batch_exists` and `batch_get_into`, objects damaged in the store.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use hicache_core::Error;
use hicache_core::geometry::{KvDtype, KvGeometry};
use hicache_core::layout::HostLayout;
use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, put, random_keys, random_pages};
use hicache_storage_mooncake::testing::{self, Cluster, Master, store_library};
use hicache_storage_mooncake::{MooncakeConfig, MooncakeStorage};

/// Every call against a master that went away returns within this (Mooncake's client gives up on its own).
const CALL_DEADLINE: Duration = Duration::from_secs(30);

fn namespace(page_size: usize) -> StorageNamespace {
    StorageNamespace::single_rank(
        format!("faults-{:08x}", rand::random::<u32>()),
        KvGeometry::mha(2, 2, 64, KvDtype::Bf16).unwrap(),
        HostLayout::PageFirst,
        page_size,
    )
}

#[test]
fn a_master_that_does_not_answer_is_a_one_line_error() {
    // a loopback port nobody listens on
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = MooncakeConfig {
        library: Some(store_library()),
        local_hostname: "127.0.0.1".into(),
        global_segment_size: 0,
        ..MooncakeConfig::new(format!("127.0.0.1:{port}"))
    };
    let started = Instant::now();
    let Err(error) = MooncakeStorage::open(config, &namespace(4)) else { panic!("opened without a master") };
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    let message = error.to_string();
    assert!(!message.contains('\n'), "one line: {message}");
    assert!(message.contains(&format!("127.0.0.1:{port}")) && message.contains("does not answer"), "{message}");
    // refused at once: it says so, not that it waited the timeout
    assert!(message.contains("refused") && !message.contains("within"), "{message}");
}

#[test]
fn a_missing_library_names_the_variable() {
    let config = MooncakeConfig {
        library: Some("/nonexistent/libmooncake_store.so".into()),
        ..MooncakeConfig::new("127.0.0.1:1")
    };
    let Err(error) = MooncakeStorage::open(config, &namespace(4)) else { panic!("opened without a library") };
    let message = error.to_string();
    assert!(message.contains("MOONCAKE_STORE_LIBRARY") && message.contains("/nonexistent"), "{message}");
}

/// Runs `call`, failing the test when it takes longer than [`CALL_DEADLINE`].
fn timed<T>(what: &str, call: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let result = call();
    assert!(started.elapsed() < CALL_DEADLINE, "{what} took {:?}", started.elapsed());
    result
}

#[test]
fn a_master_killed_mid_run_fails_calls_fast_and_the_backend_recovers_when_it_is_back() {
    let mut cluster = Cluster::start();
    let namespace = namespace(4);
    let bytes = namespace.geometry.bytes_per_page(namespace.page_size);
    let backend = MooncakeStorage::open(cluster.config(), &namespace).unwrap();
    let address = cluster.master().address();
    let (keys, pages) = (random_keys(8), random_pages(8, bytes));
    assert_eq!(put(&backend, &keys, &pages), vec![SetOutcome::Stored; 8]);

    let names_master = |error: &Error| error.to_string().contains(&address);
    cluster.master().kill();
    // the first call finds the master gone (within Mooncake's own deadline); every later one fails without trying
    let first = timed("batch_exists", || backend.batch_exists(&keys));
    assert!(first.as_ref().is_err_and(names_master) || first == Ok(0), "{first:?}");
    let at_once = backend.batch_exists(&keys).unwrap_err().to_string();
    assert!(at_once.contains("not tried") && at_once.contains(&address), "{at_once}");
    let (more_keys, more_pages) = (random_keys(4), random_pages(4, bytes));
    match timed("batch_set", || {
        backend.batch_set(&more_keys, &more_pages.iter().map(|page| vec![page.as_slice()]).collect::<Vec<_>>())
    }) {
        Ok(outcomes) => {
            for outcome in outcomes {
                let SetOutcome::Failed(failure) = outcome else { panic!("stored without a master: {outcome:?}") };
                assert!(failure.message.contains(&address), "{failure}");
            }
        }
        Err(error) => assert!(names_master(&error), "{error}"),
    }
    match timed("batch_exists", || backend.batch_exists(&keys)) {
        Ok(found) => assert_eq!(found, 0, "found pages without a master"),
        Err(error) => assert!(names_master(&error), "{error}"),
    }
    let mut buffers = vec![vec![0xA5u8; bytes]; keys.len()];
    let mut targets: Vec<Vec<&mut [u8]>> = buffers.iter_mut().map(|buffer| vec![buffer.as_mut_slice()]).collect();
    match timed("batch_get", || backend.batch_get(&keys, &mut targets)) {
        Ok(outcomes) => assert!(outcomes.iter().all(|outcome| *outcome != GetOutcome::Hit), "{outcomes:?}"),
        Err(error) => assert!(names_master(&error), "{error}"),
    }

    cluster.master().restart();
    // the clients mount their segments again on their next contact with the new master
    let deadline = Instant::now() + CALL_DEADLINE;
    let (new_keys, new_pages) = (random_keys(4), random_pages(4, bytes));
    let segments: Vec<Vec<&[u8]>> = new_pages.iter().map(|page| vec![page.as_slice()]).collect();
    loop {
        // calls fail at once (not tried) until a probe finds the master back
        let outcomes = timed("batch_set after the restart", || backend.batch_set(&new_keys, &segments));
        if outcomes.as_ref().is_ok_and(|outcomes| outcomes.iter().all(SetOutcome::is_stored)) {
            break;
        }
        assert!(Instant::now() < deadline, "the backend did not recover within {CALL_DEADLINE:?}: {outcomes:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (outcomes, buffers) = fetch(&backend, &new_keys, bytes, 0);
    assert_eq!(outcomes, vec![GetOutcome::Hit; 4]);
    assert_eq!(buffers, new_pages);
    // the old master's objects are gone with it: misses, never wrong bytes
    let (outcomes, buffers) = fetch(&backend, &keys, bytes, 0);
    for ((outcome, buffer), page) in outcomes.iter().zip(&buffers).zip(&pages) {
        match outcome {
            GetOutcome::Hit => assert_eq!(buffer, page),
            GetOutcome::Miss => assert!(buffer.iter().all(|&byte| byte == 0), "a miss wrote the buffer"),
            GetOutcome::Failed(failure) => panic!("{failure}"),
        }
    }
}

#[test]
fn a_master_stopped_before_open_fails_the_open_within_the_connect_timeout() {
    // a stopped master still accepts connections (the kernel does), but answers nothing: Mooncake's setup would wait
    // for minutes
    let master = Master::start();
    master.signal("STOP");
    let config = MooncakeConfig { connect_timeout: Duration::from_secs(2), ..testing::config(&master) };
    let started = Instant::now();
    let Err(error) = MooncakeStorage::open(config, &namespace(4)) else { panic!("opened a stopped master") };
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(2) + CALL_DEADLINE / 2, "the open took {waited:?}");
    let message = error.to_string();
    assert!(
        message.contains("did not set up a client within 2000 ms") && message.contains(&master.address()),
        "{message}"
    );
    // dropping the master kills it (SIGKILL ends a stopped process too)
}

#[test]
fn a_backend_whose_master_died_closes_within_the_connect_timeout() {
    let mut cluster = Cluster::start();
    let namespace = namespace(4);
    let bytes = namespace.geometry.bytes_per_page(namespace.page_size);
    // this client lends memory too, so closing it has a segment to unmount at a master that is gone
    let config = MooncakeConfig { global_segment_size: 32 << 20, ..cluster.config() };
    let connect_timeout = config.connect_timeout;
    let backend = MooncakeStorage::open(config, &namespace).unwrap();
    let (keys, pages) = (random_keys(4), random_pages(4, bytes));
    assert_eq!(put(&backend, &keys, &pages), vec![SetOutcome::Stored; 4]);
    cluster.drop_holder();
    cluster.master().kill();
    let _ = timed("batch_exists", || backend.batch_exists(&keys));
    let started = Instant::now();
    drop(backend);
    // Mooncake's own unmount retries against the gone master for about 40 s
    assert!(started.elapsed() < connect_timeout + CALL_DEADLINE / 3, "closing took {:?}", started.elapsed());
}

#[test]
fn objects_evicted_after_exists_are_misses_never_wrong_bytes() {
    // a 16 MiB cluster and 64 KiB pages: 600 pages overflow it many times, so the master evicts
    let cluster = Cluster::start_with_segment(16 << 20);
    let namespace = namespace(64);
    let bytes = namespace.geometry.bytes_per_page(namespace.page_size);
    assert_eq!(bytes, 64 << 10);
    let backend = MooncakeStorage::open(cluster.config(), &namespace).unwrap();
    let (first_keys, first_pages) = (random_keys(32), random_pages(32, bytes));
    assert_eq!(put(&backend, &first_keys, &first_pages), vec![SetOutcome::Stored; 32]);
    assert_eq!(backend.batch_exists(&first_keys).unwrap(), 32);
    // the master evicts in the background once the cluster is nearly full: keep writing (at least 18 rounds, 36 MiB,
    // over twice the cluster) until it has evicted one of the first pages, within a deadline
    let (mut refused, mut rounds) = (0, 0);
    let deadline = Instant::now() + CALL_DEADLINE;
    while rounds < 18 || backend.batch_exists(&first_keys).unwrap() == 32 {
        assert!(Instant::now() < deadline, "no first page evicted after {rounds} rounds (refused puts: {refused})");
        let (keys, pages) = (random_keys(32), random_pages(32, bytes));
        let outcomes = put(&backend, &keys, &pages);
        refused += outcomes.iter().filter(|outcome| !outcome.is_stored()).count();
        rounds += 1;
        // a poll interval, not a guess: the loop ends on the eviction it waits for
        std::thread::sleep(Duration::from_millis(100));
    }
    let (outcomes, buffers) = fetch(&backend, &first_keys, bytes, 0x5A);
    let mut misses = 0;
    for ((outcome, buffer), page) in outcomes.iter().zip(&buffers).zip(&first_pages) {
        match outcome {
            GetOutcome::Hit => assert_eq!(buffer, page, "a hit with wrong bytes"),
            GetOutcome::Miss => {
                misses += 1;
                assert!(buffer.iter().all(|&byte| byte == 0x5A), "a miss wrote the buffer");
            }
            GetOutcome::Failed(failure) => {
                // one part evicted and the other not: never a hit
                assert!(failure.message.contains("incomplete"), "{failure}");
                misses += 1;
            }
        }
    }
    assert!(misses > 0, "nothing was evicted (refused puts: {refused}); the test did not test eviction");
}

#[test]
fn objects_of_another_size_are_corrupt_or_a_size_mismatch_never_a_hit() {
    use hicache_storage_mooncake::{KeyScheme, SglangRelease};
    // SGLang 0.5.2's keys do not name the geometry: a deployment with other page sizes finds these objects
    let cluster = Cluster::start();
    let scheme = KeyScheme::Sglang { release: SglangRelease::V0_5_2, tag: None };
    let config = || MooncakeConfig { scheme: scheme.clone(), ..cluster.config() };
    let (small, large) = (namespace(4), namespace(8));
    let small_bytes = small.geometry.bytes_per_page(small.page_size);
    let large_bytes = large.geometry.bytes_per_page(large.page_size);
    let writer = MooncakeStorage::open(config(), &small).unwrap();
    let (keys, pages) = (random_keys(2), random_pages(2, small_bytes));
    assert_eq!(put(&writer, &keys, &pages), vec![SetOutcome::Stored; 2]);
    // a larger part than stored: fewer bytes arrive (a short read)
    let reader = MooncakeStorage::open(config(), &large).unwrap();
    let (outcomes, _) = fetch(&reader, &keys, large_bytes, 0);
    for outcome in &outcomes {
        let GetOutcome::Failed(failure) = outcome else { panic!("{outcome:?}") };
        assert_eq!(failure.kind, hicache_core::storage::FailureKind::Corrupt, "{failure}");
        assert!(failure.message.contains("short read"), "{failure}");
    }
    // and the other way round: the stored object does not fit the part
    let (large_keys, large_pages) = (random_keys(2), random_pages(2, large_bytes));
    assert_eq!(put(&reader, &large_keys, &large_pages), vec![SetOutcome::Stored; 2]);
    let (outcomes, _) = fetch(&writer, &large_keys, small_bytes, 0);
    for outcome in &outcomes {
        let GetOutcome::Failed(failure) = outcome else { panic!("{outcome:?}") };
        assert_eq!(failure.kind, hicache_core::storage::FailureKind::SizeMismatch, "{failure}");
    }
    assert_eq!(reader.stats().get_failures, 2);
}

/// A page one of whose objects was replaced in the store by other bytes of its size (a faulty writer, store or
/// network), or whose checksum object is gone or belongs to other bytes, is never a hit: the page's checksum, bound
/// to its key and namespace, names the damage. Removed and written again, it reads whole.
#[test]
fn a_damaged_page_or_one_without_its_checksum_is_never_a_hit() {
    let cluster = Cluster::start();
    let namespace = namespace(4);
    let bytes = namespace.geometry.bytes_per_page(namespace.page_size);
    let backend = MooncakeStorage::open(cluster.config(), &namespace).unwrap();
    let (keys, pages) = (random_keys(6), random_pages(6, bytes));
    assert_eq!(put(&backend, &keys, &pages), vec![SetOutcome::Stored; 6]);
    let objects = |page: usize| backend.object_keys(&keys[page]);
    assert_eq!(objects(0).len(), 3, "K, V and the checksum: {:?}", objects(0));
    assert!(objects(0)[2].ends_with("_sum"));
    // page 1: its V replaced by other bytes of its size; page 3: its checksum gone; page 4: a checksum of other
    // bytes
    let other: Vec<u8> = random_pages(1, bytes / 2).remove(0);
    backend.replace_object(&objects(1)[1], Some(&other)).unwrap();
    backend.replace_object(&objects(3)[2], None).unwrap();
    let mut stranger = 0u64.to_le_bytes();
    stranger[0] = 1;
    backend.replace_object(&objects(4)[2], Some(&stranger)).unwrap();
    // the query stops where a page lacks its checksum
    assert_eq!(backend.batch_exists(&keys).unwrap(), 3);
    assert_eq!(backend.batch_contains(&keys).unwrap(), [true, true, true, false, true, true]);
    let (outcomes, buffers) = fetch(&backend, &keys, bytes, 0);
    for (page, (outcome, buffer)) in outcomes.iter().zip(&buffers).enumerate() {
        match page {
            1 | 3 | 4 => {
                let GetOutcome::Failed(failure) = outcome else { panic!("page {page}: {outcome:?}") };
                assert_eq!(failure.kind, hicache_core::storage::FailureKind::Corrupt, "{failure}");
                let why = if page == 3 { "incomplete" } else { "checksum" };
                assert!(failure.message.contains(why), "page {page}: {failure}");
            }
            _ => {
                assert_eq!(*outcome, GetOutcome::Hit, "page {page}");
                assert_eq!(*buffer, pages[page], "page {page}");
            }
        }
    }
    // a reader told not to verify trusts the bytes as they arrive: the damaged page passes, the one without its
    // checksum object still does not
    let trusting =
        MooncakeStorage::open(MooncakeConfig { verify_checksum: false, ..cluster.config() }, &namespace).unwrap();
    let (outcomes, buffers) = fetch(&trusting, &keys[1..4], bytes, 0);
    assert_eq!(outcomes[0], GetOutcome::Hit);
    assert_eq!(buffers[0][bytes / 2..], other[..], "page 1's replaced V, unchecked");
    assert!(matches!(&outcomes[2], GetOutcome::Failed(failure) if failure.message.contains("incomplete")));
    // a damaged page stays damaged until it is removed; written again, it reads whole
    assert_eq!(backend.remove(&keys[1..2]).unwrap(), 1);
    assert_eq!(put(&backend, &keys[1..2], &pages[1..2]), [SetOutcome::Stored]);
    let (outcomes, buffers) = fetch(&backend, &keys[1..2], bytes, 0);
    assert_eq!((outcomes[0].clone(), &buffers[0]), (GetOutcome::Hit, &pages[1]));
}
