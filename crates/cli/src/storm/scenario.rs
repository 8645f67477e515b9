//! The scenarios: a model of the world and the client/server variants compared in it.

use std::time::Duration;

use backstop::retry::{Backoff, Jitter};

use super::dist::LogNormal;
use super::engine::{
    ClientConfig, Deadlines, Downstream, LimitKind, Model, Phase, RetryAfter, ServerConfig,
};
use super::kind::ScenarioKind;
use super::series::Focus;

/// Which server limit the `backstop` variants use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub(crate) enum ServerLimit {
    /// A fixed limit equal to the workers (the service's default).
    #[default]
    Fixed,
    /// The library's Gradient2, from a tenth of the workers up to all of them.
    Adaptive,
}

/// Knobs common to every scenario.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Knobs {
    /// Multiplies the offered load and the workers (capacity scales with it, ratios do not).
    pub(crate) scale: f64,
    /// Overrides the scenario's duration.
    pub(crate) duration: Option<Duration>,
    /// Overrides the scenario's offered load (logical requests per second, before `scale`).
    pub(crate) rate: Option<f64>,
    pub(crate) interval: Duration,
    pub(crate) seed: u64,
    pub(crate) limit: ServerLimit,
    /// `backstop` clients also use the library's adaptive throttle.
    pub(crate) throttle: bool,
}

/// One client/server pairing compared in a scenario.
#[derive(Debug, Clone)]
pub(crate) struct Variant {
    pub(crate) name: String,
    pub(crate) client: ClientConfig,
    pub(crate) server: ServerConfig,
}

/// A scenario ready to run.
#[derive(Debug, Clone)]
pub(crate) struct Scenario {
    /// The scenario's name in reports.
    pub(crate) name: &'static str,
    pub(crate) model: Model,
    pub(crate) variants: Vec<Variant>,
    pub(crate) focus: Focus,
    /// Lines printed above the table: what the scenario is and what to look for.
    pub(crate) notes: Vec<String>,
}

pub(super) const MS: Duration = Duration::from_millis(1);
pub(super) const SECOND: Duration = Duration::from_secs(1);

pub(super) fn lognormal(mean_ms: u32, p99_ms: u32) -> LogNormal {
    LogNormal::new(mean_ms * MS, p99_ms * MS).expect("the scenario's shapes are valid")
}

/// No budget, no jitter, a fixed per-attempt timeout, retry at once (whatever the server's
/// Retry-After says), 3 attempts.
pub(super) fn naive_client(timeout: Duration) -> ClientConfig {
    ClientConfig {
        max_attempts: 3,
        // The smallest backoff the library accepts: "retry immediately".
        backoff: Backoff::new(
            Duration::from_nanos(1),
            Duration::from_nanos(1),
            Jitter::None,
            Duration::ZERO,
        )
        .expect("valid"),
        budget: None,
        storm_alarm: false,
        throttle: false,
        timeout,
        deadlines: Deadlines::PerAttempt,
        honours_pushback: false,
        hedge_quantile: None,
        hedge_delay: None,
    }
}

/// The library's defaults: 3 attempts, full-jitter backoff, a 0.1 budget with 20 of burst, the
/// storm alarm, one deadline shared by the attempts and told to the server.
pub(super) fn backstop_client(timeout: Duration, throttle: bool) -> ClientConfig {
    ClientConfig {
        max_attempts: 3,
        backoff: Backoff::default(),
        budget: Some((0.1, 20)),
        storm_alarm: true,
        throttle,
        timeout,
        deadlines: Deadlines::Shared,
        honours_pushback: true,
        hedge_quantile: None,
        hedge_delay: None,
    }
}

/// `backstop load --policy naive`: 3 attempts, 50 ms then 100 ms between them (no jitter, no
/// budget, Retry-After ignored), a fresh key and a fresh `timeout` per attempt, each attempt's
/// deadline sent to the server as its `grpc-timeout`.
fn live_naive_client(timeout: Duration) -> ClientConfig {
    ClientConfig {
        max_attempts: 3,
        backoff: Backoff::new(
            Duration::from_millis(50),
            SECOND,
            Jitter::None,
            Duration::ZERO,
        )
        .expect("valid"),
        deadlines: Deadlines::PerAttemptPropagated,
        ..naive_client(timeout)
    }
}

