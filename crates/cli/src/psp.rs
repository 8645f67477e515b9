//! `backstop psp`: the PSP simulator as a standalone process.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use backstop_payment::psp::{self, Faults, PspConfig, PspError};
use clap::Args;
use clap::error::ErrorKind;

/// Flags of `backstop psp`.
#[derive(Debug, Clone, Args)]
pub(crate) struct PspArgs {
    /// Address to listen on (port 0: any free port, logged at start).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8082")]
    listen: SocketAddr,
    /// Delay before each charge request is handled, in milliseconds.
    #[arg(long, value_name = "N", default_value_t = 0)]
    latency_ms: u64,
    /// Probability in [0, 1] of answering 500 without charging.
    #[arg(long, value_name = "F", default_value_t = 0.0, value_parser = parse_rate, allow_negative_numbers = true)]
    error_rate: f64,
    /// Probability in [0, 1] of answering 503 + Retry-After without charging.
    #[arg(long, value_name = "F", default_value_t = 0.0, value_parser = parse_rate, allow_negative_numbers = true)]
    unavailable_rate: f64,
    /// Probability in [0, 1] of charging, then answering after the caller's deadline.
    #[arg(long, value_name = "F", default_value_t = 0.0, value_parser = parse_rate, allow_negative_numbers = true)]
    commit_then_timeout_rate: f64,
    /// Probability in [0, 1] of charging, then closing the connection without an answer.
    #[arg(long, value_name = "F", default_value_t = 0.0, value_parser = parse_rate, allow_negative_numbers = true)]
    commit_then_drop_rate: f64,
    /// Seed of the fault RNG, for reproducible runs.
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// SQLite file for the PSP's charges (in memory when absent).
    #[arg(long = "db", value_name = "PATH")]
    db: Option<PathBuf>,
}

impl PspArgs {
    /// The PSP configuration these flags describe; an error when the rates add up past 1.
    pub(crate) fn config(&self) -> Result<PspConfig, clap::Error> {
        let faults = Faults {
            latency: Duration::from_millis(self.latency_ms),
            error_rate: self.error_rate,
            unavailable_rate: self.unavailable_rate,
            commit_then_timeout_rate: self.commit_then_timeout_rate,
            commit_then_drop_rate: self.commit_then_drop_rate,
            ..Faults::default()
        };
        faults
            .validate()
            .map_err(|error| clap::Error::raw(ErrorKind::ArgumentConflict, error.to_string()))?;
        Ok(PspConfig {
            listen: self.listen,
            db_path: self.db.clone(),
            faults,
            seed: self.seed,
        })
    }
}

/// Runs the PSP until `shutdown` resolves.
pub(crate) async fn run(
    config: PspConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), PspError> {
    let faults = &config.faults;
    tracing::info!(
        listen = %config.listen,
        db = %config.db_path.as_deref().map_or("(memory)".into(), |path| path.display().to_string()),
        latency_ms = u64::try_from(faults.latency.as_millis()).unwrap_or(u64::MAX),
        error_rate = faults.error_rate,
        unavailable_rate = faults.unavailable_rate,
        commit_then_timeout_rate = faults.commit_then_timeout_rate,
        commit_then_drop_rate = faults.commit_then_drop_rate,
        seed = config.seed,
        "starting psp"
    );
    psp::serve(config, shutdown).await
}

/// A probability flag: a number in `[0, 1]`.
pub(crate) fn parse_rate(value: &str) -> Result<f64, String> {
    let rate: f64 = value
        .parse()
        .map_err(|_| format!("`{value}` is not a number; expected a rate in [0, 1]"))?;
    if (0.0..=1.0).contains(&rate) {
        Ok(rate)
    } else {
        Err(format!("`{value}` is outside [0, 1]"))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        psp: PspArgs,
    }

    fn parse(args: &[&str]) -> Result<PspArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("psp").chain(args.iter().copied())).map(|cli| cli.psp)
    }

    #[test]
    fn flags_build_the_config() {
        let args = parse(&[
            "--listen",
            "127.0.0.1:0",
            "--latency-ms",
            "25",
            "--error-rate",
            "0.1",
            "--unavailable-rate",
            "0.2",
            "--commit-then-timeout-rate",
            "0.3",
            "--commit-then-drop-rate",
            "0.4",
            "--seed",
            "7",
            "--db",
            "psp.db",
        ])
        .unwrap();
        let config = args.config().unwrap();
        assert_eq!(config.listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(config.faults.latency, Duration::from_millis(25));
        assert_eq!(config.faults.error_rate, 0.1);
        assert_eq!(config.faults.unavailable_rate, 0.2);
        assert_eq!(config.faults.commit_then_timeout_rate, 0.3);
        assert_eq!(config.faults.commit_then_drop_rate, 0.4);
        assert_eq!(config.seed, Some(7));
        assert_eq!(config.db_path, Some(PathBuf::from("psp.db")));
    }

    #[test]
    fn defaults_inject_nothing() {
        let config = parse(&[]).unwrap().config().unwrap();
        assert_eq!(config.listen, "127.0.0.1:8082".parse().unwrap());
        assert_eq!(config.faults, Faults::default());
        assert_eq!(config.seed, None);
        assert_eq!(config.db_path, None);
    }

    #[test]
    fn rates_outside_unit_interval_are_clap_errors() {
        for bad in ["1.5", "-0.1", "NaN", "lots"] {
            let error = parse(&["--error-rate", bad]).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::ValueValidation, "{bad}");
        }
    }

    #[test]
    fn rates_adding_past_one_are_refused() {
        let args = parse(&["--error-rate", "0.6", "--unavailable-rate", "0.6"]).unwrap();
        assert_eq!(
            args.config().unwrap_err().kind(),
            ErrorKind::ArgumentConflict
        );
    }
}
