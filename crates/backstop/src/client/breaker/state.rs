//! The breaker's state machine: closed, open, half-open, over a sliding window of outcomes.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use metrics::SharedString;
use tokio::time::Instant;

use super::CircuitOpen;
use crate::observe::{self, label};

/// Buckets the window is divided into: old outcomes leave the window one bucket at a time.
const BUCKETS: u32 = 10;

/// A breaker that cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum BreakerError {
    /// The failure ratio is not in `(0, 1]`.
    #[error("breaker failure ratio must be within (0, 1], got {0}")]
    Ratio(f64),
    /// The window or the open period is zero.
    #[error("breaker window and open period must be longer than zero")]
    ZeroDuration,
    /// No probe would ever be let through in half-open.
    #[error("breaker needs at least one half-open probe")]
    NoProbe,
}

/// Where the breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Attempts go through; outcomes are counted.
    Closed,
    /// Attempts fail at once without being sent, until the open period ends.
    Open,
    /// A few probes go through; one success closes, one failure opens again.
    HalfOpen,
}

impl BreakerState {
    /// The value of the state gauge: 0 closed, 1 half-open, 2 open.
    pub fn gauge_value(self) -> f64 {
        match self {
            BreakerState::Closed => 0.0,
            BreakerState::HalfOpen => 1.0,
            BreakerState::Open => 2.0,
        }
    }
}

/// The breaker's thresholds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    /// Open when failures / outcomes in the window reach this (default 0.5).
    pub failure_ratio: f64,
    /// ... and the window holds at least this many outcomes (default 20), so that two failures
    /// out of three requests do not cut a quiet destination off.
    pub min_requests: u32,
    /// How far back outcomes count (default 10 s).
    pub window: Duration,
    /// How long the circuit stays open before probing (default 5 s).
    pub open_for: Duration,
    /// Probes allowed at once in half-open (default 1).
    pub probes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_ratio: 0.5,
            min_requests: 20,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
            probes: 1,
        }
    }
}

/// A circuit breaker for one destination; clones share the state.
///
/// ```
/// use std::time::Duration;
/// use backstop::client::breaker::{BreakerConfig, BreakerState, CircuitBreaker};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let breaker = CircuitBreaker::new(BreakerConfig { min_requests: 4, ..Default::default() }).unwrap();
/// for _ in 0..4 {
///     breaker.try_acquire().unwrap().record(false);
/// }
/// assert_eq!(breaker.state(), BreakerState::Open);
/// assert!(breaker.try_acquire().is_err());
///
/// tokio::time::advance(Duration::from_secs(5)).await;
/// breaker.try_acquire().unwrap().record(true); // the probe succeeds
/// assert_eq!(breaker.state(), BreakerState::Closed);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct CircuitBreaker {
    config: BreakerConfig,
    shared: Arc<Shared>,
}

/// While closed (nearly always), attempts are let through and counted without the lock: every
/// attempt to the destination passes here, from every worker thread. The lock guards the phase
/// changes and the open and half-open states.
#[derive(Debug)]
struct Shared {
    /// Bucket periods are counted from here.
    origin: Instant,
    /// Whether the phase is [`Phase::Closed`]; written under the lock.
    closed: AtomicBool,
    /// Per bucket: its period (high 32 bits) and the successes counted in it (low 32 bits).
    ok: [AtomicU64; BUCKETS as usize],
    /// The same for failures.
    failed: [AtomicU64; BUCKETS as usize],
    state: Mutex<State>,
    /// The state gauge, once [published](CircuitBreaker::publish_as).
    gauge: OnceLock<metrics::Gauge>,
}

#[derive(Debug)]
struct State {
    phase: Phase,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Closed,
    Open { until: Instant },
    HalfOpen { in_flight: u32 },
}

