//! `backstop serve` pushes clients away under sustained overload: with one place in the gate,
//! held by a payment the PSP keeps waiting, the payments after it are refused; once the
//! refusals count as sustained overload, the refusals close their HTTP/1.1 connections
//! (`Connection: close`) and the pushes are counted in `/metrics`. With `--no-push-away`,
//! none is.
//!
//! Nothing is timed: the overload is the held place, sustained from the 20th request in the
//! window (the fewest the window counts) with `--shed-sustain 0s` and an hour-long window.

#[path = "support/serve_process.rs"]
mod serve_process;

use std::time::Duration;

use backstop_payment::psp::{self, Faults, PspConfig};
use serde_json::json;
use serve_process::{ServeProcess, serve_command};

async fn serve(
    store: &std::path::Path,
    psp_url: &str,
    push: bool,
) -> (ServeProcess, reqwest::Client) {
    let mut command = serve_command();
    command
        .arg("--store")
        .arg(store)
        .args(["--psp", psp_url, "--max-inflight", "1", "--no-slow-start"])
        .args([
            "--shed-threshold",
            "0",
            "--shed-sustain",
            "0s",
            "--shed-window",
            "1h",
        ])
        .args(["--push-away-percent", "100"]);
    if !push {
        command.arg("--no-push-away");
    }
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let process = serve_process::spawn(command, &http).await;
    (process, http)
}

/// One payment with `timeout` (`grpc-timeout`): its status and whether the answer closes its
/// connection.
async fn pay(http: &reqwest::Client, base: &str, order: &str, timeout: &str) -> (u16, bool) {
    let response = http
        .post(format!("{base}/v1/payments"))
        .header("idempotency-key", format!("key-{order}"))
        .header("grpc-timeout", timeout)
        .json(&json!({"order_id": order, "amount_cents": 100}))
        .send()
        .await
        .expect("the server answers");
    let close = response
        .headers()
        .get(reqwest::header::CONNECTION)
        .is_some_and(|v| v == "close");
    (response.status().as_u16(), close)
}

/// The value of the first `/metrics` line of metric `name` with all of `labels`.
async fn metric(http: &reqwest::Client, base: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| {
            l.starts_with(&format!("{name}{{")) && labels.iter().all(|label| l.contains(label))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Holds the gate's only place with a payment the PSP never answers in time, then sends 30
/// payments that cannot wait: whether each answer closed its connection.
async fn overload(push: bool) -> (Vec<(u16, bool)>, Option<f64>) {
    let dir = tempfile::tempdir().unwrap();
    let psp = psp::spawn(PspConfig::default()).await.unwrap();
    psp.faults()
        .set(Faults {
            latency: Duration::from_secs(3600),
            ..Faults::default()
        })
        .unwrap();
    let (server, http) = serve(&dir.path().join("pay.db"), &psp.url(), push).await;
    let base = server.base.clone();
    let held = {
        let (http, base) = (http.clone(), base.clone());
        tokio::spawn(async move { pay(&http, &base, "held", "60S").await })
    };
    // Until the held payment has the place.
    while metric(&http, &base, "rpc_server_concurrency_inflight", &[]).await != Some(1.0) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut answers = Vec::new();
    for i in 0..30 {
        // 10 ms cannot cover the service time: refused at once.
        answers.push(pay(&http, &base, &format!("o-{i}"), "10m").await);
    }
    let pushed = metric(
        &http,
        &base,
        "rpc_server_connections_pushed_total",
        &["protocol=\"http1\"", "service=\"payment-http\""],
    )
    .await;
    held.abort();
    (answers, pushed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sustained_overload_closes_http1_connections_and_counts_them() {
    let (answers, pushed) = overload(true).await;
    assert!(answers.iter().all(|&(s, _)| s == 503), "{answers:?}");
    // The held payment is the first request the window counts: the 19th refusal is the 20th,
    // and the first answer to close its connection. How many follow within the second's
    // share depends on the pace.
    let closed: Vec<usize> = (0..answers.len()).filter(|&i| answers[i].1).collect();
    assert_eq!(closed.first(), Some(&18), "{answers:?}");
    // The scrape's own answer may be pushed too.
    let pushed = pushed.expect("pushes are counted") as usize;
    assert!(
        (closed.len()..=closed.len() + 1).contains(&pushed),
        "{pushed} pushed, {closed:?} closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_push_away_keeps_every_connection() {
    let (answers, pushed) = overload(false).await;
    assert!(answers.iter().all(|&(s, c)| s == 503 && !c), "{answers:?}");
    assert_eq!(pushed, None);
}
