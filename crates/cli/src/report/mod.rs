//! HTML reports of storm runs: charts a person would rather look at than read numbers, and the
//! numbers beside them.
//!
//! The input is plain data ([`Report`]: a title, a scenario description and one or more named
//! [`Run`]s, each a time series of [`Row`]s plus summary key/values), whoever produced it: the
//! simulator or a live run. [`write()`] creates the directory and writes three files:
//!
//! - `index.html`: self-contained (inline SVG charts and CSS, no script, font or anything
//!   fetched from elsewhere): offered load split into originals and retries with goodput and
//!   refusals (one chart per run, same scales), goodput, p99 latency, queue depth, the
//!   admission limit against in flight, the retry ratio with the 0.1 and 0.2 lines, and wasted
//!   work; each chart overlays the runs with a legend. A chart no run has data for is left out.
//! - `data.json`: the [`Report`] as given (`format` is [`FORMAT`]): `title`, `description`,
//!   `runs: [{name, summary: [[key, value], ...], rows: [{time_s, ...}, ...]}]`, a missing
//!   value as `null`.
//! - `data.csv`: one line per row of every run, the header [`CSV_COLUMNS`]: `run`, then the
//!   [`Row`] fields in their order; a missing value is an empty cell.
//!
//! The column names are stable: tools read them. Rates are per second of the run's time
//! (simulated or wall); non-finite values are written as missing.

mod sample;
mod svg;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub(crate) use sample::{SampleArgs, run_sample};
use svg::{Chart, Series, Style, Threshold, escape};

/// The `format` of `data.json`; a change of its fields changes the version.
pub(crate) const FORMAT: &str = "backstop-report/1";

/// The header of `data.csv`.
pub(crate) const CSV_COLUMNS: [&str; 12] = [
    "run",
    "time_s",
    "offered_originals_per_s",
    "offered_retries_per_s",
    "goodput_per_s",
    "refused_per_s",
    "wasted_per_s",
    "queue_depth",
    "p99_ms",
    "admission_limit",
    "in_flight",
    "retry_ratio",
];

/// A report: one scenario, one or more runs of it (e.g. "naive" and "backstop").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Report {
    /// Always [`FORMAT`] when written.
    #[serde(default)]
    pub(crate) format: String,
    /// Page title.
    pub(crate) title: String,
    /// What the scenario does (plain text; blank lines separate paragraphs).
    pub(crate) description: String,
    /// The runs, in the order they are shown.
    pub(crate) runs: Vec<Run>,
}

/// One run of the scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Run {
    /// Name in legends and table headers.
    pub(crate) name: String,
    /// Headline figures, in order (e.g. `("goodput", "833 /s")`).
    pub(crate) summary: Vec<(String, String)>,
    /// The time series, one row per interval, in time order.
    pub(crate) rows: Vec<Row>,
}

/// One interval of a run. Everything but the time is optional: a run reports what it measures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Row {
    /// End of the interval, seconds from the start of the run.
    pub(crate) time_s: f64,
    /// First attempts offered, per second.
    pub(crate) offered_originals_per_s: Option<f64>,
    /// Retries (and hedges) offered, per second.
    pub(crate) offered_retries_per_s: Option<f64>,
    /// Requests answered successfully within their deadline, per second.
    pub(crate) goodput_per_s: Option<f64>,
    /// Requests refused by admission control, per second.
    pub(crate) refused_per_s: Option<f64>,
    /// Work done for answers nobody waited for any more, requests per second.
    pub(crate) wasted_per_s: Option<f64>,
    /// Requests waiting for a worker at the end of the interval.
    pub(crate) queue_depth: Option<f64>,
    /// 99th percentile latency of the interval's answers, milliseconds.
    pub p99_ms: Option<f64>,
    /// The admission (concurrency) limit.
    pub(crate) admission_limit: Option<f64>,
    /// Requests in flight (holding a place under the limit).
    pub(crate) in_flight: Option<f64>,
    /// Retries per logical request.
    pub(crate) retry_ratio: Option<f64>,
}

impl Row {
    /// The optional fields in [`CSV_COLUMNS`] order (after `run` and `time_s`).
    fn values(&self) -> [Option<f64>; 10] {
        [
            self.offered_originals_per_s,
            self.offered_retries_per_s,
            self.goodput_per_s,
            self.refused_per_s,
            self.wasted_per_s,
            self.queue_depth,
            self.p99_ms,
            self.admission_limit,
            self.in_flight,
            self.retry_ratio,
        ]
    }

