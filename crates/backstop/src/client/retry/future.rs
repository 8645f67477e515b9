//! [`RetryCall`]: one logical call run as attempts, the future behind [`Retry`](super::Retry).
//!
//! Written by hand rather than as an `async fn`: the compiler's state machine for the same loop
//! kept the service twice, the attempt's request beside its future and a timer per await, 3.1 KB
//! written into a fresh box on every call; here every field is there once and one timer serves
//! the body read, every attempt (at the deadline) and every backoff (reset in between).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower::BoxError;
use tower_service::Service;

use super::{Config, GRPC_PREVIOUS_RPC_ATTEMPTS, RetryStopped};
use crate::client::body_error::{BodyFault, RequestBodyError, caller_fault};
use crate::client::classify::error_status;
use crate::client::hedge::{HedgeAllowance, Side};
use crate::client::observer::{AttemptEvent, AttemptKind, AttemptObserver, CallEnd, refusal};
use crate::client::replay::{Buffered, Buffering, Replay, ReplayBody, ResendBy};
use crate::client::transparent::ResendRequested;
use crate::client::{Error, Reach};
use crate::deadline::Deadline;
use crate::retry::{Attempt, Attempts, CallInfo, RetryError, RetryPolicy, StopReason};
use crate::status::{Code, Outcome as Classified, Status};

/// What each attempt sends.
pub(super) enum Content<B> {
    /// The body is being read for replay (an eligible call).
    Buffering(Buffering<B>),
    /// Read in full: every attempt gets a copy.
    Replay(Replay),
    /// Sent once, by the first attempt (ineligible, or over the replay cap).
    Once(Option<ReplayBody<B>>),
}

impl<B> Content<B> {
    /// `body`, sent once by the first attempt. It marks the call's head (`parts`), which
    /// every attempt's request copies, if it fails: the caller's fault, whatever error the
    /// transport reports for it.
    pub(super) fn once(body: ReplayBody<B>, parts: &mut Parts) -> Self {
        let fault = BodyFault::default();
        let body = body.marking(&fault);
        parts.extensions.insert(fault);
        Content::Once(Some(body))
    }

    /// What the attempts of the call with head `parts` send once the body is read.
    pub(super) fn read(buffered: Buffered<B>, parts: &mut Parts) -> Self {
        match buffered {
            Buffered::Replayable(replay) => Content::Replay(replay),
            Buffered::TooLarge(once) => Content::once(once, parts),
        }
    }
}

/// The attempt in flight.
#[derive(Debug, Clone, Copy)]
pub(super) struct Current {
    pub(super) attempt: Attempt,
    /// The budget left when it started.
    pub(super) remaining: Duration,
    pub(super) started: Instant,
    /// Whether it is the transparent re-send of the attempt before it.
    pub(super) resending: bool,
}

/// The first attempt, already sent by [`Retry::call`](super::Retry) on its own service.
pub(super) type Sent<F> = (F, Current, Attempts);

