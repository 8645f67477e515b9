//! Server-side tower layers: deadlines, metrics, tenants, rate limits, admission and
//! idempotency for any `http::Request -> http::Response` service (axum, hyper, tonic over
//! HTTP/2).
//!
//! Every layer answers its refusals itself as `application/problem+json` ([`problem`]) with a
//! stable `code`, never as an error: the services keep the inner service's error type. A
//! refusal needs a body the inner service did not make, so each layer answers with
//! [`body::ResponseBody`], the inner body untouched or a small body in memory; the layers
//! that read a request's body first (idempotency, [`grpc::UnaryLimit`]) hand the inner
//! service a [`body::RequestBody`]. Nothing is asked of the inner service's bodies beyond
//! [`http_body::Body<Data = Bytes>`](http_body::Body), so the layers wrap an axum `Router`,
//! tonic's server (`tonic::transport::Server::builder().layer(..)`) and a bare hyper service
//! alike. Every layer is `Clone` through shared state, so no `Buffer` is needed.
//!
//! The same stack serves gRPC: a request with `Content-Type: application/grpc` is refused in
//! gRPC's own form, a trailers-only response with `grpc-status`, `grpc-message` and
//! `grpc-retry-pushback-ms` where HTTP gets `Retry-After` ([`problem::Protocol`]); the
//! deadline comes from `grpc-timeout` either way; the idempotency layer reads the key from the
//! `idempotency-key` metadata, caps the message from its length prefix ([`grpc`]) and replays
//! stored answers with their trailers.
//!
//! # Order
//!
//! [`ServerStack`] composes the layers outermost first:
//!
//! 1. [`deadline`]: reads `grpc-timeout` the moment the request arrives. It goes first so that
//!    everything after it, queueing at the gate included, is paid out of the caller's time,
//!    and so that a late answer is cut at the deadline into a 504.
//! 2. [`metrics`]: sees every request, the refused ones too, and names the route once for the
//!    layers below.
//! 3. [`tenant`]: who is calling (authentication), needed by the rate limit and the
//!    idempotency scope.
//! 4. [`fault`]: injected faults for experiments (off by default): an aborted attempt spends
//!    no quota, holds no gate slot and leaves its idempotency key unused.
//! 5. [`rate_limit`]: a tenant over quota gets 429. Cheap rejections come first: a token
//!    bucket check costs nanoseconds and protects the gate from a single noisy tenant.
//! 6. [`idempotency::intake`]: reads a keyed request's key and body (bounded by the body cap
//!    and the deadline) before the gate, so a client sending its body slowly, or never
//!    finishing it, holds no permit another tenant needs; and waits, holding no permit, for a
//!    running attempt with the same key to finish, then has its answer replayed.
//! 7. [`concurrency`] (the gate): our own capacity; 503 when the request could not start before its deadline.
//! 8. [`idempotency`]: last, so that every request refused above (bad deadline, over quota,
//!    overloaded) leaves its key unused and the client's retry with the same key starts fresh;
//!    and only admitted requests pay for a store round trip. A keyed request with less time
//!    left than the gate's minimal service time is refused here before its claim
//!    ([`IdempotencyLayer::min_time_left`]), so it leaves its key unused too.
//!
//! # Which requests are keyed
//!
//! A method is described once, in the [`MethodPolicies`] table its clients use too
//! ([`ServerStack::policies`]): a request whose policy is `Keyed` must carry an
//! `Idempotency-Key` and is deduplicated, its records kept for the policy's key TTL; the
//! table's gRPC paths and HTTP routes name the requests in the metrics. There is no second
//! list of routes to keep in step with the table.
//!
//! The table is looked up in one place, the idempotency layer (which the intake shares), by
//! the request's method and
//!
//! - for gRPC, its path, `/package.Service/Method`: tonic's router does nothing more;
//! - for HTTP, the route template the application's router matched, when the stack runs
//!   after routing and is told where to find it ([`ServerStack::matched_path_from`]; with
//!   axum, `MatchedPath`). Put it on the routes with axum's `Router::route_layer`: each route
//!   is wrapped after the match, so the stack sees exactly the route whose handler will run,
//!   `{*rest}` templates and all, and a request no route takes never reaches it
//!   (`Router::layer` wraps the fallback too, where the path is matched against the table);
//! - else (the stack in front of the router, as on tonic's server) the request's path,
//!   matched against the table's route templates, `{param}` matching one segment.
//!
//! A `Keyed` method that reaches its handler unclaimed is caught twice. At run time the
//! handler refuses it: only a claim puts the
//! [`IdempotencyKey`](crate::idempotency::IdempotencyKey) extension on a request, and a
//! handler of a keyed method requires it. Before that, in a test or at start-up,
//! [`idempotency::coverage`] sends each keyed entry of the table through the finished service
//! without a key and reports every entry the idempotency layer did not refuse: one no route
//! serves (the table and the router disagree on its spelling) or one that went past the
//! layer unclaimed.
//!
//! # On tonic, hyper and axum
//!
//! The stack, and each layer alone, goes wherever a tower layer goes: on tonic's own server
//! in front of generated services, around an axum `Router`, or in front of a hyper
//! `service_fn` served through `hyper_util::service::TowerToHyperService`. The service
//! behind it gets requests with a [`ServerStackBody`] (see [`body`] for services that take
//! a single body type).
//!
//! ```no_run
//! use backstop::idempotency::MemoryStore;
//! use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
//! use backstop::server::ServerStack;
//!
//! # async fn serve(routes: tonic::service::Routes) -> Result<(), tonic::transport::Error> {
//! let charge = MethodPolicy::builder("Charge", Idempotency::Keyed)
//!     .key_ttl(KEY_TTL_PAYMENTS)
//!     .build();
//! let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
//!     .method("/payment.v1.Payment/Charge", charge)
//!     .validated()
//!     .unwrap();
//! let stack = ServerStack::new("payments", MemoryStore::new())
//!     .policies(policies)
//!     .into_layer();
//! tonic::transport::Server::builder()
//!     .layer(stack)
//!     .add_routes(routes)
//!     .serve("127.0.0.1:50051".parse().unwrap())
//!     .await
//! # }
//! ```
//!
//! # Example
//!
//! ```
//! use backstop::admission::Gate;
//! use backstop::idempotency::MemoryStore;
//! use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
//! use backstop::server::ServerStack;
//! use http::Method;
//! use std::time::Duration;
//!
//! let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
//!     .route(
//!         Method::POST,
//!         "/v1/payments",
//!         MethodPolicy::builder("CreatePayment", Idempotency::Keyed)
//!             .key_ttl(KEY_TTL_PAYMENTS)
//!             .build(),
//!     )
//!     .route(
//!         Method::GET,
//!         "/v1/payments/{id}",
//!         MethodPolicy::builder("GetPayment", Idempotency::Safe).build(),
//!     )
//!     .validated()
//!     .unwrap();
//! let stack = ServerStack::new("payments", MemoryStore::new())
//!     .policies(policies)
//!     .lease(Duration::from_secs(5))
//!     .gate(Gate::new(256, Duration::from_millis(20)));
//! let layer = stack.into_layer();
//! # let _ = layer;
//! ```

