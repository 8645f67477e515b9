//! `backstop proxy`'s flags and the settings they make.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use backstop::admission::QueueConfig;
use backstop::client::breaker::BreakerConfig;
use backstop_payment::config::StoreLocation;
use clap::Args;
use clap::error::ErrorKind;
use http::{HeaderName, Uri};

use super::forward::{DEFAULT_EFFECT_KEY_HEADER, UpstreamProtocol};
use super::policy::RouteTable;
use super::scope::ScopeHeaders;
use super::timeout_headers::{DEFAULT_TIMEOUT_HEADERS, TimeoutHeaders};

/// Flags of `backstop proxy`.
#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// Validate a routes file, print each route's effective policy, and exit (status 2 when
    /// the file is refused, naming what is wrong).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["config", "upstream"])]
    check_config: Option<PathBuf>,
    /// Address to accept HTTP/1.1 and HTTP/2 (h2c) on (port 0: any free port, logged at
    /// start).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The upstream, `http://HOST:PORT`; repeat it to balance over several (each request
    /// goes to the one with the fewest requests in flight of two picked at random).
    #[arg(long, value_name = "URL", required_unless_present = "check_config")]
    upstream: Vec<String>,
    /// How requests reach the upstream: `auto` sends gRPC over HTTP/2 with prior knowledge
    /// (h2c) and the rest over HTTP/1.1; `http1` and `h2c` send everything one way.
    #[arg(long, value_name = "PROTOCOL", value_enum, default_value_t = UpstreamProtocol::Auto)]
    upstream_protocol: UpstreamProtocol,
    /// The routes file (TOML): each route's idempotency class, timeout, attempts, hedging and
    /// rate class. Without it every request passes through with the defaults (10 s timeout),
    /// but a POST or PATCH carrying an `Idempotency-Key`, which is keyed (the `auto` class of a
    /// route that names none). See `--check-config`.
    ///
    /// On SIGHUP it is read and checked again, and its routes replace those in effect (log
    /// `policies reloaded`); a file that is refused is logged (`policy reload refused`) and the
    /// routes in effect stay. A reload refuses to un-key a keyed route (its keys' records
    /// promise a retry the first answer), to change the rate classes or `[proxy]
    /// replay_headers` (made at start); the flags are not read again.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where keyed requests' records live: `sqlite://PATH` (or `sqlite:PATH`, or a bare path;
    /// embedded, one proxy) or `postgres://USER@HOST:PORT/DB` (shared by several proxies).
    #[arg(long, value_name = "URL", default_value = "backstop-proxy.db")]
    store: String,
    /// Address of `/metrics` (Prometheus), `/healthz` and `/readyz`, apart from the proxied
    /// port so that no upstream path is hidden (port 0: any free port, logged at start).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9901")]
    admin: SocketAddr,
    /// Headers of milliseconds a caller may send its timeout in, besides `grpc-timeout`
    /// (repeatable; replaces the defaults).
    #[arg(long = "timeout-header", value_name = "NAME", default_values_t = DEFAULT_TIMEOUT_HEADERS.map(String::from))]
    timeout_headers: Vec<String>,
    /// Kept from the time left for the way to the upstream and back: the upstream gets what is
    /// left minus this.
    #[arg(long, value_name = "DURATION", default_value = "5ms", value_parser = parse_margin)]
    margin: Duration,
    /// A request header that identifies the caller (repeatable; replaces the default,
    /// `Authorization`, as the routes file's `[proxy] scope_headers` does: give one or the
    /// other). Idempotency keys and rate limits are scoped by a hash of these headers' values:
    /// one caller's key never replays another caller's answer, and only the hash is kept. A
    /// request carrying none of them, or on a route with `scope = "shared"`, is in the one
    /// shared scope (`default`).
    #[arg(long, value_name = "NAME")]
    scope_header: Vec<String>,
    /// The header carrying a keyed request's effect key to the upstream (the same for every
    /// forward of one key; a caller's own is removed).
    #[arg(long, value_name = "NAME", default_value = DEFAULT_EFFECT_KEY_HEADER)]
    effect_key_header: String,
    /// How long an idle connection to the upstream is kept for the next request: keep it
    /// below the upstream's own keep-alive timeout (Node's is 5 s), or a request may be
    /// written on a connection the upstream is closing.
    #[arg(long, value_name = "DURATION", default_value = "4s", value_parser = parse_idle)]
    upstream_idle_timeout: Duration,
    /// With several `--upstream`s, each has a circuit breaker of its own: it opens when at
    /// least this many requests to the endpoint in 10 s ended, half of them failed (a 5xx, or
    /// no answer), and the endpoint is left out of the balancing while it is open.
    #[arg(long, value_name = "N", default_value_t = 20)]
    endpoint_breaker_min_requests: u32,
    /// How long an endpoint's open breaker leaves it out before one request probes it.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_open_for)]
    endpoint_breaker_open_for: Duration,
    /// Longest timeout a caller may ask for; longer ones are cut to it.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_max_timeout)]
    max_timeout: Duration,
    /// How long a keyed request holds its key before a retry may take it over (at least the
    /// request's timeout).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_lease)]
    lease: Duration,
    /// The largest answer body of a keyed route kept for replay, unless the route sets
    /// `max_replay_body` (bytes, or with KiB, MiB, GiB). A larger answer streams through as it
    /// comes, and a retry with its key gets its status with `replay_body_too_large`, never a
    /// second forward.
    #[arg(long, value_name = "SIZE", default_value = "1MiB", value_parser = crate::byte_size::parse)]
    max_replay_body: usize,
    /// Requests forwarded at once; beyond it requests wait in a fair bounded queue, or get
    /// 503 + Retry-After.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    max_inflight: usize,
    /// Turn slow start off. With it (the default), when half of the recent requests fail (the
    /// upstream answers 5xx, cannot be reached, or its circuit is open) the limit drops to
    /// --slow-start-floor, and once requests succeed again it ramps back up to --max-inflight,
    /// doubling per round trip, instead of releasing the whole queue at once onto an upstream
    /// that is just back.
    #[arg(long)]
    no_slow_start: bool,
    /// Requests forwarded at once during an outage, where slow start ramps up from (capped by
    /// --max-inflight).
    #[arg(long, value_name = "N", default_value_t = backstop_payment::config::DEFAULT_SLOW_START_FLOOR)]
    slow_start_floor: usize,
    /// Most requests waiting for one of the --max-inflight places.
    #[arg(long, value_name = "N", default_value_t = QueueConfig::DEFAULT_MAX_WAITERS)]
    queue_size: usize,
    /// Connections open at once; at the cap an idle one is closed to make room, or the new
    /// one refused when all are busy.
    #[arg(long, value_name = "N", default_value_t = backstop_payment::config::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// On SIGTERM or ctrl-c, how long in-flight requests may take to finish before they are
    /// cut.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_drain)]
    drain_timeout: Duration,
    /// How often expired idempotency records are deleted.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_sweep)]
    sweep_every: Duration,
    /// Follow the fleet's retry switch kept in this Redis (`backstop retries off|on|ratio R`):
    /// the retries and hedges to the upstream stop or lower with the fleet's.
    #[arg(long, value_name = "URL")]
    retry_switch_redis: Option<String>,
    /// The retry switch's key.
    #[arg(long, value_name = "KEY", default_value = backstop::retry::switch::DEFAULT_KEY)]
    retry_switch_key: String,
}

