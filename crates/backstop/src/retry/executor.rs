//! Running a logical request: attempts under one deadline, backoff or pushback between them,
//! the budget consulted before every retry.

use std::future::Future;
use std::time::Duration;

use rand::{Rng, RngExt};
use tokio::time::Instant;

use super::throttle::is_overload_refusal;
use super::{RetryError, RetryPolicy, StopReason};
use crate::deadline::Deadline;
use crate::observe::{event, label};
use crate::status::{Code, Outcome, RetryClass, Status, problem};

pub use crate::observe::RPC_CLIENT_RETRY_STOPS_TOTAL;

/// The problem code of an attempt rejected locally by adaptive throttling.
const THROTTLED_PROBLEM: &str = "throttled";

/// The smallest wait after a pushback: a server that says "retry after 0" still gets a pause.
const MIN_PUSHBACK: Duration = Duration::from_millis(1);

/// One attempt of a logical request, handed to the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for the first attempt, 2 for the first retry, ...
    pub number: u32,
    /// The logical request's deadline, the same for every attempt. Send its remaining budget
    /// (e.g. as `grpc-timeout`, after [`Deadline::child`] for the margin), never a fresh one.
    pub deadline: Deadline,
}

impl Attempt {
    /// Whether this attempt is a retry (any attempt after the first).
    pub fn is_retry(&self) -> bool {
        self.number > 1
    }
}

/// What the caller knows about a logical request, for the `rpc_attempt` log event.
///
/// Nothing here becomes a metric label. The idempotency key must be generated (and persisted)
/// before [`RetryPolicy::execute_with`] is called and sent unchanged on every attempt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallInfo<'a> {
    /// The request's idempotency key, which ties its attempts together in the logs.
    pub idempotency_key: Option<&'a str>,
    /// The address or name of the instance called.
    pub peer: Option<&'a str>,
    /// The trace id (e.g. from `traceparent`).
    pub trace_id: Option<&'a str>,
}

impl<'a> CallInfo<'a> {
    /// No key, peer or trace id.
    pub fn new() -> Self {
        Self::default()
    }

    /// With the idempotency key.
    pub fn key(self, idempotency_key: &'a str) -> Self {
        Self {
            idempotency_key: Some(idempotency_key),
            ..self
        }
    }

    /// With the peer.
    pub fn peer(self, peer: &'a str) -> Self {
        Self {
            peer: Some(peer),
            ..self
        }
    }

    /// With the trace id.
    pub fn trace_id(self, trace_id: &'a str) -> Self {
        Self {
            trace_id: Some(trace_id),
            ..self
        }
    }
}

