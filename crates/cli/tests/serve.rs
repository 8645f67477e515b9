//! `backstop serve` as a real process: kill -9 in the middle of a charge, restart on the same
//! store, retry with the same key; and the start-up refusals.

#[path = "support/serve_process.rs"]
mod serve_process;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use backstop_payment::psp::{self, Fault, PspConfig, PspHandle};
use serde_json::{Value, json};
use serve_process::{BIN, ServeProcess, serve_command};
use tokio::process::Command;

/// A running `backstop serve` child and its log lines.
struct Serve {
    process: ServeProcess,
    base: String,
    grpc: String,
    http: reqwest::Client,
}

impl Serve {
    /// Starts the binary on a free port and returns once `/healthz` answers.
    async fn start(store: &Path, psp_url: &str) -> Serve {
        Serve::start_with(store, psp_url, &[], None).await
    }

    /// [`Serve::start`] with extra flags and, with `nofile`, a lowered file descriptor limit.
    async fn start_with(store: &Path, psp_url: &str, extra: &[&str], nofile: Option<u32>) -> Serve {
        let mut command = match nofile {
            Some(limit) => {
                let mut sh = Command::new("sh");
                sh.args([
                    "-c",
                    &format!("ulimit -n {limit} && exec \"$0\" \"$@\""),
                    BIN,
                ])
                .args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"]);
                sh
            }
            None => serve_command(),
        };
        command
            .arg("--store")
            .arg(store)
            .args(["--psp", psp_url])
            .args(extra);
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let process = serve_process::spawn(command, &http).await;
        Serve {
            base: process.base.clone(),
            grpc: process.grpc.clone(),
            process,
            http,
        }
    }

    async fn post(
        &self,
        key: &str,
        body: &Value,
        timeout: &str,
    ) -> reqwest::Result<(u16, Value, Option<u64>)> {
        let r = self
            .http
            .post(format!("{}/v1/payments", self.base))
            .header("idempotency-key", key)
            .header("grpc-timeout", timeout)
            .json(body)
            .send()
            .await?;
        let status = r.status().as_u16();
        let retry_after = r
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let json = r.json().await.unwrap_or(Value::Null);
        Ok((status, json, retry_after))
    }

    async fn kill9(mut self) {
        self.process.child.kill().await.expect("SIGKILL");
    }

    async fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.process.child.id().expect("running").to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill -TERM");
        assert!(sent.success());
        self.process.child.wait().await.expect("exits")
    }
}

