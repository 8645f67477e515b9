use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{Layer, ServiceExt};
use tower_test::mock;

use super::*;
use crate::client::replay::ReplayBody;
use crate::retry::{Backoff, Jitter, RetryBudget, RetryError};
use crate::status::{Code, Status};

type Body = ReplayBody<Full<Bytes>>;
type Handle = mock::Handle<Request<Body>, Response<()>>;
type Mocked = Retry<mock::Mock<Request<Body>, Response<()>>>;

const MS: Duration = Duration::from_millis(1);

/// The stop of a call that failed, under the typed error the retry layer fails with.
fn stopped_by(err: &BoxError) -> Option<&RetryError> {
    use std::error::Error as _;
    err.downcast_ref::<crate::client::Error>()?
        .source()?
        .downcast_ref::<RetryError>()
}

/// How far the attempts of a call that failed got.
fn reach_of(err: &BoxError) -> Reach {
    err.downcast_ref::<crate::client::Error>()
        .expect("the retry layer fails with a typed error")
        .reach()
}

fn policy_builder(budget: RetryBudget) -> crate::retry::RetryPolicyBuilder {
    RetryPolicy::builder("psp", "Charge")
        .backoff(Backoff::new(10 * MS, 10 * MS, Jitter::None, Duration::ZERO).unwrap())
        .spend(budget)
        .keyed(true)
}

fn policy(budget: RetryBudget) -> RetryPolicy {
    policy_builder(budget).build().unwrap()
}

fn service(idempotency: Idempotency, budget: RetryBudget) -> (Mocked, Handle) {
    let (svc, handle) = mock::pair();
    let layer = RetryLayer::new(policy(budget), idempotency).replay_cap(16);
    (layer.layer(svc), handle)
}

fn request(body: &'static str, key: Option<&str>) -> Request<Full<Bytes>> {
    let mut builder = Request::post("http://psp/v1/charges");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    let mut request = builder
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    request
        .extensions_mut()
        .insert(Deadline::after(Duration::from_secs(1)));
    request
}

fn status(code: u16) -> Response<()> {
    Response::builder().status(code).body(()).unwrap()
}

async fn body_of(request: Request<Body>) -> Bytes {
    request.into_body().collect().await.unwrap().to_bytes()
}

#[tokio::test(start_paused = true)]
async fn a_keyed_call_is_retried_with_its_key_body_and_attempt_count() {
    let (svc, mut handle) = service(Idempotency::Keyed, RetryBudget::default());
    handle.allow(3);
    let call = tokio::spawn(svc.oneshot(request("{\"a\":1}", Some("k-1"))));

    let mut previous = Vec::new();
    for (i, code) in [503, 503, 201].into_iter().enumerate() {
        let (sent, send) = handle.next_request().await.unwrap();
        assert_eq!(sent.headers()["idempotency-key"], "k-1", "attempt {i}");
        previous.push(
            sent.headers()
                .get(&GRPC_PREVIOUS_RPC_ATTEMPTS)
                .map(|v| v.to_str().unwrap().to_owned()),
        );
        send.send_response(status(code));
        assert_eq!(body_of(sent).await, "{\"a\":1}");
    }
    assert_eq!(previous, [None, Some("1".into()), Some("2".into())]);
    let response = call.await.unwrap().unwrap();
    assert_eq!(response.status(), 201);
    assert!(response.extensions().get::<RetryStopped>().is_none());
}

