//! `backstop chaos` end to end, at CI scale: a few hundred payments through SIGKILLs and PSP
//! faults, on one instance over SQLite and on two over one PostgreSQL database, with no
//! violation, kills that really happened and retries that really happened. The checker's
//! verdict on broken histories is unit-tested beside it (`chaos::check`).
//!
//! PostgreSQL is 127.0.0.1:5432 (database `test`, or `BACKSTOP_TEST_POSTGRES`); the command
//! creates and drops a schema of its own. The PostgreSQL run is skipped, saying so, when
//! PostgreSQL does not answer.

// The check that PostgreSQL answers, shared with the library's and the payment service's tests.
#[path = "../../backstop/tests/support/services.rs"]
mod services;

use std::process::Stdio;

use serde_json::Value;
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_backstop");

/// Runs `backstop chaos --json` with `args` and returns its exit success and summary.
async fn chaos(args: &[&str]) -> (bool, Value) {
    let output = Command::new(BIN)
        .arg("chaos")
        .args(args)
        .arg("--json")
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

/// What every small run must show: no violation, every payment acknowledged and charged once,
/// the kills asked for, and retries because of them.
fn assert_clean(success: bool, s: &Value, payments: u64, kills: u64) {
    assert!(success, "exit status: {s:#}");
    assert_eq!(s["violations"], 0, "{s:#}");
    assert!(s.get("first_violation").is_none(), "{s:#}");
    assert_eq!(s["payments"], payments, "{s:#}");
    assert_eq!(s["acknowledged"], payments, "{s:#}");
    assert_eq!(s["psp_charges"], payments, "one charge per order: {s:#}");
    assert_eq!(s["kills"], kills, "{s:#}");
    let attempts = s["attempts"].as_u64().expect("attempts");
    assert!(attempts > payments, "retries happened: {s:#}");
    assert!(s["retried"].as_u64().expect("retried") > 0, "{s:#}");
    // Kills cut requests: some attempts got no answer at all.
    assert!(s["unanswered"].as_u64().expect("unanswered") > 0, "{s:#}");
    // The PSP charged and lost answers, both ways.
    let faults = &s["psp_faults"];
    assert!(
        faults["commit_then_timeout"].as_u64().expect("count") > 0,
        "{s:#}"
    );
    assert!(
        faults["commit_then_drop"].as_u64().expect("count") > 0,
        "{s:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_one_instance_killed_five_times_charges_every_order_once() {
    let (success, summary) = chaos(&[
        "--store",
        "sqlite",
        "--payments",
        "200",
        "--concurrency",
        "16",
        "--kills",
        "5",
        "--seed",
        "18",
        // Generous: a loaded machine stretches the run, it does not fail it.
        "--max-time",
        "5m",
    ])
    .await;
    eprintln!("{summary}");
    assert_clean(success, &summary, 200, 5);
    assert_eq!(summary["store"], "sqlite");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_instances_killed_six_times_charge_every_order_once() {
    if !services::postgres() {
        return;
    }
    let store = services::postgres_url();
    let (success, summary) = chaos(&[
        "--store",
        &store,
        "--instances",
        "2",
        "--payments",
        "200",
        "--concurrency",
        "16",
        "--kills",
        "6",
        "--seed",
        "19",
        "--max-time",
        "5m",
    ])
    .await;
    eprintln!("{summary}");
    assert_clean(success, &summary, 200, 6);
    assert_eq!(summary["store"], "postgres");
    assert_eq!(summary["instances"], 2);
}

#[tokio::test]
async fn flags_that_cannot_run_are_usage_errors() {
    let output = Command::new(BIN)
        .args(["chaos", "--instances", "2"])
        .stdin(Stdio::null())
        .output()
        .await
        .expect("backstop chaos runs");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--store postgres://"), "{stderr}");
}
