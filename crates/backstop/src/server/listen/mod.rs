//! One accept loop for every listener: HTTP/1.1 and HTTP/2 with prior knowledge (h2c) on the
//! same port, with the limits a port open to hostile clients needs.
//!
//! A bare `accept` loop trusts its clients: a connection that never finishes its request head,
//! or stays idle, holds a file descriptor for ever; once they run out, `accept` fails in a busy
//! loop and well-behaved clients (health checks included) cannot get in. [`Listener`] bounds
//! each of these:
//!
//! - **header read timeout**: once the first bytes of an HTTP/1 request head arrive, the whole
//!   head must follow within [`ListenConfig::header_read_timeout`], or the connection is closed;
//! - **idle timeout**: a connection with no request in flight and none started for
//!   [`ListenConfig::idle_timeout`] is shut down gracefully (HTTP/2 `GOAWAY`). It is kept longer
//!   than the idle time clients keep pooled connections (90 s is common), so that the server
//!   rarely closes a connection a client is about to reuse;
//! - **HTTP/2 keepalive pings and a stream limit**: a dead peer is found within
//!   [`ListenConfig::http2_keepalive_interval`] + [`ListenConfig::http2_keepalive_timeout`], and
//!   one connection runs at most [`ListenConfig::http2_max_concurrent_streams`] requests;
//! - **connection cap**: at [`ListenConfig::max_connections`] open connections, a new one makes
//!   room by closing the oldest connection with no request in flight (a slow or idle client); when
//!   every connection is serving a request, the new one is closed at once. While the closed
//!   ones are still closing, new connections wait in the kernel's backlog rather than being
//!   refused. Both are counted in
//!   [`RPC_SERVER_CONNECTIONS_REJECTED_TOTAL`](crate::observe::RPC_SERVER_CONNECTIONS_REJECTED_TOTAL);
//!   the open connections are the gauge
//!   [`RPC_SERVER_CONNECTIONS`](crate::observe::RPC_SERVER_CONNECTIONS);
//! - **accept errors**: out of file descriptors (`EMFILE`), the loop closes the oldest idle
//!   connection and backs off (doubling up to [`ListenConfig::accept_backoff_max`]) instead of
//!   spinning; errors of a single connection (reset before accept) are skipped.
//!
//! Shutdown is one future: when it resolves the listener stops accepting at once, every
//! connection is asked to finish (HTTP/1 closes after its current response, HTTP/2 sends
//! `GOAWAY`), and those still open after [`ListenConfig::drain_timeout`] are closed, their
//! requests dropped (and so cancelled). [`Listener::serve`] returns once every connection task
//! has ended, so whatever a dropped request does on drop has already been started.
//!
//! Under sustained overload ([`ListenConfig::push_away`]), a share of the connections (never
//! one whose tenant the gate said is within its share) are asked to reconnect, so that clients
//! rebalance across instances: HTTP/2 ones get a graceful
//! `GOAWAY`, HTTP/1 ones `Connection: close` on a response (see [`PushAway`]).
//!
//! Every request carries a [`ConnectionInfo`] extension: the peer address, and a way to close
//! its connection at once without an answer.
//!
//! ```no_run
//! use backstop::server::listen::{ListenConfig, Listener};
//! use std::convert::Infallible;
//!
//! # async fn run() -> std::io::Result<()> {
//! let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let service = tower::service_fn(|_request: http::Request<hyper::body::Incoming>| async {
//!     Ok::<_, Infallible>(http::Response::new(String::from("hello")))
//! });
//! let shutdown = async {
//!     let _ = tokio::signal::ctrl_c().await;
//! };
//! Listener::new("hello", tcp, ListenConfig::default())
//!     .serve(service, shutdown)
//!     .await;
//! # Ok(())
//! # }
//! ```

// The accept loop and the drain are in `accept`, the open connections and the cap in `registry`,
// one connection's task and its request accounting in `connection`, the header read and idle
// timers in `timeouts`, the push-away budget in `push`, the HTTP/2 stream tasks in `streams`,
// and what the connection tasks share (built by `accept`) in `shared`.
mod accept;
mod connection;
mod push;
mod registry;
mod shared;
mod streams;
#[cfg(test)]
mod test_support;
mod timeouts;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

