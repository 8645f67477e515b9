//! The live scenarios the simulator mirrors (`slowdown`, `overload`, `outage`): what the PSP
//! does, what is offered and which variants are compared, declared once for both. The live run
//! runs the plan; [`mirror`] reads the same plan into `storm sim`'s model of it (see
//! `super::mirror`), and the report puts both side by side.

use std::time::Duration;

use super::mirror::{self as sim, LIVE_LOCAL, places};
use super::plan::{MS, NORMAL, Phase, Plan, S, healthy, variant};
use crate::storm::kind::ScenarioKind;
use crate::storm::scenario::{Scenario, capacity};
use crate::storm::series::Focus;

/// The PSP slows from 100 ms to 600 ms for 20 s at 200/s: naive against backstop clients.
pub(super) fn slowdown() -> Plan {
    Plan {
        rate: Some(200.0),
        capacity_multiple: 1.0,
        duration: S(40),
        recovery_at: Some(S(30)),
        burst: None,
        series_interval: None,
        probe: None,
        probe_rate: 2_000.0,
        phases: vec![
            healthy(S(0), NORMAL),
            healthy(S(10), MS(600)),
            healthy(S(30), NORMAL),
        ],
        variants: vec![
            variant(
                "naive",
                vec!["--max-inflight", "64"],
                vec!["--policy", "naive"],
            ),
            variant("backstop", vec!["--max-inflight", "64"], vec![]),
        ],
    }
}

/// 3x the measured capacity for 20 s.
pub(super) fn overload() -> Plan {
    Plan {
        rate: None,
        capacity_multiple: 3.0,
        duration: S(20),
        recovery_at: None,
        burst: None,
        series_interval: None,
        probe: None,
        probe_rate: 2_000.0,
        phases: vec![healthy(S(0), NORMAL)],
        variants: vec![variant("backstop", vec!["--max-inflight", "16"], vec![])],
    }
}

/// The PSP refuses everything for 10 s, then comes back with cold-start latency; the backstop
/// client and server against each with one control off, and naive clients.
pub(super) fn outage() -> Plan {
    Plan {
        rate: Some(200.0),
        capacity_multiple: 1.0,
        duration: S(40),
        recovery_at: Some(S(20)),
        burst: None,
        series_interval: None,
        probe: None,
        probe_rate: 2_000.0,
        phases: vec![
            healthy(S(0), NORMAL),
            Phase {
                unavailable: true,
                ..healthy(S(10), NORMAL)
            },
            // Back, cold: slow for a while before it is warm again.
            healthy(S(20), MS(400)),
            healthy(S(25), NORMAL),
        ],
        variants: vec![
            variant("backstop", vec!["--max-inflight", "64"], vec![]),
            variant(
                "no-slow-start",
                vec!["--max-inflight", "64", "--no-slow-start"],
                vec![],
            ),
            variant(
                "no-storm-alarm",
                vec!["--max-inflight", "64"],
                vec!["--no-storm-alarm"],
            ),
            variant(
                "naive",
                vec!["--max-inflight", "64"],
                vec!["--policy", "naive"],
            ),
        ],
    }
}

