//! Fuzz target: the token-list parsers never panic, what they accept prints back to the same list, and the wide
//! parser agrees with the narrow one.
#![no_main]

use hicache_core::tokens::{parse_tokens, parse_wide_tokens};
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
    // the wide parser accepts everything the narrow one does, with the same values
    match parse_wide_tokens(text) {
        Ok(wide) => {
            if let Ok(narrow) = parse_tokens(text) {
                assert!(wide.iter().copied().eq(narrow.iter().map(|&token| u64::from(token))));
            }
            let printed = wide.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
            assert_eq!(parse_wide_tokens(&printed).expect("printed list parses"), wide);
        }
        Err(error) => assert!(parse_tokens(text).is_err(), "narrow accepted what wide refused: {error}"),
    }
});
