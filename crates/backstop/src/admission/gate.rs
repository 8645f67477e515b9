//! A concurrency gate whose wait is bounded by the caller's deadline.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use metrics::{Gauge, SharedString};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::limit::{FixedLimit, Limit};
use crate::deadline::Deadline;
use crate::observe::{self, label};
use crate::status::Status;

/// Retry-After hint given with [`Overloaded`] unless configured otherwise.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Bounded concurrency with a bounded wait.
///
/// At most [`Gate::limit`] requests hold a [`GatePermit`] at once. A request that finds the gate
/// full waits for a permit at most `deadline.remaining() - min_service`: beyond that it could
/// not be served in time anyway, so it is refused with [`Overloaded`] instead of occupying a
/// queue slot. When that wait is zero or negative it is refused at once. A free permit is always
/// granted: the deadline itself is the deadline layer's business, the gate only bounds waiting.
/// Waiters are served first come, first served. Cloning shares the gate.
///
/// The limit is fixed ([`Gate::new`]) or adaptive ([`Gate::with_limit`], e.g. a
/// [`Gradient2`](super::Gradient2)): then every permit handed back with [`GatePermit::finish`]
/// feeds its latency to the limit, which resizes the gate. A lowered limit takes effect as
/// running requests finish; none is interrupted.
///
/// ```
/// use std::time::Duration;
/// use backstop::admission::Gate;
/// use backstop::deadline::Deadline;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let gate = Gate::new(1, Duration::from_millis(20));
/// let deadline = Deadline::after(Duration::from_millis(100));
///
/// let permit = gate.enter(&deadline).await.unwrap();
/// assert_eq!(gate.inflight(), 1);
///
/// // Full: a second request waits at most 100 - 20 = 80 ms, then is refused.
/// let refused = gate.enter(&deadline).await.unwrap_err();
/// assert_eq!(refused.retry_after, Duration::from_secs(1));
///
/// permit.finish();
/// assert_eq!(gate.inflight(), 0);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Gate {
    shared: Arc<Shared>,
    min_service: Duration,
    retry_after: Duration,
}

#[derive(Debug)]
struct Shared {
    semaphore: Arc<Semaphore>,
    /// The limit in effect; written only while `limiter` is locked.
    limit: AtomicUsize,
    /// Permits to forget instead of returning, owed since the limit was lowered below the
    /// number of permits out.
    debt: AtomicUsize,
    inflight: AtomicUsize,
    /// `None` for a fixed limit: nothing to learn, no lock on the way out.
    limiter: Option<Mutex<Box<dyn Limit>>>,
    gauges: OnceLock<Gauges>,
}

/// `rpc_server_concurrency_limit` and `rpc_server_concurrency_inflight` for one `service`.
#[derive(Debug)]
struct Gauges {
    service: SharedString,
    /// Handles registered with the first recorder that saw this gate.
    handles: OnceLock<(usize, Gauge, Gauge)>,
}

impl Gauges {
    fn with(&self, f: impl FnOnce(&Gauge, &Gauge)) {
        let register = || {
            (
                metrics::gauge!(observe::RPC_SERVER_CONCURRENCY_LIMIT, label::SERVICE => self.service.clone()),
                metrics::gauge!(observe::RPC_SERVER_CONCURRENCY_INFLIGHT, label::SERVICE => self.service.clone()),
            )
        };
        let Some(recorder) = observe::recorder_id() else {
            return;
        };
        let (owner, limit, inflight) = self.handles.get_or_init(|| {
            let (limit, inflight) = register();
            (recorder, limit, inflight)
        });
        if *owner == recorder {
            f(limit, inflight);
        } else {
            let (limit, inflight) = register();
            f(&limit, &inflight);
        }
    }
}

impl Shared {
    fn admitted(self: &Arc<Self>, permit: OwnedSemaphorePermit) -> GatePermit {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        if let Some(gauges) = self.gauges.get() {
            let limit = self.limit.load(Ordering::Relaxed);
            gauges.with(|l, i| {
                l.set(limit as f64);
                i.increment(1.0);
            });
        }
        GatePermit {
            permit: Some(permit),
            shared: Arc::clone(self),
            admitted: Instant::now(),
            finished: false,
            failed: false,
        }
    }