pub mod body;
pub mod concurrency;
pub mod deadline;
pub mod fault;
pub mod grpc;
pub mod idempotency;
pub mod listen;
pub mod metrics;
pub mod problem;
pub mod rate_limit;
pub mod tenant;

mod reject;
mod select;
#[cfg(test)]
pub(crate) mod testing;

pub use self::concurrency::GateLayer;
pub use self::deadline::DeadlineLayer;
pub use self::fault::FaultLayer;
pub use self::idempotency::{IdempotencyLayer, KeyedRoute};
pub use self::metrics::MetricsLayer;
pub use self::problem::Problem;
pub use self::rate_limit::RateLimitLayer;
pub use self::select::MatchedPathFn;
pub use self::tenant::{Tenant, TenantLayer};

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use tower::ServiceBuilder;
use tower_layer::Layer;

use crate::admission::{Gate, KeyedTokenBucket, Quota};
use crate::idempotency::Store;
use crate::policy::{MethodPolicies, ReloadablePolicies};
use crate::status::Status;

/// Default concurrency limit of the stack's gate.
pub const DEFAULT_MAX_INFLIGHT: usize = 1024;

/// Default minimal service time: the gate does not admit a request with less time left.
pub const DEFAULT_MIN_SERVICE: Duration = Duration::from_millis(5);

/// Default per-tenant rate (requests per second) of the stack's rate limit.
pub const DEFAULT_TENANT_RATE: NonZeroU32 = NonZeroU32::new(100).unwrap();

/// Default per-tenant burst of the stack's rate limit.
pub const DEFAULT_TENANT_BURST: NonZeroU32 = NonZeroU32::new(200).unwrap();

/// Default number of tenants whose buckets are kept.
pub const DEFAULT_MAX_TENANTS: NonZeroUsize = NonZeroUsize::new(10_000).unwrap();

