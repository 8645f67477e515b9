//! The admission queue of the [`Gate`](super::Gate): see [`AdmissionQueue`].

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::observe::reject_reason;

/// How waiters are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Discipline {
    /// Per-tenant sub-queues in turn, sojourn drops and adaptive LIFO (the default).
    #[default]
    Fair,
    /// One first-come-first-served line, each waiter bounded only by its deadline.
    Fifo,
}

impl Discipline {
    /// `fair` or `fifo`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Discipline::Fair => "fair",
            Discipline::Fifo => "fifo",
        }
    }
}

impl fmt::Display for Discipline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A queue discipline other than `fair` or `fifo`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown queue discipline {0:?}: expected `fair` or `fifo`")]
pub struct UnknownDiscipline(pub String);

impl std::str::FromStr for Discipline {
    type Err = UnknownDiscipline;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fair" => Ok(Discipline::Fair),
            "fifo" => Ok(Discipline::Fifo),
            other => Err(UnknownDiscipline(other.to_owned())),
        }
    }
}

/// Why a waiter was refused or dropped; each is a `reason` label of
/// `rpc_server_rejected_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The queue is at its bound by count or by memory.
    Full,
    /// The waiter's tenant holds more than its share of the queue.
    TenantShare,
    /// The time left cannot cover the expected service time.
    Deadline,
    /// Waited longer than the queue allows (its target while overloaded, else its interval).
    Sojourn,
    /// A retry refused before first attempts: the gate had no free slot while its queue was
    /// half full or the gate was shedding under sustained overload (see
    /// [`Gate::enter_retry_as`](super::Gate::enter_retry_as)).
    Retry,
}

impl DropReason {
    /// The metric label: `full`, `tenant_share`, `deadline`, `sojourn` or `retry`.
    pub const fn as_str(self) -> &'static str {
        match self {
            DropReason::Full => reject_reason::FULL,
            DropReason::TenantShare => reject_reason::TENANT_SHARE,
            DropReason::Deadline => reject_reason::DEADLINE,
            DropReason::Sojourn => reject_reason::SOJOURN,
            DropReason::Retry => reject_reason::RETRY,
        }
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Settings of an [`AdmissionQueue`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConfig {
    /// Fair (the default) or FIFO.
    pub discipline: Discipline,
    /// Most waiters at once.
    pub max_waiters: usize,
    /// Most declared cost (bytes) of the waiters at once.
    pub max_bytes: usize,
    /// Queueing delay a standing queue may not exceed (CoDel's target).
    pub target: Duration,
    /// Window over which the least queueing delay is measured, and the longest wait when the
    /// queue is not overloaded; stretched to twice the target in effect when that is longer.
    pub interval: Duration,
    /// Least time serving a request takes; waiting may not eat into it.
    pub min_service: Duration,
    /// Overloaded this long without a break counts as shedding hard: refused clients are told
    /// not to retry soon.
    pub hard_shed_after: Duration,
}

impl QueueConfig {
    /// Default [`QueueConfig::max_waiters`].
    pub const DEFAULT_MAX_WAITERS: usize = 1024;
    /// Default [`QueueConfig::max_bytes`]: 32 MiB.
    pub const DEFAULT_MAX_BYTES: usize = 32 << 20;
    /// Default [`QueueConfig::target`].
    pub const DEFAULT_TARGET: Duration = Duration::from_millis(5);
    /// Default [`QueueConfig::interval`].
    pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(100);
    /// Default [`QueueConfig::hard_shed_after`].
    pub const DEFAULT_HARD_SHED_AFTER: Duration = Duration::from_secs(2);
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            discipline: Discipline::Fair,
            max_waiters: Self::DEFAULT_MAX_WAITERS,
            max_bytes: Self::DEFAULT_MAX_BYTES,
            target: Self::DEFAULT_TARGET,
            interval: Self::DEFAULT_INTERVAL,
            min_service: Duration::from_millis(20),
            hard_shed_after: Self::DEFAULT_HARD_SHED_AFTER,
        }
    }
}

/// Identifies a waiter for [`AdmissionQueue::remove`] and [`AdmissionQueue::check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(u64);

