//! `backstop retries`: the fleet's retry switch, read and set in Redis (see
//! [`backstop::retry::switch`]).
//!
//! Every backstop client given the same Redis and key (`serve --redis`, `load
//! --retry-switch-redis`, `proxy --retry-switch-redis`) applies the setting within a poll
//! (250 ms): `off` stops retries and hedges, `budget R` holds them to a share R of requests,
//! `on` (no key) lets each destination's own budget decide. `--for` makes a setting end by
//! itself, so a forgotten `off` does not outlive the outage it was set for.

use std::time::Duration;

use backstop::retry::RetrySetting;
use backstop::retry::switch::{DEFAULT_KEY, read_redis, write_redis};
use clap::{Args, Subcommand};

/// Flags of `backstop retries`.
#[derive(Debug, Clone, Args)]
pub(crate) struct RetriesArgs {
    #[command(subcommand)]
    action: Action,
    /// The Redis every client of the fleet watches.
    #[arg(long, value_name = "URL", env = "BACKSTOP_REDIS", global = true)]
    redis: Option<String>,
    /// The key holding the setting.
    #[arg(long, value_name = "KEY", default_value = DEFAULT_KEY, global = true)]
    key: String,
}

#[derive(Debug, Clone, Subcommand)]
enum Action {
    /// Stop every retry and hedge of the fleet
    Off(Lasting),
    /// Let each destination's own retry budget decide again (removes the key)
    On,
    /// Hold retries and hedges to at most RATIO of logical requests (e.g. 0.02)
    Budget {
        /// Retries and hedges per logical request, between 0 and 1.
        #[arg(value_parser = parse_ratio)]
        ratio: f64,
        #[command(flatten)]
        lasting: Lasting,
    },
    /// Print the setting in effect and how long it lasts
    Status,
}

#[derive(Debug, Clone, Args)]
struct Lasting {
    /// End the setting after this long (e.g. `10m`); without it, it holds until `on`.
    #[arg(long = "for", value_name = "DURATION", value_parser = parse_lasting)]
    lasting: Option<Duration>,
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    let ratio: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number between 0 and 1"))?;
    RetrySetting::budget(ratio)
        .map(|_| ratio)
        .map_err(|e| e.to_string())
}

fn parse_lasting(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))?;
    if d < Duration::from_millis(1) || d > Duration::from_secs(30 * 86_400) {
        return Err(format!("{s:?}: between 1ms and 30 days"));
    }
    Ok(d)
}

/// Runs `backstop retries ...`.
pub(crate) async fn run(args: RetriesArgs) -> Result<(), Box<dyn std::error::Error>> {
    let Some(url) = args.redis.as_deref() else {
        return Err("--redis URL (or BACKSTOP_REDIS) names the fleet's Redis".into());
    };
    let (setting, lasting) = match args.action {
        Action::Status => {
            let (setting, left) = read_redis(url, &args.key).await?;
            match setting {
                Ok(setting) => println!("{}", describe(setting, left)),
                // Watching clients keep their last setting on such a value.
                Err(error) => println!("refused by every client ({error}); set it again"),
            }
            return Ok(());
        }
        Action::Off(lasting) => (RetrySetting::Off, lasting.lasting),
        Action::On => (RetrySetting::On, None),
        Action::Budget { ratio, lasting } => (RetrySetting::budget(ratio)?, lasting.lasting),
    };
    write_redis(url, &args.key, setting, lasting).await?;
    println!("{}", describe(setting, lasting));
    Ok(())
}

fn describe(setting: RetrySetting, left: Option<Duration>) -> String {
    let what = match setting {
        RetrySetting::On => "on: each destination's retry budget decides".to_owned(),
        RetrySetting::Off => "off: no retries, no hedges".to_owned(),
        RetrySetting::Budget(ratio) => {
            format!("budget={ratio}: retries and hedges within {ratio} per request")
        }
    };
    match left {
        Some(left) if setting != RetrySetting::On => format!(
            "{what} (for {} more)",
            humantime::format_duration(Duration::from_secs(left.as_secs().max(1)))
        ),
        _ => what,
    }
}
