//! Retries that cannot multiply load.
//!
//! A retry is worth sending only when the failure may go away, a second attempt can still
//! finish before the caller stops waiting, and its side effect is controlled. This module holds
//! the pieces that enforce that:
//!
//! - [`Backoff`]: exponential delays with jitter, a cap and a floor, so that clients that failed
//!   together do not come back together.
//! - [`RetryBudget`]: retries as a fraction of logical requests, shared by every caller of a
//!   destination, so that a failing dependency sees at most `1 + ratio` times its normal load,
//!   not `max_attempts` times.
//! - [`StormAlarm`]: the retry ratio per destination over a sliding window; above 0.2 retries
//!   and hedges stop ([`StopReason::Storm`]) until it falls back to 0.1.
//! - [`inbound`]: retry at one layer: a request that arrived as a retry is served without the
//!   calls it makes retrying again.
//! - [`RetrySwitch`]: the fleet's setting (retries and hedges on, off, or within a lower
//!   ratio), set for every process at once through Redis ([`switch`]).
//! - [`RetryThrottle`] (instead of the budget, when asked for): gRPC's `retryThrottling` token
//!   bucket, retries sent only while failures have not drained half of it.
//! - [`AdaptiveThrottle`] (optional): attempts rejected locally, before the transport, with a
//!   probability that grows with the share of attempts the server refused
//!   ([`StopReason::Throttled`]).
//! - [`RetrySpend`]: the above for one destination in one object, and the decisions that read
//!   them (may this retry or hedge be sent?), shared by every policy calling it.
//! - [`RetryPolicy::execute`]: one logical request run as attempts that share ONE
//!   [`Deadline`](crate::deadline::Deadline), waiting between them only when the deadline
//!   leaves room for the wait and a minimal attempt, honouring the server's pushback, and
//!   reporting why it stopped ([`StopReason`]) in the error, the metrics and the logs.
//!
//! # Where it lives
//!
//! This module is the mechanism, usable alone. The client runs it per call in
//! [`client::retry`](crate::client::retry) (with hedges in [`client::hedge`](crate::client::hedge),
//! the circuit breaker in [`client::breaker`](crate::client::breaker) and re-sends that never
//! reached the server in [`client::transparent`](crate::client::transparent)); what a method
//! allows (attempts, codes, backoff, hedging) is its [`MethodPolicy`](crate::policy::MethodPolicy).
//! The server's side is the pushback it sends: `Retry-After` and `grpc-retry-pushback-ms` from
//! [`admission`](crate::admission).
//!
//! The budget and the backoff also serve a plain [`tower::retry::Policy`]: [`RetryBudget`] is a
//! tower [`Budget`](tower::retry::budget::Budget) (one deposit per logical request, one
//! withdrawal per retry, as here) and [`Backoff`] a tower
//! [`MakeBackoff`](tower::retry::backoff::MakeBackoff) of [`BackoffSession`]s.
//!
//! Which statuses are retried follows [`Status::retry_class`](crate::status::Status::retry_class):
//! `UNAVAILABLE` with backoff, `RESOURCE_EXHAUSTED` and `ABORTED` after
//! their pushback, `DEADLINE_EXCEEDED` only when the call carries an idempotency key
//! ([`RetryPolicyBuilder::keyed`]), everything else never.
//!
//! ```
//! use std::time::Duration;
//! use backstop::deadline::Deadline;
//! use backstop::retry::{RetryBudget, RetryPolicy, RetrySpend, StopReason};
//! use backstop::status::{Code, Status};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // One spend (here a budget alone) per destination, shared by every method that calls it.
//! let psp = RetrySpend::new(RetryBudget::new(0.1, 20)?);
//! let charge = RetryPolicy::builder("psp", "Charge").spend(psp.clone()).keyed(true).build()?;
//!
//! let err = charge
//!     .execute(Deadline::after(Duration::from_millis(300)), |_attempt| async {
//!         Err::<(), _>(Status::new(Code::Unavailable, "psp down"))
//!     })
//!     .await
//!     .unwrap_err();
//! assert_eq!(err.reason, StopReason::MaxAttempts);
//! assert_eq!(err.attempts, 3);
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//!
//! - `backoff`: [`Backoff`] and [`Jitter`], with their defaults ([`DEFAULT_BACKOFF_BASE`] and
//!   the constants beside it); [`BackoffSession`], one request's delays as a tower backoff.
//! - [`budget`]: [`RetryBudget`], with the reasoning behind budgets.
//! - `policy`: [`RetryPolicy`] and its builder, and [`DEFAULT_MIN_ATTEMPT`].
//! - `executor`: [`RetryPolicy::execute`], [`Attempt`], [`CallInfo`], and [`Attempts`], the
//!   bookkeeping of one request for a caller that runs its attempts itself (on a virtual clock
//!   too: its `..._at` steps read no clock).
//! - `error`: [`RetryError`] and [`StopReason`].
//! - [`storm`]: [`StormAlarm`], retries and hedges stopped while a destination's retry ratio
//!   says it is down for everyone.
//! - [`retry_throttle`]: [`RetryThrottle`], gRPC's retry throttling.
//! - [`throttle`]: [`AdaptiveThrottle`], attempts rejected locally while the server refuses
//!   load.
//! - `spend`: [`RetrySpend`], a destination's budget, alarm, switch and throttles together.
//!
//! # Metrics and logs
//!
//! All metrics carry `service` and `method` (from the policy), never a key:
//! [`RPC_CLIENT_REQUESTS_TOTAL`](crate::observe::RPC_CLIENT_REQUESTS_TOTAL) (logical
//! requests), [`RPC_CLIENT_ATTEMPTS_TOTAL`](crate::observe::RPC_CLIENT_ATTEMPTS_TOTAL)
//! (`attempt`, `outcome`), [`RPC_CLIENT_RETRIES_TOTAL`](crate::observe::RPC_CLIENT_RETRIES_TOTAL),
//! [`RPC_CLIENT_RETRY_STOPS_TOTAL`] (`reason`) and
//! [`RPC_CLIENT_ATTEMPT_DURATION_SECONDS`](crate::observe::RPC_CLIENT_ATTEMPT_DURATION_SECONDS)
//! (`attempt`). Each attempt is logged
//! as a tracing event with `event = "rpc_attempt"` and the fields `method`, `idempotency_key`,
//! `attempt`, `outcome`, `code`, `deadline_remaining_ms` (at send time), `peer`, `trace_id`; a
//! stop as `event = "rpc_retry_stopped"` with its `reason`.
//!
//! An attempt is a send. One refused locally before it was sent (adaptive throttling, an open
//! circuit, less of the deadline left than the peer's margin) is none: it is not counted in
//! the attempt metrics, the retries or the `rpc_attempt` events. The logical request still
//! counts, and its stop is counted and logged with the reason (`throttled`, `circuit_open`,
//! `deadline`); a request refused before its first send fails with outcome `rejected` and
//! `attempts` 0.

