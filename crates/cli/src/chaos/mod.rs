//! `backstop chaos`: an exactly-once checker anyone can run.
//!
//! It starts `serve` instances on a store of its own (one on a SQLite file in a temporary
//! directory, or several on a PostgreSQL schema of their own) in front of an in-process PSP
//! that charges and then loses the answer (late or dropped) at the given rates; sends
//! `--payments` logical payments from `--concurrency` clients, each retrying with its key until
//! a final answer; kills an instance with SIGKILL on a schedule drawn from `--seed` and starts
//! it again at once; then checks the history (see [`check`]) and prints the counts and the
//! first violation with its whole history. Everything stays on loopback and is bounded by
//! `--max-time`.
//!
//! With `--target proxy` the instances are `backstop proxy` in front of an upstream the user
//! started (`--upstream`), on one keyed route, and the payments are requests to that route;
//! the charges checked are the effects the upstream lists at `--ledger` (a JSON array of
//! objects with the `key` each effect's request carried): at most one per key, one per
//! acknowledged key, every answer of a key the same bytes. A 500 `outcome_unknown` is a final
//! refusal there (a key forwarded before a crash, to an upstream that does not deduplicate).

mod check;
mod fleet;
mod ledger;
mod summary;
mod workload;

use std::error::Error;
use std::io::IsTerminal;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use backstop::db::postgres::tokio_postgres;
use backstop::db::sqlite::{Db, SqliteOptions};
use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
use backstop_payment::config::DEFAULT_MERCHANT;
use backstop_payment::intents::Intents;
use backstop_payment::psp::faults::FaultCounts;
use backstop_payment::psp::{self, Faults, PspConfig, PspHandle};
use backstop_payment::psp_client::psp_reference;
use clap::Args;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use check::{Answer, History, Promise, PspCharge, RunningIntent};
use fleet::{Addresses, Fleet, Launch, Role};
use ledger::{Ledger, proxy_routes, read_ledger};
use summary::{Kill, Summary, print, summarize};
use workload::{Workload, millis};

/// Most running intents listed after a run (more means something is badly wrong anyway).
const RUNNING_LIMIT: u32 = 1000;
/// How often a run on a terminal says how far it got.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// What a chaos run puts under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Target {
    /// `backstop serve` in front of an in-process PSP.
    Serve,
    /// `backstop proxy` in front of `--upstream`.
    Proxy,
}

