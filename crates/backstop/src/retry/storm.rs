//! The storm alarm: a destination's retry ratio watched over a sliding window, retries and
//! hedges switched off while it is too high.
//!
//! A budget caps what retries add (`ratio x requests + burst`), but it keeps spending that
//! allowance on a dependency that is down for everyone: every retry still fails, and the
//! budget's 10 % is 10 % more load on a service that cannot answer the first 100 %. The alarm
//! watches how many retries the destination's calls *ask for* per logical request. A few
//! random failures ask for about as many retries as they fail (10 % failing: about 0.11 per
//! request); a dependency that is down asks for one or more per request. Above
//! [`StormConfig::warn`] (0.1) the alarm warns; above [`StormConfig::trip`] (0.2) it trips and
//! every retry and hedge to the destination stops with [`StopReason::Storm`](super::StopReason)
//! until the ratio is back to the warning level or below (the gap keeps it from flapping).
//!
//! A ratio over few requests is mostly chance: three unlucky failures among the first ten
//! calls are a ratio of 0.3 while one attempt in ten fails. So a level is reached only when the
//! retries exceed `threshold x requests` by three standard deviations of chance,
//! `3 x sqrt(threshold x requests)`: with 10 % of attempts failing at random (about 0.11
//! retries asked per request) it never trips, while a dependency that is down (one or two
//! retries asked per request) still trips it at the [`StormConfig::min_requests`]th request.
//! Clearing needs no such margin: a tripped alarm clears once the ratio is at the warning level
//! or below.
//!
//! Hedges are not counted: a hedge answers a slow attempt, not a failed one (the hedging layer
//! sends none while the alarm is tripped).
//!
//! Retries are counted when asked for, whether or not they are then sent: counting only the
//! retries sent would make the alarm clear itself as soon as it stopped them, and send the
//! next wave into the same outage. The retry executor counts a logical request when its first
//! attempt ends, not when it starts, so that a burst of calls still waiting for their first
//! answer does not dilute the ratio while the first answers already say the destination is
//! down. Nothing is judged on fewer than
//! [`StormConfig::min_requests`] logical requests in the window.
//!
//! The gauge `rpc_client_storm_alarm{service,level}` (`level` one of `warning`, `tripped`; 1
//! while at or above that level, else 0) is set at 0 when the alarm is created, then on every
//! change of level, when one `rpc_storm_alarm` event is also logged with the new level, the
//! ratio and the counts.
//!
//! ```
//! use backstop::retry::{StormAlarm, StormConfig, StormLevel};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let alarm = StormAlarm::new("psp", StormConfig::default());
//! // Ten calls to a dependency that is down: each asks for a retry.
//! for _ in 0..10 {
//!     alarm.record_request();
//!     let _ = alarm.retry_wanted();
//! }
//! assert_eq!(alarm.level(), StormLevel::Tripped);
//! assert!(!alarm.retry_wanted(), "no retry while it storms");
//! # }
//! ```

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use metrics::SharedString;
use tokio::time::Instant;

use super::window::SlidingCounts;
use crate::observe::{event, label};

pub use crate::observe::RPC_CLIENT_STORM_ALARM;

/// A storm alarm configuration that cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum StormConfigError {
    /// The thresholds are not `0 <= warn <= trip`, finite.
    #[error("storm alarm thresholds must satisfy 0 <= warn <= trip, got warn {warn}, trip {trip}")]
    Thresholds {
        /// The warning threshold given.
        warn: f64,
        /// The trip threshold given.
        trip: f64,
    },
    /// The window is shorter than a millisecond.
    #[error("storm alarm window must be at least 1 ms")]
    Window,
}

/// When a [`StormAlarm`] warns, trips and clears.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StormConfig {
    warn: f64,
    trip: f64,
    window: Duration,
    min_requests: u64,
}

impl Default for StormConfig {
    /// Warns above 0.1 retries per logical request, trips above 0.2, over 10 s, judged on at
    /// least 10 logical requests.
    fn default() -> Self {
        Self {
            warn: 0.1,
            trip: 0.2,
            window: Duration::from_secs(10),
            min_requests: 10,
        }
    }
}

