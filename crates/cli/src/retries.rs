//! `backstop retries`: the fleet's retry switch, read and set in Redis (see
//! [`backstop::retry::switch`]).
//!
//! Every backstop client given the same Redis and key (`serve --redis`, `load
//! --retry-switch-redis`, `proxy --retry-switch-redis`) applies the setting within a poll
//! (250 ms): `off` stops retries and hedges, `ratio R` holds them to a share R of requests,
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
    Ratio {
        /// Retries and hedges per logical request, between 0 and 1.
        #[arg(value_parser = parse_ratio)]
        ratio: f64,
        #[command(flatten)]
        lasting: Lasting,
    },
    /// Print the setting in effect and how long it lasts
    Status,
    /// Receive Alertmanager's webhook: set the switch while named alerts fire, on when resolved
    ///
    /// Point an Alertmanager receiver at http://ADDR/alertmanager (`webhook_configs`, with
    /// `send_resolved: true` and a `repeat_interval` shorter than --for). While an alert it
    /// names fires, the switch holds SETTING for --for, renewed by each notification; when
    /// every such alert of a notification is resolved, the switch is set on.
    Webhook(Webhook),
}

#[derive(Debug, Clone, Args)]
struct Webhook {
    /// Address to listen on.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9099")]
    listen: std::net::SocketAddr,
    /// An alert name that sets the switch (repeatable).
    #[arg(
        long = "alert",
        value_name = "NAME",
        default_value = "BackstopRetryStorm"
    )]
    alerts: Vec<String>,
    /// The setting held while such an alert fires: `off` or `ratio=R`.
    #[arg(long, value_name = "SETTING", default_value = "off", value_parser = parse_held)]
    setting: RetrySetting,
    /// How long a firing notification holds the setting (renewed by the next one).
    #[arg(long = "for", value_name = "DURATION", default_value = "15m", value_parser = parse_lasting)]
    lasting: Duration,
}

fn parse_held(s: &str) -> Result<RetrySetting, String> {
    match s.parse::<RetrySetting>().map_err(|e| e.to_string())? {
        RetrySetting::On => Err("an alert holds `off` or `ratio=R`, not `on`".into()),
        setting => Ok(setting),
    }
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
    RetrySetting::ratio(ratio)
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

/// Runs `backstop retries ...`; a webhook runs until `shutdown`.
pub(crate) async fn run(
    args: RetriesArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), Box<dyn std::error::Error>> {
    let Some(url) = args.redis.as_deref() else {
        return Err("--redis URL (or BACKSTOP_REDIS) names the fleet's Redis".into());
    };
    let (setting, lasting) = match args.action {
        Action::Webhook(webhook) => {
            return webhook::run(webhook, url.to_owned(), args.key, shutdown).await;
        }
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
        Action::Ratio { ratio, lasting } => (RetrySetting::ratio(ratio)?, lasting.lasting),
    };
    write_redis(url, &args.key, setting, lasting).await?;
    println!("{}", describe(setting, lasting));
    Ok(())
}

fn describe(setting: RetrySetting, left: Option<Duration>) -> String {
    let what = match setting {
        RetrySetting::On => "on: each destination's retry budget decides".to_owned(),
        RetrySetting::Off => "off: no retries, no hedges".to_owned(),
        RetrySetting::Ratio(ratio) => {
            format!("ratio={ratio}: retries and hedges within {ratio} per request")
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

mod webhook {
    //! Alertmanager's webhook, setting the switch.

    use std::collections::HashMap;
    use std::sync::Arc;

    use axum::Json;
    use axum::extract::{DefaultBodyLimit, State};
    use axum::http::StatusCode;
    use axum::routing::post;
    use backstop::retry::RetrySetting;
    use backstop::retry::switch::write_redis;
    use backstop::server::listen::{ListenConfig, Listener};
    use serde::Deserialize;

    use super::Webhook;

    /// Largest notification read: Alertmanager's carry a group's alerts, far below this.
    const MAX_BODY: usize = 1 << 20;

    /// What a notification (webhook payload version 4) says, as far as the switch cares.
    #[derive(Debug, Deserialize)]
    struct Notification {
        alerts: Vec<Alert>,
    }

    #[derive(Debug, Deserialize)]
    struct Alert {
        status: String,
        #[serde(default)]
        labels: HashMap<String, String>,
    }

    struct Hook {
        settings: Webhook,
        url: String,
        key: String,
    }

    pub(super) async fn run(
        settings: Webhook,
        url: String,
        key: String,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let tcp = tokio::net::TcpListener::bind(settings.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", settings.listen))?;
        let addr = tcp.local_addr()?;
        let hook = Arc::new(Hook { settings, url, key });
        let app = axum::Router::new()
            .route("/alertmanager", post(notified))
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(hook.clone());
        tracing::info!(
            listen = %addr,
            key = hook.key,
            alerts = ?hook.settings.alerts,
            setting = %hook.settings.setting,
            "retry switch webhook listening"
        );
        Listener::new("retries-webhook", tcp, ListenConfig::default())
            .serve(app, shutdown)
            .await;
        Ok(())
    }

    async fn notified(
        State(hook): State<Arc<Hook>>,
        Json(notification): Json<Notification>,
    ) -> (StatusCode, String) {
        let named: Vec<&Alert> = notification
            .alerts
            .iter()
            .filter(|a| {
                a.labels
                    .get("alertname")
                    .is_some_and(|name| hook.settings.alerts.contains(name))
            })
            .collect();
        if named.is_empty() {
            return (
                StatusCode::OK,
                "no alert of the switch: nothing set\n".into(),
            );
        }
        let firing = named.iter().any(|a| a.status == "firing");
        let (setting, lasting) = if firing {
            (hook.settings.setting, Some(hook.settings.lasting))
        } else {
            (RetrySetting::On, None)
        };
        match write_redis(&hook.url, &hook.key, setting, lasting).await {
            Ok(()) => {
                tracing::warn!(setting = %setting, firing, key = hook.key, "retry switch set by an alert");
                (StatusCode::OK, format!("set {setting}\n"))
            }
            // Alertmanager sends the notification again.
            Err(error) => {
                tracing::error!(%error, "retry switch webhook: Redis did not take the setting");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Redis did not take the setting\n".into(),
                )
            }
        }
    }
}