    /// The row with non-finite values made missing (JSON has no NaN).
    fn sanitized(&self) -> Row {
        let f = |v: Option<f64>| v.filter(|v| v.is_finite());
        Row {
            time_s: self.time_s,
            offered_originals_per_s: f(self.offered_originals_per_s),
            offered_retries_per_s: f(self.offered_retries_per_s),
            goodput_per_s: f(self.goodput_per_s),
            refused_per_s: f(self.refused_per_s),
            wasted_per_s: f(self.wasted_per_s),
            queue_depth: f(self.queue_depth),
            p99_ms: f(self.p99_ms),
            admission_limit: f(self.admission_limit),
            in_flight: f(self.in_flight),
            retry_ratio: f(self.retry_ratio),
        }
    }
}

/// A report that could not be written.
#[derive(Debug)]
pub(crate) enum ReportError {
    /// The report cannot be drawn (no run, a run without rows, a time that is not finite).
    Invalid(String),
    /// A file or the directory could not be written.
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

impl std::fmt::Display for ReportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReportError::Invalid(why) => write!(f, "cannot draw the report: {why}"),
            ReportError::Io { path, .. } => write!(f, "cannot write {}", path.display()),
        }
    }
}

impl std::error::Error for ReportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReportError::Invalid(_) => None,
            ReportError::Io { source, .. } => Some(source),
        }
    }
}

/// Writes `index.html`, `data.json` and `data.csv` into `dir` (created if missing).
pub(crate) fn write(report: &Report, dir: &Path) -> Result<(), ReportError> {
    let report = validated(report)?;
    let io = |path: PathBuf| move |source| ReportError::Io { path, source };
    std::fs::create_dir_all(dir).map_err(io(dir.to_owned()))?;
    let json = serde_json::to_string_pretty(&report).expect("a report serialises");
    for (name, text) in [
        ("index.html", html(&report)),
        ("data.json", json),
        ("data.csv", csv(&report)),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(io(path.clone()))?;
    }
    Ok(())
}

fn validated(report: &Report) -> Result<Report, ReportError> {
    if report.runs.is_empty() {
        return Err(ReportError::Invalid("it has no run".into()));
    }
    let mut report = report.clone();
    report.format = FORMAT.to_owned();
    for run in &mut report.runs {
        if run.rows.is_empty() {
            return Err(ReportError::Invalid(format!(
                "run {:?} has no rows",
                run.name
            )));
        }
        if let Some(row) = run.rows.iter().find(|r| !r.time_s.is_finite()) {
            return Err(ReportError::Invalid(format!(
                "run {:?} has a row at time {}",
                run.name, row.time_s
            )));
        }
        run.rows = run.rows.iter().map(Row::sanitized).collect();
    }
    Ok(report)
}

fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

fn csv(report: &Report) -> String {
    let mut out = CSV_COLUMNS.join(",");
    out.push('\n');
    for run in &report.runs {
        let name = csv_field(&run.name);
        for row in &run.rows {
            let _ = write!(out, "{name},{}", row.time_s);
            for v in row.values() {
                out.push(',');
                if let Some(v) = v {
                    let _ = write!(out, "{v}");
                }
            }
            out.push('\n');
        }
    }
    out
}

/// Colours of the runs, in order (red first: the first run is usually the baseline).
const RUN_COLORS: [&str; 6] = [
    "#d1495b", "#2f6fb0", "#3c9d5d", "#8e6bbf", "#e08a1e", "#3aa6a0",
];
const ORIGINALS: &str = "#5b8fd0";
const RETRIES: &str = "#f08c2e";
const GOODPUT: &str = "#2e9e5b";
const REFUSED: &str = "#6b6b6b";
const WARN: &str = "#d98a00";
const PAGE: &str = "#c62828";

fn points(run: &Run, field: impl Fn(&Row) -> Option<f64>) -> Vec<(f64, Option<f64>)> {
    run.rows.iter().map(|r| (r.time_s, field(r))).collect()
}

fn has(report: &Report, field: impl Fn(&Row) -> Option<f64>) -> bool {
    report
        .runs
        .iter()
        .any(|run| run.rows.iter().any(|r| field(r).is_some()))
}

