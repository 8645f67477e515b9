//! `grpc.health.v1.Health` and server reflection on the gRPC port, for the tools people already
//! run against gRPC services: Kubernetes' gRPC probes, `grpc_health_probe`, Envoy's health
//! checks, `grpcurl`, Postman.
//!
//! # Health
//!
//! [`Health`] holds the status of two names: `""` (the whole server) and `payment.v1.Payment`.
//! Both are
//! - `SERVING` while the intents store answers: the same ping `GET /readyz` makes, repeated
//!   every [`POLL_EVERY`] by the task [`Health::spawn`] starts (the server stops it with the
//!   rest of its background work);
//! - `NOT_SERVING` when the ping fails or takes longer than [`CHECK_TIMEOUT`], and before the
//!   first check;
//! - `NOT_SERVING` for good as soon as the server starts draining ([`Health::drain`]): a
//!   `Watch` stream open at that moment receives `NOT_SERVING` and then ends, so that it does
//!   not hold the drain open until its bound.
//!
//! Any other name is `NOT_FOUND`, as the protocol asks.
//!
//! # Reflection
//!
//! `grpc.reflection.v1.ServerReflection` and its predecessor `grpc.reflection.v1alpha` (which
//! older clients still ask for) describe `payment.v1` (the descriptor set `build.rs` emits,
//! [`FILE_DESCRIPTOR_SET`]), `grpc.health.v1` and reflection itself.
//!
//! # Beside the server stack
//!
//! [`Health::routes`] are served beside the server stack, like `/healthz` and `/readyz` on the HTTP
//! port: a probe needs no bearer key, is never rate-limited, never waits at the gate and is not
//! counted as payment traffic. The gRPC port sends the paths [`is_beside`] recognises to them
//! and everything else through the stack (see
//! [`build_routers`](crate::server::build_routers)).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::FutureExt;
use futures_util::stream::{self, Stream, StreamExt};
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;
use tonic::service::Routes;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;
use tonic_health::pb::health_check_response::ServingStatus as WireStatus;
use tonic_health::pb::health_server::{self, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::{HealthReporter, HealthService};

use super::proto::payment_server;
use crate::intents::Intents;

/// The encoded `FileDescriptorSet` of `proto/payment/v1/payment.proto`, written by `build.rs`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/payment_v1_descriptor.bin"));

/// The health name of the payment service (its full gRPC service name).
pub const PAYMENT_SERVICE: &str = payment_server::SERVICE_NAME;

/// How often [`Health::spawn`]'s task checks the store.
pub const POLL_EVERY: Duration = Duration::from_secs(1);

/// Longest wait for the store's answer: a slower one is `NOT_SERVING`.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// Path prefixes of the services served beside the stack.
const BESIDE: [&str; 3] = [
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
];

/// Whether a request for `path` goes to [`Health::routes`] rather than through the server stack.
pub fn is_beside(path: &str) -> bool {
    BESIDE.iter().any(|prefix| path.starts_with(prefix))
}

/// The serving status the health service reports (see the [module docs](self)). Cheap to
/// clone; clones share the status.
#[derive(Debug, Clone)]
pub struct Health {
    reporter: HealthReporter,
    /// `true` once draining started; status writes hold `writes`, so that a store check
    /// finishing after the drain cannot turn `SERVING` back on.
    draining: Arc<watch::Sender<bool>>,
    /// The status last written (`None`: not yet checked). A check that finds the status
    /// unchanged writes nothing: the reporter would send the same status again to every
    /// `Watch` stream, which asks for changes only.
    writes: Arc<Mutex<Option<bool>>>,
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

impl Health {
    /// Both names `NOT_SERVING` until the first [`Health::check`].
    pub fn new() -> Health {
        let reporter = HealthReporter::new();
        for name in ["", PAYMENT_SERVICE] {
            // Nothing else holds the reporter yet: its lock is free.
            reporter
                .set_service_status(name, ServingStatus::NotServing)
                .now_or_never()
                .expect("a new reporter's lock is free");
        }
        Health {
            reporter,
            draining: Arc::new(watch::channel(false).0),
            writes: Arc::new(Mutex::new(None)),
        }
    }

    /// Sets both names `SERVING` or `NOT_SERVING`; nothing once draining started.
    pub async fn set_serving(&self, serving: bool) {
        let mut written = self.writes.lock().await;
        if !self.is_draining() && *written != Some(serving) {
            self.set_both(serving).await;
            *written = Some(serving);
        }
    }

    /// Draining started: both names `NOT_SERVING` from now on, and open `Watch` streams end
    /// after saying so.
    pub async fn drain(&self) {
        let mut written = self.writes.lock().await;
        // The flag first: a `Watch` stream checks it before the status (see `watch`).
        self.draining.send_replace(true);
        self.set_both(false).await;
        *written = Some(false);
    }

    /// Whether [`Health::drain`] was called.
    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    async fn set_both(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for name in ["", PAYMENT_SERVICE] {
            self.reporter.set_service_status(name, status).await;
        }
    }

    /// Pings the store as `GET /readyz` does and sets the status from the answer; returns
    /// whether it answered within [`CHECK_TIMEOUT`].
    pub async fn check(&self, intents: &Intents) -> bool {
        let ready = match tokio::time::timeout(CHECK_TIMEOUT, intents.ping()).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "gRPC health: the store does not answer");
                false
            }
            Err(_) => {
                tracing::warn!(
                    timeout_ms = CHECK_TIMEOUT.as_millis() as u64,
                    "gRPC health: the store did not answer in time"
                );
                false
            }
        };
        self.set_serving(ready).await;
        ready
    }

    /// Checks the store every [`POLL_EVERY`] until draining starts (or the task is aborted).
    pub fn spawn(&self, intents: Intents) -> JoinHandle<()> {
        let health = self.clone();
        let mut draining = self.draining.subscribe();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(POLL_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = draining.wait_for(|draining| *draining) => return,
                    _ = every.tick() => {}
                }
                health.check(&intents).await;
            }
        })
    }

    /// `grpc.health.v1.Health` reporting this status, and server reflection (v1 and v1alpha),
    /// on tonic's router: to be served beside the server stack.
    pub fn routes(&self) -> Routes {
        let health = HealthServer::new(DrainingHealth {
            inner: HealthService::from_health_reporter(self.reporter.clone()),
            draining: self.draining.subscribe(),
        });
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let v1 = reflection()
            .build_v1()
            .expect("the payment and health descriptor sets are valid");
        let v1alpha = reflection()
            .build_v1alpha()
            .expect("the payment and health descriptor sets are valid");
        Routes::new(health).add_service(v1).add_service(v1alpha)
    }
}

