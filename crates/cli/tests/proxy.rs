//! `backstop proxy` as a real process in front of a real upstream that is not Rust: a Python
//! standard-library HTTP server (`support/upstream.py`) that records every request it gets and
//! every effect it executes in a file, and can be told to be slow.
//!
//! Nothing here synchronises by sleeping: each test waits for a condition (a line in the
//! upstream's events file, a log line, an answer), bounded by a generous timeout.

// The per-test PostgreSQL schema and the check that the servers answer, shared with the
// other crates' tests.
#[path = "../../backstop/tests/support/postgres_schema.rs"]
mod postgres_schema;
#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;
#[path = "../../backstop/tests/support/services.rs"]
mod services;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// The binary under test.
const BIN: &str = env!("CARGO_BIN_EXE_backstop");

/// Longest wait for anything a test waits on.
const PATIENCE: Duration = Duration::from_secs(30);

const ROUTES: &str = r#"
[policies.fallback]
timeout = "10s"

[[policies.route]]
match = "POST /v1/charges"
name = "CreateCharge"
idempotency = "keyed"
timeout = "10s"

[[policies.route]]
match = "POST /dedup/charges"
name = "DedupCharge"
idempotency = "keyed"
timeout = "10s"
upstream_dedups_by_effect_key = true

[[policies.route]]
match = "GET /v1/charges/{id}"
idempotency = "safe"

[[policies.route]]
match = "/shop.v1.Orders/Create"
idempotency = "keyed"
timeout = "3s"

[proxy]
replay_headers = ["x-upstream"]
"#;

/// Whether python3 is here (it is wherever the tests run; skipped with a message otherwise).
async fn python_ready() -> bool {
    python::python_ready("json, http.server", "the proxy tests", "(python3 itself)").await
}

/// Waits until `check` answers `Some`, looking every 20 ms for at most [`PATIENCE`].
async fn wait_for<T>(what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let give_up = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "gave up waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A file of `support/`.
fn support(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/support")
        .join(name)
}

/// The Python upstream.
struct Upstream {
    _child: Child,
    url: String,
    events: PathBuf,
}

impl Upstream {
    /// The HTTP upstream (`support/upstream.py`).
    async fn start(dir: &Path) -> Upstream {
        Self::start_script(dir, "upstream.py", &[]).await
    }

    /// The gRPC upstream (`support/grpc_upstream.py serve`).
    async fn start_grpc(dir: &Path) -> Upstream {
        Self::start_script(dir, "grpc_upstream.py", &["serve"]).await
    }

    async fn start_script(dir: &Path, script: &str, args: &[&str]) -> Upstream {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let events = dir.join(format!(
            "events-{}.jsonl",
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&events, "").unwrap();
        let mut child = python::python3()
            .arg(support(script))
            .args(args)
            .arg("--events")
            .arg(&events)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 starts");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(PATIENCE, lines.next_line())
            .await
            .expect("the upstream starts in time")
            .unwrap()
            .expect("the upstream prints its address");
        let addr = line.strip_prefix("listening ").expect("listening line");
        Upstream {
            _child: child,
            url: format!("http://{addr}"),
            events: events.clone(),
        }
    }

    /// Every event recorded so far.
    fn events(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.events)
            .unwrap()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).expect("an events line is JSON"))
            .collect()
    }

    /// The events of kind `event` for requests with `key` (or any, with `None`).
    fn of(&self, event: &str, key: Option<&str>) -> Vec<Value> {
        self.events()
            .into_iter()
            .filter(|e| e["event"] == event && key.is_none_or(|k| e["key"] == k))
            .collect()
    }
}

/// A running `backstop proxy`.
struct Proxy {
    child: Child,
    base: String,
    admin: String,
    _logs: mpsc::UnboundedReceiver<String>,
}

impl Proxy {
    /// The command for a proxy in front of `upstream` keeping its records in `dir`.
    fn command(dir: &Path, upstream: &str) -> Command {
        Self::command_at(dir, upstream, "127.0.0.1:0")
    }

    /// [`command`](Self::command), listening on `listen`.
    fn command_at(dir: &Path, upstream: &str, listen: &str) -> Command {
        let store = format!("sqlite://{}", dir.join("proxy.db").display());
        Self::command_on(dir, &[upstream], &store, listen)
    }

    /// The command for a proxy in front of `upstreams` keeping its records in `store`.
    fn command_on(dir: &Path, upstreams: &[&str], store: &str, listen: &str) -> Command {
        let routes = dir.join("routes.toml");
        if !routes.exists() {
            std::fs::write(&routes, ROUTES).unwrap();
        }
        let mut command = Command::new(BIN);
        command.args(["proxy", "--listen", listen, "--admin", "127.0.0.1:0"]);
        for upstream in upstreams {
            command.args(["--upstream", upstream]);
        }
        command
            .arg("--config")
            .arg(&routes)
            .args(["--store", store])
            .args(["--lease", "1s", "--drain-timeout", "5s"]);
        command
    }

