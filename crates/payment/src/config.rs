//! Configuration of the payment service (what `backstop serve` flags fill in).
//!
//! [`Config::validate`] runs before anything is opened or bound: an open service (no API keys)
//! on a non-loopback address is a start-up error, not a warning.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::num::NonZeroU32;

use backstop::admission::redis::{FailurePolicy, RedisConfig};
use backstop::admission::{QueueConfig, Quota, SheddingConfig};
use backstop::policy::MethodPolicies;
use backstop::server::listen::PushAway;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::policies;

/// Default HTTP listen address.
pub const DEFAULT_HTTP: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8081));
/// Default gRPC listen address.
pub const DEFAULT_GRPC: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 50051));
/// Default store file, relative to the working directory.
pub const DEFAULT_STORE: &str = "backstop.db";
/// Largest accepted request body: 1 MiB.
pub const BODY_LIMIT: usize = 1024 * 1024;
/// Default cap on open connections per listener.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Requests admitted at once during an outage, where slow start ramps up from.
pub const DEFAULT_SLOW_START_FLOOR: usize = 4;
/// Merchant of every request when the service runs without API keys.
pub const DEFAULT_MERCHANT: &str = "default";

/// How the admission gate's concurrency limit is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LimitMode {
    /// `max_inflight` requests at once, always.
    #[default]
    Fixed,
    /// Found from the latency of admitted requests (a gradient limit), between `min_inflight`
    /// and `max_inflight`: lower when latency rises above its baseline, higher when it falls.
    Adaptive,
}

impl LimitMode {
    /// The flag value: `fixed` or `adaptive`.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitMode::Fixed => "fixed",
            LimitMode::Adaptive => "adaptive",
        }
    }
}

impl std::fmt::Display for LimitMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LimitMode {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fixed" => Ok(LimitMode::Fixed),
            "adaptive" => Ok(LimitMode::Adaptive),
            _ => Err(ConfigError::LimitMode),
        }
    }
}

/// Where the service keeps its tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A SQLite file (WAL, `synchronous=FULL`, group commit).
    Sqlite(PathBuf),
    /// A PostgreSQL database (`postgres://user@host:port/db`), which several instances may
    /// share.
    Postgres(String),
}

impl StoreLocation {
    /// Parses `sqlite://PATH`, `postgres://...` (or `postgresql://...`) or a bare path; any
    /// other `scheme://` is refused.
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        if s.is_empty() {
            return Err(ConfigError::EmptyStore);
        }
        if let Some(path) = s.strip_prefix("sqlite://") {
            if path.is_empty() {
                return Err(ConfigError::EmptyStore);
            }
            return Ok(StoreLocation::Sqlite(PathBuf::from(path)));
        }
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            use backstop::db::postgres::tokio_postgres;
            return match s.parse::<tokio_postgres::Config>() {
                Ok(_) => Ok(StoreLocation::Postgres(s.to_owned())),
                Err(e) => Err(ConfigError::InvalidPostgresUrl(e.to_string())),
            };
        }
        if let Some((scheme, _)) = s.split_once("://") {
            return Err(ConfigError::UnknownStoreScheme(
                scheme.chars().take(32).collect(),
            ));
        }
        Ok(StoreLocation::Sqlite(PathBuf::from(s)))
    }

    /// The SQLite file path (`None` for PostgreSQL).
    pub fn path(&self) -> Option<&Path> {
        match self {
            StoreLocation::Sqlite(p) => Some(p),
            StoreLocation::Postgres(_) => None,
        }
    }

    /// The store for logs: the path, or the URL without its password.
    pub fn redacted(&self) -> String {
        match self {
            StoreLocation::Sqlite(p) => p.display().to_string(),
            StoreLocation::Postgres(url) => match url.split_once("://") {
                Some((scheme, rest)) => match rest.split_once('@') {
                    Some((creds, host)) => {
                        let user = creds.split(':').next().unwrap_or_default();
                        format!(
                            "{scheme}://{user}@{}",
                            host.split('?').next().unwrap_or(host)
                        )
                    }
                    None => format!("{scheme}://{}", rest.split('?').next().unwrap_or(rest)),
                },
                None => String::new(),
            },
        }
    }

    /// The embedded PSP's own database file, next to the store: `backstop.db` ->
    /// `backstop-psp.db` (for PostgreSQL, `backstop-psp.db` in the working directory).
    pub fn psp_sibling(&self) -> PathBuf {
        let path = self.path().unwrap_or(Path::new(DEFAULT_STORE));
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "backstop".to_owned());
        path.with_file_name(format!("{stem}-psp.db"))
    }
}

