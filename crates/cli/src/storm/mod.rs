//! `backstop storm`: the storm lab.
//!
//! `backstop storm sim` reproduces retry storms, overload and recovery in a deterministic
//! discrete-event simulation whose clients and server admission are the library's own policy
//! types, so a policy is judged by the code that ships.

mod dist;
mod engine;
mod output;
mod scenario;
mod series;

use std::error::Error;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde::Serialize;

use self::scenario::{Knobs, Scenario, ScenarioKind, ServerLimit};
use self::series::{Row, Summary};

/// Flags of `backstop storm`.
#[derive(Debug, Clone, Args)]
pub(crate) struct StormArgs {
    #[command(subcommand)]
    command: StormCommand,
}

#[derive(Debug, Clone, Subcommand)]
enum StormCommand {
    /// Simulate a scenario (deterministic for a seed; virtual time, no network)
    ///
    /// Clients are open-loop (Poisson arrivals) and use the library's retry policy, budget,
    /// backoff, storm alarm, adaptive throttle and hedging policy; the server has a number of
    /// workers behind the library's concurrency limit, and a downstream whose latency changes
    /// over time. A client that times out does not stop the server's work.
    Sim(SimArgs),
}

/// Flags of `backstop storm sim`.
#[derive(Debug, Clone, Args)]
pub(crate) struct SimArgs {
    /// The scenario.
    #[arg(long, value_enum, default_value_t = ScenarioKind::Slowdown)]
    scenario: ScenarioKind,
    /// Which variant to run: `all`, or one of the scenario's (slowdown: `naive`, `backstop`;
    /// outage-recovery: `naive`, `backstop`, `backstop-no-alarm`; hedging: `p95`, `p50`,
    /// `p50-budget`; littles-law: `limit-N...`).
    #[arg(long, default_value = "all")]
    policy: String,
    /// Seeds the simulation: the same seed gives the same output.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Simulated time, e.g. `60s` (default: the scenario's).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    duration: Option<Duration>,
    /// Length of one row of the series, e.g. `1s`, `500ms`.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_interval)]
    interval: Duration,
    /// Multiplies the offered load and the server's workers (e.g. 50 for 100,000/s in the
    /// slowdown scenario); ratios and the story stay the same.
    #[arg(long, default_value_t = 1.0, value_parser = parse_scale)]
    scale: f64,
    /// The `backstop` server's concurrency limit: `fixed` at the workers, or `adaptive`
    /// (Gradient2 from a tenth of the workers up to all of them).
    #[arg(long, value_enum, default_value_t = ServerLimit::Fixed)]
    limit: ServerLimit,
    /// `backstop` clients also reject attempts locally with adaptive throttling.
    #[arg(long)]
    throttle: bool,
    /// Print the series and summaries as one JSON object.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Print the series as CSV, then a blank line and the summaries as CSV.
    #[arg(long)]
    csv: bool,
}

/// The most simulated time a run may ask for.
const MAX_DURATION: Duration = Duration::from_secs(3_600);

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (e.g. 60s, 2m)"))?;
    if d.is_zero() || d > MAX_DURATION {
        return Err(format!("must be above 0 and at most {}", humantime::format_duration(MAX_DURATION)));
    }
    Ok(d)
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (e.g. 1s, 500ms)"))?;
    if d < Duration::from_millis(10) || d > Duration::from_secs(600) {
        return Err("must be between 10ms and 10m".to_owned());
    }
    Ok(d)
}

fn parse_scale(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !(v.is_finite() && v > 0.0 && v <= 1_000.0) {
        return Err("must be above 0 and at most 1000".to_owned());
    }
    Ok(v)
}

/// A run of one variant: its series and summary.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct VariantRun {
    pub(crate) policy: String,
    pub(crate) rows: Vec<Row>,
    pub(crate) summary: Summary,
}

/// Everything one `storm sim` computed.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    pub(crate) scenario: &'static str,
    pub(crate) seed: u64,
    pub(crate) scale: f64,
    pub(crate) duration_s: f64,
    pub(crate) interval_s: f64,
    pub(crate) notes: Vec<String>,
    pub(crate) runs: Vec<VariantRun>,
}

/// `backstop storm ...`.
pub(crate) fn run(args: StormArgs) -> Result<(), Box<dyn Error>> {
    match args.command {
        StormCommand::Sim(args) => {
            let report = simulate(&args)?;
            let mut out = std::io::stdout().lock();
            if args.json {
                output::json(&mut out, &report)?;
            } else if args.csv {
                output::csv(&mut out, &report)?;
            } else {
                output::table(&mut out, &report)?;
            }
            Ok(())
        }
    }
}

/// A `--policy` the scenario does not have.
#[derive(Debug, thiserror::Error)]
#[error("scenario {scenario} has no policy `{policy}`; choose all, {choices}")]
pub(crate) struct UnknownPolicy {
    scenario: &'static str,
    policy: String,
    choices: String,
}

/// Runs the variants `args` selects.
pub(crate) fn simulate(args: &SimArgs) -> Result<Report, UnknownPolicy> {
    let knobs = Knobs {
        scale: args.scale,
        duration: args.duration,
        interval: args.interval,
        seed: args.seed,
        limit: args.limit,
        throttle: args.throttle,
    };
    let scenario = Scenario::build(args.scenario, knobs);
    let selected: Vec<_> = scenario
        .variants
        .iter()
        .filter(|v| args.policy == "all" || v.name == args.policy)
        .collect();
    if selected.is_empty() {
        return Err(UnknownPolicy {
            scenario: scenario.kind.as_str(),
            policy: args.policy.clone(),
            choices: scenario.names().join(", "),
        });
    }
    let interval = scenario.model.interval.as_secs_f64();
    let runs = selected
        .into_iter()
        .map(|variant| {
            let mut run = engine::run(&scenario.model, &variant.client, &variant.server);
            let summary = series::summarise(
                &variant.name,
                &mut run.rows,
                &run.totals,
                interval,
                scenario.focus,
            );
            VariantRun {
                policy: variant.name.clone(),
                rows: run.rows,
                summary,
            }
        })
        .collect();
    Ok(Report {
        scenario: scenario.kind.as_str(),
        seed: args.seed,
        scale: args.scale,
        duration_s: scenario.model.duration.as_secs_f64(),
        interval_s: interval,
        notes: scenario.notes,
        runs,
    })
}
