//! [`AttemptObserver`]: what the client stack did with each call, told as it happens.
//!
//! The stack already decides everything a caller may want to record about a call: which
//! attempt a send was, whether it was a retry, a hedge or a transparent re-send, how its answer
//! was classified, and why the attempts stopped. An observer set with
//! [`ClientStackBuilder::observer`](super::ClientStackBuilder::observer) is handed those
//! decisions, from the same places that count them in the client metrics and log them as
//! `rpc_attempt` events, so a load generator, a test harness or an audit trail never has to
//! guess them again from headers and markers.
//!
//! - [`AttemptObserver::on_attempt`], once per physical send: the first attempt, each retry,
//!   each hedge and each transparent re-send, when it ends (answered, failed, cut off at the
//!   deadline, or dropped because the other attempt of a hedge race answered first). An
//!   attempt the stack refused to send (an open circuit, too little time left for the margin,
//!   adaptive throttling) is not a send: the call's end says why it stopped.
//! - [`AttemptObserver::on_call_end`], once per logical call, when the stack returns its
//!   result: the outcome, how many attempts it made, and why they stopped when it did not
//!   succeed. A call its caller drops before it ends (the caller stopped waiting) is told
//!   nothing more.
//!
//! Both are called on the task that polls the call, while it is being polled: keep them short
//! and never block (hand the event to a channel or a lock-free counter for anything slow).
//! Every event carries the call's request [`Extensions`], so an observer shared by all calls
//! can find what its caller put there to tell the calls apart.
//!
//! The stack holds the observer as an `Arc<dyn AttemptObserver>`: one type of stack whatever
//! observes it (the stack's service type does not grow a parameter), and a call reaches the
//! observer through one pointer it already holds. Without an observer nothing is built or
//! called for it.
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use backstop::client::observer::{AttemptEvent, AttemptKind, AttemptObserver};
//! use backstop::client::{ClientStack, Destination};
//! use backstop::policy::{Idempotency, MethodPolicy};
//!
//! /// Counts the retries that were sent.
//! #[derive(Debug, Default)]
//! struct Retries(AtomicU32);
//!
//! impl AttemptObserver for Retries {
//!     fn on_attempt(&self, attempt: &AttemptEvent<'_>) {
//!         if attempt.kind == AttemptKind::Retry {
//!             self.0.fetch_add(1, Ordering::Relaxed);
//!         }
//!     }
//! }
//!
//! let retries = Arc::new(Retries::default());
//! let get = MethodPolicy::builder("GetCharge", Idempotency::Safe).build();
//! let stack = ClientStack::builder(&Destination::new("psp"), get)
//!     .observer(retries.clone())
//!     .build()
//!     .unwrap();
//! # let _ = stack;
//! ```

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Extensions;
use tokio::time::Instant;

use super::circuit_open::CircuitOpen;
use crate::deadline::DeadlineExceeded;
use crate::retry::StopReason;
use crate::status::{Code, Outcome};

/// Told by the [client stack](super::ClientStack) what became of each send and each call (see
/// the [module docs](self)). Both methods do nothing unless overridden.
pub trait AttemptObserver: Send + Sync + 'static {
    /// One physical send ended.
    fn on_attempt(&self, attempt: &AttemptEvent<'_>) {
        let _ = attempt;
    }

    /// A logical call ended: the stack is returning its result.
    fn on_call_end(&self, end: &CallEnd<'_>) {
        let _ = end;
    }
}

/// What a send was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AttemptKind {
    /// The first attempt of the call.
    First,
    /// An attempt after a failed one, sent after the backoff or the server's pushback.
    Retry,
    /// A copy of a slow attempt, sent while it was still running.
    Hedge,
    /// The same attempt again, at once: the send before it provably never reached the server.
    Transparent,
}

impl AttemptKind {
    /// `first`, `retry`, `hedge` or `transparent`.
    pub const fn as_str(self) -> &'static str {
        match self {
            AttemptKind::First => "first",
            AttemptKind::Retry => "retry",
            AttemptKind::Hedge => "hedge",
            AttemptKind::Transparent => "transparent",
        }
    }
}