/// The charts of the page: the per-run load charts, then the overlays.
fn charts(report: &Report) -> (Vec<Chart>, Vec<Chart>) {
    let x_max = report
        .runs
        .iter()
        .flat_map(|r| r.rows.iter().map(|row| row.time_s))
        .fold(0.0, f64::max);
    let time = "time (s)".to_owned();

    // Offered load per run, on one scale so that the runs compare at a glance.
    let mut per_run: Vec<Chart> = report
        .runs
        .iter()
        .map(|run| Chart {
            title: format!("{}: offered load and goodput", run.name),
            x_label: time.clone(),
            y_label: "requests / s".into(),
            series: [
                (
                    "originals offered",
                    ORIGINALS,
                    Style::Stacked,
                    points(run, |r| r.offered_originals_per_s),
                ),
                (
                    "retries offered",
                    RETRIES,
                    Style::Stacked,
                    points(run, |r| r.offered_retries_per_s),
                ),
                (
                    "goodput",
                    GOODPUT,
                    Style::Line,
                    points(run, |r| r.goodput_per_s),
                ),
                (
                    "refused",
                    REFUSED,
                    Style::Dashed,
                    points(run, |r| r.refused_per_s),
                ),
            ]
            .into_iter()
            .filter(|(_, _, _, p)| p.iter().any(|(_, v)| v.is_some()))
            .map(|(label, color, style, points)| Series {
                label: label.into(),
                color,
                style,
                points,
            })
            .collect(),
            thresholds: vec![],
            x_max: Some(x_max),
            y_max: None,
            log_y_min: None,
            note: "Offered load stacked: first attempts, then retries on top. Goodput: \
                   answered successfully within the deadline. Same scale for every run."
                .into(),
        })
        .collect();
    let shared_top = per_run
        .iter()
        .map(|c| {
            let offered: Vec<f64> = (0..c.series.first().map_or(0, |s| s.points.len()))
                .map(|i| {
                    c.series
                        .iter()
                        .filter(|s| s.style == Style::Stacked)
                        .filter_map(|s| s.points.get(i).and_then(|p| p.1))
                        .sum()
                })
                .collect();
            let lines = c
                .series
                .iter()
                .filter(|s| s.style != Style::Stacked)
                .flat_map(|s| s.points.iter().filter_map(|p| p.1));
            offered
                .into_iter()
                .chain(lines)
                .filter(|v| v.is_finite())
                .fold(0.0, f64::max)
        })
        .fold(0.0, f64::max);
    for c in &mut per_run {
        c.y_max = Some(shared_top * 1.08);
    }
    per_run.retain(|c| !c.series.is_empty());

    let overlay = |title: &str, y_label: &str, note: &str, field: fn(&Row) -> Option<f64>| {
        has(report, field).then(|| Chart {
            title: title.into(),
            x_label: time.clone(),
            y_label: y_label.into(),
            series: report
                .runs
                .iter()
                .zip(RUN_COLORS.iter().cycle())
                .map(|(run, color)| Series {
                    label: run.name.clone(),
                    color,
                    style: Style::Line,
                    points: points(run, field),
                })
                .collect(),
            thresholds: vec![],
            x_max: Some(x_max),
            y_max: None,
            log_y_min: None,
            note: note.into(),
        })
    };
    let mut overlays = Vec::new();
    overlays.extend(overlay(
        "Goodput",
        "answered in time / s",
        "Requests answered successfully within their deadline, per second.",
        |r| r.goodput_per_s,
    ));
    overlays.extend(overlay(
        "p99 latency",
        "p99 (ms)",
        "99th percentile latency of the answers in each interval.",
        |r| r.p99_ms,
    ));
    if let Some(mut ratio) = overlay(
        "Retry ratio",
        "retries per logical request (log)",
        "Retries per logical request, on a log scale so that 0.1 and 0.2 stay apart. Above \
         0.1 a client's storm alarm warns; above 0.2 it stops retrying.",
        |r| r.retry_ratio,
    ) {
        ratio.log_y_min = Some(0.01);
        ratio.thresholds = vec![
            Threshold {
                value: 0.1,
                label: "0.1 warn".into(),
                color: WARN,
            },
            Threshold {
                value: 0.2,
                label: "0.2 storm".into(),
                color: PAGE,
            },
        ];
        overlays.push(ratio);
    }
    overlays.extend(overlay(
        "Queue depth",
        "requests waiting",
        "Requests waiting for a worker: a queue hides overload until its wait exceeds the \
         deadline.",
        |r| r.queue_depth,
    ));
    if has(report, |r| r.admission_limit) || has(report, |r| r.in_flight) {
        let mut series = Vec::new();
        for (run, color) in report.runs.iter().zip(RUN_COLORS.iter().cycle()) {
            if run.rows.iter().any(|r| r.admission_limit.is_some()) {
                series.push(Series {
                    label: format!("{} limit", run.name),
                    color,
                    style: Style::Line,
                    points: points(run, |r| r.admission_limit),
                });
            }
            if run.rows.iter().any(|r| r.in_flight.is_some()) {
                series.push(Series {
                    label: format!("{} in flight", run.name),
                    color,
                    style: Style::Dashed,
                    points: points(run, |r| r.in_flight),
                });
            }
        }
        overlays.push(Chart {
            title: "Admission limit and in flight".into(),
            x_label: time.clone(),
            y_label: "requests".into(),
            series,
            thresholds: vec![],
            x_max: Some(x_max),
            y_max: None,
            log_y_min: None,
            note: "Solid: the admission limit (fixed, or adaptive: lowered when latency rises). \
                   Dashed: requests in flight."
                .into(),
        });
    }
    overlays.extend(overlay(
        "Wasted work",
        "answers nobody waited for / s",
        "Work finished after its caller gave up: capacity spent on nothing.",
        |r| r.wasted_per_s,
    ));
    (per_run, overlays)
}