    async fn start(dir: &Path, upstream: &str) -> Proxy {
        Self::spawn(Self::command(dir, upstream)).await
    }

    async fn spawn(mut command: Command) -> Proxy {
        let mut child = command
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("backstop starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, mut logs) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let listening = tokio::time::timeout(PATIENCE, async {
            loop {
                let line = logs.recv().await.expect("the proxy logs its address");
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                if v["fields"]["message"] == "proxy listening" {
                    break v;
                }
            }
        })
        .await
        .expect("the proxy starts in time");
        let field = |name: &str| listening["fields"][name].as_str().unwrap().to_owned();
        Proxy {
            child,
            base: format!("http://{}", field("listen")),
            admin: format!("http://{}", field("admin")),
            _logs: logs,
        }
    }

    /// SIGKILL, and wait for the process to be gone.
    async fn kill9(&mut self) {
        self.child.kill().await.expect("SIGKILL");
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// An answer: status, headers, body bytes.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

async fn send(request: reqwest::RequestBuilder) -> reqwest::Result<Answer> {
    let response = request.send().await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.bytes().await?.to_vec();
    Ok(Answer {
        status,
        headers,
        body,
    })
}

fn charge(
    http: &reqwest::Client,
    base: &str,
    path: &str,
    key: &str,
    body: &str,
) -> reqwest::RequestBuilder {
    http.post(format!("{base}{path}"))
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body.to_owned())
}

#[tokio::test]
async fn duplicate_keyed_requests_in_parallel_are_forwarded_once() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    let http = client();

    let mut calls = Vec::new();
    for _ in 0..8 {
        let request = charge(
            &http,
            &proxy.base,
            "/v1/charges",
            "dup-1",
            r#"{"amount":100}"#,
        )
        .header("X-Upstream-Sleep-Ms", "300");
        calls.push(tokio::spawn(send(request)));
    }
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap().unwrap());
    }
    assert!(answers.iter().all(|a| a.status == 201), "all 201");
    let first = &answers[0].body;
    assert!(
        answers.iter().all(|a| a.body == *first),
        "byte-identical answers"
    );
    assert_eq!(
        answers.iter().filter(|a| !a.replayed()).count(),
        1,
        "one forwarded, the others replayed"
    );
    let effects = upstream.of("effect", Some("dup-1"));
    assert_eq!(effects.len(), 1, "{effects:?}");
    assert_eq!(upstream.of("received", Some("dup-1")).len(), 1);
    let effect_key = effects[0]["effect_key"]
        .as_str()
        .expect("an effect key was sent");
    assert_eq!(effect_key.len(), 32);
    assert!(effect_key.chars().all(|c| c.is_ascii_hexdigit()));
    assert!(
        answers.iter().all(|a| a.headers["x-upstream"] == "python"),
        "the headers the routes file names are replayed too"
    );

    // The library's metric names, under the proxy's service label.
    let metrics = http
        .get(format!("{}/metrics", proxy.admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "rpc_server_requests_total",
        "rpc_server_duration_seconds",
        "idempotency_claims_total",
        "rpc_server_connections",
    ] {
        assert!(metrics.contains(name), "{name} missing:\n{metrics}");
    }
    assert!(metrics.contains(r#"service="proxy""#), "{metrics}");
    assert!(
        metrics.contains(r#"method="POST /v1/charges""#),
        "labelled by route: {metrics}"
    );
}

#[tokio::test]
async fn a_retry_after_the_client_timed_out_gets_the_first_answer_replayed() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    let http = client();
    let body = r#"{"amount":250}"#;

    let impatient = tokio::spawn(send(
        charge(&http, &proxy.base, "/v1/charges", "late-1", body)
            .header("X-Upstream-Sleep-Ms", "1500"),
    ));
    // Once the request reached the upstream, its client gives up (its connection closes).
    wait_for("the first effect", async || {
        (!upstream.of("effect", Some("late-1")).is_empty()).then_some(())
    })
    .await;
    impatient.abort();
    assert!(impatient.await.unwrap_err().is_cancelled());

    // The retry waits for the forwarded request's answer and gets it replayed.
    let retry = send(charge(&http, &proxy.base, "/v1/charges", "late-1", body))
        .await
        .unwrap();
    assert_eq!(
        retry.status,
        201,
        "{}",
        String::from_utf8_lossy(&retry.body)
    );
    assert!(retry.replayed());
    let again = send(charge(&http, &proxy.base, "/v1/charges", "late-1", body))
        .await
        .unwrap();
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, retry.body, "byte for byte");
    assert_eq!(upstream.of("effect", Some("late-1")).len(), 1);
    assert_eq!(upstream.of("received", Some("late-1")).len(), 1);
    assert!(
        upstream.of("cancelled", Some("late-1")).is_empty(),
        "the proxy kept the forwarded request going when its caller left"
    );
}

#[tokio::test]
async fn the_same_key_with_another_body_is_refused_and_not_forwarded() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    let http = client();

    let first = send(charge(
        &http,
        &proxy.base,
        "/v1/charges",
        "reuse-1",
        r#"{"amount":1}"#,
    ))
    .await
    .unwrap();
    assert_eq!(first.status, 201);
    let other = send(charge(
        &http,
        &proxy.base,
        "/v1/charges",
        "reuse-1",
        r#"{"amount":2}"#,
    ))
    .await
    .unwrap();
    assert_eq!(other.status, 409);
    assert_eq!(other.json()["code"], "idempotency_key_reused");
    assert_eq!(upstream.of("received", Some("reuse-1")).len(), 1);

    // A body that is not JSON, or none, is compared byte for byte.
    for (key, body) in [("form-1", "amount=1&currency=EUR"), ("empty-1", "")] {
        let form = |body: &str| {
            http.post(format!("{}/v1/charges", proxy.base))
                .header("Idempotency-Key", key)
                .header("Content-Type", "application/x-www-form-urlencoded")
                .body(body.to_owned())
        };
        let first = send(form(body)).await.unwrap();
        assert_eq!(
            first.status,
            201,
            "{}",
            String::from_utf8_lossy(&first.body)
        );
        let again = send(form(body)).await.unwrap();
        assert_eq!((again.status, again.replayed()), (201, true));
        assert_eq!(again.body, first.body);
        let other = send(form("amount=2")).await.unwrap();
        assert_eq!(other.json()["code"], "idempotency_key_reused");
        assert_eq!(upstream.of("received", Some(key)).len(), 1);
    }

    // A keyed route without a key is refused before anything is forwarded.
    let keyless = send(
        http.post(format!("{}/v1/charges", proxy.base))
            .header("Content-Type", "application/json")
            .body("{}"),
    )
    .await
    .unwrap();
    assert_eq!(keyless.status, 400);
    assert_eq!(keyless.json()["code"], "missing_idempotency_key");
    assert_eq!(upstream.of("received", None).len(), 3);
}