/// Flags of `backstop chaos`.
#[derive(Debug, Clone, Args)]
pub(crate) struct ChaosArgs {
    /// What runs under test: `serve` (the payment service, in front of an in-process PSP) or
    /// `proxy` (`backstop proxy` in front of `--upstream`, its effects read from `--ledger`).
    #[arg(long, value_name = "TARGET", value_enum, default_value_t = Target::Serve)]
    target: Target,
    /// With `--target proxy`: the upstream, `http://HOST:PORT`, started by you; it executes an
    /// effect for each request it gets and lists them at `--ledger`.
    #[arg(long, value_name = "URL")]
    upstream: Option<String>,
    /// With `--target proxy`: where the upstream lists the effects it executed, a JSON array
    /// of objects with `key` (the `Idempotency-Key` the request carried); `effect_key` and
    /// `effect_id` are shown when present. Default: the upstream's `/_effects`.
    #[arg(long, value_name = "URL")]
    ledger: Option<String>,
    /// With `--target proxy`: the path every payment is POSTed to, declared keyed in the
    /// proxy's routes.
    #[arg(long, value_name = "PATH", default_value = "/v1/charges")]
    path: String,
    /// With `--target proxy`: the upstream deduplicates by the effect key, and the route says
    /// so (after a crash the proxy forwards a key again, under the same effect key).
    #[arg(long)]
    upstream_dedups: bool,
    /// A header added to every payment request, `NAME: VALUE` (repeatable): e.g. a delay the
    /// upstream understands, so that kills land while requests are at the upstream.
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// `sqlite` (one instance on a file in a temporary directory) or a PostgreSQL URL
    /// (`postgres://USER@HOST:PORT/DB`: the instances share a schema created for the run).
    #[arg(long, value_name = "STORE", default_value = "sqlite")]
    store: String,
    /// `serve` instances (more than one needs PostgreSQL).
    #[arg(long, value_name = "N", default_value = "1")]
    instances: NonZeroUsize,
    /// Logical payments: each a new order with its own key.
    #[arg(long, value_name = "N", default_value = "1000")]
    payments: NonZeroUsize,
    /// Clients sending at once.
    #[arg(long, value_name = "N", default_value = "16")]
    concurrency: NonZeroUsize,
    /// Mean time between two kills (each drawn in [0.5, 1.5] times this); 0 for no kills.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration)]
    kill_every: Duration,
    /// Exactly this many kills instead, spread evenly over the payments (the k-th once k in
    /// K + 1 of them have their final answer), whatever the speed of the machine.
    #[arg(long, value_name = "K", conflicts_with = "kill_every")]
    kills: Option<usize>,
    /// Seed of the kill schedule and the clients' choices (random when absent; printed).
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// Probability in [0, 1] that the PSP charges, then answers after the caller's deadline.
    #[arg(long, value_name = "F", default_value_t = 0.05, value_parser = crate::psp::parse_rate)]
    commit_then_timeout_rate: f64,
    /// Probability in [0, 1] that the PSP charges, then closes the connection unanswered.
    #[arg(long, value_name = "F", default_value_t = 0.05, value_parser = crate::psp::parse_rate)]
    commit_then_drop_rate: f64,
    /// Seed of the PSP's faults (the run's seed when absent).
    #[arg(long, value_name = "N")]
    psp_seed: Option<u64>,
    /// Budget of each attempt, sent as `grpc-timeout`.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = parse_duration)]
    timeout: Duration,
    /// Bound on the workload: payments without a final answer by then are violations.
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_duration)]
    max_time: Duration,
    /// Bound on the checks after the workload (lookups, replays).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    settle: Duration,
    /// Keep the PostgreSQL schema, and the temporary directory (SQLite store, logs) which a
    /// failed run keeps anyway.
    #[arg(long)]
    keep: bool,
    /// Print the summary as one JSON object.
    #[arg(long)]
    json: bool,
}

/// When instances are killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Schedule {
    /// After jittered pauses of this mean.
    Every(Duration),
    /// This many times, spread over the payments.
    Spread(usize),
    /// Never.
    Never,
}

/// Where the instances keep their state.
#[derive(Debug, Clone, PartialEq, Eq)]
enum StoreKind {
    Sqlite,
    Postgres(String),
}

impl ChaosArgs {
    fn store_kind(&self) -> Result<StoreKind, String> {
        match (self.target, &self.upstream) {
            (Target::Proxy, None) => {
                return Err("--target proxy needs --upstream URL (an upstream you started)".into());
            }
            (Target::Serve, Some(_)) => {
                return Err("--upstream is for --target proxy".into());
            }
            (Target::Proxy, Some(url)) => {
                if !url.starts_with("http://") {
                    return Err(format!("--upstream must be an http:// URL, got {url:?}"));
                }
                if !self.path.starts_with('/') || self.path.contains(['{', '}', ' ']) {
                    return Err(format!(
                        "--path must be a plain path starting with /, got {:?}",
                        self.path
                    ));
                }
            }
            (Target::Serve, None) => {}
        }
        let kind = if self.store == "sqlite" {
            StoreKind::Sqlite
        } else if self.store.starts_with("postgres://") || self.store.starts_with("postgresql://") {
            if self.store.contains("options=") {
                return Err("--store: the URL must not set `options` (the run sets search_path to its own schema)".into());
            }
            StoreKind::Postgres(self.store.clone())
        } else {
            return Err(format!(
                "--store must be `sqlite` or a postgres:// URL, got {:?}",
                self.store
            ));
        };
        if kind == StoreKind::Sqlite && self.instances.get() > 1 {
            return Err("--instances above 1 needs a shared store: --store postgres://...".into());
        }
        let faults = self.faults();
        faults.validate().map_err(|e| e.to_string())?;
        Ok(kind)
    }

