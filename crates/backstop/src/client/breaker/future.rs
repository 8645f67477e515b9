//! The breaker's response future.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;
use tower::BoxError;

use super::{CircuitOpen, Permit};
use crate::client::RequestBodyError;
use crate::client::body_error::BodyFault;
use crate::client::classify::{is_failure_of_destination, response_status};
use crate::client::transparent::ResendRequested;

pin_project! {
    /// Records the attempt's outcome with the breaker, or fails at once when it was open.
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        kind: Kind<F>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<F> {
        Running { #[pin] future: F, permit: Option<Permit>, fault: Option<BodyFault> },
        Open { open: CircuitOpen },
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn running(future: F, permit: Option<Permit>, fault: Option<BodyFault>) -> Self {
        Self {
            kind: Kind::Running {
                future,
                permit,
                fault,
            },
        }
    }

    pub(super) fn open(open: CircuitOpen) -> Self {
        Self {
            kind: Kind::Open { open },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
    E: Into<BoxError>,
{
    type Output = Result<Response<B>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Open { open } => Poll::Ready(Err(Box::new(*open))),
            KindProj::Running {
                future,
                permit,
                fault,
            } => {
                let result = ready!(future.poll(cx)).map_err(Into::into);
                let healthy = match &result {
                    Ok(response) => Some(
                        response_status(response).is_none_or(|s| !is_failure_of_destination(&s)),
                    ),
                    // Never sent, and sent again at once by the retry layer: the re-send's
                    // outcome is the one that counts (a dropped permit records nothing).
                    Err(e) if e.is::<ResendRequested>() => None,
                    // The request's own body failed: its caller's fault, not the destination's.
                    Err(e)
                        if RequestBodyError::find(&**e).is_some()
                            || fault.as_ref().is_some_and(|f| f.get().is_some()) =>
                    {
                        None
                    }
                    Err(_) => Some(false),
                };
                if let (Some(permit), Some(healthy)) = (permit.take(), healthy) {
                    permit.record(healthy);
                }
                Poll::Ready(result)
            }
        }
    }
}
