//! Concurrency limit (the gate): bounded in-flight work, a bounded fair queue, 503 + `Retry-After`.
//!
//! [`GateLayer`] admits a request through an [`admission::Gate`](crate::admission::Gate). The
//! permit is acquired when the request is called (at once when the gate has room) or *inside the
//! response future* while it waits in the gate's queue, never in `poll_ready`: a request that
//! merely waits to be called holds nothing. It waits as its [`Tenant`]
//! (the request extension, else the default tenant), declaring its body length plus a fixed
//! overhead as its memory cost, and the queue decides: a request whose time left cannot
//! cover the expected service time is never served, one that waited too long while a standing
//! queue exists is dropped, and a tenant holding more than its share is refused.
//!
//! A refusal is 503 problem+json `overloaded` (`UNAVAILABLE`) with `Retry-After` (never 500:
//! overload is not a bug, and the client must back off), counted in
//! `rpc_server_rejected_total{reason}` with the queue's reason: `deadline`, `sojourn`, `full`,
//! `tenant_share`, or `overloaded` when the request did not queue. The wait is estimated from
//! the queue and the limit, with jitter; while the server sheds hard it is long, and a gRPC
//! answer says "do not retry" (`grpc-retry-pushback-ms: -1`), as it does under sustained
//! overload ([`Gate::shedding`]). A refused request counts once toward that overload. The permit is held until the
//! inner future completes or is dropped. A request served hands its permit back as finished
//! work, so its latency teaches an adaptive limit ([`Gate::with_limit`]) and the queue's
//! expected service time; a failure (500, 502, 503, gRPC `UNAVAILABLE`, `INTERNAL`, `UNKNOWN`,
//! `DATA_LOSS`) is handed back as failed, which a [`SlowStart`](crate::admission::SlowStart)
//! counts toward an outage and a latency limit treats like a dropped request (its caller went
//! away, or a timeout): counted only when it took longer than recent requests. A request
//! refused by the gate, or given up while waiting, never ran and teaches nothing; nor does an
//! answer whose outcome is `rejected` (the [`Outcome`](crate::status::Outcome) response
//! extension a [`Problem`] sets): a refusal by a layer inside the gate, or the caller's own
//! fault, such as a request body that broke on its way in
//! (`client::RequestBodyError`), which says nothing of serving
//! however long it took. What counts toward health, and what does not, is
//! [`crate::admission`]'s table.
//!
//! Behind a [`Listener`](super::listen::Listener), each request also tells its connection
//! whether its tenant is within its fair share of the gate ([`Gate::within_share`]; see
//! [`ConnectionInfo::set_within_share`]), so that push-away under sustained overload moves only
//! the connections of tenants over their share.
//!
//! A request without a [`Deadline`] extension (no deadline layer outside) is given
//! the timeout [`GateLayer::default_timeout`].

mod layer;

pub mod future;

pub use self::layer::GateLayer;

use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tower_service::Service;

use self::future::ResponseFuture;
use super::body::ResponseBody;
use super::listen::ConnectionInfo;
use super::metrics::{Rejected, Route, count_rejected};
use super::problem::{Problem, Protocol};
use super::tenant::Tenant;
use crate::admission::{Gate, Overloaded};
use crate::deadline::Deadline;
use crate::status::Status;

/// The `reason` label of a refusal by a full gate that did not queue the request; refusals by
/// the queue carry its reason (`deadline`, `sojourn`, `full`, `tenant_share`).
pub const REASON: &str = crate::observe::reject_reason::OVERLOADED;

/// Timeout of a request that reaches the gate without a [`Deadline`]: the one default
/// timeout of every method policy.
pub use crate::policy::DEFAULT_TIMEOUT;

/// Admits requests through a [`Gate`].
#[derive(Debug, Clone)]
pub struct GateService<S> {
    inner: S,
    gate: Gate,
    default_timeout: Duration,
}

impl<S> GateService<S> {
    /// Wraps `inner` with `gate`.
    pub fn new(inner: S, gate: Gate, default_timeout: Duration) -> Self {
        Self {
            inner,
            gate,
            default_timeout,
        }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for GateService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, Request<ReqBody>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Only the inner service's readiness: no permit is taken here.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // A free slot admits the request at once: the ready inner service is called here, so
        // it needs no clone and the request no waiting state.
        if let Some(permit) = self
            .gate
            .try_admit(Tenant::from_extensions(request.extensions()))
        {
            mark_connection(&request, permit.within_share());
            return ResponseFuture::admitted(self.inner.call(request), permit);
        }
        let deadline = request
            .extensions()
            .get::<Deadline>()
            .copied()
            .unwrap_or_else(|| Deadline::after(self.default_timeout));
        // The ready service goes into the future; `self` keeps a fresh clone (tower's idiom for
        // calling later).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(self.gate.clone(), deadline, inner, request)
    }
}

/// Tells the listener whether the request's tenant is within its share (see
/// [`ConnectionInfo::set_within_share`]), so that push-away spares a quiet tenant.
fn mark_connection<B>(request: &Request<B>, within_share: bool) {
    if let Some(info) = request.extensions().get::<ConnectionInfo>() {
        info.set_within_share(within_share);
    }
}

fn overloaded<B>(
    route: &Route,
    refused: Overloaded,
    protocol: Protocol,
) -> Response<ResponseBody<B>> {
    let reason = refused.reason_label();
    count_rejected(route, reason);
    let mut response = Problem::from_status(&Status::from(refused)).into_response_for(protocol);
    response.extensions_mut().insert(Rejected(reason));
    response
}

#[cfg(test)]
mod tests;