pin_project! {
    #[project = StepProj]
    enum Step<F> {
        /// Reading the body (cut off at the deadline).
        Buffering,
        /// About to start the next attempt (or the re-send of the last one).
        Next,
        /// Waiting for the service to be ready for the attempt in flight.
        Ready,
        /// The attempt's call.
        Calling { #[pin] future: F },
        /// Backing off before the next attempt; the timer is set to the end of the wait.
        Waiting,
        /// Finished: the result was returned.
        Done,
    }
}

pin_project! {
    /// One logical call's attempts (see the [retry layer](super)).
    pub(super) struct RetryCall<S, B, ResB>
    where
        S: Service<Request<ReplayBody<B>>, Response = Response<ResB>>,
    {
        // The service the attempts call; `None` until an attempt after the first needs one
        // (the first was sent by the layer itself), then a clone of `spare`. Boxed, as is
        // `last`: both are rare, and inline they would make every call's future larger (this
        // future is allocated and moved once per call; over 1 KiB, the allocator's slow path).
        inner: Option<Box<S>>,
        spare: Arc<Mutex<S>>,
        config: Arc<Config>,
        parts: Parts,
        deadline: Deadline,
        key: Option<Box<str>>,
        trace_id: Option<Box<str>>,
        content: Content<B>,
        // Set once the body is read, when the call's request is counted and its budget
        // deposit made.
        attempts: Option<Attempts>,
        // The response of the last failed attempt, returned if it ends up being the answer.
        last: Option<Box<Response<ResB>>>,
        // An attempt that never reached the server, to be sent again at once (see
        // `ResendRequested`).
        resend: Option<(Attempt, Duration)>,
        // How far the attempts got so far (the hedge layer keeps its dropped sends' own).
        reach: Reach,
        current: Option<Current>,
        // When the attempt in flight is abandoned if still unanswered (see `AttemptLimit`);
        // `None` when it runs until the deadline.
        abandon_at: Option<Instant>,
        // At the deadline while reading the body and during attempts (at `abandon_at` during
        // an attempt that has one); at the end of the wait while backing off.
        #[pin]
        timer: Sleep,
        #[pin]
        step: Step<S::Future>,
    }
}

impl<S, B, ResB> RetryCall<S, B, ResB>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>>,
{
    #[allow(clippy::too_many_arguments)] // One constructor, called from one place.
    pub(super) fn new(
        inner: Option<S>,
        spare: Arc<Mutex<S>>,
        config: Arc<Config>,
        parts: Parts,
        deadline: Deadline,
        (key, trace_id): (Option<Box<str>>, Option<Box<str>>),
        content: Content<B>,
        first: Option<Sent<S::Future>>,
    ) -> Self {
        let (step, current, attempts) = match (first, &content) {
            (Some((future, current, attempts)), _) => {
                (Step::Calling { future }, Some(current), Some(attempts))
            }
            (None, Content::Buffering(_)) => (Step::Buffering, None, None),
            (None, Content::Replay(_) | Content::Once(_)) => (Step::Next, None, None),
        };
        let abandon_at =
            current.and_then(|current| abandon_at(&config, &content, current, &deadline));
        Self {
            inner: inner.map(Box::new),
            spare,
            config,
            parts,
            deadline,
            key,
            trace_id,
            content,
            attempts,
            last: None,
            resend: None,
            reach: Reach::NotSent,
            current,
            abandon_at,
            timer: tokio::time::sleep_until(abandon_at.unwrap_or(deadline.instant())),
            step,
        }
    }
}

/// What became of an attempt.
enum Outcome<ResB> {
    Response(Response<ResB>),
    Failed(BoxError),
    CutOff,
    /// Unanswered at its limit, before the deadline.
    Abandoned,
}

impl<S, B, ResB> Future for RetryCall<S, B, ResB>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<ResB>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            // What became of the attempt, and whether it was handed to the service below.
            let (sent, on_wire) = match this.step.as_mut().project() {
                StepProj::Buffering => {
                    let Content::Buffering(buffering) = this.content else {
                        this.step.set(Step::Next);
                        continue;
                    };
                    match buffering.poll_buffer(cx) {
                        Poll::Ready(Ok(buffered)) => {
                            *this.content = Content::read(buffered, this.parts);
                        }
                        Poll::Ready(Err(e)) => {
                            // The caller's body broke before anything was sent.
                            let e: BoxError = Box::new(RequestBodyError::new(e));
                            told(this.config, this.parts, this.key)
                                .end_unsent(&*e, Some(StopReason::RequestBody));
                            return done(this.step, Err(unsent(e)));
                        }
                        Poll::Pending => {
                            // Reading the body is part of the call: it too ends at the deadline,
                            // and the body still coming in then is its sender's slowness.
                            ready!(this.timer.as_mut().poll(cx));
                            let e: BoxError = Box::new(RequestBodyError::too_slow());
                            told(this.config, this.parts, this.key)
                                .end_unsent(&*e, Some(StopReason::RequestBody));
                            return done(this.step, Err(unsent(e)));
                        }
                    }
                    this.step.set(Step::Next);
                    continue;
                }
                StepProj::Next => {
                    let policy = policy(this.config, this.content);
                    let call = call_info(this.config, this.key, this.trace_id);
                    let attempts = this
                        .attempts
                        .get_or_insert_with(|| policy.attempts(*this.deadline));
                    let current = match start_attempt(attempts, policy, &call, this.resend.take()) {
                        Ok(current) => current,
                        Err(stopped) => {
                            told(this.config, this.parts, this.key).end_stopped(&stopped);
                            let reach = call_reach(*this.reach, this.parts);
                            let one_layer = policy.spend().retries_at_one_layer();
                            return done(
                                this.step,
                                stop(this.last.take(), stopped, one_layer, reach),
                            );
                        }
                    };
                    if matches!(this.content, Content::Once(None)) {
                        // Unreachable: a body sent once allows one attempt only.
                        let status = Status::new(Code::Internal, "body already sent");
                        let remaining = current.remaining;
                        match attempts.failed(policy, &call, status, remaining, Duration::ZERO) {
                            Ok(_) => continue,
                            Err(stopped) => {
                                told(this.config, this.parts, this.key).end_stopped(&stopped);
                                let reach = call_reach(*this.reach, this.parts);
                                let one_layer = policy.spend().retries_at_one_layer();
                                let result = stop(this.last.take(), stopped, one_layer, reach);
                                return done(this.step, result);
                            }
                        }
                    }
                    *this.current = Some(current);
                    this.step.set(Step::Ready);
                    continue;
                }
                StepProj::Ready => {
                    let inner = match this.inner {
                        Some(inner) => inner,
                        None => this.inner.insert(Box::new(
                            this.spare
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .clone(),
                        )),
                    };
                    match inner.poll_ready(cx) {
                        Poll::Ready(Ok(())) => {
                            let Some(current) = *this.current else {
                                this.step.set(Step::Next);
                                continue;
                            };
                            let request = attempt_request(this.parts, this.content, current);
                            let future = inner.call(request);
                            *this.abandon_at =
                                abandon_at(this.config, this.content, current, this.deadline);
                            if let Some(at) = *this.abandon_at {
                                this.timer.as_mut().reset(at);
                            }
                            this.step.set(Step::Calling { future });
                            continue;
                        }
                        // Not sent: the service was never ready for it.
                        Poll::Ready(Err(e)) => (Outcome::Failed(e.into()), false),
                        Poll::Pending => {
                            ready!(this.timer.as_mut().poll(cx));
                            (Outcome::CutOff, false)
                        }
                    }
                }
                StepProj::Calling { future } => match future.poll(cx) {
                    Poll::Ready(Ok(response)) => (Outcome::Response(response), true),
                    Poll::Ready(Err(e)) => (Outcome::Failed(e.into()), true),
                    Poll::Pending => {
                        ready!(this.timer.as_mut().poll(cx));
                        if this.abandon_at.is_some() {
                            (Outcome::Abandoned, true)
                        } else {
                            (Outcome::CutOff, true)
                        }
                    }
                },
                StepProj::Waiting => {
                    ready!(this.timer.as_mut().poll(cx));
                    this.timer.as_mut().reset(this.deadline.instant());
                    this.step.set(Step::Next);
                    continue;
                }
                StepProj::Done => return Poll::Pending,
            };
            // The attempt is over (its future, if any, is dropped here, which cancels it).
            this.step.set(Step::Next);
            if this.abandon_at.take().is_some() {
                this.timer.as_mut().reset(this.deadline.instant());
            }
            let (Some(current), Some(attempts)) = (this.current.take(), this.attempts.as_mut())
            else {
                continue;
            };
            let policy = policy(this.config, this.content);
            let call = call_info(this.config, this.key, this.trace_id);
            let tell = told(this.config, this.parts, this.key);
            let elapsed = current.started.elapsed();
            let remaining = current.remaining;
            *this.reach = (*this.reach).max(match &sent {
                Outcome::Response(_) => Reach::Answered,
                // Not handed to the service below: it cannot have left.
                _ if !on_wire => Reach::NotSent,
                Outcome::Failed(e) if caller_fault(&**e, &this.parts.extensions).is_none() => {
                    Reach::of_error(&**e)
                }
                // The body broke on its way out, or the attempt got no answer in time.
                Outcome::Failed(_) | Outcome::CutOff | Outcome::Abandoned => Reach::Unknown,
            });
            let next = match sent {
                Outcome::Response(response) => {
                    match (this.config.classifier)(response.status(), response.headers()) {
                        None => {
                            tell.attempt(this.deadline, &current, on_wire.then_some(OK));
                            attempts.succeeded(policy, &call, remaining, elapsed);
                            tell.end(Classified::Ok, attempts.sent(), None);
                            return done(this.step, Ok(response));
                        }
                        Some(status) => {
                            tell.attempt(this.deadline, &current, on_wire.then(|| seen(&status)));
                            *this.last = Some(Box::new(response));
                            attempts.failed(policy, &call, status, remaining, elapsed)
                        }
                    }
                }
                Outcome::Failed(e) => {
                    let e = match e.downcast::<ResendRequested>() {
                        // Not an attempt: the same one goes again, its budget token already
                        // taken.
                        Ok(never_sent) if !current.resending => {
                            if tell.observed() {
                                let status = error_status(&*never_sent);
                                tell.attempt(this.deadline, &current, Some(seen(&status)));
                            }
                            *this.resend = Some((current.attempt, remaining));
                            continue;
                        }
                        Ok(never_sent) => never_sent.into_source(),
                        Err(e) => e,
                    };
                    if let Some(fault) = caller_fault(&*e, &this.parts.extensions) {
                        // The caller's own body broke: the destination did nothing wrong and no
                        // retry fixes it, so it is no attempt of the destination's (its budget,
                        // storm alarm and throttle learn nothing) and the call stops here.
                        let fault = fault.clone();
                        tell.attempt(this.deadline, &current, None);
                        Err(attempts.refused(policy, &call, fault, StopReason::RequestBody))
                    } else if let Some(reason) = refusal(&*e) {
                        let status = error_status(&*e);
                        // Refused before sending (an open circuit, or less than the peer's
                        // margin left): no attempt, and nothing a later one would change, so
                        // stop, spending nothing. The last answer, if any, stays the call's.
                        tell.attempt(this.deadline, &current, None);
                        Err(attempts.refused(policy, &call, status, reason))
                    } else {
                        let status = error_status(&*e);
                        *this.last = None;
                        let sent = tell.observed() && on_wire;
                        tell.attempt(this.deadline, &current, sent.then(|| seen(&status)));
                        attempts.failed(policy, &call, status, remaining, elapsed)
                    }
                }
                Outcome::CutOff if waiting_on_caller(this.parts) => {
                    // The deadline passed while the body still waited on its sender: the
                    // caller was too slow, not the destination.
                    *this.last = None;
                    tell.attempt(this.deadline, &current, None);
                    let slow = RequestBodyError::too_slow().status().clone();
                    Err(attempts.refused(policy, &call, slow, StopReason::RequestBody))
                }
                Outcome::CutOff => {
                    *this.last = None;
                    let timeout = (Classified::Timeout, Code::DeadlineExceeded);
                    tell.attempt(this.deadline, &current, on_wire.then_some(timeout));
                    attempts.cut_off(policy, &call, remaining, elapsed)
                }
                Outcome::Abandoned => {
                    *this.last = None;
                    tracing::debug!(
                        name: crate::observe::event::RPC_ATTEMPT_ABANDONED,
                        event = crate::observe::event::RPC_ATTEMPT_ABANDONED,
                        attempt = current.attempt.number,
                        duration_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
                        "no answer within the attempt limit; abandoned for the next attempt"
                    );
                    let status = Status::new(
                        Code::Unavailable,
                        "no answer within the attempt limit; abandoned",
                    );
                    tell.attempt(this.deadline, &current, Some(seen(&status)));
                    attempts.failed(policy, &call, status, remaining, elapsed)
                }
            };
            match next {
                // No wait (a zero backoff, or a transparent re-send): the next attempt now.
                Ok(wait) if wait.is_zero() => {}
                Ok(wait) => {
                    this.timer.as_mut().reset(Instant::now() + wait);
                    this.step.set(Step::Waiting);
                }
                Err(stopped) => {
                    tell.end_stopped(&stopped);
                    let one_layer = policy.spend().retries_at_one_layer();
                    let reach = call_reach(*this.reach, this.parts);
                    return done(this.step, stop(this.last.take(), stopped, one_layer, reach));
                }
            }
        }
    }
}

