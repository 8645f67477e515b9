//! `backstop serve`: the payment service.

use std::future::Future;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::time::Duration;

use backstop::admission::redis::{FailurePolicy, RedisConfig};
use backstop::admission::{Discipline, QueueConfig, SheddingConfig};
use backstop::server::listen::PushAway;
use backstop_payment::config::{ApiKey, Config, LimitMode, PspTarget, StoreLocation};
use backstop_payment::server::{self, ServeError};
use backstop_proxy::hangups::Hangups;
use clap::Args;
use clap::error::ErrorKind;

use crate::{api_keys, serve_policies};

/// Flags of `backstop serve`.
#[derive(Debug, Clone, Args)]
pub(crate) struct ServeArgs {
    /// Settings from a TOML file whose keys are these flags' long names (`max-inflight = 64`);
    /// a flag, or its environment variable, wins over the file.
    #[arg(long, value_name = "PATH", env = "BACKSTOP_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Print the settings in effect, as a config file with where each came from (API keys
    /// and passwords left out), and exit.
    #[arg(long)]
    print_config: bool,
    /// HTTP address (port 0: any free port, logged at start).
    #[arg(
        long,
        env = "BACKSTOP_HTTP",
        value_name = "ADDR",
        default_value = "127.0.0.1:8081"
    )]
    http: SocketAddr,
    /// gRPC address (`payment.v1.Payment`, h2c; port 0: any free port, logged at start).
    #[arg(
        long,
        env = "BACKSTOP_GRPC",
        value_name = "ADDR",
        default_value = "127.0.0.1:50051"
    )]
    grpc: SocketAddr,
    /// Store: `sqlite://PATH`, a file path, or `postgres://USER@HOST:PORT/DB` (shared by
    /// several instances).
    #[arg(
        long,
        env = "BACKSTOP_STORE",
        value_name = "URL",
        default_value = "backstop.db"
    )]
    store: String,
    /// PSP base URL; without it an embedded PSP starts on a loopback port with its own
    /// database next to the store (`backstop.db` -> `backstop-psp.db`).
    #[arg(long, env = "BACKSTOP_PSP", value_name = "URL")]
    psp: Option<String>,
    /// Requests executing at once; beyond it 503 + Retry-After. With `--limit adaptive`, the
    /// upper bound of the limit (and where it starts).
    #[arg(
        long,
        env = "BACKSTOP_MAX_INFLIGHT",
        value_name = "N",
        default_value_t = 256
    )]
    max_inflight: usize,
    /// The largest answer body of a keyed method kept for replay where the method's policy
    /// sets none (bytes, or with KiB, MiB, GiB): a larger answer streams to its caller, and a
    /// retry with its key gets its status with `replay_body_too_large`.
    #[arg(long, env = "BACKSTOP_MAX_REPLAY_BODY", value_name = "SIZE", default_value = "1MiB", value_parser = backstop_proxy::byte_size::parse)]
    max_replay_body: usize,
    /// Connections open at once on each port; at the cap an idle one is closed to make room,
    /// or the new one refused when all are busy. Keep it below the file descriptor limit.
    #[arg(long, env = "BACKSTOP_MAX_CONNECTIONS", value_name = "N", default_value_t = backstop_payment::config::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// On SIGTERM or ctrl-c, how long in-flight requests may take to finish before they are cut
    /// (both ports drain at once, within this one bound).
    #[arg(long, env = "BACKSTOP_DRAIN_TIMEOUT", value_name = "DURATION", default_value = "10s", value_parser = parse_drain)]
    drain_timeout: Duration,
    /// How often expired idempotency records are deleted, in batches that let claims through
    /// between them (a sweep also runs at start-up). From 1s to 1d.
    #[arg(long, env = "BACKSTOP_SWEEP_EVERY", value_name = "DURATION", default_value = "60s", value_parser = parse_sweep_every)]
    sweep_every: Duration,
    /// `fixed`: --max-inflight requests at once. `adaptive`: a limit found from the latency of
    /// served requests, between --min-inflight and --max-inflight, lowered when latency rises
    /// above its baseline and raised when it falls.
    #[arg(long, env = "BACKSTOP_LIMIT", value_name = "MODE", default_value_t = LimitMode::Fixed)]
    limit: LimitMode,
    /// Lower bound of the adaptive limit.
    #[arg(
        long,
        env = "BACKSTOP_MIN_INFLIGHT",
        value_name = "N",
        default_value_t = 8
    )]
    min_inflight: usize,
    /// How requests wait for a slot when all are busy. `fair`: per-merchant queues served in
    /// turn, each merchant holding at most an equal share; a request is dropped (503 +
    /// Retry-After) once its remaining budget cannot cover the expected service time, and,
    /// when a standing queue forms, once it has waited longer than --queue-target (the newest
    /// are then served first). `fifo`: one first-come-first-served line, each request waiting
    /// as long as its budget allows.
    #[arg(long, env = "BACKSTOP_QUEUE", value_name = "MODE", default_value_t = Discipline::Fair)]
    queue: Discipline,
    /// Most requests waiting for a slot; beyond it 503 + Retry-After.
    #[arg(long, env = "BACKSTOP_QUEUE_SIZE", value_name = "N", default_value_t = QueueConfig::DEFAULT_MAX_WAITERS)]
    queue_size: usize,
    /// Most memory the waiting requests may hold (their bodies plus overhead), in bytes.
    #[arg(long, env = "BACKSTOP_QUEUE_MEMORY", value_name = "BYTES", default_value_t = QueueConfig::DEFAULT_MAX_BYTES)]
    queue_memory: usize,
    /// Queueing delay a standing queue may not exceed (`fair`): once even the shortest wait
    /// over --queue-interval is longer, requests that waited this long are dropped. Raised to
    /// two gaps between finishing requests (service time / limit) when those are longer.
    #[arg(long, env = "BACKSTOP_QUEUE_TARGET", value_name = "DURATION", default_value = "5ms", value_parser = parse_queue_duration)]
    queue_target: Duration,
    /// Window over which the shortest wait is measured, and the longest wait while no
    /// standing queue exists (`fair`; at least twice the target in effect).
    #[arg(long, env = "BACKSTOP_QUEUE_INTERVAL", value_name = "DURATION", default_value = "100ms", value_parser = parse_queue_duration)]
    queue_interval: Duration,
    /// Turn slow start off. With it (the default), when half of the recent requests fail (the
    /// PSP or the store is down) the limit drops to --slow-start-floor, and once requests
    /// succeed again it ramps back up, doubling per round trip, instead of releasing the whole
    /// backlog at once onto a dependency that is just back.
    #[arg(long, env = "BACKSTOP_NO_SLOW_START")]
    no_slow_start: bool,
    /// Requests admitted at once during an outage, where slow start ramps up from (capped by
    /// the limit).
    #[arg(long, env = "BACKSTOP_SLOW_START_FLOOR", value_name = "N", default_value_t = backstop_payment::config::DEFAULT_SLOW_START_FLOOR)]
    slow_start_floor: usize,
    /// Share (percent) of the requests the gate refuses, over --shed-window, above which it
    /// counts as shedding; once that lasts --shed-sustain the overload is sustained: refusals
    /// tell gRPC clients not to retry (`grpc-retry-pushback-ms: -1`) and connections are
    /// pushed away (--push-away-percent). 100 never counts as shedding.
    #[arg(long, env = "BACKSTOP_SHED_THRESHOLD", value_name = "PERCENT", default_value_t = SheddingConfig::DEFAULT_THRESHOLD * 100.0, value_parser = parse_percent, allow_negative_numbers = true)]
    shed_threshold: f64,
    /// Sliding window the refused share is measured over (at least 10ms).
    #[arg(long, env = "BACKSTOP_SHED_WINDOW", value_name = "DURATION", default_value = "10s", value_parser = parse_shed_window)]
    shed_window: Duration,
    /// How long shedding must last without a break to count as sustained overload.
    #[arg(long, env = "BACKSTOP_SHED_SUSTAIN", value_name = "DURATION", default_value = "5s", value_parser = parse_shed_sustain)]
    shed_sustain: Duration,
    /// Turn pushing clients away off. With it (the default), under sustained overload a share
    /// of each port's connections is asked to reconnect, so that clients rebalance across
    /// instances: HTTP/2 (gRPC) connections get a graceful GOAWAY (requests in flight finish),
    /// HTTP/1.1 responses `Connection: close`.
    #[arg(long, env = "BACKSTOP_NO_PUSH_AWAY")]
    no_push_away: bool,
    /// Most connections pushed away per second, in percent of each port's open connections
    /// (above 0, at most 100; at least one connection a second).
    #[arg(long, env = "BACKSTOP_PUSH_AWAY_PERCENT", value_name = "PERCENT", default_value_t = PushAway::DEFAULT_SHARE * 100.0, value_parser = parse_push_percent, allow_negative_numbers = true)]
    push_away_percent: f64,
    /// For experiments: abort this percentage (0 to 100) of the payment requests at random with
    /// 503 problem+json `fault_injected` / gRPC UNAVAILABLE, before any work (no quota spent,
    /// the idempotency key left unused). Off (0) by default.
    #[arg(long, env = "BACKSTOP_FAULT_ABORT_PERCENT", value_name = "PERCENT", default_value_t = 0.0, value_parser = parse_percent, allow_negative_numbers = true)]
    fault_abort_percent: f64,
    /// Requests per second per merchant; beyond it 429 + Retry-After.
    #[arg(long, env = "BACKSTOP_TENANT_RATE", value_name = "PER_SEC", default_value_t = NonZeroU32::new(1000).expect("non-zero"))]
    tenant_rate: NonZeroU32,
    /// Burst per merchant.
    #[arg(long, env = "BACKSTOP_TENANT_BURST", value_name = "N", default_value_t = NonZeroU32::new(2000).expect("non-zero"))]
    tenant_burst: NonZeroU32,
    /// `MERCHANT=KEY`, repeatable (visible in `ps`: prefer --api-key-file or
    /// BACKSTOP_API_KEYS=MERCHANT=KEY,...). With keys from any of the three, `Authorization:
    /// Bearer KEY` is required; without, the service is open (merchant `default`) and only on a
    /// loopback address.
    #[arg(long = "api-key", value_name = "MERCHANT=KEY")]
    api_keys: Vec<String>,
    /// File of API keys: one `MERCHANT=KEY` a line, `#` comments; not readable by every user.
    #[arg(long, env = "BACKSTOP_API_KEY_FILE", value_name = "PATH")]
    api_key_file: Option<std::path::PathBuf>,
    /// Share the per-merchant rate limits between instances through this Redis
    /// (`redis://HOST:PORT[/DB]`); without it each instance limits on its own.
    #[arg(long, env = "BACKSTOP_REDIS", value_name = "URL")]
    redis: Option<String>,
    /// When Redis does not answer: `open` limits with this instance's share of the rate
    /// (rate / --instances), `closed` answers 503 + Retry-After.
    #[arg(
        long,
        env = "BACKSTOP_REDIS_FAILURE",
        value_name = "POLICY",
        default_value = "open"
    )]
    redis_failure: FailurePolicy,
    /// How long one rate-limit decision waits for Redis (and each Redis command may take)
    /// before --redis-failure decides, e.g. 100ms; at most 10s.
    #[arg(long, env = "BACKSTOP_REDIS_TIMEOUT", value_name = "DURATION", default_value = "100ms", value_parser = parse_redis_timeout)]
    redis_timeout: Duration,
    /// Prefix of the rate-limit keys in Redis (instances sharing limits use the same one).
    #[arg(long, env = "BACKSTOP_REDIS_PREFIX", value_name = "PREFIX", default_value = backstop::admission::redis::DEFAULT_PREFIX)]
    redis_prefix: String,
    /// The Redis key of the fleet's retry switch (`backstop retries`), which the PSP client
    /// follows when --redis is set.
    #[arg(long, env = "BACKSTOP_RETRY_SWITCH_KEY", value_name = "KEY", default_value = backstop::retry::switch::DEFAULT_KEY)]
    retry_switch_key: String,
    /// How many instances share the Redis limits (sets each one's fallback share).
    #[arg(long, env = "BACKSTOP_INSTANCES", value_name = "N", default_value_t = NonZeroU32::MIN)]
    instances: NonZeroU32,
    /// Export the service's spans to this OpenTelemetry collector (OTLP over HTTP/protobuf,
    /// plain HTTP), e.g. `http://127.0.0.1:4318`: they go to URL/v1/traces, each request's span
    /// a child of the caller's `traceparent`. Without it nothing is exported. Needs a build with
    /// the `otel` feature (on by default).
    #[cfg_attr(
        feature = "otel",
        arg(long, value_name = "URL", env = "OTEL_EXPORTER_OTLP_ENDPOINT")
    )]
    #[cfg_attr(not(feature = "otel"), arg(long, value_name = "URL"))]
    otlp_endpoint: Option<String>,
}

