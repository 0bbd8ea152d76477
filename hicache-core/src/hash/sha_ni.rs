//! SHA-256 compression of several independent messages at once with the x86 SHA extensions.
//!
//! One page key depends on the previous one, so a single chain is bound by the latency of the SHA round
//! instruction; independent chains (different requests) have no such dependency. This kernel runs the rounds of
//! `L` messages interleaved, so the CPU overlaps them, and otherwise follows the textbook SHA-NI schedule: the state
//! as `ABEF`/`CDGH` vectors, two rounds per `sha256rnds2`, the message schedule by `sha256msg1`/`sha256msg2`.
//!
//! The only `unsafe` is the call into the `#[target_feature]` function, made after the CPU was checked for those
//! features; inside it every intrinsic is safe (no pointers: words are built with `_mm_set_epi32` and read back
//! with `_mm_extract_epi32`).
#![expect(unsafe_code, reason = "calling a #[target_feature] function after checking the CPU has those features")]

use super::Block;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{
    __m128i, _mm_add_epi32, _mm_alignr_epi8, _mm_extract_epi32, _mm_set_epi32, _mm_sha256msg1_epu32,
    _mm_sha256msg2_epu32, _mm_sha256rnds2_epu32, _mm_shuffle_epi32,
};

/// SHA-256 round constants (FIPS 180-4 §4.2.2: fractional parts of the cube roots of the first 64 primes).
#[cfg(target_arch = "x86_64")]
const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
    0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
    0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
    0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
];

/// Proof that this CPU has the SHA extensions (and SSSE3 and SSE4.1): only [`ShaNi::detect`] makes one.
#[derive(Clone, Copy, Debug)]
pub(super) struct ShaNi(());

impl ShaNi {
    /// `Some` when the CPU has the features [`compress_lanes`](Self::compress_lanes) is compiled for.
    pub(super) fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            let present = std::arch::is_x86_feature_detected!("sha")
                && std::arch::is_x86_feature_detected!("ssse3")
                && std::arch::is_x86_feature_detected!("sse4.1");
            present.then_some(Self(()))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            None
        }
    }

    /// Compresses `blocks[lane]` into `states[lane]` for every lane.
    ///
    /// # Panics
    ///
    /// When the lanes' block counts differ.
    pub(super) fn compress_lanes<const L: usize>(self, states: &mut [[u32; 8]; L], blocks: [&[Block]; L]) {
        assert!(blocks.iter().all(|lane| lane.len() == blocks[0].len()), "lanes must have equal block counts");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `self` exists only if `detect` found sha, ssse3 and sse4.1 on this CPU, the features the function
        // is compiled for; it takes no pointers, so there is no other precondition.
        unsafe {
            compress_lanes_sha_ni(states, blocks)
        }
    }
}

/// Most tokens in a page whose padded message after a prior key is one block: 8 prior words + tokens + the 0x80
/// word + two length words ≤ 16.
pub(super) const MAX_ONE_BLOCK_PAGE: usize = 5;