/// What `backstop proxy` was asked to do.
#[derive(Debug)]
pub(crate) enum Mode {
    /// `--check-config FILE`, and the `--scope-header`s given with it.
    Check(PathBuf, Vec<HeaderName>),
    /// Run the proxy.
    Run(Box<Settings>),
}

/// A proxy's settings, checked.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) listen: SocketAddr,
    pub(crate) admin: SocketAddr,
    pub(crate) upstreams: Vec<Uri>,
    pub(crate) protocol: UpstreamProtocol,
    pub(crate) table: RouteTable,
    /// The routes file, read again on SIGHUP.
    pub(crate) config: Option<PathBuf>,
    pub(crate) store: StoreLocation,
    pub(crate) timeouts: TimeoutHeaders,
    pub(crate) margin: Duration,
    pub(crate) effect_key_header: HeaderName,
    /// Whose a key is.
    pub(crate) scopes: ScopeHeaders,
    pub(crate) upstream_idle_timeout: Duration,
    pub(crate) max_timeout: Duration,
    /// Slow start's floor, or `None` without slow start.
    pub(crate) slow_start: Option<usize>,
    /// The breaker of each upstream endpoint (with more than one).
    pub(crate) endpoint_breaker: BreakerConfig,
    pub(crate) lease: Duration,
    /// The largest keyed answer body kept for replay, where a route sets none.
    pub(crate) max_replay_body: usize,
    pub(crate) max_inflight: usize,
    pub(crate) queue_size: usize,
    pub(crate) max_connections: usize,
    pub(crate) drain_timeout: Duration,
    pub(crate) sweep_every: Duration,
    /// The Redis URL and key of the fleet's retry switch, when followed.
    pub(crate) retry_switch: Option<(String, String)>,
}

