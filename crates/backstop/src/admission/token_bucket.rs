//! A lock-free token bucket (GCRA on one `AtomicU64`).
//!
//! A token bucket with rate `r` and capacity `B` is the same thing as GCRA ("generic cell rate
//! algorithm"): instead of a token count and a refill timestamp, it keeps one number, the
//! *theoretical arrival time* (TAT) at which the bucket would be full again. A request of cost
//! `c` moves the TAT forward by `c / r`; it is allowed when the new TAT lies at most `B / r`
//! ahead of now. One compare-and-swap per decision, no lock, no floating point.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::MonotonicClock;

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// A rate limit: tokens per interval and how many may be spent at once.
///
/// Invalid limits cannot be written: the integer constructors take `NonZeroU32`, the others
/// validate and return [`InvalidQuota`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    /// Nanoseconds per token (at least one).
    interval_ns: u64,
    /// Bucket capacity in tokens.
    burst: u32,
}

/// A quota that cannot be enforced (zero, negative, not finite or too fine for nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidQuota {
    /// The rate is zero, negative or not a finite number.
    #[error("rate must be a finite number above zero")]
    Rate,
    /// The period per token is zero, or the rate is above one token per nanosecond.
    #[error("a token must take at least one nanosecond")]
    Period,
    /// The burst is zero.
    #[error("burst must be at least one token")]
    Burst,
}

impl Quota {
    /// `rate` tokens per second, with room for `burst` at once.
    pub fn per_second(rate: NonZeroU32, burst: NonZeroU32) -> Self {
        Self {
            interval_ns: (NANOS_PER_SEC / u64::from(rate.get())).max(1),
            burst: burst.get(),
        }
    }

    /// One token every `period`, with room for `burst` at once (rates below one per second).
    pub fn with_period(period: Duration, burst: NonZeroU32) -> Result<Self, InvalidQuota> {
        let interval_ns = u64::try_from(period.as_nanos()).unwrap_or(u64::MAX);
        if interval_ns == 0 {
            return Err(InvalidQuota::Period);
        }
        Ok(Self {
            interval_ns,
            burst: burst.get(),
        })
    }

    /// A rate from configuration (e.g. a command-line flag), validated.
    pub fn from_rate(rate_per_sec: f64, burst: u32) -> Result<Self, InvalidQuota> {
        if !rate_per_sec.is_finite() || rate_per_sec <= 0.0 {
            return Err(InvalidQuota::Rate);
        }
        let burst = NonZeroU32::new(burst).ok_or(InvalidQuota::Burst)?;
        let ns = (NANOS_PER_SEC as f64 / rate_per_sec).round();
        if ns < 1.0 {
            return Err(InvalidQuota::Period);
        }
        // `as` saturates for values beyond u64::MAX.
        Self::with_period(Duration::from_nanos(ns as u64), burst)
    }

    /// Time to earn one token.
    pub fn interval(&self) -> Duration {
        Duration::from_nanos(self.interval_ns)
    }

    /// Bucket capacity in tokens.
    pub fn burst(&self) -> u32 {
        self.burst
    }

    /// How far ahead of now the TAT may lie: `burst x interval`.
    pub(crate) fn tolerance_ns(&self) -> u64 {
        self.interval_ns.saturating_mul(u64::from(self.burst))
    }

    pub(crate) fn interval_ns(&self) -> u64 {
        self.interval_ns
    }
}

/// A request could not be granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// Not enough tokens now; enough will have accrued after this long.
    #[error("rate limited; retry after {0:?}")]
    RetryAfter(Duration),
    /// The cost is larger than the burst: no wait will ever make it fit.
    #[error("cost {cost} exceeds the burst of {burst} tokens")]
    ExceedsBurst {
        /// Tokens asked for.
        cost: u32,
        /// Bucket capacity.
        burst: u32,
    },
}

/// The GCRA state shared by [`TokenBucket`] and the keyed buckets: one TAT, in nanoseconds
/// on the owner's clock.
#[derive(Debug, Default)]
pub(crate) struct Cell {
    tat: AtomicU64,
}

impl Cell {
    /// A full bucket.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Spends `inc_ns` (cost x interval) at `now_ns` if the TAT stays within `tolerance_ns`;
    /// otherwise returns the wait in nanoseconds.
    #[inline]
    pub(crate) fn decide(&self, now_ns: u64, inc_ns: u64, tolerance_ns: u64) -> Result<(), u64> {
        let mut current = self.tat.load(Ordering::Relaxed);
        loop {
            let new_tat = current.max(now_ns).saturating_add(inc_ns);
            let ahead = new_tat - now_ns;
            if ahead > tolerance_ns {
                return Err(ahead - tolerance_ns);
            }
            match self.tat.compare_exchange_weak(
                current,
                new_tat,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(actual) => current = actual,
            }
        }
    }

