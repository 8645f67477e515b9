//! Server metrics and the per-request log event.
//!
//! [`MetricsLayer`] sits right inside the deadline layer, so it sees every request, including
//! the ones refused by the layers below it. Per request it records:
//!
//! - `rpc_server_requests_total{service,method,attempt,outcome}`: `attempt` is the caller's
//!   attempt number, 1 + its `grpc-previous-rpc-attempts` header (absent: 1), labelled `"1"`
//!   to `"5"` then `"6+"` as the client labels its own ([`observe::attempt_label`]), so a
//!   dashboard splits the server's answers and latency by attempt as it splits the client's;
//!   `outcome` is one of `ok`, `retryable`,
//!   `fatal`, `timeout`, `rejected`, `cancelled`, read from the answer's head by
//!   [`Outcome::of_head`], as the client reads the same answer (its `grpc-status` if it has
//!   one, as every trailers-only gRPC error does, else its HTTP status; a 409 with a pushback
//!   is `retryable`, a bare 409 `fatal`). What the server alone knows comes first: a response
//!   carrying the [`Rejected`] extension (set by the rate limiter and the gate) counts as
//!   `rejected` (its caller sees a 503's `retryable`), and a problem answer as its own
//!   outcome says;
//! - `rpc_server_duration_seconds{service,method,attempt,outcome}` (histogram);
//! - `rpc_server_inflight{service,method}` (gauge);
//! - one `tracing` event `rpc_server_request` with `service`, `method`, `status`, `outcome`,
//!   `grpc_code` (gRPC calls only), `duration_ms` (to the microsecond), `deadline_remaining_ms`, `idempotency_key` (from the header, when it is a
//!   valid key), `attempt` (1 + the caller's `grpc-previous-rpc-attempts`), `peer` (see
//!   [`MetricsLayer::peer_from`]) and `trace_id` (from a valid W3C `traceparent`).
//!
//! The `method` label is a route name such as `POST /v1/payments`, never the raw path: paths
//! carry ids and keys, and a label per id would grow the metric set without bound. Routes are
//! declared with [`MetricsLayer::route`] (`{param}` matches one segment) or named by a function
//! ([`MetricsLayer::route_name`]); in a [`ServerStack`](crate::server::ServerStack) with
//! policies, a request is named by the entry of the table selected for it (once, by the
//! deadline layer), from the table in effect, so a route a reload adds is counted under its own
//! name at once. Anything else is labelled `"<METHOD> other"`. A router's
//! fallback (no route matched: 404, 405) goes under [`MetricsLayer::unmatched`], labelled
//! `"unmatched"`.
//!
//! The layer also inserts a [`Route`] request extension so the layers below label their own
//! metrics (`rpc_server_rejected_total`, `idempotency_claims_total`) with the same `service` and
//! `method`.
//!
//! A request whose future is dropped before it answered is recorded too: as `timeout` / 504 when
//! its deadline had passed (the deadline layer cut it), else as `cancelled` / 499 (the client
//! disconnected or reset the stream, as it does to a hedge that lost): not a server failure.
//!
//! The metric handles of a route are resolved once, from the recorder in effect when the route
//! first records, and kept (per outcome), so a request pays no registry lookup. A request
//! recorded under another recorder (a test's local recorder) takes the uncached path and is
//! counted where it belongs. Recorders are told apart by address: a layer should not outlive a
//! local recorder it served under and then serve under a new one. The idempotency key and the
//! trace id are read from the request only when the log event is enabled.
//!
//! ```
//! use backstop::server::metrics::MetricsLayer;
//! use http::Method;
//!
//! let layer = MetricsLayer::new("payments")
//!     .route(Method::POST, "/v1/payments")
//!     .route(Method::GET, "/v1/payments/{id}");
//! # let _ = layer;
//! ```

/// Target of the per-request log event (and, with `otel`, of its span).
const TARGET: &str = "backstop::server";

pub mod future;
mod layer;

pub use self::layer::{MetricsLayer, PeerFn, RouteFn, UNMATCHED};

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use http::{Extensions, Request, Response};
use metrics::{Counter, Gauge, Histogram, SharedString};
use tower_service::Service;

