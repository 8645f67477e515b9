//! Every server layer on three servers: tonic's own (`Server::builder().layer(..)` in front of
//! a tonic service), a bare hyper connection serving a `service_fn`, and axum.
//!
//! Nothing here asks a body to be buildable from bytes: tonic's request and response bodies
//! are tonic's own, hyper's request body is `Incoming`, and the handlers answer with a boxed
//! body. Each test starts its own server on 127.0.0.1:0 and checks what a client sees: a
//! refusal written by the layer (503 + `Retry-After`, gRPC `UNAVAILABLE` with its pushback,
//! 429, 504, 401, 400) or the inner service's answer passed through (the tenant and deadline
//! the layer set, a replay of the stored answer).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use backstop::Deadline;
use backstop::admission::{Gate, KeyedTokenBucket, Quota};
use backstop::idempotency::MemoryStore;
use backstop::server::body::RequestBody;
use backstop::server::{
    DeadlineLayer, FaultLayer, GateLayer, IdempotencyLayer, RateLimitLayer, ServerStack, Tenant,
    TenantLayer,
};
use backstop::status::{Code, Status};
use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::Body;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use serde_json::{Value, json};
use support::policies::keyed;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};
use tower::{BoxError, Layer, Service, service_fn};

/// What the handlers share with the test: how often they ran, and a hold for `text: "hold"`.
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

impl App {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Counts the call; a `hold` waits for the test's permit.
    async fn run(&self, text: &str) -> usize {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if text == "hold" {
            self.entered.notify_one();
            self.release.acquire().await.unwrap().forget();
        }
        n
    }
}

/// What the handler saw, as text: the same for gRPC and HTTP.
fn seen(text: &str, extensions: &http::Extensions, call: usize) -> String {
    let tenant = Tenant::from_extensions(extensions);
    let budget = extensions
        .get::<Deadline>()
        .map(|d| d.remaining().as_millis().to_string())
        .unwrap_or_else(|| "none".to_owned());
    format!("{text} tenant={tenant} budget_ms={budget} call={call}")
}

// ---------------------------------------------------------------------------------------------
// gRPC: a hand-written tonic service, as tonic's code generator would write it.

/// The one message of `test.Echo/Say`, both ways.
#[derive(Clone, PartialEq, prost::Message)]
struct Say {
    #[prost(string, tag = "1")]
    text: String,
}

const SAY: &str = "/test.Echo/Say";

#[derive(Clone, Default)]
struct EchoServer(App);

impl tonic::server::NamedService for EchoServer {
    const NAME: &'static str = "test.Echo";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<B> Service<Request<B>> for EchoServer
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send + 'static,
{
    type Response = Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let app = self.0.clone();
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<Say, Say>::default();
            Ok(tonic::server::Grpc::new(codec)
                .unary(SayMethod(app), request)
                .await)
        })
    }
}

struct SayMethod(App);

impl tonic::server::UnaryService<Say> for SayMethod {
    type Response = Say;
    type Future = BoxFuture<Result<tonic::Response<Say>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<Say>) -> Self::Future {
        let app = self.0.clone();
        Box::pin(async move {
            let text = request.get_ref().text.clone();
            let call = app.run(&text).await;
            Ok(tonic::Response::new(Say {
                text: seen(&text, request.extensions(), call),
            }))
        })
    }
}

