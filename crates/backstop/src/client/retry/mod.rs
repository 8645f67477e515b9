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
//!   [`SetDeadline`](super::deadline::SetDeadline)); the executor never waits past it. A call
//!   that arrives without one (no deadline layer above) gets the method's timeout from now:
//!   [`Retry::timeout`], by default [`DEFAULT_TIMEOUT`], the one every method policy starts
//!   from. Nothing here makes up a budget of its own.
//! - **Classification.** Each response is read by a [`Classifier`], by default
//!   [`classify_head`](super::classify::classify_head): HTTP status or
//!   `grpc-status` (trailers-only answers), pushback from `grpc-retry-pushback-ms` /
//!   `Retry-After`. Errors by [`error_status`](super::classify::error_status).
//! - **Budget, backoff, pushback, reasons.** As the executor does: full jitter, the
//!   destination's shared [`RetryBudget`](crate::retry::RetryBudget), pushback jittered by
//!   [0.8, 1.2], and a [`StopReason`] on every stop, in metrics and logs.
//! - `grpc-previous-rpc-attempts` on every retry (the number of attempts before it).
//! - **Transparent re-sends.** The bodies of a replayable call's attempts are marked as
//!   re-sent from here: a [transparent-retry layer](super::transparent) below then keeps no
//!   copy of them, and when one never reached the server it answers
//!   [`ResendRequested`](super::transparent::ResendRequested); the
//!   same attempt is sent again at once, once, without counting against max attempts.
//! - **Attempt limit.** With an [`AttemptLimit`] (the [client stack](super::ClientStack) sets
//!   one per destination), an attempt that could still be retried and has had no answer after
//!   half of what was left of the deadline (when that half is past the destination's measured
//!   tail) is abandoned (dropped, which cancels it) and counted as `UNAVAILABLE`; the next
//!   attempt follows within the same deadline. A stranded attempt (sent on a connection that
//!   went away at that instant, or to a peer that vanished) then costs half the budget, not all
//!   of it.
//!
//! - **Observer.** Under a [client stack](super::ClientStack) with an
//!   [`AttemptObserver`](super::AttemptObserver), each send is told as it ends and each call's
//!   end with its stop reason, beside the executor step that counts and logs it.
//!
//! When the attempts stop on a response (a 503 after three tries, a 400 at once), that
//! response is returned, with a [`RetryStopped`] extension saying why. When they stop without
//! one (transport errors, the deadline, an open circuit), the error is an
//! [`Error`] whose source is the [`RetryError`](crate::retry::RetryError). Both
//! say how far the attempts got ([`Reach`]), read from each attempt's end: an answer, an error
//! that proves nothing was sent (a refused connection, an open circuit), or no answer to a
//! request that may have left (a reset, a cut-off, a hedge dropped unanswered).

mod attempt_limit;
pub(super) mod config;
mod future;
mod layer;
#[cfg(feature = "otel")]
mod otel;

pub use self::attempt_limit::AttemptLimit;
pub use self::layer::RetryLayer;
pub use super::previous_attempts::GRPC_PREVIOUS_RPC_ATTEMPTS;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower::BoxError;
use tower_service::Service;

use self::attempt_limit::Limiter;
pub(crate) use self::config::Config;
use self::future::{Content, RetryCall};
use super::body_error::RequestBodyError;
use super::classify::Classifier;
use super::hedge::HedgeAllowance;
use super::idempotency::IDEMPOTENCY_KEY;
use super::replay::{Buffering, ReplayBody};
use super::select::Selected;
use super::{Error, Reach};
use crate::deadline::{Deadline, Margin};
use crate::policy::{DEFAULT_TIMEOUT, Idempotency};
use crate::retry::{RetryPolicy, StopReason};

/// The response future of [`Retry`].
pub type ResponseFuture<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

/// Put on a response that ended the attempts without succeeding: how many were sent, why
/// no further one was, and how far they got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryStopped {
    /// Why the attempts stopped.
    pub reason: StopReason,
    /// Attempts sent, first included.
    pub attempts: u32,
    /// How far the call's attempts got: [`Reach::Answered`], or [`Reach::Unknown`] when an
    /// earlier attempt (or a hedge) got no answer.
    pub reach: Reach,
}

/// Runs each logical call as attempts (see the [module docs](self)).
#[derive(Debug)]
pub struct Retry<S> {
    inner: S,
    /// Whether `inner` said it was ready in the last `poll_ready`: then the first attempt is
    /// sent on it from `call`, and the call clones no service unless it needs a second attempt.
    ready: bool,
    /// A handle kept to be cloned for the attempts after the first, shared by every clone.
    spare: Arc<Mutex<S>>,
    config: Arc<Config>,
}

