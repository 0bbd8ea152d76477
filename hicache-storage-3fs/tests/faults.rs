//! Faults of the real parts around 3FS (a Redis killed, restarted empty, or not there; data files that disagree with
//! the config; metadata that names a page out of range; a page reused while read), through the USRBIO **mock**.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hicache_core::Error;
use hicache_core::storage::{FailureKind, GetOutcome, SetOutcome, StorageBackend};
use hicache_core::testing::conformance::{fetch, mha_namespace, put, random_keys, random_pages};
use hicache_storage_3fs::metadata::{Located, PageMetadata, RedisMetadata, Reservation, Space, SpaceCounts};
use hicache_storage_3fs::testing::{Mount, RedisServer};
use hicache_storage_3fs::{Hf3fsConfig, Hf3fsStorage};

const FILE_SIZE: u64 = 1 << 20;

fn page_bytes(backend: &Hf3fsStorage) -> usize {
    backend.space().page_bytes as usize
}

#[test]
fn redis_unreachable_at_start_is_a_one_line_error_naming_the_url() {
    let mount = Mount::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("redis://127.0.0.1:{port}");
    let started = Instant::now();
    let error = Hf3fsStorage::open(mount.config(FILE_SIZE, Some(&url)), &mha_namespace(0, 1)).err().expect("no Redis");
    let text = error.to_string();
    assert!(text.contains(&url) && !text.contains('\n'), "{text}");
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    let error = Hf3fsStorage::open(mount.config(FILE_SIZE, Some("redis://[bad")), &mha_namespace(0, 1)).err().unwrap();
    assert!(matches!(&error, Error::InvalidConfig { field, .. } if field == "metadata_server_url"), "{error}");
}

#[test]
fn redis_killed_mid_run_fails_pages_in_bounded_time_and_service_resumes_when_it_is_back() {
    let (mount, mut redis) = (Mount::new(), RedisServer::start());
    let namespace = mha_namespace(0, 1);
    let backend = Hf3fsStorage::open(mount.config(FILE_SIZE, Some(&redis.url())), &namespace).unwrap();
    let bytes = page_bytes(&backend);
    let (keys, pages) = (random_keys(4), random_pages(4, bytes));
    assert_eq!(put(&backend, &keys, &pages), vec![SetOutcome::Stored; 4]);
    redis.kill();
    let started = Instant::now();
    let outcomes = put(&backend, &random_keys(2), &random_pages(2, bytes));
    assert!(
        outcomes.iter().all(|outcome| matches!(outcome, SetOutcome::Failed(failure)
        if failure.message.contains(&redis.url()))),
        "{outcomes:?}"
    );
    let (outcomes, _) = fetch(&backend, &keys, bytes, 0);
    assert!(outcomes.iter().all(|outcome| matches!(outcome, GetOutcome::Failed(_))), "{outcomes:?}");
    let error = backend.batch_exists(&keys).expect_err("no Redis");
    assert!(error.to_string().contains(&redis.url()), "{error}");
    assert!(started.elapsed() < Duration::from_secs(10), "calls took {:?} without Redis", started.elapsed());
    // back, empty (no persistence): the pages are misses, never another key's bytes, and writes work again
    redis.restart();
    let (outcomes, buffers) = fetch(&backend, &keys, bytes, 0xee);
    assert_eq!(outcomes, vec![GetOutcome::Miss; 4]);
    assert!(buffers.iter().all(|buffer| buffer.iter().all(|&byte| byte == 0xee)));
    let (fresh, fresh_pages) = (random_keys(3), random_pages(3, bytes));
    assert_eq!(put(&backend, &fresh, &fresh_pages), vec![SetOutcome::Stored; 3]);
    let (outcomes, buffers) = fetch(&backend, &fresh, bytes, 0);
    assert_eq!((outcomes, buffers), (vec![GetOutcome::Hit; 3], fresh_pages));
}

#[test]
fn a_data_file_shorter_than_file_size_is_refused_naming_both() {
    let mount = Mount::new();
    let namespace = mha_namespace(0, 1);
    drop(Hf3fsStorage::open(mount.config(FILE_SIZE / 2, None), &namespace).unwrap());
    let error = Hf3fsStorage::open(mount.config(FILE_SIZE, None), &namespace).err().expect("a shorter file");
    let text = error.to_string();
    assert!(text.contains(&(FILE_SIZE / 2).to_string()) && text.contains(&FILE_SIZE.to_string()), "{text}");
    assert!(text.contains("hicache.0.bin"), "{text}");
    // a config too small for one page names the field
    let error = Hf3fsStorage::open(mount.config(100, None), &mha_namespace(1, 2)).err().unwrap();
    assert!(matches!(&error, Error::InvalidConfig { field, .. } if field == "file_size"), "{error}");
}

