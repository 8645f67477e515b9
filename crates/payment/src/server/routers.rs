//! [`build_routers`]: the HTTP and the gRPC routes behind one server stack, configured from
//! [`Config`], and the routes served beside it (health, readiness, metrics; on the gRPC port
//! `grpc.health.v1` and reflection).

use std::convert::Infallible;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::handler::Handler;
use axum::routing::{get, post};
use backstop::admission::redis::{RedisLimitError, RedisTokenBucket, SharedLimiter};
use backstop::admission::{
    FixedLimit, Gate, Gradient2, KeyedTokenBucket, Quota, Shedding, SlowStart,
};
use backstop::policy::ReloadablePolicies;
use backstop::server::listen::ConnectionInfo;
use backstop::server::{DeadlineLayer, FaultLayer, IdempotencyLayer, RateLimitLayer, ServerStack};
use futures_util::future::BoxFuture;
use http::Request;
use hyper::body::Incoming;
use tonic::service::Routes;
use tower::util::{BoxCloneService, MapRequestLayer};
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

use crate::auth::Authenticator;
use crate::config::{BODY_LIMIT, Config, LimitMode};
use crate::grpc;
use crate::grpc::health::{self, Health};
use crate::service::phases;
use crate::service::protocol::{OneProtocolLayer, Port};
use crate::service::{PaymentBackend, handlers, openapi};
use crate::state::AppState;

/// Service label of the server metrics.
pub const SERVICE_NAME: &str = "payment";

/// Most merchants whose rate-limit buckets are held at once.
const MAX_TENANT_BUCKETS: std::num::NonZeroUsize = backstop::server::DEFAULT_MAX_TENANTS;

/// Shortest service time the gate keeps in reserve: a request whose budget cannot wait for a
/// slot and still get this much is refused at once.
const MIN_SERVICE: Duration = Duration::from_millis(20);

/// The per-merchant rate limit: buckets in Redis shared by all instances when `--redis` is set,
/// else in this process. Call it inside the runtime (Redis connects lazily, on first use).
/// Each rate class of `config.rate_classes` gets buckets of its own (in Redis under the prefix
/// followed by the class's name).
pub fn rate_limit_layer(config: &Config) -> Result<RateLimitLayer, RedisLimitError> {
    let quota = Quota::per_second(config.tenant_rate, config.tenant_burst);
    let Some(redis) = &config.redis else {
        let buckets = |quota| KeyedTokenBucket::new(quota, MAX_TENANT_BUCKETS);
        let mut layer = RateLimitLayer::new(buckets(quota));
        for (class, &quota) in &config.rate_classes {
            layer = layer.class(class.clone(), buckets(quota));
        }
        return Ok(layer);
    };
    let shared = |redis: &backstop::admission::redis::RedisConfig, quota| {
        Ok::<_, RedisLimitError>(
            SharedLimiter::new(
                RedisTokenBucket::new(redis, quota)?,
                config.redis_failure,
                config.instances,
            )
            .timeout(config.redis_timeout),
        )
    };
    let mut layer = RateLimitLayer::shared(shared(redis, quota)?);
    for (class, &quota) in &config.rate_classes {
        let own = redis
            .clone()
            .prefix(format!("{}class:{class}:", redis.key_prefix()));
        layer = layer.shared_class(class.clone(), shared(&own, quota)?);
    }
    Ok(layer)
}

/// The two routers of the service, behind one server stack (so HTTP and gRPC share the gate,
/// the merchants' buckets and the idempotency store).
#[derive(Debug, Clone)]
pub struct Routers {
    /// HTTP: payment routes under the stack, `/healthz`, `/readyz` and `/metrics` beside it.
    pub http: Router,
    /// gRPC: `payment.v1.Payment` on tonic's own router, under the stack; `grpc.health.v1` and
    /// reflection beside it.
    pub grpc: GrpcService,
    /// The status `grpc.health.v1` reports: the server checks the store into it and drains it.
    pub health: Health,
    /// The method table the stack runs by, replaceable while it serves (a reload of the
    /// config file's `[policies]`; see [`check_policies`](crate::policies::check_policies) for what
    /// the service accepts).
    pub policies: ReloadablePolicies,
    /// The gate's record of its refusals: while it sheds under sustained overload, the
    /// listeners push clients away.
    pub shedding: Shedding,
}

pub use crate::grpc::server::GrpcService;

