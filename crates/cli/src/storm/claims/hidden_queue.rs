//! Client-side hidden queues (2.1.4): one HTTP/2 connection allows MAX_CONCURRENT_STREAMS
//! calls at once, a client pool a fixed number: a concurrency limit on the client, and by
//! Little's law a ceiling of `limit / latency` requests per second. The calls beyond it wait
//! in the client, where no server metric sees them: only a pending-queue gauge does.
//!
//! Here the engine's "server" is the client's connection: its limit is the streams (or the
//! pool), its queue the pending calls, its work the call to the real server (whose own
//! latency is the row's server-side p99).

use std::time::Duration;

use super::{Claim, ratio, rows_in};
use crate::storm::engine::{ClientConfig, Downstream, Phase};
use crate::storm::kind::ScenarioKind;
use crate::storm::scenario::{
    Knobs, SECOND, Scenario, Variant, lognormal, model, naive_client, naive_server, scaled,
};
use crate::storm::series::Focus;
use crate::storm::{SimError, VariantRun};

pub(super) fn build(knobs: Knobs) -> Result<Claim, SimError> {
    let latency = lognormal(400, 600);
    let offered = knobs.rate.unwrap_or(2_500.0);
    let streams = scaled(100.0, knobs.scale);
    // Little's law: L = lambda x W in flight on average; 1.2x for the tail.
    let pool = scaled(offered * latency.mean().as_secs_f64() * 1.2, knobs.scale);
    let phases = vec![Phase {
        from: Duration::ZERO,
        downstream: Downstream::Latency(latency),
    }];
    // One attempt, and a timeout beyond the run: every wait shows, none is cut short.
    let client = ClientConfig {
        max_attempts: 1,
        ..naive_client(120 * SECOND)
    };
    let ceiling = streams as f64 / latency.mean().as_secs_f64();
    let part = Scenario {
        name: ScenarioKind::HiddenQueue.as_str(),
        model: model(&knobs, 30 * SECOND, offered, Duration::ZERO, phases),
        variants: vec![
            Variant {
                name: format!("streams-{streams}"),
                client: client.clone(),
                server: naive_server(streams),
            },
            Variant {
                name: format!("pool-{pool}"),
                client,
                server: naive_server(pool),
            },
        ],
        focus: Focus {
            from: 0.0,
            to: f64::INFINITY,
            capacity: ceiling,
            recover_at: None,
        },
        notes: Vec::new(),
    };
    Ok(Claim {
        name: ScenarioKind::HiddenQueue.as_str(),
        parts: vec![part],
        notes: vec![
            format!(
                "{:.0}/s offered to a server that answers in 400 ms (p99 600 ms) whatever the load; one attempt, no timeout within the run",
                offered * knobs.scale
            ),
            format!(
                "streams-{streams}: every call over one HTTP/2 connection whose MAX_CONCURRENT_STREAMS is {streams}: by Little's law at most {streams} / 0.4 s = {ceiling:.0}/s; the rest wait in the client. pool-{pool}: a pool sized by Little's law (lambda x W x 1.2). In the charts, the queue is the client's pending calls and in flight the calls at the server; the server-side p99 is what the server's latency metric shows"
            ),
        ],
        conclude,
    })
}

/// Goodput per second over the run.
fn goodput(run: &VariantRun) -> f64 {
    let rows: Vec<_> = rows_in(run, 0.0, f64::INFINITY).collect();
    let seconds = rows.len() as f64 * interval_of(run);
    ratio(rows.iter().map(|r| r.goodput).sum::<u64>() as f64, seconds)
}

fn interval_of(run: &VariantRun) -> f64 {
    match run.rows.as_slice() {
        [a, b, ..] => b.t - a.t,
        _ => 1.0,
    }
}

/// The worst server-side p99 of the run, ms.
fn server_p99(run: &VariantRun) -> f64 {
    run.rows
        .iter()
        .map(|r| r.service_p99_ms)
        .fold(0.0, f64::max)
}

fn pending_at_end(run: &VariantRun) -> u64 {
    run.rows.last().map_or(0, |r| r.queue)
}

fn conclude(runs: &mut [VariantRun]) -> String {
    for run in runs.iter_mut() {
        run.extra = vec![
            ("goodput/s".into(), format!("{:.0}", goodput(run))),
            (
                "server-side p99 (the server's metric)".into(),
                format!("{:.0} ms", server_p99(run)),
            ),
            (
                "client-side p99 (worst row)".into(),
                format!("{:.0} ms", run.summary.focus_p99_ms),
            ),
            (
                "pending in the client at the end".into(),
                pending_at_end(run).to_string(),
            ),
        ];
    }
    let streams = runs.iter().find(|r| r.policy.starts_with("streams-"));
    let pool = runs.iter().find(|r| r.policy.starts_with("pool-"));
    match (streams, pool) {
        (Some(s), Some(p)) => format!(
            "what the numbers show: behind {} streams the client gets {:.0}/s of the {:.0}/s it offers while the server answers every call in a p99 of {:.0} ms and holds {} calls: nothing on the server is wrong. The wait is in the client: {} calls pending at the end and a client p99 of {:.0} ms, seen only by a pending-queue gauge. Sized by Little's law, {} gets {:.0}/s with the same server p99 ({:.0} ms)",
            s.policy.trim_start_matches("streams-"),
            goodput(s),
            s.summary.stability.a0,
            server_p99(s),
            s.rows.last().map_or(0, |r| r.inflight),
            pending_at_end(s),
            s.summary.focus_p99_ms,
            p.policy,
            goodput(p),
            server_p99(p)
        ),
        _ => "what the numbers show: run both variants to compare them".to_owned(),
    }
}
