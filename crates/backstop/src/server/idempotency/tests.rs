use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use tokio::sync::Semaphore;
use tower::{Service, ServiceExt, service_fn};
use tower_layer::Layer;

use super::*;
use crate::clock::ManualClock;
use crate::idempotency::{MemoryStore, RecordStatus};
use crate::observe::IDEMPOTENCY_CLAIMS_TOTAL;
use crate::policy::{Idempotency, MethodPolicy};
use crate::server::metrics::MetricsLayer;
use crate::server::testing::{body, keyed, problem_code, with_metrics};

type Body = Full<Bytes>;

/// The request body a service behind the idempotency layer gets.
type In = RequestBody<Body>;

const PAY: &str = r#"{"order_id":"o-1","amount_cents":100}"#;

fn layer(store: &MemoryStore) -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::new(store.clone())
        .clock(ManualClock::new(1_000_000))
        .policies(keyed(Method::POST, "/v1/payments"))
        .max_body(1024)
}

fn post(key: Option<&str>, json: &str) -> Request<Body> {
    let mut builder = Request::builder().method(Method::POST).uri("/v1/payments");
    if let Some(key) = key {
        builder = builder.header(IDEMPOTENCY_KEY, key);
    }
    builder
        .body(Body::from(Bytes::copy_from_slice(json.as_bytes())))
        .unwrap()
}

fn for_tenant(mut req: Request<Body>, tenant: &str) -> Request<Body> {
    req.extensions_mut().insert(Tenant::new(tenant));
    req
}

/// A handler answering `status` with a JSON body that numbers the call, plus headers.
#[derive(Clone)]
struct Handler {
    calls: Arc<AtomicUsize>,
    status: StatusCode,
}

impl Handler {
    fn new(status: StatusCode) -> Self {
        Self {
            calls: Arc::new(AtomicUsize::new(0)),
            status,
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn service(
        &self,
    ) -> impl Service<Request<In>, Response = Response<Body>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static {
        let this = self.clone();
        service_fn(move |req: Request<In>| {
            let n = this.calls.fetch_add(1, Ordering::SeqCst) + 1;
            let status = this.status;
            let key = req
                .extensions()
                .get::<IdempotencyKey>()
                .map(|k| k.as_str().to_owned());
            let lease = req.extensions().get::<Lease>().cloned();
            async move {
                let received = body(Response::new(req.into_body())).await;
                let json = format!(
                    "{{\"call\":{n},\"key\":{:?},\"leased\":{},\"received\":{}}}",
                    key.unwrap_or_default(),
                    lease.is_some(),
                    String::from_utf8_lossy(&received)
                );
                let mut res = Response::new(Body::from(json));
                *res.status_mut() = status;
                let h = res.headers_mut();
                h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
                h.insert(header::LOCATION, "/v1/payments/pi_1".parse().unwrap());
                h.insert("x-request-only", "1".parse().unwrap());
                Ok::<_, Infallible>(res)
            }
        })
    }
}

async fn send<S, B>(svc: &S, req: Request<Body>) -> (StatusCode, http::HeaderMap, Bytes)
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let res = svc.clone().oneshot(req).await.unwrap();
    let (parts, b) = res.into_parts();
    let bytes = body(Response::new(b)).await;
    (parts.status, parts.headers, bytes)
}

async fn record(store: &MemoryStore, tenant: &str, key: &str) -> Option<RecordStatus> {
    store
        .get(tenant, &IdempotencyKey::parse(key).unwrap())
        .await
        .unwrap()
        .map(|r| r.status)
}

#[tokio::test]
async fn other_routes_pass_through_without_a_key() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::OK);
    let svc = layer(&store).layer(handler.service());
    let req = Request::builder()
        .method(Method::GET)
        .uri("/v1/payments/pi_1")
        .body(Body::default())
        .unwrap();
    let (status, _, _) = send(&svc, req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(handler.calls(), 1);
    assert!(store.is_empty());
}

#[tokio::test]
async fn missing_or_invalid_key_is_400_and_writes_nothing() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).layer(handler.service());
    let long = "k".repeat(256);
    for (key, code) in [
        (None, "missing_idempotency_key"),
        (Some(long.as_str()), "invalid_idempotency_key"),
        (Some("has space"), "invalid_idempotency_key"),
        (Some("\"unterminated"), "invalid_idempotency_key"),
    ] {
        let (status, headers, bytes) = send(&svc, post(key, PAY)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{key:?}");
        assert_eq!(headers[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(problem_code(&bytes), code, "{key:?}");
    }
    assert_eq!(handler.calls(), 0);
    assert!(store.is_empty());
}

#[tokio::test]
async fn announced_oversized_body_is_413_before_reading() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).layer(handler.service());
    // The body itself is empty (not JSON): only the announced length can give 413.
    let mut req = post(Some("k1"), "");
    req.headers_mut()
        .insert(header::CONTENT_LENGTH, "1000000000".parse().unwrap());
    let (status, _, bytes) = send(&svc, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(problem_code(&bytes), "body_too_large");
    assert!(store.is_empty());
}

#[tokio::test]
async fn oversized_body_without_length_is_413() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).layer(handler.service());
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(2000));
    let (status, _, _) = send(&svc, post(Some("k1"), &big)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(handler.calls(), 0);
    assert!(store.is_empty());
}

#[tokio::test]
async fn non_json_body_is_400_invalid_body() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).layer(handler.service());
    let (status, _, bytes) = send(&svc, post(Some("k1"), "amount=100")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(problem_code(&bytes), "invalid_body");
    assert_eq!(handler.calls(), 0);
    assert!(store.is_empty());
}

