//! A response future that is either an immediate refusal or the inner service's future.
//!
//! The layers that refuse work (bad `grpc-timeout`, tenant over quota, unknown credentials)
//! answer without calling the inner service; this keeps those paths free of boxing. The
//! refusal is a body written in memory, the inner answer's body passes through untouched
//! (see [`ResponseBody`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use super::body::ResponseBody;

pin_project! {
    /// Either an immediate response or the inner future.
    #[project = RejectOrProj]
    #[derive(Debug)]
    pub(crate) enum RejectOr<F, B> {
        /// Answer at once without calling the inner service.
        Reject { response: Option<Response<ResponseBody<B>>> },
        /// The inner service's future.
        Inner { #[pin] fut: F },
    }
}

impl<F, B> RejectOr<F, B> {
    pub(crate) fn reject(response: Response<ResponseBody<B>>) -> Self {
        Self::Reject {
            response: Some(response),
        }
    }

    pub(crate) fn inner(fut: F) -> Self {
        Self::Inner { fut }
    }
}

impl<F, B, E> Future for RejectOr<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            RejectOrProj::Reject { response } => Poll::Ready(Ok(response
                .take()
                .expect("RejectOr polled after completion"))),
            RejectOrProj::Inner { fut } => fut
                .poll(cx)
                .map(|result| result.map(|response| response.map(ResponseBody::inner))),
        }
    }
}