use self::future::ResponseFuture;
use self::layer::Shared;
use crate::deadline::Deadline;
use crate::observe::{self, Outcome, label};

/// The `service` and `method` labels of a request, set by [`MetricsLayer`] as a request
/// extension and used by the layers below it for their own metrics.
///
/// Cloning is cheap (one reference count): the metrics layer keeps one `Route` per route name
/// and hands out clones, which also carry the metric handles resolved for that route.
#[derive(Clone)]
pub struct Route {
    inner: Arc<RouteInner>,
}

struct RouteInner {
    service: SharedString,
    method: SharedString,
    /// Handles of this route's server metrics, resolved on first use (see [`Route::handles`]).
    handles: OnceLock<Handles>,
}

/// The server metric handles of one route, registered with one recorder.
struct Handles {
    /// Identity of the recorder the handles belong to (see [`observe::recorder_id`]).
    recorder: usize,
    inflight: Gauge,
    /// `rpc_server_requests_total` and `rpc_server_duration_seconds` per attempt label and
    /// outcome, registered on the first request with those labels (as the macros would),
    /// indexed by [`finished_index`].
    finished: [OnceLock<(Counter, Histogram)>; ATTEMPT_LABELS * Outcome::ALL.len()],
    /// `idempotency_claims_total` per claim result, indexed by [`claim_index`].
    claims: [OnceLock<Counter>; 4],
}

impl fmt::Debug for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Route")
            .field("service", &self.inner.service)
            .field("method", &self.inner.method)
            .finish()
    }
}

impl Route {
    /// Labels for a service and a route name.
    pub fn new(service: impl Into<SharedString>, method: impl Into<SharedString>) -> Self {
        Self {
            inner: Arc::new(RouteInner {
                service: service.into(),
                method: method.into(),
                handles: OnceLock::new(),
            }),
        }
    }

    /// The labels of a request: its `Route` extension, or `unknown` / `unknown` when no
    /// [`MetricsLayer`] ran.
    pub fn from_extensions(extensions: &Extensions) -> Self {
        static UNKNOWN: OnceLock<Route> = OnceLock::new();
        extensions.get::<Route>().cloned().unwrap_or_else(|| {
            UNKNOWN
                .get_or_init(|| {
                    Self::new(
                        SharedString::const_str("unknown"),
                        SharedString::const_str("unknown"),
                    )
                })
                .clone()
        })
    }

    /// The `service` label.
    pub fn service(&self) -> &str {
        &self.inner.service
    }

    /// The `method` label (route name).
    pub fn method(&self) -> &str {
        &self.inner.method
    }

    pub(crate) fn service_label(&self) -> SharedString {
        self.inner.service.clone()
    }

    pub(crate) fn method_label(&self) -> SharedString {
        self.inner.method.clone()
    }

    /// The route's metric handles for the recorder in effect now, registering them on first
    /// use; `None` when they belong to another recorder (the first one to serve the route keeps
    /// the cache; requests recorded elsewhere take the uncached path) or when the recorder is
    /// stateless (the no-op recorder).
    fn handles(&self) -> Option<&Handles> {
        let recorder = observe::recorder_id()?;
        let handles = self.inner.handles.get_or_init(|| Handles {
            recorder,
            inflight: metrics::gauge!(
                observe::RPC_SERVER_INFLIGHT,
                label::SERVICE => self.service_label(),
                label::METHOD => self.method_label(),
            ),
            finished: std::array::from_fn(|_| OnceLock::new()),
            claims: Default::default(),
        });
        (handles.recorder == recorder).then_some(handles)
    }

    /// Adds `delta` to `rpc_server_inflight`.
    pub(super) fn inflight(&self, delta: f64) {
        match self.handles() {
            Some(handles) => handles.inflight.increment(delta),
            None => metrics::gauge!(
                observe::RPC_SERVER_INFLIGHT,
                label::SERVICE => self.service_label(),
                label::METHOD => self.method_label(),
            )
            .increment(delta),
        }
    }

