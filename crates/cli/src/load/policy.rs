//! How a logical request becomes attempts: backstop's policy, or the naive loop of seed 2.10.2
//! kept for comparison.

use std::sync::Mutex;
use std::time::Duration;

use backstop::deadline::Deadline;
use backstop::idempotency::IdempotencyKey;
use backstop::retry::{CallInfo, RetryPolicy, StopReason};
use backstop::status::{Outcome, RetryClass, Status};
use clap::ValueEnum;
use tokio::time::Instant;

use super::report::{AttemptRecord, LogicalRecord, Tally};
use super::target::{Client, Send};

/// Attempts of the naive preset.
const NAIVE_ATTEMPTS: u32 = 3;
/// The naive preset's fixed first delay, doubled each retry, never jittered.
const NAIVE_DELAY: Duration = Duration::from_millis(50);

/// Which client behaviour drives the load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PolicyKind {
    /// One key and one deadline per logical request, retry budget, full jitter, pushback.
    Backstop,
    /// 3 attempts, no budget, no jitter, a fresh key and a fresh timeout per attempt (the
    /// seed's 2.10.2 bug; for comparison only: it can charge twice).
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

/// One logical request's business data.
#[derive(Debug)]
pub(crate) struct Logical {
    pub(crate) order_id: String,
    pub(crate) amount_cents: u64,
}

/// Runs a logical request and tallies it.
#[derive(Debug, Clone)]
pub(crate) enum Driver {
    /// backstop's executor with one budget shared by every logical request (one destination).
    Backstop { policy: RetryPolicy },
    /// The naive loop.
    Naive,
}

impl Driver {
    pub(crate) fn new(kind: PolicyKind) -> Result<Driver, String> {
        match kind {
            PolicyKind::Backstop => {
                let policy = RetryPolicy::builder("payment", "POST /v1/payments")
                    .keyed(true)
                    .build()
                    .map_err(|e| format!("retry policy: {e}"))?;
                Ok(Driver::Backstop { policy })
            }
            PolicyKind::Naive => Ok(Driver::Naive),
        }
    }

    /// Runs `logical` within `timeout` and records its attempts and end in `tally`.
    pub(crate) async fn run(
        &self,
        client: &Client,
        logical: &Logical,
        timeout: Duration,
        tally: &mut Tally,
    ) {
        match self {
            Driver::Backstop { policy } => backstop(policy, client, logical, timeout, tally).await,
            Driver::Naive => naive(client, logical, timeout, tally).await,
        }
    }
}

/// Records an attempt when dropped: also the attempts the executor cuts off at the deadline,
/// whose futures never finish.
struct AttemptGuard<'a> {
    log: &'a Mutex<Vec<AttemptRecord>>,
    number: u32,
    started: Instant,
    outcome: Outcome,
}

impl Drop for AttemptGuard<'_> {
    fn drop(&mut self) {
        let record = AttemptRecord {
            number: self.number,
            latency: self.started.elapsed(),
            outcome: self.outcome,
            hedge: false,
        };
        self.log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(record);
    }
}

async fn backstop(
    policy: &RetryPolicy,
    client: &Client,
    logical: &Logical,
    timeout: Duration,
    tally: &mut Tally,
) {
    // Generated once, before the first send, and sent unchanged on every attempt.
    let key = IdempotencyKey::generate();
    let deadline = Deadline::after(timeout);
    let attempts = Mutex::new(Vec::new());
    let call = CallInfo::new().key(key.as_str());
    let result = policy
        .execute_with(&call, deadline, |attempt| {
            let attempts = &attempts;
            let key = key.as_str();
            async move {
                let mut guard = AttemptGuard {
                    log: attempts,
                    number: attempt.number,
                    started: Instant::now(),
                    // What it counts as when the deadline cuts it off.
                    outcome: Outcome::Timeout,
                };
                let result = client
                    .send(Send {
                        order_id: &logical.order_id,
                        amount_cents: logical.amount_cents,
                        idempotency_key: key,
                        attempt: attempt.number,
                        deadline: attempt.deadline,
                    })
                    .await;
                guard.outcome = outcome_of(&result);
                result
            }
        })
        .await;
    for a in attempts.into_inner().unwrap_or_else(|p| p.into_inner()) {
        tally.attempt(a);
    }
    tally.logical(match result {
        Ok(()) => LogicalRecord {
            outcome: Outcome::Ok,
            stop_reason: None,
        },
        Err(e) => LogicalRecord {
            outcome: e.last.outcome(),
            stop_reason: Some(e.reason.as_str()),
        },
    });
}

async fn naive(client: &Client, logical: &Logical, timeout: Duration, tally: &mut Tally) {
    let mut delay = NAIVE_DELAY;
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
            outcome,
            hedge: false,
        });
        let stop = match &result {
            Ok(()) => None,
            Err(status) if status.retry_class() == RetryClass::Fatal => {
                Some(StopReason::NonRetryable)
            }
            Err(_) if number == NAIVE_ATTEMPTS => Some(StopReason::MaxAttempts),
            Err(_) => {
                tokio::time::sleep(delay).await;
                delay *= 2;
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