impl RetryPolicy {
    /// Runs one logical request: calls `f` once per attempt until it succeeds or the policy
    /// stops, and reports why it stopped.
    ///
    /// Same as [`execute_with`](Self::execute_with) with an empty [`CallInfo`].
    pub async fn execute<F, Fut, T>(&self, deadline: Deadline, f: F) -> Result<T, RetryError>
    where
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        self.execute_with(&CallInfo::new(), deadline, f).await
    }

    /// Runs one logical request: calls `f` once per attempt until it succeeds or the policy
    /// stops, and reports why it stopped.
    ///
    /// - Every attempt shares `deadline` and is cut off when it passes (the attempt then
    ///   counts as `DEADLINE_EXCEEDED` and the request stops with [`StopReason::Deadline`]).
    /// - The budget gets one deposit per call of this method (one logical request) and loses
    ///   one token per retry; no token, no retry ([`StopReason::BudgetExhausted`]). With a
    ///   [gRPC retry throttle](super::RetrySpend::retry_throttle), a failure with a
    ///   retried code also takes a token from it, a success gives back its ratio, and no retry
    ///   follows a failure that leaves half its tokens or fewer (the same stop reason).
    /// - Fatal codes stop at once ([`StopReason::NonRetryable`]), and so does
    ///   `DEADLINE_EXCEEDED` unless the policy is [keyed](super::RetryPolicyBuilder::keyed).
    /// - Between attempts it waits the server's pushback x uniform[0.8, 1.2] (never zero) when
    ///   the status carries one, else the backoff delay. It only waits when the deadline leaves
    ///   room for the wait plus [`min_attempt`](Self::min_attempt); otherwise it stops with
    ///   [`StopReason::Pushback`] or [`StopReason::Deadline`] without sleeping.
    /// - At most [`max_attempts`](Self::max_attempts) attempts ([`StopReason::MaxAttempts`]).
    ///
    /// Each attempt is counted in `rpc_client_attempts_total{attempt,outcome}` and logged as an
    /// `rpc_attempt` event with `call`'s fields; a stop is counted in
    /// `rpc_client_retry_stops_total{reason}` and logged as `rpc_retry_stopped`. An attempt
    /// adaptive throttling refuses is not sent, so it is no attempt: only the stop
    /// (`throttled`) is counted and logged, and a request refused before its first attempt
    /// fails with outcome `rejected`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use backstop::deadline::Deadline;
    /// use backstop::retry::{CallInfo, RetryPolicy, StopReason};
    /// use backstop::status::{Code, Status};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let policy = RetryPolicy::builder("psp", "Charge").keyed(true).build()?;
    /// // The key exists before the first attempt and is the same on every attempt.
    /// let key = "pay-o-8812";
    /// let call = CallInfo::new().key(key).peer("10.2.7.11:8443");
    ///
    /// let deadline = Deadline::after(Duration::from_secs(1));
    /// let charged = policy
    ///     .execute_with(&call, deadline, |attempt| async move {
    ///         assert_eq!(attempt.deadline, deadline); // one deadline for all attempts
    ///         if attempt.number < 3 {
    ///             Err(Status::new(Code::Unavailable, "psp restarting"))
    ///         } else {
    ///             Ok(format!("charged with {key}"))
    ///         }
    ///     })
    ///     .await?;
    /// assert_eq!(charged, "charged with pay-o-8812");
    ///
    /// // A fatal answer is not retried, and the error says why it stopped.
    /// let err = policy
    ///     .execute(Deadline::after(Duration::from_secs(1)), |_| async {
    ///         Err::<(), _>(Status::new(Code::InvalidArgument, "amount must be positive"))
    ///     })
    ///     .await
    ///     .unwrap_err();
    /// assert_eq!((err.attempts, err.reason), (1, StopReason::NonRetryable));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn execute_with<F, Fut, T>(
        &self,
        call: &CallInfo<'_>,
        deadline: Deadline,
        mut f: F,
    ) -> Result<T, RetryError>
    where
        F: FnMut(Attempt) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let mut attempts = self.attempts(deadline);
        loop {
            let started = Instant::now();
            let (attempt, remaining) = attempts.start(self, call, started)?;
            let result = tokio::time::timeout_at(deadline.instant(), f(attempt)).await;
            let elapsed = started.elapsed();
            let wait = match result {
                Ok(Ok(value)) => {
                    attempts.succeeded(self, call, remaining, elapsed);
                    return Ok(value);
                }
                Ok(Err(status)) => attempts.failed(self, call, status, remaining, elapsed)?,
                Err(_elapsed) => attempts.cut_off(self, call, remaining, elapsed)?,
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// The bookkeeping of one logical request's attempts, for a caller that runs each attempt
    /// itself rather than through a closure (the retry layer, which owns the service it calls
    /// and must not clone it per attempt). [`execute_with`](Self::execute_with) is the loop
    /// around it: `start`, run the attempt cut off at the deadline, then `succeeded`, `failed`
    /// or `cut_off`, and sleep the wait they return.
    ///
    /// The bookkeeping holds no reference to the policy or the call's details: each step is
    /// given them, so that a hand-written future can own the bookkeeping beside them. The
    /// `..._at` steps read no clock and draw from the generator they are given, so a caller on a
    /// virtual clock (a discrete-event simulation) runs the same decisions deterministically.
    ///
    /// Creating it counts one logical request: it deposits into the budget.
    pub fn attempts(&self, deadline: Deadline) -> Attempts {
        self.spend.record_request();
        self.metrics.request(&self.service, &self.method);
        Attempts {
            deadline,
            number: 0,
            prev_delay: Duration::ZERO,
            last: None,
        }
    }

    /// The wait before the next attempt, or why there is none. Takes the budget token last,
    /// so a retry that will not be sent does not spend one.
    #[allow(clippy::too_many_arguments)]
    fn next_delay<R: Rng + ?Sized>(
        &self,
        status: &Status,
        cut_off: bool,
        attempts: u32,
        prev_delay: Duration,
        deadline: &Deadline,
        now: Instant,
        rng: &mut R,
    ) -> Result<Wait, StopReason> {
        if cut_off {
            return Err(StopReason::Deadline);
        }
        if status.problem() == problem::CIRCUIT_OPEN {
            return Err(StopReason::CircuitOpen);
        }
        if self
            .retryable
            .as_deref()
            .is_some_and(|codes| !codes.contains(&status.code()))
        {
            return Err(StopReason::NonRetryable);
        }
        match status.retry_class() {
            RetryClass::Fatal => return Err(StopReason::NonRetryable),
            RetryClass::Timeout if !self.keyed => return Err(StopReason::NonRetryable),
            RetryClass::Timeout | RetryClass::Retryable | RetryClass::RetryAfterPushback => {}
        }
        // gRPC counts a failure with a retried code before it looks at the attempts left, so
        // a call's last failure drains the bucket too; counted the same way, the same answers
        // send the same retries as a gRPC client would.
        if self.counts_throttle() && !self.spend.record_retryable_failure() {
            return Err(StopReason::BudgetExhausted);
        }
        if attempts >= self.max_attempts {
            return Err(StopReason::MaxAttempts);
        }
        // A retry is asked for: the storm alarm counts it whether or not it is sent.
        self.spend.retry_wanted_at(now)?;
        let remaining = deadline.remaining_at(now);
        let wait = match status.pushback() {
            Some(pushback) => {
                let delay = jitter_pushback(pushback, rng).max(self.backoff.floor());
                if !fits(remaining, delay, self.min_attempt) {
                    return Err(StopReason::Pushback);
                }
                Wait::Pushback(delay)
            }
            None => {
                let delay = self.backoff.delay(attempts - 1, prev_delay, rng);
                if !fits(remaining, delay, self.min_attempt) {
                    return Err(StopReason::Deadline);
                }
                Wait::Backoff(delay)
            }
        };
        if !self.spend.take_retry_token() {
            return Err(StopReason::BudgetExhausted);
        }
        Ok(wait)
    }

    /// Whether this policy's answers feed gRPC's retry throttling: as in gRPC, only a method
    /// that may be retried counts its attempts.
    fn counts_throttle(&self) -> bool {
        self.max_attempts > 1
    }

    #[allow(clippy::too_many_arguments)]
    fn record_attempt(
        &self,
        call: &CallInfo<'_>,
        number: u32,
        outcome: Outcome,
        code: &'static str,
        stop_reason: Option<StopReason>,
        remaining_at_send: Duration,
        elapsed: Duration,
    ) {
        self.metrics.attempt(
            &self.service,
            &self.method,
            number,
            outcome,
            elapsed.as_secs_f64(),
        );
        if number > 1 {
            // A retry is counted once sent: one decided on but then refused is none.
            self.metrics.retry(&self.service, &self.method);
        }
        tracing::info!(
            name: event::RPC_ATTEMPT,
            event = event::RPC_ATTEMPT,
            service = &*self.service,
            method = &*self.method,
            idempotency_key = call.idempotency_key,
            attempt = number,
            outcome = outcome.as_str(),
            code,
            deadline_remaining_ms =
                u64::try_from(remaining_at_send.as_millis()).unwrap_or(u64::MAX),
            duration_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
            stop_reason = stop_reason.map(StopReason::as_str),
            peer = call.peer,
            trace_id = call.trace_id,
            "{}",
            event::RPC_ATTEMPT
        );
    }

    fn stop(
        &self,
        call: &CallInfo<'_>,
        last: Status,
        attempts: u32,
        reason: StopReason,
    ) -> RetryError {
        metrics::counter!(RPC_CLIENT_RETRY_STOPS_TOTAL,
            label::SERVICE => self.service.clone(), label::METHOD => self.method.clone(),
            label::REASON => reason.as_str())
        .increment(1);
        tracing::info!(
            name: event::RPC_RETRY_STOPPED,
            event = event::RPC_RETRY_STOPPED,
            service = &*self.service,
            method = &*self.method,
            idempotency_key = call.idempotency_key,
            attempts,
            reason = reason.as_str(),
            code = last.code().as_str(),
            trace_id = call.trace_id,
            "{}",
            event::RPC_RETRY_STOPPED
        );
        RetryError {
            last,
            attempts,
            reason,
        }
    }
}

/// A wait the executor decided on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// A backoff delay; the next decorrelated delay builds on it.
    Backoff(Duration),
    /// The server's pushback, jittered.
    Pushback(Duration),
}

