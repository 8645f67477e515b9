//! Hedging: an extra attempt when the first is slower than usual.
//!
//! Tail latency is mostly one slow replica or one unlucky packet. [`Hedge`] sends the attempt,
//! and if no answer has come after the rolling p95 of the destination's recent latencies, sends
//! a copy (through the balancer, so usually to another endpoint). The first final answer wins
//! and the other sends are dropped, which cancels them. One hedge per logical call unless the
//! policy allows more ([`HedgePolicy::hedges`], a gRPC `hedgingPolicy.maxAttempts`): each
//! further copy goes out a delay after the one before, or at once when a send fails in a way
//! another attempt could still fix (as gRPC does); when every send fails, the last failure is
//! the attempt's answer, for the retry layer to judge.
//!
//! Hedges are paid from the destination's [`RetryBudget`](crate::retry::RetryBudget), the same one retries use, so
//! hedging cannot double the load on a destination that is slow because it is overloaded.
//! A hedge only spends from a budget holding at least half its burst: the rest is kept for
//! retries, which a call needs to succeed when attempts fail, where a hedge only shortens a
//! slow one (hedging at the p95 would otherwise drain the budget that 10 % of failing attempts
//! need).
//! A hedge is only ever built for `Safe` and `Keyed` methods (the stack refuses to hedge an
//! `Unsafe` one at build time): the copy carries the same idempotency key, so the server runs
//! the effect once.
//!
//! When to hedge and what a hedge may spend is the [`HedgePolicy`] of
//! [`backstop::hedge`](crate::hedge), with the latency window its delay is read from; this
//! module is the layer that acts on it.
//!
//! A request whose body cannot be replayed (over the cap) is not hedged. Only the answers of
//! successful attempts feed the latency window, so failures do not lower the hedge delay.
//!
//! # When the hedge is sent
//!
//! By default at the destination's rolling p95 ([`HedgePolicy::new`]), which has to be
//! measured first: until [`HedgePolicy::MIN_SAMPLES`] successful answers are in the window no
//! attempt is hedged, so a fresh client (or a destination with little traffic) runs unhedged
//! for its first calls. [`HedgePolicy::min_delay`] puts a floor under the p95. A fixed delay
//! ([`HedgePolicy::fixed_delay`], a gRPC `hedgingDelay` read from a
//! [service config](crate::client::service_config)) is the delay itself: the hedge goes out
//! exactly that long after its attempt, from the first call on, whatever the p95.
//!
//! # Keyed hedges and a shared store
//!
//! The hedge of a `Keyed` call carries the same idempotency key, so when the server's
//! instances share one idempotency store it finds the first attempt's claim and waits on it
//! (for the first attempt's answer, or for its lease to lapse) instead of running the handler
//! again. That is what makes it safe, and it is also its limit: such a hedge only helps when
//! the first attempt is slow before it claims the key (a slow connection, a queue, a stalled
//! instance that never got to the claim). A tail that starts after the claim (a slow database
//! write, a slow downstream call inside the handler) holds the claim for as long as it lasts,
//! and the hedge waits it out with it. `Safe` methods, which need no claim, are hedged for the
//! whole of their latency.
//!
//! The hedge's request carries a [`Hedged`] extension. Its `grpc-previous-rpc-attempts` is one
//! above the attempt it races, the value the next retry would carry too, so a service below
//! the stack that observes what is sent (a recording transport) needs the marker to tell the
//! two apart. An [`AttemptObserver`](super::AttemptObserver) needs neither: the race of an
//! observed call's hedged attempt (when each send started and how it ended) is kept in its
//! [`HedgeAllowance`], and the retry layer tells both sends, the hedge as a hedge.

mod layer;

pub use self::layer::HedgeLayer;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use http::{HeaderValue, Request, Response};
use tokio::time::Instant;
use tower::{BoxError, ServiceExt};
use tower_service::Service;

use super::Reach;
use super::classify::{error_status, response_status};
use super::future::LayerFuture;
use super::observer::refused_locally;
use super::previous_attempts::GRPC_PREVIOUS_RPC_ATTEMPTS;
use super::replay::{ReplayBody, try_clone_request};
use super::select::Selected;
use crate::hedge::HedgePolicy;
use crate::observe::{RPC_CLIENT_HEDGES_TOTAL, label};
use crate::status::{Code, Outcome, RetryClass};