/// Which PSP the service charges through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PspTarget {
    /// A PSP already running at this base URL (for example `backstop psp`).
    Url(String),
    /// Start the simulator in-process on an OS-chosen loopback port, with its own database file.
    Embedded {
        /// The simulator's database file.
        db: PathBuf,
    },
}

/// One `MERCHANT=KEY` pair.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    /// Merchant (tenant) the key authenticates.
    pub merchant: String,
    /// The bearer token.
    pub key: String,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("ApiKey")
            .field("merchant", &self.merchant)
            .field("key", &"<redacted>")
            .finish()
    }
}

impl ApiKey {
    /// Parses `MERCHANT=KEY`: a merchant of 1..=64 characters from `[A-Za-z0-9._-]` and a key of
    /// 1..=256 visible ASCII characters.
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        let (merchant, key) = s.split_once('=').ok_or(ConfigError::ApiKeyFormat)?;
        let merchant_ok = (1..=64).contains(&merchant.len())
            && merchant
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        let key_ok =
            (1..=256).contains(&key.len()) && key.bytes().all(|b| (0x21..=0x7e).contains(&b));
        if !merchant_ok || !key_ok {
            return Err(ConfigError::ApiKeyFormat);
        }
        Ok(ApiKey {
            merchant: merchant.to_owned(),
            key: key.to_owned(),
        })
    }
}

