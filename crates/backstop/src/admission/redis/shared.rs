//! [`SharedLimiter`]: the Redis bucket bounded in time, with a policy for when Redis fails.

use std::fmt;
use std::future::Future;
use std::num::{NonZeroU32, NonZeroUsize};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use super::{RedisLimitError, RedisTokenBucket};
use crate::admission::{KeyedTokenBucket, Quota};
use crate::clock::MonotonicClock;
use crate::deadline::Deadline;
use crate::observe::{RATE_LIMIT_REDIS_UNAVAILABLE_TOTAL, label, redis_unavailable_result};

/// Default bound on one Redis decision (the request's deadline may bound it more).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);
/// Default time Redis is left alone after a failure before one request probes it again.
pub const DEFAULT_COOLDOWN: Duration = Duration::from_secs(1);
/// Least time between two warnings that Redis is unavailable.
const WARN_EVERY: Duration = Duration::from_secs(10);
/// Tenants the local fallback buckets hold at most.
const FALLBACK_MAX_KEYS: NonZeroUsize = NonZeroUsize::new(10_000).unwrap();

/// What to do when Redis does not decide in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailurePolicy {
    /// Keep serving: decide with this instance's local bucket at its share of the rate
    /// ([`local_share`]). Over all instances the tenant keeps about its quota.
    Open,
    /// Refuse: the server answers 503 + `Retry-After` until Redis is back.
    Closed,
}

impl FailurePolicy {
    /// `"open"` or `"closed"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailurePolicy::Open => "open",
            FailurePolicy::Closed => "closed",
        }
    }
}

