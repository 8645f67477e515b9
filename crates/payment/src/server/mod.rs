//! The payment server: the HTTP routes ([`crate::service`]) and the gRPC ones
//! ([`crate::grpc`]) behind one layer stack, their listeners, start-up and graceful shutdown.
//!
//! # Layers
//!
//! One stack serves both routers ([`build_routers`]): HTTP and gRPC share the
//! gate, the merchants' buckets and the idempotency store. Outermost first: deadline (reads
//! `grpc-timeout` on arrival) -> metrics and request log ->
//! authentication ([`crate::auth`], sets the `Tenant`) -> fault injection (`--fault-abort-percent`,
//! off by default) -> per-merchant rate limit -> gate ->
//! idempotency (claims the key, scoped per merchant) -> handler. Health, readiness and metrics
//! routes bypass the stack, and so do `grpc.health.v1` and server reflection on the gRPC port
//! ([`crate::grpc::health`]: `SERVING` while the store answers, `NOT_SERVING` from the moment
//! draining starts). The HTTP side is an axum router; the gRPC side is tonic's own router
//! ([`GrpcService`]), wrapped by the same stack directly.
//!
//! # Layout
//! - `routers`: [`build_routers`] and the layers it configures.
//! - `leases`: the idempotency store counting the keys it handed out, so that shutdown can wait
//!   for those of requests cut at the drain bound.
//! - this module: [`Server`] (start-up, serving, draining) and [`serve`].

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use backstop::clock::{Clock, SystemClock};
use backstop::db::postgres::Error as PgError;
use backstop::db::sqlite::{Db, Error as DbError, SqliteOptions};
use backstop::idempotency::Sweeper;
use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
use backstop::idempotency::sqlite::SqliteStore;
use backstop::observe;
use backstop::retry::RetryBudget;
use backstop::server::listen::{ListenConfig, Listener, PushAway};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

mod leases;
mod routers;

pub use self::routers::{GrpcService, Routers, SERVICE_NAME, build_routers, rate_limit_layer};

use self::leases::OpenLeases;
use crate::config::{Config, ConfigError, PspTarget, StoreLocation};
use crate::grpc::health::Health;
use crate::intents::Intents;
use crate::psp::{self, PspConfig, PspHandle};
use crate::psp_client::{ClientError, PspClient};
use crate::service::PaymentStore;
use crate::state::AppState;

