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
use crate::admission::{Discipline, QueueConfig};
use crate::observe::{RPC_SERVER_REJECTED_TOTAL, RPC_SERVER_REQUESTS_TOTAL};
use crate::server::metrics::MetricsLayer;
use crate::server::tenant::Tenant;
use crate::server::testing::{flat, problem_code, with_metrics};

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
        .map(|_| {
            GateLayer::new(gate.clone())
                .layer(held(release.clone()))
                .map_response(flat)
        })
        .collect();
    for svc in &mut services {
        svc.ready().await.unwrap();
    }
    assert_eq!(gate.inflight(), 0, "ready services hold nothing");
}

#[tokio::test(start_paused = true)]
async fn full_gate_waits_at_most_time_left_minus_min_service_then_503() {
    let gate = Gate::new(1, Duration::from_millis(20));
    let release = Arc::new(Semaphore::new(0));
    let svc = GateLayer::new(gate.clone())
        .layer(held(release.clone()))
        .map_response(flat);

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
    assert!(retry_after_secs(&res) >= 1);
    assert_eq!(problem_code(res.body()), "overloaded");
    assert_eq!(res.extensions().get(), Some(&Rejected("deadline")));

    release.add_permits(1);
    let res = first.await.unwrap().unwrap();
    assert_eq!(res.body(), "done");
    assert_eq!(gate.inflight(), 0, "the permit is released with the answer");
}

#[tokio::test(start_paused = true)]
async fn time_left_below_min_service_is_refused_at_once() {
    let gate = Gate::new(1, Duration::from_millis(50));
    let release = Arc::new(Semaphore::new(0));
    let svc = GateLayer::new(gate.clone())
        .layer(held(release.clone()))
        .map_response(flat);
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
    let svc = GateLayer::new(gate.clone())
        .layer(held(release.clone()))
        .map_response(flat);
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
    let svc = GateLayer::new(gate.clone())
        .layer(held(release))
        .map_response(flat);
    let running = tokio::spawn(svc.oneshot(request(Duration::from_secs(5))));
    tokio::task::yield_now().await;
    assert_eq!(gate.inflight(), 1);
    running.abort();
    let _ = running.await;
    assert_eq!(gate.inflight(), 0);
}

#[tokio::test(start_paused = true)]
async fn request_without_deadline_uses_the_default_timeout() {
    let gate = Gate::new(1, Duration::from_millis(10));
    let release = Arc::new(Semaphore::new(0));
    let svc = GateLayer::new(gate.clone())
        .default_timeout(Duration::from_millis(60))
        .layer(held(release))
        .map_response(flat);
    let _first = tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(5))));
    tokio::task::yield_now().await;
    let start = Instant::now();
    let bare = Request::builder().body(Bytes::new()).unwrap();
    let res = svc.oneshot(bare).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(start.elapsed(), Duration::from_millis(50));
}

#[tokio::test(start_paused = true)]
async fn each_request_counts_once_toward_sustained_overload() {
    let gate = Gate::new(1, Duration::from_millis(10));
    let release = Arc::new(Semaphore::new(0));
    let svc = GateLayer::new(gate.clone())
        .layer(held(release.clone()))
        .map_response(flat);
    let first = tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(5))));
    tokio::task::yield_now().await;
    // Tried at once, then through the queue: one refusal all the same.
    let res = svc
        .oneshot(request(Duration::from_millis(5)))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        gate.shedding().refused_share(),
        0.5,
        "one admitted, one refused"
    );
    release.add_permits(1);
    first.await.unwrap().unwrap();
}

