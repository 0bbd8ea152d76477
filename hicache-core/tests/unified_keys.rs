//! The unified L3 key scheme against SGLang 0.5.23's own `plan_unified_kv` and `namespace_digest`: golden vectors
//! made by running its module (`tests/data/make_unified_keys.py`), byte for byte down to the MessagePack the digest
//! hashes, and every deployment it refuses refused here with the same kind of error.

use hicache_core::ErrorKind;
use hicache_core::unified_keys::{UnifiedRank, plan};
use serde_json::Value;

const GOLDEN: &str = include_str!("data/sglang_0_5_23_unified_keys.json");

fn golden() -> Value {
    serde_json::from_str(GOLDEN).expect("the golden file parses")
}

fn rank(args: &Value) -> UnifiedRank {
    serde_json::from_value(args.clone()).unwrap_or_else(|error| panic!("{args}: {error}"))
}

fn pairs(value: &Value) -> Vec<(u64, u64)> {
    serde_json::from_value(value.clone()).expect("pairs of integers")
}

#[test]
fn plans_digests_and_encodings_are_sglangs() {
    let golden = golden();
    let cases = golden["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 64);
    let mut kinds = std::collections::BTreeSet::new();
    for case in cases {
        let args = &case["args"];
        let planned = plan(&rank(args)).unwrap_or_else(|error| panic!("{args}: {error}"));
        assert_eq!(hex::encode(planned.namespace.encode()), case["encoded"], "{args}");
        assert_eq!(planned.namespace.digest(), case["digest"], "{args}");
        let suffixes: Vec<String> = serde_json::from_value(case["suffixes"].clone()).unwrap();
        assert_eq!(planned.suffixes, suffixes, "{args}");
        assert_eq!(planned.layer_ranges, pairs(&case["layer_ranges"]), "{args}");
        assert_eq!(planned.head_ranges, pairs(&case["head_ranges"]), "{args}");
        kinds.insert((
            args["rank_replicated"].as_bool(),
            args["layer_partition"].is_null(),
            planned.suffixes.len() > 1,
        ));
    }
    // the vectors cover replicated and sharded pools, with and without a layer grid, one chunk and several
    assert!(kinds.len() >= 6, "{kinds:?}");
}

#[test]
fn what_sglang_refuses_is_refused_with_the_same_kind_of_error() {
    let golden = golden();
    for refused in golden["refused"].as_array().expect("refused") {
        let args = &refused["args"];
        let outcome = plan(&rank(args));
        match refused["error"].as_str() {
            Some("ValueError") => {
                let error = outcome.expect_err(&args.to_string());
                assert_eq!(error.kind(), ErrorKind::InvalidInput, "{args}: {error}");
                assert!(error.to_string().contains("unified key scheme: "), "{error}");
            }
            Some("NotImplementedError") => {
                let error = outcome.expect_err(&args.to_string());
                assert_eq!(error.kind(), ErrorKind::Unsupported, "{args}: {error}");
            }
            other => panic!("{args}: SGLang said {other:?}"),
        }
    }
}

#[test]
fn a_page_key_names_the_chunk_not_the_writer() {
    // a TP2 rank's chunks are exactly the union of two TP4 ranks' when the fleet agrees on head_group
    let args = |tp_size: u64, tp_rank: u64| {
        serde_json::json!({"model_id": "m", "dtype": "bfloat16", "page_size": 64, "rank_replicated": false,
            "local_kv_heads": 8 / tp_size, "attn_tp_rank": tp_rank, "attn_tp_size": tp_size, "attn_cp_size": 1,
            "start_layer": 0, "end_layer": 32, "is_final_stage": true, "head_group": 2, "layer_partition": 8})
    };
    let keys = |tp_size: u64, tp_rank: u64| plan(&rank(&args(tp_size, tp_rank))).unwrap().page_keys("abc");
    let mut tp4: Vec<String> = keys(4, 0).into_iter().chain(keys(4, 1)).collect();
    let mut tp2 = keys(2, 0);
    tp4.sort();
    tp2.sort();
    assert_eq!(tp2, tp4);
    assert_eq!(tp2.len(), 4 * 2, "four layer chunks by two head groups");
    assert!(tp2.iter().all(|key| key.starts_with("abc_ukv1-")), "{tp2:?}");
}
