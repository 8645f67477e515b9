//! Wall-clock time, read through one trait so tests can set it.
//!
//! Two clocks matter to an RPC layer and they must not be mixed up:
//!
//! - the **monotonic** clock measures time left inside one process. [`Deadline`](crate::deadline::Deadline)
//!   and the [`Gate`](crate::admission::Gate) read it through `tokio::time::Instant`, so a test
//!   can pause and advance it. The token buckets decide on every request, where a clock read is
//!   most of the cost, so they read a [`MonotonicClock`]: the CPU's invariant time-stamp counter
//!   by default (via `quanta`), or tokio's clock when a test needs paused time;
//! - the **wall** clock (unix epoch milliseconds) is what a store persists: lease expiry, TTL,
//!   `created_at`. It is read here, through [`Clock`], and passed into store calls as an explicit
//!   `now_ms` so the storage code never reads time itself.
//!
//! Production code holds a [`SystemClock`]; tests hold a [`ManualClock`] and move it by hand.
//!
//! ```
//! use std::time::Duration;
//! use backstop::clock::{Clock, ManualClock};
//!
//! let clock = ManualClock::new(1_000);
//! clock.advance(Duration::from_millis(250));
//! assert_eq!(clock.now_ms(), 1_250);
//! ```

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A monotonic clock in nanoseconds since its own creation, for hot paths.
///
/// [`MonotonicClock::new`] reads the CPU's invariant time-stamp counter where there is one (a
/// few nanoseconds, against about twenty for `Instant::now`) and the operating system's
/// monotonic clock otherwise. [`MonotonicClock::tokio`] reads `tokio::time::Instant`, so a test
/// on a paused runtime moves it with `tokio::time::advance`. Clones share the origin.
///
/// ```
/// use std::time::Duration;
/// use backstop::clock::MonotonicClock;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let clock = MonotonicClock::tokio();
/// tokio::time::advance(Duration::from_millis(3)).await;
/// assert_eq!(clock.now_ns(), 3_000_000);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    source: MonotonicSource,
}

#[derive(Debug, Clone)]
enum MonotonicSource {
    /// A raw counter reading taken at creation, scaled to nanoseconds on each read.
    Counter {
        clock: quanta::Clock,
        origin: u64,
    },
    Tokio {
        origin: tokio::time::Instant,
    },
}

impl MonotonicClock {
    /// The cheapest monotonic clock this machine has, reading zero now.
    ///
    /// The first one in a process calibrates the counter against the operating system's clock
    /// (a busy loop of at most 200 ms); later ones reuse that calibration.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self {
            source: MonotonicSource::Counter { clock, origin },
        }
    }

    /// tokio's clock, reading zero now: paused and advanced with the runtime in tests.
    pub fn tokio() -> Self {
        Self {
            source: MonotonicSource::Tokio {
                origin: tokio::time::Instant::now(),
            },
        }
    }

    /// Nanoseconds since this clock was created (never decreasing).
    #[inline]
    pub fn now_ns(&self) -> u64 {
        match &self.source {
            MonotonicSource::Counter { clock, origin } => {
                clock.delta_as_nanos(*origin, clock.raw())
            }
            MonotonicSource::Tokio { origin } => {
                let elapsed = origin.elapsed();
                // u64 nanoseconds cover 584 years; cheaper than `as_nanos()`'s u128.
                elapsed
                    .as_secs()
                    .saturating_mul(1_000_000_000)
                    .saturating_add(u64::from(elapsed.subsec_nanos()))
            }
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

/// A source of wall-clock time in unix epoch milliseconds.
pub trait Clock: Send + Sync + Debug + 'static {
    /// Milliseconds since the unix epoch (negative before 1970).
    fn now_ms(&self) -> i64;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now_ms(&self) -> i64 {
        (**self).now_ms()
    }
}

impl<C: Clock + ?Sized> Clock for Box<C> {
    fn now_ms(&self) -> i64 {
        (**self).now_ms()
    }
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
            Err(before) => i64::try_from(before.duration().as_millis()).map_or(i64::MIN, |ms| -ms),
        }
    }
}

/// A wall clock that only moves when told to; clones share the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now_ms: Arc<AtomicI64>,
}

impl ManualClock {
    /// A clock reading `now_ms`.
    pub fn new(now_ms: i64) -> Self {
        Self {
            now_ms: Arc::new(AtomicI64::new(now_ms)),
        }
    }

    /// Sets the time to `now_ms` (it may go backwards, as a real wall clock can).
    pub fn set(&self, now_ms: i64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }

    /// Moves the time forward by `by` (saturating; sub-millisecond parts are dropped).
    pub fn advance(&self, by: Duration) {
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        let _ = self
            .now_ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_add(ms))
            });
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_clones_share_time() {
        let a = ManualClock::new(10);
        let b = a.clone();
        a.advance(Duration::from_millis(5));
        assert_eq!(b.now_ms(), 15);
        b.set(3);
        assert_eq!(a.now_ms(), 3);
    }

    #[test]
    fn manual_clock_advance_saturates() {
        let c = ManualClock::new(i64::MAX - 1);
        c.advance(Duration::from_secs(10));
        assert_eq!(c.now_ms(), i64::MAX);
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now_ms() > 1_577_836_800_000);
    }

    #[test]
    fn monotonic_clock_never_goes_back() {
        let clock = MonotonicClock::new();
        let mut last = clock.now_ns();
        for _ in 0..1_000 {
            let now = clock.now_ns();
            assert!(now >= last);
            last = now;
        }
        // Clones share the origin.
        assert!(clock.clone().now_ns() >= last);
    }

    #[tokio::test(start_paused = true)]
    async fn tokio_monotonic_clock_follows_paused_time() {
        let clock = MonotonicClock::tokio();
        assert_eq!(clock.now_ns(), 0);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(clock.clone().now_ns(), 2_000_000_000);
    }

    #[test]
    fn clocks_work_behind_pointers() {
        let shared: Arc<dyn Clock> = Arc::new(ManualClock::new(42));
        assert_eq!(shared.now_ms(), 42);
        let boxed: Box<dyn Clock> = Box::new(ManualClock::new(7));
        assert_eq!(boxed.now_ms(), 7);
    }
}