    fn schedule(&self) -> Schedule {
        match self.kills {
            Some(0) => Schedule::Never,
            Some(kills) => Schedule::Spread(kills),
            None if self.kill_every.is_zero() => Schedule::Never,
            None => Schedule::Every(self.kill_every),
        }
    }

    /// Checks what clap cannot: the store, the instances it allows, the fault rates together.
    pub(crate) fn validate(&self) -> Result<(), clap::Error> {
        self.store_kind().map(drop).map_err(|e| {
            clap::Error::raw(clap::error::ErrorKind::ArgumentConflict, format!("{e}\n"))
        })
    }

    fn faults(&self) -> Faults {
        Faults {
            commit_then_timeout_rate: self.commit_then_timeout_rate,
            commit_then_drop_rate: self.commit_then_drop_rate,
            ..Faults::default()
        }
    }
}

/// Runs the chaos check; an error when the run could not be made or found a violation.
pub(crate) async fn run(args: ChaosArgs) -> Result<(), Box<dyn Error>> {
    let kind = args.store_kind()?;
    let seed = args.seed.unwrap_or_else(rand::random);
    let psp_seed = args.psp_seed.unwrap_or(seed);
    let run_id = format!("chaos-{seed:x}-{:x}", rand::random::<u32>());
    let dir = tempfile::Builder::new()
        .prefix("backstop-chaos-")
        .tempdir()?;
    let schema = match &kind {
        StoreKind::Sqlite => None,
        StoreKind::Postgres(url) => Some(Schema::create(url, &run_id.replace('-', "_")).await?),
    };
    let outcome = run_in(&args, &kind, seed, psp_seed, &run_id, &dir, schema.as_ref()).await;
    // A run that could not be made, or found a violation, keeps its logs and store.
    let failed = outcome
        .as_ref()
        .map_or(true, |summary| summary.violations > 0);
    let kept = (args.keep || failed).then(|| dir.keep().display().to_string());
    if let Some(schema) = &schema {
        if args.keep {
            eprintln!("kept schema {}", schema.name);
        } else if let Err(error) = schema.drop().await {
            eprintln!("warning: cannot drop schema {}: {error}", schema.name);
        }
    }
    let mut summary = outcome.map_err(|error| match &kept {
        Some(path) => format!("{error} (logs kept in {path})").into(),
        None => error,
    })?;
    summary.kept = kept;
    print(&summary, args.json)?;
    match summary.violations {
        0 => Ok(()),
        n => Err(format!(
            "{n} violation(s) of exactly-once; first: {}",
            summary
                .first_violation
                .as_ref()
                .map_or(String::new(), |e| e.violation.to_string())
        )
        .into()),
    }
}