/// Sends a keyed request that the upstream holds, waits for its effect, kills the proxy with
/// SIGKILL, and starts it again on the same store.
async fn crash_mid_request(
    dir: &Path,
    upstream: &Upstream,
    path: &str,
    key: &str,
    body: &str,
) -> Proxy {
    let mut proxy = Proxy::start(dir, &upstream.url).await;
    let http = client();
    let request = charge(&http, &proxy.base, path, key, body)
        .header("X-Upstream-Sleep-Ms", "20000")
        .header("X-Request-Timeout", "4000");
    let pending = tokio::spawn(send(request));
    wait_for("the effect", async || {
        (!upstream.of("effect", Some(key)).is_empty()).then_some(())
    })
    .await;
    proxy.kill9().await;
    assert!(
        pending.await.unwrap().is_err(),
        "no answer from a killed proxy"
    );
    // The upstream sees its connection dropped.
    wait_for("the upstream to see the request dropped", async || {
        (!upstream.of("cancelled", Some(key)).is_empty()).then_some(())
    })
    .await;
    Proxy::start(dir, &upstream.url).await
}

#[tokio::test]
async fn a_retry_after_a_crash_answers_outcome_unknown_and_forwards_nothing() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let body = r#"{"amount":999}"#;
    let proxy = crash_mid_request(dir.path(), &upstream, "/v1/charges", "crash-1", body).await;
    let http = client();

    // The retry waits for the dead run's lease to end, then learns that its outcome is
    // unknown: nothing is forwarded again.
    let retry = send(charge(&http, &proxy.base, "/v1/charges", "crash-1", body))
        .await
        .unwrap();
    assert_eq!(
        retry.status,
        500,
        "{}",
        String::from_utf8_lossy(&retry.body)
    );
    assert_eq!(retry.json()["code"], "outcome_unknown");
    let again = send(charge(&http, &proxy.base, "/v1/charges", "crash-1", body))
        .await
        .unwrap();
    assert_eq!((again.status, again.replayed()), (500, true));
    assert_eq!(again.json()["code"], "outcome_unknown");
    assert_eq!(upstream.of("received", Some("crash-1")).len(), 1);
    assert_eq!(upstream.of("effect", Some("crash-1")).len(), 1);
}

#[tokio::test]
async fn after_a_crash_a_route_whose_upstream_dedups_is_forwarded_again_with_the_same_effect_key() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let body = r#"{"amount":7}"#;
    let proxy = crash_mid_request(dir.path(), &upstream, "/dedup/charges", "crash-2", body).await;
    let http = client();

    let retry = send(charge(
        &http,
        &proxy.base,
        "/dedup/charges",
        "crash-2",
        body,
    ))
    .await
    .unwrap();
    assert_eq!(
        retry.status,
        201,
        "{}",
        String::from_utf8_lossy(&retry.body)
    );
    assert!(
        !retry.replayed(),
        "forwarded again, the upstream's own answer"
    );
    let received = upstream.of("received", Some("crash-2"));
    assert_eq!(received.len(), 2, "{received:?}");
    assert_eq!(
        received[0]["effect_key"], received[1]["effect_key"],
        "the same effect key both times"
    );
    assert_eq!(
        upstream.of("effect", Some("crash-2")).len(),
        1,
        "executed once"
    );
    assert_eq!(upstream.of("deduped", Some("crash-2")).len(), 1);
    let effect = &upstream.of("effect", Some("crash-2"))[0];
    assert_eq!(retry.json()["effect_id"], effect["effect_id"]);

    let again = send(charge(
        &http,
        &proxy.base,
        "/dedup/charges",
        "crash-2",
        body,
    ))
    .await
    .unwrap();
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, retry.body);
    assert_eq!(upstream.of("received", Some("crash-2")).len(), 2);
}

