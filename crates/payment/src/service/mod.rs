//! The HTTP payment service: routes, the layer stack, start-up and graceful shutdown.
//!
//! # HTTP contract
//!
//! | request | answers |
//! |---|---|
//! | `POST /v1/payments` + `Idempotency-Key` | `201` payment + `Location`; a replay of a stored answer byte for byte + `Idempotent-Replayed: true` |
//! | `GET /v1/payments/{intent_id}` | `200` payment (this merchant's only), else `404` `payment_not_found` |
//! | `GET /healthz` | `200` while the process runs |
//! | `GET /readyz` | `200` when the store answers a read, else `503` `store_unavailable` (PostgreSQL down or slow included) |
//! | `GET /metrics` | Prometheus text |
//!
//! A payment is `{"intent_id", "order_id", "amount_cents", "currency", "status", "charge_id"}`
//! with `status` one of `running` (outcome not known yet), `succeeded`, `failed`.
//!
//! Errors are `application/problem+json` with a stable `code`:
//!
//! | status | code | when |
//! |---|---|---|
//! | 400 | `missing_idempotency_key`, `invalid_idempotency_key` | key absent, sent twice, or not 1-255 visible ASCII |
//! | 400 | `invalid_body` | the body is not JSON (the idempotency layer fingerprints it first) |
//! | 400 | `malformed_json`, `invalid_body`, `duplicate_field`, `unknown_field`, `missing_field`, `invalid_order_id`, `invalid_amount`, `invalid_currency` | see [`request`] |
//! | 400 | `invalid_grpc_timeout` | malformed `grpc-timeout` (no unit, 9 digits, zero) |
//! | 401 | `unauthenticated` + `WWW-Authenticate: Bearer` | keys configured and no, an unknown, or more than one bearer key |
//! | 402 | `payment_declined` | the PSP refused definitively (a 4xx): intent `failed`, nothing charged. 402 rather than 422: the request was valid, the payment was refused |
//! | 409 | `order_conflict` | the order already has a running or succeeded intent under another key; names `intent_id` |
//! | 409 | `idempotency_key_reused` | the key was used with other parameters; `fingerprint_prefix` |
//! | 409 | `request_in_progress` + `Retry-After` | the same key is still running when this request's budget ends (until then it waits for that answer, which it replays) |
//! | 413 | `body_too_large` | body over 1 MiB (decided on `Content-Length` before reading when present) |
//! | 415 | `grpc_on_http_port` | `Content-Type: application/grpc` on the HTTP port (gRPC has its own address) |
//! | 429 | `rate_limited` + `Retry-After` | the merchant is over `--tenant-rate` / `--tenant-burst` |
//! | 503 | `rate_limiter_unavailable` + `Retry-After` | `--redis` does not answer and `--redis-failure closed` |
//! | 502 | `psp_conflict` | the PSP holds the effect key with other parameters (never expected) |
//! | 503 | `overloaded` + `Retry-After` | the concurrency limit (`--max-inflight`, the adaptive one, or the slow start's ramp after an outage) is reached and no slot frees in time |
//! | 503 | `store_unavailable` + `Retry-After` | the store failed; retry with the same key |
//! | 503 | `psp_unavailable` + `Retry-After`, `intent_id` | the PSP charged nothing and the PSP client gave up (retry budget spent, PSP unreachable or pushing back): retry with the same key |
//! | 504 | `payment_outcome_unknown` + `Retry-After`, `"status": "unknown"`, `intent_id` | a charge was sent and no answer came: retry with the same key (the same effect key is re-sent; the PSP charges once) or `GET` the payment |
//! | 504 | `deadline_exceeded` | the request's own deadline passed (also before the store was reached: the key stays unused), or cannot cover a PSP round trip (checked before any write) |
//!
//! A running payment two minutes old is settled by [`crate::resolver`] (in the background and
//! on `GET`): charged, or its effect key voided at the PSP and the payment failed.
//!
//! # Layers
//!
//! One stack serves both routers ([`build_routers`]): HTTP and gRPC ([`crate::grpc`]) share the
//! gate, the merchants' buckets and the idempotency store. Outermost first: deadline (reads
//! `grpc-timeout` on arrival) -> metrics and request log ->
//! authentication ([`crate::auth`], sets the `Tenant`) -> fault injection (`--fault-abort-percent`,
//! off by default) -> per-merchant rate limit -> gate ->
//! idempotency (claims the key, scoped per merchant) -> handler. Health, readiness and metrics
//! routes bypass the stack.
//!
//! # Layout
//! - [`request`]: the `POST /v1/payments` body, validated with one problem code per mistake.
//! - [`trace`]: W3C `traceparent` read, generated and propagated.
//! - [`handlers`]: the route handlers.
//! - `payments`: the payment logic the HTTP handlers and the gRPC service share.
//! - `server`: [`Server`] (start-up, serving, draining) and [`serve`].
//! - `store`: [`PaymentStore`], the idempotency store on SQLite or PostgreSQL.

pub mod handlers;
mod leases;
pub(crate) mod payments;
pub mod protocol;
pub mod request;
mod server;
mod store;
pub mod trace;

pub use handlers::AppState;
pub use server::{RunningServer, ServeError, Server, prometheus_handle, serve};
pub use store::PaymentStore;

use std::time::Duration;

use axum::Router;
use axum::handler::Handler;
use axum::routing::{get, post};
use backstop::admission::redis::{RedisLimitError, RedisTokenBucket, SharedLimiter};
use backstop::admission::{FixedLimit, Gate, Gradient2, KeyedTokenBucket, Quota, SlowStart};
use backstop::idempotency::Store;
use backstop::server::listen::ConnectionInfo;
use backstop::server::{
    DeadlineLayer, FaultLayer, IdempotencyLayer, KeyedRoute, RateLimitLayer, ServerStack,
};
use http::Method;