/// Everything the service needs to start.
#[derive(Debug, Clone)]
pub struct Config {
    /// HTTP listen address (`127.0.0.1:0` picks a free port).
    pub http: SocketAddr,
    /// gRPC listen address (`payment.v1.Payment` over h2c).
    pub grpc: SocketAddr,
    /// The store.
    pub store: StoreLocation,
    /// The PSP.
    pub psp: PspTarget,
    /// Requests executing at once before the gate answers 503 + Retry-After: the limit when
    /// `limit` is fixed, its upper bound (and starting point) when adaptive.
    pub max_inflight: usize,
    /// Fixed or adaptive concurrency limit.
    pub limit: LimitMode,
    /// Lower bound of an adaptive limit.
    pub min_inflight: usize,
    /// The gate's queue: discipline, bounds, sojourn target and interval (its minimal service
    /// time is the service's).
    pub queue: QueueConfig,
    /// Slow start around the limit (fixed or adaptive): while most requests fail (the PSP or
    /// the store is down) the limit drops to this floor, and once they succeed again it ramps
    /// back up, doubling per round trip. `None` turns it off.
    pub slow_start: Option<usize>,
    /// When the gate sheds under sustained overload (the share of requests it refused over a
    /// sliding window, above a threshold for long enough): its refusals then ask clients not
    /// to retry, and `push_away` pushes connections elsewhere.
    pub shedding: SheddingConfig,
    /// Share of each listener's open connections (at least one) pushed per second to
    /// reconnect, so that clients rebalance across instances, while the overload is
    /// sustained: HTTP/2 ones get a graceful `GOAWAY`, HTTP/1.1 ones `Connection: close`.
    /// `None` turns it off.
    pub push_away: Option<f64>,
    /// Percentage of payment requests aborted at random with 503 / `UNAVAILABLE` before any
    /// work (fault injection, for experiments); 0 injects nothing.
    pub fault_abort_percent: f64,
    /// Sustained requests per second per merchant before 429 + Retry-After.
    pub tenant_rate: NonZeroU32,
    /// Burst per merchant.
    pub tenant_burst: NonZeroU32,
    /// Bearer keys; empty means open (loopback only, merchant `default`).
    pub api_keys: Vec<ApiKey>,
    /// Budget of a request that carries no `grpc-timeout`.
    pub default_timeout: Duration,
    /// Smallest margin kept back from the request deadline for the PSP call (the margin is
    /// otherwise 2 x RTT_p99 + 5 ms of the PSP).
    pub psp_margin_floor: Duration,
    /// How long an idempotency record is kept (7 days for payments).
    pub key_ttl: Duration,
    /// How long a claimed key stays `running` before another request may take it over.
    pub lease: Duration,
    /// The largest answer body of a keyed method kept for replay, for methods whose policy
    /// sets none: a larger answer streams to its caller and a retry with its key gets its
    /// status with `replay_body_too_large` (default
    /// [`DEFAULT_MAX_REPLAY_BODY`](backstop::policy::DEFAULT_MAX_REPLAY_BODY), 1 MiB).
    pub max_replay_body: usize,
    /// Bound on draining in-flight requests at shutdown.
    pub drain_timeout: Duration,
    /// How often expired idempotency records are deleted (a sweep also runs at start-up).
    pub sweep_every: Duration,
    /// Most connections open at once on each listener; at the cap an idle connection is closed
    /// to make room, or the new one is refused when all are busy. Keep it below the file
    /// descriptor limit.
    pub max_connections: usize,
    /// Per-merchant rate limits shared through Redis by all instances; `None` keeps them in
    /// this process.
    pub redis: Option<RedisConfig>,
    /// What the rate limit does when Redis does not answer.
    pub redis_failure: FailurePolicy,
    /// How long one rate-limit decision waits for Redis before `redis_failure` decides.
    pub redis_timeout: Duration,
    /// How many instances share the Redis quota: with `FailurePolicy::Open` each falls back to
    /// rate / instances.
    pub instances: NonZeroU32,
    /// The Redis key of the fleet's retry switch, followed by the PSP client when `redis` is
    /// set (see [`backstop::retry::switch`]).
    pub retry_switch_key: String,
    /// The method policy table the server stack runs by, when a config file gives one;
    /// `None`: [`method_policies`](Self::method_policies) builds it from the settings above.
    /// [`validate`](Self::validate) holds it to the service's rules
    /// ([`check_policies`](crate::policies::check_policies)).
    pub policies: Option<MethodPolicies>,
    /// Per-merchant quotas of the rate classes the policies name, each with its own buckets;
    /// the `default` class spends `tenant_rate` and `tenant_burst`.
    pub rate_classes: BTreeMap<String, Quota>,
}

impl Config {
    /// Defaults for everything, storing in `store` and spawning the embedded PSP next to it.
    pub fn new(store: StoreLocation) -> Self {
        let psp = PspTarget::Embedded {
            db: store.psp_sibling(),
        };
        Config {
            http: DEFAULT_HTTP,
            grpc: DEFAULT_GRPC,
            store,
            psp,
            max_inflight: 256,
            limit: LimitMode::Fixed,
            min_inflight: 8,
            queue: QueueConfig::default(),
            slow_start: Some(DEFAULT_SLOW_START_FLOOR),
            shedding: SheddingConfig::default(),
            push_away: Some(PushAway::DEFAULT_SHARE),
            fault_abort_percent: 0.0,
            tenant_rate: NonZeroU32::new(1000).expect("non-zero"),
            tenant_burst: NonZeroU32::new(2000).expect("non-zero"),
            api_keys: Vec::new(),
            default_timeout: Duration::from_secs(10),
            psp_margin_floor: Duration::from_millis(20),
            key_ttl: Duration::from_secs(7 * 24 * 3600),
            lease: Duration::from_secs(5),
            max_replay_body: backstop::policy::DEFAULT_MAX_REPLAY_BODY,
            drain_timeout: Duration::from_secs(10),
            sweep_every: Duration::from_secs(60),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            redis: None,
            redis_failure: FailurePolicy::Open,
            redis_timeout: backstop::admission::redis::DEFAULT_TIMEOUT,
            instances: NonZeroU32::MIN,
            retry_switch_key: backstop::retry::switch::DEFAULT_KEY.to_owned(),
            policies: None,
            rate_classes: BTreeMap::new(),
        }
    }

