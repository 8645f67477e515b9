//! Per-tenant rate limit: a tenant over its quota gets 429 + `Retry-After`.
//!
//! [`RateLimitLayer`] spends one token of the caller's bucket in a
//! [`KeyedTokenBucket`] keyed by the [`Tenant`] request
//! extension (requests without one share the bucket of [`Tenant::DEFAULT`]). An empty bucket is
//! answered at once, without calling the inner service, with 429 problem+json `rate_limited`
//! (`RESOURCE_EXHAUSTED`) and `Retry-After` set to the time until a token is back (at least 1 s,
//! never 0: "retry now" would only feed the overload). The refusal is counted in
//! `rpc_server_rejected_total{reason="rate_limited"}`.
//!
//! Each method may have a quota of its own: its [`MethodPolicy`](crate::policy::MethodPolicy)
//! names a rate class, and [`RateLimitLayer::class`] gives a class its own buckets (say,
//! status polls in `reads`, so that a client converging on unknown outcomes cannot spend the
//! tokens its charges need). Requests find their class through the layer's
//! [policies](RateLimitLayer::policies), the table the idempotency layer and the clients read
//! ([`ServerStack::policies`](crate::server::ServerStack::policies) gives it to both); a class
//! with no buckets of its own, or a layer with no table, spends from the default buckets.
//!
//! Quota (429) is about the *caller* and the [concurrency limit](crate::server::concurrency) (503) about *our own*
//! capacity; both are refusals before any work, so the idempotency key stays unused.
//!
//! With the `redis` feature the buckets can instead be shared by several instances
//! (`RateLimitLayer::shared`, an `admission::redis::SharedLimiter`). The local path stays a
//! synchronous check; the shared one waits for Redis, bounded by the limiter's timeout and the
//! request's [`Deadline`](crate::deadline::Deadline) (set by the
//! [`deadline`](crate::server::deadline) layer), and holds the request meanwhile. When Redis
//! fails the limiter's policy decides: a local fallback bucket (`open`), or 503 problem+json
//! `rate_limiter_unavailable` + `Retry-After` (`closed`), counted as
//! `rpc_server_rejected_total{reason="rate_limiter_unavailable"}`. Never a 500.

mod layer;

pub mod future;

pub use self::layer::RateLimitLayer;

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tower_service::Service;

use self::future::ResponseFuture;
use super::body::ResponseBody;
use super::metrics::{Rejected, Route, count_rejected};
use super::problem::{Problem, Protocol};
use super::reject::RejectOr;
use super::select::PolicyLookup;
use super::tenant::Tenant;
use crate::admission::KeyedTokenBucket;
#[cfg(feature = "redis")]
use crate::admission::redis::{Decision, SharedLimiter, Verdict};
use crate::status::Status;

/// The `reason` label of a rate-limit refusal.
pub const REASON: &str = crate::observe::reject_reason::RATE_LIMITED;

/// The `reason` label of a refusal because the shared limiter could not decide (fail closed).
pub const UNAVAILABLE_REASON: &str = crate::observe::reject_reason::RATE_LIMITER_UNAVAILABLE;

/// Where the buckets are kept.
#[derive(Debug, Clone)]
enum Limiter {
    /// In this process: decided synchronously.
    Local(KeyedTokenBucket),
    /// In Redis, shared with other instances: decided after a round trip.
    #[cfg(feature = "redis")]
    Shared(SharedLimiter),
}

/// The rate classes with buckets of their own, and how a request finds its class.
#[derive(Debug, Default)]
struct Classes {
    lookup: Option<PolicyLookup>,
    limiters: Vec<(Box<str>, Limiter)>,
}

impl Classes {
    /// The limiter of `request`'s rate class, if that class has one of its own.
    fn limiter_of<B>(&self, request: &Request<B>) -> Option<&Limiter> {
        if self.limiters.is_empty() {
            return None;
        }
        let policy = self.lookup.as_ref()?.policy_of(request);
        let class = policy.rate_class();
        self.limiters
            .iter()
            .find(|(name, _)| &**name == class)
            .map(|(_, limiter)| limiter)
    }
}

