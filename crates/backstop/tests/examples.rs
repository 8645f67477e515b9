//! Every example runs to the end and shows what it says it shows: each starts its own server
//! on 127.0.0.1:0, checks its outcome itself (a non-zero exit status when it is wrong) and
//! prints a line per step; this test runs each binary and reads that output.
//!
//! The binaries are built here with the same cargo (a no-op after `cargo test`, which builds
//! the examples already): `cargo test --test examples` alone would otherwise run stale or
//! missing binaries. No assertion depends on time; the timeout only stops a hung example.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;

const EXAMPLES: [&str; 9] = [
    "two_hop",
    "amplification",
    "sync_retries",
    "fixed_window",
    "payload_costs",
    "axum_server",
    "tonic_server",
    "tonic_client",
    "hyper_client",
];

/// Far beyond what any example needs, even on a loaded machine.
const TIMEOUT: Duration = Duration::from_secs(120);

/// Builds the examples once and returns the path of each executable, as cargo reports it.
fn executables() -> &'static HashMap<String, PathBuf> {
    static BUILT: OnceLock<HashMap<String, PathBuf>> = OnceLock::new();
    BUILT.get_or_init(|| {
        let mut cargo = Command::new(env!("CARGO"));
        cargo
            .args([
                "build",
                "--quiet",
                "--message-format=json-render-diagnostics",
            ])
            .arg("--manifest-path")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
        for name in EXAMPLES {
            cargo.args(["--example", name]);
        }
        let output = cargo.stderr(Stdio::inherit()).output().expect("cargo runs");
        assert!(output.status.success(), "building the examples failed");
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|message| message["reason"] == "compiler-artifact")
            .filter_map(|message| {
                let name = message["target"]["name"].as_str()?.to_owned();
                let executable = message["executable"].as_str()?.into();
                Some((name, executable))
            })
            .collect()
    })
}

/// Runs example `name`, expecting exit status 0 and every line of `expected` in its output.
async fn run(name: &str, expected: &[&str]) {
    let path = executables()
        .get(name)
        .unwrap_or_else(|| panic!("cargo built no example {name}"));
    // On timeout the future is dropped, and with it the child, killed.
    let run = tokio::process::Command::new(path)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(TIMEOUT, run)
        .await
        .unwrap_or_else(|_| panic!("{name} did not finish within {TIMEOUT:?}"))
        .unwrap_or_else(|e| panic!("{name} ({}) does not run: {e}", path.display()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{name} exited with {}\n--- stdout\n{stdout}--- stderr\n{stderr}",
        output.status
    );
    for line in expected {
        assert!(
            stdout.contains(line),
            "{name} did not print {line:?}\n--- stdout\n{stdout}"
        );
    }
}

#[tokio::test]
async fn axum_server() {
    run(
        "axum_server",
        &[
            "idempotent-replayed: true",
            "no key:      400",
            "gate full:   503",
            "metrics:     rpc_server_duration_seconds in ",
            "ok: ",
        ],
    )
    .await;
}

#[tokio::test]
async fn tonic_server() {
    run(
        "tonic_server",
        &[
            "idempotent-replayed: true",
            "no key:     InvalidArgument",
            "gate full:  Unavailable",
            "ok: ",
        ],
    )
    .await;
}

#[tokio::test]
async fn tonic_client() {
    run(
        "tonic_client",
        &[
            "GetBalance: OK 1999 cents after 3 attempts",
            "Transfer:   Unavailable after 1 attempt",
            "ok: ",
        ],
    )
    .await;
}

#[tokio::test]
async fn hyper_client() {
    run(
        "hyper_client",
        &[
            "caller got: 201 Created",
            "previous_attempts: Some(\"1\")",
            "attempt=\"1\",outcome=\"retryable\"} 1",
            "attempt=\"2\",outcome=\"ok\"} 1",
            "ok: ",
        ],
    )
    .await;
}

#[tokio::test]
async fn two_hop() {
    run(
        "two_hop",
        &[
            "504 Gateway Timeout \"deadline_exceeded\"",
            "201 Created replayed=true; backend ran 2 charges",
            "503 Service Unavailable \"unavailable\" Retry-After: Some(",
            "caller gave 500 ms: 201 Created",
            "gRPC caller gave 100 ms: DeadlineExceeded",
            "ok: ",
        ],
    )
    .await;
}

#[tokio::test]
async fn sync_retries() {
    run(
        "sync_retries",
        &[
            "sync retries (a connection held through the sleeps): 16.7 requests/s",
            "backstop (a call slot per attempt, none while sleeping): 40.0 requests/s",
            "ok: the sync loop serves a third",
        ],
    )
    .await;
}

#[tokio::test]
async fn fixed_window() {
    run(
        "fixed_window",
        &[
            "fixed window of 100/min: 200 requests passed within 2 s across the boundary",
            "token bucket of 100/min (burst 100): 103 requests passed within 2 s",
            "ok: the fixed window let twice its limit through",
        ],
    )
    .await;
}

/// Byte counts, the same on every machine: the figures the chapter gives are printed exactly.
#[tokio::test]
async fn payload_costs() {
    run(
        "payload_costs",
        &[
            "json 233 bytes, protobuf 95 bytes: 2.45x",
            "a lookup:     25 bytes ->    45 gzipped",
            "8 requests:   1873 bytes ->   265 gzipped",
            "the chapter's three claims hold",
        ],
    )
    .await;
}

#[tokio::test]
async fn amplification() {
    run(
        "amplification",
        &[
            "naive (3 attempts at each of 3 hops): 2",
            "ok: naive >= 20, backstop's retries alone <= 1.1",
        ],
    )
    .await;
}
