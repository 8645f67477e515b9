//! A gateway that streams its caller's body to an upstream through the client stack, written
//! the natural way: an axum handler, the request's body handed on as it is, `oneshot`, `?`.
//!
//! `cargo run -p backstop --example streaming_gateway` starts, on free ports of 127.0.0.1, an
//! upstream (axum, `POST /v1/orders` reads the body and answers 201) and the gateway in front
//! of it, then checks and prints:
//!
//! 1. a well-formed order goes through: 201;
//! 2. thirty callers whose bodies break on the way in (a malformed chunk size, `-4`) each get
//!    400 `request_body_invalid` from the gateway, not a 502: the client stack's error says
//!    the body failed on the caller's side ([`client::Error::is_request_body`]);
//! 3. the upstream's circuit breaker is still closed (it opens after 20 failures by default),
//!    so the next well-formed order goes through too.
//!
//! The handler is the whole integration:
//!
//! ```text
//! async fn order(State(gateway), request: Request<Body>) -> Result<Response, client::Error> {
//!     let call = Request::post(&gateway.orders).body(request.into_body())...;
//!     Ok(gateway.upstream.clone().oneshot(call).await?.map(Body::new))
//! }
//! ```

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use backstop::client::breaker::BreakerState;
use backstop::client::{self, ClientStack, Destination, HttpService};
use backstop::policy::{Idempotency, MethodPolicy};
use bytes::Bytes;
use http::{Request, StatusCode, header};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::{BoxError, ServiceExt};

/// The upstream: reads the whole order, answers 201.
pub(crate) async fn upstream() -> Result<SocketAddr, BoxError> {
    async fn create(body: Bytes) -> (StatusCode, String) {
        (StatusCode::CREATED, format!("{} bytes", body.len()))
    }
    serve(Router::new().route("/v1/orders", post(create))).await
}

/// The gateway's state: the client stack over a pooled HTTP client, for bodies of axum's
/// `Body` type (the caller's own, streamed).
#[derive(Clone)]
struct Gateway {
    upstream: HttpService<Body>,
    orders: String,
}

/// Forwards the caller's order, its body streamed as it arrives. A body that breaks on its
/// way in comes back as the caller's 400 (408, 413), never a 5xx, and is not counted against
/// the upstream.
async fn order(
    State(gateway): State<Gateway>,
    request: Request<Body>,
) -> Result<Response, client::Error> {
    let (parts, body) = request.into_parts();
    let mut call = Request::post(&gateway.orders);
    if let Some(kind) = parts.headers.get(header::CONTENT_TYPE) {
        call = call.header(header::CONTENT_TYPE, kind);
    }
    let call = call.body(body).expect("a valid request");
    let answer = gateway.upstream.clone().oneshot(call).await?;
    Ok(answer.map(Body::new))
}

/// The gateway in front of `upstream`, calling it as `destination`.
pub(crate) async fn gateway(
    upstream: SocketAddr,
    destination: &Destination,
) -> Result<SocketAddr, BoxError> {
    // Creating an order is not safe to send twice: sent once, streamed.
    let policy = MethodPolicy::builder("CreateOrder", Idempotency::Unsafe).build();
    let state = Gateway {
        upstream: ClientStack::builder(destination, policy).build()?.http(),
        orders: format!("http://{upstream}/v1/orders"),
    };
    let app = Router::new()
        .route("/v1/orders", post(order))
        .with_state(state);
    serve(app).await
}

async fn serve(app: Router) -> Result<SocketAddr, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// Writes `request` on a new connection to `addr` and reads the answer until the gateway
/// closes the connection or has sent `content-length` bytes: its status and body.
pub(crate) async fn send_raw(addr: SocketAddr, request: &[u8]) -> Result<(u16, String), BoxError> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.write_all(request).await?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tcp.read(&mut buf).await.unwrap_or(0);
        answer.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&answer);
        let whole = text.split_once("\r\n\r\n").is_some_and(|(head, body)| {
            head.lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(name, _)| name.eq_ignore_ascii_case("content-length"))
                .and_then(|(_, len)| len.trim().parse::<usize>().ok())
                .is_some_and(|len| body.len() >= len)
        });
        if n == 0 || whole {
            break;
        }
    }
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no status line")?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    Ok((status, body))
}

/// An order whose chunked body breaks at once: a chunk size of `-4`.
pub(crate) const BROKEN_ORDER: &[u8] = b"POST /v1/orders HTTP/1.1\r\nhost: gateway\r\n\
content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n-4\r\n";

/// A well-formed order.
pub(crate) const ORDER: &[u8] = b"POST /v1/orders HTTP/1.1\r\nhost: gateway\r\n\
content-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let destination = Destination::new("orders");
    let gateway = gateway(upstream().await?, &destination).await?;

    let (status, _) = send_raw(gateway, ORDER).await?;
    assert_eq!(status, 201);
    println!("1. a well-formed order: {status}");

    for _ in 0..30 {
        let (status, body) = send_raw(gateway, BROKEN_ORDER).await?;
        assert_eq!(status, 400, "{body}");
        assert!(body.contains("request_body_invalid"), "{body}");
    }
    println!("2. thirty orders with broken bodies: 400 request_body_invalid each");

    let breaker = destination.circuit_breaker().expect("a breaker by default");
    assert_eq!(breaker.state(), BreakerState::Closed);
    let (status, _) = send_raw(gateway, ORDER).await?;
    assert_eq!(status, 201);
    println!("3. the upstream's breaker is closed; the next order: {status}");
    Ok(())
}