/// Serves `EchoServer` on tonic's own server with `layer` in front; expands to the address.
macro_rules! serve_tonic {
    ($layer:expr, $app:expr) => {{
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = tonic::transport::Server::builder()
            .layer($layer)
            .add_service(EchoServer($app.clone()));
        tokio::spawn(
            router.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        addr
    }};
}

/// One `Say` call with `metadata`.
async fn say(
    addr: SocketAddr,
    text: &str,
    metadata: &[(&'static str, &str)],
) -> Result<tonic::Response<Say>, tonic::Status> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(Say { text: text.into() });
    for (name, value) in metadata {
        request.metadata_mut().insert(*name, value.parse().unwrap());
    }
    let codec = tonic_prost::ProstCodec::<Say, Say>::default();
    grpc.unary(request, http::uri::PathAndQuery::from_static(SAY), codec)
        .await
}

fn replayed<T>(response: &tonic::Response<T>) -> Option<&str> {
    response
        .metadata()
        .get("idempotent-replayed")
        .and_then(|v| v.to_str().ok())
}

fn pushback_ms(status: &tonic::Status) -> Option<i64> {
    status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

// ---------------------------------------------------------------------------------------------
// HTTP: the same handler behind a bare hyper connection and behind axum.

type AnswerBody = BoxBody<Bytes, Infallible>;

/// Reads `{"text": ..}`, runs it, and answers 201 with what it saw: a body that cannot be
/// built from bytes by anyone but this handler.
async fn answer<B>(app: App, request: Request<B>) -> Response<AnswerBody>
where
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let (head, body) = request.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let text = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["text"].as_str().map(str::to_owned))
        .unwrap_or_default();
    let call = app.run(&text).await;
    let doc = json!({ "seen": seen(&text, &head.extensions, call) });
    Response::builder()
        .status(201)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(doc.to_string())).boxed())
        .unwrap()
}

/// The handler as a bare tower service taking requests with body `B`.
fn handler<B>(
    app: &App,
) -> impl Service<Request<B>, Response = Response<AnswerBody>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: std::fmt::Debug,
{
    let app = app.clone();
    service_fn(move |request: Request<B>| {
        let app = app.clone();
        async move { Ok::<_, Infallible>(answer(app, request).await) }
    })
}

/// Serves `service` on bare hyper connections (HTTP/1 and HTTP/2).
async fn serve_hyper<S, B>(service: S) -> SocketAddr
where
    S: Service<Request<Incoming>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// Serves `POST /pay` on axum with `layer` around the router.
macro_rules! serve_axum {
    ($layer:expr, $app:expr) => {{
        let app = $app.clone();
        let router = axum::Router::new()
            .route(
                "/pay",
                axum::routing::post(move |request: axum::extract::Request| answer(app, request)),
            )
            .layer($layer);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        addr
    }};
}