impl ProxyArgs {
    /// The mode and settings these flags describe, or the error to report as a usage error.
    pub(crate) fn mode(&self) -> Result<Mode, clap::Error> {
        let invalid =
            |message: String| clap::Error::raw(ErrorKind::InvalidValue, format!("{message}\n"));
        let header = |flag: &str, name: &str| {
            HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| invalid(format!("{flag}: {name:?} is not a header name")))
        };
        let scope_flag = self
            .scope_header
            .iter()
            .map(|name| header("--scope-header", name))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(file) = &self.check_config {
            return Ok(Mode::Check(file.clone(), scope_flag));
        }
        let upstreams = self
            .upstream
            .iter()
            .map(|url| parse_upstream(url).map_err(&invalid))
            .collect::<Result<Vec<_>, _>>()?;
        let table = match &self.config {
            Some(file) => RouteTable::load(file).map_err(|e| invalid(e.to_string()))?,
            None => RouteTable::pass_through(),
        };
        let store = self.store.as_str();
        let store = match store.strip_prefix("sqlite:") {
            Some(path) if !store.starts_with("sqlite://") => format!("sqlite://{path}"),
            _ => store.to_owned(),
        };
        let store = StoreLocation::parse(&store).map_err(|e| invalid(format!("--store: {e}")))?;
        let timeouts = self
            .timeout_headers
            .iter()
            .map(|name| header("--timeout-header", name))
            .collect::<Result<Vec<_>, _>>()?;
        let effect_key_header = header("--effect-key-header", &self.effect_key_header)?;
        let scopes =
            ScopeHeaders::resolve(scope_flag, table.scope_headers.as_deref()).map_err(&invalid)?;
        if effect_key_header == backstop::server::idempotency::IDEMPOTENCY_KEY {
            return Err(invalid(
                "--effect-key-header cannot be Idempotency-Key: the caller's key is forwarded \
                 as it came"
                    .into(),
            ));
        }
        for (flag, n) in [
            ("--max-inflight", self.max_inflight),
            ("--queue-size", self.queue_size),
            ("--max-connections", self.max_connections),
            ("--slow-start-floor", self.slow_start_floor),
            (
                "--endpoint-breaker-min-requests",
                self.endpoint_breaker_min_requests as usize,
            ),
        ] {
            if n == 0 {
                return Err(invalid(format!("{flag} must be at least 1")));
            }
        }
        Ok(Mode::Run(Box::new(Settings {
            listen: self.listen,
            admin: self.admin,
            upstreams,
            protocol: self.upstream_protocol,
            table,
            config: self.config.clone(),
            store,
            timeouts: TimeoutHeaders::new(timeouts),
            margin: self.margin,
            effect_key_header,
            scopes,
            upstream_idle_timeout: self.upstream_idle_timeout,
            max_timeout: self.max_timeout,
            slow_start: (!self.no_slow_start).then_some(self.slow_start_floor),
            endpoint_breaker: BreakerConfig {
                min_requests: self.endpoint_breaker_min_requests,
                open_for: self.endpoint_breaker_open_for,
                ..BreakerConfig::default()
            },
            lease: self.lease,
            max_replay_body: self.max_replay_body,
            max_inflight: self.max_inflight,
            queue_size: self.queue_size,
            max_connections: self.max_connections,
            drain_timeout: self.drain_timeout,
            sweep_every: self.sweep_every,
            retry_switch: self
                .retry_switch_redis
                .clone()
                .map(|url| (url, self.retry_switch_key.clone())),
        })))
    }
}

