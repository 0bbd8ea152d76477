//! The storage conformance suite on the in-memory backend, bare and wrapped in a fault injector with no faults.

use std::sync::Arc;

use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::{FaultPlan, FaultyStorage, MemoryStorage, MemoryStore, StorageBackend};

/// Backends over one shared store, as processes sharing a cluster.
struct Shared(Arc<MemoryStore>);

impl hicache_core::testing::conformance::Harness for Shared {
    fn open(&self, namespace: &StorageNamespace) -> Box<dyn StorageBackend> {
        Box::new(MemoryStorage::shared(self.0.clone(), namespace))
    }
}

/// The same, each backend wrapped in a fault injector whose plan is empty: the wrapper must be transparent.
struct Wrapped(Arc<MemoryStore>);

impl hicache_core::testing::conformance::Harness for Wrapped {
    fn open(&self, namespace: &StorageNamespace) -> Box<dyn StorageBackend> {
        Box::new(FaultyStorage::new(MemoryStorage::shared(self.0.clone(), namespace), FaultPlan::default()))
    }
}

mod memory {
    use super::*;
    hicache_core::storage_conformance_tests!(Shared(MemoryStore::new()));
}

mod memory_behind_empty_fault_plan {
    use super::*;
    hicache_core::storage_conformance_tests!(Wrapped(MemoryStore::new()));
}
