//! Per-tenant rate limit: a tenant over its quota gets 429 + `Retry-After` (seed 2.7).
//!
//! [`RateLimitLayer`] spends one token of the caller's bucket in a
//! [`KeyedTokenBucket`] keyed by the [`Tenant`] request
//! extension (requests without one share the bucket of [`Tenant::DEFAULT`]). An empty bucket is
//! answered at once, without calling the inner service, with 429 problem+json `rate_limited`
//! (`RESOURCE_EXHAUSTED`) and `Retry-After` set to the time until a token is back (at least 1 s,
//! never 0: "retry now" would only feed the overload). The refusal is counted in
//! `rpc_server_rejected_total{reason="rate_limited"}`.
//!
//! Quota (429) is about the *caller* and the [`gate`](crate::server::gate) (503) about *our own*
//! capacity; both are refusals before any work, so the idempotency key stays unused.

mod layer;

pub mod future;

pub use self::layer::RateLimitLayer;

use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use self::future::ResponseFuture;
use super::metrics::{Rejected, Route, count_rejected};
use super::problem::{Problem, Protocol};
use super::reject::RejectOr;
use super::tenant::Tenant;
use crate::admission::KeyedTokenBucket;
use crate::status::Status;

/// The `reason` label of a rate-limit refusal.
pub const REASON: &str = crate::observe::reject_reason::RATE_LIMITED;

/// Refuses requests of tenants over their quota.
#[derive(Debug, Clone)]
pub struct RateLimit<S> {
    inner: S,
    buckets: KeyedTokenBucket,
}

impl<S> RateLimit<S> {
    /// Wraps `inner` with the given per-tenant buckets.
    pub fn new(inner: S, buckets: KeyedTokenBucket) -> Self {
        Self { inner, buckets }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: From<Bytes>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        match self.buckets.check(Tenant::of(&request)) {
            Ok(()) => ResponseFuture::new(RejectOr::inner(self.inner.call(request))),
            Err(wait) => {
                count_rejected(&Route::from_extensions(request.extensions()), REASON);
                let protocol = Protocol::of(request.headers());
                ResponseFuture::new(RejectOr::reject(rate_limited(wait, protocol)))
            }
        }
    }
}

fn rate_limited<B: From<Bytes>>(wait: Duration, protocol: Protocol) -> Response<B> {
    let mut response =
        Problem::from_status(&Status::rate_limited(wait)).into_response_for(protocol);
    response.extensions_mut().insert(Rejected(REASON));
    response
}

#[cfg(test)]
mod tests;
