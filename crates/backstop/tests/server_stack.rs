//! The server stack on a real axum app over loopback, driven by an HTTP client.
//!
//! Each test starts its own server on 127.0.0.1:0. Handlers that must stay busy wait on a
//! semaphore the test controls; nothing here depends on how fast the machine is except the
//! deadline test, which only needs a request to outlive a 100 ms budget while its handler waits
//! on a semaphore that is not released before then.

use std::collections::HashMap;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use backstop::admission::{Gate, KeyedTokenBucket, Quota};
use backstop::idempotency::{Fingerprint, IdempotencyKey, MemoryStore, RecordStatus, Store};
use backstop::server::{ServerStack, Tenant};
use backstop::status::{Code, Status};
use http::Method;
use serde_json::{Value, json};
use support::policies::keyed;
use tokio::sync::{Notify, Semaphore};

/// What the handler does, chosen by the request's `order_id`:
/// `slow-*` waits for a permit from `release`; `flaky-*` answers 503 on its first call;
/// `amount_cents <= 0` is a client mistake (422); anything else is 201.
#[derive(Clone)]
struct App {
    calls: Arc<Mutex<HashMap<String, usize>>>,
    release: Arc<Semaphore>,
    entered: Arc<Notify>,
}

impl Default for App {
    fn default() -> Self {
        Self {
            calls: Arc::default(),
            release: Arc::new(Semaphore::new(0)),
            entered: Arc::default(),
        }
    }
}

impl App {
    fn calls(&self, order: &str) -> usize {
        self.calls.lock().unwrap().get(order).copied().unwrap_or(0)
    }
}

async fn pay(
    State(app): State<App>,
    Extension(key): Extension<IdempotencyKey>,
    Extension(tenant): Extension<Tenant>,
    Json(req): Json<Value>,
) -> Response {
    let order = req["order_id"].as_str().unwrap_or_default().to_owned();
    let n = {
        let mut calls = app.calls.lock().unwrap();
        let n = calls.entry(order.clone()).or_default();
        *n += 1;
        *n
    };
    app.entered.notify_one();
    if order.starts_with("slow") {
        app.release.acquire().await.unwrap().forget();
    }
    if order.starts_with("flaky") && n == 1 {
        return (StatusCode::SERVICE_UNAVAILABLE, "PSP unavailable").into_response();
    }
    if req["amount_cents"].as_i64().unwrap_or(0) <= 0 {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            "amount_cents must be positive",
        )
            .into_response();
    }
    let body = json!({
        "id": format!("pi_{order}_{n}"),
        "merchant": tenant.as_str(),
        "request_key": key.as_str(),
        "amount_cents": req["amount_cents"],
    });
    let mut res = (StatusCode::CREATED, Json(body)).into_response();
    res.headers_mut().insert(
        "location",
        format!("/v1/payments/pi_{order}_{n}").parse().unwrap(),
    );
    res
}

/// Bearer keys of the two test merchants.
fn authenticate(head: &http::request::Parts) -> Result<Tenant, Status> {
    match head.headers.get("authorization").map(|v| v.as_bytes()) {
        Some(b"Bearer key-acme") => Ok(Tenant::new("acme")),
        Some(b"Bearer key-globex") => Ok(Tenant::new("globex")),
        _ => Err(Status::new(Code::Unauthenticated, "unknown API key")),
    }
}

struct Server {
    base: String,
    app: App,
    store: MemoryStore,
    http: reqwest::Client,
}

fn stack(store: &MemoryStore) -> ServerStack<MemoryStore> {
    ServerStack::new("payments", store.clone())
        .policies(keyed(&[(Method::POST, "/v1/payments")]))
        .authenticate(authenticate)
}

