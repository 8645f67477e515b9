//! Fault injection for experiments, in the style of Envoy's fault filter: abort a share of the
//! requests with a chosen status, and delay a share of them.
//!
//! [`FaultLayer`] decides per request, independently: first whether to delay it (by a fixed
//! duration, before the inner service is called; the request's deadline still runs, so the
//! deadline layer outside may cut it), then whether to abort it. An aborted request never
//! reaches the inner service and is answered with the configured [`Status`] (by default
//! `UNAVAILABLE` / 503 problem+json `fault_injected`, without `Retry-After`: it plays a random
//! failure, not a refusal), in gRPC's form for a gRPC request. Each injected fault is counted in
//! `rpc_server_faults_injected_total{service,method,fault}` (`fault` one of `abort`, `delay`).
//!
//! In [`ServerStack`](super::ServerStack) it sits after authentication and before the rate
//! limit, the gate and idempotency: an aborted attempt spends no quota, holds no gate slot,
//! teaches the concurrency limit nothing, and leaves its idempotency key unused, so the
//! client's retry with the same key starts fresh. Off by default ([`FaultLayer::none`]): a
//! request then costs one branch.
//!
//! The draws come from one generator per layer (clones share it); [`FaultLayer::seeded`] makes
//! them reproducible, which is what tests want. It is meant for experiments, not production.
//!
//! ```
//! use std::time::Duration;
//! use backstop::server::fault::FaultLayer;
//!
//! // Abort 10 % of the requests with 503, delay 5 % of them by 200 ms.
//! let layer = FaultLayer::none()
//!     .abort_percent(10.0)
//!     .unwrap()
//!     .delay(5.0, Duration::from_millis(200))
//!     .unwrap()
//!     .seeded(7);
//! assert_eq!(layer.abort_share(), 10.0);
//! assert!(FaultLayer::none().abort_percent(101.0).is_err());
//! ```

mod layer;

pub mod future;

pub use self::layer::{FaultError, FaultLayer};

use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use rand::RngExt;
use rand::rngs::StdRng;
use tower_service::Service;

use self::future::ResponseFuture;
use super::body::ResponseBody;
use super::metrics::Route;
use super::problem::{Problem, Protocol};
use crate::status::{Code, Status};

pub use crate::observe::RPC_SERVER_FAULTS_INJECTED_TOTAL;

/// The problem code of the default abort.
pub const FAULT_INJECTED: &str = "fault_injected";

/// The default abort: `UNAVAILABLE` / 503, problem `fault_injected`, no pushback.
pub fn default_abort() -> Status {
    Status::new(Code::Unavailable, "fault injected").with_problem(FAULT_INJECTED)
}

/// What the layer injects, shared by its clones.
#[derive(Debug)]
struct Faults {
    /// Percentage of requests aborted, in `0..=100`.
    abort_percent: f64,
    abort: Status,
    /// Percentage of requests delayed, in `0..=100`.
    delay_percent: f64,
    delay: Duration,
    rng: Mutex<StdRng>,
}

impl Faults {
    /// Draws this request's faults: the delay, if any, and whether it is aborted.
    fn draw(&self) -> (Option<Duration>, bool) {
        let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        let delayed = self.delay_percent > 0.0 && rng.random::<f64>() * 100.0 < self.delay_percent;
        let aborted = self.abort_percent > 0.0 && rng.random::<f64>() * 100.0 < self.abort_percent;
        (delayed.then_some(self.delay), aborted)
    }
}

/// Injects the faults of a [`FaultLayer`] in front of `S`.
#[derive(Debug, Clone)]
pub struct Fault<S> {
    inner: S,
    faults: Option<Arc<Faults>>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Fault<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, Request<ReqBody>, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let Some(faults) = &self.faults else {
            return ResponseFuture::inner(self.inner.call(request));
        };
        let (delay, aborted) = faults.draw();
        let route = Route::from_extensions(request.extensions());
        let abort = aborted.then(|| {
            count(&route, "abort");
            Problem::from_status(&faults.abort).into_response_for(Protocol::of(request.headers()))
        });
        match (delay, abort) {
            (None, None) => ResponseFuture::inner(self.inner.call(request)),
            (None, Some(response)) => ResponseFuture::abort(response),
            (Some(delay), abort) => {
                count(&route, "delay");
                // The ready service goes with the request; `self` keeps a fresh clone (tower's
                // idiom for calling later).
                let clone = self.inner.clone();
                let ready = std::mem::replace(&mut self.inner, clone);
                ResponseFuture::delayed(delay, abort, ready, request)
            }
        }
    }
}

fn count(route: &Route, fault: &'static str) {
    metrics::counter!(
        RPC_SERVER_FAULTS_INJECTED_TOTAL,
        crate::observe::label::SERVICE => route.service_label(),
        crate::observe::label::METHOD => route.method_label(),
        crate::observe::label::FAULT => fault,
    )
    .increment(1);
}

#[cfg(test)]
mod tests;