/// `storm sim`'s mirror of the live run of `scenario` at the time scale `scale`, seeded with
/// `seed`: the same rate (or the same multiple of `capacity_per_s`, the capacity the live run
/// measured; else what its places serve at the PSP's latency), places, PSP phases, deadlines
/// and variants. `None` for the scenarios without one (the claims': `storm sim --scenario
/// NAME` is their deterministic version, at its own parameters).
pub(super) fn mirror(
    scenario: ScenarioKind,
    seed: u64,
    scale: f64,
    capacity_per_s: Option<f64>,
) -> Option<Scenario> {
    let secs = Duration::as_secs_f64;
    match scenario {
        ScenarioKind::Slowdown => {
            let plan = slowdown().scaled(scale);
            let places = places(&plan.variants[0])?;
            // The slow phase, from its start to the PSP's recovery.
            let slow = &plan.phases[1];
            let (from, to) = (secs(&slow.at), secs(&plan.phases[2].at));
            let focus = Focus {
                from,
                to,
                capacity: capacity(places, LIVE_LOCAL, slow.latency),
                recover_at: Some(to),
            };
            let notes = vec![format!(
                "simulated mirror of the live run: {places} places, {:.0}/s, PSP {} ms -> {} ms \
                 from {from:.0} s to {to:.0} s, 2 s deadlines; both clients against the gate",
                plan.rate?,
                plan.phases[0].latency.as_millis(),
                slow.latency.as_millis()
            )];
            sim::mirror("live-slowdown", &plan, seed, plan.rate?, focus, notes)
        }
        ScenarioKind::Overload => {
            let plan = overload().scaled(scale);
            let places = places(&plan.variants[0])?;
            let latency = plan.phases[0].latency;
            let nominal = capacity(places, Duration::ZERO, latency);
            let measured = capacity_per_s.filter(|c| *c > 0.0).unwrap_or(nominal);
            let rate = plan.capacity_multiple * measured;
            let seconds = secs(&plan.duration);
            let focus = Focus {
                from: 0.0,
                to: seconds,
                capacity: capacity(places, LIVE_LOCAL, latency),
                recover_at: None,
            };
            let notes = vec![format!(
                "simulated mirror of the live run: {places} places, PSP {} ms, {rate:.0}/s \
                 offered ({}x {measured:.1}/s) for {seconds:.0} s, 2 s deadlines",
                latency.as_millis(),
                plan.capacity_multiple
            )];
            sim::mirror("live-overload", &plan, seed, rate, focus, notes)
        }
        ScenarioKind::Outage => {
            let plan = outage().scaled(scale);
            let places = places(&plan.variants[0])?;
            // Down, back cold, warm again.
            let [_, down, cold, warm] = &plan.phases[..] else {
                return None;
            };
            let (up, warm) = (secs(&cold.at), secs(&warm.at));
            let focus = Focus {
                from: up,
                to: warm,
                capacity: capacity(places, LIVE_LOCAL, cold.latency),
                recover_at: Some(up),
            };
            let notes = vec![format!(
                "simulated mirror of the live run: {places} places, {:.0}/s, PSP {} ms; 503 \
                 after {} ms from {:.0} s to {up:.0} s, {} ms until {warm:.0} s; 2 s deadlines",
                plan.rate?,
                plan.phases[0].latency.as_millis(),
                down.latency.as_millis(),
                secs(&down.at),
                cold.latency.as_millis()
            )];
            sim::mirror("live-outage", &plan, seed, plan.rate?, focus, notes)
        }
        ScenarioKind::LittlesLaw
        | ScenarioKind::OutageRecovery
        | ScenarioKind::Hedging
        | ScenarioKind::Jitter
        | ScenarioKind::Utilization
        | ScenarioKind::Cold
        | ScenarioKind::Burst
        | ScenarioKind::HedgeDrift
        | ScenarioKind::HiddenQueue
        | ScenarioKind::Amplification => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storm::simulate_all;

    #[test]
    fn the_outage_plan_compares_with_and_without_slow_start() {
        let plan = outage();
        let flags = |name: &str| {
            let v = plan.variants.iter().find(|v| v.name == name).unwrap();
            (v.serve.clone(), v.load.clone())
        };
        let (serve, load) = flags("no-slow-start");
        assert!(serve.contains(&"--no-slow-start"));
        assert_eq!(load, flags("backstop").1, "only the server differs");
    }

    /// The mirror of `storm run --scenario slowdown`: naive clients against the gate send
    /// more attempts than backstop's, and the same seed gives the same runs.
    #[test]
    fn the_live_slowdown_mirror_shows_naive_amplifying() {
        let runs = simulate_all(&mirror(ScenarioKind::Slowdown, 1, 0.25, None).unwrap());
        let by = |name: &str| &runs.iter().find(|r| r.policy == name).unwrap().summary;
        assert!(by("naive").amplification > by("backstop").amplification + 0.2);
        assert!(by("backstop").amplification < 1.15);
        let again = simulate_all(&mirror(ScenarioKind::Slowdown, 1, 0.25, None).unwrap());
        assert_eq!(runs[0].summary.attempts, again[0].summary.attempts);
    }

    /// The mirror of `storm run --scenario outage`: the live plan's variants; slow start hands
    /// the returning PSP a few calls where the gate without it hands all 64 places'; naive
    /// clients multiply their attempts, backstop's do not.
    #[test]
    fn the_live_outage_mirror_compares_slow_start_and_clients() {
        let runs = simulate_all(&mirror(ScenarioKind::Outage, 1, 0.25, None).unwrap());
        let names: Vec<&str> = runs.iter().map(|r| r.policy.as_str()).collect();
        let live: Vec<&str> = outage().variants.iter().map(|v| v.name).collect();
        assert_eq!(names, live);
        let by = |name: &str| &runs.iter().find(|r| r.policy == name).unwrap().summary;
        assert_eq!(by("no-slow-start").return_inflight, Some(64));
        assert!(by("backstop").return_inflight.unwrap() <= 16);
        assert!(by("naive").amplification > by("backstop").amplification + 0.5);
        assert!(by("backstop").amplification < 1.1);
        assert!(by("no-storm-alarm").amplification > by("backstop").amplification);
        let again = simulate_all(&mirror(ScenarioKind::Outage, 1, 0.25, None).unwrap());
        for (a, b) in runs.iter().zip(&again) {
            assert_eq!(a.summary, b.summary);
        }
    }

    /// The mirror of `storm run --scenario overload` offers three times the capacity it is
    /// given (or 16 places at 100 ms) and serves about what 16 places can.
    #[test]
    fn the_live_overload_mirror_offers_three_times_the_capacity() {
        assert_eq!(
            mirror(ScenarioKind::Overload, 1, 0.25, Some(140.0))
                .unwrap()
                .model
                .rate,
            420.0
        );
        let scenario = mirror(ScenarioKind::Overload, 1, 0.25, None).unwrap();
        assert_eq!(scenario.model.rate, 480.0);
        assert_eq!(scenario.names(), ["backstop"]);
        let runs = simulate_all(&scenario);
        let s = &runs[0].summary;
        assert!(s.focus_goodput > 0.9 * s.focus_capacity, "{s:?}");
        assert!(s.focus_goodput <= s.focus_capacity * 1.05, "{s:?}");
        assert!(s.amplification < 1.05, "{s:?}");
    }
}
