//! Each claim's headline on a scaled-down run, and each claim's determinism.

use std::time::Duration;

use crate::storm::scenario::{ScenarioKind, ServerLimit};
use crate::storm::{Report, SimArgs, VariantRun, simulate};

/// A scaled-down run of `scenario` (debug builds run these in CI).
fn run(scenario: ScenarioKind, scale: f64, seconds: Option<u64>, seed: u64) -> Report {
    let args = SimArgs {
        scenario,
        policy: "all".to_owned(),
        seed,
        duration: seconds.map(Duration::from_secs),
        rate: None,
        interval: None,
        scale,
        limit: ServerLimit::Fixed,
        throttle: false,
        json: false,
        csv: false,
        report: None,
    };
    simulate(&args).unwrap()
}

fn by<'a>(report: &'a Report, policy: &str) -> &'a VariantRun {
    report
        .runs
        .iter()
        .find(|r| r.policy == policy)
        .unwrap_or_else(|| panic!("no run {policy}"))
}

/// The number at the start of the scenario's figure `key` of run `policy`.
fn figure(report: &Report, policy: &str, key: &str) -> f64 {
    let run = by(report, policy);
    let (_, value) = run
        .extra
        .iter()
        .find(|(k, _)| k.starts_with(key))
        .unwrap_or_else(|| panic!("{policy} has no {key}: {:?}", run.extra));
    value
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{key} of {policy} is not a number: {value}"))
}

fn json(report: &Report) -> String {
    serde_json::to_string(report).unwrap()
}

/// Every claim gives the same output for the same seed, and another for another seed.
#[test]
fn each_claim_is_deterministic_for_a_seed() {
    let small = [
        (ScenarioKind::Jitter, 0.1, Some(20)),
        (ScenarioKind::Utilization, 0.1, Some(25)),
        (ScenarioKind::Cold, 0.1, Some(25)),
    ];
    for (kind, scale, seconds) in small {
        let a = json(&run(kind, scale, seconds, 5));
        assert_eq!(a, json(&run(kind, scale, seconds, 5)), "{kind:?}");
        assert_ne!(a, json(&run(kind, scale, seconds, 6)), "{kind:?}");
    }
}

/// Clients that failed together and back off without jitter come back together: the peak of
/// retries in one 100 ms row is several times what decorrelated jitter lets through, and
/// well above full jitter's.
#[test]
fn jitter_without_it_retries_pulse() {
    let report = run(ScenarioKind::Jitter, 0.2, Some(22), 1);
    let peak = |p| figure(&report, p, "peak retries/s");
    let none = peak("no-jitter");
    assert!(
        none > 3.0 * peak("decorrelated"),
        "{none} {}",
        peak("decorrelated")
    );
    assert!(none > 1.3 * peak("full"), "{none} {}", peak("full"));
    assert!(none > 1.1 * peak("equal"), "{none} {}", peak("equal"));
    // The pulse is the synchronized batch: over 10x the first attempts' rate.
    assert!(none > 10.0 * 200.0, "{none}");
    assert!(
        report
            .notes
            .last()
            .unwrap()
            .starts_with("what the numbers show")
    );
}

/// The same jittered retries after the same slowdown: with 30 % headroom or more the backlog
/// drains; at 90 % and 95 % the retries keep the server from ever catching up.
#[test]
fn utilization_survives_at_70_and_collapses_at_90() {
    let report = run(ScenarioKind::Utilization, 0.2, None, 1);
    let good = |p| figure(&report, p, "goodput / first attempts");
    assert!(good("util-50") > 0.95 && good("util-70") > 0.95);
    assert!(good("util-90") < 0.2 && good("util-95") < 0.2);
    let retries = |p| figure(&report, p, "retries per first attempt");
    assert!(retries("util-70") < 0.1 && retries("util-90") > 1.0);
}

/// A cold downstream given every worker's call at its return slows past the deadline and is
/// never warmed: goodput collapses for the rest of the run. The ramp of slow start gives it
/// calls it can finish, and it is back within seconds.
#[test]
fn cold_slow_start_recovers_where_without_it_goodput_collapses() {
    let report = run(ScenarioKind::Cold, 0.2, Some(45), 1);
    let goodput = |p| figure(&report, p, "goodput/s after the return");
    // 400/s offered.
    assert!(goodput("slow-start") > 300.0, "{}", goodput("slow-start"));
    assert!(
        goodput("no-slow-start") < 40.0,
        "{}",
        goodput("no-slow-start")
    );
    let errors = |p| figure(&report, p, "error rate after the return");
    assert!(errors("slow-start") < 20.0 && errors("no-slow-start") > 90.0);
    assert!(
        by(&report, "slow-start")
            .summary
            .recovery_s
            .is_some_and(|s| s < 10.0)
    );
    assert!(by(&report, "no-slow-start").summary.recovery_s.is_none());
}
