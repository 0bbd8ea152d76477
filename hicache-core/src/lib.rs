//! GPU-agnostic core of hicache, a hierarchical KV cache for LLM inference.
//!
//! The device pool (L1) and pinned host pool (L2) hold KV pages of running and recent requests; a storage tier (L3)
//! keeps them across requests and instances, found again by a chained hash of the token prefix. This crate holds what
//! every part shares and runs without a GPU: page keys ([`hash`]), key namespaces ([`namespace`]), KV geometry
//! ([`geometry`]) and host layouts ([`layout`]), the host page allocator ([`host_pool`]) and the host pool's memory
//! with its page leases ([`host_memory`]), the device slots an engine lends ([`device_slots`]), TP collectives
//! ([`collective`]), device↔host transfers and the CPU transfer engine ([`transfer`]), the cache controller with its
//! operations ([`controller`]) and the tiered prefix tree that drives it ([`tree`]), rate limiting ([`rate_limit`]),
//! the storage trait with an in-memory and a fault-injection backend ([`storage`]), the configuration ([`config`]) and
//! the token-list parser ([`tokens`]).
//!
//! An engine starts from the crate root: [`HiCacheBuilder`] makes a [`HiRadixTree`] from one [`HiCacheConfig`] and
//! its [`TransferEngine`], lending its [`DeviceSlotAllocator`] to the tree's calls; the modules hold the rest.
//!
//! **Invariant:** this crate never links CUDA or any FFI library and does I/O only through the storage trait. It maps
//! the host pool's memory through the operating system (`memmap2`), as any allocator does. `unsafe` is denied except in
//! `hash/sha_ni.rs` (one call into a `#[target_feature]` function after the CPU check), the loom model of
//! `controller/progress.rs` (loom's cells) and `host_memory.rs` (the pool's bytes lent to threads page by page). The
//! `testing` feature, for tests only, adds the `testing` module: the conformance suite, the controller rig and
//! `testing/service.rs`, which asks the kernel (libc's `prctl`) to stop a test's service when the test dies.
#![deny(unsafe_code)]

mod builder;
pub mod collective;
pub mod config;
pub mod controller;
pub mod cost;
pub mod device_slots;
pub mod error;
pub mod extra_config;
pub mod geometry;
pub mod hash;
pub mod host_memory;
pub mod host_pool;
pub mod layout;
pub mod namespace;
pub mod rate_limit;
pub mod storage;
mod sync;
#[cfg(feature = "testing")]
pub mod testing;
pub mod threads;
pub mod tokens;
pub mod transfer;
pub mod tree;
pub mod unified_keys;

pub use builder::HiCacheBuilder;
pub use collective::{Collective, SingleRank};
pub use config::HiCacheConfig;
pub use device_slots::{DeviceSlot, DeviceSlotAllocator, PagedSlots};
pub use error::{Cause, Error, ErrorKind};
pub use storage::{GetOutcome, SetOutcome, StorageBackend};
pub use transfer::{CpuEngine, TransferEngine, TransferEvent};
pub use tree::{HiRadixTree, TreeSettings};
