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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Buf;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tower::ServiceExt;
use tower::util::Oneshot;
use tower_service::Service;

use crate::observe::{self, connection_rejected, label};

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

    /// Serves every connection with a clone of `service` until `shutdown` resolves, then
    /// drains (see the [module docs](self)). Returns when every connection has ended.
    pub async fn serve<S, B>(self, service: S, shutdown: impl Future<Output = ()>)
    where
        S: Service<Request<Incoming>, Response = Response<B>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let Listener { name, tcp, config } = self;
        let streams = Streams::default();
        let mut builder = auto::Builder::new(streams.clone());
        // hyper's own header timeout would also run while a keep-alive connection waits for
        // its next request, closing it under clients that pool connections longer: the head
        // timer below starts at the first byte of a head instead.
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(None);
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(config.http2_keepalive_interval)
            .keep_alive_timeout(config.http2_keepalive_timeout)
            .max_concurrent_streams(config.http2_max_concurrent_streams);
        let shared = Arc::new(Shared {
            builder,
            config,
            open: Registry::default(),
            metrics: Metrics::new(&name),
        });
        let (drain_tx, drain_rx) = watch::channel(false);
        let mut conns = JoinSet::new();
        let mut backoff = None::<Duration>;
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = async {
                    shared.room_to_accept().await;
                    tcp.accept().await
                } => match accepted {
                    Ok((stream, peer)) => {
                        backoff = None;
                        if let Some(conn) = shared.admit() {
                            conns.spawn(serve_connection(
                                Arc::clone(&shared),
                                conn,
                                stream,
                                peer,
                                service.clone(),
                                drain_rx.clone(),
                            ));
                        }
                    }
                    Err(error) if is_connection_error(&error) => {}
                    Err(error) => {
                        // Most likely out of file descriptors: free one if a connection is
                        // idle, and pause instead of spinning on the same error.
                        shared.open.evict_idle(&shared.metrics);
                        let wait = backoff.map_or(shared.config.accept_backoff, |b| {
                            (b * 2).min(shared.config.accept_backoff_max)
                        });
                        if backoff.is_none() {
                            tracing::warn!(listener = %name, %error, "accept failed; backing off");
                        }
                        backoff = Some(wait);
                        tokio::select! {
                            () = tokio::time::sleep(wait) => {}
                            () = &mut shutdown => break,
                        }
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        drop(tcp);
        let _ = drain_tx.send(true);
        let drained = tokio::time::timeout(shared.config.drain_timeout, async {
            while conns.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                listener = %name,
                open = conns.len(),
                "drain bound reached: closing the remaining connections"
            );
        }
        // Aborts what is left and waits until each task has been dropped: HTTP/1 requests
        // are polled by their connection task, HTTP/2 requests by tasks of their own.
        conns.shutdown().await;
        streams.abort_all().await;
    }
}

/// Errors of one connection that `accept` reports: the next accept is fine.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// What every connection task of one listener shares.
struct Shared {
    builder: auto::Builder<Streams>,
    config: ListenConfig,
    open: Registry,
    metrics: Metrics,
}

impl Shared {
    /// Connections picked to make room close on their own task: an eighth over the cap is
    /// left for them, so a fast flood cannot outrun the closing and exhaust descriptors.
    fn hard_cap(&self) -> usize {
        let cap = self.config.max_connections;
        cap.saturating_add((cap / 8).max(1))
    }

    /// Waits while the hard cap is reached and some connections are closing to make room.
    ///
    /// New connections wait in the kernel's backlog meanwhile: accepting one only to refuse
    /// it would reset a well-behaved client that happened to arrive right behind a flood.
    /// Closing connections end without waiting on anything, so the wait is short.
    async fn room_to_accept(&self) {
        loop {
            let freed = self.open.freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            {
                let open = self.open.lock();
                let closing = || open.values().any(|c| c.evicted.load(Ordering::Acquire));
                if open.len() < self.hard_cap() || !closing() {
                    return;
                }
            }
            freed.await;
        }
    }

