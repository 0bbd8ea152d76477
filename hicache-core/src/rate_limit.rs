//! Rate limiting: a token bucket over an injected clock (L3 bandwidth shaping), and the prefetch capacity account.
//!
//! Time comes from a [`Clock`], so tests drive it by hand ([`ManualClock`]) instead of sleeping.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::Error;

/// A monotonic clock: time since its own origin.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Now, as time since the clock's origin.
    fn now(&self) -> Duration;
}

/// The real monotonic clock, from its creation.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self { origin: Instant::now() }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that moves only when told; clones share the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at time zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.nanos.fetch_add(u64::try_from(by.as_nanos()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

/// The answer of a [`TokenBucket`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// The amount was taken from the bucket; go ahead.
    Granted,
    /// Not enough yet; ask again after this long.
    Wait(Duration),
}

const NANOS_PER_SECOND: u128 = 1_000_000_000;

/// A token bucket of `rate` units per second holding at most `burst` units.
///
/// A request larger than the burst is granted when the bucket is full and leaves it in debt, so it is delayed but
/// never starved. Amounts are kept in unit-nanoseconds, so refills are exact.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    rate: u64,
    burst: u64,
    /// Units × 10^9; negative while in debt.
    level: i128,
    last: Duration,
}

impl TokenBucket {
    /// A full bucket at time `now`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the rate or the burst is zero.
    pub fn new(rate_per_second: u64, burst: u64, now: Duration) -> Result<Self, Error> {
        if rate_per_second == 0 {
            return Err(Error::InvalidArgument { field: "rate", reason: "must be at least 1 per second".into() });
        }
        if burst == 0 {
            return Err(Error::InvalidArgument { field: "burst", reason: "must be at least 1".into() });
        }
        Ok(Self { rate: rate_per_second, burst, level: i128::from(burst) * NANOS_PER_SECOND as i128, last: now })
    }

    /// Takes `amount` units if the bucket allows it at `now`, or says how long to wait.
    pub(crate) fn try_acquire(&mut self, amount: u64, now: Duration) -> Admission {
        self.refill(now);
        let needed = i128::from(amount.min(self.burst)) * NANOS_PER_SECOND as i128;
        if self.level >= needed {
            self.level -= i128::from(amount) * NANOS_PER_SECOND as i128;
            Admission::Granted
        } else {
            let missing = (needed - self.level) as u128;
            Admission::Wait(Duration::from_nanos(
                missing.div_ceil(u128::from(self.rate)).try_into().unwrap_or(u64::MAX),
            ))
        }
    }

    /// Units available at `now` (zero while in debt).
    pub fn available(&mut self, now: Duration) -> u64 {
        self.refill(now);
        (self.level.max(0) / NANOS_PER_SECOND as i128) as u64
    }

    fn refill(&mut self, now: Duration) {
        // a clock never goes back, but a caller's `now` might be stale: never refill negatively
        let elapsed = now.saturating_sub(self.last).as_nanos();
        self.last = self.last.max(now);
        let cap = i128::from(self.burst) * NANOS_PER_SECOND as i128;
        let room = (cap - self.level).max(0) as u128;
        self.level += elapsed.saturating_mul(u128::from(self.rate)).min(room) as i128;
    }
}

/// How many tokens ongoing prefetches hold in the host pool, against a limit (docs/sglang.md#prefetch:
/// `prefetch_rate_limited`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefetchCapacity {
    limit: u64,
    occupied: u64,
}