async fn charges(psp: &PspHandle, order: &str) -> usize {
    psp.store()
        .list(Some(backstop_payment::psp_client::psp_reference(
            backstop_payment::config::DEFAULT_MERCHANT,
            order,
        )))
        .await
        .unwrap()
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_request_then_retry_on_the_same_store_charges_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("pay.db");
    let psp = psp::spawn(PspConfig::default()).await.unwrap();
    // The PSP commits the charge, then holds the answer: the kill lands mid-request.
    psp.faults().script([Fault::CommitThenTimeout]).unwrap();
    let body = json!({"order_id": "order-k9", "amount_cents": 4321});

    let server = Serve::start(&store, &psp.url()).await;
    let first = {
        let http = server.http.clone();
        let url = format!("{}/v1/payments", server.base);
        let body = body.clone();
        tokio::spawn(async move {
            http.post(url)
                .header("idempotency-key", "k9-key")
                .header("grpc-timeout", "3S")
                .json(&body)
                .send()
                .await
        })
    };
    // Mid-request: the PSP has committed and is holding the answer.
    while charges(&psp, "order-k9").await == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.kill9().await;
    assert!(
        first.await.unwrap().is_err(),
        "the killed server never answered"
    );

    let server = Serve::start(&store, &psp.url()).await;
    // The dead process's claim holds its lease: the retry waits for it to end (or the server
    // says how long to wait), then takes the key over. Taking over late in its budget, it may
    // run out of time: an unknown outcome or a passed deadline is retried with the same key.
    let mut answer = None;
    for _ in 0..20 {
        let (status, json, retry_after) = server.post("k9-key", &body, "5S").await.unwrap();
        if status == 409 && json["code"] == "request_in_progress" {
            let wait = retry_after.expect("409 in progress carries Retry-After");
            tokio::time::sleep(Duration::from_secs(wait)).await;
            continue;
        }
        if status == 504
            && (json["code"] == "payment_outcome_unknown" || json["code"] == "deadline_exceeded")
        {
            continue;
        }
        answer = Some((status, json));
        break;
    }
    let (status, json) = answer.expect("the retry converged");
    assert_eq!(status, 201, "{json}");
    assert_eq!(json["status"], "succeeded");
    assert_eq!(charges(&psp, "order-k9").await, 1, "charged exactly once");
    let stored = psp
        .store()
        .list(Some("default:order-k9".into()))
        .await
        .unwrap();
    assert_eq!(json["charge_id"], stored[0].charge_id.as_str());
    assert_eq!(json["intent_id"], stored[0].effect_key.as_str());

    // A replay now returns the same answer.
    let (status, again, _) = server.post("k9-key", &body, "5S").await.unwrap();
    assert_eq!(status, 201);
    assert_eq!(again, json);

    let exit = server.terminate().await;
    assert!(exit.success(), "graceful shutdown exits 0: {exit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_cuts_a_call_at_the_drain_bound_and_releases_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("pay.db");
    let psp = psp::spawn(PspConfig::default()).await.unwrap();
    // The PSP commits, then holds its answer past the drain bound.
    psp.faults().script([Fault::CommitThenTimeout]).unwrap();
    let body = json!({"order_id": "order-drain-cut", "amount_cents": 700});
    let server = Serve::start_with(&store, &psp.url(), &["--drain-timeout", "1s"], None).await;
    let held = {
        let http = server.http.clone();
        let url = format!("{}/v1/payments", server.base);
        let body = body.clone();
        tokio::spawn(async move {
            http.post(url)
                .header("idempotency-key", "drain-cut-key")
                .header("grpc-timeout", "60S")
                .json(&body)
                .send()
                .await
        })
    };
    while charges(&psp, "order-drain-cut").await == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(server.terminate().await.success(), "a clean stop");
    assert!(held.await.unwrap().is_err(), "cut at the drain bound");

    // The same key at once: the cut call no longer holds it (no 409 for the lease).
    let server = Serve::start(&store, &psp.url()).await;
    let (status, json, _) = server.post("drain-cut-key", &body, "10S").await.unwrap();
    assert_eq!(status, 201, "{json}");
    assert_eq!(charges(&psp, "order-drain-cut").await, 1, "charged once");
    assert!(server.terminate().await.success());
}

#[tokio::test]
async fn grpc_is_served_on_the_grpc_address_with_the_same_store() {
    use backstop_payment::grpc::proto::ChargeRequest;
    use backstop_payment::grpc::proto::payment_client::PaymentClient;

    let dir = tempfile::tempdir().unwrap();
    let psp = psp::spawn(PspConfig::default()).await.unwrap();
    let server = Serve::start(&dir.path().join("pay.db"), &psp.url()).await;
    let mut client = PaymentClient::connect(format!("http://{}", server.grpc))
        .await
        .expect("the gRPC port accepts h2c");
    let call = || {
        let mut request = tonic::Request::new(ChargeRequest {
            order_id: "order-grpc".into(),
            amount_cents: 1234,
            currency: "EUR".into(),
        });
        request
            .metadata_mut()
            .insert("idempotency-key", "grpc-key".parse().unwrap());
        request.set_timeout(Duration::from_secs(5));
        request
    };
    let first = client.charge(call()).await.expect("charged").into_inner();
    assert_eq!(first.status, "succeeded");
    let again = client.charge(call()).await.expect("replayed");
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(again.into_inner(), first);
    // The same payment over HTTP: one store behind both protocols.
    let got: Value = server
        .http
        .get(format!("{}/v1/payments/{}", server.base, first.intent_id))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got["charge_id"], first.charge_id.as_str());
    assert_eq!(charges(&psp, "order-grpc").await, 1);
    assert!(server.terminate().await.success());
}

