//! `backstop storm`: the storm lab.
//!
//! `backstop storm sim` reproduces retry storms, overload and recovery in a deterministic
//! discrete-event simulation whose clients and server admission are the library's own policy
//! types, so a policy is judged by the code that ships; `backstop storm run` runs the same
//! scenarios against the real service.
//!
//! # Layout
//! - `kind`: the scenarios, one list for both commands, and which command runs which.
//! - `scenario`: the simulated scenarios' models and variants; `claims`: the chapter's
//!   claims, simulated; `engine`: the discrete-event engine; `series`, `dist`, `output`: its
//!   rows, draws and output.
//! - `run`: the live runs: their plans, the processes, the figures and the report, with the
//!   simulator's mirror of a live plan built from the plan itself.

mod claims;
mod dist;
mod engine;
mod kind;
mod output;
mod run;
mod scenario;
mod series;

use std::error::Error;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde::Serialize;

use self::kind::ScenarioKind;
use self::scenario::{Knobs, Scenario, ServerLimit};
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
    /// Run a scenario against the real service (loopback, bounded in time)
    ///
    /// Starts the PSP simulator, a `backstop serve` per variant on a fresh SQLite store and a
    /// `backstop load` with a per-second series; changes the PSP's latency or availability on
    /// schedule, samples the server's gauges and memory, and compares the variants.
    Run(run::RunArgs),
}

/// Flags of `backstop storm sim`.
#[derive(Debug, Clone, Args)]
pub(crate) struct SimArgs {
    /// The scenario.
    #[arg(long, value_parser = kind::simulated(), default_value = "slowdown")]
    scenario: ScenarioKind,
    /// Which variant to run: `all`, or one of the scenario's (slowdown: `naive`, `backstop`;
    /// outage-recovery: `naive`, `backstop`, `backstop-no-slow-start`,
    /// `backstop-no-retry-after`, `backstop-no-alarm`, `backstop-no-alarm-no-retry-after`;
    /// hedging: `p95`, `p50`, `p50-budget`; littles-law: `limit-N...`; the others list theirs
    /// when given one they do not have).
    #[arg(long, default_value = "all")]
    policy: String,
    /// Seeds the simulation: the same seed gives the same output.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Simulated time, e.g. `60s` (default: the scenario's).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    duration: Option<Duration>,
    /// Length of one row of the series, e.g. `1s`, `500ms` (default: 100ms for jitter, 1s for
    /// the others).
    #[arg(long, value_name = "DURATION", value_parser = parse_interval)]
    interval: Option<Duration>,
    /// Logical requests per second offered, before --scale (default: the scenario's: 2000 for
    /// slowdown, outage-recovery and cold, 1000 for littles-law, hedging and jitter, 800 for
    /// burst, 2500 for hidden-queue, 200 for amplification; utilization and hedge-drift set
    /// theirs from the capacity).
    #[arg(long, value_name = "PER_SEC", value_parser = parse_rate)]
    rate: Option<f64>,
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
    /// Also write an HTML report with charts (and the numbers as JSON and CSV) into this
    /// directory.
    #[arg(long, value_name = "DIR")]
    report: Option<std::path::PathBuf>,
}

