//! How a logical request becomes attempts: backstop's client stack ([`super::stack`]), or the
//! naive retry loop (a fresh key per attempt) kept for comparison.

use std::time::Duration;

use backstop::client::Destination;
use backstop::deadline::Deadline;
use backstop::idempotency::IdempotencyKey;
use backstop::retry::{Backoff, StopReason};
use backstop::status::{Outcome, RetryClass, Status};
use clap::ValueEnum;
use tokio::time::Instant;

use super::logical::Logical;
use super::report::{AttemptRecord, LogicalRecord, Tally};
use super::stack::{Hedge, StackClient};
use super::target::{Client, Send, Target};

/// Attempts of the naive preset.
const NAIVE_ATTEMPTS: u32 = 3;
/// The naive preset's fixed first delay, doubled each retry, never jittered.
const NAIVE_DELAY: Duration = Duration::from_millis(50);

/// Which client behaviour drives the load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PolicyKind {
    /// The library's client stack: one key and one deadline per logical request, retries
    /// with a budget, full jitter and pushback, a hedge after the p95, transparent re-sends.
    Backstop,
    /// 3 attempts, no budget, no jitter, a fresh key and a fresh timeout per attempt (the
    /// classic retry bug; for comparison only: it can charge twice).
    Naive,
}

impl PolicyKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Backstop => "backstop",
            PolicyKind::Naive => "naive",
        }
    }
}

/// Runs a logical request and tallies it.
#[derive(Debug, Clone)]
pub(crate) enum Driver {
    /// backstop's client stack, one destination (budget, breaker, latency window) for every
    /// logical request.
    Backstop(StackClient),
    /// The naive loop over a plain client, its delays drawn from the backoff if it has one
    /// (shared: every logical request clones the driver).
    Naive(std::sync::Arc<(Client, Option<Backoff>)>),
}

impl Driver {
    /// The driver of `kind` for `target`; `timeout` is each logical request's deadline,
    /// `destination` (breaker, storm alarm, throttle) is shared by every logical request,
    /// `hedge` says when an attempt is hedged (`backstop` only) and `naive_backoff` draws the
    /// naive loop's delays (`naive` only).
    pub(crate) fn new(
        kind: PolicyKind,
        target: &Target,
        api_key: Option<String>,
        timeout: Duration,
        destination: Destination,
        hedge: Hedge,
        naive_backoff: Option<Backoff>,
    ) -> Result<Driver, String> {
        match kind {
            PolicyKind::Backstop => {
                StackClient::new(target, api_key.as_deref(), timeout, &destination, hedge)
                    .map(Driver::Backstop)
            }
            PolicyKind::Naive => target
                .client(api_key)
                .map(|client| Driver::Naive(std::sync::Arc::new((client, naive_backoff)))),
        }
    }

    /// Runs `logical` within `timeout` and records its attempts and end in `tally`.
    pub(crate) async fn run(&self, logical: &Logical, timeout: Duration, tally: &mut Tally) {
        match self {
            Driver::Backstop(client) => {
                let (attempts, end) = client.run(logical).await;
                if attempts.is_empty() {
                    tally.unsent();
                }
                for a in attempts {
                    tally.attempt(a);
                }
                tally.logical(end);
            }
            Driver::Naive(naive_loop) => {
                let (client, backoff) = &**naive_loop;
                naive(client, backoff.as_ref(), logical, timeout, tally).await;
            }
        }
    }
}

async fn naive(
    client: &Client,
    backoff: Option<&Backoff>,
    logical: &Logical,
    timeout: Duration,
    tally: &mut Tally,
) {
    let mut delay = NAIVE_DELAY;
    let mut prev = Duration::ZERO;
    for number in 1..=NAIVE_ATTEMPTS {
        // The bug under study: a new key and a new full timeout on every attempt.
        let key = IdempotencyKey::generate();
        let deadline = Deadline::after(timeout);
        let started = Instant::now();
        let result = tokio::time::timeout(
            timeout,
            client.send(Send {
                order_id: &logical.order_id,
                amount_cents: logical.amount_cents,
                idempotency_key: key.as_str(),
                attempt: number,
                deadline,
            }),
        )
        .await
        .unwrap_or_else(|_| {
            Err(Status::new(
                backstop::status::Code::DeadlineExceeded,
                "no answer in time",
            ))
        });
        let outcome = outcome_of(&result);
        tally.attempt(AttemptRecord {
            number,
            latency: started.elapsed(),
            outcome: outcome.into(),
            hedge: false,
            resend: false,
            sent: started,
        });
        let stop = match &result {
            Ok(()) => None,
            Err(status) if status.retry_class() == RetryClass::Fatal => {
                Some(StopReason::NonRetryable)
            }
            Err(_) if number == NAIVE_ATTEMPTS => Some(StopReason::MaxAttempts),
            Err(_) => {
                match backoff {
                    Some(backoff) => {
                        prev = backoff.delay(number - 1, prev, &mut rand::rng());
                        tokio::time::sleep(prev).await;
                    }
                    None => {
                        tokio::time::sleep(delay).await;
                        delay *= 2;
                    }
                }
                continue;
            }
        };
        tally.logical(LogicalRecord {
            outcome,
            stop_reason: stop.map(StopReason::as_str),
        });
        return;
    }
}

fn outcome_of(result: &Result<(), Status>) -> Outcome {
    match result {
        Ok(()) => Outcome::Ok,
        Err(status) => status.outcome(),
    }
}
