//! Server-side tower layers: deadlines, metrics, tenants, rate limits, admission and
//! idempotency for any `http::Request -> http::Response` service (axum, hyper, tonic over
//! HTTP/2).
//!
//! Every layer answers its refusals itself as `application/problem+json` ([`problem`]) with a
//! stable `code`, never as an error: the services keep the inner service's error type, so they
//! drop into an axum `Router` unchanged. Every layer is `Clone` through shared state, so no
//! `Buffer` is needed.
//!
//! # Order
//!
//! The layers go outermost first:
//!
//! 1. [`deadline`]: reads `grpc-timeout` the moment the request arrives. It goes first so that
//!    everything after it, queueing at the gate included, is paid out of the caller's budget,
//!    and so that a late answer is cut at the deadline into a 504.
//! 2. [`metrics`]: sees every request, the refused ones too, and names the route once for the
//!    layers below.
//! 3. [`tenant`]: who is calling (authentication), needed by the rate limit and the
//!    idempotency scope.
//! 4. [`rate_limit`]: a tenant over quota gets 429. Cheap rejections come first: a token
//!    bucket check costs nanoseconds and protects the gate from a single noisy tenant.
//! 5. [`gate`]: our own capacity; 503 when the request could not start within its budget.
//! 6. `idempotency`: last, so that every request refused above (bad deadline, over quota,
//!    overloaded) leaves its key unused and the client's retry with the same key starts fresh;
//!    and only admitted requests pay for reading the body and a store round trip.
//!

pub mod deadline;
pub mod gate;
pub mod metrics;
pub mod problem;
pub mod rate_limit;
pub mod tenant;

mod reject;
mod route;
#[cfg(test)]
mod testing;

pub use self::deadline::DeadlineLayer;
pub use self::gate::GateLayer;
pub use self::metrics::MetricsLayer;
pub use self::problem::Problem;
pub use self::rate_limit::RateLimitLayer;
pub use self::tenant::{Tenant, TenantLayer};