#[tokio::test]
async fn a_budget_that_runs_out_is_504_and_the_upstream_sees_the_request_dropped() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    let http = client();

    let started = std::time::Instant::now();
    let late = send(
        http.get(format!("{}/v1/charges/c-1", proxy.base))
            .header("X-Request-Timeout", "1000")
            .header("X-Upstream-Sleep-Ms", "20000"),
    )
    .await
    .unwrap();
    assert_eq!(late.status, 504);
    assert_eq!(late.json()["code"], "deadline_exceeded");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "cut at the deadline"
    );
    wait_for("the upstream to see the request dropped", async || {
        upstream
            .of("cancelled", None)
            .into_iter()
            .find(|e| e["path"] == "/v1/charges/c-1")
    })
    .await;
    // The upstream got the budget in the caller's form, less what the proxy spent.
    let received = &upstream.of("received", None)[0];
    let ms: u64 = received["x_request_timeout"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..1000).contains(&ms), "{ms}");
    assert!(received["grpc_timeout"].is_null());

    // gRPC's header form goes out as grpc-timeout.
    let quick = send(
        http.get(format!("{}/v1/charges/c-2", proxy.base))
            .header("grpc-timeout", "2S"),
    )
    .await
    .unwrap();
    assert_eq!(quick.status, 200);
    let echo = quick.json()["echo"].clone();
    let timeout = echo["grpc_timeout"].as_str().unwrap();
    let budget = backstop::deadline::decode_grpc_timeout(timeout).unwrap();
    assert!(
        budget < Duration::from_secs(2) && budget > Duration::from_secs(1),
        "{timeout}"
    );
}

#[tokio::test]
async fn unknown_routes_pass_through_and_callers_cannot_choose_the_effect_key() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    let http = client();

    let get = send(
        http.get(format!("{}/anything/at/all?x=1", proxy.base))
            .header("Idempotency-Effect-Key", "forged"),
    )
    .await
    .unwrap();
    assert_eq!(get.status, 200);
    let echo = get.json()["echo"].clone();
    assert_eq!(echo["path"], "/anything/at/all?x=1");
    assert!(
        echo["effect_key"].is_null(),
        "a caller's effect key is removed"
    );
    assert_eq!(echo["x_forwarded_for"], "127.0.0.1");
    assert!(
        echo["grpc_timeout"].is_string(),
        "the fallback's budget goes along"
    );

    // An unknown POST is forwarded as it came, key or no key, and never deduplicated.
    for _ in 0..2 {
        let post = send(
            http.post(format!("{}/v2/other", proxy.base))
                .header("Idempotency-Key", "not-a-keyed-route")
                .body("not json"),
        )
        .await
        .unwrap();
        assert_eq!(post.status, 201);
        assert!(!post.replayed());
    }
    assert_eq!(upstream.of("effect", Some("not-a-keyed-route")).len(), 2);
    // A body larger than what the proxy keeps to send again streams through, once.
    let large = vec![b'x'; 3 << 20];
    let upload = send(http.post(format!("{}/v2/upload", proxy.base)).body(large))
        .await
        .unwrap();
    assert_eq!(upload.status, 201);
    let uploads: Vec<Value> = upstream
        .of("received", None)
        .into_iter()
        .filter(|e| e["path"] == "/v2/upload")
        .collect();
    assert_eq!(uploads.len(), 1);
    assert_eq!(uploads[0]["body_len"], 3 << 20);
    // The upstream's own status passes through.
    let teapot = send(
        http.get(format!("{}/brew", proxy.base))
            .header("X-Upstream-Status", "418"),
    )
    .await
    .unwrap();
    assert_eq!(teapot.status, 418);
}

