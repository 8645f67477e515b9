//! Response future of [`RateLimit`](super::RateLimit).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use crate::server::reject::RejectOr;

pin_project! {
    /// Either the 429 answer or the inner future.
    #[derive(Debug)]
    pub struct ResponseFuture<F, B> {
        #[pin]
        inner: RejectOr<F, B>,
    }
}

impl<F, B> ResponseFuture<F, B> {
    pub(super) fn new(inner: RejectOr<F, B>) -> Self {
        Self { inner }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx)
    }
}
