//! Why a logical request stopped being retried, and the error that says so.

use std::fmt;

use crate::status::Status;

/// Why no further attempt was made. Every "did not retry" carries one, in
/// the error, the `rpc_client_retry_stops_total{reason}` metric and the `rpc_retry_stopped`
/// log event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopReason {
    /// The failure cannot be fixed by trying again: a fatal code, or a timeout on a call that
    /// carries no idempotency key (its effect is unknown; converge by querying).
    NonRetryable,
    /// The policy's attempts are used up.
    MaxAttempts,
    /// The shared retry budget has no token left: the dependency is failing for many callers.
    BudgetExhausted,
    /// The deadline has passed, or what is left of it cannot cover the backoff plus a minimal
    /// attempt.
    Deadline,
    /// The server's pushback (`Retry-After`, `grpc-retry-pushback-ms`) ends too close to the
    /// deadline for another attempt.
    Pushback,
    /// A circuit breaker is open for the destination.
    CircuitOpen,
    /// The storm alarm is on: retries are switched off while the retry ratio is too high.
    Storm,
    /// Adaptive throttling rejected the attempt locally: it was not sent.
    Throttled,
    /// The fleet's [retry switch](super::RetrySwitch) is off: no retries, no hedges.
    SwitchedOff,
    /// The request this call serves arrived as a retry: the layer above retries, this one
    /// does not ([`inbound`](super::inbound)).
    RetriedAbove,
    /// The request's own body failed while it was being sent (malformed, cut short, too
    /// large, too slow, its sender gone): the caller's side, which no retry fixes and which
    /// says nothing of the destination (`client::RequestBodyError`).
    RequestBody,
}

impl StopReason {
    /// Every reason, in declaration order.
    pub const ALL: [StopReason; 11] = [
        StopReason::NonRetryable,
        StopReason::MaxAttempts,
        StopReason::BudgetExhausted,
        StopReason::Deadline,
        StopReason::Pushback,
        StopReason::CircuitOpen,
        StopReason::Storm,
        StopReason::Throttled,
        StopReason::SwitchedOff,
        StopReason::RetriedAbove,
        StopReason::RequestBody,
    ];

    /// The reason code used in metrics and logs: `non_retryable`, `max_attempts`,
    /// `budget_exhausted`, `deadline`, `pushback`, `circuit_open`, `storm`, `throttled`,
    /// `switched_off`, `retried_above` or `request_body`.
    pub const fn as_str(self) -> &'static str {
        match self {
            StopReason::NonRetryable => "non_retryable",
            StopReason::MaxAttempts => "max_attempts",
            StopReason::BudgetExhausted => "budget_exhausted",
            StopReason::Deadline => "deadline",
            StopReason::Pushback => "pushback",
            StopReason::CircuitOpen => "circuit_open",
            StopReason::Storm => "storm",
            StopReason::Throttled => "throttled",
            StopReason::SwitchedOff => "switched_off",
            StopReason::RetriedAbove => "retried_above",
            StopReason::RequestBody => "request_body",
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A logical request failed: the status of its last attempt, how many attempts were sent, and
/// why no further attempt was made.
///
/// `attempts` is 0 when the deadline had already passed before the first attempt (`last` is
/// then a `DEADLINE_EXCEEDED` status made by the executor), or when the first attempt was
/// refused locally before it was sent (`last` is then the refusal, whose outcome is
/// `rejected`). An attempt refused after others were sent leaves `last` the status of the
/// last one sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("gave up after {attempts} attempt(s), reason {reason}; last status {}", .last.code())]
pub struct RetryError {
    /// The status of the last attempt (its source).
    #[source]
    pub last: Status,
    /// Attempts sent, first included.
    pub attempts: u32,
    /// Why the executor stopped.
    pub reason: StopReason,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;
    use std::error::Error as _;

    #[test]
    fn reason_codes_follow_the_design() {
        let codes: Vec<&str> = StopReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            codes,
            [
                "non_retryable",
                "max_attempts",
                "budget_exhausted",
                "deadline",
                "pushback",
                "circuit_open",
                "storm",
                "throttled",
                "switched_off",
                "retried_above",
                "request_body"
            ]
        );
        assert_eq!(StopReason::Pushback.to_string(), "pushback");
    }

    #[test]
    fn error_names_its_reason_and_keeps_the_status_as_source() {
        let e = RetryError {
            last: Status::new(Code::Unavailable, "down"),
            attempts: 3,
            reason: StopReason::MaxAttempts,
        };
        assert_eq!(
            e.to_string(),
            "gave up after 3 attempt(s), reason max_attempts; last status UNAVAILABLE"
        );
        let source = e.source().expect("the last status is the source");
        assert_eq!(source.to_string(), e.last.to_string());
    }
}