pub use push::{InvalidPushAway, PushAway};
use registry::ConnState;

/// Boxed error of a service or body.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Limits of one listener's connections; [`Default`] gives values fit for a service on a
/// private network.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ListenConfig {
    /// Longest time an HTTP/1 request head may take, from its first bytes to its end.
    /// Default 10 s.
    pub header_read_timeout: Duration,
    /// A connection with no request in flight and none started for this long is shut down
    /// gracefully (checked every `idle_timeout`, so it may live up to twice as long).
    /// Default 120 s: longer than clients keep idle pooled connections.
    pub idle_timeout: Duration,
    /// Interval of HTTP/2 keepalive pings. Default 20 s.
    pub http2_keepalive_interval: Duration,
    /// How long an HTTP/2 keepalive ping may go unanswered before the connection is closed.
    /// Default 20 s.
    pub http2_keepalive_timeout: Duration,
    /// Most requests (streams) one HTTP/2 connection runs at once. Default 256.
    pub http2_max_concurrent_streams: u32,
    /// Most connections open at once (see the [module docs](self)); the ones closed to make
    /// room may overrun it by an eighth while they close. Keep it below the process's file
    /// descriptor limit, leaving room for the store and outgoing connections. Default 1024.
    pub max_connections: usize,
    /// First pause after a failed accept; doubles on each failure in a row. Default 5 ms.
    pub accept_backoff: Duration,
    /// Longest pause after failed accepts. Default 1 s.
    pub accept_backoff_max: Duration,
    /// Bound on draining the connections at shutdown. Default 10 s.
    pub drain_timeout: Duration,
    /// Pushes a share of the connections to reconnect (elsewhere) while a gate sheds under
    /// sustained overload (see [`PushAway`]). Default `None`: never.
    pub push_away: Option<PushAway>,
}

impl Default for ListenConfig {
    fn default() -> Self {
        ListenConfig {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            http2_keepalive_interval: Duration::from_secs(20),
            http2_keepalive_timeout: Duration::from_secs(20),
            http2_max_concurrent_streams: 256,
            max_connections: 1024,
            accept_backoff: Duration::from_millis(5),
            accept_backoff_max: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(10),
            push_away: None,
        }
    }
}

/// Request extension: the connection the request arrived on.
#[derive(Debug, Clone)]
pub struct ConnectionInfo {
    peer: SocketAddr,
    conn: Arc<ConnState>,
}

impl ConnectionInfo {
    /// The client's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Closes the connection at once: no answer is sent, and every request in flight on it is
    /// dropped.
    pub fn close(&self) {
        self.conn.close.notify_one();
    }

    /// Tells the listener whether the tenant of the request being served is within its fair
    /// share of the server (the [`GateLayer`](crate::server::GateLayer) does, from
    /// [`GatePermit::within_share`](crate::admission::GatePermit::within_share) or
    /// [`Gate::within_share`](crate::admission::Gate::within_share)). Under sustained overload,
    /// [`PushAway`] never pushes a connection whose latest request said "within": a quiet tenant
    /// keeps its connections while a noisy one is moved. Nothing is allocated.
    ///
    /// ```
    /// use backstop::server::listen::ConnectionInfo;
    ///
    /// fn mark(request: &http::Request<()>, within: bool) {
    ///     if let Some(info) = request.extensions().get::<ConnectionInfo>() {
    ///         info.set_within_share(within);
    ///     }
    /// }
    /// # mark(&http::Request::new(()), true);
    /// ```
    pub fn set_within_share(&self, within: bool) {
        let share = if within {
            registry::share::WITHIN
        } else {
            registry::share::OVER
        };
        self.conn
            .share
            .store(share, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A bound TCP listener and the limits it serves with.
#[derive(Debug)]
pub struct Listener {
    name: String,
    tcp: TcpListener,
    config: ListenConfig,
}

impl Listener {
    /// Serves `tcp` with `config`; `name` is the `service` label of the connection metrics.
    pub fn new(name: impl Into<String>, tcp: TcpListener, config: ListenConfig) -> Self {
        Listener {
            name: name.into(),
            tcp,
            config,
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}
