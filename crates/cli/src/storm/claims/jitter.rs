//! Retry pulses (2.3.2): clients that failed at the same moment retry at the same moments
//! unless their backoff is jittered. The same outage, four jitter modes of the library's
//! backoff.

use std::time::Duration;

use backstop::retry::{Backoff, Jitter};

use super::{Claim, find, ratio, rows_in};
use crate::storm::VariantRun;
use crate::storm::engine::{ClientConfig, Deadlines, Downstream, Phase};
use crate::storm::kind::ScenarioKind;
use crate::storm::scenario::{
    Knobs, MS, Scenario, Variant, capacity, lognormal, model, naive_client, naive_server, scaled,
};
use crate::storm::series::Focus;

/// The jitter modes compared, by variant name.
const MODES: [(&str, Jitter); 4] = [
    ("no-jitter", Jitter::None),
    ("full", Jitter::Full),
    ("equal", Jitter::Equal),
    ("decorrelated", Jitter::Decorrelated),
];

/// The downstream hangs from here...
const STALL: f64 = 10.0;
/// ...its hung calls all fail together here, and it refuses every call...
const RESET: f64 = 12.0;
/// ...until here.
const BACK: f64 = 16.0;

/// Retries at or below this share of the first attempts count as drained.
const DRAINED: f64 = 0.1;

pub(super) fn build(knobs: Knobs) -> Claim {
    // Enough workers that the stalled calls never queue: the pulse is the clients' doing.
    let workers = scaled(5_000.0, knobs.scale);
    let rate = knobs.rate.unwrap_or(1_000.0);
    let at = Duration::from_secs_f64;
    let healthy = Downstream::Latency(lognormal(20, 60));
    let phases = vec![
        Phase {
            from: Duration::ZERO,
            downstream: healthy,
        },
        Phase {
            from: at(STALL),
            downstream: Downstream::StalledUntil { at: at(RESET) },
        },
        Phase {
            from: at(RESET),
            downstream: Downstream::Failing {
                after: MS,
                pushback: None,
            },
        },
        Phase {
            from: at(BACK),
            downstream: healthy,
        },
    ];
    let client = |jitter: Jitter| ClientConfig {
        max_attempts: 5,
        backoff: Backoff::new(200 * MS, Duration::from_secs(5), jitter, 10 * MS)
            .expect("valid backoff"),
        // A per-attempt timeout longer than the stall: the hung calls fail at the reset, not
        // one by one at their own timeouts.
        timeout: Duration::from_secs(5),
        deadlines: Deadlines::PerAttempt,
        ..naive_client(Duration::from_secs(5))
    };
    let variants = MODES
        .iter()
        .map(|&(name, jitter)| Variant {
            name: name.to_owned(),
            client: client(jitter),
            server: naive_server(workers),
        })
        .collect();
    let part = Scenario {
        name: ScenarioKind::Jitter.as_str(),
        model: model(&knobs, Duration::from_secs(30), rate, MS, phases),
        variants,
        focus: Focus {
            from: RESET,
            to: BACK + 5.0,
            capacity: capacity(workers, MS, 20 * MS),
            recover_at: Some(BACK),
        },
        notes: Vec::new(),
    };
    Claim {
        name: ScenarioKind::Jitter.as_str(),
        parts: vec![part],
        notes: vec![
            format!(
                "{:.0}/s offered, 20 ms calls; from {STALL:.0} s the downstream hangs and at {RESET:.0} s every hung call fails at once (a reset of all its connections); it refuses every call (1 ms) until {BACK:.0} s",
                rate * knobs.scale
            ),
            "clients: 5 attempts, backoff ceilings 200 ms, 400 ms, 800 ms and 1.6 s (cap 5 s, floor 10 ms), a 5 s timeout per attempt, no budget and no storm alarm, so that the jitter alone differs: none (the ceiling itself), full (uniform below the ceiling), equal (upper half), decorrelated (up to 3x the previous delay). Peak: the most retries sent in one row (100 ms rows unless --interval says otherwise), per second. Drained: from the downstream's return until retries stay at or below 10 % of first attempts".to_owned(),
        ],
        conclude,
    }
}

/// The most retries sent in one row, per second.
fn peak(run: &VariantRun, interval: f64) -> f64 {
    let most = run
        .rows
        .iter()
        .map(|r| r.offered_retries)
        .max()
        .unwrap_or(0);
    most as f64 / interval
}

/// Seconds from the downstream's return until retries stay at or below [`DRAINED`] of the
/// first attempts (to the end of the last row above it).
fn drain(run: &VariantRun, interval: f64) -> f64 {
    let last = rows_in(run, BACK, f64::INFINITY)
        .filter(|r| r.offered_retries as f64 > DRAINED * r.offered_originals as f64)
        .map(|r| r.t + interval)
        .fold(BACK, f64::max);
    last - BACK
}

fn interval_of(run: &VariantRun) -> f64 {
    match run.rows.as_slice() {
        [a, b, ..] => b.t - a.t,
        _ => 1.0,
    }
}

fn conclude(runs: &mut [VariantRun]) -> String {
    for run in runs.iter_mut() {
        let interval = interval_of(run);
        let originals = rows_in(run, 0.0, STALL)
            .map(|r| r.offered_originals)
            .sum::<u64>() as f64
            / STALL;
        let p = peak(run, interval);
        run.extra = vec![
            (
                format!("peak retries/s (in one {:.0} ms row)", interval * 1e3),
                format!(
                    "{p:.0} ({:.1}x the first attempts' rate)",
                    ratio(p, originals)
                ),
            ),
            ("retries sent".into(), run.summary.retries.to_string()),
            (
                "drained after the return".into(),
                format!("{:.1} s", drain(run, interval)),
            ),
        ];
    }
    let figure = |name: &str| {
        find(runs, name).map(|r| {
            let interval = interval_of(r);
            (peak(r, interval), drain(r, interval))
        })
    };
    match (
        figure("no-jitter"),
        figure("full"),
        figure("equal"),
        figure("decorrelated"),
    ) {
        (Some(none), Some(full), Some(equal), Some(dec)) => format!(
            "what the numbers show: without jitter the failures that came together come back together: retries peak at {:.0}/s in one row, {:.1}x full jitter's {:.0}/s, {:.1}x equal's {:.0}/s and {:.1}x decorrelated's {:.0}/s; drained {:.1} s after the return without jitter, {:.1} s full, {:.1} s equal, {:.1} s decorrelated",
            none.0,
            ratio(none.0, full.0),
            full.0,
            ratio(none.0, equal.0),
            equal.0,
            ratio(none.0, dec.0),
            dec.0,
            none.1,
            full.1,
            equal.1,
            dec.1
        ),
        _ => "what the numbers show: run all four modes to compare their peaks".to_owned(),
    }
}
