//! Deadlines on the client: one per logical call, a shrinking `grpc-timeout` per attempt.
//!
//! Two services, on both sides of the retry layer:
//!
//! - [`SetDeadline`] (above retry) gives the logical call its one [`Deadline`]: the earliest
//!   of a `Deadline` the caller put in the request's extensions, the deadline the calling task
//!   runs under ([`Deadline::current`]: inside a handler behind the server stack, the incoming
//!   request's) and `now + the method's timeout` (which caps the others, as gRPC's service
//!   config timeout does). So a handler that calls another service the natural way,
//!   `client.oneshot(request)`, forwards what is left of its own time; it never starts a
//!   fresh one. Every attempt, retry and hedge shares that deadline, and the whole call is cut
//!   off when it passes. Work that leaves the handler's task keeps the deadline with
//!   [`deadline::carry`](crate::deadline::carry).
//! - [`AttemptTimeout`] (below retry) sends each attempt with `grpc-timeout` = what is left of
//!   that deadline minus the peer's [`Margin`] (`2 x RTT_p99 + 5 ms` within the destination's
//!   floor and ceiling), so the server gives up before the client does and its answer can
//!   still travel back. The round trips are what the server did not spend: each attempt's
//!   duration minus the processing time the server reports in
//!   [`Server-Timing`](crate::deadline::server_timing) (backstop servers do). A server that
//!   takes 300 ms therefore costs the next call's time nothing; an answer without the header
//!   teaches the margin nothing, and the destination's floor (or a margin fixed with
//!   [`Destination::fixed_margin`](crate::client::Destination::fixed_margin)) stands. An
//!   attempt that would start with no more than the margin left fails at once with
//!   [`DeadlineExceeded`](crate::deadline::DeadlineExceeded) and is not sent.
//!
//! HTTP requests carry `grpc-timeout` too: backstop servers read it the way gRPC servers do.

pub mod future;
mod layer;

pub use self::layer::{AttemptTimeoutLayer, SetDeadlineLayer};

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use tokio::time::Instant;
use tower::BoxError;
use tower_service::Service;

use self::future::{AttemptFuture, SetDeadlineFuture};
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
    /// Wraps `inner`; a call's deadline is the earliest of its [`Deadline`] extension, the
    /// task's [`Deadline::current`] and `default` from now (under a client stack, its method's
    /// timeout instead).
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
    type Future = SetDeadlineFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        // Under a client stack serving several methods, the call's own method's timeout.
        let timeout = match request.extensions().get::<Selected>() {
            Some(selected) => selected.0.timeout,
            None => self.default,
        };
        let deadline = call_deadline(
            request.extensions().get::<Deadline>().copied(),
            Deadline::current(),
            timeout,
        );
        request.extensions_mut().insert(deadline);
        let future = self.inner.call(request);
        if self.timed {
            SetDeadlineFuture::timed(future, deadline)
        } else {
            SetDeadlineFuture::untimed(future)
        }
    }
}

/// The deadline of a call: the earliest of the one the caller set on the request, the one the
/// caller's task runs under (the request it is handling) and the method's timeout from now.
/// As gRPC does, a method's timeout caps a longer deadline; nothing ever extends one.
fn call_deadline(
    explicit: Option<Deadline>,
    inherited: Option<Deadline>,
    timeout: Duration,
) -> Deadline {
    [explicit, inherited]
        .into_iter()
        .flatten()
        .fold(Deadline::after(timeout), Ord::min)
}

/// Sends each attempt with the time left minus the peer's margin, or not at all.
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

impl<S, B, RB> Service<Request<B>> for AttemptTimeout<S>
where
    S: Service<Request<B>, Response = http::Response<RB>>,
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
    async fn each_attempt_sends_the_time_left_minus_the_margin() {
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
        send.send_response(held_for(30));
        call.await.unwrap();

        // The 40 ms attempt, 30 of them the server's own work, raises the margin to
        // 2 x 10 + 5 = 25 ms.
        assert_eq!(margin.current(), 25 * MS);
        let mut request = Request::new(());
        request.extensions_mut().insert(deadline);
        let call = svc.ready().await.unwrap().call(request);
        let (sent, send) = handle.next_request().await.unwrap();
        let budget =
            decode_grpc_timeout(sent.headers()[&GRPC_TIMEOUT_HEADER].to_str().unwrap()).unwrap();
        assert_eq!(budget, (1000 - 40 - 25) * MS);
        send.send_response(Response::new(()));
        call.await.unwrap();
    }

    /// An answer saying how long the server worked on it.
    fn held_for(ms: u32) -> Response<()> {
        let mut response = Response::new(());
        response.headers_mut().insert(
            &crate::deadline::server_timing::SERVER_TIMING,
            crate::deadline::server_timing::header_value(ms * MS),
        );
        response
    }

    /// A backend that takes 300 ms per answer costs later calls nothing: the margin learns
    /// the round trip, not the work. A peer that does not report its work teaches nothing.
    #[tokio::test(start_paused = true)]
    async fn a_slow_server_does_not_shrink_the_next_calls_timeout() {
        let margin = Arc::new(Margin::new(5 * MS));
        let (svc, mut handle) = mock::pair::<Request<()>, Response<()>>();
        let mut svc = AttemptTimeout::new(svc, margin.clone());
        handle.allow(100);
        for i in 0..40 {
            let mut request = Request::new(());
            request
                .extensions_mut()
                .insert(Deadline::after(Duration::from_millis(500)));
            let call = svc.ready().await.unwrap().call(request);
            let (_, send) = handle.next_request().await.unwrap();
            advance(301 * MS).await;
            // Half of them say how long they worked; the others say nothing.
            send.send_response(if i % 2 == 0 {
                held_for(300)
            } else {
                Response::new(())
            });
            call.await.unwrap();
        }
        assert_eq!(margin.current(), 7 * MS);

        let mut request = Request::new(());
        request
            .extensions_mut()
            .insert(Deadline::after(Duration::from_millis(500)));
        let call = svc.ready().await.unwrap().call(request);
        let (sent, send) = handle.next_request().await.unwrap();
        let budget =
            decode_grpc_timeout(sent.headers()[&GRPC_TIMEOUT_HEADER].to_str().unwrap()).unwrap();
        assert_eq!(budget, 493 * MS, "a 500 ms budget minus 2 x 1 ms + 5 ms");
        send.send_response(Response::new(()));
        call.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_without_time_left_fails_at_once_and_is_not_sent() {
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
