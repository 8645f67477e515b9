//! `backstop`: run the reference payment system's processes.
//!
//! - `backstop serve`: the payment service (HTTP JSON, `/metrics`, `/healthz`, `/readyz`) with an
//!   embedded PSP unless `--psp URL` is given.
//! - `backstop psp`: the PSP simulator (a fake payment provider with fault injection).
//! - `backstop load`: an open-loop load driver for the payment service, with a summary of
//!   attempts, retries, outcomes, latency per attempt and stop reasons.
//! - `backstop reconcile`: compares the PSP's charges with the payment store; with `--apply`,
//!   refunds duplicate charges and settles orphaned intents, recording each action.
//! - `backstop storm sim`: a deterministic simulation of retry storms, overload and recovery,
//!   with the library's own policies as clients and admission; `backstop storm run`: the same
//!   experiments against the real service, with HTML reports.
//! - `backstop proxy`: a reverse proxy giving any HTTP or gRPC service durable idempotency,
//!   deadlines across the hop and admission control, from the library's server stack; it
//!   lives in its own crate, `backstop_proxy` (crates/proxy), which this command dispatches to.
//! - `backstop chaos`: an exactly-once checker: payments retried through SIGKILLs and PSP
//!   faults, then the history checked.

use std::collections::BTreeSet;
use std::error::Error;
use std::ffi::OsString;
use std::process::ExitCode;

use backstop_proxy::error_chain::Chain;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};

mod api_keys;
mod chaos;
mod config_file;
mod load;
mod logging;
#[cfg(feature = "otel")]
mod otel;
mod package_assets;
mod psp;
mod reconcile;
mod report;
mod retries;
mod serve;
mod serve_policies;
mod storm;

