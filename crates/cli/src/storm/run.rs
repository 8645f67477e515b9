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

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use backstop_payment::psp::{self, Faults, PspConfig, PspHandle};
use clap::{Args, ValueEnum};

use super::scenario;
use crate::report;
use serde::Serialize;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// Flags of `backstop storm run`.
#[derive(Debug, Clone, Args)]
pub(crate) struct RunArgs {
    /// Which experiment to run.
    #[arg(long, value_enum)]
    scenario: LiveScenario,
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

/// The experiments `storm run` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum LiveScenario {
    /// The PSP slows from 100 ms to 600 ms for 20 s: naive vs backstop clients.
    Slowdown,
    /// 3x the measured capacity for 20 s.
    Overload,
    /// The PSP refuses everything for 10 s, then comes back with cold-start latency.
    Outage,
}

/// How the PSP behaves from `at` on.
#[derive(Debug, Clone, Copy)]
struct Phase {
    at: Duration,
    latency: Duration,
    unavailable: bool,
}

/// One side of a comparison: the flags its `serve` and `load` get.
#[derive(Debug, Clone)]
struct Variant {
    name: &'static str,
    serve: Vec<&'static str>,
    load: Vec<&'static str>,
}

/// A scenario made concrete.
#[derive(Debug, Clone)]
struct Plan {
    /// Logical requests per second offered (`None`: a multiple of the measured capacity).
    rate: Option<f64>,
    capacity_multiple: f64,
    duration: Duration,
    /// When the load drops back (for the recovery time), if the scenario has such a moment.
    recovery_at: Option<Duration>,
    phases: Vec<Phase>,
    variants: Vec<Variant>,
}

const MS: fn(u64) -> Duration = Duration::from_millis;
const S: fn(u64) -> Duration = Duration::from_secs;

fn plan(scenario: LiveScenario) -> Plan {
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

/// One second of one variant: the load's series and the server's samples.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Second {
    /// Seconds from the start of the load.
    pub(crate) t_s: f64,
    /// First attempts sent.
    pub(crate) originals: u64,
    /// Retries sent.
    pub(crate) retries: u64,
    /// Hedged copies sent.
    pub(crate) hedges: u64,
    /// Logical requests that succeeded.
    pub(crate) ok: u64,
    /// ... refused by admission.
    pub(crate) rejected: u64,
    /// ... whose deadline passed.
    pub(crate) timeout: u64,
    /// ... that failed otherwise.
    pub(crate) failed: u64,
    /// p99 latency of those that succeeded, in ms.
    pub(crate) p99_ms: Option<f64>,
    /// The gate's limit, as the server published it.
    pub(crate) limit: Option<f64>,
    /// Requests holding a gate slot.
    pub(crate) inflight: Option<f64>,
    /// Requests waiting in the gate's queue.
    pub(crate) queue: Option<f64>,
    /// The server's resident memory, in MiB.
    pub(crate) rss_mib: Option<f64>,
}

/// What one variant did.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct VariantResult {
    /// The variant's name.
    pub(crate) name: String,
    /// Flags its `serve` got.
    pub(crate) serve_flags: Vec<String>,
    /// Flags its `load` got.
    pub(crate) load_flags: Vec<String>,
    /// Logical requests offered per second.
    pub(crate) rate: f64,
    /// The load's own summary (`backstop load --json`).
    pub(crate) load: Value,
    /// Logical requests that succeeded per second of load.
    pub(crate) goodput_per_s: f64,
    /// Attempts sent per logical request.
    pub(crate) attempts_per_logical: f64,
    /// Seconds from the moment the load or the dependency recovered until a whole second
    /// served at least 90% of the offered rate (`None`: never within the run).
    pub(crate) recovery_s: Option<f64>,
    /// Highest resident memory of the server seen, in MiB.
    pub(crate) peak_rss_mib: Option<f64>,
    /// Intents left `running` once the load stopped.
    pub(crate) intents_running: Option<u64>,
    /// Per second.
    pub(crate) seconds: Vec<Second>,
}