/// tonic-health's service, whose `Watch` streams end once draining starts.
#[derive(Debug)]
struct DrainingHealth {
    inner: HealthService,
    draining: watch::Receiver<bool>,
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl health_server::Health for DrainingHealth {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.inner.check(request).await
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let statuses = self.inner.watch(request).await?.into_inner();
        let mut draining = self.draining.clone();
        let drained = async move {
            let _ = draining.wait_for(|draining| *draining).await;
        };
        // `take_until` looks at the drain before each status, and `Health::drain` raises it
        // before it writes: the `NOT_SERVING` of the drain is sent once, here, then the stream
        // ends.
        let last = HealthCheckResponse {
            status: WireStatus::NotServing as i32,
        };
        let stream = statuses
            .take_until(drained)
            .chain(stream::once(async move { Ok(last) }));
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use health_server::Health as _;

    use super::*;

    async fn status(service: &DrainingHealth, name: &str) -> WireStatus {
        service
            .check(Request::new(HealthCheckRequest {
                service: name.to_owned(),
            }))
            .await
            .expect("a known name")
            .into_inner()
            .status()
    }

    fn service(health: &Health) -> DrainingHealth {
        DrainingHealth {
            inner: HealthService::from_health_reporter(health.reporter.clone()),
            draining: health.draining.subscribe(),
        }
    }

    #[tokio::test]
    async fn follows_the_store_until_the_drain_and_never_after() {
        let health = Health::new();
        let service = service(&health);
        for name in ["", PAYMENT_SERVICE] {
            assert_eq!(
                status(&service, name).await,
                WireStatus::NotServing,
                "before a check"
            );
        }
        health.set_serving(true).await;
        assert_eq!(status(&service, PAYMENT_SERVICE).await, WireStatus::Serving);
        // The store stops answering.
        health.set_serving(false).await;
        assert_eq!(status(&service, "").await, WireStatus::NotServing);
        health.set_serving(true).await;

        let mut watch = service
            .watch(Request::new(HealthCheckRequest {
                service: String::new(),
            }))
            .await
            .unwrap()
            .into_inner();
        let first = watch.next().await.unwrap().unwrap();
        assert_eq!(first.status(), WireStatus::Serving);
        health.drain().await;
        // A check that answered just before the drain lands after it: ignored.
        health.set_serving(true).await;
        for name in ["", PAYMENT_SERVICE] {
            assert_eq!(
                status(&service, name).await,
                WireStatus::NotServing,
                "{name:?}"
            );
        }
        let last = watch.next().await.unwrap().unwrap();
        assert_eq!(last.status(), WireStatus::NotServing);
        assert!(
            watch.next().await.is_none(),
            "the stream ends after the drain"
        );
    }
}
