//! Concurrency limits for the [`Gate`](super::Gate): fixed, or found from observed latency.
//!
//! A [`Limit`] is told how long each admitted request took ([`Limit::on_sample`]) and answers
//! how many requests may run at once ([`Limit::limit`]). [`FixedLimit`] ignores the samples;
//! [`Gradient2`] lowers itself when latency rises above its long-run baseline and grows back when
//! it falls, the way Netflix's concurrency-limits `Gradient2Limit` and Envoy's adaptive
//! concurrency filter do. [`SlowStart`] wraps either: it drops the limit to a small floor when
//! most recent requests fail (a dependency is down) and, once they succeed again, ramps it back
//! up by doubling per round trip instead of releasing the whole backlog at once. Samples are
//! passed in, so a limit reads no clock and is deterministic.

use std::fmt;
use std::time::Duration;

/// How many requests may run at once, possibly learned from the latency of those that ran.
pub trait Limit: fmt::Debug + Send + 'static {
    /// Requests admitted at once now (at least 1).
    fn limit(&self) -> usize;

    /// A request admitted through the gate finished after `rtt`; `inflight` requests (this one
    /// included) held a slot when it did.
    fn on_sample(&mut self, rtt: Duration, inflight: usize);

    /// A request was abandoned (cancelled by its caller) after running `elapsed`: its latency is
    /// only known to be at least that. Ignored unless the limit says otherwise.
    fn on_abandoned(&mut self, elapsed: Duration, inflight: usize) {
        let _ = (elapsed, inflight);
    }

    /// A request admitted through the gate failed (a 5xx or a gRPC error) after `elapsed`.
    /// Its latency says little about serving time (a fast failure is no evidence of fast
    /// service), so by default it is treated as abandoned work.
    fn on_failure(&mut self, elapsed: Duration, inflight: usize) {
        self.on_abandoned(elapsed, inflight);
    }
}

/// A limit that never moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedLimit(usize);

impl FixedLimit {
    /// `limit` requests at once (raised to 1 if zero).
    pub fn new(limit: usize) -> Self {
        Self(limit.max(1))
    }
}

impl Limit for FixedLimit {
    fn limit(&self) -> usize {
        self.0
    }

    fn on_sample(&mut self, _: Duration, _: usize) {}
}

/// Short-window smoothing: about the last 10 samples.
const SHORT_WINDOW: f64 = 10.0;
/// Long-window smoothing: about the last 500 samples, the baseline.
const LONG_WINDOW: f64 = 500.0;
/// Latency may grow to this multiple of the baseline before the limit shrinks: below it,
/// more concurrency is not (yet) queueing.
const TOLERANCE: f64 = 1.5;
/// Weight of each new estimate in the limit (the rest is the previous limit).
const SMOOTHING: f64 = 0.2;
/// The limit shrinks by at most half of itself per sample, however bad the gradient.
const MIN_GRADIENT: f64 = 0.5;
/// A baseline more than this multiple of the short-window latency is decayed: latency fell
/// for good and the limit should not wait 500 samples to believe it.
const DRIFT: f64 = 2.0;
/// Decay factor applied to a drifted baseline per sample.
const DRIFT_DECAY: f64 = 0.95;

/// A gradient-based adaptive limit (in the style of Netflix's `Gradient2Limit`).
///
/// It keeps two exponentially weighted averages of the request latency: a short one (the last
/// ~10 samples, what the service does now) and a long one (the last ~500, its baseline). Each
/// sample computes
///
/// ```text
/// gradient  = clamp(1.5 × long / short, 0.5, 1.0)
/// estimate  = limit × gradient + (√limit if gradient = 1, else 0)   // room for a small queue
/// limit     = clamp(0.8 × limit + 0.2 × estimate, min, max)
/// ```
///
/// so while latency stays within 1.5× the baseline the limit grows by about `0.2 × √limit` per
/// sample, and when it rises beyond, the limit shrinks (by at most 10% per sample) until
/// latency is back within tolerance or the baseline has followed it. A limit
/// that is not used (fewer than half its slots held) does not grow: there is no evidence that
/// more would be served well. When latency falls for good, a baseline above twice the short
/// average decays by 5% per sample so the limit recovers within tens of samples, not hundreds.
///
/// A request abandoned by its caller after `elapsed` counts as a sample only when `elapsed` is
/// above the short average: it then proves latency is at least that high (a deadline that
/// expires in a slow service must lower the limit), while an early cancellation says nothing.
///
/// ```
/// use std::time::Duration;
/// use backstop::admission::{Gradient2, Limit};
///
/// let mut limit = Gradient2::new(4, 64);
/// assert_eq!(limit.limit(), 64); // starts at the upper bound
/// for _ in 0..50 {
///     limit.on_sample(Duration::from_millis(100), 64);
/// }
/// for _ in 0..20 {
///     limit.on_sample(Duration::from_millis(600), 64);
/// }
/// assert!(limit.limit() < 16, "{}", limit.limit());
/// ```
#[derive(Debug, Clone)]
pub struct Gradient2 {
    min: usize,
    max: usize,
    estimate: f64,
    short: Option<f64>,
    long: Option<f64>,
}

