//! Response futures of the client deadline services.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Timeout};
use tower::BoxError;

use crate::deadline::{Deadline, DeadlineExceeded, Margin, server_timing};

pin_project! {
    /// The logical call, cut off at its deadline with [`DeadlineExceeded`] (unless a layer
    /// below enforces it: see [`SetDeadline::untimed`](super::SetDeadline::untimed)).
    #[derive(Debug)]
    pub struct SetDeadlineFuture<F> {
        #[pin]
        kind: CallKind<F>,
    }
}

pin_project! {
    #[project = CallKindProj]
    #[derive(Debug)]
    enum CallKind<F> {
        Timed { #[pin] inner: Timeout<F> },
        Untimed { #[pin] inner: F },
    }
}

impl<F: Future> SetDeadlineFuture<F> {
    pub(super) fn timed(inner: F, deadline: Deadline) -> Self {
        Self {
            kind: CallKind::Timed {
                inner: tokio::time::timeout_at(deadline.instant(), inner),
            },
        }
    }

    pub(super) fn untimed(inner: F) -> Self {
        Self {
            kind: CallKind::Untimed { inner },
        }
    }
}

impl<F, T, E> Future for SetDeadlineFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let timed = match self.project().kind.project() {
            CallKindProj::Untimed { inner } => return inner.poll(cx).map_err(Into::into),
            CallKindProj::Timed { inner } => inner,
        };
        Poll::Ready(match ready!(timed.poll(cx)) {
            Ok(result) => result.map_err(Into::into),
            Err(_elapsed) => Err(Box::new(DeadlineExceeded::PASSED)),
        })
    }
}

pin_project! {
    /// One attempt: its duration, less the server's own reported processing time, feeds the
    /// peer's margin; refused when no time was left.
    #[derive(Debug)]
    pub struct AttemptFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<F> {
        Running { #[pin] future: F, started: Instant, margin: Option<Arc<Margin>> },
        Refused { exceeded: DeadlineExceeded },
    }
}

impl<F> AttemptFuture<F> {
    pub(super) fn running(future: F, started: Instant, margin: Option<Arc<Margin>>) -> Self {
        Self {
            kind: Kind::Running {
                future,
                started,
                margin,
            },
        }
    }

    pub(super) fn refused(exceeded: DeadlineExceeded) -> Self {
        Self {
            kind: Kind::Refused { exceeded },
        }
    }
}

impl<F, B, E> Future for AttemptFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<B>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Refused { exceeded } => Poll::Ready(Err(Box::new(*exceeded))),
            KindProj::Running {
                future,
                started,
                margin,
            } => {
                let result = ready!(future.poll(cx));
                if let (Ok(response), Some(margin)) = (&result, margin) {
                    // Only the network's share: the time the server says it held the request
                    // is its work, which the next call's budget must not be cut for. An
                    // answer that does not say teaches nothing (the floor, or a configured
                    // margin, stands).
                    let held = server_timing::from_headers(response.headers());
                    margin.observe_attempt(started.elapsed(), held);
                }
                Poll::Ready(result.map_err(Into::into))
            }
        }
    }
}
