//! The fleet's retry switch across processes: three `backstop load` clients watching one Redis
//! key stop retrying when `backstop retries off` sets it, each within 2 s, and retry again
//! after `backstop retries on`.
//!
//! The service is a stand-in on 127.0.0.1 that fails one first attempt in twelve with 503
//! (few enough that no client's storm alarm trips, so only the switch stops their retries) and
//! serves every retry, counting the retries it sees by the `grpc-previous-rpc-attempts` header.

#[path = "support/proxy_harness.rs"]
mod proxy_harness;
#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;
#[path = "support/serve_process.rs"]
mod serve_process;
#[path = "../../backstop/tests/support/services.rs"]
mod services;

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use serve_process::BIN;

/// What the stand-in service has seen.
#[derive(Default)]
struct Seen {
    first: AtomicU64,
    retries: AtomicU64,
}

async fn stand_in() -> (String, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let counts = seen.clone();
    let app = Router::new().route(
        "/v1/payments",
        post(move |headers: HeaderMap| {
            let seen = counts.clone();
            async move {
                if headers.contains_key("grpc-previous-rpc-attempts") {
                    seen.retries.fetch_add(1, Ordering::SeqCst);
                    return (StatusCode::CREATED, "{}");
                }
                let n = seen.first.fetch_add(1, Ordering::SeqCst);
                if n % 12 == 11 {
                    (StatusCode::SERVICE_UNAVAILABLE, "{}")
                } else {
                    (StatusCode::CREATED, "{}")
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), seen)
}

/// A `backstop load` client watching `key`, its log lines sent to `lines` tagged with `id`.
fn client(
    target: &str,
    key: &str,
    id: usize,
    lines: mpsc::UnboundedSender<(usize, String)>,
) -> Child {
    let mut child = Command::new(BIN)
        .args(["--log-format", "json", "load", "--target", target])
        .args(["--rate", "40", "--duration", "60s", "--timeout", "5s"])
        .args(["--retry-switch-redis", &services::redis_url()])
        .args(["--retry-switch-key", key])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("backstop load starts");
    let stderr = child.stderr.take().expect("piped stderr");
    tokio::spawn(async move {
        let mut reader = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = reader.next_line().await {
            if lines.send((id, line)).is_err() {
                break;
            }
        }
    });
    child
}

fn unique_key(test: &str) -> String {
    format!(
        "backstop-test:retry-switch:{test}:{}:{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

fn retries(args: &[&str], key: &str) {
    let out = std::process::Command::new(BIN)
        .arg("retries")
        .args(args)
        .args(["--redis", &services::redis_url(), "--key", key])
        .output()
        .expect("backstop retries runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Waits (at most 60 s, far beyond what the load needs) until `seen` counts `n` more retries
/// than `from`.
async fn retries_arrive(seen: &Seen, from: u64, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.retries.load(Ordering::SeqCst) < from + n {
        assert!(Instant::now() < deadline, "retries did not arrive");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn three_clients_stop_retrying_within_two_seconds_of_the_switch_and_resume_after() {
    if !services::redis() {
        return;
    }
    let key = unique_key("load");
    let (target, seen) = stand_in().await;
    let (tx, mut lines) = mpsc::unbounded_channel();
    let _clients: Vec<Child> = (0..3)
        .map(|id| client(&target, &key, id, tx.clone()))
        .collect();
    drop(tx);
    retries_arrive(&seen, 0, 10).await;

    let switched = Instant::now();
    retries(&["off"], &key);
    // Each client logs the setting it applied; all three within 2 s of the switch.
    let mut applied = [None; 3];
    while applied.iter().any(Option::is_none) {
        let (id, line) = tokio::time::timeout(Duration::from_secs(60), lines.recv())
            .await
            .expect("every client applies the switch")
            .expect("the clients run");
        if line.contains("rpc_retry_switch") && line.contains("\"setting\":\"off\"") {
            applied[id].get_or_insert_with(|| switched.elapsed());
        }
    }
    for (id, after) in applied.iter().enumerate() {
        let after = after.expect("applied");
        assert!(
            after <= Duration::from_secs(2),
            "client {id} applied the switch after {after:?}"
        );
    }
    // Retries decided before the switch may still be waiting out their backoff (at most
    // 2 s); after that, none is sent while first attempts keep failing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (first, quiet) = (
        seen.first.load(Ordering::SeqCst),
        seen.retries.load(Ordering::SeqCst),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        seen.first.load(Ordering::SeqCst) >= first + 24,
        "the clients kept sending (and failing) first attempts"
    );
    assert_eq!(
        seen.retries.load(Ordering::SeqCst),
        quiet,
        "no retry while the switch is off"
    );

    retries(&["on"], &key);
    retries_arrive(&seen, quiet, 5).await;
}

/// `serve --redis` follows the switch too (its PSP client's retries and hedges).
#[tokio::test]
async fn a_service_with_redis_follows_the_switch() {
    if !services::redis() {
        return;
    }
    let key = unique_key("serve");
    let dir = tempfile::tempdir().unwrap();
    let mut command = serve_process::serve_command();
    command.arg("--store").arg(dir.path().join("pay.db")).args([
        "--redis",
        &services::redis_url(),
        "--retry-switch-key",
        &key,
    ]);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut process = serve_process::spawn(command, &http).await;
    retries(&["ratio", "0.02", "--for", "1m"], &key);
    loop {
        let line = tokio::time::timeout(Duration::from_secs(60), process.logs.recv())
            .await
            .expect("the service applies the switch")
            .expect("the service runs");
        if line.contains("rpc_retry_switch") && line.contains("ratio=0.02") {
            break;
        }
    }
    let status = std::process::Command::new(BIN)
        .args([
            "retries",
            "status",
            "--redis",
            &services::redis_url(),
            "--key",
            &key,
        ])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&status.stdout);
    assert!(printed.starts_with("ratio=0.02"), "{printed}");
    assert!(printed.contains("more)"), "{printed}");
}

/// `backstop retries webhook`: Alertmanager's notifications set the switch while a named
/// alert fires (for `--for`), and on once it is resolved; others change nothing; a body that is
/// not a notification is refused.
#[tokio::test]
async fn alertmanager_notifications_set_the_switch() {
    if !services::redis() {
        return;
    }
    let key = unique_key("webhook");
    let mut child = Command::new(BIN)
        .args(["--log-format", "json", "retries", "webhook"])
        .args(["--listen", "127.0.0.1:0", "--for", "1m"])
        .args(["--redis", &services::redis_url(), "--key", &key])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut log = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = log
            .next_line()
            .await
            .unwrap()
            .expect("the webhook logs its address");
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if let Some(addr) = v["fields"]["listen"].as_str() {
            break addr.to_owned();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = log.next_line().await {} });
    let url = format!("http://{addr}/alertmanager");
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let notify = |status: &str, name: &str| {
        serde_json::json!({
            "version": "4",
            "status": status,
            "receiver": "backstop",
            "alerts": [{"status": status, "labels": {"alertname": name, "service": "psp"}}],
        })
    };
    let client = redis::Client::open(services::redis_url()).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    let read = |redis: &mut redis::aio::MultiplexedConnection| {
        let mut redis = redis.clone();
        let key = key.clone();
        async move {
            let value: Option<String> = redis::cmd("GET")
                .arg(&key)
                .query_async(&mut redis)
                .await
                .unwrap();
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut redis)
                .await
                .unwrap();
            (value, ttl)
        }
    };

    let r = http
        .post(&url)
        .json(&notify("firing", "BackstopRejecting"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(read(&mut redis).await.0, None, "another alert sets nothing");

    let r = http
        .post(&url)
        .json(&notify("firing", "BackstopRetryStorm"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (value, ttl) = read(&mut redis).await;
    assert_eq!(value.as_deref(), Some("off"));
    assert!((1..=60_000).contains(&ttl), "held for --for: {ttl} ms");

    let r = http
        .post(&url)
        .body("{\"alerts\": 3}")
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_client_error(), "{}", r.status());
    assert_eq!(
        read(&mut redis).await.0.as_deref(),
        Some("off"),
        "unchanged by a bad body"
    );

    let r = http
        .post(&url)
        .json(&notify("resolved", "BackstopRetryStorm"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(read(&mut redis).await.0, None, "on: the key is removed");
}

/// `backstop proxy --retry-switch-redis` follows the switch too (its retries and hedges to the
/// upstream), as its metrics show.
/// A proxy in front of an upstream that answers 503 retries a safe route's request while the
/// switch is on, sends each request once while it is off, and retries again once it is on.
/// (Five failing requests in all: fewer than the storm alarm's and the breaker's minimum, so
/// only the switch decides.)
#[tokio::test]
async fn a_proxy_stops_retrying_while_the_switch_is_off() {
    if !services::redis() || !proxy_harness::python_ready().await {
        return;
    }
    let key = unique_key("proxy");
    let dir = tempfile::tempdir().unwrap();
    let upstream = proxy_harness::Upstream::start(dir.path()).await;
    let proxy = proxy_harness::Proxy::options(dir.path(), &[&upstream.url])
        .args(&[
            "--retry-switch-redis",
            &services::redis_url(),
            "--retry-switch-key",
            &key,
        ])
        .start()
        .await;
    let http = proxy_harness::client();
    let failing = async |path: &str| {
        let answer = proxy_harness::call(
            http.get(format!("{}{path}", proxy.base))
                .header("X-Upstream-Status", "503"),
        )
        .await;
        answer.assert_status(503);
        upstream.received_at(path)
    };
    let gauge = async |setting: &str| {
        let line = format!("rpc_client_retry_switch{{setting=\"{setting}\"}} 1");
        proxy_harness::wait_for("the proxy to apply the switch", async || {
            proxy.metrics().await.contains(&line).then_some(())
        })
        .await;
    };

    gauge("on").await;
    assert!(failing("/v1/charges/on-1").await > 1, "retried while on");

    retries(&["off", "--for", "1m"], &key);
    gauge("off").await;
    for i in 0..3 {
        let path = format!("/v1/charges/off-{i}");
        assert_eq!(failing(&path).await, 1, "{path}: sent once while off");
    }

    retries(&["on"], &key);
    gauge("on").await;
    assert!(
        failing("/v1/charges/on-2").await > 1,
        "retried again once on"
    );
}