/// What a `storm run` measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunResult {
    /// Which scenario.
    pub(crate) scenario: LiveScenario,
    /// Measured capacity (logical requests per second), for scenarios that offer a multiple.
    pub(crate) capacity_per_s: Option<f64>,
    /// What every duration of the scenario was multiplied by.
    pub(crate) time_scale: f64,
    /// Each variant, in order.
    pub(crate) variants: Vec<VariantResult>,
}

/// Runs the scenario and prints (or writes) what it measured.
pub(crate) async fn run(args: RunArgs) -> Result<(), Box<dyn std::error::Error>> {
    let result = execute(args.scenario, args.time_scale).await?;
    if let Some(dir) = &args.out {
        write_out(dir, &result)?;
    }
    if let Some(dir) = &args.report {
        report::write(&to_report(&result), dir)?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        print!("{}", render(&result));
    }
    Ok(())
}

/// Runs `scenario` with every duration multiplied by `scale`.
pub(crate) async fn execute(
    scenario: LiveScenario,
    scale: f64,
) -> Result<RunResult, Box<dyn std::error::Error>> {
    let mut plan = plan(scenario);
    plan.duration = plan.duration.mul_f64(scale);
    plan.recovery_at = plan.recovery_at.map(|d| d.mul_f64(scale));
    for phase in &mut plan.phases {
        phase.at = phase.at.mul_f64(scale);
    }
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
        variants.push(run_variant(&plan, variant, rate, &dir).await?);
    }
    Ok(RunResult {
        scenario,
        capacity_per_s: capacity,
        time_scale: scale,
        variants,
    })
}

/// Offers far more than the service can take for a few seconds and counts what it served.
async fn measure_capacity(
    plan: &Plan,
    work: &Path,
    scale: f64,
) -> Result<f64, Box<dyn std::error::Error>> {
    let probe = Plan {
        duration: S(5).mul_f64(scale.max(0.2)),
        recovery_at: None,
        ..plan.clone()
    };
    let dir = work.join("capacity");
    std::fs::create_dir_all(&dir)?;
    let variant = &plan.variants[0];
    let measured = run_variant(&probe, variant, 2_000.0, &dir).await?;
    Ok(measured.goodput_per_s)
}