async fn run_in(
    args: &ChaosArgs,
    kind: &StoreKind,
    seed: u64,
    psp_seed: u64,
    run_id: &str,
    dir: &tempfile::TempDir,
    schema: Option<&Schema>,
) -> Result<Summary, Box<dyn Error>> {
    let sqlite_path = dir.path().join("backstop.db");
    let store = match (kind, schema) {
        (StoreKind::Postgres(url), Some(schema)) => schema.store_url(url),
        _ => format!("sqlite://{}", sqlite_path.display()),
    };
    // The PSP behind `serve`, or the upstream's ledger behind a proxy: where charges are read.
    let (charges, role) = match (args.target, &args.upstream) {
        (Target::Proxy, Some(upstream)) => {
            let config = dir.path().join("routes.toml");
            std::fs::write(&config, proxy_routes(&args.path, args.upstream_dedups))?;
            let ledger = args
                .ledger
                .clone()
                .unwrap_or_else(|| format!("{}/_effects", upstream.trim_end_matches('/')));
            let role = Role::Proxy {
                upstream: upstream.clone(),
                config,
            };
            (Charges::Ledger(ledger), role)
        }
        _ => {
            let psp = psp::spawn(PspConfig {
                faults: args.faults(),
                seed: Some(psp_seed),
                ..PspConfig::default()
            })
            .await?;
            let role = Role::Serve { psp: psp.url() };
            (Charges::Psp(psp), role)
        }
    };
    let launch = Launch {
        bin: std::env::current_exe()?,
        store: store.clone(),
        role,
        log_dir: dir.path().to_owned(),
    };
    let mut fleet = Fleet::start(launch, args.instances.get()).await?;

    let started = Instant::now();
    let workload = Workload {
        payments: args.payments.get(),
        concurrency: args.concurrency.get(),
        timeout: args.timeout,
        run_id: run_id.to_owned(),
        seed,
        deadline: started + args.max_time,
        path: args.payment_path().to_owned(),
        headers: args.headers.clone(),
        outcome_unknown_is_final: args.target == Target::Proxy,
    };
    let progress = Arc::new(AtomicUsize::new(0));
    let mut clients = tokio::spawn(workload::run(
        workload,
        fleet.addresses(),
        started,
        progress.clone(),
    ));
    let mut rng = StdRng::seed_from_u64(seed);
    let mut kills = Vec::new();
    let schedule = args.schedule();
    // A line on a terminal now and then: a long run is not a hung one.
    let mut report = tokio::time::interval_at(started + PROGRESS_EVERY, PROGRESS_EVERY);
    let on_terminal = std::io::stderr().is_terminal();
    let payments = loop {
        // When the next kill is due: after a jittered pause, or once enough payments have
        // their final answer (polled: the clients only count).
        let due = match schedule {
            Schedule::Every(mean) => Some(mean.mul_f64(rng.random_range(0.5..1.5))),
            Schedule::Spread(total) if kills.len() < total => Some(Duration::from_millis(20)),
            Schedule::Spread(_) | Schedule::Never => None,
        };
        tokio::select! {
            payments = &mut clients => break payments?,
            _ = report.tick(), if on_terminal => {
                eprintln!(
                    "chaos: {} of {} payments final, {} kills, {:.0} s",
                    progress.load(Ordering::Relaxed),
                    args.payments,
                    kills.len(),
                    started.elapsed().as_secs_f64()
                );
            }
            () = tokio::time::sleep(due.unwrap_or_default()), if due.is_some() => {
                if let Schedule::Spread(total) = schedule {
                    let threshold = (kills.len() + 1) * args.payments.get() / (total + 1);
                    if progress.load(Ordering::Relaxed) < threshold {
                        continue;
                    }
                }
                let instance = rng.random_range(0..fleet.len());
                let at_ms = millis(started.elapsed());
                let restarted = async {
                    fleet.kill(instance).await?;
                    let restart = Instant::now();
                    fleet.restart(instance).await?;
                    Ok::<_, fleet::FleetError>(restart.elapsed())
                }
                .await;
                match restarted {
                    Ok(took) => kills.push(Kill { at_ms, instance, restart_ms: millis(took) }),
                    Err(error) => {
                        clients.abort();
                        return Err(error.into());
                    }
                }
            }
        }
    };
    let workload_time = started.elapsed();

    let mut history = History {
        promise: match args.target {
            Target::Serve => Promise::Payments,
            Target::Proxy => Promise::Effects,
        },
        payments,
        running: Vec::new(),
        psp_charges: 0,
    };
    let ledger = match &charges {
        Charges::Psp(_) => None,
        Charges::Ledger(url) => Some(read_ledger(url, run_id).await?),
    };
    verify(
        &mut history,
        &fleet.addresses(),
        &charges,
        ledger.as_ref(),
        args,
    )
    .await;
    fleet.stop().await;
    let (psp_charges, psp_faults) = match charges {
        Charges::Psp(psp) => {
            history.running = running_intents(kind, &sqlite_path, &store).await?;
            let total = psp.store().count().await?;
            let faults = psp.faults().drawn();
            psp.shutdown().await;
            (total, faults)
        }
        Charges::Ledger(_) => {
            let total = ledger.as_ref().map_or(0, Ledger::total);
            (total, FaultCounts::default())
        }
    };
    history.psp_charges = psp_charges;

    let violations = check::check(&history);
    Ok(summarize(
        args,
        kind,
        seed,
        psp_seed,
        &history,
        &violations,
        kills,
        (psp_charges, psp_faults),
        workload_time,
        started.elapsed(),
    ))
}