impl ShaNi {
    /// Hashes `steps` whole pages of `page_size` ≤ [`MAX_ONE_BLOCK_PAGE`] tokens on each lane, chaining from
    /// `states[lane]` (the lane's last key); pushes each key to `keys[lane]` and leaves the last in `states`.
    ///
    /// A page of this size is one block whose first eight words are the previous state, so the message is built
    /// straight from the state words, with no buffer between pages.
    ///
    /// # Panics
    ///
    /// When the page size is 0 or above [`MAX_ONE_BLOCK_PAGE`], or a lane has fewer than `steps` pages.
    pub(super) fn chain_one_block_pages<const L: usize>(
        self,
        page_size: usize,
        steps: usize,
        tokens: [&[u32]; L],
        states: &mut [[u32; 8]; L],
        keys: [&mut Vec<super::PageKey>; L],
    ) {
        assert!((1..=MAX_ONE_BLOCK_PAGE).contains(&page_size), "page size {page_size} is not one block");
        assert!(tokens.iter().all(|tokens| tokens.len() >= steps * page_size), "a lane is short of pages");
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `compress_lanes`: `self` proves the CPU has the features; no pointers are involved.
        unsafe {
            chain_one_block_pages_sha_ni(page_size, steps, tokens, states, keys)
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn chain_one_block_pages_sha_ni<const L: usize>(
    page_size: usize,
    steps: usize,
    tokens: [&[u32]; L],
    states: &mut [[u32; 8]; L],
    keys: [&mut Vec<super::PageKey>; L],
) {
    let (initial_abef, initial_cdgh) = pack_state(&super::H0);
    let bits = (32 + 4 * page_size as u32) * 8;
    for step in 0..steps {
        let mut schedule = [[initial_abef; 4]; L];
        for ((lane_schedule, state), lane_tokens) in schedule.iter_mut().zip(states.iter()).zip(&tokens) {
            // the previous key's words, the page's tokens (little-endian bytes read big-endian), 0x80, zeros, the
            // bit length
            let mut words: Block = [0; 16];
            words[..8].copy_from_slice(state);
            for (word, token) in words[8..].iter_mut().zip(&lane_tokens[step * page_size..(step + 1) * page_size]) {
                *word = u32::from_be_bytes(token.to_le_bytes());
            }
            words[8 + page_size] = 0x8000_0000;
            words[15] = bits;
            *lane_schedule = load_words(&words);
        }
        let (mut abef, mut cdgh) = ([initial_abef; L], [initial_cdgh; L]);
        macro_rules! quads {
            ($($quad:literal)*) => { $( quad_rounds($quad, &mut abef, &mut cdgh, &mut schedule); )* };
        }
        quads!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        for lane in 0..L {
            let (x, y) = (_mm_add_epi32(abef[lane], initial_abef), _mm_add_epi32(cdgh[lane], initial_cdgh));
            states[lane] = unpack_state(x, y);
            keys[lane].push(super::PageKey::from_words(states[lane]));
        }
    }
}

/// The `ABEF`/`CDGH` vectors of the state words `a..h`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse2")]
fn pack_state(state: &[u32; 8]) -> (__m128i, __m128i) {
    let [a, b, c, d, e, f, g, h] = state.map(|word| word as i32);
    (_mm_set_epi32(a, b, e, f), _mm_set_epi32(c, d, g, h))
}

/// A block's sixteen words as four vectors, word 0 in the lowest lane.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse2")]
fn load_words(words: &Block) -> [__m128i; 4] {
    let word = |index: usize| words[index] as i32;
    [0, 4, 8, 12].map(|first| _mm_set_epi32(word(first + 3), word(first + 2), word(first + 1), word(first)))
}

/// The state words `a..h` from the `ABEF`/`CDGH` vectors.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse4.1")]
fn unpack_state(abef: __m128i, cdgh: __m128i) -> [u32; 8] {
    [
        _mm_extract_epi32::<3>(abef),
        _mm_extract_epi32::<2>(abef),
        _mm_extract_epi32::<3>(cdgh),
        _mm_extract_epi32::<2>(cdgh),
        _mm_extract_epi32::<1>(abef),
        _mm_extract_epi32::<0>(abef),
        _mm_extract_epi32::<1>(cdgh),
        _mm_extract_epi32::<0>(cdgh),
    ]
    .map(|word| word as u32)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn compress_lanes_sha_ni<const L: usize>(states: &mut [[u32; 8]; L], blocks: [&[Block]; L]) {
    let mut abef = [_mm_set_epi32(0, 0, 0, 0); L];
    let mut cdgh = abef;
    for ((abef, cdgh), state) in abef.iter_mut().zip(&mut cdgh).zip(states.iter()) {
        (*abef, *cdgh) = pack_state(state);
    }
    for block in 0..blocks[0].len() {
        let (saved_abef, saved_cdgh) = (abef, cdgh);
        let mut schedule = [[abef[0]; 4]; L];
        for (lane_schedule, lane_blocks) in schedule.iter_mut().zip(&blocks) {
            *lane_schedule = load_words(&lane_blocks[block]);
        }
        // written out so every schedule index is a constant and the schedule stays in registers
        macro_rules! quads {
            ($($quad:literal)*) => { $( quad_rounds($quad, &mut abef, &mut cdgh, &mut schedule); )* };
        }
        quads!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        for lane in 0..L {
            abef[lane] = _mm_add_epi32(abef[lane], saved_abef[lane]);
            cdgh[lane] = _mm_add_epi32(cdgh[lane], saved_cdgh[lane]);
        }
    }
    for lane in 0..L {
        states[lane] = unpack_state(abef[lane], cdgh[lane]);
    }
}

/// Four rounds of every lane with schedule words `quad`, then (for the first twelve) the schedule's next four words.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
fn quad_rounds<const L: usize>(
    quad: usize,
    abef: &mut [__m128i; L],
    cdgh: &mut [__m128i; L],
    schedule: &mut [[__m128i; 4]; L],
) {
    let constants =
        _mm_set_epi32(K[4 * quad + 3] as i32, K[4 * quad + 2] as i32, K[4 * quad + 1] as i32, K[4 * quad] as i32);
    for lane in 0..L {
        let words = _mm_add_epi32(schedule[lane][quad % 4], constants);
        cdgh[lane] = _mm_sha256rnds2_epu32(cdgh[lane], abef[lane], words);
        abef[lane] = _mm_sha256rnds2_epu32(abef[lane], cdgh[lane], _mm_shuffle_epi32(words, 0x0e));
    }
    if quad < 12 {
        for w in schedule.iter_mut() {
            let (w0, w1, w2, w3) = (w[quad % 4], w[(quad + 1) % 4], w[(quad + 2) % 4], w[(quad + 3) % 4]);
            let partial = _mm_add_epi32(_mm_sha256msg1_epu32(w0, w1), _mm_alignr_epi8(w3, w2, 4));
            w[quad % 4] = _mm_sha256msg2_epu32(partial, w3);
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Each lane equals sha2's own compression of the same blocks from the same state.
        #[test]
        fn lanes_match_sha2(
            seed_states in any::<[[u32; 8]; 3]>(),
            data in prop::collection::vec(any::<[u32; 16]>(), 3..=12),
        ) {
            let Some(sha_ni) = ShaNi::detect() else {
                // not silent on CI: hash::tests::sha_extensions_are_used_where_ci_runs fails there
                return Ok(());
            };
            let per_lane = data.len() / 3;
            let lanes: [&[Block]; 3] = [&data[..per_lane], &data[per_lane..2 * per_lane], &data[2 * per_lane..3 * per_lane]];
            let mut states = seed_states;
            sha_ni.compress_lanes(&mut states, lanes);
            for lane in 0..3 {
                let mut expected = seed_states[lane];
                let bytes: Vec<[u8; 64]> = lanes[lane].iter().map(super::super::block_bytes).collect();
                sha2::block_api::compress256(&mut expected, &bytes);
                prop_assert_eq!(states[lane], expected, "lane {}", lane);
            }
        }
    }
}
