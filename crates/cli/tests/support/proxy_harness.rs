//! What the `backstop proxy` tests share: the Python upstreams (`upstream.py`,
//! `grpc_upstream.py`) and the events they record, a proxy process in front of them, and the
//! requests a test sends through it.
//!
//! Nothing here synchronises by sleeping: a test waits for a condition ([`wait_for`]),
//! bounded by [`PATIENCE`].
//!
//! Needs the including test to declare the `python` support module at its root.

// Each test binary uses what it needs of this module.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::python;

/// The binary under test.
pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_backstop");

/// Longest wait for anything a test waits on.
pub(crate) const PATIENCE: Duration = Duration::from_secs(30);

/// The routes file every proxy of the tests reads unless told otherwise.
pub(crate) const ROUTES: &str = r#"
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
pub(crate) async fn python_ready() -> bool {
    python::python_ready("json, http.server", "the proxy tests", "(python3 itself)").await
}

/// Waits until `check` answers `Some`, looking every 20 ms for at most [`PATIENCE`].
pub(crate) async fn wait_for<T>(what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
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

/// A file of `tests/support/`.
pub(crate) fn support(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/support")
        .join(name)
}

/// A port free a moment ago on 127.0.0.1: for a process that must come back on the same
/// address, or an address nobody listens on.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A Python upstream, killed when dropped.
pub(crate) struct Upstream {
    child: Child,
    /// `http://` and its address.
    pub(crate) url: String,
    events: PathBuf,
}

impl Upstream {
    /// The HTTP upstream (`support/upstream.py`), its events file in `dir`.
    pub(crate) async fn start(dir: &Path) -> Upstream {
        Self::start_script(dir, "upstream.py", &[]).await
    }

    /// The gRPC upstream (`support/grpc_upstream.py serve`).
    pub(crate) async fn start_grpc(dir: &Path) -> Upstream {
        Self::start_script(dir, "grpc_upstream.py", &["serve"]).await
    }

    /// `script` with `args`, on a port of its choosing.
    pub(crate) async fn start_script(dir: &Path, script: &str, args: &[&str]) -> Upstream {
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
            child,
            url: format!("http://{addr}"),
            events,
        }
    }

    /// Kills the upstream (SIGKILL) and waits for it to be gone.
    pub(crate) async fn kill(&mut self) {
        self.child.kill().await.expect("SIGKILL");
    }

    /// Every event recorded so far.
    pub(crate) fn events(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.events)
            .unwrap()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).expect("an events line is JSON"))
            .collect()
    }

    /// The events of kind `event` for requests with `key` (or any, with `None`).
    pub(crate) fn of(&self, event: &str, key: Option<&str>) -> Vec<Value> {
        self.events()
            .into_iter()
            .filter(|e| e["event"] == event && key.is_none_or(|k| e["key"] == k))
            .collect()
    }

    /// The effects executed for `key`.
    pub(crate) fn effects(&self, key: &str) -> Vec<Value> {
        self.of("effect", Some(key))
    }

    /// The requests received with `key`.
    pub(crate) fn received(&self, key: &str) -> Vec<Value> {
        self.of("received", Some(key))
    }

    /// How many requests for `path` (with its query) were received.
    pub(crate) fn received_at(&self, path: &str) -> usize {
        self.of("received", None)
            .iter()
            .filter(|e| e["path"] == path)
            .count()
    }

    /// The most requests the upstream had in flight at once.
    pub(crate) fn most_in_flight(&self) -> u64 {
        self.of("received", None)
            .iter()
            .filter_map(|e| e["in_flight"].as_u64())
            .max()
            .unwrap_or(0)
    }
}

/// How to start a `backstop proxy`: [`Proxy::options`], then [`ProxyOptions::start`].
#[derive(Debug, Clone)]
pub(crate) struct ProxyOptions {
    dir: PathBuf,
    upstreams: Vec<String>,
    store: String,
    listen: String,
    routes: String,
    args: Vec<String>,
}

impl ProxyOptions {
    /// Keeps the records in `store` instead of `DIR/proxy.db`.
    pub(crate) fn store(mut self, store: &str) -> Self {
        self.store = store.to_owned();
        self
    }