/// Adds one to `bucket` for `period`, starting it afresh if it held an older period.
fn count(bucket: &AtomicU64, period: u32) {
    let mut current = bucket.load(Ordering::Relaxed);
    loop {
        let next = if (current >> 32) as u32 == period {
            current.saturating_add(1)
        } else {
            (u64::from(period) << 32) | 1
        };
        match bucket.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return,
            Err(seen) => current = seen,
        }
    }
}

/// The sum of the counts of `buckets` whose periods lie in `oldest..=newest`.
fn sum(buckets: &[AtomicU64], oldest: u32, newest: u32) -> u64 {
    buckets
        .iter()
        .map(|b| b.load(Ordering::Relaxed))
        .filter(|v| (oldest..=newest).contains(&((v >> 32) as u32)))
        .map(|v| v & u64::from(u32::MAX))
        .sum()
}

/// Leave to send one attempt; say how it went with [`record`](Self::record). Dropped without
/// a verdict (a cancelled hedge), it counts for nothing.
#[derive(Debug)]
pub struct Permit {
    breaker: CircuitBreaker,
    probe: bool,
    done: bool,
}

impl CircuitBreaker {
    /// A closed breaker with `config`.
    pub fn new(config: BreakerConfig) -> Result<Self, BreakerError> {
        if !(config.failure_ratio > 0.0 && config.failure_ratio <= 1.0) {
            return Err(BreakerError::Ratio(config.failure_ratio));
        }
        if config.window.is_zero() || config.open_for.is_zero() {
            return Err(BreakerError::ZeroDuration);
        }
        if config.probes == 0 {
            return Err(BreakerError::NoProbe);
        }
        Ok(Self {
            config,
            shared: Arc::new(Shared {
                origin: Instant::now(),
                closed: AtomicBool::new(true),
                ok: Default::default(),
                failed: Default::default(),
                state: Mutex::new(State {
                    phase: Phase::Closed,
                }),
                gauge: OnceLock::new(),
            }),
        })
    }

    /// Publishes the state as the gauge [`RPC_CLIENT_BREAKER_STATE`] labelled `service` (the
    /// destination), updated at every change. The first call names it; later calls change
    /// nothing. Call it after installing a `metrics` recorder.
    ///
    /// [`RPC_CLIENT_BREAKER_STATE`]: crate::observe::RPC_CLIENT_BREAKER_STATE
    pub fn publish_as(&self, service: impl Into<SharedString>) {
        let service = service.into();
        let gauge = self.shared.gauge.get_or_init(
            || metrics::gauge!(observe::RPC_CLIENT_BREAKER_STATE, label::SERVICE => service),
        );
        gauge.set(self.state().gauge_value());
    }

    /// Updates the gauge, if published (under the lock, so changes report in order).
    fn report(&self, state: BreakerState) {
        if let Some(gauge) = self.shared.gauge.get() {
            gauge.set(state.gauge_value());
        }
    }

    /// The thresholds.
    pub fn config(&self) -> &BreakerConfig {
        &self.config
    }

