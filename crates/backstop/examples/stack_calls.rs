//! Runs N calls through one in-process stack, for counting instructions per call with
//! `valgrind --tool=callgrind` (`bench/instructions.sh`, `bench/layers.sh`): instruction counts
//! do not move with whatever else the machine is doing, so they compare two builds where
//! timings cannot.
//!
//! `cargo run --release -p backstop --example stack_calls -- MODE CALLS [LAYERS]`, where MODE is
//! `client_bare`, `client_stack`, `server_bare`, `server_stack` or `server_keyed` (the same
//! services as the `stacks` criterion bench), or `client_layers` / `server_layers` with the
//! number of layers to stack (0 to 7 / 0 to 6); on a current-thread runtime, with the
//! Prometheus recorder installed and mimalloc allocating, as in `backstop serve`.
use std::convert::Infallible;
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use backstop::admission::{Gate, KeyedTokenBucket, Quota};
use backstop::client::breaker::{Breaker, BreakerConfig, CircuitBreaker};
use backstop::client::classify::classify_head;
use backstop::client::deadline::{AttemptTimeout, SetDeadline};
use backstop::client::hedge::Hedge;
use backstop::client::idempotency::IdempotencyKeyService;
use backstop::client::replay::{DEFAULT_REPLAY_CAP, ReplayBody};
use backstop::client::retry::Retry;
use backstop::client::transparent::TransparentRetry;
use backstop::client::{ClientStack, Destination};
use backstop::deadline::Deadline;
use backstop::idempotency::MemoryStore;
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
use backstop::server::body::RequestBody;
use backstop::server::{
    DeadlineLayer, GateLayer, IdempotencyLayer, MetricsLayer, RateLimitLayer, ServerStack,
    ServerStackBody, TenantLayer,
};
use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::Full;
use tower::{BoxError, Layer, Service, ServiceExt, service_fn};

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

/// The client modes' transport: answers at once, never sending anything.
fn transport() -> impl Service<
    Request<ReplayBody<Full<Bytes>>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Copy {
    service_fn(|_r: Request<ReplayBody<Full<Bytes>>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
    })
}

/// The server modes' trivial handler.
fn handler<B>() -> impl Service<
    Request<B>,
    Response = Response<axum::body::Body>,
    Error = Infallible,
    Future = impl Send,
> + Copy {
    service_fn(|_r: Request<B>| async {
        Ok::<_, Infallible>(Response::new(axum::body::Body::from("{}")))
    })
}

/// Tenant buckets with limits far above the offered load: the server modes count the layers,
/// not refusals.
fn unlimited_buckets() -> KeyedTokenBucket {
    let quota = Quota::per_second(NonZeroU32::MAX, NonZeroU32::MAX);
    KeyedTokenBucket::new(quota, NonZeroUsize::MIN.saturating_add(1023))
}

/// A gate far wider than the offered load.
fn wide_gate() -> Gate {
    Gate::new(100_000, Duration::from_millis(1))
}

/// Calls `service` `calls` times, each with a fresh request carrying a [`Deadline`] (as every
/// attempt below the retry layer does) and its body wrapped by `body`.
async fn drive<S, B>(service: S, calls: u64, body: fn(Full<Bytes>) -> B) -> Result<(), BoxError>
where
    S: Service<Request<B>, Response = Response<Full<Bytes>>> + Clone,
    S::Error: Into<BoxError>,
{
    for _ in 0..calls {
        let mut request = request().map(body);
        request
            .extensions_mut()
            .insert(Deadline::after(Duration::from_secs(10)));
        let response = service.clone().oneshot(request).await.map_err(Into::into)?;
        assert!(response.status().is_success());
    }
    Ok(())
}

/// The client stack's lowest `layers` layers (0 to 7) over the same transport as
/// `client_stack`, so that the difference between two counts is what one layer costs per call:
/// 1 transparent retry, 2 breaker, 3 attempt timeout, 4 hedge (off, as for the bench's method),
/// 5 retry, 6 deadline, 7 logical request (keys off: the method is `Safe`). All 7 is the
/// `client_stack` service, except that every request already carries its deadline.
async fn client_layers(layers: usize, calls: u64) -> Result<(), BoxError> {
    let transport = transport();
    let destination = Destination::new("bench");
    let contract = MethodPolicy::builder("Echo", Idempotency::Safe)
        .timeout(Duration::from_secs(10))
        .build();
    let policy = ClientStack::builder(&destination, contract)
        .build()?
        .retry_policy("/v1/echo")
        .clone();
    let timeout = Duration::from_secs(10);
    let once = ReplayBody::once;
    let transparent =
        TransparentRetry::new(transport, Some(destination.spend().retry_budget().clone()));
    if layers == 0 {
        return drive(transport, calls, once).await;
    }
    if layers == 1 {
        return drive(transparent, calls, once).await;
    }
    let breaker = Breaker::new(transparent, CircuitBreaker::new(BreakerConfig::default())?);
    if layers == 2 {
        return drive(breaker, calls, once).await;
    }
    let attempt = AttemptTimeout::new(breaker, destination.margin().clone());
    if layers == 3 {
        return drive(attempt, calls, once).await;
    }
    let hedge = Hedge::disabled(attempt);
    if layers == 4 {
        return drive(hedge, calls, once).await;
    }
    let retry = Retry::new(
        hedge,
        policy,
        Idempotency::Safe,
        DEFAULT_REPLAY_CAP,
        classify_head,
        Some("bench".into()),
    )
    .hedged(false);
    let same = |body| body;
    if layers == 5 {
        return drive(retry, calls, same).await;
    }
    let deadline = SetDeadline::untimed(retry, timeout);
    if layers == 6 {
        return drive(deadline, calls, same).await;
    }
    drive(IdempotencyKeyService::disabled(deadline), calls, same).await
}

