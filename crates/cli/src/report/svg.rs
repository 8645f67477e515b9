//! Inline SVG line and area charts: hand-written, so the page needs no script, font or
//! stylesheet from anywhere else, and looks the same in every browser.

use std::fmt::Write as _;

/// Width and height of a chart's view box; the page scales it to its column.
const W: f64 = 640.0;
const H: f64 = 330.0;
/// Plot area margins: room for the title and legend above, tick labels left and below.
const LEFT: f64 = 62.0;
const RIGHT: f64 = 18.0;
const TOP: f64 = 58.0;
const BOTTOM: f64 = 46.0;

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Style {
    /// A solid line.
    Line,
    /// A thinner dashed line (a secondary quantity beside a solid one).
    Dashed,
    /// Filled down to the series below it (stacked in the order given).
    Stacked,
}

/// One series of a chart: points `(x, y)`; `None` leaves a gap.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub(crate) label: String,
    pub(crate) color: &'static str,
    pub(crate) style: Style,
    pub(crate) points: Vec<(f64, Option<f64>)>,
}

/// A horizontal reference line (a threshold), dashed, labelled at its right end.
#[derive(Debug, Clone)]
pub(crate) struct Threshold {
    pub(crate) value: f64,
    pub(crate) label: String,
    pub(crate) color: &'static str,
}

/// A chart: title, axis labels with units, series, thresholds.
#[derive(Debug, Clone)]
pub(crate) struct Chart {
    pub(crate) title: String,
    pub(crate) x_label: String,
    pub(crate) y_label: String,
    pub(crate) series: Vec<Series>,
    pub(crate) thresholds: Vec<Threshold>,
    /// Highest x value drawn (the same for charts shown side by side), else from the data.
    pub(crate) x_max: Option<f64>,
    /// Highest y value drawn (the same for small multiples), else from the data.
    pub(crate) y_max: Option<f64>,
    /// One sentence under the chart: what to look at.
    pub(crate) note: String,
    /// A logarithmic y axis from this value up (values below it drawn at the bottom): for a
    /// ratio spanning 0.05 to 2 whose thresholds (0.1, 0.2) must stay apart.
    pub(crate) log_y_min: Option<f64>,
}

/// Escapes text for XML and HTML content and attribute values.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A "nice" step (1, 2 or 5 times a power of ten) giving about `target` ticks up to `max`.
pub(crate) fn nice_step(max: f64, target: f64) -> f64 {
    if !(max.is_finite() && max > 0.0) {
        return 1.0;
    }
    let raw = max / target;
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude)
}

/// A tick label for `v` on an axis stepping by `step`: no more decimals than the step needs,
/// thousands as `k`.
pub(crate) fn tick_label(v: f64, step: f64) -> String {
    if v.abs() >= 10_000.0 && step >= 1000.0 {
        return tick_label(v / 1000.0, step / 1000.0) + "k";
    }
    let decimals = if step >= 1.0 {
        0
    } else {
        // Integer arithmetic on a small positive count: at most a dozen decimals.
        (-step.log10().floor()).clamp(0.0, 12.0) as usize
    };
    format!("{v:.decimals$}")
}

impl Chart {
    /// Highest value of the data (stacked series added up) and the thresholds.
    fn data_max(&self) -> f64 {
        let mut max: f64 = self.thresholds.iter().map(|t| t.value).fold(0.0, f64::max);
        let stacked = stack(&self.series);
        for (series, tops) in self.series.iter().zip(&stacked) {
            let values = match series.style {
                Style::Stacked => tops.clone(),
                _ => series.points.iter().map(|p| p.1).collect(),
            };
            for v in values.into_iter().flatten() {
                if v.is_finite() {
                    max = max.max(v);
                }
            }
        }
        max
    }

    /// The y axis: linear from 0 to a tick above the data (with a little headroom), or
    /// logarithmic from `log_y_min` to the next 1-2-5 value above the data.
    fn y_scale(&self) -> YScale {
        let max = self.y_max.unwrap_or(self.data_max() * 1.08);
        match self.log_y_min {
            Some(lo) if lo > 0.0 => {
                let top = log_ticks(lo, f64::INFINITY)
                    .into_iter()
                    .find(|t| *t >= max.max(lo * 10.0))
                    .unwrap_or(lo * 10.0);
                YScale::Log { lo, top }
            }
            _ => {
                let step = nice_step(max, 5.0);
                YScale::Linear {
                    top: (max / step).ceil().max(1.0) * step,
                    step,
                }
            }
        }
    }