#[tokio::test]
async fn a_layer_taking_any_body_fingerprints_other_bodies_byte_for_byte() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).any_body(true).layer(handler.service());
    let (s1, _, b1) = send(&svc, post(Some("k1"), "amount=100")).await;
    assert_eq!(s1, StatusCode::CREATED);
    let (s2, h2, b2) = send(&svc, post(Some("k1"), "amount=100")).await;
    assert_eq!((s2, b2), (StatusCode::CREATED, b1));
    assert_eq!(h2[IDEMPOTENT_REPLAYED], "true");
    let (s3, _, bytes) = send(&svc, post(Some("k1"), "amount=200")).await;
    assert_eq!(s3, StatusCode::CONFLICT);
    assert_eq!(problem_code(&bytes), "idempotency_key_reused");
    // An empty body is a body too.
    let (s4, _, _) = send(&svc, post(Some("k2"), "")).await;
    assert_eq!(s4, StatusCode::CREATED);
    let (s5, h5, _) = send(&svc, post(Some("k2"), "")).await;
    assert_eq!(s5, StatusCode::CREATED);
    assert_eq!(h5[IDEMPOTENT_REPLAYED], "true");
    // JSON is still compared in its canonical form.
    let (s6, _, _) = send(&svc, post(Some("k3"), PAY)).await;
    let respelled = r#"{ "amount_cents": 100, "order_id": "o-1" }"#;
    let (s7, h7, _) = send(&svc, post(Some("k3"), respelled)).await;
    assert_eq!((s6, s7), (StatusCode::CREATED, StatusCode::CREATED));
    assert_eq!(h7[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(handler.calls(), 3);
}

#[tokio::test]
async fn success_is_stored_and_replayed_byte_for_byte() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).layer(handler.service());
    let (s1, h1, b1) = send(&svc, post(Some("k1"), PAY)).await;
    assert_eq!(s1, StatusCode::CREATED);
    assert!(h1.get(IDEMPOTENT_REPLAYED).is_none());
    let doc: serde_json::Value = serde_json::from_slice(&b1).unwrap();
    assert_eq!(doc["key"], "k1", "the handler sees the key");
    assert_eq!(doc["leased"], true, "the handler sees the lease");
    assert_eq!(doc["received"]["amount_cents"], 100, "the body is rebuilt");

    // Same key, same parameters (other JSON spelling): the stored answer.
    let respelled = r#"{ "amount_cents": 100, "order_id": "o-1" }"#;
    let (s2, h2, b2) = send(&svc, post(Some("k1"), respelled)).await;
    assert_eq!(s2, StatusCode::CREATED);
    assert_eq!(b2, b1, "byte for byte");
    assert_eq!(h2[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(h2[header::CONTENT_TYPE], "application/json");
    assert_eq!(h2[header::LOCATION], "/v1/payments/pi_1");
    assert!(
        h2.get("x-request-only").is_none(),
        "only the headers that matter"
    );
    assert_eq!(handler.calls(), 1);
    assert_eq!(
        record(&store, "default", "k1").await,
        Some(RecordStatus::Succeeded)
    );
}

#[tokio::test]
async fn configured_headers_are_replayed_too() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store)
        .store_header(http::HeaderName::from_static("x-request-only"))
        .layer(handler.service());
    send(&svc, post(Some("k1"), PAY)).await;
    let (_, h, _) = send(&svc, post(Some("k1"), PAY)).await;
    assert_eq!(h["x-request-only"], "1");
}

