//! Keyed requests refused before their handler ran leave nothing in the idempotency store:
//! counted in the store's own table (SQLite in a temporary directory, PostgreSQL in a schema of
//! its own), over real connections on 127.0.0.1.
//!
//! - budgets too small to run (`grpc-timeout` `999u`, `5m`, `20m`, under a gate whose minimal
//!   service time is 20 ms, as the payment service's) are refused 504 `deadline_exceeded` /
//!   `DEADLINE_EXCEEDED` before the claim, over HTTP and gRPC (before the fix, they were
//!   claimed and reached the handlers, whose own budget check answered 504 after the claim:
//!   a `failed` row each);
//! - a gRPC message whose compressed flag is set while the request names no `grpc-encoding`
//!   is refused `INTERNAL` by the layer before the claim, not by tonic's codec after it;
//! - a gRPC message compressed with an encoding the service does not accept is refused
//!   `UNIMPLEMENTED` by tonic's codec after the claim, and that answer releases the record;
//! - a handler that refuses before doing anything and says so ([`NothingDone`]) leaves no
//!   record either, whatever its status; the same answer without the marker is a retryable
//!   failure and keeps its `failed` record (the layer does not guess from a status).
//!
//! No assertion depends on how fast the machine is: a budget that runs out earlier than
//! expected is refused the same way.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use backstop::Deadline;
use backstop::admission::Gate;
use backstop::idempotency::Store;
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
use backstop::server::ServerStack;
use backstop::server::idempotency::NothingDone;
use bytes::Bytes;
use http::{Method, Request};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::net::TcpListener;
use tower::BoxError;

/// The gRPC method of the test service.
const SAY: &str = "/test.Echo/Say";

/// How often a handler ran, HTTP and gRPC together.
#[derive(Clone, Default)]
struct Calls(Arc<AtomicUsize>);

impl Calls {
    fn add(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// The least budget the handlers need for their work (as the payment service's handler
/// checks that its budget covers a PSP round trip before any write); the same as the gate's
/// minimal service time, so the stack refuses before the claim what they would refuse.
const MIN_WORK: Duration = Duration::from_millis(20);

/// Whether the request's deadline leaves the handler the budget its work needs.
fn budget_suffices(extensions: &http::Extensions) -> bool {
    extensions
        .get::<Deadline>()
        .is_none_or(|deadline| deadline.remaining() >= MIN_WORK)
}

/// Runs and answers 201; first refuses (504, unmarked, as a handler that does not know about
/// the marker) when its budget cannot cover its work.
async fn pay(State(calls): State<Calls>, request: Request<axum::body::Body>) -> Response {
    calls.add();
    if !budget_suffices(request.extensions()) {
        return (StatusCode::GATEWAY_TIMEOUT, "no time for the downstream").into_response();
    }
    (StatusCode::CREATED, "paid").into_response()
}

/// Refuses before doing anything, as a handler whose budget cannot cover its downstream call:
/// 504, marked [`NothingDone`].
async fn refuse_untouched(State(calls): State<Calls>) -> Response {
    calls.add();
    let mut response = (StatusCode::GATEWAY_TIMEOUT, "no time for the downstream").into_response();
    response.extensions_mut().insert(NothingDone);
    response
}

/// The same answer without the marker: for all the layer knows, it did something.
async fn refuse_unmarked(State(calls): State<Calls>) -> Response {
    calls.add();
    (StatusCode::GATEWAY_TIMEOUT, "no time for the downstream").into_response()
}

/// The one message of `test.Echo/Say`, both ways.
#[derive(Clone, PartialEq, prost::Message)]
struct Say {
    #[prost(string, tag = "1")]
    text: String,
}

/// A hand-written tonic service, as tonic's code generator would write it: the request is
/// decoded by tonic's own codec.
#[derive(Clone)]
struct EchoServer(Calls);

impl tonic::server::NamedService for EchoServer {
    const NAME: &'static str = "test.Echo";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<B> tower::Service<Request<B>> for EchoServer
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let calls = self.0.clone();
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<Say, Say>::default();
            Ok(tonic::server::Grpc::new(codec)
                .unary(SayMethod(calls), request)
                .await)
        })
    }
}

struct SayMethod(Calls);