/// When the attempt `current` is abandoned if it has no answer yet: `None` unless the call
/// has an [`AttemptLimit`](super::AttemptLimit) that applies to it, and could be retried after
/// this attempt (its body is kept, the policy allows another attempt that an `UNAVAILABLE`
/// would start, and the budget has a token). Measured from what is left of `deadline` as the
/// attempt starts (a transparent re-send's `remaining` is its first send's), so it is always
/// before the deadline.
fn abandon_at<B>(
    config: &Config,
    content: &Content<B>,
    current: Current,
    deadline: &Deadline,
) -> Option<Instant> {
    let limiter = config.limiter.as_ref()?;
    let policy = &config.policy;
    let retryable = matches!(content, Content::Replay(_))
        && current.attempt.number < policy.max_attempts()
        && policy
            .retryable_codes()
            .is_none_or(|codes| codes.contains(&Code::Unavailable))
        && policy.spend().has_retry_token();
    if !retryable {
        return None;
    }
    let remaining = deadline.remaining_at(current.started);
    let limit = limiter.limit.limit_by(&limiter.margin, remaining)?;
    Some(current.started + limit)
}

/// Whether the body of the call with head `parts` is streamed and waits on its sender.
fn waiting_on_caller(parts: &Parts) -> bool {
    parts
        .extensions
        .get::<BodyFault>()
        .is_some_and(BodyFault::is_waiting)
}

