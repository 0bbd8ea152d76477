//! The storage conformance suite on the file backend, in both layouts, each over one shared temporary directory.

use std::path::PathBuf;

use hicache_core::namespace::StorageNamespace;
use hicache_core::storage::StorageBackend;
use hicache_core::testing::conformance::Harness;
use hicache_storage_file::{FileConfig, FileFormat, FileStorage};

/// Backends of every namespace over one directory, as processes sharing it (in the default settings, batches of small
/// pages are written behind).
struct Files {
    dir: tempfile::TempDir,
    format: FileFormat,
    capacity_bytes: Option<u64>,
    /// `None`: the default.
    write_behind_bytes: Option<u64>,
    write_split_bytes: u64,
}

impl Files {
    fn new(format: FileFormat) -> Self {
        Self {
            dir: tempfile::tempdir().expect("temporary directory"),
            format,
            capacity_bytes: None,
            write_behind_bytes: None,
            write_split_bytes: 0,
        }
    }

    fn with_capacity(format: FileFormat, capacity_bytes: u64) -> Self {
        Self { capacity_bytes: Some(capacity_bytes), ..Self::new(format) }
    }

    fn writing_behind(format: FileFormat, write_behind_bytes: u64) -> Self {
        Self { write_behind_bytes: Some(write_behind_bytes), ..Self::new(format) }
    }

    fn splitting_writes(format: FileFormat, write_split_bytes: u64) -> Self {
        Self { write_split_bytes, ..Self::new(format) }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

impl Harness for Files {
    fn open(&self, namespace: &StorageNamespace) -> Box<dyn StorageBackend> {
        let defaults = FileConfig::new(self.path(), self.format);
        let config = FileConfig {
            capacity_bytes: self.capacity_bytes,
            write_behind_bytes: self.write_behind_bytes.unwrap_or(defaults.write_behind_bytes),
            write_split_bytes: self.write_split_bytes,
            ..defaults
        };
        Box::new(FileStorage::open(config, namespace).expect("opens"))
    }
}

mod native {
    use super::*;
    hicache_core::storage_conformance_tests!(Files::new(FileFormat::Native));
}

mod sglang_layout {
    use super::*;
    hicache_core::storage_conformance_tests!(Files::new(FileFormat::Sglang));
}

/// A capacity far above what the suite writes: the account is kept and checked, nothing is evicted.
mod native_with_capacity {
    use super::*;
    hicache_core::storage_conformance_tests!(Files::with_capacity(FileFormat::Native, 1 << 30));
}

mod sglang_layout_with_capacity {
    use super::*;
    hicache_core::storage_conformance_tests!(Files::with_capacity(FileFormat::Sglang, 1 << 30));
}

/// Every segment page written before `batch_set` returns.
mod native_in_place {
    use super::*;
    hicache_core::storage_conformance_tests!(Files::writing_behind(FileFormat::Native, 0));
}

/// Segment pages written behind with a budget of a few pages (so batches also wait for room, and those over half of
/// it are written in place between them): every promise holds for the process that wrote them.
mod native_writing_behind {
    use super::*;
    hicache_core::storage_conformance_tests!(Files::writing_behind(FileFormat::Native, 64 << 10));
}

/// Every segment page written by a write of its own, the writes of a batch submitted together.
mod native_splitting_writes {
    use super::*;
    hicache_core::storage_conformance_tests!(Files::splitting_writes(FileFormat::Native, 1));
}
