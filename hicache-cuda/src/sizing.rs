//! Sizing the pinned host pool from a config (SGLang's `hicache_ratio` or `hicache_size`), refused with a clear error
//! when the machine lacks the memory rather than failing inside the driver or swapping.
//!
//! SGLang keeps 10 GiB of RAM free beside the host pool (docs/sglang.md#constants); so does this, by default.

use hicache_core::Error;
use hicache_core::config::HiCacheConfig;

/// RAM left free beside the host pool, as SGLang.
pub const HOST_RESERVE_BYTES: u64 = 10 << 30;

/// The host pool's size in tokens for a device pool of `device_tokens` tokens of `bytes_per_token`, from the config,
/// checked against `available_bytes` of RAM (see [`available_memory`]) less [`HOST_RESERVE_BYTES`].
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming `hicache_size` or `hicache_ratio`: the pool would not exceed the device pool, or
/// would not fit (the message gives both sizes in GB).
pub fn host_pool_tokens(
    config: &HiCacheConfig,
    device_tokens: usize,
    bytes_per_token: usize,
    available_bytes: u64,
) -> Result<usize, Error> {
    let tokens = config.host_pool_tokens(device_tokens, bytes_per_token)?;
    let needed = tokens as u64 * bytes_per_token as u64;
    let room = available_bytes.saturating_sub(HOST_RESERVE_BYTES);
    if needed > room {
        let field = if config.hicache_size > 0 { "hicache_size" } else { "hicache_ratio" };
        return Err(Error::InvalidConfig {
            field: field.into(),
            reason: format!(
                "the host pool needs {:.1} GB of pinned memory; this machine has {:.1} GB available, {:.1} GB after \
                 the {} GiB kept free",
                needed as f64 / 1e9,
                available_bytes as f64 / 1e9,
                room as f64 / 1e9,
                HOST_RESERVE_BYTES >> 30
            ),
        });
    }
    Ok(tokens)
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
///
/// # Errors
///
/// [`Error::Device`] when the file cannot be read or has no such line.
pub fn available_memory() -> Result<u64, Error> {
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(|error| Error::device_caused("read /proc/meminfo", error.to_string(), error))?;
    parse_mem_available(&text).ok_or_else(|| Error::device("read /proc/meminfo", "no MemAvailable line"))
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|line| line.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    #[test]
    fn a_pool_that_fits_gets_its_tokens_and_one_that_does_not_names_the_field() {
        // 128 KiB per token (Llama-3.1-8B), 100 000 device tokens, ratio 2: 200 000 host tokens = 26.2 GB
        let config = HiCacheConfig::default();
        let tokens = host_pool_tokens(&config, 100_000, 128 << 10, 64 * GB).unwrap();
        assert_eq!(tokens, 200_000);
        let error = host_pool_tokens(&config, 100_000, 128 << 10, 30 * GB).unwrap_err().to_string();
        assert!(error.contains("hicache_ratio") && error.contains("26.2 GB") && error.contains("30.0 GB"), "{error}");
        let sized = HiCacheConfig { hicache_size: 40, ..HiCacheConfig::default() };
        let error = host_pool_tokens(&sized, 100_000, 128 << 10, 45 * GB).unwrap_err().to_string();
        assert!(error.starts_with("config field `hicache_size`"), "{error}");
        assert!(host_pool_tokens(&sized, 100_000, 128 << 10, 60 * GB).is_ok());
    }

    #[test]
    fn meminfo_is_read_in_kib() {
        let text = "MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(20_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert!(available_memory().unwrap() > 0, "this machine's /proc/meminfo");
    }
}
