//! Per-interval counts of a load run, for charts and for judging recovery: what was offered
//! (originals, retries, hedges), what came back (by outcome), and how long the logical
//! requests that ended in each interval took.
//!
//! Written with `--series PATH` as CSV, one row per interval:
//!
//! | column | meaning |
//! |---|---|
//! | `t_s` | start of the interval, seconds from the start of the run |
//! | `originals` | first attempts sent |
//! | `retries` | retries sent (attempt number > 1, not hedges) |
//! | `hedges` | hedged copies sent |
//! | `ok` | logical requests that succeeded |
//! | `rejected` | ... refused by admission (overload, quota) |
//! | `timeout` | ... whose deadline passed |
//! | `failed` | ... that failed otherwise |
//! | `p50_ms`, `p99_ms` | latency of the logical requests that succeeded (empty: none) |

use std::io::{self, Write};
use std::time::Duration;

use backstop::status::Outcome;
use hdrhistogram::Histogram;
use tokio::time::Instant;

use super::report::AttemptKind;

/// Intervals a series holds at most: the interval widens with long runs to stay within it.
const MAX_ROWS: usize = 600;

/// Highest latency recorded, in ms (longer is clamped): one hour.
const MAX_LATENCY_MS: u64 = 3_600_000;

/// The per-interval counts of one run.
#[derive(Debug)]
pub(crate) struct Series {
    start: Instant,
    width: Duration,
    rows: Vec<Row>,
}

#[derive(Debug)]
struct Row {
    originals: u64,
    retries: u64,
    hedges: u64,
    ok: u64,
    rejected: u64,
    timeout: u64,
    failed: u64,
    /// Milliseconds, of logical requests that succeeded.
    latency: Histogram<u64>,
}

impl Row {
    fn new() -> Row {
        Row {
            originals: 0,
            retries: 0,
            hedges: 0,
            ok: 0,
            rejected: 0,
            timeout: 0,
            failed: 0,
            latency: Histogram::new_with_bounds(1, MAX_LATENCY_MS, 3)
                .expect("constant histogram bounds are valid"),
        }
    }
}

impl Series {
    /// A series for a run starting at `start` that schedules requests for `run` (answers may
    /// come up to a deadline later; the rows grow as needed, within [`MAX_ROWS`]), in rows of
    /// `interval`, widened if the run would need more than half of [`MAX_ROWS`].
    pub(crate) fn new(start: Instant, run: Duration, interval: Duration) -> Series {
        let per_row = run.div_f64(MAX_ROWS as f64 / 2.0);
        Series {
            start,
            width: per_row.max(interval),
            rows: Vec::new(),
        }
    }

    /// The row of the interval holding `at` (times past the last row go to the last row).
    fn row(&mut self, at: Instant) -> &mut Row {
        let offset = at.saturating_duration_since(self.start);
        let index = (offset.as_secs_f64() / self.width.as_secs_f64()) as usize;
        let index = index.min(MAX_ROWS - 1);
        while self.rows.len() <= index {
            self.rows.push(Row::new());
        }
        &mut self.rows[index]
    }

    /// Records one logical request: its attempts (when each was sent, and what it was), and
    /// how it ended at `ended` after starting at `started`.
    pub(crate) fn record(
        &mut self,
        attempts: &[(Instant, AttemptKind)],
        outcome: Outcome,
        started: Instant,
        ended: Instant,
    ) {
        for &(sent, kind) in attempts {
            let row = self.row(sent);
            match kind {
                AttemptKind::Original => row.originals += 1,
                AttemptKind::Retry => row.retries += 1,
                AttemptKind::Hedge => row.hedges += 1,
                // Never left the client: nothing was offered to the server.
                AttemptKind::Resend => {}
            }
        }
        let row = self.row(ended);
        match outcome {
            Outcome::Ok => {
                row.ok += 1;
                let ms =
                    u64::try_from(ended.duration_since(started).as_millis()).unwrap_or(u64::MAX);
                row.latency.saturating_record(ms.clamp(1, MAX_LATENCY_MS));
            }
            Outcome::Rejected => row.rejected += 1,
            Outcome::Timeout => row.timeout += 1,
            Outcome::Retryable | Outcome::Fatal | Outcome::Cancelled => row.failed += 1,
        }
    }

    /// Writes the series as CSV (see the module docs for the columns).
    pub(crate) fn write_csv(&self, mut out: impl Write) -> io::Result<()> {
        writeln!(
            out,
            "t_s,originals,retries,hedges,ok,rejected,timeout,failed,p50_ms,p99_ms"
        )?;
        for (i, row) in self.rows.iter().enumerate() {
            // In whole milliseconds first, so that 0.1 s rows print as 0.3, not 0.30000000000000004.
            let t = (self.width.as_millis() * i as u128) as f64 / 1000.0;
            let quantile = |q: f64| {
                if row.latency.is_empty() {
                    String::new()
                } else {
                    // The bucket's lower bound: within 0.1% of the value recorded.
                    let v = row.latency.value_at_quantile(q);
                    row.latency.lowest_equivalent(v).to_string()
                }
            };
            writeln!(
                out,
                "{t},{},{},{},{},{},{},{},{},{}",
                row.originals,
                row.retries,
                row.hedges,
                row.ok,
                row.rejected,
                row.timeout,
                row.failed,
                quantile(0.5),
                quantile(0.99),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempts_count_where_they_were_sent_and_answers_where_they_ended() {
        let start = Instant::now();
        let mut series = Series::new(start, Duration::from_secs(10), Duration::from_secs(1));
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        series.record(
            &[
                (start + ms(100), AttemptKind::Original),
                (start + ms(1_200), AttemptKind::Retry),
                (start + ms(1_300), AttemptKind::Resend),
            ],
            Outcome::Ok,
            start + ms(100),
            start + ms(2_100),
        );
        series.record(
            &[
                (start + ms(500), AttemptKind::Original),
                (start + ms(700), AttemptKind::Hedge),
            ],
            Outcome::Rejected,
            start + ms(500),
            start + ms(900),
        );
        series.record(&[], Outcome::Timeout, start + s(3), start + s(5));
        let mut csv = Vec::new();
        series.write_csv(&mut csv).unwrap();
        let csv = String::from_utf8(csv).unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(
            lines,
            [
                "t_s,originals,retries,hedges,ok,rejected,timeout,failed,p50_ms,p99_ms",
                "0,2,0,1,0,1,0,0,,",
                "1,0,1,0,0,0,0,0,,",
                "2,0,0,0,1,0,0,0,2000,2000",
                "3,0,0,0,0,0,0,0,,",
                "4,0,0,0,0,0,0,0,,",
                "5,0,0,0,0,0,1,0,,",
            ]
        );
    }

    #[test]
    fn long_runs_widen_the_interval_and_stay_bounded() {
        let start = Instant::now();
        let mut series = Series::new(
            start,
            Duration::from_secs(24 * 3600),
            Duration::from_secs(1),
        );
        assert!(series.width > Duration::from_secs(1));
        series.record(
            &[],
            Outcome::Ok,
            start,
            start + Duration::from_secs(100 * 24 * 3600),
        );
        assert_eq!(series.rows.len(), MAX_ROWS);
    }
}