#[test]
fn overload_is_counted_as_rejected() {
    let ((), m) = with_metrics(|| async {
        let gate = Gate::new(1, Duration::from_millis(10));
        let release = Arc::new(Semaphore::new(0));
        let svc = MetricsLayer::new("payments")
            .route(Method::POST, "/v1/payments")
            .layer(
                GateLayer::new(gate)
                    .layer(held(release.clone()))
                    .map_response(flat),
            );
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
            &[("reason", "deadline"), ("method", "POST /v1/payments")]
        ),
        1,
        "5 ms of budget cannot cover 10 ms of service"
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
    let mut svc = GateLayer::new(gate.clone())
        .layer(CountClones(clones.clone()))
        .map_response(flat);
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

/// A queue whose waiters wait as long as their budget allows: tests of the limit need every
/// request served, however long the queue.
fn fifo() -> QueueConfig {
    QueueConfig {
        discipline: Discipline::Fifo,
        ..QueueConfig::default()
    }
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
        )
        .with_queue(fifo());
        gate.publish_as("payments");
        let latency_ms = Arc::new(AtomicUsize::new(100));
        let svc = GateLayer::new(gate.clone())
            .layer(slowed(latency_ms.clone()))
            .map_response(flat);
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
    let svc = GateLayer::new(gate.clone())
        .layer(slowed(latency_ms.clone()))
        .map_response(flat);
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
async fn a_callers_broken_body_teaches_the_limit_nothing_however_long_it_took() {
    let gate = Gate::with_limit(
        crate::admission::Gradient2::new(1, 8),
        Duration::from_millis(5),
    )
    .with_queue(fifo());
    let latency_ms = Arc::new(AtomicUsize::new(100));
    let served = GateLayer::new(gate.clone())
        .layer(slowed(latency_ms))
        .map_response(flat);
    rounds(&served, 8, 20).await;
    assert_eq!(gate.limit(), 8);

    // Bodies trickling in for seconds, then cut short: the caller's 400, outcome `rejected`.
    let broken = GateLayer::new(gate.clone())
        .layer(service_fn(|_req: Request<Bytes>| async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let status = crate::status::Status::new(crate::status::Code::InvalidArgument, "cut")
                .with_problem(crate::status::problem::REQUEST_BODY_INVALID)
                .as_rejected();
            let res = crate::server::problem::Problem::from_status(&status).into_http_response();
            Ok::<_, Infallible>(res)
        }))
        .map_response(flat);
    let calls: Vec<_> = (0..40)
        .map(|_| tokio::spawn(broken.clone().oneshot(request(Duration::from_secs(30)))))
        .collect();
    for call in calls {
        assert_eq!(
            call.await.unwrap().unwrap().status(),
            StatusCode::BAD_REQUEST
        );
    }
    assert_eq!(
        gate.limit(),
        8,
        "five seconds of a caller's body is no slow server"
    );
    assert_eq!(gate.inflight(), 0);
}

#[tokio::test(start_paused = true)]
async fn fast_failures_do_not_raise_a_lowered_limit() {
    let gate = Gate::with_limit(
        crate::admission::Gradient2::new(1, 8),
        Duration::from_millis(5),
    )
    .with_queue(fifo());
    let latency_ms = Arc::new(AtomicUsize::new(100));
    let served = GateLayer::new(gate.clone())
        .layer(slowed(latency_ms.clone()))
        .map_response(flat);
    rounds(&served, 8, 20).await;
    latency_ms.store(600, Ordering::Relaxed);
    rounds(&served, 8, 3).await;
    let lowered = gate.limit();
    assert!(lowered < 8, "{lowered}");

    // The service now fails at once (its dependency gave up): 503s in no time at all.
    let failing = GateLayer::new(gate.clone())
        .layer(service_fn(|_req: Request<Bytes>| async {
            let mut res = Response::new(Bytes::new());
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            Ok::<_, Infallible>(res)
        }))
        .map_response(flat);
    let grpc_failing = GateLayer::new(gate.clone())
        .layer(service_fn(|_req: Request<Bytes>| async {
            let mut res = Response::new(Bytes::new());
            res.headers_mut()
                .insert("grpc-status", http::HeaderValue::from_static("14"));
            Ok::<_, Infallible>(res)
        }))
        .map_response(flat);
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

fn retry_after_secs(res: &Response<Bytes>) -> u64 {
    res.headers()[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

fn as_tenant(mut req: Request<Bytes>, tenant: &str) -> Request<Bytes> {
    req.extensions_mut().insert(Tenant::new(tenant));
    req
}

fn grpc(mut req: Request<Bytes>) -> Request<Bytes> {
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    req
}

/// Sends `req` through `svc` in a task, and lets it reach the gate.
async fn spawn<S>(svc: &S, req: Request<Bytes>) -> tokio::task::JoinHandle<Response<Bytes>>
where
    S: Service<Request<Bytes>, Response = Response<Bytes>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let call = tokio::spawn({
        let svc = svc.clone();
        async move { svc.oneshot(req).await.unwrap() }
    });
    tokio::task::yield_now().await;
    call
}

#[test]
fn queue_refusals_carry_their_reason_in_the_metric_and_the_answer() {
    let (responses, m) = with_metrics(|| async {
        let gate = Gate::new(1, Duration::from_millis(10)).with_queue(QueueConfig {
            max_waiters: 2,
            ..QueueConfig::default()
        });
        let release = Arc::new(Semaphore::new(0));
        let svc = MetricsLayer::new("payments")
            .route(Method::POST, "/v1/payments")
            .layer(
                GateLayer::new(gate.clone())
                    .layer(held(release.clone()))
                    .map_response(flat),
            );
        let _running = spawn(&svc, request(Duration::from_secs(5))).await;
        // One tenant may hold the whole queue...
        let a1 = spawn(&svc, as_tenant(request(Duration::from_secs(5)), "a")).await;
        let a2 = spawn(&svc, as_tenant(request(Duration::from_secs(5)), "a")).await;
        assert_eq!(gate.queued(), 2);
        // ...but not a third place, nor against another tenant's share: a2, the newest, goes.
        let a3 = spawn(&svc, as_tenant(request(Duration::from_secs(5)), "a")).await;
        let _b = spawn(&svc, as_tenant(request(Duration::from_secs(5)), "b")).await;
        let a3 = a3.await.unwrap();
        // A request whose budget cannot cover the service time is refused at once.
        let late = svc
            .clone()
            .oneshot(request(Duration::from_millis(10)))
            .await
            .unwrap();
        // Nobody is served for an interval: a standing queue; waiters past the target go.
        tokio::time::sleep(Duration::from_millis(150)).await;
        let a1 = a1.await.unwrap();
        release.add_permits(10);
        (a2.await.unwrap(), a3, late, a1)
    });
    let (a2, a3, late, a1) = responses;
    let expected = [
        (&a2, "tenant_share"),
        (&a3, "tenant_share"),
        (&late, "deadline"),
        (&a1, "sojourn"),
    ];
    for (res, reason) in expected {
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE, "{reason}");
        assert_eq!(problem_code(res.body()), "overloaded");
        assert_eq!(res.extensions().get(), Some(&Rejected(reason)));
        assert!(retry_after_secs(res) >= 1, "{reason}");
    }
    for reason in ["tenant_share", "deadline", "sojourn"] {
        assert!(
            m.counter(RPC_SERVER_REJECTED_TOTAL, &[("reason", reason)]) >= 1,
            "{reason}"
        );
    }
    assert_eq!(
        m.counter(RPC_SERVER_REJECTED_TOTAL, &[("reason", "tenant_share")]),
        2,
        "a3 refused, a2 pushed out"
    );
}

#[test]
fn a_full_queue_refuses_with_reason_full_and_the_queue_is_published() {
    let (res, m) = with_metrics(|| async {
        let gate = Gate::new(1, Duration::from_millis(10)).with_queue(QueueConfig {
            max_waiters: 1,
            ..fifo()
        });
        gate.publish_as("payments");
        let release = Arc::new(Semaphore::new(0));
        let svc = GateLayer::new(gate.clone())
            .layer(held(release.clone()))
            .map_response(flat);
        let running = spawn(&svc, request(Duration::from_secs(5))).await;
        let waiting = spawn(&svc, request(Duration::from_secs(5))).await;
        let res = svc
            .clone()
            .oneshot(request(Duration::from_secs(5)))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        release.add_permits(2);
        assert_eq!(running.await.unwrap().status(), StatusCode::OK);
        assert_eq!(waiting.await.unwrap().status(), StatusCode::OK);
        res
    });
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.extensions().get(), Some(&Rejected("full")));
    let labels = [("service", "payments")];
    assert_eq!(
        m.gauge(crate::observe::RPC_SERVER_QUEUE_LENGTH, &labels),
        0.0
    );
    assert_eq!(
        m.samples(crate::observe::RPC_SERVER_QUEUE_DELAY_SECONDS, &labels),
        2,
        "one admitted at once, one after waiting"
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_whose_caller_goes_away_leaves_the_queue_at_once() {
    let gate = Gate::new(1, Duration::from_millis(5));
    let release = Arc::new(Semaphore::new(0));
    let svc = GateLayer::new(gate.clone())
        .layer(held(release.clone()))
        .map_response(flat);
    let running = spawn(&svc, request(Duration::from_secs(5))).await;
    let waiting = spawn(&svc, request(Duration::from_secs(5))).await;
    assert_eq!((gate.inflight(), gate.queued()), (1, 1));
    waiting.abort();
    let _ = waiting.await;
    assert_eq!(
        (gate.inflight(), gate.queued()),
        (1, 0),
        "left, holding nothing"
    );
    release.add_permits(1);
    running.await.unwrap();
    assert_eq!((gate.inflight(), gate.queued()), (0, 0));
    assert!(
        gate.try_enter().is_ok(),
        "the slot is free for the next one"
    );
}

#[test]
fn shedding_hard_tells_grpc_clients_not_to_retry_and_http_clients_to_wait_long() {
    let ((grpc_res, http_res, early), _) = with_metrics(|| async {
        let gate = Gate::new(1, Duration::from_millis(5)).with_queue(QueueConfig {
            hard_shed_after: Duration::from_millis(500),
            ..QueueConfig::default()
        });
        let latency_ms = Arc::new(AtomicUsize::new(20));
        let svc = GateLayer::new(gate.clone())
            .layer(slowed(latency_ms))
            .map_response(flat);
        // Ten arrivals per service time, for well over the half second.
        let mut calls = Vec::new();
        let mut early = None;
        for i in 0..600 {
            calls.push(tokio::spawn(
                svc.clone().oneshot(grpc(request(Duration::from_secs(5)))),
            ));
            tokio::time::sleep(Duration::from_millis(2)).await;
            if i == 100 {
                let res = svc.clone().oneshot(grpc(request(Duration::from_millis(6))));
                early = Some(res.await.unwrap());
            }
        }
        let grpc_res = svc
            .clone()
            .oneshot(grpc(request(Duration::from_millis(6))))
            .await
            .unwrap();
        let http_res = svc
            .clone()
            .oneshot(request(Duration::from_millis(6)))
            .await
            .unwrap();
        for call in calls {
            call.await.unwrap().unwrap();
        }
        (grpc_res, http_res, early.unwrap())
    });
    let pushback = |res: &Response<Bytes>| {
        res.headers()["grpc-retry-pushback-ms"]
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(early.headers()["grpc-status"], "14");
    assert!(
        pushback(&early).parse::<u64>().is_ok(),
        "early on, retry later: {}",
        pushback(&early)
    );
    assert_eq!(grpc_res.headers()["grpc-status"], "14");
    assert_eq!(pushback(&grpc_res), "-1", "do not retry");
    assert_eq!(http_res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(retry_after_secs(&http_res) >= 30);
}

#[test]
fn retry_after_follows_the_queue_and_is_jittered() {
    let (waits, _) = with_metrics(|| async {
        let gate = Gate::new(1, Duration::from_millis(50)).with_queue(QueueConfig {
            max_waiters: 1000,
            ..fifo()
        });
        let release = Arc::new(Semaphore::new(0));
        let svc = GateLayer::new(gate.clone())
            .layer(held(release.clone()))
            .map_response(flat);
        let _running = spawn(&svc, request(Duration::from_secs(60))).await;
        let mut waiting = Vec::new();
        for _ in 0..400 {
            waiting.push(spawn(&svc, request(Duration::from_secs(60))).await);
        }
        // 400 waiters x 50 ms for one slot: 20 s to drain, bounded to 10 s plus jitter.
        let mut waits = Vec::new();
        for _ in 0..20 {
            let res = svc
                .clone()
                .oneshot(request(Duration::from_millis(40)))
                .await
                .unwrap();
            waits.push(retry_after_secs(&res));
        }
        release.add_permits(1_000);
        for w in waiting {
            w.await.unwrap();
        }
        waits
    });
    assert!(waits.iter().all(|w| (10..=20).contains(w)), "{waits:?}");
    assert!(waits.iter().any(|w| *w != waits[0]), "jittered: {waits:?}");
}

/// Slow start through the gate layer (paused clock): a burst of 5xx answers drops the gate
/// to its floor; when the service answers again, a burst of requests is admitted a few at
/// a time and the limit ramps back to the inner limit instead of jumping there.
#[tokio::test(start_paused = true)]
async fn the_server_gate_admits_few_after_a_burst_of_5xx_then_ramps_back() {
    use std::convert::Infallible;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use bytes::Bytes;
    use http::{Request, Response, StatusCode};
    use tower::{ServiceExt, service_fn};
    use tower_layer::Layer;

    use crate::admission::{FixedLimit, Gate, SlowStart};
    use crate::deadline::Deadline;
    use crate::server::GateLayer;

    // One FIFO line bounded by the (long) deadline: every request waits for its turn, so
    // the test watches the limit alone, not the fair queue's sojourn drops.
    let gate = Gate::with_limit(
        SlowStart::new(FixedLimit::new(16), 2),
        Duration::from_millis(5),
    )
    .with_queue(crate::admission::QueueConfig {
        discipline: crate::admission::Discipline::Fifo,
        ..crate::admission::QueueConfig::default()
    });
    let down = Arc::new(AtomicBool::new(true));
    let svc = GateLayer::new(gate.clone()).layer(service_fn({
        let down = down.clone();
        move |_req: Request<Bytes>| {
            let down = down.load(Ordering::Relaxed);
            async move {
                let mut response = Response::new(Bytes::new());
                if down {
                    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                } else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok::<_, Infallible>(response)
            }
        }
    }));
    let call = |svc: &_| {
        let svc: tower::util::BoxCloneService<_, _, _> = Clone::clone(svc);
        let mut request = Request::new(Bytes::new());
        request
            .extensions_mut()
            .insert(Deadline::after(Duration::from_secs(60)));
        tokio::spawn(svc.oneshot(request))
    };
    let svc = tower::util::BoxCloneService::new(svc);

    assert_eq!(gate.limit(), 16);
    for _ in 0..40 {
        let answer = call(&svc).await.unwrap().unwrap();
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(
        gate.limit(),
        2,
        "the burst of 503s dropped the gate to its floor"
    );

    down.store(false, Ordering::Relaxed);
    let calls: Vec<_> = (0..64).map(|_| call(&svc)).collect();
    tokio::task::yield_now().await;
    assert_eq!(gate.inflight(), 2, "admits few at first");
    let mut limits = vec![gate.limit()];
    while calls.iter().any(|c| !c.is_finished()) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        limits.push(gate.limit());
    }
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap().status(), StatusCode::OK);
    }
    assert!(limits.windows(2).all(|w| w[0] <= w[1]), "{limits:?}");
    assert!(
        limits.iter().any(|l| (3..16).contains(l)),
        "ramps, does not jump: {limits:?}"
    );
    assert_eq!(gate.limit(), 16, "{limits:?}");
    assert_eq!(gate.inflight(), 0);
}
