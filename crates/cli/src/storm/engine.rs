//! The discrete-event engine: open-loop clients driven by the library's retry, budget, storm
//! alarm, throttle and hedging types, a server with a concurrency limit and an admission step,
//! and a downstream whose latency changes by phase. Virtual time in nanoseconds; a binary heap
//! of events; one seeded generator. No runtime, no sleeping: the same model and seed give the
//! same run.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use backstop::admission::{
    AdmissionQueue, FixedLimit, Gradient2, Limit, Pushback, QueueConfig, SlowStart, Ticket,
};
use backstop::deadline::Deadline;
use backstop::hedge::{HedgePolicy, LatencyWindow};
use backstop::retry::{
    AdaptiveThrottle, Attempts, Backoff, CallInfo, RetryBudget, RetryError, RetryPolicy,
    StormAlarm, StormConfig,
};
use backstop::status::{Code, Status, problem};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::time::Instant;

use super::dist::{LogNormal, exponential_nanos};
use super::series::{Row, Totals};

const NANOS: u64 = 1_000_000_000;

/// What the world does: arrivals, the server's own work, the downstream by phase.
#[derive(Debug, Clone)]
pub(crate) struct Model {
    /// Simulated time; arrivals and the series stop there.
    pub(crate) duration: Duration,
    /// Length of one row of the series.
    pub(crate) interval: Duration,
    /// Logical requests per second (Poisson arrivals).
    pub(crate) rate: f64,
    /// The server's own part of every request, on top of the downstream call.
    pub(crate) local: Duration,
    /// The downstream from each phase's start on; the first starts at 0.
    pub(crate) phases: Vec<Phase>,
    /// Seeds arrivals, service times, jitter and the throttle.
    pub(crate) seed: u64,
}

/// The downstream from `from` on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Phase {
    /// When the phase starts.
    pub(crate) from: Duration,
    /// How the downstream answers during it.
    pub(crate) downstream: Downstream,
}

/// How the downstream answers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Downstream {
    /// Successfully, after a log-normal latency.
    Latency(LogNormal),
    /// With an error after `after` (a refused connection, a 503), which the server passes on
    /// to its client with `pushback` as its Retry-After, if any.
    Failing {
        /// How long the failing call takes.
        after: Duration,
        /// The pushback the failure carries to the client.
        pushback: Option<Duration>,
    },
}

/// How clients call: the retry policy's knobs, the timeout, hedging.
#[derive(Debug, Clone)]
pub(crate) struct ClientConfig {
    /// Attempts per logical request, first included.
    pub(crate) max_attempts: u32,
    /// Delays between attempts.
    pub(crate) backoff: Backoff,
    /// Retry budget `(ratio, burst)`; `None` for no budget at all.
    pub(crate) budget: Option<(f64, u32)>,
    /// The library's storm alarm, with its defaults.
    pub(crate) storm_alarm: bool,
    /// The library's adaptive throttle, with its defaults.
    pub(crate) throttle: bool,
    /// The client's timeout.
    pub(crate) timeout: Duration,
    /// How `timeout` bounds the attempts, and what the server is told of it.
    pub(crate) deadlines: Deadlines,
    /// Whether a refusal's pushback (Retry-After) is waited out before the next attempt; a
    /// client that ignores it retries on its own backoff.
    pub(crate) honours_pushback: bool,
    /// Hedge once at this quantile of recent latencies (through the library's hedging policy).
    pub(crate) hedge_quantile: Option<f64>,
}

/// How a client's timeout bounds its attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deadlines {
    /// One deadline of `timeout` for the logical request, shared by its attempts and
    /// propagated to the server.
    Shared,
    /// Every attempt gets `timeout` afresh (a fixed per-attempt timeout); the server is not
    /// told any deadline.
    PerAttempt,
    /// Every attempt gets `timeout` afresh and tells the server its own deadline (a fresh
    /// `grpc-timeout` per attempt, as `backstop load --policy naive` sends).
    PerAttemptPropagated,
}

impl Deadlines {
    fn per_attempt(self) -> bool {
        self != Deadlines::Shared
    }
}

/// The server's admission: the concurrency limit and whether waiting is bounded by the
/// caller's deadline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServerConfig {
    /// The concurrency limit (workers, or the gate in front of them).
    pub(crate) limit: LimitKind,
    /// The library's [`SlowStart`] around the limit, with this floor: when half the recent
    /// requests fail the limit drops to the floor, and it ramps back up, doubling per round
    /// trip, once they succeed again. `None`: the limit alone.
    pub(crate) slow_start: Option<usize>,
    /// Bound every wait by `deadline - min_service` and refuse beyond it (the library's
    /// gate), and stop serving a request when its deadline passes (the library's deadline
    /// layer drops the handler then, freeing its slot); otherwise an unbounded first-come
    /// first-served queue whose requests run to the end whoever still waits for them.
    pub(crate) deadline_aware: bool,
    /// The least time serving a request takes.
    pub(crate) min_service: Duration,
    /// The pushback sent with a refusal.
    pub(crate) retry_after: RetryAfter,
    /// Waiters go through the library's fair queue (sojourn drops, adaptive LIFO) instead of
    /// one first-come first-served line; only with `deadline_aware`.
    pub(crate) fair_queue: bool,
}

