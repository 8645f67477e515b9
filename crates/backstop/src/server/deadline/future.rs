//! Response future of [`DeadlineService`](super::DeadlineService).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep, sleep_until};

use crate::deadline::Deadline;
use crate::deadline::server_timing::{self, SERVER_TIMING};
use crate::server::body::ResponseBody;
use crate::server::problem::{Problem, Protocol};
use crate::status::{Code, Status, problem};

pin_project! {
    /// Either the inner future racing the deadline, or an immediate 400.
    #[derive(Debug)]
    pub struct ResponseFuture<F, B> {
        #[pin]
        kind: Kind<F, B>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<F, B> {
        Running {
            #[pin]
            inner: F,
            deadline: Deadline,
            // Attempts before this one (`grpc-previous-rpc-attempts`): retry at one layer.
            previous: u32,
            // When the request arrived, if answers say how long the server held them.
            arrived: Option<Instant>,
            protocol: Protocol,
            // Made on the first poll that finds the inner future pending: a request answered
            // at once never touches the timer.
            #[pin]
            sleep: Option<Sleep>,
        },
        Rejected {
            response: Option<Response<ResponseBody<B>>>,
        },
        Done,
    }
}

impl<F, B> ResponseFuture<F, B> {
    pub(super) fn running(
        inner: F,
        deadline: Deadline,
        previous: u32,
        arrived: Option<Instant>,
        protocol: Protocol,
    ) -> Self {
        Self {
            kind: Kind::Running {
                inner,
                deadline,
                previous,
                arrived,
                protocol,
                sleep: None,
            },
        }
    }

    pub(super) fn rejected(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Rejected {
                response: Some(response),
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut kind = self.project().kind;
        match kind.as_mut().project() {
            KindProj::Running {
                inner,
                deadline,
                previous,
                arrived,
                protocol,
                mut sleep,
            } => {
                // The handler and every layer below see the request's deadline as
                // `Deadline::current()`: a client call made there sends what is left of it;
                // and whether it arrived as a retry, so such a call does not retry again.
                let previous = *previous;
                let polled =
                    deadline.enter(|| crate::retry::inbound::enter(previous, || inner.poll(cx)));
                if let Poll::Ready(result) = polled {
                    let arrived = *arrived;
                    return Poll::Ready(result.map(|mut response| {
                        stamp(&mut response, arrived);
                        response.map(ResponseBody::inner)
                    }));
                }
                if sleep.is_none() {
                    sleep.set(Some(sleep_until(deadline.instant())));
                }
                if let Some(sleep) = sleep.as_pin_mut() {
                    std::task::ready!(sleep.poll(cx));
                }
                // Drop the inner future now, before answering: its cleanup (an idempotency
                // record marked failed, a gate permit returned) happens before the client
                // can see the 504 and retry.
                let (protocol, arrived) = (*protocol, *arrived);
                kind.set(Kind::Done);
                let mut response = deadline_exceeded(protocol);
                stamp(&mut response, arrived);
                Poll::Ready(Ok(response))
            }
            KindProj::Rejected { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
            KindProj::Done => panic!("ResponseFuture polled after completion"),
        }
    }
}

/// Says how long the server held the request, so the caller's margin can leave it out.
/// The handler's own `Server-Timing` metrics are kept; a `backstop` entry from further in (an
/// answer relayed from another backstop server) is dropped, since it timed another hop, even
/// when this server does not say its own time.
fn stamp<B>(response: &mut Response<B>, arrived: Option<Instant>) {
    let ours = arrived.map(|arrived| server_timing::header_value(arrived.elapsed()));
    let headers = response.headers_mut();
    match headers.entry(&SERVER_TIMING) {
        // The usual case: one lookup of the name, for the insert too.
        http::header::Entry::Vacant(entry) => {
            if let Some(ours) = ours {
                entry.insert(ours);
            }
        }
        http::header::Entry::Occupied(entry) => {
            let kept: Vec<_> = entry
                .remove_entry_mult()
                .1
                .filter(|value| !server_timing::names_ours(value.as_bytes()))
                .chain(ours)
                .collect();
            for value in kept {
                headers.append(&SERVER_TIMING, value);
            }
        }
    }
}

fn deadline_exceeded<B>(protocol: Protocol) -> Response<ResponseBody<B>> {
    let status = Status::new(
        Code::DeadlineExceeded,
        "the request's deadline passed before the server answered",
    )
    .with_problem(problem::DEADLINE_EXCEEDED);
    Problem::from_status(&status).into_response_for(protocol)
}