impl<S: Clone> Clone for Retry<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            // A clone has not been polled ready.
            ready: false,
            spare: Arc::clone(&self.spare),
            config: Arc::clone(&self.config),
        }
    }
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
    ) -> Self
    where
        S: Clone,
    {
        let config = Config::new(
            policy,
            idempotency,
            replay_cap,
            classifier,
            peer,
            true,
            None,
            DEFAULT_TIMEOUT,
        );
        Self::with_config(inner, Arc::new(config))
    }

    /// Wraps `inner` with a configuration built beforehand (the client stack's).
    pub(crate) fn with_config(inner: S, config: Arc<Config>) -> Self
    where
        S: Clone,
    {
        Self {
            spare: Arc::new(Mutex::new(inner.clone())),
            ready: false,
            inner,
            config,
        }
    }

    /// The deadline, from now, of a call that reaches this layer without a [`Deadline`] (no
    /// [`SetDeadline`](super::deadline::SetDeadline) above): the method's timeout. Without it,
    /// [`DEFAULT_TIMEOUT`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        if let Some(config) = Arc::get_mut(&mut self.config) {
            config.timeout = timeout;
        }
        self
    }

    /// Whether a [hedge layer](super::hedge::Hedge) below may hedge this call's attempts
    /// (default `true`): the call then carries the [`HedgeAllowance`] that counts its hedges
    /// against the hedge policy's limit. Without one below, `false` saves the allowance.
    pub fn hedged(mut self, hedged: bool) -> Self {
        if let Some(config) = Arc::get_mut(&mut self.config) {
            config.hedged = hedged;
        }
        self
    }

    /// Abandons and retries an attempt left unanswered past `limit`, measured against the
    /// round trips of `margin` (the destination's, shared with its
    /// [`AttemptTimeout`](super::deadline::AttemptTimeout)); see [`AttemptLimit`]. Without it
    /// (the default) an attempt runs until the deadline.
    pub fn attempt_limit(mut self, limit: AttemptLimit, margin: Arc<Margin>) -> Self {
        if let Some(config) = Arc::get_mut(&mut self.config) {
            config.limiter = Some(Limiter { limit, margin });
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

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Always ready: waiting for the service is part of an attempt, bounded by the call's
        // deadline, which is not known here. When the service is ready at once, the first
        // attempt goes out on it from `call`.
        self.ready = matches!(self.inner.poll_ready(cx), Poll::Ready(Ok(())));
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        // Under a client stack serving several methods, the call's own method's.
        let config = match parts.extensions.get::<Selected>() {
            Some(selected) => Arc::clone(&selected.0.retry),
            None => Arc::clone(&self.config),
        };
        let deadline = *parts
            .extensions
            .get_or_insert_with(|| Deadline::after(config.timeout));
        if config.hedged {
            parts.extensions.insert(match config.observer {
                Some(_) => HedgeAllowance::observed(),
                None => HedgeAllowance::default(),
            });
        }
        let key: Option<Box<str>> = parts
            .headers
            .get(&IDEMPOTENCY_KEY)
            .and_then(|v| v.to_str().ok())
            .map(Box::from);
        // Decided before reading anything: may this call be sent more than once at all?
        let replayable = match config.idempotency {
            Idempotency::Safe => true,
            Idempotency::Keyed => key.is_some(),
            Idempotency::Unsafe => false,
        };
        let mut content = if replayable {
            Content::Buffering(Buffering::new(body, config.replay_cap))
        } else {
            Content::once(ReplayBody::once(body), &mut parts)
        };
        // A body that is all there already (most are: one buffer) is read here, so that the
        // first attempt can leave at once.
        if let Content::Buffering(buffering) = &mut content {
            match buffering.poll_buffer(&mut Context::from_waker(Waker::noop())) {
                Poll::Ready(Ok(buffered)) => content = Content::read(buffered, &mut parts),
                Poll::Ready(Err(e)) => {
                    // The caller's body broke before anything was sent.
                    let e: BoxError = Box::new(RequestBodyError::new(e));
                    future::told(&config, &parts, &key)
                        .end_unsent(&*e, Some(StopReason::RequestBody));
                    let e = Error::reached(e, Reach::NotSent);
                    return Box::pin(std::future::ready(Err(e.into())));
                }
                Poll::Pending => {}
            }
        }
        // The `trace_id` log field, from a valid `traceparent` only.
        let trace_id: Option<Box<str>> = crate::observe::trace_context::extract(&parts.headers)
            .map(|span| span.trace_id().to_string().into_boxed_str());
        // The first attempt goes out now on the service polled ready, if it was and the body
        // is read; the others (or all, if not) on one clone of it the future owns.
        let first = if std::mem::take(&mut self.ready) && !matches!(content, Content::Buffering(_))
        {
            let policy = future::policy(&config, &content);
            let call = future::call_info(&config, &key, &trace_id);
            let mut attempts = policy.attempts(deadline);
            match future::start_attempt(&mut attempts, policy, &call, None) {
                Ok(current) => {
                    let request = future::attempt_request(&parts, &mut content, current);
                    Some((self.inner.call(request), current, attempts))
                }
                Err(stopped) => {
                    future::told(&config, &parts, &key).end_stopped(&stopped);
                    let stopped = future::stop(None, stopped, false, Reach::NotSent);
                    return Box::pin(std::future::ready(stopped));
                }
            }
        } else {
            None
        };
        let inner = first.is_none().then(|| self.inner.clone());
        Box::pin(RetryCall::new(
            inner,
            Arc::clone(&self.spare),
            config,
            parts,
            deadline,
            (key, trace_id),
            content,
            first,
        ))
    }
}

#[cfg(test)]
mod tests;
