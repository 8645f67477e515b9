//! Two hops, written the natural way: a gateway whose handler calls a backend through the
//! client stack, both behind the server stack.
//!
//! `cargo run -p backstop --example two_hop` starts, on free ports of 127.0.0.1, a backend
//! (axum, a keyed `POST /v1/charges` that works 300 ms), an HTTP gateway (axum,
//! `POST /v1/checkout`) and a gRPC gateway (tonic, `/demo.Checkout/Pay`) in front of it, and a
//! gateway whose backend is gone. It checks and prints:
//!
//! 1. the budget shrinks hop by hop with no code in the handler: the caller gives the gateway
//!    1 s, the backend is told less;
//! 2. when it runs out, the gateway answers 504 and the backend was told less than the caller
//!    gave, never a fresh budget;
//! 3. a key sent twice is charged once: the second answer is the stored one
//!    (`Idempotent-Replayed: true`);
//! 4. a dead backend is answered 503 with a `Retry-After`;
//! 5. the backend's 300 ms of work do not eat the next call's budget: the margin kept for the
//!    way back is the network's share only;
//! 6. the same from a tonic gateway: `?` turns the client stack's error into a gRPC status.
//!
//! The gateway's handler is the whole integration: forward the caller's key, `oneshot`, `?`.
//!
//! ```text
//! async fn checkout(State(gateway), Extension(key), body) -> Result<Response, client::Error> {
//!     let request = Request::post(&gateway.charges).header("idempotency-key", key.as_str())...;
//!     Ok(gateway.backend.clone().oneshot(request).await?.map(Body::new))
//! }
//! ```
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{MatchedPath, State};
use axum::response::Response;
use axum::routing::post;
use axum::{Extension, Json, Router};
use backstop::Deadline;
use backstop::client::{self, ClientStack, Destination, HttpService};
use backstop::idempotency::{IdempotencyKey, MemoryStore};
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
use backstop::server::ServerStack;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{BoxError, Service, ServiceExt};

/// How long the backend works on a charge.
const WORK: Duration = Duration::from_millis(300);

// ---- the backend: a keyed route that takes 300 ms ----

/// What the backend saw of each charge it ran.
#[derive(Clone, Default)]
struct Backend {
    /// The budget each run started with.
    budgets: Arc<Mutex<Vec<Duration>>>,
}

async fn charge(
    State(backend): State<Backend>,
    Extension(key): Extension<IdempotencyKey>,
) -> (StatusCode, Json<serde_json::Value>) {
    // The server stack runs the handler under the request's deadline.
    let budget = Deadline::current().map_or(Duration::MAX, |d| d.remaining());
    backend.budgets.lock().unwrap().push(budget);
    tokio::time::sleep(WORK).await;
    let body = serde_json::json!({ "charged": key.as_str(), "budget_ms": budget.as_millis() });
    (StatusCode::CREATED, Json(body))
}

