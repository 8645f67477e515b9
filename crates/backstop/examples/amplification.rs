//! Retry amplification across three hops, live: what one user request costs the deepest
//! service when it is down.
//!
//! `cargo run -p backstop --example amplification [USER_REQUESTS]` starts on free ports of
//! 127.0.0.1 a deepest service D that answers every call 503, and twice a chain in front of
//! it: a user client calling B, B's handler calling C, C's handler calling D.
//!
//! - **naive:** every client makes up to 3 attempts, 10 ms apart, with no budget and nothing
//!   said between the hops: each hop retries what the hop below already retried.
//! - **backstop:** every client is the library's client stack (one `Destination` per hop, its
//!   default retry budget and storm alarm), B and C run behind the server stack, and their
//!   handlers are the natural two lines (`oneshot`, `?`). Retries then happen at one layer: a
//!   hop that already retried answers "do not retry", and a request that arrives as a retry is
//!   passed on once.
//!
//! It prints the attempts D received per user request for each chain (backstop's twice: with
//! its circuit breakers off, the retries alone, and with the defaults, whose breakers open on
//! the dead service), and exits non-zero unless the naive chain multiplies (at least 20) and
//! backstop's retries alone stay at most 1.1.
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{MatchedPath, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::post;
use backstop::admission::{KeyedTokenBucket, Quota};
use backstop::client::{self, ClientStack, Destination, HttpService};
use backstop::idempotency::MemoryStore;
use backstop::policy::{Idempotency, MethodPolicies, MethodPolicy};
use backstop::server::{DEFAULT_MAX_TENANTS, ServerStack};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tower::ServiceExt;

/// Attempts per call, first included, for both chains.
const ATTEMPTS: u32 = 3;

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free port");
    let addr = listener.local_addr().expect("bound");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// D: down, counting what reaches it.
async fn deepest(received: Arc<AtomicU64>) -> SocketAddr {
    let app = Router::new().route(
        "/work",
        post(move || {
            let received = received.clone();
            async move {
                received.fetch_add(1, Ordering::Relaxed);
                StatusCode::SERVICE_UNAVAILABLE
            }
        }),
    );
    serve(app).await
}

/// The one method of the chain: safe to repeat, retried on `UNAVAILABLE`.
fn work() -> MethodPolicy {
    MethodPolicy::builder("Work", Idempotency::Safe)
        .max_attempts(ATTEMPTS)
        .timeout(Duration::from_secs(10))
        .build()
}

fn post_work(to: SocketAddr) -> Request<Full<Bytes>> {
    Request::post(format!("http://{to}/work"))
        .body(Full::new(Bytes::new()))
        .expect("a valid request")
}

/// A destination of the backstop chain: the defaults, or without its circuit breaker (to see
/// what the retries alone do).
fn destination(name: &'static str, breaker: bool) -> Destination {
    let destination = Destination::new(name);
    if breaker {
        destination
    } else {
        destination.breaker(None)
    }
}

/// A hop of the backstop chain: its handler calls `next` through the client stack.
async fn backstop_hop(name: &'static str, next: SocketAddr, breaker: bool) -> SocketAddr {
    let client = ClientStack::builder(&destination(name, breaker), work())
        .build()
        .expect("a valid policy")
        .http();
    async fn handler(
        State((client, next)): State<(HttpService, SocketAddr)>,
    ) -> Result<Response, client::Error> {
        Ok(client.oneshot(post_work(next)).await?.map(Body::new))
    }
    // No per-tenant quota in the way: every user request is one the chain serves.
    let unlimited = NonZeroU32::new(1_000_000).expect("non-zero");
    let stack = ServerStack::new(name, MemoryStore::new())
        .tenant_buckets(KeyedTokenBucket::new(
            Quota::per_second(unlimited, unlimited),
            DEFAULT_MAX_TENANTS,
        ))
        .policies(MethodPolicies::new(work()))
        .matched_path_from(|ext| ext.get::<MatchedPath>().map(MatchedPath::as_str))
        .into_layer();
    let app = Router::new()
        .route("/work", post(handler))
        .route_layer(stack)
        .with_state((client, next));
    serve(app).await
}

/// A naive client: up to [`ATTEMPTS`] attempts while the answer is 5xx, 10 ms apart.
async fn naive_call(http: &reqwest::Client, to: SocketAddr) -> StatusCode {
    let mut status = StatusCode::SERVICE_UNAVAILABLE;
    for attempt in 0..ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        status = match http.post(format!("http://{to}/work")).send().await {
            Ok(answer) => answer.status(),
            Err(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        if !status.is_server_error() {
            break;
        }
    }
    status
}

/// A hop of the naive chain: its handler calls `next` with [`naive_call`].
async fn naive_hop(next: SocketAddr) -> SocketAddr {
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("a client");
    let app = Router::new()
        .route(
            "/work",
            post(
                |State((http, next)): State<(reqwest::Client, SocketAddr)>| async move {
                    naive_call(&http, next).await
                },
            ),
        )
        .with_state((http, next));
    serve(app).await
}

/// Sends `users` user requests, 16 at a time, through `call`.
async fn drive<F, Fut>(users: u64, call: F)
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..16)
        .map(|_| {
            let (call, next) = (call.clone(), next.clone());
            tokio::spawn(async move {
                while next.fetch_add(1, Ordering::Relaxed) < users {
                    call().await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("a worker does not panic");
    }
}

/// The backstop chain (breakers on or off): attempts at its deepest service per user request.
async fn backstop_chain(users: u64, breaker: bool) -> f64 {
    let received = Arc::new(AtomicU64::new(0));
    let d = deepest(received.clone()).await;
    let c = backstop_hop("hop-c", d, breaker).await;
    let b = backstop_hop("hop-b", c, breaker).await;
    let user = ClientStack::builder(&destination("hop-b-from-user", breaker), work())
        .build()
        .expect("a valid policy")
        .http();
    drive(users, move || {
        let user = user.clone();
        async move {
            let _ = user.oneshot(post_work(b)).await;
        }
    })
    .await;
    received.load(Ordering::Relaxed) as f64 / users as f64
}

#[tokio::main]
async fn main() {
    let users: u64 = std::env::args()
        .nth(1)
        .map(|n| n.parse().expect("USER_REQUESTS is a number"))
        .unwrap_or(300);

    let naive_received = Arc::new(AtomicU64::new(0));
    let d = deepest(naive_received.clone()).await;
    let c = naive_hop(d).await;
    let b = naive_hop(c).await;
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("a client");
    drive(users, move || {
        let http = http.clone();
        async move {
            naive_call(&http, b).await;
        }
    })
    .await;
    let naive = naive_received.load(Ordering::Relaxed) as f64 / users as f64;

    let retries_only = backstop_chain(users, false).await;
    let backstop = backstop_chain(users, true).await;

    println!("user requests: {users} per chain; the deepest service down");
    println!("attempts at the deepest service per user request:");
    println!("  naive (3 attempts at each of 3 hops): {naive:.2}");
    println!("  backstop, circuit breakers off (retries alone): {retries_only:.2}");
    println!("  backstop, defaults (breakers open on the dead service): {backstop:.2}");
    let ok = naive >= 20.0 && retries_only <= 1.1 && backstop <= retries_only;
    println!(
        "{}: naive {} 20, backstop's retries alone {} 1.1",
        if ok { "ok" } else { "FAILED" },
        if naive >= 20.0 { ">=" } else { "<" },
        if retries_only <= 1.1 { "<=" } else { ">" },
    );
    if !ok {
        std::process::exit(1);
    }
}