    /// Registers a new connection, making room at the cap; `None` when it must be refused.
    fn admit(&self) -> Option<Registered> {
        let cap = self.config.max_connections;
        let hard_cap = self.hard_cap();
        let mut open = self.open.lock();
        if open.len() >= cap
            && (open.len() >= hard_cap || !Registry::evict_in(&open, &self.metrics))
        {
            self.metrics.rejected(connection_rejected::REFUSED);
            return None;
        }
        let id = self.open.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(ConnState::new());
        open.insert(id, Arc::clone(&conn));
        drop(open);
        self.metrics.open.increment(1.0);
        Some(Registered { id, conn })
    }
}

/// The open connections of a listener, oldest first.
#[derive(Default)]
struct Registry {
    conns: Mutex<BTreeMap<u64, Arc<ConnState>>>,
    next_id: AtomicU64,
    /// Notified whenever a connection leaves.
    freed: Notify,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<ConnState>>> {
        // A poisoned map is still consistent: every update is a single insert or remove.
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn evict_idle(&self, metrics: &Metrics) -> bool {
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

/// State of one connection, seen by its task, its requests and the registry.
#[derive(Debug)]
struct ConnState {
    /// When the connection was accepted: the origin of `head_since`.
    opened: tokio::time::Instant,
    /// Milliseconds from `opened` to the first byte of the request head being read, plus one;
    /// 0 while no head is being read.
    head_since: AtomicU64,
    /// Notified when a head starts.
    head_started: Notify,
    /// The peer speaks HTTP/2: frames between requests (pings, window updates) are no head.
    http2: std::sync::atomic::AtomicBool,
    /// Requests between the service call and the end of their response body.
    in_flight: AtomicUsize,
    /// Requests started so far (for the idle timeout).
    started: AtomicU64,
    /// Set once the registry picked the connection to make room.
    evicted: std::sync::atomic::AtomicBool,
    /// Notified to close the connection at once.
    close: Notify,
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
        }
    }

    /// Bytes arrived: when no request is in flight they start a request head.
    fn bytes_read(&self, first: &[u8], first_read: bool) {
        if first_read && first.starts_with(HTTP2_PREFACE_START) {
            self.http2.store(true, Ordering::Relaxed);
        }
        if self.http2.load(Ordering::Relaxed) || self.in_flight.load(Ordering::Acquire) > 0 {
            return;
        }
        let since = u64::try_from(self.opened.elapsed().as_millis())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1);
        if self
            .head_since
            .compare_exchange(0, since, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.head_started.notify_one();
        }
    }
}

/// How an HTTP/2 connection with prior knowledge starts (`PRI * HTTP/2.0`).
const HTTP2_PREFACE_START: &[u8] = b"PRI ";

/// A connection's place in the registry; leaving it (drop) frees the place.
struct Registered {
    id: u64,
    conn: Arc<ConnState>,
}

/// Held by each request until its response body ends or is dropped.
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn start(conn: &Arc<ConnState>) -> Self {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        conn.head_since.store(0, Ordering::Release);
        conn.started.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(conn))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The connection metrics of one listener.
struct Metrics {
    name: String,
    open: metrics::Gauge,
}

