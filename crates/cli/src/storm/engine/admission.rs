//! The server's admission step: which arriving attempts run, wait or are refused, and what
//! a refusal's pushback says.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use backstop::admission::{AdmissionQueue, Limit, Pushback, QueueConfig, Ticket};
use tokio::time::Instant;

use super::{ServerConfig, nanos};

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
    max_queue: Option<usize>,
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
            max_queue: config.max_queue,
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
        if self.max_queue.is_some_and(|max| self.waiting >= max) {
            return Arrive::Refuse;
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

/// The one tenant of the simulated clients.
const TENANT: &str = "default";

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
            self.queue.admitted_directly(at, TENANT);
            self.inflight += 1;
            return Arrive::Run;
        }
        // No deadline known: the request may wait as long as the queue lets anyone wait.
        let deadline = deadline.map_or(at + Duration::from_secs(3_600), |d| self.at(d));
        let pushed = self.queue.push(at, TENANT, deadline, 1, key);
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
        self.queue.release(TENANT);
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
