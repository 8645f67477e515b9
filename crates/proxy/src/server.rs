//! The proxy's wiring: the store, the library's server stack around the [`Forwarder`], the
//! listeners (the proxied port and the admin port), and the drain.
//!
//! Outermost first, a request meets: the listener (header read and idle timeouts, connection
//! cap, HTTP/1.1 and h2c), [`Front`] (a budget in a configured timeout header read as
//! `grpc-timeout`; the request's scope, a hash of its credentials (see [`super::scope`]); a
//! write of an `auto` route that carries a key sent under its route's keyed twin; a keyed
//! request moved onto a task of its own), then the library's
//! [`ServerStack`]: deadline, metrics and request log, rate limit, idempotency intake (key,
//! body, fingerprint; waits for a running attempt of the same key), the gate (bounded fair
//! queue, 503 + `Retry-After`), the idempotency layer (claim, replay, conflict, takeover), and
//! at the bottom the forwarder.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use backstop::admission::{FixedLimit, Gate, KeyedTokenBucket, QueueConfig, Quota, SlowStart};
use backstop::clock::SystemClock;
use backstop::db::sqlite::{Db, SqliteOptions};
use backstop::idempotency::Sweeper;
use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
use backstop::idempotency::sqlite::SqliteStore;
use backstop::server::listen::{ConnectionInfo, ListenConfig, Listener};
use backstop::server::problem::Protocol;
use backstop::server::{
    DEFAULT_MAX_TENANTS, DEFAULT_MIN_SERVICE, DeadlineLayer, IdempotencyLayer, RateLimitLayer,
    ServerStack,
};
use backstop_payment::config::StoreLocation;
use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tower::{BoxError, Layer, Service, ServiceExt};

use super::args::Settings;
use super::forward::{
    BoxFuture, ForwardSettings, Forwarder, OutcomeUnknown, ProxyStore, outcome_unknown,
};
use super::policy::{Keying, RouteTable};
use super::routes::{self, Routes};
use super::scope::ScopeHeaders;
use super::timeout_headers::{self, TimeoutHeaders};
use crate::hangups::Hangups;

