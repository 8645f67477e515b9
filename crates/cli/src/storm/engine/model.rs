//! What a simulation is given (the world, the clients, the server) and what it returns.

use std::time::Duration;

use backstop::admission::{FixedLimit, Gradient2, Limit, SlowStart};
use backstop::retry::Backoff;

use crate::storm::dist::LogNormal;
use crate::storm::series::{Row, Totals};

/// What the world does: arrivals, the server's own work, the downstream by phase.
#[derive(Debug, Clone)]
pub(crate) struct Model {
    /// Simulated time; arrivals and the series stop there.
    pub(crate) duration: Duration,
    /// Length of one row of the series.
    pub(crate) interval: Duration,
    /// Logical requests per second (Poisson arrivals).
    pub(crate) rate: f64,
    /// `rate` multiplied by each factor from its instant on (a burst, a ramp of load); empty
    /// for a constant rate. In time order.
    pub(crate) load: Vec<(Duration, f64)>,
    /// The server's own part of every request, on top of the downstream call.
    pub(crate) local: Duration,
    /// The downstream from each phase's start on; the first starts at 0.
    pub(crate) phases: Vec<Phase>,
    /// Seeds arrivals, service times, jitter and the throttle.
    pub(crate) seed: u64,
}

/// The downstream from `from` on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Phase {
    /// When the phase starts.
    pub(crate) from: Duration,
    /// How the downstream answers during it.
    pub(crate) downstream: Downstream,
}

/// How the downstream answers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Downstream {
    /// Successfully, after a log-normal latency.
    Latency(LogNormal),
    /// With an error after `after` (a refused connection, a 503), which the server passes on
    /// to its client with `pushback` as its Retry-After, if any.
    Failing {
        /// How long the failing call takes.
        after: Duration,
        /// The pushback the failure carries to the client.
        pushback: Option<Duration>,
    },
    /// Hangs, and every call started in the phase fails together at `at` (a dependency that
    /// stops answering and then resets all its connections at once): the failures, and so the
    /// retries, are synchronized.
    StalledUntil {
        /// When the hung calls fail.
        at: Duration,
    },
    /// A dependency whose capacity warms with recent traffic (caches, connection pools, JIT).
    Cold(Cold),
}

/// A downstream that is slower and serves fewer calls at once when cold, and warms with the
/// calls it serves successfully.
///
/// Warmth `w` in `[0, 1]` is the count of recent successes (decaying with `tau`) over
/// `warm_after`. A call's latency is a draw of `latency`, times `1 + (cold_factor - 1)(1 - w)`
/// (cache misses), times `max(1, in flight / concurrency(w))` where `concurrency` grows from
/// `cold_concurrency` to `warm_concurrency` with `w` (calls beyond what it can hold at once
/// share it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cold {
    /// Latency when warm and not crowded.
    pub(crate) latency: LogNormal,
    /// How much slower a call is when fully cold.
    pub(crate) cold_factor: f64,
    /// Calls it serves at once without slowing, cold.
    pub(crate) cold_concurrency: f64,
    /// Calls it serves at once without slowing, warm.
    pub(crate) warm_concurrency: f64,
    /// Recent successes that make it fully warm.
    pub(crate) warm_after: f64,
    /// How fast warmth fades without traffic.
    pub(crate) tau: Duration,
}

impl Cold {
    /// The latency factor of a call started with `inflight` calls at the downstream (itself
    /// included) and warmth `w`.
    pub(crate) fn factor(&self, w: f64, inflight: usize) -> f64 {
        let w = w.clamp(0.0, 1.0);
        let concurrency =
            self.cold_concurrency + (self.warm_concurrency - self.cold_concurrency) * w;
        let crowded = (inflight as f64 / concurrency.max(1.0)).max(1.0);
        (1.0 + (self.cold_factor - 1.0) * (1.0 - w)) * crowded
    }
}

/// How clients call: the retry policy's knobs, the timeout, hedging.
#[derive(Debug, Clone)]
pub(crate) struct ClientConfig {
    /// Attempts per logical request, first included.
    pub(crate) max_attempts: u32,
    /// Delays between attempts.
    pub(crate) backoff: Backoff,
    /// Retry budget `(ratio, burst)`; `None` for no budget at all.
    pub(crate) budget: Option<(f64, u32)>,
    /// The library's storm alarm, with its defaults.
    pub(crate) storm_alarm: bool,
    /// The library's adaptive throttle, with its defaults.
    pub(crate) throttle: bool,
    /// The client's timeout.
    pub(crate) timeout: Duration,
    /// How `timeout` bounds the attempts, and what the server is told of it.
    pub(crate) deadlines: Deadlines,
    /// Whether a refusal's pushback (Retry-After) is waited out before the next attempt; a
    /// client that ignores it retries on its own backoff.
    pub(crate) honours_pushback: bool,
    /// Hedge once at this quantile of recent latencies (through the library's hedging policy).
    pub(crate) hedge_quantile: Option<f64>,
    /// Hedge once after this fixed delay instead (the policy's `fixed_delay`, a gRPC
    /// `hedgingDelay`); takes precedence over `hedge_quantile`.
    pub(crate) hedge_delay: Option<Duration>,
}