/// The most simulated time a run may ask for.
const MAX_DURATION: Duration = Duration::from_secs(3_600);

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (e.g. 60s, 2m)"))?;
    if d.is_zero() || d > MAX_DURATION {
        return Err(format!(
            "must be above 0 and at most {}",
            humantime::format_duration(MAX_DURATION)
        ));
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

fn parse_rate(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !(v.is_finite() && v > 0.0 && v <= 1_000_000.0) {
        return Err("must be above 0 and at most 1000000".to_owned());
    }
    Ok(v)
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
    /// The scenario's own figures for this run (e.g. the peak retry rate per 100 ms), in
    /// order, beside the common summary.
    pub(crate) extra: Vec<(String, String)>,
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
pub(crate) async fn run(args: StormArgs) -> Result<(), Box<dyn Error>> {
    match args.command {
        StormCommand::Run(args) => run::run(args).await,
        StormCommand::Sim(args) => {
            let report = simulate(&args)?;
            if let Some(dir) = &args.report {
                crate::report::write(&to_report(&report), dir)?;
            }
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

/// Most logical requests one run may simulate: beyond it a run would take hours and, with a
/// naive fleet's unbounded queue, more memory than the machine has.
const MAX_LOGICAL: f64 = 500_000_000.0;

/// A simulation that cannot be run as asked.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SimError {
    /// A `--policy` the scenario does not have.
    #[error("scenario {scenario} has no policy `{policy}`; choose all, {choices}")]
    UnknownPolicy {
        scenario: &'static str,
        policy: String,
        choices: String,
    },
    /// A scenario that cannot be scaled down this far.
    #[error("{0}")]
    Unfit(String),
    /// Offered load times duration is beyond [`MAX_LOGICAL`].
    #[error(
        "{requests:.0} logical requests ({rate:.0}/s for {seconds:.0} s) is more than one run may simulate ({MAX_LOGICAL:.0}); lower --scale, --rate or --duration"
    )]
    TooLarge {
        requests: f64,
        rate: f64,
        seconds: f64,
    },
}

/// Runs the variants `args` selects.
pub(crate) fn simulate(args: &SimArgs) -> Result<Report, SimError> {
    let knobs = Knobs {
        scale: args.scale,
        duration: args.duration,
        rate: args.rate,
        interval: args
            .interval
            .unwrap_or_else(|| args.scenario.default_interval()),
        seed: args.seed,
        limit: args.limit,
        throttle: args.throttle,
    };
    let Some(scenario) = Scenario::build(args.scenario, knobs) else {
        return claims::simulate(args.scenario, knobs, &args.policy);
    };
    check_size(&scenario.model)?;
    let selected: Vec<_> = scenario
        .variants
        .iter()
        .filter(|v| args.policy == "all" || v.name == args.policy)
        .collect();
    if selected.is_empty() {
        return Err(SimError::UnknownPolicy {
            scenario: scenario.name,
            policy: args.policy.clone(),
            choices: scenario.names().join(", "),
        });
    }
    let runs = run_variants(&scenario, &selected);
    Ok(Report {
        scenario: scenario.name,
        seed: args.seed,
        scale: args.scale,
        duration_s: scenario.model.duration.as_secs_f64(),
        interval_s: scenario.model.interval.as_secs_f64(),
        notes: scenario.notes,
        runs,
    })
}

/// Fails when `model` asks for more logical requests than one run may simulate.
fn check_size(model: &engine::Model) -> Result<(), SimError> {
    let seconds = model.duration.as_secs_f64();
    let peak = model.load.iter().map(|&(_, f)| f).fold(1.0, f64::max);
    let requests = model.rate * peak * seconds;
    if requests > MAX_LOGICAL {
        return Err(SimError::TooLarge {
            requests,
            rate: model.rate * peak,
            seconds,
        });
    }
    Ok(())
}

/// Simulates each of `variants` of `scenario`.
fn run_variants(scenario: &Scenario, variants: &[&scenario::Variant]) -> Vec<VariantRun> {
    let interval = scenario.model.interval.as_secs_f64();
    variants
        .iter()
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
                extra: Vec::new(),
            }
        })
        .collect()
}

/// Simulates every variant of `scenario` (a mirror of a `storm run` scenario).
pub(crate) fn simulate_all(scenario: &Scenario) -> Vec<VariantRun> {
    let variants: Vec<_> = scenario.variants.iter().collect();
    run_variants(scenario, &variants)
}

