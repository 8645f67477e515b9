use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tower::{Service, ServiceExt, service_fn};
use tower_layer::Layer;

use super::*;
use crate::observe::{RPC_SERVER_REJECTED_TOTAL, RPC_SERVER_REQUESTS_TOTAL};
use crate::server::metrics::MetricsLayer;
use crate::server::testing::{problem_code, with_metrics};

/// A handler that finishes only when the test adds a permit to `release`.
fn held(
    release: Arc<Semaphore>,
) -> impl Service<Request<Bytes>, Response = Response<Bytes>, Error = Infallible, Future: Send>
+ Clone
+ Send {
    service_fn(move |_req: Request<Bytes>| {
        let release = release.clone();
        async move {
            release.acquire().await.unwrap().forget();
            Ok::<_, Infallible>(Response::new(Bytes::from_static(b"done")))
        }
    })
}

fn request(budget: Duration) -> Request<Bytes> {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri("/v1/payments")
        .body(Bytes::new())
        .unwrap();
    req.extensions_mut().insert(Deadline::after(budget));
    req
}

#[tokio::test(start_paused = true)]
async fn no_permit_is_taken_in_poll_ready() {
    let gate = Gate::new(1, Duration::from_millis(5));
    let release = Arc::new(Semaphore::new(0));
    let mut services: Vec<_> = (0..10)
        .map(|_| GateLayer::new(gate.clone()).layer(held(release.clone())))
        .collect();
    for svc in &mut services {
        svc.ready().await.unwrap();
    }
    assert_eq!(gate.inflight(), 0, "ready services hold nothing");
}

#[tokio::test(start_paused = true)]
async fn full_gate_waits_at_most_budget_minus_min_service_then_503() {
    let gate = Gate::new(1, Duration::from_millis(20));
    let release = Arc::new(Semaphore::new(0));
    let svc = GateLayer::new(gate.clone()).layer(held(release.clone()));

    let first = tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(5))));
    tokio::task::yield_now().await;
    assert_eq!(
        gate.inflight(),
        1,
        "the permit is held while the handler runs"
    );

    let start = Instant::now();
    let res = svc
        .clone()
        .oneshot(request(Duration::from_millis(100)))
        .await
        .unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(80));
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()[header::RETRY_AFTER], "1");
    assert_eq!(problem_code(res.body()), "overloaded");
    assert_eq!(res.extensions().get(), Some(&Rejected("overloaded")));

    release.add_permits(1);
    let res = first.await.unwrap().unwrap();
    assert_eq!(res.body(), "done");
    assert_eq!(gate.inflight(), 0, "the permit is released with the answer");
}

#[tokio::test(start_paused = true)]
async fn budget_below_min_service_is_refused_at_once() {
    let gate = Gate::new(1, Duration::from_millis(50));
    let release = Arc::new(Semaphore::new(0));
    let svc = GateLayer::new(gate.clone()).layer(held(release.clone()));
    let _first = tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(5))));
    tokio::task::yield_now().await;

    let start = Instant::now();
    let res = svc
        .oneshot(request(Duration::from_millis(30)))
        .await
        .unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test(start_paused = true)]
async fn waiter_is_admitted_when_a_slot_frees_in_time() {
    let gate = Gate::new(1, Duration::from_millis(20));
    let release = Arc::new(Semaphore::new(0));
    let svc = GateLayer::new(gate.clone()).layer(held(release.clone()));
    let first = tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(5))));
    tokio::task::yield_now().await;
    let second = tokio::spawn(svc.oneshot(request(Duration::from_secs(1))));
    tokio::time::sleep(Duration::from_millis(50)).await;
    release.add_permits(2);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(second.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(gate.inflight(), 0);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_response_future_releases_the_permit() {
    let gate = Gate::new(1, Duration::from_millis(5));
    let release = Arc::new(Semaphore::new(0));
    let svc = GateLayer::new(gate.clone()).layer(held(release));
    let running = tokio::spawn(svc.oneshot(request(Duration::from_secs(5))));
    tokio::task::yield_now().await;
    assert_eq!(gate.inflight(), 1);
    running.abort();
    let _ = running.await;
    assert_eq!(gate.inflight(), 0);
}

#[tokio::test(start_paused = true)]
async fn request_without_deadline_uses_the_default_budget() {
    let gate = Gate::new(1, Duration::from_millis(10));
    let release = Arc::new(Semaphore::new(0));
    let svc = GateLayer::new(gate.clone())
        .default_budget(Duration::from_millis(60))
        .layer(held(release));
    let _first = tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(5))));
    tokio::task::yield_now().await;
    let start = Instant::now();
    let bare = Request::builder().body(Bytes::new()).unwrap();
    let res = svc.oneshot(bare).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(start.elapsed(), Duration::from_millis(50));
}

