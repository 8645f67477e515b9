//! Per-tenant token buckets shared by several instances through Redis (feature `redis`).
//!
//! A [`KeyedTokenBucket`](super::KeyedTokenBucket) limits what *one* process admits; three
//! instances behind a load balancer would let a tenant through at three times its rate.
//! [`RedisTokenBucket`] keeps the same GCRA state (one theoretical arrival time per tenant) in
//! Redis instead, and decides with one atomic Lua script (`gcra.lua`, run by `EVALSHA`, loaded
//! again after a `NOSCRIPT`):
//!
//! - the time is the Redis server's (`TIME` inside the script), so the instances' clocks never
//!   enter the decision;
//! - a key expires (`PX`) when its bucket is full again, so an idle tenant costs nothing and a
//!   flood of made-up tenant ids costs memory only for as long as their buckets take to refill;
//! - the decisions are those of the local bucket: allowed, or denied with the wait until a
//!   token is back, at microsecond resolution (the quota's interval is rounded to whole
//!   microseconds, at least one).
//!
//! Redis is another dependency that can fail or hang. [`SharedLimiter`] wraps the bucket with
//! what a server needs: every decision bounded by a timeout and by the request's deadline, and
//! a [`FailurePolicy`] for when Redis does not answer: `Open` decides with a local bucket at
//! this instance's share of the rate ([`local_share`]), `Closed` refuses (the server answers
//! 503 + `Retry-After`). After a failure Redis is left alone for a cool-down, so a dead Redis
//! costs requests nothing but the fallback decision; one request then probes it again.
//!
//! ```no_run
//! use std::num::NonZeroU32;
//! use backstop::admission::Quota;
//! use backstop::admission::redis::{RedisConfig, RedisTokenBucket};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let quota = Quota::per_second(NonZeroU32::new(100).unwrap(), NonZeroU32::new(20).unwrap());
//! let config = RedisConfig::new("redis://127.0.0.1:6379")?.prefix("payments:rl:");
//! let tenants = RedisTokenBucket::new(&config, quota)?;
//! match tenants.check("acme").await? {
//!     Ok(()) => { /* serve */ }
//!     Err(wait) => println!("over quota, retry in {wait:?}"),
//! }
//! # Ok(())
//! # }
//! ```

mod shared;

pub use self::shared::{
    DEFAULT_COOLDOWN, DEFAULT_TIMEOUT, Decision, FailurePolicy, ParseFailurePolicyError,
    PendingDecision, SharedLimiter, Verdict, local_share,
};

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Client, RedisError, Script};
use sha2::{Digest, Sha256};

use super::Quota;

/// Source of the GCRA script.
pub const SCRIPT: &str = include_str!("gcra.lua");

static GCRA: LazyLock<Script> = LazyLock::new(|| Script::new(SCRIPT));

/// Longest tenant id used verbatim in a key; longer ids are hashed, so a key's size is bounded
/// whatever the client sent.
const MAX_VERBATIM_KEY: usize = 128;

/// Largest increment or tolerance sent to the script: 2^50 µs (about 35 years), well inside the
/// integers a Lua double holds exactly once added to the server's time (about 2^51 µs now).
const MAX_SPAN_US: u64 = 1 << 50;

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "backstop:rl:";

/// Where the shared buckets live and how to reach them.
///
/// [`RedisConfig::new`] checks the URL without connecting.
#[derive(Clone)]
pub struct RedisConfig {
    url: String,
    client: Client,
    prefix: String,
    connections: NonZeroUsize,
    connect_timeout: Duration,
    response_timeout: Duration,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redacted(&self.url))
            .field("prefix", &self.prefix)
            .field("connections", &self.connections)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .finish()
    }
}

/// The URL without its credentials, for logs.
fn redacted(url: &str) -> String {
    match (url.split_once("://"), url.rfind('@')) {
        (Some((scheme, _)), Some(at)) => format!("{scheme}://***{}", &url[at..]),
        _ => url.to_owned(),
    }
}