/// An upstream URL: `http://HOST:PORT` and nothing more.
fn parse_upstream(url: &str) -> Result<Uri, String> {
    let uri: Uri = url
        .parse()
        .map_err(|e| format!("--upstream {url:?}: {e} (expected e.g. http://127.0.0.1:9000)"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!(
                "--upstream {url:?}: https is not supported; use plain http (h2c for HTTP/2)"
            ));
        }
        _ => return Err(format!("--upstream {url:?}: expected an http:// URL")),
    }
    if uri.authority().is_none() {
        return Err(format!("--upstream {url:?}: no host"));
    }
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
        return Err(format!(
            "--upstream {url:?}: a path or query is not supported; requests keep their own"
        ));
    }
    Ok(uri)
}

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 5ms or 10s: {e}"))
}

fn within(
    s: &str,
    range: std::ops::RangeInclusive<Duration>,
    what: &str,
) -> Result<Duration, String> {
    let d = duration(s)?;
    if range.contains(&d) {
        Ok(d)
    } else {
        Err(format!("{s} is outside {what}"))
    }
}

fn parse_margin(s: &str) -> Result<Duration, String> {
    within(s, Duration::ZERO..=Duration::from_secs(10), "0s..=10s")
}

fn parse_open_for(s: &str) -> Result<Duration, String> {
    within(
        s,
        Duration::from_millis(10)..=Duration::from_secs(600),
        "10ms..=10m",
    )
}

fn parse_max_timeout(s: &str) -> Result<Duration, String> {
    within(
        s,
        Duration::from_millis(1)..=Duration::from_secs(3600),
        "1ms..=1h",
    )
}

fn parse_lease(s: &str) -> Result<Duration, String> {
    within(
        s,
        Duration::from_millis(100)..=Duration::from_secs(3600),
        "100ms..=1h",
    )
}

fn parse_idle(s: &str) -> Result<Duration, String> {
    within(
        s,
        Duration::from_millis(100)..=Duration::from_secs(600),
        "100ms..=10min",
    )
}

fn parse_drain(s: &str) -> Result<Duration, String> {
    within(s, Duration::ZERO..=Duration::from_secs(600), "0s..=10min")
}

