//! Deadlines on the client: one per logical call, a shrinking `grpc-timeout` per attempt.
//!
//! Two services, on both sides of the retry layer:
//!
//! - [`SetDeadline`] (above retry) gives the logical call its one [`Deadline`]: the one the
//!   caller put in the request's extensions (for a hop, the incoming request's deadline), else
//!   `now + default timeout`. Every attempt, retry and hedge shares it, and the whole call is cut
//!   off when it passes.
//! - [`AttemptTimeout`] (below retry) sends each attempt with `grpc-timeout` = what is left of
//!   that deadline minus the peer's [`Margin`] (`max(floor, 2 x RTT_p99 + 5 ms)`, learned from
//!   the durations of this destination's attempts), so the server gives up before the client
//!   does and its answer can still travel back. An attempt that would start with no more than
//!   the margin left fails at once with
//!   [`DeadlineExceeded`](crate::deadline::DeadlineExceeded) and is not sent.
//!
//! HTTP requests carry `grpc-timeout` too: backstop servers read it the way gRPC servers do.

pub mod future;
mod layer;

pub use self::layer::{AttemptTimeoutLayer, DeadlineLayer};

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use tokio::time::Instant;
use tower::BoxError;
use tower_service::Service;

use self::future::{AttemptFuture, ResponseFuture};
use super::select::Selected;
use crate::deadline::{Deadline, GRPC_TIMEOUT_HEADER, Margin, grpc_timeout_header_value};

/// Gives a logical call its deadline and cuts the call off when it passes.
#[derive(Debug, Clone)]
pub struct SetDeadline<S> {
    inner: S,
    default: Duration,
    timed: bool,
}

impl<S> SetDeadline<S> {
    /// Wraps `inner`; calls without a [`Deadline`] extension get `default` from now.
    pub fn new(inner: S, default: Duration) -> Self {
        Self {
            inner,
            default,
            timed: true,
        }
    }

    /// Like [`new`](Self::new), but leaves cutting the call off to the service below, for a
    /// service that enforces the deadline itself: the [retry layer](super::retry::Retry) cuts
    /// every attempt at it and never waits past it. Saves a timer per call.
    pub fn untimed(inner: S, default: Duration) -> Self {
        Self {
            timed: false,
            ..Self::new(inner, default)
        }
    }
}

impl<S, B> Service<Request<B>> for SetDeadline<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        // Under a client stack serving several methods, the call's own method's timeout.
        let default = match request.extensions().get::<Selected>() {
            Some(selected) => selected.0.timeout,
            None => self.default,
        };
        let deadline = *request
            .extensions_mut()
            .get_or_insert_with(|| Deadline::after(default));
        let future = self.inner.call(request);
        if self.timed {
            ResponseFuture::timed(future, deadline)
        } else {
            ResponseFuture::untimed(future)
        }
    }
}

/// Sends each attempt with the remaining budget minus the peer's margin, or not at all.
#[derive(Debug, Clone)]
pub struct AttemptTimeout<S> {
    inner: S,
    margin: Arc<Margin>,
}

impl<S> AttemptTimeout<S> {
    /// Wraps `inner`, keeping `margin` (shared by every stack calling the same destination)
    /// for the way back and feeding it the attempts' durations.
    pub fn new(inner: S, margin: Arc<Margin>) -> Self {
        Self { inner, margin }
    }
}