const CSS: &str = "
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; background: #f3f4f6; color: #1f2933;
  font: 15px/1.5 system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif; }
main { max-width: 1240px; margin: 0 auto; padding: 28px 24px 40px; }
h1 { font-size: 26px; margin: 0 0 6px; }
h2 { font-size: 18px; margin: 28px 0 12px; }
.description p { margin: 4px 0; color: #3e4c59; max-width: 90ch; }
.files { color: #616e7c; font-size: 13px; margin-top: 8px; }
table { border-collapse: collapse; background: #fff; border-radius: 8px; overflow: hidden;
  box-shadow: 0 1px 2px rgba(0,0,0,.08); }
th, td { padding: 7px 16px; text-align: right; border-bottom: 1px solid #e4e7eb; }
th:first-child, td:first-child { text-align: left; color: #3e4c59; }
thead th { background: #e9edf2; font-weight: 600; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 6px; }
.grid2 { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 16px; }
.card { background: #fff; border-radius: 8px; padding: 8px 6px 2px;
  box-shadow: 0 1px 2px rgba(0,0,0,.08); }
.note { margin: 0 14px 10px; font-size: 13px; color: #616e7c; }
svg.chart { width: 100%; height: auto; display: block; }
svg .title { font-size: 16px; font-weight: 600; fill: #1f2933; }
svg .legend { font-size: 12.5px; fill: #3e4c59; }
svg .tick { font-size: 12px; fill: #616e7c; }
svg .axis-label { font-size: 12.5px; fill: #3e4c59; }
svg .threshold { font-size: 12px; font-weight: 600; }
svg .grid { stroke: #e4e7eb; stroke-width: 1; }
svg .axis { stroke: #9aa5b1; stroke-width: 1; }
svg text { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif; }
";

fn html(report: &Report) -> String {
    let (per_run, overlays) = charts(report);
    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n<h1>{}</h1>\n\
         <div class=\"description\">",
        escape(&report.title),
        escape(&report.title)
    );
    for paragraph in report
        .description
        .split("\n\n")
        .filter(|p| !p.trim().is_empty())
    {
        let _ = write!(s, "<p>{}</p>", escape(paragraph.trim()));
    }
    s.push_str(
        "</div>\n<p class=\"files\">The numbers: <a href=\"data.csv\">data.csv</a>, \
         <a href=\"data.json\">data.json</a>.</p>\n",
    );

    // Summary: one column per run, keys in the order they first appear.
    let mut keys: Vec<&str> = Vec::new();
    for run in &report.runs {
        for (k, _) in &run.summary {
            if !keys.contains(&k.as_str()) {
                keys.push(k);
            }
        }
    }
    if !keys.is_empty() {
        s.push_str("<h2>Summary</h2>\n<table>\n<thead><tr><th></th>");
        for (run, color) in report.runs.iter().zip(RUN_COLORS.iter().cycle()) {
            let _ = write!(
                s,
                "<th><span class=\"swatch\" style=\"background:{color}\"></span>{}</th>",
                escape(&run.name)
            );
        }
        s.push_str("</tr></thead>\n<tbody>\n");
        for key in keys {
            let _ = write!(s, "<tr><td>{}</td>", escape(key));
            for run in &report.runs {
                let value = run
                    .summary
                    .iter()
                    .find(|(k, _)| k == key)
                    .map_or("", |(_, v)| v);
                let _ = write!(s, "<td>{}</td>", escape(value));
            }
            s.push_str("</tr>\n");
        }
        s.push_str("</tbody>\n</table>\n");
    }

    let section = |s: &mut String, title: &str, charts: &[Chart]| {
        if charts.is_empty() {
            return;
        }
        let _ = write!(s, "<h2>{}</h2>\n<div class=\"grid2\">\n", escape(title));
        for chart in charts {
            let _ = writeln!(
                s,
                "<div class=\"card\">{}<p class=\"note\">{}</p></div>",
                chart.render(),
                escape(&chart.note)
            );
        }
        s.push_str("</div>\n");
    };
    section(&mut s, "Offered load", &per_run);
    let runs = if report.runs.len() > 1 {
        "Runs compared"
    } else {
        "Over time"
    };
    section(&mut s, runs, &overlays);
    s.push_str("</main>\n</body>\n</html>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        let row = |t: f64, ratio: Option<f64>| Row {
            time_s: t,
            offered_originals_per_s: Some(100.0),
            offered_retries_per_s: Some(5.0),
            goodput_per_s: Some(f64::NAN),
            retry_ratio: ratio,
            ..Row::default()
        };
        Report {
            format: String::new(),
            title: "A <test>".into(),
            description: "one\n\ntwo".into(),
            runs: vec![
                Run {
                    name: "naive, fixed".into(),
                    summary: vec![("goodput".into(), "1 /s".into())],
                    rows: vec![row(1.0, Some(0.05)), row(2.0, None)],
                },
                Run {
                    name: "backstop".into(),
                    summary: vec![("amplification".into(), "1.1".into())],
                    rows: vec![row(1.0, Some(0.3))],
                },
            ],
        }
    }

    #[test]
    fn csv_has_the_stable_header_empty_cells_and_quoted_names() {
        let text = csv(&validated(&report()).unwrap());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "run,time_s,offered_originals_per_s,offered_retries_per_s,goodput_per_s,\
             refused_per_s,wasted_per_s,queue_depth,p99_ms,admission_limit,in_flight,retry_ratio"
        );
        assert_eq!(lines[1], "\"naive, fixed\",1,100,5,,,,,,,,0.05");
        assert_eq!(lines[2], "\"naive, fixed\",2,100,5,,,,,,,,");
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn json_round_trips_with_the_format_and_nulls() {
        let dir = tempfile::tempdir().unwrap();
        write(&report(), dir.path()).unwrap();
        let text = std::fs::read_to_string(dir.path().join("data.json")).unwrap();
        let back: Report = serde_json::from_str(&text).unwrap();
        assert_eq!(back.format, FORMAT);
        assert_eq!(
            back.runs[0].rows[0].goodput_per_s, None,
            "NaN is written as missing"
        );
        assert_eq!(back.runs[1].summary[0].0, "amplification");
    }

    #[test]
    fn html_is_self_contained_escaped_and_has_the_threshold_lines() {
        let page = html(&validated(&report()).unwrap());
        assert!(page.contains("A &lt;test&gt;") && !page.contains("<test>"));
        // Nothing fetched from elsewhere: the SVG namespace is the only URL.
        let bare = page.replace("xmlns=\"http://www.w3.org/2000/svg\"", "");
        for needle in ["<script", "<link", "http://", "https://", "url(", "@import"] {
            assert!(!bare.contains(needle), "{needle}");
        }
        assert!(page.contains("0.1 warn") && page.contains("0.2 storm"));
        // Two load charts (one per run), goodput is all missing: no goodput chart.
        assert_eq!(page.matches(": offered load and goodput</text>").count(), 2);
        assert!(!page.contains(">Goodput<"));
        assert!(!page.contains("NaN"));
    }

    #[test]
    fn load_charts_share_one_scale_and_empty_charts_are_left_out() {
        let mut r = validated(&report()).unwrap();
        r.runs[1].rows[0].offered_retries_per_s = Some(400.0);
        let (per_run, overlays) = charts(&r);
        assert_eq!(per_run.len(), 2);
        assert_eq!(per_run[0].y_max, per_run[1].y_max);
        assert!(per_run[0].y_max.unwrap() >= 500.0, "{:?}", per_run[0].y_max);
        let titles: Vec<&str> = overlays.iter().map(|c| c.title.as_str()).collect();
        assert_eq!(titles, ["Retry ratio"], "only what some run measured");
    }

    #[test]
    fn empty_reports_are_refused_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = report();
        r.runs[1].rows.clear();
        let e = write(&r, dir.path()).unwrap_err();
        assert!(e.to_string().contains("\"backstop\" has no rows"), "{e}");
        r.runs.clear();
        assert!(write(&r, dir.path()).is_err());
        assert!(!dir.path().join("index.html").exists());
    }
}