/// glibc's allocator serialises frees of memory allocated on another thread behind an arena
/// lock; under a multi-threaded tokio runtime, where a request's futures and buffers often
/// move between workers, that lock was most of the process's futex calls (measured in
/// BENCHMARKS.md: the RPC overhead bench gains about a third of its throughput with mimalloc).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// backstop: RPC reliability toolkit and its reference payment system.
#[derive(Debug, Parser)]
#[command(
    name = "backstop",
    version,
    about = "backstop's reference payment system: the payment service, a PSP simulator, a load driver and an exactly-once checker; and a reverse proxy giving any service the same promises"
)]
struct Cli {
    /// Log lines on stderr: `text` (readable) or `json` (one object a line). Default: text on
    /// a terminal, JSON otherwise. `RUST_LOG` filters them.
    #[arg(long, global = true, value_enum, value_name = "FORMAT")]
    log_format: Option<logging::LogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the payment service (HTTP JSON and gRPC, with retries made safe by idempotency keys)
    ///
    /// HTTP JSON on 127.0.0.1:8081 and gRPC on 127.0.0.1:50051 by default, a SQLite store, and
    /// an embedded PSP unless --psp is given.
    Serve(Box<serve::ServeArgs>),
    /// Run the PSP simulator: a fake payment provider with fault injection
    ///
    /// It keeps its own store, deduplicates charges on the effect key, and injects errors,
    /// latency and lost answers on demand.
    Psp(psp::PspArgs),
    /// Drive the payment service with open-loop load and summarise what it cost
    ///
    /// Each logical request is a new order with its own key; the summary gives attempts,
    /// retries, outcomes and latency per attempt.
    Load(load::LoadArgs),
    /// Compare the PSP's charges with the payment store; --apply refunds duplicates
    ///
    /// Finds duplicate charges, orphaned intents and charges, and amount or currency
    /// mismatches for a time window or a list of orders. A dry run by default; --apply refunds
    /// each duplicate (once, whatever the number of runs), marks orphaned intents succeeded,
    /// and records every action in the store's `reconciliation` table.
    Reconcile(reconcile::ReconcileArgs),
    /// Write a sample HTML report from synthetic data (development aid for the report writer)
    #[command(hide = true)]
    ReportSample(report::SampleArgs),
    /// The storm lab: retry storms, overload and recovery, reproduced
    ///
    /// `storm sim` simulates a scenario deterministically (virtual time, seeded) with the
    /// library's own retry, budget, storm alarm, hedging and admission policies; `storm run`
    /// runs one against the real service, PSP simulator and load driver on loopback.
    Storm(storm::StormArgs),
    /// Check exactly-once under SIGKILLs and PSP faults, and print the first violation
    ///
    /// Starts `serve` instances on a store of their own and a PSP that charges and then loses
    /// the answer; clients retry each payment with its key until a final answer while
    /// instances are killed and restarted; then every order must be charged at most once,
    /// every acknowledged payment stored, succeeded and charged once, nothing left running and
    /// every same-key answer byte-identical. Exits non-zero on a violation.
    Chaos(chaos::ChaosArgs),
    /// Write the man pages and shell completions generated from these definitions (for the
    /// Debian package: deploy/debian/build)
    #[command(hide = true)]
    PackageAssets(package_assets::PackageAssetsArgs),
    /// Run a reverse proxy that makes retries safe for a service in any language
    ///
    /// In front of an HTTP/1.1 or h2c upstream: keyed routes (from the routes file, see
    /// --check-config) are forwarded at most once per Idempotency-Key, with answers replayed
    /// byte for byte from an embedded SQLite (or a shared PostgreSQL) store; the caller's
    /// budget (grpc-timeout or a timeout header) reaches the upstream minus the hop's margin,
    /// 504 when it runs out; a bounded fair queue answers 503 + Retry-After under overload.
    /// Prometheus metrics on --admin.
    Proxy(Box<backstop_proxy::ProxyArgs>),
    /// Turn the fleet's retries off, on, or down to a budget, for every client at once
    ///
    /// Every backstop client watching the same Redis key (serve --redis, load and proxy with
    /// --retry-switch-redis) applies the setting within a quarter of a second: `off` stops
    /// retries and hedges, `budget 0.02` holds them to 2 % of requests, `on` lets each
    /// destination's own budget decide. `--for 10m` ends a setting by itself.
    Retries(retries::RetriesArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let (cli, matches) = parse();
    // The load driver would drown its own summary in per-attempt events: warnings only.
    let default_level = match cli.command {
        Command::Load(_) | Command::Reconcile(_) | Command::Chaos(_) => "warn",
        // The simulated clients' policies log as real ones do; only errors belong here.
        Command::Storm(_) => "error",
        _ => "info",
    };
    let traces_url = match &cli.command {
        Command::Serve(args) => args
            .otlp_traces_url()
            .unwrap_or_else(|error| usage_error(error, "serve")),
        _ => None,
    };
    // The exporter exists only when asked for: without --otlp-endpoint nothing is built.
    #[cfg(feature = "otel")]
    let (export, extra) = match traces_url.as_ref().map(otel::install).transpose() {
        Ok(Some((export, layer))) => (Some(export), Some(layer)),
        Ok(None) => (None, None),
        Err(error) => {
            eprintln!("error: cannot export spans: {error}");
            return ExitCode::from(2);
        }
    };
    #[cfg(not(feature = "otel"))]
    let extra = {
        debug_assert!(traces_url.is_none(), "refused by otlp_traces_url");
        None
    };
    if let Err(error) = logging::init(cli.log_format, default_level, extra) {
        // Same status as a flag error: the process was started wrong and did nothing.
        eprintln!("error: {error}");
        return ExitCode::from(2);
    }
    let result: Result<(), Box<dyn Error>> = match cli.command {
        Command::Serve(args) => {
            let mut config = args
                .config()
                .unwrap_or_else(|error| usage_error(error, "serve"));
            if let (Some(section), Some(file)) = (matches.policies.clone(), args.config_file()) {
                if let Err(message) = serve_policies::apply(&mut config, section) {
                    usage_error(config_file::file_error(file, &message), "serve");
                }
            }
            if args.print_config() {
                let table = config.method_policies();
                let merchants: Vec<String> =
                    config.api_keys.iter().map(|k| k.merchant.clone()).collect();
                print!(
                    "{}",
                    config_file::print(
                        &serve_command(),
                        &matches.serve,
                        &matches.from_file,
                        &merchants,
                        (matches.policies.as_ref(), &table),
                    )
                );
                return ExitCode::SUCCESS;
            }
            let file = args.config_file().map(std::path::Path::to_path_buf);
            let result = serve::run(config, file, shutdown_signal()).await;
            // After the drain: the last requests' spans are batched by now.
            #[cfg(feature = "otel")]
            if let Some(export) = export {
                export.shutdown().await;
            }
            result.map_err(Into::into)
        }
        Command::Psp(args) => {
            let config = args
                .config()
                .unwrap_or_else(|error| usage_error(error, "psp"));
            psp::run(config, shutdown_signal())
                .await
                .map_err(Into::into)
        }
        Command::Load(args) => load::run(args).await,
        Command::Reconcile(args) => {
            let plan = args
                .plan(reconcile::now_ms(), reconcile::os_user())
                .unwrap_or_else(|error| usage_error(error, "reconcile"));
            match reconcile::run(plan).await {
                Ok(code) => return code,
                Err(error) => Err(error.into()),
            }
        }
        Command::ReportSample(args) => report::run_sample(&args),
        Command::PackageAssets(args) => package_assets::run(&args, Cli::command()),
        Command::Storm(args) => storm::run(args).await,
        Command::Chaos(args) => {
            if let Err(error) = args.validate() {
                usage_error(error, "chaos");
            }
            chaos::run(args).await
        }
        Command::Retries(args) => retries::run(args, shutdown_signal()).await,
        Command::Proxy(args) => match backstop_proxy::run(&args, shutdown_signal()).await {
            Ok(code) => return code,
            Err(backstop_proxy::Error::Usage(error)) => usage_error(error, "proxy"),
            Err(error) => Err(error.into()),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let message = Chain(&*error).to_string();
            // One line: the logs go to the same stderr.
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Reports a flag error found after parsing the way clap reports its own, with the usage of
/// `subcommand`, and exits with status 2.
fn usage_error(error: clap::Error, subcommand: &str) -> ! {
    let mut cli = Cli::command();
    cli.build();
    match cli.find_subcommand_mut(subcommand) {
        Some(command) => error.format(command).exit(),
        None => error.format(&mut cli).exit(),
    }
}

/// What the command line said beyond [`Cli`]: `serve`'s matches (where each setting came
/// from) and the settings taken from its config file.
struct Matches {
    serve: ArgMatches,
    from_file: BTreeSet<String>,
    /// The config file's `[policies]` table.
    policies: Option<toml::Value>,
}

/// `serve`'s definition, as the full command builds it.
fn serve_command() -> clap::Command {
    let mut command = Cli::command();
    command.build();
    command
        .find_subcommand("serve")
        .cloned()
        .unwrap_or_else(|| clap::Command::new("serve"))
}

/// Parses the command line; for `serve --config FILE`, again with the file's settings added
/// where neither a flag nor an environment variable gave one (see [`config_file`]).
fn parse() -> (Cli, Matches) {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let matches = Cli::command().get_matches_from(&argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let serve_matches = matches.subcommand_matches("serve").cloned();
    let (Command::Serve(args), Some(serve)) = (&cli.command, serve_matches) else {
        let none = Matches {
            serve: ArgMatches::default(),
            from_file: BTreeSet::new(),
            policies: None,
        };
        return (cli, none);
    };
    let Some(file) = args.config_file() else {
        let found = Matches {
            serve,
            from_file: BTreeSet::new(),
            policies: None,
        };
        return (cli, found);
    };
    let config_file::FileSettings {
        args: extra,
        policies,
    } = config_file::file_args(file, &serve_command(), &serve)
        .unwrap_or_else(|error| usage_error(error, "serve"));
    let from_file = extra
        .iter()
        .filter_map(|a| a.to_str()?.strip_prefix("--"))
        .map(|a| a.split('=').next().unwrap_or(a).to_owned())
        .collect();
    // Right after the subcommand's name: the file's settings are `serve`'s arguments.
    let at = argv
        .iter()
        .position(|a| a == "serve")
        .map_or(argv.len(), |i| i + 1);
    let mut with_file = argv;
    with_file.splice(at..at, extra);
    let matches = Cli::command().get_matches_from(&with_file);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let serve = matches
        .subcommand_matches("serve")
        .cloned()
        .unwrap_or_default();
    (
        cli,
        Matches {
            serve,
            from_file,
            policies,
        },
    )
}

/// Resolves on ctrl-c, or SIGTERM on unix.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::warn!(%error, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutdown requested");
}
