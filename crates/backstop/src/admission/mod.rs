//! Admission control: say "not now" early and cheaply instead of collapsing.
//!
//! Two different questions, two different answers:
//!
//! - **capacity** (backpressure, protects this server): [`Gate`] bounds how many requests run
//!   at once; those that find it full wait in its [`AdmissionQueue`], bounded by count and
//!   memory, fair between tenants (one within an equal part of the limit is never refused for
//!   another's load, nor its connections pushed away), which never hands out a request whose remaining budget
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