/// `service` label of the request metrics.
pub(crate) const SERVICE_NAME: &str = "proxy";
/// `service` label of the proxied port's connection metrics.
const LISTENER_NAME: &str = "proxy-http";
/// `service` label of the admin port's connection metrics.
const ADMIN_NAME: &str = "proxy-admin";
/// Requests per second of a rate class the routes file gives no quota (the `default` class):
/// high enough never to be the limit.
const UNLIMITED: NonZeroU32 = NonZeroU32::new(1_000_000).unwrap();
/// Response headers a keyed answer is stored and replayed with, besides the library's
/// (`Content-Type`, `Location`).
const REPLAYED: [HeaderName; 6] = [
    header::CACHE_CONTROL,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::ETAG,
    header::LAST_MODIFIED,
    header::VARY,
];
/// How often the Prometheus recorder drains its histogram buffers.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Why the proxy did not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    /// An address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The SQLite store could not be opened.
    #[error("cannot open the store")]
    Db(#[source] backstop::db::sqlite::Error),
    /// The idempotency store could not be set up.
    #[error("cannot set up the idempotency store")]
    Store(#[source] backstop::idempotency::StoreError),
    /// The client stack towards the upstream refused the routes' policies.
    #[error("cannot build the client towards the upstream")]
    Client(#[source] backstop::client::StackError),
    /// An upstream endpoint's breaker could not be made.
    #[error("invalid upstream endpoint breaker")]
    Breaker(#[source] backstop::client::breaker::BreakerError),
    /// The fleet's retry switch could not watch Redis.
    #[error("--retry-switch-redis: {0}")]
    RetrySwitch(String),
    /// A listener's task failed.
    #[error("the proxy failed")]
    Serve(#[source] tokio::task::JoinError),
}

/// Binds both ports, opens the store, and proxies until `shutdown` resolves; then drains.
/// Each of `hangups` reloads the routes file.
pub(crate) async fn run(
    settings: Settings,
    hangups: Hangups,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ProxyError> {
    // Both ports first: a busy one fails before a store file is created.
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr)
            .await
            .map_err(|source| ProxyError::Bind { addr, source })
    };
    let listener = bind(settings.listen).await?;
    let admin = bind(settings.admin).await?;
    match &settings.store {
        StoreLocation::Sqlite(path) => {
            let db = Db::open(path, SqliteOptions::default()).map_err(ProxyError::Db)?;
            let store = SqliteStore::new(db).await.map_err(ProxyError::Store)?;
            serve(store, settings, hangups, listener, admin, shutdown).await
        }
        StoreLocation::Postgres(url) => {
            let store = PostgresStore::connect(url, PostgresOptions::default())
                .await
                .map_err(ProxyError::Store)?;
            serve(store, settings, hangups, listener, admin, shutdown).await
        }
    }
}

async fn serve<St: ProxyStore>(
    store: St,
    settings: Settings,
    hangups: Hangups,
    listener: TcpListener,
    admin: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ProxyError> {
    let metrics = prometheus_handle();
    let addr = local_addr(&listener, settings.listen)?;
    let admin_addr = local_addr(&admin, settings.admin)?;
    let table = &settings.table;
    // Watched for as long as the proxy serves (dropped with this function's frame).
    let (retry_switch, _switch_watch) = match &settings.retry_switch {
        Some((url, key)) => {
            let switch = backstop::retry::RetrySwitch::new();
            let watch = switch
                .watch_redis(url, key.clone(), backstop::retry::switch::DEFAULT_POLL)
                .map_err(|e| ProxyError::RetrySwitch(e.to_string()))?;
            (Some(switch), Some(watch))
        }
        None => (None, None),
    };
    let forwarder = Forwarder::<St>::new(
        &settings.upstreams,
        ForwardSettings {
            protocol: settings.protocol,
            table: table.clone(),
            max_timeout: settings.max_timeout,
            timeouts: settings.timeouts.clone(),
            margin: settings.margin,
            effect_key_header: settings.effect_key_header.clone(),
            idle_timeout: settings.upstream_idle_timeout,
            endpoint_breaker: settings.endpoint_breaker,
            retry_switch,
        },
    )?;
    let routes = forwarder.routes().clone();
    let stack = stack(store.clone(), &settings, &routes);
    let detached = Detached::default();
    let front = Front {
        stack: stack.layer(forwarder),
        routes: routes.clone(),
        timeouts: settings.timeouts.clone(),
        scopes: settings.scopes.clone(),
        detached: detached.clone(),
    };

    let sweeper = Sweeper::spawn(store, SystemClock, settings.sweep_every);
    let upkeep = {
        let metrics = metrics.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(UPKEEP_EVERY).await;
                metrics.run_upkeep();
            }
        })
    };
    let mut limits = ListenConfig::default();
    limits.max_connections = settings.max_connections;
    limits.drain_timeout = settings.drain_timeout;

    // The proxied port stops first; the admin port answers (`/readyz` 503, `/metrics`) until
    // the drain is over.
    let (stop_tx, stop_rx) = watch::channel(false);
    let (admin_stop_tx, admin_stop_rx) = watch::channel(false);
    let stopped = |mut stop_rx: watch::Receiver<bool>| async move {
        let _ = stop_rx.wait_for(|stop| *stop).await;
    };
    let (ready_tx, ready_rx) = watch::channel(true);
    let admin_service = Admin {
        metrics,
        ready: ready_rx,
    };
    let proxy_task = tokio::spawn(
        Listener::new(LISTENER_NAME, listener, limits.clone()).serve(front, stopped(stop_rx)),
    );
    let admin_task = tokio::spawn(
        Listener::new(ADMIN_NAME, admin, ListenConfig::default())
            .serve(admin_service, stopped(admin_stop_rx)),
    );
    let upstreams: Vec<String> = settings.upstreams.iter().map(ToString::to_string).collect();
    tracing::info!(
        listen = %addr,
        admin = %admin_addr,
        upstreams = ?upstreams,
        store = %settings.store.redacted(),
        routes = table.routes.len() - 1,
        keyed = table.routes.iter().filter(|r| r.policy.requires_key()).count(),
        scope = %settings.scopes.describe(),
        unrouted = %unrouted(table),
        "proxy listening"
    );
    let reloads = tokio::spawn(routes::reload_on_hangup(
        hangups,
        settings.config.clone(),
        routes,
    ));

    shutdown.await;
    reloads.abort();
    let _ = ready_tx.send(false);
    tracing::info!(
        drain_ms = settings.drain_timeout.as_millis() as u64,
        "shutting down: draining in-flight requests"
    );
    let _ = stop_tx.send(true);
    let proxied = proxy_task.await;
    // Keyed requests whose callers went away run on: give them the same bound to record
    // their answers.
    if tokio::time::timeout(settings.drain_timeout, detached.idle())
        .await
        .is_err()
    {
        tracing::warn!(
            running = detached.running(),
            "keyed requests still running after the drain: their keys answer outcome_unknown \
             once their leases end"
        );
    }
    let _ = admin_stop_tx.send(true);
    let admin = admin_task.await;
    sweeper.abort();
    upkeep.abort();
    tracing::info!("proxy stopped");
    proxied.map_err(ProxyError::Serve)?;
    admin.map_err(ProxyError::Serve)?;
    Ok(())
}

fn local_addr(listener: &TcpListener, addr: SocketAddr) -> Result<SocketAddr, ProxyError> {
    listener
        .local_addr()
        .map_err(|source| ProxyError::Bind { addr, source })
}

/// The library's server stack as the proxy configures it, reading the routes in effect.
fn stack<St: ProxyStore>(
    store: St,
    settings: &Settings,
    routes: &Routes,
) -> backstop::server::ServerStackLayer<St> {
    let table = &settings.table;
    // Whatever the upstream takes: JSON is compared in its canonical form, the rest byte for
    // byte.
    let mut idempotency = IdempotencyLayer::new(store.clone())
        .clock(SystemClock)
        .any_body(true)
        .max_replay_body(settings.max_replay_body);
    for name in REPLAYED.iter().chain(&table.replay_headers) {
        idempotency = idempotency.store_header(name.clone());
    }
    let queue = QueueConfig {
        max_waiters: settings.queue_size,
        ..QueueConfig::default()
    };
    // The scope (the tenant) and an `auto` route's keyed twin are the front's to set.
    ServerStack::new(SERVICE_NAME, store)
        .matched_path_from(keyed_twin)
        .deadline(DeadlineLayer::new(backstop::policy::DEFAULT_TIMEOUT).max(settings.max_timeout))
        .rate_limit(rate_limit(table))
        .gate(gate(settings).with_queue(queue))
        .idempotency(idempotency)
        .reloadable_policies(routes.server_policies().clone())
        .lease(settings.lease)
        .peer_from(|ext| ext.get::<ConnectionInfo>().map(ConnectionInfo::peer))
        .into_layer()
}

/// What becomes of a request no route names, in one line.
fn unrouted(table: &RouteTable) -> &'static str {
    match table.routes.last().map(|fallback| fallback.keying()) {
        Some(Keying::WhenSent) => {
            "a POST or PATCH carrying an Idempotency-Key is keyed; the rest passes through"
        }
        Some(Keying::Always) => "keyed: an Idempotency-Key is required",
        _ => "passed through as it came, an Idempotency-Key too",
    }
}

