//! Fuzz target: the page-key parser never panics, accepts exactly 64 hex digits, and prints them back in lowercase.
#![no_main]

use hicache_core::hash::PageKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let valid = text.len() == 64 && text.bytes().all(|byte| byte.is_ascii_hexdigit());
    match text.parse::<PageKey>() {
        Ok(key) => {
            assert!(valid, "accepted {text:?}");
            assert_eq!(key.to_string(), text.to_ascii_lowercase());
        }
        Err(error) => {
            assert!(!valid, "refused {text:?}: {error}");
            assert!(error.to_string().starts_with("invalid page key"));
        }
    }
});