    /// Applies a new limit; called with `limiter` locked, so resizes never interleave.
    fn resize(&self, new: usize) {
        let old = self.limit.swap(new, Ordering::Relaxed);
        if new > old {
            let grow = new - old;
            // Cancel owed permits first, then add the rest.
            let owed = self
                .debt
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
                    Some(d.saturating_sub(grow))
                })
                .unwrap_or_else(|d| d);
            self.semaphore.add_permits(grow - owed.min(grow));
        } else if new < old {
            let shrink = old - new;
            // Idle permits go now; permits out are forgotten as they come back.
            let forgotten = self.semaphore.forget_permits(shrink);
            self.debt.fetch_add(shrink - forgotten, Ordering::AcqRel);
        }
    }

    fn release(&self, permit: &mut GatePermit) {
        let elapsed = permit.admitted.elapsed();
        let inflight = self.inflight.load(Ordering::Relaxed);
        let mut limit = None;
        if let Some(limiter) = &self.limiter {
            let mut limiter = limiter.lock().unwrap_or_else(PoisonError::into_inner);
            if permit.finished {
                limiter.on_sample(elapsed, inflight);
            } else if permit.failed {
                limiter.on_failure(elapsed, inflight);
            } else {
                limiter.on_abandoned(elapsed, inflight);
            }
            let new = limiter.limit().clamp(1, Semaphore::MAX_PERMITS);
            self.resize(new);
            limit = Some(new);
        }
        self.inflight.fetch_sub(1, Ordering::Relaxed);
        if let Some(gauges) = self.gauges.get() {
            gauges.with(|l, i| {
                if let Some(limit) = limit {
                    l.set(limit as f64);
                }
                i.decrement(1.0);
            });
        }
        if let Some(semaphore_permit) = permit.permit.take() {
            let owed = self
                .debt
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| d.checked_sub(1))
                .is_ok();
            if owed {
                semaphore_permit.forget();
            }
        }
    }
}

/// Proof of admission through a [`Gate`]; the slot is released when this is finished or
/// dropped.
///
/// Hand it back with [`GatePermit::finish`] when the work is done: its latency then teaches an
/// adaptive limit. Work that failed goes back with [`GatePermit::fail`], which tells the limit
/// the dependency or the server broke (see [`Limit::on_failure`]). A permit merely dropped counts
/// as abandoned work (a cancelled request), whose latency is only a lower bound.
#[derive(Debug)]
#[must_use = "the gate slot is released as soon as the permit is dropped"]
pub struct GatePermit {
    permit: Option<OwnedSemaphorePermit>,
    shared: Arc<Shared>,
    admitted: Instant,
    finished: bool,
    failed: bool,
}

impl GatePermit {
    /// Releases the slot of work that completed, feeding its latency to the gate's limit.
    pub fn finish(mut self) {
        self.finished = true;
    }

    /// Releases the slot of work that failed (the server or a dependency broke), telling the
    /// gate's limit so: a slow start drops to its floor when most recent work fails.
    pub fn fail(mut self) {
        self.failed = true;
    }
}

impl Drop for GatePermit {
    fn drop(&mut self) {
        let shared = Arc::clone(&self.shared);
        shared.release(self);
    }
}

/// The gate is full and no slot freed up within the budget the request could spend waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("over capacity; retry after {retry_after:?}")]
pub struct Overloaded {
    /// How long the caller should wait before trying again.
    pub retry_after: Duration,
}

impl From<Overloaded> for Status {
    fn from(o: Overloaded) -> Self {
        Status::overloaded(o.retry_after)
    }
}

impl Gate {
    /// A gate admitting `limit` requests at once (raised to 1 if zero, capped at tokio's
    /// semaphore maximum), where serving a request takes at least `min_service`.
    pub fn new(limit: usize, min_service: Duration) -> Self {
        Self::build(FixedLimit::new(limit).limit(), None, min_service)
    }

    /// A gate whose limit is `limit`'s, told the latency of every finished request.
    pub fn with_limit(limit: impl Limit, min_service: Duration) -> Self {
        let initial = limit.limit();
        Self::build(initial, Some(Mutex::new(Box::new(limit))), min_service)
    }