#[tokio::test]
async fn same_key_other_parameters_is_409_with_the_original_prefix() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).layer(handler.service());
    send(&svc, post(Some("k1"), PAY)).await;
    let other = r#"{"order_id":"o-1","amount_cents":1000}"#;
    let (status, _, bytes) = send(&svc, post(Some("k1"), other)).await;
    assert_eq!(status, StatusCode::CONFLICT);
    let doc: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(doc["code"], "idempotency_key_reused");
    let original = Fingerprint::of_json("POST /v1/payments", PAY.as_bytes()).unwrap();
    assert_eq!(doc["fingerprint_prefix"], original.prefix8());
    assert_eq!(handler.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn concurrent_retry_is_409_in_progress_with_retry_after() {
    let store = MemoryStore::new();
    let release = Arc::new(Semaphore::new(0));
    let gate = release.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let svc = layer(&store).layer(service_fn(move |_req: Request<In>| {
        let gate = gate.clone();
        counted.fetch_add(1, Ordering::SeqCst);
        async move {
            gate.acquire().await.unwrap().forget();
            let mut res = Response::new(Body::from("{}"));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(res)
        }
    }));
    let first = tokio::spawn(svc.clone().oneshot(post(Some("k1"), PAY)));
    while calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let (status, headers, bytes) = send(&svc, post(Some("k1"), PAY)).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(problem_code(&bytes), "request_in_progress");
    assert_eq!(
        headers[header::RETRY_AFTER],
        "6",
        "the rest of the 5 s lease and its 0.5 s clock skew margin, rounded up"
    );
    release.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn lease_covers_the_request_deadline() {
    let store = MemoryStore::new();
    let release = Arc::new(Semaphore::new(0));
    let gate = release.clone();
    let svc = layer(&store).layer(service_fn(move |_req: Request<In>| {
        let gate = gate.clone();
        async move {
            gate.acquire().await.unwrap().forget();
            Ok::<_, Infallible>(Response::new(Body::from("{}")))
        }
    }));
    let mut req = post(Some("k1"), PAY);
    req.extensions_mut()
        .insert(crate::deadline::Deadline::after(Duration::from_secs(30)));
    let _first = tokio::spawn(svc.clone().oneshot(req));
    tokio::task::yield_now().await;
    let (status, headers, _) = send(&svc, post(Some("k1"), PAY)).await;
    assert_eq!(status, StatusCode::CONFLICT);
    // 30 s of budget and the 0.5 s clock skew margin, rounded up.
    assert_eq!(headers[header::RETRY_AFTER], "31");
}

#[tokio::test]
async fn retryable_failure_lets_the_same_key_run_again() {
    for failure in [
        StatusCode::INTERNAL_SERVER_ERROR,
        StatusCode::SERVICE_UNAVAILABLE,
        StatusCode::GATEWAY_TIMEOUT,
        StatusCode::TOO_MANY_REQUESTS,
    ] {
        let store = MemoryStore::new();
        let failing = Handler::new(failure);
        let svc = layer(&store).layer(failing.service());
        let (status, headers, _) = send(&svc, post(Some("k1"), PAY)).await;
        assert_eq!(status, failure);
        assert!(headers.get(IDEMPOTENT_REPLAYED).is_none());
        assert_eq!(
            record(&store, "default", "k1").await,
            Some(RecordStatus::Failed)
        );

        // The same key runs again, and still refuses other parameters meanwhile.
        let ok = Handler::new(StatusCode::CREATED);
        let svc = layer(&store).layer(ok.service());
        let other = r#"{"order_id":"o-2","amount_cents":1}"#;
        assert_eq!(
            send(&svc, post(Some("k1"), other)).await.0,
            StatusCode::CONFLICT
        );
        assert_eq!(
            send(&svc, post(Some("k1"), PAY)).await.0,
            StatusCode::CREATED
        );
        assert_eq!(ok.calls(), 1, "{failure}");
    }
}

#[tokio::test]
async fn conflict_with_retry_after_is_retryable_plain_conflict_is_not() {
    let store = MemoryStore::new();
    let svc = layer(&store).layer(service_fn(|req: Request<In>| async move {
        let busy = req.uri().query() == Some("busy");
        let mut res = Response::new(Body::from("{}"));
        *res.status_mut() = StatusCode::CONFLICT;
        if busy {
            res.headers_mut()
                .insert(header::RETRY_AFTER, "1".parse().unwrap());
        }
        Ok::<_, Infallible>(res)
    }));
    let mut busy = post(Some("k1"), PAY);
    *busy.uri_mut() = "/v1/payments?busy".parse().unwrap();
    send(&svc, busy).await;
    assert_eq!(
        record(&store, "default", "k1").await,
        Some(RecordStatus::Failed)
    );
    send(&svc, post(Some("k2"), PAY)).await;
    assert_eq!(record(&store, "default", "k2").await, None);
}

#[tokio::test]
async fn client_mistake_leaves_the_key_unused() {
    let store = MemoryStore::new();
    let rejecting = Handler::new(StatusCode::UNPROCESSABLE_ENTITY);
    let svc = layer(&store).layer(rejecting.service());
    let (status, _, _) = send(&svc, post(Some("k1"), PAY)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        record(&store, "default", "k1").await,
        None,
        "nothing written"
    );
    // The key is free for a corrected request with other parameters.
    let ok = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).layer(ok.service());
    let fixed = r#"{"order_id":"o-1","amount_cents":200}"#;
    assert_eq!(
        send(&svc, post(Some("k1"), fixed)).await.0,
        StatusCode::CREATED
    );
}

/// A handler that failed (an error from the inner service) may have performed its effect
/// first: on the default policy its record stays running, so a retry learns `outcome_unknown`
/// when the lease ends; on a route whose effect is safe to repeat it is failed, so a retry runs.
#[tokio::test]
async fn inner_error_leaves_the_record_running_unless_repeats_are_safe() {
    use crate::policy::{KEY_TTL_PAYMENTS, MethodPolicies, Takeover};
    let failing = || {
        service_fn(|_req: Request<In>| async {
            Err::<Response<Body>, _>(std::io::Error::other("connection reset"))
        })
    };
    let store = MemoryStore::new();
    let svc = layer(&store).layer(failing());
    assert!(svc.oneshot(post(Some("k1"), PAY)).await.is_err());
    assert_eq!(
        record(&store, "default", "k1").await,
        Some(RecordStatus::Running)
    );

    let rerun = MethodPolicy::builder("Keyed", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .takeover(Takeover::Rerun)
        .build();
    let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(Method::POST, "/v1/payments", rerun);
    let svc = IdempotencyLayer::new(store.clone())
        .policies(policies)
        .layer(failing());
    assert!(svc.oneshot(post(Some("k2"), PAY)).await.is_err());
    assert_eq!(
        record(&store, "default", "k2").await,
        Some(RecordStatus::Failed)
    );
}

#[tokio::test(start_paused = true)]
async fn dropped_request_leaves_its_record_running_on_a_route_that_refuses_a_repeat() {
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let svc = layer(&store).layer(service_fn(move |_req: Request<In>| {
        counted.fetch_add(1, Ordering::SeqCst);
        std::future::pending::<Result<Response<Body>, Infallible>>()
    }));
    let running = tokio::spawn(svc.clone().oneshot(post(Some("k1"), PAY)));
    while calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    running.abort();
    let _ = running.await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // The handler may have performed its effect: the key is neither failed nor freed.
    assert_eq!(
        record(&store, "default", "k1").await,
        Some(RecordStatus::Running)
    );
}

#[tokio::test(start_paused = true)]
async fn dropped_request_fails_its_record_so_a_retry_can_run_where_repeats_are_safe() {
    use crate::policy::{KEY_TTL_PAYMENTS, MethodPolicies, Takeover};
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let rerun = MethodPolicy::builder("Keyed", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .takeover(Takeover::Rerun)
        .build();
    let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(Method::POST, "/v1/payments", rerun);
    let svc = IdempotencyLayer::new(store.clone())
        .policies(policies)
        .layer(service_fn(move |_req: Request<In>| {
            counted.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<Response<Body>, Infallible>>()
        }));
    let running = tokio::spawn(svc.clone().oneshot(post(Some("k1"), PAY)));
    while calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        record(&store, "default", "k1").await,
        Some(RecordStatus::Running)
    );
    running.abort();
    let _ = running.await;
    // The guard's `fail` runs on a spawned task.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        record(&store, "default", "k1").await,
        Some(RecordStatus::Failed)
    );
}

#[tokio::test]
async fn records_are_scoped_by_tenant() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).layer(handler.service());
    let (_, _, acme) = send(&svc, for_tenant(post(Some("k1"), PAY), "acme")).await;
    // Another tenant with the same key: its own request, never acme's answer.
    let (status, headers, globex) = send(&svc, for_tenant(post(Some("k1"), PAY), "globex")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get(IDEMPOTENT_REPLAYED).is_none());
    assert_ne!(acme, globex);
    // ...nor a conflict with acme's parameters.
    let other = r#"{"order_id":"o-9","amount_cents":9}"#;
    let (status, _, _) = send(&svc, for_tenant(post(Some("k2"), other), "globex")).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _, _) = send(&svc, for_tenant(post(Some("k2"), PAY), "acme")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(handler.calls(), 4);
}

