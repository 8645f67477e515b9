//! A concurrency gate whose waiters wait in an [`AdmissionQueue`].

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use metrics::{Gauge, Histogram, SharedString};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::limit::{FixedLimit, Limit};
use super::queue::{AdmissionQueue, Admitted, DropReason, Pushback, QueueConfig, Ticket};
use super::shedding::{Shedding, SheddingConfig};
use crate::deadline::Deadline;
use crate::observe::{self, label, reject_reason};
use crate::status::Status;

/// The tenant of a waiter entering with [`Gate::enter`], and of a request that names none.
pub const DEFAULT_TENANT: &str = "default";

/// Bounded concurrency with a bounded, fair wait.
///
/// At most [`Gate::limit`] requests hold a [`GatePermit`] at once. A request that finds a slot
/// free (and nobody waiting) is admitted at once, whatever its deadline: the deadline itself is
/// the deadline layer's business. Otherwise it waits in the gate's [`AdmissionQueue`], which
/// decides who gets the next free slot and who is refused with [`Overloaded`] instead: no
/// request waits beyond the point where its time left can no longer cover the expected service
/// time (at least `min_service`), and with the default [`Discipline::Fair`](super::Discipline)
/// tenants are served in turn, a standing queue is cut short (waiters older than the target
/// are dropped, the newest served first) and the queue is bounded by count and by memory. The
/// refusal says why ([`Overloaded::reason`]) and how long to wait before retrying, computed
/// from the queue and the limit, with jitter. Cloning shares the gate.
///
/// The limit is fixed ([`Gate::new`]) or adaptive ([`Gate::with_limit`], e.g. a
/// [`Gradient2`](super::Gradient2)): then every permit handed back with [`GatePermit::finish`]
/// feeds its latency to the limit, which resizes the gate. A lowered limit takes effect as
/// running requests finish; none is interrupted. A waiter whose future is dropped leaves the
/// queue at once and holds nothing.
///
/// ```
/// use std::time::Duration;
/// use backstop::admission::{DropReason, Gate};
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
/// // Full: a second request waits at most until its time left only covers the service time.
/// let refused = gate.enter(&deadline).await.unwrap_err();
/// assert_eq!(refused.reason, Some(DropReason::Deadline));
/// assert!(refused.retry && refused.retry_after >= Duration::from_millis(100));
///
/// permit.finish();
/// assert_eq!(gate.inflight(), 0);
/// # }
/// ```
#[derive(Debug, Clone)]
#[doc(
    alias = "concurrency limit",
    alias = "ConcurrencyLimit",
    alias = "load shedding"
)]
pub struct Gate {
    shared: Arc<Shared>,
    min_service: Duration,
}

/// What a waiter is told: its permit, or why not.
type Reply = Result<GatePermit, Overloaded>;
/// How a waiter is told.
type Notify = oneshot::Sender<Reply>;

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// `None` for a fixed limit: nothing to learn.
    limiter: Option<Mutex<Box<dyn Limit>>>,
    gauges: OnceLock<Gauges>,
}

#[derive(Debug)]
struct State {
    limit: usize,
    /// Permits out.
    running: usize,
    queue: AdmissionQueue<Notify>,
    /// A fixed Retry-After instead of the queue's estimate.
    retry_after: Option<Duration>,
    /// Every admission and refusal, to tell a sustained overload.
    shedding: Shedding,
}

/// The gate's metrics for one `service`.
#[derive(Debug)]
struct Gauges {
    service: SharedString,
    /// Handles registered with the first recorder that saw this gate.
    handles: OnceLock<(usize, Handles)>,
}

#[derive(Debug)]
struct Handles {
    limit: Gauge,
    inflight: Gauge,
    queue: Gauge,
    delay: Histogram,
}