async fn start(stack: ServerStack<MemoryStore>, store: MemoryStore) -> Server {
    let app = App::default();
    let router = Router::new()
        .route("/v1/payments", post(pay))
        .layer(stack.into_layer())
        .with_state(app.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    Server {
        base: format!("http://{addr}"),
        app,
        store,
        http: reqwest::Client::new(),
    }
}

async fn server() -> Server {
    let store = MemoryStore::new();
    start(stack(&store), store).await
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: bytes::Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }

    fn retry_after(&self) -> u64 {
        self.headers["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    }
}

impl Server {
    fn pay(&self, merchant: &str, key: Option<&str>, body: &Value) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .post(format!("{}/v1/payments", self.base))
            .bearer_auth(format!("key-{merchant}"))
            .json(body);
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Answer {
        let res = req.send().await.unwrap();
        Answer {
            status: res.status(),
            headers: res.headers().clone(),
            body: res.bytes().await.unwrap(),
        }
    }

    async fn record(&self, merchant: &str, key: &str) -> Option<RecordStatus> {
        let key = IdempotencyKey::parse(key).unwrap();
        self.store
            .get(merchant, &key)
            .await
            .unwrap()
            .map(|r| r.status)
    }
}

fn order(id: &str, amount: i64) -> Value {
    json!({ "order_id": id, "amount_cents": amount })
}

#[tokio::test]
async fn replay_is_byte_for_byte_with_the_replayed_header() {
    let s = server().await;
    let first = s.send(s.pay("acme", Some("k-1"), &order("o1", 100))).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.headers.get("idempotent-replayed").is_none());

    let again = s.send(s.pay("acme", Some("k-1"), &order("o1", 100))).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.body, first.body, "byte for byte");
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(again.headers["content-type"], first.headers["content-type"]);
    assert_eq!(again.headers["location"], first.headers["location"]);
    assert_eq!(s.app.calls("o1"), 1, "the handler ran once");
}

#[tokio::test]
async fn quoted_structured_field_key_is_the_same_key() {
    let s = server().await;
    let first = s.send(s.pay("acme", Some("k-sf"), &order("o1", 100))).await;
    let again = s
        .send(s.pay("acme", Some("\"k-sf\""), &order("o1", 100)))
        .await;
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(again.body, first.body);
}

/// The same key with other parameters must not be answered with the first request's result as
/// if it were the second's.
#[tokio::test]
async fn same_key_with_other_parameters_is_refused_409_never_replayed() {
    let s = server().await;
    let first = order("o1", 100);
    s.send(s.pay("acme", Some("k-1"), &first)).await;
    let changed = s.send(s.pay("acme", Some("k-1"), &order("o1", 1000))).await;
    assert_eq!(changed.status, StatusCode::CONFLICT);
    assert_eq!(changed.headers["content-type"], "application/problem+json");
    assert_eq!(changed.code(), "idempotency_key_reused");
    let original =
        Fingerprint::of_json("POST /v1/payments", &serde_json::to_vec(&first).unwrap()).unwrap();
    assert_eq!(changed.json()["fingerprint_prefix"], original.prefix8());
    assert!(changed.headers.get("idempotent-replayed").is_none());
    assert_eq!(s.app.calls("o1"), 1);
}

#[tokio::test]
async fn concurrent_retry_whose_budget_ends_first_gets_in_progress_with_retry_after() {
    let s = server().await;
    let first = tokio::spawn(s.pay("acme", Some("k-slow"), &order("slow-1", 100)).send());
    s.app.entered.notified().await;

    // The retry waits for the first attempt's answer, but no longer than its own budget.
    let retry = s
        .send(
            s.pay("acme", Some("k-slow"), &order("slow-1", 100))
                .header("grpc-timeout", "200m"),
        )
        .await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.code(), "request_in_progress");
    assert!(retry.retry_after() >= 1);

    s.app.release.add_permits(1);
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(s.app.calls("slow-1"), 1);
}

#[tokio::test]
async fn retryable_failure_lets_the_same_key_run_again() {
    let s = server().await;
    let failed = s
        .send(s.pay("acme", Some("k-f"), &order("flaky-1", 100)))
        .await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(s.record("acme", "k-f").await, Some(RecordStatus::Failed));

    let retried = s
        .send(s.pay("acme", Some("k-f"), &order("flaky-1", 100)))
        .await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert!(retried.headers.get("idempotent-replayed").is_none());
    assert_eq!(s.app.calls("flaky-1"), 2);
    let replay = s
        .send(s.pay("acme", Some("k-f"), &order("flaky-1", 100)))
        .await;
    assert_eq!(replay.body, retried.body);
}