/// Where a run reads what was charged.
enum Charges {
    /// The in-process PSP behind `serve`.
    Psp(PspHandle),
    /// The upstream's list of effects at this URL, behind a proxy.
    Ledger(String),
}

/// After the workload: looks up and replays every acknowledged payment, converges the ones
/// left with an unknown outcome, and reads the charges of every order (the PSP's, or behind a
/// proxy the upstream's effects).
async fn verify(
    history: &mut History,
    addresses: &Addresses,
    charges: &Charges,
    ledger: Option<&Ledger>,
    args: &ChaosArgs,
) {
    let deadline = Instant::now() + args.settle;
    let http = workload::client(args.timeout);
    let gate = Arc::new(Semaphore::new(args.concurrency.get()));
    let mut checks = tokio::task::JoinSet::new();
    for (index, payment) in history.payments.iter().enumerate() {
        let (http, addresses, gate) = (http.clone(), addresses.clone(), gate.clone());
        let (order_id, key) = (payment.order_id.clone(), payment.key.clone());
        let ack = payment
            .attempts
            .iter()
            .find(|a| a.acknowledged())
            .map(|a| a.body.clone());
        // Behind a proxy nothing is looked up: the upstream's answers are its own.
        let intent = match charges {
            Charges::Psp(_) => payment
                .attempts
                .iter()
                .rev()
                .find_map(|a| check::intent_id(&a.body)),
            Charges::Ledger(_) => None,
        };
        let store = match charges {
            Charges::Psp(psp) => Some(psp.store().clone()),
            Charges::Ledger(_) => None,
        };
        let effects = ledger
            .and_then(|l| l.by_key.get(&key))
            .cloned()
            .unwrap_or_default();
        let path = args.payment_path().to_owned();
        let headers = args.headers.clone();
        let timeout = args.timeout;
        checks.spawn(async move {
            let Ok(_permit) = gate.acquire_owned().await else {
                return (index, None, None, Vec::new());
            };
            // A GET converges an intent the PSP charged; for an acknowledged one it reads the
            // stored payment back.
            let lookup = match &intent {
                Some(id) => {
                    let path = format!("/v1/payments/{id}");
                    send(&addresses, deadline, |base| {
                        http.get(format!("{base}{path}"))
                    })
                    .await
                }
                None => None,
            };
            let replay = match ack {
                Some(_) => {
                    let body = workload::body(&order_id);
                    send(&addresses, deadline, |base| {
                        let mut request = http
                            .post(format!("{base}{path}"))
                            .header("content-type", "application/json")
                            .header("idempotency-key", &key)
                            .header("grpc-timeout", workload::grpc_timeout(timeout));
                        for (name, value) in &headers {
                            request = request.header(name, value);
                        }
                        request.body(body.clone())
                    })
                    .await
                }
                None => None,
            };
            let charges = match store {
                Some(store) => store
                    .list(Some(psp_reference(DEFAULT_MERCHANT, &order_id)))
                    .await
                    .unwrap_or_default()
                    .into_iter()
                    .map(|c| PspCharge {
                        charge_id: c.charge_id,
                        effect_key: c.effect_key,
                    })
                    .collect(),
                None => effects,
            };
            (index, lookup, replay, charges)
        });
    }
    while let Some(result) = checks.join_next().await {
        if let Ok((index, lookup, replay, charges)) = result {
            let payment = &mut history.payments[index];
            payment.lookup = lookup;
            payment.replay = replay;
            payment.charges = charges;
        }
    }
}

