//! Idempotency claims at the edges, over real connections on 127.0.0.1 and real stores
//! (memory, SQLite, PostgreSQL): requests cut by tiny budgets or by the client going away leave
//! their key free; a deadline is a deadline, not a store failure; a second request with a key in
//! progress waits for the first's answer; a merchant's stalled bodies hold no capacity another
//! merchant needs, over HTTP/1.1 and HTTP/2.
//!
//! No assertion depends on how fast the machine is: each checks what answers and records
//! exist, whatever the interleaving.

use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use backstop::admission::{Gate, KeyedTokenBucket, Quota};
use backstop::idempotency::{IdempotencyKey, MemoryStore, Store};
use backstop::server::{ServerStack, Tenant};
use backstop::status::{Code, Status};
use bytes::Bytes;
use http::Method;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use serde_json::{Value, json};
use support::policies::{buffered, keyed};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};

/// Orders starting with `slow` wait for a permit of `release`; every call is counted.
#[derive(Clone)]
struct App {
    calls: Arc<AtomicUsize>,
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

async fn pay(State(app): State<App>, Json(req): Json<Value>) -> Response {
    let n = app.calls.fetch_add(1, Ordering::SeqCst) + 1;
    app.entered.notify_one();
    let order = req["order_id"].as_str().unwrap_or_default();
    if order.starts_with("slow") {
        app.release.acquire().await.unwrap().forget();
    }
    (
        StatusCode::CREATED,
        Json(json!({ "order": order, "call": n })),
    )
        .into_response()
}

/// A route that is not keyed: echoes its JSON body.
async fn lookup(State(app): State<App>, Json(req): Json<Value>) -> Response {
    app.calls.fetch_add(1, Ordering::SeqCst);
    Json(req).into_response()
}

fn authenticate(head: &http::request::Parts) -> Result<Tenant, Status> {
    match head.headers.get("authorization").map(|v| v.as_bytes()) {
        Some(b"Bearer key-a") => Ok(Tenant::new("merchant-a")),
        Some(b"Bearer key-b") => Ok(Tenant::new("merchant-b")),
        _ => Err(Status::new(Code::Unauthenticated, "unknown API key")),
    }
}

struct Server {
    addr: std::net::SocketAddr,
    base: String,
    app: App,
    http: reqwest::Client,
}

/// The server stack over `store` with `max_inflight` places, served over HTTP/1.1 and h2c
/// (prior knowledge) on 127.0.0.1:0.
async fn start<St: Store>(store: St, max_inflight: usize) -> Server {
    let app = App::default();
    let stack = ServerStack::new("payments", store)
        .policies(keyed(&[(Method::POST, "/v1/payments")]).route(
            Method::POST,
            "/v1/lookup",
            buffered("Lookup"),
        ))
        .authenticate(authenticate)
        // Quotas are not under test: hundreds of requests a second per merchant.
        .tenant_buckets(KeyedTokenBucket::new(
            Quota::per_second(
                NonZeroU32::new(100_000).unwrap(),
                NonZeroU32::new(100_000).unwrap(),
            ),
            NonZeroUsize::new(16).unwrap(),
        ))
        .gate(Gate::new(max_inflight, Duration::from_millis(5)));
    let router = Router::new()
        .route("/v1/payments", post(pay))
        .route("/v1/lookup", post(lookup))
        .layer(stack.into_layer())
        .with_state(app.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                continue;
            };
            let service = TowerToHyperService::new(router.clone());
            tokio::spawn(async move {
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    Server {
        addr,
        base: format!("http://{addr}"),
        app,
        http: reqwest::Client::new(),
    }
}

fn order(id: &str) -> String {
    json!({ "order_id": id, "amount_cents": 100 }).to_string()
}

impl Server {
    /// Merchant B's payment with `key`, and `grpc-timeout` when given.
    async fn pay(&self, key: &str, body: &str, budget: Option<&str>) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}/v1/payments", self.base))
            .header("authorization", "Bearer key-b")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(budget) = budget {
            req = req.header("grpc-timeout", budget);
        }
        req.send().await.unwrap()
    }
}

async fn problem_code(res: reqwest::Response) -> String {
    let body: Value = res.json().await.unwrap();
    body["code"].as_str().unwrap_or_default().to_owned()
}

/// 200 requests with a 1 µs or 1 ms budget, each followed at once by the same key with a normal
/// budget: the second is always 201, never `request_in_progress` for a key that a request cut
/// mid-claim left behind.
async fn tiny_timeouts_leave_the_key_free<St: Store>(store: St) {
    let server = start(store, 64).await;
    for i in 0..200 {
        let key = format!("tiny-{i}");
        let body = order(&format!("o-{i}"));
        let budget = if i % 2 == 0 { "1u" } else { "1m" };
        let cut = server.pay(&key, &body, Some(budget)).await;
        let status = cut.status();
        assert!(
            status == StatusCode::GATEWAY_TIMEOUT || status == StatusCode::CREATED,
            "{key} with {budget}: {status}"
        );
        if status == StatusCode::GATEWAY_TIMEOUT {
            assert_eq!(problem_code(cut).await, "deadline_exceeded", "{key}");
        }
        let again = server.pay(&key, &body, None).await;
        assert_eq!(again.status(), StatusCode::CREATED, "{key} after {budget}");
    }
}

/// Requests whose client goes away right after sending them, each followed by the same key:
/// always 201.
async fn disconnects_leave_the_key_free<St: Store>(store: St) {
    let server = start(store, 64).await;
    for i in 0..50 {
        let key = format!("gone-{i}");
        let body = order(&format!("o-{i}"));
        let mut socket = TcpStream::connect(server.addr).await.unwrap();
        let request = format!(
            "POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-b\r\n\
             idempotency-key: {key}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(request.as_bytes()).await.unwrap();
        drop(socket);
        let again = server.pay(&key, &body, None).await;
        assert_eq!(again.status(), StatusCode::CREATED, "{key}");
    }
}

/// Two concurrent requests with one key: the second waits for the first and gets its answer
/// replayed, the handler runs once.
async fn same_key_in_flight_is_replayed(first: &Server, second: &Server) {
    let body = order("slow-1");
    let running = {
        let (http, base) = (first.http.clone(), first.base.clone());
        let body = body.clone();
        tokio::spawn(async move {
            http.post(format!("{base}/v1/payments"))
                .header("authorization", "Bearer key-b")
                .header("idempotency-key", "k-same")
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
        })
    };
    first.app.entered.notified().await;
    let waiting = {
        let (http, base) = (second.http.clone(), second.base.clone());
        let body = body.clone();
        tokio::spawn(async move {
            http.post(format!("{base}/v1/payments"))
                .header("authorization", "Bearer key-b")
                .header("idempotency-key", "k-same")
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
        })
    };
    // Whether the second arrives before or after this, its answer must be the replay.
    tokio::time::sleep(Duration::from_millis(50)).await;
    first.app.release.add_permits(1);
    let running = running.await.unwrap();
    assert_eq!(running.status(), StatusCode::CREATED);
    let original = running.bytes().await.unwrap();
    let waiting = waiting.await.unwrap();
    assert_eq!(waiting.status(), StatusCode::CREATED, "replayed, not 409");
    assert_eq!(waiting.headers()["idempotent-replayed"], "true");
    assert_eq!(waiting.bytes().await.unwrap(), original);
    let mut calls = first.app.calls.load(Ordering::SeqCst);
    if !std::ptr::eq(first, second) {
        calls += second.app.calls.load(Ordering::SeqCst);
    }
    assert_eq!(calls, 1, "the handler ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_tiny_timeouts_leave_the_key_free() {
    tiny_timeouts_leave_the_key_free(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_disconnects_leave_the_key_free() {
    disconnects_leave_the_key_free(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_in_flight_waits_and_is_replayed_not_409() {
    let server = start(MemoryStore::new(), 64).await;
    same_key_in_flight_is_replayed(&server, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_in_flight_is_409_when_the_budget_ends_first() {
    let store = MemoryStore::new();
    let server = start(store.clone(), 64).await;
    let body = order("slow-2");
    let running = {
        let (http, base, body) = (server.http.clone(), server.base.clone(), body.clone());
        tokio::spawn(async move {
            http.post(format!("{base}/v1/payments"))
                .header("authorization", "Bearer key-b")
                .header("idempotency-key", "k-held")
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
        })
    };
    server.app.entered.notified().await;
    let refused = server.pay("k-held", &body, Some("300m")).await;
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    assert!(refused.headers().contains_key("retry-after"));
    assert_eq!(problem_code(refused).await, "request_in_progress");
    server.app.release.add_permits(1);
    assert_eq!(running.await.unwrap().status(), StatusCode::CREATED);
    let record = store
        .get("merchant-b", &IdempotencyKey::new("k-held").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        record.status,
        backstop::idempotency::RecordStatus::Succeeded
    );
}

/// Merchant A opens more stalled requests (headers sent, body never finished, a 60 s budget)
/// than the server has places; merchant B's payment must still get one. Its 20 s budget ends
/// long before A's requests do: a place freed by one of them cannot serve it.
async fn stalled_bodies_leave_room_for_others(server: &Server) {
    let paid = server.pay("b-1", &order("b-order-1"), Some("20S")).await;
    assert_eq!(paid.status(), StatusCode::CREATED, "merchant B is served");
    assert_eq!(server.app.calls.load(Ordering::SeqCst), 1, "A never ran");
}

const MAX_INFLIGHT: usize = 4;
const STALLED: usize = 3 * MAX_INFLIGHT;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_http1_bodies_hold_no_gate_permit() {
    let server = start(MemoryStore::new(), MAX_INFLIGHT).await;
    let mut held = Vec::new();
    for i in 0..STALLED {
        let mut socket = TcpStream::connect(server.addr).await.unwrap();
        let head = format!(
            "POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-a\r\n\
             idempotency-key: a-{i}\r\ncontent-type: application/json\r\n\
             grpc-timeout: 60S\r\ncontent-length: 100\r\n\r\n{{\"order_id\":"
        );
        socket.write_all(head.as_bytes()).await.unwrap();
        held.push(socket);
    }
    stalled_bodies_leave_room_for_others(&server).await;
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_on_a_buffered_route_hold_no_gate_permit() {
    let server = start(MemoryStore::new(), MAX_INFLIGHT).await;
    let mut held = Vec::new();
    for _ in 0..STALLED {
        let mut socket = TcpStream::connect(server.addr).await.unwrap();
        let head = "POST /v1/lookup HTTP/1.1\r\nhost: x\r\nauthorization: Bearer key-a\r\n\
                    content-type: application/json\r\ngrpc-timeout: 60S\r\n\
                    content-length: 100\r\n\r\n{\"id\":";
        socket.write_all(head.as_bytes()).await.unwrap();
        held.push(socket);
    }
    stalled_bodies_leave_room_for_others(&server).await;
    let looked_up = server
        .http
        .post(format!("{}/v1/lookup", server.base))
        .header("authorization", "Bearer key-b")
        .header("content-type", "application/json")
        .header("grpc-timeout", "20S")
        .body(r#"{"id":"x"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(looked_up.status(), StatusCode::OK);
    assert_eq!(looked_up.text().await.unwrap(), r#"{"id":"x"}"#);
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_http2_bodies_hold_no_gate_permit() {
    let server = start(MemoryStore::new(), MAX_INFLIGHT).await;
    let socket = TcpStream::connect(server.addr).await.unwrap();
    let (client, connection) = h2::client::handshake(socket).await.unwrap();
    tokio::spawn(connection);
    let mut held = Vec::new();
    for i in 0..STALLED {
        let mut client = client.clone().ready().await.unwrap();
        let request = http::Request::post(format!("{}/v1/payments", server.base))
            .header("authorization", "Bearer key-a")
            .header("idempotency-key", format!("a-{i}"))
            .header("content-type", "application/json")
            .header("grpc-timeout", "60S")
            .body(())
            .unwrap();
        let (response, mut stream) = client.send_request(request, false).unwrap();
        stream
            .send_data(Bytes::from_static(b"{\"order_id\":"), false)
            .unwrap();
        held.push((response, stream));
    }
    stalled_bodies_leave_room_for_others(&server).await;
    drop(held);
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use backstop::db::sqlite::SqliteOptions;
    use backstop::idempotency::sqlite::SqliteStore;

    async fn store() -> (SqliteStore, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())
            .await
            .unwrap();
        (store, dir)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_tiny_timeouts_leave_the_key_free() {
        let (store, _dir) = store().await;
        super::tiny_timeouts_leave_the_key_free(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_disconnects_leave_the_key_free() {
        let (store, _dir) = store().await;
        super::disconnects_leave_the_key_free(store).await;
    }
}

mod support {
    pub(crate) mod policies;
    #[cfg(feature = "postgres")]
    pub(crate) mod postgres_schema;
    #[cfg(feature = "postgres")]
    pub(crate) mod services;
}

/// Against the PostgreSQL on 127.0.0.1:5432, each test in a schema of its own.
#[cfg(feature = "postgres")]
mod postgres {
    use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
    use backstop::idempotency::{IdempotencyKey, Store};

    use super::support::postgres_schema::Schema;
    use super::support::services;
    use super::*;

    async fn store(schema: &Schema) -> PostgresStore {
        PostgresStore::connect_with(
            schema.config(),
            PostgresOptions {
                max_connections: 4,
                writers: 2,
                ..PostgresOptions::default()
            },
        )
        .await
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_tiny_timeouts_leave_the_key_free() {
        if !services::postgres() {
            return;
        }
        let schema = Schema::create("claim_edges").await;
        tiny_timeouts_leave_the_key_free(store(&schema).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_disconnects_leave_the_key_free() {
        if !services::postgres() {
            return;
        }
        let schema = Schema::create("claim_edges").await;
        disconnects_leave_the_key_free(store(&schema).await).await;
    }

    /// A 1 ms budget on a healthy database: 504 `deadline_exceeded`, never 503
    /// `store_unavailable`, and the key is left unused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_deadline_during_the_claim_is_504_not_store_unavailable() {
        if !services::postgres() {
            return;
        }
        let schema = Schema::create("claim_edges").await;
        let store = store(&schema).await;
        let server = start(store.clone(), 64).await;
        for i in 0..5 {
            let key = format!("pg-1m-{i}");
            let body = order(&format!("o-{i}"));
            let cut = server.pay(&key, &body, Some("1m")).await;
            assert_eq!(cut.status(), StatusCode::GATEWAY_TIMEOUT, "{key}");
            assert_eq!(problem_code(cut).await, "deadline_exceeded", "{key}");
            let record = store
                .get("merchant-b", &IdempotencyKey::new(&key).unwrap())
                .await
                .unwrap();
            assert!(record.is_none(), "{key} left unused: {record:?}");
            let again = server.pay(&key, &body, None).await;
            assert_eq!(again.status(), StatusCode::CREATED, "{key}");
        }
    }

    /// Two instances sharing one database: the second request, on the other instance, waits
    /// for the first's answer and replays it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn same_key_on_two_instances_waits_and_is_replayed() {
        if !services::postgres() {
            return;
        }
        let schema = Schema::create("claim_edges").await;
        let one = start(store(&schema).await, 64).await;
        let two = start(store(&schema).await, 64).await;
        same_key_in_flight_is_replayed(&one, &two).await;
    }
}