/// A waiter refused at enqueue, with its item handed back.
#[derive(Debug)]
pub struct Refused<T> {
    /// Why.
    pub reason: DropReason,
    /// The item that was offered.
    pub item: T,
}

/// A waiter chosen to be served.
#[derive(Debug)]
pub struct Admitted<T> {
    /// Its item.
    pub item: T,
    /// How long it waited.
    pub sojourn: Duration,
    /// Its tenant (its line's, under [`Discipline::Fifo`]): hand it to
    /// [`AdmissionQueue::release`] once the request is served.
    pub tenant: Arc<str>,
}

/// What to tell a refused client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pushback {
    /// How long to wait before trying again.
    pub wait: Duration,
    /// `false` while the server sheds hard: do not retry this request at all.
    pub retry: bool,
}

/// Shortest wait advised: a refusal is not an invitation to come back at once.
const MIN_PUSHBACK: Duration = Duration::from_millis(100);
/// Longest wait advised while the server is not shedding hard.
const MAX_PUSHBACK: Duration = Duration::from_secs(10);
/// Jitter spreads retries over at least this much, so whole-second `Retry-After` values
/// differ too.
const JITTER_SPAN: Duration = Duration::from_secs(1);
/// Wait advised while shedding hard (before jitter, which adds up to as much again).
const HARD_SHED_PUSHBACK: Duration = Duration::from_secs(30);
/// Weight of a new service time in the smoothed average (about the last 20).
const SERVICE_ALPHA: f64 = 0.1;

#[derive(Debug)]
struct Entry<T> {
    tenant: Arc<str>,
    enqueued: Instant,
    /// The overload episode (its start) during which the door let this waiter in: its turn was
    /// then expected within the target, so it is not dropped at the target.
    vetted: Option<Instant>,
    deadline: Instant,
    cost: usize,
    item: T,
}

/// One tenant's line: tickets in arrival order. Tickets removed out of order stay behind as
/// tombstones and are skipped when reached; `live` counts the others. `running` counts the
/// tenant's requests being served (admitted and not yet released).
#[derive(Debug, Default)]
struct Line {
    tickets: VecDeque<u64>,
    live: usize,
    running: usize,
}

impl Line {
    /// The tenant's requests served and waiting.
    fn usage(&self) -> usize {
        self.live + self.running
    }
}

/// Lines of tenants with no request served or waiting kept for their next request (so that a
/// tenant's requests do not allocate its name each time it goes idle), beyond the active ones.
const IDLE_LINES: usize = 256;

