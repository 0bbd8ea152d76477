//! The storage conformance suite on the NIXL backend with the real POSIX plugin, over one shared temporary
//! directory (backends of every namespace, as processes sharing it).

mod common;

use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::testing::conformance::Harness;
use hicache_storage_nixl::NixlStorage;

struct Posix {
    dir: tempfile::TempDir,
    /// Bounds small enough that the suite's batches overflow them: files and ranges are closed and deregistered
    /// while others stay in use.
    small_caches: bool,
}

impl Posix {
    fn new() -> Self {
        Self { dir: tempfile::tempdir().expect("temporary directory"), small_caches: false }
    }

    fn with_small_caches() -> Self {
        Self { small_caches: true, ..Self::new() }
    }
}

impl Harness for Posix {
    fn open(&self, namespace: &StorageNamespace) -> Box<dyn StorageBackend> {
        let mut config = common::config(self.dir.path());
        if self.small_caches {
            config.max_open_files = 3;
            config.max_registered_regions = 1;
        }
        Box::new(NixlStorage::open(config, namespace).expect("opens"))
    }
}

mod posix {
    use super::*;
    hicache_core::storage_conformance_tests!(Posix::new());
}

mod posix_with_small_caches {
    use super::*;
    hicache_core::storage_conformance_tests!(Posix::with_small_caches());
}
