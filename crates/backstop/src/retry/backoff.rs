//! Exponential backoff with jitter, a cap and a floor.
//!
//! Without jitter every client that failed at the same moment retries at the same moment, and
//! the retries arrive as a synchronized pulse. The ceiling for retry `i` (0 for the first retry)
//! is `min(cap, base x multiplier^i)`, the multiplier being 2 unless set (gRPC's
//! `backoffMultiplier`); the [`Jitter`] mode decides where below that ceiling the delay lands.
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

use rand::{Rng, RngExt};

// The defaults of every backoff nobody configured, a method policy's included: defined here,
// beside the type, so that `policy` stays plain data that needs nothing of `retry`.

/// The first retry's backoff ceiling.
pub const DEFAULT_BACKOFF_BASE: Duration = Duration::from_millis(50);

/// The largest backoff delay.
pub const DEFAULT_BACKOFF_CAP: Duration = Duration::from_secs(2);

/// The smallest backoff delay: full jitter never degenerates into "retry at once".
pub const DEFAULT_BACKOFF_FLOOR: Duration = Duration::from_millis(10);

/// How much each retry's backoff ceiling grows over the one before (gRPC's
/// `backoffMultiplier`).
pub const DEFAULT_BACKOFF_MULTIPLIER: f64 = 2.0;

/// Where below the ceiling a backoff delay is drawn: anywhere from the floor, which spreads a
/// fleet's retries the most.
pub const DEFAULT_JITTER: Jitter = Jitter::Full;

/// How a delay is drawn below the exponential ceiling `min(cap, base x multiplier^i)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Jitter {
    /// No randomness: the delay is the ceiling itself. Deterministic and monotone; only for
    /// tests and single clients, since a fleet using it retries in lockstep.
    None,
    /// Uniform in `[floor, ceiling]`. Spreads retries the most; the default
    /// ([`DEFAULT_JITTER`]).
    Full,
    /// Uniform in `[ceiling / 2, ceiling]` (raised to the floor): always waits at least half the
    /// ceiling, at the price of less spread.
    Equal,
    /// Uniform in `[base, min(cap, 3 x previous delay)]`: each delay depends on the previous
    /// one rather than on the retry number, so clients drift apart over time.
    Decorrelated,
}

impl Default for Jitter {
    fn default() -> Self {
        DEFAULT_JITTER
    }
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
    /// The multiplier is not a finite number above zero.
    #[error("backoff multiplier must be a finite number above 0, got {0}")]
    Multiplier(String),
}

/// Exponential backoff: `base x multiplier^i`, bounded by `cap`, jittered, never below `floor`.
///
/// Every delay lies in `[floor, cap]`. The defaults, [`DEFAULT_BACKOFF_BASE`] and the
/// constants beside it, are base 50 ms, cap 2 s, multiplier 2, [`Jitter::Full`], floor 10 ms.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    jitter: Jitter,
    floor: Duration,
    /// Finite and above zero (checked by `with_multiplier`), so comparing bits is equality.
    multiplier: f64,
}

impl PartialEq for Backoff {
    fn eq(&self, other: &Self) -> bool {
        (self.base, self.cap, self.jitter, self.floor)
            == (other.base, other.cap, other.jitter, other.floor)
            && self.multiplier.to_bits() == other.multiplier.to_bits()
    }
}

impl Eq for Backoff {}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: DEFAULT_BACKOFF_BASE,
            cap: DEFAULT_BACKOFF_CAP,
            jitter: DEFAULT_JITTER,
            floor: DEFAULT_BACKOFF_FLOOR,
            multiplier: DEFAULT_BACKOFF_MULTIPLIER,
        }
    }
}

