//! One gRPC service config, two clients: backstop's client stack built from the JSON, and the
//! reference implementation (Python `grpcio`, `tests/interop/grpcio_service_config.py`) given
//! the same JSON as its `grpc.service_config`. Each sends the same sequential calls to a flaky
//! server that fails a fixed pattern of attempts with `UNAVAILABLE`; the attempts the server
//! sees per logical call must agree within 2 %, with a `retryPolicy` alone and with
//! `retryThrottling` added where the throttling holds back retries.
//!
//! The pattern depends only on the attempt's position in the server's count, and calls are
//! sent one after the other, so the count is the same on every run: nothing depends on timing.
//!
//! `.ci/run` installs `grpcio` and sets `BACKSTOP_REQUIRE_INTEROP=1`: there a missing
//! `python3` or `grpcio` fails the test. Elsewhere it is reported loudly and the test passes.

#[path = "support/python.rs"]
mod python;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use backstop::client::replay::ReplayBody;
use backstop::client::service_config::ServiceConfig;
use backstop::client::{ClientStack, Destination, Throttling};
use backstop::retry::RetryBudget;
use http::uri::PathAndQuery;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::{Service, ServiceExt, service_fn};

use python::{output_of, python_ready, python3};

const METHOD: &str = "/flaky.Flaky/Call";
/// Logical calls per client.
const CALLS: u32 = 400;
/// Attempts whose position in the server's count, modulo `PERIOD`, is in `FAILING` fail.
/// Three failures in a row exhaust a call's attempts; the fourth fails a first attempt only.
const PERIOD: u64 = 10;
const FAILING: [u64; 4] = [0, 1, 2, 6];

