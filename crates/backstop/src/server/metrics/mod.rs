//! Server metrics and the per-request log event (DESIGN section 6).
//!
//! [`MetricsLayer`] sits right inside the deadline layer, so it sees every request, including
//! the ones refused by the layers below it. Per request it records:
//!
//! - `rpc_server_requests_total{service,method,outcome}`: `outcome` is one of `ok`, `retryable`,
//!   `fatal`, `timeout`, `rejected`, derived from the HTTP status through
//!   [`status`](crate::status); a response carrying the [`Rejected`] extension (set by the rate
//!   limiter and the gate) counts as `rejected`;
//! - `rpc_server_duration_seconds{service,method,outcome}` (histogram);
//! - `rpc_server_inflight{service,method}` (gauge);
//! - one `tracing` event `rpc_server_request` with `service`, `method`, `status`, `outcome`,
//!   `duration_ms`, `deadline_remaining_ms`, `idempotency_key` (from the header, when it is a
//!   valid key) and `trace_id` (from a valid W3C `traceparent`).
//!
//! The `method` label is a route name such as `POST /v1/payments`, never the raw path: paths
//! carry ids and keys, and a label per id would grow the metric set without bound. Routes are
//! declared with [`MetricsLayer::route`] (`{param}` matches one segment) or named by a function
//! ([`MetricsLayer::route_name`]); anything else is labelled `"<METHOD> other"`.
//!
//! The layer also inserts a [`Route`] request extension so the layers below label their own
//! metrics (`rpc_server_rejected_total`, `idempotency_claims_total`) with the same `service` and
//! `method`.
//!
//! A request whose future is dropped before it answered is recorded too: as `timeout` / 504 when
//! its deadline had passed (the deadline layer cut it), else as a client cancellation (499).
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

pub mod future;
mod layer;

pub use self::layer::{MetricsLayer, RouteFn};

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Extensions, Request, Response};
use metrics::SharedString;
use tower_service::Service;

use self::future::ResponseFuture;
use self::layer::Shared;
use crate::deadline::Deadline;
use crate::observe::{self, label};

/// The `service` and `method` labels of a request, set by [`MetricsLayer`] as a request
/// extension and used by the layers below it for their own metrics.
#[derive(Debug, Clone)]
pub struct Route {
    service: SharedString,
    method: SharedString,
}

impl Route {
    /// Labels for a service and a route name.
    pub fn new(service: impl Into<SharedString>, method: impl Into<SharedString>) -> Self {
        Self {
            service: service.into(),
            method: method.into(),
        }
    }

    /// The labels of a request: its `Route` extension, or `unknown` / `unknown` when no
    /// [`MetricsLayer`] ran.
    pub fn from_extensions(extensions: &Extensions) -> Self {
        extensions.get::<Route>().cloned().unwrap_or_else(|| {
            Self::new(
                SharedString::const_str("unknown"),
                SharedString::const_str("unknown"),
            )
        })
    }

    /// The `service` label.
    pub fn service(&self) -> &str {
        &self.service
    }

    /// The `method` label (route name).
    pub fn method(&self) -> &str {
        &self.method
    }

    pub(crate) fn service_label(&self) -> SharedString {
        self.service.clone()
    }

    pub(crate) fn method_label(&self) -> SharedString {
        self.method.clone()
    }
}

/// Message of the per-request log event.
pub const EVENT: &str = "rpc_server_request";

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
        let route = Route {
            service: self.shared.service.clone(),
            method: self.shared.route_of(request.method(), request.uri().path()),
        };
        let deadline = request.extensions().get::<Deadline>().copied();
        let record = future::Record::start(route.clone(), deadline, request.headers());
        request.extensions_mut().insert(route);
        ResponseFuture::new(self.inner.call(request), record)
    }
}

/// The trace id of a W3C `traceparent` header (`00-<32 hex>-<16 hex>-<2 hex>`), if valid.
pub(crate) fn trace_id(traceparent: &str) -> Option<&str> {
    fn hex(s: &str, len: usize) -> bool {
        s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    }
    let mut parts = traceparent.split('-');
    let version = parts.next()?;
    let trace = parts.next()?;
    let parent = parts.next()?;
    let flags = parts.next()?;
    let rest = parts.next();
    let ok = hex(version, 2)
        && version != "ff"
        && (version != "00" || rest.is_none())
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(parent, 16)
        && parent.bytes().any(|b| b != b'0')
        && hex(flags, 2);
    ok.then_some(trace)
}

#[cfg(test)]
mod tests;
