//! A user's two-hop service, written the natural way, against real servers on 127.0.0.1: a
//! gateway (axum, the server stack) whose handler calls a backend (axum, the server stack, a
//! keyed route) through the client stack with a plain `oneshot`.
//!
//! Each test is one promise the handler gets without writing code for it: the budget shrinks
//! (and never resets), a method's timeout caps it, work spawned off the handler keeps it, the
//! backend's own work does not eat the next call's budget, and failures come back as answers
//! the gateway's caller can act on (504, 503 + `Retry-After`, `circuit_open`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{MatchedPath, State};
use axum::response::Response;
use axum::routing::post;
use axum::{Extension, Json, Router};
use backstop::Deadline;
use backstop::client::breaker::{BreakerConfig, CircuitBreaker};
use backstop::client::{self, ClientStack, Destination, HttpService};
use backstop::deadline::{self, Margin};
use backstop::idempotency::{IdempotencyKey, MemoryStore};
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
use backstop::server::ServerStack;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::ServiceExt;

/// The budget each backend run was told, in order.
#[derive(Clone, Default)]
struct Told(Arc<Mutex<Vec<Duration>>>);

impl Told {
    fn all(&self) -> Vec<Duration> {
        self.0.lock().unwrap().clone()
    }
}

fn keyed_stack(name: &str) -> ServerStack<MemoryStore> {
    let keyed = MethodPolicy::builder(name, Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .build();
    ServerStack::new(name, MemoryStore::new())
        .policies(MethodPolicies::new(keyed).validated().unwrap())
        .matched_path_from(|ext| ext.get::<MatchedPath>().map(|m| m.as_str()))
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// A backend whose keyed `POST /v1/charges` records the budget it was given and works `work`.
async fn backend(work: Duration) -> (SocketAddr, Told) {
    let told = Told::default();
    let charge = move |State(told): State<Told>| async move {
        let budget = Deadline::current().map_or(Duration::MAX, |d| d.remaining());
        told.0.lock().unwrap().push(budget);
        tokio::time::sleep(work).await;
        (StatusCode::CREATED, Json(serde_json::json!({ "ok": true })))
    };
    let app = Router::new()
        .route("/v1/charges", post(charge))
        .route_layer(keyed_stack("backend").into_layer())
        .with_state(told.clone());
    (serve(app).await, told)
}

#[derive(Clone)]
struct Gateway {
    backend: HttpService,
    charges: String,
}

impl Gateway {
    fn new(backend: SocketAddr, destination: &Destination, policy: MethodPolicy) -> Self {
        Self {
            backend: ClientStack::builder(destination, policy)
                .build()
                .unwrap()
                .http(),
            charges: format!("http://{backend}/v1/charges"),
        }
    }

    fn charge(&self, key: &IdempotencyKey) -> Request<Full<Bytes>> {
        Request::post(&self.charges)
            .header("idempotency-key", key.as_str())
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    }
}

/// The handler as a user writes it: no deadline, no timeout, `?` on the client's error.
async fn checkout(
    State(gateway): State<Gateway>,
    Extension(key): Extension<IdempotencyKey>,
) -> Result<Response, client::Error> {
    let answer = gateway
        .backend
        .clone()
        .oneshot(gateway.charge(&key))
        .await?;
    Ok(answer.map(Body::new))
}

/// The same call made from a task the handler spawns, the deadline carried in one line.
async fn checkout_in_background(
    State(gateway): State<Gateway>,
    Extension(key): Extension<IdempotencyKey>,
) -> Result<Response, client::Error> {
    let request = gateway.charge(&key);
    let call = tokio::spawn(deadline::carry(gateway.backend.clone().oneshot(request)));
    let answer = call.await.expect("the call does not panic")?;
    Ok(answer.map(Body::new))
}

fn keyed_policy(timeout: Duration) -> MethodPolicy {
    MethodPolicy::builder("Charge", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .timeout(timeout)
        .build()
}

async fn gateway(state: Gateway) -> SocketAddr {
    let app = Router::new()
        .route("/v1/checkout", post(checkout))
        .route("/v1/checkout-in-background", post(checkout_in_background))
        .route_layer(keyed_stack("gateway").into_layer())
        .with_state(state);
    serve(app).await
}

/// What the gateway's caller got.
struct Answer {
    status: StatusCode,
    code: Option<String>,
    retry_after: Option<u64>,
    /// The answer says "do not retry" (`grpc-retry-pushback-ms: -1`).
    no_retry: bool,
}

async fn call(gateway: SocketAddr, path: &str, key: &str, budget: &str) -> Answer {
    call_as_attempt(gateway, path, key, budget, 1).await
}

/// [`call`] as the caller's `attempt`th attempt (`grpc-previous-rpc-attempts` on a retry).
async fn call_as_attempt(
    gateway: SocketAddr,
    path: &str,
    key: &str,
    budget: &str,
    attempt: u32,
) -> Answer {
    let caller = client::connect::pooled::<Full<Bytes>>(false);
    let mut request = Request::post(format!("http://{gateway}{path}"))
        .header("idempotency-key", key)
        .header("grpc-timeout", budget)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    if attempt > 1 {
        request.headers_mut().insert(
            "grpc-previous-rpc-attempts",
            (attempt - 1).to_string().parse().unwrap(),
        );
    }
    let response = caller.request(request).await.unwrap();
    let status = response.status();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let no_retry = response
        .headers()
        .get("grpc-retry-pushback-ms")
        .is_some_and(|v| v == "-1");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let code = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|doc| doc["code"].as_str().map(str::to_owned));
    Answer {
        status,
        code,
        retry_after,
        no_retry,
    }
}

/// The first finding: `grpc-timeout: 500m` at the gateway became a fresh 2 s at the
/// backend; `100m` gave a 504 at the gateway while the backend had been told 1.8 s.
#[tokio::test]
async fn the_natural_handler_forwards_what_is_left_of_the_deadline() {
    let (backend, told) = backend(Duration::from_millis(300)).await;
    let state = Gateway::new(
        backend,
        &Destination::new("b1"),
        keyed_policy(Duration::from_secs(2)),
    );
    let gateway = gateway(state).await;

    let ok = call(gateway, "/v1/checkout", "k-1", "500m").await;
    assert_eq!(ok.status, StatusCode::CREATED);
    let late = call(gateway, "/v1/checkout", "k-2", "100m").await;
    assert_eq!(late.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(late.code.as_deref(), Some("deadline_exceeded"));

    let told = told.all();
    assert!(told[0] < Duration::from_millis(500), "{told:?}");
    assert!(told[1] < Duration::from_millis(100), "{told:?}");
}

/// gRPC takes the minimum of the caller's deadline and the method's timeout: so does the stack.
#[tokio::test]
async fn the_methods_timeout_caps_an_inherited_deadline() {
    let (backend, told) = backend(Duration::ZERO).await;
    let state = Gateway::new(
        backend,
        &Destination::new("b2"),
        keyed_policy(Duration::from_millis(200)),
    );
    let gateway = gateway(state).await;
    let ok = call(gateway, "/v1/checkout", "k-1", "5S").await;
    assert_eq!(ok.status, StatusCode::CREATED);
    let told = told.all();
    assert!(told[0] <= Duration::from_millis(200), "{told:?}");
}

/// A task spawned off the handler does not inherit task-locals; `deadline::carry` takes the
/// deadline along in one line.
#[tokio::test]
async fn work_spawned_off_the_handler_keeps_the_deadline_it_carries() {
    let (backend, told) = backend(Duration::ZERO).await;
    let state = Gateway::new(
        backend,
        &Destination::new("b3"),
        keyed_policy(Duration::from_secs(10)),
    );
    let gateway = gateway(state).await;
    let ok = call(gateway, "/v1/checkout-in-background", "k-1", "400m").await;
    assert_eq!(ok.status, StatusCode::CREATED);
    let told = told.all();
    assert!(told[0] < Duration::from_millis(400), "{told:?}");
}

/// The second finding: one 300 ms answer grew the margin to its 250 ms cap, so a
/// 500 ms budget left the backend 249 ms and both hops answered 504. The margin now learns
/// the round trip only (the backend reports its own time in `Server-Timing`).
#[tokio::test]
async fn a_slow_backend_does_not_eat_the_next_calls_timeout() {
    let (backend, told) = backend(Duration::from_millis(300)).await;
    let destination = Destination::new("b4");
    let state = Gateway::new(backend, &destination, keyed_policy(Duration::from_secs(2)));
    let gateway = gateway(state).await;

    assert_eq!(
        call(gateway, "/v1/checkout", "k-1", "2S").await.status,
        StatusCode::CREATED
    );
    assert!(
        destination.margin().current() < Margin::DEFAULT_CEILING,
        "the margin learnt the backend's work: {:?}",
        destination.margin().current()
    );
    let tight = call(gateway, "/v1/checkout", "k-2", "500m").await;
    assert_eq!(tight.status, StatusCode::CREATED, "told {:?}", told.all());
}

/// The third finding: a dead backend must be a 503 with `Retry-After` (not a 500, not
/// a 503 the caller retries at once), and an open breaker must stop calls with `circuit_open`.
#[tokio::test]
async fn a_dead_backend_is_a_503_with_retry_after_then_an_open_circuit() {
    let gone = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let breaker = CircuitBreaker::new(BreakerConfig {
        min_requests: 4,
        open_for: Duration::from_secs(30),
        ..BreakerConfig::default()
    })
    .unwrap();
    let destination = Destination::new("gone").breaker(Some(breaker));
    let state = Gateway::new(gone, &destination, keyed_policy(Duration::from_secs(2)));
    let gateway = gateway(state).await;

    let first = call(gateway, "/v1/checkout", "k-0", "2S").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(first.code.as_deref(), Some("unavailable"));
    assert!(first.retry_after.is_some_and(|s| s >= 1));

    // Failures open the circuit: a later call is refused without being sent.
    let mut codes = Vec::new();
    for i in 1..=6 {
        let answer = call(gateway, "/v1/checkout", &format!("k-{i}"), "2S").await;
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        codes.push(answer.code.unwrap_or_default());
        if codes.last().is_some_and(|c| c == "circuit_open") {
            // Told when the breaker probes again, not "at once".
            assert!(answer.retry_after.is_some_and(|s| s >= 1));
            return;
        }
    }
    panic!("no call stopped with circuit_open: {codes:?}");
}

/// The stack takes the body the user has: here the gateway streams axum's own request body to
/// the backend, through an `HttpService<Body>` kept in the state.
#[tokio::test]
async fn the_stack_accepts_axums_body_as_it_is() {
    let (backend, told) = backend(Duration::ZERO).await;
    let policy = keyed_policy(Duration::from_secs(2));
    let stack = ClientStack::builder(&Destination::new("b5"), policy)
        .build()
        .unwrap();
    #[derive(Clone)]
    struct Relay {
        backend: HttpService<Body>,
        charges: String,
    }
    let relay = |State(relay): State<Relay>, request: Request<Body>| async move {
        let (parts, body) = request.into_parts();
        let mut forward = Request::post(&relay.charges).body(body).unwrap();
        if let Some(key) = parts.headers.get("idempotency-key") {
            forward.headers_mut().insert("idempotency-key", key.clone());
        }
        let answer = relay.backend.oneshot(forward).await?;
        Ok::<_, client::Error>(answer.map(Body::new))
    };
    let app = Router::new()
        .route("/v1/checkout", post(relay))
        .with_state(Relay {
            backend: stack.http(),
            charges: format!("http://{backend}/v1/charges"),
        });
    let gateway = serve(app).await;
    let ok = call(gateway, "/v1/checkout", "k-1", "1S").await;
    assert_eq!(ok.status, StatusCode::CREATED);
    // Even outside the server stack's deadline layer, the stack sent a budget: its method's.
    assert!(told.all()[0] <= Duration::from_secs(2));
}

/// Retry at one layer: the gateway's call to a failing backend is retried when the gateway's
/// request is a first attempt, and sent once when it arrived as a retry (the caller retries;
/// three hops retrying each would multiply), unless the destination keeps its own retries.
#[tokio::test]
async fn a_request_that_arrived_as_a_retry_is_served_without_retrying_below() {
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = sent.clone();
    let failing = Router::new().route(
        "/v1/charges",
        post(move || {
            let count = count.clone();
            async move {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                StatusCode::SERVICE_UNAVAILABLE
            }
        }),
    );
    let backend = serve(failing).await;
    let sent_now = || sent.load(std::sync::atomic::Ordering::SeqCst);
    let policy = keyed_policy(Duration::from_secs(5));
    let gateway_one_layer = gateway(Gateway::new(
        backend,
        &Destination::new("backend"),
        policy.clone(),
    ))
    .await;

    let first = call_as_attempt(gateway_one_layer, "/v1/checkout", "k-first", "5S", 1).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(sent_now(), 3, "a first attempt is retried below");
    assert!(
        first.no_retry,
        "retried here: the caller is told not to retry too"
    );

    let retry = call_as_attempt(gateway_one_layer, "/v1/checkout", "k-retry", "5S", 2).await;
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(sent_now(), 4, "a retry is sent on once");
    assert!(
        !retry.no_retry,
        "sent once: the caller's retries are the ones that count"
    );

    let own = Destination::new("backend-own").retry_at_one_layer(false);
    let gateway_own = gateway(Gateway::new(backend, &own, policy)).await;
    call_as_attempt(gateway_own, "/v1/checkout", "k-own", "5S", 2).await;
    assert_eq!(
        sent_now(),
        7,
        "a destination that keeps its retries retries anyway"
    );
}
