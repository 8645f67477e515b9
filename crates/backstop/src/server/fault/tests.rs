use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use tokio::time::Instant;
use tower::{Service, ServiceExt, service_fn};
use tower_layer::Layer;

use super::*;
use crate::server::testing::{flat, problem_code, with_metrics};

/// A handler answering 200 at once, counting its calls.
fn counted(
    calls: Arc<AtomicUsize>,
) -> impl Service<Request<Bytes>, Response = Response<Bytes>, Error = Infallible, Future: Send>
+ Clone
+ Send {
    service_fn(move |_req: Request<Bytes>| {
        calls.fetch_add(1, Ordering::Relaxed);
        async { Ok::<_, Infallible>(Response::new(Bytes::from_static(b"ok"))) }
    })
}

fn request() -> Request<Bytes> {
    Request::post("/v1/payments").body(Bytes::new()).unwrap()
}

/// Sends `n` requests through `layer`; returns the statuses in order and the handler's calls.
async fn send(layer: &FaultLayer, n: usize) -> (Vec<StatusCode>, usize) {
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = layer.layer(counted(calls.clone())).map_response(flat);
    let mut statuses = Vec::with_capacity(n);
    for _ in 0..n {
        statuses.push(svc.clone().oneshot(request()).await.unwrap().status());
    }
    (statuses, calls.load(Ordering::Relaxed))
}

#[tokio::test(start_paused = true)]
async fn none_passes_every_request_through() {
    let layer = FaultLayer::none();
    assert!(!layer.is_active());
    let (statuses, calls) = send(&layer, 100).await;
    assert!(statuses.iter().all(|s| *s == StatusCode::OK));
    assert_eq!(calls, 100);
    let zero = FaultLayer::none()
        .abort_percent(0.0)
        .unwrap()
        .delay(100.0, Duration::ZERO)
        .unwrap();
    assert!(!zero.is_active(), "nothing to inject");
}