/// The response future of [`Hedge`]: the inner call's own future unless the attempt may be
/// hedged.
pub type ResponseFuture<F, T> = LayerFuture<F, T>;

/// The hedges of one logical call: put in the request's extensions by the retry layer and
/// shared by the call's attempts, so that a call is hedged at most as many times as its
/// policy allows ([`HedgePolicy::max_hedges`]), whichever of its attempts the hedges race.
/// It also keeps how far the sends of its races got ([`Reach`]): the retry layer sees only the
/// result each race returns, not the sends it dropped.
#[derive(Debug, Clone, Default)]
pub struct HedgeAllowance(Arc<Allowance>);

#[derive(Debug, Default)]
struct Allowance {
    /// Hedges sent for the call so far.
    taken: AtomicU32,
    /// The furthest [`Reach`] of the sends of the call's races ([`Reach::as_u8`]).
    reach: AtomicU8,
    /// Whether the call is observed: the race of its hedged attempt is then kept in `race`.
    observed: bool,
    /// The race of the attempt that was hedged, once it is over, until the retry layer takes it
    /// to tell the call's [`AttemptObserver`](super::observer::AttemptObserver).
    race: Mutex<Option<Race>>,
}

impl HedgeAllowance {
    /// Takes one hedge of a call allowed one; `false` if it was taken already.
    pub fn take(&self) -> bool {
        self.take_up_to(1)
    }

    /// Takes one hedge of a call allowed `max`; `false` once `max` were taken.
    pub fn take_up_to(&self, max: u32) -> bool {
        self.0
            .taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// The allowance of a call whose hedge race, if it has one, is kept for its observer.
    pub(crate) fn observed() -> Self {
        Self(Arc::new(Allowance {
            observed: true,
            ..Allowance::default()
        }))
    }

    /// Records that a send of one of the call's races got as far as `reach`.
    pub(crate) fn reached(&self, reach: Reach) {
        self.0.reach.fetch_max(reach.as_u8(), Ordering::AcqRel);
    }

    /// How far the sends of the call's races got, as far as this layer saw them.
    pub(crate) fn reach(&self) -> Reach {
        Reach::from_u8(self.0.reach.load(Ordering::Acquire))
    }

    /// The race of the call's hedged attempt, once it is over (once: it is taken).
    pub(crate) fn take_race(&self) -> Option<Race> {
        self.0
            .race
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// How the sends of a hedged attempt went, as the hedge layer saw them.
#[derive(Debug, Clone)]
pub(crate) struct Race {
    /// The attempt the retry layer sent.
    pub(crate) primary: Leg,
    /// Its copies, in the order they were sent.
    pub(crate) hedges: Vec<Leg>,
    /// Whose result was returned; `None` when the race was dropped first (cut off above).
    pub(crate) returned: Option<Side>,
}

/// One side of a hedge race.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Primary,
    /// The hedge at this index of [`Race::hedges`].
    Hedge(usize),
}

/// One send of a hedge race.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Leg {
    pub(crate) started: Instant,
    /// How it ended, if it did before the race was over.
    pub(crate) ended: Option<LegEnd>,
}

/// How a send of a hedge race ended.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LegEnd {
    pub(crate) duration: Duration,
    pub(crate) outcome: Outcome,
    pub(crate) code: Code,
    /// `false` when it was refused before it was sent (an open circuit, no time left).
    pub(crate) sent: bool,
}

impl Leg {
    fn new(started: Instant) -> Self {
        Self {
            started,
            ended: None,
        }
    }

    fn end<B>(&mut self, result: &Result<Response<B>, BoxError>) {
        let (status, sent) = match result {
            Ok(response) => (response_status(response), true),
            Err(e) => (Some(error_status(&**e)), !refused_locally(&**e)),
        };
        let (outcome, code) = status.map_or((Outcome::Ok, Code::Ok), |s| (s.outcome(), s.code()));
        self.ended = Some(LegEnd {
            duration: self.started.elapsed(),
            outcome,
            code,
            sent,
        });
    }
}

