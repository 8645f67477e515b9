//! The HTML report in a real browser: `backstop report-sample` writes a report from synthetic
//! data, headless Chromium renders it without console errors, with its charts in the DOM, and
//! the screenshot is a picture, not a blank page.
//!
//! Without Chromium the browser checks are skipped with a printed reason, unless
//! `BACKSTOP_REQUIRE_CHROMIUM=1` (CI), where its absence fails the test.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_backstop");

/// The charts of the sample: two load charts (one per run) and six comparisons.
const SAMPLE_CHARTS: usize = 8;

fn write_sample(dir: &Path) {
    let out = std::process::Command::new(BIN)
        .args(["report-sample", "--out"])
        .arg(dir)
        .output()
        .expect("backstop runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in ["chromium", "chromium-browser", "google-chrome"] {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Some(candidate);
            }
        }
    }
    None
}

/// Chromium, or `None` (with the reason printed) when it is missing and not required.
fn chromium_or_skip() -> Option<PathBuf> {
    let found = chromium();
    if found.is_none() {
        assert!(
            std::env::var("BACKSTOP_REQUIRE_CHROMIUM").as_deref() != Ok("1"),
            "BACKSTOP_REQUIRE_CHROMIUM=1 but no chromium on PATH (Debian package `chromium`)"
        );
        eprintln!("skipped: no chromium on PATH (Debian package `chromium`)");
    }
    found
}

/// Runs headless Chromium on `page` with `args`, its console on stderr, within a generous
/// bound (a loaded machine starts a browser slowly; a hung one must not hang the suite).
async fn headless(browser: &Path, profile: &Path, page: &Path, args: &[&str]) -> Output {
    let url = format!("file://{}", page.display());
    let child = Command::new(browser)
        .args([
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--hide-scrollbars",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(&url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("chromium starts");
    tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .expect("chromium finishes within 3 minutes")
        .expect("chromium runs")
}

/// Lines of Chromium's log that report a console message or an uncaught script error.
fn console_errors(stderr: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(stderr)
        .lines()
        .filter(|l| l.contains("Uncaught") || l.contains(":CONSOLE"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_report_writes_html_json_and_csv_with_stable_columns() {
    let dir = tempfile::tempdir().unwrap();
    write_sample(dir.path());
    let csv = std::fs::read_to_string(dir.path().join("data.csv")).unwrap();
    assert_eq!(
        csv.lines().next().unwrap(),
        "run,time_s,offered_originals_per_s,offered_retries_per_s,goodput_per_s,refused_per_s,\
         wasted_per_s,queue_depth,p99_ms,admission_limit,in_flight,retry_ratio"
    );
    // The naive run has no admission limit: an empty cell, not a zero.
    let naive = csv.lines().nth(1).unwrap();
    assert!(
        naive.starts_with("naive,1,") && naive.contains(",,"),
        "{naive}"
    );
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("data.json")).unwrap())
            .unwrap();
    assert_eq!(json["format"], "backstop-report/1");
    let runs = json["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["rows"][0]["admission_limit"], Value::Null);
    assert!(runs[1]["rows"][0]["retry_ratio"].is_f64());
    assert_eq!(
        csv.lines().count() - 1,
        runs.iter()
            .map(|r| r["rows"].as_array().unwrap().len())
            .sum::<usize>()
    );
    let html = std::fs::read_to_string(dir.path().join("index.html")).unwrap();
    assert_eq!(html.matches("<svg ").count(), SAMPLE_CHARTS);
}

#[tokio::test]
async fn chromium_renders_the_report_without_errors() {
    let Some(browser) = chromium_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report");
    write_sample(&report);
    let page = report.join("index.html");

    // The check for console errors sees them: a page with a script error is caught.
    let broken = dir.path().join("broken.html");
    std::fs::write(
        &broken,
        "<!DOCTYPE html><script>no_such_function();</script>",
    )
    .unwrap();
    let out = headless(&browser, &dir.path().join("p0"), &broken, &["--dump-dom"]).await;
    assert!(
        !console_errors(&out.stderr).is_empty(),
        "a script error must show in chromium's log: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The DOM as the browser parsed it: every chart an SVG with its lines.
    let out = headless(&browser, &dir.path().join("p1"), &page, &["--dump-dom"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dom = String::from_utf8_lossy(&out.stdout);
    assert_eq!(dom.matches("<svg ").count(), SAMPLE_CHARTS, "{dom}");
    assert!(dom.matches("<polyline ").count() >= 2 * SAMPLE_CHARTS);
    assert_eq!(console_errors(&out.stderr), Vec::<String>::new());

    // The screenshot: the right size, and a picture (many colours, chart colours among them).
    let png = dir.path().join("report.png");
    let out = headless(
        &browser,
        &dir.path().join("p2"),
        &page,
        &[
            &format!("--screenshot={}", png.display()),
            "--window-size=1280,2000",
        ],
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(console_errors(&out.stderr), Vec::<String>::new());
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(&png).expect("a screenshot was written"),
    ));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (1280, 2000));
    let channels = info.color_type.samples();
    assert!(channels >= 3, "{:?}", info.color_type);
    let pixels = buf[..info.buffer_size()].chunks_exact(channels);
    let (mut colours, mut saturated, mut total) = (HashSet::new(), 0usize, 0usize);
    for p in pixels {
        let (r, g, b) = (p[0], p[1], p[2]);
        colours.insert((r, g, b));
        // Lines and areas in colour; text and background are grey.
        if r.max(g).max(b) - r.min(g).min(b) > 80 {
            saturated += 1;
        }
        total += 1;
    }
    assert!(
        colours.len() > 200,
        "{} colours: a blank page?",
        colours.len()
    );
    assert!(
        saturated * 200 > total,
        "{saturated} of {total} pixels in colour: no charts drawn?"
    );
}
