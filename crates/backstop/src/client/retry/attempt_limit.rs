//! [`AttemptLimit`]: how long one attempt may go unanswered before it is abandoned and retried.

use std::sync::Arc;
use std::time::Duration;

use crate::deadline::Margin;

/// How long one attempt of a retryable call may wait for its answer before the retry layer
/// abandons it (dropping it, which cancels it) and sends the next attempt, inside the call's one
/// deadline: `max(floor, multiple x RTT_p99)` of the destination's recent attempts, as its
/// [`Margin`] measures them.
///
/// An attempt can be stranded without any answer or error: sent on a connection that went away
/// at the same instant, or to a peer that vanished without closing it. Without a limit it holds
/// the call until the deadline; with one, the call loses `limit` and is retried. An attempt is
/// only limited when the call may still be retried after it: its body is kept for replay
/// (`Safe` calls, `Keyed` calls with their key), the policy allows another attempt, the
/// destination's retry budget has a token, and at least the limit is left of the deadline once
/// it would be cut. The last attempt the call can make is never cut short.
///
/// An attempt abandoned while the server is still working on it is not free: a `Keyed` retry
/// may then find its key in progress. Hence a floor well above a healthy round trip and a
/// multiple well past the tail: the limit is for attempts that will never be answered, not for
/// slow ones (hedging is for those; a hedged stack's limit is never below twice the hedge's
/// minimum delay, so it does not pre-empt the hedge).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptLimit {
    floor: Duration,
    multiple: u32,
}

impl AttemptLimit {
    /// The shortest limit by default: far longer than a loaded server takes to answer, so that
    /// only calls with more than 2 s of deadline are ever cut short.
    pub const DEFAULT_FLOOR: Duration = Duration::from_secs(1);
    /// The multiple of the destination's round-trip p99 by default: an answer that slow is
    /// far past its tail.
    pub const DEFAULT_MULTIPLE: u32 = 10;

    /// A limit of `max(floor, multiple x RTT_p99)`.
    pub fn new(floor: Duration, multiple: u32) -> Self {
        Self { floor, multiple }
    }

    /// The same limit, never below `floor`.
    pub fn at_least(self, floor: Duration) -> Self {
        Self::new(self.floor.max(floor), self.multiple)
    }

    /// The limit for an attempt to a destination whose round-trip p99 is `rtt_p99` (zero
    /// before any was measured: then the floor).
    pub fn limit(&self, rtt_p99: Duration) -> Duration {
        rtt_p99.saturating_mul(self.multiple).max(self.floor)
    }

    /// The limit applying to an attempt starting with `remaining` of the call's budget, or
    /// `None` when cutting it there would not leave at least as long for the next one.
    pub(crate) fn within(&self, rtt_p99: Duration, remaining: Duration) -> Option<Duration> {
        let limit = self.limit(rtt_p99);
        (limit.saturating_mul(2) <= remaining).then_some(limit)
    }
}

impl Default for AttemptLimit {
    /// `max(1 s, 10 x RTT_p99)`.
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

    #[test]
    fn the_limit_follows_the_round_trips_above_its_floor() {
        let limit = AttemptLimit::default();
        assert_eq!(limit.limit(Duration::ZERO), 1_000 * MS);
        assert_eq!(limit.limit(3 * MS), 1_000 * MS);
        assert_eq!(limit.limit(180 * MS), 1_800 * MS);
        assert_eq!(limit.at_least(1_500 * MS).limit(3 * MS), 1_500 * MS);
        assert_eq!(limit.at_least(MS), limit);
        assert_eq!(
            AttemptLimit::new(MS, u32::MAX).limit(Duration::MAX),
            Duration::MAX
        );
    }

    #[test]
    fn an_attempt_is_limited_only_when_the_next_one_gets_as_long() {
        let limit = AttemptLimit::new(250 * MS, 10);
        assert_eq!(limit.within(Duration::ZERO, 500 * MS), Some(250 * MS));
        assert_eq!(limit.within(Duration::ZERO, 499 * MS), None);
        assert_eq!(limit.within(100 * MS, 10_000 * MS), Some(1_000 * MS));
        assert_eq!(limit.within(100 * MS, 1_999 * MS), None);
    }
}