/// Refuses requests of tenants over their quota.
#[derive(Debug, Clone)]
pub struct RateLimit<S> {
    inner: S,
    /// The default buckets.
    limiter: Limiter,
    /// Classes with buckets of their own; `None` when there are none.
    classes: Option<Arc<Classes>>,
}

impl<S> RateLimit<S> {
    /// Wraps `inner` with the given per-tenant buckets.
    pub fn new(inner: S, buckets: KeyedTokenBucket) -> Self {
        Self::with_limiter(inner, Limiter::Local(buckets), None)
    }

    /// Wraps `inner` with buckets shared through Redis.
    #[cfg(feature = "redis")]
    pub fn shared(inner: S, limiter: SharedLimiter) -> Self {
        Self::with_limiter(inner, Limiter::Shared(limiter), None)
    }

    fn with_limiter(inner: S, limiter: Limiter, classes: Option<Arc<Classes>>) -> Self {
        Self {
            inner,
            limiter,
            classes,
        }
    }
}

/// The limiter `request` spends from: its class's own, else the default.
fn limiter_for<'a, B>(
    default: &'a Limiter,
    classes: Option<&'a Classes>,
    request: &Request<B>,
) -> &'a Limiter {
    classes
        .and_then(|c| c.limiter_of(request))
        .unwrap_or(default)
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, Request<ReqBody>, S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        match limiter_for(&self.limiter, self.classes.as_deref(), &request) {
            Limiter::Local(buckets) => match buckets.check(Tenant::of(&request)) {
                Ok(()) => ResponseFuture::new(RejectOr::inner(self.inner.call(request))),
                Err(wait) => {
                    count_rejected(&Route::from_extensions(request.extensions()), REASON);
                    let protocol = Protocol::of(request.headers());
                    ResponseFuture::new(RejectOr::reject(rate_limited(wait, protocol)))
                }
            },
            #[cfg(feature = "redis")]
            Limiter::Shared(limiter) => {
                let deadline = request
                    .extensions()
                    .get::<crate::deadline::Deadline>()
                    .copied();
                let protocol = Protocol::of(request.headers());
                match limiter.check(Tenant::of(&request), deadline) {
                    Decision::Ready(verdict) => {
                        let route = || Route::from_extensions(request.extensions());
                        match refusal(verdict, route, protocol) {
                            None => ResponseFuture::new(RejectOr::inner(self.inner.call(request))),
                            Some(response) => ResponseFuture::new(RejectOr::reject(response)),
                        }
                    }
                    Decision::Pending(pending) => {
                        let route = Route::from_extensions(request.extensions());
                        let check =
                            Box::pin(async move { refusal(pending.await, || route, protocol) });
                        // The ready service goes with the request; this one is a fresh clone
                        // that must be polled ready again.
                        let ready = self.inner.clone();
                        let ready = std::mem::replace(&mut self.inner, ready);
                        ResponseFuture::deciding(check, ready, request)
                    }
                }
            }
        }
    }
}

/// The answer to a shared decision: `None` admits.
#[cfg(feature = "redis")]
fn refusal<B>(
    verdict: Verdict,
    route: impl FnOnce() -> Route,
    protocol: Protocol,
) -> Option<Response<ResponseBody<B>>> {
    match verdict {
        Verdict::Allowed => None,
        Verdict::Limited(wait) => {
            count_rejected(&route(), REASON);
            Some(rate_limited(wait, protocol))
        }
        Verdict::Unavailable(wait) => {
            count_rejected(&route(), UNAVAILABLE_REASON);
            let mut response = Problem::from_status(&Status::rate_limiter_unavailable(wait))
                .into_response_for(protocol);
            response
                .extensions_mut()
                .insert(Rejected(UNAVAILABLE_REASON));
            Some(response)
        }
    }
}

fn rate_limited<B>(wait: Duration, protocol: Protocol) -> Response<ResponseBody<B>> {
    let mut response =
        Problem::from_status(&Status::rate_limited(wait)).into_response_for(protocol);
    response.extensions_mut().insert(Rejected(REASON));
    response
}

#[cfg(test)]
mod tests;