#[tokio::test(start_paused = true)]
async fn unsafe_calls_and_keyed_calls_without_a_key_are_sent_once() {
    for (idempotency, key) in [(Idempotency::Unsafe, Some("k")), (Idempotency::Keyed, None)] {
        let (svc, mut handle) = service(idempotency, RetryBudget::default());
        handle.allow(3);
        let call = tokio::spawn(svc.oneshot(request("x", key)));
        let (sent, send) = handle.next_request().await.unwrap();
        assert!(!sent.body().is_replayable(), "not buffered: {idempotency}");
        send.send_response(status(503));
        let response = call.await.unwrap().unwrap();
        assert_eq!(response.status(), 503);
        let stopped = response.extensions().get::<RetryStopped>().unwrap();
        assert_eq!(stopped.attempts, 1);
    }
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_cap_is_sent_once_and_not_refused() {
    let (svc, mut handle) = service(Idempotency::Safe, RetryBudget::default());
    handle.allow(3);
    let call = tokio::spawn(svc.oneshot(request("0123456789abcdefXYZ", None)));
    let (sent, send) = handle.next_request().await.unwrap();
    send.send_response(status(503));
    assert_eq!(body_of(sent).await, "0123456789abcdefXYZ");
    let response = call.await.unwrap().unwrap();
    assert_eq!(
        response
            .extensions()
            .get::<RetryStopped>()
            .unwrap()
            .attempts,
        1
    );
}

#[tokio::test(start_paused = true)]
async fn grpc_trailers_only_statuses_are_classified() {
    let (svc, mut handle) = service(Idempotency::Safe, RetryBudget::default());
    handle.allow(5);
    let call = tokio::spawn(svc.clone().oneshot(request("x", None)));
    let grpc = |code: &str| {
        Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", code)
            .body(())
            .unwrap()
    };
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(grpc("14"));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(grpc("0"));
    assert!(
        call.await
            .unwrap()
            .unwrap()
            .extensions()
            .get::<RetryStopped>()
            .is_none()
    );

    let call = tokio::spawn(svc.oneshot(request("x", None)));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(grpc("3"));
    let response = call.await.unwrap().unwrap();
    let stopped = response.extensions().get::<RetryStopped>().unwrap();
    assert_eq!(
        (stopped.attempts, stopped.reason),
        (1, StopReason::NonRetryable)
    );
}

#[tokio::test(start_paused = true)]
async fn pushback_is_honoured_and_a_negative_one_stops_retries() {
    let (svc, mut handle) = service(Idempotency::Safe, RetryBudget::default());
    handle.allow(5);
    let start = Instant::now();
    let call = tokio::spawn(svc.clone().oneshot(request("x", None)));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(
        Response::builder()
            .status(503)
            .header("grpc-retry-pushback-ms", "300")
            .body(())
            .unwrap(),
    );
    let (_, send) = handle.next_request().await.unwrap();
    let waited = start.elapsed();
    assert!(waited >= 240 * MS && waited <= 360 * MS, "{waited:?}");
    send.send_response(status(200));
    call.await.unwrap().unwrap();

    let call = tokio::spawn(svc.oneshot(request("x", None)));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(
        Response::builder()
            .status(503)
            .header("grpc-retry-pushback-ms", "-1")
            .body(())
            .unwrap(),
    );
    let response = call.await.unwrap().unwrap();
    let stopped = response.extensions().get::<RetryStopped>().unwrap();
    assert_eq!(
        (stopped.attempts, stopped.reason),
        (1, StopReason::Pushback)
    );
}

#[tokio::test(start_paused = true)]
async fn transport_errors_end_in_a_retry_error_with_its_reason() {
    let budget = RetryBudget::new(0.0, 1).unwrap();
    let (svc, mut handle) = service(Idempotency::Safe, budget);
    handle.allow(5);
    let call = tokio::spawn(svc.oneshot(request("x", None)));
    for _ in 0..2 {
        let (_, send) = handle.next_request().await.unwrap();
        send.send_error(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
    }
    let err = call.await.unwrap().unwrap_err();
    assert_eq!(reach_of(&err), Reach::Unknown, "reset after sending");
    let err = stopped_by(&err).unwrap();
    assert_eq!((err.attempts, err.reason), (2, StopReason::BudgetExhausted));
    assert_eq!(err.last.code(), Code::Unavailable);
}

#[tokio::test(start_paused = true)]
async fn retries_never_extend_the_deadline() {
    let (svc, mut handle) = service(Idempotency::Safe, RetryBudget::default());
    handle.allow(5);
    let start = Instant::now();
    let call = tokio::spawn(svc.oneshot(request("x", None)));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(status(503));
    // The second attempt hangs: the call ends at the deadline, not later.
    let (_, _hanging) = handle.next_request().await.unwrap();
    let err = call.await.unwrap().unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    let err = stopped_by(&err).unwrap();
    assert_eq!(err.reason, StopReason::Deadline);
}

#[tokio::test(start_paused = true)]
async fn a_destination_can_read_its_answers_its_own_way() {
    /// A provider whose 500 means "try again".
    fn provider(status: http::StatusCode, _: &http::HeaderMap) -> Option<Status> {
        (!status.is_success()).then(|| Status::new(Code::Unavailable, "provider error"))
    }
    let (svc, mut handle) = mock::pair();
    let mut svc = RetryLayer::new(policy(RetryBudget::default()), Idempotency::Safe)
        .classifier(provider)
        .layer(svc);
    handle.allow(2);
    let call = tokio::spawn(svc.call(request("x", None)));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(status(500));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(status(200));
    assert_eq!(call.await.unwrap().unwrap().status(), 200);
}

/// An attempt the attempt-timeout layer refuses (less than the margin left) is not retried:
/// the call stops on the deadline and spends no budget on sends that cannot happen. Not sent,
/// it is no attempt: the call fails `rejected` after 0 attempts.
#[tokio::test(start_paused = true)]
async fn an_attempt_refused_for_lack_of_time_stops_on_the_deadline() {
    use crate::client::deadline::AttemptTimeout;
    use crate::deadline::Margin;
    use std::sync::Arc;

    let budget = RetryBudget::new(0.1, 20).unwrap();
    let (svc, mut handle) = mock::pair::<Request<Body>, Response<()>>();
    handle.allow(10);
    // A margin larger than the whole deadline: every attempt is refused before sending.
    let margin = Arc::new(Margin::new(Duration::from_secs(5)));
    let svc = RetryLayer::new(policy(budget.clone()), Idempotency::Keyed)
        .layer(AttemptTimeout::new(svc, margin));
    let err = svc.oneshot(request("{}", Some("k-1"))).await.unwrap_err();
    let stopped = stopped_by(&err).expect("a retry error");
    assert_eq!(stopped.reason, StopReason::Deadline);
    assert_eq!(stopped.attempts, 0);
    assert_eq!(reach_of(&err), Reach::NotSent);
    assert_eq!(stopped.last.outcome(), crate::status::Outcome::Rejected);
    assert!((budget.available() - 20.0).abs() < 1e-9, "no token spent");
    assert!(handle.next_request().await.is_none(), "nothing was sent");
}

/// The retry layer over the transparent-retry layer (as in the client stack), with a breaker
/// between them that opens on a single failure.
fn with_transparent_below(
    budget: RetryBudget,
    max_attempts: u32,
) -> (
    impl tower::Service<
        Request<Full<Bytes>>,
        Response = Response<()>,
        Error = BoxError,
        Future = impl Send,
    > + Send,
    Handle,
) {
    use crate::client::breaker::{Breaker, BreakerConfig, CircuitBreaker};
    use crate::client::transparent::TransparentRetry;

    let (svc, handle) = mock::pair::<Request<Body>, Response<()>>();
    let breaker = CircuitBreaker::new(BreakerConfig {
        failure_ratio: 0.01,
        min_requests: 1,
        ..BreakerConfig::default()
    })
    .unwrap();
    let below = Breaker::new(TransparentRetry::new(svc, Some(budget.clone())), breaker);
    let policy = policy_builder(budget)
        .max_attempts(max_attempts)
        .build()
        .unwrap();
    let svc = RetryLayer::new(policy, Idempotency::Keyed).layer(below);
    (svc, handle)
}

/// A transparent re-send under the retry layer is made by the retry layer from its own copy:
/// the same attempt again (no `grpc-previous-rpc-attempts`, max attempts untouched), marked as
/// the re-send, paid from the budget, and not counted by the breaker in between.
#[tokio::test(start_paused = true)]
async fn a_never_sent_attempt_is_sent_again_by_the_retry_layer() {
    use crate::client::replay::ResendBy;

    let budget = RetryBudget::new(0.1, 5).unwrap();
    let (svc, mut handle) = with_transparent_below(budget.clone(), 1);
    handle.allow(4);
    let call = tokio::spawn(svc.oneshot(request("{\"a\":1}", Some("k-1"))));

    let (first, send) = handle.next_request().await.unwrap();
    assert_eq!(first.body().resend_by(), Some(ResendBy::Above));
    send.send_error(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));

    let (again, send) = handle.next_request().await.unwrap();
    assert_eq!(again.body().resend_by(), Some(ResendBy::Nobody));
    assert!(again.headers().get(&GRPC_PREVIOUS_RPC_ATTEMPTS).is_none());
    assert_eq!(again.headers()["idempotency-key"], "k-1");
    send.send_response(status(200));
    assert_eq!(body_of(again).await, "{\"a\":1}");

    // One attempt allowed, and it succeeded: the breaker (open on any failure) let it through.
    let response = call.await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        (budget.available() - 4.0).abs() < 1e-9,
        "one token for the re-send"
    );
}

