//! Page keys: SGLang's chained SHA-256 over token ids, bit for bit.
//!
//! `H_i = SHA-256(raw 32 bytes of H_{i-1}, if any || each token id of page i as u32 little-endian)`, shown as 64
//! lowercase hex digits (SGLang's `get_hash_str`, docs/sglang.md#keys). A key therefore names the whole prefix up to
//! and including its page. Nothing else goes into the hash; backends add their namespace to the key string
//! ([`crate::namespace`]).
//!
//! SGLang 0.5.20 and later add two rules, both of which leave the keys of ordinary requests unchanged:
//! * a request with an `extra_key` (e.g. a LoRA adapter's name) or a `cache_salt` starts its chain from a seed
//!   ([`namespace_seed`]) instead of no prior, so such requests never share pages with others;
//! * a page holding a token id of 2^32 or more hashes `prior || 0xff || each id as u64 little-endian`
//!   ([`PageHasher::page_keys_wide`]); a page of smaller ids hashes as above.
//!
//! The hasher pads and compresses blocks itself through `sha2`'s block function, so a page costs one call into the
//! SHA instructions and no per-token work beyond writing the little-endian bytes. One chain is bound by the latency
//! of those instructions (each page waits for the previous key); [`PageHasher::page_keys_many`] hashes independent
//! chains (different requests) interleaved, several at a time (`sha_ni.rs`).

use std::fmt;
use std::str::FromStr;

mod sha_ni;

use sha_ni::ShaNi;
use sha2::block_api::compress256;

use crate::error::{Error, shorten};

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

    /// The digest as the eight big-endian state words it came from (how it is chained into the next page).
    fn words(&self) -> [u32; 8] {
        std::array::from_fn(|index| {
            u32::from_be_bytes([self.0[4 * index], self.0[4 * index + 1], self.0[4 * index + 2], self.0[4 * index + 3]])
        })
    }

    fn from_words(words: [u32; 8]) -> Self {
        let mut bytes = [0u8; KEY_BYTES];
        for (out, word) in bytes.chunks_exact_mut(4).zip(words) {
            out.copy_from_slice(&word.to_be_bytes());
        }
        Self(bytes)
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
        let invalid = |reason: String| Error::InvalidKey { text: shorten(text, 80), reason };
        if text.len() != 2 * KEY_BYTES {
            return Err(invalid(format!(
                "expected {} hex digits, found {} characters",
                2 * KEY_BYTES,
                text.chars().count()
            )));
        }
        // one pass through a nibble table (keys arrive by the hundred per storage call)
        let mut bytes = [0u8; KEY_BYTES];
        for (byte, pair) in bytes.iter_mut().zip(text.as_bytes().chunks_exact(2)) {
            let (high, low) = (HEX_VALUE[usize::from(pair[0])], HEX_VALUE[usize::from(pair[1])]);
            if high == NOT_HEX || low == NOT_HEX {
                let (at, ch) = text.char_indices().find(|(_, ch)| !ch.is_ascii_hexdigit()).unwrap_or_default();
                return Err(invalid(format!("character {ch:?} at position {at} is not a hex digit")));
            }
            *byte = (high << 4) | low;
        }
        Ok(Self(bytes))
    }
}

/// [`HEX_VALUE`]'s mark of a byte that is not a hex digit.
const NOT_HEX: u8 = 0xff;

/// The value of each ASCII hex digit (either case); [`NOT_HEX`] for every other byte.
const HEX_VALUE: [u8; 256] = {
    let mut table = [NOT_HEX; 256];
    let mut digit = 0;
    while digit < 10 {
        table[b'0' as usize + digit] = digit as u8;
        digit += 1;
    }
    let mut letter = 0;
    while letter < 6 {
        table[b'a' as usize + letter] = 10 + letter as u8;
        table[b'A' as usize + letter] = 10 + letter as u8;
        letter += 1;
    }
    table
};

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

/// Independent chains hashed together by the SHA extensions (measured on an AMD EPYC: 2 lanes run 28 M blocks/s, 4 lanes 24 M (register spills), one 16 M).
const LANES: usize = 2;