/// A response of the stack as the listener sends it.
fn boxed<B>(response: http::Response<B>) -> axum::response::Response
where
    B: hyper::body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<tower::BoxError>,
{
    response.map(axum::body::Body::new)
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
    let gate = gate.with_queue(config.queue.clone());
    // `Config::validate` refuses bad settings first; a gate built without it keeps the
    // default ones.
    match Shedding::new(config.shedding) {
        Ok(shedding) => gate.with_shedding(shedding),
        Err(_) => gate,
    }
}

/// The route template axum's router matched, for the stack's policy lookup.
fn matched_path(extensions: &http::Extensions) -> Option<&str> {
    extensions
        .get::<axum::extract::MatchedPath>()
        .map(axum::extract::MatchedPath::as_str)
}

/// Builds the HTTP and the gRPC routers over one server stack (see [`Routers`]).
pub fn build_routers<St: PaymentBackend>(
    state: AppState,
    store: St,
    config: &Config,
    rate_limit: RateLimitLayer,
) -> Routers {
    let auth = Authenticator::new(&config.api_keys);
    let policies = ReloadablePolicies::new(config.method_policies())
        .expect("Config::validate checked the table");
    let gate = gate(config);
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
        .gate(gate.clone())
        .idempotency(
            IdempotencyLayer::new(store)
                .clock(state.clock.clone())
                .max_body(BODY_LIMIT)
                .max_replay_body(config.max_replay_body),
        )
        // Which requests are keyed, their key TTL and their metric names: the same table the
        // clients use, looked up by the route axum matched (gRPC: by the method path).
        .reloadable_policies(policies.clone())
        .lease(config.lease)
        .matched_path_from(matched_path)
        .peer_from(|ext| match ext.get::<ConnectionInfo>() {
            Some(connection) => Some(connection.peer()),
            None => ext
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|info| info.0),
        })
        .into_layer();

    // Requests no route takes are counted and logged too, as `unmatched`.
    let unmatched = stack.unmatched();
    // tonic's router as it is: the stack's layers ask nothing of its bodies.
    let stacked = BoxCloneService::new(
        ServiceBuilder::new()
            .map_response(boxed)
            .layer(stack.clone())
            .map_request(phases::erase::<St, _>)
            .layer(grpc::unary_limit())
            .service(grpc::routes(state.clone())),
    );
    let health = Health::new();
    let grpc = BoxCloneService::new(OneProtocolLayer(Port::Grpc).layer(Beside {
        beside: health.routes(),
        stacked,
    }));

    let payments = Router::new()
        .route("/v1/payments", post(handlers::create_payment))
        .route("/v1/payments/{intent_id}", get(handlers::get_payment))
        .method_not_allowed_fallback(handlers::method_not_allowed.layer(unmatched.clone()))
        // On the routes alone: the stack sees the route axum matched and nothing else, so a
        // table entry no route serves is found by the coverage check.
        .route_layer(MapRequestLayer::new(phases::erase::<St, axum::body::Body>))
        .route_layer(stack)
        .with_state(state.clone());

    let http = Router::new()
        .route("/healthz", get(handlers::healthz))
        .route("/readyz", get(handlers::readyz))
        .route("/metrics", get(handlers::metrics))
        .route("/openapi.json", get(openapi::openapi_json))
        .method_not_allowed_fallback(handlers::method_not_allowed.layer(unmatched.clone()))
        .with_state(state)
        .merge(payments)
        .fallback(handlers::not_found.layer(unmatched))
        .layer(OneProtocolLayer(Port::Http));
    Routers {
        http,
        grpc,
        health,
        policies,
        shedding: gate.shedding(),
    }
}

/// The gRPC port's dispatch: health and reflection ([`health::is_beside`]) to their own router,
/// everything else through the server stack. A path-prefix match rather than one tonic router
/// for all services, because the stack wraps tonic's router whole (it sees every request
/// before any route is chosen), and probes must not meet its authentication, rate limit, gate
/// or metrics; a tower `Steer` would do the same with a picker closure and ready both sides
/// for every call.
#[derive(Clone)]
struct Beside {
    beside: Routes,
    stacked: GrpcService,
}

impl Service<Request<Incoming>> for Beside {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    /// The stack's readiness: payment calls, the hot path, are called on it directly (the
    /// listener calls each request on a fresh clone, so a probe dropping that readiness
    /// releases whatever it reserved).
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.stacked.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Incoming>) -> Self::Future {
        if health::is_beside(request.uri().path()) {
            let answer = self.beside.clone().oneshot(request);
            Box::pin(async move { answer.await.map(boxed) })
        } else {
            self.stacked.call(request)
        }
    }
}

impl std::fmt::Debug for Beside {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Beside").finish_non_exhaustive()
    }
}
