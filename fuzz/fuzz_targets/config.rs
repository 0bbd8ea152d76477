//! Fuzz target: the config reader never panics, names a field in every error, and what it accepts survives a round trip.
#![no_main]

use hicache_core::config::HiCacheConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match HiCacheConfig::from_json(text) {
        Ok(config) => {
            let written = serde_json::to_string(&config).expect("serialises");
            let again = HiCacheConfig::from_json(&written).unwrap_or_else(|error| panic!("{written}: {error}"));
            assert_eq!(again, config);
        }
        Err(error) => assert!(error.to_string().starts_with("config field `"), "{error}"),
    }
});