/// `backstop load` (the library's client stack with its defaults): the library's client
/// defaults and a hedge after the p95 of recent latencies.
fn live_backstop_client(timeout: Duration, storm_alarm: bool) -> ClientConfig {
    ClientConfig {
        storm_alarm,
        hedge_quantile: Some(0.95),
        ..backstop_client(timeout, false)
    }
}

/// An unbounded first-come first-served queue in front of `workers`; no deadline known, no
/// slow start; a refusal (none happen: the queue keeps everyone) would say 1 s.
pub(super) fn naive_server(workers: usize) -> ServerConfig {
    ServerConfig {
        limit: LimitKind::Fixed(workers),
        slow_start: None,
        deadline_aware: false,
        min_service: Duration::ZERO,
        retry_after: RetryAfter::Fixed(SECOND),
        fair_queue: false,
        max_queue: None,
    }
}

/// `backstop serve`'s default slow-start floor.
const SLOW_START_FLOOR: usize = backstop_payment::config::DEFAULT_SLOW_START_FLOOR;

/// The library's gate as `backstop serve` builds it by default: a limit (fixed at the workers,
/// or Gradient2) behind a slow start (floor 4), its fair queue (every wait bounded by the
/// caller's deadline less the expected service, sojourn drops, adaptive LIFO), and refusals
/// whose Retry-After is computed from the queue.
pub(super) fn backstop_server(workers: usize, limit: ServerLimit) -> ServerConfig {
    ServerConfig {
        limit: match limit {
            ServerLimit::Fixed => LimitKind::Fixed(workers),
            ServerLimit::Adaptive => LimitKind::Gradient2 {
                min: (workers / 10).max(1),
                max: workers,
            },
        },
        slow_start: Some(SLOW_START_FLOOR),
        deadline_aware: true,
        min_service: 20 * MS,
        retry_after: RetryAfter::Computed,
        fair_queue: true,
        max_queue: None,
    }
}

// ---------------------------------------------------------------------------------------------
// Mirrors of `storm run`'s live scenarios

/// The live runs' deadline: `backstop load`'s default `--timeout`, per logical request
/// (backstop) or per attempt (naive).
const LIVE_TIMEOUT: Duration = Duration::from_secs(2);
/// The service's own part of a request in the mirrors: the gate, the handler, the store. A
/// guess: the simulator has no CPU or SQLite to measure it on.
const LIVE_LOCAL: Duration = MS;

/// The PSP simulator's latency as the mirrors draw it: a fixed delay in the real run, here
/// with a 10 % tail so requests do not all end in lockstep.
fn psp(latency_ms: u32) -> Downstream {
    Downstream::Latency(lognormal(latency_ms, latency_ms * 11 / 10))
}

/// `Phase`s from `(start in seconds, downstream)` pairs, the starts multiplied by `scale`.
fn live_phases(scale: f64, phases: &[(f64, Downstream)]) -> Vec<Phase> {
    phases
        .iter()
        .map(|&(from, downstream)| Phase {
            from: Duration::from_secs_f64(from * scale),
            downstream,
        })
        .collect()
}

/// The mirrors' model: `rate` for `seconds x scale`, one-second rows.
fn live_model(seed: u64, scale: f64, seconds: f64, rate: f64, phases: Vec<Phase>) -> Model {
    Model {
        duration: Duration::from_secs_f64(seconds * scale),
        interval: SECOND,
        rate,
        local: LIVE_LOCAL,
        phases,
        load: Vec::new(),
        seed,
    }
}

/// `backstop serve --max-inflight N` with its defaults: the gate of [`backstop_server`].
fn live_server(max_inflight: usize) -> ServerConfig {
    backstop_server(max_inflight, ServerLimit::Fixed)
}