/// Which library limit sizes the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitKind {
    /// [`FixedLimit`].
    Fixed(usize),
    /// [`Gradient2`] within `min..=max`, starting at `max`.
    Gradient2 {
        /// Lower bound.
        min: usize,
        /// Upper bound and start.
        max: usize,
    },
}

impl LimitKind {
    /// The limit, behind a [`SlowStart`] with floor `slow_start` if one is given.
    fn build(self, slow_start: Option<usize>) -> Box<dyn Limit> {
        match (self, slow_start) {
            (LimitKind::Fixed(n), None) => Box::new(FixedLimit::new(n)),
            (LimitKind::Fixed(n), Some(floor)) => {
                Box::new(SlowStart::new(FixedLimit::new(n), floor))
            }
            (LimitKind::Gradient2 { min, max }, None) => Box::new(Gradient2::new(min, max)),
            (LimitKind::Gradient2 { min, max }, Some(floor)) => {
                Box::new(SlowStart::new(Gradient2::new(min, max), floor))
            }
        }
    }
}

/// What a refusal tells the client about when to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryAfter {
    /// Nothing: the client's own backoff decides (a 503 without `Retry-After`).
    None,
    /// The same pushback on every refusal.
    Fixed(Duration),
    /// What the library's gate computes by default: [`AdmissionQueue::pushback`] from the
    /// queue ahead and the limit, jittered, and "do not retry" while the queue sheds hard.
    /// Needs the fair queue.
    Computed,
}

/// What one run produced: the per-interval series and the run's totals.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    /// One row per interval.
    pub(crate) rows: Vec<Row>,
    /// Counts over the whole run.
    pub(crate) totals: Totals,
}

// ---------------------------------------------------------------------------------------------
// Admission

/// What admission decided for an arriving attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrive {
    /// A slot is free: start now.
    Run,
    /// Wait; refused at `expire` (virtual nanoseconds) unless started before.
    Queue {
        /// When the wait bound passes, if any.
        expire: Option<u64>,
    },
    /// Refused at once.
    Refuse,
}

/// The server's admission step: which attempts run, which wait and which are refused. A
/// trait so other disciplines (a fair CoDel queue) can be put in front of the same workers.
/// Attempts are named by an opaque `u64` key.
pub(crate) trait Admission: std::fmt::Debug {
    /// An attempt arrives at `now` with its propagated `deadline`, if any.
    fn arrive(&mut self, now: u64, key: u64, deadline: Option<u64>) -> Arrive;
    /// A waiting attempt's bound passed at `now`: `None` when it is refused now (forgotten),
    /// `Some(at)` when it may keep waiting and should be looked at again at `at`.
    fn expire(&mut self, now: u64, key: u64) -> Option<u64>;
    /// Waiting attempts refused on someone else's behalf (pushed out, or found unable to
    /// finish in time when a slot freed), to be answered as refused.
    fn take_refused(&mut self) -> Vec<u64> {
        Vec::new()
    }
    /// A running attempt ended after `rtt`: served ([`Limit::on_sample`]), failed by the
    /// downstream ([`Limit::on_failure`], what a slow start judges), or cut at its deadline
    /// ([`Limit::on_abandoned`]).
    fn finished(&mut self, rtt: Duration, outcome: WorkOutcome);
    /// The pushback for a refusal at `now` computed from the waiting line, `unit` in `[0, 1)`
    /// drawn for its jitter; `None` when this admission has no estimate to give.
    fn pushback(&mut self, now: u64, unit: f64) -> Option<Pushback> {
        let _ = (now, unit);
        None
    }
    /// The next waiting attempt to start at `now`, while a slot is free.
    fn next(&mut self, now: u64) -> Option<u64>;
    /// Attempts waiting.
    fn queue_len(&self) -> usize;
    /// Attempts running.
    fn inflight(&self) -> usize;
    /// The concurrency limit now.
    fn limit(&self) -> usize;
}

/// First come, first served behind a library [`Limit`], each wait bounded by the caller's
/// deadline when one is known: the discipline of the library's `Gate`.
#[derive(Debug)]
pub(crate) struct FifoGate {
    limit: Box<dyn Limit>,
    deadline_aware: bool,
    min_service: u64,
    /// Waiting keys and when their wait ends (`u64::MAX` for never); entries whose wait ended
    /// are skipped lazily.
    queue: VecDeque<(u64, u64)>,
    waiting: usize,
    inflight: usize,
}

impl FifoGate {
    pub(crate) fn new(config: &ServerConfig) -> Self {
        Self {
            limit: config.limit.build(config.slow_start),
            deadline_aware: config.deadline_aware,
            min_service: nanos(config.min_service),
            queue: VecDeque::new(),
            waiting: 0,
            inflight: 0,
        }
    }
}