/// A server stack whose every route is `Keyed` (payments keep their keys 7 days).
fn keyed_stack(name: &str) -> Result<ServerStack<MemoryStore>, BoxError> {
    let keyed = MethodPolicy::builder(name, Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .build();
    Ok(ServerStack::new(name, MemoryStore::new())
        .policies(MethodPolicies::new(keyed).validated()?)
        .matched_path_from(|ext| ext.get::<MatchedPath>().map(|m| m.as_str())))
}

async fn serve(app: Router) -> Result<SocketAddr, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

// ---- the HTTP gateway: its handler calls the backend the natural way ----

#[derive(Clone)]
struct Gateway {
    /// The client stack over a pooled HTTP client: a type the state can name.
    backend: HttpService,
    charges: String,
}

async fn checkout(
    State(gateway): State<Gateway>,
    Extension(key): Extension<IdempotencyKey>,
    body: Bytes,
) -> Result<Response, client::Error> {
    // No deadline, no timeout here: the call sends what is left of this request's budget.
    let request = Request::post(&gateway.charges)
        .header("idempotency-key", key.as_str())
        .header("content-type", "application/json")
        .body(Full::new(body))
        .expect("a valid request");
    let answer = gateway.backend.clone().oneshot(request).await?;
    Ok(answer.map(Body::new))
}

/// The client stack's policy for the backend: keyed, so retries carry the caller's key.
fn backend_policy() -> MethodPolicy {
    MethodPolicy::builder("Charge", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .build()
}

async fn gateway(backend: SocketAddr, destination: &Destination) -> Result<SocketAddr, BoxError> {
    let state = Gateway {
        backend: ClientStack::builder(destination, backend_policy())
            .build()?
            .http(),
        charges: format!("http://{backend}/v1/charges"),
    };
    let app = Router::new()
        .route("/v1/checkout", post(checkout))
        .route_layer(keyed_stack("gateway")?.into_layer())
        .with_state(state);
    serve(app).await
}

// ---- the gRPC gateway: a tonic method, `?` on the client stack's error ----

#[derive(Clone, PartialEq, prost::Message)]
struct PayRequest {
    #[prost(string, tag = "1")]
    order_id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PayReply {
    #[prost(string, tag = "1")]
    backend_said: String,
}

const PAY: &str = "/demo.Checkout/Pay";

impl tonic::server::NamedService for Gateway {
    const NAME: &'static str = "demo.Checkout";
}

impl Gateway {
    async fn pay(
        &self,
        request: tonic::Request<PayRequest>,
    ) -> Result<tonic::Response<PayReply>, tonic::Status> {
        let key = request.extensions().get::<IdempotencyKey>().cloned();
        let key = key.ok_or_else(|| tonic::Status::internal("the stack sets the key"))?;
        let body = serde_json::json!({ "order_id": request.get_ref().order_id }).to_string();
        let call = Request::post(&self.charges)
            .header("idempotency-key", key.as_str())
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| tonic::Status::internal(e.to_string()))?;
        // A refusal from the backend (its 504, its 409) becomes this method's status too.
        let answer = client::Error::for_status(self.backend.clone().oneshot(call).await?)?;
        let body = answer.into_body().collect().await;
        let body = body.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        Ok(tonic::Response::new(PayReply {
            backend_said: String::from_utf8_lossy(&body.to_bytes()).into_owned(),
        }))
    }
}

// Written by hand as tonic's code generator would, so the example needs no build script.
impl<B> Service<http::Request<B>> for Gateway
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let gateway = self.clone();
        Box::pin(async move {
            if request.uri().path() != PAY {
                return Ok(tonic::Status::unimplemented("no such method").into_http());
            }
            let pay = tower::service_fn(move |r: tonic::Request<PayRequest>| {
                let gateway = gateway.clone();
                async move { gateway.pay(r).await }
            });
            let codec = tonic_prost::ProstCodec::<PayReply, PayRequest>::default();
            Ok(tonic::server::Grpc::new(codec).unary(pay, request).await)
        })
    }
}

