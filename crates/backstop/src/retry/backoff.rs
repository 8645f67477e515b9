//! Exponential backoff with jitter, a cap and a floor.
//!
//! Without jitter every client that failed at the same moment retries at the same moment, and
//! the retries arrive as a synchronized pulse. The ceiling for retry `i` (0 for the first retry)
//! is `min(cap, base x 2^i)`; the [`Jitter`] mode decides where below that ceiling the delay
//! lands.
//!
//! Two details matter once the ceiling reaches the cap:
//!
//! - The delay is bounded by the cap *after* jitter has been applied, and the random draw keeps
//!   its width there: at the cap, full jitter still draws from `[floor, cap]`, equal jitter from
//!   `[cap / 2, cap]`. A backoff that first jitters and then clamps a value drawn above the cap
//!   parks most capped clients on exactly `cap`, which is the lockstep jitter exists to break.
//! - The floor raises the low end of the draw instead of piling every short draw onto one
//!   value: full jitter never degenerates into "retry immediately" (a minimum wait such as
//!   10 ms), and a floor above a small ceiling yields the floor.
//!
//! The random number generator is a parameter, so tests use a seeded one and stay
//! deterministic.
//!
//! ```
//! use std::time::Duration;
//! use backstop::retry::{Backoff, Jitter};
//! use rand::{SeedableRng, rngs::StdRng};
//!
//! let backoff = Backoff::default();
//! let mut rng = StdRng::seed_from_u64(7);
//! let mut prev = Duration::ZERO;
//! for retry in 0..10 {
//!     let delay = backoff.delay(retry, prev, &mut rng);
//!     assert!(delay >= Duration::from_millis(10) && delay <= Duration::from_secs(2));
//!     prev = delay;
//! }
//!
//! // Without jitter the delays are the bare ceilings: 50, 100, 200 ms ...
//! let plain = Backoff::new(
//!     Duration::from_millis(50),
//!     Duration::from_secs(2),
//!     Jitter::None,
//!     Duration::ZERO,
//! )?;
//! assert_eq!(plain.delay(2, Duration::ZERO, &mut rng), Duration::from_millis(200));
//! # Ok::<(), backstop::retry::BackoffError>(())
//! ```

use std::time::Duration;

use rand::Rng;

/// How a delay is drawn below the exponential ceiling `min(cap, base x 2^i)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Jitter {
    /// No randomness: the delay is the ceiling itself. Deterministic and monotone; only for
    /// tests and single clients, since a fleet using it retries in lockstep.
    None,
    /// Uniform in `[floor, ceiling]`. Spreads retries the most; the default.
    #[default]
    Full,
    /// Uniform in `[ceiling / 2, ceiling]` (raised to the floor): always waits at least half the
    /// ceiling, at the price of less spread.
    Equal,
    /// Uniform in `[base, min(cap, 3 x previous delay)]`: each delay depends on the previous
    /// one rather than on the retry number, so clients drift apart over time.
    Decorrelated,
}

impl Jitter {
    /// The mode's name in configuration and logs: `none`, `full`, `equal`, `decorrelated`.
    pub fn as_str(self) -> &'static str {
        match self {
            Jitter::None => "none",
            Jitter::Full => "full",
            Jitter::Equal => "equal",
            Jitter::Decorrelated => "decorrelated",
        }
    }
}

/// A backoff that cannot be built: the limits contradict each other.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackoffError {
    /// A zero base would make every ceiling zero.
    #[error("backoff base must be greater than zero")]
    ZeroBase,
    /// The cap is below the base, so even the first ceiling would exceed it.
    #[error("backoff cap {cap:?} is below the base {base:?}")]
    CapBelowBase {
        /// The configured base.
        base: Duration,
        /// The configured cap.
        cap: Duration,
    },
    /// The floor is above the cap, so no delay could satisfy both.
    #[error("backoff floor {floor:?} is above the cap {cap:?}")]
    FloorAboveCap {
        /// The configured floor.
        floor: Duration,
        /// The configured cap.
        cap: Duration,
    },
}