async fn run_variant(
    plan: &Plan,
    variant: &Variant,
    rate: f64,
    dir: &Path,
) -> Result<VariantResult, Box<dyn std::error::Error>> {
    let first = plan.phases.first().copied().unwrap_or(Phase {
        at: Duration::ZERO,
        latency: Duration::ZERO,
        unavailable: false,
    });
    let psp = psp::spawn(PspConfig {
        faults: faults_of(first),
        ..PspConfig::default()
    })
    .await?;
    let db = dir.join("pay.db");
    let server = Server::start(&db, &psp.url(), &variant.serve).await?;
    let series_path = dir.join("series.csv");
    let mut load = Command::new(std::env::current_exe()?);
    load.args(["load", "--target", &format!("http://{}", server.http)])
        .args(["--rate", &rate.to_string()])
        .args([
            "--duration",
            &format!("{}ms", plan.duration.as_millis().max(1)),
        ])
        .args(["--concurrency", "100000", "--json", "--series"])
        .arg(&series_path)
        .args(&variant.load)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let load = load.spawn()?;
    let start = Instant::now();
    let output = load.wait_with_output();
    let mut output = std::pin::pin!(output);
    let mut samples = Vec::new();
    let mut next_phase = 1;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let http = reqwest::Client::builder().no_proxy().build()?;
    let output = loop {
        tokio::select! {
            out = &mut output => break out?,
            _ = tick.tick() => {
                samples.push(server.sample(&http, start.elapsed()).await);
            }
            () = sleep_until_phase(plan, next_phase, start) => {
                psp.faults().set(faults_of(plan.phases[next_phase]))?;
                next_phase += 1;
            }
        }
    };
    if !output.status.success() {
        return Err(format!(
            "load failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )
        .into());
    }
    let summary: Value = serde_json::from_slice(&output.stdout)?;
    let intents_running = server.running_intents(&db).await;
    server.stop().await;
    stop_psp(psp).await;

    let mut seconds = read_series(&series_path)?;
    for sample in &samples {
        let index = sample.t.as_secs() as usize;
        if let Some(second) = seconds.get_mut(index) {
            second.limit = sample.limit;
            second.inflight = sample.inflight;
            second.queue = sample.queue;
            second.rss_mib = sample.rss_mib;
        }
    }
    let logical = summary["logical_requests"].as_u64().unwrap_or(0);
    let ok = summary["outcomes"]["ok"].as_u64().unwrap_or(0);
    let attempts = summary["attempts"].as_u64().unwrap_or(0);
    let recovery_s = plan.recovery_at.and_then(|at| recovery(&seconds, at, rate));
    Ok(VariantResult {
        name: variant.name.to_owned(),
        serve_flags: variant.serve.iter().map(|s| (*s).to_owned()).collect(),
        load_flags: variant.load.iter().map(|s| (*s).to_owned()).collect(),
        rate,
        goodput_per_s: ok as f64 / plan.duration.as_secs_f64().max(1e-3),
        attempts_per_logical: if logical == 0 {
            0.0
        } else {
            attempts as f64 / logical as f64
        },
        recovery_s,
        peak_rss_mib: samples.iter().filter_map(|s| s.rss_mib).reduce(f64::max),
        intents_running,
        load: summary,
        seconds,
    })
}

fn faults_of(phase: Phase) -> Faults {
    Faults {
        latency: phase.latency,
        unavailable_rate: if phase.unavailable { 1.0 } else { 0.0 },
        ..Faults::default()
    }
}

async fn sleep_until_phase(plan: &Plan, next: usize, start: Instant) {
    match plan.phases.get(next) {
        Some(phase) => tokio::time::sleep_until(start + phase.at).await,
        None => std::future::pending().await,
    }
}

async fn stop_psp(psp: PspHandle) {
    // Held requests (a slow phase) are cut: nobody is waiting for them any more.
    let _ = tokio::time::timeout(S(5), psp.shutdown()).await;
}

/// Seconds from `at` until the first whole second that served >= 90% of `rate`.
fn recovery(seconds: &[Second], at: Duration, rate: f64) -> Option<f64> {
    seconds
        .iter()
        .filter(|s| s.t_s >= at.as_secs_f64())
        .find(|s| s.ok as f64 >= 0.9 * rate)
        .map(|s| s.t_s + 1.0 - at.as_secs_f64())
}

fn read_series(path: &Path) -> Result<Vec<Second>, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(path)?;
    let mut seconds = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() < 10 {
            return Err(format!("unexpected series row {line:?}").into());
        }
        let n = |i: usize| f[i].parse::<u64>().unwrap_or(0);
        seconds.push(Second {
            t_s: f[0].parse().unwrap_or(0.0),
            originals: n(1),
            retries: n(2),
            hedges: n(3),
            ok: n(4),
            rejected: n(5),
            timeout: n(6),
            failed: n(7),
            p99_ms: f[9].parse().ok(),
            ..Second::default()
        });
    }
    Ok(seconds)
}

/// What the sampler saw at one moment.
#[derive(Debug, Clone, Copy)]
struct Sample {
    t: Duration,
    limit: Option<f64>,
    inflight: Option<f64>,
    queue: Option<f64>,
    rss_mib: Option<f64>,
}

