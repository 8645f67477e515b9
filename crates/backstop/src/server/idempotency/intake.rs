//! The part of idempotency that runs before the gate: [`IntakeLayer`].
//!
//! Two things a keyed request may spend a long time on need no capacity of ours, so they
//! happen here, outside the gate, holding no permit:
//!
//! - **reading the body.** A client that sends its body slowly (or never finishes it) waits
//!   here, bounded by the body cap and the request's deadline, instead of holding a permit
//!   that another tenant's request needs;
//! - **waiting for a running attempt.** When another request with the same key and the same
//!   parameters is still running, the request waits for that attempt's outcome (polling the
//!   store with backoff, so it works across instances sharing a store): the stored answer is
//!   replayed from here (no second pass through the gate), or, if the attempt failed
//!   retryably or was released, the request goes through the gate again and runs itself.
//!   Only when its deadline comes first is it answered 409 `request_in_progress` +
//!   `Retry-After`. A waiter is woken at once when the attempt runs on the same instance.
//!
//! Requests of methods that are not keyed but whose policy
//! [buffers the body](crate::policy::MethodPolicy::buffers_body) (unary calls) have their
//! bodies read here too, within the same caps.
//!
//! The key, fingerprint and body read here travel to [`IdempotencyService`](super::IdempotencyService) as a
//! request extension, so the request is read and fingerprinted once.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tokio::time::{Instant, sleep_until, timeout_at};
use tower::ServiceExt;
use tower_layer::Layer;
use tower_service::Service;

use super::layer::{IntakeKind, Shared};
use super::{BoxError, InProgress, KeyedRoute, Prepared, prepare, read_body, replay};
use crate::clock::Clock;
use crate::deadline::Deadline;
use crate::idempotency::{IdempotencyKey, Record, RecordStatus, Store};
use crate::server::body::{RequestBody, ResponseBody};
use crate::server::metrics::Route;
use crate::server::problem::Protocol;
use crate::server::tenant::Tenant;

/// First pause before looking at a running attempt again; each later pause doubles.
const FIRST_PAUSE: Duration = Duration::from_millis(2);

/// Longest pause between two looks at a running attempt.
const MAX_PAUSE: Duration = Duration::from_millis(50);

/// Least time kept, when the wait ends, to claim again and answer before the deadline.
const MIN_ANSWER_MARGIN: Duration = Duration::from_millis(10);

/// Most time kept back for the answer.
const MAX_ANSWER_MARGIN: Duration = Duration::from_millis(250);

/// The time a waiter keeps for its own answer: a fifth of what it had when it began to wait,
/// within [`MIN_ANSWER_MARGIN`, `MAX_ANSWER_MARGIN`]. The caller's clock started before ours
/// (the request had to travel), so an answer sent at our deadline arrives after the caller
/// stopped listening; the 409 and its `Retry-After` are only useful if they arrive in time.
fn answer_margin(remaining: Duration) -> Duration {
    (remaining / 5).clamp(MIN_ANSWER_MARGIN, MAX_ANSWER_MARGIN)
}

/// Reads keyed requests and waits for running attempts outside the gate; see the
/// [module docs](self). Made by [`IdempotencyLayer::intake`](super::IdempotencyLayer::intake),
/// with which it shares the route table and the store.
pub struct IntakeLayer<St> {
    shared: Arc<Shared<St>>,
}

impl<St> IntakeLayer<St> {
    pub(super) fn new(shared: Arc<Shared<St>>) -> Self {
        Self { shared }
    }
}

impl<St> Clone for IntakeLayer<St> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<St> fmt::Debug for IntakeLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IntakeLayer")
            .field("policies", &self.shared.lookup.as_ref().map(|l| &l.source))
            .finish_non_exhaustive()
    }
}

impl<S, St> Layer<S> for IntakeLayer<St> {
    type Service = Intake<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Intake {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service of [`IntakeLayer`].
pub struct Intake<S, St> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S: Clone, St> Clone for Intake<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for Intake<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Intake")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for Intake<S, St>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = IntakeFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let kind = self.shared.intake_of(&request);
        if let IntakeKind::Unread = kind {
            return IntakeFuture {
                kind: Kind::Passthrough {
                    fut: self.inner.call(request.map(RequestBody::inner)),
                },
            };
        }
        // The ready service answers the first call; later calls wait for readiness again.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        let fut: Keyed<ResBody, S::Error> = match kind {
            IntakeKind::Keyed(route) => Box::pin(intake(shared, route, inner, request)),
            IntakeKind::Buffered | IntakeKind::Unread => Box::pin(buffer(shared, inner, request)),
        };
        IntakeFuture {
            kind: Kind::Keyed { fut },
        }
    }
}

type Keyed<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

pin_project! {
    /// Response future of [`Intake`]: the inner future unchanged (routes that are not keyed)
    /// or the keyed intake.
    pub struct IntakeFuture<F, B, E> {
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

impl<F, B, E> fmt::Debug for IntakeFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Passthrough { .. } => "passthrough",
            Kind::Keyed { .. } => "keyed",
        };
        f.debug_struct("IntakeFuture").field("kind", &kind).finish()
    }
}

