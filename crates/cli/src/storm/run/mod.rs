//! `backstop storm run`: the lab's scenarios against the real service.
//!
//! Each run starts its own PSP simulator (in this process, so its faults can be changed on
//! schedule), a `backstop serve` child on a fresh SQLite file, and a `backstop load` child with
//! `--series`; while the load runs it samples the server's `/metrics` (the gate's limit and
//! in-flight count) and its resident memory once a second. Everything listens on loopback and
//! every phase is bounded in time. Variants of a scenario (naive vs backstop clients, slow start
//! on or off) run one after the other on fresh processes, so they do not share state.
//!
//! Scenarios:
//! - `slowdown`: the PSP's latency goes from 100 ms to 600 ms for 20 s, then back; naive vs
//!   backstop clients;
//! - `overload`: the service's capacity is measured first, then offered 3x of it for 20 s;
//! - `outage`: the PSP refuses everything for 10 s, then comes back slow (a cold start);
//!   the time until goodput is back, with and without the client's storm alarm and the
//!   server's slow start.
//!
//! And the live counterparts of `storm sim`'s chapter claims (see [`claims`]):
//! - `jitter`: the PSP stalls for 1 s, then fails the whole stalled cohort at once; naive
//!   clients retry after a 1 s backoff without jitter, or with full, equal or decorrelated
//!   jitter. The figure is the share of the retries sent in the busiest 300 ms;
//! - `utilization`: the same client and the same 4 s slowdown at 70% and at 90% of the
//!   measured capacity;
//! - `cold`: the PSP is down for 5 s, then back cold (slower the more calls it holds) for
//!   10 s, with and without the server's slow start;
//! - `burst`: 1 s of twice the base load on top of it, against a server queue that holds the
//!   excess (`Q >= (lambda_peak - mu) x T_burst`) and one that does not;
//! - `hedge-drift`: a fixed hedge delay at 30%, 90% and 110% of the measured capacity, with
//!   and without the retry budget;
//! - `hidden-queue`: the library's client with no limit of its own, and with
//!   `Destination::max_in_flight` near and below what the load needs.
//!
//! The scenarios are the lab's one list (`storm::kind`), shared with `storm sim`; this command
//! takes those with a live plan.
//!
//! # Layout
//! - `plan`: what a live scenario is made of (the PSP's phases, the load, the variants);
//!   `mirrored`: the plans of `slowdown`, `overload` and `outage`, each with the window its
//!   simulated mirror is read in; `mirror`: a plan as the simulator sees it (`storm sim`'s
//!   mirror, built from the plan itself); `claims`: the plans of the claims.
//! - `variant`: one variant run end to end; `server`: its `backstop serve` child.
//! - `result`: what a run measured; `figures`: each claim's own figures; `output`: the summary
//!   and the files; `report`: the HTML report with the simulator's mirror beside the measured
//!   runs; `claims_text`: the report's text on each claim.

mod claims;
mod claims_text;
mod figures;
mod mirror;
mod mirrored;
mod output;
mod plan;
mod report;
mod result;
mod server;
mod variant;

use std::path::PathBuf;

use clap::Args;

use self::output::{render, write_out};
use self::plan::Plan;
use self::report::to_report;
use self::result::RunResult;
use self::variant::{measure_capacity, run_variant};
use super::kind::{self, ScenarioKind};

/// Flags of `backstop storm run`.
#[derive(Debug, Clone, Args)]
pub(crate) struct RunArgs {
    /// Which experiment to run.
    #[arg(long, value_parser = kind::live())]
    scenario: ScenarioKind,
    /// Directory for the per-second series of each variant (CSV) and the summary (JSON);
    /// created if missing.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Print the summary as one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Write an HTML report with charts (and the numbers as JSON and CSV) into this directory.
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
    /// Multiplies every duration of the scenario (phases and load), e.g. 0.2 for a quick look.
    #[arg(long, value_name = "F", default_value_t = 1.0, value_parser = parse_scale)]
    time_scale: f64,
}