impl Admission for FifoGate {
    fn arrive(&mut self, now: u64, key: u64, deadline: Option<u64>) -> Arrive {
        // A free slot goes to those already waiting first, as with a fair semaphore.
        if self.waiting == 0 && self.inflight < self.limit.limit() {
            self.inflight += 1;
            return Arrive::Run;
        }
        let expire = match (self.deadline_aware, deadline) {
            (true, Some(deadline)) => {
                let bound = deadline.saturating_sub(self.min_service);
                if bound <= now {
                    return Arrive::Refuse;
                }
                Some(bound)
            }
            _ => None,
        };
        self.queue.push_back((key, expire.unwrap_or(u64::MAX)));
        self.waiting += 1;
        Arrive::Queue { expire }
    }

    fn expire(&mut self, _now: u64, _key: u64) -> Option<u64> {
        self.waiting -= 1;
        None
    }

    fn finished(&mut self, rtt: Duration, outcome: WorkOutcome) {
        outcome.teach(self.limit.as_mut(), rtt, self.inflight);
        self.inflight -= 1;
    }

    fn next(&mut self, now: u64) -> Option<u64> {
        if self.inflight >= self.limit.limit() {
            return None;
        }
        while let Some((key, expire)) = self.queue.pop_front() {
            if expire <= now {
                // Refused (or about to be) by its expiry event.
                continue;
            }
            self.waiting -= 1;
            self.inflight += 1;
            return Some(key);
        }
        None
    }

    fn queue_len(&self) -> usize {
        self.waiting
    }

    fn inflight(&self) -> usize {
        self.inflight
    }

    fn limit(&self) -> usize {
        self.limit.limit()
    }
}

/// The library's [`AdmissionQueue`] behind a library [`Limit`]: what the `Gate` does, on the
/// simulation's clock (virtual nanoseconds mapped onto instants from a fixed origin).
#[derive(Debug)]
pub(crate) struct QueueGate {
    limit: Box<dyn Limit>,
    queue: AdmissionQueue<u64>,
    tickets: HashMap<u64, Ticket>,
    refused: Vec<u64>,
    inflight: usize,
    origin: Instant,
}

impl QueueGate {
    pub(crate) fn new(config: &ServerConfig) -> Self {
        let limit = config.limit.build(config.slow_start);
        let mut queue = AdmissionQueue::new(QueueConfig {
            min_service: config.min_service,
            ..QueueConfig::default()
        });
        queue.set_slots(limit.limit());
        Self {
            limit,
            queue,
            tickets: HashMap::new(),
            refused: Vec::new(),
            inflight: 0,
            origin: Instant::now(),
        }
    }

    fn at(&self, t: u64) -> Instant {
        self.origin + Duration::from_nanos(t)
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
    }

    fn collect_dropped(&mut self) {
        for (key, _reason) in self.queue.take_dropped() {
            self.tickets.remove(&key);
            self.refused.push(key);
        }
    }
}

impl Admission for QueueGate {
    fn arrive(&mut self, now: u64, key: u64, deadline: Option<u64>) -> Arrive {
        let at = self.at(now);
        if self.queue.is_empty() && self.inflight < self.limit.limit() {
            self.queue.admitted_directly(at);
            self.inflight += 1;
            return Arrive::Run;
        }
        // No deadline known: the request may wait as long as the queue lets anyone wait.
        let deadline = deadline.map_or(at + Duration::from_secs(3_600), |d| self.at(d));
        let pushed = self.queue.push(at, "default", deadline, 1, key);
        self.collect_dropped();
        match pushed {
            Ok(ticket) => {
                self.tickets.insert(key, ticket);
                let check = self.queue.next_check(ticket, at);
                Arrive::Queue {
                    expire: check.map(|c| self.nanos(c).max(now + 1)),
                }
            }
            Err(_) => Arrive::Refuse,
        }
    }

    fn expire(&mut self, now: u64, key: u64) -> Option<u64> {
        let at = self.at(now);
        let ticket = *self.tickets.get(&key)?;
        if self.queue.check(ticket, at).is_some() {
            self.tickets.remove(&key);
            return None;
        }
        match self.queue.next_check(ticket, at) {
            Some(check) => Some(self.nanos(check).max(now + 1)),
            None => {
                self.tickets.remove(&key);
                None
            }
        }
    }

    fn take_refused(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.refused)
    }

    fn finished(&mut self, rtt: Duration, outcome: WorkOutcome) {
        outcome.teach(self.limit.as_mut(), rtt, self.inflight);
        // Only served requests say how long serving takes, as in the gate.
        if outcome == WorkOutcome::Served {
            self.queue.on_service(rtt);
        }
        self.queue.set_slots(self.limit.limit());
        self.inflight -= 1;
    }

    fn pushback(&mut self, now: u64, unit: f64) -> Option<Pushback> {
        let at = self.at(now);
        Some(self.queue.pushback(at, self.limit.limit(), unit))
    }

    fn next(&mut self, now: u64) -> Option<u64> {
        if self.inflight >= self.limit.limit() {
            return None;
        }
        let popped = self.queue.pop(self.at(now));
        self.collect_dropped();
        let admitted = popped?;
        self.tickets.remove(&admitted.item);
        self.inflight += 1;
        Some(admitted.item)
    }

    fn queue_len(&self) -> usize {
        self.queue.len()
    }

    fn inflight(&self) -> usize {
        self.inflight
    }

    fn limit(&self) -> usize {
        self.limit.limit()
    }
}

