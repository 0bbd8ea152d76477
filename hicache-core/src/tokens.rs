//! Token-list parsing: whitespace- or comma-separated integers, or a JSON array, into u32 token ids (or u64 ones).
//!
//! SGLang hashes each token id as an unsigned 32-bit little-endian integer and raises `OverflowError` for anything
//! outside `[0, 2^32)`; hicache refuses such a token up front, naming its position.

use crate::error::{Error, shorten};

/// Parses token ids from text.
///
/// Text whose first non-blank character is `[` is read as a JSON array of integers; anything else as integers
/// separated by whitespace and/or commas. Positions in errors count tokens from 1.
///
/// # Errors
///
/// [`Error::InvalidToken`] naming the first bad token's position and text, or the JSON syntax error.
pub fn parse_tokens(text: &str) -> Result<Vec<u32>, Error> {
    parse_up_to(text, u64::from(u32::MAX), OUT_OF_RANGE)?
        .into_iter()
        .map(|token| Ok(u32::try_from(token).expect("checked against u32::MAX")))
        .collect()
}

/// Parses token ids of up to 64 bits (SGLang 0.5.20 and later hash ids of 2^32 and above too: see
/// [`PageHasher::page_keys_wide`](crate::hash::PageHasher::page_keys_wide)), in the formats of [`parse_tokens`].
///
/// # Errors
///
/// As [`parse_tokens`], with the range `[0, 2^64 - 1]`.
pub fn parse_wide_tokens(text: &str) -> Result<Vec<u64>, Error> {
    parse_up_to(text, u64::MAX, OUT_OF_WIDE_RANGE)
}

fn parse_up_to(text: &str, max: u64, out_of_range: &str) -> Result<Vec<u64>, Error> {
    if text.trim_start().starts_with('[') {
        parse_json(text, max, out_of_range)
    } else {
        parse_separated(text, max, out_of_range)
    }
}

fn parse_separated(text: &str, max: u64, out_of_range: &str) -> Result<Vec<u64>, Error> {
    text.split(|ch: char| ch.is_whitespace() || ch == ',')
        .filter(|word| !word.is_empty())
        .enumerate()
        .map(|(index, word)| token_from_text(index + 1, word, max, out_of_range))
        .collect()
}

fn token_from_text(position: usize, word: &str, max: u64, out_of_range: &str) -> Result<u64, Error> {
    let invalid = |reason: &str| Error::InvalidToken { position, text: shorten(word, 40), reason: reason.to_owned() };
    let (negative, digits) = match word.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, word.strip_prefix('+').unwrap_or(word)),
    };
    if digits.is_empty() || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
        return Err(invalid("not an integer"));
    }
    // only digits remain, so parsing fails on overflow alone
    match digits.parse::<u64>() {
        Ok(value) if value <= max && (!negative || value == 0) => Ok(value),
        _ => Err(invalid(out_of_range)),
    }
}

const OUT_OF_RANGE: &str = "token ids must be in [0, 4294967295] (SGLang hashes them as u32)";
const OUT_OF_WIDE_RANGE: &str = "token ids must be in [0, 18446744073709551615]";

fn parse_json(text: &str, max: u64, out_of_range: &str) -> Result<Vec<u64>, Error> {
    let values: Vec<serde_json::Value> = serde_json::from_str(text)
        .map_err(|error| Error::InvalidTokenList { reason: format!("not a JSON array of integers: {error}") })?;
    values
        .iter()
        .enumerate()
        .map(|(index, value)| {
            let invalid = |reason: &str| Error::InvalidToken {
                position: index + 1,
                text: shorten(&value.to_string(), 40),
                reason: reason.to_owned(),
            };
            match value {
                serde_json::Value::Number(number) => match (number.as_u64(), number.as_i64()) {
                    (Some(value), _) if value <= max => Ok(value),
                    (Some(_), _) | (None, Some(_)) => Err(invalid(out_of_range)),
                    _ => Err(invalid("not an integer")),
                },
                _ => Err(invalid("not an integer")),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn reads_every_separator_style_and_json() {
        assert_eq!(parse_tokens("1 2\n3\t4").unwrap(), [1, 2, 3, 4]);
        assert_eq!(parse_tokens("1,2, 3 ,4,").unwrap(), [1, 2, 3, 4]);
        assert_eq!(parse_tokens("  [1, 2, 4294967295]\n").unwrap(), [1, 2, u32::MAX]);
        assert_eq!(parse_tokens("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_tokens("[]").unwrap(), Vec::<u32>::new());
    }

    #[test]
    fn names_the_position_of_a_bad_token() {
        let message = parse_tokens("1 2 4294967296 5").unwrap_err().to_string();
        assert_eq!(
            message,
            "token 3 (\"4294967296\"): token ids must be in [0, 4294967295] (SGLang hashes them as u32)"
        );
        assert!(parse_tokens("1,-1").unwrap_err().to_string().starts_with("token 2 (\"-1\")"));
        assert!(parse_tokens("7 x").unwrap_err().to_string().starts_with("token 2 (\"x\"): not an integer"));
        assert!(parse_tokens("1.5").unwrap_err().to_string().contains("not an integer"));
        assert!(parse_tokens("[1, 2.5]").unwrap_err().to_string().starts_with("token 2 (\"2.5\")"));
        assert!(parse_tokens("[1, \"2\"]").unwrap_err().to_string().starts_with("token 2"));
        assert!(parse_tokens("[1, -3]").unwrap_err().to_string().contains("[0, 4294967295]"));
        assert!(parse_tokens("[1, 2").unwrap_err().to_string().contains("not a JSON array"));
        let huge = "9".repeat(60);
        assert!(parse_tokens(&huge).unwrap_err().to_string().contains("[0, 4294967295]"));
    }

    #[test]
    fn wide_ids_go_up_to_u64_max() {
        let max = u64::MAX;
        assert_eq!(parse_wide_tokens("0 4294967296 18446744073709551615").unwrap(), [0, 1 << 32, max]);
        assert_eq!(parse_wide_tokens("[4294967296, 1]").unwrap(), [1 << 32, 1]);
        let message = parse_wide_tokens("1 18446744073709551616").unwrap_err().to_string();
        assert_eq!(message, "token 2 (\"18446744073709551616\"): token ids must be in [0, 18446744073709551615]");
        assert!(parse_wide_tokens("[1, -1]").unwrap_err().to_string().starts_with("token 2"));
    }

    proptest! {
        #[test]
        fn printed_wide_lists_parse_back(tokens in proptest::collection::vec(any::<u64>(), 0..100), json: bool) {
            let text = if json {
                serde_json::to_string(&tokens).unwrap()
            } else {
                tokens.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
            };
            prop_assert_eq!(parse_wide_tokens(&text).unwrap(), tokens);
        }

        #[test]
        fn printed_lists_parse_back(tokens in proptest::collection::vec(any::<u32>(), 0..100), style in 0..3u8) {
            let text = match style {
                0 => tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(" "),
                1 => tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
                _ => serde_json::to_string(&tokens).unwrap(),
            };
            prop_assert_eq!(parse_tokens(&text).unwrap(), tokens);
        }
    }
}