#[test]
fn another_geometry_on_a_recorded_file_is_refused_naming_both() {
    let (mount, redis) = (Mount::new(), RedisServer::start());
    let namespace = mha_namespace(0, 1);
    drop(Hf3fsStorage::open(mount.config(FILE_SIZE, Some(&redis.url())), &namespace).unwrap());
    let other = hicache_core::namespace::StorageNamespace { page_size: 8, ..namespace };
    let error = Hf3fsStorage::open(mount.config(FILE_SIZE, Some(&redis.url())), &other).err().expect("other pages");
    assert!(matches!(&error, Error::InvalidConfig { field, .. } if field == "file_size"), "{error}");
    assert!(error.to_string().contains("pages of 512 bytes"), "{error}");
}

#[test]
fn a_page_index_out_of_range_fails_the_page_naming_it_and_the_page_count() {
    let (mount, redis) = (Mount::new(), RedisServer::start());
    let backend = Hf3fsStorage::open(mount.config(FILE_SIZE, Some(&redis.url())), &mha_namespace(0, 1)).unwrap();
    let bytes = page_bytes(&backend);
    let keys = random_keys(2);
    assert_eq!(put(&backend, &keys, &random_pages(2, bytes)), vec![SetOutcome::Stored; 2]);
    let pages = backend.layout().num_pages;
    let id = &backend.space().id;
    redis::cmd("HSET")
        .arg(format!("hicache:3fs:{id}:keys"))
        .arg(backend.metadata_key(&keys[1]))
        .arg(format!("{}:1", pages + 5))
        .query::<()>(&mut redis.connection())
        .unwrap();
    let (outcomes, _) = fetch(&backend, &keys, bytes, 0);
    assert_eq!(outcomes[0], GetOutcome::Hit);
    match &outcomes[1] {
        GetOutcome::Failed(failure) => {
            assert!(failure.message.contains(&format!("page {}", pages + 5)), "{failure}");
            assert!(failure.message.contains(&format!("holds {pages} pages")), "{failure}");
        }
        other => panic!("{other:?}"),
    }
}