impl Gradient2 {
    /// A limit kept within `min..=max` (`min` raised to 1, `max` to `min`), starting at `max`.
    pub fn new(min: usize, max: usize) -> Self {
        let min = min.max(1);
        let max = max.max(min);
        Self {
            min,
            max,
            estimate: max as f64,
            short: None,
            long: None,
        }
    }

    /// Starts at `initial` (within the bounds) instead of the upper bound.
    pub fn initial(mut self, initial: usize) -> Self {
        self.estimate = initial.clamp(self.min, self.max) as f64;
        self
    }

    /// The lower bound.
    pub fn min(&self) -> usize {
        self.min
    }

    /// The upper bound.
    pub fn max(&self) -> usize {
        self.max
    }

    /// The short-window (recent) latency average, once a sample was seen.
    pub fn short_rtt(&self) -> Option<Duration> {
        self.short.map(Duration::from_secs_f64)
    }

    /// The long-window (baseline) latency average, once a sample was seen.
    pub fn long_rtt(&self) -> Option<Duration> {
        self.long.map(Duration::from_secs_f64)
    }
}

/// Exponentially weighted average over about `window` samples, seeded by the first one.
fn ewma(average: Option<f64>, sample: f64, window: f64) -> f64 {
    let alpha = 2.0 / (window + 1.0);
    average.map_or(sample, |a| a + alpha * (sample - a))
}

impl Limit for Gradient2 {
    fn limit(&self) -> usize {
        // `estimate` is finite and within the bounds, so the cast cannot saturate.
        (self.estimate as usize).clamp(self.min, self.max)
    }

    fn on_sample(&mut self, rtt: Duration, inflight: usize) {
        // A zero latency would make the gradient infinite; a microsecond is below any RPC.
        let rtt = rtt.as_secs_f64().max(1e-6);
        let short = ewma(self.short, rtt, SHORT_WINDOW);
        let mut long = ewma(self.long, rtt, LONG_WINDOW);
        if long > DRIFT * short {
            long *= DRIFT_DECAY;
        }
        self.short = Some(short);
        self.long = Some(long);

        let gradient = (TOLERANCE * long / short).clamp(MIN_GRADIENT, 1.0);
        // Headroom for a small queue only while latency is within tolerance: added always (as
        // Netflix's Gradient2 does), it would hold the limit at twice the headroom however slow
        // the service became.
        let queue = if gradient < 1.0 {
            0.0
        } else {
            self.estimate.sqrt()
        };
        let mut estimate = self.estimate * gradient + queue;
        if (inflight as f64) < self.estimate / 2.0 {
            // Application-limited: do not grow a limit nobody uses.
            estimate = estimate.min(self.estimate);
        }
        let smoothed = (1.0 - SMOOTHING) * self.estimate + SMOOTHING * estimate;
        self.estimate = smoothed.clamp(self.min as f64, self.max as f64);
    }

