//! What every connection task of one listener shares: the connection builder, the limits,
//! the open connections and the push-away count.

use hyper_util::server::conn::auto;

use super::ListenConfig;
use super::push::Pushed;
use super::registry::{ConnState, Metrics, Registered, Registry};
use super::streams::Streams;

/// What every connection task of one listener shares.
pub(super) struct Shared {
    pub(super) builder: auto::Builder<Streams>,
    pub(super) config: ListenConfig,
    pub(super) open: Registry,
    pub(super) metrics: Metrics,
    pub(super) pushed: Pushed,
}

impl Shared {
    /// Waits while the connection cap leaves no room (see [`Registry::room_to_accept`]).
    pub(super) async fn room_to_accept(&self) {
        self.open.room_to_accept(self.config.max_connections).await;
    }

    /// Registers a new connection, making room at the cap; `None` when it must be refused.
    pub(super) fn admit(&self) -> Option<Registered> {
        self.open.admit(self.config.max_connections, &self.metrics)
    }

    /// Whether to push `conn` away with the response being sent now; counts it if so.
    pub(super) fn push_now(&self, conn: &ConnState, http2: bool) -> bool {
        let Some(push) = &self.config.push_away else {
            return false;
        };
        if !self.pushed.push_now(push, conn, &self.open) {
            return false;
        }
        self.metrics.pushed(http2);
        true
    }
}
