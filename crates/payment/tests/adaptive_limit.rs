//! `--limit adaptive` against a real service and a real PSP whose latency is raised: the
//! concurrency limit the service publishes moves down, every request is answered (served or
//! refused as `overloaded`, never left hanging or failed), and no intent is left `running`.
//! No timing assertions: only where the limit went and what the answers were.

mod support;

use backstop_payment::config::LimitMode;
use reqwest::StatusCode;
use std::time::Duration;
use support::{Harness, body};

const MAX: usize = 16;

/// The value of `rpc_server_concurrency_limit` in `GET /metrics`.
async fn published_limit(h: &Harness) -> f64 {
    let text = String::from_utf8(h.get("/metrics", &[]).await.bytes).unwrap();
    text.lines()
        .find(|l| l.starts_with("rpc_server_concurrency_limit{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no concurrency limit gauge in\n{text}"))
}

/// Sends one wave of `MAX` concurrent payments; returns how many were created. Every answer is
/// 201 or a 503 `overloaded`.
async fn wave(h: &Harness, name: &str) -> usize {
    let calls: Vec<_> = (0..MAX)
        .map(|i| {
            let (http, base) = (h.http.clone(), h.base.clone());
            let key = format!("{name}-{i}");
            let order = format!("order-{name}-{i}");
            tokio::spawn(async move {
                let r = http
                    .post(format!("{base}/v1/payments"))
                    .header("content-type", "application/json")
                    .header("idempotency-key", key)
                    .body(body(&order, 100))
                    .send()
                    .await
                    .expect("request sent");
                support::answer(r).await
            })
        })
        .collect();
    let mut created = 0;
    for call in calls {
        let a = call.await.unwrap();
        match a.status {
            StatusCode::CREATED => created += 1,
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(a.code(), "overloaded", "{:?}", a.json);
                assert!(a.header("retry-after").is_some());
            }
            other => panic!("unexpected {other}: {:?}", a.json),
        }
    }
    created
}

async fn running_intents(h: &Harness) -> u64 {
    h.server
        .intents()
        .db()
        .expect("a SQLite store")
        .read(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM payment_intent WHERE status = 'running'",
                [],
                |r| r.get(0),
            )
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn adaptive_limit_goes_down_when_the_psp_slows_and_every_request_is_answered() {
    let h = Harness::start_with(|c| {
        c.limit = LimitMode::Adaptive;
        c.min_inflight = 4;
        c.max_inflight = MAX;
    })
    .await;

    // Baseline: the PSP answers at once.
    let mut created = 0;
    for round in 0..5 {
        created += wave(&h, &format!("fast-{round}")).await;
    }
    // Fast answers keep the limit at or near its bound; not exactly at it on a loaded machine,
    // where a scheduling stall looks like latency rising.
    let before = published_limit(&h).await;
    assert!(before >= 4.0, "never below --min-inflight: {before}");

    // The PSP slows to 1 s: the latency the gate sees is far above its baseline.
    h.latency(Duration::from_secs(1));
    let slow = wave(&h, "slow").await;
    assert!(slow > 0, "a slow PSP still serves");
    let lowered = published_limit(&h).await;
    assert!(
        lowered <= before && lowered < MAX as f64,
        "limit {before} -> {lowered}"
    );
    assert!(lowered >= 4.0, "never below --min-inflight: {lowered}");

    // Fast again: the limit grows back as requests finish.
    h.latency(Duration::ZERO);
    for round in 0..10 {
        created += wave(&h, &format!("again-{round}")).await;
    }
    let recovered = published_limit(&h).await;
    assert!(recovered > lowered, "limit {lowered} -> {recovered}");

    assert!(created > 0);
    assert_eq!(running_intents(&h).await, 0, "no intent left running");
}