    /// Listens on `listen` instead of a port of the system's choosing.
    pub(crate) fn listen(mut self, listen: &str) -> Self {
        self.listen = listen.to_owned();
        self
    }

    /// Reads `routes` instead of [`ROUTES`].
    pub(crate) fn routes(mut self, routes: &str) -> Self {
        self.routes = routes.to_owned();
        self
    }

    /// Adds command-line arguments.
    pub(crate) fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    /// The routes file the proxy reads (`--config`): named by its first content, so that
    /// proxies started alike share one.
    pub(crate) fn routes_file(&self) -> PathBuf {
        self.dir.join(format!(
            "routes-{:016x}.toml",
            fxhash(self.routes.as_bytes())
        ))
    }

    /// The command these options make.
    pub(crate) fn command(&self) -> Command {
        let routes = self.routes_file();
        if !routes.exists() {
            std::fs::write(&routes, &self.routes).unwrap();
        }
        let mut command = Command::new(BIN);
        command.args(["proxy", "--listen", &self.listen, "--admin", "127.0.0.1:0"]);
        for upstream in &self.upstreams {
            command.args(["--upstream", upstream]);
        }
        command
            .arg("--config")
            .arg(&routes)
            .args(["--store", &self.store])
            .args(["--lease", "1s", "--drain-timeout", "5s"])
            .args(&self.args);
        command
    }

    /// Starts the proxy and waits until it listens.
    pub(crate) async fn start(&self) -> Proxy {
        Proxy::spawn(self.command()).await
    }
}

/// A stable hash, to name a routes file by its content.
fn fxhash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A running `backstop proxy`, killed when dropped.
pub(crate) struct Proxy {
    pub(crate) child: Child,
    /// `http://` and the proxy's address.
    pub(crate) base: String,
    /// `http://` and the admin address (`/metrics`, `/readyz`).
    pub(crate) admin: String,
    /// Its "proxy listening" log line, as JSON.
    pub(crate) listening: Value,
    /// Its log lines (JSON) after "proxy listening".
    logs: mpsc::UnboundedReceiver<String>,
}

impl Proxy {
    /// A proxy in front of `upstreams`, its records in `DIR/proxy.db`, reading [`ROUTES`].
    pub(crate) fn options(dir: &Path, upstreams: &[&str]) -> ProxyOptions {
        ProxyOptions {
            dir: dir.to_owned(),
            upstreams: upstreams.iter().map(|u| (*u).to_owned()).collect(),
            store: format!("sqlite://{}", dir.join("proxy.db").display()),
            listen: "127.0.0.1:0".to_owned(),
            routes: ROUTES.to_owned(),
            args: Vec::new(),
        }
    }

    /// The proxy of [`options`](Self::options) with nothing changed, started.
    pub(crate) async fn start(dir: &Path, upstream: &str) -> Proxy {
        Self::options(dir, &[upstream]).start().await
    }

