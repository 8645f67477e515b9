//! What each live scenario does: the PSP's phases, the offered load and the variants compared.

use std::time::Duration;

use super::LiveScenario;

/// How the PSP behaves from `at` on.
#[derive(Debug, Clone, Copy)]
pub(super) struct Phase {
    pub(super) at: Duration,
    pub(super) latency: Duration,
    pub(super) unavailable: bool,
}

/// One side of a comparison: the flags its `serve` and `load` get.
#[derive(Debug, Clone)]
pub(super) struct Variant {
    pub(super) name: &'static str,
    pub(super) serve: Vec<&'static str>,
    pub(super) load: Vec<&'static str>,
}

/// A scenario made concrete.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    /// Logical requests per second offered (`None`: a multiple of the measured capacity).
    pub(super) rate: Option<f64>,
    pub(super) capacity_multiple: f64,
    pub(super) duration: Duration,
    /// When the load drops back (for the recovery time), if the scenario has such a moment.
    pub(super) recovery_at: Option<Duration>,
    pub(super) phases: Vec<Phase>,
    pub(super) variants: Vec<Variant>,
}

pub(super) const MS: fn(u64) -> Duration = Duration::from_millis;
pub(super) const S: fn(u64) -> Duration = Duration::from_secs;

pub(super) fn plan(scenario: LiveScenario) -> Plan {
    let normal = MS(100);
    match scenario {
        LiveScenario::Slowdown => Plan {
            rate: Some(200.0),
            capacity_multiple: 1.0,
            duration: S(40),
            recovery_at: Some(S(30)),
            phases: vec![
                Phase {
                    at: S(0),
                    latency: normal,
                    unavailable: false,
                },
                Phase {
                    at: S(10),
                    latency: MS(600),
                    unavailable: false,
                },
                Phase {
                    at: S(30),
                    latency: normal,
                    unavailable: false,
                },
            ],
            variants: vec![
                Variant {
                    name: "naive",
                    serve: vec!["--max-inflight", "64"],
                    load: vec!["--policy", "naive"],
                },
                Variant {
                    name: "backstop",
                    serve: vec!["--max-inflight", "64"],
                    load: vec![],
                },
            ],
        },
        LiveScenario::Overload => Plan {
            rate: None,
            capacity_multiple: 3.0,
            duration: S(20),
            recovery_at: None,
            phases: vec![Phase {
                at: S(0),
                latency: normal,
                unavailable: false,
            }],
            variants: vec![Variant {
                name: "backstop",
                serve: vec!["--max-inflight", "16"],
                load: vec![],
            }],
        },
        LiveScenario::Outage => Plan {
            rate: Some(200.0),
            capacity_multiple: 1.0,
            duration: S(40),
            recovery_at: Some(S(20)),
            phases: vec![
                Phase {
                    at: S(0),
                    latency: normal,
                    unavailable: false,
                },
                Phase {
                    at: S(10),
                    latency: normal,
                    unavailable: true,
                },
                // Back, cold: slow for a while before it is warm again.
                Phase {
                    at: S(20),
                    latency: MS(400),
                    unavailable: false,
                },
                Phase {
                    at: S(25),
                    latency: normal,
                    unavailable: false,
                },
            ],
            variants: vec![
                Variant {
                    name: "backstop",
                    serve: vec!["--max-inflight", "64"],
                    load: vec![],
                },
                Variant {
                    name: "no-slow-start",
                    serve: vec!["--max-inflight", "64", "--no-slow-start"],
                    load: vec![],
                },
                Variant {
                    name: "no-storm-alarm",
                    serve: vec!["--max-inflight", "64"],
                    load: vec!["--no-storm-alarm"],
                },
                Variant {
                    name: "naive",
                    serve: vec!["--max-inflight", "64"],
                    load: vec!["--policy", "naive"],
                },
            ],
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_has_variants_and_ordered_phases() {
        for scenario in [
            LiveScenario::Slowdown,
            LiveScenario::Overload,
            LiveScenario::Outage,
        ] {
            let plan = plan(scenario);
            assert!(!plan.variants.is_empty());
            assert!(plan.phases.windows(2).all(|w| w[0].at < w[1].at));
            assert!(plan.phases.iter().all(|p| p.at < plan.duration));
        }
    }

    #[test]
    fn the_outage_plan_compares_with_and_without_slow_start() {
        let plan = plan(LiveScenario::Outage);
        let flags = |name: &str| {
            let v = plan.variants.iter().find(|v| v.name == name).unwrap();
            (v.serve.clone(), v.load.clone())
        };
        let (serve, load) = flags("no-slow-start");
        assert!(serve.contains(&"--no-slow-start"));
        assert_eq!(load, flags("backstop").1, "only the server differs");
    }
}