/// Metadata that, on the first `locate`, lets another writer take over the located pages before answering: the
/// reader then reads pages rewritten for other keys.
struct ReuseBeforeAnswering {
    inner: Arc<dyn PageMetadata>,
    intruder: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl PageMetadata for ReuseBeforeAnswering {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn reserve(&self, space: &Space, keys: &[String]) -> Result<Vec<Reservation>, Error> {
        self.inner.reserve(space, keys)
    }
    fn confirm(&self, space: &Space, written: &[(String, Located)], released: &[Located]) -> Result<(), Error> {
        self.inner.confirm(space, written, released)
    }
    fn locate(&self, space: &Space, keys: &[String]) -> Result<Vec<Option<Located>>, Error> {
        let located = self.inner.locate(space, keys)?;
        if let Some(intrude) = self.intruder.lock().unwrap().take() {
            intrude();
        }
        Ok(located)
    }
    fn exists(&self, space: &Space, keys: &[String]) -> Result<Vec<bool>, Error> {
        self.inner.exists(space, keys)
    }
    fn delete(&self, space: &Space, keys: &[String]) -> Result<usize, Error> {
        self.inner.delete(space, keys)
    }
    fn clear(&self, space: &Space, prefix: &str) -> Result<u64, Error> {
        self.inner.clear(space, prefix)
    }
    fn list(&self, space: &Space, prefix: &str) -> Result<Vec<String>, Error> {
        self.inner.list(space, prefix)
    }
    fn counts(&self, space: &Space) -> Result<SpaceCounts, Error> {
        self.inner.counts(space)
    }
    fn round_trips(&self) -> u64 {
        self.inner.round_trips()
    }
}

#[test]
fn a_page_reused_between_locating_and_reading_is_never_another_keys_bytes() {
    let (mount, redis) = (Mount::new(), RedisServer::start());
    let namespace = mha_namespace(0, 1);
    let config = mount.config(FILE_SIZE, Some(&redis.url()));
    let shared: Arc<dyn PageMetadata> = Arc::new(RedisMetadata::connect(&redis.url()).unwrap());
    let writer = Hf3fsStorage::open_with_metadata(config.clone(), &namespace, shared.clone()).unwrap();
    let (bytes, capacity) = (page_bytes(&writer), writer.layout().num_pages as usize);
    let (keys, pages) = (random_keys(capacity), random_pages(capacity, bytes));
    assert_eq!(put(&writer, &keys, &pages), vec![SetOutcome::Stored; capacity]);
    // the intruder fills the whole file with other keys: every located page is rewritten
    let (others, other_pages) = (random_keys(capacity), random_pages(capacity, bytes));
    let intruder = Hf3fsStorage::open_with_metadata(config.clone(), &namespace, shared.clone()).unwrap();
    let metadata = Arc::new(ReuseBeforeAnswering {
        inner: shared,
        intruder: std::sync::Mutex::new(Some(Box::new(move || {
            assert_eq!(put(&intruder, &others, &other_pages), vec![SetOutcome::Stored; capacity]);
        }))),
    });
    let reader = Hf3fsStorage::open_with_metadata(config, &namespace, metadata).unwrap();
    let (outcomes, _) = fetch(&reader, &keys, bytes, 0);
    for outcome in &outcomes {
        assert!(
            matches!(outcome, GetOutcome::Failed(failure) if failure.kind == FailureKind::Corrupt
                && failure.message.contains("reused")),
            "{outcomes:?}"
        );
    }
}

#[test]
fn bytes_overwritten_beneath_the_tier_are_corrupt_never_a_hit() {
    let (mount, namespace) = (Mount::new(), mha_namespace(0, 1));
    let backend = Hf3fsStorage::open(mount.config(FILE_SIZE, None), &namespace).unwrap();
    let bytes = page_bytes(&backend);
    let keys = random_keys(3);
    let pages = random_pages(3, bytes);
    assert_eq!(put(&backend, &keys, &pages), vec![SetOutcome::Stored; 3]);
    let (outcomes, read) = fetch(&backend, &keys, bytes, 0);
    assert_eq!((outcomes, read), (vec![GetOutcome::Hit; 3], pages.clone()));
    // another program writes one byte into the middle of the second page's bytes (its footer untouched): find the
    // page by its bytes in the data file
    let mut file = std::fs::read(backend.data_file()).unwrap();
    let at = file.windows(bytes).position(|window| window == pages[1].as_slice()).expect("the page in the file");
    file[at + bytes / 2] ^= 0x40;
    std::fs::write(backend.data_file(), &file).unwrap();
    let (outcomes, read) = fetch(&backend, &keys, bytes, 0);
    assert_eq!((&outcomes[0], &read[0]), (&GetOutcome::Hit, &pages[0]));
    assert_eq!((&outcomes[2], &read[2]), (&GetOutcome::Hit, &pages[2]));
    match &outcomes[1] {
        GetOutcome::Failed(failure) => {
            assert_eq!(failure.kind, FailureKind::Corrupt, "{failure}");
            assert!(failure.message.contains("checksum"), "{failure}");
        }
        other => panic!("a page changed beneath the tier came back as {other:?}"),
    }
    // with the check turned off, the footer's key and generation still hold, so the changed bytes are served
    drop(backend);
    let config = Hf3fsConfig { verify_checksum: false, ..mount.config(FILE_SIZE, None) };
    let unverified = Hf3fsStorage::open(config, &namespace).unwrap();
    let (outcomes, read) = fetch(&unverified, &keys, bytes, 0);
    assert_eq!(outcomes, vec![GetOutcome::Hit; 3]);
    assert_eq!((&read[0], &read[2]), (&pages[0], &pages[2]));
    assert_eq!(read[1][bytes / 2], pages[1][bytes / 2] ^ 0x40, "the changed byte, served unchecked");
}

/// A loopback listener that answers every connection with `reply` (then closes it), or, with `None`, accepts and
/// says nothing; its URL. The thread ends with the test process.
fn fake_server(reply: Option<&'static [u8]>) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for mut stream in listener.incoming().flatten() {
            match reply {
                Some(reply) => {
                    let mut buffer = [0u8; 1024];
                    let _ = stream.read(&mut buffer);
                    let _ = stream.write_all(reply);
                }
                None => held.push(stream),
            }
        }
    });
    url
}

#[test]
fn a_server_that_is_not_redis_is_a_one_line_error_saying_so() {
    let url = fake_server(Some(
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 11\r\n\r\nBad Request",
    ));
    let error = RedisMetadata::with_timeout(&url, Duration::from_secs(5)).err().expect("not Redis");
    let text = error.to_string();
    assert!(!text.contains('\n'), "one line: {text}");
    assert!(text.contains(&url) && text.contains("is it a Redis server?"), "{text}");
}

#[test]
fn a_metadata_call_ends_within_its_timeout_and_says_how_long_it_waited() {
    // a server that accepts and never answers: connecting and loading the scripts share one deadline
    let url = fake_server(None);
    let timeout = Duration::from_secs(1);
    let started = Instant::now();
    let error = RedisMetadata::with_timeout(&url, timeout).err().expect("no answer");
    let took = started.elapsed();
    let Error::Timeout { waited_ms, .. } = &error else { panic!("{error}") };
    assert!(*waited_ms >= 1000 && u128::from(*waited_ms) <= took.as_millis(), "said {waited_ms} ms, took {took:?}");
    // each of the several scripts waited the whole timeout before
    assert!(took < timeout * 2 + Duration::from_millis(500), "took {took:?} for a {timeout:?} timeout");
}
