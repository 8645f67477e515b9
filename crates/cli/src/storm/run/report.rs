//! The run's HTML report: the measured variants beside the simulator's mirror of the same
//! scenario, with a text on where the two are expected to differ.

use super::mirrored;
use super::result::RunResult;
use crate::report;
use crate::storm::kind::ScenarioKind;
use crate::storm::scenario;

/// The run as a report: one chart series per variant.
pub(super) fn to_report(result: &RunResult) -> report::Report {
    let mut runs: Vec<report::Run> = result
        .variants
        .iter()
        .map(|v| report::Run {
            name: v.name.clone(),
            summary: vec![
                ("offered".into(), format!("{:.0} /s", v.rate)),
                ("goodput".into(), format!("{:.1} /s", v.goodput_per_s)),
                (
                    "attempts per request".into(),
                    format!("{:.3}", v.attempts_per_logical),
                ),
                (
                    "recovery".into(),
                    v.recovery_s.map_or("-".into(), |s| format!("{s:.0} s")),
                ),
                (
                    "peak server RSS".into(),
                    v.peak_rss_mib.map_or("-".into(), |m| format!("{m:.0} MiB")),
                ),
                (
                    "intents left running".into(),
                    v.intents_running.map_or("-".into(), |n| n.to_string()),
                ),
            ]
            .into_iter()
            .chain(v.figures.iter().map(|(k, x)| (k.clone(), figure(*x))))
            .collect(),
            rows: v
                .seconds
                .iter()
                .map(|s| report::Row {
                    time_s: s.t_s + 1.0,
                    offered_originals_per_s: Some(s.originals as f64),
                    offered_retries_per_s: Some((s.retries + s.hedges) as f64),
                    goodput_per_s: Some(s.ok as f64),
                    refused_per_s: Some(s.rejected as f64),
                    queue_depth: s.queue,
                    p99_ms: s.p99_ms,
                    admission_limit: s.limit,
                    in_flight: s.inflight,
                    retry_ratio: (s.originals > 0)
                        .then(|| (s.retries + s.hedges) as f64 / s.originals as f64),
                    ..report::Row::default()
                })
                .collect(),
        })
        .collect();
    // The simulator's mirror of the same scenario, beside the measured runs.
    if let Some(mirror) = mirror(result) {
        for sim in crate::storm::simulate_all(&mirror) {
            let name = format!("sim: {}", sim.policy);
            runs.push(crate::storm::report_run(&sim, name, 1.0));
        }
    }
    report::Report {
        format: String::new(),
        title: format!("storm run: {}", result.scenario.as_str()),
        description: describe(result),
        runs,
    }
}

/// Seeds the simulator's mirrors on the report.
const MIRROR_SEED: u64 = 1;

/// `storm sim`'s mirror of the scenario `result` ran, on the same time scale (see
/// [`mirrored::mirror`]).
fn mirror(result: &RunResult) -> Option<scenario::Scenario> {
    mirrored::mirror(
        result.scenario,
        MIRROR_SEED,
        result.time_scale,
        result.capacity_per_s,
    )
}

/// A figure as the report shows it: shares and ratios with three decimals, counts whole.
pub(super) fn figure(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{x:.0}")
    } else {
        format!("{x:.3}")
    }
}

