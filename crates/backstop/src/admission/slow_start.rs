//! Slow start after an outage: a [`Limit`] decorator that ramps admission back up.

use std::time::Duration;

use super::limit::Limit;

/// Outcomes judged for an outage: the last 50 completions.
const WINDOW: u32 = 50;
/// Fewest outcomes in the window before an outage is declared.
const MIN_SAMPLES: u32 = 20;
/// Share of failures in the window at or above which the dependency is taken to be down.
const TRIP_SHARE: f64 = 0.5;
/// Successes in a row that end an outage, at least: one success is not a recovery.
const MIN_STREAK: usize = 2;

/// Where a [`SlowStart`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlowStartState {
    /// Out of the way: the limit is the inner limit's.
    Steady,
    /// Most recent requests failed: the limit is the floor until a round of them succeeds.
    Outage,
    /// Recovering: the limit grows by one per success (doubling per round trip) up to the
    /// inner limit's.
    Ramping,
}

/// Slow start around another [`Limit`]: when a dependency goes down, admission drops to a
/// small floor, and when it comes back, admission ramps up the way TCP's congestion window
/// does instead of releasing the whole backlog at once onto a dependency answering with
/// cold-start latency.
///
/// It judges outcomes, never a clock, so it is deterministic:
///
/// - **steady**: the limit is the inner limit's. When, among the last 50 completions (at least
///   20 of them), half or more are failures ([`Limit::on_failure`]), it goes to *outage*.
///   Random failures do not trip it: at 10% failing, half of 50 failing is vanishingly rare.
/// - **outage**: the limit is the floor. A failure restarts the count; `floor` successes in a
///   row (at least two; a full round at the floor) start the *ramp*, so a single success
///   among failures does not open the gate.
/// - **ramping**: the limit starts at the floor and grows by one with each success, so it
///   doubles per round trip. Isolated failures are tolerated; a window of fresh outcomes (at
///   least 20 since the ramp began) with half or more failures goes back to *outage*. When the
///   ramp reaches the inner limit it is *steady* again.
///
/// Every sample, failure and abandonment is passed on to the inner limit, so an adaptive limit
/// keeps learning underneath; a cancelled request (abandoned) says nothing about the
/// dependency and is not judged.
///
/// ```
/// use std::time::Duration;
/// use backstop::admission::{FixedLimit, Limit, SlowStart, SlowStartState};
///
/// let mut limit = SlowStart::new(FixedLimit::new(64), 4);
/// let ms = Duration::from_millis(1);
/// for _ in 0..20 {
///     limit.on_failure(ms, 64); // the dependency is down
/// }
/// assert_eq!((limit.state(), limit.limit()), (SlowStartState::Outage, 4));
/// for _ in 0..4 {
///     limit.on_sample(100 * ms, 4); // one round at the floor succeeds
/// }
/// assert_eq!((limit.state(), limit.limit()), (SlowStartState::Ramping, 4));
/// for _ in 0..4 {
///     limit.on_sample(100 * ms, 4);
/// }
/// assert_eq!(limit.limit(), 8, "doubled in one round");
/// ```
#[derive(Debug, Clone)]
pub struct SlowStart<L> {
    inner: L,
    floor: usize,
    /// The last outcomes, newest in bit 0: 1 for a failure.
    outcomes: u64,
    /// Outcomes held in `outcomes` (at most [`WINDOW`]).
    len: u32,
    phase: Phase,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Steady,
    Outage { streak: usize },
    Ramping { window: usize },
}

impl<L: Limit> SlowStart<L> {
    /// Slow start around `inner`, dropping to `floor` requests at once during an outage
    /// (raised to 1 if zero).
    pub fn new(inner: L, floor: usize) -> Self {
        Self {
            inner,
            floor: floor.max(1),
            outcomes: 0,
            len: 0,
            phase: Phase::Steady,
        }
    }

    /// The limit during an outage, and where a ramp starts.
    pub fn floor(&self) -> usize {
        self.floor
    }

    /// The wrapped limit.
    pub fn inner(&self) -> &L {
        &self.inner
    }

    /// Where it stands.
    pub fn state(&self) -> SlowStartState {
        match self.phase {
            Phase::Steady => SlowStartState::Steady,
            Phase::Outage { .. } => SlowStartState::Outage,
            Phase::Ramping { .. } => SlowStartState::Ramping,
        }
    }