    /// The current state (an open circuit whose period ended reads as half-open).
    pub fn state(&self) -> BreakerState {
        match self.lock().phase {
            Phase::Closed => BreakerState::Closed,
            Phase::Open { until } if Instant::now() < until => BreakerState::Open,
            Phase::Open { .. } | Phase::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Leave to send an attempt, or how long until the next probe.
    pub fn try_acquire(&self) -> Result<Permit, CircuitOpen> {
        if self.shared.closed.load(Ordering::Acquire) {
            return Ok(Permit {
                breaker: self.clone(),
                probe: false,
                done: false,
            });
        }
        let now = Instant::now();
        let mut state = self.lock();
        let probe = match state.phase {
            Phase::Closed => false,
            Phase::Open { until } if now < until => {
                return Err(CircuitOpen {
                    retry_in: until - now,
                });
            }
            Phase::Open { .. } => {
                state.phase = Phase::HalfOpen { in_flight: 1 };
                self.report(BreakerState::HalfOpen);
                true
            }
            Phase::HalfOpen { in_flight } if in_flight < self.config.probes => {
                state.phase = Phase::HalfOpen {
                    in_flight: in_flight + 1,
                };
                true
            }
            Phase::HalfOpen { .. } => {
                // Probes are out; the answer is one round trip away.
                return Err(CircuitOpen {
                    retry_in: Duration::from_millis(1),
                });
            }
        };
        drop(state);
        Ok(Permit {
            breaker: self.clone(),
            probe,
            done: false,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn reset_counts(&self) {
        for bucket in self.shared.ok.iter().chain(&self.shared.failed) {
            bucket.store(0, Ordering::Relaxed);
        }
    }

    /// Opens the circuit (under the lock) for the configured period from `now`.
    fn open(&self, state: &mut State, now: Instant) {
        state.phase = Phase::Open {
            until: now + self.config.open_for,
        };
        self.shared.closed.store(false, Ordering::Release);
        self.reset_counts();
        self.report(BreakerState::Open);
    }

    fn bucket_len(&self) -> Duration {
        (self.config.window / BUCKETS).max(Duration::from_nanos(1))
    }

    fn record(&self, probe: bool, success: Option<bool>) {
        if !probe {
            // Late answers of attempts sent before the circuit changed do not move it.
            if let Some(success) = success {
                if self.shared.closed.load(Ordering::Acquire) {
                    self.count(success);
                }
            }
            return;
        }
        let now = Instant::now();
        let mut state = self.lock();
        if let Phase::HalfOpen { in_flight } = state.phase {
            match success {
                Some(true) => {
                    state.phase = Phase::Closed;
                    self.reset_counts();
                    self.shared.closed.store(true, Ordering::Release);
                    self.report(BreakerState::Closed);
                }
                Some(false) => self.open(&mut state, now),
                None => {
                    state.phase = Phase::HalfOpen {
                        in_flight: in_flight.saturating_sub(1),
                    };
                }
            }
        }
    }

    /// Counts an outcome of the closed circuit; a failure may open it.
    fn count(&self, success: bool) {
        let now = Instant::now();
        let period = period_of(now, self.shared.origin, self.bucket_len());
        let slot = (period % BUCKETS) as usize;
        let buckets = if success {
            &self.shared.ok
        } else {
            &self.shared.failed
        };
        count(&buckets[slot], period);
        // Only a failure can open the circuit.
        if success {
            return;
        }
        let oldest = period.saturating_sub(BUCKETS - 1);
        let ok = sum(&self.shared.ok, oldest, period);
        let failed = sum(&self.shared.failed, oldest, period);
        let total = ok + failed;
        if total >= u64::from(self.config.min_requests)
            && failed as f64 >= self.config.failure_ratio * total as f64
        {
            let mut state = self.lock();
            // Another failure may have opened it meanwhile.
            if matches!(state.phase, Phase::Closed) {
                self.open(&mut state, now);
            }
        }
    }
}

/// The bucket period `now` falls in, counted from `origin`. Periods start at 1 so an empty
/// bucket (period 0) never counts.
fn period_of(now: Instant, origin: Instant, bucket: Duration) -> u32 {
    let since = now.saturating_duration_since(origin);
    // Wraps after 2^32 buckets (13 years of 100 ms buckets); a wrapped bucket merely
    // restarts its count.
    ((since.as_nanos() / bucket.as_nanos().max(1)) as u32)
        .wrapping_add(1)
        .max(1)
}

impl Permit {
    /// Records the attempt's outcome: `true` for a success (or a failure that says nothing
    /// about the destination's health), `false` for a destination failure.
    pub fn record(mut self, success: bool) {
        self.done = true;
        self.breaker.record(self.probe, Some(success));
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.done {
            self.breaker.record(self.probe, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::advance;

    fn breaker(min_requests: u32) -> CircuitBreaker {
        CircuitBreaker::new(BreakerConfig {
            min_requests,
            ..BreakerConfig::default()
        })
        .unwrap()
    }

    fn outcomes(b: &CircuitBreaker, ok: u32, failed: u32) {
        for _ in 0..ok {
            b.try_acquire().unwrap().record(true);
        }
        for _ in 0..failed {
            b.try_acquire().unwrap().record(false);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_published_gauge_follows_every_change() {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        let state = || {
            crate::server::testing::Recorded::of(&recorder).gauge(
                observe::RPC_CLIENT_BREAKER_STATE,
                &[(label::SERVICE, "psp")],
            )
        };
        let b = breaker(4);
        metrics::with_local_recorder(&recorder, || b.publish_as("psp"));
        assert_eq!(state(), 0.0, "closed");
        outcomes(&b, 0, 4);
        assert_eq!(state(), 2.0, "open");
        advance(b.config().open_for).await;
        let probe = b.try_acquire().unwrap();
        assert_eq!(state(), 1.0, "half-open");
        probe.record(false);
        assert_eq!(state(), 2.0, "open again");
        advance(b.config().open_for).await;
        b.try_acquire().unwrap().record(true);
        assert_eq!(state(), 0.0, "closed again");
    }

    #[test]
    fn invalid_configs_are_refused() {
        let bad = |c: BreakerConfig| CircuitBreaker::new(c).unwrap_err();
        let d = BreakerConfig::default();
        assert_eq!(
            bad(BreakerConfig {
                failure_ratio: 0.0,
                ..d
            }),
            BreakerError::Ratio(0.0)
        );
        assert!(matches!(
            bad(BreakerConfig {
                failure_ratio: f64::NAN,
                ..d
            }),
            BreakerError::Ratio(_)
        ));
        assert_eq!(
            bad(BreakerConfig {
                window: Duration::ZERO,
                ..d
            }),
            BreakerError::ZeroDuration
        );
        assert_eq!(bad(BreakerConfig { probes: 0, ..d }), BreakerError::NoProbe);
    }

    #[tokio::test(start_paused = true)]
    async fn opens_at_the_failure_ratio_once_the_window_has_enough_requests() {
        let b = breaker(10);
        outcomes(&b, 0, 9);
        assert_eq!(b.state(), BreakerState::Closed, "below min_requests");
        outcomes(&b, 1, 0);
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "9 of 10 failed but last was ok"
        );
        outcomes(&b, 0, 1);
        assert_eq!(b.state(), BreakerState::Open);
        let open = b.try_acquire().unwrap_err();
        assert_eq!(open.retry_in, Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_healthy_ratio_keeps_it_closed() {
        let b = breaker(10);
        for _ in 0..10 {
            outcomes(&b, 2, 1);
        }
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn old_failures_leave_the_window() {
        let b = breaker(10);
        outcomes(&b, 0, 9);
        advance(Duration::from_secs(11)).await;
        outcomes(&b, 5, 1);
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn half_open_lets_one_probe_and_its_outcome_decides() {
        let b = breaker(2);
        outcomes(&b, 0, 2);
        assert_eq!(b.state(), BreakerState::Open);
        advance(Duration::from_millis(4_999)).await;
        assert!(b.try_acquire().is_err());
        advance(Duration::from_millis(1)).await;
        assert_eq!(b.state(), BreakerState::HalfOpen);
        let probe = b.try_acquire().unwrap();
        assert!(b.try_acquire().is_err(), "one probe at a time");
        probe.record(false);
        assert_eq!(b.state(), BreakerState::Open);

        advance(Duration::from_secs(5)).await;
        b.try_acquire().unwrap().record(true);
        assert_eq!(b.state(), BreakerState::Closed);
        outcomes(&b, 0, 1);
        assert_eq!(b.state(), BreakerState::Closed, "the window starts afresh");
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_probe_frees_its_slot() {
        let b = breaker(1);
        outcomes(&b, 0, 1);
        advance(Duration::from_secs(5)).await;
        drop(b.try_acquire().unwrap());
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(b.try_acquire().is_ok());
    }
}
