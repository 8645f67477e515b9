//! The accept loop and the drain at shutdown.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use hyper_util::rt::TokioTimer;
use hyper_util::server::conn::auto;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tower_service::Service;

use super::connection::serve_connection;
use super::push::Pushed;
use super::registry::{Metrics, Registry};
use super::{BoxError, ListenConfig, Listener};

impl Listener {
    /// Serves every connection with a clone of `service` until `shutdown` resolves, then
    /// drains (see the [module docs](crate::server::listen)). Returns when every connection has ended.
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
            pushed: Pushed::new(),
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
pub(super) struct Shared {
    pub(super) builder: auto::Builder<Streams>,
    pub(super) config: ListenConfig,
    pub(super) open: Registry,
    pub(super) metrics: Metrics,
    pub(super) pushed: Mutex<Pushed>,
}

/// The executor of HTTP/2 streams: hyper runs each stream's request on a task of its own, which
/// a dropped connection would not cancel; these are kept so the drain bound can abort them.
#[derive(Clone, Default)]
pub(super) struct Streams(Arc<StreamTasks>);

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

#[cfg(test)]
mod tests;