#[test]
fn overload_is_counted_as_rejected() {
    let ((), m) = with_metrics(|| async {
        let gate = Gate::new(1, Duration::from_millis(10));
        let release = Arc::new(Semaphore::new(0));
        let svc = MetricsLayer::new("payments")
            .route(Method::POST, "/v1/payments")
            .layer(GateLayer::new(gate).layer(held(release.clone())));
        let first = tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(5))));
        tokio::task::yield_now().await;
        let res = svc
            .oneshot(request(Duration::from_millis(5)))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        release.add_permits(1);
        first.await.unwrap().unwrap();
    });
    assert_eq!(
        m.counter(
            RPC_SERVER_REJECTED_TOTAL,
            &[("reason", "overloaded"), ("method", "POST /v1/payments")]
        ),
        1
    );
    assert_eq!(
        m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("outcome", "rejected")]),
        1
    );
    assert_eq!(
        m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("outcome", "ok")]),
        1
    );
}

/// Counts its clones; answers 200 at once.
#[derive(Debug)]
struct CountClones(Arc<AtomicUsize>);

impl Clone for CountClones {
    fn clone(&self) -> Self {
        self.0.fetch_add(1, Ordering::Relaxed);
        Self(self.0.clone())
    }
}

impl Service<Request<Bytes>> for CountClones {
    type Response = Response<Bytes>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<Bytes>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Request<Bytes>) -> Self::Future {
        std::future::ready(Ok(Response::new(Bytes::new())))
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_admitted_at_once_holds_a_permit_and_needs_no_service_clone() {
    let gate = Gate::new(1, Duration::from_millis(5));
    let clones = Arc::new(AtomicUsize::new(0));
    let mut svc = GateLayer::new(gate.clone()).layer(CountClones(clones.clone()));
    let fut = svc
        .ready()
        .await
        .unwrap()
        .call(request(Duration::from_secs(1)));
    assert_eq!(gate.inflight(), 1, "admitted when called");
    assert_eq!(fut.await.unwrap().status(), StatusCode::OK);
    assert_eq!(gate.inflight(), 0, "permit released with the answer");
    assert_eq!(clones.load(Ordering::Relaxed), 0);
}

/// A handler that answers after the latency in `latency_ms` (paused clock).
fn slowed(
    latency_ms: Arc<AtomicUsize>,
) -> impl Service<Request<Bytes>, Response = Response<Bytes>, Error = Infallible, Future: Send>
+ Clone
+ Send {
    service_fn(move |_req: Request<Bytes>| {
        let ms = latency_ms.load(Ordering::Relaxed) as u64;
        async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok::<_, Infallible>(Response::new(Bytes::from_static(b"done")))
        }
    })
}

/// Sends `n` rounds of `width` concurrent requests through `svc`; every one is answered 200.
async fn rounds<S>(svc: &S, width: usize, n: usize)
where
    S: Service<Request<Bytes>, Response = Response<Bytes>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    for _ in 0..n {
        let calls: Vec<_> = (0..width)
            .map(|_| tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(30)))))
            .collect();
        for call in calls {
            assert_eq!(call.await.unwrap().unwrap().status(), StatusCode::OK);
        }
    }
}