/// The attempts of one logical request so far: see [`RetryPolicy::attempts`].
#[derive(Debug)]
pub struct Attempts {
    deadline: Deadline,
    number: u32,
    prev_delay: Duration,
    /// The status of the last failed attempt, reported if the deadline stops the next one.
    last: Option<Status>,
}

impl Attempts {
    /// The next attempt, starting `now`, and the budget left as it starts, or the stop when
    /// nothing is left. (`now` from the caller, who times the attempt from the same reading.)
    pub fn start(
        &mut self,
        policy: &RetryPolicy,
        call: &CallInfo<'_>,
        now: Instant,
    ) -> Result<(Attempt, Duration), RetryError> {
        let remaining = self.deadline.remaining_at(now);
        if remaining.is_zero() {
            // Nothing left to send with: only before the first attempt, or after a wait that
            // ended on the deadline with a zero minimal attempt.
            let last = self.last.take().unwrap_or_else(|| {
                Status::new(
                    Code::DeadlineExceeded,
                    "deadline passed before the first attempt",
                )
                .with_problem(problem::DEADLINE_EXCEEDED)
            });
            return Err(policy.stop(call, last, self.number, StopReason::Deadline));
        }
        if !policy.spend.admit_at(now) {
            // Rejected locally: never sent, so not an attempt.
            let status = Status::new(
                Code::Unavailable,
                "rejected locally by adaptive throttling: the server is refusing load",
            )
            .with_problem(THROTTLED_PROBLEM);
            return Err(self.stop_unsent(policy, call, status, StopReason::Throttled));
        }
        self.number += 1;
        Ok((
            Attempt {
                number: self.number,
                deadline: self.deadline,
            },
            remaining,
        ))
    }

