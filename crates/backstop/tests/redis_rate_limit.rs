//! The Redis token bucket and the shared rate limit against the real Redis on 127.0.0.1:6379
//! (or `BACKSTOP_TEST_REDIS`; the tests that need it skip, saying so, when it does not answer).
//!
//! Every test uses its own key prefix. Quotas are slow (a token an hour) so that no decision
//! depends on how fast the machine runs the test; the failure tests bound only what must be
//! bounded (an answer at all, long before a generous limit).

#![cfg(feature = "redis")]

mod support {
    pub(crate) mod services;
}

use std::convert::Infallible;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use backstop::admission::Quota;
use backstop::admission::redis::{
    Decision, FailurePolicy, RedisConfig, RedisTokenBucket, SharedLimiter, Verdict,
};
use backstop::deadline::Deadline;
use backstop::observe::{RATE_LIMIT_REDIS_UNAVAILABLE_TOTAL, RPC_SERVER_REJECTED_TOTAL};
use backstop::server::{MetricsLayer, RateLimitLayer, Tenant};
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use redis::AsyncCommands;
use tokio::net::TcpListener;
use tower::{ServiceExt, service_fn};
use tower_layer::Layer;

use support::services::{self, redis_url};

const HOUR: Duration = Duration::from_secs(3600);

fn prefix(test: &str) -> String {
    format!("backstop-test:{test}:{}:", uuid::Uuid::now_v7())
}

/// `burst` tokens, one more an hour.
fn hourly(burst: u32) -> Quota {
    Quota::with_period(HOUR, NonZeroU32::new(burst).unwrap()).unwrap()
}

fn bucket(prefix: &str, quota: Quota) -> RedisTokenBucket {
    let config = RedisConfig::new(&redis_url()).unwrap().prefix(prefix);
    RedisTokenBucket::new(&config, quota).unwrap()
}

async fn raw() -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// A Redis URL on which nothing listens.
async fn closed_port() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("redis://127.0.0.1:{port}")
}

/// A Redis URL whose server accepts connections and never answers.
async fn silent_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    format!("redis://{addr}")
}

fn limiter(url: &str, quota: Quota, policy: FailurePolicy, instances: u32) -> SharedLimiter {
    let config = RedisConfig::new(url).unwrap().prefix(prefix("failure"));
    let bucket = RedisTokenBucket::new(&config, quota).unwrap();
    SharedLimiter::new(bucket, policy, NonZeroU32::new(instances).unwrap())
}

async fn decide(limiter: &SharedLimiter, tenant: &str, deadline: Option<Deadline>) -> Verdict {
    match limiter.check(tenant, deadline) {
        Decision::Ready(verdict) => verdict,
        Decision::Pending(pending) => pending.await,
    }
}

#[tokio::test]
async fn allows_the_burst_then_denies_with_the_wait() {
    if !services::redis() {
        return;
    }
    let b = bucket(&prefix("allow_deny"), hourly(3));
    for _ in 0..3 {
        assert_eq!(b.check("acme").await.unwrap(), Ok(()));
    }
    let wait = b.check("acme").await.unwrap().unwrap_err();
    // The next token is an hour after the first one was taken (less the time the test took).
    assert!(wait <= HOUR, "{wait:?}");
    assert!(wait > HOUR - Duration::from_secs(60), "{wait:?}");
    // A denial spends nothing: the wait only shrinks.
    let again = b.check("acme").await.unwrap().unwrap_err();
    assert!(again <= wait);
    // Another tenant has its own bucket.
    assert_eq!(b.check("globex").await.unwrap(), Ok(()));
}

