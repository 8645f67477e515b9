//! Retry amplification across hops (the chapter's opening: layers of retries multiply). A user
//! request goes edge -> A -> B -> C; each of the three callers has a client, and C fails. With
//! 3 attempts at every layer C sees up to 3 x 3 x 3 = 27 attempts per user request.
//!
//! The hops need an engine of their own (the main one has one client and one server): virtual
//! time in nanoseconds, one heap of events, one seeded generator, and the library's retry
//! bookkeeping (`Attempts` with its budget, backoff and storm alarm) at every hop.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use backstop::deadline::Deadline;
use backstop::retry::{
    Attempts, Backoff, CallInfo, Jitter, RetryBudget, RetryPolicy, RetrySpend, StormAlarm,
    StormConfig,
};
use backstop::status::{Code, Status};
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::time::Instant;

use crate::storm::dist::exponential_nanos;
use crate::storm::kind::ScenarioKind;
use crate::storm::scenario::Knobs;
use crate::storm::series::{self, Focus, Row, Totals};
use crate::storm::{Report, SimError, VariantRun};

const NANOS: u64 = 1_000_000_000;
/// Callers in the chain: the edge's client, A's and B's. C, the deepest hop, only answers.
const LAYERS: usize = 3;
/// The deepest hop fails from here on.
const FAIL_FROM: f64 = 10.0;
/// Each hop's own work before it calls the next.
const LOCAL: u64 = 1_000_000;
/// How long the deepest hop takes to answer (or to fail).
const DEEPEST: u64 = 5_000_000;

/// The most user requests one run may simulate.
const MAX_REQUESTS: f64 = 2_000_000.0;

/// How every hop's client retries: 3 attempts in every case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kind {
    /// The library's backoff (full jitter) and a 0.1 retry budget with 20 of burst; else
    /// retried at once without a budget.
    budget: bool,
    /// The library's storm alarm at every hop.
    alarm: bool,
    /// Retry at one layer: a call made on behalf of a request that arrived as a retry (or on
    /// behalf of one) is made once, and says so to the next hop; and a hop whose own call
    /// below failed answers "do not retry" (gRPC's pushback), so the layer nearest the
    /// failure is the one that retries.
    one_layer: bool,
}

const VARIANTS: [(&str, Kind); 5] = [
    (
        "naive",
        Kind {
            budget: false,
            alarm: false,
            one_layer: false,
        },
    ),
    (
        "budget-every-hop",
        Kind {
            budget: true,
            alarm: false,
            one_layer: false,
        },
    ),
    (
        "budget-one-layer",
        Kind {
            budget: true,
            alarm: false,
            one_layer: true,
        },
    ),
    (
        "backstop-every-hop",
        Kind {
            budget: true,
            alarm: true,
            one_layer: false,
        },
    ),
    (
        "backstop",
        Kind {
            budget: true,
            alarm: true,
            one_layer: true,
        },
    ),
];

pub(super) fn simulate(knobs: Knobs, policy: &str) -> Result<Report, SimError> {
    let name = ScenarioKind::Amplification.as_str();
    let selected: Vec<_> = VARIANTS
        .iter()
        .filter(|(n, _)| policy == "all" || *n == policy)
        .collect();
    if selected.is_empty() {
        return Err(SimError::UnknownPolicy {
            scenario: name,
            policy: policy.to_owned(),
            choices: VARIANTS.map(|(n, _)| n).join(", "),
        });
    }
    let rate = knobs.rate.unwrap_or(200.0) * knobs.scale;
    let duration = knobs.duration.unwrap_or(Duration::from_secs(30));
    // A naive chain makes up to 27 deepest calls and 13 calls in all per user request, each
    // a few events: beyond `MAX_REQUESTS` a run takes minutes.
    let requests = rate * duration.as_secs_f64();
    if requests > MAX_REQUESTS {
        return Err(SimError::Unfit(format!(
            "{requests:.0} user requests ({rate:.0}/s for {:.0} s) is more than an amplification run may simulate ({MAX_REQUESTS:.0}); lower --scale, --rate or --duration",
            duration.as_secs_f64()
        )));
    }
    let interval = knobs.interval;
    let runs: Vec<VariantRun> = selected
        .iter()
        .map(|&&(name, kind)| {
            let mut chain = Chain::new(kind, rate, duration, interval, knobs.seed);
            chain.run();
            chain.into_run(name)
        })
        .collect();
    let mut notes = vec![
        format!(
            "{rate:.0} user requests/s for {:.0} s, each through edge -> A -> B -> C (1 ms of work per hop, a 1 s deadline propagated); C answers in 5 ms and fails every call from {FAIL_FROM:.0} s on. Figure: attempts reaching C per user request while it fails",
            duration.as_secs_f64()
        ),
        "3 attempts at every layer in every variant. naive: retried at once, no budget: up to 3 x 3 x 3 = 27. budget-...: the library's backoff (full jitter) and a 0.1 retry budget with 20 of burst at every layer; backstop-...: and the storm alarm at every layer. ...-every-hop: each layer retries on its own; ...-one-layer and backstop: retry at one layer: a hop serving a request that arrived as a retry (or on behalf of one) calls the next hop once and marks the call so, and a hop whose call below failed answers \"do not retry\" (gRPC pushback), so only the layer nearest the failure retries. Retries shed first is not exercised: C fails fast, it is not overloaded. Worst row: the most attempts at C per user request in one row of the failure (attempts sent in the row over user requests started in it, so a row can pass 27)".to_owned(),
    ];
    notes.push(conclude(&runs));
    Ok(Report {
        scenario: name,
        seed: knobs.seed,
        scale: knobs.scale,
        duration_s: duration.as_secs_f64(),
        interval_s: interval.as_secs_f64(),
        notes,
        runs,
    })
}