    fn build(
        initial: usize,
        limiter: Option<Mutex<Box<dyn Limit>>>,
        min_service: Duration,
    ) -> Self {
        let initial = initial.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            shared: Arc::new(Shared {
                semaphore: Arc::new(Semaphore::new(initial)),
                limit: AtomicUsize::new(initial),
                debt: AtomicUsize::new(0),
                inflight: AtomicUsize::new(0),
                limiter,
                gauges: OnceLock::new(),
            }),
            min_service,
            retry_after: DEFAULT_RETRY_AFTER,
        }
    }

    /// Sets the Retry-After hint carried by [`Overloaded`] (default one second).
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// Publishes the limit and the requests holding a slot as
    /// `rpc_server_concurrency_limit{service}` and `rpc_server_concurrency_inflight{service}`,
    /// updated as requests enter and leave. The first name given sticks; clones share it.
    pub fn publish_as(&self, service: impl Into<SharedString>) {
        // A second name is ignored: one gate is one set of gauges.
        let _ = self.shared.gauges.set(Gauges {
            service: service.into(),
            handles: OnceLock::new(),
        });
    }

    /// Enters the gate, waiting at most `deadline.remaining() - min_service` for a slot.
    pub async fn enter(&self, deadline: &Deadline) -> Result<GatePermit, Overloaded> {
        if let Ok(permit) = self.try_enter() {
            return Ok(permit);
        }
        let max_wait = deadline
            .remaining()
            .checked_sub(self.min_service)
            .filter(|w| !w.is_zero())
            .ok_or_else(|| self.overloaded())?;
        let acquire = Arc::clone(&self.shared.semaphore).acquire_owned();
        match tokio::time::timeout(max_wait, acquire).await {
            Ok(Ok(permit)) => Ok(self.shared.admitted(permit)),
            // Timed out, or the semaphore was closed (never done here).
            Ok(Err(_)) | Err(_) => Err(self.overloaded()),
        }
    }

    /// Enters the gate only if a slot is free now.
    pub fn try_enter(&self) -> Result<GatePermit, Overloaded> {
        Arc::clone(&self.shared.semaphore)
            .try_acquire_owned()
            .map(|permit| self.shared.admitted(permit))
            .map_err(|_| self.overloaded())
    }

    /// Requests holding a permit now.
    pub fn inflight(&self) -> usize {
        self.shared.inflight.load(Ordering::Relaxed)
    }

    /// Most requests admitted at once, now.
    pub fn limit(&self) -> usize {
        self.shared.limit.load(Ordering::Relaxed)
    }

    /// Whether the limit learns from latency (see [`Gate::with_limit`]).
    pub fn is_adaptive(&self) -> bool {
        self.shared.limiter.is_some()
    }

    /// Least time serving a request takes; waiting may not eat into it.
    pub fn min_service(&self) -> Duration {
        self.min_service
    }

    fn overloaded(&self) -> Overloaded {
        Overloaded {
            retry_after: self.retry_after,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::Gradient2;
    use crate::status::{Code, Outcome};
    use tokio::time::Instant;

    const MS: Duration = Duration::from_millis(1);

    #[tokio::test(start_paused = true)]
    async fn waits_at_most_remaining_minus_min_service() {
        let gate = Gate::new(2, 30 * MS);
        let d = Deadline::after(100 * MS);
        let _a = gate.enter(&d).await.unwrap();
        let _b = gate.enter(&d).await.unwrap();
        assert_eq!(gate.inflight(), 2);
        let start = Instant::now();
        let err = gate.enter(&d).await.unwrap_err();
        assert_eq!(start.elapsed(), 70 * MS);
        assert_eq!(err.retry_after, Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn rejects_at_once_when_no_budget_for_waiting() {
        let gate = Gate::new(1, 50 * MS).with_retry_after(3 * MS);
        let _held = gate
            .enter(&Deadline::after(Duration::from_secs(1)))
            .await
            .unwrap();
        for budget in [Duration::ZERO, 30 * MS, 50 * MS] {
            let start = Instant::now();
            let err = gate.enter(&Deadline::after(budget)).await.unwrap_err();
            assert_eq!(start.elapsed(), Duration::ZERO, "{budget:?}");
            assert_eq!(
                err,
                Overloaded {
                    retry_after: 3 * MS
                }
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_freed_slot_goes_to_the_waiter() {
        let gate = Gate::new(1, 10 * MS);
        let held = gate
            .enter(&Deadline::after(Duration::from_secs(1)))
            .await
            .unwrap();
        let releaser = tokio::spawn(async move {
            tokio::time::sleep(40 * MS).await;
            drop(held);
        });
        let start = Instant::now();
        let permit = gate.enter(&Deadline::after(100 * MS)).await.unwrap();
        assert_eq!(start.elapsed(), 40 * MS);
        assert_eq!(gate.inflight(), 1);
        drop(permit);
        assert_eq!(gate.inflight(), 0);
        releaser.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn free_slot_is_granted_even_with_little_budget() {
        let gate = Gate::new(1, 50 * MS);
        let permit = gate.enter(&Deadline::after(MS)).await;
        assert!(permit.is_ok());
        assert!(gate.try_enter().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_a_waiting_enter_takes_no_slot() {
        let gate = Gate::new(1, MS);
        let held = gate.try_enter().unwrap();
        let waiting = tokio::time::timeout(5 * MS, gate.enter(&Deadline::after(MS * 100))).await;
        assert!(waiting.is_err());
        drop(held);
        assert_eq!(gate.inflight(), 0);
        assert!(gate.try_enter().is_ok());
    }

    /// `rounds` times: fills every free slot, lets `rtt` of paused time pass, finishes them all.
    async fn serve(gate: &Gate, rtt: Duration, rounds: usize) {
        for _ in 0..rounds {
            let held: Vec<_> = std::iter::from_fn(|| gate.try_enter().ok()).collect();
            assert!(!held.is_empty());
            tokio::time::advance(rtt).await;
            held.into_iter().for_each(GatePermit::finish);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_gate_admits_according_to_the_current_limit() {
        let gate = Gate::with_limit(Gradient2::new(2, 8).initial(4), MS);
        assert!(gate.is_adaptive() && !Gate::new(3, MS).is_adaptive());
        assert_eq!(gate.limit(), 4);
        let held: Vec<_> = (0..4).map(|_| gate.try_enter().unwrap()).collect();
        assert!(gate.try_enter().is_err(), "four slots, four held");
        for permit in held {
            tokio::time::advance(100 * MS).await;
            permit.finish();
        }
        assert_eq!(gate.inflight(), 0);

        // Latency rises tenfold: the limit falls to its lower bound, and the gate with it.
        serve(&gate, 100 * MS, 20).await;
        serve(&gate, Duration::from_secs(1), 10).await;
        assert_eq!(gate.limit(), 2);
        let held: Vec<_> = (0..2).map(|_| gate.try_enter().unwrap()).collect();
        assert!(gate.try_enter().is_err(), "the lowered limit is enforced");
        drop(held);
        assert_eq!(gate.inflight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lowered_limit_takes_effect_as_running_requests_finish() {
        let gate = Gate::with_limit(Gradient2::new(1, 4), MS);
        serve(&gate, 10 * MS, 5).await;
        let held: Vec<_> = (0..4).map(|_| gate.try_enter().unwrap()).collect();
        // Each slow finish lowers the limit; freed slots are kept back rather than handed out.
        tokio::time::advance(Duration::from_secs(10)).await;
        for permit in held {
            permit.finish();
        }
        let limit = gate.limit();
        assert!(limit < 4, "{limit}");
        let again: Vec<_> = (0..limit).map(|_| gate.try_enter().unwrap()).collect();
        assert!(gate.try_enter().is_err(), "no more than {limit} admitted");
        assert_eq!(gate.inflight(), limit);
        drop(again);

        // Latency falls back: the limit and the gate grow back to the bound.
        serve(&gate, 10 * MS, 50).await;
        assert_eq!(gate.limit(), 4);
        let held: Vec<_> = (0..4).map(|_| gate.try_enter().unwrap()).collect();
        assert!(gate.try_enter().is_err());
        drop(held);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_wait_feeds_nothing_and_an_abandoned_slow_request_lowers_the_limit() {
        let gate = Gate::with_limit(Gradient2::new(1, 2), MS);
        serve(&gate, 10 * MS, 20).await;
        let held = [gate.try_enter().unwrap(), gate.try_enter().unwrap()];
        let waiting = tokio::time::timeout(5 * MS, gate.enter(&Deadline::after(100 * MS))).await;
        assert!(waiting.is_err());
        assert_eq!(gate.limit(), 2, "a wait that gave up is no sample");
        tokio::time::advance(Duration::from_secs(5)).await;
        drop(held);
        assert_eq!(
            gate.limit(),
            1,
            "slow work, even abandoned, says latency rose"
        );
        assert_eq!(gate.inflight(), 0);
    }

    #[test]
    fn limits_and_status() {
        assert_eq!(Gate::new(0, MS).limit(), 1);
        assert_eq!(Gate::new(7, MS).min_service(), MS);
        let s: Status = Overloaded {
            retry_after: 2 * MS,
        }
        .into();
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(s.outcome(), Outcome::Rejected);
        assert_eq!(s.pushback(), Some(2 * MS));
    }
}