impl ServeArgs {
    /// The config file named by `--config` (or `BACKSTOP_CONFIG`).
    pub(crate) fn config_file(&self) -> Option<&std::path::Path> {
        self.config.as_deref()
    }

    /// Whether to print the settings in effect and exit.
    pub(crate) fn print_config(&self) -> bool {
        self.print_config
    }

    /// Where `--otlp-endpoint` sends spans (its URL with `/v1/traces`), if given. A build
    /// without the `otel` feature refuses the flag rather than ignore it.
    pub(crate) fn otlp_traces_url(&self) -> Result<Option<http::Uri>, clap::Error> {
        let Some(endpoint) = self.otlp_endpoint.as_deref() else {
            return Ok(None);
        };
        let invalid = |message: String| {
            clap::Error::raw(
                clap::error::ErrorKind::InvalidValue,
                format!("invalid --otlp-endpoint {endpoint:?}: {message}\n"),
            )
        };
        if !cfg!(feature = "otel") {
            return Err(invalid(
                "this backstop was built without the `otel` feature, so it cannot export spans \
                 (build it with `--features otel`)"
                    .into(),
            ));
        }
        otlp_traces_url(endpoint).map(Some).map_err(invalid)
    }

    /// The service configuration these flags and `BACKSTOP_API_KEYS` describe.
    pub(crate) fn config(&self) -> Result<Config, clap::Error> {
        self.config_with_env_keys(std::env::var(api_keys::ENV).ok().as_deref())
    }