#[tokio::test]
async fn client_mistake_leaves_the_key_unused() {
    let s = server().await;
    let bad = s.send(s.pay("acme", Some("k-4xx"), &order("o4", -5))).await;
    assert_eq!(bad.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(s.record("acme", "k-4xx").await, None, "nothing written");
    // The corrected request (other parameters) may use the same key.
    let fixed = s.send(s.pay("acme", Some("k-4xx"), &order("o4", 5))).await;
    assert_eq!(fixed.status, StatusCode::CREATED);
}

#[tokio::test]
async fn bad_input_is_refused_and_writes_nothing() {
    let s = server().await;
    let missing = s.send(s.pay("acme", None, &order("o1", 1))).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.code(), "missing_idempotency_key");

    let long = "k".repeat(256);
    let invalid = s.send(s.pay("acme", Some(&long), &order("o1", 1))).await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST);
    assert_eq!(invalid.code(), "invalid_idempotency_key");

    let not_json = s
        .send(
            s.http
                .post(format!("{}/v1/payments", s.base))
                .bearer_auth("key-acme")
                .header("idempotency-key", "k-nj")
                .body("order_id=o1"),
        )
        .await;
    assert_eq!(not_json.status, StatusCode::BAD_REQUEST);
    assert_eq!(not_json.code(), "invalid_body");

    let huge = json!({ "order_id": "o1", "pad": "x".repeat(2 * 1024 * 1024) });
    let too_large = s.send(s.pay("acme", Some("k-big"), &huge)).await;
    assert_eq!(too_large.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(too_large.code(), "body_too_large");

    let anonymous = s
        .send(
            s.http
                .post(format!("{}/v1/payments", s.base))
                .header("idempotency-key", "k-anon")
                .json(&order("o1", 1)),
        )
        .await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);

    assert!(s.store.is_empty());
    assert_eq!(s.app.calls("o1"), 0);
}

#[tokio::test]
async fn grpc_timeout_malformed_is_400_and_expired_is_504() {
    let s = server().await;
    for bad in ["123456789m", "10", "fast", "0S"] {
        let res = s
            .send(
                s.pay("acme", Some("k-t"), &order("slow-t", 1))
                    .header("grpc-timeout", bad),
            )
            .await;
        assert_eq!(res.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(res.code(), "invalid_grpc_timeout", "{bad}");
    }
    assert_eq!(
        s.record("acme", "k-t").await,
        None,
        "refused before it started"
    );

    // The handler waits for a permit that is not given before the deadline: it is cut.
    let late = s
        .send(
            s.pay("acme", Some("k-t"), &order("slow-t", 1))
                .header("grpc-timeout", "100m"),
        )
        .await;
    assert_eq!(late.status, StatusCode::GATEWAY_TIMEOUT, "never 408 or 499");
    assert_eq!(late.code(), "deadline_exceeded");
    // The cut attempt may have performed its effect: on a route that refuses to repeat one
    // (the default takeover), its record stays running until its lease ends, and a retry
    // before that is told the key is in progress, by its own deadline; nothing runs again.
    // (On a `Rerun` route the cut fails the record and a retry runs at once: the library's
    // `deadline_cut_on_a_rerun_route_fails_the_record_so_the_retry_runs`.)
    assert_eq!(s.record("acme", "k-t").await, Some(RecordStatus::Running));
    let retried = s
        .send(
            s.pay("acme", Some("k-t"), &order("slow-t", 1))
                .header("grpc-timeout", "300m"),
        )
        .await;
    assert_eq!(retried.status, StatusCode::CONFLICT);
    assert_eq!(retried.code(), "request_in_progress");
    assert_eq!(s.app.calls("slow-t"), 1);
}

#[tokio::test]
async fn tenant_over_quota_gets_429_with_retry_after_and_key_unused() {
    let store = MemoryStore::new();
    let quota = Quota::per_second(NonZeroU32::new(1).unwrap(), NonZeroU32::new(2).unwrap());
    let buckets = KeyedTokenBucket::new(quota, NonZeroUsize::new(100).unwrap());
    let s = start(stack(&store).tenant_buckets(buckets), store).await;
    for (i, key) in ["q1", "q2"].iter().enumerate() {
        let ok = s
            .send(s.pay("acme", Some(key), &order(&format!("q{i}"), 1)))
            .await;
        assert_eq!(ok.status, StatusCode::CREATED);
    }
    let limited = s.send(s.pay("acme", Some("q3"), &order("q3", 1))).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(limited.code(), "rate_limited");
    assert!(limited.retry_after() >= 1, "never Retry-After: 0");
    assert_eq!(limited.json()["retry_after"], limited.retry_after());
    assert_eq!(
        s.record("acme", "q3").await,
        None,
        "refused before it started"
    );
    // Another merchant has its own bucket.
    let other = s.send(s.pay("globex", Some("q3"), &order("q3", 1))).await;
    assert_eq!(other.status, StatusCode::CREATED);
}

/// Overload must be answered with 503 (own capacity) or 429 (tenant quota) plus Retry-After,
/// never with 500.
#[tokio::test]
async fn overload_is_answered_503_with_retry_after_never_500() {
    let store = MemoryStore::new();
    let s = start(
        stack(&store).gate(Gate::new(1, Duration::from_millis(50))),
        store,
    )
    .await;
    let busy = tokio::spawn(s.pay("acme", Some("k-busy"), &order("slow-o", 1)).send());
    s.app.entered.notified().await;

    // A budget below the minimal service time cannot wait for the slot: refused at once.
    let refused = s
        .send(
            s.pay("acme", Some("k-over"), &order("o-over", 1))
                .header("grpc-timeout", "20m"),
        )
        .await;
    assert_ne!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.code(), "overloaded");
    assert!(refused.retry_after() >= 1);
    assert_eq!(s.record("acme", "k-over").await, None, "key unused");
    assert_eq!(s.app.calls("o-over"), 0);

    s.app.release.add_permits(1);
    assert_eq!(busy.await.unwrap().unwrap().status(), StatusCode::CREATED);
    // With the slot free, the refused request's retry runs normally under the same key.
    let retried = s
        .send(s.pay("acme", Some("k-over"), &order("o-over", 1)))
        .await;
    assert_eq!(retried.status, StatusCode::CREATED);
}

