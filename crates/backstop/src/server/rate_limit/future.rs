//! Response future of [`RateLimit`](super::RateLimit).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::Response;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::server::body::ResponseBody;
use crate::server::reject::RejectOr;

/// A decision still on its way (shared limiter): `None` admits, `Some` is the refusal.
pub(super) type Check<B> = Pin<Box<dyn Future<Output = Option<Response<ResponseBody<B>>>> + Send>>;

pin_project! {
    /// The refusal, the inner future, or (shared limiter) the decision still on its way
    /// followed by one of those.
    pub struct ResponseFuture<S, Req, F, B> {
        // Boxed: the local path, which never decides asynchronously, keeps a small future.
        deciding: Option<Box<Deciding<S, Req, B>>>,
        #[pin]
        inner: Option<RejectOr<F, B>>,
    }
}

/// The decision being made, with the ready service and the request it will get if admitted.
struct Deciding<S, Req, B> {
    check: Check<B>,
    service: S,
    request: Req,
}

impl<S, Req, F, B> fmt::Debug for ResponseFuture<S, Req, F, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("deciding", &self.deciding.is_some())
            .finish_non_exhaustive()
    }
}

impl<S, Req, F, B> ResponseFuture<S, Req, F, B> {
    pub(super) fn new(inner: RejectOr<F, B>) -> Self {
        Self {
            deciding: None,
            inner: Some(inner),
        }
    }

    /// Waits for `check`, then answers its refusal or calls `service` (already ready).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(super) fn deciding(check: Check<B>, service: S, request: Req) -> Self {
        Self {
            deciding: Some(Box::new(Deciding {
                check,
                service,
                request,
            })),
            inner: None,
        }
    }
}

impl<S, Req, B, E> Future for ResponseFuture<S, Req, S::Future, B>
where
    S: Service<Req, Response = Response<B>, Error = E>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Some(deciding) = this.deciding.as_mut() {
            let refusal = ready!(deciding.check.as_mut().poll(cx));
            let Some(deciding) = this.deciding.take() else {
                unreachable!("checked above")
            };
            let Deciding {
                mut service,
                request,
                ..
            } = *deciding;
            this.inner.set(Some(match refusal {
                Some(response) => RejectOr::reject(response),
                None => RejectOr::inner(service.call(request)),
            }));
        }
        match this.inner.as_pin_mut() {
            Some(inner) => inner.poll(cx),
            None => panic!("ResponseFuture polled after completion"),
        }
    }
}