/// The admission gate: `--max-inflight` places, behind a slow start unless it is turned off
/// (the upstream failing most requests drops the limit to the floor, and it ramps back up as
/// they succeed again).
fn gate(settings: &Settings) -> Gate {
    match settings.slow_start {
        Some(floor) => Gate::with_limit(
            SlowStart::new(FixedLimit::new(settings.max_inflight), floor),
            DEFAULT_MIN_SERVICE,
        ),
        None => Gate::new(settings.max_inflight, DEFAULT_MIN_SERVICE),
    }
}

/// The path of the keyed twin of an `auto` route a request runs under, set by the [`Front`]:
/// the server stack looks its policy up there instead of at the request's path.
#[derive(Debug, Clone)]
struct KeyedTwin(Arc<str>);

fn keyed_twin(extensions: &http::Extensions) -> Option<&str> {
    extensions.get::<KeyedTwin>().map(|twin| &*twin.0)
}

/// The rate classes' buckets: the routes file's quotas, and no practical limit for the
/// `default` class unless it gives one.
fn rate_limit(table: &RouteTable) -> RateLimitLayer {
    let buckets = |quota: Quota| KeyedTokenBucket::new(quota, DEFAULT_MAX_TENANTS);
    let quota_of = |rate: NonZeroU32, burst: Option<NonZeroU32>| {
        Quota::per_second(rate, burst.unwrap_or(rate))
    };
    let default = table
        .rate_classes
        .get(backstop::policy::DEFAULT_RATE_CLASS)
        .map_or(Quota::per_second(UNLIMITED, UNLIMITED), |spec| {
            quota_of(spec.rate, spec.burst)
        });
    let mut layer = RateLimitLayer::new(buckets(default));
    for (class, spec) in &table.rate_classes {
        layer = layer.class(class.clone(), buckets(quota_of(spec.rate, spec.burst)));
    }
    layer
}

/// The process's Prometheus recorder (the library's duration metrics as histograms).
fn prometheus_handle() -> PrometheusHandle {
    let handle = backstop::observe::with_duration_buckets(PrometheusBuilder::new())
        .install_recorder()
        .unwrap_or_else(|error| {
            tracing::warn!(%error, "a metrics recorder was already installed; /metrics stays empty");
            PrometheusBuilder::new().build_recorder().handle()
        });
    backstop::observe::describe_metrics();
    backstop::observe::publish_build_info();
    handle
}

/// The body every answer of the proxied port is sent with.
type AnswerBody = UnsyncBoxBody<Bytes, BoxError>;

fn boxed<B>(response: Response<B>) -> Response<AnswerBody>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    response.map(|body| body.map_err(Into::into).boxed_unsync())
}

