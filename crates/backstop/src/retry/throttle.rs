//! Client-side adaptive throttling: a client facing a server that sheds load sends less, not
//! more.
//!
//! Each client keeps, over a sliding window, the attempts it wanted to send (`requests`) and
//! those the server accepted (`accepts`: any answer that is not an overload refusal, that is
//! `UNAVAILABLE`/503 with pushback or `RESOURCE_EXHAUSTED`/429), and rejects a new attempt
//! locally, before it reaches the transport, with probability
//!
//! ```text
//! max(0, (requests - K x accepts) / (requests + 1))
//! ```
//!
//! With `K` = 2 a healthy server is never throttled (requests stay under twice the accepts);
//! one that refuses most of its load sees at most about `K x accepts` attempts, so refusals
//! it has to send stay bounded while it recovers. Locally rejected attempts count as
//! requests, so the probability rises as long as the server keeps refusing and falls as soon
//! as it accepts again.
//!
//! ```
//! use backstop::retry::AdaptiveThrottle;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let throttle = AdaptiveThrottle::default();
//! // 100 attempts, 10 accepted: (100 - 2 x 10) / 101.
//! for i in 0..100 {
//!     throttle.record_request();
//!     if i < 10 {
//!         throttle.record_accept();
//!     }
//! }
//! assert!((throttle.reject_probability() - 80.0 / 101.0).abs() < 1e-9);
//! assert!(!throttle.admit_with(0.5), "a draw under the probability is rejected");
//! # }
//! ```

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::time::Instant;

use super::window::SlidingCounts;
use crate::status::{Code, Outcome, Status};

/// An adaptive throttle that cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum ThrottleError {
    /// `K` is not a finite number of at least 1 (below 1 a healthy server would be throttled).
    #[error("adaptive throttling K must be finite and at least 1, got {0}")]
    K(f64),
    /// The window is shorter than a millisecond.
    #[error("adaptive throttling window must be at least 1 ms")]
    Window,
}

/// A destination's adaptive throttle (see the [module docs](self)). Cheap to clone; clones
/// share the counts.
#[derive(Debug, Clone)]
pub struct AdaptiveThrottle {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    k: f64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Requests (first) and accepts (second).
    counts: SlidingCounts,
    /// A seeded generator for reproducible runs; the thread's own otherwise.
    rng: Option<StdRng>,
}

impl Default for AdaptiveThrottle {
    /// `K` = 2 over the last 2 minutes.
    fn default() -> Self {
        Self::build(Self::DEFAULT_K, Self::DEFAULT_WINDOW, Instant::now())
    }
}

impl AdaptiveThrottle {
    /// The multiplier unless configured.
    pub const DEFAULT_K: f64 = 2.0;
    /// The window unless configured.
    pub const DEFAULT_WINDOW: Duration = Duration::from_secs(120);

    /// A throttle with multiplier `k` (at least 1) over `window` (at least 1 ms).
    pub fn new(k: f64, window: Duration) -> Result<Self, ThrottleError> {
        if !(k.is_finite() && k >= 1.0) {
            return Err(ThrottleError::K(k));
        }
        if window < Duration::from_millis(1) {
            return Err(ThrottleError::Window);
        }
        Ok(Self::build(k, window, Instant::now()))
    }

    /// [`new`](Self::new) with the window's slots counted from `origin` instead of now: for a
    /// caller on a virtual clock (a simulation), which then drives the throttle only through
    /// the `..._at` methods.
    pub fn new_at(k: f64, window: Duration, origin: Instant) -> Result<Self, ThrottleError> {
        Self::new(k, window).map(|_| Self::build(k, window, origin))
    }

    fn build(k: f64, window: Duration, origin: Instant) -> Self {
        Self {
            inner: Arc::new(Inner {
                k,
                state: Mutex::new(State {
                    counts: SlidingCounts::new_at(window, origin),
                    rng: None,
                }),
            }),
        }
    }