/// `POST /pay` with `{"text": text}` and `headers`.
async fn post(addr: SocketAddr, text: &str, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut request = reqwest::Client::new()
        .post(format!("http://{addr}/pay"))
        .json(&json!({ "text": text }));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

async fn problem_code(response: reqwest::Response) -> String {
    let doc: Value = response.json().await.unwrap();
    doc["code"].as_str().unwrap_or_default().to_owned()
}

async fn seen_by_handler(response: reqwest::Response) -> String {
    let doc: Value = response.json().await.unwrap();
    doc["seen"].as_str().unwrap_or_default().to_owned()
}

// ---------------------------------------------------------------------------------------------
// The layers under test.

/// One place, and a budget too short to wait for it: the second request is refused at once.
fn gate_layer() -> GateLayer {
    GateLayer::new(Gate::new(1, Duration::from_millis(50)))
        .default_timeout(Duration::from_millis(30))
}

/// One request per tenant, then nothing for a long while.
fn rate_limit_layer() -> RateLimitLayer {
    let one = NonZeroU32::new(1).unwrap();
    let quota = Quota::per_second(one, one);
    RateLimitLayer::new(KeyedTokenBucket::new(quota, NonZeroUsize::new(16).unwrap()))
}

/// 200 ms unless the caller asks for less, and never more than 5 s.
fn deadline_layer() -> DeadlineLayer {
    DeadlineLayer::new(Duration::from_millis(200)).max(Duration::from_secs(5))
}

/// `Bearer k1` is tenant `acme`; anything else is refused.
fn tenant_layer() -> TenantLayer {
    TenantLayer::from_fn(|head: &http::request::Parts| {
        match head.headers.get("authorization").map(|v| v.as_bytes()) {
            Some(b"Bearer k1") => Ok(Tenant::new("acme")),
            _ => {
                Err(Status::new(Code::Unauthenticated, "unknown key")
                    .with_problem("unauthenticated"))
            }
        }
    })
}

/// Every request aborted before it reaches the service.
fn fault_layer() -> FaultLayer {
    FaultLayer::none().abort_percent(100.0).unwrap()
}

fn idempotency_layer() -> IdempotencyLayer<MemoryStore> {
    IdempotencyLayer::new(MemoryStore::new())
        .policies(keyed(&[(Method::POST, "/pay"), (Method::POST, SAY)]))
}

fn stack_layer() -> backstop::server::ServerStackLayer<MemoryStore> {
    ServerStack::new("any_server", MemoryStore::new())
        .policies(keyed(&[(Method::POST, "/pay"), (Method::POST, SAY)]))
        .gate(Gate::new(8, Duration::from_millis(1)))
        .into_layer()
}

// ---------------------------------------------------------------------------------------------
// Gate: a held request takes the one place; the next is refused, the held one then answers.

#[tokio::test]
async fn gate_on_tonic_refuses_with_unavailable_and_pushback() {
    let app = App::default();
    let addr = serve_tonic!(gate_layer(), app);
    let held = tokio::spawn(async move { say(addr, "hold", &[]).await });
    app.entered.notified().await;

    let refused = say(addr, "next", &[]).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        pushback_ms(&refused).is_some_and(|ms| ms != 0),
        "{refused:?}"
    );

    app.release.add_permits(1);
    let answered = held.await.unwrap().unwrap().into_inner();
    assert!(answered.text.starts_with("hold "), "{}", answered.text);
    assert_eq!(app.calls(), 1, "the refused call never reached the service");
}

/// The gate over HTTP: a held request takes the one place; the next gets 503 + Retry-After.
async fn expect_gate_over_http(addr: SocketAddr, app: &App) {
    let held = tokio::spawn(async move { post(addr, "hold", &[]).await });
    app.entered.notified().await;

    let refused = post(addr, "next", &[]).await;
    assert_eq!(refused.status(), 503);
    assert!(refused.headers().contains_key("retry-after"));
    assert_eq!(problem_code(refused).await, "overloaded");

    app.release.add_permits(1);
    assert_eq!(held.await.unwrap().status(), 201);
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn gate_on_hyper_refuses_with_503_and_retry_after() {
    let app = App::default();
    let addr = serve_hyper(gate_layer().layer(handler::<Incoming>(&app))).await;
    expect_gate_over_http(addr, &app).await;
}

#[tokio::test]
async fn gate_on_axum_refuses_with_503_and_retry_after() {
    let app = App::default();
    let addr = serve_axum!(gate_layer(), app);
    expect_gate_over_http(addr, &app).await;
}

// ---------------------------------------------------------------------------------------------
// Rate limit: the first request passes, the second is over quota.

#[tokio::test]
async fn rate_limit_on_tonic_refuses_with_resource_exhausted() {
    let app = App::default();
    let addr = serve_tonic!(rate_limit_layer(), app);
    say(addr, "first", &[]).await.unwrap();
    let refused = say(addr, "second", &[]).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(
        pushback_ms(&refused).is_some_and(|ms| ms >= 1),
        "{refused:?}"
    );
    assert_eq!(app.calls(), 1);
}

/// The rate limit over HTTP: the first request passes, the second gets 429 + Retry-After.
async fn expect_rate_limit_over_http(addr: SocketAddr, app: &App) {
    assert_eq!(post(addr, "first", &[]).await.status(), 201);
    let refused = post(addr, "second", &[]).await;
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));
    assert_eq!(problem_code(refused).await, "rate_limited");
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn rate_limit_on_hyper_refuses_with_429() {
    let app = App::default();
    let addr = serve_hyper(rate_limit_layer().layer(handler::<Incoming>(&app))).await;
    expect_rate_limit_over_http(addr, &app).await;
}