/// The race a distributed bucket must not have: clients that read the tokens (GET), decide,
/// then write them back (SET) all read the same count when their reads come before their
/// writes, and each takes "the last token". Here every client reads before any writes (the
/// interleaving that load produces sooner or later, forced so that the count is exact): 20
/// clients on a bucket of 10 tokens are all let through. The library's bucket reads, decides
/// and writes in one script, which Redis runs atomically: of the same 20, exactly 10 pass.
#[tokio::test]
async fn get_then_set_over_issues_where_the_atomic_script_does_not() {
    if !services::redis() {
        return;
    }
    const CLIENTS: usize = 20;
    const TOKENS: u32 = 10;
    let key = format!("{}tokens", prefix("get_then_set"));
    let mut conn = raw().await;
    let _: () = conn.set(&key, TOKENS).await.unwrap();
    let read_all = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        let (mut conn, key, read_all) = (conn.clone(), key.clone(), read_all.clone());
        clients.spawn(async move {
            let tokens: u32 = conn.get(&key).await.unwrap();
            read_all.wait().await;
            if tokens == 0 {
                return false;
            }
            let _: () = conn.set(&key, tokens - 1).await.unwrap();
            true
        });
    }
    let naive = clients
        .join_all()
        .await
        .into_iter()
        .filter(|&ok| ok)
        .count();
    assert_eq!(naive, CLIENTS, "every client read 10 and took one");

    let b = Arc::new(bucket(&prefix("get_then_set_script"), hourly(TOKENS)));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        let b = b.clone();
        clients.spawn(async move { b.check("acme").await.unwrap().is_ok() });
    }
    let atomic = clients
        .join_all()
        .await
        .into_iter()
        .filter(|&ok| ok)
        .count();
    assert_eq!(
        atomic, TOKENS as usize,
        "the script issues the bucket's tokens, no more"
    );
}

#[tokio::test]
async fn two_instances_share_one_bucket() {
    if !services::redis() {
        return;
    }
    // Two limiters with their own connections, as two service instances would have: together
    // they admit one burst, not two.
    let prefix = prefix("two_instances");
    let a = bucket(&prefix, hourly(20));
    let b = bucket(&prefix, hourly(20));
    let mut tasks = Vec::new();
    for i in 0..40 {
        let limiter = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            limiter.check("acme").await.unwrap().is_ok()
        }));
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += usize::from(task.await.unwrap());
    }
    assert_eq!(admitted, 20);
    assert!(a.check("acme").await.unwrap().is_err());
    assert!(b.check("acme").await.unwrap().is_err());
}

#[tokio::test]
async fn reloads_the_script_after_noscript() {
    if !services::redis() {
        return;
    }
    let b = bucket(&prefix("noscript"), hourly(2));
    assert_eq!(b.check("acme").await.unwrap(), Ok(()));
    let mut redis = raw().await;
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut redis)
        .await
        .unwrap();
    // EVALSHA answers NOSCRIPT; the bucket loads the script again and decides on the same state.
    assert_eq!(b.check("acme").await.unwrap(), Ok(()));
    assert!(b.check("acme").await.unwrap().is_err());
    let exists: Vec<bool> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(RedisTokenBucket::script_sha())
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(exists, [true]);
}

#[tokio::test]
async fn keys_expire_when_the_bucket_would_be_full_again() {
    if !services::redis() {
        return;
    }
    let b = bucket(&prefix("expiry"), hourly(5));
    let key = b.key("acme");
    let mut redis = raw().await;
    let hour_ms = HOUR.as_millis() as i64;

    b.check("acme").await.unwrap().unwrap();
    let ttl: i64 = redis.pttl(&key).await.unwrap();
    assert!(ttl > hour_ms - 60_000 && ttl <= hour_ms, "{ttl}");

    b.check("acme").await.unwrap().unwrap();
    let ttl: i64 = redis.pttl(&key).await.unwrap();
    assert!(ttl > 2 * hour_ms - 60_000 && ttl <= 2 * hour_ms, "{ttl}");

    // The stored value is the theoretical arrival time in microseconds of the server's clock:
    // about now + 2 h, and an integer (the script writes every digit).
    let tat: String = redis.get(&key).await.unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut redis).await.unwrap();
    let now_us = secs * 1_000_000 + micros;
    let tat: u64 = tat.parse().unwrap();
    let ahead = tat - now_us;
    assert!(ahead <= 2 * 3_600_000_000 && ahead > 2 * 3_600_000_000 - 60_000_000);

    // A tenant that never came has no key at all.
    let absent: i64 = redis.pttl(b.key("never")).await.unwrap();
    assert_eq!(absent, -2);
}