impl Gauges {
    fn with(&self, f: impl FnOnce(&Handles)) {
        let register = || {
            let service = || (label::SERVICE, self.service.clone());
            Handles {
                limit: metrics::gauge!(observe::RPC_SERVER_CONCURRENCY_LIMIT, &[service()]),
                inflight: metrics::gauge!(observe::RPC_SERVER_CONCURRENCY_INFLIGHT, &[service()]),
                queue: metrics::gauge!(observe::RPC_SERVER_QUEUE_LENGTH, &[service()]),
                delay: metrics::histogram!(observe::RPC_SERVER_QUEUE_DELAY_SECONDS, &[service()]),
            }
        };
        let Some(recorder) = observe::recorder_id() else {
            return;
        };
        let (owner, handles) = self.handles.get_or_init(|| (recorder, register()));
        if *owner == recorder {
            f(handles);
        } else {
            f(&register());
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Hands out a slot to a request of `tenant` (counted by the queue already); `sojourn` is
    /// how long it waited for it, `within_share` whether its tenant was within its share.
    fn admit(
        self: &Arc<Self>,
        state: &mut State,
        now: Instant,
        sojourn: Duration,
        tenant: Arc<str>,
        within_share: bool,
    ) -> GatePermit {
        state.running += 1;
        state.shedding.record(true);
        if let Some(gauges) = self.gauges.get() {
            gauges.with(|h| {
                h.limit.set(state.limit as f64);
                h.inflight.set(state.running as f64);
                h.queue.set(state.queue.len() as f64);
                h.delay.record(sojourn.as_secs_f64());
            });
        }
        GatePermit {
            shared: Arc::clone(self),
            tenant,
            within_share,
            admitted: now,
            finished: false,
            failed: false,
            unmeasured: false,
        }
    }

    /// A refusal now, for `reason` (`None`: no free slot and no waiting).
    fn refusal(state: &mut State, now: Instant, reason: Option<DropReason>) -> Overloaded {
        let Pushback { wait, retry } = match state.retry_after {
            Some(wait) => Pushback { wait, retry: true },
            None => state.queue.pushback(now, state.limit, rand::random()),
        };
        state.shedding.record(false);
        Overloaded {
            retry_after: wait,
            reason,
            // Under sustained overload a retry only comes back to be refused again.
            retry: retry && !state.shedding.is_sustained(),
        }
    }

    /// Fills free slots from the queue and collects the waiters dropped on the way: the replies
    /// to send once the state is unlocked (a permit that cannot be delivered is dropped, which
    /// locks the state again).
    fn dispatch(self: &Arc<Self>, state: &mut State, now: Instant) -> Vec<(Notify, Reply)> {
        let mut replies = Vec::new();
        while state.running < state.limit {
            let Some(Admitted {
                item,
                sojourn,
                tenant,
            }) = state.queue.pop(now)
            else {
                break;
            };
            // Counted already: this one and one more may exceed the share where this one
            // alone does not, which only errs towards "over".
            let within = state.queue.within_share(&tenant);
            let permit = self.admit(state, now, sojourn, tenant, within);
            replies.push((item, Ok(permit)));
        }
        for (notify, reason) in state.queue.take_dropped() {
            let refused = Self::refusal(state, now, Some(reason));
            replies.push((notify, Err(refused)));
        }
        if let Some(gauges) = self.gauges.get() {
            gauges.with(|h| h.queue.set(state.queue.len() as f64));
        }
        replies
    }

    /// A permit for `tenant` if a slot is free and nobody waits.
    fn try_admit(
        self: &Arc<Self>,
        state: &mut State,
        now: Instant,
        tenant: &str,
    ) -> Option<GatePermit> {
        if state.running >= state.limit || !state.queue.is_empty() {
            return None;
        }
        let within = state.queue.within_share(tenant);
        let tenant = state.queue.admitted_directly(now, tenant);
        Some(self.admit(state, now, Duration::ZERO, tenant, within))
    }

    fn release(self: &Arc<Self>, permit: &GatePermit) {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(permit.admitted);
        let mut state = self.lock();
        if let Some(limiter) = self.limiter.as_ref().filter(|_| !permit.unmeasured) {
            let mut limiter = limiter.lock().unwrap_or_else(PoisonError::into_inner);
            if permit.finished {
                limiter.on_sample(elapsed, state.running);
            } else if permit.failed {
                limiter.on_failure(elapsed, state.running);
            } else {
                limiter.on_abandoned(elapsed, state.running);
            }
            state.limit = limiter.limit().max(1);
            let slots = state.limit;
            state.queue.set_slots(slots);
        }
        if permit.finished {
            state.queue.on_service(elapsed);
        }
        state.queue.release(&permit.tenant);
        state.running -= 1;
        let replies = self.dispatch(&mut state, now);
        if let Some(gauges) = self.gauges.get() {
            gauges.with(|h| {
                h.limit.set(state.limit as f64);
                h.inflight.set(state.running as f64);
            });
        }
        drop(state);
        deliver(replies);
    }
}

/// Tells waiters; each reply that finds its waiter gone is dropped here, outside the lock.
fn deliver(replies: Vec<(Notify, Reply)>) {
    for (notify, reply) in replies {
        let _ = notify.send(reply);
    }
}

/// The outcome of joining the gate without being refused.
enum Joined {
    Admitted(GatePermit),
    Queued {
        reply: oneshot::Receiver<Reply>,
        ticket: Ticket,
        check_at: Option<Instant>,
    },
}

/// Takes a waiter out of the queue if its future is dropped before it was answered.
struct Leave<'a> {
    shared: &'a Shared,
    ticket: Option<Ticket>,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let mut state = self.shared.lock();
            let notify = state.queue.remove(ticket);
            if let Some(gauges) = self.shared.gauges.get() {
                gauges.with(|h| h.queue.set(state.queue.len() as f64));
            }
            drop(state);
            drop(notify);
        }
    }
}

