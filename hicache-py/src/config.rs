//! The backend's settings, read from SGLang's extra config: hicache-core's reader (`hicache_core::extra_config`),
//! which the CLI's `config check` shares.

pub use hicache_core::extra_config::*;
