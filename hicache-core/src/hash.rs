//! Page keys: SGLang's chained SHA-256 over token ids, bit for bit.
//!
//! `H_i = SHA-256(raw 32 bytes of H_{i-1}, if any || each token id of page i as u32 little-endian)`, shown as 64
//! lowercase hex digits (SGLang's `get_hash_str`, spec §7.1). A key therefore names the whole prefix up to and
//! including its page. Nothing else goes into the hash; backends add their namespace to the key string
//! ([`crate::namespace`]).
//!
//! The hasher pads and compresses blocks itself through `sha2`'s block function, so a page costs one call into the
//! SHA instructions and no per-token work beyond writing the little-endian bytes.

use std::fmt;
use std::str::FromStr;

use sha2::block_api::compress256;

use crate::error::Error;

/// Length of a page key in bytes (a SHA-256 digest).
pub const KEY_BYTES: usize = 32;

/// One page key: the raw SHA-256 digest of a page chained to its prefix.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey([u8; KEY_BYTES]);

impl PageKey {
    /// Wraps a raw digest.
    pub const fn from_bytes(bytes: [u8; KEY_BYTES]) -> Self {
        Self(bytes)
    }

    /// The raw digest, as chained into the next page's hash.
    pub const fn as_bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    /// The 64 lowercase hex digits SGLang uses as the key (`hexdigest()`).
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = [0u8; 2 * KEY_BYTES];
        hex::encode_to_slice(self.0, &mut buf).map_err(|_| fmt::Error)?;
        // hex digits are ASCII
        f.write_str(std::str::from_utf8(&buf).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageKey({self})")
    }
}

impl FromStr for PageKey {
    type Err = Error;

    /// Parses exactly 64 hex digits (either case, as Python's `bytes.fromhex`; shown back in lowercase).
    fn from_str(text: &str) -> Result<Self, Error> {
        let invalid = |reason: String| Error::InvalidKey { text: truncate_for_message(text), reason };
        if text.len() != 2 * KEY_BYTES {
            return Err(invalid(format!(
                "expected {} hex digits, found {} characters",
                2 * KEY_BYTES,
                text.chars().count()
            )));
        }
        if let Some((at, ch)) = text.char_indices().find(|(_, ch)| !ch.is_ascii_hexdigit()) {
            return Err(invalid(format!("character {ch:?} at position {at} is not a hex digit")));
        }
        let mut bytes = [0u8; KEY_BYTES];
        hex::decode_to_slice(text, &mut bytes).map_err(|error| invalid(error.to_string()))?;
        Ok(Self(bytes))
    }
}

fn truncate_for_message(text: &str) -> String {
    const SHOWN: usize = 80;
    if text.chars().count() <= SHOWN {
        text.to_owned()
    } else {
        format!("{}…", text.chars().take(SHOWN).collect::<String>())
    }
}

/// What to do with a trailing page shorter than the page size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PartialPage {
    /// Refuse the sequence with [`Error::PartialPage`] (the default: a short page is never stored by SGLang's cache).
    #[default]
    Reject,
    /// Leave the tail unhashed, as SGLang's prefetch does (`len - len % page_size`).
    Drop,
    /// Hash the tail as a short page, as `get_hash_str` does when given a short slice.
    Hash,
}

const H0: [u32; 8] = [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];

/// Hashes pages one after another, chaining each key into the next; reuses its block buffer across pages.
#[derive(Debug, Default)]
pub struct PageHasher {
    blocks: Vec<[u8; 64]>,
}

impl PageHasher {
    /// A hasher with an empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// The key of one page of `tokens` chained to `prior` (SGLang's `get_hash_str(tokens, prior_hash)`).
    pub fn page_key(&mut self, prior: Option<&PageKey>, tokens: &[u32]) -> PageKey {
        let prior_len = if prior.is_some() { KEY_BYTES } else { 0 };
        let message_len = prior_len + 4 * tokens.len();
        // message, then 0x80, then zeros, then the 64-bit big-endian bit length, to a multiple of 64 bytes; up to
        // five blocks (a page of 64 tokens after a prior key) are built on the stack, exactly sized
        let block_count = (message_len + 1 + 8).div_ceil(64);
        match block_count {
            1 => digest_padded(&mut [[0u8; 64]; 1], prior, tokens, message_len),
            2 => digest_padded(&mut [[0u8; 64]; 2], prior, tokens, message_len),
            3 => digest_padded(&mut [[0u8; 64]; 3], prior, tokens, message_len),
            4 => digest_padded(&mut [[0u8; 64]; 4], prior, tokens, message_len),
            5 => digest_padded(&mut [[0u8; 64]; 5], prior, tokens, message_len),
            _ => {
                self.blocks.clear();
                self.blocks.resize(block_count, [0u8; 64]);
                digest_padded(&mut self.blocks, prior, tokens, message_len)
            }
        }
    }