    /// Draws from a generator seeded with `seed` instead of the thread's: the same calls
    /// then reject the same attempts (tests, reproducible benchmarks).
    pub fn seeded(self, seed: u64) -> Self {
        self.lock().rng = Some(StdRng::seed_from_u64(seed));
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one attempt and decides whether it may be sent: `false` means reject it
    /// locally.
    pub fn admit(&self) -> bool {
        self.admit_at(Instant::now())
    }

    /// [`admit`](Self::admit) at `now`.
    pub fn admit_at(&self, now: Instant) -> bool {
        let mut state = self.lock();
        let draw = match &mut state.rng {
            Some(rng) => rng.random::<f64>(),
            None => rand::rng().random::<f64>(),
        };
        Self::admit_locked(self.inner.k, &mut state, now, draw)
    }

    /// [`admit`](Self::admit) with the random draw given (uniform in `[0, 1)`): rejected when
    /// it falls under the rejection probability.
    pub fn admit_with(&self, draw: f64) -> bool {
        Self::admit_locked(self.inner.k, &mut self.lock(), Instant::now(), draw)
    }

    fn admit_locked(k: f64, state: &mut State, now: Instant, draw: f64) -> bool {
        state.counts.add(now, 1, 0);
        let (requests, accepts) = state.counts.totals(now);
        draw >= probability(k, requests, accepts)
    }

    /// Counts one attempt without deciding (for an attempt sent anyway).
    pub fn record_request(&self) {
        self.lock().counts.add(Instant::now(), 1, 0);
    }

    /// Counts one accepted attempt: an answer that is not an overload refusal.
    pub fn record_accept(&self) {
        self.record_accept_at(Instant::now());
    }

    /// [`record_accept`](Self::record_accept) at `now`.
    pub fn record_accept_at(&self, now: Instant) {
        self.lock().counts.add(now, 0, 1);
    }

    /// The probability with which the next attempt would be rejected, now.
    pub fn reject_probability(&self) -> f64 {
        self.reject_probability_at(Instant::now())
    }

    /// The probability with which an attempt at `now` would be rejected.
    pub fn reject_probability_at(&self, now: Instant) -> f64 {
        let (requests, accepts) = self.lock().counts.totals(now);
        probability(self.inner.k, requests, accepts)
    }

    /// The multiplier `K`.
    pub fn k(&self) -> f64 {
        self.inner.k
    }
}

/// `max(0, (requests - k x accepts) / (requests + 1))`.
fn probability(k: f64, requests: u64, accepts: u64) -> f64 {
    let requests = requests as f64;
    ((requests - k * accepts as f64) / (requests + 1.0)).max(0.0)
}

/// Whether a failed attempt's `status` is the server refusing load (what the throttle does not
/// count as accepted): `UNAVAILABLE` with pushback (a shedding server's 503 with
/// `Retry-After`), `RESOURCE_EXHAUSTED` (429), or a status marked as a refusal.
pub(crate) fn is_overload_refusal(status: &Status) -> bool {
    status.outcome() == Outcome::Rejected
        || status.code() == Code::ResourceExhausted
        || (status.code() == Code::Unavailable && status.pushback().is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_and_window_are_checked() {
        for k in [0.5, f64::NAN, f64::INFINITY, -2.0] {
            assert!(
                matches!(
                    AdaptiveThrottle::new(k, Duration::from_secs(1)),
                    Err(ThrottleError::K(_))
                ),
                "{k}"
            );
        }
        assert!(AdaptiveThrottle::new(1.0, Duration::ZERO).is_err());
        assert_eq!(
            AdaptiveThrottle::new(1.5, Duration::from_secs(1))
                .unwrap()
                .k(),
            1.5
        );
    }

    #[test]
    fn the_probability_follows_the_sre_formula() {
        assert_eq!(probability(2.0, 0, 0), 0.0);
        assert_eq!(probability(2.0, 100, 50), 0.0);
        assert_eq!(probability(2.0, 100, 60), 0.0);
        assert!((probability(2.0, 100, 0) - 100.0 / 101.0).abs() < 1e-12);
        assert!((probability(2.0, 100, 25) - 50.0 / 101.0).abs() < 1e-12);
    }

    #[test]
    fn overload_refusals_are_not_accepts() {
        let retry_after = Duration::from_secs(1);
        assert!(is_overload_refusal(&Status::overloaded(retry_after)));
        assert!(is_overload_refusal(&Status::rate_limited(retry_after)));
        assert!(is_overload_refusal(
            &Status::new(Code::Unavailable, "down").with_pushback(retry_after)
        ));
        assert!(!is_overload_refusal(&Status::new(
            Code::Unavailable,
            "down"
        )));
        assert!(!is_overload_refusal(&Status::new(
            Code::InvalidArgument,
            "bad"
        )));
    }

    /// A server that refuses everything is soon sent almost nothing; once it accepts again the
    /// throttle lets everything through within one window.
    #[tokio::test(start_paused = true)]
    async fn a_refusing_server_is_throttled_until_it_accepts_again() {
        let throttle = AdaptiveThrottle::new(2.0, Duration::from_secs(10))
            .unwrap()
            .seeded(7);
        let mut sent = 0;
        for _ in 0..1_000 {
            if throttle.admit() {
                sent += 1;
            }
            tokio::time::advance(Duration::from_millis(5)).await;
        }
        // All 1,000 within one window: the probability climbs to 1000/1001.
        assert!(sent < 30, "{sent} of 1000 sent to a server refusing all");
        assert!(throttle.reject_probability() > 0.99);

        // The refusals leave the window; the server now accepts every attempt sent.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(throttle.reject_probability(), 0.0);
        let mut sent = 0;
        for _ in 0..1_000 {
            if throttle.admit() {
                sent += 1;
                throttle.record_accept();
            }
            tokio::time::advance(Duration::from_millis(5)).await;
        }
        assert_eq!(sent, 1_000, "a server that accepts is never throttled");
    }

    /// Driven through the `..._at` entry points by a virtual clock and a seed, the throttle
    /// reads no clock and decides the same way every time.
    #[test]
    fn a_virtual_clock_and_a_seed_give_the_same_decisions() {
        let run = || {
            let origin = Instant::now() + Duration::from_secs(3_600);
            let throttle = AdaptiveThrottle::new_at(2.0, Duration::from_secs(10), origin)
                .unwrap()
                .seeded(3);
            let sent: Vec<bool> = (0..200u64)
                .map(|i| throttle.admit_at(origin + Duration::from_millis(i)))
                .collect();
            let at = origin + Duration::from_millis(200);
            assert!(throttle.reject_probability_at(at) > 0.9);
            // The refusals leave the window on the virtual clock.
            let later = origin + Duration::from_secs(11);
            assert_eq!(throttle.reject_probability_at(later), 0.0);
            throttle.record_accept_at(later);
            sent
        };
        let first = run();
        assert!(first.iter().filter(|s| **s).count() < 30);
        assert_eq!(first, run());
        assert!(AdaptiveThrottle::new_at(0.5, Duration::from_secs(1), Instant::now()).is_err());
    }
}
