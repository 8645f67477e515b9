//! Hedging: one extra attempt when the first is slower than usual.
//!
//! Tail latency is mostly one slow replica or one unlucky packet. [`Hedge`] sends the attempt,
//! and if no answer has come after the rolling p95 of the destination's recent latencies, sends
//! one copy (through the balancer, so usually to another endpoint). The first good answer wins
//! and the other attempt is dropped, which cancels it. At most one hedge per logical call.
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

mod latency;
mod layer;
pub(super) mod policy;

pub use self::latency::LatencyWindow;
pub use self::layer::HedgeLayer;
pub use self::policy::HedgePolicy;

use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderValue, Request, Response};
use tokio::time::Instant;
use tower::{BoxError, ServiceExt};
use tower_service::Service;

use super::classify::{error_status, response_status};
use super::future::LayerFuture;
use super::observer::refused_locally;
use super::previous_attempts::GRPC_PREVIOUS_RPC_ATTEMPTS;
use super::replay::{ReplayBody, try_clone_request};
use super::select::Selected;
use crate::observe::{RPC_CLIENT_HEDGES_TOTAL, label};
use crate::status::{Code, Outcome, RetryClass};

/// The response future of [`Hedge`]: the inner call's own future unless the attempt may be
/// hedged.
pub type ResponseFuture<F, T> = LayerFuture<F, T>;

/// One hedge per logical call: put in the request's extensions by the retry layer and shared by
/// the call's attempts.
#[derive(Debug, Clone, Default)]
pub struct HedgeAllowance(Arc<Allowance>);

#[derive(Debug, Default)]
struct Allowance {
    taken: AtomicBool,
    /// Whether the call is observed: the race of its hedged attempt is then kept in `race`.
    observed: bool,
    /// The race of the attempt that was hedged, once it is over, until the retry layer takes it
    /// to tell the call's [`AttemptObserver`](super::observer::AttemptObserver).
    race: Mutex<Option<Race>>,
}

impl HedgeAllowance {
    /// Takes the call's one hedge; `false` if it was taken already.
    pub fn take(&self) -> bool {
        !self.0.taken.swap(true, Ordering::AcqRel)
    }

    /// The allowance of a call whose hedge race, if it has one, is kept for its observer.
    pub(crate) fn observed() -> Self {
        Self(Arc::new(Allowance {
            observed: true,
            ..Allowance::default()
        }))
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

/// How the two sends of a hedged attempt went, as the hedge layer saw them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Race {
    /// The attempt the retry layer sent.
    pub(crate) primary: Leg,
    /// Its copy.
    pub(crate) hedge: Leg,
    /// Whose result was returned; `None` when the race was dropped first (cut off above).
    pub(crate) returned: Option<Side>,
}

/// One side of a hedge race.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Primary,
    Hedge,
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
    race: Race,
}

impl RaceLog {
    /// The race of an observed call, or `None`.
    fn new(allowance: Option<&HedgeAllowance>, started: Instant, hedged: Instant) -> Option<Self> {
        let allowance = allowance.filter(|a| a.0.observed)?.clone();
        Some(Self {
            allowance,
            race: Race {
                primary: Leg::new(started),
                hedge: Leg::new(hedged),
                returned: None,
            },
        })
    }
}

impl Drop for RaceLog {
    fn drop(&mut self) {
        *self
            .allowance
            .0
            .race
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(self.race);
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
        let leg = match side {
            Side::Primary => &mut log.race.primary,
            Side::Hedge => &mut log.race.hedge,
        };
        leg.end(result);
        if returned {
            log.race.returned = Some(side);
        }
    }
}

/// Put in the extensions of a hedge's request (and so of a transparent re-send of it); never
/// in those of an attempt the retry layer sends. See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hedged;

/// Sends a second copy of a slow attempt (see the [module docs](self)).
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
        // Only an attempt that can be copied, once the window knows the p95, may be hedged;
        // only then is a second handle on the service needed.
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

async fn run<S, B, ResB>(
    primary: S::Future,
    hedge: Option<(S, Request<ReplayBody<B>>, Duration)>,
    policy: HedgePolicy,
    started: Instant,
) -> Result<Response<ResB>, BoxError>
where
    S: Service<Request<ReplayBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send,
    B: Send + 'static,
    ResB: Send + 'static,
{
    let mut primary = pin!(async move { primary.await.map_err(Into::<BoxError>::into) });
    let Some((svc, mut backup, delay)) = hedge else {
        let result = primary.await;
        record(&policy, &result, started);
        return result;
    };
    let allowance = backup.extensions().get::<HedgeAllowance>().cloned();
    tokio::select! {
        result = &mut primary => {
            record(&policy, &result, started);
            return result;
        }
        () = tokio::time::sleep(delay) => {}
    }
    let allowed = allowance.as_ref().is_none_or(HedgeAllowance::take);
    if !allowed || !policy.try_hedge_at(Instant::now()) {
        let result = primary.await;
        record(&policy, &result, started);
        return result;
    }
    metrics::counter!(RPC_CLIENT_HEDGES_TOTAL,
        label::SERVICE => policy.service.clone(), label::METHOD => policy.method.clone())
    .increment(1);
    let previous = backup
        .headers()
        .get(&GRPC_PREVIOUS_RPC_ATTEMPTS)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(0);
    backup.headers_mut().insert(
        &GRPC_PREVIOUS_RPC_ATTEMPTS,
        HeaderValue::from(previous.saturating_add(1)),
    );
    backup.extensions_mut().insert(Hedged);
    let hedge_started = Instant::now();
    // Handed to the allowance when the race is over, or dropped unfinished.
    let mut log = RaceLog::new(allowance.as_ref(), started, hedge_started);
    let mut secondary =
        pin!(async move { svc.oneshot(backup).await.map_err(Into::<BoxError>::into) });
    // The first final answer wins; the other attempt is dropped, which cancels it.
    tokio::select! {
        result = &mut primary => {
            let last = is_final(&result);
            leg_ended(&mut log, Side::Primary, &result, last);
            if last {
                record(&policy, &result, started);
                return result;
            }
            let result = secondary.await;
            leg_ended(&mut log, Side::Hedge, &result, true);
            record(&policy, &result, hedge_started);
            result
        }
        result = &mut secondary => {
            let last = is_final(&result);
            leg_ended(&mut log, Side::Hedge, &result, last);
            if last {
                record(&policy, &result, hedge_started);
                return result;
            }
            let result = primary.await;
            leg_ended(&mut log, Side::Primary, &result, true);
            record(&policy, &result, started);
            result
        }
    }
}

#[cfg(test)]
mod tests;
