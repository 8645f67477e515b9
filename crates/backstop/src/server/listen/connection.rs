//! One connection's task: serving it until it ends, is closed, goes idle or drains, and
//! counting its requests in flight until their response bodies end.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};

use bytes::Buf;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use pin_project_lite::pin_project;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tower::ServiceExt;
use tower::util::Oneshot;
use tower_service::Service;

use super::registry::{Registered, Unregister};
use super::shared::Shared;
use super::timeouts::{ReadWatch, head_too_slow, idle_for};
use super::{BoxError, ConnState, ConnectionInfo};

/// Why a connection task stopped polling its connection.
enum Stop {
    Done,
    Close,
    Idle,
    Drain,
}

pub(super) async fn serve_connection<S, B>(
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
        open: &shared.open,
        metrics: &shared.metrics,
        id: registered.id,
    };
    let conn_state = registered.conn;
    // Small request/response exchanges: do not wait to fill a segment.
    let _ = stream.set_nodelay(true);
    let service = ConnService {
        inner: service,
        shared: Arc::clone(&shared),
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
    let stop = loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%peer, %error, "connection ended with an error");
                }
                break Stop::Done;
            }
            () = conn_state.close.notified() => break Stop::Close,
            () = &mut slow_head => break Stop::Close,
            () = &mut idle => break Stop::Idle,
            _ = drain.wait_for(|draining| *draining) => break Stop::Drain,
            () = conn_state.go_away.notified() => {
                // Pushed away (HTTP/2): the requests in flight finish and the connection ends
                // as any other, the client opening a new one for its next requests.
                conn.as_mut().graceful_shutdown();
            }
        }
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

/// The service of one connection: adds [`ConnectionInfo`], counts requests in flight and
/// pushes the connection away under overload.
#[derive(Clone)]
struct ConnService<S> {
    inner: S,
    shared: Arc<Shared>,
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
        let http2 = request.version() == http::Version::HTTP_2;
        if http2 {
            self.info.conn.http2.store(true, Ordering::Relaxed);
        }
        let in_flight = InFlight::start(&self.info.conn);
        request.extensions_mut().insert(self.info.clone());
        let push = self.shared.config.push_away.is_some().then(|| Push {
            shared: Arc::clone(&self.shared),
            http2,
        });
        ResponseFuture {
            inner: self.inner.clone().oneshot(request),
            in_flight: Some(in_flight),
            push,
        }
    }
}

pin_project! {
    /// Response future of [`ConnService`]: hands the in-flight mark to the body.
    struct ResponseFuture<F> {
        #[pin]
        inner: F,
        in_flight: Option<InFlight>,
        push: Option<Push>,
    }
}

/// What a response needs to push its connection away.
struct Push {
    shared: Arc<Shared>,
    http2: bool,
}

impl Push {
    /// Pushes the connection away with `response` if the listener says so now.
    fn apply<B>(&self, conn: &ConnState, response: &mut Response<B>) {
        if !self.shared.push_now(conn, self.http2) {
            return;
        }
        if self.http2 {
            // `Connection` is not an HTTP/2 header: the connection task sends `GOAWAY`.
            conn.go_away.notify_one();
        } else {
            response.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<InFlightBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut result = ready!(this.inner.poll(cx));
        let in_flight = this.in_flight.take();
        if let (Some(push), Some(in_flight), Ok(response)) =
            (this.push.as_ref(), in_flight.as_ref(), result.as_mut())
        {
            push.apply(&in_flight.0, response);
        }
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

#[cfg(test)]
mod tests;
