//! The event loop: one heap of virtual-time events, the requests and attempts they name, and
//! the series each interval closes. What the clients do on an event is in `client`, what the
//! server does in `server`.

mod client;
mod server;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use backstop::hedge::{HedgePolicy, LatencyWindow};
use backstop::retry::{
    AdaptiveThrottle, Attempts, CallInfo, RetryBudget, RetryPolicy, RetrySpend, StormAlarm,
    StormConfig,
};
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::time::Instant;

use super::admission::{Admission, WorkOutcome};
use super::slab::{Key, Slab};
use super::{ClientConfig, Model, NANOS, Run, ServerConfig, nanos};
use crate::storm::dist::exponential_nanos;
use crate::storm::series::{Row, Totals};

/// What an event does, kept in the top byte of its payload.
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

/// One run's state: the clock, the pending events, the clients' policies, the requests in
/// flight and the series being filled.
pub(super) struct Sim<'a> {
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
    /// Server-side times (ms, a worker's start to its answer) of the current interval: what
    /// the server's own latency metric shows.
    service: Vec<u32>,
    /// A cold downstream's recent successes (decayed to `heat_at`) and its fading time, if the
    /// model has one.
    heat: f64,
    heat_at: u64,
    cold_tau: Option<f64>,
}

impl<'a> Sim<'a> {
    pub(super) fn new(
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
        let spend = RetrySpend::new(budget)
            .storm_alarm(storm)
            .throttle(throttle);
        let policy = RetryPolicy::builder("sim", "call")
            .max_attempts(client.max_attempts)
            .backoff(client.backoff)
            .spend(spend.clone())
            // Calls carry an idempotency key, so an attempt that timed out may be sent again.
            .keyed(true)
            .build()
            .expect("attempts checked by the scenario");
        let hedges = client.hedge_quantile.is_some() || client.hedge_delay.is_some();
        let hedge = hedges.then(|| {
            HedgePolicy::new(spend, "sim", "call")
                .quantile(client.hedge_quantile.unwrap_or(0.95))
                .fixed_delay(client.hedge_delay)
                .latencies(Arc::new(LatencyWindow::new(
                    HedgePolicy::WINDOW,
                    HedgePolicy::MIN_SAMPLES,
                )))
        });
        let cold = model.phases.iter().find_map(|p| match p.downstream {
            super::Downstream::Cold(c) => Some(c),
            _ => None,
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
            service: Vec::new(),
            // Warm at the start: twice what makes it fully warm.
            heat: cold.map_or(0.0, |c| 2.0 * c.warm_after),
            heat_at: 0,
            cold_tau: cold.map(|c| c.tau.as_secs_f64()),
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

    pub(super) fn run(mut self) -> Run {
        self.next_arrival();
        for i in 1..=self.rows.len() as u64 {
            self.schedule((i * self.interval).min(self.end), Kind::Tick, i - 1);
        }
        while let Some((t, _, payload)) = self.pop() {
            self.now = t;
            let kind = Kind::from_u8((payload >> 56) as u8);
            let key = Key::unpack(payload & ((1 << 56) - 1));
            match kind {
                // Payload 1: no request, the rate changed: draw the next arrival at the new one.
                Kind::Arrival if payload & 1 == 1 => self.next_arrival(),
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

    /// The arrival rate at `t`, and when it next changes.
    fn rate_at(&self, t: u64) -> (f64, Option<u64>) {
        let mut factor = 1.0;
        for &(from, f) in &self.model.load {
            let from = nanos(from);
            if from > t {
                return (self.model.rate * factor, Some(from));
            }
            factor = f;
        }
        (self.model.rate * factor, None)
    }

    /// Schedules the next arrival from now. Where the rate changes before it, a redraw at the
    /// change instead: exact for Poisson arrivals, which have no memory.
    fn next_arrival(&mut self) {
        let (rate, change) = self.rate_at(self.now);
        let next = (rate > 0.0).then(|| self.now + exponential_nanos(&mut self.rng, rate).max(1));
        match (next, change) {
            (Some(next), Some(change)) if change <= next => {
                self.schedule(change, Kind::Arrival, 1);
            }
            (None, Some(change)) => self.schedule(change, Kind::Arrival, 1),
            (Some(next), _) => self.schedule(next, Kind::Arrival, 0),
            (None, None) => {}
        }
    }

    /// A cold downstream's warmth now, in `[0, 1]`.
    fn warmth(&mut self, cold: &super::model::Cold) -> f64 {
        self.decay_heat();
        (self.heat / cold.warm_after).min(1.0)
    }

    fn decay_heat(&mut self) {
        if let Some(tau) = self.cold_tau {
            let dt = (self.now - self.heat_at) as f64 / NANOS as f64;
            self.heat *= (-dt / tau).exp();
            self.heat_at = self.now;
        }
    }

    fn set_in_system(&mut self, delta: i64) {
        self.area += self.in_system as f64 * (self.now - self.last_change) as f64;
        self.last_change = self.now;
        self.in_system = self.in_system.saturating_add_signed(delta);
    }

    /// Closes interval `i`: the gauges at its end and its latency percentile.
    fn tick(&mut self, i: usize) {
        let storm = self
            .policy
            .spend()
            .storm()
            .map(|s| s.level_at(self.at(self.now)).as_str());
        let service_p99 = p99(&mut self.service);
        self.service.clear();
        let p99 = p99(&mut self.latencies);
        self.latencies.clear();
        let row = &mut self.rows[i];
        row.queue = self.admission.queue_len() as u64;
        row.inflight = self.admission.inflight() as u64;
        row.limit = self.admission.limit() as u64;
        row.p99_ms = p99;
        row.service_p99_ms = service_p99;
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