/// How far the attempts of the call with head `parts` got: `reach` as this layer saw them,
/// and the sends its hedge races dropped.
fn call_reach(reach: Reach, parts: &Parts) -> Reach {
    parts
        .extensions
        .get::<HedgeAllowance>()
        .map_or(reach, |allowance| reach.max(allowance.reach()))
}

/// A call that failed before any attempt was sent.
fn unsent(error: BoxError) -> BoxError {
    Error::reached(error, Reach::NotSent).into()
}

/// Ends the call with `result`.
fn done<F, T>(mut step: Pin<&mut Step<F>>, result: T) -> Poll<T> {
    step.set(Step::Done);
    Poll::Ready(result)
}

/// Starts the next attempt `now`: the transparent re-send of the last one if there is one
/// (neither counted nor timed against the deadline again), else a new one, or the stop.
pub(super) fn start_attempt(
    attempts: &mut Attempts,
    policy: &RetryPolicy,
    call: &CallInfo<'_>,
    resend: Option<(Attempt, Duration)>,
) -> Result<Current, RetryError> {
    let started = Instant::now();
    let resending = resend.is_some();
    let (attempt, remaining) = match resend {
        Some(again) => again,
        None => attempts.start(policy, call, started)?,
    };
    Ok(Current {
        attempt,
        remaining,
        started,
        resending,
    })
}

