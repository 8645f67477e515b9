//! The retry layer: one logical call run as attempts by the [`RetryPolicy`] executor.
//!
//! [`Retry`] adapts [`RetryPolicy::execute_with`] to `http::Request -> http::Response`
//! services (tonic channels, hyper clients, reqwest-style clients as tower services):
//!
//! - **Eligibility first.** Whether the call may be sent more than once at all is decided from
//!   the method's [`Idempotency`] before anything is read: `Unsafe` never (not even by a
//!   transparent retry), `Keyed` only when the request carries its `idempotency-key`, `Safe`
//!   always. An ineligible call is sent once, its body streamed as is.
//! - **Replay.** An eligible call's body is read once into a [`Replay`](super::replay::Replay)
//!   (up to the byte cap) and every attempt, hedge and transparent re-send gets a copy; a body
//!   over the cap is sent once.
//! - **One deadline.** Every attempt shares the call's [`Deadline`] (set above by
//!   [`SetDeadline`](super::deadline::SetDeadline)); the executor never waits past it.
//! - **Classification.** Each response is read by a [`Classifier`], by default
//!   [`classify_head`](super::classify::classify_head): HTTP status or
//!   `grpc-status` (trailers-only answers), pushback from `grpc-retry-pushback-ms` /
//!   `Retry-After`. Errors by [`error_status`].
//! - **Budget, backoff, pushback, reasons.** As the executor does: full jitter, the
//!   destination's shared [`RetryBudget`](crate::retry::RetryBudget), pushback jittered by
//!   [0.8, 1.2], and a [`StopReason`] on every stop, in metrics and logs.
//! - `grpc-previous-rpc-attempts` on every retry (the number of attempts before it).
//! - **Transparent re-sends.** The bodies of a replayable call's attempts are marked as
//!   re-sent from here: a [transparent-retry layer](super::transparent) below then keeps no
//!   copy of them, and when one never reached the server it answers [`ResendRequested`]; the
//!   same attempt is sent again at once, once, without counting against max attempts.
//!
//! When the attempts stop on a response (a 503 after three tries, a 400 at once), that
//! response is returned, with a [`RetryStopped`] extension saying why. When they stop without
//! one (transport errors, the deadline, an open circuit), the error is a
//! [`RetryError`](crate::retry::RetryError).

mod layer;

pub use self::layer::RetryLayer;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tower::BoxError;
use tower_service::Service;

use super::classify::{Classifier, error_status};
use super::hedge::HedgeAllowance;
use super::logical::IDEMPOTENCY_KEY;
use super::replay::{Buffered, ReplayBody, ResendBy, buffer};
use super::transparent::ResendRequested;
use crate::contract::{DEFAULT_TIMEOUT, Idempotency};
use crate::deadline::{Deadline, DeadlineExceeded};
use crate::retry::{Attempt, CallInfo, RetryPolicy, StopReason};
use crate::status::{Code, Status};

/// Header carrying, on a retry or a hedge, how many attempts of the call came before it.
pub static GRPC_PREVIOUS_RPC_ATTEMPTS: HeaderName =
    HeaderName::from_static("grpc-previous-rpc-attempts");

/// The W3C trace context header, read for the `trace_id` log field.
static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The response future of [`Retry`].
pub type ResponseFuture<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

/// Put on a response that ended the attempts without succeeding: how many were sent and why
/// no further one was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryStopped {
    /// Why the attempts stopped.
    pub reason: StopReason,
    /// Attempts sent, first included.
    pub attempts: u32,
}

#[derive(Debug)]
struct Config {
    policy: RetryPolicy,
    single: RetryPolicy,
    idempotency: Idempotency,
    replay_cap: usize,
    peer: Option<Arc<str>>,
    classifier: Classifier,
    hedged: bool,
}

/// Runs each logical call as attempts (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct Retry<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> Retry<S> {
    /// Wraps `inner` with `policy` for a method of class `idempotency`, buffering bodies of up
    /// to `replay_cap` bytes, reading answers with `classifier`
    /// ([`classify_head`](super::classify::classify_head) unless the destination says
    /// otherwise); `peer` names the destination in logs.
    pub fn new(
        inner: S,
        policy: RetryPolicy,
        idempotency: Idempotency,
        replay_cap: usize,
        classifier: Classifier,
        peer: Option<Arc<str>>,
    ) -> Self {
        let single = policy.single_attempt();
        Self {
            inner,
            config: Arc::new(Config {
                policy,
                single,
                idempotency,
                replay_cap,
                peer,
                classifier,
                hedged: true,
            }),
        }
    }

    /// Whether a [hedge layer](super::hedge::Hedge) below may hedge this call's attempts
    /// (default `true`): the call then carries the [`HedgeAllowance`] that limits it to one
    /// hedge. Without one below, `false` saves the allowance.
    pub fn hedged(mut self, hedged: bool) -> Self {
        if let Some(config) = Arc::get_mut(&mut self.config) {
            config.hedged = hedged;
        }
        self
    }
}

impl<S, B, ResB> Service<Request<B>> for Retry<S>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    B: Body<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Send + 'static,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<Response<ResB>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Each attempt waits for readiness of its own clone of the inner service, inside the
        // deadline.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        Box::pin(run(self.inner.clone(), self.config.clone(), request))
    }
}

/// What each attempt sends.
enum Content<B> {
    Replay(super::replay::Replay),
    Once(Option<ReplayBody<B>>),
}