#[test]
fn claims_are_counted_by_result() {
    let ((), m) = with_metrics(|| async {
        let store = MemoryStore::new();
        let handler = Handler::new(StatusCode::CREATED);
        let svc = MetricsLayer::new("payments")
            .route(Method::POST, "/v1/payments")
            .layer(layer(&store).layer(handler.service()));
        let other = r#"{"order_id":"o-2","amount_cents":1}"#;
        for req in [
            post(Some("k1"), PAY),
            post(Some("k1"), PAY),
            post(Some("k1"), other),
        ] {
            svc.clone().oneshot(req).await.unwrap();
        }
    });
    for result in ["claimed", "replay", "conflict"] {
        assert_eq!(
            m.counter(
                IDEMPOTENCY_CLAIMS_TOTAL,
                &[("result", result), ("method", "POST /v1/payments")]
            ),
            1,
            "{result}"
        );
    }
}

#[tokio::test]
async fn two_idempotency_key_headers_are_400_never_first_wins() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).layer(handler.service());
    for (first, second) in [("k1", "k2"), ("k1", "k1")] {
        let mut req = post(Some(first), PAY);
        req.headers_mut()
            .append(IDEMPOTENCY_KEY, HeaderValue::from_static(second));
        let (status, _, bytes) = send(&svc, req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{first} + {second}");
        assert_eq!(problem_code(&bytes), "invalid_idempotency_key");
    }
    assert_eq!(handler.calls(), 0);
    assert!(store.is_empty(), "neither key was used");
}

#[tokio::test(start_paused = true)]
async fn expired_deadline_is_504_and_claims_nothing() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let svc = layer(&store).layer(handler.service());
    let mut req = post(Some("k1"), PAY);
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_micros(1)));
    tokio::time::advance(Duration::from_millis(1)).await;
    let (status, _, bytes) = send(&svc, req).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(problem_code(&bytes), "deadline_exceeded");
    assert_eq!(handler.calls(), 0);
    assert!(store.is_empty());
}

#[tokio::test(start_paused = true)]
async fn time_left_below_the_minimum_is_504_and_claims_nothing() {
    let store = MemoryStore::new();
    let handler = Handler::new(StatusCode::CREATED);
    let budget = |ms| {
        let mut req = post(Some("k1"), PAY);
        req.extensions_mut()
            .insert(Deadline::after(Duration::from_millis(ms)));
        req
    };
    // The default: 5 ms.
    let svc = layer(&store).layer(handler.service());
    let (status, _, bytes) = send(&svc, budget(4)).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(problem_code(&bytes), "deadline_exceeded");
    // Set, or asked at each request.
    let needed = Arc::new(AtomicUsize::new(30));
    let asked = needed.clone();
    for svc in [
        layer(&store)
            .min_time_left(Duration::from_millis(30))
            .layer(handler.service()),
        layer(&store)
            .min_time_left_with(move || Duration::from_millis(asked.load(Ordering::SeqCst) as u64))
            .layer(handler.service()),
    ] {
        let (status, _, _) = send(&svc, budget(29)).await;
        assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    }
    assert_eq!(handler.calls(), 0);
    assert!(store.is_empty());
    let (status, _, _) = send(&svc, budget(5)).await;
    assert_eq!(status, StatusCode::CREATED, "5 ms is enough by default");
    needed.store(10, Ordering::SeqCst);
    let svc = layer(&store)
        .min_time_left_with(move || Duration::from_millis(needed.load(Ordering::SeqCst) as u64))
        .layer(handler.service());
    let mut req = post(Some("k2"), PAY);
    req.extensions_mut()
        .insert(Deadline::after(Duration::from_millis(29)));
    let (status, _, _) = send(&svc, req).await;
    assert_eq!(status, StatusCode::CREATED, "the budget asked for changed");
}