fn parse_sweep(s: &str) -> Result<Duration, String> {
    within(
        s,
        Duration::from_secs(1)..=Duration::from_secs(86_400),
        "1s..=1d",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct T {
        #[command(flatten)]
        args: ProxyArgs,
    }

    fn settings(args: &[&str]) -> Result<Settings, clap::Error> {
        let mut argv = vec!["proxy"];
        argv.extend_from_slice(args);
        match T::try_parse_from(argv)?.args.mode()? {
            Mode::Run(settings) => Ok(*settings),
            Mode::Check(..) => panic!("not a run"),
        }
    }

    #[test]
    fn defaults() {
        let s = settings(&["--upstream", "http://127.0.0.1:9000"]).unwrap();
        assert_eq!(s.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(s.admin, "127.0.0.1:9901".parse().unwrap());
        assert_eq!(s.store, StoreLocation::Sqlite("backstop-proxy.db".into()));
        assert_eq!(s.protocol, UpstreamProtocol::Auto);
        assert_eq!(s.effect_key_header, "idempotency-effect-key");
        assert_eq!(s.margin, Duration::from_millis(5));
        assert_eq!(s.table.routes.len(), 1, "the fallback alone");
        assert_eq!(s.scopes, ScopeHeaders::resolve(Vec::new(), None).unwrap());
        let s = settings(&[
            "--upstream",
            "http://h:1",
            "--scope-header",
            "x-api-key",
            "--scope-header",
            "Cookie",
        ])
        .unwrap();
        let names = ["x-api-key", "cookie"]
            .map(HeaderName::from_static)
            .to_vec();
        assert_eq!(s.scopes, ScopeHeaders::resolve(names, None).unwrap());
        assert!(settings(&["--upstream", "http://h:1", "--scope-header", "a b"]).is_err());
        assert_eq!(
            s.slow_start,
            Some(backstop_payment::config::DEFAULT_SLOW_START_FLOOR)
        );
        assert_eq!(s.endpoint_breaker.min_requests, 20);
        assert_eq!(s.endpoint_breaker.open_for, Duration::from_secs(5));
    }

    #[test]
    fn slow_start_and_endpoint_breakers() {
        let up = ["--upstream", "http://h:1"];
        let with = |more: &[&str]| settings(&[&up[..], more].concat());
        assert_eq!(with(&["--no-slow-start"]).unwrap().slow_start, None);
        assert_eq!(
            with(&["--slow-start-floor", "3"]).unwrap().slow_start,
            Some(3)
        );
        assert!(with(&["--slow-start-floor", "0"]).is_err());
        let s = with(&[
            "--endpoint-breaker-min-requests",
            "4",
            "--endpoint-breaker-open-for",
            "1s",
        ])
        .unwrap();
        assert_eq!(s.endpoint_breaker.min_requests, 4);
        assert_eq!(s.endpoint_breaker.open_for, Duration::from_secs(1));
        assert!(with(&["--endpoint-breaker-min-requests", "0"]).is_err());
        assert!(with(&["--endpoint-breaker-open-for", "1ms"]).is_err());
    }

    #[test]
    fn stores_and_upstreams() {
        let s = settings(&[
            "--upstream",
            "http://127.0.0.1:9000",
            "--upstream",
            "http://127.0.0.1:9001/",
            "--store",
            "sqlite:/tmp/p.db",
        ])
        .unwrap();
        assert_eq!(s.upstreams.len(), 2);
        assert_eq!(s.store, StoreLocation::Sqlite("/tmp/p.db".into()));
        let s = settings(&["--upstream", "http://h:1", "--store", "postgres://u@h/db"]).unwrap();
        assert_eq!(s.store, StoreLocation::Postgres("postgres://u@h/db".into()));
        for bad in ["https://h:1", "127.0.0.1:9000", "http://h:1/api", "http://"] {
            assert!(settings(&["--upstream", bad]).is_err(), "{bad}");
        }
        assert!(settings(&[]).is_err(), "an upstream is required");
        assert!(settings(&["--upstream", "http://h:1", "--store", "redis://x"]).is_err());
        assert!(
            settings(&[
                "--upstream",
                "http://h:1",
                "--effect-key-header",
                "Idempotency-Key"
            ])
            .is_err()
        );
        assert!(settings(&["--upstream", "http://h:1", "--max-inflight", "0"]).is_err());
    }

    #[test]
    fn check_config_needs_no_upstream() {
        let t = T::try_parse_from(["proxy", "--check-config", "routes.toml"]).unwrap();
        assert!(matches!(t.args.mode().unwrap(), Mode::Check(_, _)));
        assert!(
            T::try_parse_from([
                "proxy",
                "--check-config",
                "a.toml",
                "--upstream",
                "http://h:1"
            ])
            .is_err()
        );
    }
}