impl StormConfig {
    /// Warns above `warn` retries per logical request, trips above `trip` and clears at `warn`
    /// or below; the default window and minimum of requests.
    pub fn new(warn: f64, trip: f64) -> Result<Self, StormConfigError> {
        if !(warn.is_finite() && trip.is_finite() && 0.0 <= warn && warn <= trip) {
            return Err(StormConfigError::Thresholds { warn, trip });
        }
        Ok(Self {
            warn,
            trip,
            ..Self::default()
        })
    }

    /// The window the ratio is measured over (default 10 s, in tenths).
    pub fn window(mut self, window: Duration) -> Result<Self, StormConfigError> {
        if window < Duration::from_millis(1) {
            return Err(StormConfigError::Window);
        }
        self.window = window;
        Ok(self)
    }

    /// The fewest logical requests in the window for the ratio to count (default 10): below
    /// it the alarm is calm.
    pub fn min_requests(mut self, min_requests: u64) -> Self {
        self.min_requests = min_requests;
        self
    }

    /// The ratio above which the alarm warns (and at or below which a tripped alarm clears).
    pub fn warn(&self) -> f64 {
        self.warn
    }

    /// The ratio above which the alarm trips.
    pub fn trip(&self) -> f64 {
        self.trip
    }
}

/// How a destination's retry ratio stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum StormLevel {
    /// At or below the warning threshold (or too few requests to judge).
    Calm,
    /// Above the warning threshold: retries still go out.
    Warning,
    /// Tripped: retries and hedges stop until the ratio is back to the warning level.
    Tripped,
}

impl StormLevel {
    /// `calm`, `warning` or `tripped`.
    pub const fn as_str(self) -> &'static str {
        match self {
            StormLevel::Calm => "calm",
            StormLevel::Warning => "warning",
            StormLevel::Tripped => "tripped",
        }
    }
}

/// One destination's storm alarm (see the [module docs](self)). Cheap to clone; clones share
/// the state.
#[derive(Debug, Clone)]
pub struct StormAlarm {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    service: SharedString,
    config: StormConfig,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Logical requests (first) and retries asked for (second).
    counts: SlidingCounts,
    level: StormLevel,
    /// Times it tripped so far.
    trips: u64,
}

/// A change of level, reported outside the lock.
struct Change {
    level: StormLevel,
    ratio: f64,
    requests: u64,
    retries: u64,
}

impl StormAlarm {
    /// A calm alarm for the destination `service` (the metric label and log field). Its gauge
    /// is set to calm (0 for both levels) at once, so that dashboards and alerts see the
    /// series before the first change of level.
    pub fn new(service: impl Into<SharedString>, config: StormConfig) -> Self {
        Self::new_at(service, config, Instant::now())
    }

    /// [`new`](Self::new) with the window's slots counted from `origin` instead of now: for a
    /// caller on a virtual clock (a simulation), which then drives the alarm only through the
    /// `..._at` methods.
    pub fn new_at(service: impl Into<SharedString>, config: StormConfig, origin: Instant) -> Self {
        let alarm = Self {
            inner: Arc::new(Inner {
                service: service.into(),
                config,
                state: Mutex::new(State {
                    counts: SlidingCounts::new_at(config.window, origin),
                    level: StormLevel::Calm,
                    trips: 0,
                }),
            }),
        };
        alarm.set_gauges(StormLevel::Calm);
        alarm
    }

    /// The configuration.
    pub fn config(&self) -> &StormConfig {
        &self.inner.config
    }

    /// Records one logical request.
    pub fn record_request(&self) {
        self.record_request_at(Instant::now());
    }

    /// [`record_request`](Self::record_request) at `now`.
    pub fn record_request_at(&self, now: Instant) {
        self.record(now, 1, 0);
    }

    /// Records a retry asked for; `true` when it may be sent, `false` while the alarm is
    /// tripped.
    pub fn retry_wanted(&self) -> bool {
        self.retry_wanted_at(Instant::now())
    }