#[tokio::test]
async fn rate_limit_on_axum_refuses_with_429() {
    let app = App::default();
    let addr = serve_axum!(rate_limit_layer(), app);
    expect_rate_limit_over_http(addr, &app).await;
}

// ---------------------------------------------------------------------------------------------
// Deadline: the budget reaches the handler; a held request is cut; a bad header is refused.

fn budget_ms(seen: &str) -> u64 {
    let start = seen.find("budget_ms=").unwrap() + "budget_ms=".len();
    seen[start..].split(' ').next().unwrap().parse().unwrap()
}

#[tokio::test]
async fn deadline_on_tonic_sets_the_timeout_and_cuts_late_answers() {
    let app = App::default();
    let addr = serve_tonic!(deadline_layer(), app);

    let answered = say(addr, "quick", &[("grpc-timeout", "2S")]).await.unwrap();
    let budget = budget_ms(&answered.into_inner().text);
    assert!((1000..=2000).contains(&budget), "{budget}");

    // No `grpc-timeout`: tonic sets no timer of its own, the layer's 200 ms default cuts it.
    let cut = say(addr, "hold", &[]).await.unwrap_err();
    assert_eq!(cut.code(), tonic::Code::DeadlineExceeded, "{cut:?}");

    let refused = say(addr, "quick", &[("grpc-timeout", "soon")])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert_eq!(app.calls(), 2);
}

/// The deadline over HTTP: the budget reaches the handler, a held request is cut with 504, a
/// malformed `grpc-timeout` is refused with 400.
async fn expect_deadline_over_http(addr: SocketAddr) {
    let answered = post(addr, "quick", &[("grpc-timeout", "2S")]).await;
    assert_eq!(answered.status(), 201);
    let budget = budget_ms(&seen_by_handler(answered).await);
    assert!((1000..=2000).contains(&budget), "{budget}");

    let cut = post(addr, "hold", &[]).await;
    assert_eq!(cut.status(), 504);
    assert_eq!(problem_code(cut).await, "deadline_exceeded");

    let refused = post(addr, "quick", &[("grpc-timeout", "soon")]).await;
    assert_eq!(refused.status(), 400);
    assert_eq!(problem_code(refused).await, "invalid_grpc_timeout");
}

#[tokio::test]
async fn deadline_on_hyper_sets_the_timeout_and_cuts_late_answers() {
    let app = App::default();
    let addr = serve_hyper(deadline_layer().layer(handler::<Incoming>(&app))).await;
    expect_deadline_over_http(addr).await;
}

#[tokio::test]
async fn deadline_on_axum_sets_the_timeout_and_cuts_late_answers() {
    let app = App::default();
    let addr = serve_axum!(deadline_layer(), app);
    expect_deadline_over_http(addr).await;
}

// ---------------------------------------------------------------------------------------------
// Tenant: a known key reaches the handler as its tenant; an unknown one is refused.

#[tokio::test]
async fn tenant_on_tonic_resolves_or_refuses_unauthenticated() {
    let app = App::default();
    let addr = serve_tonic!(tenant_layer(), app);
    let answered = say(addr, "hi", &[("authorization", "Bearer k1")])
        .await
        .unwrap();
    assert!(
        answered.get_ref().text.contains("tenant=acme"),
        "{answered:?}"
    );
    let refused = say(addr, "hi", &[("authorization", "Bearer nope")])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert_eq!(app.calls(), 1);
}

