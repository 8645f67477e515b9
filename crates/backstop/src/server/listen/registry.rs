//! The open connections of a listener, and the cap on them: eviction of idle connections to
//! make room, refusal when every connection is busy.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::observe::{self, connection_rejected, label, protocol};

/// The open connections of a listener, oldest first.
#[derive(Default)]
pub(super) struct Registry {
    conns: Mutex<BTreeMap<u64, Arc<ConnState>>>,
    next_id: AtomicU64,
    /// Notified whenever a connection leaves.
    freed: Notify,
}

impl Registry {
    /// Connections picked to make room close on their own task: an eighth over `cap` is left
    /// for them, so a fast flood cannot outrun the closing and exhaust descriptors.
    fn hard_cap(cap: usize) -> usize {
        cap.saturating_add((cap / 8).max(1))
    }

    /// Waits while the hard cap over `cap` is reached and some connections are closing to
    /// make room.
    ///
    /// New connections wait in the kernel's backlog meanwhile: accepting one only to refuse
    /// it would reset a well-behaved client that happened to arrive right behind a flood.
    /// Closing connections end without waiting on anything, so the wait is short.
    pub(super) async fn room_to_accept(&self, cap: usize) {
        loop {
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            {
                let open = self.lock();
                let closing = || open.values().any(|c| c.evicted.load(Ordering::Acquire));
                if open.len() < Registry::hard_cap(cap) || !closing() {
                    return;
                }
            }
            freed.await;
        }
    }

    /// Registers a new connection, making room at `cap`; `None` when it must be refused.
    pub(super) fn admit(&self, cap: usize, metrics: &Metrics) -> Option<Registered> {
        let hard_cap = Registry::hard_cap(cap);
        let mut open = self.lock();
        if open.len() >= cap && (open.len() >= hard_cap || !Registry::evict_in(&open, metrics)) {
            metrics.rejected(connection_rejected::REFUSED);
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(ConnState::new());
        open.insert(id, Arc::clone(&conn));
        drop(open);
        metrics.open.increment(1.0);
        Some(Registered { id, conn })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<ConnState>>> {
        // A poisoned map is still consistent: every update is a single insert or remove.
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connections open now.
    pub(super) fn len(&self) -> usize {
        self.lock().len()
    }

    pub(super) fn evict_idle(&self, metrics: &Metrics) -> bool {
        Registry::evict_in(&self.lock(), metrics)
    }

    /// Closes the oldest connection with no request in flight that is not closing already.
    fn evict_in(open: &BTreeMap<u64, Arc<ConnState>>, metrics: &Metrics) -> bool {
        let idle = open.values().find(|c| {
            c.in_flight.load(Ordering::Acquire) == 0 && !c.evicted.swap(true, Ordering::AcqRel)
        });
        match idle {
            Some(conn) => {
                conn.close.notify_one();
                metrics.rejected(connection_rejected::EVICTED);
                true
            }
            None => false,
        }
    }
}

/// What [`ConnState::share`] says of the tenant a connection serves.
pub(super) mod share {
    /// Nobody said (no gate behind the listener, or no request yet).
    pub(in super::super) const UNKNOWN: u8 = 0;
    /// Within its share: never pushed away.
    pub(in super::super) const WITHIN: u8 = 1;
    /// Over its share.
    pub(in super::super) const OVER: u8 = 2;
}

/// State of one connection, seen by its task, its requests and the registry.
#[derive(Debug)]
pub(super) struct ConnState {
    /// When the connection was accepted: the origin of `head_since`.
    pub(super) opened: tokio::time::Instant,
    /// Milliseconds from `opened` to the first byte of the request head being read, plus one;
    /// 0 while no head is being read.
    pub(super) head_since: AtomicU64,
    /// Notified when a head starts.
    pub(super) head_started: Notify,
    /// The peer speaks HTTP/2: frames between requests (pings, window updates) are no head.
    pub(super) http2: AtomicBool,
    /// Requests between the service call and the end of their response body.
    pub(super) in_flight: AtomicUsize,
    /// Requests started so far (for the idle timeout).
    pub(super) started: AtomicU64,
    /// Set once the registry picked the connection to make room.
    evicted: AtomicBool,
    /// Notified to close the connection at once.
    pub(super) close: Notify,
    /// Set once the connection was pushed away under overload.
    pub(super) pushed: AtomicBool,
    /// Whether the tenant of its latest request was within its share of the server, as the
    /// gate said: [`share::UNKNOWN`], [`share::WITHIN`] or [`share::OVER`].
    pub(super) share: AtomicU8,
    /// Notified to shut an HTTP/2 connection down gracefully (`GOAWAY`).
    pub(super) go_away: Notify,
}

impl ConnState {
    fn new() -> Self {
        ConnState {
            opened: tokio::time::Instant::now(),
            head_since: AtomicU64::new(0),
            head_started: Notify::new(),
            http2: Default::default(),
            in_flight: AtomicUsize::new(0),
            started: AtomicU64::new(0),
            evicted: Default::default(),
            close: Notify::new(),
            pushed: Default::default(),
            share: AtomicU8::new(share::UNKNOWN),
            go_away: Notify::new(),
        }
    }
}

/// A connection's place in the registry; leaving it (drop) frees the place.
pub(super) struct Registered {
    pub(super) id: u64,
    pub(super) conn: Arc<ConnState>,
}

/// The connection metrics of one listener.
pub(super) struct Metrics {
    name: String,
    open: metrics::Gauge,
}

impl Metrics {
    pub(super) fn new(name: &str) -> Self {
        Metrics {
            name: name.to_owned(),
            open: metrics::gauge!(observe::RPC_SERVER_CONNECTIONS, label::SERVICE => name.to_owned()),
        }
    }

    pub(super) fn pushed(&self, http2: bool) {
        let protocol = if http2 {
            protocol::HTTP2
        } else {
            protocol::HTTP1
        };
        metrics::counter!(
            observe::RPC_SERVER_CONNECTIONS_PUSHED_TOTAL,
            label::SERVICE => self.name.clone(),
            label::PROTOCOL => protocol,
        )
        .increment(1);
    }

    fn rejected(&self, reason: &'static str) {
        metrics::counter!(
            observe::RPC_SERVER_CONNECTIONS_REJECTED_TOTAL,
            label::SERVICE => self.name.clone(),
            label::REASON => reason,
        )
        .increment(1);
    }
}

/// Removes a connection from the registry when its task ends, however it ends.
pub(super) struct Unregister<'a> {
    pub(super) open: &'a Registry,
    pub(super) metrics: &'a Metrics,
    pub(super) id: u64,
}

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        self.open.lock().remove(&self.id);
        self.open.freed.notify_waiters();
        self.metrics.open.decrement(1.0);
    }
}

#[cfg(test)]
mod tests;