    /// The configuration, with `env_keys` as the value of `BACKSTOP_API_KEYS`.
    fn config_with_env_keys(&self, env_keys: Option<&str>) -> Result<Config, clap::Error> {
        let invalid =
            |e: &dyn std::fmt::Display| clap::Error::raw(ErrorKind::InvalidValue, format!("{e}\n"));
        let store = StoreLocation::parse(&self.store).map_err(|e| invalid(&e))?;
        let mut config = Config::new(store);
        config.http = self.http;
        config.grpc = self.grpc;
        if let Some(url) = &self.psp {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(invalid(&format!(
                    "--psp must be an http:// URL, got {url:?}"
                )));
            }
            config.psp = PspTarget::Url(url.clone());
        }
        config.max_inflight = self.max_inflight;
        config.max_replay_body = self.max_replay_body;
        config.max_connections = self.max_connections;
        config.drain_timeout = self.drain_timeout;
        config.sweep_every = self.sweep_every;
        config.limit = self.limit;
        config.min_inflight = self.min_inflight;
        config.queue = QueueConfig {
            discipline: self.queue,
            max_waiters: self.queue_size,
            max_bytes: self.queue_memory,
            target: self.queue_target,
            interval: self.queue_interval,
            ..QueueConfig::default()
        };
        config.slow_start = (!self.no_slow_start).then_some(self.slow_start_floor);
        config.shedding = SheddingConfig {
            window: self.shed_window,
            threshold: self.shed_threshold / 100.0,
            sustain: self.shed_sustain,
            ..SheddingConfig::default()
        };
        config.push_away = (!self.no_push_away).then_some(self.push_away_percent / 100.0);
        config.fault_abort_percent = self.fault_abort_percent;
        config.tenant_rate = self.tenant_rate;
        config.tenant_burst = self.tenant_burst;
        config.api_keys = self
            .api_keys
            .iter()
            .map(|k| ApiKey::parse(k))
            .collect::<Result<_, _>>()
            .map_err(|e| invalid(&e))?;
        if let Some(value) = env_keys {
            config
                .api_keys
                .extend(api_keys::from_env_value(value).map_err(|e| invalid(&e))?);
        }
        if let Some(path) = &self.api_key_file {
            config
                .api_keys
                .extend(api_keys::from_file(path).map_err(|e| invalid(&e))?);
        }
        if let Some(url) = &self.redis {
            let redis = RedisConfig::new(url)
                .map_err(|_| invalid(&"--redis must be a redis:// URL"))?
                .prefix(self.redis_prefix.clone())
                // A command may finish after its decision gave up (it then refills nothing);
                // its own bound stays at least the connection's default.
                .response_timeout(self.redis_timeout.max(REDIS_COMMAND_TIMEOUT));
            config.redis = Some(redis);
        }
        config.redis_failure = self.redis_failure;
        config.redis_timeout = self.redis_timeout;
        config.instances = self.instances;
        config.retry_switch_key = self.retry_switch_key.clone();
        Ok(config)
    }
}

