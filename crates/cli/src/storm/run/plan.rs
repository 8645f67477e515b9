//! What each live scenario does: the PSP's phases, the offered load and the variants compared.

use std::time::Duration;

use super::{LiveScenario, claims};

/// How the PSP behaves from `at` on.
#[derive(Debug, Clone, Copy)]
pub(super) struct Phase {
    pub(super) at: Duration,
    pub(super) latency: Duration,
    /// Every charge answered `503` + `Retry-After` (1 s unless `pushback` says otherwise).
    pub(super) unavailable: bool,
    /// The `Retry-After` of those `503`s.
    pub(super) pushback: Option<Duration>,
    /// Every charge answered `500`.
    pub(super) error: bool,
    /// A stall: charges arriving within this long of the phase's start are held until then,
    /// and all answered together (see `Faults::hold_until`).
    pub(super) hold: Option<Duration>,
    /// Slower the more calls it holds (see `Faults::slow_above`; 0: off).
    pub(super) slow_above: u32,
}

/// A healthy PSP answering after `latency`, from `at` on: what a phase is unless it says
/// otherwise.
pub(super) const fn healthy(at: Duration, latency: Duration) -> Phase {
    Phase {
        at,
        latency,
        unavailable: false,
        pushback: None,
        error: false,
        hold: None,
        slow_above: 0,
    }
}

/// One side of a comparison: the flags its `serve` and `load` get.
#[derive(Debug, Clone)]
pub(super) struct Variant {
    pub(super) name: &'static str,
    pub(super) serve: Vec<&'static str>,
    pub(super) load: Vec<&'static str>,
    /// Its offered rate, as a share of the plan's (or of the measured capacity).
    pub(super) rate_share: f64,
}

/// A variant offered the plan's rate.
pub(super) fn variant(
    name: &'static str,
    serve: Vec<&'static str>,
    load: Vec<&'static str>,
) -> Variant {
    Variant {
        name,
        serve,
        load,
        rate_share: 1.0,
    }
}

/// A second `load`, started `at` and running for `duration` at `rate` on top of the first:
/// a burst.
#[derive(Debug, Clone, Copy)]
pub(super) struct Burst {
    pub(super) at: Duration,
    pub(super) duration: Duration,
    pub(super) rate: f64,
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
    /// A burst on top of the load, if the scenario has one.
    pub(super) burst: Option<Burst>,
    /// Width of the load's series rows (`--series-interval`) when a scenario needs them finer
    /// than a second; they are summed into seconds for the summary.
    pub(super) series_interval: Option<Duration>,
    /// The server and client the capacity is measured with (`None`: the first variant's).
    pub(super) probe: Option<Variant>,
    /// The rate offered while measuring the capacity: far above it, but not so far that
    /// refusing the excess takes the cores the service needs.
    pub(super) probe_rate: f64,
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
            burst: None,
            series_interval: None,
            probe: None,
            probe_rate: 2_000.0,
            phases: vec![
                healthy(S(0), normal),
                healthy(S(10), MS(600)),
                healthy(S(30), normal),
            ],
            variants: vec![
                variant(
                    "naive",
                    vec!["--max-inflight", "64"],
                    vec!["--policy", "naive"],
                ),
                variant("backstop", vec!["--max-inflight", "64"], vec![]),
            ],
        },
        LiveScenario::Overload => Plan {
            rate: None,
            capacity_multiple: 3.0,
            duration: S(20),
            recovery_at: None,
            burst: None,
            series_interval: None,
            probe: None,
            probe_rate: 2_000.0,
            phases: vec![healthy(S(0), normal)],
            variants: vec![variant("backstop", vec!["--max-inflight", "16"], vec![])],
        },
        LiveScenario::Outage => Plan {
            rate: Some(200.0),
            capacity_multiple: 1.0,
            duration: S(40),
            recovery_at: Some(S(20)),
            burst: None,
            series_interval: None,
            probe: None,
            probe_rate: 2_000.0,
            phases: vec![
                healthy(S(0), normal),
                Phase {
                    unavailable: true,
                    ..healthy(S(10), normal)
                },
                // Back, cold: slow for a while before it is warm again.
                healthy(S(20), MS(400)),
                healthy(S(25), normal),
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
        },
        LiveScenario::Jitter => claims::jitter(),
        LiveScenario::Utilization => claims::utilization(),
        LiveScenario::Cold => claims::cold(),
        LiveScenario::Burst => claims::burst(),
        LiveScenario::HedgeDrift => claims::hedge_drift(),
        LiveScenario::HiddenQueue => claims::hidden_queue(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_has_variants_and_ordered_phases() {
        for &scenario in <LiveScenario as clap::ValueEnum>::value_variants() {
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