impl Metrics {
    fn new(name: &str) -> Self {
        Metrics {
            name: name.to_owned(),
            open: metrics::gauge!(observe::RPC_SERVER_CONNECTIONS, label::SERVICE => name.to_owned()),
        }
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

/// Why a connection task stopped polling its connection.
enum Stop {
    Done,
    Close,
    Idle,
    Drain,
}

async fn serve_connection<S, B>(
    shared: Arc<Shared>,
    registered: Registered,
    stream: TcpStream,
    peer: SocketAddr,
    service: S,
    mut drain: watch::Receiver<bool>,
) where
    S: Service<Request<Incoming>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let _registered = Unregister {
        shared: &shared,
        id: registered.id,
    };
    let conn_state = registered.conn;
    // Small request/response exchanges: do not wait to fill a segment.
    let _ = stream.set_nodelay(true);
    let service = ConnService {
        inner: service,
        info: ConnectionInfo {
            peer,
            conn: Arc::clone(&conn_state),
        },
    };
    let io = ReadWatch {
        stream,
        conn: Arc::clone(&conn_state),
        first_read: true,
    };
    let conn = shared.builder.serve_connection(TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    let idle = idle_for(&conn_state, shared.config.idle_timeout);
    let mut idle = std::pin::pin!(idle);
    let slow_head = head_too_slow(&conn_state, shared.config.header_read_timeout);
    let mut slow_head = std::pin::pin!(slow_head);
    let stop = tokio::select! {
        result = conn.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
            Stop::Done
        }
        () = conn_state.close.notified() => Stop::Close,
        () = &mut slow_head => Stop::Close,
        () = &mut idle => Stop::Idle,
        _ = drain.wait_for(|draining| *draining) => Stop::Drain,
    };
    match stop {
        Stop::Done | Stop::Close => {}
        Stop::Idle => {
            conn.as_mut().graceful_shutdown();
            // A peer that does not take the GOAWAY (or the close) gets as long as a request
            // head.
            tokio::select! {
                _ = tokio::time::timeout(shared.config.header_read_timeout, conn.as_mut()) => {}
                () = conn_state.close.notified() => {}
            }
        }
        Stop::Drain => {
            // An HTTP/1 connection with no request started (idle, or a head still arriving)
            // has nothing to finish; HTTP/2 gets its GOAWAY, which tells the client which
            // requests were taken.
            if !conn_state.http2.load(Ordering::Relaxed)
                && conn_state.in_flight.load(Ordering::Acquire) == 0
            {
                return;
            }
            conn.as_mut().graceful_shutdown();
            // The listener's drain bound aborts this task if the requests take too long.
            tokio::select! {
                _ = conn.as_mut() => {}
                () = conn_state.close.notified() => {}
            }
        }
    }
}

/// Resolves once a request head has taken longer than `timeout` since its first byte.
async fn head_too_slow(conn: &ConnState, timeout: Duration) {
    loop {
        conn.head_started.notified().await;
        loop {
            let since = conn.head_since.load(Ordering::Acquire);
            if since == 0 {
                // The request started: wait for the next head.
                break;
            }
            let started = conn.opened + Duration::from_millis(since - 1);
            tokio::time::sleep_until(started + timeout).await;
            if conn.head_since.load(Ordering::Acquire) == since {
                return;
            }
        }
    }
}

/// Resolves once the connection has had no request in flight and none started for a whole
/// `idle_timeout`.
async fn idle_for(conn: &ConnState, idle_timeout: Duration) {
    let mut seen = conn.started.load(Ordering::Relaxed);
    loop {
        tokio::time::sleep(idle_timeout).await;
        let started = conn.started.load(Ordering::Relaxed);
        if started == seen && conn.in_flight.load(Ordering::Acquire) == 0 {
            return;
        }
        seen = started;
    }
}

/// The executor of HTTP/2 streams: hyper runs each stream's request on a task of its own, which
/// a dropped connection would not cancel; these are kept so the drain bound can abort them.
#[derive(Clone, Default)]
struct Streams(Arc<StreamTasks>);

#[derive(Default)]
struct StreamTasks {
    next_id: AtomicU64,
    running: Mutex<Running>,
    ended: Notify,
}

/// Stream tasks by id; a task that ended before its handle was recorded leaves its id in
/// `ended_early` instead.
#[derive(Default)]
struct Running {
    tasks: HashMap<u64, tokio::task::AbortHandle>,
    ended_early: HashSet<u64>,
}

impl StreamTasks {
    fn lock(&self) -> std::sync::MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<F> hyper::rt::Executor<F> for Streams
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, stream: F) {
        let id = self.0.next_id.fetch_add(1, Ordering::Relaxed);
        let ended = StreamEnded {
            tasks: Arc::clone(&self.0),
            id,
        };
        let task = tokio::spawn(async move {
            let _ended = ended;
            stream.await;
        });
        let mut running = self.0.lock();
        if !running.ended_early.remove(&id) {
            running.tasks.insert(id, task.abort_handle());
        }
    }
}