// ---------------------------------------------------------------------------------------------
// Bookkeeping

/// A slab with generations, so an event naming a freed and reused slot is recognised as stale.
#[derive(Debug)]
struct Slab<T> {
    items: Vec<(u32, Option<T>)>,
    free: Vec<u32>,
}

/// Generations are kept to 24 bits (they share an event's payload with its kind and index).
const GEN_MASK: u32 = (1 << 24) - 1;

impl<T> Slab<T> {
    fn new() -> Self {
        Self {
            items: Vec::new(),
            free: Vec::new(),
        }
    }

    fn insert(&mut self, value: T) -> Key {
        match self.free.pop() {
            Some(idx) => {
                let slot = &mut self.items[idx as usize];
                slot.0 = (slot.0 + 1) & GEN_MASK;
                slot.1 = Some(value);
                Key {
                    idx,
                    generation: slot.0,
                }
            }
            None => {
                let idx = u32::try_from(self.items.len()).expect("fewer than 2^32 live entries");
                self.items.push((0, Some(value)));
                Key { idx, generation: 0 }
            }
        }
    }

    fn get(&mut self, key: Key) -> Option<&mut T> {
        match self.items.get_mut(key.idx as usize) {
            Some((generation, Some(value))) if *generation == key.generation => Some(value),
            _ => None,
        }
    }

    fn remove(&mut self, key: Key) -> Option<T> {
        match self.items.get_mut(key.idx as usize) {
            Some((generation, value)) if *generation == key.generation && value.is_some() => {
                self.free.push(key.idx);
                value.take()
            }
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    idx: u32,
    generation: u32,
}

impl Key {
    fn pack(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.idx)
    }

    fn unpack(v: u64) -> Self {
        Key {
            idx: v as u32,
            generation: ((v >> 32) as u32) & GEN_MASK,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Arrival = 0,
    Send = 1,
    Hedge = 2,
    Timeout = 3,
    Expire = 4,
    Done = 5,
    Tick = 6,
}

impl Kind {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Kind::Arrival,
            1 => Kind::Send,
            2 => Kind::Hedge,
            3 => Kind::Timeout,
            4 => Kind::Expire,
            5 => Kind::Done,
            _ => Kind::Tick,
        }
    }
}

/// A logical request on the client.
#[derive(Debug)]
struct Logical {
    attempts: Attempts,
    /// The logical deadline (the attempts' shared one).
    deadline: u64,
    started: u64,
    /// Attempts the client still waits for (the attempt and perhaps its hedge).
    open: [Option<Key>; 2],
    first_failed: bool,
    hedged: bool,
    /// The budget the current attempt started with (for the attempt's log record).
    remaining: Duration,
}

impl Logical {
    fn outstanding(&self) -> usize {
        self.open.iter().filter(|k| k.is_some()).count()
    }