    /// [`retry_wanted`](Self::retry_wanted) at `now`.
    pub fn retry_wanted_at(&self, now: Instant) -> bool {
        self.record(now, 0, 1) != StormLevel::Tripped
    }

    /// The level now (the window slides even without calls).
    pub fn level(&self) -> StormLevel {
        self.level_at(Instant::now())
    }

    /// The level at `now`.
    pub fn level_at(&self, now: Instant) -> StormLevel {
        self.record(now, 0, 0)
    }

    /// How many times the alarm has tripped since it was made.
    pub fn trips(&self) -> u64 {
        self.lock().trips
    }

    /// Retries asked for per logical request over the window now.
    pub fn ratio(&self) -> f64 {
        self.ratio_at(Instant::now())
    }

    /// Retries asked for per logical request over the window ending at `now`.
    pub fn ratio_at(&self, now: Instant) -> f64 {
        let state = self.lock();
        let (requests, retries) = state.counts.totals(now);
        ratio(requests, retries)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds to the counts, re-judges the level and reports a change; the level after.
    fn record(&self, now: Instant, requests: u64, retries: u64) -> StormLevel {
        let config = &self.inner.config;
        let (level, change) = {
            let mut state = self.lock();
            if requests != 0 || retries != 0 {
                state.counts.add(now, requests, retries);
            }
            let (requests, retries) = state.counts.totals(now);
            let ratio = ratio(requests, retries);
            let level = if requests < config.min_requests {
                StormLevel::Calm
            } else if beyond_chance(requests, retries, config.trip)
                || (state.level == StormLevel::Tripped && ratio > config.warn)
            {
                StormLevel::Tripped
            } else if beyond_chance(requests, retries, config.warn) {
                StormLevel::Warning
            } else {
                StormLevel::Calm
            };
            let changed = std::mem::replace(&mut state.level, level) != level;
            if changed && level == StormLevel::Tripped {
                state.trips += 1;
            }
            (
                level,
                changed.then_some(Change {
                    level,
                    ratio,
                    requests,
                    retries,
                }),
            )
        };
        if let Some(change) = change {
            self.report(change);
        }
        level
    }

    fn set_gauges(&self, level: StormLevel) {
        let service = &self.inner.service;
        for (name, at) in [
            (StormLevel::Warning.as_str(), StormLevel::Warning),
            (StormLevel::Tripped.as_str(), StormLevel::Tripped),
        ] {
            metrics::gauge!(RPC_CLIENT_STORM_ALARM,
                label::SERVICE => service.clone(), label::LEVEL => name)
            .set(if level >= at { 1.0 } else { 0.0 });
        }
    }

    fn report(&self, change: Change) {
        self.set_gauges(change.level);
        let service = &self.inner.service;
        let message = match change.level {
            StormLevel::Tripped => "retry storm: retries and hedges stopped",
            StormLevel::Warning => "retry ratio above the warning threshold",
            StormLevel::Calm => "retry ratio back to normal",
        };
        if change.level == StormLevel::Calm {
            tracing::info!(
                name: event::RPC_STORM_ALARM,
                event = event::RPC_STORM_ALARM,
                service = &**service,
                level = change.level.as_str(),
                ratio = change.ratio,
                requests = change.requests,
                retries = change.retries,
                "{message}"
            );
        } else {
            tracing::warn!(
                name: event::RPC_STORM_ALARM,
                event = event::RPC_STORM_ALARM,
                service = &**service,
                level = change.level.as_str(),
                ratio = change.ratio,
                requests = change.requests,
                retries = change.retries,
                "{message}"
            );
        }
    }
}

/// Standard deviations of chance by which the retries must exceed a threshold.
const CHANCE_SIGMAS: f64 = 3.0;

/// Whether `retries` over `requests` is above `threshold` by more than chance: retries asked
/// are roughly Poisson, with a standard deviation of `sqrt(threshold x requests)` at the
/// threshold.
fn beyond_chance(requests: u64, retries: u64, threshold: f64) -> bool {
    let expected = threshold * requests as f64;
    retries as f64 > expected + CHANCE_SIGMAS * expected.sqrt()
}

fn ratio(requests: u64, retries: u64) -> f64 {
    if requests == 0 {
        0.0
    } else {
        retries as f64 / requests as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::testing::Recorded;
    use metrics_util::debugging::DebuggingRecorder;

    const SECOND: Duration = Duration::from_secs(1);

    /// `requests` logical requests of which the last `retries` ask for one retry; how many of
    /// those were refused.
    fn traffic(alarm: &StormAlarm, requests: u32, retries: u32) -> u32 {
        let mut refused = 0;
        for i in 0..requests {
            alarm.record_request();
            if i >= requests - retries && !alarm.retry_wanted() {
                refused += 1;
            }
        }
        refused
    }

    #[test]
    fn thresholds_must_be_ordered_and_finite() {
        for (warn, trip) in [
            (0.3, 0.2),
            (-0.1, 0.2),
            (0.1, f64::NAN),
            (0.1, f64::INFINITY),
        ] {
            assert!(StormConfig::new(warn, trip).is_err(), "{warn} {trip}");
        }
        let c = StormConfig::new(0.05, 0.5).unwrap();
        assert_eq!((c.warn(), c.trip()), (0.05, 0.5));
        assert_eq!(
            StormConfig::default().window(Duration::ZERO),
            Err(StormConfigError::Window)
        );
    }

    /// Issue 15, item 5: above 0.1 it warns, above 0.2 it trips and refuses retries (in both
    /// cases by more than chance), and it clears only once the ratio is back to 0.1 or below,
    /// with a gauge and a log line at each change.
    #[tokio::test(start_paused = true)]
    async fn the_alarm_trips_above_0_2_and_clears_back_at_0_1() {
        let recorder = DebuggingRecorder::new();
        let _guard = metrics::set_default_local_recorder(&recorder);
        // Both gauges from one snapshot (a snapshot holds what changed since the last one).
        let gauges = || {
            let recorded = Recorded::of(&recorder);
            let level = |level| {
                recorded.gauge(
                    RPC_CLIENT_STORM_ALARM,
                    &[("service", "psp"), ("level", level)],
                )
            };
            (level("warning"), level("tripped"))
        };
        let alarm = StormAlarm::new("psp", StormConfig::default());
        // Calm from the start: both series exist, at 0, before the first change.
        let at_start: Vec<_> = recorder
            .snapshotter()
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(key, ..)| key.key().name() == RPC_CLIENT_STORM_ALARM)
            .map(|(key, _, _, value)| {
                (key.key().labels().nth(1).unwrap().value().to_owned(), value)
            })
            .collect();
        assert_eq!(at_start.len(), 2, "{at_start:?}");
        assert!(
            at_start
                .iter()
                .all(|(_, v)| *v == metrics_util::debugging::DebugValue::Gauge(0.0.into())),
            "{at_start:?}"
        );

        // 100 requests, 10 retries: 0.1 is not above the warning level.
        assert_eq!(traffic(&alarm, 100, 10), 0);
        assert_eq!(alarm.level(), StormLevel::Calm);
        // 25 / 150 = 0.167 is within chance of 0.1 (15 + 3 x sqrt(15) = 26.6 retries): calm.
        assert_eq!(traffic(&alarm, 50, 15), 0);
        assert_eq!(alarm.level(), StormLevel::Calm);
        // 40 / 150 = 0.267 is beyond it: a warning, and within chance of 0.2 (30 + 3 x
        // sqrt(30) = 46.4 retries), so not a storm yet...
        assert_eq!(traffic(&alarm, 0, 0), 0);
        for _ in 0..15 {
            assert!(alarm.retry_wanted());
        }
        assert_eq!(alarm.level(), StormLevel::Warning);
        assert_eq!(gauges(), (1.0, 0.0));
        for _ in 0..6 {
            assert!(alarm.retry_wanted());
        }
        assert_eq!(alarm.level(), StormLevel::Warning);
        // ...the 47th retry asked for is: refused.
        assert!(!alarm.retry_wanted());
        assert_eq!(alarm.level(), StormLevel::Tripped);
        assert_eq!(gauges(), (1.0, 1.0));

        // The ratio falls under 0.2 but stays above 0.1: still tripped (hysteresis).
        tokio::time::advance(SECOND).await;
        assert_eq!(traffic(&alarm, 200, 0), 0);
        assert!(
            alarm.ratio() > 0.1 && alarm.ratio() < 0.2,
            "{}",
            alarm.ratio()
        );
        assert_eq!(alarm.level(), StormLevel::Tripped);
        assert!(!alarm.retry_wanted());
        // The storm's seconds leave the window: calm, and retries go out again.
        tokio::time::advance(9 * SECOND).await;
        assert_eq!(traffic(&alarm, 20, 0), 0);
        assert_eq!(alarm.level(), StormLevel::Calm);
        assert!(alarm.retry_wanted());
        assert_eq!(gauges(), (0.0, 0.0));
        assert_eq!(alarm.trips(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn too_few_requests_are_not_a_storm() {
        let alarm = StormAlarm::new("psp", StormConfig::default());
        // Nine calls that each ask for two retries: no judgement yet.
        for _ in 0..9 {
            alarm.record_request();
            assert!(alarm.retry_wanted());
            assert!(alarm.retry_wanted());
        }
        assert_eq!(alarm.level(), StormLevel::Calm);
        alarm.record_request();
        assert!(!alarm.retry_wanted());
    }

    #[tokio::test(start_paused = true)]
    async fn clones_share_one_alarm() {
        let a = StormAlarm::new("psp", StormConfig::default());
        let b = a.clone();
        assert_eq!(traffic(&a, 10, 0), 0);
        for _ in 0..7 {
            let _ = b.retry_wanted();
        }
        assert_eq!(a.level(), StormLevel::Tripped);
    }

    /// The `..._at` entry points read no clock: driven by a virtual clock an hour away from the
    /// real one, the alarm trips and clears on that clock alone.
    #[test]
    fn a_virtual_clock_drives_the_alarm() {
        let origin = Instant::now() + Duration::from_secs(3_600);
        let alarm = StormAlarm::new_at("psp", StormConfig::default(), origin);
        for i in 0..10 {
            let at = origin + Duration::from_millis(i);
            alarm.record_request_at(at);
            let _ = alarm.retry_wanted_at(at);
        }
        let later = origin + Duration::from_millis(10);
        assert_eq!(alarm.level_at(later), StormLevel::Tripped);
        assert!(!alarm.retry_wanted_at(later));
        assert!(alarm.ratio_at(later) > 1.0);
        // A window later on the virtual clock the storm has left it.
        assert_eq!(alarm.level_at(origin + 11 * SECOND), StormLevel::Calm);
    }

    /// One attempt in ten failing at random never trips it, not even when chance gathers
    /// three failures among the first ten calls (a ratio of 0.3); a dependency that is down
    /// trips it at the tenth call.
    #[tokio::test(start_paused = true)]
    async fn ten_percent_failing_at_random_is_no_storm_but_a_dead_dependency_is() {
        use rand::{RngExt, SeedableRng, rngs::StdRng};

        let alarm = StormAlarm::new("psp", StormConfig::default());
        assert_eq!(traffic(&alarm, 10, 3), 0);
        assert!((alarm.ratio() - 0.3).abs() < 1e-9);
        assert_ne!(alarm.level(), StormLevel::Tripped);

        let mut rng = StdRng::seed_from_u64(15);
        for _ in 0..100_000 {
            alarm.record_request();
            // A failed attempt asks for a retry, which fails in turn one time in ten.
            let mut attempts = 1;
            while attempts < 3 && rng.random_bool(0.1) {
                assert!(alarm.retry_wanted(), "ratio {}", alarm.ratio());
                attempts += 1;
            }
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        assert_eq!(alarm.trips(), 0);

        let dead = StormAlarm::new("psp", StormConfig::default());
        for i in 1..=10 {
            dead.record_request();
            assert_eq!(dead.retry_wanted(), i < 10, "call {i}");
        }
    }
}