/// A `backstop serve` child process.
struct Server {
    child: Child,
    http: String,
    /// Keeps the log pipe drained.
    _logs: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(
        db: &Path,
        psp: &str,
        flags: &[&str],
    ) -> Result<Server, Box<dyn std::error::Error>> {
        let mut child = Command::new(std::env::current_exe()?)
            .args([
                "--log-format",
                "json",
                "serve",
                "--http",
                "127.0.0.1:0",
                "--grpc",
                "127.0.0.1:0",
            ])
            .arg("--store")
            .arg(format!("sqlite://{}", db.display()))
            .args(["--psp", psp])
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stderr = child.stderr.take().ok_or("no stderr pipe")?;
        let mut lines = BufReader::new(stderr).lines();
        let http = tokio::time::timeout(S(60), async {
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                if v["fields"]["message"] == "payment service listening" {
                    return v["fields"]["http"].as_str().map(str::to_owned);
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
        .ok_or("serve did not start (see its flags)")?;
        let logs = tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Server {
            child,
            http,
            _logs: logs,
        })
    }

    async fn sample(&self, http: &reqwest::Client, t: Duration) -> Sample {
        let text = match http
            .get(format!("http://{}/metrics", self.http))
            .timeout(MS(500))
            .send()
            .await
        {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        let gauge = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse().ok())
        };
        Sample {
            t,
            limit: gauge("rpc_server_concurrency_limit"),
            inflight: gauge("rpc_server_concurrency_inflight"),
            queue: gauge("rpc_server_queue_length"),
            rss_mib: self.child.id().and_then(rss_mib),
        }
    }

    /// Intents left `running`, read from the store once the load has stopped.
    async fn running_intents(&self, db: &Path) -> Option<u64> {
        let db = db.to_owned();
        tokio::task::spawn_blocking(move || {
            let conn = rusqlite::Connection::open_with_flags(
                &db,
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
            )
            .ok()?;
            conn.query_row(
                "SELECT COUNT(*) FROM payment_intent WHERE status = 'running'",
                [],
                |r| r.get::<_, i64>(0),
            )
            .ok()
            .and_then(|n| u64::try_from(n).ok())
        })
        .await
        .ok()
        .flatten()
    }

    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            // SIGTERM: the service drains; SIGKILL after the bound if it does not.
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        if tokio::time::timeout(S(15), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// Resident memory of process `pid`, in MiB (Linux).
fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

fn write_out(dir: &Path, result: &RunResult) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(dir)
        .map_err(|e| format!("cannot create --out {}: {e}", dir.display()))?;
    std::fs::write(dir.join("summary.json"), serde_json::to_vec_pretty(result)?)?;
    for variant in &result.variants {
        let mut csv = String::from(
            "t_s,originals,retries,hedges,ok,rejected,timeout,failed,p99_ms,limit,inflight,queue,\
             rss_mib\n",
        );
        let opt = |v: Option<f64>| v.map(|v| format!("{v}")).unwrap_or_default();
        for s in &variant.seconds {
            csv.push_str(&format!(
                "{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
                s.t_s,
                s.originals,
                s.retries,
                s.hedges,
                s.ok,
                s.rejected,
                s.timeout,
                s.failed,
                opt(s.p99_ms),
                opt(s.limit),
                opt(s.inflight),
                opt(s.queue),
                opt(s.rss_mib),
            ));
        }
        std::fs::write(dir.join(format!("{}.csv", variant.name)), csv)?;
    }
    Ok(())
}

/// The run as a report: one chart series per variant.
fn to_report(result: &RunResult) -> report::Report {
    let mut runs: Vec<report::Run> = result
        .variants
        .iter()
        .map(|v| report::Run {
            name: v.name.clone(),
            summary: vec![
                ("offered".into(), format!("{:.0} /s", v.rate)),
                ("goodput".into(), format!("{:.1} /s", v.goodput_per_s)),
                (
                    "attempts per request".into(),
                    format!("{:.3}", v.attempts_per_logical),
                ),
                (
                    "recovery".into(),
                    v.recovery_s.map_or("-".into(), |s| format!("{s:.0} s")),
                ),
                (
                    "peak server RSS".into(),
                    v.peak_rss_mib.map_or("-".into(), |m| format!("{m:.0} MiB")),
                ),
                (
                    "intents left running".into(),
                    v.intents_running.map_or("-".into(), |n| n.to_string()),
                ),
            ],
            rows: v
                .seconds
                .iter()
                .map(|s| report::Row {
                    time_s: s.t_s + 1.0,
                    offered_originals_per_s: Some(s.originals as f64),
                    offered_retries_per_s: Some((s.retries + s.hedges) as f64),
                    goodput_per_s: Some(s.ok as f64),
                    refused_per_s: Some(s.rejected as f64),
                    queue_depth: s.queue,
                    p99_ms: s.p99_ms,
                    admission_limit: s.limit,
                    in_flight: s.inflight,
                    retry_ratio: (s.originals > 0)
                        .then(|| (s.retries + s.hedges) as f64 / s.originals as f64),
                    ..report::Row::default()
                })
                .collect(),
        })
        .collect();
    // The simulator's mirror of the same scenario, beside the measured runs.
    for sim in super::simulate_all(&mirror(result)) {
        let name = format!("sim: {}", sim.policy);
        runs.push(super::report_run(&sim, name, 1.0));
    }
    report::Report {
        format: String::new(),
        title: format!("storm run: {}", scenario_name(result.scenario)),
        description: describe(result),
        runs,
    }
}

/// Seeds the simulator's mirrors on the report.
const MIRROR_SEED: u64 = 1;

/// `storm sim`'s mirror of the scenario `result` ran: the same rate (or the same multiple of
/// the measured capacity), places, PSP phases, deadlines and variants, on the same time scale.
fn mirror(result: &RunResult) -> scenario::Scenario {
    let scale = result.time_scale;
    match result.scenario {
        LiveScenario::Slowdown => scenario::live_slowdown(MIRROR_SEED, scale),
        LiveScenario::Overload => {
            scenario::live_overload(MIRROR_SEED, scale, result.capacity_per_s)
        }
        LiveScenario::Outage => scenario::live_outage(MIRROR_SEED, scale),
    }
}

fn scenario_name(scenario: LiveScenario) -> &'static str {
    match scenario {
        LiveScenario::Slowdown => "slowdown",
        LiveScenario::Overload => "overload",
        LiveScenario::Outage => "outage",
    }
}

fn describe(result: &RunResult) -> String {
    let what = match result.scenario {
        LiveScenario::Slowdown => {
            "The PSP's latency goes from 100 ms to 600 ms for half the run, then back, under a \
             steady offered load; each variant runs on its own fresh service."
        }
        LiveScenario::Overload => {
            "The service's capacity is measured first, then it is offered three times that."
        }
        LiveScenario::Outage => {
            "The PSP refuses every charge for a quarter of the run, then comes back slow (a cold \
             start) before it is warm again; recovery is the time from its return until a whole \
             second serves 90% of the offered load."
        }
    };
    let mut text = format!(
        "{what}\n\nMeasured on loopback: a real `backstop serve` (SQLite), the PSP simulator and \
         `backstop load`; the limit, in-flight and queue figures are the server's own gauges, \
         sampled once a second."
    );
    if let Some(capacity) = result.capacity_per_s {
        text.push_str(&format!("\n\nMeasured capacity: {capacity:.1} payments/s."));
    }
    text.push_str(&format!(
        "\n\nThe runs named `sim:` are `backstop storm sim`'s mirror of this scenario (seed \
         {MIRROR_SEED}, the same time scale): the same offered rate, places, PSP phases, 2 s \
         deadlines and variants, every server with `serve`'s default gate (a fixed limit behind \
         a slow start with floor 4, the fair queue, a Retry-After computed from the queue), and \
         the clients as `load` sends: backstop with the library's client defaults and a hedge \
         after the p95; naive with 3 attempts 50 ms and 100 ms apart, a fresh 2 s deadline per \
         attempt sent to the server, and any Retry-After ignored."
    ));
    text.push_str(
        "\n\nWhere the simulator and the measured runs are expected to differ, whatever the \
         scenario: the simulated service spends a fixed 1 ms of its own on a request, the real \
         one spends CPU on HTTP, JSON, the idempotency store and SQLite writes, on a machine \
         it shares with the PSP simulator and the load generator, so its capacity is below \
         places / PSP latency and its latency has a tail the simulator does not draw (the \
         simulated PSP latency has a 10 % tail, the PSP simulator's none). Simulated arrivals \
         are Poisson, `load` starts requests evenly spaced: a simulated second of 200/s varies \
         by about 14 requests either way, a measured one does not.",
    );
    text.push_str(&match result.scenario {
        LiveScenario::Slowdown => "\n\nIn this scenario: while the PSP takes 600 ms, 64 \
             places serve about 106/s of the 200/s offered in both. In the real service each of \
             the naive client's extra attempts goes through the idempotency store and the \
             intents table under a fresh key (SQLite writes), which the simulated service does \
             not pay for: a gap in goodput between the measured and the simulated naive runs is \
             that cost."
            .to_owned(),
        LiveScenario::Overload => {
            let capacity = result
                .capacity_per_s
                .map_or("160/s (16 places / 100 ms)".to_owned(), |c| {
                    format!("the measured {c:.1}/s")
                });
            format!(
                "\n\nIn this scenario: both offer three times {capacity}, but the simulated \
                 server serves 16 / 101 ms = 158/s whatever was measured (the real capacity is \
                 measured because the service's own work is not known in advance), so its \
                 goodput over the measured capacity comes out above the measured run's by the \
                 ratio of the two. The real server also spends CPU refusing the excess (every \
                 refusal is an HTTP request parsed and answered, on the cores the load \
                 generator uses too); the simulated one refuses for free."
            )
        }
        LiveScenario::Outage => {
            let scale = result.time_scale;
            format!(
                "\n\nIn this scenario: during the outage the PSP simulator answers every charge \
                 with 503 + `Retry-After: 1` after its 100 ms, and the mirror's downstream does \
                 the same, the server passing the 1 s on as the service's 503 \
                 `psp_unavailable` does; but the real service's PSP client may also retry a 503 \
                 itself after that second, within its own retry budget and storm alarm, holding \
                 a gate slot about 1.2 s, where the simulated server calls its downstream once \
                 per attempt. Neither the simulated downstream nor the PSP simulator gets slower \
                 for being given more calls at once, so in both the slow start can only cost \
                 goodput while it ramps (from 4, doubling per round trip of 400 ms, to 64 in \
                 about 2 s): what it buys, a dependency just back receiving a few calls instead \
                 of the whole backlog, shows in the in-flight figures, not in the goodput. While \
                 the PSP is cold, 64 places at 400 ms serve 160/s of the 200/s offered, so no \
                 variant is back before the PSP is warm at {:.0} s, {:.0} s after its return. \
                 Recovery is measured differently: the first whole second serving 90% of the \
                 offered rate in the real run, the first of three intervals each serving 90% of \
                 the requests it started in the simulator, which Poisson arrivals can move by a \
                 second either way.",
                25.0 * scale,
                5.0 * scale
            )
        }
    });
    text
}

fn render(result: &RunResult) -> String {
    let mut out = format!("scenario {}\n", scenario_name(result.scenario));
    if let Some(capacity) = result.capacity_per_s {
        out.push_str(&format!("measured capacity {capacity:.1}/s\n"));
    }
    out.push_str(&format!(
        "{:<16} {:>8} {:>10} {:>9} {:>9} {:>9} {:>10} {:>9}\n",
        "variant", "rate/s", "goodput/s", "attempts", "not ok", "recovery", "peak RSS", "running"
    ));
    for v in &result.variants {
        let logical = v.load["logical_requests"].as_u64().unwrap_or(0);
        let not_ok = logical.saturating_sub(v.load["outcomes"]["ok"].as_u64().unwrap_or(0));
        out.push_str(&format!(
            "{:<16} {:>8.0} {:>10.1} {:>9.3} {:>9} {:>9} {:>10} {:>9}\n",
            v.name,
            v.rate,
            v.goodput_per_s,
            v.attempts_per_logical,
            not_ok,
            v.recovery_s.map_or("-".to_owned(), |s| format!("{s:.0} s")),
            v.peak_rss_mib
                .map_or("-".to_owned(), |m| format!("{m:.0} MiB")),
            v.intents_running.map_or("-".to_owned(), |n| n.to_string()),
        ));
    }
    out
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
    fn recovery_is_the_first_whole_second_at_ninety_percent() {
        let second = |t: f64, ok: u64| Second {
            t_s: t,
            ok,
            ..Second::default()
        };
        let seconds = [
            second(0.0, 100),
            second(1.0, 10),
            second(2.0, 50),
            second(3.0, 95),
            second(4.0, 100),
        ];
        assert_eq!(recovery(&seconds, S(1), 100.0), Some(3.0));
        assert_eq!(recovery(&seconds[..3], S(1), 100.0), None);
    }

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
        assert!(parse_scale("0").is_err());
        assert!(parse_scale("x").is_err());
        assert_eq!(parse_scale("0.5"), Ok(0.5));
    }