    /// Whether the bucket is full at `now_ns`: forgetting it then loses nothing.
    pub(crate) fn is_full(&self, now_ns: u64) -> bool {
        self.tat.load(Ordering::Relaxed) <= now_ns
    }

    /// The TAT, in nanoseconds on the owner's clock.
    pub(crate) fn tat(&self) -> u64 {
        self.tat.load(Ordering::Relaxed)
    }
}

/// A token bucket: `rate` tokens per second on average, up to `burst` at once.
///
/// Lock-free: one atomic compare-and-swap per decision. Time is a [`MonotonicClock`], the
/// CPU's time-stamp counter by default; a test that pauses time gives it
/// [`MonotonicClock::tokio`]. Share it behind an `Arc`.
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use backstop::admission::{Quota, TokenBucket};
/// use backstop::clock::MonotonicClock;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let quota = Quota::per_second(NonZeroU32::new(10).unwrap(), NonZeroU32::new(2).unwrap());
/// let bucket = TokenBucket::with_clock(quota, MonotonicClock::tokio());
/// assert!(bucket.check().is_ok());
/// assert!(bucket.check().is_ok());
/// // Empty: the next token comes in 1/10 s.
/// assert_eq!(bucket.check(), Err(Duration::from_millis(100)));
/// tokio::time::advance(Duration::from_millis(100)).await;
/// assert!(bucket.check().is_ok());
/// # }
/// ```
#[derive(Debug)]
pub struct TokenBucket {
    quota: Quota,
    clock: MonotonicClock,
    cell: Cell,
}

impl TokenBucket {
    /// A full bucket earning `rate_per_sec` tokens per second, holding at most `burst`.
    pub fn new(rate_per_sec: NonZeroU32, burst: NonZeroU32) -> Self {
        Self::with_quota(Quota::per_second(rate_per_sec, burst))
    }

    /// A full bucket for `quota`.
    pub fn with_quota(quota: Quota) -> Self {
        Self::with_clock(quota, MonotonicClock::new())
    }

    /// A full bucket for `quota` that reads time from `clock`.
    pub fn with_clock(quota: Quota, clock: MonotonicClock) -> Self {
        Self {
            quota,
            clock,
            cell: Cell::new(),
        }
    }

    /// The clock the bucket reads; its [`now_ns`](MonotonicClock::now_ns) is what
    /// [`check_at`](Self::check_at) takes.
    pub fn clock(&self) -> &MonotonicClock {
        &self.clock
    }

    /// The bucket's quota.
    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// Takes one token, or says how long until one is available.
    #[inline]
    pub fn check(&self) -> Result<(), Duration> {
        self.check_at(self.clock.now_ns())
    }

    /// [`check`](Self::check) at `now_ns` on the bucket's [`clock`](Self::clock) (for callers
    /// that already read it).
    #[inline]
    pub fn check_at(&self, now_ns: u64) -> Result<(), Duration> {
        self.cell
            .decide(now_ns, self.quota.interval_ns, self.quota.tolerance_ns())
            .map_err(Duration::from_nanos)
    }

    /// Takes `cost` tokens at once, or none.
    pub fn try_acquire(&self, cost: u32) -> Result<(), Denied> {
        self.try_acquire_at(self.clock.now_ns(), cost)
    }

    /// [`try_acquire`](Self::try_acquire) at `now_ns` on the bucket's [`clock`](Self::clock).
    pub fn try_acquire_at(&self, now_ns: u64, cost: u32) -> Result<(), Denied> {
        if cost > self.quota.burst {
            return Err(Denied::ExceedsBurst {
                cost,
                burst: self.quota.burst,
            });
        }
        let inc = self.quota.interval_ns.saturating_mul(u64::from(cost));
        self.cell
            .decide(now_ns, inc, self.quota.tolerance_ns())
            .map_err(|ns| Denied::RetryAfter(Duration::from_nanos(ns)))
    }