/// Exponential backoff: `base x 2^i`, bounded by `cap`, jittered, never below `floor`.
///
/// Every delay lies in `[floor, cap]`. The defaults are base
/// 50 ms, cap 2 s, [`Jitter::Full`], floor 10 ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    jitter: Jitter,
    floor: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(50),
            cap: Duration::from_secs(2),
            jitter: Jitter::Full,
            floor: Duration::from_millis(10),
        }
    }
}

impl Backoff {
    /// A backoff with the given limits.
    ///
    /// Fails when `base` is zero, `cap < base`, or `floor > cap`.
    pub fn new(
        base: Duration,
        cap: Duration,
        jitter: Jitter,
        floor: Duration,
    ) -> Result<Backoff, BackoffError> {
        if base.is_zero() {
            return Err(BackoffError::ZeroBase);
        }
        if cap < base {
            return Err(BackoffError::CapBelowBase { base, cap });
        }
        if floor > cap {
            return Err(BackoffError::FloorAboveCap { floor, cap });
        }
        Ok(Backoff {
            base,
            cap,
            jitter,
            floor,
        })
    }

    /// The same limits with another jitter mode.
    pub fn with_jitter(self, jitter: Jitter) -> Backoff {
        Backoff { jitter, ..self }
    }

    /// The delay before the first retry's ceiling doubles: `base x 2^0`.
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The largest delay ever returned.
    pub fn cap(&self) -> Duration {
        self.cap
    }

    /// How delays are drawn below the ceiling.
    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// The smallest delay ever returned.
    pub fn floor(&self) -> Duration {
        self.floor
    }

    /// The ceiling for retry `retry` (0 for the first retry): `min(cap, base x 2^retry)`,
    /// saturating instead of overflowing.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let base = nanos(self.base);
        let cap = nanos(self.cap);
        let raw = if retry >= u64::BITS {
            cap
        } else {
            base.saturating_mul(1u64 << retry)
        };
        Duration::from_nanos(raw.min(cap))
    }

    /// The delay before retry `retry` (0 for the first retry, i.e. the second attempt).
    ///
    /// `prev` is the previous delay returned for this logical request (`Duration::ZERO` before
    /// the first retry); only [`Jitter::Decorrelated`] reads it. The result always lies in
    /// `[floor, cap]`.
    pub fn delay<R: Rng + ?Sized>(&self, retry: u32, prev: Duration, rng: &mut R) -> Duration {
        let floor = nanos(self.floor);
        let cap = nanos(self.cap);
        let ceiling = nanos(self.ceiling(retry));
        let drawn = match self.jitter {
            Jitter::None => ceiling,
            Jitter::Full => uniform(rng, floor, ceiling.max(floor)),
            Jitter::Equal => uniform(rng, (ceiling / 2).max(floor), ceiling.max(floor)),
            Jitter::Decorrelated => {
                let base = nanos(self.base);
                let prev = if prev.is_zero() { base } else { nanos(prev) };
                let low = base.max(floor);
                // Bound the range by the cap before drawing: drawing up to 3 x prev and then
                // clamping would put about two thirds of the capped clients on exactly `cap`.
                let high = prev.saturating_mul(3).min(cap).max(low);
                uniform(rng, low, high)
            }
        };
        // The cap is applied after jitter; the bounds above already keep the draw inside it,
        // so this only guards the invariant.
        Duration::from_nanos(drawn.clamp(floor, cap))
    }
}

