//! Admission control: say "not now" early and cheaply instead of collapsing.
//!
//! Two different questions, two different answers:
//!
//! - **capacity** (backpressure, protects this server): [`Gate`] bounds how many requests run
//!   at once; those that find it full wait in its [`AdmissionQueue`], bounded by count and
//!   memory, fair between tenants (one within an equal part of the limit is never refused for
//!   another's load, nor its connections pushed away), which never hands out a request whose time left
//!   cannot cover the expected service time and, once a standing queue forms, drops waiters
//!   past a short sojourn target and serves the newest first. A refused request gets
//!   [`Overloaded`] with its reason, answered `503` / `UNAVAILABLE` + `Retry-After` estimated
//!   from the queue (or "do not retry" while the server sheds hard, or while its [`Shedding`]
//!   window says the overload is sustained: then a listener may also push clients to other
//!   instances, see [`PushAway`](crate::server::listen::PushAway)). The bound is fixed or
//!   found: a [`Gradient2`] limit lowers itself when the latency of admitted requests rises
//!   above its baseline, and grows back when it falls.
//!   Around either, a [`SlowStart`] drops the bound to a small floor while most requests fail
//!   (a dependency is down) and ramps it back up, doubling per round trip, once they succeed
//!   again.
//! - **quota** (rate limiting, protects everyone else from one tenant): [`TokenBucket`] and
//!   [`KeyedTokenBucket`] allow bursts and bound the mean rate; over quota is `429` /
//!   `RESOURCE_EXHAUSTED` + `Retry-After`. With the `redis` feature, the `redis` module shares the
//!   per-tenant buckets between instances.
//!
//! # What counts toward a destination's health
//!
//! Four mechanisms judge whether a service is well from what its requests end with: the
//! client's circuit breaker (`client::breaker`, one per destination; the proxy's per-endpoint
//! breakers are the same), the client's retry budget, storm alarm and adaptive throttle
//! (`client::retry`), and the server's gate: [`SlowStart`] (is a dependency down?), an
//! adaptive limit such as [`Gradient2`] (is serving getting slower?) and [`Shedding`] (is the
//! gate refusing much?). Only the peer's own failures may move them; what a caller did to its
//! own request must not, or one caller could take a service offline for everyone.
//!
//! | how a request ended | breaker | retry budget, storm alarm, throttle | slow start | adaptive limit | shedding |
//! |---|---|---|---|---|---|
//! | success (2xx, 3xx, gRPC `OK`) | success | a request (deposits), no retry | success | latency sample | admitted |
//! | the peer failed: 5xx, `UNAVAILABLE`, `INTERNAL`, `UNKNOWN`, `DATA_LOSS`, a transport error (refused, reset or closed by the peer, no answer) | failure | retried within the policy: spends budget, counts toward the storm alarm | failure (answered 5xx) | like abandoned work | admitted |
//! | the peer answered a timeout (504, `DEADLINE_EXCEEDED`) | failure | retried on keyed and safe methods only | nothing | abandoned: a sample only when it ran longer than recent requests | admitted |
//! | the peer refused the request itself: 4xx (400, 404, 409, 422, ...) | success: the peer works | not retried (409 with `Retry-After` after the wait) | success | latency sample | admitted |
//! | the peer refused load: 429 / `RESOURCE_EXHAUSTED` (503 `overloaded` is `UNAVAILABLE`, above) | success | retried after its pushback; the throttle counts the refusal | success | latency sample | admitted |
//! | **the caller's request body broke** on its way in: malformed framing, cut short, reset, over a size limit, too slow (`client::RequestBodyError`; answered 400, 408, 413, or nothing) | **nothing** | **nothing**: no attempt counted, no retry, stop `request_body` | **nothing** (outcome `rejected`) | **nothing**, however long it took | admitted |
//! | the caller cancelled (dropped the call, went away) | nothing: the attempt is dropped unanswered | nothing more | nothing | abandoned: a sample only when it ran longer than recent requests | admitted |
//! | the caller's deadline passed during an attempt (cut off by the client stack) | nothing: dropped unanswered | stop `deadline`, nothing spent | nothing (504) | abandoned: a sample only when it ran longer than recent requests | admitted |
//! | the caller's deadline too short to send at all (less than the margin left) | nothing: refused above the breaker | stop `deadline`, no attempt | nothing (504) | abandoned, fast: no sample | admitted |
//! | not sent: the circuit is open, or local throttling refused it | not sent | stop `circuit_open` / `throttled`, nothing spent | failure when this hop answers 503 for it (its dependency is down) | like abandoned work | admitted |
//! | refused inside the gate before any work, with outcome `rejected` | nothing | nothing | nothing | nothing | admitted |
//! | refused by the gate itself (503 `overloaded`) | | | nothing: never ran | nothing | **refused** |
//!
//! One caller-made outcome still counts: a peer that answers `DEADLINE_EXCEEDED` because the
//! timeout it was sent was short (its caller's deadline was) reads, to the breaker, like a
//! slow peer; the breaker keeps no latency to tell them apart. A timeout that cannot cover the
//! way there and back (less than the margin left) is never sent, which leaves only timeouts
//! just above the margin. A streamed call whose body then breaks has made its budget deposit (one request's share,
//! as every request does) before the body broke; it takes nothing out. The columns are the
//! inputs of [`Limit::on_sample`] (served), [`Limit::on_failure`] (failed) and
//! [`Limit::on_abandoned`]; an answer with outcome `rejected` reaches none of them
//! ([`GatePermit::discard`]).
//!
//! # Where it lives
//!
//! These are the primitives. On the server, the concurrency limit is
//! [`server::concurrency`](crate::server::concurrency) (`GateLayer`, 503) and the quota
//! [`server::rate_limit`](crate::server::rate_limit) (429), whose classes are the methods'
//! [`rate_class`](crate::policy::MethodPolicy::rate_class). On the client, the answer to both
//! is pushback: [`client::retry`](crate::client::retry) waits as long as they say.
//!
//! Both refusals carry a wait, formatted by [`RetryAfter`] (never `0`, which would invite an
//! immediate retry). Neither is ever a `500`.
//!
//! ```
//! use std::num::{NonZeroU32, NonZeroUsize};
//! use std::time::Duration;
//! use backstop::admission::{Gate, KeyedTokenBucket, Quota, RetryAfter};
//! use backstop::deadline::Deadline;
//! use backstop::status::Status;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let quota = Quota::per_second(NonZeroU32::new(100).unwrap(), NonZeroU32::new(1).unwrap());
//! let tenants = KeyedTokenBucket::new(quota, NonZeroUsize::new(10_000).unwrap());
//! let gate = Gate::new(64, Duration::from_millis(5));
//!
//! async fn admit(tenants: &KeyedTokenBucket, gate: &Gate, tenant: &str) -> Result<(), Status> {
//!     tenants.check(tenant).map_err(Status::rate_limited)?;
//!     let _permit = gate.enter(&Deadline::after(Duration::from_millis(200))).await?;
//!     Ok(()) // serve the request while holding the permit
//! }
//!
//! assert!(admit(&tenants, &gate, "acme").await.is_ok());
//! let refused = admit(&tenants, &gate, "acme").await.unwrap_err();
//! assert_eq!(refused.http_status(), http::StatusCode::TOO_MANY_REQUESTS);
//! let header = RetryAfter::from(refused.pushback().unwrap()).to_header_value();
//! assert_eq!(header, "1"); // 10 ms, rounded up to whole seconds
//! # }
//! ```

mod concurrency;
mod keyed;
mod limit;
mod queue;
#[cfg(feature = "redis")]
pub mod redis;
mod retry_after;
mod shedding;
mod slow_start;
mod token_bucket;

pub use concurrency::{DEFAULT_TENANT, Gate, GatePermit, Overloaded};
pub use keyed::KeyedTokenBucket;
pub use limit::{FixedLimit, Gradient2, Limit};
pub use queue::{
    AdmissionQueue, Admitted, Discipline, DropReason, Pushback, QueueConfig, Refused, Ticket,
    UnknownDiscipline,
};
pub use retry_after::{RetryAfter, RetryAfterError};
pub use shedding::{InvalidShedding, Shedding, SheddingConfig};
pub use slow_start::{SlowStart, SlowStartState};
pub use token_bucket::{Denied, InvalidQuota, Quota, TokenBucket};
