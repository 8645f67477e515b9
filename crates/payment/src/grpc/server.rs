//! The gRPC listener: h2c (HTTP/2 with prior knowledge) on its own address, stopped with the
//! HTTP server.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::service::ServeError;

/// A bound gRPC listener and the router it will serve.
#[derive(Debug)]
pub(crate) struct Bound {
    listener: TcpListener,
    addr: SocketAddr,
    router: Router,
}

/// A gRPC server running on a background task.
#[derive(Debug)]
pub(crate) struct Running {
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Bound {
    /// Binds `addr` for `router`.
    pub(crate) async fn bind(addr: SocketAddr, router: Router) -> Result<Bound, ServeError> {
        let bind_error = |source| ServeError::Bind { addr, source };
        let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        Ok(Bound {
            listener,
            addr,
            router,
        })
    }

    /// The bound address (the real port when asked for port 0).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves on a background task until [`Running::stop`].
    pub(crate) fn spawn(self) -> Running {
        let (stop, stopped) = oneshot::channel::<()>();
        let served = axum::serve(
            self.listener,
            self.router
                .into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(async move {
            let _ = stopped.await;
        });
        let task = tokio::spawn(async move { served.await });
        Running { stop, task }
    }
}

impl Running {
    /// Stops accepting, lets in-flight calls finish for at most `drain`, then closes.
    pub(crate) async fn stop(self, drain: Duration) {
        let Running { stop, mut task } = self;
        let _ = stop.send(());
        match tokio::time::timeout(drain, &mut task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => tracing::warn!(%error, "the gRPC server failed"),
            Ok(Err(_)) => {}
            Err(_) => {
                tracing::warn!("drain bound reached: closing the remaining gRPC connections");
                task.abort();
            }
        }
    }
}