    fn x_range(&self) -> (f64, f64) {
        let xs = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0));
        let (lo, hi) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
        let lo = if lo.is_finite() { lo.min(0.0) } else { 0.0 };
        let hi = self.x_max.unwrap_or(if hi.is_finite() { hi } else { 1.0 });
        (lo, if hi > lo { hi } else { lo + 1.0 })
    }

    /// The chart as an `<svg>` element.
    pub(crate) fn render(&self) -> String {
        let (x_lo, x_hi) = self.x_range();
        let scale = self.y_scale();
        let pw = W - LEFT - RIGHT;
        let ph = H - TOP - BOTTOM;
        let sx = |x: f64| LEFT + (x - x_lo) / (x_hi - x_lo) * pw;
        let sy = |y: f64| TOP + ph - scale.fraction(y) * ph;

        let mut s = String::new();
        let _ = write!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" role="img" aria-label="{}" class="chart">"#,
            escape(&self.title)
        );
        let _ = write!(
            s,
            r#"<text x="{LEFT}" y="22" class="title">{}</text>"#,
            escape(&self.title)
        );
        // Legend: one row under the title.
        let mut lx = LEFT;
        for series in &self.series {
            let swatch = match series.style {
                Style::Stacked => format!(
                    r#"<rect x="{lx}" y="33" width="14" height="10" fill="{}" fill-opacity="0.55" stroke="{}"/>"#,
                    series.color, series.color
                ),
                Style::Line => format!(
                    r#"<line x1="{lx}" y1="38" x2="{}" y2="38" stroke="{}" stroke-width="3"/>"#,
                    lx + 16.0,
                    series.color
                ),
                Style::Dashed => format!(
                    r#"<line x1="{lx}" y1="38" x2="{}" y2="38" stroke="{}" stroke-width="2" stroke-dasharray="4 3"/>"#,
                    lx + 16.0,
                    series.color
                ),
            };
            s.push_str(&swatch);
            let _ = write!(
                s,
                r#"<text x="{}" y="42" class="legend">{}</text>"#,
                lx + 21.0,
                escape(&series.label)
            );
            // Approximate text width at 12 px: wide enough for proportional fonts.
            lx += 21.0 + 6.6 * series.label.chars().count() as f64 + 16.0;
        }
        // Thresholds in the legend too, not printed on their lines: close ones would overlap.
        for t in &self.thresholds {
            let _ = write!(
                s,
                r#"<line x1="{lx}" y1="38" x2="{}" y2="38" stroke="{}" stroke-width="2" stroke-dasharray="6 4"/><text x="{}" y="42" class="legend threshold" fill="{}">{}</text>"#,
                lx + 18.0,
                t.color,
                lx + 23.0,
                t.color,
                escape(&t.label)
            );
            lx += 23.0 + 6.6 * t.label.chars().count() as f64 + 16.0;
        }

        // Grid and y ticks.
        for (v, label) in scale.ticks() {
            let y = sy(v);
            let _ = write!(
                s,
                r#"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" class="grid"/><text x="{:.1}" y="{:.1}" class="tick" text-anchor="end">{label}</text>"#,
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0,
            );
        }
        // x ticks.
        let x_step = nice_step(x_hi - x_lo, 8.0);
        let mut v = (x_lo / x_step).ceil() * x_step;
        while v <= x_hi + x_step / 1000.0 {
            let x = sx(v);
            let _ = write!(
                s,
                r#"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" class="axis"/><text x="{x:.1}" y="{:.1}" class="tick" text-anchor="middle">{}</text>"#,
                TOP + ph,
                TOP + ph + 5.0,
                TOP + ph + 19.0,
                tick_label(v, x_step)
            );
            v += x_step;
        }
        let _ = write!(
            s,
            r#"<line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" class="axis"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{:.1}" class="axis"/>"#,
            TOP + ph,
            LEFT + pw,
            TOP + ph,
            TOP + ph
        );
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{:.1}" class="axis-label" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            H - 8.0,
            escape(&self.x_label)
        );
        let _ = write!(
            s,
            r#"<text transform="translate(16 {:.1}) rotate(-90)" class="axis-label" text-anchor="middle">{}</text>"#,
            TOP + ph / 2.0,
            escape(&self.y_label)
        );

        // Stacked areas first (under the lines), bottom layer first.
        let stacked = stack(&self.series);
        for (i, series) in self.series.iter().enumerate() {
            if series.style != Style::Stacked {
                continue;
            }
            let below = self.series[..i]
                .iter()
                .zip(&stacked)
                .rev()
                .find(|(s, _)| s.style == Style::Stacked)
                .map(|(_, tops)| tops.clone());
            for run in segments(&series.points, &stacked[i]) {
                let mut d = String::new();
                for (k, &(_, x, top)) in run.iter().enumerate() {
                    let _ = write!(
                        d,
                        "{}{:.1},{:.1} ",
                        if k == 0 { "M" } else { "L" },
                        sx(x),
                        sy(top)
                    );
                }
                for &(j, x, _) in run.iter().rev() {
                    let base = below.as_ref().and_then(|b| b.get(j).copied().flatten());
                    let base = base.unwrap_or(0.0);
                    let _ = write!(d, "L{:.1},{:.1} ", sx(x), sy(base));
                }
                let _ = write!(
                    s,
                    r#"<path d="{}Z" fill="{}" fill-opacity="0.45" stroke="{}" stroke-width="1.5"/>"#,
                    d, series.color, series.color
                );
            }
        }
        for t in &self.thresholds {
            let y = sy(t.value);
            let _ = write!(
                s,
                r#"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{}" stroke-width="1.5" stroke-dasharray="7 5"/>"#,
                LEFT + pw,
                t.color,
            );
        }
        for series in &self.series {
            let (width, dash) = match series.style {
                Style::Stacked => continue,
                Style::Line => (2.5, ""),
                Style::Dashed => (2.0, r#" stroke-dasharray="5 4""#),
            };
            let values: Vec<Option<f64>> = series.points.iter().map(|p| p.1).collect();
            for run in segments(&series.points, &values) {
                let pts: Vec<String> = run
                    .iter()
                    .map(|&(_, x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
                    .collect();
                let _ = write!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="{width}" stroke-linejoin="round"{dash}/>"#,
                    pts.join(" "),
                    series.color
                );
            }
        }
        s.push_str("</svg>");
        s
    }
}