impl<F, B, E> Future for IntakeFuture<F, B, E>
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

/// Reads the whole body of a request to a buffered route, then sends it on.
async fn buffer<S, St, ReqBody, ResBody>(
    shared: Arc<Shared<St>>,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
{
    let (head, body) = request.into_parts();
    match read_body(&shared, &head, body, Protocol::of(&head.headers)).await {
        Ok(body) => {
            let request = Request::from_parts(head, RequestBody::buffered(body));
            Ok(inner.call(request).await?.map(ResponseBody::inner))
        }
        Err(refusal) => Ok(refusal),
    }
}

/// Reads the request, then sends it on until it is not refused as in progress, or its deadline
/// ends.
async fn intake<S, St, ReqBody, ResBody>(
    shared: Arc<Shared<St>>,
    route: KeyedRoute,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    St: Store,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
{
    let (mut head, body) = request.into_parts();
    let prepared = match prepare(&shared, &head, body).await {
        Ok(prepared) => prepared,
        Err(refusal) => return Ok(refusal),
    };
    let body = prepared.body.clone();
    head.extensions.insert(prepared);
    // Without a deadline layer outside, wait no longer than one lease.
    let deadline = head
        .extensions
        .get::<Deadline>()
        .copied()
        .unwrap_or_else(|| Deadline::after(route.lease));
    let give_up = deadline
        .instant()
        .checked_sub(answer_margin(deadline.remaining()))
        .unwrap_or_else(Instant::now);
    let mut pause = FIRST_PAUSE;
    loop {
        let request = Request::from_parts(head, RequestBody::buffered(body.clone()));
        let response = inner.ready().await?.call(request).await?;
        // Only a request told to wait comes back with its head: the first attempt's is not
        // copied in case it must be sent again.
        let Some(sent) = response
            .extensions()
            .get::<InProgress>()
            .and_then(InProgress::take)
        else {
            return Ok(response.map(ResponseBody::inner));
        };
        head = sent;
        // Only a waiter needs the scope and the key: the head keeps both.
        let scope = Tenant::from_extensions(&head.extensions);
        let Some(Prepared {
            key, fingerprint, ..
        }) = head.extensions.get::<Prepared>()
        else {
            return Ok(response.map(ResponseBody::inner));
        };
        match finished(&shared, scope, key, give_up, &mut pause).await {
            Wait::GaveUp => return Ok(response.map(ResponseBody::inner)),
            // The attempt it waited for succeeded with the same parameters: its answer is
            // replayed from here, without passing the gate and claiming again.
            Wait::Settled(Some(record))
                if record.status == RecordStatus::Succeeded
                    && record.fingerprint == *fingerprint =>
            {
                if let Some(stored) = record.response {
                    Route::from_extensions(&head.extensions).count_claim("replay");
                    return Ok(replay(stored));
                }
            }
            // Failed, released, its runner gone, or the store could not say: the claim decides.
            Wait::Settled(_) => {}
        }
    }
}

/// How a wait for a running attempt ended.
enum Wait {
    /// The waiter's own deadline came first.
    GaveUp,
    /// The record is no longer running under a live lease: as the store read it, if it could.
    Settled(Option<Box<Record>>),
}

/// Waits until the record of `key` is no longer running under a live lease (completed,
/// failed, released, or its runner gone), looking with growing pauses and woken at once when
/// the attempt settles on this instance.
async fn finished<St: Store>(
    shared: &Shared<St>,
    scope: &str,
    key: &IdempotencyKey,
    give_up: Instant,
    pause: &mut Duration,
) -> Wait {
    let settled = shared.settled.watch(scope, key);
    loop {
        // Registered before the look, so a settling after it is not missed.
        let woken = settled.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        match timeout_at(give_up, shared.store.get(scope, key)).await {
            Err(_) => return Wait::GaveUp,
            Ok(Ok(Some(record)))
                if record.status == RecordStatus::Running
                    && record.lease_until_ms > shared.clock.now_ms() => {}
            Ok(Ok(record)) => return Wait::Settled(record.map(Box::new)),
            Ok(Err(_)) => return Wait::Settled(None),
        }
        let now = Instant::now();
        if now >= give_up {
            return Wait::GaveUp;
        }
        tokio::select! {
            () = sleep_until((now + *pause).min(give_up)) => {}
            () = woken => {}
        }
        *pause = (*pause * 2).min(MAX_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_keeps_a_fifth_of_its_time_left_for_the_answer_within_bounds() {
        assert_eq!(
            answer_margin(Duration::from_millis(300)),
            Duration::from_millis(60)
        );
        assert_eq!(answer_margin(Duration::from_millis(20)), MIN_ANSWER_MARGIN);
        assert_eq!(answer_margin(Duration::ZERO), MIN_ANSWER_MARGIN);
        assert_eq!(answer_margin(Duration::from_secs(10)), MAX_ANSWER_MARGIN);
    }
}