#[tokio::test]
async fn closed_policy_refuses_while_redis_is_down() {
    let l = limiter(&closed_port().await, hourly(5), FailurePolicy::Closed, 1);
    let Decision::Pending(first) = l.check("acme", None) else {
        panic!("the first decision asks Redis");
    };
    let Verdict::Unavailable(wait) = first.await else {
        panic!("refused");
    };
    assert!(wait > Duration::ZERO);
    // Known down: the next decisions are made at once, without a round trip.
    assert!(matches!(
        l.check("acme", None),
        Decision::Ready(Verdict::Unavailable(_))
    ));
}

#[tokio::test]
async fn open_policy_falls_back_to_this_instances_share() {
    // Burst 4 over 2 instances: 2 each while Redis is down.
    let l = limiter(&closed_port().await, hourly(4), FailurePolicy::Open, 2);
    assert_eq!(l.fallback().quota().burst(), 2);
    assert_eq!(decide(&l, "acme", None).await, Verdict::Allowed);
    assert_eq!(decide(&l, "acme", None).await, Verdict::Allowed);
    assert!(matches!(
        decide(&l, "acme", None).await,
        Verdict::Limited(wait) if wait > Duration::from_secs(3000)
    ));
}

#[tokio::test]
async fn a_silent_redis_costs_at_most_the_limiter_timeout() {
    let l = limiter(&silent_server().await, hourly(5), FailurePolicy::Closed, 1)
        .timeout(Duration::from_millis(200));
    let verdict = tokio::time::timeout(Duration::from_secs(30), decide(&l, "acme", None))
        .await
        .expect("the decision is bounded by the limiter's timeout");
    assert!(matches!(verdict, Verdict::Unavailable(_)));
    // The timeout marked Redis down.
    assert!(matches!(l.check("acme", None), Decision::Ready(_)));
}

#[tokio::test]
async fn a_silent_redis_never_holds_a_request_past_its_deadline() {
    let l = limiter(&silent_server().await, hourly(5), FailurePolicy::Closed, 1)
        .timeout(Duration::from_secs(3600));
    let deadline = Deadline::after(Duration::from_millis(200));
    let verdict = tokio::time::timeout(Duration::from_secs(30), decide(&l, "acme", Some(deadline)))
        .await
        .expect("the decision is bounded by the request's deadline");
    assert!(matches!(verdict, Verdict::Unavailable(_)));
    // The request ran out of time, not Redis: the next request asks Redis again.
    assert!(matches!(l.check("acme", None), Decision::Pending(_)));
}

// The layer, with a local metrics recorder on a current-thread runtime (real time: Redis
// answers over real sockets).

/// Name, labels and value of one recorded counter.
type Counter = (String, Vec<(String, String)>, u64);

fn with_recorder<F: std::future::Future>(test: F) -> (F::Output, Vec<Counter>) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let output = metrics::with_local_recorder(&recorder, || runtime.block_on(test));
    let counters = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| match value {
            DebugValue::Counter(c) => Some((
                key.key().name().to_owned(),
                key.key()
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect(),
                c,
            )),
            _ => None,
        })
        .collect();
    (output, counters)
}

fn counter(counters: &[Counter], name: &str, label: (&str, &str)) -> u64 {
    counters
        .iter()
        .filter(|(n, ls, _)| n == name && ls.iter().any(|(k, v)| k == label.0 && v == label.1))
        .map(|(_, _, c)| c)
        .sum()
}

fn request(tenant: &str) -> Request<Bytes> {
    let mut request = Request::builder()
        .method(Method::POST)
        .uri("/v1/payments")
        .body(Bytes::new())
        .unwrap();
    request.extensions_mut().insert(Tenant::new(tenant));
    request
}