    /// A measured run of `scenario` as `execute` returns it, one second per variant, without
    /// running anything.
    fn measured(scenario: LiveScenario, time_scale: f64) -> RunResult {
        let variants = plan(scenario)
            .variants
            .iter()
            .map(|v| VariantResult {
                name: v.name.to_owned(),
                serve_flags: v.serve.iter().map(|s| (*s).to_owned()).collect(),
                load_flags: v.load.iter().map(|s| (*s).to_owned()).collect(),
                rate: 200.0,
                load: serde_json::json!({"logical_requests": 200, "outcomes": {"ok": 190}}),
                goodput_per_s: 190.0,
                attempts_per_logical: 1.0,
                recovery_s: None,
                peak_rss_mib: None,
                intents_running: Some(0),
                seconds: vec![Second {
                    t_s: 0.0,
                    originals: 200,
                    ok: 190,
                    ..Second::default()
                }],
            })
            .collect();
        RunResult {
            scenario,
            capacity_per_s: (scenario == LiveScenario::Overload).then_some(143.6),
            time_scale,
            variants,
        }
    }

    #[test]
    fn every_live_scenario_is_mirrored_with_its_variants() {
        for scenario in [
            LiveScenario::Slowdown,
            LiveScenario::Overload,
            LiveScenario::Outage,
        ] {
            let live: Vec<&str> = plan(scenario).variants.iter().map(|v| v.name).collect();
            let mirror = mirror(&measured(scenario, 1.0));
            assert_eq!(mirror.names(), live, "{scenario:?}");
            assert_eq!(mirror.model.duration, plan(scenario).duration);
        }
        // The overload mirror offers three times the measured capacity.
        let overload = mirror(&measured(LiveScenario::Overload, 0.5));
        assert!((overload.model.rate - 3.0 * 143.6).abs() < 1e-9);
        assert_eq!(overload.model.duration, S(10));
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

    /// The report of each live scenario carries the measured runs and, beside them, the
    /// simulator's mirror (`sim: ...`), and says where the two are expected to differ.
    #[test]
    fn the_report_puts_the_simulated_mirror_beside_every_live_scenario() {
        for scenario in [
            LiveScenario::Slowdown,
            LiveScenario::Overload,
            LiveScenario::Outage,
        ] {
            let result = measured(scenario, 0.05);
            let report = to_report(&result);
            let names: Vec<&str> = report.runs.iter().map(|r| r.name.as_str()).collect();
            for variant in &result.variants {
                let sim = format!("sim: {}", variant.name);
                assert!(names.contains(&variant.name.as_str()), "{names:?}");
                assert!(
                    names.contains(&sim.as_str()),
                    "{sim} missing from {names:?}"
                );
            }
            assert_eq!(names.len(), 2 * result.variants.len(), "{names:?}");
            let sim = report
                .runs
                .iter()
                .find(|r| r.name.starts_with("sim: "))
                .unwrap();
            assert!(!sim.rows.is_empty());
            assert!(report.description.contains("The runs named `sim:`"));
            assert!(
                report.description.contains("In this scenario:"),
                "{}",
                report.description
            );
        }
    }
}