/// A y axis.
#[derive(Debug, Clone, Copy, PartialEq)]
enum YScale {
    /// From 0 to `top`, ticks every `step`.
    Linear { top: f64, step: f64 },
    /// Logarithmic from `lo` to `top`, ticks at 1, 2 and 5 times powers of ten.
    Log { lo: f64, top: f64 },
}

impl YScale {
    /// Where `v` sits between the bottom (0) and the top (1), clamped.
    fn fraction(self, v: f64) -> f64 {
        match self {
            YScale::Linear { top, .. } => v.clamp(0.0, top) / top,
            YScale::Log { lo, top } => {
                (v.clamp(lo, top).log10() - lo.log10()) / (top.log10() - lo.log10())
            }
        }
    }

    /// Tick values and their labels.
    fn ticks(self) -> Vec<(f64, String)> {
        match self {
            YScale::Linear { top, step } => {
                let n = (top / step).round() as usize;
                (0..=n)
                    .map(|i| {
                        let v = step * i as f64;
                        (v, tick_label(v, step))
                    })
                    .collect()
            }
            YScale::Log { lo, top } => log_ticks(lo, top)
                .into_iter()
                .map(|v| (v, format!("{v}")))
                .collect(),
        }
    }
}

/// 1, 2 and 5 times powers of ten from `lo` (included) up to `hi`; at most 40 of them.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut decade = 10f64.powf(lo.log10().floor());
    while out.len() < 40 {
        for m in [1.0, 2.0, 5.0] {
            // Rounded to 12 significant digits: 0.1 * 2 must print as 0.2.
            let v = format!("{:.12e}", m * decade)
                .parse::<f64>()
                .unwrap_or(m * decade);
            if v > hi * (1.0 + 1e-9) {
                return out;
            }
            if v >= lo * (1.0 - 1e-9) {
                out.push(v);
            }
        }
        decade *= 10.0;
    }
    out
}

/// For each series, the top of its band when the `Stacked` series are added up in order
/// (`None` where the series has no value); other series are left as they are.
fn stack(series: &[Series]) -> Vec<Vec<Option<f64>>> {
    let mut acc: Vec<f64> = Vec::new();
    series
        .iter()
        .map(|s| {
            if s.style != Style::Stacked {
                return s.points.iter().map(|p| p.1).collect();
            }
            if acc.len() < s.points.len() {
                acc.resize(s.points.len(), 0.0);
            }
            s.points
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let v = p.1.filter(|v| v.is_finite())?;
                    acc[i] += v.max(0.0);
                    Some(acc[i])
                })
                .collect()
        })
        .collect()
}

