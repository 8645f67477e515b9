//! Each claim's headline on a scaled-down run, and each claim's determinism.

use std::time::Duration;

use crate::storm::kind::ScenarioKind;
use crate::storm::scenario::ServerLimit;
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
        (ScenarioKind::Utilization, 0.1, Some(35)),
        (ScenarioKind::Cold, 0.1, Some(25)),
        (ScenarioKind::Burst, 0.1, Some(20)),
        (ScenarioKind::HedgeDrift, 0.5, Some(60)),
        (ScenarioKind::HiddenQueue, 0.1, Some(10)),
        (ScenarioKind::Amplification, 0.2, Some(15)),
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

/// A queue sized by the bound absorbs the burst: below it refuses, at it hardly, above it
/// not at all. Under sustained overload the queue only adds latency: a rate limit serves
/// nearly as much at a fraction of the p99.
#[test]
fn burst_queue_bound_absorbs_and_sustained_overload_wants_a_rate_limit() {
    let report = run(ScenarioKind::Burst, 0.2, None, 1);
    // At scale 0.2: mu = 200/s, a burst of 300/s for 2 s: Q = 200.
    let refused = |p| figure(&report, p, "refused");
    assert!(refused("queue-50") > 100.0, "{}", refused("queue-50"));
    assert!(refused("queue-200") < 0.2 * refused("queue-50"));
    assert_eq!(refused("queue-800"), 0.0);
    let p99 = |p| figure(&report, p, "worst p99 in the overload");
    let good = |p| figure(&report, p, "goodput/s in the overload");
    assert!(p99("sustained-queue-200") > 3.0 * p99("sustained-rate-limit"));
    // At 20 workers a loss system loses more to Poisson bunching than at 100 (96 % there).
    assert!(good("sustained-rate-limit") > 0.85 * good("sustained-queue-200"));
}

/// A fixed hedge delay at the unloaded p95 hedges about 5 % at low load and nearly every
/// request near saturation, where the hedges' own load collapses goodput; the budget holds
/// the share at its 10 %.
#[test]
fn hedge_drift_follows_load_and_the_budget_caps_it() {
    let report = run(ScenarioKind::HedgeDrift, 1.0, None, 1);
    let share = |p, level| figure(&report, p, &format!("at {level} % load"));
    assert!(share("no-budget", 30) < 8.0, "{}", share("no-budget", 30));
    assert!(share("no-budget", 90) > 50.0, "{}", share("no-budget", 90));
    for level in [30, 50, 70, 80, 90, 95] {
        assert!(
            share("budget", level) <= 11.0,
            "{level}: {}",
            share("budget", level)
        );
    }
    let goodput = |p: &str| {
        let run = by(&report, p);
        let (_, v) = run
            .extra
            .iter()
            .find(|(k, _)| k.starts_with("at 90 %"))
            .unwrap();
        v.split(", ")
            .nth(1)
            .unwrap()
            .trim_end_matches("/s")
            .parse::<f64>()
            .unwrap()
    };
    assert!(goodput("budget") > 3.0 * goodput("no-budget"));
}

/// 100 streams at 400 ms carry 250/s (Little's law) of 2500/s offered; the server's own
/// latency stays at its 400 ms while the calls pile up in the client. A pool sized by
/// Little's law carries the load.
#[test]
fn hidden_queue_caps_throughput_where_no_server_metric_shows_it() {
    let report = run(ScenarioKind::HiddenQueue, 0.2, Some(20), 1);
    // At scale 0.2: 500/s offered, 20 streams: 50/s.
    let good = |p| figure(&report, p, "goodput/s");
    assert!(
        (good("streams-20") - 50.0).abs() < 5.0,
        "{}",
        good("streams-20")
    );
    assert!(good("pool-240") > 450.0, "{}", good("pool-240"));
    let server = |p| figure(&report, p, "server-side p99");
    let client = |p| figure(&report, p, "client-side p99");
    assert!(server("streams-20") < 1_000.0 && client("streams-20") > 10_000.0);
    assert!(figure(&report, "streams-20", "pending in the client") > 5_000.0);
    assert_eq!(figure(&report, "pool-240", "pending in the client"), 0.0);
}

/// Three layers of 3 attempts in front of a failing hop: naive clients send it about 27
/// attempts per user request; budgets at every layer still compound; retrying at one layer
/// with the budget (and the storm alarm) holds it to 1.1 or less.
#[test]
fn amplification_naive_multiplies_backstop_retries_at_one_layer() {
    let report = run(ScenarioKind::Amplification, 1.0, Some(20), 1);
    let per_request = |p| figure(&report, p, "attempts at C per user request");
    assert!(per_request("naive") >= 20.0, "{}", per_request("naive"));
    assert!(
        per_request("backstop") <= 1.1,
        "{}",
        per_request("backstop")
    );
    assert!(per_request("budget-one-layer") < per_request("budget-every-hop"));
    assert!(per_request("budget-every-hop") > 1.2);
    // Before the failure every variant sends one attempt per user request.
    for p in ["naive", "budget-every-hop", "backstop"] {
        assert!((figure(&report, p, "... before it fails") - 1.0).abs() < 0.01);
    }
}

/// The load schedule: arrivals follow the rate of the moment (800/s, 1500/s for the burst's
/// 2 s, 800/s again; here at scale 0.2).
#[test]
fn arrivals_follow_the_load_schedule() {
    let report = run(ScenarioKind::Burst, 0.2, Some(20), 1);
    let run = by(&report, "queue-800");
    let rate = |from: f64, to: f64| {
        let rows: Vec<_> = run
            .rows
            .iter()
            .filter(|r| r.t >= from && r.t < to)
            .collect();
        rows.iter().map(|r| r.offered_originals).sum::<u64>() as f64 / rows.len() as f64
    };
    let (before, burst, after) = (rate(0.0, 10.0), rate(10.0, 12.0), rate(12.0, 20.0));
    assert!((before - 160.0).abs() < 16.0, "{before}");
    assert!((burst - 300.0).abs() < 40.0, "{burst}");
    assert!((after - 160.0).abs() < 16.0, "{after}");
}