/// The policy the call runs by: the method's, or a single attempt for a body sent once.
pub(super) fn policy<'a, B>(config: &'a Config, content: &Content<B>) -> &'a RetryPolicy {
    match content {
        Content::Once(_) => &config.single,
        Content::Buffering(_) | Content::Replay(_) => &config.policy,
    }
}

pub(super) fn call_info<'a>(
    config: &'a Config,
    key: &'a Option<Box<str>>,
    trace_id: &'a Option<Box<str>>,
) -> CallInfo<'a> {
    CallInfo {
        idempotency_key: key.as_deref(),
        peer: config.peer.as_deref(),
        trace_id: trace_id.as_deref(),
    }
}

/// The request of the attempt in flight: the call's head and a body for it.
pub(super) fn attempt_request<B>(
    parts: &Parts,
    content: &mut Content<B>,
    current: Current,
) -> Request<ReplayBody<B>> {
    let body = match content {
        // Every attempt can be made again from the head and the replay: a transparent-retry
        // layer below asks for a re-send instead of keeping its own copy of each attempt, and
        // a re-send is not sent again.
        Content::Replay(replay) => replay.body_resent_by(if current.resending {
            ResendBy::Nobody
        } else {
            ResendBy::Above
        }),
        Content::Once(once) => once.take().unwrap_or_else(|| Replay::default().body()),
        // Not reached: attempts start once the body is read.
        Content::Buffering(_) => Replay::default().body(),
    };
    let mut request = Request::from_parts(parts.clone(), body);
    if current.attempt.number > 1 {
        request.headers_mut().insert(
            &GRPC_PREVIOUS_RPC_ATTEMPTS,
            HeaderValue::from(current.attempt.number - 1),
        );
    }
    #[cfg(feature = "otel")]
    super::otel::start_attempt(&mut request, current.attempt.number);
    request
}