#[tokio::test]
async fn an_answer_marked_nothing_done_releases_the_key_whatever_its_status() {
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let refusing = service_fn(move |_req: Request<In>| {
        let n = counted.fetch_add(1, Ordering::SeqCst);
        async move {
            let mut res = Response::new(Body::from("no budget for the downstream"));
            *res.status_mut() = StatusCode::GATEWAY_TIMEOUT;
            // Marked on the first call only: the second is the same answer unmarked.
            if n == 0 {
                res.extensions_mut().insert(NothingDone);
            }
            Ok::<_, Infallible>(res)
        }
    });
    let svc = layer(&store).layer(refusing);
    let (status, _, _) = send(&svc, post(Some("k1"), PAY)).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert!(store.is_empty(), "marked: released, nothing left");
    let (status, _, _) = send(&svc, post(Some("k1"), PAY)).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(
        record(&store, "default", "k1").await,
        Some(RecordStatus::Failed),
        "unmarked: a retryable failure, as before"
    );
}

#[tokio::test(start_paused = true)]
async fn a_resume_route_cut_before_any_phase_releases_its_key() {
    let store = MemoryStore::new();
    let policies = crate::policy::MethodPolicies::new(
        MethodPolicy::builder("other", Idempotency::Unsafe).build(),
    )
    .route(
        Method::POST,
        "/v1/payments",
        MethodPolicy::builder("Pay", Idempotency::Keyed)
            .key_ttl(crate::policy::KEY_TTL_PAYMENTS)
            .takeover(Takeover::Resume)
            .build(),
    );
    let hangs = service_fn(|_req: Request<In>| async {
        std::future::pending::<()>().await;
        Ok::<_, Infallible>(Response::new(Body::default()))
    });
    let svc = IdempotencyLayer::new(store.clone())
        .clock(ManualClock::new(1_000_000))
        .policies(policies)
        .layer(hangs);
    let cut = tokio::time::timeout(Duration::from_secs(1), svc.oneshot(post(Some("k1"), PAY)));
    assert!(cut.await.is_err(), "the handler hangs until it is cut");
    // The release runs on a spawned task.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(store.is_empty(), "no phase began: released, not failed");
}

/// A store whose claims are committed by a writer task of their own, as the SQLite and
/// PostgreSQL writers do: the caller only waits for the answer, and dropping the caller does not
/// stop the commit. Each claim waits for a permit of `commit` before it is written.
#[derive(Clone)]
struct WriterStore {
    inner: MemoryStore,
    commit: Arc<Semaphore>,
}