/// A hedge race under way, handed to the call's allowance when it is over or dropped.
struct RaceLog {
    allowance: HedgeAllowance,
    race: Option<Race>,
}

impl RaceLog {
    /// The race of an observed call, or `None`.
    fn new(allowance: Option<&HedgeAllowance>, started: Instant) -> Option<Self> {
        let allowance = allowance.filter(|a| a.0.observed)?.clone();
        Some(Self {
            allowance,
            race: Some(Race {
                primary: Leg::new(started),
                hedges: Vec::new(),
                returned: None,
            }),
        })
    }

    fn race(&mut self) -> &mut Race {
        self.race
            .as_mut()
            .expect("the race is handed over on drop only")
    }
}

impl Drop for RaceLog {
    fn drop(&mut self) {
        *self
            .allowance
            .0
            .race
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = self.race.take();
    }
}

/// Records in `log`, if any, that a hedge was sent at `started`.
fn hedge_sent(log: &mut Option<RaceLog>, started: Instant) {
    if let Some(log) = log {
        log.race().hedges.push(Leg::new(started));
    }
}

/// Records in `log`, if any, that the `side` of the race ended with `result`, and whether it is
/// the result returned.
fn leg_ended<B>(
    log: &mut Option<RaceLog>,
    side: Side,
    result: &Result<Response<B>, BoxError>,
    returned: bool,
) {
    if let Some(log) = log {
        let race = log.race();
        let leg = match side {
            Side::Primary => Some(&mut race.primary),
            Side::Hedge(i) => race.hedges.get_mut(i),
        };
        if let Some(leg) = leg {
            leg.end(result);
        }
        if returned {
            race.returned = Some(side);
        }
    }
}

/// Put in the extensions of a hedge's request (and so of a transparent re-send of it); never
/// in those of an attempt the retry layer sends. See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hedged;

/// Sends copies of a slow attempt (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct Hedge<S> {
    inner: S,
    policy: Option<HedgePolicy>,
}

impl<S> Hedge<S> {
    /// Wraps `inner` with `policy`.
    pub fn new(inner: S, policy: HedgePolicy) -> Self {
        Self {
            inner,
            policy: Some(policy),
        }
    }

    /// Wraps `inner` without hedging: every attempt is sent once.
    pub fn disabled(inner: S) -> Self {
        Self {
            inner,
            policy: None,
        }
    }
}

impl<S, B, ResB> Service<Request<ReplayBody<B>>> for Hedge<S>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    B: Send + 'static,
    ResB: Send + 'static,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, Response<ResB>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<ReplayBody<B>>) -> Self::Future {
        // Under a client stack serving several methods, the call's own method's.
        let policy = match request.extensions().get::<Selected>() {
            Some(selected) => selected.0.hedge.as_ref(),
            None => self.policy.as_ref(),
        };
        let Some(policy) = policy.cloned() else {
            return LayerFuture::direct(self.inner.call(request));
        };
        let started = Instant::now();
        // Only an attempt that can be copied, once the delay is known (a fixed one, or the p95
        // once the window has its samples), may be hedged; only then is a second handle on the
        // service needed.
        let hedge = match (try_clone_request(&request), policy.delay()) {
            (Some(backup), Some(delay)) => Some((self.inner.clone(), backup, delay)),
            _ => None,
        };
        let primary = self.inner.call(request);
        LayerFuture::boxed(Box::pin(run(primary, hedge, policy, started)))
    }
}

/// Whether no other attempt could do better than this result.
fn is_final<B>(result: &Result<Response<B>, BoxError>) -> bool {
    match result {
        Ok(response) => {
            response_status(response).is_none_or(|s| s.retry_class() == RetryClass::Fatal)
        }
        Err(_) => false,
    }
}

fn record<B>(policy: &HedgePolicy, result: &Result<Response<B>, BoxError>, started: Instant) {
    if let Ok(response) = result {
        if response_status(response).is_none() {
            policy.record_latency(started.elapsed());
        }
    }
}

/// One send of the race, with the side it is and when it started.
type LegFuture<ResB> =
    Pin<Box<dyn Future<Output = (Side, Instant, Result<Response<ResB>, BoxError>)> + Send>>;

