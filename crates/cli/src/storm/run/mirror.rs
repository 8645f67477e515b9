//! A live plan as the simulator sees it: `storm sim`'s mirror of a `storm run` scenario, read
//! from the plan itself (its rate, duration, PSP phases and variants), so the two cannot drift
//! apart.
//!
//! The PSP's phases become the simulated downstream's: a healthy PSP answers after its
//! latency (drawn with a 10 % tail, so requests do not all end in lockstep), an unavailable
//! one fails after it with its `Retry-After`. Each variant's flags become a client and a
//! server: `serve --max-inflight N` is the gate `serve` builds by default with N places
//! (`--no-slow-start`: without its slow start), `load` the library's client stack with a hedge
//! after the p95 (`--no-storm-alarm`: without the alarm) or, with `--policy naive`, the naive
//! loop. A plan using anything else (a stall, errors, a cold PSP, other flags) has no mirror.

use std::time::Duration;

use backstop::retry::{Backoff, Jitter};

use super::plan::{Phase, Plan, Variant};
use crate::storm::engine::{ClientConfig, Deadlines, Downstream, Model};
use crate::storm::scenario::{
    self, SECOND, Scenario, ServerLimit, backstop_client, backstop_server, lognormal, naive_client,
};
use crate::storm::series::Focus;

/// The live runs' deadline: `backstop load`'s default `--timeout`, per logical request
/// (backstop) or per attempt (naive).
const LIVE_TIMEOUT: Duration = Duration::from_secs(2);
/// The service's own part of a request in the mirrors: the gate, the handler, the store. A
/// guess: the simulator has no CPU or SQLite to measure it on.
pub(super) const LIVE_LOCAL: Duration = Duration::from_millis(1);

/// The simulated scenario named `name` mirroring `plan` (its times already multiplied by the
/// time scale) at `rate` logical requests per second, with `seed`; `focus` is the window its
/// summary reads and `notes` say what it is. `None` when the plan uses something the simulator
/// does not model.
pub(super) fn mirror(
    name: &'static str,
    plan: &Plan,
    seed: u64,
    rate: f64,
    focus: Focus,
    notes: Vec<String>,
) -> Option<Scenario> {
    if plan.burst.is_some() || plan.series_interval.is_some() {
        return None;
    }
    let phases = plan
        .phases
        .iter()
        .map(downstream)
        .collect::<Option<Vec<_>>>()?;
    let variants = plan
        .variants
        .iter()
        .map(variant)
        .collect::<Option<Vec<_>>>()?;
    Some(Scenario {
        name,
        model: Model {
            duration: plan.duration,
            interval: SECOND,
            rate,
            local: LIVE_LOCAL,
            phases,
            load: Vec::new(),
            seed,
        },
        variants,
        focus,
        notes,
    })
}

/// The simulated downstream of a PSP phase.
fn downstream(phase: &Phase) -> Option<crate::storm::engine::Phase> {
    if phase.error || phase.hold.is_some() || phase.slow_above > 0 {
        return None;
    }
    let downstream = if phase.unavailable {
        Downstream::Failing {
            after: phase.latency,
            pushback: Some(phase.pushback.unwrap_or(SECOND)),
        }
    } else {
        let ms = u32::try_from(phase.latency.as_millis()).ok()?;
        Downstream::Latency(lognormal(ms, ms * 11 / 10))
    };
    Some(crate::storm::engine::Phase {
        from: phase.at,
        downstream,
    })
}

/// The places `serve` gets in `variant` (`--max-inflight`).
pub(super) fn places(variant: &Variant) -> Option<usize> {
    let at = variant.serve.iter().position(|&f| f == "--max-inflight")?;
    variant.serve.get(at + 1)?.parse().ok()
}

/// The simulated client and server of a live variant, from its flags.
fn variant(live: &Variant) -> Option<scenario::Variant> {
    let mut server = backstop_server(places(live)?, ServerLimit::Fixed);
    let mut serve = live.serve.iter();
    while let Some(&flag) = serve.next() {
        match flag {
            "--max-inflight" => {
                serve.next();
            }
            "--no-slow-start" => server.slow_start = None,
            _ => return None,
        }
    }
    let client = match live.load.as_slice() {
        [] => backstop_load(true),
        ["--no-storm-alarm"] => backstop_load(false),
        ["--policy", "naive"] => naive_load(),
        _ => return None,
    };
    Some(scenario::Variant {
        name: live.name.to_owned(),
        client,
        server,
    })
}

/// `backstop load --policy naive`: 3 attempts, 50 ms then 100 ms between them (no jitter, no
/// budget, Retry-After ignored), a fresh key and a fresh timeout per attempt, each attempt's
/// deadline sent to the server as its `grpc-timeout`.
fn naive_load() -> ClientConfig {
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
        ..naive_client(LIVE_TIMEOUT)
    }
}

/// `backstop load` (the library's client stack with its defaults): the library's client
/// defaults and a hedge after the p95 of recent latencies.
fn backstop_load(storm_alarm: bool) -> ClientConfig {
    ClientConfig {
        storm_alarm,
        hedge_quantile: Some(0.95),
        ..backstop_client(LIVE_TIMEOUT, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storm::run::plan::{MS, S, healthy, variant as live_variant};

    fn plan(variants: Vec<Variant>) -> Plan {
        Plan {
            rate: Some(200.0),
            capacity_multiple: 1.0,
            duration: S(10),
            recovery_at: None,
            phases: vec![healthy(S(0), MS(100))],
            variants,
            burst: None,
            series_interval: None,
            probe: None,
            probe_rate: 2_000.0,
        }
    }

    fn focus() -> Focus {
        Focus {
            from: 0.0,
            to: 10.0,
            capacity: 1.0,
            recover_at: None,
        }
    }

    #[test]
    fn the_flags_become_the_simulated_client_and_server() {
        let plan = plan(vec![
            live_variant("a", vec!["--max-inflight", "16"], vec![]),
            live_variant(
                "b",
                vec!["--max-inflight", "8", "--no-slow-start"],
                vec!["--policy", "naive"],
            ),
        ]);
        let mirror = mirror("t", &plan, 1, 200.0, focus(), Vec::new()).unwrap();
        let (a, b) = (&mirror.variants[0], &mirror.variants[1]);
        assert_eq!(
            a.server.slow_start,
            backstop_server(16, ServerLimit::Fixed).slow_start
        );
        assert!(a.server.slow_start.is_some() && b.server.slow_start.is_none());
        assert!(a.client.storm_alarm && a.client.hedge_quantile == Some(0.95));
        assert_eq!(b.client.deadlines, Deadlines::PerAttemptPropagated);
        assert_eq!(mirror.model.duration, S(10));
    }

    #[test]
    fn a_plan_the_simulator_cannot_model_has_no_mirror() {
        for serve in [vec!["--max-inflight", "16", "--queue", "fifo"], vec![]] {
            let plan = plan(vec![live_variant("a", serve, vec![])]);
            assert!(mirror("t", &plan, 1, 200.0, focus(), Vec::new()).is_none());
        }
        let plan = plan(vec![live_variant(
            "a",
            vec!["--max-inflight", "16"],
            vec!["--fixed-hedge-delay", "130ms"],
        )]);
        assert!(mirror("t", &plan, 1, 200.0, focus(), Vec::new()).is_none());
    }
}
