//! Slow start against a real `backstop serve` and the PSP simulator: the PSP goes unavailable,
//! the admission limit drops to its floor; the PSP comes back with cold-start latency, the limit
//! ramps back to its maximum and every payment completes. Qualitative only: no timing
//! assertion, generous bounds on retries.

#[path = "support/serve_process.rs"]
mod serve_process;

use std::time::Duration;

use backstop_payment::psp::{self, Faults, PspConfig};
use serde_json::{Value, json};
use serve_process::{ServeProcess, serve_command};
const MAX_INFLIGHT: f64 = 8.0;
const FLOOR: f64 = 2.0;

struct Serve {
    _process: ServeProcess,
    base: String,
    http: reqwest::Client,
}

impl Serve {
    async fn start(store: &std::path::Path, psp_url: &str) -> Serve {
        let mut command = serve_command();
        command
            .arg("--store")
            .arg(store)
            .args(["--psp", psp_url, "--max-inflight", "8"])
            .args(["--slow-start-floor", "2"]);
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let process = serve_process::spawn(command, &http).await;
        Serve {
            base: process.base.clone(),
            _process: process,
            http,
        }
    }

    /// One attempt: the status and the problem code or payment status.
    async fn pay(&self, order: &str, timeout: &str) -> (u16, Value) {
        let response = self
            .http
            .post(format!("{}/v1/payments", self.base))
            .header("idempotency-key", format!("key-{order}"))
            .header("grpc-timeout", timeout)
            .json(&json!({"order_id": order, "amount_cents": 100}))
            .send()
            .await
            .expect("the server answers");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    /// The admission limit gauge.
    async fn limit(&self) -> f64 {
        let text = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find(|l| l.starts_with("rpc_server_concurrency_limit{"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no limit gauge in\n{text}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_psp_outage_the_limit_drops_then_ramps_back_and_every_payment_completes() {
    let dir = tempfile::tempdir().unwrap();
    let psp = psp::spawn(PspConfig::default()).await.unwrap();
    let server = Serve::start(&dir.path().join("pay.db"), &psp.url()).await;

    for i in 0..5 {
        let (status, body) = server.pay(&format!("before-{i}"), "10S").await;
        assert_eq!(status, 201, "{body}");
    }
    assert_eq!(server.limit().await, MAX_INFLIGHT);

    // The PSP goes down: every charge is answered 500 without charging; the PSP client gives
    // up and each payment fails with 503 `psp_unavailable`.
    let down = Faults {
        error_rate: 1.0,
        ..Faults::default()
    };
    psp.faults().set(down).unwrap();
    for i in 0..30 {
        let (status, body) = server.pay(&format!("outage-{i}"), "10S").await;
        assert_eq!(
            (status, &body["code"]),
            (503, &json!("psp_unavailable")),
            "{body}"
        );
    }
    assert_eq!(
        server.limit().await,
        FLOOR,
        "most requests failing dropped the limit to the floor"
    );

    // Back, with cold-start latency. A burst of payments, each retried with its key until it
    // completes: the limit ramps back to the maximum.
    let cold = Faults {
        latency: Duration::from_millis(50),
        ..Faults::default()
    };
    psp.faults().set(cold).unwrap();
    let server = std::sync::Arc::new(server);
    let payments: Vec<_> = (0..40)
        .map(|i| {
            let server = server.clone();
            tokio::spawn(async move {
                let order = format!("after-{i}");
                for _ in 0..200 {
                    let (status, body) = server.pay(&order, "5S").await;
                    match status {
                        201 => return body,
                        // Refused at the gate while the limit ramps, or the PSP's answer came
                        // too late: the same key again.
                        503 | 504 => tokio::time::sleep(Duration::from_millis(20)).await,
                        _ => panic!("{status} {body}"),
                    }
                }
                panic!("{order} never completed");
            })
        })
        .collect();
    for payment in payments {
        let body = payment.await.unwrap();
        assert_eq!(body["status"], "succeeded", "{body}");
    }
    assert_eq!(
        server.limit().await,
        MAX_INFLIGHT,
        "the limit is back at its maximum"
    );
}
