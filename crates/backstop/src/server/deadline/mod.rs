//! Deadline extraction: the first thing a request meets.
//!
//! The caller sends the time it has left in `grpc-timeout` (the same header gRPC uses; HTTP
//! callers send it too, as grpc-gateway does). [`DeadlineLayer`] converts it into an absolute
//! [`Deadline`] on the local monotonic clock *in `call`*, before any other layer, so that queueing,
//! authentication and decoding are paid out of the caller's time. The deadline is
//! stored as a request extension for the layers and the handler below, and is the task's
//! [`Deadline::current`] while they run: a handler that calls another service through the
//! [client stack](crate::client::ClientStack) forwards what is left of it without a line of
//! code (work it spawns keeps it with [`deadline::carry`](crate::deadline::carry)).
//!
//! Every answer says how long the server held the request, in
//! `Server-Timing: backstop;dur=<ms>` ([`server_timing`](crate::deadline::server_timing)): the
//! calling client subtracts it from the attempt's duration to learn the network's share of its
//! margin, not the server's work.
//!
//! - no header: the method's [`MethodPolicy::timeout`](crate::policy::MethodPolicy::timeout)
//!   when the layer has the methods' [policies](DeadlineLayer::policies), else a configured
//!   default timeout (10 s unless set, the same default every policy has);
//! - a timeout above the configured maximum (60 s unless set) is clamped to it;
//! - a malformed value (no unit, a 9-digit value, zero, garbage) is answered at once with 400
//!   problem+json `invalid_grpc_timeout`;
//! - when the deadline passes before the inner service answers, the inner future is dropped and
//!   the client gets 504 problem+json `deadline_exceeded` (`DEADLINE_EXCEEDED`), never 408 or
//!   499 / `CANCELLED`: the server, not the client, gave up.
//!
//! A gRPC request gets the same answers as gRPC status (`INVALID_ARGUMENT`,
//! `DEADLINE_EXCEEDED`; see [`Protocol`]).
//!
//! ```
//! use backstop::server::deadline::DeadlineLayer;
//! use std::time::Duration;
//!
//! let layer = DeadlineLayer::new(Duration::from_secs(5)).max(Duration::from_secs(30));
//! # let _ = layer;
//! ```

pub mod future;
mod layer;

pub use self::layer::DeadlineLayer;

use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tokio::time::Instant;
use tower_service::Service;

use self::future::ResponseFuture;
use super::body::ResponseBody;
use super::problem::{Problem, Protocol};
use crate::deadline::{Deadline, GRPC_TIMEOUT_HEADER, decode_grpc_timeout};

/// The `grpc-timeout` header, named once.
use crate::status::{Code, Status, problem};

/// Default timeout of a request that carries no `grpc-timeout`: the one default timeout of
/// every method policy.
pub use crate::policy::DEFAULT_TIMEOUT;

/// Default upper bound on the timeout a caller may ask for.
pub const DEFAULT_MAX_TIMEOUT: Duration = Duration::from_secs(60);

/// Sets the request's [`Deadline`] from `grpc-timeout` and answers 504 when it passes.
#[derive(Debug, Clone)]
pub struct DeadlineService<S> {
    inner: S,
    default: Duration,
    max: Duration,
    policies: Option<crate::server::select::PolicyLookup>,
    server_timing: bool,
}

impl<S> DeadlineService<S> {
    /// Wraps `inner` with the given default and maximum timeouts.
    pub fn new(inner: S, default: Duration, max: Duration) -> Self {
        Self {
            inner,
            default: default.min(max),
            max,
            policies: None,
            server_timing: true,
        }
    }

    /// The timeout for `request`'s `grpc-timeout` (or, without one, its method's). The first
    /// layer of a stack: it selects the request's policy for the layers after it.
    fn timeout<B>(&self, request: &mut Request<B>) -> Result<Duration, Status> {
        let timeout = match &self.policies {
            Some(lookup) => lookup.select(request).timeout(),
            None => self.default,
        };
        let Some(value) = request.headers().get(&GRPC_TIMEOUT_HEADER) else {
            return Ok(timeout.min(self.max));
        };
        let invalid = || {
            Status::new(
                Code::InvalidArgument,
                "grpc-timeout must be 1 to 8 digits followed by one of H M S m u n",
            )
            .with_problem(problem::INVALID_GRPC_TIMEOUT)
        };
        let text = value.to_str().map_err(|_| invalid())?;
        let timeout = decode_grpc_timeout(text).map_err(|_| invalid())?;
        Ok(timeout.min(self.max))
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for DeadlineService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        let protocol = Protocol::of(request.headers());
        match self.timeout(&mut request) {
            Ok(timeout) => {
                let arrived = Instant::now();
                let deadline = Deadline::after_at(arrived, timeout);
                request.extensions_mut().insert(deadline);
                let stamp = self.server_timing.then_some(arrived);
                let previous = crate::retry::inbound::parse(
                    request
                        .headers()
                        .get(&crate::retry::inbound::PREVIOUS_ATTEMPTS),
                );
                ResponseFuture::running(
                    self.inner.call(request),
                    deadline,
                    previous,
                    stamp,
                    protocol,
                )
            }
            Err(status) => {
                ResponseFuture::rejected(Problem::from_status(&status).into_response_for(protocol))
            }
        }
    }
}

#[cfg(test)]
mod tests;