/// Builder of the full server stack; see the [module docs](self) for the order.
///
/// Each part has a default and can be replaced wholesale ([`ServerStack::deadline`],
/// [`ServerStack::metrics`], [`ServerStack::tenant`], [`ServerStack::fault`],
/// [`ServerStack::rate_limit`],
/// [`ServerStack::gate`], [`ServerStack::idempotency`]); [`ServerStack::into_layer`] finishes.
#[derive(Debug, Clone)]
pub struct ServerStack<St> {
    policies: Option<select::TableSource>,
    lease: Option<Duration>,
    matched_path: Option<MatchedPathFn>,
    deadline: DeadlineLayer,
    metrics: MetricsLayer,
    tenant: TenantLayer,
    fault: FaultLayer,
    rate_limit: RateLimitLayer,
    gate: GateLayer,
    idempotency: IdempotencyLayer<St>,
}

impl<St: Store> ServerStack<St> {
    /// A stack labelled `service` keeping idempotency records in `store`, with the defaults:
    /// 10 s deadline (60 s max), no route names, no tenant resolution, 100 req/s per tenant
    /// with bursts of 200, 1024 requests in flight with a 5 ms minimal service time, and no keyed
    /// methods until it is given its [policies](Self::policies).
    pub fn new(service: impl Into<String>, store: St) -> Self {
        Self {
            policies: None,
            lease: None,
            matched_path: None,
            deadline: DeadlineLayer::default(),
            metrics: MetricsLayer::new(service),
            tenant: TenantLayer::none(),
            fault: FaultLayer::none(),
            rate_limit: RateLimitLayer::new(default_buckets()),
            gate: GateLayer::new(Gate::new(DEFAULT_MAX_INFLIGHT, DEFAULT_MIN_SERVICE)),
            idempotency: IdempotencyLayer::new(store),
        }
    }

    /// Replaces the deadline layer.
    pub fn deadline(mut self, layer: DeadlineLayer) -> Self {
        self.deadline = layer;
        self
    }

    /// Names where the log event's `peer` comes from (see [`MetricsLayer::peer_from`]).
    pub fn peer_from(mut self, f: metrics::PeerFn) -> Self {
        self.metrics = self.metrics.peer_from(f);
        self
    }

    /// Replaces the metrics layer.
    pub fn metrics(mut self, layer: MetricsLayer) -> Self {
        self.metrics = layer;
        self
    }

    /// Replaces the tenant layer.
    pub fn tenant(mut self, layer: TenantLayer) -> Self {
        self.tenant = layer;
        self
    }

    /// Resolves the tenant from the request head (see [`TenantLayer::from_fn`]).
    pub fn authenticate<F>(self, resolve: F) -> Self
    where
        F: Fn(&http::request::Parts) -> Result<Tenant, Status> + Send + Sync + 'static,
    {
        self.tenant(TenantLayer::from_fn(resolve))
    }

    /// Injects faults (for experiments; none by default).
    pub fn fault(mut self, layer: FaultLayer) -> Self {
        self.fault = layer;
        self
    }

    /// Replaces the rate limit layer.
    pub fn rate_limit(mut self, layer: RateLimitLayer) -> Self {
        self.rate_limit = layer;
        self
    }

    /// Uses `buckets` for the per-tenant rate limit.
    pub fn tenant_buckets(self, buckets: KeyedTokenBucket) -> Self {
        self.rate_limit(RateLimitLayer::new(buckets))
    }

    /// Uses `gate` for admission.
    pub fn gate(mut self, gate: Gate) -> Self {
        self.gate = GateLayer::new(gate);
        self
    }

    /// Replaces the gate layer.
    pub fn gate_layer(mut self, layer: GateLayer) -> Self {
        self.gate = layer;
        self
    }

    /// Replaces the idempotency layer.
    pub fn idempotency(mut self, layer: IdempotencyLayer<St>) -> Self {
        self.idempotency = layer;
        self
    }

    /// The methods' policies, the same table the clients use, and the stack's only list of
    /// methods: a request without `grpc-timeout` gets its method's timeout (see
    /// [`DeadlineLayer::policies`]), its `Keyed` methods are the keyed routes and its
    /// `buffer_body` ones are read before the gate (see [`IdempotencyLayer::policies`]), the
    /// rate limit spends from each
    /// method's rate class (see [`RateLimitLayer::class`]), and its gRPC paths (as `POST`)
    /// and HTTP routes are named in the metrics (by the table in effect, after a reload too). Applied when the layer is made, whatever
    /// [`ServerStack::deadline`], [`ServerStack::idempotency`], [`ServerStack::rate_limit`]
    /// or [`ServerStack::metrics`] replaced.
    pub fn policies(mut self, policies: MethodPolicies) -> Self {
        self.policies = Some(select::TableSource::from(policies));
        self
    }