/// The tenant layer over HTTP: a known key reaches the handler as its tenant, none gets 401.
async fn expect_tenant_over_http(addr: SocketAddr, app: &App) {
    let answered = post(addr, "hi", &[("authorization", "Bearer k1")]).await;
    assert!(seen_by_handler(answered).await.contains("tenant=acme"));
    let refused = post(addr, "hi", &[]).await;
    assert_eq!(refused.status(), 401);
    assert_eq!(refused.headers()["www-authenticate"], "Bearer");
    assert_eq!(problem_code(refused).await, "unauthenticated");
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn tenant_on_hyper_resolves_or_refuses_401() {
    let app = App::default();
    let addr = serve_hyper(tenant_layer().layer(handler::<Incoming>(&app))).await;
    expect_tenant_over_http(addr, &app).await;
}

#[tokio::test]
async fn tenant_on_axum_resolves_or_refuses_401() {
    let app = App::default();
    let addr = serve_axum!(tenant_layer(), app);
    expect_tenant_over_http(addr, &app).await;
}

// ---------------------------------------------------------------------------------------------
// Fault injection: an aborted request never reaches the service.

#[tokio::test]
async fn fault_on_tonic_aborts_with_unavailable() {
    let app = App::default();
    let addr = serve_tonic!(fault_layer(), app);
    let aborted = say(addr, "hi", &[]).await.unwrap_err();
    assert_eq!(aborted.code(), tonic::Code::Unavailable, "{aborted:?}");
    assert_eq!(app.calls(), 0);
}

/// Fault injection over HTTP: the aborted request gets 503 and never reaches the service.
async fn expect_fault_over_http(addr: SocketAddr, app: &App) {
    let aborted = post(addr, "hi", &[]).await;
    assert_eq!(aborted.status(), 503);
    assert_eq!(problem_code(aborted).await, "fault_injected");
    assert_eq!(app.calls(), 0);
}

#[tokio::test]
async fn fault_on_hyper_aborts_with_503() {
    let app = App::default();
    let addr = serve_hyper(fault_layer().layer(handler::<Incoming>(&app))).await;
    expect_fault_over_http(addr, &app).await;
}

#[tokio::test]
async fn fault_on_axum_aborts_with_503() {
    let app = App::default();
    let addr = serve_axum!(fault_layer(), app);
    expect_fault_over_http(addr, &app).await;
}

// ---------------------------------------------------------------------------------------------
// The unary message cap: decided from the length prefix, the message read once and handed on.

#[tokio::test]
async fn unary_limit_on_tonic_caps_the_message_and_hands_it_on() {
    let app = App::default();
    let addr = serve_tonic!(backstop::server::grpc::UnaryLimitLayer::new(16), app);
    let answered = say(addr, "short", &[]).await.unwrap();
    assert!(
        answered.get_ref().text.starts_with("short "),
        "{answered:?}"
    );
    let refused = say(addr, "a message well over sixteen bytes", &[])
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert_eq!(app.calls(), 1);
}

// ---------------------------------------------------------------------------------------------
// Idempotency: the first call runs, the retry with the same key is replayed, a call without a
// key is refused. The service behind it reads the body the layer buffered.

#[tokio::test]
async fn idempotency_on_tonic_replays_the_stored_answer() {
    let app = App::default();
    let addr = serve_tonic!(idempotency_layer(), app);
    let key = [("idempotency-key", "say-1")];
    let first = say(addr, "pay", &key).await.unwrap();
    assert!(first.metadata().get("idempotent-replayed").is_none());
    let retry = say(addr, "pay", &key).await.unwrap();
    assert_eq!(replayed(&retry), Some("true"));
    assert_eq!(
        retry.get_ref(),
        first.get_ref(),
        "the same message, byte for byte"
    );
    assert_eq!(app.calls(), 1);

    let other = say(addr, "other", &key).await.unwrap_err();
    assert_eq!(other.code(), tonic::Code::FailedPrecondition, "{other:?}");
    let keyless = say(addr, "pay", &[]).await.unwrap_err();
    assert_eq!(keyless.code(), tonic::Code::InvalidArgument, "{keyless:?}");
    assert_eq!(app.calls(), 1);
}

/// Idempotency over HTTP: the retry with the same key is replayed (the handler ran once), a
/// call without a key gets 400.
async fn expect_idempotency_over_http(addr: SocketAddr, app: &App) {
    let key = [("idempotency-key", "pay-1")];
    let first = post(addr, "pay", &key).await;
    assert_eq!(first.status(), 201);
    let first = seen_by_handler(first).await;
    let retry = post(addr, "pay", &key).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(seen_by_handler(retry).await, first);
    assert_eq!(app.calls(), 1);

    let keyless = post(addr, "pay", &[]).await;
    assert_eq!(keyless.status(), 400);
    assert_eq!(problem_code(keyless).await, "missing_idempotency_key");
}

#[tokio::test]
async fn idempotency_on_hyper_replays_the_stored_answer() {
    let app = App::default();
    let service = idempotency_layer().layer(handler::<RequestBody<Incoming>>(&app));
    let addr = serve_hyper(service).await;
    expect_idempotency_over_http(addr, &app).await;
}

#[tokio::test]
async fn idempotency_on_axum_replays_the_stored_answer() {
    let app = App::default();
    let addr = serve_axum!(idempotency_layer(), app);
    expect_idempotency_over_http(addr, &app).await;
}

/// A service that takes only tonic's own body gets it by mapping the layer's body.
#[tokio::test]
async fn idempotency_in_front_of_a_service_taking_tonics_body() {
    let app = App::default();
    let strict = handler::<tonic::body::Body>(&app);
    let service = tower::ServiceBuilder::new()
        .layer(idempotency_layer())
        .map_request(|request: Request<RequestBody<Incoming>>| request.map(tonic::body::Body::new))
        .service(strict);
    let addr = serve_hyper(service).await;
    let key = [("idempotency-key", "pay-2")];
    let first = seen_by_handler(post(addr, "pay", &key).await).await;
    let retry = post(addr, "pay", &key).await;
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(seen_by_handler(retry).await, first);
    assert_eq!(app.calls(), 1);
}

// ---------------------------------------------------------------------------------------------
// The whole stack as one layer.

#[tokio::test]
async fn server_stack_on_tonic() {
    let app = App::default();
    let addr = serve_tonic!(stack_layer(), app);
    let key = [("idempotency-key", "stack-1"), ("grpc-timeout", "3S")];
    let first = say(addr, "pay", &key).await.unwrap();
    let budget = budget_ms(&first.get_ref().text);
    assert!((2000..=3000).contains(&budget), "{budget}");
    let retry = say(addr, "pay", &key).await.unwrap();
    assert_eq!(replayed(&retry), Some("true"));
    assert_eq!(retry.get_ref(), first.get_ref());
    let refused = say(addr, "pay", &[("grpc-timeout", "later")])
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert_eq!(app.calls(), 1);
}

/// The whole stack over HTTP: a keyed retry is replayed, a keyless call gets 400.
async fn expect_server_stack_over_http(addr: SocketAddr, app: &App) {
    let key = [("idempotency-key", "stack-1")];
    let first = seen_by_handler(post(addr, "pay", &key).await).await;
    let retry = post(addr, "pay", &key).await;
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(seen_by_handler(retry).await, first);
    let keyless = post(addr, "pay", &[]).await;
    assert_eq!(keyless.status(), 400);
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn server_stack_on_hyper() {
    let app = App::default();
    let service = stack_layer().layer(handler::<RequestBody<RequestBody<Incoming>>>(&app));
    let addr = serve_hyper(service).await;
    expect_server_stack_over_http(addr, &app).await;
}

#[tokio::test]
async fn server_stack_on_axum() {
    let app = App::default();
    let addr = serve_axum!(stack_layer(), app);
    expect_server_stack_over_http(addr, &app).await;
}

mod support {
    pub(crate) mod policies;
}
