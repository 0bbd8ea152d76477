//! The storage conformance suite against a real `mooncake_master` and Mooncake's C API library, for the native key
//! scheme and SGLang's (both releases), with MHA and MLA pages (the suite's MLA checks open MLA namespaces).
//!
//! Each test starts its own master on loopback ports and stops it by its PID at the end.

use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::testing::conformance::Harness;
use hicache_storage_mooncake::testing::Cluster;
use hicache_storage_mooncake::{KeyScheme, MooncakeStorage, SglangRelease};

struct Store {
    cluster: Cluster,
    scheme: KeyScheme,
}

impl Store {
    fn new(scheme: KeyScheme) -> Self {
        Self { cluster: Cluster::start(), scheme }
    }
}

impl Harness for Store {
    fn open(&self, namespace: &StorageNamespace) -> Box<dyn StorageBackend> {
        let config = hicache_storage_mooncake::MooncakeConfig { scheme: self.scheme.clone(), ..self.cluster.config() };
        Box::new(MooncakeStorage::open(config, namespace).expect("opens against the test master"))
    }
}

mod native {
    use super::*;
    hicache_core::storage_conformance_tests!(Store::new(KeyScheme::Native));
}

/// SGLang 0.5.2's keys have no model name, so two models sharing a cluster read each other's pages: the suite's
/// isolation check cannot hold for this scheme and is replaced by one that shows the sharing.
mod sglang_0_5_2 {
    use super::*;

    fn store() -> Store {
        Store::new(KeyScheme::Sglang { release: SglangRelease::V0_5_2, tag: None })
    }

    hicache_core::storage_conformance_tests_without_isolation!(store());

    #[test]
    fn models_share_pages_under_0_5_2_keys() {
        use hicache_core::storage::{GetOutcome, SetOutcome};
        use hicache_core::testing::conformance::{fetch, mha_namespace, put, random_keys, random_pages};
        let store = store();
        let one = mha_namespace(0, 1);
        let other = StorageNamespace { model: format!("{}-other", one.model), ..one.clone() };
        let bytes = one.geometry.bytes_per_page(one.page_size);
        let (keys, pages) = (random_keys(2), random_pages(2, bytes));
        assert_eq!(put(store.open(&one).as_ref(), &keys, &pages), vec![SetOutcome::Stored; 2]);
        let (outcomes, buffers) = fetch(store.open(&other).as_ref(), &keys, bytes, 0);
        assert_eq!(outcomes, vec![GetOutcome::Hit; 2]);
        assert_eq!(buffers, pages, "the other model reads the first one's bytes: the 0.5.2 scheme's known defect");
        // the native scheme keeps them apart
        let native = Store::new(KeyScheme::Native);
        put(native.open(&one).as_ref(), &keys, &pages);
        assert_eq!(native.open(&other).batch_exists(&keys).unwrap(), 0);
    }
}

mod sglang_0_5_23 {
    use super::*;
    hicache_core::storage_conformance_tests!(Store::new(KeyScheme::Sglang {
        release: SglangRelease::V0_5_23,
        tag: Some("tenant".into())
    }));
}
