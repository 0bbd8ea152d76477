//! The unified key scheme on the file tier, in both file layouts: a TP2 deployment's chunks read byte for byte by
//! TP1, TP4 and two pipeline stages, and a page missing a chunk never read
//! ([`hicache_core::testing::unified::topologies_share_chunks`]).

use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::testing::unified::topologies_share_chunks;
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

#[test]
fn every_topology_reads_the_chunks_a_tp2_deployment_wrote() {
    for format in [FileFormat::Native, FileFormat::Sglang] {
        let dir = tempfile::tempdir().unwrap();
        let shared = topologies_share_chunks(&|namespace: &StorageNamespace| {
            Ok(Box::new(FileStorage::open(FileConfig::new(dir.path(), format), namespace)?) as Box<dyn StorageBackend>)
        });
        assert_eq!(shared.read, vec![shared.written; 3], "{format:?}: each topology read every chunk");
    }
}
