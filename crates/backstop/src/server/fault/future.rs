//! Response future of [`Fault`](super::Fault).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::Response;
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use crate::server::body::ResponseBody;

pin_project! {
    /// The inner future, an injected abort, or a delay followed by one of those.
    pub struct ResponseFuture<S, Req, B>
    where
        S: Service<Req>,
    {
        #[pin]
        state: State<S, Req, S::Future, B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, Req, F, B> {
        Inner {
            #[pin]
            fut: F,
        },
        Abort {
            response: Option<Response<ResponseBody<B>>>,
        },
        Delayed {
            // Boxed: the common paths keep a small future.
            sleep: Pin<Box<Sleep>>,
            then: Option<(Option<Response<ResponseBody<B>>>, S, Req)>,
        },
    }
}

impl<S, Req, B> fmt::Debug for ResponseFuture<S, Req, B>
where
    S: Service<Req>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, Req, B> ResponseFuture<S, Req, B>
where
    S: Service<Req>,
{
    pub(super) fn inner(fut: S::Future) -> Self {
        Self {
            state: State::Inner { fut },
        }
    }

    pub(super) fn abort(response: Response<ResponseBody<B>>) -> Self {
        Self {
            state: State::Abort {
                response: Some(response),
            },
        }
    }

    /// Waits `delay`, then answers `abort` or calls `service` (already ready) with `request`.
    pub(super) fn delayed(
        delay: Duration,
        abort: Option<Response<ResponseBody<B>>>,
        service: S,
        request: Req,
    ) -> Self {
        Self {
            state: State::Delayed {
                sleep: Box::pin(tokio::time::sleep(delay)),
                then: Some((abort, service, request)),
            },
        }
    }
}

impl<S, Req, B> Future for ResponseFuture<S, Req, B>
where
    S: Service<Req, Response = Response<B>>,
{
    type Output = Result<Response<ResponseBody<B>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Inner { fut } => {
                    return fut
                        .poll(cx)
                        .map(|result| result.map(|response| response.map(ResponseBody::inner)));
                }
                StateProj::Abort { response } => {
                    return Poll::Ready(Ok(response
                        .take()
                        .expect("ResponseFuture polled after completion")));
                }
                StateProj::Delayed { sleep, then } => {
                    ready!(sleep.as_mut().poll(cx));
                    let (abort, mut service, request) =
                        then.take().expect("ResponseFuture polled after completion");
                    match abort {
                        Some(response) => state.set(State::Abort {
                            response: Some(response),
                        }),
                        None => state.set(State::Inner {
                            fut: service.call(request),
                        }),
                    }
                }
            }
        }
    }
}