/// How a client's timeout bounds its attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deadlines {
    /// One deadline of `timeout` for the logical request, shared by its attempts and
    /// propagated to the server.
    Shared,
    /// Every attempt gets `timeout` afresh (a fixed per-attempt timeout); the server is not
    /// told any deadline.
    PerAttempt,
    /// Every attempt gets `timeout` afresh and tells the server its own deadline (a fresh
    /// `grpc-timeout` per attempt, as `backstop load --policy naive` sends).
    PerAttemptPropagated,
}

impl Deadlines {
    pub(super) fn per_attempt(self) -> bool {
        self != Deadlines::Shared
    }
}

/// The server's admission: the concurrency limit and whether waiting is bounded by the
/// caller's deadline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServerConfig {
    /// The concurrency limit (workers, or the gate in front of them).
    pub(crate) limit: LimitKind,
    /// The library's [`SlowStart`] around the limit, with this floor: when half the recent
    /// requests fail the limit drops to the floor, and it ramps back up, doubling per round
    /// trip, once they succeed again. `None`: the limit alone.
    pub(crate) slow_start: Option<usize>,
    /// Bound every wait by `deadline - min_service` and refuse beyond it (the library's
    /// gate), and stop serving a request when its deadline passes (the library's deadline
    /// layer drops the handler then, freeing its slot); otherwise an unbounded first-come
    /// first-served queue whose requests run to the end whoever still waits for them.
    pub(crate) deadline_aware: bool,
    /// The least time serving a request takes.
    pub(crate) min_service: Duration,
    /// The pushback sent with a refusal.
    pub(crate) retry_after: RetryAfter,
    /// Waiters go through the library's fair queue (sojourn drops, adaptive LIFO) instead of
    /// one first-come first-served line; only with `deadline_aware`.
    pub(crate) fair_queue: bool,
    /// At most this many wait in the first-come first-served line (without the fair queue);
    /// an arrival that finds it full is refused. `Some(0)` is a rate limit: what cannot start
    /// at once is refused. `None`: unbounded.
    pub(crate) max_queue: Option<usize>,
}

/// Which library limit sizes the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitKind {
    /// [`FixedLimit`].
    Fixed(usize),
    /// [`Gradient2`] within `min..=max`, starting at `max`.
    Gradient2 {
        /// Lower bound.
        min: usize,
        /// Upper bound and start.
        max: usize,
    },
}

impl LimitKind {
    /// The limit, behind a [`SlowStart`] with floor `slow_start` if one is given.
    pub(super) fn build(self, slow_start: Option<usize>) -> Box<dyn Limit> {
        match (self, slow_start) {
            (LimitKind::Fixed(n), None) => Box::new(FixedLimit::new(n)),
            (LimitKind::Fixed(n), Some(floor)) => {
                Box::new(SlowStart::new(FixedLimit::new(n), floor))
            }
            (LimitKind::Gradient2 { min, max }, None) => Box::new(Gradient2::new(min, max)),
            (LimitKind::Gradient2 { min, max }, Some(floor)) => {
                Box::new(SlowStart::new(Gradient2::new(min, max), floor))
            }
        }
    }
}

/// What a refusal tells the client about when to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryAfter {
    /// Nothing: the client's own backoff decides (a 503 without `Retry-After`).
    None,
    /// The same pushback on every refusal.
    Fixed(Duration),
    /// What the library's gate computes by default:
    /// [`AdmissionQueue::pushback`](backstop::admission::AdmissionQueue::pushback) from the
    /// queue ahead and the limit, jittered, and "do not retry" while the queue sheds hard.
    /// Needs the fair queue.
    Computed,
}

/// What one run produced: the per-interval series and the run's totals.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    /// One row per interval.
    pub(crate) rows: Vec<Row>,
    /// Counts over the whole run.
    pub(crate) totals: Totals,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cold() -> Cold {
        Cold {
            latency: LogNormal::new(Duration::from_millis(50), Duration::from_millis(150)).unwrap(),
            cold_factor: 10.0,
            cold_concurrency: 5.0,
            warm_concurrency: 1_000.0,
            warm_after: 1_000.0,
            tau: Duration::from_secs(2),
        }
    }

    #[test]
    fn a_cold_downstream_is_slower_and_narrower_until_warm() {
        let c = cold();
        // Warm and not crowded: the plain latency.
        assert_eq!(c.factor(1.0, 1), 1.0);
        assert_eq!(c.factor(1.0, 1_000), 1.0);
        // Cold: cache misses, and crowded beyond 5 calls.
        assert_eq!(c.factor(0.0, 1), 10.0);
        assert_eq!(c.factor(0.0, 50), 100.0);
        // Half warm: 5.5x slower, 502.5 calls wide.
        assert!((c.factor(0.5, 100) - 5.5).abs() < 1e-9);
        // Warmth is clamped.
        assert_eq!(c.factor(-1.0, 1), c.factor(0.0, 1));
        assert_eq!(c.factor(2.0, 1), c.factor(1.0, 1));
    }
}