    /// Tokens available now, rounded down.
    pub fn available(&self) -> u32 {
        let now = self.clock.now_ns();
        let used_ns = self.cell.tat().saturating_sub(now);
        let used = used_ns.div_ceil(self.quota.interval_ns);
        u32::try_from(u64::from(self.quota.burst).saturating_sub(used)).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    /// A bucket on tokio's clock, for tests on paused time.
    fn paused(rate: u32, burst: u32) -> TokenBucket {
        TokenBucket::with_clock(
            Quota::per_second(nz(rate), nz(burst)),
            MonotonicClock::tokio(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn burst_then_rate() {
        let b = paused(100, 5);
        for _ in 0..5 {
            assert_eq!(b.check(), Ok(()));
        }
        assert_eq!(b.check(), Err(Duration::from_millis(10)));
        assert_eq!(b.available(), 0);
        tokio::time::advance(Duration::from_millis(4)).await;
        assert_eq!(b.check(), Err(Duration::from_millis(6)));
        tokio::time::advance(Duration::from_millis(6)).await;
        assert_eq!(b.check(), Ok(()));
        assert_eq!(b.check(), Err(Duration::from_millis(10)));
        // Idle long enough: full again, never more than the burst.
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(b.available(), 5);
        for _ in 0..5 {
            assert_eq!(b.check(), Ok(()));
        }
        assert!(b.check().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn cost_is_all_or_nothing() {
        let b = paused(10, 4);
        assert_eq!(b.try_acquire(3), Ok(()));
        assert_eq!(
            b.try_acquire(2),
            Err(Denied::RetryAfter(Duration::from_millis(100)))
        );
        assert_eq!(b.available(), 1);
        assert_eq!(b.try_acquire(1), Ok(()));
        assert_eq!(
            b.try_acquire(5),
            Err(Denied::ExceedsBurst { cost: 5, burst: 4 })
        );
        assert_eq!(b.try_acquire(0), Ok(()));
    }

    #[test]
    fn quota_validation() {
        assert_eq!(Quota::from_rate(0.0, 1), Err(InvalidQuota::Rate));
        assert_eq!(Quota::from_rate(-3.0, 1), Err(InvalidQuota::Rate));
        assert_eq!(Quota::from_rate(f64::NAN, 1), Err(InvalidQuota::Rate));
        assert_eq!(Quota::from_rate(f64::INFINITY, 1), Err(InvalidQuota::Rate));
        assert_eq!(Quota::from_rate(1.0, 0), Err(InvalidQuota::Burst));
        assert_eq!(Quota::from_rate(1e10, 1), Err(InvalidQuota::Period));
        assert_eq!(
            Quota::with_period(Duration::ZERO, nz(1)),
            Err(InvalidQuota::Period)
        );
        let q = Quota::from_rate(0.5, 3).unwrap();
        assert_eq!(q.interval(), Duration::from_secs(2));
        assert_eq!(q.burst(), 3);
        assert_eq!(
            Quota::per_second(nz(u32::MAX), nz(1)).interval(),
            Duration::from_nanos(1)
        );
        let tiny = Quota::from_rate(1e-300, 1).unwrap();
        assert_eq!(tiny.interval(), Duration::from_nanos(u64::MAX));
    }

    #[tokio::test(start_paused = true)]
    async fn slow_quota_never_overflows() {
        let b = TokenBucket::with_clock(
            Quota::from_rate(1e-300, u32::MAX).unwrap(),
            MonotonicClock::tokio(),
        );
        assert!(b.check().is_ok());
        // Saturating arithmetic: an absurd quota must not panic.
        let _ = b.try_acquire(u32::MAX);
        let _ = b.available();
    }

    #[test]
    fn concurrent_checks_never_exceed_burst() {
        let b = std::sync::Arc::new(TokenBucket::new(nz(1), nz(1_000)));
        let mut handles = Vec::new();
        for _ in 0..4 {
            let b = b.clone();
            handles.push(std::thread::spawn(move || {
                (0..1_000).filter(|_| b.check_at(0).is_ok()).count()
            }));
        }
        let granted: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(granted, 1_000);
    }

    proptest! {
        /// Over any schedule, granted tokens <= burst + rate x elapsed.
        #[test]
        fn never_grants_more_than_burst_plus_rate(
            rate in 1u32..1_000,
            burst in 1u32..50,
            steps in proptest::collection::vec((0u64..50_000_000, 1u32..5), 1..200),
        ) {
            let b = TokenBucket::new(nz(rate), nz(burst));
            let mut now = 0;
            let mut granted = 0u64;
            for (advance_ns, cost) in steps {
                now += advance_ns;
                if b.try_acquire_at(now, cost).is_ok() {
                    granted += u64::from(cost);
                }
            }
            let earned = now / b.quota().interval_ns();
            prop_assert!(granted <= u64::from(burst) + earned);
        }
    }
}
