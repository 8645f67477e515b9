//! Hedge drift (2.3.4): a hedge sent after a fixed delay, the p95 of the unloaded latency,
//! answers 5 % of requests when the service is idle; as load rises the queue's wait pushes
//! more and more requests past the delay, and the hedges add load that pushes more. The
//! budget caps what hedges may add.

use std::time::Duration;

use super::{Claim, ratio, rows_in};
use crate::storm::engine::{ClientConfig, Downstream, Phase};
use crate::storm::kind::ScenarioKind;
use crate::storm::scenario::{
    Knobs, SECOND, Scenario, Variant, backstop_client, capacity, lognormal, model, naive_server,
    scaled,
};
use crate::storm::series::Focus;
use crate::storm::{SimError, VariantRun};

/// Load in percent of the capacity, each for [`STEP`] seconds.
const LEVELS: [u32; 6] = [30, 50, 70, 80, 90, 95];
/// Seconds per level.
const STEP: f64 = 10.0;
/// Seconds at the start of a level left out of its figures (the queue settling).
const SETTLE: f64 = 3.0;

pub(super) fn build(knobs: Knobs) -> Result<Claim, SimError> {
    // Few workers, so that the queue's wait grows with load well before saturation.
    let workers = scaled(20.0, knobs.scale);
    let latency = lognormal(50, 150);
    let mu = capacity(workers, Duration::ZERO, latency.mean());
    let delay = latency.p95();
    let phases = vec![Phase {
        from: Duration::ZERO,
        downstream: Downstream::Latency(latency),
    }];
    let hedged = |budget: (f64, u32)| ClientConfig {
        max_attempts: 1,
        budget: Some(budget),
        storm_alarm: false,
        hedge_delay: Some(delay),
        ..backstop_client(2 * SECOND, false)
    };
    let duration = STEP * LEVELS.len() as f64;
    let mut model = model(
        &knobs,
        Duration::from_secs_f64(duration),
        mu / knobs.scale,
        Duration::ZERO,
        phases,
    );
    model.load = LEVELS
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            (
                Duration::from_secs_f64(i as f64 * STEP),
                f64::from(l) / 100.0,
            )
        })
        .collect();
    let part = Scenario {
        name: ScenarioKind::HedgeDrift.as_str(),
        model,
        variants: vec![
            Variant {
                // A budget that never binds: the delay alone decides.
                name: "no-budget".into(),
                client: hedged((1.0, 1_000_000)),
                server: naive_server(workers),
            },
            Variant {
                name: "budget".into(),
                client: hedged((0.1, 20)),
                server: naive_server(workers),
            },
        ],
        focus: Focus {
            from: 0.0,
            to: f64::INFINITY,
            capacity: mu,
            recover_at: None,
        },
        notes: Vec::new(),
    };
    Ok(Claim {
        name: ScenarioKind::HedgeDrift.as_str(),
        parts: vec![part],
        notes: vec![
            format!(
                "{workers} workers at 50 ms (p99 150 ms): capacity {mu:.0}/s; load steps every {STEP:.0} s through 30, 50, 70, 80, 90 and 95 % of it; a FIFO queue in front; the attempt that loses the race is not cancelled at the server (it runs to its end, as on a server that does not see the cancellation)"
            ),
            format!(
                "clients: one attempt, a 2 s deadline, one hedge after a fixed {:.0} ms (the unloaded p95, as a gRPC hedgingDelay is set); no-budget: a budget that never binds; budget: the library's 0.1 retry budget (a hedge only while it holds half its burst). Hedge share: hedges per first attempt over each level but its first {SETTLE:.0} s",
                delay.as_secs_f64() * 1e3
            ),
        ],
        conclude,
    })
}

/// Hedges per first attempt, goodput per second and the worst p99 at level `i`.
fn level(run: &VariantRun, i: usize) -> (f64, f64, f64) {
    let from = i as f64 * STEP + SETTLE;
    let rows: Vec<_> = rows_in(run, from, (i + 1) as f64 * STEP).collect();
    let seconds = (STEP - SETTLE).max(1.0);
    let hedges: u64 = rows.iter().map(|r| r.hedges).sum();
    let originals: u64 = rows.iter().map(|r| r.offered_originals).sum();
    let good: u64 = rows.iter().map(|r| r.goodput).sum();
    let p99 = rows.iter().map(|r| r.p99_ms).fold(0.0, f64::max);
    (
        ratio(hedges as f64, originals as f64),
        good as f64 / seconds,
        p99,
    )
}

fn conclude(runs: &mut [VariantRun]) -> String {
    let mut parts = Vec::new();
    for run in runs.iter_mut() {
        let levels: Vec<(u32, (f64, f64, f64))> = LEVELS
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, level(run, i)))
            .collect();
        run.extra = levels
            .iter()
            .map(|&(l, (share, good, p99))| {
                (
                    format!("at {l} % load: hedge share, goodput/s, p99"),
                    format!("{:.0} % hedged, {good:.0}/s, {p99:.0} ms", 100.0 * share),
                )
            })
            .collect();
        let shares: Vec<String> = levels
            .iter()
            .map(|(l, (share, ..))| format!("{:.0} % at {l} %", 100.0 * share))
            .collect();
        parts.push(format!("{}: {}", run.policy, shares.join(", ")));
    }
    format!(
        "what the numbers show: with a fixed delay the hedge share follows the load, not the tail: {}. Without a budget the hedges' own load feeds the queue that makes them; the budget holds them to what it allows",
        parts.join("; ")
    )
}