/// Up to 3 attempts on `UNAVAILABLE`, with backoffs short enough not to slow the test.
const RETRY: &str = r#"{
  "methodConfig": [{
    "name": [{"service": "flaky.Flaky"}],
    "retryPolicy": {
      "maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
      "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
}"#;

/// The same, throttled: 4 tokens, 0.8 back per success. Four failures in ten attempts drain
/// the bucket faster than the six successes fill it, so it keeps falling to half and holding
/// back retries, then filling up again.
const THROTTLED: &str = r#"{
  "methodConfig": [{
    "name": [{"service": "flaky.Flaky"}],
    "retryPolicy": {
      "maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s",
      "backoffMultiplier": 1, "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }],
  "retryThrottling": {"maxTokens": 4, "tokenRatio": 0.8}
}"#;

/// A server whose every method answers `UNAVAILABLE` to the attempts the pattern names and
/// an empty message to the others, counting the attempts.
#[derive(Clone, Default)]
struct Flaky {
    attempts: Arc<AtomicU64>,
}

impl tonic::server::NamedService for Flaky {
    const NAME: &'static str = "flaky.Flaky";
}

impl Service<http::Request<tonic::body::Body>> for Flaky {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let nth = self.attempts.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            let answer = service_fn(move |_: tonic::Request<()>| async move {
                if FAILING.contains(&(nth % PERIOD)) {
                    Err(Status::unavailable("flaky by design"))
                } else {
                    Ok(tonic::Response::new(()))
                }
            });
            let codec = ProstCodec::<(), ()>::default();
            Ok(tonic::server::Grpc::new(codec).unary(answer, request).await)
        })
    }
}

/// A fresh flaky server on a port of 127.0.0.1 the OS picks, counting from 0.
async fn serve() -> (SocketAddr, Arc<AtomicU64>) {
    let flaky = Flaky::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = Server::builder().add_service(flaky.clone());
    tokio::spawn(server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    (addr, flaky.attempts)
}

/// The attempts per logical call backstop's stack sends with `json`, `throttling` picked
/// from it.
async fn backstop_ratio(json: &str, throttling: Throttling) -> f64 {
    let (addr, attempts) = serve().await;
    let config = ServiceConfig::from_json(json).unwrap();
    // What gRPC's client does not have is left out, so that the config alone decides.
    let destination = Destination::new("flaky")
        .throttling(throttling)
        .storm_alarm(None)
        .breaker(None)
        .attempt_limit(None);
    let stack = ClientStack::builder(&destination, config.policies().unwrap())
        .build()
        .unwrap();
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let to_tonic: fn(
        http::Request<ReplayBody<tonic::body::Body>>,
    ) -> http::Request<tonic::body::Body> = |request| request.map(tonic::body::Body::new);
    let mut client = tonic::client::Grpc::new(stack.layer(channel.map_request(to_tonic)));
    let mut unavailable = 0;
    for _ in 0..CALLS {
        client.ready().await.unwrap();
        let codec = ProstCodec::<(), ()>::default();
        let path = PathAndQuery::from_static(METHOD);
        match client.unary(tonic::Request::new(()), path, codec).await {
            Ok(_) => {}
            Err(status) if status.code() == Code::Unavailable => unavailable += 1,
            Err(status) => panic!("unexpected status: {status:?}"),
        }
    }
    let sent = attempts.load(Ordering::SeqCst);
    eprintln!("backstop: {CALLS} calls, {unavailable} unavailable, {sent} attempts");
    sent as f64 / f64::from(CALLS)
}

/// The attempts per logical call grpcio sends with `json`.
async fn grpcio_ratio(json: &str) -> f64 {
    let (addr, attempts) = serve().await;
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/grpcio_service_config.py");
    let stdout = output_of(
        "grpcio client",
        python3()
            .arg(&script)
            .arg("--target")
            .arg(addr.to_string())
            .arg("--method")
            .arg(METHOD)
            .arg("--calls")
            .arg(CALLS.to_string())
            .arg("--service-config")
            .arg(json),
    )
    .await;
    let sent = attempts.load(Ordering::SeqCst);
    eprintln!("grpcio: {} {sent} attempts", stdout.trim());
    sent as f64 / f64::from(CALLS)
}

/// Asserts that the two ratios are within 2 % of each other.
fn assert_close(what: &str, backstop: f64, grpcio: f64) {
    eprintln!("{what}: backstop {backstop:.4} vs grpcio {grpcio:.4} attempts per call");
    assert!(
        (backstop - grpcio).abs() <= 0.02 * grpcio,
        "{what}: backstop sends {backstop:.4} attempts per call, grpcio {grpcio:.4}"
    );
}

#[tokio::test]
async fn a_retry_policy_sends_as_many_attempts_as_grpcio() {
    if !python_ready("grpc", "the service config interop test", "grpcio==1.85.1").await {
        return;
    }
    // No retryThrottling: gRPC limits retries by maxAttempts alone, so the budget must not.
    let backstop = backstop_ratio(RETRY, Throttling::Budget(RetryBudget::unlimited())).await;
    let grpcio = grpcio_ratio(RETRY).await;
    assert_close("retryPolicy", backstop, grpcio);
    // The pattern makes the retries matter: 4 failures in 10 attempts.
    assert!(backstop > 1.4, "{backstop}");
}

#[tokio::test]
async fn retry_throttling_holds_back_as_many_retries_as_grpcio() {
    if !python_ready("grpc", "the service config interop test", "grpcio==1.85.1").await {
        return;
    }
    let config = ServiceConfig::from_json(THROTTLED).unwrap();
    let throttle = config.retry_throttle().expect("retryThrottling is set");
    let backstop = backstop_ratio(THROTTLED, Throttling::Grpc(throttle)).await;
    let grpcio = grpcio_ratio(THROTTLED).await;
    assert_close("retryPolicy + retryThrottling", backstop, grpcio);
    // The throttling held retries back: unthrottled, the same pattern costs more attempts.
    let unthrottled = backstop_ratio(RETRY, Throttling::Budget(RetryBudget::unlimited())).await;
    assert!(
        backstop < unthrottled - 0.1,
        "throttled {backstop} vs unthrottled {unthrottled}"
    );
}