mod backoff;
pub mod budget;
mod error;
mod executor;
pub mod inbound;
mod metrics;
mod policy;
pub mod retry_throttle;
mod spend;
pub mod storm;
pub mod switch;
pub mod throttle;
mod window;

pub use backoff::{
    Backoff, BackoffError, BackoffSession, DEFAULT_BACKOFF_BASE, DEFAULT_BACKOFF_CAP,
    DEFAULT_BACKOFF_FLOOR, DEFAULT_BACKOFF_MULTIPLIER, DEFAULT_JITTER, Jitter,
};
pub use budget::{BudgetError, RetryBudget};
pub use error::{RetryError, StopReason};
pub use executor::{Attempt, Attempts, CallInfo, RPC_CLIENT_RETRY_STOPS_TOTAL};
pub use policy::{DEFAULT_MIN_ATTEMPT, PolicyError, RetryPolicy, RetryPolicyBuilder};
pub use retry_throttle::{RetryThrottle, RetryThrottleError};
pub use spend::RetrySpend;
pub use storm::{RPC_CLIENT_STORM_ALARM, StormAlarm, StormConfig, StormConfigError, StormLevel};
pub use switch::{RetrySetting, RetrySwitch, SettingError};
pub use throttle::{AdaptiveThrottle, ThrottleError};