/// `storm run --scenario slowdown` as the simulator sees it: 200/s offered to a service of 64
/// places whose work is a PSP call of 100 ms, 600 ms from 10 s to 30 s, over 40 s; 2 s
/// deadlines. Both client kinds face the service's gate, as they do in the real run. Durations
/// are multiplied by `scale` (the live run's `--time-scale`).
pub(crate) fn live_slowdown(seed: u64, scale: f64) -> Scenario {
    let workers = 64;
    let (from, to) = (10.0 * scale, 30.0 * scale);
    let phases = live_phases(
        scale,
        &[(0.0, psp(100)), (10.0, psp(600)), (30.0, psp(100))],
    );
    Scenario {
        name: "live-slowdown",
        model: live_model(seed, scale, 40.0, 200.0, phases),
        variants: vec![
            Variant {
                name: "naive".into(),
                client: live_naive_client(LIVE_TIMEOUT),
                server: live_server(workers),
            },
            Variant {
                name: "backstop".into(),
                client: live_backstop_client(LIVE_TIMEOUT, true),
                server: live_server(workers),
            },
        ],
        focus: Focus {
            from,
            to,
            capacity: capacity(workers, LIVE_LOCAL, 600 * MS),
            recover_at: Some(to),
        },
        notes: vec![format!(
            "simulated mirror of the live run: {workers} places, 200/s, PSP 100 ms -> 600 ms \
             from {from:.0} s to {to:.0} s, 2 s deadlines; both clients against the gate"
        )],
    }
}

/// `storm run --scenario overload` as the simulator sees it: `backstop serve --max-inflight
/// 16` in front of a PSP of 100 ms, offered 3x `capacity` (the live run's measured one, else
/// the 160/s of 16 places at 100 ms) for 20 s x `scale`; backstop clients, 2 s deadlines.
pub(crate) fn live_overload(seed: u64, scale: f64, capacity_per_s: Option<f64>) -> Scenario {
    let workers = 16;
    let nominal = workers as f64 / 0.1;
    let rate = 3.0 * capacity_per_s.filter(|c| *c > 0.0).unwrap_or(nominal);
    let seconds = 20.0 * scale;
    Scenario {
        name: "live-overload",
        model: live_model(
            seed,
            scale,
            20.0,
            rate,
            live_phases(scale, &[(0.0, psp(100))]),
        ),
        variants: vec![Variant {
            name: "backstop".into(),
            client: live_backstop_client(LIVE_TIMEOUT, true),
            server: live_server(workers),
        }],
        focus: Focus {
            from: 0.0,
            to: seconds,
            capacity: capacity(workers, LIVE_LOCAL, 100 * MS),
            recover_at: None,
        },
        notes: vec![format!(
            "simulated mirror of the live run: {workers} places, PSP 100 ms, {rate:.0}/s offered \
             (3x {:.1}/s) for {seconds:.0} s, 2 s deadlines",
            rate / 3.0
        )],
    }
}

/// The variants of `storm run --scenario outage`, by name, in the live plan's order.
pub(crate) const LIVE_OUTAGE_VARIANTS: [&str; 4] =
    ["backstop", "no-slow-start", "no-storm-alarm", "naive"];

/// `storm run --scenario outage` as the simulator sees it: 200/s offered to `backstop serve
/// --max-inflight 64`; the PSP answers in 100 ms, refuses every charge (503 + `Retry-After: 1`
/// after its 100 ms) from 10 s to 20 s, then answers in 400 ms (a cold start) until 25 s and in
/// 100 ms after; 40 s, durations multiplied by `scale`. The variants are the live plan's.
pub(crate) fn live_outage(seed: u64, scale: f64) -> Scenario {
    let workers = 64;
    let unavailable = Downstream::Failing {
        after: 100 * MS,
        pushback: Some(SECOND),
    };
    let phases = live_phases(
        scale,
        &[
            (0.0, psp(100)),
            (10.0, unavailable),
            (20.0, psp(400)),
            (25.0, psp(100)),
        ],
    );
    let (up, warm) = (20.0 * scale, 25.0 * scale);
    let variant = |name: &str| {
        let (client, server) = match name {
            "backstop" => (
                live_backstop_client(LIVE_TIMEOUT, true),
                live_server(workers),
            ),
            "no-slow-start" => (
                live_backstop_client(LIVE_TIMEOUT, true),
                ServerConfig {
                    slow_start: None,
                    ..live_server(workers)
                },
            ),
            "no-storm-alarm" => (
                live_backstop_client(LIVE_TIMEOUT, false),
                live_server(workers),
            ),
            _ => (live_naive_client(LIVE_TIMEOUT), live_server(workers)),
        };
        Variant {
            name: name.to_owned(),
            client,
            server,
        }
    };
    Scenario {
        name: "live-outage",
        model: live_model(seed, scale, 40.0, 200.0, phases),
        variants: LIVE_OUTAGE_VARIANTS.iter().map(|n| variant(n)).collect(),
        focus: Focus {
            from: up,
            to: warm,
            capacity: capacity(workers, LIVE_LOCAL, 400 * MS),
            recover_at: Some(up),
        },
        notes: vec![format!(
            "simulated mirror of the live run: {workers} places, 200/s, PSP 100 ms; 503 after \
             100 ms from {:.0} s to {up:.0} s, 400 ms until {warm:.0} s; 2 s deadlines",
            10.0 * scale
        )],
    }
}

