//! One module per subcommand.

pub(crate) mod bench;
#[cfg(feature = "3fs")]
mod bench_3fs;
pub(crate) mod bench_controller;
#[cfg(feature = "mooncake")]
mod bench_mooncake;
pub(crate) mod bench_storage;
mod bench_storage_controller;
pub(crate) mod bench_transfer;
#[cfg(feature = "cuda")]
pub(crate) mod bench_transfer_cuda;
pub(crate) mod config;
pub(crate) mod hash;
pub(crate) mod placement;
pub(crate) mod store;
mod store_target;
mod watch;