impl RedisConfig {
    /// A `redis://` (or `rediss://`, `unix://`) URL, checked now; nothing is connected yet.
    /// Keys start with [`DEFAULT_PREFIX`]; one multiplexed connection; 1 s to connect, 1 s for
    /// an answer (a [`SharedLimiter`] bounds each decision more tightly).
    pub fn new(url: &str) -> Result<Self, RedisLimitError> {
        let client = Client::open(url).map_err(RedisLimitError::Url)?;
        Ok(Self {
            url: url.to_owned(),
            client,
            prefix: DEFAULT_PREFIX.to_owned(),
            connections: NonZeroUsize::MIN,
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
        })
    }

    /// The prefix of every key (instances sharing buckets must use the same one; tests use
    /// their own).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How many multiplexed connections decisions are spread over, round robin. One carries
    /// many concurrent decisions already (their commands are pipelined); more spread the
    /// client's work over more reader tasks.
    pub fn connections(mut self, n: NonZeroUsize) -> Self {
        self.connections = n;
        self
    }

    /// Bound on establishing a connection.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Bound on waiting for one answer.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// The URL as given, credentials included (for another client of the same Redis, such
    /// as the [retry switch](crate::retry::RetrySwitch::watch_redis)); log
    /// [`display_url`](Self::display_url) instead.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URL with its credentials masked.
    pub fn display_url(&self) -> String {
        redacted(&self.url)
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }
}

/// Redis could not make a decision.
#[derive(Debug, thiserror::Error)]
pub enum RedisLimitError {
    /// The URL is not a Redis URL.
    #[error("invalid Redis URL")]
    Url(#[source] RedisError),
    /// Connecting, sending or the script failed.
    #[error("Redis rate limiter call failed")]
    Redis(#[source] RedisError),
    /// The script answered something other than a non-negative integer.
    #[error("unexpected answer from the rate limit script: {0}")]
    UnexpectedReply(i64),
}

/// Per-key GCRA token buckets kept in Redis and shared by every instance using the same
/// server and key prefix.
///
/// Cloning shares the connections. Connections are made lazily and re-made after a failure,
/// so a limiter can be built while Redis is down.
#[derive(Clone)]
pub struct RedisTokenBucket {
    inner: Arc<Inner>,
}

struct Inner {
    connections: Box<[ConnectionManager]>,
    next: AtomicUsize,
    prefix: String,
    quota: Quota,
    increment_us: u64,
    tolerance_us: u64,
}

impl std::fmt::Debug for RedisTokenBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTokenBucket")
            .field("prefix", &self.inner.prefix)
            .field("quota", &self.inner.quota)
            .field("connections", &self.inner.connections.len())
            .finish()
    }
}