    /// Counts one finished request (`attempt` is 1-based) in `rpc_server_requests_total` and
    /// its duration in `rpc_server_duration_seconds`.
    pub(super) fn finished(&self, attempt: u32, outcome: Outcome, seconds: f64) {
        let resolve = || {
            (
                metrics::counter!(
                    observe::RPC_SERVER_REQUESTS_TOTAL,
                    label::SERVICE => self.service_label(),
                    label::METHOD => self.method_label(),
                    label::ATTEMPT => observe::attempt_label(attempt),
                    label::OUTCOME => outcome.as_str(),
                ),
                metrics::histogram!(
                    observe::RPC_SERVER_DURATION_SECONDS,
                    label::SERVICE => self.service_label(),
                    label::METHOD => self.method_label(),
                    label::ATTEMPT => observe::attempt_label(attempt),
                    label::OUTCOME => outcome.as_str(),
                ),
            )
        };
        match self.handles() {
            Some(handles) => {
                let (requests, duration) =
                    handles.finished[finished_index(attempt, outcome)].get_or_init(resolve);
                requests.increment(1);
                duration.record(seconds);
            }
            None => {
                let (requests, duration) = resolve();
                requests.increment(1);
                duration.record(seconds);
            }
        }
    }
}

impl Route {
    /// Counts one idempotency claim in `idempotency_claims_total{service,method,result}`.
    pub(crate) fn count_claim(&self, result: &'static str) {
        let resolve = || {
            metrics::counter!(
                observe::IDEMPOTENCY_CLAIMS_TOTAL,
                label::SERVICE => self.service_label(),
                label::METHOD => self.method_label(),
                label::RESULT => result,
            )
        };
        match (self.handles(), claim_index(result)) {
            (Some(handles), Some(i)) => handles.claims[i].get_or_init(resolve).increment(1),
            _ => resolve().increment(1),
        }
    }
}

/// Attempt labels a server sees: `"1"` to `"5"` and `"6+"` (never `"0"`).
const ATTEMPT_LABELS: usize = 6;

/// Index of an attempt's and an outcome's handles in [`Handles::finished`]: attempts past the
/// fifth share the `"6+"` label, and so one slot.
fn finished_index(attempt: u32, outcome: Outcome) -> usize {
    let attempt = (attempt.clamp(1, ATTEMPT_LABELS as u32) - 1) as usize;
    attempt * Outcome::ALL.len() + outcome.index()
}

fn claim_index(result: &str) -> Option<usize> {
    use observe::claim_result::{CLAIMED, CONFLICT, IN_PROGRESS, REPLAY};
    [CLAIMED, REPLAY, CONFLICT, IN_PROGRESS]
        .iter()
        .position(|r| *r == result)
}

/// Message of the per-request log event.
pub const EVENT: &str = observe::event::RPC_SERVER_REQUEST;

/// Response extension: the request was refused by admission control (rate limit, overload)
/// before any work started. The metrics layer counts such a response as outcome `rejected`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejected(pub &'static str);

impl Rejected {
    /// The `reason` label (`rate_limited`, `overloaded`).
    pub fn reason(&self) -> &'static str {
        self.0
    }
}

/// Counts a refusal in `rpc_server_rejected_total{service,method,reason}`.
pub(crate) fn count_rejected(route: &Route, reason: &'static str) {
    metrics::counter!(
        observe::RPC_SERVER_REJECTED_TOTAL,
        label::SERVICE => route.service_label(),
        label::METHOD => route.method_label(),
        label::REASON => reason,
    )
    .increment(1);
}

/// Records metrics and a log event for each request.
#[derive(Debug, Clone)]
pub struct Metrics<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> Metrics<S> {
    /// Wraps `inner`; see [`MetricsLayer`].
    pub fn new(inner: S, layer: &MetricsLayer) -> Self {
        Self {
            inner,
            shared: layer.shared(),
        }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Metrics<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        let route = self.shared.route_of(&mut request);
        let deadline = request.extensions().get::<Deadline>().copied();
        let record = future::Record::start(route.clone(), deadline, &request, self.shared.peer_fn);
        request.extensions_mut().insert(route);
        ResponseFuture::new(self.inner.call(request), record)
    }
}

#[cfg(feature = "otel")]
mod otel;
#[cfg(test)]
mod tests;
