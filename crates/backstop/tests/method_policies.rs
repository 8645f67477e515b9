//! One client stack over one tonic `Channel`, a real gRPC server on loopback, and a table of
//! method policies: each method's calls are retried as its own policy says, whatever the
//! others say, and the server counts the attempts it received.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use backstop::client::replay::ReplayBody;
use backstop::client::{ClientStack, Destination};
use backstop::policy::{Idempotency, MethodPolicies, MethodPolicy};
use backstop::retry::{Backoff, Jitter};
use backstop::status::Code as BackstopCode;
use http::uri::PathAndQuery;
use tonic::server::NamedService;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::{Service, ServiceExt};

const SERVICE: &str = "test.v1.Echo";

/// What the server received, per method path: the `grpc-previous-rpc-attempts` of each
/// attempt (`None` on a first attempt).
type Received = Arc<Mutex<HashMap<String, Vec<Option<String>>>>>;

/// `Flaky` answers `UNAVAILABLE` twice, then succeeds; every other method always answers
/// `UNAVAILABLE`.
#[derive(Clone, Default)]
struct Echo {
    received: Received,
}

impl NamedService for Echo {
    const NAME: &'static str = SERVICE;
}

impl Service<http::Request<tonic::body::Body>> for Echo {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let path = request.uri().path().to_owned();
        let previous = request
            .headers()
            .get("grpc-previous-rpc-attempts")
            .map(|v| v.to_str().unwrap().to_owned());
        let nth = {
            let mut received = self.received.lock().unwrap();
            let attempts = received.entry(path.clone()).or_default();
            attempts.push(previous);
            attempts.len()
        };
        let flaky = path == format!("/{SERVICE}/Flaky");
        Box::pin(async move {
            let answer = tower::service_fn(move |_: tonic::Request<()>| async move {
                if flaky && nth > 2 {
                    Ok(tonic::Response::new(()))
                } else {
                    Err(Status::unavailable("try again"))
                }
            });
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<(), ()>::default());
            Ok(grpc.unary(answer, request).await)
        })
    }
}

/// A quick backoff, so the retries do not wait long on the real clock.
fn quick() -> Backoff {
    Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(5),
        Jitter::Full,
        Duration::ZERO,
    )
    .unwrap()
}

#[tokio::test]
async fn one_stack_over_one_channel_retries_each_method_by_its_own_policy() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = Echo::default();
    let received = echo.received.clone();
    tokio::spawn(
        Server::builder()
            .add_service(echo)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );

    let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        // Retried on UNAVAILABLE, three attempts in all.
        .method(
            format!("/{SERVICE}/Flaky"),
            MethodPolicy::builder("Flaky", Idempotency::Safe)
                .max_attempts(3)
                .retryable([BackstopCode::Unavailable])
                .backoff(quick())
                .build(),
        )
        // Never retried.
        .method(
            format!("/{SERVICE}/Once"),
            MethodPolicy::builder("Once", Idempotency::Unsafe).build(),
        )
        // The rest of the service: two attempts.
        .service(
            SERVICE,
            MethodPolicy::builder("Echo", Idempotency::Safe)
                .max_attempts(2)
                .backoff(quick())
                .build(),
        );
    // Neither breaker nor storm alarm: the attempts sent are the policies' alone.
    let destination = Destination::new("echo").breaker(None).storm_alarm(None);
    let stack = ClientStack::builder(&destination, policies)
        .build()
        .unwrap();

    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    // The stack sends a replayable body; tonic's channel takes its own body type.
    let to_tonic: fn(
        http::Request<ReplayBody<tonic::body::Body>>,
    ) -> http::Request<tonic::body::Body> = |r| r.map(tonic::body::Body::new);
    let client = tonic::client::Grpc::new(stack.layer(channel.map_request(to_tonic)));

    let call = |method: &'static str| {
        let mut client = client.clone();
        async move {
            client.ready().await.unwrap();
            let path = PathAndQuery::from_maybe_shared(format!("/{SERVICE}/{method}")).unwrap();
            client
                .unary(
                    tonic::Request::new(()),
                    path,
                    ProstCodec::<(), ()>::default(),
                )
                .await
        }
    };

    call("Flaky").await.expect("the third attempt succeeds");
    let once = call("Once").await.unwrap_err();
    assert_eq!(once.code(), Code::Unavailable);
    let other = call("Other").await.unwrap_err();
    assert_eq!(other.code(), Code::Unavailable);

    let received = received.lock().unwrap();
    let previous = |method: &str| received[&format!("/{SERVICE}/{method}")].clone();
    assert_eq!(
        previous("Flaky"),
        [None, Some("1".into()), Some("2".into())],
        "retried twice, each retry saying how many attempts came before it"
    );
    assert_eq!(previous("Once"), [None], "never retried");
    assert_eq!(
        previous("Other"),
        [None, Some("1".into())],
        "the service's policy"
    );
}