/// The rate limit layer over a handler counting its calls, under the metrics layer.
async fn serve(layer: RateLimitLayer, requests: usize) -> (Vec<Response<Bytes>>, usize) {
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        service_fn(move |_req: Request<Bytes>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(Response::new(Bytes::new())) }
        })
    };
    let svc = MetricsLayer::new("payments")
        .route(Method::POST, "/v1/payments")
        .layer(layer.layer(handler));
    let mut out = Vec::new();
    for _ in 0..requests {
        let response = svc.clone().oneshot(request("acme")).await.unwrap();
        // The handler answers with no body; a refusal's body is the one the layer wrote.
        out.push(
            response.map(|body| Bytes::copy_from_slice(body.buffered_data().unwrap_or_default())),
        );
    }
    (out, calls.load(Ordering::SeqCst))
}

fn problem_code(response: &Response<Bytes>) -> String {
    let doc: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
    doc["code"].as_str().unwrap().to_owned()
}

#[test]
fn layer_admits_then_answers_429_from_the_shared_bucket() {
    if !services::redis() {
        return;
    }
    let ((responses, calls), counters) = with_recorder(async {
        let l = limiter(&redis_url(), hourly(2), FailurePolicy::Closed, 1);
        serve(RateLimitLayer::shared(l), 3).await
    });
    assert_eq!(responses[0].status(), StatusCode::OK);
    assert_eq!(responses[1].status(), StatusCode::OK);
    assert_eq!(responses[2].status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(problem_code(&responses[2]), "rate_limited");
    let retry_after: u64 = responses[2].headers()[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after > 3000 && retry_after <= 3600, "{retry_after}");
    assert_eq!(calls, 2, "the refused request never ran");
    assert_eq!(
        counter(
            &counters,
            RPC_SERVER_REJECTED_TOTAL,
            ("reason", "rate_limited")
        ),
        1
    );
}

#[test]
fn layer_fails_closed_with_503_and_retry_after() {
    let ((responses, calls), counters) = with_recorder(async {
        let l = limiter(&closed_port().await, hourly(2), FailurePolicy::Closed, 1);
        serve(RateLimitLayer::shared(l), 2).await
    });
    for response in &responses {
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(problem_code(response), "rate_limiter_unavailable");
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    }
    assert_eq!(calls, 0);
    assert_eq!(
        counter(
            &counters,
            RPC_SERVER_REJECTED_TOTAL,
            ("reason", "rate_limiter_unavailable")
        ),
        2
    );
    assert_eq!(
        counter(
            &counters,
            RATE_LIMIT_REDIS_UNAVAILABLE_TOTAL,
            ("result", "rejected")
        ),
        2
    );
    assert_eq!(
        counter(
            &counters,
            "rpc_server_requests_total",
            ("outcome", "rejected")
        ),
        2
    );
}

#[test]
fn layer_fails_open_to_the_local_share() {
    let ((responses, calls), counters) = with_recorder(async {
        let l = limiter(&closed_port().await, hourly(6), FailurePolicy::Open, 3);
        serve(RateLimitLayer::shared(l), 3).await
    });
    let statuses: Vec<_> = responses.iter().map(Response::status).collect();
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    assert_eq!(calls, 2);
    assert_eq!(
        counter(
            &counters,
            RATE_LIMIT_REDIS_UNAVAILABLE_TOTAL,
            ("result", "fallback")
        ),
        3
    );
}

#[test]
fn connections_can_be_spread_over_a_pool() {
    if !services::redis() {
        return;
    }
    let (admitted, _) = with_recorder(async {
        let config = RedisConfig::new(&redis_url())
            .unwrap()
            .prefix(prefix("pool"))
            .connections(NonZeroUsize::new(3).unwrap());
        let b = RedisTokenBucket::new(&config, hourly(4)).unwrap();
        let mut admitted = 0;
        for _ in 0..8 {
            admitted += usize::from(b.check("acme").await.unwrap().is_ok());
        }
        admitted
    });
    assert_eq!(admitted, 4);
}
