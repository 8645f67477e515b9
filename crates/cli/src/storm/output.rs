//! `storm sim`'s output: a table for people, JSON and CSV for programs.

use std::io::{self, Write};

use super::Report;
use super::series::Summary;

/// The series and summaries as one JSON object.
pub(crate) fn json(out: &mut impl Write, report: &Report) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, report)?;
    writeln!(out)
}

const CSV_ROW_HEADER: &str = "scenario,policy,t,offered_originals,offered_retries,hedges,goodput,wasted,refused,attempts_failed,queue,inflight,limit,p99_ms,retry_ratio,failure_probability,logical_ok,logical_failed,storm";

const CSV_SUMMARY_HEADER: &str = "scenario,policy,logical,success,attempts,retries,hedges,amplification,focus_from,focus_to,focus_amplification,focus_goodput,focus_capacity,focus_wasted,focus_p99_ms,wasted,refused,peak_queue,peak_queue_mib,r,a0,a_star,p_star,p_slope,gain,verdict,recovery_s,to_capacity_s,return_inflight,little_l,little_lambda,little_w_ms,little_lambda_w,little_relative_error";

/// The series as CSV (one line per policy and interval), a blank line, then one summary line
/// per policy.
pub(crate) fn csv(out: &mut impl Write, report: &Report) -> io::Result<()> {
    writeln!(out, "{CSV_ROW_HEADER}")?;
    for run in &report.runs {
        for r in &run.rows {
            writeln!(
                out,
                "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{:.4},{:.4},{},{},{}",
                report.scenario,
                run.policy,
                r.t,
                r.offered_originals,
                r.offered_retries,
                r.hedges,
                r.goodput,
                r.wasted,
                r.refused,
                r.attempts_failed,
                r.queue,
                r.inflight,
                r.limit,
                // No logical request ended in the interval: no latency to show.
                if r.logical_ok + r.logical_failed == 0 {
                    "-".to_owned()
                } else {
                    format!("{:.0}", r.p99_ms)
                },
                r.retry_ratio,
                r.failure_probability,
                r.logical_ok,
                r.logical_failed,
                r.storm
            )?;
        }
    }
    writeln!(out)?;
    writeln!(out, "{CSV_SUMMARY_HEADER}")?;
    for run in &report.runs {
        let s = &run.summary;
        let st = &s.stability;
        let l = &s.little;
        writeln!(
            out,
            "{},{},{},{:.4},{},{},{},{:.4},{},{},{:.4},{:.1},{:.1},{:.1},{},{},{},{},{:.1},{:.4},{:.1},{:.1},{:.4},{:.8},{:.4},{},{},{},{},{:.2},{:.2},{:.2},{:.2},{:.4}",
            report.scenario,
            s.policy,
            s.logical,
            s.success,
            s.attempts,
            s.retries,
            s.hedges,
            s.amplification,
            s.focus_from,
            s.focus_to,
            s.focus_amplification,
            s.focus_goodput,
            s.focus_capacity,
            s.focus_wasted,
            s.focus_p99_ms,
            s.wasted,
            s.refused,
            s.peak_queue,
            s.peak_queue_mib,
            st.r,
            st.a0,
            st.a_star,
            st.p_star,
            st.p_slope,
            st.gain,
            st.verdict,
            s.recovery_s.map(|v| v.to_string()).unwrap_or_default(),
            s.to_capacity_s.map(|v| v.to_string()).unwrap_or_default(),
            s.return_inflight.map(|v| v.to_string()).unwrap_or_default(),
            l.l,
            l.lambda,
            l.w_ms,
            l.lambda_w,
            l.relative_error
        )?;
    }
    Ok(())
}

/// Per-policy tables, one row per interval, then the summaries side by side.
pub(crate) fn table(out: &mut impl Write, report: &Report) -> io::Result<()> {
    writeln!(
        out,
        "scenario {} (seed {}, scale {}, {} s simulated)",
        report.scenario, report.seed, report.scale, report.duration_s
    )?;
    for note in &report.notes {
        writeln!(out, "  {note}")?;
    }
    for run in &report.runs {
        writeln!(out)?;
        writeln!(out, "policy {}", run.policy)?;
        writeln!(
            out,
            "{:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>6} {:>7} {:>6} {:>6} {:>8}",
            "t(s)",
            "orig/s",
            "retry/s",
            "good/s",
            "waste/s",
            "refuse/s",
            "queue",
            "limit",
            "p99 ms",
            "ratio",
            "fail",
            "storm"
        )?;
        let per_s = 1.0 / report.interval_s;
        for r in &run.rows {
            writeln!(
                out,
                "{:>6.1} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>8} {:>6} {:>7} {:>6.2} {:>6.2} {:>8}",
                r.t,
                r.offered_originals as f64 * per_s,
                r.offered_retries as f64 * per_s,
                r.goodput as f64 * per_s,
                r.wasted as f64 * per_s,
                r.refused as f64 * per_s,
                r.queue,
                r.limit,
                // No logical request ended in the interval: no latency to show.
                if r.logical_ok + r.logical_failed == 0 {
                    "-".to_owned()
                } else {
                    format!("{:.0}", r.p99_ms)
                },
                r.retry_ratio,
                r.failure_probability,
                r.storm
            )?;
        }
    }
    if report.runs.len() > 1 {
        writeln!(out)?;
        side_by_side(out, report)?;
    }
    writeln!(out)?;
    summaries(out, report)?;
    extras(out, report)
}