impl Streams {
    /// Aborts every stream task and waits until each has been dropped.
    async fn abort_all(&self) {
        for task in self.0.lock().tasks.values() {
            task.abort();
        }
        loop {
            let ended = self.0.ended.notified();
            let mut ended = std::pin::pin!(ended);
            ended.as_mut().enable();
            if self.0.lock().tasks.is_empty() {
                return;
            }
            ended.await;
        }
    }
}

/// Unregisters a stream task when it ends or is dropped.
struct StreamEnded {
    tasks: Arc<StreamTasks>,
    id: u64,
}

impl Drop for StreamEnded {
    fn drop(&mut self) {
        let mut running = self.tasks.lock();
        if running.tasks.remove(&self.id).is_none() {
            running.ended_early.insert(self.id);
        }
        if running.tasks.is_empty() {
            self.tasks.ended.notify_waiters();
        }
    }
}

/// Removes a connection from the registry when its task ends, however it ends.
struct Unregister<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        self.shared.open.lock().remove(&self.id);
        self.shared.open.freed.notify_waiters();
        self.shared.metrics.open.decrement(1.0);
    }
}

/// The service of one connection: adds [`ConnectionInfo`] and counts requests in flight.
#[derive(Clone)]
struct ConnService<S> {
    inner: S,
    info: ConnectionInfo,
}

impl<S, B> hyper::service::Service<Request<Incoming>> for ConnService<S>
where
    S: Service<Request<Incoming>, Response = Response<B>> + Clone,
{
    type Response = Response<InFlightBody<B>>;
    type Error = S::Error;
    type Future = ResponseFuture<Oneshot<S, Request<Incoming>>>;

    fn call(&self, mut request: Request<Incoming>) -> Self::Future {
        if request.version() == http::Version::HTTP_2 {
            self.info.conn.http2.store(true, Ordering::Relaxed);
        }
        let in_flight = InFlight::start(&self.info.conn);
        request.extensions_mut().insert(self.info.clone());
        ResponseFuture {
            inner: self.inner.clone().oneshot(request),
            in_flight: Some(in_flight),
        }
    }
}

pin_project! {
    /// Response future of [`ConnService`]: hands the in-flight mark to the body.
    struct ResponseFuture<F> {
        #[pin]
        inner: F,
        in_flight: Option<InFlight>,
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<InFlightBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = ready!(this.inner.poll(cx));
        let in_flight = this.in_flight.take();
        Poll::Ready(result.map(|response| {
            response.map(|inner| InFlightBody {
                inner,
                _in_flight: in_flight,
            })
        }))
    }
}

pin_project! {
    /// A response body that keeps its request counted as in flight until it ends.
    struct InFlightBody<B> {
        #[pin]
        inner: B,
        _in_flight: Option<InFlight>,
    }
}

impl<B: Body> Body for InFlightBody<B>
where
    B::Data: Buf,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// The connection's socket, telling its state when the bytes of a request head arrive.
    struct ReadWatch {
        #[pin]
        stream: TcpStream,
        conn: Arc<ConnState>,
        first_read: bool,
    }
}

impl AsyncRead for ReadWatch {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        ready!(this.stream.poll_read(cx, buf))?;
        let read = &buf.filled()[before..];
        if !read.is_empty() {
            this.conn.bytes_read(read, *this.first_read);
            *this.first_read = false;
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for ReadWatch {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.project().stream.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.project().stream.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().stream.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().stream.poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