    fn record(&mut self, failed: bool) {
        self.outcomes = (self.outcomes << 1) | u64::from(failed);
        self.len = (self.len + 1).min(WINDOW);
    }

    fn forget_outcomes(&mut self) {
        self.outcomes = 0;
        self.len = 0;
    }

    /// Whether the window says the dependency is down.
    fn down(&self) -> bool {
        let failures = (self.outcomes & ((1u64 << WINDOW) - 1)).count_ones();
        self.len >= MIN_SAMPLES && f64::from(failures) >= TRIP_SHARE * f64::from(self.len)
    }

    fn outage(&mut self) {
        self.phase = Phase::Outage { streak: 0 };
    }
}

impl<L: Limit> Limit for SlowStart<L> {
    fn limit(&self) -> usize {
        let inner = self.inner.limit();
        match self.phase {
            Phase::Steady => inner,
            Phase::Outage { .. } => self.floor.min(inner),
            Phase::Ramping { window } => window.min(inner),
        }
        .max(1)
    }

    fn on_sample(&mut self, rtt: Duration, inflight: usize) {
        self.inner.on_sample(rtt, inflight);
        self.record(false);
        match &mut self.phase {
            Phase::Steady => {}
            Phase::Outage { streak } => {
                *streak += 1;
                if *streak >= self.floor.max(MIN_STREAK) {
                    self.phase = Phase::Ramping { window: self.floor };
                    // The ramp is judged on what happens from now on, not on the outage.
                    self.forget_outcomes();
                }
            }
            Phase::Ramping { window } => {
                *window += 1;
                if *window >= self.inner.limit() {
                    self.phase = Phase::Steady;
                }
            }
        }
    }

    fn on_failure(&mut self, elapsed: Duration, inflight: usize) {
        self.inner.on_failure(elapsed, inflight);
        self.record(true);
        match &mut self.phase {
            Phase::Steady | Phase::Ramping { .. } => {
                if self.down() {
                    self.outage();
                }
            }
            Phase::Outage { streak } => *streak = 0,
        }
    }