/// Longest accepted `--drain-timeout`.
const MAX_DRAIN: Duration = Duration::from_secs(600);

/// The shortest bound on one Redis command (the connection's default).
const REDIS_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);

/// Longest accepted `--redis-timeout`: a decision waits no longer for a limiter that is gone.
const MAX_REDIS_TIMEOUT: Duration = Duration::from_secs(10);

fn parse_redis_timeout(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 100ms or 1s: {e}"))?;
    if d.is_zero() || d > MAX_REDIS_TIMEOUT {
        return Err(format!("{s} must be above zero and at most 10s"));
    }
    Ok(d)
}

/// Longest accepted --queue-target / --queue-interval.
const MAX_QUEUE_DURATION: Duration = Duration::from_secs(60);

fn parse_queue_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 5ms or 100ms: {e}"))?;
    if d.is_zero() || d > MAX_QUEUE_DURATION {
        return Err(format!("{s} must be above zero and at most 60s"));
    }
    Ok(d)
}

fn parse_drain(s: &str) -> Result<Duration, String> {
    let drain = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 10s or 500ms: {e}"))?;
    if drain > MAX_DRAIN {
        return Err(format!("{s} is longer than 10 minutes"));
    }
    Ok(drain)
}

fn parse_sweep_every(s: &str) -> Result<Duration, String> {
    let every = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 60s or 5m: {e}"))?;
    if !(Duration::from_secs(1)..=Duration::from_secs(24 * 3600)).contains(&every) {
        return Err(format!("{s} is outside 1s..=1d"));
    }
    Ok(every)
}