/// One 64-byte SHA-256 block as the sixteen big-endian words the compression function reads.
///
/// Blocks are built as words, not bytes: a prior key goes in as the state words it came out as, and a token's
/// little-endian bytes read big-endian are its byte-swapped value, so no byte shuffling is needed.
type Block = [u32; 16];

/// One token sequence to hash into page keys, continuing from `prior` if given.
#[derive(Clone, Copy, Debug)]
pub struct Chain<'a> {
    /// The tokens.
    pub tokens: &'a [u32],
    /// Key of the page before the first one, if any.
    pub prior: Option<PageKey>,
}

/// Hashes pages one after another, chaining each key into the next; reuses its block buffers across pages.
#[derive(Debug)]
pub struct PageHasher {
    lanes: [Vec<Block>; LANES],
    sha_ni: Option<ShaNi>,
}

impl Default for PageHasher {
    fn default() -> Self {
        Self { lanes: Default::default(), sha_ni: ShaNi::detect() }
    }
}

impl PageHasher {
    /// A hasher with empty buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// The key of one page of `tokens` chained to `prior` (SGLang's `get_hash_str(tokens, prior_hash)`).
    pub fn page_key(&mut self, prior: Option<&PageKey>, tokens: &[u32]) -> PageKey {
        PageKey::from_words(self.chain_step(0, prior.map(PageKey::words).as_ref(), tokens))
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
        let tokens = hashed_tokens(tokens, page_size, partial)?;
        let mut keys = vec![Vec::with_capacity(tokens.len().div_ceil(page_size))];
        self.finish(Cursor { chain: 0, tokens, last: prior.map(|key| key.words()) }, page_size, &mut keys);
        Ok(keys.pop().unwrap_or_default())
    }

