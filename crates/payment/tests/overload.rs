//! Five times the service's capacity against a real service and a real PSP slowed to 100 ms:
//! goodput does not collapse, refusals are 503 (`overloaded` from the gate) + `Retry-After`,
//! and no intent is left `running` once the load stops.
//!
//! Qualitative claims only: the capacity is measured first, in the same test, on the same
//! machine, and the overloaded goodput is compared with it, with a wide margin. With a
//! first-come-first-served wait bounded only by the deadline (`--queue fifo`), most admitted
//! requests have too little budget left to reach the PSP and goodput collapses.

mod support;

use std::sync::Arc;
use std::time::Duration;

use backstop_payment::config::Config;
use reqwest::StatusCode;
use support::{Answer, Harness, body};
use tokio::time::Instant;

/// Requests served at once (`--max-inflight`).
const LIMIT: usize = 4;
/// The PSP's latency: capacity is about LIMIT / 200 ms, few enough requests that a loaded
/// machine can still send five times as many.
const PSP_LATENCY: Duration = Duration::from_millis(200);
/// How long each phase sends.
const PHASE: Duration = Duration::from_secs(4);
/// Every request's budget (`grpc-timeout`): ten PSP latencies.
const BUDGET: &str = "2000m";
/// The client waits far longer than the budget: the server always answers first.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

async fn pay(h: &Harness, key: String) -> Answer {
    let r = h
        .http
        .post(format!("{}/v1/payments", h.base))
        .header("content-type", "application/json")
        .header("idempotency-key", &key)
        .header("grpc-timeout", BUDGET)
        .timeout(CLIENT_TIMEOUT)
        .body(body(&format!("order-{key}"), 100))
        .send()
        .await
        .expect("the service answers");
    support::answer(r).await
}

/// Payments created per second by LIMIT clients sending back to back: the capacity.
async fn capacity(h: &Arc<Harness>) -> f64 {
    let start = Instant::now();
    let workers: Vec<_> = (0..LIMIT)
        .map(|w| {
            let h = Arc::clone(h);
            tokio::spawn(async move {
                let mut created = 0u32;
                let mut i = 0;
                while start.elapsed() < PHASE {
                    let a = pay(&h, format!("one-{w}-{i}")).await;
                    created += u32::from(a.status == StatusCode::CREATED);
                    i += 1;
                }
                created
            })
        })
        .collect();
    let mut created = 0;
    for w in workers {
        created += w.await.unwrap();
    }
    f64::from(created) / start.elapsed().as_secs_f64()
}

/// Sends at `rate` per second for PHASE without waiting for answers (an open loop, as
/// independent clients do), then collects every answer.
async fn offer(h: &Arc<Harness>, rate: f64) -> (Vec<Answer>, Duration) {
    let start = Instant::now();
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut calls = Vec::new();
    while start.elapsed() < PHASE {
        ticks.tick().await;
        let h = Arc::clone(h);
        let key = format!("five-{}", calls.len());
        calls.push(tokio::spawn(async move { pay(&h, key).await }));
    }
    let mut answers = Vec::with_capacity(calls.len());
    for call in calls {
        answers.push(call.await.unwrap());
    }
    (answers, start.elapsed())
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

fn tune(c: &mut Config) {
    c.max_inflight = LIMIT;
    // Far above the load: the gate is what refuses, not the merchant's quota.
    c.tenant_rate = std::num::NonZeroU32::new(1_000_000).unwrap();
    c.tenant_burst = std::num::NonZeroU32::new(1_000_000).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_times_capacity_keeps_goodput_and_refuses_with_retry_after() {
    let h = Arc::new(Harness::start_with(tune).await);
    h.latency(PSP_LATENCY);

    let capacity = capacity(&h).await;
    assert!(capacity > 0.0, "the service serves at 1x");

    let (answers, elapsed) = offer(&h, 5.0 * capacity).await;
    let created = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED)
        .count();
    let goodput = created as f64 / elapsed.as_secs_f64();
    let refused: Vec<_> = answers
        .iter()
        .filter(|a| a.status == StatusCode::SERVICE_UNAVAILABLE)
        .collect();
    let metrics = String::from_utf8(h.get("/metrics", &[]).await.bytes).unwrap();
    for line in metrics.lines().filter(|l| {
        l.starts_with("rpc_server_rejected_total")
            || l.starts_with("rpc_server_queue_delay_seconds_count")
            || l.starts_with("rpc_server_queue_delay_seconds_sum")
            || l.starts_with("rpc_server_requests_total")
    }) {
        eprintln!("{line}");
    }
    let others: Vec<_> = answers
        .iter()
        .filter(|a| ![StatusCode::CREATED, StatusCode::SERVICE_UNAVAILABLE].contains(&a.status))
        .map(|a| (a.status, a.code().to_owned()))
        .collect();
    eprintln!(
        "capacity {capacity:.1}/s; at 5x: {} sent, {created} created ({goodput:.1}/s), {} refused, {} others {:?}",
        answers.len(),
        refused.len(),
        others.len(),
        others.iter().take(3).collect::<Vec<_>>()
    );

    assert!(
        goodput > 0.5 * capacity,
        "goodput collapsed: {goodput:.1}/s at 5x against {capacity:.1}/s at 1x"
    );
    let overloaded = refused.iter().filter(|a| a.code() == "overloaded").count();
    assert!(overloaded > 0, "5x the capacity cannot all be served");
    for a in &refused {
        let wait: u64 = a
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no Retry-After: {:?}", a.headers));
        assert!(wait >= 1);
    }

    // The load has stopped and every request was answered: nothing may stay `running`. A
    // generous bound for the last handlers to finish on a loaded machine.
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let running = running_intents(&h).await;
        if running == 0 {
            break;
        }
        assert!(Instant::now() < give_up, "{running} intents left running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Back to 1x: served again.
    let after = pay(&h, "after".to_owned()).await;
    assert_eq!(after.status, StatusCode::CREATED, "{:?}", after.json);
}
