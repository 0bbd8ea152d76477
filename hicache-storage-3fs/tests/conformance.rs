//! The storage conformance suite through the USRBIO **mock** (plain files), with page metadata in this process and
//! in a real Redis on loopback (started per test, stopped by its PID).

use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::testing::conformance::Harness;
use hicache_storage_3fs::Hf3fsStorage;
use hicache_storage_3fs::testing::{Mount, RedisServer};

struct Store {
    mount: Mount,
    redis: Option<RedisServer>,
}

impl Harness for Store {
    fn open(&self, namespace: &StorageNamespace) -> Box<dyn StorageBackend> {
        let url = self.redis.as_ref().map(RedisServer::url);
        let config = self.mount.config(1 << 20, url.as_deref());
        Box::new(Hf3fsStorage::open(config, namespace).expect("opens on the mock mount"))
    }
}

mod in_process {
    use super::*;
    hicache_core::storage_conformance_tests!(Store { mount: Mount::new(), redis: None });
}

mod redis {
    use super::*;
    hicache_core::storage_conformance_tests!(Store { mount: Mount::new(), redis: Some(RedisServer::start()) });
}
