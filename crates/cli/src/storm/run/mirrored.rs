//! The live scenarios the simulator mirrors (`slowdown`, `overload`, `outage`): what the PSP
//! does, what is offered and which variants are compared. Their mirrors, the same scenarios as
//! `storm sim` sees them, are `storm::scenario::live_*`; the report puts both side by side.

use super::plan::{MS, NORMAL, Phase, Plan, S, healthy, variant};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
