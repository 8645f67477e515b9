//! Runs N calls through one in-process stack, for counting instructions per call with
//! `valgrind --tool=callgrind` (`bench/instructions.sh`): instruction counts do not move with
//! whatever else the machine is doing, so they compare two builds where timings cannot.
//!
//! `cargo run --release -p backstop --example stack_calls -- MODE CALLS`, where MODE is
//! `client_bare`, `client_stack`, `server_bare`, `server_stack` or `server_keyed` (the same
//! services as the
//! `stacks` criterion bench, on a current-thread runtime, with the Prometheus recorder
//! installed and mimalloc allocating, as in `backstop serve`).
use std::convert::Infallible;
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use backstop::admission::{Gate, KeyedTokenBucket, Quota};
use backstop::client::replay::ReplayBody;
use backstop::client::{ClientStack, Destination};
use backstop::contract::{Idempotency, MethodContract};
use backstop::idempotency::MemoryStore;
use backstop::server::{KeyedRoute, ServerStack};
use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::Full;
use tower::{Layer, ServiceExt, service_fn};

/// The allocator the `backstop` binary ships with, as in the other benches.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BODY: &[u8] = br#"{"order_id":"o-1","amount_cents":100}"#;

fn request() -> Request<Full<Bytes>> {
    Request::post("http://bench/v1/echo")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(BODY)))
        .expect("valid request")
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_default();
    let calls: u64 = args.next().and_then(|n| n.parse().ok()).unwrap_or(10_000);
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(backstop::observe::LATENCY_BUCKETS_SECONDS)?
        .install_recorder()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        match mode.as_str() {
            "client_bare" => {
                let bare = service_fn(|_r: Request<Full<Bytes>>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
                });
                for _ in 0..calls {
                    let response = bare.oneshot(request()).await?;
                    assert!(response.status().is_success());
                }
            }
            "client_stack" => {
                let transport = service_fn(|_r: Request<ReplayBody<Full<Bytes>>>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
                });
                let contract = MethodContract::builder("Echo", Idempotency::Safe)
                    .default_timeout(Duration::from_secs(10))
                    .build();
                let stack = ClientStack::builder(&Destination::new("bench"), contract)
                    .build()?
                    .layer(transport);
                for _ in 0..calls {
                    let response = stack
                        .clone()
                        .oneshot(request())
                        .await
                        .map_err(|e| e.to_string())?;
                    assert!(response.status().is_success());
                }
            }
            "server_keyed" => {
                // The route keyed on the in-memory store, a fresh key per call: the
                // idempotency layer's own work (claim, fingerprint, store the answer).
                let handler = service_fn(|_r: Request<axum::body::Body>| async {
                    Ok::<_, Infallible>(Response::new(axum::body::Body::from("{}")))
                });
                let quota = Quota::per_second(NonZeroU32::MAX, NonZeroU32::MAX);
                let buckets = KeyedTokenBucket::new(quota, NonZeroUsize::MIN.saturating_add(1023));
                let stack = ServerStack::new("bench", MemoryStore::new())
                    .tenant_buckets(buckets)
                    .gate(Gate::new(100_000, Duration::from_millis(1)))
                    .keyed(Method::POST, "/v1/echo", KeyedRoute::payments())
                    .into_layer()
                    .layer(handler);
                for i in 0..calls {
                    let mut request = request().map(axum::body::Body::new);
                    let key = http::HeaderValue::try_from(format!("key-{i}"))?;
                    request.headers_mut().insert("idempotency-key", key);
                    let response = stack.clone().oneshot(request).await?;
                    assert!(response.status().is_success());
                }
            }
            "server_bare" | "server_stack" => {
                let handler = service_fn(|_r: Request<axum::body::Body>| async {
                    Ok::<_, Infallible>(Response::new(axum::body::Body::from("{}")))
                });
                let request = || request().map(axum::body::Body::new);
                if mode == "server_bare" {
                    for _ in 0..calls {
                        let response = handler.oneshot(request()).await?;
                        assert!(response.status().is_success());
                    }
                } else {
                    // Limits far above the offered load: this counts the layers, not refusals.
                    let quota = Quota::per_second(NonZeroU32::MAX, NonZeroU32::MAX);
                    let buckets = KeyedTokenBucket::new(quota, NonZeroUsize::MIN.saturating_add(1023));
                    let stack = ServerStack::new("bench", MemoryStore::new())
                        .tenant_buckets(buckets)
                        .gate(Gate::new(100_000, Duration::from_millis(1)))
                        .route(Method::POST, "/v1/echo")
                        .into_layer()
                        .layer(handler);
                    for _ in 0..calls {
                        let response = stack.clone().oneshot(request()).await?;
                        assert!(response.status().is_success());
                    }
                }
            }
            other => {
                return Err(format!(
                    "unknown mode {other:?}: client_bare | client_stack | server_bare | server_stack | \
                     server_keyed"
                )
                .into());
            }
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    });
    // Drain the recorded histogram samples, as a served process's upkeep or scrape would, so
    // that their cost is counted.
    metrics.run_upkeep();
    result
}