/// The call's result once the attempts stopped, having got as far as `reach`: the last failed
/// response, if the last attempt got one, marked with why they stopped; else the error.
///
/// With retries at one layer (`one_layer`), an unavailable answer this layer already retried
/// (or stopped retrying for the destination's sake) also says "do not retry"
/// (`grpc-retry-pushback-ms: -1`), so that a handler relaying it as it is keeps its own
/// caller from retrying on top: the answer to a handler's `?` says the same (see
/// [`Error`](crate::client::Error)).
pub(super) fn stop<ResB>(
    last: Option<Box<Response<ResB>>>,
    stopped: RetryError,
    one_layer: bool,
    reach: Reach,
) -> Result<Response<ResB>, BoxError> {
    match last.map(|last| *last) {
        Some(mut response) => {
            if one_layer && retried_here(&stopped) {
                response.headers_mut().insert(
                    &crate::status::GRPC_RETRY_PUSHBACK_MS_NAME,
                    HeaderValue::from_static("-1"),
                );
            }
            response.extensions_mut().insert(RetryStopped {
                reason: stopped.reason,
                attempts: stopped.attempts,
                reach,
            });
            Ok(response)
        }
        None => Err(Error::reached(Box::new(stopped), reach).into()),
    }
}

/// Whether an unavailable peer was retried at this layer, or its retries stopped for the
/// destination's sake: then the layers above must not retry it too.
fn retried_here(stopped: &RetryError) -> bool {
    stopped.last.code() == Code::Unavailable
        && (stopped.attempts > 1
            || matches!(
                stopped.reason,
                StopReason::BudgetExhausted | StopReason::Storm | StopReason::SwitchedOff
            ))
}

/// The attempt succeeded, as the observer is told.
const OK: (Classified, Code) = (Classified::Ok, Code::Ok);

/// A failed attempt's outcome and code, as the observer is told.
fn seen(status: &Status) -> (Classified, Code) {
    (status.outcome(), status.code())
}

/// What the call's observer, if it has one, is told with.
pub(super) struct Told<'a> {
    observer: Option<&'a dyn AttemptObserver>,
    config: &'a Config,
    extensions: &'a http::Extensions,
    key: Option<&'a str>,
}

/// The observer of the call with head `parts`, by `config`, whose key is `key`.
pub(super) fn told<'a>(
    config: &'a Config,
    parts: &'a Parts,
    key: &'a Option<Box<str>>,
) -> Told<'a> {
    Told {
        observer: config.observer.as_ref().map(|o| &*o.0),
        config,
        extensions: &parts.extensions,
        key: key.as_deref(),
    }
}

