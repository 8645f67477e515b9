//! Queue sizing under bursts (2.6.2): a queue absorbs a burst when it holds
//! `Q >= (lambda_peak - mu) x T_burst`; under sustained overload it absorbs nothing, only
//! adds its length to every wait, and a rate limit (refuse what cannot start) serves as much.

use std::time::Duration;

use super::{Claim, find, ratio, rows_in};
use crate::storm::engine::{ClientConfig, Downstream, Phase, ServerConfig};
use crate::storm::kind::ScenarioKind;
use crate::storm::scenario::{
    Knobs, SECOND, Scenario, Variant, capacity, lognormal, model, naive_client, naive_server,
    scaled,
};
use crate::storm::series::Focus;
use crate::storm::{SimError, VariantRun};

/// The burst (or the sustained overload) starts here...
const FROM: f64 = 10.0;
/// ...and the burst lasts this long.
const T_BURST: f64 = 2.0;
/// The sustained overload is read from here on (its queue full).
const SUSTAINED_FROM: f64 = 15.0;

pub(super) fn build(knobs: Knobs) -> Result<Claim, SimError> {
    let workers = scaled(100.0, knobs.scale);
    let latency = lognormal(100, 200);
    let mu = capacity(workers, Duration::ZERO, latency.mean());
    let base = knobs.rate.unwrap_or(800.0);
    let (peak, sustained) = (1_500.0, 1_200.0);
    if base * knobs.scale >= mu {
        return Err(SimError::Unfit(format!(
            "burst needs a base load below the capacity ({mu:.0}/s); lower --rate"
        )));
    }
    let bound = ((peak * knobs.scale - mu) * T_BURST).round() as usize;
    let phases = vec![Phase {
        from: Duration::ZERO,
        downstream: Downstream::Latency(latency),
    }];
    // One attempt, no deadline told to the server, a timeout long enough that the queue's
    // wait shows in the latency instead of in timeouts.
    let client = ClientConfig {
        max_attempts: 1,
        ..naive_client(30 * SECOND)
    };
    let server = |max: usize| ServerConfig {
        max_queue: Some(max),
        ..naive_server(workers)
    };
    let variant = |name: String, max: usize| Variant {
        name,
        client: client.clone(),
        server: server(max),
    };
    let at = Duration::from_secs_f64;
    let mut burst_model = model(&knobs, 30 * SECOND, base, Duration::ZERO, phases.clone());
    burst_model.load = vec![(at(FROM), peak / base), (at(FROM + T_BURST), 1.0)];
    let mut sustained_model = model(&knobs, 30 * SECOND, base, Duration::ZERO, phases);
    sustained_model.load = vec![(at(FROM), sustained / base)];
    let focus = Focus {
        from: FROM,
        to: f64::INFINITY,
        capacity: mu,
        recover_at: None,
    };
    let sizes = [("below", bound / 4), ("at", bound), ("above", bound * 4)];
    let burst = Scenario {
        name: ScenarioKind::Burst.as_str(),
        model: burst_model,
        variants: sizes
            .iter()
            .map(|&(_, q)| variant(format!("queue-{q}"), q))
            .collect(),
        focus,
        notes: Vec::new(),
    };
    let overload = Scenario {
        name: ScenarioKind::Burst.as_str(),
        model: sustained_model,
        variants: vec![
            variant(format!("sustained-queue-{bound}"), bound),
            variant("sustained-rate-limit".into(), 0),
        ],
        focus,
        notes: Vec::new(),
    };
    let s = knobs.scale;
    Ok(Claim {
        name: ScenarioKind::Burst.as_str(),
        parts: vec![burst, overload],
        notes: vec![
            format!(
                "{workers} workers at 100 ms (p99 200 ms): mu = {mu:.0}/s; {:.0}/s offered, one attempt each, 30 s timeout",
                base * s
            ),
            format!(
                "a burst of {:.0}/s for {T_BURST:.0} s from {FROM:.0} s: Q >= (lambda_peak - mu) x T_burst = ({:.0} - {mu:.0}) x {T_BURST:.0} = {bound}; queues of {} (below), {bound} (at) and {} (above the bound); a full queue refuses",
                peak * s,
                peak * s,
                bound / 4,
                bound * 4
            ),
            format!(
                "sustained overload: {:.0}/s from {FROM:.0} s to the end, behind the queue of {bound} and behind a rate limit (no queue: what cannot start at once is refused); read from {SUSTAINED_FROM:.0} s",
                sustained * s
            ),
        ],
        conclude: if bound == 0 {
            conclude_nothing
        } else {
            conclude
        },
    })
}

fn conclude_nothing(_: &mut [VariantRun]) -> String {
    "what the numbers show: at this scale the bound rounds to no queue at all".to_owned()
}

/// Refusals, and the burst's excess over the capacity it could not absorb.
fn refused(run: &VariantRun) -> u64 {
    run.rows.iter().map(|r| r.refused).sum()
}

/// Goodput per second and the worst p99 (ms) in the sustained overload.
fn sustained(run: &VariantRun) -> (f64, f64) {
    let rows: Vec<_> = rows_in(run, SUSTAINED_FROM, f64::INFINITY).collect();
    let seconds = rows.len() as f64 * interval_of(run);
    let good: u64 = rows.iter().map(|r| r.goodput).sum();
    let p99 = rows.iter().map(|r| r.p99_ms).fold(0.0, f64::max);
    (ratio(good as f64, seconds), p99)
}

fn interval_of(run: &VariantRun) -> f64 {
    match run.rows.as_slice() {
        [a, b, ..] => b.t - a.t,
        _ => 1.0,
    }
}

fn conclude(runs: &mut [VariantRun]) -> String {
    for run in runs.iter_mut() {
        let mut extra = vec![
            ("refused".into(), refused(run).to_string()),
            ("peak queue".into(), run.summary.peak_queue.to_string()),
            (
                "worst p99".into(),
                format!("{:.0} ms", run.summary.focus_p99_ms),
            ),
        ];
        if run.policy.starts_with("sustained") {
            let (good, p99) = sustained(run);
            extra.push(("goodput/s in the overload".into(), format!("{good:.0}")));
            extra.push(("worst p99 in the overload".into(), format!("{p99:.0} ms")));
        }
        run.extra = extra;
    }
    let bursts: Vec<&VariantRun> = runs
        .iter()
        .filter(|r| r.policy.starts_with("queue-"))
        .collect();
    let limit = find(runs, "sustained-rate-limit");
    let queue = runs
        .iter()
        .find(|r| r.policy.starts_with("sustained-queue-"));
    let mut sentence = String::from("what the numbers show: ");
    if let [below, at, above] = bursts.as_slice() {
        sentence += &format!(
            "under the burst the queue below the bound refuses {} requests, the queue at the bound {} and the one above {} (its extra room unused: peak {} waiting); ",
            refused(below),
            refused(at),
            refused(above),
            above.summary.peak_queue
        );
    }
    if let (Some(limit), Some(queue)) = (limit, queue) {
        let (q, l) = (sustained(queue), sustained(limit));
        sentence += &format!(
            "under sustained overload the queue stays full: it serves {:.0}/s with a worst p99 of {:.0} ms, the rate limit {:.0}/s ({:.0} % of that) with {:.0} ms: past a burst the queue only adds its length to every wait, and a rate limit should take its place",
            q.0,
            q.1,
            l.0,
            100.0 * ratio(l.0, q.0),
            l.1
        );
    }
    sentence
}
