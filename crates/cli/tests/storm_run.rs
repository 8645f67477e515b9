//! `backstop storm run` against the real service: a shortened slowdown, naive vs backstop
//! clients. Counts only (attempts per logical request, rows of the series), never timings.

use std::process::Stdio;

use serde_json::Value;
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_backstop");

#[tokio::test]
async fn a_slowdown_run_shows_naive_retries_multiplying_and_backstop_holding() {
    let dir = tempfile::tempdir().unwrap();
    let report = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args([
            "storm",
            "run",
            "--scenario",
            "slowdown",
            "--time-scale",
            "0.2",
            "--json",
        ])
        .arg("--out")
        .arg(dir.path())
        .arg("--report")
        .arg(report.path())
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "storm run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let result: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(result["scenario"], "slowdown");
    let variants = result["variants"].as_array().unwrap();
    let by_name = |name: &str| {
        variants
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {result}"))
    };
    let (naive, backstop) = (by_name("naive"), by_name("backstop"));
    for v in [naive, backstop] {
        assert!(v["load"]["logical_requests"].as_u64().unwrap() > 0, "{v}");
        assert!(!v["seconds"].as_array().unwrap().is_empty(), "{v}");
        let csv = std::fs::read_to_string(
            dir.path()
                .join(format!("{}.csv", v["name"].as_str().unwrap())),
        )
        .unwrap();
        assert!(csv.starts_with("t_s,originals,retries"), "{csv}");
        assert!(csv.lines().count() > 2, "{csv}");
    }
    // The naive client resends every attempt that timed out on a slowed dependency, with a
    // fresh key; backstop's retries stay within its budget and storm alarm.
    let amplification = |v: &Value| v["attempts_per_logical"].as_f64().unwrap();
    assert!(
        amplification(naive) > amplification(backstop),
        "naive {} vs backstop {}",
        amplification(naive),
        amplification(backstop)
    );
    assert!(amplification(backstop) <= 1.25, "{backstop}");
    assert!(dir.path().join("summary.json").exists());
    let page = std::fs::read_to_string(report.path().join("index.html")).unwrap();
    assert!(page.contains("<svg") && page.contains("naive") && page.contains("backstop"));
    // The simulator's mirror of the scenario is on the same page.
    assert!(page.contains("sim: naive") && page.contains("sim: backstop"));
    let csv = std::fs::read_to_string(report.path().join("data.csv")).unwrap();
    assert!(
        csv.lines().any(|l| l.starts_with("sim: backstop,")),
        "{csv}"
    );
    assert!(report.path().join("data.csv").exists());
}
