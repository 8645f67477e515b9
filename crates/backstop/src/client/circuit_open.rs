//! [`CircuitOpen`], the error of an attempt the breaker did not send.
//!
//! It sits apart from the breaker because reading results needs it too: `classify` turns it
//! into `UNAVAILABLE` marked `circuit_open`, while the breaker classifies its responses with
//! `classify`. Its public path is `client::breaker::CircuitOpen`.

use std::time::Duration;

/// An attempt was not sent: the circuit is open for the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("circuit open for the destination; next probe in {retry_in:?}")]
pub struct CircuitOpen {
    /// Time until the breaker lets a probe through.
    pub retry_in: Duration,
}