fn full(response: Response<Bytes>) -> Response<AnswerBody> {
    boxed(response.map(Full::new))
}

/// In front of the stack: a budget in a timeout header read as `grpc-timeout`, the scope
/// (the [`Tenant`](backstop::server::Tenant) every layer reads), an `auto` route's keyed
/// twin when the request is a write carrying a key, and a keyed request run on a task of its
/// own. Once a keyed request is forwarded its answer is worth recording whether or not its
/// caller still waits: a caller that timed out and retries with the same key then gets it
/// replayed instead of an unknown outcome. Its deadline still bounds it (the deadline layer
/// runs inside the task).
#[derive(Clone)]
struct Front<S> {
    stack: S,
    routes: Routes,
    timeouts: TimeoutHeaders,
    scopes: ScopeHeaders,
    detached: Detached,
}

impl<S, B> Service<Request<Incoming>> for Front<S>
where
    S: Service<Request<Incoming>, Response = Response<B>, Error = OutcomeUnknown>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<AnswerBody>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<AnswerBody>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Each request is sent through a clone of the stack, made ready then.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<Incoming>) -> Self::Future {
        if let Err(problem) = self.timeouts.read(&mut request) {
            let refusal = timeout_headers::refusal::<Bytes>(problem, request.headers());
            return Box::pin(async move { Ok(full(refusal)) });
        }
        let protocol = Protocol::of(request.headers());
        let keyed = {
            let generation = self.routes.current();
            let route = generation
                .table
                .route_for(request.method(), request.uri().path());
            let scope = self.scopes.scope_of(route.shared, request.headers());
            let twin = route
                .twin_for(request.method(), request.headers())
                .map(|twin| KeyedTwin(twin.clone()));
            let keyed = route.keying() == Keying::Always || twin.is_some();
            if let Some(twin) = twin {
                request.extensions_mut().insert(twin);
            }
            request.extensions_mut().insert(scope);
            keyed
        };
        let call = self.stack.clone().oneshot(request);
        let answer = move |result: Result<Response<B>, OutcomeUnknown>| match result {
            Ok(response) => boxed(response),
            Err(error) => full(outcome_unknown(&error, protocol)),
        };
        if !keyed {
            return Box::pin(async move { Ok(answer(call.await)) });
        }
        let running = self.detached.enter();
        let task = tokio::spawn(async move {
            let result = call.await;
            drop(running);
            result
        });
        Box::pin(async move {
            Ok(match task.await {
                Ok(result) => answer(result),
                Err(error) => {
                    tracing::error!(%error, "keyed request task failed");
                    full(
                        backstop::server::Problem::new(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "internal",
                        )
                        .into_response_for(protocol),
                    )
                }
            })
        })
    }
}

/// Keyed requests running on tasks of their own, counted so that shutdown can wait for them.
#[derive(Debug, Clone, Default)]
struct Detached {
    inner: Arc<DetachedInner>,
}

#[derive(Debug, Default)]
struct DetachedInner {
    running: AtomicUsize,
    idle: Notify,
}

/// One running keyed request; dropped when it ends.
struct Running(Arc<DetachedInner>);

impl Drop for Running {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Detached {
    fn enter(&self) -> Running {
        self.inner.running.fetch_add(1, Ordering::AcqRel);
        Running(self.inner.clone())
    }

    fn running(&self) -> usize {
        self.inner.running.load(Ordering::Acquire)
    }

    /// Resolves once none runs.
    async fn idle(&self) {
        loop {
            let notified = self.inner.idle.notified();
            if self.running() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// The admin port: `/metrics`, `/healthz`, `/readyz` (503 from the moment draining starts).
#[derive(Clone)]
struct Admin {
    metrics: PrometheusHandle,
    ready: watch::Receiver<bool>,
}

impl Service<Request<Incoming>> for Admin {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Incoming>) -> Self::Future {
        let text = |status: StatusCode, content_type: &'static str, body: String| {
            let mut response = Response::new(Full::new(Bytes::from(body)));
            *response.status_mut() = status;
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(content_type),
            );
            response
        };
        const PLAIN: &str = "text/plain; charset=utf-8";
        let response = match request.uri().path() {
            "/metrics" => text(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                self.metrics.render(),
            ),
            "/healthz" => text(StatusCode::OK, PLAIN, "ok\n".into()),
            "/readyz" if *self.ready.borrow() => text(StatusCode::OK, PLAIN, "ready\n".into()),
            "/readyz" => text(StatusCode::SERVICE_UNAVAILABLE, PLAIN, "draining\n".into()),
            _ => text(StatusCode::NOT_FOUND, PLAIN, "not found\n".into()),
        };
        std::future::ready(Ok(response))
    }
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin").finish_non_exhaustive()
    }
}