impl fmt::Display for FailurePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failure policy other than `open` or `closed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the Redis failure policy must be \"open\" or \"closed\"")]
pub struct ParseFailurePolicyError;

impl FromStr for FailurePolicy {
    type Err = ParseFailurePolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "open" => Ok(FailurePolicy::Open),
            "closed" => Ok(FailurePolicy::Closed),
            _ => Err(ParseFailurePolicyError),
        }
    }
}

/// One instance's share of a quota shared by `instances`: the rate divided by `instances`, and
/// the burst too (at least one token).
pub fn local_share(quota: Quota, instances: NonZeroU32) -> Quota {
    let burst = NonZeroU32::new(quota.burst() / instances.get()).unwrap_or(NonZeroU32::MIN);
    Quota::with_period(quota.interval().saturating_mul(instances.get()), burst).unwrap_or(quota)
}

/// The outcome of one shared decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A token was taken: serve the request.
    Allowed,
    /// Over quota: a token is back after this long (429).
    Limited(Duration),
    /// Redis did not decide and the policy is [`FailurePolicy::Closed`]: retry after this long
    /// (503).
    Unavailable(Duration),
}

/// A decision, known now or after a round trip to Redis.
#[derive(Debug)]
pub enum Decision {
    /// Decided without Redis (it is known to be down): no waiting.
    Ready(Verdict),
    /// Redis is asked; the future resolves by the timeout or the deadline, whichever is first.
    Pending(PendingDecision),
}

impl Decision {
    /// The verdict when it is known without waiting.
    pub fn ready(self) -> Option<Verdict> {
        match self {
            Decision::Ready(verdict) => Some(verdict),
            Decision::Pending(_) => None,
        }
    }
}

/// A decision waiting on Redis; never outlives the bound it was made with.
pub struct PendingDecision(Pin<Box<dyn Future<Output = Verdict> + Send>>);

impl fmt::Debug for PendingDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PendingDecision")
    }
}

impl Future for PendingDecision {
    type Output = Verdict;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Verdict> {
        self.0.as_mut().poll(cx)
    }
}

/// Per-tenant rate limits shared through Redis, bounded in time, with a [`FailurePolicy`].
///
/// Each decision waits for Redis at most [`timeout`](Self::timeout) and never past the
/// request's deadline. A failure (an error or that timeout) marks Redis down for a cool-down:
/// decisions are then made at once by the policy, without a round trip, and after the
/// cool-down one request probes Redis again. Each decision made without Redis counts in
/// `rate_limit_redis_unavailable_total{result}`; the first failure, and then at most one a ten
/// seconds, is logged at `warn`.
///
/// Cloning shares the state.
#[derive(Debug, Clone)]
pub struct SharedLimiter {
    state: Arc<State>,
    timeout: Duration,
    cooldown_ns: u64,
}

#[derive(Debug)]
struct State {
    bucket: RedisTokenBucket,
    policy: FailurePolicy,
    /// The local buckets of [`FailurePolicy::Open`].
    fallback: KeyedTokenBucket,
    /// tokio's clock, so the breaker, the fallback buckets and the deadline share one time
    /// (paused in tests).
    clock: MonotonicClock,
    breaker: Breaker,
}

impl SharedLimiter {
    /// Decisions by `bucket`; when Redis fails, by `policy`. With [`FailurePolicy::Open`] the
    /// local buckets get [`local_share`] of the bucket's quota for `instances` instances.
    pub fn new(bucket: RedisTokenBucket, policy: FailurePolicy, instances: NonZeroU32) -> Self {
        let clock = MonotonicClock::tokio();
        let fallback = KeyedTokenBucket::with_clock(
            local_share(bucket.quota(), instances),
            FALLBACK_MAX_KEYS,
            clock.clone(),
        );
        Self {
            state: Arc::new(State {
                bucket,
                policy,
                fallback,
                clock,
                breaker: Breaker::default(),
            }),
            timeout: DEFAULT_TIMEOUT,
            cooldown_ns: duration_ns(DEFAULT_COOLDOWN),
        }
    }

    /// Bound on one decision (default 100 ms); the request's deadline may bound it more.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long Redis is left alone after a failure (default 1 s, at least 1 ms).
    pub fn cooldown(mut self, cooldown: Duration) -> Self {
        self.cooldown_ns = duration_ns(cooldown.max(Duration::from_millis(1)));
        self
    }

    /// The failure policy.
    pub fn policy(&self) -> FailurePolicy {
        self.state.policy
    }

    /// The Redis bucket.
    pub fn bucket(&self) -> &RedisTokenBucket {
        &self.state.bucket
    }

    /// The local buckets used while Redis is down with [`FailurePolicy::Open`].
    pub fn fallback(&self) -> &KeyedTokenBucket {
        &self.state.fallback
    }

    /// Takes one token from `tenant`'s shared bucket, waiting for Redis until the limiter's
    /// timeout or `deadline`, whichever comes first.
    pub fn check(&self, tenant: &str, deadline: Option<Deadline>) -> Decision {
        let now = Instant::now();
        let state = &self.state;
        let now_ns = state.clock.now_ns();
        let probe = match state.breaker.route(now_ns, self.cooldown_ns) {
            Route::Redis { probe } => probe,
            Route::Skip { retry_in_ns } => {
                return Decision::Ready(state.without_redis(tenant, retry_in_ns));
            }
        };
        let own = now + self.timeout;
        let (until, by_deadline) = match deadline {
            Some(d) if d.instant() < own => (d.instant(), true),
            _ => (own, false),
        };
        let state = self.state.clone();
        let tenant = tenant.to_owned();
        let cooldown_ns = self.cooldown_ns;
        Decision::Pending(PendingDecision(Box::pin(async move {
            let outcome = tokio::time::timeout_at(until, state.bucket.check(&tenant)).await;
            let failure = match outcome {
                Ok(Ok(decision)) => {
                    state.reachable(probe);
                    return match decision {
                        Ok(()) => Verdict::Allowed,
                        Err(wait) => Verdict::Limited(wait),
                    };
                }
                // The request ran out of time, not Redis: decide without blaming it.
                Err(_) if by_deadline => return state.without_redis(&tenant, cooldown_ns),
                Ok(Err(error)) => Failure::Error(error),
                Err(_) => Failure::Timeout,
            };
            let now_ns = state.clock.now_ns();
            state.failed(&failure, now_ns, cooldown_ns);
            state.without_redis(&tenant, cooldown_ns)
        })))
    }
}

enum Failure {
    Error(RedisLimitError),
    Timeout,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Timeout => f.write_str("no answer within the limiter's timeout"),
            Failure::Error(e) => match std::error::Error::source(e) {
                Some(cause) => write!(f, "{e}: {cause}"),
                None => write!(f, "{e}"),
            },
        }
    }
}

impl State {
    /// The policy's decision, made locally.
    fn without_redis(&self, tenant: &str, retry_in_ns: u64) -> Verdict {
        let (verdict, result) = match self.policy {
            FailurePolicy::Open => match self.fallback.check(tenant) {
                Ok(()) => (Verdict::Allowed, redis_unavailable_result::FALLBACK),
                Err(wait) => (Verdict::Limited(wait), redis_unavailable_result::FALLBACK),
            },
            FailurePolicy::Closed => (
                Verdict::Unavailable(Duration::from_nanos(retry_in_ns)),
                redis_unavailable_result::REJECTED,
            ),
        };
        metrics::counter!(RATE_LIMIT_REDIS_UNAVAILABLE_TOTAL, label::RESULT => result).increment(1);
        verdict
    }

    fn failed(&self, failure: &Failure, now_ns: u64, cooldown_ns: u64) {
        self.breaker.trip(now_ns, cooldown_ns);
        if self.breaker.should_warn(now_ns, duration_ns(WARN_EVERY)) {
            tracing::warn!(
                error = %failure,
                policy = %self.policy,
                cooldown_ms = cooldown_ns / 1_000_000,
                "Redis rate limiter unavailable: deciding by the failure policy until it answers again"
            );
        }
    }

    fn reachable(&self, probe: bool) {
        if self.breaker.reset() && probe {
            tracing::info!("Redis rate limiter reachable again");
        }
    }
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Whether to ask Redis, on the limiter's own clock (nanoseconds since its epoch).
#[derive(Debug, Default)]
struct Breaker {
    /// 0 while Redis answers; otherwise when the next probe may go (never 0: a trip sets it to
    /// at least the cool-down).
    retry_at_ns: AtomicU64,
    /// No warning before this time.
    warn_at_ns: AtomicU64,
}

#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// Ask Redis; `probe` when it is the one request let through after a cool-down.
    Redis { probe: bool },
    /// Redis is down: decide without it; the next probe is this far away.
    Skip { retry_in_ns: u64 },
}

impl Breaker {
    fn route(&self, now_ns: u64, cooldown_ns: u64) -> Route {
        let at = self.retry_at_ns.load(Ordering::Relaxed);
        if at == 0 {
            return Route::Redis { probe: false };
        }
        if now_ns < at {
            return Route::Skip {
                retry_in_ns: at - now_ns,
            };
        }
        // The cool-down is over: the one caller that moves it forward probes.
        let next = now_ns.saturating_add(cooldown_ns).max(1);
        match self
            .retry_at_ns
            .compare_exchange(at, next, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => Route::Redis { probe: true },
            Err(0) => Route::Redis { probe: false },
            Err(other) => Route::Skip {
                retry_in_ns: other.saturating_sub(now_ns).max(1),
            },
        }
    }

    fn trip(&self, now_ns: u64, cooldown_ns: u64) {
        let next = now_ns.saturating_add(cooldown_ns).max(1);
        self.retry_at_ns.fetch_max(next, Ordering::Relaxed);
    }

    /// Marks Redis reachable; whether it was marked down.
    fn reset(&self) -> bool {
        self.retry_at_ns.load(Ordering::Relaxed) != 0
            && self.retry_at_ns.swap(0, Ordering::Relaxed) != 0
    }

    fn should_warn(&self, now_ns: u64, every_ns: u64) -> bool {
        let at = self.warn_at_ns.load(Ordering::Relaxed);
        now_ns >= at
            && self
                .warn_at_ns
                .compare_exchange(
                    at,
                    now_ns.saturating_add(every_ns),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::redis::RedisConfig;

    const MS: u64 = 1_000_000;

    /// A limiter whose Redis refuses connections (nothing listens on the port).
    async fn unreachable(quota: Quota, policy: FailurePolicy, instances: u32) -> SharedLimiter {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        drop(listener);
        let bucket = RedisTokenBucket::new(&RedisConfig::new(&url).unwrap(), quota).unwrap();
        SharedLimiter::new(bucket, policy, NonZeroU32::new(instances).unwrap())
    }

    async fn decide(limiter: &SharedLimiter) -> Verdict {
        match limiter.check("acme", None) {
            Decision::Ready(verdict) => verdict,
            Decision::Pending(pending) => pending.await,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn while_redis_is_down_one_request_probes_after_each_cooldown() {
        let quota = Quota::per_second(NonZeroU32::MIN, NonZeroU32::MIN);
        let l = unreachable(quota, FailurePolicy::Closed, 1)
            .await
            .cooldown(Duration::from_secs(1));
        let Decision::Pending(first) = l.check("acme", None) else {
            panic!("the first decision asks Redis");
        };
        assert!(matches!(first.await, Verdict::Unavailable(_)));
        // Down: every decision is made at once, announcing the time to the next probe.
        let Decision::Ready(Verdict::Unavailable(wait)) = l.check("acme", None) else {
            panic!("decided without Redis");
        };
        assert!(wait > Duration::ZERO && wait <= Duration::from_secs(1));
        tokio::time::advance(wait - Duration::from_millis(1)).await;
        assert_eq!(
            l.check("acme", None).ready(),
            Some(Verdict::Unavailable(Duration::from_millis(1)))
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        // Exactly one request probes; the others keep deciding at once.
        let Decision::Pending(probe) = l.check("acme", None) else {
            panic!("the cool-down is over: probe");
        };
        assert!(l.check("acme", None).ready().is_some());
        assert!(matches!(probe.await, Verdict::Unavailable(_)));
        assert!(l.check("acme", None).ready().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn failing_open_refills_at_this_instances_share() {
        // 10/s with bursts of 2, shared by 2 instances: 5/s (one token per 200 ms), burst 1.
        let quota = Quota::per_second(NonZeroU32::new(10).unwrap(), NonZeroU32::new(2).unwrap());
        let l = unreachable(quota, FailurePolicy::Open, 2)
            .await
            .cooldown(Duration::from_secs(3600));
        assert_eq!(decide(&l).await, Verdict::Allowed);
        let Verdict::Limited(wait) = decide(&l).await else {
            panic!("the local share is spent");
        };
        assert!(wait > Duration::ZERO && wait <= Duration::from_millis(200));
        tokio::time::advance(wait).await;
        assert_eq!(l.check("acme", None).ready(), Some(Verdict::Allowed));
        assert_eq!(
            l.check("acme", None).ready(),
            Some(Verdict::Limited(Duration::from_millis(200)))
        );
    }

    #[test]
    fn breaker_skips_redis_for_the_cooldown_then_lets_one_probe() {
        let b = Breaker::default();
        assert_eq!(b.route(5 * MS, 100 * MS), Route::Redis { probe: false });
        b.trip(10 * MS, 100 * MS);
        assert_eq!(
            b.route(10 * MS, 100 * MS),
            Route::Skip {
                retry_in_ns: 100 * MS
            }
        );
        assert_eq!(
            b.route(60 * MS, 100 * MS),
            Route::Skip {
                retry_in_ns: 50 * MS
            }
        );
        // Cool-down over: exactly one probe, the others keep skipping.
        assert_eq!(b.route(110 * MS, 100 * MS), Route::Redis { probe: true });
        assert_eq!(
            b.route(110 * MS, 100 * MS),
            Route::Skip {
                retry_in_ns: 100 * MS
            }
        );
        // The probe failed: another cool-down.
        b.trip(115 * MS, 100 * MS);
        assert_eq!(
            b.route(200 * MS, 100 * MS),
            Route::Skip {
                retry_in_ns: 15 * MS
            }
        );
        assert_eq!(b.route(215 * MS, 100 * MS), Route::Redis { probe: true });
        // The probe succeeded: everyone asks Redis again.
        assert!(b.reset());
        assert!(!b.reset());
        assert_eq!(b.route(216 * MS, 100 * MS), Route::Redis { probe: false });
    }

    #[test]
    fn a_trip_at_time_zero_still_marks_redis_down() {
        let b = Breaker::default();
        b.trip(0, 0);
        assert_eq!(b.route(0, 0), Route::Skip { retry_in_ns: 1 });
    }

    #[test]
    fn warnings_are_spaced_out() {
        let b = Breaker::default();
        let every = 10_000 * MS;
        assert!(b.should_warn(0, every));
        assert!(!b.should_warn(1, every));
        assert!(!b.should_warn(9_999 * MS, every));
        assert!(b.should_warn(10_000 * MS, every));
        assert!(!b.should_warn(10_001 * MS, every));
    }

    #[test]
    fn policies_parse() {
        assert_eq!("open".parse(), Ok(FailurePolicy::Open));
        assert_eq!("closed".parse(), Ok(FailurePolicy::Closed));
        assert_eq!(
            "Open".parse::<FailurePolicy>(),
            Err(ParseFailurePolicyError)
        );
        assert_eq!(FailurePolicy::Closed.to_string(), "closed");
    }

    #[test]
    fn local_share_divides_rate_and_burst() {
        let q = Quota::per_second(NonZeroU32::new(300).unwrap(), NonZeroU32::new(30).unwrap());
        let share = local_share(q, NonZeroU32::new(3).unwrap());
        assert_eq!(share.interval(), q.interval() * 3);
        assert_eq!(share.burst(), 10);
        let tiny = Quota::per_second(NonZeroU32::new(1).unwrap(), NonZeroU32::new(2).unwrap());
        assert_eq!(local_share(tiny, NonZeroU32::new(5).unwrap()).burst(), 1);
        assert_eq!(local_share(q, NonZeroU32::MIN), q);
    }
}
