//! A `backstop serve` child process for tests: started on free ports, its log drained for the
//! life of the child, handed back once `/healthz` answers.

// Each test binary uses what it needs of this module.
#![allow(dead_code)]

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// The binary under test.
pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_backstop");

/// A running `backstop serve` and what it logged.
pub(crate) struct ServeProcess {
    /// The child, killed when dropped.
    pub(crate) child: Child,
    /// `http://` and the HTTP listener's address.
    pub(crate) base: String,
    /// The gRPC listener's address (no scheme).
    pub(crate) grpc: String,
    /// The "payment service listening" log line (the settings the service started with).
    pub(crate) listening: Value,
    /// The log lines after the "listening" one, kept so the pipe never fills.
    pub(crate) logs: mpsc::UnboundedReceiver<String>,
}

/// `backstop serve` on free loopback ports; the caller adds the store and its own flags.
pub(crate) fn serve_command() -> Command {
    let mut command = Command::new(BIN);
    command.args(["serve", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"]);
    command
}

/// Spawns `command` (from [`serve_command`], or a wrapper that `exec`s it), waits for the
/// service to log its addresses and for `/healthz` to answer 200 through `http`.
pub(crate) async fn spawn(mut command: Command, http: &reqwest::Client) -> ServeProcess {
    let mut child = command
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("backstop binary starts");
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, mut logs) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let (http_addr, grpc, listening) = loop {
        let line = logs
            .recv()
            .await
            .expect("the server logs its address before exiting");
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if v["fields"]["message"] == "payment service listening" {
            let field = |name: &str| v["fields"][name].as_str().expect("address").to_owned();
            break (field("http"), field("grpc"), v);
        }
    };
    let base = format!("http://{http_addr}");
    // Readiness: poll /healthz (no fixed sleep before it).
    for _ in 0..1000 {
        if let Ok(r) = http.get(format!("{base}/healthz")).send().await {
            if r.status() == 200 {
                return ServeProcess {
                    child,
                    base,
                    grpc,
                    listening,
                    logs,
                };
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the server never became healthy");
}