async fn run<S, B, ResB>(
    mut inner: S,
    config: Arc<Config>,
    request: Request<B>,
) -> Result<Response<ResB>, BoxError>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    B: Body<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Send + 'static,
{
    let (mut parts, body) = request.into_parts();
    let deadline = *parts
        .extensions
        .get_or_insert_with(|| Deadline::after(DEFAULT_TIMEOUT));
    if config.hedged {
        parts.extensions.insert(HedgeAllowance::default());
    }
    let key = parts
        .headers
        .get(&IDEMPOTENCY_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    // Decided before reading anything: may this call be sent more than once at all?
    let replayable = match config.idempotency {
        Idempotency::Safe => true,
        Idempotency::Keyed => key.is_some(),
        Idempotency::Unsafe => false,
    };
    let (policy, mut content) = if replayable {
        // Reading the body is part of the call: it too ends at the deadline.
        let buffered = tokio::time::timeout_at(deadline.instant(), buffer(body, config.replay_cap))
            .await
            .map_err(|_elapsed| DeadlineExceeded::PASSED)?;
        match buffered.map_err(Into::into)? {
            Buffered::Replayable(replay) => (&config.policy, Content::Replay(replay)),
            Buffered::TooLarge(once) => (&config.single, Content::Once(Some(once))),
        }
    } else {
        (&config.single, Content::Once(Some(ReplayBody::once(body))))
    };
    let trace_id = parts
        .headers
        .get(&TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split('-').nth(1))
        .filter(|id| id.len() == 32)
        .map(str::to_owned);
    let call = CallInfo {
        idempotency_key: key.as_deref(),
        peer: config.peer.as_deref(),
        trace_id: trace_id.as_deref(),
    };

    // The attempts are run here rather than through `execute_with`'s closure, so that they
    // all call the one service this future owns (readiness, then call) instead of a clone each.
    let mut attempts = policy.attempts(&call, deadline);
    // The response of the last failed attempt, returned if it ends up being the answer.
    let mut last: Option<Response<ResB>> = None;
    // An attempt that never reached the server, to be sent again at once (see
    // `ResendRequested`).
    let mut resend: Option<(Attempt, Duration)> = None;
    let stopped = loop {
        let resending = resend.is_some();
        let started = Instant::now();
        let (attempt, remaining) = match resend.take() {
            Some(again) => again,
            None => match attempts.start(started) {
                Ok(next) => next,
                Err(stopped) => break stopped,
            },
        };
        let body = match &mut content {
            // Every attempt can be made again from `parts` and the replay: a transparent-retry
            // layer below asks for a re-send instead of keeping its own copy of each attempt,
            // and a re-send is not sent again.
            Content::Replay(replay) => Some(replay.body_resent_by(if resending {
                ResendBy::Nobody
            } else {
                ResendBy::Above
            })),
            Content::Once(once) => once.take(),
        };
        let Some(body) = body else {
            // Unreachable: a body sent once allows one attempt only.
            let status = Status::new(Code::Internal, "body already sent");
            match attempts.failed(status, remaining, Duration::ZERO) {
                Ok(_) => continue,
                Err(stopped) => break stopped,
            }
        };
        // Readiness, then the request is made and handed over at once: the future keeps only
        // the inner call's own future across the await, not a request (keeps it small).
        let sent = tokio::time::timeout_at(
            deadline.instant(),
            std::future::poll_fn(|cx| inner.poll_ready(cx).map_err(Into::<BoxError>::into)),
        )
        .await;
        let sent = match sent {
            Ok(Ok(())) => {
                let mut request = Request::from_parts(parts.clone(), body);
                if attempt.number > 1 {
                    request.headers_mut().insert(
                        &GRPC_PREVIOUS_RPC_ATTEMPTS,
                        HeaderValue::from(attempt.number - 1),
                    );
                }
                let call = inner.call(request);
                tokio::time::timeout_at(deadline.instant(), call)
                    .await
                    .map(|r| r.map_err(Into::<BoxError>::into))
            }
            Ok(Err(e)) => Ok(Err(e)),
            Err(elapsed) => Err(elapsed),
        };
        let elapsed = started.elapsed();
        let next = match sent {
            Ok(Ok(response)) => match (config.classifier)(response.status(), response.headers()) {
                None => {
                    attempts.succeeded(remaining, elapsed);
                    return Ok(response);
                }
                Some(status) => {
                    last = Some(response);
                    attempts.failed(status, remaining, elapsed)
                }
            },
            Ok(Err(e)) => {
                let e = match e.downcast::<ResendRequested>() {
                    // Not an attempt: the same one goes again, its budget token already taken.
                    Ok(_never_sent) if !resending => {
                        resend = Some((attempt, remaining));
                        continue;
                    }
                    Ok(never_sent) => never_sent.into_source(),
                    Err(e) => e,
                };
                last = None;
                let status = error_status(&*e);
                if e.is::<DeadlineExceeded>() {
                    // Refused before sending (less than the peer's margin left): a later
                    // attempt would have even less, so stop on the deadline, spending nothing.
                    attempts.out_of_time(status, remaining, elapsed)
                } else {
                    attempts.failed(status, remaining, elapsed)
                }
            }
            Err(_elapsed) => {
                last = None;
                attempts.cut_off(remaining, elapsed)
            }
        };
        match next {
            Ok(wait) => tokio::time::sleep(wait).await,
            Err(stopped) => break stopped,
        }
    };
    match last {
        Some(mut response) => {
            response.extensions_mut().insert(RetryStopped {
                reason: stopped.reason,
                attempts: stopped.attempts,
            });
            Ok(response)
        }
        None => Err(Box::new(stopped)),
    }
}

#[cfg(test)]
mod tests;