async fn refused(args: &[&str]) -> (std::process::ExitStatus, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .arg("serve")
        .args(args)
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn open_service_on_a_public_address_refuses_to_start() {
    let (status, stderr) = refused(&["--http", "0.0.0.0:0"]).await;
    assert!(!status.success());
    assert!(
        stderr.contains("refusing to serve without API keys"),
        "{stderr}"
    );
}

#[tokio::test]
async fn open_service_on_a_public_grpc_address_refuses_to_start() {
    let (status, stderr) = refused(&["--grpc", "0.0.0.0:0"]).await;
    assert!(!status.success());
    assert!(
        stderr.contains("refusing to serve without API keys on non-loopback address 0.0.0.0:0"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_busy_port_fails_before_creating_anything_and_says_so_once() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_addr = busy.local_addr().unwrap().to_string();
    for flags in [
        ["--http", busy_addr.as_str(), "--grpc", "127.0.0.1:0"],
        ["--http", "127.0.0.1:0", "--grpc", busy_addr.as_str()],
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(BIN)
            .arg("serve")
            .args(flags)
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "one line: {stderr}");
        assert!(
            lines[0].contains(&format!("cannot listen on {busy_addr}")),
            "{stderr}"
        );
        let created: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(created.is_empty(), "nothing is created: {created:?}");
    }
}

/// Connections that open and never finish a request head.
async fn slowloris(addr: &str, count: usize, partial: &[u8]) -> Vec<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt;
    let mut held = Vec::with_capacity(count);
    for _ in 0..count {
        let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
            continue;
        };
        // The server may already have closed it to make room: that is the point.
        let _ = stream.write_all(partial).await;
        held.push(stream);
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_flood_past_the_fd_limit_leaves_the_service_reachable() {
    let dir = tempfile::tempdir().unwrap();
    let psp = psp::spawn(PspConfig::default()).await.unwrap();
    // 256 descriptors for the whole process; 300 + 100 slow connections would exhaust them.
    let server = Serve::start_with(
        &dir.path().join("pay.db"),
        &psp.url(),
        &["--max-connections", "64"],
        Some(256),
    )
    .await;
    let http_addr = server.base.trim_start_matches("http://").to_owned();
    let _http_flood = slowloris(&http_addr, 300, b"POST /v1/payments HTTP/1.1\r\nx-slow: ").await;
    let _grpc_flood = slowloris(&server.grpc, 100, b"PRI * HTTP/2.0\r\n").await;

    // A new, well-behaved client still gets in, on a connection of its own.
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let health = client
        .get(format!("{}/healthz", server.base))
        .send()
        .await
        .expect("/healthz answers during the flood");
    assert_eq!(health.status(), 200);
    let payment = client
        .post(format!("{}/v1/payments", server.base))
        .header("idempotency-key", "during-the-flood")
        .header("grpc-timeout", "30S")
        .json(&json!({"order_id": "order-flood", "amount_cents": 100}))
        .send()
        .await
        .expect("a payment answers during the flood");
    assert_eq!(payment.status(), 201);
    let metrics = client
        .get(format!("{}/metrics", server.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("rpc_server_connections_rejected_total{")
                && l.contains("reason=\"evicted\"")),
        "{metrics}"
    );
    assert!(server.terminate().await.success());
}

#[tokio::test]
async fn unreachable_postgres_store_refuses_to_start() {
    // Port 1 on loopback: nothing listens, the connection is refused at once.
    let (status, stderr) = refused(&["--store", "postgres://postgres@127.0.0.1:1/test"]).await;
    assert!(!status.success());
    assert!(
        stderr.contains("no PostgreSQL connection available"),
        "{stderr}"
    );
}