    fn on_abandoned(&mut self, elapsed: Duration, inflight: usize) {
        self.inner.on_abandoned(elapsed, inflight);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{FixedLimit, Gradient2};

    const MS: Duration = Duration::from_millis(1);

    fn succeed<L: Limit>(limit: &mut SlowStart<L>, n: usize) {
        for _ in 0..n {
            let inflight = limit.limit();
            limit.on_sample(100 * MS, inflight);
        }
    }

    fn fail<L: Limit>(limit: &mut SlowStart<L>, n: usize) {
        for _ in 0..n {
            let inflight = limit.limit();
            limit.on_failure(MS, inflight);
        }
    }

    /// One round trip: as many successes as the limit admits now. Returns the limit after.
    fn round<L: Limit>(limit: &mut SlowStart<L>) -> usize {
        let n = limit.limit();
        succeed(limit, n);
        limit.limit()
    }

    fn in_outage(inner: usize, floor: usize) -> SlowStart<FixedLimit> {
        let mut limit = SlowStart::new(FixedLimit::new(inner), floor);
        succeed(&mut limit, 100);
        fail(&mut limit, 50);
        assert_eq!(limit.state(), SlowStartState::Outage);
        limit
    }

    #[test]
    fn steady_until_half_the_recent_requests_fail_then_the_floor() {
        let mut limit = SlowStart::new(FixedLimit::new(256), 4);
        assert_eq!(
            (limit.state(), limit.limit()),
            (SlowStartState::Steady, 256)
        );
        succeed(&mut limit, 100);
        // 24 failures among the last 50: under half.
        fail(&mut limit, 24);
        assert_eq!(
            (limit.state(), limit.limit()),
            (SlowStartState::Steady, 256)
        );
        fail(&mut limit, 1);
        assert_eq!((limit.state(), limit.limit()), (SlowStartState::Outage, 4));
    }

    #[test]
    fn too_few_outcomes_are_not_judged() {
        let mut limit = SlowStart::new(FixedLimit::new(64), 4);
        fail(&mut limit, 19);
        assert_eq!(limit.limit(), 64, "19 failures out of 19: too few to judge");
        fail(&mut limit, 1);
        assert_eq!(limit.limit(), 4);
    }

    #[test]
    fn the_ramp_doubles_per_round_of_successes_and_ends_at_the_inner_limit() {
        let mut limit = in_outage(256, 4);
        assert_eq!(
            round(&mut limit),
            4,
            "the round at the floor ends the outage"
        );
        assert_eq!(limit.state(), SlowStartState::Ramping);
        let mut seen = vec![limit.limit()];
        while limit.state() == SlowStartState::Ramping {
            seen.push(round(&mut limit));
        }
        assert_eq!(seen, [4, 8, 16, 32, 64, 128, 256]);
        assert_eq!(limit.state(), SlowStartState::Steady, "out of the way");
        succeed(&mut limit, 1_000);
        assert_eq!(limit.limit(), 256, "never above the inner limit");
    }

    #[test]
    fn a_single_success_during_an_outage_does_not_flap_it() {
        let mut limit = in_outage(64, 4);
        for _ in 0..100 {
            succeed(&mut limit, 3);
            fail(&mut limit, 1);
            assert_eq!(limit.limit(), 4, "{:?}", limit.state());
        }
        assert_eq!(limit.state(), SlowStartState::Outage);
        // A floor of one still asks for two successes in a row.
        let mut limit = in_outage(64, 1);
        succeed(&mut limit, 1);
        assert_eq!(limit.state(), SlowStartState::Outage);
        succeed(&mut limit, 1);
        assert_eq!(limit.state(), SlowStartState::Ramping);
    }

    #[test]
    fn isolated_failures_do_not_stop_a_ramp_but_a_new_outage_does() {
        let mut limit = in_outage(256, 4);
        succeed(&mut limit, 4);
        for _ in 0..5 {
            round(&mut limit);
            fail(&mut limit, 1);
        }
        assert_eq!(limit.state(), SlowStartState::Ramping);
        assert!(limit.limit() > 64, "{}", limit.limit());

        // The last round and one failure: 49 of the last 50 succeeded. 23 more failures are
        // still under half; the 24th is half.
        fail(&mut limit, 23);
        assert_eq!(limit.state(), SlowStartState::Ramping);
        fail(&mut limit, 1);
        assert_eq!(limit.state(), SlowStartState::Outage);
        assert_eq!(limit.limit(), 4);
    }

    #[test]
    fn ten_percent_failing_at_random_never_trips_it() {
        use rand::{RngExt, SeedableRng, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(15);
        let mut limit = SlowStart::new(FixedLimit::new(128), 4);
        for _ in 0..100_000 {
            if rng.random_bool(0.1) {
                limit.on_failure(MS, 128);
            } else {
                limit.on_sample(100 * MS, 128);
            }
            assert_eq!(limit.limit(), 128);
        }
    }

    #[test]
    fn abandoned_requests_are_not_judged_and_the_inner_limit_keeps_learning() {
        let mut limit = SlowStart::new(Gradient2::new(4, 64), 4);
        for _ in 0..100 {
            limit.on_abandoned(Duration::from_secs(5), 64);
        }
        assert_eq!(limit.state(), SlowStartState::Steady);
        for _ in 0..200 {
            limit.on_sample(100 * MS, 64);
        }
        for _ in 0..50 {
            limit.on_sample(600 * MS, 64);
        }
        let lowered = limit.inner().limit();
        assert!(lowered < 64, "{lowered}");
        assert_eq!(limit.limit(), lowered);
        // During a ramp the inner limit still caps it, and the ramp ends there.
        fail(&mut limit, 50);
        succeed(&mut limit, 4);
        while limit.state() == SlowStartState::Ramping {
            round(&mut limit);
        }
        assert_eq!(limit.limit(), limit.inner().limit());
        assert!(limit.limit() <= 64);
    }

    #[test]
    fn a_floor_above_the_inner_limit_is_capped_and_zero_is_one() {
        let mut limit = SlowStart::new(FixedLimit::new(2), 8);
        fail(&mut limit, 50);
        assert_eq!((limit.state(), limit.limit()), (SlowStartState::Outage, 2));
        assert_eq!(SlowStart::new(FixedLimit::new(2), 0).floor(), 1);
    }
}