/// Sends the request `build` makes for a live instance until it gets an answer that is not a
/// 5xx, 409 or 429 (or the deadline passes: the last answer, if any).
async fn send(
    addresses: &Addresses,
    deadline: Instant,
    build: impl Fn(&str) -> reqwest::RequestBuilder,
) -> Option<Answer> {
    let mut last = None;
    let mut pause = Duration::from_millis(50);
    while Instant::now() < deadline {
        let base = (0..addresses.len()).find_map(|i| addresses.get(i));
        if let Some(base) = base {
            if let Ok(response) = build(&base).send().await {
                let status = response.status().as_u16();
                if let Ok(body) = response.text().await {
                    let answer = Answer { status, body };
                    if !matches!(status, 409 | 429 | 500..=599) {
                        return Some(answer);
                    }
                    last = Some(answer);
                }
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
    last
}

/// The intents the store still holds `running`, read from the store itself.
async fn running_intents(
    kind: &StoreKind,
    sqlite_path: &std::path::Path,
    store: &str,
) -> Result<Vec<RunningIntent>, Box<dyn Error>> {
    let intents = match kind {
        StoreKind::Sqlite => {
            Intents::open(Db::open(sqlite_path, SqliteOptions::default())?).await?
        }
        StoreKind::Postgres(_) => {
            let store = PostgresStore::connect(store, PostgresOptions::default()).await?;
            Intents::postgres(store.pool().clone(), store.timeout()).await?
        }
    };
    Ok(intents
        .running_before(i64::MAX, RUNNING_LIMIT)
        .await?
        .into_iter()
        .map(|i| RunningIntent {
            intent_id: i.intent_id,
            order_id: i.order_id,
        })
        .collect())
}

/// A PostgreSQL schema created for one run.
#[derive(Debug)]
struct Schema {
    url: String,
    name: String,
}

impl Schema {
    async fn create(url: &str, name: &str) -> Result<Schema, Box<dyn Error>> {
        let schema = Schema {
            url: url.to_owned(),
            name: name.to_owned(),
        };
        schema
            .execute(&format!("CREATE SCHEMA {}", schema.name))
            .await?;
        Ok(schema)
    }

    /// `url` with this schema first on the search path.
    fn store_url(&self, url: &str) -> String {
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}options=-c%20search_path%3D{}", self.name)
    }

    async fn drop(&self) -> Result<(), Box<dyn Error>> {
        self.execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name))
            .await
    }

    async fn execute(&self, sql: &str) -> Result<(), Box<dyn Error>> {
        let (client, connection) = tokio_postgres::connect(&self.url, tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("cannot connect to PostgreSQL: {e}"))?;
        let connection = tokio::spawn(connection);
        client.batch_execute(sql).await?;
        drop(client);
        let _ = connection.await;
        Ok(())
    }
}

impl ChaosArgs {
    /// Where each payment is POSTed.
    fn payment_path(&self) -> &str {
        match self.target {
            Target::Serve => "/v1/payments",
            Target::Proxy => &self.path,
        }
    }
}

