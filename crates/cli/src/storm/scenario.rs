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
