//! [`LayerFuture`]: the response future shared by the client layers that usually pass a call
//! straight through and only sometimes have more to do.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tower::BoxError;

/// A boxed response future, for the paths that run more than the inner call.
pub type BoxResponseFuture<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

pin_project! {
    /// The response future of a client layer: the inner service's own future, polled in place
    /// (no allocation, no clone of the service) when the layer has nothing to add to the call,
    /// or a boxed future when it does (a hedge, a re-send, a journal write). The fast path is
    /// the common one: most calls are not hedged, not re-sent and not journaled.
    #[derive(Debug)]
    pub struct LayerFuture<F, T> {
        #[pin]
        kind: Kind<F, T>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, T> {
        Direct { #[pin] future: F },
        Boxed { future: BoxResponseFuture<T> },
    }
}

impl<F, T> std::fmt::Debug for Kind<F, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Direct { .. } => "Direct",
            Kind::Boxed { .. } => "Boxed",
        })
    }
}

impl<F, T> LayerFuture<F, T> {
    /// The inner call's future, as it is.
    pub(crate) fn direct(future: F) -> Self {
        Self {
            kind: Kind::Direct { future },
        }
    }

    /// A future that does more than the inner call.
    pub(crate) fn boxed(future: BoxResponseFuture<T>) -> Self {
        Self {
            kind: Kind::Boxed { future },
        }
    }
}

impl<F, T, E> Future for LayerFuture<F, T>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Direct { future } => Poll::Ready(ready!(future.poll(cx)).map_err(Into::into)),
            KindProj::Boxed { future } => future.as_mut().poll(cx),
        }
    }
}

pin_project! {
    /// The response future of a [`ClientStack`](super::ClientStack)'s service: the call, its
    /// failure read as a typed [`Error`](super::Error).
    #[derive(Debug)]
    pub struct CallFuture<F> {
        #[pin]
        inner: F,
    }
}

impl<F> CallFuture<F> {
    pub(crate) fn new(inner: F) -> Self {
        Self { inner }
    }
}

impl<F, T, E> Future for CallFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, super::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let result = ready!(self.project().inner.poll(cx));
        Poll::Ready(result.map_err(|e| super::Error::from_box(e.into())))
    }
}