    /// The chained keys of `tokens` split into pages of `page_size`, starting from `prior`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when `page_size` is 0; [`Error::PartialPage`] when the length is not a multiple of
    /// the page size and `partial` is [`PartialPage::Reject`].
    pub fn page_keys(
        &mut self,
        tokens: &[u32],
        page_size: usize,
        prior: Option<PageKey>,
        partial: PartialPage,
    ) -> Result<Vec<PageKey>, Error> {
        if page_size == 0 {
            return Err(Error::InvalidArgument { field: "page_size", reason: "must be at least 1".into() });
        }
        let tail = tokens.len() % page_size;
        if tail != 0 && partial == PartialPage::Reject {
            return Err(Error::PartialPage { tokens: tokens.len(), page_size });
        }
        let hashed = if partial == PartialPage::Drop { &tokens[..tokens.len() - tail] } else { tokens };
        let mut keys = Vec::with_capacity(hashed.len().div_ceil(page_size));
        let mut last = prior;
        for page in hashed.chunks(page_size) {
            let key = self.page_key(last.as_ref(), page);
            keys.push(key);
            last = Some(key);
        }
        Ok(keys)
    }
}

/// Fills zeroed `blocks` with the padded message `prior || tokens` and compresses them.
fn digest_padded(blocks: &mut [[u8; 64]], prior: Option<&PageKey>, tokens: &[u32], message_len: usize) -> PageKey {
    let bytes: &mut [u8] = blocks.as_flattened_mut();
    let prior_len = message_len - 4 * tokens.len();
    if let Some(prior) = prior {
        bytes[..KEY_BYTES].copy_from_slice(&prior.0);
    }
    write_le_tokens(&mut bytes[prior_len..message_len], tokens);
    bytes[message_len] = 0x80;
    let total = bytes.len();
    bytes[total - 8..].copy_from_slice(&((message_len as u64) * 8).to_be_bytes());
    let mut state = H0;
    compress256(&mut state, blocks);
    let mut digest = [0u8; KEY_BYTES];
    for (out, word) in digest.chunks_exact_mut(4).zip(state) {
        out.copy_from_slice(&word.to_be_bytes());
    }
    PageKey(digest)
}

#[cfg(target_endian = "little")]
fn write_le_tokens(out: &mut [u8], tokens: &[u32]) {
    out.copy_from_slice(bytemuck::cast_slice(tokens));
}

#[cfg(not(target_endian = "little"))]
fn write_le_tokens(out: &mut [u8], tokens: &[u32]) {
    for (chunk, token) in out.chunks_exact_mut(4).zip(tokens) {
        chunk.copy_from_slice(&token.to_le_bytes());
    }
}

/// The key of one page chained to `prior`; see [`PageHasher::page_key`].
pub fn page_key(prior: Option<&PageKey>, tokens: &[u32]) -> PageKey {
    PageHasher::new().page_key(prior, tokens)
}

/// The chained keys of a token sequence; see [`PageHasher::page_keys`].
///
/// # Errors
///
/// As [`PageHasher::page_keys`].
pub fn page_keys(
    tokens: &[u32],
    page_size: usize,
    prior: Option<PageKey>,
    partial: PartialPage,
) -> Result<Vec<PageKey>, Error> {
    PageHasher::new().page_keys(tokens, page_size, prior, partial)
}

#[cfg(test)]
mod tests {
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
        fn display_and_parse_round_trip(bytes in any::<[u8; 32]>()) {
            let key = PageKey(bytes);
            let text = key.to_string();
            prop_assert_eq!(text.len(), 64);
            prop_assert!(text.chars().all(|ch| matches!(ch, '0'..='9' | 'a'..='f')));
            prop_assert_eq!(text.parse::<PageKey>().unwrap(), key);
        }
    }
}