/// A bounded, fair queue that drops what cannot finish in time: who waits for a slot of the
/// [`Gate`](super::Gate), who is served next, and who is refused because waiting longer would
/// only turn overload into late failures.
///
/// This is the algorithm alone: a synchronous data structure that reads no clock.
/// Every operation takes `now`, so the gate drives it with tokio's clock and a simulator or a
/// test drives the very same code in virtual time. It holds one item per waiter (the gate's is a
/// channel to wake it) and decides:
///
/// - **bounds**: at most [`QueueConfig::max_waiters`] waiters and
///   [`QueueConfig::max_bytes`] of declared cost; beyond, [`DropReason::Full`].
/// - **deadlines**: a waiter whose time left cannot cover the expected service time is
///   never handed out ([`DropReason::Deadline`]), neither at enqueue nor at the head. The
///   expected service time is the larger of [`QueueConfig::min_service`] and a smoothed
///   average of recent service times ([`Self::on_service`]).
/// - **sojourn** (CoDel for RPC): if even the shortest queueing delay seen over the last
///   [`QueueConfig::interval`] (at least twice the target in effect) exceeded
///   [`QueueConfig::target`] (at least two expected gaps between finishing requests), a
///   standing queue exists and the queue is *overloaded*: waiters older than the target are
///   dropped ([`DropReason::Sojourn`]), until free slots find nobody waiting at least as often
///   as somebody. Otherwise a waiter may wait up to the interval.
/// - **the door**: a newcomer beyond what the slots serve within the wait allowed (the
///   interval; the target while overloaded) is refused at once ([`DropReason::Sojourn`] too)
///   instead of after waiting, so overload costs fast refusals; a newcomer let in during an
///   overload is expected to be served within the target and may wait up to the interval.
/// - **adaptive LIFO**: while overloaded and the queue still holds more than the target
///   allows (the backlog from before the overload was seen), the newest waiter is served first
///   (it is the most likely to still make its deadline); first come, first served otherwise.
/// - **fairness**: each tenant has its own sub-queue and the sub-queues are served in turn
///   (deficit round robin where every request costs one slot). A tenant may hold at most an
///   equal share of the queue among the tenants waiting ([`DropReason::TenantShare`]); when the
///   queue is full, a tenant under its share pushes out the newest waiter of the tenant with
///   the most, so a flood from one tenant cannot lock the others out.
/// - **fair share of the slots**: the queue also counts each tenant's requests being served
///   (reported by [`Self::admitted_directly`], [`Self::pop`] and [`Self::release`]). While the
///   requests served and waiting exceed the slots, a tenant whose own fit an equal part of the
///   slots among the tenants with requests ([`Self::within_share`]) is never refused for the
///   others' load: it is let in past the door (pushing out the newest waiter of the tenant with
///   the most waiters over its share, if the door is reached) and its waiters are never dropped
///   on sojourn. Only the bounds and its own deadlines refuse it.
///
/// [`Discipline::Fifo`] turns the last four off: one first-come-first-served line whose wait is
/// bounded only by each waiter's deadline.
///
/// Waiters dropped by an operation on someone else's behalf (pushed out, found expired at the
/// head) are collected; take them with [`Self::take_dropped`] and tell them.
///
/// ```
/// use std::time::Duration;
/// use tokio::time::Instant;
/// use backstop::admission::{AdmissionQueue, DropReason, QueueConfig};
///
/// let mut queue = AdmissionQueue::new(QueueConfig::default());
/// let t0 = Instant::now();
/// let deadline = t0 + Duration::from_secs(1);
/// let a = queue.push(t0, "acme", deadline, 512, "a").unwrap();
/// queue.push(t0, "acme", deadline, 512, "b").unwrap();
/// queue.push(t0, "globex", deadline, 512, "c").unwrap();
/// assert_eq!(queue.len(), 3);
///
/// // Tenants take turns: acme, then globex, then acme again.
/// let now = t0 + Duration::from_millis(1);
/// assert_eq!(queue.pop(now).map(|w| w.item), Some("a"));
/// assert_eq!(queue.pop(now).map(|w| w.item), Some("c"));
/// assert_eq!(queue.pop(now).map(|w| w.item), Some("b"));
/// assert!(queue.remove(a).is_none(), "already served");
///
/// // Budget too short for the expected service time: refused at once.
/// let refused = queue.push(now, "acme", now + Duration::from_millis(1), 0, "d").unwrap_err();
/// assert_eq!(refused.reason, DropReason::Deadline);
/// ```
pub struct AdmissionQueue<T> {
    config: QueueConfig,
    entries: HashMap<u64, Entry<T>>,
    lines: HashMap<Arc<str>, Line>,
    /// Tenants with waiters, in serving order.
    round: VecDeque<Arc<str>>,
    next_ticket: u64,
    bytes: usize,
    /// Smoothed service time in seconds, once one was reported.
    service: Option<f64>,
    interval_start: Option<Instant>,
    /// Least queueing delay of the waiters served in the current interval.
    min_delay: Option<Duration>,
    /// Since when the queue has held at least one waiter.
    nonempty_since: Option<Instant>,
    /// Since when the queue has been overloaded without a break.
    overloaded_since: Option<Instant>,
    /// Free slots that found nobody waiting, in the current interval.
    idle: u32,
    /// Free slots given to a waiter, in the current interval.
    served: u32,
    /// Newcomers refused at the door of a standing queue, in the current interval: demand a
    /// free slot would have found waiting.
    turned_away: u32,
    /// Requests served at once (the gate's limit), to scale the target and share the slots.
    slots: usize,
    /// Tenants with requests served or waiting.
    active: usize,
    /// Requests served now, of every tenant.
    running: usize,
    dropped: Vec<(T, DropReason)>,
}