/// A simulation as an HTML report: one run per variant, one row per interval.
fn to_report(sim: &Report) -> crate::report::Report {
    let runs = sim
        .runs
        .iter()
        .map(|run| report_run(run, run.policy.clone(), sim.interval_s))
        .collect();
    crate::report::Report {
        format: String::new(),
        title: format!("storm sim: {}", sim.scenario),
        description: format!(
            "Simulated (virtual time, seed {}, scale {}): {} s in intervals of {} s. Clients and \
             admission are the library's own policy types.\n\n{}",
            sim.seed,
            sim.scale,
            sim.duration_s,
            sim.interval_s,
            sim.notes.join("\n\n")
        ),
        runs,
    }
}

/// One simulated run as a run of a report, named `name`.
pub(crate) fn report_run(run: &VariantRun, name: String, interval_s: f64) -> crate::report::Run {
    let per_s = |n: u64| n as f64 / interval_s;
    let s = &run.summary;
    let mut summary: Vec<(String, String)> = run.extra.clone();
    summary.extend([
        ("success".into(), format!("{:.1} %", 100.0 * s.success)),
        (
            "attempts per request".into(),
            format!("{:.2}", s.amplification),
        ),
        (
            "goodput in the window".into(),
            format!(
                "{:.0} /s of {:.0} /s capacity",
                s.focus_goodput, s.focus_capacity
            ),
        ),
        (
            "wasted work in the window".into(),
            format!("{:.0} /s", s.focus_wasted),
        ),
        ("peak queue".into(), s.peak_queue.to_string()),
        (
            "r x A0 x p'(A*)".into(),
            format!("{:.2} ({})", s.stability.gain, s.stability.verdict),
        ),
        (
            "recovery".into(),
            s.recovery_s.map_or("-".into(), |r| format!("{r:.0} s")),
        ),
        (
            "back to capacity".into(),
            s.to_capacity_s.map_or("-".into(), |r| format!("{r:.0} s")),
        ),
        (
            "in flight an interval after the return".into(),
            s.return_inflight.map_or("-".into(), |n| n.to_string()),
        ),
    ]);
    crate::report::Run {
        name,
        summary,
        rows: run
            .rows
            .iter()
            .map(|r| crate::report::Row {
                time_s: r.t + interval_s,
                offered_originals_per_s: Some(per_s(r.offered_originals)),
                offered_retries_per_s: Some(per_s(r.offered_retries)),
                goodput_per_s: Some(per_s(r.goodput)),
                refused_per_s: Some(per_s(r.refused)),
                wasted_per_s: Some(per_s(r.wasted)),
                queue_depth: Some(r.queue as f64),
                p99_ms: (r.p99_ms > 0.0).then_some(r.p99_ms),
                admission_limit: Some(r.limit as f64),
                in_flight: Some(r.inflight as f64),
                retry_ratio: Some(r.retry_ratio),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small-scale run (debug builds run these in CI).
    fn args(scenario: ScenarioKind, scale: f64, seconds: u64) -> SimArgs {
        SimArgs {
            scenario,
            policy: "all".to_owned(),
            seed: 7,
            duration: Some(Duration::from_secs(seconds)),
            rate: None,
            interval: Some(Duration::from_secs(1)),
            scale,
            limit: ServerLimit::Fixed,
            throttle: false,
            json: false,
            csv: false,
            report: None,
        }
    }

    fn by_policy<'a>(report: &'a Report, policy: &str) -> &'a VariantRun {
        report
            .runs
            .iter()
            .find(|r| r.policy == policy)
            .unwrap_or_else(|| panic!("no run {policy}"))
    }

    fn row_at(run: &VariantRun, t: f64) -> &Row {
        run.rows.iter().find(|r| (r.t - t).abs() < 1e-9).unwrap()
    }

    /// The slowdown case: the downstream slows, capacity falls from 5000/s to 833/s under 2000/s.
    /// Naive clients multiply their load (retry ratio climbing towards 2), goodput collapses
    /// and the queue keeps growing after the downstream has recovered; the library's clients
    /// add no more than the budget allows and the service is back as soon as the downstream
    /// is.
    #[test]
    fn slowdown_naive_diverges_backstop_stays_bounded_and_recovers() {
        let report = simulate(&args(ScenarioKind::Slowdown, 0.1, 50)).unwrap();
        let naive = by_policy(&report, "naive");
        let backstop = by_policy(&report, "backstop");

        let (n, b) = (&naive.summary, &backstop.summary);
        // Load amplification: retries grow to about 2 per original.
        assert!(n.focus_amplification > 2.0, "{}", n.focus_amplification);
        assert!(row_at(naive, 10.0).retry_ratio < row_at(naive, 15.0).retry_ratio);
        assert!(row_at(naive, 15.0).retry_ratio > 1.5);
        // Goodput far below the degraded capacity, and the backlog never drains: the storm
        // outlives its cause.
        assert!(
            n.focus_goodput < 0.2 * n.focus_capacity,
            "{}",
            n.focus_goodput
        );
        assert!(row_at(naive, 49.0).queue > row_at(naive, 39.0).queue);
        assert_eq!(n.recovery_s, None);
        assert_eq!(n.stability.verdict, "overloaded");

        // The library's clients: within 1 + ratio (plus the burst) of the original load.
        let originals = b.attempts - b.retries;
        assert!(
            b.retries as f64 <= 0.1 * originals as f64 + 20.0,
            "{} retries for {originals}",
            b.retries
        );
        assert!(
            b.focus_amplification <= 1.1 + 1e-9,
            "{}",
            b.focus_amplification
        );
        assert!(
            b.peak_queue < n.peak_queue / 4,
            "{} vs {}",
            b.peak_queue,
            n.peak_queue
        );
        let recovery = b.recovery_s.expect("backstop recovers within the run");
        assert!(recovery <= 3.0, "{recovery}");
        assert!(b.stability.gain < 1.0);
        // Behind today's first-come first-served gate the admitted requests wait until little
        // of their deadline is left, so goodput stays low, but above naive's.
        assert!(
            b.focus_goodput > n.focus_goodput,
            "{} vs {}",
            b.focus_goodput,
            n.focus_goodput
        );
    }

    /// Near the knee of the stability condition: 800/s against the degraded 833/s. Naive
    /// retries tip the loop over (r x A0 x p'(A*) >= 1: a storm, goodput collapses); the
    /// library's clients stay stable and keep goodput near the degraded capacity.
    #[test]
    fn near_the_knee_naive_storms_and_backstop_keeps_goodput() {
        let report = simulate(&SimArgs {
            rate: Some(800.0),
            ..args(ScenarioKind::Slowdown, 0.2, 40)
        })
        .unwrap();
        let n = &by_policy(&report, "naive").summary;
        let b = &by_policy(&report, "backstop").summary;
        assert_eq!(n.stability.verdict, "storm", "{:?}", n.stability);
        assert!(n.focus_amplification > 1.5, "{}", n.focus_amplification);
        assert!(
            n.focus_goodput < 0.5 * n.focus_capacity,
            "{}",
            n.focus_goodput
        );
        assert_eq!(b.stability.verdict, "stable", "{:?}", b.stability);
        assert!(
            b.focus_amplification <= 1.1 + 1e-9,
            "{}",
            b.focus_amplification
        );
        assert!(
            b.focus_goodput > 0.75 * b.focus_capacity,
            "{}",
            b.focus_goodput
        );
    }

    /// With the library's adaptive throttle the clients send about twice what the server
    /// accepts: the gate's queue already keeps goodput near capacity, and the throttle keeps it
    /// there while sending fewer attempts per request (it rejects some locally, first
    /// attempts included). Counted per request: once the throttle rejects an attempt the two
    /// runs' random draws, and with them the requests arriving, differ.
    #[test]
    fn slowdown_adaptive_throttle_sends_less_for_the_same_goodput() {
        let plain = simulate(&SimArgs {
            policy: "backstop".to_owned(),
            ..args(ScenarioKind::Slowdown, 0.1, 40)
        })
        .unwrap();
        let throttled = simulate(&SimArgs {
            policy: "backstop".to_owned(),
            throttle: true,
            ..args(ScenarioKind::Slowdown, 0.1, 40)
        })
        .unwrap();
        let (p, t) = (&plain.runs[0].summary, &throttled.runs[0].summary);
        assert!(
            t.focus_goodput > 0.9 * p.focus_goodput,
            "{} vs {}",
            t.focus_goodput,
            p.focus_goodput
        );
        let per_request = |s: &Summary| s.attempts as f64 / s.logical as f64;
        assert!(
            per_request(t) < per_request(p),
            "{} vs {} attempts per request",
            per_request(t),
            per_request(p)
        );
        assert!(t.stops["throttled"] > 0);
    }

    #[test]
    fn the_same_seed_gives_the_same_output() {
        let run = |seed| {
            let mut a = args(ScenarioKind::OutageRecovery, 0.05, 25);
            a.seed = seed;
            serde_json::to_string(&simulate(&a).unwrap()).unwrap()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }

    /// Little's law: 1000/s at 150 ms (p99 250 ms) keeps about 150 requests in flight
    /// (L = lambda W), a limit sized by lambda x W_p99 x 1.2 (the chapter's 300) serves it; a
    /// limit too small refuses the excess, and behind an unbounded queue it makes latency and
    /// memory grow without bound.
    #[test]
    fn littles_law_holds_and_a_small_limit_hurts() {
        let report = simulate(&args(ScenarioKind::LittlesLaw, 0.2, 20)).unwrap();
        let enough = &report.runs[0].summary;
        let small = &report.runs[1].summary;
        let queued = &report.runs[2].summary;
        assert!(enough.little.relative_error < 0.05, "{:?}", enough.little);
        // 200/s at 150 ms: about 30 in flight, and 60 places (200 x 0.25 x 1.2).
        assert_eq!(report.runs[0].policy, "limit-60");
        assert!((enough.little.l - 30.0).abs() < 3.0, "{:?}", enough.little);
        assert!(enough.refused == 0 && enough.success > 0.97, "{enough:?}");
        // 20 places for 30 needed: the gate's queue refuses the excess early, and serves what
        // 20 places can (about 133/s of 200/s), no more.
        assert!(small.success < 0.9 && small.refused > 0, "{small:?}");
        assert!(
            small.focus_goodput < 0.85 * enough.focus_goodput,
            "{small:?}"
        );
        assert!(small.focus_p99_ms <= 1_000.0);
        // The unbounded queue only grows; the gate's is bounded by the deadline.
        let queue = |run: usize, t: f64| row_at(&report.runs[run], t).queue;
        assert!(queue(2, 19.0) > queue(2, 10.0) && queue(2, 10.0) > queue(2, 5.0));
        assert!(queued.peak_queue > 2 * small.peak_queue, "{queued:?}");
        assert!(queued.little.w_ms > 4.0 * enough.little.w_ms);
    }

    /// Hedging at the p95 costs a few per cent more attempts (a little over 5 %:
    /// the hedged answers, faster, pull the measured p95 down), at the p50 more than half
    /// again; the retry budget caps the latter at its ratio.
    #[test]
    fn hedging_at_p95_is_cheap_and_at_p50_is_not() {
        let report = simulate(&args(ScenarioKind::Hedging, 0.2, 20)).unwrap();
        let share = |policy| {
            let s = &by_policy(&report, policy).summary;
            s.hedges as f64 / (s.attempts - s.hedges) as f64
        };
        let (p95, p50, budget) = (share("p95"), share("p50"), share("p50-budget"));
        assert!((0.02..0.10).contains(&p95), "{p95}");
        assert!(p50 > 0.35, "{p50}");
        assert!(budget < 0.12, "{budget}");
    }

    /// After the outage every variant of the library's clients is back once the downstream is
    /// warm (cold, it serves less than the load), naive ones not within the run. The slow start
    /// holds the limit at its floor through the outage, hands the returning downstream a few
    /// calls instead of every worker's, and ramps back to the workers within seconds; the
    /// simulated downstream is not hurt by a burst, so the ramp shows as a cost: back to
    /// capacity later, less goodput while cold.
    #[test]
    fn outage_recovery_with_and_without_slow_start() {
        let report = simulate(&args(ScenarioKind::OutageRecovery, 0.1, 45)).unwrap();
        let workers: u64 = 50;
        let summary = |policy| &by_policy(&report, policy).summary;
        for policy in [
            "backstop",
            "backstop-no-slow-start",
            "backstop-no-retry-after",
            "backstop-no-alarm",
            "backstop-no-alarm-no-retry-after",
        ] {
            let recovery = summary(policy).recovery_s.expect(policy);
            // The downstream is warm 15 s after its return.
            assert!((15.0..=17.0).contains(&recovery), "{policy}: {recovery}");
            assert!(summary(policy).focus_amplification < 1.11, "{policy}");
        }
        assert_eq!(summary("naive").recovery_s, None);
        assert!(summary("naive").focus_amplification > 2.5);

        let (slow, plain) = (
            by_policy(&report, "backstop"),
            by_policy(&report, "backstop-no-slow-start"),
        );
        assert_eq!(row_at(slow, 15.0).limit, 4, "the floor during the outage");
        assert_eq!(row_at(plain, 15.0).limit, workers);
        // A second after the return: a few calls at the downstream, against every worker's.
        let first = row_at(slow, 20.0);
        assert!(first.limit < workers / 2, "{first:?}");
        let at_return = slow.summary.return_inflight.unwrap();
        assert!(at_return <= first.limit, "{at_return}");
        assert_eq!(plain.summary.return_inflight, Some(workers));
        // Doubling per round trip: back at the workers within 3 s.
        assert_eq!(row_at(slow, 22.0).limit, workers);
        let (s, p) = (&slow.summary, &plain.summary);
        assert!(
            s.to_capacity_s.unwrap() > p.to_capacity_s.unwrap(),
            "{:?} vs {:?}",
            s.to_capacity_s,
            p.to_capacity_s
        );
        assert!(s.focus_goodput < p.focus_goodput);
    }

    /// Retry-After against the storm alarm, at full scale through the outage and the cold
    /// downstream (which serves less than the load, so the gate sheds): with the alarm on, the
    /// alarm stops retries and the computed pushback changes nothing that matters; with it
    /// off, the pushback ("do not retry" once the queue has been overloaded a while) stops
    /// retries the budget would have let through.
    #[test]
    fn the_computed_retry_after_stops_retries_the_alarm_would() {
        let run = |policy: &str| {
            let report = simulate(&SimArgs {
                policy: policy.to_owned(),
                seed: 1,
                ..args(ScenarioKind::OutageRecovery, 1.0, 35)
            })
            .unwrap();
            report.runs[0].summary.clone()
        };
        let (with, without) = (run("backstop"), run("backstop-no-retry-after"));
        assert!(with.focus_amplification < 1.01 && without.focus_amplification < 1.01);
        assert!(with.stops["pushback"] > 0);
        assert!(!without.stops.contains_key("pushback"));

        let (with, without) = (
            run("backstop-no-alarm"),
            run("backstop-no-alarm-no-retry-after"),
        );
        assert!(with.stops["pushback"] > 0, "{:?}", with.stops);
        // Without pushback the budget is what stops retries: 0.1 per request.
        assert!(without.focus_amplification > 1.09, "{without:?}");
        assert!(
            with.focus_amplification + 0.04 < without.focus_amplification,
            "{} vs {} attempts per request",
            with.focus_amplification,
            without.focus_amplification
        );
    }

    #[test]
    fn an_unknown_policy_is_a_clear_error() {
        let mut a = args(ScenarioKind::Hedging, 0.1, 2);
        a.policy = "p99".to_owned();
        let err = simulate(&a).unwrap_err().to_string();
        assert_eq!(
            err,
            "scenario hedging has no policy `p99`; choose all, p95, p50, p50-budget"
        );
    }
}
