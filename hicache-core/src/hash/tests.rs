//! The page hash against SGLang's algorithm written independently, golden vectors and properties.

use proptest::prelude::*;
use sha2::{Digest, Sha256};

use super::*;

/// The algorithm as SGLang writes it, through the streaming digest: an independent reference.
fn reference_key(prior: Option<&PageKey>, tokens: &[u32]) -> PageKey {
    let mut hasher = Sha256::new();
    if let Some(prior) = prior {
        hasher.update(prior.as_bytes());
    }
    for token in tokens {
        hasher.update(token.to_le_bytes());
    }
    PageKey(hasher.finalize().into())
}

#[test]
fn empty_page_without_prior_is_sha256_of_nothing() {
    assert_eq!(page_key(None, &[]).to_string(), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

#[test]
fn partial_pages_follow_the_chosen_policy() {
    let tokens: Vec<u32> = (0..10).collect();
    let error = page_keys(&tokens, 4, None, PartialPage::Reject).unwrap_err();
    assert_eq!(error.to_string(), "10 tokens are not a whole number of pages of 4 tokens (2 left over)");
    assert_eq!(page_keys(&tokens, 4, None, PartialPage::Drop).unwrap().len(), 2);
    let hashed = page_keys(&tokens, 4, None, PartialPage::Hash).unwrap();
    assert_eq!(hashed[2], reference_key(Some(&hashed[1]), &tokens[8..]));
    assert!(page_keys(&tokens, 0, None, PartialPage::Hash).is_err());
}

#[test]
fn many_chains_refuse_a_partial_page_before_hashing_anything() {
    let tokens: Vec<u32> = (0..8).collect();
    let chains = [Chain { tokens: &tokens, prior: None }, Chain { tokens: &tokens[..7], prior: None }];
    let error = PageHasher::new().page_keys_many(&chains, 4, PartialPage::Reject).unwrap_err();
    assert_eq!(error, Error::PartialPage { tokens: 7, page_size: 4 });
    let dropped = PageHasher::new().page_keys_many(&chains, 4, PartialPage::Drop).unwrap();
    assert_eq!(dropped[1], dropped[0][..1]);
}

/// The interleaved path is the one that runs on CI's machines; make its absence visible there, not silent.
#[test]
fn sha_extensions_are_used_where_ci_runs() {
    if std::env::var("CI").is_ok_and(|value| value == "true") && cfg!(target_arch = "x86_64") {
        assert!(ShaNi::detect().is_some(), "CI machines have the SHA extensions; the interleaved path went untested");
    }
}

#[test]
fn parsing_rejects_bad_keys_with_the_reason() {
    let short = "abc".parse::<PageKey>().unwrap_err().to_string();
    assert!(short.contains("expected 64 hex digits, found 3"), "{short}");
    let bad = format!("{}g", "0".repeat(63)).parse::<PageKey>().unwrap_err().to_string();
    assert!(bad.contains("'g' at position 63"), "{bad}");
    let upper = "E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855".parse::<PageKey>().unwrap();
    assert_eq!(upper, page_key(None, &[]));
}

proptest! {
    #[test]
    fn fast_path_matches_streaming_sha256(
        tokens in proptest::collection::vec(any::<u32>(), 0..300),
        prior in proptest::option::of(any::<[u8; 32]>()),
    ) {
        let prior = prior.map(PageKey);
        prop_assert_eq!(page_key(prior.as_ref(), &tokens), reference_key(prior.as_ref(), &tokens));
    }

    #[test]
    fn chain_links_each_page_to_the_previous_key(
        tokens in proptest::collection::vec(any::<u32>(), 0..200),
        page_size in 1usize..20,
    ) {
        let keys = page_keys(&tokens, page_size, None, PartialPage::Hash).unwrap();
        let mut last = None;
        for (page, key) in tokens.chunks(page_size).zip(&keys) {
            prop_assert_eq!(*key, reference_key(last.as_ref(), page));
            last = Some(*key);
        }
        prop_assert_eq!(keys.len(), tokens.len().div_ceil(page_size));
    }

    #[test]
    fn wide_pages_hash_a_marker_and_u64_ids_and_narrow_pages_as_before(
        tokens in proptest::collection::vec(prop_oneof![any::<u32>().prop_map(u64::from), any::<u64>()], 0..120),
        page_size in 1usize..12,
    ) {
        let keys = PageHasher::new().page_keys_wide(&tokens, page_size, None, PartialPage::Hash).unwrap();
        let mut last: Option<PageKey> = None;
        for (page, key) in tokens.chunks(page_size).zip(&keys) {
            let expected = match page.iter().map(|&token| u32::try_from(token)).collect::<Result<Vec<u32>, _>>() {
                Ok(narrow) => reference_key(last.as_ref(), &narrow),
                Err(_) => {
                    let mut hasher = Sha256::new();
                    if let Some(last) = &last {
                        hasher.update(last.as_bytes());
                    }
                    hasher.update([0xffu8]);
                    page.iter().for_each(|token| hasher.update(token.to_le_bytes()));
                    PageKey(hasher.finalize().into())
                }
            };
            prop_assert_eq!(*key, expected);
            last = Some(*key);
        }
        prop_assert_eq!(keys.len(), tokens.len().div_ceil(page_size));
    }

    #[test]
    fn many_chains_equal_each_chain_alone(
        chains in prop::collection::vec(
            (prop::collection::vec(any::<u32>(), 0..90), proptest::option::of(any::<[u8; 32]>())),
            0..11,
        ),
        page_size in 1usize..20,
    ) {
        let inputs: Vec<Chain<'_>> =
            chains.iter().map(|(tokens, prior)| Chain { tokens, prior: prior.map(PageKey) }).collect();
        let together = PageHasher::new().page_keys_many(&inputs, page_size, PartialPage::Hash).unwrap();
        prop_assert_eq!(together.len(), inputs.len());
        for (chain, keys) in inputs.iter().zip(&together) {
            let alone = page_keys(chain.tokens, page_size, chain.prior, PartialPage::Hash).unwrap();
            prop_assert_eq!(keys, &alone);
        }
    }

    #[test]
    fn portable_path_matches_streaming_sha256(
        chains in prop::collection::vec(prop::collection::vec(any::<u32>(), 0..40), 0..6),
        page_size in 1usize..12,
    ) {
        let mut portable = PageHasher { lanes: Default::default(), sha_ni: None };
        let inputs: Vec<Chain<'_>> = chains.iter().map(|tokens| Chain { tokens, prior: None }).collect();
        let together = portable.page_keys_many(&inputs, page_size, PartialPage::Hash).unwrap();
        for (tokens, keys) in chains.iter().zip(&together) {
            let mut last = None;
            for (page, key) in tokens.chunks(page_size).zip(keys) {
                prop_assert_eq!(*key, reference_key(last.as_ref(), page));
                last = Some(*key);
            }
        }
    }

    #[test]
    fn display_and_parse_round_trip(bytes in any::<[u8; 32]>()) {
        let key = PageKey(bytes);
        let text = key.to_string();
        prop_assert_eq!(text.len(), 64);
        prop_assert!(text.chars().all(|ch| matches!(ch, '0'..='9' | 'a'..='f')));
        prop_assert_eq!(text.parse::<PageKey>().unwrap(), key);
    }

    #[test]
    fn parsing_agrees_with_the_hex_crate(text in "[0-9a-fA-F]{64}|[0-9a-fA-Fg-z ]{64}|.{60,66}") {
        let mut expected = [0u8; 32];
        match (text.parse::<PageKey>(), hex::decode_to_slice(&text, &mut expected)) {
            (Ok(key), Ok(())) => prop_assert_eq!(key.0, expected),
            (Err(error), Err(_)) => prop_assert!(error.to_string().starts_with("invalid page key")),
            (ours, theirs) => prop_assert!(false, "{text:?}: ours {ours:?}, hex {theirs:?}"),
        }
    }
}
