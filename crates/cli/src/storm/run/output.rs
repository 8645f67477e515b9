//! What a run leaves behind without the report: the series and summary files of `--out`, and
//! the table printed on the terminal.

use std::path::Path;

use super::report::figure;
use super::result::RunResult;

pub(super) fn write_out(dir: &Path, result: &RunResult) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(dir)
        .map_err(|e| format!("cannot create --out {}: {e}", dir.display()))?;
    std::fs::write(dir.join("summary.json"), serde_json::to_vec_pretty(result)?)?;
    for variant in &result.variants {
        let mut csv = String::from(
            "t_s,originals,retries,hedges,ok,rejected,timeout,failed,p99_ms,limit,inflight,queue,\
             rss_mib\n",
        );
        let opt = |v: Option<f64>| v.map(|v| format!("{v}")).unwrap_or_default();
        for s in &variant.seconds {
            csv.push_str(&format!(
                "{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
                s.t_s,
                s.originals,
                s.retries,
                s.hedges,
                s.ok,
                s.rejected,
                s.timeout,
                s.failed,
                opt(s.p99_ms),
                opt(s.limit),
                opt(s.inflight),
                opt(s.queue),
                opt(s.rss_mib),
            ));
        }
        std::fs::write(dir.join(format!("{}.csv", variant.name)), csv)?;
    }
    Ok(())
}

pub(super) fn render(result: &RunResult) -> String {
    let mut out = format!("scenario {}\n", result.scenario.as_str());
    if let Some(capacity) = result.capacity_per_s {
        out.push_str(&format!("measured capacity {capacity:.1}/s\n"));
    }
    out.push_str(&format!(
        "{:<20} {:>8} {:>10} {:>9} {:>9} {:>9} {:>10} {:>9}\n",
        "variant", "rate/s", "goodput/s", "attempts", "not ok", "recovery", "peak RSS", "running"
    ));
    for v in &result.variants {
        // The burst's own load counts too.
        let not_ok: u64 = std::iter::once(&v.load)
            .chain(&v.burst_load)
            .map(|load| {
                let logical = load["logical_requests"].as_u64().unwrap_or(0);
                logical.saturating_sub(load["outcomes"]["ok"].as_u64().unwrap_or(0))
            })
            .sum();
        out.push_str(&format!(
            "{:<20} {:>8.0} {:>10.1} {:>9.3} {:>9} {:>9} {:>10} {:>9}\n",
            v.name,
            v.rate,
            v.goodput_per_s,
            v.attempts_per_logical,
            not_ok,
            v.recovery_s.map_or("-".to_owned(), |s| format!("{s:.0} s")),
            v.peak_rss_mib
                .map_or("-".to_owned(), |m| format!("{m:.0} MiB")),
            v.intents_running.map_or("-".to_owned(), |n| n.to_string()),
        ));
    }
    for v in result.variants.iter().filter(|v| !v.figures.is_empty()) {
        let figures: Vec<String> = v
            .figures
            .iter()
            .map(|(name, x)| format!("{name} {}", figure(*x)))
            .collect();
        out.push_str(&format!("{}: {}\n", v.name, figures.join(", ")));
    }
    out
}