    fn on_abandoned(&mut self, elapsed: Duration, inflight: usize) {
        if self
            .short
            .is_some_and(|short| elapsed.as_secs_f64() > short)
        {
            self.on_sample(elapsed, inflight);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Feeds `n` samples of `rtt` with every slot held, returning the limit after each.
    fn feed(limit: &mut Gradient2, rtt: Duration, n: usize) -> Vec<usize> {
        (0..n)
            .map(|_| {
                let inflight = limit.limit();
                limit.on_sample(rtt, inflight);
                limit.limit()
            })
            .collect()
    }

    #[test]
    fn stays_at_max_while_latency_is_steady() {
        let mut limit = Gradient2::new(4, 256);
        let seen = feed(&mut limit, 100 * MS, 1_000);
        assert!(seen.iter().all(|&l| l == 256), "{seen:?}");
    }

    #[test]
    fn lowers_within_twenty_samples_when_latency_rises_from_100_to_600_ms() {
        let mut limit = Gradient2::new(4, 256);
        feed(&mut limit, 100 * MS, 200);
        let seen = feed(&mut limit, 600 * MS, 20);
        assert!(
            seen.windows(2).all(|w| w[1] <= w[0]),
            "never rises: {seen:?}"
        );
        assert!(seen[19] < 256 / 4, "{seen:?}");
    }

    #[test]
    fn recovers_within_bounded_samples_when_latency_falls_back() {
        let mut limit = Gradient2::new(4, 256);
        feed(&mut limit, 100 * MS, 200);
        feed(&mut limit, 600 * MS, 100);
        let low = limit.limit();
        assert!(low < 32, "{low}");
        let seen = feed(&mut limit, 100 * MS, 400);
        // The short average needs a few samples to fall below the tolerance; from then on the
        // limit only grows.
        assert!(seen[5..].windows(2).all(|w| w[1] >= w[0]), "{seen:?}");
        assert_eq!(seen.last(), Some(&256), "{seen:?}");
        let first_full = seen.iter().position(|&l| l == 256).unwrap();
        assert!(
            first_full < 300,
            "back at the bound after {first_full} samples"
        );
    }

    #[test]
    fn never_leaves_its_bounds() {
        let mut limit = Gradient2::new(8, 40).initial(10);
        assert_eq!(limit.limit(), 10);
        let rtts = [
            MS,
            1000 * MS,
            Duration::ZERO,
            5 * MS,
            Duration::from_secs(3600),
        ];
        for i in 0..5_000 {
            let inflight = [0, 1, limit.limit(), 1_000][i % 4];
            limit.on_sample(rtts[i % rtts.len()] * (i as u32 % 7 + 1), inflight);
            assert!((8..=40).contains(&limit.limit()), "{}", limit.limit());
        }
        feed(&mut limit, 10 * MS, 100);
        let seen = feed(&mut limit, Duration::from_secs(60), 40);
        assert_eq!(seen.last(), Some(&8), "settles at the lower bound");
        let seen = feed(&mut limit, 10 * MS, 500);
        assert_eq!(seen.last(), Some(&40), "and grows back to the upper one");
    }

    #[test]
    fn unused_limit_does_not_grow_but_still_shrinks() {
        let mut limit = Gradient2::new(1, 100).initial(20);
        for _ in 0..100 {
            limit.on_sample(10 * MS, 2);
        }
        assert_eq!(limit.limit(), 20, "two of twenty slots used: no growth");
        for _ in 0..30 {
            limit.on_sample(100 * MS, 2);
        }
        assert!(limit.limit() < 20, "{}", limit.limit());
    }

    #[test]
    fn abandoned_requests_count_only_when_they_prove_latency_rose() {
        let mut limit = Gradient2::new(1, 100);
        limit.on_abandoned(Duration::from_secs(5), 100);
        assert_eq!(limit.short_rtt(), None, "no estimate to compare with yet");
        feed(&mut limit, 100 * MS, 100);
        for _ in 0..50 {
            limit.on_abandoned(MS, 100);
        }
        assert_eq!(limit.limit(), 100, "early cancellations say nothing");
        assert_eq!(limit.short_rtt(), Some(100 * MS));
        for _ in 0..20 {
            limit.on_abandoned(Duration::from_secs(1), 100);
        }
        assert!(limit.limit() < 50, "{}", limit.limit());
    }

    #[test]
    fn bounds_are_sane_and_fixed_ignores_samples() {
        let limit = Gradient2::new(0, 0);
        assert_eq!((limit.min(), limit.max(), limit.limit()), (1, 1, 1));
        let mut fixed = FixedLimit::new(0);
        fixed.on_sample(Duration::from_secs(9), 1);
        fixed.on_abandoned(Duration::from_secs(9), 1);
        assert_eq!(fixed.limit(), 1);
        assert_eq!(FixedLimit::new(7).limit(), 7);
    }
}
