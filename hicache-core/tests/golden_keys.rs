//! Page keys equal SGLang 0.5.2's, byte for byte: golden vectors made by SGLang's own `get_hash_str`
//! (`tests/data/make_golden.py` says how).

use hicache_core::hash::{PageKey, PartialPage, page_keys};
use hicache_core::tokens::parse_tokens;
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    cases: Vec<Case>,
    rejected_by_sglang: Vec<Rejected>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    page_size: usize,
    prior: Option<String>,
    tokens: Vec<u32>,
    keys: Vec<String>,
}

#[derive(Deserialize)]
struct Rejected {
    tokens: Vec<i64>,
}

fn golden() -> Golden {
    serde_json::from_str(include_str!("data/sglang_0_5_2_page_keys.json")).expect("golden file parses")
}

#[test]
fn keys_match_sglang_get_hash_str() {
    let golden = golden();
    assert!(golden.cases.len() >= 20, "the golden file lost its cases");
    for case in golden.cases {
        let prior = case.prior.as_deref().map(|text| text.parse::<PageKey>().expect("prior parses"));
        let keys = page_keys(&case.tokens, case.page_size, prior, PartialPage::Hash).expect("hashing succeeds");
        let shown: Vec<String> = keys.iter().map(PageKey::to_string).collect();
        assert_eq!(shown, case.keys, "case {:?}", case.name);
    }
}

#[test]
fn tokens_sglang_rejects_are_rejected_with_their_position() {
    for rejected in golden().rejected_by_sglang {
        let text = rejected.tokens.iter().map(i64::to_string).collect::<Vec<_>>().join(" ");
        let error = parse_tokens(&text).expect_err("out-of-range token").to_string();
        assert!(error.starts_with("token 2 "), "{error}");
    }
}