impl<S, B> Service<Request<B>> for AttemptTimeout<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = AttemptFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let Some(deadline) = request.extensions().get::<Deadline>().copied() else {
            return AttemptFuture::running(self.inner.call(request), Instant::now(), None);
        };
        // One reading of the clock for the budget sent and the attempt's start.
        let now = Instant::now();
        let child = match deadline.child_at(now, self.margin.current()) {
            Ok(child) => child,
            Err(exceeded) => return AttemptFuture::refused(exceeded),
        };
        request.headers_mut().insert(
            &GRPC_TIMEOUT_HEADER,
            grpc_timeout_header_value(child.remaining_at(now)),
        );
        AttemptFuture::running(self.inner.call(request), now, Some(self.margin.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deadline::{DeadlineExceeded, decode_grpc_timeout};
    use http::Response;
    use tokio::time::advance;
    use tower::ServiceExt;
    use tower_test::mock;

    const MS: Duration = Duration::from_millis(1);

    #[tokio::test(start_paused = true)]
    async fn each_attempt_sends_the_remaining_budget_minus_the_margin() {
        let margin = Arc::new(Margin::new(20 * MS));
        let (svc, mut handle) = mock::pair::<Request<()>, Response<()>>();
        let mut svc = AttemptTimeout::new(svc, margin.clone());
        handle.allow(2);

        let deadline = Deadline::after(Duration::from_secs(1));
        let mut request = Request::new(());
        request.extensions_mut().insert(deadline);
        let call = svc.ready().await.unwrap().call(request);
        let (sent, send) = handle.next_request().await.unwrap();
        let budget =
            decode_grpc_timeout(sent.headers()[&GRPC_TIMEOUT_HEADER].to_str().unwrap()).unwrap();
        assert_eq!(budget, 980 * MS);
        assert!(
            sent.headers()[&GRPC_TIMEOUT_HEADER].is_sensitive(),
            "a per-attempt budget must not be HPACK-indexed"
        );
        advance(40 * MS).await;
        send.send_response(Response::new(()));
        call.await.unwrap();

        // The observed 40 ms attempt raises the margin to 2 x 40 + 5 = 85 ms.
        assert_eq!(margin.current(), 85 * MS);
        let mut request = Request::new(());
        request.extensions_mut().insert(deadline);
        let call = svc.ready().await.unwrap().call(request);
        let (sent, send) = handle.next_request().await.unwrap();
        let budget =
            decode_grpc_timeout(sent.headers()[&GRPC_TIMEOUT_HEADER].to_str().unwrap()).unwrap();
        assert_eq!(budget, (1000 - 40 - 85) * MS);
        send.send_response(Response::new(()));
        call.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_without_budget_fails_at_once_and_is_not_sent() {
        let margin = Arc::new(Margin::new(50 * MS));
        let (svc, mut handle) = mock::pair::<Request<()>, Response<()>>();
        let mut svc = AttemptTimeout::new(svc, margin);
        handle.allow(1);
        let mut request = Request::new(());
        request.extensions_mut().insert(Deadline::after(50 * MS));
        let err = svc.ready().await.unwrap().call(request).await.unwrap_err();
        let refused = err.downcast_ref::<DeadlineExceeded>().unwrap();
        assert_eq!(refused.margin, 50 * MS);
        assert!(futures_util::FutureExt::now_or_never(handle.next_request()).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn the_logical_deadline_is_set_once_and_cuts_the_call_off() {
        let (svc, mut handle) = mock::pair::<Request<()>, Response<()>>();
        let mut svc = SetDeadline::new(svc, Duration::from_secs(2));
        handle.allow(2);

        // A deadline from the caller (an incoming request's) is kept.
        let inherited = Deadline::after(300 * MS);
        let mut request = Request::new(());
        request.extensions_mut().insert(inherited);
        let call = svc.ready().await.unwrap().call(request);
        let (sent, _send) = handle.next_request().await.unwrap();
        assert_eq!(sent.extensions().get::<Deadline>(), Some(&inherited));
        advance(300 * MS).await;
        let err = call.await.unwrap_err();
        assert!(err.is::<DeadlineExceeded>());

        // Otherwise the default.
        let call = svc.ready().await.unwrap().call(Request::new(()));
        let (sent, send) = handle.next_request().await.unwrap();
        let set = sent.extensions().get::<Deadline>().unwrap();
        assert_eq!(set.remaining(), Duration::from_secs(2));
        send.send_response(Response::new(()));
        call.await.unwrap();
    }
}