fn describe(result: &RunResult) -> String {
    if let Some(text) = super::claims_text::describe(result) {
        return text;
    }
    let what = match result.scenario {
        ScenarioKind::Slowdown => {
            "The PSP's latency goes from 100 ms to 600 ms for half the run, then back, under a \
             steady offered load; each variant runs on its own fresh service."
        }
        ScenarioKind::Overload => {
            "The service's capacity is measured first, then it is offered three times that."
        }
        ScenarioKind::Outage => {
            "The PSP refuses every charge for a quarter of the run, then comes back slow (a cold \
             start) before it is warm again; recovery is the time from its return until a whole \
             second serves 90% of the offered load."
        }
        // Described by `claims_text`.
        ScenarioKind::Jitter
        | ScenarioKind::Utilization
        | ScenarioKind::Cold
        | ScenarioKind::Burst
        | ScenarioKind::HedgeDrift
        | ScenarioKind::HiddenQueue => "",
        // Never run live (`storm run` does not take them).
        ScenarioKind::LittlesLaw
        | ScenarioKind::OutageRecovery
        | ScenarioKind::Hedging
        | ScenarioKind::Amplification => "",
    };
    let mut text = format!(
        "{what}\n\nMeasured on loopback: a real `backstop serve` (SQLite), the PSP simulator and \
         `backstop load`; the limit, in-flight and queue figures are the server's own gauges, \
         sampled once a second."
    );
    if let Some(capacity) = result.capacity_per_s {
        text.push_str(&format!("\n\nMeasured capacity: {capacity:.1} payments/s."));
    }
    text.push_str(&format!(
        "\n\nThe runs named `sim:` are `backstop storm sim`'s mirror of this scenario (seed \
         {MIRROR_SEED}, the same time scale): the same offered rate, places, PSP phases, 2 s \
         deadlines and variants, every server with `serve`'s default gate (a fixed limit behind \
         a slow start with floor 4, the fair queue, a Retry-After computed from the queue), and \
         the clients as `load` sends: backstop with the library's client defaults and a hedge \
         after the p95; naive with 3 attempts 50 ms and 100 ms apart, a fresh 2 s deadline per \
         attempt sent to the server, and any Retry-After ignored."
    ));
    text.push_str(
        "\n\nWhere the simulator and the measured runs are expected to differ, whatever the \
         scenario: the simulated service spends a fixed 1 ms of its own on a request, the real \
         one spends CPU on HTTP, JSON, the idempotency store and SQLite writes, on a machine \
         it shares with the PSP simulator and the load generator, so its capacity is below \
         places / PSP latency and its latency has a tail the simulator does not draw (the \
         simulated PSP latency has a 10 % tail, the PSP simulator's none). Simulated arrivals \
         are Poisson, `load` starts requests evenly spaced: a simulated second of 200/s varies \
         by about 14 requests either way, a measured one does not.",
    );
    text.push_str(&match result.scenario {
        ScenarioKind::Slowdown => "\n\nIn this scenario: while the PSP takes 600 ms, 64 \
             places serve about 106/s of the 200/s offered in both. In the real service each of \
             the naive client's extra attempts goes through the idempotency store and the \
             intents table under a fresh key (SQLite writes), which the simulated service does \
             not pay for: a gap in goodput between the measured and the simulated naive runs is \
             that cost."
            .to_owned(),
        ScenarioKind::Overload => {
            let capacity = result
                .capacity_per_s
                .map_or("160/s (16 places / 100 ms)".to_owned(), |c| {
                    format!("the measured {c:.1}/s")
                });
            format!(
                "\n\nIn this scenario: both offer three times {capacity}, but the simulated \
                 server serves 16 / 101 ms = 158/s whatever was measured (the real capacity is \
                 measured because the service's own work is not known in advance), so its \
                 goodput over the measured capacity comes out above the measured run's by the \
                 ratio of the two. The real server also spends CPU refusing the excess (every \
                 refusal is an HTTP request parsed and answered, on the cores the load \
                 generator uses too); the simulated one refuses for free."
            )
        }
        ScenarioKind::Outage => {
            let scale = result.time_scale;
            format!(
                "\n\nIn this scenario: during the outage the PSP simulator answers every charge \
                 with 503 + `Retry-After: 1` after its 100 ms, and the mirror's downstream does \
                 the same, the server passing the 1 s on as the service's 503 \
                 `psp_unavailable` does; but the real service's PSP client may also retry a 503 \
                 itself after that second, within its own retry budget and storm alarm, holding \
                 a gate slot about 1.2 s, where the simulated server calls its downstream once \
                 per attempt. Neither the simulated downstream nor the PSP simulator gets slower \
                 for being given more calls at once, so in both the slow start can only cost \
                 goodput while it ramps (from 4, doubling per round trip of 400 ms, to 64 in \
                 about 2 s): what it buys, a dependency just back receiving a few calls instead \
                 of the whole backlog, shows in the in-flight figures, not in the goodput. While \
                 the PSP is cold, 64 places at 400 ms serve 160/s of the 200/s offered, so no \
                 variant is back before the PSP is warm at {:.0} s, {:.0} s after its return. \
                 Recovery is measured differently: the first whole second serving 90% of the \
                 offered rate in the real run, the first of three intervals each serving 90% of \
                 the requests it started in the simulator, which Poisson arrivals can move by a \
                 second either way.",
                25.0 * scale,
                5.0 * scale
            )
        }
        // Described by `claims_text`.
        ScenarioKind::Jitter
        | ScenarioKind::Utilization
        | ScenarioKind::Cold
        | ScenarioKind::Burst
        | ScenarioKind::HedgeDrift
        | ScenarioKind::HiddenQueue
        | ScenarioKind::LittlesLaw
        | ScenarioKind::OutageRecovery
        | ScenarioKind::Hedging
        | ScenarioKind::Amplification => String::new(),
    });
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storm::run::plan::{Plan, S};

    /// The live plan of `scenario`.
    fn plan(scenario: ScenarioKind) -> Plan {
        crate::storm::run::plan(scenario).expect("a live scenario")
    }
    use crate::storm::run::result::{Second, VariantResult};

    /// A measured run of `scenario` as `execute` returns it, one second per variant, without
    /// running anything.
    fn measured(scenario: ScenarioKind, time_scale: f64) -> RunResult {
        let variants = plan(scenario)
            .variants
            .iter()
            .map(|v| VariantResult {
                name: v.name.to_owned(),
                serve_flags: v.serve.iter().map(|s| (*s).to_owned()).collect(),
                load_flags: v.load.iter().map(|s| (*s).to_owned()).collect(),
                rate: 200.0,
                load: serde_json::json!({"logical_requests": 200, "outcomes": {"ok": 190}}),
                goodput_per_s: 190.0,
                attempts_per_logical: 1.0,
                recovery_s: None,
                peak_rss_mib: None,
                intents_running: Some(0),
                burst_load: None,
                figures: std::collections::BTreeMap::from([("hedge_share".to_owned(), 0.25)]),
                seconds: vec![Second {
                    t_s: 0.0,
                    originals: 200,
                    ok: 190,
                    ..Second::default()
                }],
            })
            .collect();
        RunResult {
            scenario,
            capacity_per_s: (scenario == ScenarioKind::Overload).then_some(143.6),
            time_scale,
            variants,
        }
    }

    #[test]
    fn every_live_scenario_is_mirrored_with_its_variants() {
        for scenario in [
            ScenarioKind::Slowdown,
            ScenarioKind::Overload,
            ScenarioKind::Outage,
        ] {
            let live: Vec<&str> = plan(scenario).variants.iter().map(|v| v.name).collect();
            let mirror = mirror(&measured(scenario, 1.0)).expect("mirrored");
            assert_eq!(mirror.names(), live, "{scenario:?}");
            assert_eq!(mirror.model.duration, plan(scenario).duration);
        }
        // The overload mirror offers three times the measured capacity.
        let overload = mirror(&measured(ScenarioKind::Overload, 0.5)).expect("mirrored");
        assert!((overload.model.rate - 3.0 * 143.6).abs() < 1e-9);
        assert_eq!(overload.model.duration, S(10));
    }

    /// The report of each live scenario carries the measured runs and, beside them, the
    /// simulator's mirror (`sim: ...`), and says where the two are expected to differ.
    #[test]
    fn the_report_puts_the_simulated_mirror_beside_every_live_scenario() {
        for scenario in [
            ScenarioKind::Slowdown,
            ScenarioKind::Overload,
            ScenarioKind::Outage,
        ] {
            let result = measured(scenario, 0.05);
            let report = to_report(&result);
            let names: Vec<&str> = report.runs.iter().map(|r| r.name.as_str()).collect();
            for variant in &result.variants {
                let sim = format!("sim: {}", variant.name);
                assert!(names.contains(&variant.name.as_str()), "{names:?}");
                assert!(
                    names.contains(&sim.as_str()),
                    "{sim} missing from {names:?}"
                );
            }
            assert_eq!(names.len(), 2 * result.variants.len(), "{names:?}");
            let sim = report
                .runs
                .iter()
                .find(|r| r.name.starts_with("sim: "))
                .unwrap();
            assert!(!sim.rows.is_empty());
            assert!(report.description.contains("The runs named `sim:`"));
            assert!(
                report.description.contains("In this scenario:"),
                "{}",
                report.description
            );
        }
    }

    /// The claims' scenarios have no simulated mirror: their report holds the measured runs,
    /// their figures, and says which `storm sim` scenario is the deterministic version.
    #[test]
    fn a_claims_report_holds_the_measured_runs_and_names_its_simulation() {
        for scenario in [
            ScenarioKind::Jitter,
            ScenarioKind::Utilization,
            ScenarioKind::Cold,
            ScenarioKind::Burst,
            ScenarioKind::HedgeDrift,
            ScenarioKind::HiddenQueue,
        ] {
            let result = measured(scenario, 0.1);
            let report = to_report(&result);
            let names: Vec<&str> = report.runs.iter().map(|r| r.name.as_str()).collect();
            let live: Vec<&str> = plan(scenario).variants.iter().map(|v| v.name).collect();
            assert_eq!(names, live, "{scenario:?}");
            let name = scenario.as_str();
            assert!(
                report
                    .description
                    .contains(&format!("storm sim --scenario {name}")),
                "{}",
                report.description
            );
            assert!(
                report.runs[0]
                    .summary
                    .iter()
                    .any(|(k, v)| k == "hedge_share" && v == "0.250"),
                "{:?}",
                report.runs[0].summary
            );
        }
    }
}
