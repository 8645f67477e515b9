//! [`AttemptLimit`]: when an attempt that has had no answer is abandoned for the next one.

use std::sync::Arc;
use std::time::Duration;

use crate::deadline::Margin;

/// When the retry layer abandons an attempt that has had no answer (dropping it, which cancels
/// it) and sends the next one, inside the call's one deadline: an attempt that could be retried
/// is given half of what is left of the deadline, when that half is more than
/// `max(floor, multiple x RTT_p99)` of the destination's recent attempts (as its [`Margin`]
/// measures them, once it holds [`MIN_SAMPLES`](Self::MIN_SAMPLES) of them: until the
/// destination's tail is known, nothing is cut short); otherwise it runs until the deadline.
///
/// An attempt can be stranded without any answer or error: sent on a connection that went away
/// at the same instant, or to a peer that vanished without closing it. Without a limit it holds
/// the call until the deadline; with one, it costs half the budget and the retry gets the rest.
/// An attempt is only limited when the call may still be retried after it: its body is kept for
/// replay (`Safe` calls, `Keyed` calls with their key), the policy allows another attempt on
/// `UNAVAILABLE`, and the destination's retry budget has a token. The last attempt the call can
/// make is never cut short.
///
/// An attempt abandoned while the server is still working on it is not free: a `Keyed` retry
/// may find its key in progress, and the retry adds load to a server that may be slow because
/// it is overloaded. Hence half the budget rather than a multiple of recent latencies (which lag
/// behind a server slowing down under load), and only past `max(floor, multiple x RTT_p99)`:
/// the limit is for attempts that will never be answered, not for slow ones (hedging is for
/// those; a hedged stack's floor is at least twice the hedge's minimum delay, so the limit
/// does not pre-empt the hedge).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptLimit {
    floor: Duration,
    multiple: u32,
}

impl AttemptLimit {
    /// The shortest limit by default: calls with no more than 2 s of deadline are never cut
    /// short.
    pub const DEFAULT_FLOOR: Duration = Duration::from_secs(1);
    /// The multiple of the destination's round-trip p99 the limit must exceed by default: an
    /// answer that slow is far past its tail.
    pub const DEFAULT_MULTIPLE: u32 = 10;
    /// Round trips measured before any attempt is limited.
    pub const MIN_SAMPLES: usize = 20;

    /// Half the budget left, when that is more than `max(floor, multiple x RTT_p99)`.
    pub fn new(floor: Duration, multiple: u32) -> Self {
        Self { floor, multiple }
    }

    /// The same limit with a floor of at least `floor`.
    pub fn at_least(self, floor: Duration) -> Self {
        Self::new(self.floor.max(floor), self.multiple)
    }

    /// The shortest limit for a destination whose round-trip p99 is `rtt_p99` (zero before any
    /// was measured): `max(floor, multiple x rtt_p99)`.
    pub fn shortest(&self, rtt_p99: Duration) -> Duration {
        rtt_p99.saturating_mul(self.multiple).max(self.floor)
    }

    /// How long an attempt starting with `remaining` of the call's budget is given: half of
    /// it, or `None` (until the deadline) when half is not more than
    /// [`shortest`](Self::shortest) or the round-trip p99 is not known (`None`).
    pub fn limit(&self, rtt_p99: Option<Duration>, remaining: Duration) -> Option<Duration> {
        let half = remaining / 2;
        (half > self.shortest(rtt_p99?)).then_some(half)
    }

    /// How long an attempt starting with `remaining` of the call's budget is given, measured
    /// against the p99 of `margin`'s whole attempt durations.
    pub(crate) fn limit_by(&self, margin: &Margin, remaining: Duration) -> Option<Duration> {
        self.limit(margin.attempt_p99(Self::MIN_SAMPLES), remaining)
    }
}

impl Default for AttemptLimit {
    /// Half the budget left, when that is more than `max(1 s, 10 x RTT_p99)`.
    fn default() -> Self {
        Self::new(Self::DEFAULT_FLOOR, Self::DEFAULT_MULTIPLE)
    }
}

/// An [`AttemptLimit`] and the round trips it is measured against.
#[derive(Debug, Clone)]
pub(crate) struct Limiter {
    pub(crate) limit: AttemptLimit,
    pub(crate) margin: Arc<Margin>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);
    const S: Duration = Duration::from_secs(1);

    #[test]
    fn an_attempt_gets_half_the_budget_left() {
        let limit = AttemptLimit::default();
        assert_eq!(limit.limit(Some(Duration::ZERO), 10 * S), Some(5 * S));
        assert_eq!(limit.limit(Some(3 * MS), 30 * S), Some(15 * S));
        assert_eq!(
            limit.limit(Some(Duration::ZERO), 2_001 * MS),
            Some(Duration::from_micros(1_000_500))
        );
    }

    #[test]
    fn only_when_half_is_past_the_floor_and_the_destinations_tail() {
        let limit = AttemptLimit::default();
        // The floor: a 2 s call is never cut short.
        assert_eq!(limit.limit(Some(Duration::ZERO), 2 * S), None);
        assert_eq!(limit.shortest(3 * MS), S);
        // The tail: 10 x a p99 of 600 ms is more than half of 10 s.
        assert_eq!(limit.shortest(600 * MS), 6 * S);
        assert_eq!(limit.limit(Some(600 * MS), 10 * S), None);
        assert_eq!(limit.limit(Some(400 * MS), 10 * S), Some(5 * S));
        // A hedged stack's floor.
        assert_eq!(
            limit.at_least(6 * S).limit(Some(Duration::ZERO), 10 * S),
            None
        );
        assert_eq!(limit.at_least(MS), limit);
        assert_eq!(
            AttemptLimit::new(MS, u32::MAX).shortest(Duration::MAX),
            Duration::MAX
        );
    }

    #[test]
    fn nothing_is_cut_short_until_the_destinations_tail_is_known() {
        let limit = AttemptLimit::default();
        assert_eq!(limit.limit(None, 60 * S), None);
        let margin = Margin::new(MS);
        for _ in 1..AttemptLimit::MIN_SAMPLES {
            margin.observe_attempt(3 * MS, None);
        }
        assert_eq!(limit.limit_by(&margin, 10 * S), None);
        margin.observe_attempt(3 * MS, None);
        assert_eq!(limit.limit_by(&margin, 10 * S), Some(5 * S));
    }
}