/// `NAME: VALUE`, a valid header.
fn parse_header(s: &str) -> Result<(String, String), String> {
    let (name, value) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not a header like `X-Delay: 50`"))?;
    let (name, value) = (name.trim(), value.trim());
    http::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("{name:?} is not a header name"))?;
    http::HeaderValue::from_str(value).map_err(|_| format!("{value:?} is not a header value"))?;
    Ok((name.to_owned(), value.to_owned()))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 300ms or 2s: {e}"))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        chaos: ChaosArgs,
    }

    fn parse(args: &[&str]) -> Result<ChaosArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("chaos").chain(args.iter().copied())).map(|c| c.chaos)
    }

    #[test]
    fn defaults_are_sqlite_with_faults_and_kills() {
        let args = parse(&[]).unwrap();
        assert_eq!(args.store_kind().unwrap(), StoreKind::Sqlite);
        assert_eq!(args.schedule(), Schedule::Every(Duration::from_secs(1)));
        assert_eq!(
            parse(&["--kills", "7"]).unwrap().schedule(),
            Schedule::Spread(7)
        );
        assert_eq!(
            parse(&["--kills", "0"]).unwrap().schedule(),
            Schedule::Never
        );
        assert_eq!(
            parse(&["--kill-every", "0s"]).unwrap().schedule(),
            Schedule::Never
        );
        assert!(parse(&["--kills", "3", "--kill-every", "1s"]).is_err());
        assert_eq!(args.faults().commit_then_drop_rate, 0.05);
        assert_eq!(args.faults().commit_then_timeout_rate, 0.05);
    }

    #[test]
    fn bad_flags_are_clear_errors() {
        let several_on_sqlite = parse(&["--instances", "2"]).unwrap();
        assert!(
            several_on_sqlite
                .store_kind()
                .unwrap_err()
                .contains("postgres")
        );
        let unknown = parse(&["--store", "mysql://x"]).unwrap();
        assert!(unknown.store_kind().unwrap_err().contains("sqlite"));
        let options = parse(&["--store", "postgres://u@h/db?options=-c%20x"]).unwrap();
        assert!(options.store_kind().unwrap_err().contains("options"));
        let too_much = parse(&[
            "--commit-then-timeout-rate",
            "0.7",
            "--commit-then-drop-rate",
            "0.7",
        ])
        .unwrap();
        assert!(too_much.store_kind().is_err());
        assert!(parse(&["--payments", "0"]).is_err());
        assert!(parse(&["--commit-then-drop-rate", "2"]).is_err());
        assert!(parse(&["--kill-every", "often"]).is_err());
        let pg = parse(&["--store", "postgres://u@h/db", "--instances", "3"]).unwrap();
        assert_eq!(
            pg.store_kind().unwrap(),
            StoreKind::Postgres("postgres://u@h/db".into())
        );
    }

    #[test]
    fn the_proxy_target_needs_an_upstream_and_reads_its_ledger() {
        let no_upstream = parse(&["--target", "proxy"]).unwrap();
        assert!(no_upstream.store_kind().unwrap_err().contains("--upstream"));
        let serve_upstream = parse(&["--upstream", "http://127.0.0.1:9"]).unwrap();
        assert!(
            serve_upstream
                .store_kind()
                .unwrap_err()
                .contains("--target proxy")
        );
        let https = parse(&["--target", "proxy", "--upstream", "https://x"]).unwrap();
        assert!(https.store_kind().unwrap_err().contains("http://"));
        let pattern = parse(&[
            "--target",
            "proxy",
            "--upstream",
            "http://x",
            "--path",
            "/a/{id}",
        ]);
        assert!(
            pattern
                .unwrap()
                .store_kind()
                .unwrap_err()
                .contains("--path")
        );
        assert!(parse(&["--header", "no colon"]).is_err());
        assert!(parse(&["--header", "bad name: 1"]).is_err());

        let args = parse(&[
            "--target",
            "proxy",
            "--upstream",
            "http://127.0.0.1:9",
            "--header",
            "X-Upstream-Sleep-Ms: 50",
            "--upstream-dedups",
        ])
        .unwrap();
        assert_eq!(args.store_kind().unwrap(), StoreKind::Sqlite);
        assert_eq!(args.payment_path(), "/v1/charges");
        assert_eq!(args.headers, [("X-Upstream-Sleep-Ms".into(), "50".into())]);
    }

    #[test]
    fn the_schema_goes_on_the_search_path() {
        let schema = Schema {
            url: String::new(),
            name: "chaos_1".into(),
        };
        assert_eq!(
            schema.store_url("postgres://u@h/db"),
            "postgres://u@h/db?options=-c%20search_path%3Dchaos_1"
        );
        assert_eq!(
            schema.store_url("postgres://u@h/db?sslmode=disable"),
            "postgres://u@h/db?sslmode=disable&options=-c%20search_path%3Dchaos_1"
        );
    }
}