/// Retry budget of the PSP client: 10 % of logical requests, burst 20.
const PSP_RETRY_RATIO: f64 = 0.1;
const PSP_RETRY_BURST: u32 = 20;
/// How often expired idempotency records are swept.
/// How often the PSP round trip is sampled for the deadline margin.
const PROBE_EVERY: Duration = Duration::from_secs(5);
/// Longest wait at shutdown for the keys of requests cut at the drain bound to be released.
const RELEASE_GRACE: Duration = Duration::from_secs(2);
/// `service` label of the HTTP listener's connection metrics.
const HTTP_LISTENER: &str = "payment-http";
/// How often the Prometheus recorder drains its histogram buffers.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Why the service did not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The configuration is refused.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The SQLite store could not be opened or migrated.
    #[error("cannot open the store")]
    Store(#[source] DbError),
    /// The PostgreSQL intent table could not be migrated.
    #[error("cannot set up the payment_intent table on PostgreSQL")]
    Postgres(#[source] PgError),
    /// The idempotency store could not be set up.
    #[error("cannot set up the idempotency store")]
    Idempotency(#[source] backstop::idempotency::StoreError),
    /// The embedded PSP did not start.
    #[error("cannot start the embedded PSP")]
    Psp(#[source] psp::PspError),
    /// The PSP client could not be built.
    #[error("cannot build the PSP client")]
    PspClient(#[source] ClientError),
    /// The Redis rate limiter could not be set up.
    #[error("cannot set up the Redis rate limiter")]
    RateLimit(#[source] backstop::admission::redis::RedisLimitError),
    /// The fleet's retry switch could not watch Redis.
    #[error("cannot watch the retry switch in Redis: {0}")]
    RetrySwitch(String),
    /// The HTTP or gRPC address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A listener's task failed.
    #[error("the server failed")]
    Serve(#[source] std::io::Error),
}

/// The Prometheus exporter's settings: the library's duration metrics as histograms over its
/// buckets (the exporter's default would render quantile summaries, which cannot be added up
/// across instances and cost a sketch update per sample).
fn prometheus_builder() -> PrometheusBuilder {
    observe::with_duration_buckets(PrometheusBuilder::new())
}

/// The process-wide Prometheus handle: installs the recorder on first use. If another global
/// recorder was installed first, the handle renders only what reaches it (nothing).
pub fn prometheus_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = prometheus_builder().build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics stays empty");
            } else {
                backstop::observe::describe_metrics();
                backstop::observe::publish_build_info();
                crate::resolver::describe_metrics();
            }
            handle
        })
        .clone()
}

/// A bound, ready-to-run payment service.
///
/// [`Server::bind`] binds both listeners first (so a busy port fails before anything is
/// created), then opens the store (running migrations) and starts the embedded PSP if needed:
/// when it returns, connections are accepted (they queue until [`Server::run`] serves them).
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    addr: SocketAddr,
    app: axum::Router,
    grpc: crate::grpc::server::Bound,
    grpc_router: GrpcService,
    health: Health,
    limits: ListenConfig,
    leases: OpenLeases,
    state: AppState,
    store: PaymentStore,
    psp: Option<PspHandle>,
    psp_url: String,
    policies: backstop::policy::ReloadablePolicies,
    background: Vec<JoinHandle<()>>,
}

impl Server {
    /// Validates `config`, binds the HTTP and gRPC ports, opens the store and starts or reaches
    /// the PSP.
    pub async fn bind(config: Config) -> Result<Server, ServeError> {
        config.validate()?;
        // Both ports first: a busy one must fail before a store or PSP file is created.
        let bind_error = |source| ServeError::Bind {
            addr: config.http,
            source,
        };
        let listener = TcpListener::bind(config.http).await.map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        let grpc = crate::grpc::server::Bound::bind(config.grpc)
            .await
            .map_err(|source| ServeError::Bind {
                addr: config.grpc,
                source,
            })?;

        let (store, intents) = match &config.store {
            StoreLocation::Sqlite(path) => {
                let db = Db::open(path, SqliteOptions::default()).map_err(ServeError::Store)?;
                let store = SqliteStore::new(db.clone())
                    .await
                    .map_err(ServeError::Idempotency)?;
                let intents = Intents::open(db).await.map_err(ServeError::Store)?;
                (PaymentStore::Sqlite(store), intents)
            }
            StoreLocation::Postgres(url) => {
                let store = PostgresStore::connect(url, PostgresOptions::default())
                    .await
                    .map_err(ServeError::Idempotency)?;
                let intents = Intents::postgres(store.pool().clone(), store.timeout())
                    .await
                    .map_err(ServeError::Postgres)?;
                (PaymentStore::Postgres(store), intents)
            }
        };

        let (psp, psp_url) = match &config.psp {
            PspTarget::Url(url) => (None, url.clone()),
            PspTarget::Embedded { db } => {
                let handle = psp::spawn(PspConfig {
                    db_path: Some(db.clone()),
                    ..PspConfig::default()
                })
                .await
                .map_err(ServeError::Psp)?;
                let url = handle.url();
                tracing::info!(psp = %url, db = %db.display(), "embedded PSP started");
                (Some(handle), url)
            }
        };
        // The recorder first: the PSP client registers its storm alarm's gauge when built.
        let metrics = prometheus_handle();
        let budget = RetryBudget::new(PSP_RETRY_RATIO, PSP_RETRY_BURST)
            .expect("constant retry budget is valid");
        // With Redis, the PSP client follows the fleet's retry switch (`backstop retries`);
        // the watch runs with the other background tasks.
        let (switch, switch_watch) = match &config.redis {
            Some(redis) => {
                let switch = backstop::retry::RetrySwitch::new();
                let watch = switch
                    .watch_redis(
                        redis.url(),
                        config.retry_switch_key.clone(),
                        backstop::retry::switch::DEFAULT_POLL,
                    )
                    .map_err(|e| ServeError::RetrySwitch(e.to_string()))?;
                (Some(switch), Some(watch))
            }
            None => (None, None),
        };
        let client =
            PspClient::with_retry_switch(&psp_url, budget, config.psp_margin_floor, switch)
                .map_err(ServeError::PspClient)?;

        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let state = AppState::new(intents, client.clone(), clock.clone(), metrics.clone());
        let rate_limit = rate_limit_layer(&config).map_err(ServeError::RateLimit)?;
        let leases = OpenLeases::new(store.clone());
        let Routers {
            http: app,
            grpc: grpc_router,
            health,
            policies,
            shedding,
        } = build_routers(state.clone(), leases.clone(), &config, rate_limit);
        // The first check before any connection is served: a probe never sees the status the
        // store has not been asked for yet.
        health.check(state.intents()).await;
        let mut limits = ListenConfig::default();
        limits.max_connections = config.max_connections;
        limits.drain_timeout = config.drain_timeout;
        limits.push_away = config
            .push_away
            .and_then(|share| PushAway::new(shedding).with_share(share).ok());

        let mut background = vec![Sweeper::spawn(
            store.clone(),
            SystemClock,
            config.sweep_every,
        )];
        background.push(tokio::spawn(async move {
            loop {
                if let Err(e) = client.probe_rtt(Duration::from_secs(1)).await {
                    tracing::debug!(error = %e, "PSP round-trip probe failed");
                }
                tokio::time::sleep(PROBE_EVERY).await;
            }
        }));
        background.extend(switch_watch.map(backstop::retry::switch::SwitchWatch::into_task));
        background.push(crate::resolver::spawn(state.clone()));
        background.push(health.spawn(state.intents().clone()));
        background.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(UPKEEP_EVERY).await;
                metrics.run_upkeep();
            }
        }));

        tracing::info!(
            http = %addr,
            grpc = %grpc.local_addr(),
            store = %config.store.redacted(),
            psp = %psp_url,
            open = config.is_open(),
            merchants = config.api_keys.len(),
            max_inflight = config.max_inflight,
            max_connections = config.max_connections,
            limit = %config.limit,
            "payment service listening"
        );
        if let Some(redis) = &config.redis {
            tracing::info!(
                redis = %redis.display_url(),
                failure = %config.redis_failure,
                instances = config.instances,
                "per-merchant rate limits shared through Redis"
            );
        }

        Ok(Server {
            listener,
            addr,
            app,
            grpc,
            grpc_router,
            health,
            limits,
            leases,
            state,
            store,
            psp,
            psp_url,
            policies,
            background,
        })
    }

    /// The bound HTTP address (the real port when the config said port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc.local_addr()
    }

    /// Base URL of the service, e.g. `http://127.0.0.1:8081`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The method table the server stack runs by: replace it to reload the policies without a
    /// restart (hold the new table to
    /// [`check_policies`](crate::policies::check_policies) first).
    pub fn policies(&self) -> &backstop::policy::ReloadablePolicies {
        &self.policies
    }

    /// Base URL of the PSP the service charges through.
    pub fn psp_url(&self) -> &str {
        &self.psp_url
    }

    /// The embedded PSP, when the service started one.
    pub fn embedded_psp(&self) -> Option<&PspHandle> {
        self.psp.as_ref()
    }

    /// The intent table.
    pub fn intents(&self) -> &Intents {
        self.state.intents()
    }

    /// The idempotency store.
    pub fn store(&self) -> &PaymentStore {
        &self.store
    }

    /// Serves until `shutdown` resolves, then stops accepting on both ports at once, lets
    /// in-flight requests finish on both concurrently (at most the configured drain time), waits
    /// briefly for the idempotency keys of the requests cut at that bound to be released, and
    /// stops the embedded PSP.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let Server {
            listener,
            app,
            grpc,
            grpc_router,
            health,
            limits,
            leases,
            psp,
            background,
            ..
        } = self;
        let (stop_tx, stop_rx) = watch::channel(false);
        let stopped = move || {
            let mut stop_rx = stop_rx.clone();
            async move {
                let _ = stop_rx.wait_for(|stop| *stop).await;
            }
        };
        let http = Listener::new(HTTP_LISTENER, listener, limits.clone());
        let http = tokio::spawn(http.serve(app, stopped()));
        let grpc = grpc.spawn(grpc_router, limits.clone(), stopped());
        shutdown.await;
        // Probes see the drain before the listeners stop accepting.
        health.drain().await;
        tracing::info!(
            drain_ms = limits.drain_timeout.as_millis() as u64,
            "shutting down: draining in-flight requests"
        );
        let _ = stop_tx.send(true);
        let (http, grpc) = tokio::join!(http, grpc);
        // Requests cut at the drain bound release their keys from tasks of their own: let them
        // land before the process ends, or the keys stay held for the lease.
        if tokio::time::timeout(RELEASE_GRACE, leases.settled())
            .await
            .is_err()
        {
            tracing::warn!(
                open = leases.open(),
                "idempotency keys still held after the drain"
            );
        }
        for task in background {
            task.abort();
        }
        if let Some(psp) = psp {
            psp.shutdown().await;
        }
        tracing::info!("payment service stopped");
        for joined in [http, grpc] {
            if let Err(join) = joined {
                if !join.is_cancelled() {
                    return Err(ServeError::Serve(std::io::Error::other(join)));
                }
            }
        }
        Ok(())
    }

    /// Runs the server on a background task; the returned handle stops it.
    pub fn spawn(self) -> RunningServer {
        let addr = self.addr;
        let grpc_addr = self.grpc_addr();
        let intents = self.state.intents().clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(self.run(async move {
            let _ = rx.await;
        }));
        RunningServer {
            addr,
            grpc_addr,
            intents,
            stop: Some(tx),
            task,
        }
    }
}

/// A server running on a background task (see [`Server::spawn`]).
#[derive(Debug)]
pub struct RunningServer {
    addr: SocketAddr,
    grpc_addr: SocketAddr,
    intents: Intents,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl RunningServer {
    /// The bound HTTP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// Base URL of the service.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The intent table.
    pub fn intents(&self) -> &Intents {
        &self.intents
    }

    /// Asks for a graceful shutdown and waits for it.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match (&mut self.task).await {
            Ok(r) => r,
            Err(join) => Err(ServeError::Serve(std::io::Error::other(join))),
        }
    }
}

/// Binds and serves `config` until `shutdown` resolves (see [`Server`]).
pub async fn serve(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    Server::bind(config).await?.run(shutdown).await
}