impl RedisTokenBucket {
    /// Buckets of `quota` per key in the Redis of `config`. Connects lazily: call it inside a
    /// Tokio runtime; it fails only when the client cannot be set up.
    pub fn new(config: &RedisConfig, quota: Quota) -> Result<Self, RedisLimitError> {
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.response_timeout))
            // Reconnect once per failed call; the caller's policy decides how often to try.
            .set_number_of_retries(0);
        let connections = (0..config.connections.get())
            .map(|_| {
                ConnectionManager::new_lazy_with_config(
                    config.client.clone(),
                    manager_config.clone(),
                )
                .map_err(RedisLimitError::Redis)
            })
            .collect::<Result<_, _>>()?;
        let us = |ns: u64| (ns.div_ceil(1_000)).clamp(1, MAX_SPAN_US);
        Ok(Self {
            inner: Arc::new(Inner {
                connections,
                next: AtomicUsize::new(0),
                prefix: config.prefix.clone(),
                quota,
                increment_us: us(quota.interval_ns()),
                tolerance_us: us(quota.tolerance_ns()),
            }),
        })
    }

    /// The quota each key gets.
    pub fn quota(&self) -> Quota {
        self.inner.quota
    }

    /// The Redis key holding `tenant`'s bucket: the prefix and the id, or for an id longer than
    /// 128 bytes the prefix and the id's SHA-256.
    pub fn key(&self, tenant: &str) -> String {
        let prefix = &self.inner.prefix;
        if tenant.len() <= MAX_VERBATIM_KEY {
            format!("{prefix}t:{tenant}")
        } else {
            format!(
                "{prefix}h:{}",
                hex::encode(Sha256::digest(tenant.as_bytes()))
            )
        }
    }

    /// Takes one token from `tenant`'s bucket: `Ok(Ok(()))` when allowed, `Ok(Err(wait))` when
    /// empty, with the wait until a token is back. `Err` when Redis did not decide.
    ///
    /// Not bounded in time beyond the configured connect and response timeouts; a
    /// [`SharedLimiter`] adds the request's deadline.
    pub async fn check(&self, tenant: &str) -> Result<Result<(), Duration>, RedisLimitError> {
        let inner = &*self.inner;
        let i = inner.next.fetch_add(1, Ordering::Relaxed) % inner.connections.len();
        let mut connection = inner.connections[i].clone();
        let wait_us: i64 = GCRA
            .key(self.key(tenant))
            .arg(inner.increment_us)
            .arg(inner.tolerance_us)
            .invoke_async(&mut connection)
            .await
            .map_err(RedisLimitError::Redis)?;
        match u64::try_from(wait_us) {
            Ok(0) => Ok(Ok(())),
            Ok(us) => Ok(Err(Duration::from_micros(us))),
            Err(_) => Err(RedisLimitError::UnexpectedReply(wait_us)),
        }
    }

    /// The SHA-1 by which the script is called (`EVALSHA`).
    pub fn script_sha() -> &'static str {
        GCRA.get_hash()
    }

    /// The arguments the script gets for this quota: increment and tolerance in microseconds
    /// (what `EVALSHA sha 1 key increment tolerance` sends).
    pub fn script_args(&self) -> (u64, u64) {
        (self.inner.increment_us, self.inner.tolerance_us)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU32;

    #[test]
    fn urls_are_checked_and_redacted() {
        assert!(matches!(
            RedisConfig::new("http://nope"),
            Err(RedisLimitError::Url(_))
        ));
        let c = RedisConfig::new("redis://user:secret@127.0.0.1:6379/0").unwrap();
        assert_eq!(c.display_url(), "redis://***@127.0.0.1:6379/0");
        assert!(!format!("{c:?}").contains("secret"));
        assert_eq!(
            RedisConfig::new("redis://127.0.0.1").unwrap().display_url(),
            "redis://127.0.0.1"
        );
    }

    #[tokio::test]
    async fn keys_are_prefixed_and_bounded() {
        let config = RedisConfig::new("redis://127.0.0.1:1")
            .unwrap()
            .prefix("p:");
        let quota = Quota::per_second(NonZeroU32::MIN, NonZeroU32::MIN);
        let bucket = RedisTokenBucket::new(&config, quota).unwrap();
        assert_eq!(bucket.key("acme"), "p:t:acme");
        let long = bucket.key(&"x".repeat(10_000));
        assert!(long.starts_with("p:h:"));
        assert_eq!(long.len(), 4 + 64);
        assert_eq!(bucket.script_args(), (1_000_000, 1_000_000));
    }

    #[tokio::test]
    async fn script_spans_are_whole_microseconds_within_bounds() {
        let config = RedisConfig::new("redis://127.0.0.1:1").unwrap();
        let fast = Quota::per_second(NonZeroU32::new(3_000_000).unwrap(), NonZeroU32::MIN);
        let slow = Quota::from_rate(1e-300, u32::MAX).unwrap();
        let args = |q| RedisTokenBucket::new(&config, q).unwrap().script_args();
        assert_eq!(args(fast), (1, 1));
        assert_eq!(args(slow), (MAX_SPAN_US, MAX_SPAN_US));
        assert_eq!(RedisTokenBucket::script_sha().len(), 40);
    }
}