    /// Checks the combination before anything starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.api_keys.is_empty() {
            // Every listener serves the same payments: each one is bound by the rule.
            for addr in [self.http, self.grpc] {
                if !addr.ip().is_loopback() {
                    return Err(ConfigError::OpenOnNonLoopback(addr));
                }
            }
        }
        if self.max_inflight == 0 {
            return Err(ConfigError::ZeroInflight);
        }
        if self.max_connections == 0 {
            return Err(ConfigError::ZeroConnections);
        }
        if self.limit == LimitMode::Adaptive
            && !(1..=self.max_inflight).contains(&self.min_inflight)
        {
            return Err(ConfigError::InflightBounds);
        }
        let queue = &self.queue;
        if queue.max_waiters == 0
            || queue.max_bytes == 0
            || queue.target.is_zero()
            || queue.interval < queue.target
        {
            return Err(ConfigError::Queue);
        }
        // A floor above the limit is capped by it (a small --max-inflight keeps the default).
        if self.slow_start == Some(0) {
            return Err(ConfigError::SlowStartFloor);
        }
        self.shedding
            .validate()
            .map_err(|_| ConfigError::Shedding)?;
        if self
            .push_away
            .is_some_and(|share| !(share > 0.0 && share <= 1.0))
        {
            return Err(ConfigError::PushAwayShare);
        }
        if !(0.0..=100.0).contains(&self.fault_abort_percent) {
            return Err(ConfigError::FaultPercent);
        }
        for (i, a) in self.api_keys.iter().enumerate() {
            if self.api_keys[..i].iter().any(|b| b.key == a.key) {
                return Err(ConfigError::DuplicateApiKey(a.merchant.clone()));
            }
        }
        if self.default_timeout.is_zero() || self.lease.is_zero() || self.key_ttl < self.lease {
            return Err(ConfigError::Durations);
        }
        if let Some(policies) = &self.policies {
            policies::check_policies(policies, &self.rate_classes)
                .map_err(ConfigError::Policies)?;
        }
        Ok(())
    }

    /// The policy of every method the service serves, for its server stack and its clients
    /// alike: [`policies`](Self::policies) when a config file gave the table, else
    /// [`default_policies`](policies::default_policies) from the default timeout and key TTL.
    pub fn method_policies(&self) -> MethodPolicies {
        self.policies
            .clone()
            .unwrap_or_else(|| policies::default_policies(self.default_timeout, self.key_ttl))
    }

    /// Whether requests need a bearer key.
    pub fn is_open(&self) -> bool {
        self.api_keys.is_empty()
    }
}