pub(super) fn scaled(n: f64, scale: f64) -> usize {
    ((n * scale).round() as usize).max(1)
}

/// Capacity of `workers` each busy for `local + downstream` on average, per second.
pub(super) fn capacity(workers: usize, local: Duration, downstream: Duration) -> f64 {
    workers as f64 / (local + downstream).as_secs_f64()
}

impl Scenario {
    /// Builds scenario `kind` with `knobs`; `None` for the kinds that are not one model run
    /// by several variants (see `claims`).
    pub(crate) fn build(kind: ScenarioKind, knobs: Knobs) -> Option<Scenario> {
        match kind {
            ScenarioKind::Slowdown => Some(slowdown(knobs)),
            ScenarioKind::LittlesLaw => Some(littles_law(knobs)),
            ScenarioKind::OutageRecovery => Some(outage_recovery(knobs)),
            ScenarioKind::Hedging => Some(hedging(knobs)),
            _ => None,
        }
    }

    /// The variants' names.
    pub(crate) fn names(&self) -> Vec<&str> {
        self.variants.iter().map(|v| v.name.as_str()).collect()
    }
}

pub(super) fn model(
    knobs: &Knobs,
    default: Duration,
    rate: f64,
    local: Duration,
    phases: Vec<Phase>,
) -> Model {
    Model {
        duration: knobs.duration.unwrap_or(default),
        interval: knobs.interval,
        rate: rate * knobs.scale,
        local,
        phases,
        load: Vec::new(),
        seed: knobs.seed,
    }
}

fn slowdown(knobs: Knobs) -> Scenario {
    let workers = scaled(500.0, knobs.scale);
    let local = 40 * MS;
    // 100 ms per request of which 60 ms downstream; then 600 ms mean (p99 1.5 s) of which
    // 560 ms (p99 about 1.46 s) downstream.
    let fast = lognormal(60, 150);
    let slow = lognormal(560, 1_460);
    let (from, to) = (10.0, 40.0);
    let phases = vec![
        Phase {
            from: Duration::ZERO,
            downstream: Downstream::Latency(fast),
        },
        Phase {
            from: Duration::from_secs_f64(from),
            downstream: Downstream::Latency(slow),
        },
        Phase {
            from: Duration::from_secs_f64(to),
            downstream: Downstream::Latency(fast),
        },
    ];
    let timeout = SECOND;
    let focus_capacity = capacity(workers, local, slow.mean());
    let rate = knobs.rate.unwrap_or(2_000.0);
    Scenario {
        name: ScenarioKind::Slowdown.as_str(),
        model: model(&knobs, Duration::from_secs(60), rate, local, phases),
        variants: vec![
            Variant { name: "naive".into(), client: naive_client(timeout), server: naive_server(workers) },
            Variant {
                name: "backstop".into(),
                client: backstop_client(timeout, knobs.throttle),
                server: backstop_server(workers, knobs.limit),
            },
        ],
        focus: Focus { from, to, capacity: focus_capacity, recover_at: Some(to) },
        notes: vec![
            format!(
                "{workers} workers, 100 ms per request (60 ms downstream), {:.0}/s offered; from {from:.0} s to {to:.0} s the downstream takes 600 ms mean (p99 1.5 s): capacity {:.0}/s -> {:.0}/s",
                rate * knobs.scale,
                capacity(workers, local, fast.mean()),
                focus_capacity
            ),
            "clients: 1 s timeout, 3 attempts. naive: no budget, no jitter, a fresh 1 s per attempt, retry at once, FIFO server without deadlines. backstop: library defaults (budget 0.1, full jitter, storm alarm, one deadline), the library's gate as `serve` builds it (slow start, its fair queue: deadline-bounded waits, sojourn drops, adaptive LIFO; a Retry-After computed from the queue)".to_owned(),
        ],
    }
}

