//! The fleet's retry switch kept in a Redis key, against the real Redis on 127.0.0.1:6379 (or
//! `BACKSTOP_TEST_REDIS`; skipped, saying so, when it does not answer). Every test uses its
//! own key.
//!
//! A watching switch reads the key every few milliseconds here; each test waits for the
//! setting it expects (bounded by a generous limit), so none depends on the machine's speed.

#![cfg(feature = "redis")]

mod support {
    pub(crate) mod services;
}

use std::time::Duration;

use backstop::retry::switch::{read_redis, write_redis};
use backstop::retry::{RetrySetting, RetrySwitch};
use redis::AsyncCommands;

use support::services::{self, redis_url};

const POLL: Duration = Duration::from_millis(5);

fn key(test: &str) -> String {
    format!("backstop-test:retry-switch:{test}:{}", uuid::Uuid::now_v7())
}

/// Waits until `switch` reads `want` (at most 30 s: far beyond a few polls).
async fn settles(switch: &RetrySwitch, want: RetrySetting) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while switch.setting() != want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "still {:?}, want {want:?}",
            switch.setting()
        );
        tokio::time::sleep(POLL).await;
    }
}

async fn raw_set(key: &str, value: &str) {
    let client = redis::Client::open(redis_url()).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    redis.set::<_, _, ()>(key, value).await.unwrap();
}

#[tokio::test]
async fn every_watching_switch_follows_the_key() {
    if !services::redis() {
        return;
    }
    let key = key("follows");
    let switches: Vec<RetrySwitch> = (0..3).map(|_| RetrySwitch::new()).collect();
    let _watches: Vec<_> = switches
        .iter()
        .map(|s| s.watch_redis(&redis_url(), key.clone(), POLL).unwrap())
        .collect();
    write_redis(&redis_url(), &key, RetrySetting::Off, None)
        .await
        .unwrap();
    for switch in &switches {
        settles(switch, RetrySetting::Off).await;
    }
    write_redis(&redis_url(), &key, RetrySetting::Ratio(0.02), None)
        .await
        .unwrap();
    for switch in &switches {
        settles(switch, RetrySetting::Ratio(0.02)).await;
    }
    // `on` removes the key: no key is on.
    write_redis(&redis_url(), &key, RetrySetting::On, None)
        .await
        .unwrap();
    for switch in &switches {
        settles(switch, RetrySetting::On).await;
    }
    let (setting, left) = read_redis(&redis_url(), &key).await.unwrap();
    assert_eq!((setting, left), (Ok(RetrySetting::On), None));
}

#[tokio::test]
async fn a_setting_written_for_a_while_ends_by_itself() {
    if !services::redis() {
        return;
    }
    let key = key("expires");
    let switch = RetrySwitch::new();
    let _watch = switch.watch_redis(&redis_url(), key.clone(), POLL).unwrap();
    write_redis(
        &redis_url(),
        &key,
        RetrySetting::Off,
        Some(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    // Read back while it lasts (a slow machine may already have seen it expire).
    let (setting, _) = read_redis(&redis_url(), &key).await.unwrap();
    assert!(matches!(setting, Ok(RetrySetting::Off | RetrySetting::On)));
    settles(&switch, RetrySetting::On).await;
}

#[tokio::test]
async fn a_value_that_is_not_a_setting_is_refused_and_the_last_one_holds() {
    if !services::redis() {
        return;
    }
    let key = key("refused");
    let switch = RetrySwitch::new();
    let _watch = switch.watch_redis(&redis_url(), key.clone(), POLL).unwrap();
    write_redis(&redis_url(), &key, RetrySetting::Off, None)
        .await
        .unwrap();
    settles(&switch, RetrySetting::Off).await;
    raw_set(&key, "of").await;
    // Many polls later it still holds: the watcher read the bad value and kept `off`.
    for _ in 0..20 {
        tokio::time::sleep(POLL).await;
        assert_eq!(switch.setting(), RetrySetting::Off);
    }
    let (setting, _) = read_redis(&redis_url(), &key).await.unwrap();
    assert!(setting.is_err(), "read back as refused: {setting:?}");
    write_redis(&redis_url(), &key, RetrySetting::On, None)
        .await
        .unwrap();
    settles(&switch, RetrySetting::On).await;
}

#[tokio::test]
async fn a_redis_that_does_not_answer_keeps_the_last_setting() {
    // A port nothing listens on: the watcher cannot read, and the switch stays as it was.
    let switch = RetrySwitch::new();
    switch.set(RetrySetting::Off, "operator");
    let _watch = switch
        .watch_redis("redis://127.0.0.1:1", "any", POLL)
        .unwrap();
    for _ in 0..20 {
        tokio::time::sleep(POLL).await;
        assert_eq!(switch.setting(), RetrySetting::Off);
    }
}