/// Proof of admission through a [`Gate`]; the slot is released when this is finished or
/// dropped.
///
/// Hand it back with [`GatePermit::finish`] when the work is done: its latency then teaches an
/// adaptive limit and the queue's expected service time. Work that failed goes back with
/// [`GatePermit::fail`], which tells the limit the dependency or the server broke (see
/// [`Limit::on_failure`]). A permit merely dropped counts as abandoned work (a cancelled
/// request), whose latency is only a lower bound. Work whose outcome says nothing of this
/// server or its dependencies (its caller's request body broke) goes back with
/// [`GatePermit::discard`], which teaches the limit nothing.
#[derive(Debug)]
#[must_use = "the gate slot is released as soon as the permit is dropped"]
pub struct GatePermit {
    shared: Arc<Shared>,
    tenant: Arc<str>,
    within_share: bool,
    admitted: Instant,
    finished: bool,
    failed: bool,
    unmeasured: bool,
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

    /// Releases the slot of work whose outcome says nothing of serving: refused before it ran,
    /// or failed on its caller's side (its request body broke, however long that took). The
    /// limit learns neither a latency nor a failure from it.
    pub fn discard(mut self) {
        self.unmeasured = true;
    }

    /// Whether the tenant of this request was within its fair share of the gate when the
    /// request was admitted (see [`Gate::within_share`]).
    pub fn within_share(&self) -> bool {
        self.within_share
    }
}

impl Drop for GatePermit {
    fn drop(&mut self) {
        let shared = Arc::clone(&self.shared);
        shared.release(self);
    }
}

/// The gate refused a request: no slot freed in time for it, or its queue would not keep it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("over capacity; retry after {retry_after:?}")]
#[non_exhaustive]
pub struct Overloaded {
    /// How long the caller should wait before trying again.
    pub retry_after: Duration,
    /// Why the queue refused or dropped the request; `None` when it never queued (the gate was
    /// full and the caller would not wait).
    pub reason: Option<DropReason>,
    /// `false` while the server sheds hard (its queue has been overloaded for
    /// [`QueueConfig::hard_shed_after`], or its [`Shedding`] says the overload is sustained):
    /// the caller should not retry this request at all.
    pub retry: bool,
}

impl Overloaded {
    /// The `reason` label of `rpc_server_rejected_total`: the queue's reason, else
    /// `overloaded`.
    pub fn reason_label(&self) -> &'static str {
        self.reason
            .map_or(reject_reason::OVERLOADED, DropReason::as_str)
    }
}

impl From<Overloaded> for Status {
    fn from(o: Overloaded) -> Self {
        let status = Status::overloaded(o.retry_after);
        if o.retry {
            status
        } else {
            status.with_no_retry()
        }
    }
}