impl<T> fmt::Debug for AdmissionQueue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdmissionQueue")
            .field("config", &self.config)
            .field("len", &self.entries.len())
            .field("bytes", &self.bytes)
            .field("tenants", &self.round.len())
            .field("overloaded_since", &self.overloaded_since)
            .finish_non_exhaustive()
    }
}

/// The single line of [`Discipline::Fifo`].
const FIFO_LINE: &str = "";

impl<T> AdmissionQueue<T> {
    /// An empty queue (bounds of zero are raised to one).
    pub fn new(mut config: QueueConfig) -> Self {
        config.max_waiters = config.max_waiters.max(1);
        config.max_bytes = config.max_bytes.max(1);
        config.interval = config.interval.max(Duration::from_millis(1));
        Self {
            config,
            entries: HashMap::new(),
            lines: HashMap::new(),
            round: VecDeque::new(),
            next_ticket: 0,
            bytes: 0,
            service: None,
            interval_start: None,
            min_delay: None,
            nonempty_since: None,
            overloaded_since: None,
            idle: 0,
            served: 0,
            turned_away: 0,
            slots: 1,
            active: 0,
            running: 0,
            dropped: Vec::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// Waiters now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Declared cost of the waiters now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Waiters of `tenant` now.
    pub fn tenant_len(&self, tenant: &str) -> usize {
        self.lines.get(self.line_key(tenant)).map_or(0, |l| l.live)
    }

    /// Whether a standing queue exists (as of the last operation): waiters are dropped past the
    /// target and served newest first.
    pub fn is_overloaded(&self) -> bool {
        self.overloaded_since.is_some()
    }

    /// The service time a waiter's time left must still cover: the larger of the configured
    /// minimum and the smoothed recent service time.
    pub fn expected_service(&self) -> Duration {
        let recent = self
            .service
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .unwrap_or_default();
        recent.max(self.config.min_service)
    }

    /// Reports how long a request served took, to learn the expected service time.
    pub fn on_service(&mut self, took: Duration) {
        let took = took.as_secs_f64();
        self.service = Some(match self.service {
            Some(s) => s + SERVICE_ALPHA * (took - s),
            None => took,
        });
    }

    /// Reports a request of `tenant` admitted without waiting (the queue was empty and a slot
    /// free): a queueing delay of zero, evidence that no standing queue exists. Returns the
    /// tenant to hand to [`release`](Self::release) once it is served.
    pub fn admitted_directly(&mut self, now: Instant, tenant: &str) -> Arc<str> {
        self.tick(now);
        self.sample(Duration::ZERO);
        self.idle += 1;
        let tenant = self.line(self.line_key(tenant));
        self.count(&tenant, |l| l.running += 1);
        tenant
    }

    /// Reports that a request of `tenant` (as [`admitted_directly`](Self::admitted_directly)
    /// or [`pop`](Self::pop) gave it) is no longer served.
    pub fn release(&mut self, tenant: &str) {
        if self.lines.get(tenant).is_some_and(|l| l.running > 0) {
            self.count(tenant, |l| l.running -= 1);
        }
    }

    /// Whether one more request of `tenant`, with its requests served and waiting, fits an
    /// equal part of the slots among the tenants with requests (`tenant`'s included). Such a
    /// tenant is never refused for the others' load; one that does not fit is *over its share*,
    /// and pays first for an overload.
    pub fn within_share(&self, tenant: &str) -> bool {
        let key = self.line_key(tenant);
        let usage = self.lines.get(key).map_or(0, Line::usage);
        let active = self.active + usize::from(usage == 0);
        (usage + 1).saturating_mul(active) <= self.slots
    }

    /// Enqueues a waiter of `tenant` whose deadline is `deadline`, declaring `cost` bytes.
    /// Refused with the item handed back when it cannot be served in time, the queue is full
    /// or the tenant holds its share. Waiters pushed out to make room are collected for
    /// [`take_dropped`](Self::take_dropped).
    pub fn push(
        &mut self,
        now: Instant,
        tenant: &str,
        deadline: Instant,
        cost: usize,
        item: T,
    ) -> Result<Ticket, Refused<T>> {
        self.tick(now);
        let refuse = |reason, item| Err(Refused { reason, item });
        // Exactly enough budget leaves none for waiting: refused too.
        if deadline.saturating_duration_since(now) <= self.expected_service() {
            return refuse(DropReason::Deadline, item);
        }
        if cost > self.config.max_bytes {
            return refuse(DropReason::Full, item);
        }
        let key = self.line_key(tenant);
        let fair = self.config.discipline == Discipline::Fair;
        let mine = self.lines.get(key).map_or(0, |l| l.live);
        let share = self.share(key);
        if fair && mine >= share {
            return refuse(DropReason::TenantShare, item);
        }
        let protected = fair && self.protected(key, 1);
        // A newcomer beyond what the slots can serve within the wait the queue allows (the
        // interval, or the target once a standing queue is known) would only wait to be dropped
        // on sojourn: it is refused at the door, at once, instead of after waiting.
        let cap = if fair {
            let allowed = if self.is_overloaded() {
                self.target()
            } else {
                self.interval()
            };
            self.served_within(allowed).min(self.config.max_waiters)
        } else {
            self.config.max_waiters
        };
        let cap_share = (cap / self.tenants_with(key)).max(1);
        let active = self.active + usize::from(self.lines.get(key).is_none_or(|l| l.usage() == 0));
        // Whether the requests served and waiting, the newcomer's included, exceed the slots:
        // then a tenant within its share of them is never pushed out for another.
        let contended = self.running + self.entries.len() + 1 > self.slots;
        while self.entries.len() >= cap || self.bytes + cost > self.config.max_bytes {
            // Room is made only at the expense of the tenant with the most waiters, if it is
            // over its share of the slots (under contention) and holds more than its share of
            // the queue (unless the newcomer is protected).
            let victim = fair
                .then(|| {
                    self.lines
                        .iter()
                        .filter(|(t, l)| {
                            &***t != key
                                && l.live > 0
                                && (!contended || l.usage().saturating_mul(active) > self.slots)
                                && (protected || l.live > cap_share)
                        })
                        .max_by_key(|(_, l)| l.live)
                        .map(|(t, _)| Arc::clone(t))
                })
                .flatten();
            let full = self.entries.len() >= self.config.max_waiters
                || self.bytes + cost > self.config.max_bytes;
            let Some(victim) = victim else {
                // A tenant within its share waits past the door: its turn comes within a
                // round of the tenants waiting, whatever the others' load.
                if protected && !full {
                    break;
                }
                let reason = if full {
                    DropReason::Full
                } else {
                    self.turned_away = self.turned_away.saturating_add(1);
                    DropReason::Sojourn
                };
                return refuse(reason, item);
            };
            // The newest: the one that waited least for nothing.
            if let Some(entry) = self.take_from(&victim, true) {
                self.dropped.push((entry.item, DropReason::TenantShare));
            }
        }

        let vetted = if fair { self.overloaded_since } else { None };
        let tenant = self.line(key);
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.count(&tenant, |l| {
            l.live += 1;
            l.tickets.push_back(ticket);
        });
        if self.tenant_len(&tenant) == 1 {
            self.round.push_back(Arc::clone(&tenant));
        }
        if self.entries.is_empty() {
            self.nonempty_since = Some(now);
        }
        self.bytes += cost;
        self.entries.insert(
            ticket,
            Entry {
                tenant,
                enqueued: now,
                vetted,
                deadline,
                cost,
                item,
            },
        );
        Ok(Ticket(ticket))
    }

    /// Chooses the next waiter to serve: tenants in turn, newest first while a standing queue
    /// holds more than the target allows. Waiters found unable to make their deadline, or past
    /// their sojourn, are dropped on the way and collected for
    /// [`take_dropped`](Self::take_dropped).
    pub fn pop(&mut self, now: Instant) -> Option<Admitted<T>> {
        self.tick(now);
        // Once the door keeps the queue within the target, first come is first served again:
        // newest first would starve the oldest of so short a line until the target drops it,
        // turning a refusal at the door into a late one.
        let lifo = self.is_overloaded()
            && self.config.discipline == Discipline::Fair
            && self.entries.len() > self.served_within_target();
        if self.round.is_empty() {
            // A free slot and nobody waiting: capacity exceeds demand. (Finding only waiters
            // too old to serve is no such evidence.)
            self.idle += 1;
            return None;
        }
        loop {
            let tenant = self.round.front().cloned()?;
            let entry = self.take_from(&tenant, lifo)?;
            // Served in turn: this tenant goes to the back of the round (if still waiting).
            if self.round.front() == Some(&tenant) {
                self.round.rotate_left(1);
            }
            if let Some(reason) = self.verdict(&entry, now, false) {
                self.dropped.push((entry.item, reason));
                continue;
            }
            let sojourn = now.saturating_duration_since(entry.enqueued);
            self.sample(sojourn);
            self.served += 1;
            self.count(&tenant, |l| l.running += 1);
            return Some(Admitted {
                item: entry.item,
                sojourn,
                tenant,
            });
        }
    }

    /// Removes a waiter that gave up; `None` if it is no longer queued.
    pub fn remove(&mut self, ticket: Ticket) -> Option<T> {
        let entry = self.entries.remove(&ticket.0)?;
        self.left(&entry);
        Some(entry.item)
    }

    /// Decides whether a waiter must leave now (its deadline, or its sojourn): then it is
    /// removed and returned with the reason. `None` while it may keep waiting, or when it is no
    /// longer queued.
    pub fn check(&mut self, ticket: Ticket, now: Instant) -> Option<(T, DropReason)> {
        self.tick(now);
        let reason = self.verdict(self.entries.get(&ticket.0)?, now, true)?;
        self.remove(ticket).map(|item| (item, reason))
    }

    /// When [`check`](Self::check) should next look at a waiter: the soonest instant its fate
    /// may change (sooner if the queue's state changes). `None` when it is no longer queued.
    pub fn next_check(&self, ticket: Ticket, now: Instant) -> Option<Instant> {
        let entry = self.entries.get(&ticket.0)?;
        let mut at = entry
            .deadline
            .checked_sub(self.expected_service())
            .unwrap_or(now);
        if self.config.discipline == Discipline::Fair {
            at = at.min(entry.enqueued + self.interval());
            let target = entry.enqueued + self.target();
            if self.is_vetted(entry) {
                // Waits up to the interval unless the overload ends first (the interval's
                // end decides that).
                if let Some(start) = self.interval_start {
                    at = at.min((start + self.interval()).max(now));
                }
            } else if target > now {
                at = at.min(target);
            } else if !self.is_overloaded() {
                // Past the target: it matters again when the next interval decides overload.
                if let Some(start) = self.interval_start {
                    at = at.min((start + self.interval()).max(now));
                }
            }
        }
        Some(at.max(now))
    }

    /// Waiters dropped by [`push`](Self::push) or [`pop`](Self::pop) on someone else's behalf,
    /// with the reason: tell them.
    pub fn take_dropped(&mut self) -> Vec<(T, DropReason)> {
        std::mem::take(&mut self.dropped)
    }

    /// What to tell a client refused now, given the concurrency `limit`: the time for the
    /// queue ahead to drain (waiters x expected service time / limit) within 100 ms to 10 s,
    /// plus jitter of up to as much again (at least a second's worth) so refused clients do
    /// not return in lockstep. While the queue has been overloaded for
    /// [`QueueConfig::hard_shed_after`], the advice is not to retry, with a wait of 30 to 60 s
    /// for clients that retry anyway. `unit` is a random number in `[0, 1)`, passed in so the
    /// queue stays deterministic.
    pub fn pushback(&mut self, now: Instant, limit: usize, unit: f64) -> Pushback {
        self.tick(now);
        let unit = if unit.is_finite() {
            unit.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let hard = self.overloaded_since.is_some_and(|since| {
            now.saturating_duration_since(since) >= self.config.hard_shed_after
        });
        if hard {
            return Pushback {
                wait: HARD_SHED_PUSHBACK + HARD_SHED_PUSHBACK.mul_f64(unit),
                retry: false,
            };
        }
        let ahead = u32::try_from(self.entries.len() + 1).unwrap_or(u32::MAX);
        let limit = u32::try_from(limit.max(1)).unwrap_or(u32::MAX);
        let drain = self
            .expected_service()
            .saturating_mul(ahead)
            .checked_div(limit)
            .unwrap_or(MAX_PUSHBACK)
            .clamp(MIN_PUSHBACK, MAX_PUSHBACK);
        Pushback {
            wait: drain + drain.max(JITTER_SPAN).mul_f64(unit),
            retry: true,
        }
    }

    /// Tells the queue how many requests are served at once (the gate's limit), which scales
    /// the target: a waiter in a healthy queue waits for the next of `slots` requests to
    /// finish.
    pub fn set_slots(&mut self, slots: usize) {
        self.slots = slots.max(1);
    }

    /// The target in effect: the configured one, or two expected gaps between finishing
    /// requests (expected service time / slots) if longer. A shorter one would drop waiters of
    /// a queue that is merely waiting its turn, and empty it so often that a standing queue
    /// could no longer be told from spare capacity.
    pub fn target(&self) -> Duration {
        let gap = self
            .expected_service()
            .checked_div(u32::try_from(self.slots).unwrap_or(u32::MAX))
            .unwrap_or_default();
        self.config.target.max(gap.saturating_mul(2))
    }

    /// The interval in effect: the configured one, or twice the [target](Self::target) if
    /// longer. With few slots and slow service, a window of a few gaps between finishing
    /// requests is needed to tell a standing queue from requests waiting their turn.
    pub fn interval(&self) -> Duration {
        self.config.interval.max(self.target().saturating_mul(2))
    }

    fn line_key<'a>(&self, tenant: &'a str) -> &'a str {
        match self.config.discipline {
            Discipline::Fair => tenant,
            Discipline::Fifo => FIFO_LINE,
        }
    }

    /// The most waiters one tenant may hold: an equal part of the queue among the tenants
    /// waiting, `key`'s included.
    fn share(&self, key: &str) -> usize {
        (self.config.max_waiters / self.tenants_with(key)).max(1)
    }

    /// The tenants waiting, `key`'s included (at least 1).
    fn tenants_with(&self, key: &str) -> usize {
        (self.round.len() + usize::from(self.tenant_len(key) == 0)).max(1)
    }

    /// Whether `more` requests of `key`'s line are protected from the others' load: the
    /// requests served and waiting, `more` included, take every slot (someone pays for an
    /// overload) while `key`'s fit an equal part of them. (A waiter handed the slot just freed
    /// is protected even if it was the last one waiting.)
    fn protected(&self, key: &str, more: usize) -> bool {
        let usage = self.lines.get(key).map_or(0, Line::usage) + more;
        let active = self.active + usize::from(usage == more && more > 0);
        self.running + self.entries.len() + more >= self.slots
            && usage.saturating_mul(active) <= self.slots
    }

    /// The line of `key`, made if it has none. Idle lines are kept for their tenant's next
    /// request, up to [`IDLE_LINES`] beyond the active ones.
    fn line(&mut self, key: &str) -> Arc<str> {
        if let Some((tenant, _)) = self.lines.get_key_value(key) {
            return Arc::clone(tenant);
        }
        if self.lines.len() >= self.active + IDLE_LINES {
            self.lines.retain(|_, l| l.usage() > 0);
        }
        let tenant: Arc<str> = Arc::from(key);
        self.lines.insert(Arc::clone(&tenant), Line::default());
        tenant
    }

    /// Changes the counts of `tenant`'s line (which exists), keeping the active tenants.
    fn count(&mut self, tenant: &str, change: impl FnOnce(&mut Line)) {
        let Some(line) = self.lines.get_mut(tenant) else {
            return;
        };
        let (usage, running) = (line.usage(), line.running);
        change(line);
        if line.live == 0 {
            // Only tombstones left.
            line.tickets.clear();
        }
        self.running = self.running + line.running - running;
        match (usage, line.usage()) {
            (0, 1..) => self.active += 1,
            (1.., 0) => self.active -= 1,
            _ => {}
        }
    }

    /// Accounts for `entry` leaving the queue (its ticket already out of `entries`).
    fn left(&mut self, entry: &Entry<T>) {
        self.bytes -= entry.cost;
        self.count(&entry.tenant, |l| l.live -= 1);
        if self.tenant_len(&entry.tenant) == 0 {
            self.round.retain(|t| *t != entry.tenant);
        }
        if self.entries.is_empty() {
            self.nonempty_since = None;
        }
    }

    /// How many waiters the slots can serve within the [target](Self::target).
    fn served_within_target(&self) -> usize {
        self.served_within(self.target())
    }

    /// How many waiters the slots can serve within `wait`: `wait` over the expected gap between
    /// finishing requests, rounded up (at least 1).
    fn served_within(&self, wait: Duration) -> usize {
        let gap = self
            .expected_service()
            .checked_div(u32::try_from(self.slots).unwrap_or(u32::MAX))
            .unwrap_or_default();
        if gap.is_zero() {
            return self.config.max_waiters;
        }
        let n = wait.as_nanos().div_ceil(gap.as_nanos());
        usize::try_from(n).unwrap_or(usize::MAX).max(1)
    }

    /// Whether `entry` must leave now, and why; `queued` if it is still counted in its line.
    fn verdict(&self, entry: &Entry<T>, now: Instant, queued: bool) -> Option<DropReason> {
        if entry.deadline.saturating_duration_since(now) <= self.expected_service() {
            return Some(DropReason::Deadline);
        }
        // A tenant within its share is not dropped for the standing queue others made.
        if self.config.discipline == Discipline::Fifo
            || self.protected(&entry.tenant, usize::from(!queued))
        {
            return None;
        }
        let age = now.saturating_duration_since(entry.enqueued);
        let limit = if self.is_overloaded() && !self.is_vetted(entry) {
            self.target()
        } else {
            self.interval()
        };
        (age >= limit).then_some(DropReason::Sojourn)
    }

    /// Whether the door let `entry` in during the current overload: its turn was expected
    /// within the target, so it may wait up to the interval like any waiter of a healthy queue.
    fn is_vetted(&self, entry: &Entry<T>) -> bool {
        entry.vetted.is_some() && entry.vetted == self.overloaded_since
    }

    /// Takes the oldest (or newest) waiter of `tenant` out of the queue.
    fn take_from(&mut self, tenant: &Arc<str>, newest: bool) -> Option<Entry<T>> {
        let line = self.lines.get_mut(tenant)?;
        let entry = loop {
            let ticket = if newest {
                line.tickets.pop_back()
            } else {
                line.tickets.pop_front()
            }?;
            if let Some(entry) = self.entries.remove(&ticket) {
                break entry;
            }
        };
        self.left(&entry);
        Some(entry)
    }

    fn sample(&mut self, delay: Duration) {
        self.min_delay = Some(self.min_delay.map_or(delay, |d| d.min(delay)));
    }

    /// Closes the measuring interval once it has run out and decides whether the queue is
    /// overloaded: the least delay served in it exceeded the target, or, with nobody served,
    /// the queue never emptied during it. Once overloaded, the queue stays so until, over an
    /// interval, free slots find nobody waiting at least as often as somebody.
    fn tick(&mut self, now: Instant) {
        if self.config.discipline == Discipline::Fifo {
            return;
        }
        let Some(start) = self.interval_start else {
            self.interval_start = Some(now);
            return;
        };
        let end = start + self.interval();
        if now < end {
            return;
        }
        let min_delay = self.min_delay.take();
        let idle = std::mem::take(&mut self.idle);
        let served = std::mem::take(&mut self.served);
        let turned_away = std::mem::take(&mut self.turned_away);
        let standing = if self.is_overloaded() {
            // Served newest first with the old dropped, the delays seen stay short however
            // much demand exceeds capacity; what ends the overload is free slots finding nobody
            // waiting more often than somebody. Those turned away at the door count as
            // somebody: the queue was kept short, not found empty.
            served.saturating_add(turned_away) > idle
                || (served == 0
                    && idle == 0
                    && self.nonempty_since.is_some_and(|since| since <= start))
        } else {
            match min_delay {
                Some(delay) => delay > self.target(),
                None => self.nonempty_since.is_some_and(|since| since <= start),
            }
        };
        if standing {
            self.overloaded_since.get_or_insert(end);
        } else {
            self.overloaded_since = None;
        }
        self.interval_start = Some(now);
    }
}

#[cfg(test)]
mod tests;