/// The scenario's own figures, run by run.
fn extras(out: &mut impl Write, report: &Report) -> io::Result<()> {
    for run in report.runs.iter().filter(|r| !r.extra.is_empty()) {
        writeln!(out)?;
        writeln!(out, "{}", run.policy)?;
        for (key, value) in &run.extra {
            writeln!(out, "  {key:<44} {value}")?;
        }
    }
    Ok(())
}

/// The policies' load, goodput and queue next to each other, interval by interval.
fn side_by_side(out: &mut impl Write, report: &Report) -> io::Result<()> {
    writeln!(out, "side by side: attempts sent/s, goodput/s, queue")?;
    write!(out, "{:>6}", "t(s)")?;
    for run in &report.runs {
        write!(out, " | {:^26}", truncate(&run.policy, 26))?;
    }
    writeln!(out)?;
    let per_s = 1.0 / report.interval_s;
    let rows = report.runs.iter().map(|r| r.rows.len()).max().unwrap_or(0);
    for i in 0..rows {
        let t = report.runs[0].rows.get(i).map_or(0.0, |r| r.t);
        write!(out, "{t:>6.1}")?;
        for run in &report.runs {
            match run.rows.get(i) {
                Some(r) => write!(
                    out,
                    " | {:>8.0} {:>8.0} {:>8}",
                    r.offered() as f64 * per_s,
                    r.goodput as f64 * per_s,
                    r.queue
                )?,
                None => write!(out, " | {:>26}", "")?,
            }
        }
        writeln!(out)?;
    }
    Ok(())
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((at, _)) => &s[..at],
        None => s,
    }
}

fn summaries(out: &mut impl Write, report: &Report) -> io::Result<()> {
    let runs: Vec<&Summary> = report.runs.iter().map(|r| &r.summary).collect();
    let Some(first) = runs.first() else {
        return Ok(());
    };
    writeln!(
        out,
        "summary (window {:.0}-{:.0} s)",
        first.focus_from, first.focus_to
    )?;
    let line = |out: &mut dyn Write, label: &str, f: &dyn Fn(&Summary) -> String| {
        write!(out, "  {label:<34}")?;
        for s in &runs {
            write!(out, " {:>18}", f(s))?;
        }
        writeln!(out)
    };
    line(out, "", &|s| s.policy.clone())?;
    line(out, "logical requests", &|s| s.logical.to_string())?;
    line(out, "succeeded", &|s| format!("{:.1} %", s.success * 100.0))?;
    line(out, "attempts per request (run)", &|s| {
        format!("{:.3}", s.amplification)
    })?;
    line(out, "attempts per request (window)", &|s| {
        format!("{:.3}", s.focus_amplification)
    })?;
    line(out, "goodput/s (window)", &|s| {
        format!("{:.0}", s.focus_goodput)
    })?;
    line(out, "capacity/s (window)", &|s| {
        format!("{:.0}", s.focus_capacity)
    })?;
    line(out, "goodput / capacity (window)", &|s| {
        format!("{:.2}", ratio(s.focus_goodput, s.focus_capacity))
    })?;
    line(out, "wasted work/s (window)", &|s| {
        format!("{:.0}", s.focus_wasted)
    })?;
    line(out, "worst p99 ms (window)", &|s| {
        format!("{:.0}", s.focus_p99_ms)
    })?;
    line(out, "refused", &|s| s.refused.to_string())?;
    line(out, "hedges per request", &|s| {
        format!(
            "{:.3}",
            ratio(s.hedges as f64, (s.attempts - s.retries - s.hedges) as f64)
        )
    })?;
    line(out, "peak queue (memory)", &|s| {
        format!("{} ({:.0} MiB)", s.peak_queue, s.peak_queue_mib)
    })?;
    line(out, "r (retries per failed request)", &|s| {
        format!("{:.3}", s.stability.r)
    })?;
    line(out, "A0 (originals/s)", &|s| {
        format!("{:.0}", s.stability.a0)
    })?;
    line(out, "A* (attempts/s)", &|s| {
        format!("{:.0}", s.stability.a_star)
    })?;
    line(out, "p(A*) (attempt failure)", &|s| {
        format!("{:.2}", s.stability.p_star)
    })?;
    line(out, "p'(A*) (per attempt/s)", &|s| {
        format!("{:.2e}", s.stability.p_slope)
    })?;
    line(out, "r x A0 x p'(A*)", &|s| {
        format!("{:.2} {}", s.stability.gain, s.stability.verdict)
    })?;
    line(
        out,
        "recovery after the downstream",
        &|s| match s.recovery_s {
            Some(v) => format!("{v:.0} s"),
            None if s.recovery_timed => "not in the run".to_owned(),
            None => "-".to_owned(),
        },
    )?;
    line(
        out,
        "back to capacity after it",
        &|s| match s.to_capacity_s {
            Some(v) => format!("{v:.0} s"),
            None if s.recovery_timed => "not in the run".to_owned(),
            None => "-".to_owned(),
        },
    )?;
    line(out, "in flight 1 interval after it", &|s| {
        s.return_inflight.map_or("-".to_owned(), |n| n.to_string())
    })?;
    line(out, "Little: L / lambda x W", &|s| {
        format!("{:.1} / {:.1}", s.little.l, s.little.lambda_w)
    })?;
    line(out, "Little: W ms", &|s| format!("{:.0}", s.little.w_ms))?;
    let reasons: Vec<&str> = {
        let mut all: Vec<&str> = runs.iter().flat_map(|s| s.stops.keys().copied()).collect();
        all.sort_unstable();
        all.dedup();
        all
    };
    for reason in reasons {
        line(out, &format!("gave up: {reason}"), &|s| {
            s.stops.get(reason).copied().unwrap_or(0).to_string()
        })?;
    }
    Ok(())
}

fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { 0.0 } else { a / b }
}