async fn run<S, B, ResB>(
    primary: S::Future,
    hedge: Option<(S, Request<ReplayBody<B>>, Duration)>,
    policy: HedgePolicy,
    started: Instant,
) -> Result<Response<ResB>, BoxError>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    B: Send + 'static,
    ResB: Send + 'static,
{
    // Boxed, not pinned on the stack: it may join the race's sends, which outlive this frame's
    // borrows.
    let mut primary = Box::pin(async move { primary.await.map_err(Into::<BoxError>::into) });
    let Some((svc, backup, delay)) = hedge else {
        let result = primary.await;
        record(&policy, &result, started);
        return result;
    };
    let allowance = backup.extensions().get::<HedgeAllowance>().cloned();
    // Without a hedge sent, the attempt's own answer is the answer, whatever it is: the retry
    // layer above decides what follows a failure.
    tokio::select! {
        result = &mut primary => {
            record(&policy, &result, started);
            return result;
        }
        () = tokio::time::sleep(delay) => {}
    }
    // Started with the first hedge; handed to the allowance when the race is over, or
    // dropped unfinished.
    let mut log = None;
    let mut legs: FuturesUnordered<LegFuture<ResB>> = FuturesUnordered::new();
    legs.push(Box::pin(
        async move { (Side::Primary, started, primary.await) },
    ));
    let previous = backup
        .headers()
        .get(&GRPC_PREVIOUS_RPC_ATTEMPTS)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(0);
    let max = policy.max_hedges();
    let mut sent = 0;
    // When the next hedge is due; `None` once no more may be sent.
    let mut next = Some(Instant::now());
    // The latest failure that did not settle the race, returned if every send ends so.
    let mut last = None;
    loop {
        tokio::select! {
            // Sent before a send is awaited again: a hedge due now goes out first.
            biased;
            () = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {
                let now = Instant::now();
                let allowed = allowance.as_ref().is_none_or(|a| a.take_up_to(max));
                if !allowed || !policy.try_hedge_at(now) {
                    next = None;
                    continue;
                }
                // Each hedge is a copy of the attempt's request; the body is replayable, or
                // the attempt would not have been hedged at all.
                let Some(mut request) = try_clone_request(&backup) else {
                    next = None;
                    continue;
                };
                sent += 1;
                metrics::counter!(RPC_CLIENT_HEDGES_TOTAL,
                    label::SERVICE => policy.service.clone(), label::METHOD => policy.method.clone())
                .increment(1);
                request.headers_mut().insert(
                    &GRPC_PREVIOUS_RPC_ATTEMPTS,
                    HeaderValue::from(previous.saturating_add(sent)),
                );
                request.extensions_mut().insert(Hedged);
                if log.is_none() {
                    log = RaceLog::new(allowance.as_ref(), started);
                }
                hedge_sent(&mut log, now);
                let side = Side::Hedge(sent as usize - 1);
                let svc = svc.clone();
                legs.push(Box::pin(async move {
                    (side, now, svc.oneshot(request).await.map_err(Into::<BoxError>::into))
                }));
                next = (sent < max).then(|| now + delay);
            }
            Some((side, leg_started, result)) = legs.next() => {
                let settled = is_final(&result) || (legs.is_empty() && next.is_none());
                if let Some(allowance) = &allowance {
                    allowance.reached(Reach::of_result(&result));
                    if settled && !legs.is_empty() {
                        // The sends still running are dropped unanswered.
                        allowance.reached(Reach::Unknown);
                    }
                }
                if settled {
                    leg_ended(&mut log, side, &result, true);
                    // The first final answer wins; dropping `legs` cancels the other sends.
                    record(&policy, &result, leg_started);
                    return result;
                }
                leg_ended(&mut log, side, &result, false);
                last = Some((side, leg_started, result));
                // As gRPC does, a failure that leaves the race open sends the next hedge now
                // rather than after its delay.
                if next.is_some() {
                    next = Some(Instant::now());
                }
            }
            else => break,
        }
    }
    // Every send ended without a final answer and no hedge is left to send: the last
    // failure is the attempt's.
    let (side, leg_started, result) = last.expect("a send ended before the race did");
    if let Some(log) = &mut log {
        log.race().returned = Some(side);
    }
    record(&policy, &result, leg_started);
    result
}

#[cfg(test)]
mod tests;