impl PrefetchCapacity {
    /// The limit SGLang uses: `floor(fraction × (host − device))` tokens (fraction 0.8 by default).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the host pool is not larger than the device pool or the fraction is not in
    /// (0, 1].
    pub(crate) fn for_pools(host_tokens: u64, device_tokens: u64, fraction: f64) -> Result<Self, Error> {
        if host_tokens <= device_tokens {
            return Err(Error::InvalidArgument {
                field: "host_tokens",
                reason: format!(
                    "the host pool ({host_tokens} tokens) must be larger than the device pool ({device_tokens})"
                ),
            });
        }
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(Error::InvalidArgument {
                field: "prefetch_capacity_fraction",
                reason: format!("{fraction} is not in (0, 1]"),
            });
        }
        Ok(Self::with_limit((fraction * (host_tokens - device_tokens) as f64).floor() as u64))
    }

    /// An account with an explicit limit.
    pub(crate) const fn with_limit(limit: u64) -> Self {
        Self { limit, occupied: 0 }
    }

    /// The limit in tokens.
    pub const fn limit(&self) -> u64 {
        self.limit
    }

    /// Tokens held by ongoing prefetches.
    pub const fn occupied(&self) -> u64 {
        self.occupied
    }

    /// Whether new prefetches must wait (occupied ≥ limit).
    pub(crate) const fn is_limited(&self) -> bool {
        self.occupied >= self.limit
    }

    /// Admits a prefetch of `tokens` unless the account is at its limit, as SGLang does: a prefetch that starts
    /// below the limit may take it over, and the next waits.
    pub(crate) fn try_admit(&mut self, tokens: u64) -> bool {
        if self.is_limited() {
            return false;
        }
        self.occupied += tokens;
        true
    }

    /// Gives back the tokens of a finished, revoked or aborted prefetch.
    ///
    /// # Errors
    ///
    /// [`Error::Internal`] when more is released than is held (a caller bug); nothing changes then.
    pub fn release(&mut self, tokens: u64) -> Result<(), Error> {
        self.occupied = self.occupied.checked_sub(tokens).ok_or_else(|| {
            Error::Internal(format!("prefetch capacity: releasing {tokens} tokens but only {} are held", self.occupied))
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn bucket_refills_at_its_rate_and_caps_at_its_burst() {
        let clock = ManualClock::new();
        let mut bucket = TokenBucket::new(1000, 500, clock.now()).unwrap();
        assert_eq!(bucket.try_acquire(500, clock.now()), Admission::Granted);
        assert_eq!(bucket.try_acquire(100, clock.now()), Admission::Wait(100 * MS));
        clock.advance(50 * MS);
        assert_eq!(bucket.available(clock.now()), 50);
        assert_eq!(bucket.try_acquire(100, clock.now()), Admission::Wait(50 * MS));
        clock.advance(50 * MS);
        assert_eq!(bucket.try_acquire(100, clock.now()), Admission::Granted);
        clock.advance(Duration::from_secs(60));
        assert_eq!(bucket.available(clock.now()), 500, "never more than the burst");
    }

    #[test]
    fn requests_above_the_burst_go_into_debt() {
        let clock = ManualClock::new();
        let mut bucket = TokenBucket::new(1000, 100, clock.now()).unwrap();
        assert_eq!(bucket.try_acquire(300, clock.now()), Admission::Granted);
        // 200 units of debt plus a full burst of 100 before the next large request
        assert_eq!(bucket.try_acquire(300, clock.now()), Admission::Wait(300 * MS));
        assert!(TokenBucket::new(0, 1, clock.now()).unwrap_err().to_string().starts_with("rate:"));
    }

    #[test]
    fn prefetch_capacity_uses_sglang_limit() {
        let mut capacity = PrefetchCapacity::for_pools(2000, 1000, 0.8).unwrap();
        assert_eq!(capacity.limit(), 800);
        assert!(capacity.try_admit(700));
        assert!(capacity.try_admit(700), "below the limit when it starts");
        assert!(!capacity.try_admit(1));
        capacity.release(700).unwrap();
        assert!(capacity.try_admit(1));
        assert!(capacity.release(10_000).is_err());
        assert_eq!(capacity.occupied(), 701);
        assert!(PrefetchCapacity::for_pools(1000, 1000, 0.8).is_err());
        assert!(
            PrefetchCapacity::for_pools(2000, 1000, 1.5)
                .unwrap_err()
                .to_string()
                .contains("prefetch_capacity_fraction")
        );
    }

    proptest! {
        /// Over any sequence of requests and clock steps, the bucket never grants more than burst + rate × elapsed
        /// (counting debt), and a `Wait(d)` answer is followed by a grant once `d` has passed.
        #[test]
        fn grants_never_exceed_the_rate(
            rate in 1u64..10_000, burst in 1u64..10_000,
            steps in prop::collection::vec((0u64..5_000, 0u64..20_000_000), 1..60),
        ) {
            let clock = ManualClock::new();
            let mut bucket = TokenBucket::new(rate, burst, clock.now()).unwrap();
            let mut granted: u128 = 0;
            let mut largest: u128 = 0;
            for (amount, step_nanos) in steps {
                clock.advance(Duration::from_nanos(step_nanos));
                match bucket.try_acquire(amount, clock.now()) {
                    Admission::Granted => { granted += u128::from(amount); largest = largest.max(amount.into()); }
                    Admission::Wait(wait) => {
                        let mut probe = bucket.clone();
                        prop_assert_eq!(probe.try_acquire(amount, clock.now() + wait), Admission::Granted);
                        if wait > Duration::from_nanos(1) {
                            let mut early = bucket.clone();
                            prop_assert_ne!(early.try_acquire(amount, clock.now() + wait - Duration::from_nanos(1)), Admission::Granted);
                        }
                    }
                }
                let allowed = u128::from(burst) + clock.now().as_nanos() * u128::from(rate) / NANOS_PER_SECOND + largest;
                prop_assert!(granted <= allowed, "granted {} > allowed {}", granted, allowed);
            }
        }
    }
}
