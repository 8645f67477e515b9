//! The accept loop and the drain at shutdown.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use hyper_util::rt::TokioTimer;
use hyper_util::server::conn::auto;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tower_service::Service;

use super::connection::serve_connection;
use super::push::Pushed;
use super::registry::{Metrics, Registry};
use super::shared::Shared;
use super::streams::Streams;
use super::{BoxError, Listener};

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

#[cfg(test)]
mod tests;