#[tokio::test]
async fn an_upstream_that_is_down_is_503_with_retry_after_and_the_key_stays_unused() {
    let dir = tempfile::tempdir().unwrap();
    // A port nobody listens on.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let proxy = Proxy::start(dir.path(), &format!("http://{closed}")).await;
    let http = client();
    for _ in 0..2 {
        let answer = send(charge(&http, &proxy.base, "/v1/charges", "down-1", "{}"))
            .await
            .unwrap();
        assert_eq!(
            answer.status,
            503,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(answer.json()["code"], "upstream_unavailable");
        assert!(answer.headers.contains_key("retry-after"));
    }
}

#[tokio::test]
async fn sigterm_lets_a_request_in_flight_finish() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let mut proxy = Proxy::start(dir.path(), &upstream.url).await;
    let http = client();
    let pending = tokio::spawn(send(
        charge(&http, &proxy.base, "/v1/charges", "drain-1", "{}")
            .header("X-Upstream-Sleep-Ms", "3000"),
    ));
    wait_for("the effect", async || {
        (!upstream.of("effect", Some("drain-1")).is_empty()).then_some(())
    })
    .await;
    let pid = proxy.child.id().unwrap().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(sent.success());
    // While it drains, the admin port says so (and still serves the metrics).
    wait_for("/readyz to say draining", async || {
        let r = http
            .get(format!("{}/readyz", proxy.admin))
            .send()
            .await
            .ok()?;
        (r.status() == 503).then_some(())
    })
    .await;
    let answer = pending.await.unwrap().unwrap();
    assert_eq!(answer.status, 201);
    let status = tokio::time::timeout(PATIENCE, proxy.child.wait())
        .await
        .expect("the proxy exits after the drain")
        .unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn check_config_explains_a_good_file_and_names_the_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(&good, ROUTES).unwrap();
    let out = Command::new(BIN)
        .args(["proxy", "--check-config"])
        .arg(&good)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    for want in [
        "POST /v1/charges (CreateCharge):",
        "answered 500 outcome_unknown",
        "POST /dedup/charges (DedupCharge):",
        "forwarded again with the same effect key",
        "fallback (other):",
    ] {
        assert!(text.contains(want), "{want}:\n{text}");
    }

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[policies.route]]\nmatch = \"POST /v1/charges\"\nidempotency = \"keyed\"\nretrys = 2\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["proxy", "--check-config"])
        .arg(&bad)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let error = String::from_utf8(out.stderr).unwrap();
    assert!(
        error.contains("retrys") && error.contains("bad.toml"),
        "{error}"
    );

    // The same file given to a proxy stops it at start, naming the key.
    let out = Command::new(BIN)
        .args(["proxy", "--upstream", "http://127.0.0.1:9", "--config"])
        .arg(&bad)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("retrys"));
}

#[tokio::test]
async fn a_keyed_grpc_method_is_forwarded_once_over_h2c_and_streams_pass_through() {
    if !python::python_ready("grpc", "the proxy's gRPC test", "grpcio==1.85.1").await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start_grpc(dir.path()).await;
    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    let target = proxy.base.strip_prefix("http://").unwrap();

    let out = python::output_of(
        "the gRPC calls through the proxy",
        python::python3()
            .arg(support("grpc_upstream.py"))
            .args(["call", "--target", target, "--key", "g-1", "--count", "6"])
            .args(["--payload", "0a03616263"]),
    )
    .await;
    let results: Vec<Value> = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(results.len(), 6);
    let first = &results[0]["response"];
    assert!(first.is_string(), "{results:?}");
    assert!(
        results.iter().all(|r| r["response"] == *first),
        "{results:?}"
    );
    assert_eq!(
        results.iter().filter(|r| r["replayed"] == false).count(),
        1,
        "{results:?}"
    );
    let effects = upstream.of("effect", Some("g-1"));
    assert_eq!(effects.len(), 1, "{effects:?}");
    assert_eq!(effects[0]["effect_key"].as_str().map(str::len), Some(32));
    // The caller's 20 s budget (not the route's 3 s) reached the upstream. Written back in the
    // unit the caller used, it can come out a fraction of that unit above what was left (seen:
    // 20.085 s), so the bound allows one second over.
    let left = effects[0]["time_remaining"].as_f64();
    assert!(
        left.is_some_and(|left| left > 3.0 && left < 21.0),
        "{:?}",
        effects[0]
    );

    // A streaming method is not keyed: it passes through.
    let out = python::output_of(
        "the gRPC stream through the proxy",
        python::python3()
            .arg(support("grpc_upstream.py"))
            .args(["watch", "--target", target]),
    )
    .await;
    let messages: Vec<String> = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(messages, ["update:0", "update:1", "update:2"]);
}

#[tokio::test]
async fn keys_are_scoped_by_the_scope_header() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let mut command = Proxy::command(dir.path(), &upstream.url);
    command.args(["--scope-header", "X-Api-Key"]);
    let proxy = Proxy::spawn(command).await;
    let http = client();
    let as_caller = |caller: &str| {
        charge(
            &http,
            &proxy.base,
            "/v1/charges",
            "shared-1",
            r#"{"amount":5}"#,
        )
        .header("X-Api-Key", caller.to_owned())
    };

    let a = send(as_caller("caller-a")).await.unwrap();
    let b = send(as_caller("caller-b")).await.unwrap();
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!b.replayed(), "another caller's key is its own");
    assert_ne!(a.body, b.body);
    let a_again = send(as_caller("caller-a")).await.unwrap();
    assert!(a_again.replayed());
    assert_eq!(a_again.body, a.body);
    assert_eq!(upstream.of("effect", Some("shared-1")).len(), 2);
    let db = std::fs::read(dir.path().join("proxy.db")).unwrap();
    assert!(
        !db.windows(8).any(|w| w == b"caller-a"),
        "only a hash of the scope is stored"
    );
}