/// Longest accepted --shed-window / --shed-sustain.
const MAX_SHED_DURATION: Duration = Duration::from_secs(3600);

fn parse_shed_window(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 10s or 1m: {e}"))?;
    if !(Duration::from_millis(10)..=MAX_SHED_DURATION).contains(&d) {
        return Err(format!("{s} is outside 10ms..=1h"));
    }
    Ok(d)
}

fn parse_shed_sustain(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 5s or 1m: {e}"))?;
    if d > MAX_SHED_DURATION {
        return Err(format!("{s} is longer than 1h"));
    }
    Ok(d)
}

fn parse_push_percent(s: &str) -> Result<f64, String> {
    let percent = parse_percent(s)?;
    if percent == 0.0 {
        return Err("0 pushes nothing: use --no-push-away to turn it off".to_owned());
    }
    Ok(percent)
}

fn parse_percent(s: &str) -> Result<f64, String> {
    let percent: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number; expected a percentage from 0 to 100"))?;
    if (0.0..=100.0).contains(&percent) {
        Ok(percent)
    } else {
        Err(format!("{s} is outside 0 to 100"))
    }
}

/// The traces URL of an OTLP/HTTP collector's base URL: `http://HOST:PORT[/PATH]` plus
/// `/v1/traces`.
fn otlp_traces_url(endpoint: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = endpoint
        .parse()
        .map_err(|e| format!("{e} (expected e.g. http://127.0.0.1:4318)"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => return Err("https is not supported; use plain http".into()),
        _ => return Err("expected an http:// URL, e.g. http://127.0.0.1:4318".into()),
    }
    if uri.authority().is_none() {
        return Err("no host (expected e.g. http://127.0.0.1:4318)".into());
    }
    if uri.query().is_some() {
        return Err("a query has no place in a collector's URL".into());
    }
    let base = uri.to_string();
    format!("{}/v1/traces", base.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("{e}"))
}

/// Runs the service until `shutdown` resolves (ctrl-c / SIGTERM), draining in-flight requests.
/// On SIGHUP the method table is read again from `config_file`'s `[policies]` (see
/// [`serve_policies::reload`]) and put in effect once valid; a file that is refused leaves the
/// table in effect.
pub(crate) async fn run(
    config: Config,
    config_file: Option<std::path::PathBuf>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    // Watched before the service answers anything: a SIGHUP that came first would stop it.
    let hangups = Hangups::watch("the policies");
    let server = server::Server::bind(config.clone()).await?;
    let reloads = tokio::spawn(reload_on_hangup(
        hangups,
        config,
        config_file,
        server.policies().clone(),
    ));
    let result = server.run(shutdown).await;
    reloads.abort();
    result
}

/// Reloads the policies on each SIGHUP (without a config file, says there is nothing to
/// reload: a hangup must not stop the service).
async fn reload_on_hangup(
    mut hangups: Hangups,
    config: Config,
    file: Option<std::path::PathBuf>,
    policies: backstop::policy::ReloadablePolicies,
) {
    while hangups.recv().await.is_some() {
        let Some(file) = &file else {
            tracing::warn!("SIGHUP: no --config file, nothing to reload");
            continue;
        };
        let reloaded = serve_policies::reload(&config, file)
            .and_then(|table| policies.replace(table).map_err(|e| e.to_string()));
        match reloaded {
            Ok(()) => tracing::info!(
                file = %file.display(),
                table = %policies.load(),
                "policies reloaded"
            ),
            Err(error) => tracing::error!(
                file = %file.display(),
                %error,
                "policy reload refused; the table in effect stays"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct T {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        let mut argv = vec!["serve"];
        argv.extend_from_slice(args);
        T::try_parse_from(argv)?.args.config_with_env_keys(None)
    }

    #[test]
    fn defaults() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.http, "127.0.0.1:8081".parse().unwrap());
        assert_eq!(c.grpc, "127.0.0.1:50051".parse().unwrap());
        assert_eq!(c.store, StoreLocation::Sqlite("backstop.db".into()));
        assert_eq!(
            c.psp,
            PspTarget::Embedded {
                db: "backstop-psp.db".into()
            }
        );
        assert!(c.api_keys.is_empty());
        assert!(c.redis.is_none());
        assert_eq!(c.drain_timeout, Duration::from_secs(10));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn redis_flags() {
        let c = parse(&[
            "--redis",
            "redis://127.0.0.1:6379",
            "--redis-failure",
            "closed",
            "--redis-prefix",
            "pay:",
            "--instances",
            "3",
        ])
        .unwrap();
        let redis = c.redis.unwrap();
        assert_eq!(redis.display_url(), "redis://127.0.0.1:6379");
        assert_eq!(redis.key_prefix(), "pay:");
        assert_eq!(c.redis_failure, FailurePolicy::Closed);
        assert_eq!(c.instances.get(), 3);
        let default = parse(&["--redis", "redis://127.0.0.1"]).unwrap();
        assert_eq!(default.redis_failure, FailurePolicy::Open);
        assert_eq!(
            default.redis_timeout,
            backstop::admission::redis::DEFAULT_TIMEOUT
        );
        let slow = parse(&["--redis", "redis://127.0.0.1", "--redis-timeout", "5s"]).unwrap();
        assert_eq!(slow.redis_timeout, Duration::from_secs(5));
        for bad in ["0s", "11s", "soon"] {
            assert!(parse(&["--redis-timeout", bad]).is_err(), "{bad}");
        }
        assert!(parse(&["--redis", "http://127.0.0.1"]).is_err());
        assert!(parse(&["--redis-failure", "maybe"]).is_err());
        assert!(parse(&["--instances", "0"]).is_err());
    }

    #[test]
    fn flags() {
        let c = parse(&[
            "--http",
            "0.0.0.0:9000",
            "--store",
            "sqlite:///tmp/p.db",
            "--psp",
            "http://127.0.0.1:8082",
            "--max-inflight",
            "8",
            "--tenant-rate",
            "5",
            "--tenant-burst",
            "10",
            "--api-key",
            "acme=k1",
            "--api-key",
            "globex=k2",
        ])
        .unwrap();
        assert_eq!(c.max_inflight, 8);
        assert_eq!(
            c.max_connections,
            backstop_payment::config::DEFAULT_MAX_CONNECTIONS
        );
        assert_eq!(c.tenant_rate.get(), 5);
        assert_eq!(c.api_keys.len(), 2);
        assert_eq!(c.psp, PspTarget::Url("http://127.0.0.1:8082".into()));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn limit_flags() {
        let c = parse(&[]).unwrap();
        assert_eq!((c.limit, c.min_inflight), (LimitMode::Fixed, 8));
        let c = parse(&[
            "--limit",
            "adaptive",
            "--min-inflight",
            "4",
            "--max-inflight",
            "64",
        ])
        .unwrap();
        assert_eq!(
            (c.limit, c.min_inflight, c.max_inflight),
            (LimitMode::Adaptive, 4, 64)
        );
        assert!(c.validate().is_ok());
        let err = parse(&["--limit", "auto"]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ValueValidation);
        assert!(err.to_string().contains("fixed or adaptive"), "{err}");
        let c = parse(&["--limit", "adaptive", "--min-inflight", "300"]).unwrap();
        assert!(c.validate().is_err(), "lower bound above the upper one");
    }

    #[test]
    fn queue_flags() {
        let c = parse(&[]).unwrap();
        assert_eq!(
            c.queue,
            QueueConfig::default(),
            "fair, 1024 waiters, 5 ms / 100 ms"
        );
        assert_eq!(c.queue.discipline, Discipline::Fair);
        let c = parse(&[
            "--queue",
            "fifo",
            "--queue-size",
            "64",
            "--queue-memory",
            "1048576",
            "--queue-target",
            "10ms",
            "--queue-interval",
            "200ms",
        ])
        .unwrap();
        assert_eq!(c.queue.discipline, Discipline::Fifo);
        assert_eq!((c.queue.max_waiters, c.queue.max_bytes), (64, 1 << 20));
        assert_eq!(c.queue.target, Duration::from_millis(10));
        assert_eq!(c.queue.interval, Duration::from_millis(200));
        assert!(c.validate().is_ok());

        let err = parse(&["--queue", "lifo"]).unwrap_err();
        assert!(err.to_string().contains("`fair` or `fifo`"), "{err}");
        for bad in ["0ms", "2m", "soon"] {
            assert!(parse(&["--queue-target", bad]).is_err(), "{bad}");
        }
        let c = parse(&["--queue-target", "50ms", "--queue-interval", "10ms"]).unwrap();
        assert!(c.validate().is_err(), "interval shorter than the target");
        let c = parse(&["--queue-size", "0"]).unwrap();
        let err = c.validate().unwrap_err();
        assert!(err.to_string().contains("--queue-size"), "{err}");
    }

    #[test]
    fn shedding_and_push_away_flags() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.shedding, SheddingConfig::default());
        assert_eq!(c.push_away, Some(PushAway::DEFAULT_SHARE));
        let c = parse(&[
            "--shed-threshold",
            "50",
            "--shed-window",
            "30s",
            "--shed-sustain",
            "0s",
            "--push-away-percent",
            "25",
        ])
        .unwrap();
        assert_eq!(c.shedding.threshold, 0.5);
        assert_eq!(c.shedding.window, Duration::from_secs(30));
        assert_eq!(c.shedding.sustain, Duration::ZERO);
        assert_eq!(c.push_away, Some(0.25));
        assert_eq!(parse(&["--no-push-away"]).unwrap().push_away, None);
        for bad in [
            &["--push-away-percent", "0"][..],
            &["--push-away-percent", "101"],
            &["--shed-threshold", "-1"],
            &["--shed-window", "1ms"],
            &["--shed-sustain", "2h"],
            &["--shed-window", "soon"],
        ] {
            let err = parse(bad).unwrap_err().to_string();
            assert!(err.contains(bad[0]), "{bad:?}: {err}");
        }
    }

    #[test]
    fn slow_start_flags() {
        let c = parse(&[]).unwrap();
        assert_eq!(
            c.slow_start,
            Some(backstop_payment::config::DEFAULT_SLOW_START_FLOOR)
        );
        assert_eq!(parse(&["--no-slow-start"]).unwrap().slow_start, None);
        let c = parse(&["--slow-start-floor", "16", "--limit", "adaptive"]).unwrap();
        assert_eq!(c.slow_start, Some(16));
        assert!(c.validate().is_ok());
        let c = parse(&["--slow-start-floor", "0"]).unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("--slow-start-floor"), "{err}");
        assert!(parse(&["--slow-start-floor", "-1"]).is_err());
    }

    #[test]
    fn fault_flag() {
        assert_eq!(parse(&[]).unwrap().fault_abort_percent, 0.0);
        let c = parse(&["--fault-abort-percent", "10"]).unwrap();
        assert_eq!(c.fault_abort_percent, 10.0);
        assert!(c.validate().is_ok());
        for bad in ["101", "-5", "ten", "NaN"] {
            let err = parse(&["--fault-abort-percent", bad]).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::ValueValidation, "{bad}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn api_keys_from_flags_environment_and_file_add_up() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("keys");
        std::fs::write(&file, "# merchants\ninitech=k3\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let args = T::try_parse_from([
            "serve",
            "--http",
            "0.0.0.0:9000",
            "--api-key",
            "acme=k1",
            "--api-key-file",
            file.to_str().unwrap(),
        ])
        .unwrap()
        .args;
        let c = args.config_with_env_keys(Some("globex=k2")).unwrap();
        let merchants: Vec<_> = c.api_keys.iter().map(|k| k.merchant.as_str()).collect();
        assert_eq!(merchants, ["acme", "globex", "initech"]);
        assert!(
            c.validate().is_ok(),
            "keys from any source close the service"
        );

        let env_only = T::try_parse_from(["serve", "--http", "0.0.0.0:9000"])
            .unwrap()
            .args
            .config_with_env_keys(Some("acme=k1"))
            .unwrap();
        assert_eq!(env_only.api_keys.len(), 1);
        assert!(env_only.validate().is_ok());

        std::fs::write(&file, "initech=k3\nbroken\n").unwrap();
        let error = args.config_with_env_keys(None).unwrap_err().to_string();
        assert!(error.contains("line 2"), "{error}");
        let error = args
            .config_with_env_keys(Some("a=1,,b"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("BACKSTOP_API_KEYS: entry 3"), "{error}");
    }

    #[test]
    fn refusals() {
        assert!(
            parse(&["--store", "postgres://u@h:port/db"])
                .unwrap_err()
                .to_string()
                .contains("invalid PostgreSQL store URL")
        );
        assert_eq!(
            parse(&["--store", "postgres://u@h/db"]).unwrap().store,
            StoreLocation::Postgres("postgres://u@h/db".into())
        );
        assert!(parse(&["--api-key", "nokey"]).is_err());
        assert!(parse(&["--psp", "127.0.0.1:1"]).is_err());
        assert!(parse(&["--tenant-rate", "0"]).is_err());
        let open_public = parse(&["--http", "0.0.0.0:9000"]).unwrap();
        assert!(open_public.validate().is_err());
        let open_public_grpc = parse(&["--grpc", "0.0.0.0:50051"]).unwrap();
        assert!(open_public_grpc.validate().is_err());
        assert!(
            parse(&["--max-connections", "0"])
                .unwrap()
                .validate()
                .is_err()
        );
        assert!(parse(&["--drain-timeout", "soon"]).is_err());
        assert!(parse(&["--drain-timeout", "2h"]).is_err());
        assert_eq!(
            parse(&["--drain-timeout", "1500ms"]).unwrap().drain_timeout,
            Duration::from_millis(1500)
        );
    }

    #[test]
    fn sweep_every_is_a_bounded_duration() {
        assert_eq!(parse(&[]).unwrap().sweep_every, Duration::from_secs(60));
        assert_eq!(
            parse(&["--sweep-every", "5s"]).unwrap().sweep_every,
            Duration::from_secs(5)
        );
        for bad in ["0s", "500ms", "2d", "often"] {
            assert!(parse(&["--sweep-every", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_otlp_endpoint_is_a_base_url_for_v1_traces() {
        for (base, want) in [
            ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
            ("http://127.0.0.1:4318/", "http://127.0.0.1:4318/v1/traces"),
            (
                "http://collector:4318/otlp",
                "http://collector:4318/otlp/v1/traces",
            ),
        ] {
            assert_eq!(otlp_traces_url(base).unwrap().to_string(), want, "{base}");
        }
        for (bad, why) in [
            ("https://127.0.0.1:4318", "https"),
            ("127.0.0.1:4318", "http://"),
            ("/v1/traces", "http://"),
            ("http://127.0.0.1:4318/?x=1", "query"),
            ("http://exa mple", "invalid"),
        ] {
            let error = otlp_traces_url(bad).unwrap_err();
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn no_otlp_endpoint_exports_nothing() {
        let args = T::try_parse_from(["serve"]).unwrap().args;
        if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() {
            assert_eq!(args.otlp_traces_url().unwrap(), None);
        }
    }

    #[cfg(feature = "otel")]
    #[test]
    fn an_otlp_endpoint_is_read_and_checked() {
        let args = T::try_parse_from(["serve", "--otlp-endpoint", "http://127.0.0.1:4318"])
            .unwrap()
            .args;
        let url = args.otlp_traces_url().unwrap().unwrap();
        assert_eq!(url.to_string(), "http://127.0.0.1:4318/v1/traces");
        let args = T::try_parse_from(["serve", "--otlp-endpoint", "https://x"])
            .unwrap()
            .args;
        let error = args.otlp_traces_url().unwrap_err().to_string();
        assert!(
            error.contains("--otlp-endpoint") && error.contains("https"),
            "{error}"
        );
    }

    #[cfg(not(feature = "otel"))]
    #[test]
    fn an_otlp_endpoint_without_the_otel_feature_is_refused() {
        let args = T::try_parse_from(["serve", "--otlp-endpoint", "http://127.0.0.1:4318"])
            .unwrap()
            .args;
        let error = args.otlp_traces_url().unwrap_err().to_string();
        assert!(
            error.contains("--otlp-endpoint") && error.contains("`otel` feature"),
            "{error}"
        );
    }
}
