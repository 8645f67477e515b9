//! `--redis`: per-merchant limits shared by instances through the real Redis on
//! 127.0.0.1:6379 (or `BACKSTOP_TEST_REDIS`; skipped, saying so, when it does not answer), and
//! what the service answers when Redis is down.

// The check that Redis answers, shared with the library's and the CLI's tests.
#[path = "../../backstop/tests/support/services.rs"]
mod services;
mod support;

use std::num::NonZeroU32;

use backstop::admission::redis::{FailurePolicy, RedisConfig};
use backstop_payment::config::Config;
use reqwest::StatusCode;
use support::{Harness, body};

/// A merchant may make `burst` payments, then one more an hour (no refill during a test).
fn limit(config: &mut Config, burst: u32, redis: &str, prefix: &str) {
    config.tenant_rate = NonZeroU32::MIN;
    config.tenant_burst = NonZeroU32::new(burst).unwrap();
    config.redis = Some(RedisConfig::new(redis).unwrap().prefix(prefix));
}

fn prefix(test: &str) -> String {
    format!("backstop-test:{test}:{}:", uuid::Uuid::now_v7())
}

/// A Redis URL on which nothing listens.
async fn closed_port() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("redis://127.0.0.1:{port}")
}

#[tokio::test]
async fn two_instances_share_one_quota() {
    if !services::redis() {
        return;
    }
    let prefix = prefix("payment_two_instances");
    let redis = services::redis_url();
    let a = Harness::start_with(|c| limit(c, 2, &redis, &prefix)).await;
    let b = Harness::start_with(|c| limit(c, 2, &redis, &prefix)).await;
    let first = a.post(Some("k-1"), &body("order-1", 100), &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let second = b.post(Some("k-2"), &body("order-2", 100), &[]).await;
    assert_eq!(second.status, StatusCode::CREATED);
    // The merchant's burst is spent across both instances.
    for h in [&a, &b] {
        let refused = h.post(Some("k-3"), &body("order-3", 100), &[]).await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.code(), "rate_limited");
        assert!(refused.header("retry-after").is_some());
        assert!(h.charges("order-3").await.is_empty());
    }
}

#[tokio::test]
async fn redis_down_fails_closed_with_503() {
    let redis = closed_port().await;
    let h = Harness::start_with(|c| {
        limit(c, 5, &redis, "unused:");
        c.redis_failure = FailurePolicy::Closed;
    })
    .await;
    let refused = h.post(Some("k-1"), &body("order-1", 100), &[]).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.code(), "rate_limiter_unavailable");
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert!(h.charges("order-1").await.is_empty());
    // The key was never claimed: the same request goes through once limits can be checked.
    assert_eq!(h.idempotency_rows().await, 0);
}

#[tokio::test]
async fn redis_down_fails_open_to_the_instance_share() {
    let redis = closed_port().await;
    let h = Harness::start_with(|c| {
        limit(c, 6, &redis, "unused:");
        c.redis_failure = FailurePolicy::Open;
        c.instances = NonZeroU32::new(3).unwrap();
    })
    .await;
    for i in 0..2 {
        let ok = h
            .post(
                Some(&format!("k-{i}")),
                &body(&format!("order-{i}"), 100),
                &[],
            )
            .await;
        assert_eq!(ok.status, StatusCode::CREATED);
    }
    let refused = h.post(Some("k-9"), &body("order-9", 100), &[]).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
}