fn littles_law(knobs: Knobs) -> Scenario {
    // Enough workers that only the admission limit binds.
    let workers_cap = scaled(5_000.0, knobs.scale);
    // The chapter's own figures: 1000/s with a p99 of 250 ms, so C = 1000 x 0.25 x 1.2 = 300.
    let latency = lognormal(150, 250);
    let phases = vec![Phase {
        from: Duration::ZERO,
        downstream: Downstream::Latency(latency),
    }];
    let offered = knobs.rate.unwrap_or(1_000.0);
    let rate = offered * knobs.scale;
    // C = lambda x W_p99 x 1.2
    let needed = scaled(offered * 0.250 * 1.2, knobs.scale);
    // Below L = lambda x W (150 in flight on average): too small.
    let small = scaled(offered * 0.1, knobs.scale);
    let timeout = SECOND;
    let gate = |limit: usize| ServerConfig {
        limit: LimitKind::Fixed(limit),
        ..backstop_server(workers_cap, ServerLimit::Fixed)
    };
    let unbounded = |limit: usize| ServerConfig {
        limit: LimitKind::Fixed(limit),
        ..naive_server(workers_cap)
    };
    let client = ClientConfig {
        max_attempts: 1,
        ..backstop_client(timeout, false)
    };
    Scenario {
        name: ScenarioKind::LittlesLaw.as_str(),
        model: model(
            &knobs,
            Duration::from_secs(30),
            offered,
            Duration::ZERO,
            phases,
        ),
        variants: vec![
            Variant {
                name: format!("limit-{needed}"),
                client: client.clone(),
                server: gate(needed),
            },
            Variant {
                name: format!("limit-{small}"),
                client: client.clone(),
                server: gate(small),
            },
            Variant {
                name: format!("limit-{small}-unbounded-queue"),
                client,
                server: unbounded(small),
            },
        ],
        focus: Focus {
            from: 0.0,
            to: f64::INFINITY,
            capacity: needed as f64 / latency.mean().as_secs_f64(),
            recover_at: None,
        },
        notes: vec![
            format!(
                "{rate:.0}/s, 150 ms mean (p99 250 ms), 1 s deadline, no retries: L = lambda x W = {:.0} in flight on average; C = lambda x W_p99 x 1.2 = {needed}",
                rate * 0.150
            ),
            format!(
                "limit-{needed}: enough. limit-{small}: too small, the gate refuses what cannot wait. limit-{small}-unbounded-queue: too small behind an unbounded queue: latency and memory grow without bound (memory at {} KiB per waiting request)",
                super::series::REQUEST_FOOTPRINT_KIB
            ),
        ],
    }
}

