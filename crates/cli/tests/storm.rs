//! `backstop storm sim` as a user runs it: deterministic output, three formats, clear errors.

use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_backstop");

fn sim(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("storm")
        .arg("sim")
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("the binary runs")
}

/// A small slowdown run: 200/s against 50 workers for 20 simulated seconds.
const SMALL: [&str; 6] = ["--scale", "0.1", "--duration", "20s", "--seed", "11"];

#[test]
fn the_same_seed_prints_the_same_json_and_another_seed_does_not() {
    let first = sim(&[&SMALL[..], &["--json"]].concat());
    assert!(first.status.success(), "{first:?}");
    let second = sim(&[&SMALL[..], &["--json"]].concat());
    assert_eq!(first.stdout, second.stdout);
    let other = sim(&[
        "--scale",
        "0.1",
        "--duration",
        "20s",
        "--seed",
        "12",
        "--json",
    ]);
    assert_ne!(first.stdout, other.stdout);

    let report: serde_json::Value = serde_json::from_slice(&first.stdout).unwrap();
    assert_eq!(report["scenario"], "slowdown");
    let runs = report["runs"].as_array().unwrap();
    let policies: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies, ["naive", "backstop"]);
    for run in runs {
        assert_eq!(run["rows"].as_array().unwrap().len(), 20);
        let verdict = run["summary"]["stability"]["verdict"].as_str().unwrap();
        assert!(
            ["stable", "storm", "overloaded"].contains(&verdict),
            "{verdict}"
        );
    }
}

#[test]
fn csv_has_the_series_then_the_summaries() {
    let out = sim(&[&SMALL[..], &["--csv", "--policy", "naive"]].concat());
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let (series, summary) = text.split_once("\n\n").expect("two tables");
    let mut lines = series.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("scenario,policy,t,offered_originals,")
    );
    assert_eq!(lines.count(), 20);
    let mut lines = summary.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("scenario,policy,logical,")
    );
    assert!(lines.next().unwrap().starts_with("slowdown,naive,"));
    assert_eq!(lines.next(), None);
}

#[test]
fn the_table_names_every_policy_and_the_stability_quantity() {
    let out = sim(&[
        "--scenario",
        "hedging",
        "--scale",
        "0.05",
        "--duration",
        "5s",
    ]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "policy p95",
        "policy p50",
        "policy p50-budget",
        "side by side",
        "r x A0 x p'(A*)",
        "hedges per request",
    ] {
        assert!(text.contains(needle), "{needle} missing from\n{text}");
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let out = sim(&["--policy", "careful"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        stderr.trim(),
        "error: scenario slowdown has no policy `careful`; choose all, naive, backstop"
    );
    let out = sim(&["--scale", "1000", "--duration", "1h"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("more than one run may simulate"),
        "{stderr}"
    );
    for args in [
        &["--scale", "0"][..],
        &["--scale", "many"],
        &["--duration", "2h"],
        &["--interval", "1ms"],
        &["--scenario", "tsunami"],
        &["--json", "--csv"],
    ] {
        let out = sim(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(
            String::from_utf8(out.stderr).unwrap().starts_with("error:"),
            "{args:?}"
        );
    }
}

#[test]
fn report_writes_a_page_with_a_run_per_policy() {
    let dir = tempfile::tempdir().unwrap();
    let out = sim(&[&SMALL[..], &["--report", dir.path().to_str().unwrap()]].concat());
    assert!(out.status.success(), "{out:?}");
    let page = std::fs::read_to_string(dir.path().join("index.html")).unwrap();
    assert!(page.contains("<svg"), "charts are drawn");
    assert!(
        page.contains("naive") && page.contains("backstop"),
        "a run per policy"
    );
    let csv = std::fs::read_to_string(dir.path().join("data.csv")).unwrap();
    assert!(csv.lines().any(|l| l.starts_with("naive,")), "{csv}");
    assert!(csv.lines().any(|l| l.starts_with("backstop,")), "{csv}");
}

/// A claim runs from one command: its page has a run per variant, the scenario's own figures
/// in the summaries and the sentence on what they show; `--policy` picks one run, and a
/// policy the claim does not have is refused with its choices.
#[test]
fn a_claim_writes_its_figures_and_its_finding() {
    let dir = tempfile::tempdir().unwrap();
    let small = [
        "--scenario",
        "amplification",
        "--scale",
        "0.2",
        "--duration",
        "15s",
    ];
    let out = sim(&[&small[..], &["--report", dir.path().to_str().unwrap()]].concat());
    assert!(out.status.success(), "{out:?}");
    let page = std::fs::read_to_string(dir.path().join("index.html")).unwrap();
    assert!(page.contains("<svg"), "charts are drawn");
    for needle in [
        "naive",
        "budget-every-hop",
        "budget-one-layer",
        "backstop-every-hop",
        "attempts at C per user request, C failing",
        "what the numbers show",
    ] {
        assert!(page.contains(needle), "{needle} missing from the page");
    }
    let out = sim(&[&small[..], &["--policy", "backstop", "--json"]].concat());
    assert!(out.status.success(), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["runs"].as_array().unwrap().len(), 1);
    assert_eq!(report["runs"][0]["policy"], "backstop");

    let out = sim(&["--scenario", "burst", "--policy", "huge", "--scale", "0.1"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(
        stderr.trim(),
        "error: scenario burst has no policy `huge`; choose all, queue-25, queue-100, queue-400, sustained-queue-100, sustained-rate-limit"
    );
    // A base load at or above the capacity leaves no burst to size a queue for.
    let out = sim(&["--scenario", "burst", "--rate", "1000"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .contains("lower --rate"),
        "a clear error"
    );
}

#[test]
fn a_claim_too_short_to_show_its_point_is_refused() {
    let out = sim(&["--scenario", "cold", "--duration", "15s"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(
        String::from_utf8(out.stderr).unwrap().trim(),
        "error: scenario cold needs --duration of at least 25s to show what it is about"
    );
}

#[test]
fn an_amplification_run_too_large_is_refused() {
    let out = sim(&[
        "--scenario",
        "amplification",
        "--scale",
        "1000",
        "--duration",
        "1h",
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("more than an amplification run may simulate"),
        "{stderr}"
    );
}
