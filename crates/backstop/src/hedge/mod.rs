//! When a slow attempt is worth a second send, and what that send may spend.
//!
//! A hedge races a copy of an attempt that is slower than the destination usually is. The
//! decision needs two things, both here, free of HTTP and of any layer, so that the client's
//! hedging layer, the client stack's per-method settings and a simulator that replays the same
//! decisions on a virtual clock all use one implementation:
//!
//! - [`HedgePolicy`]: when an attempt is hedged (at the rolling p95 of recent latencies, or
//!   after a fixed delay such as a gRPC `hedgingDelay`), how many hedges a call may send, and
//!   whether one may be sent now: paid from the destination's
//!   [`RetrySpend`](crate::retry::RetrySpend) (its retry budget while it holds at least half
//!   its burst, never while its storm alarm is tripped).
//! - [`LatencyWindow`]: the last few hundred latencies of a destination and their quantiles,
//!   which the p95 delay is read from.
//!
//! The layer that sends the hedges, races them and tells the observers is `client::hedge`
//! (feature `client`).

mod latency;
mod policy;

pub use self::latency::LatencyWindow;
pub use self::policy::HedgePolicy;