    /// Counts the logical request for the storm alarm when its first attempt ends: counted
    /// as it starts, a burst of calls still waiting for their first answer would dilute the
    /// retries the earliest answers ask for, and let a storm run on before the alarm trips.
    fn first_answered(&self, policy: &RetryPolicy, now: Instant) {
        if self.number == 1 {
            policy.spend.record_first_answer_at(now);
        }
    }

    /// The attempt succeeded.
    pub(crate) fn succeeded(
        &self,
        policy: &RetryPolicy,
        call: &CallInfo<'_>,
        remaining: Duration,
        elapsed: Duration,
    ) {
        self.succeeded_at(policy, call, remaining, elapsed, Instant::now());
    }

    /// The attempt succeeded, answered at `now`; `remaining` is the budget it was started
    /// with, `elapsed` how long it took.
    pub fn succeeded_at(
        &self,
        policy: &RetryPolicy,
        call: &CallInfo<'_>,
        remaining: Duration,
        elapsed: Duration,
        now: Instant,
    ) {
        policy.spend.record_accepted_at(now);
        if policy.counts_throttle() {
            policy.spend.record_retryable_success();
        }
        self.first_answered(policy, now);
        policy.record_attempt(
            call,
            self.number,
            Outcome::Ok,
            "OK",
            None,
            remaining,
            elapsed,
        );
    }

    /// The attempt was cut off at the deadline.
    pub(crate) fn cut_off(
        &mut self,
        policy: &RetryPolicy,
        call: &CallInfo<'_>,
        remaining: Duration,
        elapsed: Duration,
    ) -> Result<Duration, RetryError> {
        let status = Status::new(Code::DeadlineExceeded, "deadline passed during the attempt")
            .with_problem(problem::DEADLINE_EXCEEDED);
        let now = Instant::now();
        self.finish(
            policy,
            call,
            status,
            true,
            remaining,
            elapsed,
            now,
            &mut rand::rng(),
        )
    }

    /// The attempt was cut off at the deadline, at `now`: the request stops with
    /// [`StopReason::Deadline`] (the generator is there for symmetry with
    /// [`failed_at`](Self::failed_at); nothing is drawn from it).
    #[allow(clippy::too_many_arguments)]
    pub fn cut_off_at<R: Rng + ?Sized>(
        &mut self,
        policy: &RetryPolicy,
        call: &CallInfo<'_>,
        remaining: Duration,
        elapsed: Duration,
        now: Instant,
        rng: &mut R,
    ) -> Result<Duration, RetryError> {
        let status = Status::new(Code::DeadlineExceeded, "deadline passed during the attempt")
            .with_problem(problem::DEADLINE_EXCEEDED);
        self.finish(policy, call, status, true, remaining, elapsed, now, rng)
    }