#[test]
fn an_aborted_request_never_reaches_the_service_and_is_counted() {
    let (calls, m) = with_metrics(|| async {
        let calls = Arc::new(AtomicUsize::new(0));
        let layer = FaultLayer::none().abort_percent(100.0).unwrap();
        let svc = crate::server::MetricsLayer::new("payments")
            .route(Method::POST, "/v1/payments")
            .layer(layer.layer(counted(calls.clone())).map_response(flat));
        let response = svc.clone().oneshot(request()).await.unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(response.headers().get(header::RETRY_AFTER).is_none());
        assert_eq!(problem_code(response.body()), FAULT_INJECTED);

        let grpc = Request::post("/payment.v1.Payment/Charge")
            .header(header::CONTENT_TYPE, "application/grpc")
            .body(Bytes::new())
            .unwrap();
        let response = svc.oneshot(grpc).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["grpc-status"], "14");
        calls.load(Ordering::Relaxed)
    });
    assert_eq!(calls, 0);
    assert_eq!(
        m.counter(
            RPC_SERVER_FAULTS_INJECTED_TOTAL,
            &[("method", "POST /v1/payments"), ("fault", "abort")]
        ),
        1
    );
    // The metrics layer sees the abort as a retryable failure, not an admission refusal.
    assert_eq!(
        m.counter(
            crate::observe::RPC_SERVER_REQUESTS_TOTAL,
            &[("method", "POST /v1/payments"), ("outcome", "retryable")]
        ),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn a_seeded_layer_aborts_about_its_share_reproducibly() {
    let layer = || FaultLayer::none().abort_percent(10.0).unwrap().seeded(15);
    let (first, calls) = send(&layer(), 10_000).await;
    let aborted = first.iter().filter(|s| s.is_server_error()).count();
    assert_eq!(aborted + calls, 10_000);
    assert!((800..1_200).contains(&aborted), "{aborted} of 10,000");
    let (again, _) = send(&layer(), 10_000).await;
    assert_eq!(first, again, "the same seed, the same faults");
    let (other, _) = send(
        &FaultLayer::none().abort_percent(10.0).unwrap().seeded(16),
        10_000,
    )
    .await;
    assert_ne!(first, other);
}

#[tokio::test(start_paused = true)]
async fn a_delayed_request_goes_on_after_the_delay_or_is_then_aborted() {
    let layer = FaultLayer::none()
        .delay(100.0, Duration::from_millis(200))
        .unwrap();
    let start = Instant::now();
    let (statuses, calls) = send(&layer, 3).await;
    assert_eq!(start.elapsed(), Duration::from_millis(600));
    assert_eq!((statuses, calls), (vec![StatusCode::OK; 3], 3));

    let layer = layer
        .abort_with(Status::new(Code::Internal, "boom"))
        .abort_percent(100.0)
        .unwrap();
    let start = Instant::now();
    let (statuses, calls) = send(&layer, 1).await;
    assert_eq!(start.elapsed(), Duration::from_millis(200));
    assert_eq!(
        (statuses, calls),
        (vec![StatusCode::INTERNAL_SERVER_ERROR], 0)
    );
}

#[test]
fn percentages_outside_0_to_100_are_refused() {
    for bad in [-1.0, 100.5, f64::NAN, f64::INFINITY] {
        assert!(FaultLayer::none().abort_percent(bad).is_err(), "{bad}");
        assert!(
            FaultLayer::none()
                .delay(bad, Duration::from_millis(1))
                .is_err()
        );
    }
    let err = FaultLayer::none().abort_percent(120.0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "a fault percentage must be between 0 and 100, got 120"
    );
    let layer = FaultLayer::none().abort_percent(12.5).unwrap();
    assert_eq!(layer.abort_share(), 12.5);
    assert_eq!(layer.delay_share(), (0.0, Duration::ZERO));
}

/// In the full stack an aborted attempt leaves its idempotency key unused: the client's next
/// attempt with the same key is served, by a handler that ran once.
#[tokio::test(start_paused = true)]
async fn in_the_stack_an_aborted_attempt_leaves_its_key_unused() {
    use crate::idempotency::MemoryStore;
    use crate::server::{ServerStack, ServerStackBody};

    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let svc = ServerStack::new("payments", MemoryStore::new())
        .policies(crate::server::testing::keyed(Method::POST, "/v1/payments"))
        .fault(FaultLayer::none().abort_percent(50.0).unwrap().seeded(3))
        .into_layer()
        .layer(service_fn(
            move |_req: Request<ServerStackBody<Full<Bytes>>>| {
                counted.fetch_add(1, Ordering::SeqCst);
                async {
                    let mut res = Response::new(Full::new(Bytes::from_static(b"{}")));
                    *res.status_mut() = StatusCode::CREATED;
                    Ok::<_, Infallible>(res)
                }
            },
        ));
    let mut aborted = 0;
    for attempt in 1.. {
        assert!(attempt < 100, "never served");
        let request = Request::post("/v1/payments")
            .header("idempotency-key", "k-fault")
            .body(Full::new(Bytes::from_static(br#"{"amount_cents":1}"#)))
            .unwrap();
        let response = svc.clone().oneshot(request).await.unwrap();
        if response.status() == StatusCode::CREATED {
            break;
        }
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        aborted += 1;
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // With this seed the first attempts are aborted, so the key was retried after a fault.
    assert!(aborted > 0, "seed 3 aborts the first attempt");
}

/// 1,000 `GetCharge` calls, 10 ms apart, through the client stack with its defaults (budget
/// and storm alarm; the breaker off so every first attempt is sent) to a handler behind a
/// fault layer seeded to abort `percent` % of the attempts. Returns the attempts that reached
/// the fault layer and the calls that succeeded.
async fn default_client_against(percent: f64) -> (usize, usize, crate::client::Destination) {
    use crate::client::{ClientStack, Destination};
    use crate::policy::{Idempotency, MethodPolicy};

    let attempts = Arc::new(AtomicUsize::new(0));
    let handler = service_fn(|_req: Request<_>| async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
    });
    let faulty = FaultLayer::none()
        .abort_percent(percent)
        .unwrap()
        .seeded(15)
        .layer(handler);
    let transport = {
        let attempts = attempts.clone();
        tower::service_fn(move |request: Request<_>| {
            attempts.fetch_add(1, Ordering::Relaxed);
            faulty.clone().oneshot(request)
        })
    };
    let destination = Destination::new("psp").breaker(None);
    let contract = MethodPolicy::builder("GetCharge", Idempotency::Safe)
        .timeout(Duration::from_secs(2))
        .build();
    let client = ClientStack::builder(&destination, contract)
        .build()
        .unwrap()
        .layer(transport);
    let mut ok = 0;
    for _ in 0..1_000 {
        let request = Request::get("http://psp/v1/charges/c-1")
            .body(Full::new(Bytes::new()))
            .unwrap();
        if let Ok(response) = client.clone().oneshot(request).await
            && response.status() == StatusCode::OK
        {
            ok += 1;
        }
        tokio::time::advance(Duration::from_millis(10)).await;
    }
    (attempts.load(Ordering::Relaxed), ok, destination)
}

/// With the faults injected by this layer, the default client policy keeps retrying when 10 %
/// of attempts fail at random (>= 99 % of the calls succeed, the storm alarm stays calm), and
/// stops against a dependency that fails every attempt (at most 1.02 attempts per call).
#[tokio::test(start_paused = true)]
async fn the_default_client_retries_through_ten_percent_and_stops_against_all() {
    use crate::retry::StormLevel;

    let (attempts, ok, destination) = default_client_against(10.0).await;
    assert!(
        ok >= 990,
        "{ok} of 1,000 succeeded with {attempts} attempts"
    );
    assert!(attempts > 1_050, "failed attempts were retried: {attempts}");
    assert_ne!(
        destination.spend().storm().unwrap().level(),
        StormLevel::Tripped
    );

    let (attempts, ok, destination) = default_client_against(100.0).await;
    assert_eq!(ok, 0);
    assert!(attempts <= 1_020, "{attempts} attempts for 1,000 calls");
    assert_eq!(
        destination.spend().storm().unwrap().level(),
        StormLevel::Tripped
    );
}