/// Runs of consecutive points with a finite value: `(index, x, value)`; a gap splits them.
fn segments(points: &[(f64, Option<f64>)], values: &[Option<f64>]) -> Vec<Vec<(usize, f64, f64)>> {
    let mut runs = Vec::new();
    let mut run = Vec::new();
    for (i, (p, v)) in points.iter().zip(values).enumerate() {
        match v.filter(|v| v.is_finite() && p.0.is_finite()) {
            Some(v) => run.push((i, p.0, v)),
            None if !run.is_empty() => runs.push(std::mem::take(&mut run)),
            None => {}
        }
    }
    if !run.is_empty() {
        runs.push(run);
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(points: Vec<(f64, Option<f64>)>) -> Series {
        Series {
            label: "a <b>".into(),
            color: "#123456",
            style: Style::Line,
            points,
        }
    }

    fn chart(series: Vec<Series>) -> Chart {
        Chart {
            title: "T & U".into(),
            x_label: "time (s)".into(),
            y_label: "requests/s".into(),
            series,
            thresholds: vec![],
            x_max: None,
            y_max: None,
            note: String::new(),
            log_y_min: None,
        }
    }

    #[test]
    fn nice_steps_are_1_2_5_times_a_power_of_ten() {
        assert_eq!(nice_step(100.0, 5.0), 20.0);
        assert_eq!(nice_step(0.25, 5.0), 0.05);
        assert_eq!(nice_step(7000.0, 5.0), 2000.0);
        assert_eq!(nice_step(0.0, 5.0), 1.0);
        assert_eq!(nice_step(f64::NAN, 5.0), 1.0);
    }

    #[test]
    fn tick_labels_use_the_decimals_the_step_needs() {
        assert_eq!(tick_label(0.15, 0.05), "0.15");
        assert_eq!(tick_label(0.2, 0.1), "0.2");
        assert_eq!(tick_label(40.0, 20.0), "40");
        assert_eq!(tick_label(20_000.0, 5000.0), "20k");
    }

    #[test]
    fn gaps_split_lines_and_text_is_escaped() {
        let svg = chart(vec![line(vec![
            (0.0, Some(1.0)),
            (1.0, Some(2.0)),
            (2.0, None),
            (3.0, Some(f64::NAN)),
            (4.0, Some(3.0)),
            (5.0, Some(4.0)),
        ])])
        .render();
        assert_eq!(svg.matches("<polyline").count(), 2, "{svg}");
        assert!(svg.contains("T &amp; U") && svg.contains("a &lt;b&gt;"));
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
    }

    #[test]
    fn empty_and_flat_series_still_draw_axes() {
        for series in [vec![], vec![line(vec![(0.0, Some(0.0)), (1.0, Some(0.0))])]] {
            let svg = chart(series).render();
            assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
            assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        }
    }

    #[test]
    fn log_scale_ticks_and_clamps() {
        assert_eq!(
            log_ticks(0.01, 2.0),
            [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]
        );
        let scale = YScale::Log { lo: 0.01, top: 1.0 };
        assert_eq!(scale.fraction(0.0), 0.0, "zero is drawn at the bottom");
        assert!((scale.fraction(0.1) - 0.5).abs() < 1e-12);
        assert_eq!(scale.fraction(5.0), 1.0);
        let mut c = chart(vec![line(vec![(0.0, Some(0.0)), (1.0, Some(1.5))])]);
        c.log_y_min = Some(0.01);
        assert_eq!(c.y_scale(), YScale::Log { lo: 0.01, top: 2.0 });
        let svg = c.render();
        assert!(svg.contains(">0.2</text>") && !svg.contains("NaN"), "{svg}");
    }

    #[test]
    fn stacked_series_add_up() {
        let mut a = line(vec![(0.0, Some(1.0)), (1.0, Some(2.0))]);
        a.style = Style::Stacked;
        let mut b = line(vec![(0.0, Some(3.0)), (1.0, None)]);
        b.style = Style::Stacked;
        let tops = stack(&[a, b]);
        assert_eq!(tops[0], [Some(1.0), Some(2.0)]);
        assert_eq!(tops[1], [Some(4.0), None]);
    }
}