#[test]
fn finished_requests_teach_an_adaptive_limit_and_the_gauges_follow() {
    let (lowered, m) = with_metrics(|| async {
        let gate = Gate::with_limit(
            crate::admission::Gradient2::new(2, 8),
            Duration::from_millis(5),
        );
        gate.publish_as("payments");
        let latency_ms = Arc::new(AtomicUsize::new(100));
        let svc = GateLayer::new(gate.clone()).layer(slowed(latency_ms.clone()));
        rounds(&svc, 8, 20).await;
        assert_eq!(
            gate.limit(),
            8,
            "steady latency keeps the limit at its bound"
        );

        latency_ms.store(600, Ordering::Relaxed);
        rounds(&svc, 8, 5).await;
        let lowered = gate.limit();
        assert!(
            lowered < 8,
            "600 ms after 100 ms lowers the limit: {lowered}"
        );
        assert_eq!(gate.inflight(), 0);
        lowered
    });
    let labels = [("service", "payments")];
    assert_eq!(
        m.gauge(crate::observe::RPC_SERVER_CONCURRENCY_LIMIT, &labels),
        lowered as f64
    );
    assert_eq!(
        m.gauge(crate::observe::RPC_SERVER_CONCURRENCY_INFLIGHT, &labels),
        0.0
    );
}

#[tokio::test(start_paused = true)]
async fn a_request_cancelled_early_teaches_the_limit_nothing() {
    let gate = Gate::with_limit(
        crate::admission::Gradient2::new(1, 4),
        Duration::from_millis(5),
    );
    let latency_ms = Arc::new(AtomicUsize::new(100));
    let svc = GateLayer::new(gate.clone()).layer(slowed(latency_ms.clone()));
    rounds(&svc, 4, 10).await;
    latency_ms.store(10_000, Ordering::Relaxed);
    for _ in 0..20 {
        // Callers giving up after 1 ms: below the latency already known, so no sample.
        let call = tokio::time::timeout(
            Duration::from_millis(1),
            svc.clone().oneshot(request(Duration::from_secs(30))),
        );
        assert!(call.await.is_err());
    }
    assert_eq!(gate.limit(), 4);
    assert_eq!(gate.inflight(), 0);
}

#[tokio::test(start_paused = true)]
async fn fast_failures_do_not_raise_a_lowered_limit() {
    let gate = Gate::with_limit(
        crate::admission::Gradient2::new(1, 8),
        Duration::from_millis(5),
    );
    let latency_ms = Arc::new(AtomicUsize::new(100));
    let served = GateLayer::new(gate.clone()).layer(slowed(latency_ms.clone()));
    rounds(&served, 8, 20).await;
    latency_ms.store(600, Ordering::Relaxed);
    rounds(&served, 8, 3).await;
    let lowered = gate.limit();
    assert!(lowered < 8, "{lowered}");

    // The service now fails at once (its dependency gave up): 503s in no time at all.
    let failing = GateLayer::new(gate.clone()).layer(service_fn(|_req: Request<Bytes>| async {
        let mut res = Response::new(Bytes::new());
        *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        Ok::<_, Infallible>(res)
    }));
    let grpc_failing =
        GateLayer::new(gate.clone()).layer(service_fn(|_req: Request<Bytes>| async {
            let mut res = Response::new(Bytes::new());
            res.headers_mut()
                .insert("grpc-status", http::HeaderValue::from_static("14"));
            Ok::<_, Infallible>(res)
        }));
    for _ in 0..100 {
        assert_eq!(
            failing
                .clone()
                .oneshot(request(Duration::from_secs(1)))
                .await
                .unwrap()
                .status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        grpc_failing
            .clone()
            .oneshot(request(Duration::from_secs(1)))
            .await
            .unwrap();
    }
    assert_eq!(
        gate.limit(),
        lowered,
        "failures are no evidence of fast service"
    );
    assert_eq!(gate.inflight(), 0);
}