/// Once per attempt: a re-send that fails the same way is that attempt's failure.
#[tokio::test(start_paused = true)]
async fn a_never_sent_attempt_is_sent_again_once() {
    let budget = RetryBudget::new(0.1, 5).unwrap();
    let (svc, mut handle) = with_transparent_below(budget.clone(), 1);
    handle.allow(4);
    let call = tokio::spawn(svc.oneshot(request("{}", Some("k-1"))));
    for _ in 0..2 {
        let (_, send) = handle.next_request().await.unwrap();
        send.send_error(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
    }
    let err = call.await.unwrap().unwrap_err();
    let stopped = stopped_by(&err).expect("a retry error");
    assert_eq!(stopped.attempts, 1);
    assert_eq!(stopped.reason, StopReason::MaxAttempts);
    assert_eq!(reach_of(&err), Reach::NotSent);
    let pending = futures_util::FutureExt::now_or_never(handle.next_request());
    assert!(!matches!(pending, Some(Some(_))), "nothing else was sent");
}

/// Without a budget token there is no re-send, and the failure counts as the attempt's.
#[tokio::test(start_paused = true)]
async fn a_never_sent_attempt_without_a_token_is_a_failed_attempt() {
    // No burst: the budget starts empty.
    let budget = RetryBudget::new(0.0, 0).unwrap();
    let (svc, mut handle) = with_transparent_below(budget.clone(), 1);
    handle.allow(4);
    let call = tokio::spawn(svc.oneshot(request("{}", Some("k-1"))));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_error(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
    let err = call.await.unwrap().unwrap_err();
    assert!(stopped_by(&err).is_some());
    let pending = futures_util::FutureExt::now_or_never(handle.next_request());
    assert!(!matches!(pending, Some(Some(_))), "nothing else was sent");
}

/// A transport that counts its clones and answers each call with the next status.
#[derive(Debug)]
struct CountingClones {
    clones: Arc<std::sync::atomic::AtomicUsize>,
    statuses: Arc<std::sync::Mutex<Vec<u16>>>,
}

impl Clone for CountingClones {
    fn clone(&self) -> Self {
        self.clones
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self {
            clones: self.clones.clone(),
            statuses: self.statuses.clone(),
        }
    }
}

impl Service<Request<Body>> for CountingClones {
    type Response = Response<()>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Response<()>, std::convert::Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _request: Request<Body>) -> Self::Future {
        let code = self.statuses.lock().unwrap().remove(0);
        std::future::ready(Ok(status(code)))
    }
}

/// A call whose service is ready and whose body is all there goes out from `call` on the
/// layer's own service: no clone of the service unless a second attempt needs one (a clone
/// per call is a copy of the whole stack below and its reference counts, on every call).
#[tokio::test(start_paused = true)]
async fn a_call_clones_the_service_only_for_a_second_attempt() {
    let clones = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let transport = CountingClones {
        clones: clones.clone(),
        statuses: Arc::new(std::sync::Mutex::new(vec![200, 503, 200])),
    };
    let mut svc =
        RetryLayer::new(policy(RetryBudget::default()), Idempotency::Keyed).layer(transport);
    let made = clones.load(std::sync::atomic::Ordering::SeqCst);

    let response = svc
        .ready()
        .await
        .unwrap()
        .call(request("{}", Some("k-1")))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(clones.load(std::sync::atomic::Ordering::SeqCst), made);

    let response = svc
        .ready()
        .await
        .unwrap()
        .call(request("{}", Some("k-2")))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(clones.load(std::sync::atomic::Ordering::SeqCst), made + 1);
}

/// A margin that has seen enough round trips of 1 ms for the attempt limit to apply.
fn measured() -> Arc<Margin> {
    let margin = Arc::new(Margin::new(MS));
    for _ in 0..AttemptLimit::MIN_SAMPLES {
        margin.observe_attempt(MS, None);
    }
    margin
}

/// A retry layer with an [`AttemptLimit`] of half the budget past `max(250 ms, 10 x RTT_p99)`
/// over a mock, its margin [`measured`], at most `max_attempts` attempts. Calls get 1 s.
fn limited(idempotency: Idempotency, max_attempts: u32) -> (Mocked, Handle, Arc<Margin>) {
    let (svc, handle) = mock::pair();
    let margin = measured();
    let policy = policy_builder(RetryBudget::default())
        .max_attempts(max_attempts)
        .build()
        .unwrap();
    let layer = RetryLayer::new(policy, idempotency)
        .replay_cap(16)
        .attempt_limit(AttemptLimit::new(250 * MS, 10), margin.clone());
    (layer.layer(svc), handle, margin)
}

/// An attempt stranded without an answer (a send on a connection that went away as it was
/// handed out) is abandoned at the attempt limit and the call retried with its key, long
/// before its deadline: an unhedged call is not lost to it (issue 14, item 3).
#[tokio::test(start_paused = true)]
async fn a_stranded_attempt_is_abandoned_at_its_limit_and_retried_within_the_deadline() {
    let (svc, mut handle, _margin) = limited(Idempotency::Keyed, 3);
    handle.allow(2);
    let started = Instant::now();
    let call = tokio::spawn(svc.oneshot(request("{\"a\":1}", Some("k-1"))));

    // Never answered, never failed.
    let (_stranded, never_answered) = handle.next_request().await.unwrap();
    let (again, send) = handle.next_request().await.unwrap();
    // Half the 1 s, then the 10 ms backoff.
    assert_eq!(started.elapsed(), 510 * MS);
    assert_eq!(again.headers()["idempotency-key"], "k-1");
    assert_eq!(again.headers()[&GRPC_PREVIOUS_RPC_ATTEMPTS], "1");
    send.send_response(status(201));
    assert_eq!(body_of(again).await, "{\"a\":1}");
    assert_eq!(call.await.unwrap().unwrap().status(), 201);
    drop(never_answered);
}

/// Half the budget must be past `10 x RTT_p99` of the destination's attempts: a destination
/// that slow for the deadline is left to answer.
#[tokio::test(start_paused = true)]
async fn the_attempt_limit_leaves_a_destination_slow_for_the_deadline_alone() {
    for (p99, abandoned) in [(40 * MS, true), (60 * MS, false)] {
        let (svc, mut handle, margin) = limited(Idempotency::Safe, 3);
        for _ in 0..AttemptLimit::MIN_SAMPLES {
            margin.observe_attempt(p99, None);
        }
        handle.allow(2);
        let started = Instant::now();
        let call = tokio::spawn(svc.oneshot(request("", None)));
        let (_first, unanswered) = handle.next_request().await.unwrap();
        if abandoned {
            let (_again, send) = handle.next_request().await.unwrap();
            assert_eq!(started.elapsed(), (500 + 10) * MS);
            send.send_response(status(200));
            assert_eq!(call.await.unwrap().unwrap().status(), 200);
        } else {
            tokio::time::sleep(900 * MS).await;
            unanswered.send_response(status(200));
            assert_eq!(call.await.unwrap().unwrap().status(), 200);
            assert_eq!(started.elapsed(), 900 * MS);
        }
    }
}

/// The attempt the call cannot retry (its last, or any attempt of a call sent once) runs until
/// the deadline: cutting it short could only turn a late answer into a failure.
#[tokio::test(start_paused = true)]
async fn an_attempt_that_cannot_be_retried_is_never_cut_short() {
    // The last of two attempts.
    let (svc, mut handle, _margin) = limited(Idempotency::Keyed, 2);
    handle.allow(3);
    let started = Instant::now();
    let call = tokio::spawn(svc.oneshot(request("{\"a\":1}", Some("k-1"))));
    let (_first, _unanswered) = handle.next_request().await.unwrap();
    let (_last, _unanswered_too) = handle.next_request().await.unwrap();
    let err = call.await.unwrap().unwrap_err();
    let stopped = stopped_by(&err).expect("a retry error");
    assert_eq!(
        (stopped.attempts, stopped.reason),
        (2, StopReason::Deadline)
    );
    assert_eq!(reach_of(&err), Reach::Unknown);
    assert_eq!(started.elapsed(), Duration::from_secs(1));

    // An `Unsafe` call is sent once and waits for its answer until the deadline.
    let (svc, mut handle, _margin) = limited(Idempotency::Unsafe, 3);
    handle.allow(2);
    let started = Instant::now();
    let call = tokio::spawn(svc.oneshot(request("{\"a\":1}", None)));
    let (_once, _unanswered) = handle.next_request().await.unwrap();
    let err = call.await.unwrap().unwrap_err();
    let stopped = stopped_by(&err).expect("a retry error");
    assert_eq!(
        (stopped.attempts, stopped.reason),
        (1, StopReason::Deadline)
    );
    assert_eq!(started.elapsed(), Duration::from_secs(1));
}

/// An attempt is only limited when half the budget is past the floor: with a 400 ms deadline
/// (half of it under the 250 ms floor) it runs until the deadline.
#[tokio::test(start_paused = true)]
async fn a_deadline_too_short_for_two_limits_leaves_the_attempt_alone() {
    let (svc, mut handle, _margin) = limited(Idempotency::Keyed, 3);
    handle.allow(2);
    let mut call = request("{\"a\":1}", Some("k-1"));
    call.extensions_mut().insert(Deadline::after(400 * MS));
    let started = Instant::now();
    let call = tokio::spawn(svc.oneshot(call));
    let (_only, _unanswered) = handle.next_request().await.unwrap();
    let err = call.await.unwrap().unwrap_err();
    let stopped = stopped_by(&err).expect("a retry error");
    assert_eq!(
        (stopped.attempts, stopped.reason),
        (1, StopReason::Deadline)
    );
    assert_eq!(started.elapsed(), 400 * MS);
}

/// A transparent re-send's limit is half of what is left as it starts, not of what its first
/// send had (which, for a re-send late in the call, would run past the deadline).
#[tokio::test(start_paused = true)]
async fn a_re_sent_attempt_is_limited_by_what_is_left_as_it_starts() {
    use crate::client::transparent::TransparentRetry;

    let (svc, mut handle) = mock::pair::<Request<Body>, Response<()>>();
    let budget = RetryBudget::default();
    let policy = policy_builder(budget.clone()).build().unwrap();
    let svc = RetryLayer::new(policy, Idempotency::Keyed)
        .attempt_limit(AttemptLimit::new(100 * MS, 10), measured())
        .layer(TransparentRetry::new(svc, Some(budget)));
    handle.allow(3);
    let started = Instant::now();
    let call = tokio::spawn(svc.oneshot(request("{\"a\":1}", Some("k-1"))));

    // The first send (limited to 500 ms) fails as never sent after 400 ms (a slow connect):
    // re-sent at once with 600 ms left, so it may run 300 ms, not half of the first's 1 s.
    let (_first, send) = handle.next_request().await.unwrap();
    tokio::time::sleep(400 * MS).await;
    send.send_error(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
    let (_resent, _unanswered) = handle.next_request().await.unwrap();
    let (retry, send) = handle.next_request().await.unwrap();
    assert_eq!(started.elapsed(), (400 + 300 + 10) * MS);
    assert_eq!(retry.headers()[&GRPC_PREVIOUS_RPC_ATTEMPTS], "1");
    send.send_response(status(201));
    assert_eq!(call.await.unwrap().unwrap().status(), 201);
}

/// With no deadline layer above it, the retry layer gives a call the method's timeout, by
/// default the one [`DEFAULT_TIMEOUT`](crate::policy::DEFAULT_TIMEOUT) every policy starts
/// from, not a budget of its own: the call's attempt is cut off exactly then, and a layer with
/// the method's timeout set cuts it off at that instead.
#[tokio::test(start_paused = true)]
async fn without_a_deadline_above_a_call_gets_the_documented_default() {
    for (timeout, layer) in [
        (
            crate::policy::DEFAULT_TIMEOUT,
            RetryLayer::new(policy(RetryBudget::default()), Idempotency::Safe),
        ),
        (
            2_000 * MS,
            RetryLayer::new(policy(RetryBudget::default()), Idempotency::Safe).timeout(2_000 * MS),
        ),
    ] {
        let (svc, mut handle) = mock::pair::<Request<Body>, Response<()>>();
        handle.allow(1);
        let svc = layer.layer(svc);
        // No `Deadline` extension.
        let request = Request::get("http://psp/v1/charges/c-1")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let started = Instant::now();
        let call = tokio::spawn(svc.oneshot(request));
        let (sent, _never_answered) = handle.next_request().await.unwrap();
        let deadline = sent.extensions().get::<Deadline>().copied().unwrap();
        assert_eq!(deadline.remaining_at(started), timeout);
        let err = call.await.unwrap().unwrap_err();
        assert_eq!(started.elapsed(), timeout, "{err}");
        assert!(stopped_by(&err).is_some(), "{err}");
    }
}
