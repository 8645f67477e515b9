//! Response future of [`GateService`](super::GateService).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::{mark_connection, overloaded};
use crate::admission::{Gate, GatePermit, Overloaded};
use crate::deadline::Deadline;
use crate::server::body::ResponseBody;
use crate::server::metrics::Route;
use crate::server::problem::Protocol;
use crate::server::tenant::Tenant;
use crate::status::{Code, Outcome};

/// Memory a waiting request holds besides its body: head, extensions, futures (an estimate).
const REQUEST_OVERHEAD: usize = 2 << 10;

/// The memory a waiting request declares to the gate's queue: its announced body length
/// (bodies of the routes behind the gate are read before it) plus the overhead.
fn waiting_cost<B>(request: &Request<B>) -> usize {
    let body = request
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    REQUEST_OVERHEAD.saturating_add(body)
}

type Enter = Pin<Box<dyn Future<Output = Result<GatePermit, Overloaded>> + Send>>;

pin_project! {
    /// Waits for a permit (bounded by the deadline), then runs the inner service holding it.
    pub struct ResponseFuture<S, Req>
    where
        S: Service<Req>,
    {
        #[pin]
        state: State<S, Req, S::Future>,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateOwned]
    enum State<S, Req, F> {
        Waiting {
            gate: Gate,
            deadline: Deadline,
            // Boxed only when the gate is full and the request has to wait.
            enter: Option<Enter>,
            service: S,
            request: Req,
        },
        Running {
            #[pin]
            fut: F,
            permit: GatePermit,
        },
        Done,
    }
}

impl<S, Req> fmt::Debug for ResponseFuture<S, Req>
where
    S: Service<Req>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, ReqBody> ResponseFuture<S, Request<ReqBody>>
where
    S: Service<Request<ReqBody>>,
{
    pub(super) fn new(
        gate: Gate,
        deadline: Deadline,
        service: S,
        request: Request<ReqBody>,
    ) -> Self {
        Self {
            state: State::Waiting {
                gate,
                deadline,
                enter: None,
                service,
                request,
            },
        }
    }
}

impl<S, Req> ResponseFuture<S, Req>
where
    S: Service<Req>,
{
    /// A request admitted when it was called: already running.
    pub(super) fn admitted(fut: S::Future, permit: GatePermit) -> Self {
        Self {
            state: State::Running { fut, permit },
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, Request<ReqBody>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Waiting {
                    gate,
                    deadline,
                    enter,
                    request,
                    ..
                } => {
                    let admitted = match enter {
                        Some(enter) => std::task::ready!(enter.as_mut().poll(cx)),
                        None => match gate.try_admit(Tenant::from_extensions(request.extensions()))
                        {
                            Some(permit) => Ok(permit),
                            None => {
                                let (gate, deadline) = (gate.clone(), *deadline);
                                let tenant =
                                    Tenant::from_extensions(request.extensions()).to_owned();
                                let cost = waiting_cost(request);
                                // Retries are shed before first attempts.
                                let retry = crate::retry::inbound::parse(
                                    request
                                        .headers()
                                        .get(&crate::retry::inbound::PREVIOUS_ATTEMPTS),
                                ) > 0;
                                let waiting: Enter = Box::pin(async move {
                                    if retry {
                                        gate.enter_retry_as(&tenant, cost, &deadline).await
                                    } else {
                                        gate.enter_as(&tenant, cost, &deadline).await
                                    }
                                });
                                *enter = Some(waiting);
                                continue;
                            }
                        },
                    };
                    let StateOwned::Waiting {
                        gate,
                        mut service,
                        request,
                        ..
                    } = state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("state was Waiting")
                    };
                    match admitted {
                        Ok(permit) => {
                            mark_connection(&request, permit.within_share());
                            let fut = service.call(request);
                            state.set(State::Running { fut, permit });
                        }
                        Err(refused) => {
                            let tenant = Tenant::from_extensions(request.extensions());
                            mark_connection(&request, gate.within_share(tenant));
                            let route = Route::from_extensions(request.extensions());
                            let protocol = Protocol::of(request.headers());
                            return Poll::Ready(Ok(overloaded(&route, refused, protocol)));
                        }
                    }
                }
                StateProj::Running { fut, .. } => {
                    let result = std::task::ready!(fut.poll(cx));
                    // Release the permit as soon as the answer is ready. Only a request that was
                    // served teaches an adaptive limit how long serving takes; a failure is
                    // reported as one (a fast 503 says nothing about serving time, and would
                    // otherwise pass for good news and raise the limit); a timeout, or a future
                    // dropped while running, goes as abandoned work.
                    if let StateOwned::Running { permit, .. } =
                        state.as_mut().project_replace(State::Done)
                    {
                        match result.as_ref().map(verdict) {
                            Ok(Verdict::Served) => permit.finish(),
                            Ok(Verdict::Failed) | Err(_) => permit.fail(),
                            Ok(Verdict::Abandoned) => drop(permit),
                            Ok(Verdict::NotServing) => permit.discard(),
                        }
                    }
                    return Poll::Ready(result.map(|response| response.map(ResponseBody::inner)));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// What an answer tells the gate's limit.
enum Verdict {
    /// Served: no 5xx status and no gRPC error status. Client mistakes count as served: they
    /// took the path every request takes.
    Served,
    /// The server or a dependency broke: 500, 502, 503 (and other 5xx but 501 and 504), or
    /// gRPC `UNAVAILABLE`, `INTERNAL`, `UNKNOWN`, `DATA_LOSS`.
    Failed,
    /// Neither: a timeout (504, `DEADLINE_EXCEEDED`) says the request was slow, not that
    /// anything broke (a request that waited too long under overload is no outage), and other
    /// gRPC errors say nothing about serving.
    Abandoned,
    /// A refusal made before any work, or the caller's own fault (its request body broke):
    /// the answer's [`Outcome`] is `rejected`. It says nothing of serving, however long it
    /// took (a body trickling in for seconds is no slow server), so the limit learns nothing.
    NotServing,
}

fn verdict<B>(response: &Response<B>) -> Verdict {
    if response.extensions().get::<Outcome>() == Some(&Outcome::Rejected) {
        return Verdict::NotServing;
    }
    if let Some(grpc) = response.headers().get("grpc-status") {
        let code = grpc.to_str().ok().and_then(|c| c.parse::<i32>().ok());
        return match code.map(Code::from_i32) {
            Some(Code::Ok) => Verdict::Served,
            Some(Code::Unavailable | Code::Internal | Code::Unknown | Code::DataLoss) | None => {
                Verdict::Failed
            }
            Some(_) => Verdict::Abandoned,
        };
    }
    let status = response.status();
    if !status.is_server_error() {
        Verdict::Served
    } else if status == StatusCode::GATEWAY_TIMEOUT || status == StatusCode::NOT_IMPLEMENTED {
        Verdict::Abandoned
    } else {
        Verdict::Failed
    }
}