fn conclude(runs: &[VariantRun]) -> String {
    let figures: Vec<String> = runs
        .iter()
        .map(|r| {
            format!(
                "{} {:.2} (worst row {:.2})",
                r.policy,
                r.summary.focus_amplification,
                worst_row(r)
            )
        })
        .collect();
    format!(
        "what the numbers show: attempts reaching the failing hop per user request: {}. Retries at every layer multiply; a budget bounds each layer's share but the shares still compound, retrying at one layer keeps them from compounding, and the storm alarm stops retries once it trips",
        figures.join(", ")
    )
}

/// The most attempts at the deepest hop per user request in one row of the failure.
fn worst_row(run: &VariantRun) -> f64 {
    run.rows
        .iter()
        .filter(|r| r.t >= FAIL_FROM - 1e-9 && r.offered_originals > 0)
        .map(|r| (r.offered_originals + r.offered_retries) as f64 / r.offered_originals as f64)
        .fold(0.0, f64::max)
}

/// A hop's client.
struct Hop {
    policy: RetryPolicy,
    /// The same with one attempt: calls made on behalf of a retry.
    once: RetryPolicy,
}

/// A call from layer `layer` to the next hop.
struct Call {
    layer: usize,
    parent: Option<usize>,
    attempts: Attempts,
    /// The deadline its attempts share, passed on to the next hop.
    deadline: Deadline,
    /// Made on behalf of a retry: one attempt, and the mark passed on.
    marked: bool,
    /// When the current attempt was sent, and the time it had.
    sent_at: u64,
    remaining: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival,
    /// Send the next attempt of a call.
    Send(usize),
    /// The current attempt of a call was answered.
    Answer(usize, Answer),
    Tick(usize),
}

/// How an attempt was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Answer {
    Ok,
    Failed,
    /// Failed, and the hop says not to retry.
    FailedNoRetry,
}

/// One run of the chain.
struct Chain {
    kind: Kind,
    rate: f64,
    end: u64,
    interval: u64,
    base: Instant,
    now: u64,
    seq: u64,
    /// Events by (time, sequence): the sequence is unique, so the event itself never decides.
    heap: BinaryHeap<Reverse<(u64, u64, Event)>>,
    rng: StdRng,
    hops: Vec<Hop>,
    alarms: Vec<StormAlarm>,
    calls: Vec<Option<Call>>,
    /// Slots of calls that ended. No event names a call after it ends (one attempt at a
    /// time, no timeouts), so a slot can be reused at once.
    free: Vec<usize>,
    info: CallInfo<'static>,
    rows: Vec<Row>,
    /// Attempts reaching the deepest hop, per row.
    deepest: Vec<u64>,
    totals: Totals,
}