/// A configuration the service refuses to start with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// No API keys on an address other machines can reach.
    #[error(
        "refusing to serve without API keys on non-loopback address {0}: pass --api-key MERCHANT=KEY, or bind to 127.0.0.1 / [::1]"
    )]
    OpenOnNonLoopback(SocketAddr),
    /// A `postgres://` store URL that does not parse.
    #[error("invalid PostgreSQL store URL: {0}")]
    InvalidPostgresUrl(String),
    /// A store URL with another scheme.
    #[error("unknown store scheme {0:?}: use sqlite://PATH, postgres://... or a file path")]
    UnknownStoreScheme(String),
    /// Empty store path.
    #[error("the store path is empty")]
    EmptyStore,
    /// `--api-key` not in `MERCHANT=KEY` form.
    #[error(
        "--api-key must be MERCHANT=KEY (merchant: 1-64 of [A-Za-z0-9._-]; key: 1-256 visible ASCII)"
    )]
    ApiKeyFormat,
    /// The same key given to two merchants.
    #[error("the same API key is given twice (second time for merchant {0:?})")]
    DuplicateApiKey(String),
    /// `--max-inflight 0`.
    #[error("--max-inflight must be at least 1")]
    ZeroInflight,
    /// `--max-connections 0`.
    #[error("--max-connections must be at least 1")]
    ZeroConnections,
    /// `--min-inflight` zero or above `--max-inflight` with an adaptive limit.
    #[error("--min-inflight must be between 1 and --max-inflight")]
    InflightBounds,
    /// `--slow-start-floor` zero.
    #[error("--slow-start-floor must be at least 1")]
    SlowStartFloor,
    /// A shedding window under 10 ms or a threshold outside 0 to 1.
    #[error("--shed-window must be at least 10ms and --shed-threshold between 0 and 1")]
    Shedding,
    /// A push-away share outside (0, 1].
    #[error("--push-away-share must be above 0 and at most 1")]
    PushAwayShare,
    /// `--fault-abort-percent` outside 0 to 100.
    #[error("--fault-abort-percent must be between 0 and 100")]
    FaultPercent,
    /// `--limit` other than `fixed` or `adaptive`.
    #[error("--limit must be fixed or adaptive")]
    LimitMode,
    /// A queue bound of zero, a zero sojourn target, or an interval shorter than the target.
    #[error(
        "--queue-size and --queue-memory must be at least 1, --queue-target above zero and --queue-interval at least --queue-target"
    )]
    Queue,
    /// Zero timeout or lease, or a key TTL shorter than the lease.
    #[error("timeouts and leases must be positive and the key TTL at least the lease")]
    Durations,
    /// A policy table the service cannot run by (see
    /// [`check_policies`](crate::policies::check_policies)).
    #[error("policies: {0}")]
    Policies(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_locations() {
        assert_eq!(
            StoreLocation::parse("sqlite:///tmp/x.db").unwrap(),
            StoreLocation::Sqlite("/tmp/x.db".into())
        );
        assert_eq!(
            StoreLocation::parse("data/x.db").unwrap(),
            StoreLocation::Sqlite("data/x.db".into())
        );
        assert_eq!(
            StoreLocation::parse("postgres://u@h/db"),
            Ok(StoreLocation::Postgres("postgres://u@h/db".into()))
        );
        assert!(matches!(
            StoreLocation::parse("postgres://u@h:notaport/db"),
            Err(ConfigError::InvalidPostgresUrl(_))
        ));
        assert_eq!(
            StoreLocation::parse("postgres://u:secret@h:5432/db?options=x")
                .unwrap()
                .redacted(),
            "postgres://u@h:5432/db"
        );
        assert_eq!(
            StoreLocation::parse("postgres://u@h/db")
                .unwrap()
                .psp_sibling(),
            PathBuf::from("backstop-psp.db")
        );
        assert!(matches!(
            StoreLocation::parse("redis://h"),
            Err(ConfigError::UnknownStoreScheme(_))
        ));
        assert_eq!(
            StoreLocation::parse("sqlite://"),
            Err(ConfigError::EmptyStore)
        );
        assert_eq!(
            StoreLocation::parse("data/x.db").unwrap().psp_sibling(),
            PathBuf::from("data/x-psp.db")
        );
        assert_eq!(
            StoreLocation::parse("backstop.db").unwrap().psp_sibling(),
            PathBuf::from("backstop-psp.db")
        );
    }

    #[test]
    fn api_keys() {
        let k = ApiKey::parse("acme=sk_live_1").unwrap();
        assert_eq!(k.merchant, "acme");
        assert_eq!(k.key, "sk_live_1");
        assert!(!format!("{k:?}").contains("sk_live_1"));
        // The key may contain '='.
        assert_eq!(ApiKey::parse("a=b=c").unwrap().key, "b=c");
        for bad in ["acme", "=k", "acme=", "ac me=k", "acme=k y"] {
            assert_eq!(ApiKey::parse(bad), Err(ConfigError::ApiKeyFormat), "{bad}");
        }
    }

    #[test]
    fn open_service_only_on_loopback() {
        let mut c = Config::new(StoreLocation::Sqlite("x.db".into()));
        assert!(c.validate().is_ok());
        c.http = "0.0.0.0:8081".parse().unwrap();
        assert!(matches!(
            c.validate(),
            Err(ConfigError::OpenOnNonLoopback(_))
        ));
        c.api_keys.push(ApiKey::parse("a=k").unwrap());
        assert!(c.validate().is_ok());
        c.http = "[::1]:8081".parse().unwrap();
        c.api_keys.clear();
        assert!(c.validate().is_ok());
    }

    #[test]
    fn open_service_refuses_a_public_grpc_address_too() {
        let mut c = Config::new(StoreLocation::Sqlite("x.db".into()));
        c.grpc = "0.0.0.0:50051".parse().unwrap();
        assert_eq!(
            c.validate(),
            Err(ConfigError::OpenOnNonLoopback(c.grpc)),
            "an open gRPC port charges unauthenticated calls"
        );
        c.api_keys.push(ApiKey::parse("a=k").unwrap());
        assert!(c.validate().is_ok());
    }

    #[test]
    fn adaptive_limit_bounds_are_checked() {
        assert_eq!("adaptive".parse(), Ok(LimitMode::Adaptive));
        assert_eq!("fixed".parse(), Ok(LimitMode::Fixed));
        assert_eq!("auto".parse::<LimitMode>(), Err(ConfigError::LimitMode));
        let mut c = Config::new(StoreLocation::Sqlite("x.db".into()));
        c.min_inflight = 300;
        assert!(
            c.validate().is_ok(),
            "a fixed limit ignores the lower bound"
        );
        c.limit = LimitMode::Adaptive;
        assert_eq!(c.validate(), Err(ConfigError::InflightBounds));
        c.min_inflight = 0;
        assert_eq!(c.validate(), Err(ConfigError::InflightBounds));
        c.min_inflight = 256;
        assert!(c.validate().is_ok());
    }

    #[test]
    fn shedding_and_push_away_are_checked() {
        let mut c = Config::new(StoreLocation::Sqlite("x.db".into()));
        assert_eq!(c.push_away, Some(PushAway::DEFAULT_SHARE), "on by default");
        assert_eq!(c.validate(), Ok(()));
        for share in [0.0, 1.5, f64::NAN] {
            c.push_away = Some(share);
            assert_eq!(c.validate(), Err(ConfigError::PushAwayShare), "{share}");
        }
        c.push_away = None;
        assert_eq!(c.validate(), Ok(()));
        c.shedding.threshold = 2.0;
        assert_eq!(c.validate(), Err(ConfigError::Shedding));
        c.shedding = SheddingConfig {
            window: Duration::from_millis(1),
            ..SheddingConfig::default()
        };
        assert_eq!(c.validate(), Err(ConfigError::Shedding));
    }

    #[test]
    fn slow_start_floor_is_checked() {
        let mut c = Config::new(StoreLocation::Sqlite("x.db".into()));
        assert_eq!(c.slow_start, Some(DEFAULT_SLOW_START_FLOOR));
        c.slow_start = Some(0);
        assert_eq!(c.validate(), Err(ConfigError::SlowStartFloor));
        c.slow_start = Some(1000);
        assert!(c.validate().is_ok(), "capped by the limit");
        c.max_inflight = 1;
        c.slow_start = Some(DEFAULT_SLOW_START_FLOOR);
        assert!(
            c.validate().is_ok(),
            "the default floor with a limit of one"
        );
        c.slow_start = None;
        assert!(c.validate().is_ok());
        for bad in [-1.0, 100.1, f64::NAN] {
            c.fault_abort_percent = bad;
            assert_eq!(c.validate(), Err(ConfigError::FaultPercent), "{bad}");
        }
    }

    #[test]
    fn duplicate_keys_are_refused() {
        let mut c = Config::new(StoreLocation::Sqlite("x.db".into()));
        c.api_keys = vec![ApiKey::parse("a=k").unwrap(), ApiKey::parse("b=k").unwrap()];
        assert!(matches!(c.validate(), Err(ConfigError::DuplicateApiKey(_))));
    }
}
