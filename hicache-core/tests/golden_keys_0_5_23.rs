//! SGLang 0.5.23's newer key rules, byte for byte: golden vectors made by SGLang's own seed function and its C++ page
//! hasher (`tests/data/make_golden_0_5_23.py` says how).

use hicache_core::hash::{PageHasher, PageKey, PartialPage, namespace_seed, page_keys};
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    seeds: Vec<Seed>,
    cases: Vec<Case>,
    rejected_by_sglang: Vec<Rejected>,
}

#[derive(Deserialize)]
struct Seed {
    extra_key: Option<String>,
    cache_salt: Option<String>,
    seed: String,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    page_size: usize,
    extra_key: Option<String>,
    cache_salt: Option<String>,
    prior: Option<String>,
    tokens: Vec<u64>,
    keys: Vec<String>,
}

#[derive(Deserialize)]
struct Rejected {
    tokens: Vec<u64>,
}

fn golden() -> Golden {
    serde_json::from_str(include_str!("data/sglang_0_5_23_page_keys.json")).expect("golden file parses")
}

#[test]
fn namespace_seeds_match_sglang() {
    let golden = golden();
    assert!(golden.seeds.len() >= 9, "the golden file lost its seeds");
    for seed in &golden.seeds {
        let ours = namespace_seed(seed.extra_key.as_deref(), seed.cache_salt.as_deref()).expect("a seed");
        assert_eq!(ours.to_string(), seed.seed, "extra_key {:?}, cache_salt {:?}", seed.extra_key, seed.cache_salt);
    }
    assert_eq!(namespace_seed(None, None), None, "requests with neither keep their keys");
}

#[test]
fn namespaced_and_wide_keys_match_sglang() {
    let golden = golden();
    assert!(golden.cases.len() >= 9, "the golden file lost its cases");
    let mut hasher = PageHasher::new();
    for case in &golden.cases {
        let prior = match &case.prior {
            Some(prior) => Some(prior.parse::<PageKey>().expect("prior parses")),
            None => namespace_seed(case.extra_key.as_deref(), case.cache_salt.as_deref()),
        };
        let keys = hasher.page_keys_wide(&case.tokens, case.page_size, prior, PartialPage::Hash).expect("hashes");
        let shown: Vec<String> = keys.iter().map(PageKey::to_string).collect();
        assert_eq!(shown, case.keys, "case {:?}", case.name);
        // ids that fit in 32 bits give the same keys through the u32 path
        if let Ok(narrow) = case.tokens.iter().map(|&token| u32::try_from(token)).collect::<Result<Vec<u32>, _>>() {
            let keys = page_keys(&narrow, case.page_size, prior, PartialPage::Hash).expect("hashes");
            assert_eq!(keys.iter().map(PageKey::to_string).collect::<Vec<_>>(), case.keys, "case {:?}", case.name);
        }
    }
}

#[test]
fn ids_sglang_refuses_are_hashed_by_the_same_rule() {
    // SGLang's hasher takes ids up to 2^63 - 1; hicache takes every u64 and hashes ids past SGLang's range with the
    // same wide rule, so such keys are hicache's own (no SGLang process can ask for them)
    for rejected in golden().rejected_by_sglang {
        let keys = PageHasher::new().page_keys_wide(&rejected.tokens, 1, None, PartialPage::Reject).expect("hashes");
        assert_eq!(keys.len(), rejected.tokens.len());
    }
}