impl fmt::Display for AttemptKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One physical send, as it ended: [`AttemptObserver::on_attempt`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct AttemptEvent<'a> {
    /// The destination's name (the `service` metric label).
    pub destination: &'a str,
    /// The method policy's name (the `method` metric label).
    pub method: &'a str,
    /// 1 for the first attempt, 2 for the first retry, ... A hedge is numbered one above the
    /// attempt it copies (the count its `grpc-previous-rpc-attempts` announces, as gRPC numbers
    /// hedges); a transparent re-send has the number of the attempt it sends again.
    pub number: u32,
    /// What the send was.
    pub kind: AttemptKind,
    /// How it ended, as the retry layer classifies answers: [`Outcome::Timeout`] when the
    /// call's deadline cut it off, [`Outcome::Cancelled`] when it was dropped unanswered because
    /// the other attempt of a hedge race answered first.
    pub outcome: Outcome,
    /// The status code of its answer or failure ([`Code::Ok`] on success); `None` when it was
    /// dropped unanswered.
    pub code: Option<Code>,
    /// When it was sent.
    pub started: Instant,
    /// How long it ran.
    pub duration: Duration,
    /// What was left of the call's deadline when it was sent.
    pub deadline_remaining: Duration,
    /// The call's idempotency key, if it has one.
    pub idempotency_key: Option<&'a str>,
    /// The call's request extensions.
    pub extensions: &'a Extensions,
}

/// How a logical call ended: [`AttemptObserver::on_call_end`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct CallEnd<'a> {
    /// The destination's name (the `service` metric label).
    pub destination: &'a str,
    /// The method policy's name (the `method` metric label).
    pub method: &'a str,
    /// [`Outcome::Ok`], or the outcome of the last attempt sent when the call failed;
    /// [`Outcome::Rejected`] when the stack refused to send any (an open circuit, too little
    /// time left for the margin, adaptive throttling).
    pub outcome: Outcome,
    /// The attempts the retry layer sent, the first included (a hedge and a transparent
    /// re-send are part of the attempt they copy; an attempt refused before it was sent is no
    /// attempt, so a call refused outright made 0).
    pub attempts: u32,
    /// Why no further attempt was made, when the call did not succeed; `None` on success, or
    /// when it failed before any attempt could be made (its body could not be read).
    pub stop_reason: Option<StopReason>,
    /// The call's idempotency key, if it has one.
    pub idempotency_key: Option<&'a str>,
    /// The call's request extensions.
    pub extensions: &'a Extensions,
}

/// Why an attempt's `error` says it was refused before it was sent, if it does: an open
/// circuit ([`StopReason::CircuitOpen`]), or too little time to send it within the deadline's
/// margin ([`StopReason::Deadline`]). Such an attempt is no send, and no attempt.
pub(crate) fn refusal(error: &(dyn StdError + 'static)) -> Option<StopReason> {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if e.is::<CircuitOpen>() {
            return Some(StopReason::CircuitOpen);
        }
        if e.is::<DeadlineExceeded>() {
            return Some(StopReason::Deadline);
        }
        cause = e.source();
    }
    None
}