#[tokio::test]
async fn one_merchants_key_never_replays_anothers_response() {
    let s = server().await;
    let acme = s
        .send(s.pay("acme", Some("shared"), &order("o1", 100)))
        .await;
    let globex = s
        .send(s.pay("globex", Some("shared"), &order("o1", 100)))
        .await;
    assert_eq!(globex.status, StatusCode::CREATED);
    assert!(globex.headers.get("idempotent-replayed").is_none());
    assert_ne!(acme.body, globex.body);
    assert_eq!(globex.json()["merchant"], "globex");
    // Other parameters under globex do not conflict with acme's record either.
    let other = s
        .send(s.pay("globex", Some("shared-2"), &order("o9", 9)))
        .await;
    assert_eq!(other.status, StatusCode::CREATED);
    let acme_again = s
        .send(s.pay("acme", Some("shared"), &order("o1", 100)))
        .await;
    assert_eq!(acme_again.body, acme.body);
    assert_eq!(acme_again.json()["merchant"], "acme");
}

mod support {
    pub(crate) mod policies;
}

static ROUTE_MATCHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts how often the stack asks for the route the router matched.
fn counted_route(_: &http::Extensions) -> Option<&str> {
    ROUTE_MATCHES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    None
}

/// The request's policy is selected once, by the stack's first layer, and read by the others
/// (the rate limit, the intake, the idempotency layer): one route match per request, keyed or
/// replayed.
#[tokio::test]
async fn the_policy_is_looked_up_once_per_request() {
    let store = MemoryStore::new();
    let s = start(stack(&store).matched_path_from(counted_route), store).await;
    let matches = || ROUTE_MATCHES.load(std::sync::atomic::Ordering::SeqCst);
    let first = s
        .send(s.pay("acme", Some("k-once"), &order("o-once", 100)))
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(matches(), 1, "one lookup for a keyed request");
    let again = s
        .send(s.pay("acme", Some("k-once"), &order("o-once", 100)))
        .await;
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(matches(), 2, "one lookup for its replay");
}