impl Chain {
    fn new(kind: Kind, rate: f64, duration: Duration, interval: Duration, seed: u64) -> Self {
        let base = Instant::now();
        let mut alarms = Vec::new();
        let hops = (0..LAYERS)
            .map(|layer| {
                let service = ["edge", "a", "b"][layer];
                let builder = RetryPolicy::builder(service, "call")
                    .max_attempts(3)
                    .keyed(true);
                let (builder, budget) = if kind.budget {
                    (
                        builder.backoff(Backoff::default()),
                        RetryBudget::new(0.1, 20).expect("valid"),
                    )
                } else {
                    let tick = Duration::from_nanos(1);
                    (
                        builder.backoff(
                            Backoff::new(tick, tick, Jitter::None, Duration::ZERO).expect("valid"),
                        ),
                        RetryBudget::new(1.0, u32::MAX).expect("valid"),
                    )
                };
                let alarm = kind
                    .alarm
                    .then(|| StormAlarm::new_at(service, StormConfig::default(), base));
                alarms.extend(alarm.clone());
                let policy = builder
                    .spend(RetrySpend::new(budget).storm_alarm(alarm))
                    .build()
                    .expect("valid policy");
                Hop {
                    once: policy.single_attempt(),
                    policy,
                }
            })
            .collect();
        let interval_ns = u64::try_from(interval.as_nanos())
            .unwrap_or(u64::MAX)
            .max(1);
        let end = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let rows: Vec<Row> = (0..end.div_ceil(interval_ns))
            .map(|i| Row {
                t: (i * interval_ns) as f64 / NANOS as f64,
                storm: "off",
                ..Row::default()
            })
            .collect();
        Self {
            kind,
            rate,
            end,
            interval: interval_ns,
            base,
            now: 0,
            seq: 0,
            heap: BinaryHeap::new(),
            rng: StdRng::seed_from_u64(seed),
            hops,
            alarms,
            calls: Vec::new(),
            free: Vec::new(),
            info: CallInfo::new(),
            deepest: vec![0; rows.len()],
            rows,
            totals: Totals::default(),
        }
    }

    fn at(&self, t: u64) -> Instant {
        self.base + Duration::from_nanos(t)
    }

    fn row(&self) -> usize {
        ((self.now / self.interval) as usize).min(self.rows.len().saturating_sub(1))
    }

    fn schedule(&mut self, t: u64, event: Event) {
        if t > self.end {
            return;
        }
        self.seq += 1;
        self.heap.push(Reverse((t, self.seq, event)));
    }

    fn run(&mut self) {
        if self.rate > 0.0 {
            let first = exponential_nanos(&mut self.rng, self.rate);
            self.schedule(first, Event::Arrival);
        }
        for i in 0..self.rows.len() {
            let t = ((i as u64 + 1) * self.interval).min(self.end);
            self.schedule(t, Event::Tick(i));
        }
        while let Some(Reverse((t, _, event))) = self.heap.pop() {
            self.now = t;
            match event {
                Event::Arrival => self.arrival(),
                Event::Send(call) => self.send(call),
                Event::Answer(call, answer) => self.answer(call, answer),
                Event::Tick(i) => self.tick(i),
            }
        }
        self.totals.seconds = self.end as f64 / NANOS as f64;
    }

    fn arrival(&mut self) {
        let next = self.now + exponential_nanos(&mut self.rng, self.rate).max(1);
        self.schedule(next, Event::Arrival);
        let row = self.row();
        self.rows[row].offered_originals += 1;
        self.totals.logical += 1;
        let deadline = Deadline::at(self.at(self.now + NANOS));
        let attempts = self.hops[0].policy.attempts(deadline);
        let call = self.insert(Call {
            layer: 0,
            parent: None,
            attempts,
            deadline,
            marked: false,
            sent_at: self.now,
            remaining: Duration::ZERO,
        });
        self.send(call);
    }

    fn insert(&mut self, call: Call) -> usize {
        match self.free.pop() {
            Some(id) => {
                self.calls[id] = Some(call);
                id
            }
            None => {
                self.calls.push(Some(call));
                self.calls.len() - 1
            }
        }
    }

    fn policy(&self, call: &Call) -> &RetryPolicy {
        let hop = &self.hops[call.layer];
        if call.marked { &hop.once } else { &hop.policy }
    }

    /// Sends the next attempt of `id`: to the deepest hop, or to a hop that calls the next.
    fn send(&mut self, id: usize) {
        let now = self.at(self.now);
        let Some(mut call) = self.calls[id].take() else {
            return;
        };
        let hop = &self.hops[call.layer];
        let policy = if call.marked { &hop.once } else { &hop.policy };
        let started = call.attempts.start(policy, &self.info, now);
        let (attempt, remaining) = match started {
            Ok(ok) => ok,
            Err(_) => {
                self.calls[id] = Some(call);
                return self.finish(id, false);
            }
        };
        call.sent_at = self.now;
        call.remaining = remaining;
        let (layer, deadline) = (call.layer, call.deadline);
        let marked = self.kind.one_layer && (attempt.is_retry() || call.marked);
        self.calls[id] = Some(call);
        if layer + 1 == LAYERS {
            // An attempt reaching the deepest hop.
            let row = self.row();
            self.deepest[row] += 1;
            let answer = if (self.now as f64 / NANOS as f64) < FAIL_FROM {
                Answer::Ok
            } else {
                Answer::Failed
            };
            self.schedule(self.now + DEEPEST, Event::Answer(id, answer));
            return;
        }
        let hop = &self.hops[layer + 1];
        let policy = if marked { &hop.once } else { &hop.policy };
        let attempts = policy.attempts(deadline);
        let child = self.insert(Call {
            layer: layer + 1,
            parent: Some(id),
            attempts,
            deadline,
            marked,
            sent_at: self.now,
            remaining: Duration::ZERO,
        });
        self.schedule(self.now + LOCAL, Event::Send(child));
    }

