//! Transparent retry: re-send, once, an attempt that provably never reached the server.
//!
//! Some failures prove that the server never saw the request, so sending it again cannot
//! apply an effect twice, whatever the method's contract:
//!
//! - the connection could not be made (connection refused, or any connect error of the
//!   hyper-util client);
//! - the HTTP/2 stream was refused (`RST_STREAM` with `REFUSED_STREAM`, RFC 9113 section 8.7);
//! - the server sent `GOAWAY` and the stream's id is above its `last_stream_id` (h2 reports
//!   exactly those streams as a remote `GOAWAY` error; streams at or below it are answered).
//!
//! [`TransparentRetry`] re-sends such an attempt once, at once, without counting it against
//! the method's max attempts, but paying from the destination's budget like any other extra
//! attempt. It sits below the circuit breaker and the hedge so that the
//! retry is invisible to them, and above the balancer, so the re-send may go to another
//! endpoint. Anything else (a reset after the request was sent, a timeout) may have reached the
//! server and is left to the retry layer and the method's contract.
//!
//! # Under the retry layer
//!
//! Keeping a copy of every attempt for a re-send that almost never happens costs a copy of the
//! request head per attempt (header map, extensions). Under the [retry layer](super::retry),
//! which already keeps the call's head and body to make attempts from, this layer keeps none:
//! the retry layer marks the bodies of the attempts it makes (a mark on the
//! [`ReplayBody`], which every attempt has anyway, rather than an extension, which would cost an
//! allocation per attempt), and for such an attempt this layer answers a never-sent failure it
//! may re-send (budget token taken) with [`ResendRequested`]; the retry layer then sends the
//! same attempt again at once, without counting it against max attempts, through the layers
//! below it, so the re-send gets a fresh `grpc-timeout`. The circuit breaker does not count a
//! [`ResendRequested`] failure (the re-send's outcome is what it counts), so the re-send stays
//! invisible to it; the re-sent attempt's body is marked so that it is not re-sent again. Used
//! alone, this layer copies each attempt and re-sends it itself.
//!
//! One known imprecision, from hyper's HTTP/2 client: on a multi-threaded runtime, a request
//! that h2 has already handed to the connection can still fail with the connection's `GOAWAY`
//! error when the `GOAWAY` arrives in the same instant, whatever the stream's id (the error
//! does not carry the stream id, so the two cases cannot be told apart here). Such a request
//! may have reached the server and is re-sent anyway. This is why the re-send is limited to
//! what may be sent twice: an `Unsafe` call's body is never kept for replay, so it is never
//! re-sent; a `Keyed` call carries the same idempotency key, so the server runs it once; a
//! `Safe` call has no effect to repeat.

mod layer;

pub use self::layer::TransparentRetryLayer;

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use http::Request;
use pin_project_lite::pin_project;
use tower::{BoxError, ServiceExt};
use tower_service::Service;

use super::future::BoxResponseFuture;
use super::reach::unsent;
use super::replay::{ReplayBody, ResendBy, try_clone_request};
use crate::retry::RetryBudget;

/// Whether `error` proves the request never reached the server (see the [module docs](self)).
/// Walks the `source()` chain, matching types, never messages.
pub fn never_sent(error: &(dyn StdError + 'static)) -> bool {
    unsent(error).is_some()
}

/// The failure of an attempt made by the [retry layer](super::retry) above that never reached
/// the server and may be sent again (the budget token for it is taken): the retry layer
/// re-sends it. Its source is the transport's error.
#[derive(Debug, thiserror::Error)]
#[error("the attempt never reached the server; it is sent again")]
pub struct ResendRequested {
    #[source]
    source: BoxError,
}

impl ResendRequested {
    /// The transport's error.
    pub fn into_source(self) -> BoxError {
        self.source
    }
}

/// Re-sends, once, an attempt that never reached the server (see the [module docs](self)).
#[derive(Debug)]
pub struct TransparentRetry<S> {
    inner: S,
    shared: Arc<Shared<S>>,
}

/// What every clone of one [`TransparentRetry`] shares, behind one reference count.
#[derive(Debug)]
struct Shared<S> {
    /// A handle kept only to be cloned for a re-send, so that calls that are not re-sent (all
    /// but a few) clone nothing.
    spare: Mutex<S>,
    budget: Option<RetryBudget>,
}

impl<S: Clone> Clone for TransparentRetry<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: Clone> TransparentRetry<S> {
    /// Wraps `inner`; re-sends spend a token of `budget` when one is given.
    pub fn new(inner: S, budget: Option<RetryBudget>) -> Self {
        Self {
            shared: Arc::new(Shared {
                spare: Mutex::new(inner.clone()),
                budget,
            }),
            inner,
        }
    }
}

impl<S, B> Service<Request<ReplayBody<B>>> for TransparentRetry<S>
where
    S: Service<Request<ReplayBody<B>>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    S::Response: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<ReplayBody<B>>) -> Self::Future {
        // A body sent once is never re-sent, and neither is a re-send: then nothing is kept.
        let again = match request.body().resend_by() {
            None | Some(ResendBy::Nobody) => None,
            Some(ResendBy::Above) => Some(Again::Above(Arc::clone(&self.shared))),
            Some(ResendBy::Here) => try_clone_request(&request)
                .map(|copy| Again::Here(Box::new(copy), Arc::clone(&self.shared))),
        };
        ResponseFuture {
            state: State::First {
                future: self.inner.call(request),
                again,
            },
        }
    }
}

