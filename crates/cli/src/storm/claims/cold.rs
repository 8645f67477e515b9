//! A cold downstream after an outage (2.9): slow start costs where the dependency is no
//! slower for a burst, and protects one that is. Here it is: cold, its calls miss caches and
//! it holds few at once; it warms with the calls it serves.

use std::time::Duration;

use super::{Claim, find, ratio, rows_in};
use crate::storm::VariantRun;
use crate::storm::engine::{Cold, Downstream, Phase, ServerConfig};
use crate::storm::kind::ScenarioKind;
use crate::storm::scenario::{
    Knobs, MS, SECOND, Scenario, ServerLimit, Variant, backstop_client, backstop_server, capacity,
    lognormal, model, scaled,
};
use crate::storm::series::Focus;

/// The downstream fails from here...
const DOWN: f64 = 10.0;
/// ...to here, and comes back cold.
const UP: f64 = 20.0;

pub(super) fn build(knobs: Knobs) -> Result<Claim, crate::storm::SimError> {
    let workers = scaled(500.0, knobs.scale);
    let local = 10 * MS;
    let latency = lognormal(50, 150);
    let cold = Cold {
        latency,
        cold_factor: 10.0,
        cold_concurrency: 5.0 * knobs.scale,
        warm_concurrency: 1_000.0 * knobs.scale,
        warm_after: 1_000.0 * knobs.scale,
        tau: 2 * SECOND,
    };
    let at = Duration::from_secs_f64;
    let phases = vec![
        Phase {
            from: Duration::ZERO,
            downstream: Downstream::Cold(cold),
        },
        Phase {
            from: at(DOWN),
            downstream: Downstream::Failing {
                after: 5 * MS,
                pushback: None,
            },
        },
        Phase {
            from: at(UP),
            downstream: Downstream::Cold(cold),
        },
    ];
    let rate = knobs.rate.unwrap_or(2_000.0);
    let server = backstop_server(workers, knobs.limit);
    let client = backstop_client(SECOND, knobs.throttle);
    let part = Scenario {
        name: ScenarioKind::Cold.as_str(),
        model: model(&knobs, Duration::from_secs(60), rate, local, phases),
        variants: vec![
            Variant {
                name: "slow-start".into(),
                client: client.clone(),
                server,
            },
            Variant {
                name: "no-slow-start".into(),
                client,
                server: ServerConfig {
                    slow_start: None,
                    ..server
                },
            },
        ],
        focus: Focus {
            from: UP,
            to: f64::INFINITY,
            capacity: capacity(workers, local, latency.mean()),
            recover_at: Some(UP),
        },
        notes: Vec::new(),
    };
    let limit = match knobs.limit {
        ServerLimit::Fixed => "fixed",
        ServerLimit::Adaptive => "adaptive",
    };
    Ok(Claim {
        name: ScenarioKind::Cold.as_str(),
        parts: vec![part],
        notes: vec![
            format!(
                "{workers} workers ({limit} limit), {:.0}/s offered, 10 ms of own work and a 50 ms call (p99 150 ms) when the downstream is warm; it fails (5 ms errors) from {DOWN:.0} s to {UP:.0} s and comes back cold",
                rate * knobs.scale
            ),
            format!(
                "the cold downstream: warmth is its successes of the last ~2 s over {:.0}; cold, a call takes up to {:.0}x longer (cache misses) and it serves {:.0} calls at once without slowing ({:.0} warm): beyond that every call slows in proportion (pools, JIT). Failed and cut-off calls warm nothing",
                cold.warm_after, cold.cold_factor, cold.cold_concurrency, cold.warm_concurrency
            ),
            "both variants: the library's clients (1 s deadline, budget, storm alarm) and `serve`'s gate; slow-start keeps the gate's slow start (floor 4, doubling per round trip on successes), no-slow-start lets every worker call the downstream at its return".to_owned(),
        ],
        conclude,
    })
}

/// Goodput per second and the share of logical requests that failed, from the return on.
fn after_return(run: &VariantRun) -> (f64, f64) {
    let rows: Vec<_> = rows_in(run, UP, f64::INFINITY).collect();
    let seconds = rows.len() as f64 * interval_of(run);
    let good: u64 = rows.iter().map(|r| r.goodput).sum();
    let ok: u64 = rows.iter().map(|r| r.logical_ok).sum();
    let failed: u64 = rows.iter().map(|r| r.logical_failed).sum();
    (
        ratio(good as f64, seconds),
        ratio(failed as f64, (ok + failed) as f64),
    )
}

fn interval_of(run: &VariantRun) -> f64 {
    match run.rows.as_slice() {
        [a, b, ..] => b.t - a.t,
        _ => 1.0,
    }
}

fn recovery(run: &VariantRun) -> String {
    run.summary
        .recovery_s
        .map_or("not in the run".to_owned(), |s| format!("{s:.0} s"))
}

fn conclude(runs: &mut [VariantRun]) -> String {
    for run in runs.iter_mut() {
        let (goodput, errors) = after_return(run);
        run.extra = vec![
            ("goodput/s after the return".into(), format!("{goodput:.0}")),
            (
                "error rate after the return".into(),
                format!("{:.1} %", 100.0 * errors),
            ),
            ("time to recover".into(), recovery(run)),
        ];
    }
    match (find(runs, "slow-start"), find(runs, "no-slow-start")) {
        (Some(slow), Some(none)) => {
            let (s, n) = (after_return(slow), after_return(none));
            format!(
                "what the numbers show: given every worker's call at once, the cold downstream slows past the deadline, the calls are cut off and warm nothing: without slow start goodput after the return is {:.0}/s with {:.0} % of requests failing (recovered: {}); the ramp gives it calls it can finish, they warm it, and the ramp follows: {:.0}/s with {:.0} % failing (recovered: {})",
                n.0,
                100.0 * n.1,
                recovery(none),
                s.0,
                100.0 * s.1,
                recovery(slow)
            )
        }
        _ => "what the numbers show: run both variants to compare them".to_owned(),
    }
}