    /// [`policies`](Self::policies) from a table that may be replaced while the stack serves
    /// (a reload of its configuration): each request runs by the table in effect when it
    /// arrived, in every layer.
    pub fn reloadable_policies(mut self, policies: ReloadablePolicies) -> Self {
        self.policies = Some(select::TableSource::Reloadable(policies));
        self
    }

    /// The claim lease of the [policies](Self::policies)' keyed methods (default 5 s).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Where the route template the application's router matched is found (see
    /// [`IdempotencyLayer::matched_path_from`]); with axum,
    /// `|ext| ext.get::<MatchedPath>().map(MatchedPath::as_str)`.
    pub fn matched_path_from(mut self, f: MatchedPathFn) -> Self {
        self.matched_path = Some(f);
        self
    }

    /// The finished layer.
    pub fn into_layer(mut self) -> ServerStackLayer<St> {
        if let Some(source) = self.policies.take() {
            self.metrics = self
                .metrics
                .policies_shared(source.clone(), self.matched_path);
            self.deadline = self
                .deadline
                .policies_shared(source.clone(), self.matched_path);
            self.rate_limit = self
                .rate_limit
                .policies_shared(source.clone(), self.matched_path);
            self.idempotency = self.idempotency.policies_shared(source);
        }
        if let Some(lease) = self.lease {
            self.idempotency = self.idempotency.lease(lease);
        }
        if let Some(f) = self.matched_path {
            self.idempotency = self.idempotency.matched_path_from(f);
        }
        // A keyed request the gate would not have let wait for a slot is not worth a claim.
        if !self.idempotency.has_min_time_left() {
            let min_service = self.gate.gate().min_service();
            self.idempotency = self.idempotency.min_time_left(min_service);
        }
        self.gate
            .gate()
            .publish_as(self.metrics.service().to_owned());
        ServerStackLayer { parts: self }
    }
}

fn default_buckets() -> KeyedTokenBucket {
    KeyedTokenBucket::new(
        Quota::per_second(DEFAULT_TENANT_RATE, DEFAULT_TENANT_BURST),
        DEFAULT_MAX_TENANTS,
    )
}

/// The service the stack makes of an inner service `S`.
pub type ServerStackService<S, St> = deadline::DeadlineService<
    metrics::Metrics<
        tenant::SetTenant<
            fault::Fault<
                rate_limit::RateLimit<
                    idempotency::intake::Intake<
                        concurrency::GateService<idempotency::IdempotencyService<S, St>>,
                        St,
                    >,
                >,
            >,
        >,
    >,
>;

/// The request body the service behind a [`ServerStackLayer`] gets for a request that arrived
/// with body `B`: the bytes the idempotency intake read (keyed and buffered routes), or `B`
/// unread. Axum's `Router` and tonic's servers take any such body; see [`body`] to convert it
/// for a service that takes only one body type.
pub type ServerStackBody<B> = body::RequestBody<body::RequestBody<B>>;

/// The composed layer made by [`ServerStack::into_layer`]: deadline → metrics → tenant →
/// fault → rate limit → idempotency intake → gate → idempotency → your service.
#[derive(Debug, Clone)]
pub struct ServerStackLayer<St> {
    parts: ServerStack<St>,
}

impl<St> ServerStackLayer<St> {
    /// The stack's metrics layer alone, labelling every request `unmatched` (see
    /// [`MetricsLayer::unmatched`]): for the router's fallback, so requests no route takes
    /// are counted and logged under the same `service` without running admission control or
    /// idempotency.
    pub fn unmatched(&self) -> MetricsLayer {
        self.parts.metrics.clone().unmatched()
    }
}

impl<S, St: Store> Layer<S> for ServerStackLayer<St> {
    type Service = ServerStackService<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        let p = &self.parts;
        ServiceBuilder::new()
            .layer(p.deadline.clone())
            .layer(p.metrics.clone())
            .layer(p.tenant.clone())
            .layer(p.fault.clone())
            .layer(p.rate_limit.clone())
            .layer(p.idempotency.intake())
            .layer(p.gate.clone())
            .layer(p.idempotency.clone())
            .service(inner)
    }
}

#[cfg(test)]
mod tests;