    fn close(&mut self, key: Key) {
        for slot in &mut self.open {
            if *slot == Some(key) {
                *slot = None;
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServerState {
    Waiting,
    Running,
    Done,
}

/// One attempt (or hedge) on the wire and at the server.
#[derive(Debug)]
struct Att {
    logical: Key,
    sent_at: u64,
    /// The interval it was offered in.
    row: usize,
    /// The deadline the server is told, if any.
    deadline: Option<u64>,
    client_open: bool,
    server: ServerState,
    /// When it reached a worker.
    started: u64,
    /// How the server's work on it ends.
    outcome: WorkOutcome,
}

/// How the server's work on an attempt ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WorkOutcome {
    /// Served.
    Served,
    /// The downstream failed.
    Failed,
    /// The server gave up at the deadline.
    CutOff,
}

impl WorkOutcome {
    /// Tells `limit` how the work ended, as the gate does when a permit is finished, failed
    /// or dropped.
    fn teach(self, limit: &mut dyn Limit, rtt: Duration, inflight: usize) {
        match self {
            WorkOutcome::Served => limit.on_sample(rtt, inflight),
            WorkOutcome::Failed => limit.on_failure(rtt, inflight),
            WorkOutcome::CutOff => limit.on_abandoned(rtt, inflight),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The simulation

/// Runs `model` with clients configured by `client` against a server configured by `server`.
pub(crate) fn run(model: &Model, client: &ClientConfig, server: &ServerConfig) -> Run {
    let queued = server.deadline_aware && server.fair_queue;
    assert!(
        queued || server.retry_after != RetryAfter::Computed,
        "a computed Retry-After needs the gate's fair queue"
    );
    let admission: Box<dyn Admission> = if queued {
        Box::new(QueueGate::new(server))
    } else {
        Box::new(FifoGate::new(server))
    };
    Sim::new(model, client, server, admission).run()
}

struct Sim<'a> {
    model: &'a Model,
    client: &'a ClientConfig,
    server: &'a ServerConfig,
    base: Instant,
    now: u64,
    end: u64,
    interval: u64,
    seq: u64,
    heap: BinaryHeap<Reverse<(u64, u64, u64)>>,
    /// Events scheduled in time order (most timeouts: send time plus a constant), kept out
    /// of the heap: most of a run's events, popped from the front in O(1).
    fifo: VecDeque<(u64, u64, u64)>,
    rng: StdRng,
    /// Draws the jitter of computed pushback.
    pushback_rng: StdRng,
    policy: RetryPolicy,
    storm: Option<StormAlarm>,
    hedge: Option<HedgePolicy>,
    call: CallInfo<'static>,
    logicals: Slab<Logical>,
    atts: Slab<Att>,
    admission: Box<dyn Admission>,
    rows: Vec<Row>,
    /// Latencies (ms) of logical requests ending in the current interval.
    latencies: Vec<u32>,
    totals: Totals,
    /// Attempts at the server (waiting or running), integrated over time for Little's law.
    in_system: u64,
    area: f64,
    last_change: u64,
}

impl<'a> Sim<'a> {
    fn new(
        model: &'a Model,
        client: &'a ClientConfig,
        server: &'a ServerConfig,
        admission: Box<dyn Admission>,
    ) -> Self {
        // Virtual time maps onto the library's clock as `base + offset`, base read once; the
        // alarm and the throttle count their windows from it, so no wall-clock reading
        // reaches a decision.
        let base = Instant::now();
        let budget = match client.budget {
            Some((ratio, burst)) => {
                RetryBudget::new(ratio, burst).expect("ratio checked by the scenario")
            }
            // No budget: more tokens than any run can spend, and one more per request.
            None => RetryBudget::new(1.0, u32::MAX).expect("valid"),
        };
        let storm = client
            .storm_alarm
            .then(|| StormAlarm::new_at("sim", StormConfig::default(), base));
        let throttle = client.throttle.then(|| {
            AdaptiveThrottle::new_at(
                AdaptiveThrottle::DEFAULT_K,
                AdaptiveThrottle::DEFAULT_WINDOW,
                base,
            )
            .expect("defaults are valid")
            .seeded(model.seed ^ 0x5eed)
        });
        let policy = RetryPolicy::builder("sim", "call")
            .max_attempts(client.max_attempts)
            .backoff(client.backoff)
            .budget(budget.clone())
            .storm_alarm(storm.clone())
            .throttle(throttle)
            // Calls carry an idempotency key, so an attempt that timed out may be sent again.
            .keyed(true)
            .build()
            .expect("attempts checked by the scenario");
        let hedge = client.hedge_quantile.map(|q| {
            HedgePolicy::new(budget, "sim", "call")
                .quantile(q)
                .storm_alarm(storm.clone())
                .latencies(Arc::new(LatencyWindow::new(
                    HedgePolicy::WINDOW,
                    HedgePolicy::MIN_SAMPLES,
                )))
        });
        let interval = nanos(model.interval).max(1);
        let end = nanos(model.duration);
        let count = end.div_ceil(interval) as usize;
        let rows = (0..count)
            .map(|i| Row {
                t: (i as u64 * interval) as f64 / NANOS as f64,
                ..Row::default()
            })
            .collect();
        Self {
            model,
            client,
            server,
            base,
            now: 0,
            end,
            interval,
            seq: 0,
            heap: BinaryHeap::new(),
            fifo: VecDeque::new(),
            rng: StdRng::seed_from_u64(model.seed),
            // A stream of its own, so a variant that computes pushback sees the same arrivals
            // and service times as one that does not.
            pushback_rng: StdRng::seed_from_u64(model.seed ^ 0x9ac6_b4c6),
            policy,
            storm,
            hedge,
            call: CallInfo::new(),
            logicals: Slab::new(),
            atts: Slab::new(),
            admission,
            rows,
            latencies: Vec::new(),
            totals: Totals::default(),
            in_system: 0,
            area: 0.0,
            last_change: 0,
        }
    }

    fn at(&self, t: u64) -> Instant {
        self.base + Duration::from_nanos(t)
    }

    fn schedule(&mut self, t: u64, kind: Kind, payload: u64) {
        if t > self.end {
            return;
        }
        self.seq += 1;
        let event = (t, self.seq, (kind as u64) << 56 | payload);
        // Timeouts mostly come in time order; those that do not (a retry's shared deadline)
        // go to the heap. Either way events pop in (time, sequence) order.
        if kind == Kind::Timeout && self.fifo.back().is_none_or(|last| last.0 <= t) {
            self.fifo.push_back(event);
        } else {
            self.heap.push(Reverse(event));
        }
    }

    /// The next event in (time, sequence) order.
    fn pop(&mut self) -> Option<(u64, u64, u64)> {
        match (self.heap.peek(), self.fifo.front()) {
            (Some(Reverse(h)), Some(f)) if h < f => self.heap.pop().map(|Reverse(e)| e),
            (_, Some(_)) => self.fifo.pop_front(),
            (Some(_), None) => self.heap.pop().map(|Reverse(e)| e),
            (None, None) => None,
        }
    }

    fn row(&self) -> usize {
        ((self.now / self.interval) as usize).min(self.rows.len().saturating_sub(1))
    }

    fn run(mut self) -> Run {
        if self.model.rate > 0.0 {
            let first = exponential_nanos(&mut self.rng, self.model.rate);
            self.schedule(first, Kind::Arrival, 0);
        }
        for i in 1..=self.rows.len() as u64 {
            self.schedule((i * self.interval).min(self.end), Kind::Tick, i - 1);
        }
        while let Some((t, _, payload)) = self.pop() {
            self.now = t;
            let kind = Kind::from_u8((payload >> 56) as u8);
            let key = Key::unpack(payload & ((1 << 56) - 1));
            match kind {
                Kind::Arrival => self.arrival(),
                Kind::Send => self.send(key),
                Kind::Hedge => self.hedge(key),
                Kind::Timeout => self.timeout(key),
                Kind::Expire => self.expire(key),
                Kind::Done => self.done(key),
                Kind::Tick => self.tick((payload & 0xffff_ffff) as usize),
            }
        }
        self.totals.time_in_system = self.area / NANOS as f64;
        self.totals.seconds = self.end as f64 / NANOS as f64;
        Run {
            rows: self.rows,
            totals: self.totals,
        }
    }

    fn set_in_system(&mut self, delta: i64) {
        self.area += self.in_system as f64 * (self.now - self.last_change) as f64;
        self.last_change = self.now;
        self.in_system = self.in_system.saturating_add_signed(delta);
    }

    // --- client ---------------------------------------------------------------------------

    fn arrival(&mut self) {
        let next = self.now + exponential_nanos(&mut self.rng, self.model.rate).max(1);
        self.schedule(next, Kind::Arrival, 0);
        let timeout = nanos(self.client.timeout);
        // A fixed per-attempt timeout leaves the logical request as long as all its attempts
        // could take: the per-attempt timeouts are what ends each one.
        let deadline = if self.client.deadlines.per_attempt() {
            self.now + timeout * u64::from(self.client.max_attempts) + NANOS
        } else {
            self.now + timeout
        };
        let attempts = self.policy.attempts(Deadline::at(self.at(deadline)));
        let key = self.logicals.insert(Logical {
            attempts,
            deadline,
            started: self.now,
            open: [None, None],
            first_failed: false,
            hedged: false,
            remaining: Duration::ZERO,
        });
        self.totals.logical += 1;
        self.send(key);
    }

    /// Starts the next attempt of logical request `lkey`, as the retry policy allows.
    fn send(&mut self, lkey: Key) {
        let now = self.at(self.now);
        let Some(logical) = self.logicals.get(lkey) else {
            return;
        };
        let started = logical.attempts.start(&self.policy, &self.call, now);
        let (attempt, remaining) = match started {
            Ok(ok) => ok,
            Err(error) => return self.finish(lkey, Err(error)),
        };
        logical.remaining = remaining;
        let deadline = logical.deadline;
        let retry = attempt.is_retry();
        self.send_attempt(lkey, deadline, retry, false);
        if !retry {
            if let Some(delay) = self.hedge.as_ref().and_then(HedgePolicy::delay) {
                self.schedule(self.now + nanos(delay), Kind::Hedge, lkey.pack());
            }
        }
    }

    /// Puts one attempt on the wire to the server.
    fn send_attempt(&mut self, lkey: Key, deadline: u64, retry: bool, hedge: bool) {
        let row = self.row();
        let r = &mut self.rows[row];
        if retry || hedge {
            r.offered_retries += 1;
            self.totals.retries += u64::from(retry);
            self.totals.hedges += u64::from(hedge);
            r.hedges += u64::from(hedge);
        } else {
            r.offered_originals += 1;
        }
        self.totals.attempts += 1;
        let (timeout_at, server_deadline) = match self.client.deadlines {
            Deadlines::Shared => (deadline, Some(deadline)),
            Deadlines::PerAttempt => (self.now + nanos(self.client.timeout), None),
            Deadlines::PerAttemptPropagated => {
                let at = self.now + nanos(self.client.timeout);
                (at, Some(at))
            }
        };
        let akey = self.atts.insert(Att {
            logical: lkey,
            sent_at: self.now,
            row,
            deadline: server_deadline,
            client_open: true,
            server: ServerState::Waiting,
            started: 0,
            outcome: WorkOutcome::Served,
        });
        if let Some(logical) = self.logicals.get(lkey) {
            let slot = logical.open.iter_mut().find(|s| s.is_none());
            *slot.expect("at most an attempt and its hedge are open") = Some(akey);
        }
        self.schedule(timeout_at, Kind::Timeout, akey.pack());
        self.server_arrive(akey, server_deadline);
    }

    fn hedge(&mut self, lkey: Key) {
        let now = self.at(self.now);
        let Some(logical) = self.logicals.get(lkey) else {
            return;
        };
        if logical.hedged || logical.outstanding() != 1 {
            return;
        }
        let Some(policy) = &self.hedge else {
            return;
        };
        if !policy.try_hedge_at(now) {
            return;
        }
        logical.hedged = true;
        let deadline = logical.deadline;
        self.send_attempt(lkey, deadline, false, true);
    }

    /// The client stops waiting for attempt `akey` at its timeout.
    fn timeout(&mut self, akey: Key) {
        let Some(att) = self.atts.get(akey) else {
            return;
        };
        if !att.client_open {
            return;
        }
        att.client_open = false;
        let (lkey, row, sent_at, server) = (att.logical, att.row, att.sent_at, att.server);
        if server == ServerState::Done {
            self.atts.remove(akey);
        }
        self.rows[row].attempts_failed += 1;
        let now = self.at(self.now);
        let elapsed = Duration::from_nanos(self.now - sent_at);
        let Some(logical) = self.logicals.get(lkey) else {
            return;
        };
        logical.close(akey);
        if logical.outstanding() > 0 {
            return;
        }
        let remaining = logical.remaining;
        if !logical.first_failed {
            logical.first_failed = true;
            self.totals.first_failed += 1;
        }
        let decision = if self.client.deadlines.per_attempt() {
            let status = Status::new(Code::DeadlineExceeded, "attempt timed out");
            logical.attempts.failed_at(
                &self.policy,
                &self.call,
                status,
                remaining,
                elapsed,
                now,
                &mut self.rng,
            )
        } else {
            logical.attempts.cut_off_at(
                &self.policy,
                &self.call,
                remaining,
                elapsed,
                now,
                &mut self.rng,
            )
        };
        self.decided(lkey, decision);
    }

    /// Acts on the retry policy's decision after a failed attempt.
    fn decided(&mut self, lkey: Key, decision: Result<Duration, RetryError>) {
        match decision {
            Ok(wait) => self.schedule(self.now + nanos(wait).max(1), Kind::Send, lkey.pack()),
            Err(error) => self.finish(lkey, Err(error)),
        }
    }

    /// The server answered attempt `akey`.
    fn answered(&mut self, akey: Key, result: Result<(), Status>, worked: bool) {
        let now_ns = self.now;
        let row = self.row();
        let Some(att) = self.atts.get(akey) else {
            return;
        };
        att.server = ServerState::Done;
        if !att.client_open {
            self.atts.remove(akey);
            if worked {
                self.rows[row].wasted += 1;
                self.totals.wasted += 1;
            }
            return;
        }
        att.client_open = false;
        let (lkey, arow, sent_at) = (att.logical, att.row, att.sent_at);
        self.atts.remove(akey);
        let now = self.at(now_ns);
        let elapsed = Duration::from_nanos(now_ns - sent_at);
        let Some(logical) = self.logicals.get(lkey) else {
            return;
        };
        logical.close(akey);
        let remaining = logical.remaining;
        match result {
            Ok(()) => {
                self.rows[row].goodput += 1;
                self.totals.goodput += 1;
                logical
                    .attempts
                    .succeeded_at(&self.policy, &self.call, remaining, elapsed, now);
                if let Some(hedge) = &self.hedge {
                    hedge.record_latency(elapsed);
                }
                self.finish(lkey, Ok(()));
            }
            Err(status) => {
                self.rows[arow].attempts_failed += 1;
                if logical.outstanding() > 0 {
                    // Its hedge may still answer.
                    return;
                }
                if !logical.first_failed {
                    logical.first_failed = true;
                    self.totals.first_failed += 1;
                }
                let decision = logical.attempts.failed_at(
                    &self.policy,
                    &self.call,
                    status,
                    remaining,
                    elapsed,
                    now,
                    &mut self.rng,
                );
                self.decided(lkey, decision);
            }
        }
    }

    /// Logical request `lkey` ends: in success, or stopped for the error's reason.
    fn finish(&mut self, lkey: Key, outcome: Result<(), RetryError>) {
        let Some(logical) = self.logicals.remove(lkey) else {
            return;
        };
        let row = self.row();
        let latency_ms = (self.now - logical.started) / 1_000_000;
        self.latencies
            .push(u32::try_from(latency_ms).unwrap_or(u32::MAX));
        match outcome {
            Ok(()) => {
                self.rows[row].logical_ok += 1;
                self.totals.logical_ok += 1;
            }
            Err(error) => {
                self.rows[row].logical_failed += 1;
                *self.totals.stops.entry(error.reason.as_str()).or_default() += 1;
            }
        }
        // Attempts still out (a hedge's sibling) now answer nobody.
        for akey in logical.open.into_iter().flatten() {
            if let Some(att) = self.atts.get(akey) {
                att.client_open = false;
                if att.server == ServerState::Done {
                    self.atts.remove(akey);
                }
            }
        }
    }

    // --- server ---------------------------------------------------------------------------

    fn server_arrive(&mut self, akey: Key, deadline: Option<u64>) {
        self.set_in_system(1);
        self.totals.server_arrivals += 1;
        match self.admission.arrive(self.now, akey.pack(), deadline) {
            Arrive::Run => self.start_work(akey),
            Arrive::Queue { expire } => {
                if let Some(at) = expire {
                    self.schedule(at, Kind::Expire, akey.pack());
                }
            }
            Arrive::Refuse => self.refuse(akey),
        }
        self.refuse_dropped();
    }

    /// Answers the waiters admission dropped on someone else's behalf.
    fn refuse_dropped(&mut self) {
        for key in self.admission.take_refused() {
            let akey = Key::unpack(key);
            let Some(att) = self.atts.get(akey) else {
                continue;
            };
            if att.server != ServerState::Waiting {
                continue;
            }
            let sent_at = att.sent_at;
            self.totals.sojourn += (self.now - sent_at) as f64 / NANOS as f64;
            self.refuse(akey);
        }
    }

    fn refuse(&mut self, akey: Key) {
        self.set_in_system(-1);
        let row = self.row();
        self.rows[row].refused += 1;
        self.totals.refused += 1;
        let status = match self.server.retry_after {
            RetryAfter::None => None,
            RetryAfter::Fixed(wait) => Some(Pushback { wait, retry: true }),
            RetryAfter::Computed => {
                let unit = self.pushback_rng.random::<f64>();
                let pushback = self.admission.pushback(self.now, unit);
                Some(pushback.expect("checked by `run`: the fair queue computes pushback"))
            }
        }
        .filter(|_| self.client.honours_pushback)
        .map_or_else(
            || {
                Status::new(Code::Unavailable, "server overloaded, retry later")
                    .with_problem(problem::OVERLOADED)
            },
            // What the gate's refusal becomes (`impl From<Overloaded> for Status`).
            |Pushback { wait, retry }| {
                let status = Status::overloaded(wait);
                if retry {
                    status
                } else {
                    status.with_no_retry()
                }
            },
        );
        self.answered(akey, Err(status), false);
    }

    fn expire(&mut self, akey: Key) {
        let Some(att) = self.atts.get(akey) else {
            return;
        };
        if att.server != ServerState::Waiting {
            return;
        }
        let sent_at = att.sent_at;
        if let Some(again) = self.admission.expire(self.now, akey.pack()) {
            self.schedule(again, Kind::Expire, akey.pack());
            return;
        }
        self.totals.sojourn += (self.now - sent_at) as f64 / NANOS as f64;
        self.refuse(akey);
        self.refuse_dropped();
    }

    fn start_work(&mut self, akey: Key) {
        let now = self.now;
        let phase = self.phase(now);
        let (work, mut outcome) = match phase.downstream {
            Downstream::Latency(d) => (d.sample_nanos(&mut self.rng), WorkOutcome::Served),
            Downstream::Failing { after, .. } => (nanos(after), WorkOutcome::Failed),
        };
        let deadline_aware = self.server.deadline_aware;
        let Some(att) = self.atts.get(akey) else {
            return;
        };
        att.server = ServerState::Running;
        att.started = now;
        let mut end = now + (nanos(self.model.local) + work).max(1);
        if let Some(deadline) = att.deadline.filter(|_| deadline_aware) {
            if end > deadline {
                end = deadline.max(now + 1);
                outcome = WorkOutcome::CutOff;
            }
        }
        att.outcome = outcome;
        self.schedule(end, Kind::Done, akey.pack());
    }

    fn done(&mut self, akey: Key) {
        let now = self.now;
        let Some(att) = self.atts.get(akey) else {
            return;
        };
        let (started, outcome, sent_at) = (att.started, att.outcome, att.sent_at);
        self.admission
            .finished(Duration::from_nanos(now - started), outcome);
        self.set_in_system(-1);
        self.totals.sojourn += (now - sent_at) as f64 / NANOS as f64;
        self.totals.served += 1;
        let result = match outcome {
            WorkOutcome::Served => Ok(()),
            WorkOutcome::Failed => {
                let status = Status::new(Code::Unavailable, "downstream unavailable");
                // The pushback of the phase the call started in.
                match self.phase(started).downstream {
                    Downstream::Failing {
                        pushback: Some(wait),
                        ..
                    } if self.client.honours_pushback => Err(status.with_pushback(wait)),
                    _ => Err(status),
                }
            }
            WorkOutcome::CutOff => Err(Status::new(
                Code::DeadlineExceeded,
                "the server gave up at the deadline",
            )),
        };
        self.answered(akey, result, true);
        while let Some(next) = self.admission.next(now) {
            self.start_work(Key::unpack(next));
        }
        self.refuse_dropped();
    }

    fn phase(&self, t: u64) -> &Phase {
        let at = Duration::from_nanos(t);
        self.model
            .phases
            .iter()
            .rev()
            .find(|p| p.from <= at)
            .unwrap_or(&self.model.phases[0])
    }

    /// Closes interval `i`: the gauges at its end and its latency percentile.
    fn tick(&mut self, i: usize) {
        let storm = self
            .storm
            .as_ref()
            .map(|s| s.level_at(self.at(self.now)).as_str());
        let p99 = p99(&mut self.latencies);
        self.latencies.clear();
        let row = &mut self.rows[i];
        row.queue = self.admission.queue_len() as u64;
        row.inflight = self.admission.inflight() as u64;
        row.limit = self.admission.limit() as u64;
        row.p99_ms = p99;
        row.storm = storm.unwrap_or("off");
        self.totals.peak_queue = self.totals.peak_queue.max(row.queue);
    }
}

/// The nearest-rank p99 of `values` (0 when empty).
fn p99(values: &mut [u32]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let rank = ((values.len() as f64 * 0.99).ceil() as usize).clamp(1, values.len());
    let (_, v, _) = values.select_nth_unstable(rank - 1);
    f64::from(*v)
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
