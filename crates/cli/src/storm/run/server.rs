//! A `backstop serve` child: started on a fresh store, sampled through its `/metrics` and
//! `/proc`, and stopped with a drain.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::plan::{MS, S};

/// What the sampler saw at one moment.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sample {
    pub(super) t: Duration,
    pub(super) limit: Option<f64>,
    pub(super) inflight: Option<f64>,
    pub(super) queue: Option<f64>,
    pub(super) rss_mib: Option<f64>,
}

/// A `backstop serve` child process.
pub(super) struct Server {
    child: Child,
    pub(super) http: String,
    /// Keeps the log pipe drained.
    _logs: tokio::task::JoinHandle<()>,
}

impl Server {
    pub(super) async fn start(
        db: &Path,
        psp: &str,
        flags: &[&str],
    ) -> Result<Server, Box<dyn std::error::Error>> {
        let mut child = Command::new(std::env::current_exe()?)
            .args([
                "--log-format",
                "json",
                "serve",
                "--http",
                "127.0.0.1:0",
                "--grpc",
                "127.0.0.1:0",
            ])
            .arg("--store")
            .arg(format!("sqlite://{}", db.display()))
            .args(["--psp", psp])
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stderr = child.stderr.take().ok_or("no stderr pipe")?;
        let mut lines = BufReader::new(stderr).lines();
        let http = tokio::time::timeout(S(60), async {
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                if v["fields"]["message"] == "payment service listening" {
                    return v["fields"]["http"].as_str().map(str::to_owned);
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
        .ok_or("serve did not start (see its flags)")?;
        let logs = tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Server {
            child,
            http,
            _logs: logs,
        })
    }

    pub(super) async fn sample(&self, http: &reqwest::Client, t: Duration) -> Sample {
        let text = match http
            .get(format!("http://{}/metrics", self.http))
            .timeout(MS(500))
            .send()
            .await
        {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        let gauge = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse().ok())
        };
        Sample {
            t,
            limit: gauge("rpc_server_concurrency_limit"),
            inflight: gauge("rpc_server_concurrency_inflight"),
            queue: gauge("rpc_server_queue_length"),
            rss_mib: self.child.id().and_then(rss_mib),
        }
    }

    /// Intents left `running`, read from the store once the load has stopped.
    pub(super) async fn running_intents(&self, db: &Path) -> Option<u64> {
        let db = db.to_owned();
        tokio::task::spawn_blocking(move || {
            let conn = rusqlite::Connection::open_with_flags(
                &db,
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
            )
            .ok()?;
            conn.query_row(
                "SELECT COUNT(*) FROM payment_intent WHERE status = 'running'",
                [],
                |r| r.get::<_, i64>(0),
            )
            .ok()
            .and_then(|n| u64::try_from(n).ok())
        })
        .await
        .ok()
        .flatten()
    }

    pub(super) async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            // SIGTERM: the service drains; SIGKILL after the bound if it does not.
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        if tokio::time::timeout(S(15), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// Resident memory of process `pid`, in MiB (Linux).
fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}
