//! Fuzz target: the token-list parser never panics, and what it accepts prints back to the same list.
#![no_main]

use hicache_core::tokens::parse_tokens;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match parse_tokens(text) {
        Ok(tokens) => {
            let printed = tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
            assert_eq!(parse_tokens(&printed).expect("printed list parses"), tokens);
            let json = serde_json::to_string(&tokens).expect("serialises");
            assert_eq!(parse_tokens(&json).expect("JSON list parses"), tokens);
        }
        Err(error) => assert!(!error.to_string().is_empty()),
    }
});
