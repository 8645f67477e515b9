//! `backstop load` as a real process against real servers on loopback: every logical request
//! charged once against a healthy service, and the retry ratio against a dead one (seed 2.10.2:
//! the naive preset triples the load, the budget keeps it near its ratio).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use backstop_payment::config::{Config, StoreLocation};
use backstop_payment::service::Server;
use serde_json::Value;
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_backstop");

/// Runs `backstop load ... --json` and returns its summary.
async fn load(target: &str, extra: &[&str]) -> Value {
    let out = Command::new(BIN)
        .args(["load", "--target", target, "--json"])
        // Generous: the assertions count requests, they never time them.
        .args(["--timeout", "30s", "--concurrency", "100000"])
        .args(extra)
        .output()
        .await
        .expect("backstop load runs");
    assert!(
        out.status.success(),
        "load failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON summary on stdout")
}

async fn every_logical_request_is_one_order_charged_once(protocol: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::new(StoreLocation::Sqlite(dir.path().join("pay.db")));
    config.http = "127.0.0.1:0".parse().unwrap();
    config.grpc = "127.0.0.1:0".parse().unwrap();
    let server = Server::bind(config).await.unwrap();
    let psp_url = server.psp_url().to_owned();
    let target = match protocol {
        "grpc" => format!("grpc://{}", server.grpc_addr()),
        _ => server.url(),
    };
    let server = server.spawn();

    let s = load(&target, &["--rate", "200", "--duration", "1s"]).await;
    assert_eq!(s["logical_requests"], 200, "{s}");
    assert_eq!(s["skipped"], 0, "{s}");
    assert_eq!(s["outcomes"]["ok"], 200, "{s}");
    assert_eq!(s["retries"], 0, "{s}");
    assert_eq!(s["policy"], "backstop");
    assert_eq!(s["latency_ms"][0]["attempt"], "1");

    let charges: Value = reqwest::get(format!("{psp_url}/v1/charges"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let charges = charges.as_array().unwrap();
    assert_eq!(charges.len(), 200, "one charge per logical request");
    let mut orders: Vec<_> = charges.iter().map(|c| c["reference"].clone()).collect();
    orders.sort_by_key(|o| o.to_string());
    orders.dedup();
    assert_eq!(orders.len(), 200, "no order charged twice");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_load_charges_every_order_once() {
    every_logical_request_is_one_order_charged_once("http").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_load_charges_every_order_once() {
    every_logical_request_is_one_order_charged_once("grpc").await;
}

/// A dependency that answers every request 503 without a Retry-After.
async fn dead_service() -> (String, Arc<AtomicU64>) {
    let hits = Arc::new(AtomicU64::new(0));
    let counted = hits.clone();
    let app = Router::new().route(
        "/v1/payments",
        post(move || {
            let hits = counted.clone();
            async move {
                hits.fetch_add(1, Ordering::Relaxed);
                StatusCode::SERVICE_UNAVAILABLE
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), hits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_without_a_budget_triple_the_load_on_a_dead_dependency() {
    let (url, hits) = dead_service().await;
    let n = 1000;
    let args = ["--rate", "2000", "--duration", "500ms"];

    let naive = load(&url, &[&args[..], &["--policy", "naive"]].concat()).await;
    assert_eq!(naive["logical_requests"], n, "{naive}");
    assert_eq!(naive["retries"], 2 * n, "{naive}");
    assert_eq!(naive["retry_ratio"], 2.0);
    assert_eq!(hits.swap(0, Ordering::Relaxed), 3 * n);

    let budgeted = load(&url, &args).await;
    // Shown with --nocapture: the figures BENCHMARKS.md quotes.
    eprintln!("naive: {naive}\nbudgeted: {budgeted}");
    assert_eq!(budgeted["logical_requests"], n, "{budgeted}");
    // Budget: ratio 0.1 of logical requests plus a burst of 20.
    let retries = budgeted["retries"].as_u64().unwrap();
    assert!(retries <= n / 10 + 20, "{budgeted}");
    assert!(budgeted["retry_ratio"].as_f64().unwrap() <= 0.12);
    assert!(
        budgeted["stop_reasons"]["budget_exhausted"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(hits.load(Ordering::Relaxed), n + retries);
}

#[tokio::test]
async fn bad_flags_are_refused_with_a_reason() {
    for (args, needle) in [
        (&["--target", "ftp://x"][..], "scheme"),
        (&["--target", "http://127.0.0.1:1", "--rate", "0"], "rate"),
        (
            &["--target", "http://127.0.0.1:1", "--duration", "soon"],
            "duration",
        ),
        (
            &["--target", "http://127.0.0.1:1", "--policy", "wild"],
            "wild",
        ),
    ] {
        let out = Command::new(BIN)
            .arg("load")
            .args(args)
            .output()
            .await
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}
