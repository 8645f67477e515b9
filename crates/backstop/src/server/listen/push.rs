//! Pushing clients to other instances under sustained overload: an HTTP/2 connection gets a
//! graceful `GOAWAY`, an HTTP/1 response `Connection: close`, for a bounded share of the open
//! connections per interval.

use std::sync::atomic::Ordering;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::ConnState;
use super::registry::{self, Registry};
use crate::admission::Shedding;

/// Asks clients to reconnect, and so to rebalance across instances, while a gate sheds under
/// sustained overload (see [`Shedding`]).
///
/// A client whose connection closes reconnects through its load balancer or resolver, and may
/// land on an instance with room. Behind an L4 balancer or a pool of addresses, closing long
/// lived connections is the only way a server moves its clients; the `Retry-After` or gRPC
/// pushback of its refusals only tells them to wait. While the gate's overload is sustained,
/// each response is a chance to push its connection away:
///
/// - **HTTP/2**: the connection is shut down gracefully (`GOAWAY`): the requests in flight on
///   it finish, the client opens a new connection for the next ones;
/// - **HTTP/1**: the response carries `Connection: close`, and the connection closes once it
///   is sent.
///
/// At most [`share`](Self::with_share) of the open connections (at least one) are pushed per
/// [`interval`](Self::with_interval), so that the fleet rebalances without every client
/// reconnecting at once; a connection is pushed once. Only connections whose tenant is over
/// its fair share are pushed (as the gate marks them, see
/// [`ConnectionInfo::set_within_share`](super::ConnectionInfo::set_within_share); unmarked ones
/// count as over): a quiet tenant is not moved for a noisy one's load. Each push is counted in
/// [`RPC_SERVER_CONNECTIONS_PUSHED_TOTAL`](crate::observe::RPC_SERVER_CONNECTIONS_PUSHED_TOTAL)
/// by `protocol`.
///
/// ```
/// use std::time::Duration;
/// use backstop::admission::Gate;
/// use backstop::server::listen::{ListenConfig, PushAway};
///
/// let gate = Gate::new(64, Duration::from_millis(5));
/// let mut config = ListenConfig::default();
/// config.push_away = Some(PushAway::new(gate.shedding()).with_share(0.05).unwrap());
/// ```
#[derive(Debug, Clone)]
pub struct PushAway {
    shedding: Shedding,
    share: f64,
    interval: Duration,
}

/// A [`PushAway`] setting out of range.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum InvalidPushAway {
    /// The share is not within `(0, 1]`.
    #[error("push-away share must be above 0 and at most 1, got {0}")]
    Share(f64),
    /// The interval is zero.
    #[error("push-away interval must be above zero")]
    Interval,
}

impl PushAway {
    /// Default share of the open connections pushed per interval: a tenth.
    pub const DEFAULT_SHARE: f64 = 0.1;
    /// Default interval: a second.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

    /// Pushes connections away while `shedding` says the overload is sustained (usually the
    /// gate's, [`Gate::shedding`](crate::admission::Gate::shedding)), with the default share
    /// and interval.
    pub fn new(shedding: Shedding) -> Self {
        PushAway {
            shedding,
            share: Self::DEFAULT_SHARE,
            interval: Self::DEFAULT_INTERVAL,
        }
    }

    /// Pushes at most `share` (above 0, at most 1) of the open connections per interval, and
    /// at least one.
    pub fn with_share(mut self, share: f64) -> Result<Self, InvalidPushAway> {
        if !(share > 0.0 && share <= 1.0) {
            return Err(InvalidPushAway::Share(share));
        }
        self.share = share;
        Ok(self)
    }

    /// The interval the share is counted over.
    pub fn with_interval(mut self, interval: Duration) -> Result<Self, InvalidPushAway> {
        if interval.is_zero() {
            return Err(InvalidPushAway::Interval);
        }
        self.interval = interval;
        Ok(self)
    }

    /// The share of the open connections pushed per interval.
    pub fn share(&self) -> f64 {
        self.share
    }

    /// The interval the share is counted over.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The overload it follows.
    pub fn shedding(&self) -> &Shedding {
        &self.shedding
    }
}

/// The pushes of the current interval.
#[derive(Debug)]
pub(super) struct Pushed(Mutex<Interval>);

#[derive(Debug)]
struct Interval {
    since: Instant,
    count: usize,
}

impl Pushed {
    pub(super) fn new() -> Self {
        Pushed(Mutex::new(Interval {
            since: Instant::now(),
            count: 0,
        }))
    }

    /// Whether `push` moves `conn` away with the response being sent now, among the `open`
    /// connections; counts it if so.
    pub(super) fn push_now(&self, push: &PushAway, conn: &ConnState, open: &Registry) -> bool {
        // A connection of a tenant within its share stays: the overload is the others'.
        if conn.pushed.load(Ordering::Relaxed)
            || conn.share.load(Ordering::Relaxed) == registry::share::WITHIN
            || !push.shedding.is_sustained()
        {
            return false;
        }
        let open = open.len();
        let mut pushed = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if now.saturating_duration_since(pushed.since) >= push.interval {
            *pushed = Interval {
                since: now,
                count: 0,
            };
        }
        // Rounded down, but one at least: a small listener pushes one connection an interval.
        let budget = ((open as f64 * push.share) as usize).max(1);
        if pushed.count >= budget || conn.pushed.swap(true, Ordering::AcqRel) {
            return false;
        }
        pushed.count += 1;
        true
    }
}

#[cfg(test)]
mod tests;