/// Nanoseconds in `d`, saturating at `u64::MAX` (about 584 years).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Uniform in `[low, high]`; `low` when the range is empty or a single point.
fn uniform<R: Rng + ?Sized>(rng: &mut R, low: u64, high: u64) -> u64 {
    if low >= high {
        low
    } else {
        rng.random_range(low..=high)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{SeedableRng, rngs::StdRng};

    const MS: Duration = Duration::from_millis(1);

    fn jitter_strategy() -> impl Strategy<Value = Jitter> {
        prop_oneof![
            Just(Jitter::None),
            Just(Jitter::Full),
            Just(Jitter::Equal),
            Just(Jitter::Decorrelated),
        ]
    }

    /// Limits with `floor <= base <= cap`, or a floor above the base (still <= cap).
    fn backoff_strategy() -> impl Strategy<Value = Backoff> {
        (1u64..5_000, 0u64..20_000, 0u64..=100, jitter_strategy()).prop_map(
            |(base, extra, floor_pct, jitter)| {
                let base = base * 1_000;
                let cap = base + extra * 1_000;
                let floor = cap * floor_pct / 100;
                Backoff::new(
                    Duration::from_micros(base),
                    Duration::from_micros(cap),
                    jitter,
                    Duration::from_micros(floor),
                )
                .expect("strategy builds valid limits")
            },
        )
    }

    #[test]
    fn defaults_follow_the_design() {
        let b = Backoff::default();
        assert_eq!(b.base(), 50 * MS);
        assert_eq!(b.cap(), Duration::from_secs(2));
        assert_eq!(b.jitter(), Jitter::Full);
        assert_eq!(b.floor(), 10 * MS);
    }

    #[test]
    fn ceilings_double_until_the_cap() {
        let b = Backoff::default();
        let ceilings: Vec<u64> = (0..8).map(|i| b.ceiling(i).as_millis() as u64).collect();
        assert_eq!(ceilings, [50, 100, 200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(b.ceiling(u32::MAX), b.cap());
        assert_eq!(b.ceiling(63), b.cap());
    }

    #[test]
    fn invalid_limits_are_rejected() {
        assert_eq!(
            Backoff::new(Duration::ZERO, MS, Jitter::Full, Duration::ZERO),
            Err(BackoffError::ZeroBase)
        );
        assert_eq!(
            Backoff::new(2 * MS, MS, Jitter::Full, Duration::ZERO),
            Err(BackoffError::CapBelowBase {
                base: 2 * MS,
                cap: MS
            })
        );
        assert_eq!(
            Backoff::new(MS, 2 * MS, Jitter::Full, 3 * MS),
            Err(BackoffError::FloorAboveCap {
                floor: 3 * MS,
                cap: 2 * MS
            })
        );
    }

    #[test]
    fn full_jitter_at_the_cap_spans_floor_to_cap() {
        let b = Backoff::default();
        let mut rng = StdRng::seed_from_u64(1);
        let draws: Vec<Duration> = (0..2_000)
            .map(|_| b.delay(30, Duration::ZERO, &mut rng))
            .collect();
        let min = *draws.iter().min().unwrap();
        let max = *draws.iter().max().unwrap();
        assert!(min >= 10 * MS && min < 100 * MS, "min {min:?}");
        assert!(max <= b.cap() && max > 1_900 * MS, "max {max:?}");
        let at_cap = draws.iter().filter(|d| **d == b.cap()).count();
        assert!(at_cap <= 1, "{at_cap} draws landed exactly on the cap");
    }

    #[test]
    fn equal_jitter_at_the_cap_spans_half_cap_to_cap() {
        let b = Backoff::default().with_jitter(Jitter::Equal);
        let mut rng = StdRng::seed_from_u64(2);
        for _ in 0..2_000 {
            let d = b.delay(30, Duration::ZERO, &mut rng);
            assert!(d >= Duration::from_secs(1) && d <= b.cap(), "{d:?}");
        }
    }

    #[test]
    fn decorrelated_stays_random_at_the_cap() {
        let b = Backoff::default().with_jitter(Jitter::Decorrelated);
        let mut rng = StdRng::seed_from_u64(3);
        let draws: Vec<Duration> = (0..2_000).map(|_| b.delay(9, b.cap(), &mut rng)).collect();
        let at_cap = draws.iter().filter(|d| **d == b.cap()).count();
        assert!(at_cap <= 1, "{at_cap} draws landed exactly on the cap");
        assert!(draws.iter().all(|d| *d >= b.base() && *d <= b.cap()));
    }

    #[test]
    fn decorrelated_first_delay_is_base_to_three_base() {
        let b = Backoff::default().with_jitter(Jitter::Decorrelated);
        let mut rng = StdRng::seed_from_u64(4);
        for _ in 0..1_000 {
            let d = b.delay(0, Duration::ZERO, &mut rng);
            assert!(d >= 50 * MS && d <= 150 * MS, "{d:?}");
        }
    }

    #[test]
    fn floor_above_a_small_ceiling_yields_the_floor() {
        let b = Backoff::new(MS, Duration::from_secs(1), Jitter::Full, 20 * MS).unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        assert_eq!(b.delay(0, Duration::ZERO, &mut rng), 20 * MS);
        assert_eq!(
            b.with_jitter(Jitter::None)
                .delay(0, Duration::ZERO, &mut rng),
            20 * MS
        );
    }

    #[test]
    fn same_seed_same_delays() {
        let b = Backoff::default();
        let run = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..8)
                .map(|i| b.delay(i, Duration::ZERO, &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(9), run(9));
        assert_ne!(run(9), run(10));
    }

    proptest! {
        #[test]
        fn every_delay_lies_between_floor_and_cap(
            b in backoff_strategy(),
            retry in 0u32..200,
            prev_us in 0u64..100_000_000,
            seed in any::<u64>(),
        ) {
            let mut rng = StdRng::seed_from_u64(seed);
            let d = b.delay(retry, Duration::from_micros(prev_us), &mut rng);
            prop_assert!(d >= b.floor() && d <= b.cap(), "{:?} outside [{:?}, {:?}]", d, b.floor(), b.cap());
        }

        #[test]
        fn jittered_delays_at_the_cap_still_vary(
            base_ms in 1u64..500,
            cap_factor in 4u64..100,
            floor_pct in 0u64..40,
            jitter in prop_oneof![Just(Jitter::Full), Just(Jitter::Equal), Just(Jitter::Decorrelated)],
            seed in any::<u64>(),
        ) {
            let cap = base_ms * cap_factor;
            let b = Backoff::new(
                Duration::from_millis(base_ms),
                Duration::from_millis(cap),
                jitter,
                Duration::from_millis(cap * floor_pct / 100),
            ).unwrap();
            let mut rng = StdRng::seed_from_u64(seed);
            let draws: Vec<Duration> = (0..32).map(|_| b.delay(64, b.cap(), &mut rng)).collect();
            prop_assert!(draws.iter().any(|d| *d != draws[0]), "capped delays all equal: {:?}", draws[0]);
            let at_cap = draws.iter().filter(|d| **d == b.cap()).count();
            prop_assert!(at_cap < 4, "{} of 32 capped delays sit exactly on the cap", at_cap);
        }

        #[test]
        fn no_jitter_is_deterministic_and_monotone(
            b in backoff_strategy(),
            seed_a in any::<u64>(),
            seed_b in any::<u64>(),
        ) {
            let b = b.with_jitter(Jitter::None);
            let mut rng_a = StdRng::seed_from_u64(seed_a);
            let mut rng_b = StdRng::seed_from_u64(seed_b);
            let mut last = Duration::ZERO;
            for retry in 0..80 {
                let d = b.delay(retry, last, &mut rng_a);
                prop_assert_eq!(d, b.delay(retry, Duration::ZERO, &mut rng_b));
                prop_assert!(d >= last);
                last = d;
            }
            prop_assert_eq!(last, b.cap());
        }
    }
}