use crate::auth::Authenticator;
use crate::config::{BODY_LIMIT, Config, LimitMode};
use crate::grpc;
use protocol::{OneProtocolLayer, Port};

/// Service label of the server metrics.
pub const SERVICE_NAME: &str = "payment";

/// Most merchants whose rate-limit buckets are held at once.
const MAX_TENANT_BUCKETS: std::num::NonZeroUsize = backstop::server::DEFAULT_MAX_TENANTS;

/// Shortest service time the gate keeps in reserve: a request whose budget cannot wait for a
/// slot and still get this much is refused at once.
const MIN_SERVICE: Duration = Duration::from_millis(20);

/// The per-merchant rate limit: buckets in Redis shared by all instances when `--redis` is set,
/// else in this process. Call it inside the runtime (Redis connects lazily, on first use).
pub fn rate_limit_layer(config: &Config) -> Result<RateLimitLayer, RedisLimitError> {
    let quota = Quota::per_second(config.tenant_rate, config.tenant_burst);
    Ok(match &config.redis {
        Some(redis) => RateLimitLayer::shared(SharedLimiter::new(
            RedisTokenBucket::new(redis, quota)?,
            config.redis_failure,
            config.instances,
        )),
        None => RateLimitLayer::new(KeyedTokenBucket::new(quota, MAX_TENANT_BUCKETS)),
    })
}

/// The two routers of the service, behind one server stack (so HTTP and gRPC share the gate,
/// the merchants' buckets and the idempotency store).
#[derive(Debug, Clone)]
pub struct Routers {
    /// HTTP: payment routes under the stack, `/healthz`, `/readyz` and `/metrics` beside it.
    pub http: Router,
    /// gRPC: `payment.v1.Payment` under the stack.
    pub grpc: Router,
}

/// Builds the router: payment routes under the full layer stack, `/healthz`, `/readyz` and
/// `/metrics` beside it. `store` is the idempotency store (the same database as the intents);
/// `rate_limit` is made by [`rate_limit_layer`].
pub fn build_app<St: Store>(
    state: AppState,
    store: St,
    config: &Config,
    rate_limit: RateLimitLayer,
) -> Router {
    build_routers(state, store, config, rate_limit).http
}

/// The admission gate `config` asks for: a fixed limit, or an adaptive one starting at its
/// upper bound; either behind a slow start unless it is turned off, and waiting through the
/// configured queue.
fn gate(config: &Config) -> Gate {
    let fixed = FixedLimit::new(config.max_inflight);
    let adaptive = || Gradient2::new(config.min_inflight, config.max_inflight);
    let gate = match (config.limit, config.slow_start) {
        (LimitMode::Fixed, None) => Gate::new(config.max_inflight, MIN_SERVICE),
        (LimitMode::Fixed, Some(floor)) => {
            Gate::with_limit(SlowStart::new(fixed, floor), MIN_SERVICE)
        }
        (LimitMode::Adaptive, None) => Gate::with_limit(adaptive(), MIN_SERVICE),
        (LimitMode::Adaptive, Some(floor)) => {
            Gate::with_limit(SlowStart::new(adaptive(), floor), MIN_SERVICE)
        }
    };
    gate.with_queue(config.queue.clone())
}

/// Builds the HTTP and the gRPC routers over one server stack (see [`Routers`]).
pub fn build_routers<St: Store>(
    state: AppState,
    store: St,
    config: &Config,
    rate_limit: RateLimitLayer,
) -> Routers {
    let auth = Authenticator::new(&config.api_keys);
    let keyed = KeyedRoute::new(config.key_ttl).lease(config.lease);
    let stack = ServerStack::new(SERVICE_NAME, store.clone())
        .deadline(DeadlineLayer::new(config.default_timeout))
        .tenant(auth.layer())
        // Validated by `Config::validate`; an invalid share injects nothing.
        .fault(
            FaultLayer::none()
                .abort_percent(config.fault_abort_percent)
                .unwrap_or_default(),
        )
        .rate_limit(rate_limit)
        .gate(gate(config))
        .idempotency(
            IdempotencyLayer::new(store)
                .clock(state.clock.clone())
                .max_body(BODY_LIMIT),
        )
        .keyed(Method::POST, "/v1/payments", keyed)
        .route(Method::GET, "/v1/payments/{intent_id}")
        .keyed(Method::POST, grpc::CHARGE, keyed)
        // Unary and small: its body is read before the gate, like Charge's.
        .buffered(Method::POST, grpc::GET_CHARGE)
        .peer_from(|ext| match ext.get::<ConnectionInfo>() {
            Some(connection) => Some(connection.peer()),
            None => ext
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|info| info.0),
        })
        .into_layer();

    // Requests no route takes are counted and logged too, as `unmatched`.
    let unmatched = stack.unmatched();
    let grpc = grpc::router(state.clone())
        .layer(stack.clone())
        .layer(OneProtocolLayer(Port::Grpc));

    let payments = Router::new()
        .route("/v1/payments", post(handlers::create_payment))
        .route("/v1/payments/{intent_id}", get(handlers::get_payment))
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .layer(stack)
        .with_state(state.clone());

    let http = Router::new()
        .route("/healthz", get(handlers::healthz))
        .route("/readyz", get(handlers::readyz))
        .route("/metrics", get(handlers::metrics))
        .method_not_allowed_fallback(handlers::method_not_allowed.layer(unmatched.clone()))
        .with_state(state)
        .merge(payments)
        .fallback(handlers::not_found.layer(unmatched))
        .layer(OneProtocolLayer(Port::Http));
    Routers { http, grpc }
}