    /// The keys of several independent chains, as [`page_keys`](Self::page_keys) gives each; with the SHA
    /// extensions, chains are hashed `LANES` at a time, interleaved, which is faster than one after another.
    ///
    /// # Errors
    ///
    /// As [`page_keys`](Self::page_keys), for the first chain at fault; nothing is hashed then.
    pub fn page_keys_many(
        &mut self,
        chains: &[Chain<'_>],
        page_size: usize,
        partial: PartialPage,
    ) -> Result<Vec<Vec<PageKey>>, Error> {
        let tokens: Vec<&[u32]> =
            chains.iter().map(|chain| hashed_tokens(chain.tokens, page_size, partial)).collect::<Result<_, _>>()?;
        let mut keys: Vec<Vec<PageKey>> =
            tokens.iter().map(|tokens| Vec::with_capacity(tokens.len().div_ceil(page_size))).collect();
        let mut cursors =
            chains.iter().zip(&tokens).enumerate().filter(|(_, (_, tokens))| !tokens.is_empty()).map(
                |(index, (chain, tokens))| Cursor { chain: index, tokens, last: chain.prior.map(|key| key.words()) },
            );
        if let Some(sha_ni) = self.sha_ni {
            let mut lanes: [Option<Cursor<'_>>; LANES] = std::array::from_fn(|_| cursors.next());
            while lanes.iter().all(Option::is_some) {
                let mut running = lanes.map(|lane| lane.expect("checked: every lane holds a chain"));
                self.run_lanes(sha_ni, &mut running, page_size, &mut keys);
                lanes = running.map(|cursor| if cursor.tokens.is_empty() { cursors.next() } else { Some(cursor) });
            }
            // fewer chains left than lanes: finish them one by one
            for cursor in lanes.into_iter().flatten() {
                self.finish(cursor, page_size, &mut keys);
            }
        } else {
            for cursor in cursors {
                self.finish(cursor, page_size, &mut keys);
            }
        }
        Ok(keys)
    }

    /// Hashes one page after `prior` in lane buffer `lane`; returns the new chaining state.
    fn chain_step(&mut self, lane: usize, prior: Option<&[u32; 8]>, tokens: &[u32]) -> [u32; 8] {
        let blocks = &mut self.lanes[lane];
        pad_message(blocks, prior, tokens);
        let mut states = [H0];
        match self.sha_ni {
            Some(sha_ni) => sha_ni.compress_lanes(&mut states, [blocks]),
            None => compress_portable(&mut states[0], blocks),
        }
        states[0]
    }

    /// Hashes the rest of one chain on its own.
    fn finish(&mut self, mut cursor: Cursor<'_>, page_size: usize, keys: &mut [Vec<PageKey>]) {
        while !cursor.tokens.is_empty() {
            if let (Some(sha_ni), Some(state)) = (self.sha_ni, cursor.last)
                && page_size <= sha_ni::MAX_ONE_BLOCK_PAGE
                && cursor.tokens.len() >= page_size
            {
                // whole one-block pages after a prior key, chained in registers
                let whole = cursor.tokens.len() / page_size;
                let mut states = [state];
                sha_ni.chain_one_block_pages(page_size, whole, [cursor.tokens], &mut states, [&mut keys[cursor.chain]]);
                cursor.last = Some(states[0]);
                cursor.tokens = &cursor.tokens[whole * page_size..];
                continue;
            }
            let (page, rest) = cursor.tokens.split_at(page_size.min(cursor.tokens.len()));
            let state = self.chain_step(0, cursor.last.as_ref(), page);
            keys[cursor.chain].push(PageKey::from_words(state));
            cursor.last = Some(state);
            cursor.tokens = rest;
        }
    }

    /// Hashes the chains of every lane, interleaved, until the shortest runs out.
    fn run_lanes(
        &mut self,
        sha_ni: ShaNi,
        lanes: &mut [Cursor<'_>; LANES],
        page_size: usize,
        keys: &mut [Vec<PageKey>],
    ) {
        let steps = lanes.iter().map(|cursor| cursor.tokens.len().div_ceil(page_size)).min().unwrap_or(0);
        let whole = lanes.iter().map(|cursor| cursor.tokens.len() / page_size).min().unwrap_or(0);
        if page_size <= sha_ni::MAX_ONE_BLOCK_PAGE && whole > 0 && lanes.iter().all(|cursor| cursor.last.is_some()) {
            // whole one-block pages after a prior key: chained in registers; what is left goes below
            let mut states = lanes.each_ref().map(|cursor| cursor.last.expect("checked above"));
            let mut lane_keys: [Vec<PageKey>; LANES] = std::array::from_fn(|_| Vec::new());
            for (lane, cursor) in lane_keys.iter_mut().zip(lanes.iter()) {
                // the lane's keys are gathered apart and appended, as two lanes' chains are two entries of `keys`
                *lane = std::mem::take(&mut keys[cursor.chain]);
            }
            sha_ni.chain_one_block_pages(
                page_size,
                whole,
                lanes.each_ref().map(|cursor| cursor.tokens),
                &mut states,
                lane_keys.each_mut(),
            );
            for ((cursor, state), lane) in lanes.iter_mut().zip(states).zip(lane_keys) {
                keys[cursor.chain] = lane;
                cursor.last = Some(state);
                cursor.tokens = &cursor.tokens[whole * page_size..];
            }
            return self.run_lanes(sha_ni, lanes, page_size, keys);
        }
        for _ in 0..steps {
            let mut states = [H0; LANES];
            for (cursor, blocks) in lanes.iter().zip(&mut self.lanes) {
                pad_message(blocks, cursor.last.as_ref(), &cursor.tokens[..page_size.min(cursor.tokens.len())]);
            }
            // the first page (no prior) or a short last page may need fewer blocks than the others
            let common = self.lanes.iter().map(Vec::len).min().unwrap_or(0);
            sha_ni.compress_lanes(&mut states, std::array::from_fn(|lane| &self.lanes[lane][..common]));
            for ((state, blocks), cursor) in states.iter_mut().zip(&self.lanes).zip(lanes.iter_mut()) {
                if blocks.len() > common {
                    sha_ni.compress_lanes(std::array::from_mut(state), [&blocks[common..]]);
                }
                keys[cursor.chain].push(PageKey::from_words(*state));
                cursor.last = Some(*state);
                cursor.tokens = &cursor.tokens[page_size.min(cursor.tokens.len())..];
            }
        }
    }
}

impl PageHasher {
    /// The chained keys of token ids of any width: a page whose ids all fit in 32 bits gets the key
    /// [`page_keys`](Self::page_keys) gives it; a page with an id of 2^32 or more hashes `prior || 0xff || each id
    /// as u64 little-endian` (SGLang 0.5.20 and later).
    ///
    /// # Errors
    ///
    /// As [`page_keys`](Self::page_keys).
    pub fn page_keys_wide(
        &mut self,
        tokens: &[u64],
        page_size: usize,
        prior: Option<PageKey>,
        partial: PartialPage,
    ) -> Result<Vec<PageKey>, Error> {
        let hashed = hashed_len(tokens.len(), page_size, partial)?;
        let mut keys = Vec::with_capacity(hashed.div_ceil(page_size));
        let mut last = prior;
        let mut narrow = Vec::with_capacity(page_size);
        for page in tokens[..hashed].chunks(page_size) {
            narrow.clear();
            narrow.extend(page.iter().map_while(|&token| u32::try_from(token).ok()));
            let key = if narrow.len() == page.len() {
                self.page_key(last.as_ref(), &narrow)
            } else {
                wide_page_key(last.as_ref(), page)
            };
            keys.push(key);
            last = Some(key);
        }
        Ok(keys)
    }
}

/// The key of a page holding an id of 2^32 or more: `SHA-256(prior || 0xff || each id as u64 little-endian)`.
fn wide_page_key(prior: Option<&PageKey>, tokens: &[u64]) -> PageKey {
    use sha2::Digest as _;
    let mut hasher = sha2::Sha256::new();
    if let Some(prior) = prior {
        hasher.update(prior.as_bytes());
    }
    hasher.update([WIDE_PAGE_MARKER]);
    for token in tokens {
        hasher.update(token.to_le_bytes());
    }
    PageKey(hasher.finalize().into())
}

/// The byte that starts the ids of a page holding an id of 2^32 or more (after the prior key).
const WIDE_PAGE_MARKER: u8 = 0xff;

/// What [`namespace_seed`] hashes first: the rule's name and version.
const NAMESPACE_SEED_TAG: &[u8] = b"sglang-cache-namespace-v1";

/// The prior of the first page of a request with an `extra_key` and/or a `cache_salt` (SGLang 0.5.20 and later);
/// `None` when it has neither, so such requests keep the keys they always had.
///
/// `SHA-256("sglang-cache-namespace-v1" || part(extra_key) || part(cache_salt))`, where an absent part is the byte
/// 0x00 and a present one is 0x01, its UTF-8 length as u64 little-endian, then its UTF-8 bytes (so an absent part,
/// an empty one, and two parts run together all differ).
///
/// ```
/// use hicache_core::hash::namespace_seed;
///
/// assert_eq!(
///     namespace_seed(Some("lora-A"), None).unwrap().to_string(),
///     "19091e73108efe79001c7f32d5a406346de6d857c582ce3b77311ba43e5ab43a"
/// );
/// assert!(namespace_seed(None, None).is_none());
/// ```
pub fn namespace_seed(extra_key: Option<&str>, cache_salt: Option<&str>) -> Option<PageKey> {
    use sha2::Digest as _;
    if extra_key.is_none() && cache_salt.is_none() {
        return None;
    }
    let mut hasher = sha2::Sha256::new();
    hasher.update(NAMESPACE_SEED_TAG);
    for part in [extra_key, cache_salt] {
        match part {
            None => hasher.update([0u8]),
            Some(text) => {
                hasher.update([1u8]);
                hasher.update((text.len() as u64).to_le_bytes());
                hasher.update(text.as_bytes());
            }
        }
    }
    Some(PageKey(hasher.finalize().into()))
}

/// A chain being hashed: its index, its tokens not yet hashed, and the state of its last page.
struct Cursor<'a> {
    chain: usize,
    tokens: &'a [u32],
    last: Option<[u32; 8]>,
}

/// The tokens to hash under the partial-page policy.
fn hashed_tokens(tokens: &[u32], page_size: usize, partial: PartialPage) -> Result<&[u32], Error> {
    Ok(&tokens[..hashed_len(tokens.len(), page_size, partial)?])
}

/// How many of `tokens` tokens are hashed under the partial-page policy.
fn hashed_len(tokens: usize, page_size: usize, partial: PartialPage) -> Result<usize, Error> {
    if page_size == 0 {
        return Err(Error::InvalidArgument { field: "page_size", reason: "must be at least 1".into() });
    }
    let tail = tokens % page_size;
    match partial {
        PartialPage::Reject if tail != 0 => Err(Error::PartialPage { tokens, page_size }),
        PartialPage::Drop => Ok(tokens - tail),
        _ => Ok(tokens),
    }
}

/// Fills `blocks` with the SHA-256 padded message `prior || LE32(tokens)`: the message, 0x80, zeros, and the 64-bit
/// big-endian bit length, to a whole number of 64-byte blocks. Every part is whole words, so it is built as words.
#[inline]
fn pad_message(blocks: &mut Vec<Block>, prior: Option<&[u32; 8]>, tokens: &[u32]) {
    let prior_words = if prior.is_some() { 8 } else { 0 };
    let message_words = prior_words + tokens.len();
    let block_count = (4 * message_words + 1 + 8).div_ceil(64);
    if blocks.len() != block_count {
        blocks.resize(block_count, [0u32; 16]);
    }
    // every word is written below, so the buffer is reused without clearing
    let words: &mut [u32] = blocks.as_flattened_mut();
    let total = words.len();
    if let Some(prior) = prior {
        words[..8].copy_from_slice(prior);
    }
    for (word, token) in words[prior_words..message_words].iter_mut().zip(tokens) {
        // the token's little-endian bytes, read as a big-endian word
        *word = u32::from_be_bytes(token.to_le_bytes());
    }
    words[message_words] = 0x8000_0000;
    words[message_words + 1..total - 2].fill(0);
    let bits = (message_words as u64) * 32;
    words[total - 2] = (bits >> 32) as u32;
    words[total - 1] = bits as u32;
}

/// A block's bytes (big-endian words), for the portable compression function.
fn block_bytes(block: &Block) -> [u8; 64] {
    let mut bytes = [0u8; 64];
    for (out, word) in bytes.chunks_exact_mut(4).zip(block) {
        out.copy_from_slice(&word.to_be_bytes());
    }
    bytes
}

/// Compression by `sha2` (its own SHA-NI or software path), for CPUs without the extensions this crate uses.
fn compress_portable(state: &mut [u32; 8], blocks: &[Block]) {
    for block in blocks {
        compress256(state, &[block_bytes(block)]);
    }
}

/// The key of one page chained to `prior`; see [`PageHasher::page_key`].
pub fn page_key(prior: Option<&PageKey>, tokens: &[u32]) -> PageKey {
    PageHasher::new().page_key(prior, tokens)
}

/// The chained keys of a token sequence; see [`PageHasher::page_keys`].
///
/// ```
/// use hicache_core::hash::{PartialPage, page_keys};
///
/// // two pages of two tokens; the second key chains the first (values from SGLang 0.5.2's get_hash_str)
/// let keys = page_keys(&[0, 1, 2_147_483_648, 4_294_967_295], 2, None, PartialPage::Reject)?;
/// assert_eq!(keys[0].to_string(), "01acecb507abfe1a354aa8064f4af5d3f1acd019e37db3c11c97523b71c76e9d");
/// assert_eq!(keys[1].to_string(), "2980cae880febb5d95be412a87bb93fde9fc42626ef0a4b816fb957a2812a25a");
/// assert!(page_keys(&[1, 2, 3], 2, None, PartialPage::Reject).is_err());
/// # Ok::<(), hicache_core::Error>(())
/// ```
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
mod tests;
