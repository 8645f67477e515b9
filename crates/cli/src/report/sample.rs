//! `backstop report-sample`: a report from synthetic data, to see (and test) the report
//! writer before a simulator or a live run fills it. The numbers are made up by formulas with
//! the shape of a slowdown (a dependency slowing from 100 to 600 ms for 30 s), and the page
//! says so.

use std::error::Error;
use std::path::PathBuf;

use super::{Report, Row, Run, write};

/// Arguments of `backstop report-sample`.
#[derive(Debug, clap::Args)]
pub(crate) struct SampleArgs {
    /// Directory to write index.html, data.json and data.csv into (created if missing).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

/// Writes the sample report into `args.out` and prints where.
pub(crate) fn run_sample(args: &SampleArgs) -> Result<(), Box<dyn Error>> {
    write(&sample(), &args.out)?;
    println!("{}", args.out.join("index.html").display());
    Ok(())
}

/// Smooth step from 0 to 1 between `a` and `b`.
fn ramp(t: f64, a: f64, b: f64) -> f64 {
    ((t - a) / (b - a)).clamp(0.0, 1.0)
}

/// The synthetic report: "naive" and "backstop" clients, 2000 requests/s offered, the
/// dependency slow from 10 s to 40 s of 60.
pub(crate) fn sample() -> Report {
    let offered = 2000.0;
    // 0 before the slowdown, 1 during it, back to 0 after.
    let slow = |t: f64| ramp(t, 10.0, 12.0) * (1.0 - ramp(t, 40.0, 42.0));
    let naive = (1..=60)
        .map(|i| {
            let t = f64::from(i);
            // Retries pile up during the slowdown and drain slowly after it.
            let storm = ramp(t, 11.0, 20.0) * (1.0 - ramp(t, 40.0, 52.0));
            let retries = 20.0 + 3900.0 * storm;
            let goodput = offered * (1.0 - 0.82 * storm) - 100.0 * slow(t);
            Row {
                time_s: t,
                offered_originals_per_s: Some(offered),
                offered_retries_per_s: Some(retries),
                goodput_per_s: Some(goodput.max(0.0)),
                refused_per_s: Some(0.0),
                wasted_per_s: Some(1900.0 * storm),
                queue_depth: Some(6000.0 * storm),
                p99_ms: Some(120.0 + 2900.0 * storm + 400.0 * slow(t)),
                admission_limit: None,
                in_flight: Some(200.0 + 300.0 * slow(t).max(storm)),
                retry_ratio: Some(retries / offered),
            }
        })
        .collect();
    let backstop = (1..=60)
        .map(|i| {
            let t = f64::from(i);
            let s = slow(t);
            let retries = 20.0 + 130.0 * s;
            Row {
                time_s: t,
                offered_originals_per_s: Some(offered),
                offered_retries_per_s: Some(retries),
                goodput_per_s: Some(offered - 1160.0 * s),
                refused_per_s: Some(1100.0 * s),
                wasted_per_s: Some(40.0 * s),
                queue_depth: Some(60.0 * s),
                p99_ms: Some(120.0 + 1050.0 * s),
                admission_limit: Some(500.0 - 140.0 * s),
                in_flight: Some(200.0 + 150.0 * s),
                retry_ratio: Some(retries / offered),
            }
        })
        .collect();
    Report {
        format: String::new(),
        title: "Sample report: slowdown (synthetic data)".into(),
        description: "Synthetic numbers shaped like a slowdown, to show the report's layout: \
            2000 requests/s offered, the dependency slows from 100 ms to 600 ms between 10 s \
            and 40 s. Not a measurement.\n\n\
            \"naive\" retries every timeout at once; \"backstop\" spends a retry budget and \
            refuses what it cannot serve in time."
            .into(),
        runs: vec![
            Run {
                name: "naive".into(),
                summary: vec![
                    ("offered".into(), "2000 /s".into()),
                    ("peak retry ratio".into(), "1.96".into()),
                    ("goodput during the slowdown".into(), "260 /s".into()),
                ],
                rows: naive,
            },
            Run {
                name: "backstop".into(),
                summary: vec![
                    ("offered".into(), "2000 /s".into()),
                    ("peak retry ratio".into(), "0.075".into()),
                    ("goodput during the slowdown".into(), "840 /s".into()),
                ],
                rows: backstop,
            },
        ],
    }
}
