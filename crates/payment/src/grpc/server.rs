//! The gRPC listener: h2c (HTTP/2 with prior knowledge) on its own address, with the same
//! connection limits as the HTTP listener and stopped with it.

use std::future::Future;
use std::net::SocketAddr;

use backstop::server::listen::{ListenConfig, Listener};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use std::convert::Infallible;

use http::Request;
use hyper::body::Incoming;
use tower::util::BoxCloneService;

/// The gRPC side as this listener serves it: tonic's router for `payment.v1.Payment` behind
/// the server stack, taking requests as the listener reads them.
pub type GrpcService = BoxCloneService<Request<Incoming>, axum::response::Response, Infallible>;

/// `service` label of the gRPC listener's connection metrics.
const LISTENER: &str = "payment-grpc";

/// A bound gRPC listener.
#[derive(Debug)]
pub(crate) struct Bound {
    listener: TcpListener,
    addr: SocketAddr,
}

impl Bound {
    /// Binds `addr`.
    pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<Bound> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        Ok(Bound { listener, addr })
    }

    /// The bound address (the real port when asked for port 0).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves `service` on a background task until `shutdown` resolves, then drains within
    /// `limits.drain_timeout`; the task ends when every connection has.
    pub(crate) fn spawn(
        self,
        service: GrpcService,
        limits: ListenConfig,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> JoinHandle<()> {
        let listener = Listener::new(LISTENER, self.listener, limits);
        tokio::spawn(listener.serve(service, shutdown))
    }
}