impl Gate {
    /// A gate admitting `limit` requests at once (raised to 1 if zero), where serving a
    /// request takes at least `min_service`, with the default [`QueueConfig`].
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
        let config = QueueConfig {
            min_service,
            ..QueueConfig::default()
        };
        let initial = initial.max(1);
        let mut queue = AdmissionQueue::new(config);
        queue.set_slots(initial);
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    limit: initial,
                    running: 0,
                    queue,
                    retry_after: None,
                    shedding: Shedding::new(SheddingConfig::default())
                        .expect("the default shedding settings are valid"),
                }),
                limiter,
                gauges: OnceLock::new(),
            }),
            min_service,
        }
    }

    /// Replaces the queue's settings (its `min_service` is the gate's). Waiters queued
    /// already are refused.
    pub fn with_queue(self, config: QueueConfig) -> Self {
        let config = QueueConfig {
            min_service: self.min_service,
            ..config
        };
        let mut queue = AdmissionQueue::new(config);
        let old = {
            let mut state = self.shared.lock();
            queue.set_slots(state.limit);
            std::mem::replace(&mut state.queue, queue)
        };
        drop(old);
        self
    }

    /// Sets a fixed Retry-After hint carried by [`Overloaded`], instead of the estimate from
    /// the queue and the limit.
    pub fn with_retry_after(self, retry_after: Duration) -> Self {
        self.shared.lock().retry_after = Some(retry_after);
        self
    }

    /// Tells sustained overload by `shedding` (its settings, or a handle shared with others)
    /// instead of the default [`SheddingConfig`]. While the overload is sustained, refusals
    /// ask clients not to retry ([`Overloaded::retry`] is `false`).
    pub fn with_shedding(self, shedding: Shedding) -> Self {
        self.shared.lock().shedding = shedding;
        self
    }

    /// The gate's record of its admissions and refusals: whether it sheds under sustained
    /// overload. A [`Listener`](crate::server::listen::Listener) given it pushes clients
    /// away meanwhile.
    pub fn shedding(&self) -> Shedding {
        self.shared.lock().shedding.clone()
    }

    /// Publishes the limit, the requests holding a slot, the requests waiting and the time
    /// admitted requests waited as `rpc_server_concurrency_limit{service}`,
    /// `rpc_server_concurrency_inflight{service}`, `rpc_server_queue_length{service}` and
    /// `rpc_server_queue_delay_seconds{service}`, updated as requests enter and leave. The
    /// first name given sticks; clones share it.
    pub fn publish_as(&self, service: impl Into<SharedString>) {
        // A second name is ignored: one gate is one set of gauges.
        let _ = self.shared.gauges.set(Gauges {
            service: service.into(),
            handles: OnceLock::new(),
        });
    }

    /// Enters the gate as the default tenant, declaring no memory cost (see
    /// [`Gate::enter_as`]).
    pub async fn enter(&self, deadline: &Deadline) -> Result<GatePermit, Overloaded> {
        self.enter_as(DEFAULT_TENANT, 0, deadline).await
    }

    /// Enters the gate as `tenant`, whose waiting request holds `cost` bytes: at once if a slot
    /// is free and nobody waits, else through the queue, which hands it a slot or refuses it
    /// (at the latest when its time left only covers the expected service time).
    pub async fn enter_as(
        &self,
        tenant: &str,
        cost: usize,
        deadline: &Deadline,
    ) -> Result<GatePermit, Overloaded> {
        self.enter_with(tenant, cost, deadline, false).await
    }

    /// [`Gate::enter_as`] for a request that is a retry (it came with
    /// `grpc-previous-rpc-attempts`): when the gate must shed, retries go first. Without a
    /// free slot, a retry is refused ([`DropReason::Retry`]) instead of queued while the queue
    /// is half full or the gate sheds under sustained overload, so first attempts keep the
    /// rest of the queue: a retry's work was already asked for once, and shedding it sheds
    /// load that the retrying client multiplied (Google SRE's criticality).
    pub async fn enter_retry_as(
        &self,
        tenant: &str,
        cost: usize,
        deadline: &Deadline,
    ) -> Result<GatePermit, Overloaded> {
        self.enter_with(tenant, cost, deadline, true).await
    }

    async fn enter_with(
        &self,
        tenant: &str,
        cost: usize,
        deadline: &Deadline,
        retry: bool,
    ) -> Result<GatePermit, Overloaded> {
        let (reply, ticket, mut check_at) = match self.join(tenant, cost, deadline, retry)? {
            Joined::Admitted(permit) => return Ok(permit),
            Joined::Queued {
                reply,
                ticket,
                check_at,
            } => (reply, ticket, check_at),
        };
        let shared = &self.shared;
        let mut leave = Leave {
            shared,
            ticket: Some(ticket),
        };
        tokio::pin!(reply);
        loop {
            // Not queued any more: a reply is on its way.
            let (Some(at), Some(ticket)) = (check_at, leave.ticket) else {
                leave.ticket = None;
                return reply.await.unwrap_or_else(|_| Err(self.gone()));
            };
            tokio::select! {
                biased;
                answer = &mut reply => {
                    leave.ticket = None;
                    return answer.unwrap_or_else(|_| Err(self.gone()));
                }
                () = tokio::time::sleep_until(at) => {
                    match self.check(ticket) {
                        Ok(next) => check_at = next,
                        Err(refused) => {
                            leave.ticket = None;
                            return Err(refused);
                        }
                    }
                }
            }
        }
    }

    /// Admits at once, queues, or refuses: the synchronous half of [`Gate::enter_as`].
    fn join(
        &self,
        tenant: &str,
        cost: usize,
        deadline: &Deadline,
        retry: bool,
    ) -> Result<Joined, Overloaded> {
        let shared = &self.shared;
        let now = Instant::now();
        let mut state = shared.lock();
        if let Some(permit) = shared.try_admit(&mut state, now, tenant) {
            return Ok(Joined::Admitted(permit));
        }
        // Retries are shed first, but not those of a tenant within its share: another
        // tenant's load is no reason to refuse them.
        if retry
            && !state.queue.within_share(tenant)
            && (state.shedding.is_sustained()
                || state.queue.len() * 2 >= state.queue.config().max_waiters)
        {
            return Err(Shared::refusal(&mut state, now, Some(DropReason::Retry)));
        }
        let (notify, reply) = oneshot::channel();
        let pushed = state
            .queue
            .push(now, tenant, deadline.instant(), cost, notify);
        let joined = match pushed {
            Ok(ticket) => Ok(Joined::Queued {
                reply,
                ticket,
                check_at: state.queue.next_check(ticket, now),
            }),
            Err(refused) => Err(Shared::refusal(&mut state, now, Some(refused.reason))),
        };
        // Pushing may have pushed others out; they are told at once.
        let replies = shared.dispatch(&mut state, now);
        drop(state);
        deliver(replies);
        joined
    }

    /// Asks the queue whether a waiter must leave now: refused, or when to ask again (`None`
    /// when it is no longer queued).
    fn check(&self, ticket: Ticket) -> Result<Option<Instant>, Overloaded> {
        let shared = &self.shared;
        let now = Instant::now();
        let mut state = shared.lock();
        if let Some((_notify, reason)) = state.queue.check(ticket, now) {
            let refused = Shared::refusal(&mut state, now, Some(reason));
            if let Some(gauges) = shared.gauges.get() {
                gauges.with(|h| h.queue.set(state.queue.len() as f64));
            }
            return Err(refused);
        }
        Ok(state.queue.next_check(ticket, now))
    }

    /// A permit for `tenant` if a slot is free and nobody waits; `None` is no refusal (nothing
    /// is counted): the caller goes on to [`Gate::enter_as`].
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    pub(crate) fn try_admit(&self, tenant: &str) -> Option<GatePermit> {
        self.shared
            .try_admit(&mut self.shared.lock(), Instant::now(), tenant)
    }

    /// Enters the gate as the default tenant only if a slot is free and nobody waits.
    pub fn try_enter(&self) -> Result<GatePermit, Overloaded> {
        let now = Instant::now();
        let mut state = self.shared.lock();
        match self.shared.try_admit(&mut state, now, DEFAULT_TENANT) {
            Some(permit) => Ok(permit),
            None => Err(Shared::refusal(&mut state, now, None)),
        }
    }

    /// Whether one more request of `tenant`, with its requests running and waiting, fits an
    /// equal part of the gate's limit among the tenants with requests (see
    /// [`AdmissionQueue::within_share`]). While the gate is overloaded, such a tenant is not
    /// turned away at the door of the queue nor dropped on sojourn, and the listener does not
    /// push its connections away; the tenants over their share pay for the overload.
    ///
    /// ```
    /// use std::time::Duration;
    /// use backstop::admission::Gate;
    /// use backstop::deadline::Deadline;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// let gate = Gate::new(4, Duration::from_millis(5));
    /// let deadline = Deadline::after(Duration::from_secs(1));
    /// let mut noisy = Vec::new();
    /// for _ in 0..3 {
    ///     noisy.push(gate.enter_as("noisy", 0, &deadline).await.unwrap());
    /// }
    /// let quiet = gate.enter_as("quiet", 0, &deadline).await.unwrap();
    /// // Two tenants with requests: two of the four places each.
    /// assert!(!gate.within_share("noisy"));
    /// assert!(gate.within_share("quiet"), "its request and one more");
    /// assert!(quiet.within_share());
    /// # }
    /// ```
    pub fn within_share(&self, tenant: &str) -> bool {
        self.shared.lock().queue.within_share(tenant)
    }

    /// Requests holding a permit now.
    pub fn inflight(&self) -> usize {
        self.shared.lock().running
    }

    /// Requests waiting in the queue now.
    pub fn queued(&self) -> usize {
        self.shared.lock().queue.len()
    }

    /// Most requests admitted at once, now.
    pub fn limit(&self) -> usize {
        self.shared.lock().limit
    }

    /// Whether the limit learns from latency (see [`Gate::with_limit`]).
    pub fn is_adaptive(&self) -> bool {
        self.shared.limiter.is_some()
    }

    /// Least time serving a request takes; waiting may not eat into it.
    pub fn min_service(&self) -> Duration {
        self.min_service
    }

    /// The queue's settings.
    pub fn queue_config(&self) -> QueueConfig {
        self.shared.lock().queue.config().clone()
    }

    /// A refusal for a waiter whose reply was lost (never expected: every queued waiter is
    /// answered or removes itself).
    fn gone(&self) -> Overloaded {
        Shared::refusal(&mut self.shared.lock(), Instant::now(), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{Discipline, Gradient2};
    use crate::status::{Code, Outcome};
    use std::sync::Mutex;
    use tokio::time::Instant;

    const MS: Duration = Duration::from_millis(1);

    /// Criticality: without a free slot, a retry is refused once the queue is half full,
    /// while first attempts still queue up to the bound; with room to spare a retry waits too.
    #[tokio::test(start_paused = true)]
    async fn retries_are_shed_before_first_attempts() {
        let gate = Gate::new(1, MS).with_queue(QueueConfig {
            max_waiters: 4,
            ..QueueConfig::default()
        });
        let d = Deadline::after(Duration::from_secs(10));
        let held = gate.enter(&d).await.unwrap();
        // A quarter full: the retry still waits its turn.
        let first = tokio::spawn({
            let gate = gate.clone();
            async move { gate.enter_as("a", 0, &d).await.map(drop) }
        });
        tokio::task::yield_now().await;
        let retry = tokio::spawn({
            let gate = gate.clone();
            async move { gate.enter_retry_as("a", 0, &d).await.map(drop) }
        });
        tokio::task::yield_now().await;
        assert_eq!(gate.queued(), 2, "a retry waits while the queue has room");
        // Half full now: the next retry is refused at once, a first attempt still queues.
        let err = gate.enter_retry_as("b", 0, &d).await.unwrap_err();
        assert_eq!(err.reason, Some(DropReason::Retry));
        assert_eq!(err.reason_label(), "retry");
        let third = tokio::spawn({
            let gate = gate.clone();
            async move { gate.enter_as("c", 0, &d).await.map(drop) }
        });
        tokio::task::yield_now().await;
        assert_eq!(gate.queued(), 3);
        drop(held);
        for waiter in [first, retry, third] {
            waiter.await.unwrap().unwrap();
        }
    }

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
        assert_eq!(err.reason, Some(DropReason::Deadline));
        assert_eq!(err.reason_label(), "deadline");
        assert!(err.retry && err.retry_after >= 100 * MS, "{err:?}");
        assert_eq!(gate.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn rejects_at_once_when_no_time_for_waiting() {
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
                    retry_after: 3 * MS,
                    reason: Some(DropReason::Deadline),
                    retry: true,
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
    async fn free_slot_is_granted_even_with_little_time_left() {
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
        assert_eq!(gate.queued(), 0, "the dropped waiter left the queue");
        drop(held);
        assert_eq!(gate.inflight(), 0);
        assert!(gate.try_enter().is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_permit_sent_to_a_waiter_that_went_away_is_returned() {
        let gate = Gate::new(1, MS);
        let held = gate.try_enter().unwrap();
        let budget = Deadline::after(Duration::from_secs(1));
        let mut waiting = Box::pin(gate.enter(&budget));
        assert!(futures_util::poll!(waiting.as_mut()).is_pending());
        // The slot is handed to the waiter, which is dropped before it looks.
        drop(held);
        assert_eq!(gate.inflight(), 1);
        drop(waiting);
        assert_eq!((gate.inflight(), gate.queued()), (0, 0));
        assert!(gate.try_enter().is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn freed_slots_go_to_tenants_in_turn() {
        let gate = Gate::new(1, MS);
        let held = gate.try_enter().unwrap();
        let budget = Deadline::after(Duration::from_secs(1));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for tenant in ["flood", "flood", "flood", "quiet"] {
            let (gate, order) = (gate.clone(), Arc::clone(&order));
            waiters.push(tokio::spawn(async move {
                let permit = gate.enter_as(tenant, 0, &budget).await.unwrap();
                order.lock().unwrap().push(tenant);
                tokio::time::sleep(MS).await;
                permit.finish();
            }));
            tokio::task::yield_now().await;
        }
        assert_eq!(gate.queued(), 4);
        drop(held);
        for w in waiters {
            w.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        assert_eq!(order, ["flood", "quiet", "flood", "flood"]);
    }

    #[tokio::test(start_paused = true)]
    async fn fifo_waits_as_long_as_the_deadline_allows() {
        let gate = Gate::new(1, 10 * MS).with_queue(QueueConfig {
            discipline: Discipline::Fifo,
            ..QueueConfig::default()
        });
        assert_eq!(gate.queue_config().discipline, Discipline::Fifo);
        assert_eq!(gate.queue_config().min_service, 10 * MS);
        let _held = gate.try_enter().unwrap();
        let start = Instant::now();
        let err = gate
            .enter(&Deadline::after(Duration::from_secs(2)))
            .await
            .unwrap_err();
        assert_eq!(
            start.elapsed(),
            Duration::from_secs(2) - 10 * MS,
            "no sojourn drop"
        );
        assert_eq!(err.reason, Some(DropReason::Deadline));
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

    #[tokio::test(start_paused = true)]
    async fn sustained_shedding_asks_not_to_retry() {
        let shedding = Shedding::new(SheddingConfig {
            sustain: Duration::from_secs(1),
            min_requests: 2,
            ..SheddingConfig::default()
        })
        .unwrap();
        let gate = Gate::new(1, MS)
            .with_retry_after(3 * MS)
            .with_shedding(shedding.clone());
        let held = gate.try_enter().unwrap();
        let refused = gate.try_enter().unwrap_err();
        assert!(refused.retry, "shedding, but not for long yet");
        assert!(gate.shedding().is_shedding());
        tokio::time::advance(Duration::from_secs(1)).await;
        let refused = gate.try_enter().unwrap_err();
        assert!(
            !refused.retry && refused.retry_after == 3 * MS,
            "{refused:?}"
        );
        assert!(Status::from(refused).no_retry());
        assert!(shedding.is_sustained(), "the handle is shared");
        drop(held);
        // Admitted again: once the share falls to the threshold, refusals may be retried.
        for _ in 0..10 {
            gate.try_enter().unwrap().finish();
        }
        assert!(!shedding.is_shedding());
    }

    #[test]
    fn limits_and_status() {
        assert_eq!(Gate::new(0, MS).limit(), 1);
        assert_eq!(Gate::new(7, MS).min_service(), MS);
        let refused = Overloaded {
            retry_after: 2 * MS,
            reason: None,
            retry: true,
        };
        assert_eq!(refused.reason_label(), "overloaded");
        let s: Status = refused.into();
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(s.outcome(), Outcome::Rejected);
        assert_eq!(s.pushback(), Some(2 * MS));
        assert!(!s.no_retry());
        let s: Status = Overloaded {
            retry: false,
            ..refused
        }
        .into();
        assert!(s.no_retry());
    }
}