    /// The current attempt of `id` was answered.
    fn answer(&mut self, id: usize, answer: Answer) {
        let now = self.at(self.now);
        let Some(mut call) = self.calls[id].take() else {
            return;
        };
        let elapsed = Duration::from_nanos(self.now - call.sent_at);
        let remaining = call.remaining;
        if answer == Answer::Ok {
            call.attempts
                .succeeded_at(self.policy(&call), &self.info, remaining, elapsed, now);
            self.calls[id] = Some(call);
            return self.finish(id, true);
        }
        let status = Status::new(Code::Unavailable, "the hop below failed");
        let status = if answer == Answer::FailedNoRetry {
            // What a client reads from `grpc-retry-pushback-ms: -1`: a pushback no deadline
            // fits.
            status.with_no_retry().with_pushback(Duration::MAX)
        } else {
            status
        };
        let hop = &self.hops[call.layer];
        let policy = if call.marked { &hop.once } else { &hop.policy };
        let decision = call.attempts.failed_at(
            policy,
            &self.info,
            status,
            remaining,
            elapsed,
            now,
            &mut self.rng,
        );
        self.calls[id] = Some(call);
        match decision {
            Ok(wait) => {
                let wait = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX).max(1);
                self.schedule(self.now + wait, Event::Send(id));
            }
            Err(_) => self.finish(id, false),
        }
    }

    /// Call `id` is over: its caller hears of it, or the user does.
    fn finish(&mut self, id: usize, ok: bool) {
        let Some(call) = self.calls[id].take() else {
            return;
        };
        self.free.push(id);
        match call.parent {
            Some(parent) => {
                let answer = match (ok, self.kind.one_layer) {
                    (true, _) => Answer::Ok,
                    // This hop's client was the one to retry: its caller should not.
                    (false, true) => Answer::FailedNoRetry,
                    (false, false) => Answer::Failed,
                };
                self.schedule(self.now + LOCAL, Event::Answer(parent, answer));
            }
            None => {
                let row = self.row();
                if ok {
                    self.rows[row].goodput += 1;
                    self.rows[row].logical_ok += 1;
                    self.totals.goodput += 1;
                    self.totals.logical_ok += 1;
                } else {
                    self.rows[row].logical_failed += 1;
                }
            }
        }
    }

    fn tick(&mut self, i: usize) {
        let level = self.alarms.first().map(|a| a.level_at(self.at(self.now)));
        let r = &mut self.rows[i];
        r.storm = level.map_or("off", |l| l.as_str());
    }

    fn into_run(mut self, name: &str) -> VariantRun {
        // The deepest hop's attempts: one per user request, and the rest beyond it.
        for (r, &deepest) in self.rows.iter_mut().zip(&self.deepest) {
            r.offered_retries = deepest.saturating_sub(r.offered_originals);
        }
        let extra_total: u64 = self.rows.iter().map(|r| r.offered_retries).sum();
        self.totals.attempts = self.totals.logical + extra_total;
        self.totals.retries = extra_total;
        let interval = self.interval as f64 / NANOS as f64;
        let focus = Focus {
            from: FAIL_FROM,
            to: f64::INFINITY,
            capacity: 0.0,
            recover_at: None,
        };
        let summary = series::summarise(name, &mut self.rows, &self.totals, interval, focus);
        let extra = vec![
            (
                "attempts at C per user request, C failing".into(),
                format!("{:.2}", summary.focus_amplification),
            ),
            (
                "... before it fails".into(),
                format!("{:.2}", {
                    let before: Vec<&Row> = self
                        .rows
                        .iter()
                        .filter(|r| r.t < FAIL_FROM - 1e-9)
                        .collect();
                    let o: u64 = before.iter().map(|r| r.offered_originals).sum();
                    let x: u64 = before.iter().map(|r| r.offered_retries).sum();
                    if o == 0 {
                        0.0
                    } else {
                        (o + x) as f64 / o as f64
                    }
                }),
            ),
        ];
        let mut run = VariantRun {
            policy: name.to_owned(),
            rows: self.rows,
            summary,
            extra,
        };
        let worst = worst_row(&run);
        run.extra
            .insert(1, ("... in the worst row".into(), format!("{worst:.2}")));
        run
    }
}