impl Told<'_> {
    /// Whether there is an observer to tell.
    pub(super) fn observed(&self) -> bool {
        self.observer.is_some()
    }

    /// The attempt `current` of a call with `deadline` is over, as the retry layer read it
    /// (`None`: it was not sent). When the hedge layer below raced it against a copy, both
    /// sends are told, each as it ended.
    pub(super) fn attempt(
        &self,
        deadline: &Deadline,
        current: &Current,
        seen: Option<(Classified, Code)>,
    ) {
        let Some(observer) = self.observer else {
            return;
        };
        let number = current.attempt.number;
        let kind = if current.resending {
            AttemptKind::Transparent
        } else if number > 1 {
            AttemptKind::Retry
        } else {
            AttemptKind::First
        };
        let race = self
            .extensions
            .get::<HedgeAllowance>()
            .and_then(HedgeAllowance::take_race);
        let Some(race) = race else {
            if let Some((outcome, code)) = seen {
                let ended = (outcome, Some(code), current.started.elapsed());
                self.send(observer, deadline, number, kind, current.started, ended);
            }
            return;
        };
        let hedges = race.hedges.iter().enumerate().map(|(i, leg)| {
            let nth = u32::try_from(i).unwrap_or(u32::MAX).saturating_add(1);
            (
                Side::Hedge(i),
                *leg,
                number.saturating_add(nth),
                AttemptKind::Hedge,
            )
        });
        let legs = std::iter::once((Side::Primary, race.primary, number, kind)).chain(hedges);
        for (side, leg, number, kind) in legs {
            let ended = if race.returned == Some(side) {
                // Its result is the one the retry layer read.
                let duration = leg
                    .ended
                    .map_or_else(|| leg.started.elapsed(), |e| e.duration);
                seen.map(|(outcome, code)| (outcome, Some(code), duration))
            } else if let Some(end) = leg.ended {
                end.sent
                    .then_some((end.outcome, Some(end.code), end.duration))
            } else if race.returned.is_some() {
                // Another one answered first: this one was dropped, unanswered.
                Some((Classified::Cancelled, None, leg.started.elapsed()))
            } else {
                // All were still running when the attempt was ended from here.
                seen.map(|(outcome, code)| (outcome, Some(code), leg.started.elapsed()))
            };
            if let Some(ended) = ended {
                self.send(observer, deadline, number, kind, leg.started, ended);
            }
        }
    }

    fn send(
        &self,
        observer: &dyn AttemptObserver,
        deadline: &Deadline,
        number: u32,
        kind: AttemptKind,
        started: Instant,
        (outcome, code, duration): (Classified, Option<Code>, Duration),
    ) {
        observer.on_attempt(&AttemptEvent {
            destination: self.config.policy.service(),
            method: self.config.policy.method(),
            number,
            kind,
            outcome,
            code,
            started,
            duration,
            deadline_remaining: deadline.remaining_at(started),
            idempotency_key: self.key,
            extensions: self.extensions,
        });
    }

    /// The call ended with `outcome` after `attempts` attempts, stopped for `stop_reason`.
    pub(super) fn end(&self, outcome: Classified, attempts: u32, stop_reason: Option<StopReason>) {
        if let Some(observer) = self.observer {
            observer.on_call_end(&CallEnd {
                destination: self.config.policy.service(),
                method: self.config.policy.method(),
                outcome,
                attempts,
                stop_reason,
                idempotency_key: self.key,
                extensions: self.extensions,
            });
        }
    }

    /// The attempts stopped.
    pub(super) fn end_stopped(&self, stopped: &RetryError) {
        self.end(
            stopped.last.outcome(),
            stopped.attempts,
            Some(stopped.reason),
        );
    }

    /// The call failed with `error` before any attempt.
    pub(super) fn end_unsent(
        &self,
        error: &(dyn std::error::Error + 'static),
        stop_reason: Option<StopReason>,
    ) {
        if self.observed() {
            self.end(error_status(error).outcome(), 0, stop_reason);
        }
    }
}