pin_project! {
    /// The response future of [`TransparentRetry`]: the attempt, then at most one re-send.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<ReplayBody<B>>>,
    {
        #[pin]
        state: State<S, B>,
    }
}

/// Who re-sends a never-sent attempt.
enum Again<S, B> {
    /// This layer, with its copy of the request (boxed: under the retry layer there is no copy,
    /// and an inline one would make every call's future larger).
    Here(Box<Request<ReplayBody<B>>>, Arc<Shared<S>>),
    /// The retry layer above (see [`ResendRequested`]); only the budget is needed here.
    Above(Arc<Shared<S>>),
}

impl<S, B> Again<S, B> {
    fn shared(&self) -> &Shared<S> {
        match self {
            Again::Here(_, shared) | Again::Above(shared) => shared,
        }
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, B>
    where
        S: Service<Request<ReplayBody<B>>>,
    {
        First { #[pin] future: S::Future, again: Option<Again<S, B>> },
        // Boxed: re-sends are rare, and an inline one would make every call's future larger.
        Again { future: BoxResponseFuture<S::Response> },
    }
}

impl<S, B> std::fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, B> Future for ResponseFuture<S, B>
where
    S: Service<Request<ReplayBody<B>>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    S::Response: Send + 'static,
    B: Send + 'static,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::First { future, again } => {
                    let error: BoxError = match ready!(future.poll(cx)) {
                        Ok(response) => return Poll::Ready(Ok(response)),
                        Err(e) => e.into(),
                    };
                    let Some(again) = again.take() else {
                        return Poll::Ready(Err(error));
                    };
                    if !never_sent(&*error)
                        || !again
                            .shared()
                            .budget
                            .as_ref()
                            .is_none_or(RetryBudget::try_withdraw)
                    {
                        return Poll::Ready(Err(error));
                    }
                    tracing::debug!(
                        name: crate::observe::event::RPC_TRANSPARENT_RETRY,
                        event = crate::observe::event::RPC_TRANSPARENT_RETRY,
                        error = %error,
                        "re-sending an attempt that never reached the server"
                    );
                    let Again::Here(request, shared) = again else {
                        return Poll::Ready(Err(Box::new(ResendRequested { source: error })));
                    };
                    let request = *request;
                    let svc = shared
                        .spare
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .clone();
                    let future = svc.oneshot(request);
                    this.state.set(State::Again {
                        future: Box::pin(async move { future.await.map_err(Into::into) }),
                    });
                }
                StateProj::Again { future } => {
                    return future.as_mut().poll(cx);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::replay::Replay;
    use bytes::Bytes;
    use http::Response;
    use http_body::Body as _;
    use http_body_util::Full;
    use std::io;
    use tower_test::mock;

    type Body = ReplayBody<Full<Bytes>>;

    fn replayable() -> Request<Body> {
        Request::new(Replay::new(Bytes::from_static(b"x")).body())
    }

    #[test]
    fn only_provably_unsent_errors_qualify() {
        assert!(never_sent(&io::Error::from(
            io::ErrorKind::ConnectionRefused
        )));
        assert!(!never_sent(&io::Error::from(
            io::ErrorKind::ConnectionReset
        )));
        assert!(never_sent(&h2::Error::from(h2::Reason::REFUSED_STREAM)));
        assert!(!never_sent(&h2::Error::from(h2::Reason::CANCEL)));
        // Wrapped, as clients wrap them.
        let wrapped = io::Error::other(io::Error::from(io::ErrorKind::ConnectionRefused));
        assert!(never_sent(&wrapped));
        assert!(!never_sent(&crate::status::Status::new(
            crate::status::Code::Unavailable,
            "connection refused"
        )));
    }

    #[tokio::test]
    async fn a_refused_connection_is_sent_again_once() {
        let (svc, mut handle) = mock::pair::<Request<Body>, Response<()>>();
        let budget = RetryBudget::new(0.1, 5).unwrap();
        let mut svc = TransparentRetry::new(svc, Some(budget.clone()));
        handle.allow(4);

        let call = tokio::spawn(svc.ready().await.unwrap().call(replayable()));
        let (_, send) = handle.next_request().await.unwrap();
        send.send_error(io::Error::from(io::ErrorKind::ConnectionRefused));
        let (again, send) = handle.next_request().await.unwrap();
        assert_eq!(again.body().size_hint().exact(), Some(1));
        send.send_response(Response::new(()));
        call.await.unwrap().unwrap();
        assert_eq!(budget.available(), 4.0);

        // Once only.
        let call = tokio::spawn(svc.ready().await.unwrap().call(replayable()));
        for _ in 0..2 {
            let (_, send) = handle.next_request().await.unwrap();
            send.send_error(io::Error::from(io::ErrorKind::ConnectionRefused));
        }
        assert!(call.await.unwrap().is_err());
    }

    #[tokio::test]
    async fn an_error_after_sending_is_not_retried_here() {
        let (svc, mut handle) = mock::pair::<Request<Body>, Response<()>>();
        let mut svc = TransparentRetry::new(svc, None);
        handle.allow(2);
        let call = tokio::spawn(svc.ready().await.unwrap().call(replayable()));
        let (_, send) = handle.next_request().await.unwrap();
        send.send_error(io::Error::from(io::ErrorKind::ConnectionReset));
        assert!(call.await.unwrap().is_err());
        assert!(futures_util::FutureExt::now_or_never(handle.next_request()).is_none());
    }
}