impl Backoff {
    /// A backoff with the given limits, each ceiling twice the one before
    /// ([`with_multiplier`](Self::with_multiplier) changes that).
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
            multiplier: DEFAULT_BACKOFF_MULTIPLIER,
        })
    }

    /// The same limits with each ceiling `multiplier` times the one before (gRPC's
    /// `backoffMultiplier`). Fails unless `multiplier` is finite and above zero; below 1 the
    /// ceilings shrink, as gRPC allows, and the floor still holds.
    pub fn with_multiplier(self, multiplier: f64) -> Result<Backoff, BackoffError> {
        if !(multiplier.is_finite() && multiplier > 0.0) {
            return Err(BackoffError::Multiplier(multiplier.to_string()));
        }
        Ok(Backoff { multiplier, ..self })
    }

    /// The same limits with another jitter mode.
    pub fn with_jitter(self, jitter: Jitter) -> Backoff {
        Backoff { jitter, ..self }
    }

    /// The first retry's ceiling: `base x multiplier^0`.
    pub fn base(&self) -> Duration {
        self.base
    }

    /// How much each ceiling grows over the one before.
    pub fn multiplier(&self) -> f64 {
        self.multiplier
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

    /// The ceiling for retry `retry` (0 for the first retry):
    /// `min(cap, base x multiplier^retry)`, saturating instead of overflowing.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let base = nanos(self.base);
        let cap = nanos(self.cap);
        let raw = if self.multiplier == 2.0 {
            // Exact, in integers, for the usual doubling.
            if retry >= u64::BITS {
                cap
            } else {
                base.saturating_mul(1u64 << retry)
            }
        } else {
            let exponent = i32::try_from(retry).unwrap_or(i32::MAX);
            let raw = base as f64 * self.multiplier.powi(exponent);
            // `as` saturates (and maps NaN to 0, which cannot occur here).
            if raw >= cap as f64 { cap } else { raw as u64 }
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

/// A [`Backoff`] makes tower backoff sessions, so a [`tower::retry::Policy`] can wait with
/// backstop's delays: one [`BackoffSession`] per logical request, whose `n`-th
/// `next_backoff` waits what [`RetryPolicy`](super::RetryPolicy) waits before its `n`-th
/// retry. Server pushback, which `RetryPolicy` waits instead when a failure carries one, is
/// left to the tower policy: a tower backoff never sees the response.
///
/// ```
/// use std::time::Duration;
/// use backstop::retry::{Backoff, Jitter};
/// use tokio::time::Instant;
/// use tower::retry::backoff::{Backoff as _, MakeBackoff};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), backstop::retry::BackoffError> {
/// let ms = Duration::from_millis(1);
/// let mut backoff = Backoff::new(50 * ms, 2_000 * ms, Jitter::Equal, 10 * ms)?;
/// let mut session = backoff.make_backoff();
/// for retry in 0..8 {
///     let ceiling = backoff.ceiling(retry); // 50, 100, 200 ... 2000 ms
///     let wait = session.next_backoff();
///     let delay = wait.deadline() - Instant::now();
///     // Equal jitter: at least half the ceiling, at most the ceiling.
///     assert!(delay >= ceiling / 2 && delay <= ceiling, "retry {retry}: {delay:?}");
///     wait.await;
/// }
/// # Ok(())
/// # }
/// ```
impl tower::retry::backoff::MakeBackoff for Backoff {
    type Backoff = BackoffSession;

    fn make_backoff(&mut self) -> BackoffSession {
        BackoffSession {
            backoff: *self,
            retries: 0,
            prev: Duration::ZERO,
        }
    }
}

/// One logical request's backoff delays as a tower [`Backoff`](tower::retry::backoff::Backoff),
/// made by [`MakeBackoff`](tower::retry::backoff::MakeBackoff) on a [`Backoff`].
///
/// The `n`-th [`next_backoff`](tower::retry::backoff::Backoff::next_backoff) sleeps
/// [`Backoff::delay`] for retry `n - 1`, given the session's previous delay (read by
/// [`Jitter::Decorrelated`]) and drawn from the thread's generator, as
/// [`RetryPolicy`](super::RetryPolicy) draws its own.
///
/// Cloning starts over at the first retry, as tower's `Backoff` contract asks: a clone is the
/// next request's session, not a copy of this one's progress (a copy would make the next
/// request's first retry wait as long as this request's last).
#[derive(Debug)]
pub struct BackoffSession {
    backoff: Backoff,
    /// Delays drawn so far: the retry the next one is for.
    retries: u32,
    /// The last delay drawn (`ZERO` before the first), read by [`Jitter::Decorrelated`].
    prev: Duration,
}

impl BackoffSession {
    /// The limits the delays are drawn within.
    pub fn backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// Delays drawn so far in this session.
    pub fn retries(&self) -> u32 {
        self.retries
    }
}

impl Clone for BackoffSession {
    fn clone(&self) -> Self {
        BackoffSession {
            backoff: self.backoff,
            retries: 0,
            prev: Duration::ZERO,
        }
    }
}

/// ```
/// use std::time::Duration;
/// use backstop::retry::{Backoff, Jitter};
/// use tokio::time::Instant;
/// use tower::retry::backoff::{Backoff as _, MakeBackoff};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> Result<(), backstop::retry::BackoffError> {
/// let ms = Duration::from_millis(1);
/// let mut session = Backoff::new(50 * ms, 2_000 * ms, Jitter::None, ms)?.make_backoff();
/// let start = Instant::now();
/// for _ in 0..3 {
///     session.next_backoff().await; // 50, 100, 200 ms without jitter
/// }
/// assert_eq!(start.elapsed(), 350 * ms);
/// // A clone starts over, for the next request.
/// let mut next = session.clone();
/// assert_eq!(next.next_backoff().deadline() - Instant::now(), 50 * ms);
/// # Ok(())
/// # }
/// ```
impl tower::retry::backoff::Backoff for BackoffSession {
    type Future = tokio::time::Sleep;

    fn next_backoff(&mut self) -> tokio::time::Sleep {
        let delay = self
            .backoff
            .delay(self.retries, self.prev, &mut rand::rng());
        self.retries = self.retries.saturating_add(1);
        self.prev = delay;
        tokio::time::sleep(delay)
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
    fn the_multiplier_sets_how_fast_ceilings_grow() {
        let b = Backoff::default().with_multiplier(3.0).unwrap();
        let ceilings: Vec<u64> = (0..6).map(|i| b.ceiling(i).as_millis() as u64).collect();
        assert_eq!(ceilings, [50, 150, 450, 1350, 2000, 2000]);
        assert_eq!(b.ceiling(u32::MAX), b.cap());
        let slow = Backoff::default().with_multiplier(1.5).unwrap();
        let ceilings: Vec<u64> = (0..4).map(|i| slow.ceiling(i).as_millis() as u64).collect();
        assert_eq!(ceilings, [50, 75, 112, 168]);
        // Below 1 the ceilings shrink, and the floor still holds.
        let shrinking = Backoff::default()
            .with_multiplier(0.5)
            .unwrap()
            .with_jitter(Jitter::None);
        let mut rng = StdRng::seed_from_u64(6);
        assert_eq!(shrinking.delay(1, Duration::ZERO, &mut rng), 25 * MS);
        assert_eq!(shrinking.delay(40, Duration::ZERO, &mut rng), 10 * MS);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                Backoff::default().with_multiplier(bad),
                Err(BackoffError::Multiplier(_))
            ));
        }
        assert_ne!(b, Backoff::default());
        assert_eq!(
            Backoff::default().with_multiplier(2.0).unwrap(),
            Backoff::default()
        );
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

    /// Where [`Jitter`]'s documentation puts retry `retry`'s delay, `prev` being the delay
    /// before it (`ZERO` before the first retry).
    fn jitter_bounds(b: &Backoff, retry: u32, prev: Duration) -> (Duration, Duration) {
        let (floor, cap, ceiling) = (b.floor(), b.cap(), b.ceiling(retry));
        match b.jitter() {
            Jitter::None => (ceiling.max(floor), ceiling.max(floor)),
            Jitter::Full => (floor, ceiling.max(floor)),
            Jitter::Equal => ((ceiling / 2).max(floor), ceiling.max(floor)),
            Jitter::Decorrelated => {
                let prev = if prev.is_zero() { b.base() } else { prev };
                let low = b.base().max(floor);
                (low, (prev * 3).min(cap).max(low))
            }
        }
    }

    /// Every limit shape the tower tests run: floor below the base, floor above the first
    /// ceilings, a cap reached after a few retries.
    fn tower_limits() -> Vec<Backoff> {
        let modes = [
            Jitter::None,
            Jitter::Full,
            Jitter::Equal,
            Jitter::Decorrelated,
        ];
        let shapes = [
            (50 * MS, 2_000 * MS, 10 * MS),
            (MS, 40 * MS, 15 * MS),
            (7 * MS, 100 * MS, Duration::ZERO),
        ];
        modes
            .into_iter()
            .flat_map(|jitter| {
                shapes.map(|(base, cap, floor)| Backoff::new(base, cap, jitter, floor).unwrap())
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn tower_sessions_sleep_within_the_jitter_bounds() {
        use tokio::time::Instant;
        use tower::retry::backoff::{Backoff as _, MakeBackoff};

        for mut backoff in tower_limits() {
            let mut longest = Duration::ZERO;
            // Several sessions, so the jittered modes draw many delays per retry.
            for _ in 0..20 {
                let mut session = backoff.make_backoff();
                let mut prev = Duration::ZERO;
                for retry in 0..12 {
                    let (low, high) = jitter_bounds(&backoff, retry, prev);
                    let sleep = session.next_backoff();
                    let delay = sleep.deadline() - Instant::now();
                    assert!(
                        low <= delay && delay <= high,
                        "{backoff:?} retry {retry}: {delay:?} outside [{low:?}, {high:?}]"
                    );
                    let slept_from = Instant::now();
                    sleep.await;
                    assert!(slept_from.elapsed() >= delay);
                    prev = delay;
                    longest = longest.max(delay);
                }
                assert_eq!(session.retries(), 12);
            }
            if backoff.jitter() == Jitter::Decorrelated {
                // Decorrelated delays grow from the previous one, beyond the first retry's
                // range (a session that forgot them would stay there).
                let (_, first_high) = jitter_bounds(&backoff, 0, Duration::ZERO);
                assert!(longest > first_high, "{backoff:?}: longest {longest:?}");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn tower_session_clones_start_over() {
        use tokio::time::Instant;
        use tower::retry::backoff::{Backoff as _, MakeBackoff};

        let mut backoff = Backoff::default().with_jitter(Jitter::None);
        let mut session = backoff.make_backoff();
        let delays: Vec<Duration> = (0..5)
            .map(|_| session.next_backoff().deadline() - Instant::now())
            .collect();
        assert_eq!(delays, [50 * MS, 100 * MS, 200 * MS, 400 * MS, 800 * MS]);
        let mut next = session.clone();
        assert_eq!(next.retries(), 0);
        assert_eq!(next.next_backoff().deadline() - Instant::now(), 50 * MS);
        assert_eq!(
            session.next_backoff().deadline() - Instant::now(),
            1_600 * MS
        );
    }

    /// Our backoff as the waits of tower's own `Retry`: each wait within its retry's jitter
    /// bounds, and the request takes as long as its waits (on the paused clock, up to the
    /// timer's millisecond rounding of each).
    #[tokio::test(start_paused = true)]
    async fn tower_retry_waits_our_delays() {
        use std::future::ready;
        use std::sync::{Arc, Mutex};
        use tokio::time::{Instant, Sleep};
        use tower::retry::backoff::MakeBackoff;
        use tower::retry::{Policy, Retry};
        use tower::{ServiceExt, service_fn};

        const FAILURES: u32 = 6;

        /// Retries every failure after the session's next wait, recording the waits.
        #[derive(Clone)]
        struct Waiting<B> {
            session: B,
            waits: Arc<Mutex<Vec<Duration>>>,
        }

        impl<B, Req, Res, E> Policy<Req, Res, E> for Waiting<B>
        where
            B: tower::retry::backoff::Backoff<Future = Sleep>,
            Req: Clone,
        {
            type Future = Sleep;

            fn retry(&mut self, _: &mut Req, result: &mut Result<Res, E>) -> Option<Sleep> {
                result.is_err().then(|| {
                    let sleep = self.session.next_backoff();
                    let wait = sleep.deadline() - Instant::now();
                    self.waits.lock().unwrap().push(wait);
                    sleep
                })
            }

            fn clone_request(&mut self, request: &Req) -> Option<Req> {
                Some(request.clone())
            }
        }

        for mut backoff in tower_limits() {
            let waits = Arc::new(Mutex::new(Vec::new()));
            let policy = Waiting {
                session: backoff.make_backoff(),
                waits: Arc::clone(&waits),
            };
            let calls = Arc::new(Mutex::new(0u32));
            let flaky = {
                let calls = Arc::clone(&calls);
                service_fn(move |()| {
                    let mut calls = calls.lock().unwrap();
                    *calls += 1;
                    ready(if *calls > FAILURES {
                        Ok(())
                    } else {
                        Err("unavailable")
                    })
                })
            };
            let start = Instant::now();
            Retry::new(policy, flaky).oneshot(()).await.unwrap();
            let elapsed = start.elapsed();

            let waits = waits.lock().unwrap();
            assert_eq!(waits.len(), FAILURES as usize, "{backoff:?}");
            let mut prev = Duration::ZERO;
            for (retry, wait) in (0..).zip(waits.iter()) {
                let (low, high) = jitter_bounds(&backoff, retry, prev);
                assert!(
                    low <= *wait && *wait <= high,
                    "{backoff:?} retry {retry}: {wait:?} outside [{low:?}, {high:?}]"
                );
                prev = *wait;
            }
            let waited: Duration = waits.iter().sum();
            assert!(
                waited <= elapsed && elapsed < waited + FAILURES * MS,
                "{backoff:?}: {elapsed:?} elapsed for {waited:?} of waits"
            );
        }
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
