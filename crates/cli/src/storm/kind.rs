//! The lab's scenarios: one list for `storm sim` (a deterministic simulation) and `storm run`
//! (the real service on loopback).
//!
//! Most scenarios run both ways, each at its own parameters: the simulator at thousands of
//! requests per second, the live run at what one machine's service serves. Some run one way
//! only: [`ScenarioKind::simulated`] and [`ScenarioKind::live`] say which, and each command's
//! `--scenario` takes only its own ([`simulated`], [`live`]).

use std::time::Duration;

use clap::ValueEnum;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use serde::Serialize;

/// A scenario of the storm lab.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum ScenarioKind {
    /// A dependency slows down, naive clients against the library's. Simulated: from 60 ms to
    /// 600 ms mean (p99 1.5 s) for 30 s, capacity from 5000/s to about 833/s under 2000/s.
    /// Live: the PSP from 100 ms to 600 ms for 20 s.
    Slowdown,
    /// 3x the measured capacity for 20 s (live only).
    Overload,
    /// The PSP refuses everything for 10 s, then comes back with cold-start latency (live
    /// only).
    Outage,
    /// 1000/s at 250 ms: the concurrency Little's law asks for, and what a limit too small or
    /// a queue too long does to latency and memory (simulated only).
    LittlesLaw,
    /// The downstream fails for 10 s, then comes back cold (slow) before it is warm again
    /// (simulated only).
    OutageRecovery,
    /// Hedging at the p95 of recent latencies against hedging at the p50 (simulated only).
    Hedging,
    /// Retry pulses after a synchronized failure: no jitter against full, equal and
    /// decorrelated jitter (simulated: on the same outage, 100 ms rows by default; live: a
    /// stalled cohort failing at once).
    Jitter,
    /// The same retries after the same short slowdown at several utilizations (simulated: 50
    /// to 95 %; live: 70 % and 90 % of the measured capacity).
    Utilization,
    /// A downstream that is slow when cold, after an outage, with and without the server's
    /// slow start.
    Cold,
    /// Queue sizing under a burst against (lambda_peak - mu) x T_burst (simulated: also a
    /// queue against a rate limit under sustained overload).
    Burst,
    /// Hedging after a fixed delay as load rises, with and without the retry budget.
    HedgeDrift,
    /// A client-side limit as a hidden queue (simulated: a connection's
    /// MAX_CONCURRENT_STREAMS or a pool; live: `Destination::max_in_flight`).
    HiddenQueue,
    /// Three hops of retrying clients in front of a failing one: attempts reaching it per user
    /// request (simulated only; its live version is the example `amplification`).
    Amplification,
}

impl ScenarioKind {
    /// The name used on the command line and in reports.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ScenarioKind::Slowdown => "slowdown",
            ScenarioKind::Overload => "overload",
            ScenarioKind::Outage => "outage",
            ScenarioKind::LittlesLaw => "littles-law",
            ScenarioKind::OutageRecovery => "outage-recovery",
            ScenarioKind::Hedging => "hedging",
            ScenarioKind::Jitter => "jitter",
            ScenarioKind::Utilization => "utilization",
            ScenarioKind::Cold => "cold",
            ScenarioKind::Burst => "burst",
            ScenarioKind::HedgeDrift => "hedge-drift",
            ScenarioKind::HiddenQueue => "hidden-queue",
            ScenarioKind::Amplification => "amplification",
        }
    }

    /// Whether `storm sim` simulates it.
    pub(crate) fn simulated(self) -> bool {
        !matches!(self, ScenarioKind::Overload | ScenarioKind::Outage)
    }

    /// Whether `storm run` runs it against the real service (`amplification` has its live
    /// example instead, `crates/backstop/examples/amplification.rs`).
    pub(crate) fn live(self) -> bool {
        !matches!(
            self,
            ScenarioKind::LittlesLaw
                | ScenarioKind::OutageRecovery
                | ScenarioKind::Hedging
                | ScenarioKind::Amplification
        )
    }

    /// The length of a simulated row unless `--interval` says otherwise: pulses need 100 ms
    /// rows.
    pub(crate) fn default_interval(self) -> Duration {
        match self {
            ScenarioKind::Jitter => Duration::from_millis(100),
            _ => Duration::from_secs(1),
        }
    }
}

/// `storm sim --scenario`: the scenarios it simulates.
pub(crate) fn simulated() -> impl TypedValueParser<Value = ScenarioKind> {
    those(ScenarioKind::simulated)
}

/// `storm run --scenario`: the scenarios it runs against the real service.
pub(crate) fn live() -> impl TypedValueParser<Value = ScenarioKind> {
    those(ScenarioKind::live)
}

/// A parser of the names of the scenarios `keep` keeps (only those are listed in `--help`).
fn those(keep: fn(ScenarioKind) -> bool) -> impl TypedValueParser<Value = ScenarioKind> {
    let names = ScenarioKind::value_variants()
        .iter()
        .filter(|&&kind| keep(kind))
        .filter_map(ValueEnum::to_possible_value);
    PossibleValuesParser::new(names)
        .map(|name| ScenarioKind::from_str(&name, false).expect("a listed scenario"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_runs_one_way_at_least_under_its_one_name() {
        for &kind in ScenarioKind::value_variants() {
            assert!(kind.simulated() || kind.live(), "{kind:?}");
            let value = kind.to_possible_value().unwrap();
            assert_eq!(value.get_name(), kind.as_str());
            assert_eq!(
                serde_json::to_value(kind).unwrap(),
                serde_json::json!(kind.as_str())
            );
        }
    }

    #[test]
    fn each_command_takes_only_its_own_scenarios() {
        let command = clap::Command::new("t")
            .arg(clap::Arg::new("sim").long("sim").value_parser(simulated()))
            .arg(clap::Arg::new("live").long("live").value_parser(live()));
        let parse = |args: &[&str]| command.clone().try_get_matches_from(args);
        let matches = parse(&["t", "--sim", "hedging", "--live", "outage"]).unwrap();
        assert_eq!(
            matches.get_one::<ScenarioKind>("sim"),
            Some(&ScenarioKind::Hedging)
        );
        assert_eq!(
            matches.get_one::<ScenarioKind>("live"),
            Some(&ScenarioKind::Outage)
        );
        assert!(parse(&["t", "--sim", "outage"]).is_err());
        assert!(parse(&["t", "--live", "hedging"]).is_err());
        assert!(parse(&["t", "--live", "jitter", "--sim", "jitter"]).is_ok());
    }
}