async fn grpc_gateway(backend: SocketAddr) -> Result<SocketAddr, BoxError> {
    let gateway = Gateway {
        backend: ClientStack::builder(&Destination::new("backend-grpc"), backend_policy())
            .build()?
            .http(),
        charges: format!("http://{backend}/v1/charges"),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tonic::transport::Server::builder()
        .layer(keyed_stack("grpc-gateway")?.into_layer())
        .add_service(gateway);
    tokio::spawn(server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    Ok(addr)
}

// ---- the caller ----

/// What a caller got back.
struct Answer {
    status: StatusCode,
    retry_after: Option<String>,
    replayed: bool,
    body: serde_json::Value,
}

async fn checkout_call(
    caller: &backstop::client::connect::HttpClient<Full<Bytes>>,
    gateway: SocketAddr,
    key: &str,
    budget: &str,
) -> Result<Answer, BoxError> {
    let request = Request::post(format!("http://{gateway}/v1/checkout"))
        .header("idempotency-key", key)
        .header("grpc-timeout", budget)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"order_id":"42"}"#)))?;
    let response = caller.request(request).await?;
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (status, retry_after) = (response.status(), header("retry-after"));
    let replayed = header("idempotent-replayed").as_deref() == Some("true");
    let body = response.into_body().collect().await?.to_bytes();
    let body = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    Ok(Answer {
        status,
        retry_after,
        replayed,
        body,
    })
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let backend = Backend::default();
    let backend_app = Router::new()
        .route("/v1/charges", post(charge))
        .route_layer(keyed_stack("backend")?.into_layer())
        .with_state(backend.clone());
    let backend_addr = serve(backend_app).await?;
    let destination = Destination::new("backend");
    let gateway_addr = gateway(backend_addr, &destination).await?;
    let caller = backstop::client::connect::pooled::<Full<Bytes>>(false);
    let told = |n: usize| backend.budgets.lock().unwrap()[n];

    // 1. The budget shrinks by itself.
    let first = checkout_call(&caller, gateway_addr, "order-1", "1S").await?;
    println!(
        "1. caller gave 1 s; backend was told {:?}: {} {}",
        told(0),
        first.status,
        first.body
    );
    check(first.status == StatusCode::CREATED, "the checkout succeeds")?;
    check(
        told(0) < Duration::from_secs(1),
        "the backend gets less than the caller gave",
    )?;

    // 2. Too little for the backend's 300 ms: 504, and the backend was never given more.
    let late = checkout_call(&caller, gateway_addr, "order-2", "100m").await?;
    println!(
        "2. caller gave 100 ms: {} {}; backend was told {:?}",
        late.status,
        late.body["code"],
        told(1)
    );
    check(
        late.status == StatusCode::GATEWAY_TIMEOUT,
        "504 when the budget runs out",
    )?;
    check(
        late.body["code"] == "deadline_exceeded",
        "problem code deadline_exceeded",
    )?;
    check(
        told(1) < Duration::from_millis(100),
        "the backend is told less than 100 ms",
    )?;

    // 3. The same key again: the stored answer, the backend charged once.
    let again = checkout_call(&caller, gateway_addr, "order-1", "1S").await?;
    println!(
        "3. order-1 again: {} replayed={}; backend ran {} charges",
        again.status,
        again.replayed,
        backend.budgets.lock().unwrap().len()
    );
    check(
        again.replayed && again.body == first.body,
        "the same key replays",
    )?;
    check(
        backend.budgets.lock().unwrap().len() == 2,
        "the backend ran once per key",
    )?;

    // 4. A gateway whose backend is gone.
    let gone = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.local_addr()?
    };
    let dead_gateway = gateway(gone, &Destination::new("gone")).await?;
    let dead = checkout_call(&caller, dead_gateway, "order-3", "2S").await?;
    println!(
        "4. backend down: {} {} Retry-After: {:?}",
        dead.status, dead.body["code"], dead.retry_after
    );
    check(
        dead.status == StatusCode::SERVICE_UNAVAILABLE,
        "503 for a dead backend",
    )?;
    check(dead.retry_after.is_some(), "with Retry-After")?;

    // 5. The backend's work is not the way back: 500 ms still leave it room for 300 ms.
    let tight = checkout_call(&caller, gateway_addr, "order-4", "500m").await?;
    println!(
        "5. margin kept for the way back: {:?}; caller gave 500 ms: {}, backend was told {:?}",
        destination.margin().current(),
        tight.status,
        told(2)
    );
    check(
        tight.status == StatusCode::CREATED,
        "a 500 ms budget covers 300 ms of work",
    )?;

    // 6. A gRPC gateway: `?` on the client error gives the caller a gRPC status.
    let grpc_addr = grpc_gateway(backend_addr).await?;
    let channel = tonic::transport::Channel::from_shared(format!("http://{grpc_addr}"))?
        .connect()
        .await?;
    let mut grpc = tonic::client::Grpc::new(channel);
    let pay = |key: &'static str, timeout: Duration| {
        let mut request = tonic::Request::new(PayRequest {
            order_id: key.into(),
        });
        request.set_timeout(timeout);
        request.metadata_mut().insert(
            "idempotency-key",
            tonic::metadata::MetadataValue::from_static(key),
        );
        request
    };
    grpc.ready().await?;
    let codec = || tonic_prost::ProstCodec::<PayRequest, PayReply>::default();
    let path = || http::uri::PathAndQuery::from_static(PAY);
    let paid = grpc
        .unary(pay("order-5", Duration::from_secs(1)), path(), codec())
        .await?;
    println!(
        "6. gRPC caller gave 1 s: OK {}",
        paid.get_ref().backend_said
    );
    grpc.ready().await?;
    let late = grpc
        .unary(pay("order-6", Duration::from_millis(100)), path(), codec())
        .await
        .expect_err("100 ms cannot cover 300 ms of work");
    println!("   gRPC caller gave 100 ms: {:?}", late.code());
    check(
        late.code() == tonic::Code::DeadlineExceeded,
        "DEADLINE_EXCEEDED over gRPC",
    )?;

    println!(
        "ok: one budget across both hops, 504 when it runs out, one charge per key, 503 + Retry-After for a dead backend"
    );
    Ok(())
}

/// Fails the example (exit status 1) when what it shows did not happen.
fn check(ok: bool, what: &str) -> Result<(), BoxError> {
    if ok {
        Ok(())
    } else {
        Err(format!("expected: {what}").into())
    }
}