#[tokio::test]
async fn several_upstreams_share_the_requests() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let one = Upstream::start(dir.path()).await;
    let two = Upstream::start(dir.path()).await;
    let store = format!("sqlite://{}", dir.path().join("proxy.db").display());
    let proxy = Proxy::spawn(Proxy::command_on(
        dir.path(),
        &[&one.url, &two.url],
        &store,
        "127.0.0.1:0",
    ))
    .await;
    let http = client();
    for i in 0..40 {
        let answer = send(http.get(format!("{}/v1/charges/c-{i}", proxy.base)))
            .await
            .unwrap();
        assert_eq!(answer.status, 200);
    }
    let (a, b) = (
        one.of("received", None).len(),
        two.of("received", None).len(),
    );
    assert_eq!(a + b, 40);
    assert!(a > 0 && b > 0, "{a} and {b}");
}

#[tokio::test]
async fn two_proxies_sharing_postgresql_forward_a_key_once() {
    if !services::postgres() || !python_ready().await {
        return;
    }
    let schema = postgres_schema::Schema::create("proxy").await;
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let store = schema.store_url(None);
    let first = Proxy::spawn(Proxy::command_on(
        dir.path(),
        &[&upstream.url],
        &store,
        "127.0.0.1:0",
    ))
    .await;
    let second = Proxy::spawn(Proxy::command_on(
        dir.path(),
        &[&upstream.url],
        &store,
        "127.0.0.1:0",
    ))
    .await;
    let http = client();

    let mut calls = Vec::new();
    for i in 0..8 {
        let base = if i % 2 == 0 {
            &first.base
        } else {
            &second.base
        };
        let request = charge(&http, base, "/v1/charges", "pg-1", r#"{"amount":3}"#)
            .header("X-Upstream-Sleep-Ms", "300");
        calls.push(tokio::spawn(send(request)));
    }
    let mut bodies = Vec::new();
    for call in calls {
        let answer = call.await.unwrap().unwrap();
        assert_eq!(
            answer.status,
            201,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
        bodies.push(answer.body);
    }
    assert!(bodies.iter().all(|b| *b == bodies[0]));
    assert_eq!(upstream.of("effect", Some("pg-1")).len(), 1);
    assert_eq!(schema.count("idempotency_record").await, 1);
}

#[tokio::test]
async fn an_answer_lost_on_the_way_back_is_not_forwarded_again_unless_the_upstream_dedups() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    let http = client();
    let body = r#"{"amount":11}"#;
    // The upstream executes the effect and closes the connection without answering.
    let lossy = |path: &str, key: &str| {
        charge(&http, &proxy.base, path, key, body)
            .header("X-Upstream-Drop", "1")
            .header("X-Request-Timeout", "2000")
    };

    // By default the key is never forwarded again: the caller learns that the outcome is
    // unknown, and so does its retry once the run's lease ends.
    let lost = send(lossy("/v1/charges", "lost-1")).await.unwrap();
    assert_eq!(lost.status, 502, "{}", String::from_utf8_lossy(&lost.body));
    assert_eq!(lost.json()["code"], "upstream_outcome_unknown");
    let retry = send(charge(&http, &proxy.base, "/v1/charges", "lost-1", body))
        .await
        .unwrap();
    assert_eq!(
        retry.status,
        500,
        "{}",
        String::from_utf8_lossy(&retry.body)
    );
    assert_eq!(retry.json()["code"], "outcome_unknown");
    assert_eq!(upstream.of("received", Some("lost-1")).len(), 1);

    // Where the upstream deduplicates by the effect key, the proxy's own retry sends it again
    // under the same one (from the retry budget) and gets the upstream's answer to the first.
    let recovered = send(lossy("/dedup/charges", "lost-2")).await.unwrap();
    assert_eq!(
        recovered.status,
        201,
        "{}",
        String::from_utf8_lossy(&recovered.body)
    );
    let received = upstream.of("received", Some("lost-2"));
    assert_eq!(received.len(), 2);
    assert_eq!(received[0]["effect_key"], received[1]["effect_key"]);
    let effects = upstream.of("effect", Some("lost-2"));
    assert_eq!(effects.len(), 1);
    assert_eq!(recovered.json()["effect_id"], effects[0]["effect_id"]);
    let again = send(charge(&http, &proxy.base, "/dedup/charges", "lost-2", body))
        .await
        .unwrap();
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(upstream.of("received", Some("lost-2")).len(), 2);

    // The retry is counted as the client stack counts its own.
    let metrics = http
        .get(format!("{}/metrics", proxy.admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let retries = metrics
        .lines()
        .find(|l| {
            l.starts_with("rpc_client_retries_total")
                && l.contains(r#"service="upstream""#)
                && l.contains(r#"method="DedupCharge""#)
        })
        .unwrap_or_else(|| panic!("no retry counted:\n{metrics}"));
    assert!(retries.ends_with(" 1"), "{retries}");
}

#[tokio::test]
async fn retries_are_spent_only_where_sending_again_is_safe() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    let http = client();
    let received = |path: &str| {
        upstream
            .of("received", None)
            .into_iter()
            .filter(|e| e["path"] == path)
            .count()
    };

    // A safe route: a 503 is tried again, up to its attempts (3 by default).
    let read = send(
        http.get(format!("{}/v1/charges/c-9", proxy.base))
            .header("X-Upstream-Status", "503"),
    )
    .await
    .unwrap();
    assert_eq!(read.status, 503, "the upstream's last answer");
    assert_eq!(received("/v1/charges/c-9"), 3);

    // A keyed route whose upstream does not deduplicate, and a route no one declared: sent
    // once, whatever the answer.
    let keyed = send(
        charge(&http, &proxy.base, "/v1/charges", "busy-1", "{}")
            .header("X-Upstream-Status", "503"),
    )
    .await
    .unwrap();
    assert_eq!(keyed.status, 503);
    assert_eq!(upstream.of("received", Some("busy-1")).len(), 1);
    let unknown = send(
        http.post(format!("{}/v2/other", proxy.base))
            .header("X-Upstream-Status", "503")
            .body("x"),
    )
    .await
    .unwrap();
    assert_eq!(unknown.status, 503);
    assert_eq!(received("/v2/other"), 1);
}

#[tokio::test]
async fn a_failing_upstream_gets_no_retry_storm() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    let http = client();

    // 100 reads of a safe route (3 attempts each allowed) while the upstream answers 503.
    const READS: usize = 100;
    let mut callers = Vec::new();
    for c in 0..10 {
        let (http, base) = (http.clone(), proxy.base.clone());
        callers.push(tokio::spawn(async move {
            let mut refused = 0;
            for i in 0..READS / 10 {
                let answer = send(
                    http.get(format!("{base}/v1/charges/s-{c}-{i}"))
                        .header("X-Upstream-Status", "503"),
                )
                .await
                .unwrap();
                assert_eq!(answer.status, 503);
                if answer.json()["code"] == "circuit_open" {
                    assert!(answer.headers.contains_key("retry-after"));
                    refused += 1;
                }
            }
            refused
        }));
    }
    let mut refused = 0;
    for caller in callers {
        refused += caller.await.unwrap();
    }
    // Retries come from the budget (10 % of requests plus a burst of 20), stop when the storm
    // alarm trips, and the breaker stops sending at all once most calls fail: nowhere near the
    // 300 sends three attempts each would make.
    let sent = upstream.of("received", None).len();
    assert!(sent <= READS + READS / 10 + 20, "{sent} sends");
    assert!(refused > 0, "the circuit opened");
    assert!(sent + refused >= READS, "{sent} sent, {refused} refused");
}

#[tokio::test]
async fn beyond_max_inflight_requests_queue_or_get_503_with_retry_after() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let mut command = Proxy::command(dir.path(), &upstream.url);
    command.args(["--max-inflight", "2", "--queue-size", "2"]);
    let proxy = Proxy::spawn(command).await;
    let http = client();

    // Twelve slow requests at once against two places and a queue of two.
    let mut calls = Vec::new();
    for i in 0..12 {
        let request = charge(
            &http,
            &proxy.base,
            "/v1/charges",
            &format!("busy-{i}"),
            "{}",
        )
        .header("X-Upstream-Sleep-Ms", "500")
        .header("X-Request-Timeout", "5000");
        calls.push(tokio::spawn(send(request)));
    }
    let (mut served, mut shed) = (0, 0);
    for call in calls {
        let answer = call.await.unwrap().unwrap();
        match answer.status {
            201 => served += 1,
            503 => {
                assert_eq!(answer.json()["code"], "overloaded");
                let wait: u64 = answer.headers["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!(wait >= 1, "{wait}");
                shed += 1;
            }
            other => panic!("{other}: {}", String::from_utf8_lossy(&answer.body)),
        }
    }
    assert_eq!(served + shed, 12);
    assert!(served >= 2 && shed >= 1, "{served} served, {shed} shed");
    // The upstream never had more than two of them at once, and saw only the served ones.
    let received = upstream.of("received", None);
    assert_eq!(received.len(), served);
    let most = received
        .iter()
        .filter_map(|e| e["in_flight"].as_u64())
        .max()
        .unwrap();
    assert!(most <= 2, "{most} at once");
}

#[tokio::test]
async fn at_five_times_the_upstreams_capacity_goodput_stays_near_it() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Four workers, 100 ms a request: 40 requests a second.
    let upstream = Upstream::start_script(dir.path(), "upstream.py", &["--workers", "4"]).await;
    let mut command = Proxy::command(dir.path(), &upstream.url);
    command.args(["--max-inflight", "4"]);
    let proxy = Proxy::spawn(command).await;
    let http = client();

    // 200 requests a second for three seconds, open loop, each with a one second budget.
    const OFFERED: usize = 600;
    let mut ticks = tokio::time::interval(Duration::from_millis(5));
    let mut calls = Vec::with_capacity(OFFERED);
    for i in 0..OFFERED {
        ticks.tick().await;
        let request = http
            .get(format!("{}/v1/charges/o-{i}", proxy.base))
            .header("X-Upstream-Sleep-Ms", "100")
            .header("X-Request-Timeout", "1000");
        calls.push(tokio::spawn(send(request)));
    }
    let (mut served, mut shed, mut late) = (0, 0, 0);
    for call in calls {
        let answer = call.await.unwrap().unwrap();
        match answer.status {
            200 => served += 1,
            503 => shed += 1,
            504 => late += 1,
            other => panic!("{other}: {}", String::from_utf8_lossy(&answer.body)),
        }
    }
    eprintln!("goodput: {served} served, {shed} shed, {late} late of {OFFERED}");
    // Three seconds of capacity are 120 requests: most of them are served, in time, and the
    // excess is refused at once instead of waiting until its budget is gone.
    assert!(served >= 72, "{served} served, {shed} shed, {late} late");
    assert!(shed > served, "{served} served, {shed} shed, {late} late");
    assert!(
        late <= OFFERED / 20,
        "{served} served, {shed} shed, {late} late"
    );
    let most = upstream
        .of("received", None)
        .iter()
        .filter_map(|e| e["in_flight"].as_u64())
        .max()
        .unwrap();
    assert!(most <= 4, "{most} at once");
}

/// Sends `key` until a final answer (201, or 500 `outcome_unknown`), through whatever proxy
/// answers at `base`, retrying with the same key and body after anything else.
async fn until_final(http: &reqwest::Client, base: &str, path: &str, key: &str) -> Answer {
    let body = format!(r#"{{"key":"{key}"}}"#);
    let give_up = tokio::time::Instant::now() + PATIENCE;
    loop {
        let request = charge(http, base, path, key, &body)
            .header("X-Upstream-Sleep-Ms", "150")
            .header("X-Request-Timeout", "2000")
            .timeout(Duration::from_secs(10));
        if let Ok(answer) = send(request).await {
            let code = answer.json()["code"].clone();
            if answer.status == 201 || code == "outcome_unknown" {
                return answer;
            }
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "{key}: no final answer"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn keys_retried_through_sigkills_of_the_proxy_are_executed_at_most_once() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    // One address for every incarnation of the proxy, so that clients find the next one.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = || {
        Proxy::spawn(Proxy::command_at(
            dir.path(),
            &upstream.url,
            &format!("127.0.0.1:{port}"),
        ))
    };
    let mut proxy = start().await;
    let base = format!("http://127.0.0.1:{port}");
    assert_eq!(proxy.base, base);

    // Thirty keys, half on a route whose upstream deduplicates by the effect key, each sent
    // until it has a final answer while the proxy is killed with SIGKILL and started again.
    let http = client();
    let mut clients = Vec::new();
    for i in 0..30 {
        let (http, base) = (http.clone(), base.clone());
        let path = if i % 2 == 0 {
            "/v1/charges"
        } else {
            "/dedup/charges"
        };
        let key = format!("chaos-{i}");
        clients.push(tokio::spawn(async move {
            // Spread over the kills (load shaping, not synchronisation).
            tokio::time::sleep(Duration::from_millis(60 * i)).await;
            let answer = until_final(&http, &base, path, &key).await;
            (path, key, answer)
        }));
    }
    for _ in 0..4 {
        // Each kill lands while requests are at the upstream, a few requests after the last.
        let seen = upstream.of("received", None).len();
        wait_for("requests at the upstream", async || {
            (upstream.of("received", None).len() >= seen + 4).then_some(())
        })
        .await;
        proxy.kill9().await;
        proxy = start().await;
    }
    let mut finals = Vec::new();
    for client in clients {
        finals.push(client.await.unwrap());
    }

    let (mut acked, mut unknown) = (0, 0);
    for (path, key, answer) in &finals {
        let effects = upstream.of("effect", Some(key)).len();
        assert!(effects <= 1, "{key}: executed {effects} times");
        if answer.status == 201 {
            acked += 1;
            assert_eq!(effects, 1, "{key}: acknowledged, so executed");
            // Every later retry gets the acknowledged answer, byte for byte.
            let replay = until_final(&http, &base, path, key).await;
            assert_eq!(replay.body, answer.body, "{key}");
            assert!(replay.replayed(), "{key}");
        } else {
            unknown += 1;
            assert_eq!(
                *path, "/v1/charges",
                "{key}: a deduplicating route always converges"
            );
        }
        let received = upstream.of("received", Some(key));
        let effect_keys: std::collections::BTreeSet<_> = received
            .iter()
            .map(|e| e["effect_key"].to_string())
            .collect();
        assert_eq!(
            effect_keys.len(),
            1,
            "{key}: one effect key for every forward"
        );
    }
    eprintln!("chaos: {acked} acknowledged, {unknown} outcome_unknown, 4 kills");
    assert_eq!(acked + unknown, 30);
}