/// Runs the scenario and prints (or writes) what it measured.
pub(crate) async fn run(args: RunArgs) -> Result<(), Box<dyn std::error::Error>> {
    let result = execute(args.scenario, args.time_scale).await?;
    if let Some(dir) = &args.out {
        write_out(dir, &result)?;
    }
    if let Some(dir) = &args.report {
        crate::report::write(&to_report(&result), dir)?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        print!("{}", render(&result));
    }
    Ok(())
}

/// The plan of `scenario`'s live run; `None` for the scenarios only simulated.
fn plan(scenario: ScenarioKind) -> Option<Plan> {
    match scenario {
        ScenarioKind::Slowdown => Some(mirrored::slowdown()),
        ScenarioKind::Overload => Some(mirrored::overload()),
        ScenarioKind::Outage => Some(mirrored::outage()),
        ScenarioKind::Jitter => Some(claims::jitter()),
        ScenarioKind::Utilization => Some(claims::utilization()),
        ScenarioKind::Cold => Some(claims::cold()),
        ScenarioKind::Burst => Some(claims::burst()),
        ScenarioKind::HedgeDrift => Some(claims::hedge_drift()),
        ScenarioKind::HiddenQueue => Some(claims::hidden_queue()),
        ScenarioKind::LittlesLaw
        | ScenarioKind::OutageRecovery
        | ScenarioKind::Hedging
        | ScenarioKind::Amplification => None,
    }
}

/// Runs `scenario` with every duration multiplied by `scale`.
pub(crate) async fn execute(
    scenario: ScenarioKind,
    scale: f64,
) -> Result<RunResult, Box<dyn std::error::Error>> {
    let Some(plan) = plan(scenario) else {
        return Err(format!(
            "scenario {} has no live run; `storm sim --scenario {0}` simulates it",
            scenario.as_str()
        )
        .into());
    };
    let plan = plan.scaled(scale);
    let work = tempfile::tempdir()?;
    let capacity = match plan.rate {
        Some(_) => None,
        None => Some(measure_capacity(&plan, work.path(), scale).await?),
    };
    let rate = plan
        .rate
        .unwrap_or_else(|| capacity.unwrap_or(1.0) * plan.capacity_multiple)
        .max(1.0);
    let mut variants = Vec::new();
    for (i, variant) in plan.variants.iter().enumerate() {
        let dir = work.path().join(format!("{i}-{}", variant.name));
        std::fs::create_dir_all(&dir)?;
        let rate = (rate * variant.rate_share).max(1.0);
        let (mut result, fine) = run_variant(&plan, variant, rate, &dir).await?;
        result.figures = figures::of(scenario, &plan, capacity, &result, &fine);
        variants.push(result);
    }
    Ok(RunResult {
        scenario,
        capacity_per_s: capacity,
        time_scale: scale,
        variants,
    })
}

fn parse_scale(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !(0.01..=10.0).contains(&v) {
        return Err(format!("the time scale must be in [0.01, 10], got {s}"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_live_scenario_has_a_plan_with_variants_and_ordered_phases() {
        for &scenario in <ScenarioKind as clap::ValueEnum>::value_variants() {
            let Some(plan) = plan(scenario) else {
                assert!(!scenario.live(), "{scenario:?} has no plan");
                continue;
            };
            assert!(
                scenario.live(),
                "{scenario:?} is not offered to `storm run`"
            );
            assert!(!plan.variants.is_empty());
            assert!(plan.phases.windows(2).all(|w| w[0].at < w[1].at));
            assert!(plan.phases.iter().all(|p| p.at < plan.duration));
        }
    }

    #[test]
    fn the_time_scale_is_bounded() {
        assert!(parse_scale("0").is_err());
        assert!(parse_scale("x").is_err());
        assert_eq!(parse_scale("0.5"), Ok(0.5));
    }
}
