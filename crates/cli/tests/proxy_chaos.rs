//! `backstop chaos --target proxy` end to end, at CI scale: keyed requests retried through
//! SIGKILLs of `backstop proxy` in front of the Python upstream (`support/upstream.py`), which
//! lists the effects it executed at `/_effects`; the checker reads them and finds no key
//! executed twice. Bounded: a few dozen keys, three kills, a two-minute cap. The same with a
//! fleet: three proxies on one PostgreSQL store (a schema the command creates for the run),
//! random ones killed.

#[path = "support/proxy_harness.rs"]
mod proxy_harness;
#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;
#[path = "../../backstop/tests/support/services.rs"]
mod services;

use std::process::Stdio;

use serde_json::Value;
use tokio::process::Command;

use self::proxy_harness::{BIN, Upstream, python_ready};

const PAYMENTS: u64 = 40;
const KILLS: u64 = 3;

/// Runs `backstop chaos --target proxy --json` in front of `upstream` with `args`; its exit
/// success and summary.
async fn chaos(upstream: &Upstream, args: &[&str]) -> (bool, Value) {
    let output = Command::new(BIN)
        .args(["chaos", "--target", "proxy", "--upstream", &upstream.url])
        .args(["--payments", &PAYMENTS.to_string(), "--concurrency", "8"])
        .args(["--kills", &KILLS.to_string(), "--seed", "29"])
        // Each request stays at the upstream a while, so that kills cut some.
        .args(["--header", "X-Upstream-Sleep-Ms: 100"])
        // Generous: a loaded machine stretches the run, it does not fail it.
        .args(["--max-time", "120s", "--json"])
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .expect("backstop chaos runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let summary: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("a JSON summary ({e}): {stdout}\nstderr: {stderr}"));
    (output.status.success(), summary)
}

/// No violation, the kills asked for, requests they cut, and at most one effect per key (one
/// per acknowledged key).
fn assert_clean(success: bool, s: &Value) {
    eprintln!("{s}");
    assert!(success, "exit status: {s:#}");
    assert_eq!(s["target"], "proxy", "{s:#}");
    assert_eq!(s["violations"], 0, "{s:#}");
    assert!(s.get("first_violation").is_none(), "{s:#}");
    assert_eq!(s["payments"], PAYMENTS, "{s:#}");
    assert_eq!(s["unfinished"], 0, "{s:#}");
    assert_eq!(s["kills"], KILLS, "{s:#}");
    assert!(s["unanswered"].as_u64().expect("unanswered") > 0, "{s:#}");
    let effects = s["psp_charges"].as_u64().expect("effects");
    let acknowledged = s["acknowledged"].as_u64().expect("acknowledged");
    assert!(
        (acknowledged..=PAYMENTS).contains(&effects),
        "{effects} effects: {s:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_through_sigkills_of_the_proxy_are_never_executed_twice() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let (success, summary) = chaos(&upstream, &[]).await;
    assert_clean(success, &summary);
    // A key forwarded before a kill is never forwarded again: its retries learn that its
    // outcome is unknown (a final refusal), or got the answer if it was recorded.
    let refused = summary["refused"].as_u64().expect("refused");
    assert_eq!(
        summary["acknowledged"].as_u64().unwrap() + refused,
        PAYMENTS,
        "{summary:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_an_upstream_that_dedups_every_key_is_executed_exactly_once() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let (success, summary) = chaos(
        &upstream,
        &["--path", "/dedup/charges", "--upstream-dedups"],
    )
    .await;
    assert_clean(success, &summary);
    assert_eq!(summary["acknowledged"], PAYMENTS, "{summary:#}");
    assert_eq!(summary["psp_charges"], PAYMENTS, "{summary:#}");
}

/// Three proxies share one PostgreSQL store; the chaos run spreads its keys over them and
/// kills random instances. A key claimed through one proxy is never forwarded again through
/// another, whichever was killed: no key executed twice, every acknowledged key executed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_three_proxies_on_one_postgres_store_executes_no_key_twice() {
    if !python_ready().await || !services::postgres() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let store = services::postgres_url();
    let (success, summary) = chaos(&upstream, &["--store", &store, "--instances", "3"]).await;
    assert_clean(success, &summary);
    assert_eq!(summary["store"], "postgres", "{summary:#}");
    assert_eq!(summary["instances"], 3, "{summary:#}");
    let refused = summary["refused"].as_u64().expect("refused");
    assert_eq!(
        summary["acknowledged"].as_u64().unwrap() + refused,
        PAYMENTS,
        "{summary:#}"
    );
}