fn outage_recovery(knobs: Knobs) -> Scenario {
    let workers = scaled(500.0, knobs.scale);
    let local = 40 * MS;
    let warm = lognormal(60, 150);
    // Cold caches: every call misses for a while.
    let cold = lognormal(400, 1_200);
    let (down, up, warmed) = (10.0, 20.0, 35.0);
    let phases = vec![
        Phase {
            from: Duration::ZERO,
            downstream: Downstream::Latency(warm),
        },
        Phase {
            from: Duration::from_secs_f64(down),
            downstream: Downstream::Failing {
                after: 5 * MS,
                pushback: None,
            },
        },
        Phase {
            from: Duration::from_secs_f64(up),
            downstream: Downstream::Latency(cold),
        },
        Phase {
            from: Duration::from_secs_f64(warmed),
            downstream: Downstream::Latency(warm),
        },
    ];
    let timeout = SECOND;
    let rate = knobs.rate.unwrap_or(2_000.0);
    let mut no_alarm = backstop_client(timeout, knobs.throttle);
    no_alarm.storm_alarm = false;
    let server = backstop_server(workers, knobs.limit);
    let variant = |name: &str, client: ClientConfig, server: ServerConfig| Variant {
        name: name.to_owned(),
        client,
        server,
    };
    let client = backstop_client(timeout, knobs.throttle);
    Scenario {
        name: ScenarioKind::OutageRecovery.as_str(),
        model: model(&knobs, Duration::from_secs(60), rate, local, phases),
        variants: vec![
            variant("naive", naive_client(timeout), naive_server(workers)),
            variant("backstop", client.clone(), server),
            variant(
                "backstop-no-slow-start",
                client.clone(),
                ServerConfig {
                    slow_start: None,
                    ..server
                },
            ),
            variant(
                "backstop-no-retry-after",
                client,
                ServerConfig {
                    retry_after: RetryAfter::None,
                    ..server
                },
            ),
            variant("backstop-no-alarm", no_alarm.clone(), server),
            variant(
                "backstop-no-alarm-no-retry-after",
                no_alarm,
                ServerConfig {
                    retry_after: RetryAfter::None,
                    ..server
                },
            ),
        ],
        focus: Focus {
            from: up,
            to: warmed,
            capacity: capacity(workers, local, cold.mean()),
            recover_at: Some(up),
        },
        notes: vec![
            format!(
                "{workers} workers, {:.0}/s offered, 100 ms per request; the downstream fails (5 ms errors) from {down:.0} s to {up:.0} s, then answers cold (400 ms mean, p99 1.2 s: capacity {:.0}/s) until {warmed:.0} s",
                rate * knobs.scale,
                capacity(workers, local, cold.mean())
            ),
            "recovery: seconds from the downstream's return until goodput holds 90 % of the original load for 3 intervals (not before the downstream is warm: cold, it serves less than the load); back to capacity: until goodput holds 90 % of what the cold downstream allows".to_owned(),
            format!(
                "naive: as in slowdown. backstop: the library's clients and `serve`'s default gate (slow start with floor {SLOW_START_FLOOR}, a Retry-After computed from the queue); each -no-... variant turns one control off: the server's slow start, its Retry-After (refusals carry no pushback: clients back off on their own), the clients' storm alarm, or the alarm and the Retry-After"
            ),
            "slow start: during the outage the limit falls to the floor and the gate refuses most of what the downstream would fail; at the return the downstream gets a few calls at once (the `in flight` figure) and the limit doubles per round trip back to the workers. The simulated downstream is no slower for being given every worker's call at once, so here the ramp only costs (back to capacity later, less goodput in the window); a real dependency just back (cold caches, connection pools) is what it protects".to_owned(),
            "Retry-After: with the storm alarm on, the alarm stops retries before the pushback matters. With it off, while the gate sheds (the floor during the outage, then the cold downstream's shortfall), the computed pushback (30 to 60 s and \"do not retry\" once the queue has been overloaded for 2 s) stops retries the budget would allow: compare the two -no-alarm variants".to_owned(),
        ],
    }
}

fn hedging(knobs: Knobs) -> Scenario {
    let workers = scaled(2_000.0, knobs.scale);
    let latency = lognormal(50, 250);
    let phases = vec![Phase {
        from: Duration::ZERO,
        downstream: Downstream::Latency(latency),
    }];
    let timeout = SECOND;
    let rate = knobs.rate.unwrap_or(1_000.0);
    // A budget that never binds, so the hedging rule alone sets the cost.
    let hedged = |q: f64| ClientConfig {
        max_attempts: 1,
        budget: Some((1.0, 1_000)),
        hedge_quantile: Some(q),
        storm_alarm: false,
        ..backstop_client(timeout, false)
    };
    let budgeted = ClientConfig {
        budget: Some((0.1, 20)),
        ..hedged(0.5)
    };
    let server = backstop_server(workers, ServerLimit::Fixed);
    Scenario {
        name: ScenarioKind::Hedging.as_str(),
        model: model(&knobs, Duration::from_secs(30), rate, 10 * MS, phases),
        variants: vec![
            Variant {
                name: "p95".into(),
                client: hedged(0.95),
                server,
            },
            Variant {
                name: "p50".into(),
                client: hedged(0.50),
                server,
            },
            Variant {
                name: "p50-budget".into(),
                client: budgeted,
                server,
            },
        ],
        focus: Focus {
            from: 0.0,
            to: f64::INFINITY,
            capacity: capacity(workers, 10 * MS, latency.mean()),
            recover_at: None,
        },
        notes: vec![format!(
            "{:.0}/s, 60 ms mean (p99 260 ms), one hedge per request after the given quantile of recent latencies (the library's hedging policy); p95 and p50 with a budget that never binds, p50-budget with the default 0.1 budget",
            1_000.0 * knobs.scale
        )],
    }
}
