//! The utilization sweep (2.5.2): the same jittered retries after the same short slowdown,
//! at rising utilization. With headroom the backlog drains; near saturation the timeouts it
//! causes bring retries that keep it from draining.

use std::time::Duration;

use backstop::retry::Backoff;

use super::{Claim, ratio, rows_in};
use crate::storm::VariantRun;
use crate::storm::engine::{ClientConfig, Deadlines, Downstream, Phase};
use crate::storm::kind::ScenarioKind;
use crate::storm::scenario::{
    Knobs, MS, SECOND, Scenario, Variant, capacity, lognormal, model, naive_client, naive_server,
    scaled,
};
use crate::storm::series::Focus;

/// The utilizations swept, in percent of the server's capacity.
const LEVELS: [u32; 5] = [50, 70, 80, 90, 95];

/// The slowdown: from here...
const SLOW: f64 = 10.0;
/// ...to here.
const FAST: f64 = 15.0;
/// How the runs end is read over their last this many seconds.
const TAIL: f64 = 20.0;
/// A level survives when goodput over the tail is at least this share of the first attempts.
const SURVIVES: f64 = 0.95;

pub(super) fn build(knobs: Knobs) -> Claim {
    let workers = scaled(100.0, knobs.scale);
    let local = 10 * MS;
    let fast = lognormal(40, 120);
    let slow = lognormal(73, 220);
    let mu = capacity(workers, local, fast.mean());
    let at = Duration::from_secs_f64;
    let phases = vec![
        Phase {
            from: Duration::ZERO,
            downstream: Downstream::Latency(fast),
        },
        Phase {
            from: at(SLOW),
            downstream: Downstream::Latency(slow),
        },
        Phase {
            from: at(FAST),
            downstream: Downstream::Latency(fast),
        },
    ];
    // The library's backoff (full jitter, 50 ms doubling to 2 s) and nothing else: no budget,
    // no alarm, a fresh 1 s per attempt, the server's FIFO queue working for whoever left.
    let client = ClientConfig {
        backoff: Backoff::default(),
        deadlines: Deadlines::PerAttempt,
        ..naive_client(SECOND)
    };
    let duration = knobs.duration.unwrap_or(Duration::from_secs(60));
    let parts = LEVELS
        .iter()
        .map(|&level| {
            // The sweep sets the rate: --rate does not apply.
            let rate = mu / knobs.scale * f64::from(level) / 100.0;
            let knobs = Knobs {
                duration: Some(duration),
                ..knobs
            };
            Scenario {
                name: ScenarioKind::Utilization.as_str(),
                model: model(&knobs, duration, rate, local, phases.clone()),
                variants: vec![Variant {
                    name: format!("util-{level}"),
                    client: client.clone(),
                    server: naive_server(workers),
                }],
                focus: Focus {
                    from: FAST,
                    to: f64::INFINITY,
                    capacity: mu,
                    recover_at: Some(FAST),
                },
                notes: Vec::new(),
            }
        })
        .collect();
    Claim {
        name: ScenarioKind::Utilization.as_str(),
        parts,
        notes: vec![
            format!(
                "{workers} workers, 50 ms per request (40 ms downstream): capacity {mu:.0}/s; offered 50, 70, 80, 90 and 95 % of it; from {SLOW:.0} s to {FAST:.0} s the downstream takes {:.0} ms (capacity {:.0}/s)",
                slow.mean().as_secs_f64() * 1e3,
                capacity(workers, local, slow.mean())
            ),
            "every level: the same clients (3 attempts, the library's backoff: full jitter from 50 ms doubling to 2 s; a 1 s timeout per attempt; no budget, no storm alarm) and the same server (a FIFO queue that works for clients that left). Figures after the slowdown: goodput over the last 20 s against the first attempts offered, the worst p99, and retries per first attempt".to_owned(),
        ],
        conclude,
    }
}

/// Goodput over the run's last [`TAIL`] seconds per first attempt offered in them.
fn tail_goodput(run: &VariantRun) -> f64 {
    let end = run.rows.last().map_or(0.0, |r| r.t) + 1e-9;
    let rows: Vec<_> = rows_in(run, end - TAIL, f64::INFINITY).collect();
    let good: u64 = rows.iter().map(|r| r.goodput).sum();
    let offered: u64 = rows.iter().map(|r| r.offered_originals).sum();
    ratio(good as f64, offered as f64)
}

fn retry_share(run: &VariantRun) -> f64 {
    let rows: Vec<_> = rows_in(run, FAST, f64::INFINITY).collect();
    let retries: u64 = rows.iter().map(|r| r.offered_retries).sum();
    let originals: u64 = rows.iter().map(|r| r.offered_originals).sum();
    ratio(retries as f64, originals as f64)
}

fn conclude(runs: &mut [VariantRun]) -> String {
    let mut survived = Vec::new();
    let mut collapsed = Vec::new();
    for run in runs.iter_mut() {
        let good = tail_goodput(run);
        let name = run.policy.trim_start_matches("util-").to_owned();
        if good >= SURVIVES {
            survived.push(format!("{name} %"));
        } else {
            collapsed.push(format!(
                "{name} % (goodput {:.0} % of the load)",
                100.0 * good
            ));
        }
        run.extra = vec![
            (
                "goodput / first attempts (last 20 s)".into(),
                format!("{:.2}", good),
            ),
            (
                "worst p99 after the slowdown".into(),
                format!("{:.0} ms", run.summary.focus_p99_ms),
            ),
            (
                "retries per first attempt after it".into(),
                format!("{:.2}", retry_share(run)),
            ),
            (
                "verdict".into(),
                if good >= SURVIVES {
                    "survives"
                } else {
                    "collapsed"
                }
                .into(),
            ),
        ];
    }
    format!(
        "what the numbers show: after the same {:.0} s slowdown the same jittered retries {} and {}: jitter spreads retries in time but adds them all the same, and without headroom the backlog's timeouts bring retries that keep it from draining",
        FAST - SLOW,
        if survived.is_empty() {
            "survive at no level".to_owned()
        } else {
            format!("survive at {}", survived.join(", "))
        },
        if collapsed.is_empty() {
            "collapse at none".to_owned()
        } else {
            format!("collapse at {}", collapsed.join(", "))
        }
    )
}