/// Whether an attempt's `error` says it was refused before it was sent (see [`refusal`]).
pub(crate) fn refused_locally(error: &(dyn StdError + 'static)) -> bool {
    refusal(error).is_some()
}

/// The stack's observer, as its layers hold it.
#[derive(Clone)]
pub(crate) struct Observer(pub(crate) Arc<dyn AttemptObserver>);

impl fmt::Debug for Observer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AttemptObserver")
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::Full;
    use tower::{ServiceExt, service_fn};

    use super::*;
    use crate::client::{ClientStack, Destination};
    use crate::hedge::HedgePolicy;
    use crate::policy::{Idempotency, MethodPolicy};
    use crate::retry::RetryBudget;

    /// Marks a call, as a caller tells its calls apart.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Tag(u32);

    /// A send as the observer was told it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Sent {
        number: u32,
        kind: AttemptKind,
        outcome: Outcome,
        code: Option<Code>,
        tag: Option<Tag>,
    }

    /// A call's end as the observer was told it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Ended {
        outcome: Outcome,
        attempts: u32,
        stop_reason: Option<StopReason>,
        tag: Option<Tag>,
    }

    #[derive(Debug, Default)]
    struct Recorder {
        sends: Mutex<Vec<Sent>>,
        ends: Mutex<Vec<Ended>>,
    }

    impl AttemptObserver for Recorder {
        fn on_attempt(&self, attempt: &AttemptEvent<'_>) {
            assert_eq!((attempt.destination, attempt.method), ("psp", "GetCharge"));
            assert!(attempt.deadline_remaining <= Duration::from_secs(2));
            self.sends.lock().unwrap().push(Sent {
                number: attempt.number,
                kind: attempt.kind,
                outcome: attempt.outcome,
                code: attempt.code,
                tag: attempt.extensions.get::<Tag>().copied(),
            });
        }

        fn on_call_end(&self, end: &CallEnd<'_>) {
            self.ends.lock().unwrap().push(Ended {
                outcome: end.outcome,
                attempts: end.attempts,
                stop_reason: end.stop_reason,
                tag: end.extensions.get::<Tag>().copied(),
            });
        }
    }

    impl Recorder {
        fn take(&self) -> (Vec<Sent>, Vec<Ended>) {
            (
                std::mem::take(&mut *self.sends.lock().unwrap()),
                std::mem::take(&mut *self.ends.lock().unwrap()),
            )
        }
    }

    fn sent(number: u32, kind: AttemptKind, outcome: Outcome, code: Option<Code>) -> Sent {
        Sent {
            number,
            kind,
            outcome,
            code,
            tag: Some(Tag(7)),
        }
    }

    fn ended(outcome: Outcome, attempts: u32, stop_reason: Option<StopReason>) -> Ended {
        Ended {
            outcome,
            attempts,
            stop_reason,
            tag: Some(Tag(7)),
        }
    }

    fn get_charge() -> crate::policy::MethodPolicyBuilder {
        MethodPolicy::builder("GetCharge", Idempotency::Safe).timeout(Duration::from_secs(2))
    }

    fn request() -> Request<Full<Bytes>> {
        let mut request = Request::get("http://psp/v1/charges/c-1")
            .body(Full::new(Bytes::new()))
            .unwrap();
        request.extensions_mut().insert(Tag(7));
        request
    }

    /// The `n`th answer (from 0) of a transport answering `statuses` in turn, then 200.
    fn answers(
        statuses: &'static [u16],
    ) -> impl tower::Service<
        Request<crate::client::replay::ReplayBody<Full<Bytes>>>,
        Response = Response<()>,
        Error = io::Error,
        Future = impl Future<Output = io::Result<Response<()>>> + Send,
    > + Clone
    + Send
    + 'static {
        let calls = Arc::new(AtomicUsize::new(0));
        service_fn(move |_r| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            let status = statuses.get(n).copied().unwrap_or(200);
            std::future::ready(Ok(Response::builder().status(status).body(()).unwrap()))
        })
    }

    /// A first attempt answered 503, then a retry that succeeds: two sends, numbered 1 and 2,
    /// and one successful end after two attempts.
    #[tokio::test(start_paused = true)]
    async fn a_503_then_a_successful_retry_is_two_sends_and_one_end() {
        let recorder = Arc::new(Recorder::default());
        let dest = Destination::new("psp");
        let client = ClientStack::builder(&dest, get_charge().build())
            .observer(recorder.clone())
            .build()
            .unwrap()
            .layer(answers(&[503]));
        let response = client.oneshot(request()).await.unwrap();
        assert_eq!(response.status(), 200);
        let (sends, ends) = recorder.take();
        assert_eq!(
            sends,
            [
                sent(
                    1,
                    AttemptKind::First,
                    Outcome::Retryable,
                    Some(Code::Unavailable)
                ),
                sent(2, AttemptKind::Retry, Outcome::Ok, Some(Code::Ok)),
            ]
        );
        assert_eq!(ends, [ended(Outcome::Ok, 2, None)]);
    }

    /// What the observer is told is what the metrics count: each attempt by number and
    /// outcome, and each retry; the first is sent with the whole deadline left.
    #[tokio::test(start_paused = true)]
    async fn the_observer_is_told_what_the_metrics_count() {
        use crate::observe::{RPC_CLIENT_ATTEMPTS_TOTAL, RPC_CLIENT_RETRIES_TOTAL, attempt_label};
        use crate::server::testing::Recorded;
        use metrics_util::debugging::DebuggingRecorder;

        #[derive(Debug, Default)]
        struct Remaining(Mutex<Vec<Duration>>);
        impl AttemptObserver for Remaining {
            fn on_attempt(&self, attempt: &AttemptEvent<'_>) {
                self.0.lock().unwrap().push(attempt.deadline_remaining);
            }
        }
        struct Both(Arc<Recorder>, Arc<Remaining>);
        impl AttemptObserver for Both {
            fn on_attempt(&self, attempt: &AttemptEvent<'_>) {
                self.0.on_attempt(attempt);
                self.1.on_attempt(attempt);
            }
            fn on_call_end(&self, end: &CallEnd<'_>) {
                self.0.on_call_end(end);
            }
        }

        let metrics = DebuggingRecorder::new();
        let _guard = metrics::set_default_local_recorder(&metrics);
        let (recorder, remaining) = (Arc::new(Recorder::default()), Arc::default());
        let dest = Destination::new("psp").breaker(None).storm_alarm(None);
        let client = ClientStack::builder(&dest, get_charge().build())
            .observer(Arc::new(Both(recorder.clone(), Arc::clone(&remaining))))
            .build()
            .unwrap()
            .layer(answers(&[503, 503]));
        assert_eq!(client.oneshot(request()).await.unwrap().status(), 200);

        let (sends, ends) = recorder.take();
        assert_eq!(sends.len(), 3);
        let recorded = Recorded::of(&metrics);
        let who = [("service", "psp"), ("method", "GetCharge")];
        for send in &sends {
            let labels = [
                who[0],
                who[1],
                ("attempt", attempt_label(send.number)),
                ("outcome", send.outcome.as_str()),
            ];
            assert_eq!(
                recorded.counter(RPC_CLIENT_ATTEMPTS_TOTAL, &labels),
                1,
                "{send:?}"
            );
        }
        assert_eq!(recorded.counter(RPC_CLIENT_ATTEMPTS_TOTAL, &who), 3);
        let retries = sends
            .iter()
            .filter(|s| s.kind == AttemptKind::Retry)
            .count();
        assert_eq!(recorded.counter(RPC_CLIENT_RETRIES_TOTAL, &who), 2);
        assert_eq!(retries, 2);
        assert_eq!(ends, [ended(Outcome::Ok, 3, None)]);
        let remaining = remaining.0.lock().unwrap();
        assert_eq!(remaining[0], Duration::from_secs(2));
        assert!(remaining[1] < remaining[0] && remaining[2] < remaining[1]);
    }

    /// A slow attempt hedged after the p95: the hedge is told as one (numbered one above the
    /// attempt it copies) and wins; the attempt it raced is dropped, unanswered.
    #[tokio::test(start_paused = true)]
    async fn a_hedge_is_told_as_a_hedge_and_the_loser_as_cancelled() {
        let calls = Arc::new(AtomicUsize::new(0));
        let transport = {
            let calls = calls.clone();
            service_fn(move |_r: Request<_>| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    // Quick answers fill the latency window; then one attempt stalls.
                    let stalled = n == HedgePolicy::MIN_SAMPLES;
                    let wait = if stalled { 10_000 } else { 10 };
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                    Ok::<_, io::Error>(Response::builder().status(200).body(()).unwrap())
                }
            })
        };
        let recorder = Arc::new(Recorder::default());
        let dest = Destination::new("psp");
        let client = ClientStack::builder(&dest, get_charge().hedging(true).build())
            .observer(recorder.clone())
            .build()
            .unwrap()
            .layer(transport);
        for _ in 0..HedgePolicy::MIN_SAMPLES {
            client.clone().oneshot(request()).await.unwrap();
        }
        let (sends, _) = recorder.take();
        assert_eq!(sends.len(), HedgePolicy::MIN_SAMPLES);
        assert!(sends.iter().all(|s| s.kind == AttemptKind::First));

        let response = client.oneshot(request()).await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(calls.load(Ordering::SeqCst), HedgePolicy::MIN_SAMPLES + 2);
        let (sends, ends) = recorder.take();
        assert_eq!(
            sends,
            [
                sent(1, AttemptKind::First, Outcome::Cancelled, None),
                sent(2, AttemptKind::Hedge, Outcome::Ok, Some(Code::Ok)),
            ]
        );
        assert_eq!(ends, [ended(Outcome::Ok, 1, None)]);
    }

    /// With two hedges allowed, each send is told with its own number: the two cancelled and
    /// the one that answered.
    #[tokio::test(start_paused = true)]
    async fn every_hedge_of_a_call_is_told() {
        let calls = Arc::new(AtomicUsize::new(0));
        let transport = {
            let calls = calls.clone();
            service_fn(move |_r: Request<_>| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    // The first two stall; the second hedge answers.
                    let wait = if n < 2 { 10_000 } else { 5 };
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                    Ok::<_, io::Error>(Response::builder().status(200).body(()).unwrap())
                }
            })
        };
        let recorder = Arc::new(Recorder::default());
        let dest = Destination::new("psp");
        let policy = get_charge()
            .hedging(true)
            .hedge_delay(Duration::from_millis(10))
            .max_hedges(2)
            .build();
        let client = ClientStack::builder(&dest, policy)
            .observer(recorder.clone())
            .build()
            .unwrap()
            .layer(transport);
        let response = client.oneshot(request()).await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        let (sends, ends) = recorder.take();
        assert_eq!(
            sends,
            [
                sent(1, AttemptKind::First, Outcome::Cancelled, None),
                sent(2, AttemptKind::Hedge, Outcome::Cancelled, None),
                sent(3, AttemptKind::Hedge, Outcome::Ok, Some(Code::Ok)),
            ]
        );
        assert_eq!(ends, [ended(Outcome::Ok, 1, None)]);
    }

    /// An attempt whose connection was refused never reached the server: it is sent again at
    /// once, told as a transparent re-send with the same number, and counts as one attempt.
    #[tokio::test(start_paused = true)]
    async fn a_refused_connection_is_told_as_a_transparent_resend() {
        let calls = Arc::new(AtomicUsize::new(0));
        let transport = {
            let calls = calls.clone();
            service_fn(move |_r: Request<_>| {
                let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
                std::future::ready(if first {
                    Err(io::Error::from(io::ErrorKind::ConnectionRefused))
                } else {
                    Ok(Response::builder().status(200).body(()).unwrap())
                })
            })
        };
        let recorder = Arc::new(Recorder::default());
        let dest = Destination::new("psp");
        let client = ClientStack::builder(&dest, get_charge().build())
            .observer(recorder.clone())
            .build()
            .unwrap()
            .layer(transport);
        let response = client.oneshot(request()).await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        let (sends, ends) = recorder.take();
        assert_eq!(
            sends,
            [
                sent(
                    1,
                    AttemptKind::First,
                    Outcome::Retryable,
                    Some(Code::Unavailable)
                ),
                sent(1, AttemptKind::Transparent, Outcome::Ok, Some(Code::Ok)),
            ]
        );
        assert_eq!(ends, [ended(Outcome::Ok, 1, None)]);
    }

    /// With the retry budget spent, a 503 is not retried: one send, and the call's end says
    /// `budget_exhausted`.
    #[tokio::test(start_paused = true)]
    async fn a_call_stopped_by_the_budget_ends_with_budget_exhausted() {
        let recorder = Arc::new(Recorder::default());
        let dest = Destination::new("psp")
            .budget(RetryBudget::new(0.1, 2).unwrap())
            .storm_alarm(None)
            .breaker(None);
        while dest.spend().retry_budget().try_withdraw() {}
        let client = ClientStack::builder(&dest, get_charge().build())
            .observer(recorder.clone())
            .build()
            .unwrap()
            .layer(answers(&[503, 503, 503]));
        let response = client.oneshot(request()).await.unwrap();
        assert_eq!(response.status(), 503);
        let (sends, ends) = recorder.take();
        assert_eq!(
            sends,
            [sent(
                1,
                AttemptKind::First,
                Outcome::Retryable,
                Some(Code::Unavailable)
            )]
        );
        assert_eq!(
            ends,
            [ended(
                Outcome::Retryable,
                1,
                Some(StopReason::BudgetExhausted)
            )]
        );
    }

    /// An attempt left unanswered until the deadline is cut off there: told as a timeout, and
    /// the call's end says `deadline`.
    #[tokio::test(start_paused = true)]
    async fn a_call_stopped_by_the_deadline_ends_with_deadline() {
        let transport = service_fn(|_r: Request<_>| async {
            std::future::pending::<()>().await;
            Ok::<_, io::Error>(Response::builder().status(200).body(()).unwrap())
        });
        let recorder = Arc::new(Recorder::default());
        let dest = Destination::new("psp").attempt_limit(None);
        let client = ClientStack::builder(&dest, get_charge().build())
            .observer(recorder.clone())
            .build()
            .unwrap()
            .layer(transport);
        let error = client.oneshot(request()).await.unwrap_err();
        assert_eq!(error.reason(), Some(StopReason::Deadline));
        let (sends, ends) = recorder.take();
        assert_eq!(
            sends,
            [sent(
                1,
                AttemptKind::First,
                Outcome::Timeout,
                Some(Code::DeadlineExceeded)
            )]
        );
        assert_eq!(
            ends,
            [ended(Outcome::Timeout, 1, Some(StopReason::Deadline))]
        );
    }

    /// An attempt refused by an open circuit is no send: only the call's end is told.
    #[tokio::test(start_paused = true)]
    async fn an_attempt_refused_by_an_open_circuit_is_no_send() {
        use crate::client::breaker::{BreakerConfig, CircuitBreaker};
        let breaker = CircuitBreaker::new(BreakerConfig {
            min_requests: 4,
            ..Default::default()
        })
        .unwrap();
        for _ in 0..4 {
            breaker.try_acquire().unwrap().record(false);
        }
        let recorder = Arc::new(Recorder::default());
        let dest = Destination::new("psp").breaker(Some(breaker));
        let client = ClientStack::builder(&dest, get_charge().build())
            .observer(recorder.clone())
            .build()
            .unwrap()
            .layer(answers(&[]));
        assert!(client.oneshot(request()).await.is_err());
        let (sends, ends) = recorder.take();
        assert_eq!(sends, []);
        assert_eq!(
            ends,
            [ended(Outcome::Rejected, 0, Some(StopReason::CircuitOpen))]
        );
    }

    /// A breaker open after `failures` failed requests.
    fn open_breaker(failures: u32) -> crate::client::breaker::CircuitBreaker {
        use crate::client::breaker::{BreakerConfig, CircuitBreaker};
        let breaker = CircuitBreaker::new(BreakerConfig {
            failure_ratio: 0.01,
            min_requests: failures.max(1),
            ..Default::default()
        })
        .unwrap();
        for _ in 0..failures {
            breaker.try_acquire().unwrap().record(false);
        }
        breaker
    }

    /// A call the stack refuses to send at all (less of its deadline left than the peer's
    /// margin, an open circuit, adaptive throttling) is no attempt: the observer is told no
    /// send, `rpc_client_attempts_total` and the attempt durations count nothing and no
    /// `rpc_attempt` is logged. The call is counted, ends `rejected` after 0 attempts with its
    /// stop reason, and the stop is counted and logged with that reason.
    #[test]
    fn a_call_refused_before_any_send_is_no_attempt() {
        use crate::observe::{
            RPC_CLIENT_ATTEMPT_DURATION_SECONDS, RPC_CLIENT_ATTEMPTS_TOTAL,
            RPC_CLIENT_REQUESTS_TOTAL, RPC_CLIENT_RETRIES_TOTAL, RPC_CLIENT_RETRY_STOPS_TOTAL,
        };
        use crate::retry::AdaptiveThrottle;
        use crate::server::testing::{with_logs, with_metrics};

        let throttled = || {
            // The server refused 100 attempts: the next is refused with probability 100/101.
            let throttle = AdaptiveThrottle::default().seeded(1);
            for _ in 0..100 {
                throttle.record_request();
            }
            Destination::new("psp").throttle(Some(throttle))
        };
        let cases = [
            (
                // A margin above the whole 2 s deadline.
                Destination::new("psp").margin_floor(Duration::from_secs(3)),
                StopReason::Deadline,
            ),
            (
                Destination::new("psp").breaker(Some(open_breaker(4))),
                StopReason::CircuitOpen,
            ),
            (throttled(), StopReason::Throttled),
        ];
        for (dest, reason) in cases {
            let recorder = Arc::new(Recorder::default());
            let ((result, metrics), logs) = with_logs(|| {
                with_metrics(|| async {
                    let client = ClientStack::builder(&dest, get_charge().build())
                        .observer(recorder.clone())
                        .build()
                        .unwrap()
                        .layer(answers(&[]));
                    client.oneshot(request()).await
                })
            });
            let error = result.unwrap_err();
            assert_eq!((error.attempts(), error.reason()), (0, Some(reason)));
            assert_eq!(error.last().outcome(), Outcome::Rejected, "{reason}");
            let (sends, ends) = recorder.take();
            assert_eq!(sends, [], "{reason}");
            assert_eq!(ends, [ended(Outcome::Rejected, 0, Some(reason))]);

            let who = [("service", "psp"), ("method", "GetCharge")];
            assert_eq!(metrics.counter(RPC_CLIENT_REQUESTS_TOTAL, &who), 1);
            assert_eq!(metrics.counter(RPC_CLIENT_ATTEMPTS_TOTAL, &who), 0);
            assert_eq!(metrics.counter(RPC_CLIENT_RETRIES_TOTAL, &who), 0);
            assert_eq!(
                metrics.samples(RPC_CLIENT_ATTEMPT_DURATION_SECONDS, &who),
                0
            );
            let stop = [who[0], who[1], ("reason", reason.as_str())];
            assert_eq!(metrics.counter(RPC_CLIENT_RETRY_STOPS_TOTAL, &stop), 1);

            let events: Vec<_> = logs
                .iter()
                .filter_map(|line| line.get("event")?.as_str())
                .filter(|event| event.starts_with("rpc_"))
                .collect();
            assert_eq!(events, ["rpc_retry_stopped"], "{reason}");
            let stopped_line = logs
                .iter()
                .find(|line| line["event"] == "rpc_retry_stopped")
                .unwrap();
            assert_eq!(stopped_line["reason"], reason.as_str());
            assert_eq!(stopped_line["attempts"], 0);
        }
    }

    /// A retry the stack refuses to send (the first attempt's 503 opened the circuit) is no
    /// attempt either: one send, counted and logged once; the call ends on that answer
    /// (`retryable`, which the caller gets back marked with the stop) after 1 attempt, stopped
    /// by `circuit_open`, and no retry is counted.
    #[test]
    fn a_retry_refused_by_an_open_circuit_is_no_attempt() {
        use crate::client::retry::RetryStopped;
        use crate::observe::{
            RPC_CLIENT_ATTEMPTS_TOTAL, RPC_CLIENT_RETRIES_TOTAL, RPC_CLIENT_RETRY_STOPS_TOTAL,
        };
        use crate::server::testing::{with_logs, with_metrics};

        let recorder = Arc::new(Recorder::default());
        let dest = Destination::new("psp").breaker(Some(open_breaker(0)));
        let ((result, metrics), logs) = with_logs(|| {
            with_metrics(|| async {
                let client = ClientStack::builder(&dest, get_charge().build())
                    .observer(recorder.clone())
                    .build()
                    .unwrap()
                    .layer(answers(&[503, 503]));
                client.oneshot(request()).await
            })
        });
        let response = result.unwrap();
        assert_eq!(response.status(), 503);
        let stopped = response.extensions().get::<RetryStopped>().unwrap();
        assert_eq!(
            (stopped.reason, stopped.attempts),
            (StopReason::CircuitOpen, 1)
        );
        let (sends, ends) = recorder.take();
        assert_eq!(
            sends,
            [sent(
                1,
                AttemptKind::First,
                Outcome::Retryable,
                Some(Code::Unavailable)
            )]
        );
        assert_eq!(
            ends,
            [ended(Outcome::Retryable, 1, Some(StopReason::CircuitOpen))]
        );
        let who = [("service", "psp"), ("method", "GetCharge")];
        let first = [who[0], who[1], ("attempt", "1"), ("outcome", "retryable")];
        assert_eq!(metrics.counter(RPC_CLIENT_ATTEMPTS_TOTAL, &first), 1);
        assert_eq!(metrics.counter(RPC_CLIENT_ATTEMPTS_TOTAL, &who), 1);
        assert_eq!(metrics.counter(RPC_CLIENT_RETRIES_TOTAL, &who), 0);
        let stop = [who[0], who[1], ("reason", "circuit_open")];
        assert_eq!(metrics.counter(RPC_CLIENT_RETRY_STOPS_TOTAL, &stop), 1);
        let attempts: Vec<_> = logs
            .iter()
            .filter(|line| line["event"] == "rpc_attempt")
            .map(|line| (line["attempt"].clone(), line["outcome"].clone()))
            .collect();
        assert_eq!(attempts, [(1.into(), "retryable".into())]);
    }
}