impl tonic::server::UnaryService<Say> for SayMethod {
    type Response = Say;
    type Future = BoxFuture<Result<tonic::Response<Say>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<Say>) -> Self::Future {
        self.0.add();
        if !budget_suffices(request.extensions()) {
            let refused = tonic::Status::deadline_exceeded("no time for the downstream");
            return Box::pin(async move { Err(refused) });
        }
        let text = request.into_inner().text;
        Box::pin(async move { Ok(tonic::Response::new(Say { text })) })
    }
}

/// Every route of the test keyed, the rest `Unsafe`.
fn policies() -> MethodPolicies {
    let keyed = MethodPolicy::builder("Keyed", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .build();
    MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(Method::POST, "/v1/payments", keyed.clone())
        .route(Method::POST, "/v1/refuse-untouched", keyed.clone())
        .route(Method::POST, "/v1/refuse-unmarked", keyed.clone())
        .method(SAY, keyed)
        .validated()
        .unwrap()
}

/// The HTTP (axum) and gRPC (tonic's own server) sides, one server stack over one store.
struct Servers {
    http: String,
    grpc: SocketAddr,
    calls: Calls,
}

async fn start<St: Store>(store: St) -> Servers {
    // As the payment service's gate: a request that cannot get 20 ms is not worth starting.
    let stack = ServerStack::new("refusals", store)
        .policies(policies())
        .gate(Gate::new(64, MIN_WORK))
        .into_layer();
    let calls = Calls::default();

    let router = Router::new()
        .route("/v1/payments", post(pay))
        .route("/v1/refuse-untouched", post(refuse_untouched))
        .route("/v1/refuse-unmarked", post(refuse_unmarked))
        .layer(stack.clone())
        .with_state(calls.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc = listener.local_addr().unwrap();
    let router = tonic::transport::Server::builder()
        .layer(stack)
        .add_service(EchoServer(calls.clone()));
    tokio::spawn(router.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    Servers { http, grpc, calls }
}

/// The answer's problem code.
async fn problem_code(response: reqwest::Response) -> String {
    let body: Value = response.json().await.unwrap();
    body["code"].as_str().unwrap_or_default().to_owned()
}

impl Servers {
    /// A keyed HTTP request to `path` with `key` and, when given, `grpc-timeout`.
    async fn http(&self, path: &str, key: &str, budget: Option<&str>) -> reqwest::Response {
        let mut request = reqwest::Client::new()
            .post(format!("{}{path}", self.http))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(r#"{"amount_cents":100}"#);
        if let Some(budget) = budget {
            request = request.header("grpc-timeout", budget);
        }
        request.send().await.unwrap()
    }

    /// A raw `Say` call over h2c: `framed` is the whole request body (prefix and message), so
    /// a malformed frame can be sent. Answers the `grpc-status` (head or trailers).
    async fn grpc(&self, framed: Vec<u8>, metadata: &[(&str, &str)]) -> tonic::Code {
        let stream = tokio::net::TcpStream::connect(self.grpc).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(connection);
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(format!("http://{}{SAY}", self.grpc))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        for (name, value) in metadata {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(Bytes::from(framed))).unwrap();
        let response = sender.send_request(request).await.unwrap();
        let head = response.headers().clone();
        let collected = response.into_body().collect().await.unwrap();
        let status = head
            .get("grpc-status")
            .or_else(|| collected.trailers().and_then(|t| t.get("grpc-status")))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<i32>().ok())
            .expect("a grpc-status");
        tonic::Code::from_i32(status)
    }
}

/// `Say { text }` framed: the flag byte, the length, the message.
fn framed(text: &str, compressed: bool) -> Vec<u8> {
    let message = prost::Message::encode_to_vec(&Say { text: text.into() });
    let mut out = vec![u8::from(compressed)];
    out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    out.extend_from_slice(&message);
    out
}

/// Every refusal of the module docs, each followed by a count of the store's rows, which
/// `rows` reads from the store's own table.
async fn refusals_leave_no_row<St, F, Fut>(store: St, rows: F)
where
    St: Store,
    F: Fn() -> Fut,
    Fut: Future<Output = i64>,
{
    let servers = start(store).await;

    for budget in ["999u", "5m", "20m"] {
        let key = format!("http-{budget}");
        let refused = servers.http("/v1/payments", &key, Some(budget)).await;
        assert_eq!(refused.status(), StatusCode::GATEWAY_TIMEOUT, "{budget}");
        assert_eq!(problem_code(refused).await, "deadline_exceeded", "{budget}");
        assert_eq!(rows().await, 0, "HTTP with {budget} left a row");

        let key = format!("grpc-{budget}");
        let code = servers
            .grpc(
                framed("hello", false),
                &[("idempotency-key", &key), ("grpc-timeout", budget)],
            )
            .await;
        assert_eq!(code, tonic::Code::DeadlineExceeded, "{budget}");
        assert_eq!(rows().await, 0, "gRPC with {budget} left a row");
    }

    // The compressed flag with no compression named: INTERNAL, as gRPC requires, and nothing
    // claimed (before the fix, tonic's codec answered it after the claim: a `failed` row).
    for encoding in [None, Some("identity")] {
        let mut metadata = vec![("idempotency-key", "grpc-compressed")];
        metadata.extend(encoding.map(|e| ("grpc-encoding", e)));
        let code = servers.grpc(framed("hello", true), &metadata).await;
        assert_eq!(code, tonic::Code::Internal, "{encoding:?}");
        assert_eq!(rows().await, 0, "compressed flag, {encoding:?}: a row");
    }
    // Compressed with an encoding the service does not accept: tonic's codec answers
    // UNIMPLEMENTED with the encodings it accepts, after the claim; that answer releases it.
    let code = servers
        .grpc(
            framed("hello", true),
            &[("idempotency-key", "grpc-gzip"), ("grpc-encoding", "gzip")],
        )
        .await;
    assert_eq!(code, tonic::Code::Unimplemented);
    assert_eq!(rows().await, 0, "an encoding the codec refused left a row");
    assert_eq!(
        servers.calls.get(),
        0,
        "no refused request reached a handler"
    );

    // A handler's own refusal, marked: released, nothing left.
    let refused = servers
        .http("/v1/refuse-untouched", "untouched", None)
        .await;
    assert_eq!(refused.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(rows().await, 0, "a refusal marked NothingDone left a row");

    // The same refusal unmarked is a retryable failure: its record stays, failed.
    let failed = servers.http("/v1/refuse-unmarked", "unmarked", None).await;
    assert_eq!(failed.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(rows().await, 1, "the unmarked 504 keeps its failed record");

    // The same requests with a budget and a well-formed frame run, and are stored: the rows
    // counted above are the ones the store writes.
    let ran = servers.http("/v1/payments", "http-20m", Some("5S")).await;
    assert_eq!(ran.status(), StatusCode::CREATED);
    let code = servers
        .grpc(
            framed("hello", false),
            &[("idempotency-key", "grpc-20m"), ("grpc-timeout", "5S")],
        )
        .await;
    assert_eq!(code, tonic::Code::Ok);
    assert_eq!(rows().await, 3);
    assert_eq!(servers.calls.get(), 4, "two refusing handlers, two runs");
}

mod sqlite {
    use backstop::db::sqlite::SqliteOptions;
    use backstop::idempotency::sqlite::SqliteStore;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_refusals_leave_no_row() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())
            .await
            .unwrap();
        let db = store.db().clone();
        let rows = move || {
            let db = db.clone();
            async move {
                let n = db
                    .read(backstop::idempotency::sqlite::count_records)
                    .await
                    .unwrap();
                i64::try_from(n).unwrap()
            }
        };
        super::refusals_leave_no_row(store, rows).await;
    }
}

#[cfg(feature = "postgres")]
mod support {
    pub(crate) mod postgres_schema;
    pub(crate) mod services;
}

/// Against the PostgreSQL on 127.0.0.1:5432, in a schema of its own.
#[cfg(feature = "postgres")]
mod postgres {
    use std::sync::Arc;

    use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};

    use super::support::postgres_schema::Schema;
    use super::support::services;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_refusals_leave_no_row() {
        if !services::postgres() {
            return;
        }
        let schema = Arc::new(Schema::create("refusals").await);
        let store = PostgresStore::connect_with(
            schema.config(),
            PostgresOptions {
                max_connections: 4,
                writers: 2,
                ..PostgresOptions::default()
            },
        )
        .await
        .unwrap();
        let rows = || {
            let schema = schema.clone();
            async move { schema.count("idempotency_record").await }
        };
        super::refusals_leave_no_row(store, rows).await;
    }
}