    /// The attempt just started was refused before it was sent, by a layer below the caller
    /// (an open circuit: [`StopReason::CircuitOpen`]; less of the deadline left than the
    /// peer's margin: [`StopReason::Deadline`]). A refusal is no attempt: it is taken back from
    /// the count, neither counted in `rpc_client_attempts_total` nor logged as `rpc_attempt`,
    /// and the request stops with `reason` (`rpc_client_retry_stops_total`,
    /// `rpc_retry_stopped`), spending nothing more.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    pub(crate) fn refused(
        &mut self,
        policy: &RetryPolicy,
        call: &CallInfo<'_>,
        refusal: Status,
        reason: StopReason,
    ) -> RetryError {
        self.number = self.number.saturating_sub(1);
        self.stop_unsent(policy, call, refusal, reason)
    }

    /// Stops the request on an attempt that was not sent: the error reports the status of the
    /// last attempt sent, or `refusal` (outcome `rejected`) when none was.
    fn stop_unsent(
        &mut self,
        policy: &RetryPolicy,
        call: &CallInfo<'_>,
        refusal: Status,
        reason: StopReason,
    ) -> RetryError {
        let last = self.last.take().unwrap_or_else(|| refusal.as_rejected());
        policy.stop(call, last, self.number, reason)
    }

    /// The attempt failed with `status`: the wait before the next one, or why there is none.
    pub(crate) fn failed(
        &mut self,
        policy: &RetryPolicy,
        call: &CallInfo<'_>,
        status: Status,
        remaining: Duration,
        elapsed: Duration,
    ) -> Result<Duration, RetryError> {
        // The thread-local generator is used and dropped here, never held across an await.
        let now = Instant::now();
        self.failed_at(
            policy,
            call,
            status,
            remaining,
            elapsed,
            now,
            &mut rand::rng(),
        )
    }

    /// The attempt failed with `status`, answered at `now`: the wait before the next attempt
    /// (its jitter drawn from `rng`), or why there is none. `remaining` is the budget the
    /// attempt was started with, `elapsed` how long it took.
    #[allow(clippy::too_many_arguments)]
    pub fn failed_at<R: Rng + ?Sized>(
        &mut self,
        policy: &RetryPolicy,
        call: &CallInfo<'_>,
        status: Status,
        remaining: Duration,
        elapsed: Duration,
        now: Instant,
        rng: &mut R,
    ) -> Result<Duration, RetryError> {
        self.finish(policy, call, status, false, remaining, elapsed, now, rng)
    }

    /// The attempts sent so far (the first included).
    pub fn sent(&self) -> u32 {
        self.number
    }

    #[allow(clippy::too_many_arguments)]
    fn finish<R: Rng + ?Sized>(
        &mut self,
        policy: &RetryPolicy,
        call: &CallInfo<'_>,
        status: Status,
        cut_off: bool,
        remaining: Duration,
        elapsed: Duration,
        now: Instant,
        rng: &mut R,
    ) -> Result<Duration, RetryError> {
        self.first_answered(policy, now);
        if !cut_off && !is_overload_refusal(&status) {
            policy.spend.record_accepted_at(now);
        }
        let next = policy.next_delay(
            &status,
            cut_off,
            self.number,
            self.prev_delay,
            &self.deadline,
            now,
            rng,
        );
        policy.record_attempt(
            call,
            self.number,
            status.outcome(),
            status.code().as_str(),
            next.err(),
            remaining,
            elapsed,
        );
        let wait = match next {
            Err(reason) => return Err(policy.stop(call, status, self.number, reason)),
            Ok(Wait::Backoff(delay)) => {
                self.prev_delay = delay;
                delay
            }
            Ok(Wait::Pushback(delay)) => delay,
        };
        self.last = Some(status);
        Ok(wait)
    }
}

/// Whether `remaining` covers a wait of `delay` and then a minimal attempt.
fn fits(remaining: Duration, delay: Duration, min_attempt: Duration) -> bool {
    delay
        .checked_add(min_attempt)
        .is_some_and(|needed| needed <= remaining)
}

/// `pushback` x uniform[0.8, 1.2], at least [`MIN_PUSHBACK`], saturating instead of
/// overflowing: clients told the same Retry-After must not all come back at once.
fn jitter_pushback<R: Rng + ?Sized>(pushback: Duration, rng: &mut R) -> Duration {
    let factor: f64 = rng.random_range(0.8..=1.2);
    Duration::try_from_secs_f64(pushback.as_secs_f64() * factor)
        .unwrap_or(Duration::MAX)
        .max(MIN_PUSHBACK)
}

#[cfg(test)]
mod tests;