    /// Starts `command` and waits for its "proxy listening" log line.
    pub(crate) async fn spawn(mut command: Command) -> Proxy {
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
            listening,
            logs,
        }
    }

    /// SIGKILL, and wait for the process to be gone.
    pub(crate) async fn kill9(&mut self) {
        self.child.kill().await.expect("SIGKILL");
    }

    /// The next log line whose message is `message`, as JSON, waiting for it at most
    /// [`PATIENCE`].
    pub(crate) async fn log(&mut self, message: &str) -> Value {
        tokio::time::timeout(PATIENCE, async {
            loop {
                let line = self.logs.recv().await.expect("the proxy runs");
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                if v["fields"]["message"] == message {
                    return v;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("gave up waiting for the log line {message:?}"))
    }

    /// Sends SIGHUP and waits for the log line of its reload (`policies reloaded`) or its
    /// refusal (`policy reload refused; ...`), whichever comes; that line, as JSON.
    pub(crate) async fn hangup(&mut self) -> Value {
        let pid = self.child.id().expect("the proxy runs").to_string();
        let status = std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap();
        assert!(status.success());
        tokio::time::timeout(PATIENCE, async {
            loop {
                let line = self.logs.recv().await.expect("the proxy runs");
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                let message = v["fields"]["message"].as_str().unwrap_or_default();
                if message == "policies reloaded" || message.starts_with("policy reload refused") {
                    return v;
                }
            }
        })
        .await
        .expect("the proxy logs the reload")
    }

    /// The proxy's `/metrics` page.
    pub(crate) async fn metrics(&self) -> String {
        client()
            .get(format!("{}/metrics", self.admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

/// The common case: a temporary directory, the Python HTTP upstream, a proxy in front of it
/// and a client. Fields drop in reverse order of need: the proxy before the upstream, the
/// directory last. A test that destructures one binds every field (`dir: _dir`): with `..`
/// the fields left out are dropped at once (the upstream killed, the directory deleted).
pub(crate) struct Rig {
    pub(crate) http: reqwest::Client,
    pub(crate) proxy: Proxy,
    pub(crate) upstream: Upstream,
    pub(crate) dir: tempfile::TempDir,
}

impl Rig {
    /// A proxy with [`ROUTES`] and `args` in front of the Python HTTP upstream; `None` (the
    /// test is skipped, with a message) without python3.
    pub(crate) async fn start(args: &[&str]) -> Option<Rig> {
        if !python_ready().await {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let upstream = Upstream::start(dir.path()).await;
        let proxy = Proxy::options(dir.path(), &[&upstream.url])
            .args(args)
            .start()
            .await;
        Some(Rig {
            http: client(),
            proxy,
            upstream,
            dir,
        })
    }
}

/// A client that never goes through a proxy from the environment.
pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// An answer: status, headers, body bytes.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: reqwest::header::HeaderMap,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    /// The body as JSON (`Null` if it is not).
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The body as text, for a failing assertion's message.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Whether the proxy replayed a recorded answer.
    pub(crate) fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// Asserts the status, showing the body when it differs.
    #[track_caller]
    pub(crate) fn assert_status(&self, status: u16) {
        assert_eq!(self.status, status, "{}", self.text());
    }
}

/// Sends `request`; an error when no answer came.
pub(crate) async fn send(request: reqwest::RequestBuilder) -> reqwest::Result<Answer> {
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

/// Sends `request`, which must be answered.
pub(crate) async fn call(request: reqwest::RequestBuilder) -> Answer {
    send(request).await.expect("an answer")
}

/// A keyed JSON `POST` of `body` to `base` + `path`.
pub(crate) fn charge(
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

/// One unary gRPC call over h2c to `target` (`HOST:PORT`) with `Idempotency-Key: key` and
/// exactly `grpc-timeout: timeout`, an empty message; the call's `grpc-status`. (A grpcio
/// caller rounds its budget up, by as much as 100 ms on 20 s.)
pub(crate) async fn grpc_unary(
    target: &str,
    path: &str,
    key: &str,
    timeout: &str,
) -> Option<String> {
    use http_body_util::BodyExt;
    let tcp = tokio::net::TcpStream::connect(target).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let request = http::Request::post(format!("http://{target}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", timeout)
        .header("idempotency-key", key)
        // An empty message: not compressed, length zero.
        .body(http_body_util::Full::new(bytes::Bytes::from_static(&[
            0, 0, 0, 0, 0,
        ])))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let (head, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    head.headers
        .get("grpc-status")
        .or_else(|| trailers.get("grpc-status"))
        .map(|v| v.to_str().unwrap().to_owned())
}

/// The value of `rpc_client_breaker_state` for `service` (0 closed, 1 half-open, 2 open).
pub(crate) async fn breaker_state(proxy: &Proxy, service: &str) -> Option<f64> {
    let label = format!(r#"service="{service}""#);
    proxy
        .metrics()
        .await
        .lines()
        .find(|l| l.starts_with("rpc_client_breaker_state{") && l.contains(&label))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The admission limit (`rpc_server_concurrency_limit`).
pub(crate) async fn limit(proxy: &Proxy) -> f64 {
    let metrics = proxy.metrics().await;
    metrics
        .lines()
        .find(|l| l.starts_with("rpc_server_concurrency_limit{"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no limit gauge in\n{metrics}"))
}
