//! Response future of [`IdempotencyService`](super::IdempotencyService).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use crate::server::body::ResponseBody;

type Keyed<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

pin_project! {
    /// The inner future unchanged (routes that are not keyed) or the keyed flow.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Passthrough {
            #[pin]
            fut: F,
        },
        Keyed {
            fut: Keyed<B, E>,
        },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(super) fn passthrough(fut: F) -> Self {
        Self {
            kind: Kind::Passthrough { fut },
        }
    }

    pub(super) fn keyed(fut: Keyed<B, E>) -> Self {
        Self {
            kind: Kind::Keyed { fut },
        }
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Passthrough { .. } => "passthrough",
            Kind::Keyed { .. } => "keyed",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { fut } => fut
                .poll(cx)
                .map(|result| result.map(|response| response.map(ResponseBody::inner))),
            KindProj::Keyed { fut } => fut.as_mut().poll(cx),
        }
    }
}