/// Calls `service` `calls` times, as the server stack's modes do.
async fn serve<S, B>(service: S, calls: u64) -> Result<(), Box<dyn std::error::Error>>
where
    S: Service<Request<axum::body::Body>, Response = Response<B>> + Clone,
    S::Error: std::error::Error + 'static,
{
    for _ in 0..calls {
        let request = request().map(axum::body::Body::new);
        let response = service.clone().oneshot(request).await?;
        assert!(response.status().is_success());
    }
    Ok(())
}

/// The request body the handler gets behind the idempotency layer alone.
type Inner = RequestBody<axum::body::Body>;

/// The server stack's innermost `layers` layers (0 to 6) around the `server_stack` handler,
/// each as `ServerStack` configures it for that mode: 1 idempotency (the route is not keyed),
/// 2 gate, 3 tenant rate limit, 4 tenant, 5 metrics, 6 deadline (all 6 is `server_stack`).
async fn server_layers(layers: usize, calls: u64) -> Result<(), Box<dyn std::error::Error>> {
    let buckets = unlimited_buckets();
    let idempotency = IdempotencyLayer::new(MemoryStore::new()).layer(handler::<Inner>());
    let gate = GateLayer::new(wide_gate());
    let metrics = MetricsLayer::new("bench").route(Method::POST, "/v1/echo");
    let limited = || RateLimitLayer::new(buckets.clone()).layer(gate.layer(idempotency.clone()));
    match layers {
        0 => serve(handler::<axum::body::Body>(), calls).await,
        1 => serve(idempotency, calls).await,
        2 => serve(gate.layer(idempotency), calls).await,
        3 => serve(limited(), calls).await,
        4 => serve(TenantLayer::none().layer(limited()), calls).await,
        5 => serve(metrics.layer(TenantLayer::none().layer(limited())), calls).await,
        _ => {
            let tenant = TenantLayer::none().layer(limited());
            serve(DeadlineLayer::default().layer(metrics.layer(tenant)), calls).await
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_default();
    let calls: u64 = args.next().and_then(|n| n.parse().ok()).unwrap_or(10_000);
    let metrics = backstop::observe::with_duration_buckets(
        metrics_exporter_prometheus::PrometheusBuilder::new(),
    )
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
                let contract = MethodPolicy::builder("Echo", Idempotency::Safe)
                    .timeout(Duration::from_secs(10))
                    .build();
                let stack = ClientStack::builder(&Destination::new("bench"), contract)
                    .build()?
                    .layer(transport());
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
                let stack = ServerStack::new("bench", MemoryStore::new())
                    .tenant_buckets(unlimited_buckets())
                    .gate(wide_gate())
                    .policies(echo_policies(Idempotency::Keyed))
                    .into_layer()
                    .layer(handler::<ServerStackBody<axum::body::Body>>());
                for i in 0..calls {
                    let mut request = request().map(axum::body::Body::new);
                    let key = http::HeaderValue::try_from(format!("key-{i}"))?;
                    request.headers_mut().insert("idempotency-key", key);
                    let response = stack.clone().oneshot(request).await?;
                    assert!(response.status().is_success());
                }
            }
            "server_bare" => serve(handler::<axum::body::Body>(), calls).await?,
            "server_stack" => {
                let stack = ServerStack::new("bench", MemoryStore::new())
                    .tenant_buckets(unlimited_buckets())
                    .gate(wide_gate())
                    .policies(echo_policies(Idempotency::Unsafe))
                    .into_layer()
                    .layer(handler::<ServerStackBody<axum::body::Body>>());
                serve(stack, calls).await?;
            }
            "server_layers" => {
                let layers = args.next().and_then(|n| n.parse().ok()).unwrap_or(0);
                server_layers(layers, calls).await?;
            }
            "client_layers" => {
                let layers = args.next().and_then(|n| n.parse().ok()).unwrap_or(0);
                client_layers(layers, calls)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            other => {
                return Err(format!(
                    "unknown mode {other:?}: client_bare | client_stack | client_layers | \
                     server_bare | server_stack | server_layers | server_keyed"
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

/// `POST /v1/echo` as a service's table names it: `idempotency` (`Keyed` with the payments
/// TTL, or `Unsafe`), everything else `Unsafe`.
fn echo_policies(idempotency: Idempotency) -> MethodPolicies {
    let mut echo = MethodPolicy::builder("Echo", idempotency);
    if idempotency == Idempotency::Keyed {
        echo = echo.key_ttl(KEY_TTL_PAYMENTS);
    }
    MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build()).route(
        Method::POST,
        "/v1/echo",
        echo.build(),
    )
}
