//! The claim protocol's rules, in one place.
//!
//! Every decision a store makes about a key is one of these functions of the record's columns:
//! what a claim does ([`claim`]), whether a lease still holds its record ([`holds`]), whether
//! the sweeper may delete it ([`sweepable`]), and how long a claim's lease must be
//! ([`lease_for`]). The memory store calls them; the SQL stores encode them as conditional
//! statements and are held to them by the conformance suite
//! (`follows_the_protocol_on_random_histories`). The model check beside this module explores
//! the same functions with concurrent executors, crashes, lease expiry and clock skew, so what
//! it proves is about the rules the stores run.

#[cfg(test)]
mod checking;
#[cfg(test)]
mod model_check;
#[cfg(test)]
mod windows_check;

use std::time::Duration;

use super::RecordStatus;

/// What a store knows of a key's record when a claim for it arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Existing {
    /// Where the record is in its life.
    pub status: RecordStatus,
    /// End of its current (or last) lease: the fencing token.
    pub lease_until_ms: i64,
    /// Whether the claim carries the parameters the key was first used with.
    pub same_fingerprint: bool,
}

/// What a claim does to the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ClaimRule {
    /// No record: insert a running one whose lease ends at `lease_until_ms`.
    Insert {
        /// The new lease's end and fencing token.
        lease_until_ms: i64,
    },
    /// The key was used with other parameters: refuse, change nothing.
    Conflict,
    /// The key succeeded: replay its response, change nothing.
    Replay,
    /// Someone holds a live lease until `lease_until_ms`: come back then, change nothing.
    InProgress {
        /// The holder's lease end.
        lease_until_ms: i64,
    },
    /// A failed record, or a running one whose lease has ended (its runner is gone): run again
    /// under a new lease. The token moves strictly forward, so the previous holder's is dead.
    TakeOver {
        /// The new lease's end and fencing token.
        lease_until_ms: i64,
    },
}

/// What a claim made at `now_ms`, asking for a lease until `requested_until_ms`, does to the
/// record `existing` (`None`: no record).
pub(crate) fn claim(existing: Option<Existing>, now_ms: i64, requested_until_ms: i64) -> ClaimRule {
    let Some(existing) = existing else {
        return ClaimRule::Insert {
            lease_until_ms: requested_until_ms,
        };
    };
    if !existing.same_fingerprint {
        return ClaimRule::Conflict;
    }
    match existing.status {
        RecordStatus::Succeeded => ClaimRule::Replay,
        RecordStatus::Running if existing.lease_until_ms > now_ms => ClaimRule::InProgress {
            lease_until_ms: existing.lease_until_ms,
        },
        RecordStatus::Running | RecordStatus::Failed => ClaimRule::TakeOver {
            lease_until_ms: requested_until_ms.max(existing.lease_until_ms.saturating_add(1)),
        },
    }
}

/// Whether the lease whose token is `token` still holds a record in `status` whose lease ends
/// at `lease_until_ms`: only then may its holder complete, fail or release the record.
pub(crate) fn holds(status: RecordStatus, lease_until_ms: i64, token: i64) -> bool {
    status == RecordStatus::Running && lease_until_ms == token
}

/// Whether a sweep at `now_ms` may delete a record: expired, and not running under a lease
/// that is still live.
pub(crate) fn sweepable(
    status: RecordStatus,
    lease_until_ms: i64,
    expires_at_ms: i64,
    now_ms: i64,
) -> bool {
    expires_at_ms <= now_ms && !(status == RecordStatus::Running && lease_until_ms > now_ms)
}

/// How long a claim's lease must be: the route's lease or the request's time left,
/// whichever is longer, plus `max_clock_skew`.
///
/// The holder works until its deadline, which its own monotonic clock measures, while another
/// instance decides that the lease has ended by its wall clock. Two wall clocks may differ by up
/// to twice the bound each keeps to true time, so the lease outlasts the work by that much: a
/// takeover can then never start while the holder may still be working.
#[cfg_attr(not(feature = "server"), allow(dead_code))]
pub(crate) fn lease_for(
    route_lease: Duration,
    time_left: Option<Duration>,
    max_clock_skew: Duration,
) -> Duration {
    let work = time_left.map_or(route_lease, |t| route_lease.max(t));
    work.saturating_add(max_clock_skew.saturating_mul(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_covers_the_longer_of_route_and_timeout_plus_twice_the_skew() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(lease_for(s(5), None, ms(250)), ms(5_500));
        assert_eq!(lease_for(s(5), Some(s(2)), ms(250)), ms(5_500));
        assert_eq!(lease_for(s(5), Some(s(30)), ms(250)), ms(30_500));
        assert_eq!(lease_for(s(5), Some(s(30)), Duration::ZERO), s(30));
        assert_eq!(lease_for(Duration::MAX, None, s(1)), Duration::MAX);
    }

    #[test]
    fn a_takeover_always_moves_the_token_forward() {
        let running = |until| Existing {
            status: RecordStatus::Running,
            lease_until_ms: until,
            same_fingerprint: true,
        };
        // Asked for a lease ending before the old one (a clock behind): still after it.
        assert_eq!(
            claim(Some(running(1_000)), 1_000, 900),
            ClaimRule::TakeOver {
                lease_until_ms: 1_001
            }
        );
        assert_eq!(
            claim(Some(running(1_001)), 1_000, 5_000),
            ClaimRule::InProgress {
                lease_until_ms: 1_001
            }
        );
    }
}
