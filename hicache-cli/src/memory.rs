//! Refusing, before allocating, what does not fit this machine: a command works out the bytes it will hold from its
//! flags (with checked arithmetic) and compares them with the memory available now, so a size typed wrong is a usage
//! error naming the flags, never an abort or a wrapped-around size.

use crate::exit::Usage;

/// Memory the kernel says is available now (`MemAvailable` of `/proc/meminfo`), in bytes; `None` where unknown.
pub(crate) fn available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|line| line.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Checks that `bytes` (`None`: the computation overflowed) fit in the memory available now.
///
/// # Errors
///
/// [`Usage`] naming `flags` when the sizes overflow or need more memory than is available.
pub(crate) fn require(bytes: Option<u64>, flags: &str) -> Result<(), Usage> {
    let Some(bytes) = bytes else {
        return Err(Usage(format!("{flags}: the sizes overflow (they ask for more than 2^64 bytes)")));
    };
    match available() {
        Some(available) if bytes > available => Err(Usage(format!(
            "{flags}: this needs about {:.1} GB of memory, and {:.1} GB are available",
            bytes as f64 / 1e9,
            available as f64 / 1e9
        ))),
        _ => Ok(()),
    }
}

/// `a × b × …` in u64, `None` on overflow.
pub(crate) fn product(factors: &[u64]) -> Option<u64> {
    factors.iter().try_fold(1u64, |total, &factor| total.checked_mul(factor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_and_too_much_are_refused_naming_the_flags() {
        assert_eq!(product(&[1 << 40, 1 << 30]), None);
        assert_eq!(product(&[3, 4, 5]), Some(60));
        let error = require(None, "--pages, --page-bytes").unwrap_err().to_string();
        assert!(error.starts_with("--pages, --page-bytes: the sizes overflow"), "{error}");
        let available = available().expect("Linux has /proc/meminfo");
        assert!(available > 0);
        let error = require(Some(available.saturating_mul(4)), "--clients").unwrap_err().to_string();
        assert!(error.starts_with("--clients: this needs about"), "{error}");
        assert!(require(Some(1 << 20), "--clients").is_ok());
    }
}