impl Store for WriterStore {
    type Writes<T: Send + 'static> = crate::idempotency::memory::MemoryWrites<T>;
    async fn commit_phase<T: Send + 'static>(
        &self,
        lease: &Lease,
        point: crate::idempotency::RecoveryPoint,
        writes: Self::Writes<T>,
    ) -> Result<T, crate::idempotency::StoreError> {
        self.inner.commit_phase(lease, point, writes).await
    }
    async fn finish(
        &self,
        lease: &Lease,
        ending: crate::idempotency::Ending,
        now_ms: i64,
        writes: Self::Writes<()>,
    ) -> Result<(), crate::idempotency::StoreError> {
        self.inner.finish(lease, ending, now_ms, writes).await
    }
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, crate::idempotency::StoreError> {
        let (inner, commit) = (self.inner.clone(), self.commit.clone());
        let writer = tokio::spawn(async move {
            commit.acquire().await.unwrap().forget();
            inner.claim(req).await
        });
        writer.await.unwrap()
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: StoredResponse,
        now_ms: i64,
    ) -> Result<(), crate::idempotency::StoreError> {
        self.inner.complete(lease, response, now_ms).await
    }

    async fn fail(&self, lease: &Lease, now_ms: i64) -> Result<(), crate::idempotency::StoreError> {
        self.inner.fail(lease, now_ms).await
    }

    async fn release(&self, lease: &Lease) -> Result<(), crate::idempotency::StoreError> {
        self.inner.release(lease).await
    }

    async fn get(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> Result<Option<crate::idempotency::Record>, crate::idempotency::StoreError> {
        self.inner.get(scope, key).await
    }

    async fn sweep(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> Result<usize, crate::idempotency::StoreError> {
        self.inner.sweep(now_ms, limit).await
    }
}

#[tokio::test(start_paused = true)]
async fn claim_committed_after_its_request_was_dropped_is_released() {
    let memory = MemoryStore::new();
    let store = WriterStore {
        inner: memory.clone(),
        commit: Arc::new(Semaphore::new(0)),
    };
    let handler = Handler::new(StatusCode::CREATED);
    let svc = IdempotencyLayer::new(store.clone())
        .clock(ManualClock::new(1_000_000))
        .policies(keyed(Method::POST, "/v1/payments"))
        .layer(handler.service());
    // The request is cut (deadline, disconnect) while its claim waits for the writer...
    let cut = tokio::spawn(svc.clone().oneshot(post(Some("k1"), PAY)));
    tokio::task::yield_now().await;
    cut.abort();
    let _ = cut.await;
    // ...which then commits it anyway.
    store.commit.add_permits(1);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(record(&memory, "default", "k1").await, None, "released");
    // The retry with the same key runs at once, rather than waiting out the lease.
    store.commit.add_permits(1);
    let res = svc.clone().oneshot(post(Some("k1"), PAY)).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(handler.calls(), 1);
}

/// intake → gate (`permits` in flight) → idempotency → a handler that waits for a permit of
/// `release` when the order id starts with `slow`, and answers 503 on the first call of an
/// order starting with `flaky`.
struct Stacked {
    store: MemoryStore,
    release: Arc<Semaphore>,
    calls: Arc<AtomicUsize>,
    /// Requests the intake handed to the gate.
    passes: Arc<AtomicUsize>,
}

impl Stacked {
    fn new() -> Self {
        Self {
            store: MemoryStore::new(),
            release: Arc::new(Semaphore::new(0)),
            calls: Arc::new(AtomicUsize::new(0)),
            passes: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn service(
        &self,
        permits: usize,
    ) -> impl Service<
        Request<Body>,
        Response = Response<ResponseBody<ResponseBody<ResponseBody<Body>>>>,
        Error = Infallible,
        Future: Send,
    > + Clone
    + Send
    + 'static {
        let idempotency = layer(&self.store);
        let (release, calls) = (self.release.clone(), self.calls.clone());
        let handler = service_fn(move |req: Request<RequestBody<In>>| {
            let (release, calls) = (release.clone(), calls.clone());
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let json = body(Response::new(req.into_body())).await;
                let order: serde_json::Value = serde_json::from_slice(&json).unwrap();
                let order = order["order_id"].as_str().unwrap().to_owned();
                if order.starts_with("slow") {
                    release.acquire().await.unwrap().forget();
                }
                let status = if order.starts_with("flaky") && n == 1 {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::CREATED
                };
                let mut res = Response::new(Body::from(format!("{{\"call\":{n}}}")));
                *res.status_mut() = status;
                Ok::<_, Infallible>(res)
            }
        });
        let passes = self.passes.clone();
        tower::ServiceBuilder::new()
            .layer(idempotency.intake())
            .map_request(move |req| {
                passes.fetch_add(1, Ordering::SeqCst);
                req
            })
            .layer(crate::server::GateLayer::new(crate::admission::Gate::new(
                permits,
                Duration::from_millis(1),
            )))
            .layer(idempotency)
            .service(handler)
    }

    async fn entered(&self, n: usize) {
        while self.calls.load(Ordering::SeqCst) < n {
            tokio::task::yield_now().await;
        }
    }
}

fn with_budget(mut req: Request<Body>, budget: Duration) -> Request<Body> {
    req.extensions_mut().insert(Deadline::after(budget));
    req
}

const SLOW: &str = r#"{"order_id":"slow-1","amount_cents":100}"#;

#[tokio::test(start_paused = true)]
async fn same_key_in_flight_waits_and_replays_the_first_answer() {
    let stacked = Stacked::new();
    let svc = stacked.service(4);
    let first = tokio::spawn(svc.clone().oneshot(post(Some("k1"), SLOW)));
    stacked.entered(1).await;
    let second = tokio::spawn(
        svc.clone()
            .oneshot(with_budget(post(Some("k1"), SLOW), Duration::from_secs(10))),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!second.is_finished(), "waits instead of 409");
    stacked.release.add_permits(1);
    let first = first.await.unwrap().unwrap();
    let (parts, second) = second.await.unwrap().unwrap().into_parts();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(parts.status, StatusCode::CREATED);
    assert_eq!(parts.headers[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(body(Response::new(second)).await, &b"{\"call\":1}"[..]);
    assert_eq!(stacked.calls.load(Ordering::SeqCst), 1, "run once");
}

#[tokio::test(start_paused = true)]
async fn waiter_is_answered_as_soon_as_the_attempt_settles_on_this_instance() {
    let stacked = Stacked::new();
    let svc = stacked.service(4);
    let first = tokio::spawn(svc.clone().oneshot(post(Some("k1"), SLOW)));
    stacked.entered(1).await;
    let waiter = tokio::spawn(svc.clone().oneshot(post(Some("k1"), SLOW)));
    // Long enough for the waiter's pauses between looks to have grown to their longest.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let settled_at = tokio::time::Instant::now();
    stacked.release.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
    let waiter = waiter.await.unwrap().unwrap();
    assert_eq!(waiter.headers()[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(
        settled_at.elapsed(),
        Duration::ZERO,
        "woken by the settling, not by its next look at the store"
    );
}

#[tokio::test(start_paused = true)]
async fn same_key_waits_out_a_failed_attempt_then_runs_itself() {
    let stacked = Stacked::new();
    let svc = stacked.service(4);
    let flaky = r#"{"order_id":"flaky-slow","amount_cents":100}"#;
    let first = tokio::spawn(svc.clone().oneshot(post(Some("k1"), flaky)));
    stacked.entered(1).await;
    let second = tokio::spawn(svc.clone().oneshot(post(Some("k1"), flaky)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    stacked.release.add_permits(2);
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    let second = second.await.unwrap().unwrap();
    assert_eq!(second.status(), StatusCode::CREATED);
    assert!(second.headers().get(IDEMPOTENT_REPLAYED).is_none());
    assert_eq!(stacked.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn waiter_is_409_in_progress_only_when_its_budget_ends_first() {
    let stacked = Stacked::new();
    let svc = stacked.service(4);
    let _first = tokio::spawn(svc.clone().oneshot(post(Some("k1"), SLOW)));
    stacked.entered(1).await;
    let started = tokio::time::Instant::now();
    let budget = Duration::from_millis(300);
    let res = svc
        .clone()
        .oneshot(with_budget(post(Some("k1"), SLOW), budget))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CONFLICT);
    assert!(res.headers().contains_key(header::RETRY_AFTER));
    let waited = started.elapsed();
    assert!(
        waited > budget / 2 && waited < budget,
        "waited {waited:?} of its {budget:?}"
    );
    assert_eq!(
        problem_code(&body(Response::new(res.into_body())).await),
        "request_in_progress"
    );
}

#[tokio::test(start_paused = true)]
async fn waiting_for_the_same_key_holds_no_gate_permit() {
    let stacked = Stacked::new();
    // Two permits: the running attempt holds one; the waiter must leave the other free.
    let svc = stacked.service(2);
    let first = tokio::spawn(svc.clone().oneshot(post(Some("k1"), SLOW)));
    stacked.entered(1).await;
    let waiter = tokio::spawn(svc.clone().oneshot(post(Some("k1"), SLOW)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let other = svc
        .clone()
        .oneshot(with_budget(post(Some("k2"), PAY), Duration::from_secs(1)))
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::CREATED, "a permit was free");
    stacked.release.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
    let waiter = waiter.await.unwrap().unwrap();
    assert_eq!(waiter.headers()[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(stacked.store.len(), 2, "one record per key, nothing else");
}

/// A waiter whose attempt succeeded is answered from the intake: it passes the gate once (to
/// learn the key is in progress), never a second time for the replay.
#[tokio::test(start_paused = true)]
async fn a_waiter_replays_without_passing_the_gate_again() {
    let stacked = Stacked::new();
    let svc = stacked.service(4);
    let passes = || stacked.passes.load(Ordering::SeqCst);
    let first = tokio::spawn(svc.clone().oneshot(post(Some("k1"), SLOW)));
    stacked.entered(1).await;
    let waiter = tokio::spawn(svc.clone().oneshot(post(Some("k1"), SLOW)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(passes(), 2, "the attempt and the waiter's first try");
    stacked.release.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
    let waiter = waiter.await.unwrap().unwrap();
    assert_eq!(waiter.headers()[IDEMPOTENT_REPLAYED], "true");
    assert_eq!(passes(), 2, "no pass for the replay");
}

// ---- gRPC ----

mod grpc {
    use super::*;
    use crate::server::idempotency::ResponseBody;
    use http::HeaderMap;
    use http_body_util::BodyExt;

    const CHARGE: &str = "/payment.v1.Payment/Charge";

    fn grpc_layer(store: &MemoryStore) -> IdempotencyLayer<MemoryStore> {
        IdempotencyLayer::new(store.clone())
            .clock(ManualClock::new(1_000_000))
            .policies(keyed(Method::POST, CHARGE))
            .max_message(64)
    }

    fn framed(message: &[u8]) -> Bytes {
        let mut out = vec![0];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        Bytes::from(out)
    }

    fn call(key: Option<&str>, body: Bytes) -> Request<Body> {
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(CHARGE)
            .header(header::CONTENT_TYPE, "application/grpc");
        if let Some(key) = key {
            builder = builder.header("idempotency-key", key);
        }
        builder.body(Body::new(body)).unwrap()
    }

    /// A gRPC handler: answers `grpc-status` `code`, with one message and the status in the
    /// trailers when `code` is 0, trailers-only otherwise. Counts its calls.
    fn handler(
        calls: Arc<AtomicUsize>,
        code: u8,
    ) -> impl Service<
        Request<In>,
        Response = Response<ResponseBody<Body>>,
        Error = Infallible,
        Future: Send,
    > + Clone
    + Send
    + 'static {
        service_fn(move |req: Request<In>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                let received = body(Response::new(req.into_body())).await;
                let mut res = if code == 0 {
                    let mut trailers = HeaderMap::new();
                    trailers.insert("grpc-status", "0".parse().unwrap());
                    trailers.insert("x-call", n.to_string().parse().unwrap());
                    let mut echo = received.to_vec();
                    echo.push(n as u8);
                    Response::new(ResponseBody::buffered(Bytes::from(echo), Some(trailers)))
                } else {
                    let mut res = Response::new(ResponseBody::default());
                    res.headers_mut()
                        .insert("grpc-status", code.to_string().parse().unwrap());
                    res
                };
                res.headers_mut()
                    .insert(header::CONTENT_TYPE, "application/grpc".parse().unwrap());
                Ok::<_, Infallible>(res)
            }
        })
    }

    struct Answer {
        headers: HeaderMap,
        body: Bytes,
        trailers: Option<HeaderMap>,
    }

    async fn send_grpc<S, B>(svc: &S, req: Request<Body>) -> Answer
    where
        S: Service<Request<Body>, Response = Response<B>, Error = Infallible> + Clone,
        B: http_body::Body<Data = Bytes>,
        B::Error: std::fmt::Debug,
    {
        let res = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "gRPC answers are HTTP 200");
        let (parts, b) = res.into_parts();
        let collected = b.collect().await.unwrap();
        Answer {
            headers: parts.headers,
            trailers: collected.trailers().cloned(),
            body: collected.to_bytes(),
        }
    }

    #[tokio::test]
    async fn ok_answer_is_stored_and_replayed_with_its_trailers() {
        let store = MemoryStore::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let svc = grpc_layer(&store).layer(handler(calls.clone(), 0));
        let first = send_grpc(&svc, call(Some("g1"), framed(b"pay"))).await;
        assert!(first.headers.get(IDEMPOTENT_REPLAYED).is_none());
        let trailers = first.trailers.clone().expect("trailers");
        assert_eq!(trailers["grpc-status"], "0");

        let again = send_grpc(&svc, call(Some("g1"), framed(b"pay"))).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1, "replayed, not run again");
        assert_eq!(again.headers[IDEMPOTENT_REPLAYED], "true");
        assert_eq!(again.headers[header::CONTENT_TYPE], "application/grpc");
        assert_eq!(again.body, first.body, "the message byte for byte");
        assert_eq!(
            again.trailers,
            Some(trailers),
            "grpc-status and all trailers"
        );
        assert_eq!(
            record(&store, "default", "g1").await,
            Some(RecordStatus::Succeeded)
        );
    }

    #[tokio::test]
    async fn refusals_are_trailers_only_grpc_statuses() {
        let store = MemoryStore::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let svc = grpc_layer(&store).layer(handler(calls.clone(), 0));
        let status = |a: &Answer| a.headers["grpc-status"].to_str().unwrap().to_owned();

        let missing = send_grpc(&svc, call(None, framed(b"pay"))).await;
        assert_eq!(status(&missing), "3");
        assert!(missing.body.is_empty() && missing.trailers.is_none());

        // A length prefix over the cap, with no message behind it: refused from the prefix.
        let bomb = Bytes::from_static(&[0, 0xFF, 0xFF, 0xFF, 0xFF]);
        let too_large = send_grpc(&svc, call(Some("g2"), bomb)).await;
        assert_eq!(status(&too_large), "8");
        let truncated = send_grpc(&svc, call(Some("g2"), Bytes::from_static(&[0, 0]))).await;
        assert_eq!(status(&truncated), "3");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        assert!(store.is_empty(), "nothing claimed");

        send_grpc(&svc, call(Some("g2"), framed(b"pay"))).await;
        let reused = send_grpc(&svc, call(Some("g2"), framed(b"other"))).await;
        assert_eq!(status(&reused), "9"); // FAILED_PRECONDITION
        let message = reused.headers["grpc-message"].to_str().unwrap();
        assert!(message.contains("fingerprint_prefix="), "{message}");
    }

    #[tokio::test]
    async fn two_idempotency_key_metadata_are_invalid_argument() {
        let store = MemoryStore::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let svc = grpc_layer(&store).layer(handler(calls.clone(), 0));
        let mut req = call(Some("g1"), framed(b"pay"));
        req.headers_mut()
            .append("idempotency-key", HeaderValue::from_static("g2"));
        let answer = send_grpc(&svc, req).await;
        assert_eq!(answer.headers["grpc-status"], "3");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn buffered_route_is_read_before_the_inner_service_within_the_cap() {
        const GET: &str = "/payment.v1.Payment/GetCharge";
        let store = MemoryStore::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let read = MethodPolicy::builder("GetCharge", Idempotency::Safe)
            .buffer_body(true)
            .build();
        let svc = grpc_layer(&store)
            .policies(keyed(Method::POST, CHARGE).route(Method::POST, GET, read))
            .intake()
            .layer(handler(calls.clone(), 0));
        let to_get = |body: Bytes| {
            let mut req = call(None, body);
            *req.uri_mut() = http::Uri::from_static(GET);
            req
        };
        let bomb = Bytes::from_static(&[0, 0xFF, 0xFF, 0xFF, 0xFF]);
        let refused = send_grpc(&svc, to_get(bomb)).await;
        assert_eq!(refused.headers["grpc-status"], "8");
        assert_eq!(calls.load(Ordering::SeqCst), 0, "refused from the prefix");
        let answered = send_grpc(&svc, to_get(framed(b"id"))).await;
        assert_eq!(answered.trailers.unwrap()["grpc-status"], "0");
        assert_eq!(
            answered.body,
            framed(b"id").iter().copied().chain([1]).collect::<Vec<_>>()
        );
        assert!(store.is_empty(), "no key, no record");
    }

    #[tokio::test]
    async fn error_codes_fail_or_release_the_record_like_http() {
        let store = MemoryStore::new();
        for (code, key, expected) in [
            (14, "unavailable", Some(RecordStatus::Failed)),
            (10, "aborted", Some(RecordStatus::Failed)),
            (3, "invalid", None),
            (6, "exists", None),
        ] {
            let calls = Arc::new(AtomicUsize::new(0));
            let svc = grpc_layer(&store).layer(handler(calls.clone(), code));
            let answer = send_grpc(&svc, call(Some(key), framed(b"pay"))).await;
            assert_eq!(answer.headers["grpc-status"], code.to_string().as_str());
            assert_eq!(record(&store, "default", key).await, expected, "{code}");
            // Never replayed: the same key runs again.
            send_grpc(&svc, call(Some(key), framed(b"pay"))).await;
            assert_eq!(calls.load(Ordering::SeqCst), 2, "{code}");
        }
    }
}

/// A retry dropped while its claim (a takeover of a run that may have performed its effect)
/// is in flight leaves that run's record as it found it, on the default policy: the next
/// retry learns `outcome_unknown`, and the handler never runs again.
#[tokio::test(start_paused = true)]
async fn a_dropped_takeover_leaves_an_abandoned_run_alone() {
    let memory = MemoryStore::new();
    let store = WriterStore {
        inner: memory.clone(),
        commit: Arc::new(Semaphore::new(0)),
    };
    let clock = ManualClock::new(1_000_000);
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let svc = IdempotencyLayer::new(store.clone())
        .clock(clock.clone())
        .policies(keyed(Method::POST, "/v1/payments"))
        .layer(service_fn(move |_req: Request<In>| {
            let n = c.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    // Applies its effect, then never answers.
                    std::future::pending::<()>().await;
                }
                Ok::<_, Infallible>(Response::new(Body::from("{}")))
            }
        }));
    store.commit.add_permits(1);
    let first = tokio::spawn(svc.clone().oneshot(post(Some("k1"), PAY)));
    while calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    clock.advance(Duration::from_secs(60));
    // A retry is cut while its claim (a takeover) waits for the writer...
    let cut = tokio::spawn(svc.clone().oneshot(post(Some("k1"), PAY)));
    tokio::task::yield_now().await;
    cut.abort();
    let _ = cut.await;
    store.commit.add_permits(1);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        record(&memory, "default", "k1").await,
        Some(RecordStatus::Running),
        "the dropped takeover neither released nor failed the record"
    );
    // Past the dropped takeover's own lease.
    clock.advance(Duration::from_secs(60));
    store.commit.add_permits(1);
    let res = svc.clone().oneshot(post(Some("k1"), PAY)).await.unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    first.abort();
}
