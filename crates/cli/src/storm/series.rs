//! What a run measured: the per-interval series (one plain row per interval, what the table,
//! the JSON, the CSV and a chart writer all read) and the summary derived from it.

use std::collections::BTreeMap;

use serde::Serialize;

/// One interval of one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(crate) struct Row {
    /// Interval start, seconds of simulated time.
    pub(crate) t: f64,
    /// First attempts sent.
    pub(crate) offered_originals: u64,
    /// Retries and hedges sent.
    pub(crate) offered_retries: u64,
    /// Of `offered_retries`, the hedges.
    pub(crate) hedges: u64,
    /// Attempts answered successfully while their client still waited (goodput).
    pub(crate) goodput: u64,
    /// Attempts the server worked on whose client had already given up (wasted work).
    pub(crate) wasted: u64,
    /// Attempts the server's admission refused.
    pub(crate) refused: u64,
    /// Of the attempts sent in this interval, those that failed (refused, timed out, errors),
    /// whenever that became known.
    pub(crate) attempts_failed: u64,
    /// Attempts waiting for admission at the interval's end.
    pub(crate) queue: u64,
    /// Attempts running at the interval's end.
    pub(crate) inflight: u64,
    /// The server's concurrency limit at the interval's end.
    pub(crate) limit: u64,
    /// p99 latency, in ms, of the logical requests that ended in this interval (success or
    /// not); 0 when none did.
    pub(crate) p99_ms: f64,
    /// p99, in ms, of the server's time on the attempts it answered in this interval (from a
    /// worker's start to the answer: what the server's latency metric shows, the wait before
    /// a worker not included); 0 when none.
    pub(crate) service_p99_ms: f64,
    /// Retries and hedges sent per first attempt sent.
    pub(crate) retry_ratio: f64,
    /// `attempts_failed` over the attempts sent.
    pub(crate) failure_probability: f64,
    /// Logical requests that succeeded in this interval.
    pub(crate) logical_ok: u64,
    /// Logical requests that gave up in this interval.
    pub(crate) logical_failed: u64,
    /// The client's storm alarm at the interval's end: `calm`, `warning`, `tripped` or `off`.
    pub(crate) storm: &'static str,
}

impl Row {
    /// Attempts sent in the interval.
    pub(crate) fn offered(&self) -> u64 {
        self.offered_originals + self.offered_retries
    }

    /// Fills the derived fields.
    pub(crate) fn derive(&mut self) {
        self.retry_ratio = ratio(self.offered_retries, self.offered_originals);
        self.failure_probability = ratio(self.attempts_failed, self.offered());
    }
}

/// Counts over a whole run.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Totals {
    pub(crate) logical: u64,
    pub(crate) logical_ok: u64,
    pub(crate) attempts: u64,
    pub(crate) retries: u64,
    pub(crate) hedges: u64,
    pub(crate) goodput: u64,
    pub(crate) wasted: u64,
    pub(crate) refused: u64,
    pub(crate) served: u64,
    pub(crate) server_arrivals: u64,
    /// Logical requests whose first attempt failed.
    pub(crate) first_failed: u64,
    /// Why logical requests gave up.
    pub(crate) stops: BTreeMap<&'static str, u64>,
    pub(crate) peak_queue: u64,
    /// Attempt-seconds spent at the server (waiting or running).
    pub(crate) time_in_system: f64,
    /// Seconds from arrival to departure, summed over departed attempts.
    pub(crate) sojourn: f64,
    /// Simulated seconds.
    pub(crate) seconds: f64,
}

/// The stability quantity `r x A0 x p'(A*)` measured from a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Stability {
    /// Retries sent per logical request whose first attempt failed.
    pub(crate) r: f64,
    /// Original load: first attempts per second.
    pub(crate) a0: f64,
    /// Offered load at the operating point: attempts per second over the window.
    pub(crate) a_star: f64,
    /// Failure probability of an attempt at the operating point.
    pub(crate) p_star: f64,
    /// Slope of the failure probability against offered load (per attempt/s), least squares
    /// over the window's intervals.
    pub(crate) p_slope: f64,
    /// `r x A0 x p'(A*)`.
    pub(crate) gain: f64,
    /// `stable` (gain < 1), `storm` (gain >= 1), or `overloaded` when the original load
    /// alone is at or above the window's capacity: there is no healthy operating point and
    /// the gain says nothing.
    pub(crate) verdict: &'static str,
}

/// Little's law checked on the server: `L` (time-averaged attempts in the system) against
/// `lambda x W` (departures per second times mean time in the system).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Little {
    pub(crate) l: f64,
    pub(crate) lambda: f64,
    pub(crate) w_ms: f64,
    pub(crate) lambda_w: f64,
    /// `|L - lambda W| / L`.
    pub(crate) relative_error: f64,
}

/// A run's headline numbers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Summary {
    pub(crate) policy: String,
    pub(crate) logical: u64,
    /// Share of logical requests that succeeded.
    pub(crate) success: f64,
    pub(crate) attempts: u64,
    pub(crate) retries: u64,
    pub(crate) hedges: u64,
    /// Attempts per first attempt over the whole run.
    pub(crate) amplification: f64,
    /// The window the scenario is about (e.g. the slowdown), seconds.
    pub(crate) focus_from: f64,
    pub(crate) focus_to: f64,
    /// Attempts per first attempt within the window.
    pub(crate) focus_amplification: f64,
    /// Goodput per second within the window.
    pub(crate) focus_goodput: f64,
    /// The server's capacity within the window (workers / mean service time), per second.
    pub(crate) focus_capacity: f64,
    /// Wasted work per second within the window.
    pub(crate) focus_wasted: f64,
    /// p99 latency of logical requests within the window (the worst interval), ms.
    pub(crate) focus_p99_ms: f64,
    pub(crate) wasted: u64,
    pub(crate) refused: u64,
    pub(crate) peak_queue: u64,
    /// Peak memory held by waiting requests at the assumed footprint, MiB.
    pub(crate) peak_queue_mib: f64,
    pub(crate) stops: BTreeMap<&'static str, u64>,
    pub(crate) stability: Stability,
    /// Seconds from the recovery of the downstream until goodput is back (three intervals in
    /// a row at 90 % of the original load or more); `None` if not within the run.
    pub(crate) recovery_s: Option<f64>,
    /// Seconds from the recovery of the downstream until goodput is back to what the window's
    /// capacity allows (three intervals in a row at 90 % of the lesser of the original load and
    /// the capacity, or more); `None` if not within the run. Shorter than `recovery_s` when the
    /// downstream comes back with less capacity than the load asks for.
    pub(crate) to_capacity_s: Option<f64>,
    /// Attempts running at the server, that is calls at the downstream, at the end of the
    /// first interval after the downstream's return: how much of the backlog it received at
    /// once.
    pub(crate) return_inflight: Option<u64>,
    /// Whether the scenario has a recovery to time.
    #[serde(skip)]
    pub(crate) recovery_timed: bool,
    pub(crate) little: Little,
}

/// What the summary needs to know about the scenario.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Focus {
    pub(crate) from: f64,
    pub(crate) to: f64,
    pub(crate) capacity: f64,
    /// When the downstream recovers, if the scenario has a recovery.
    pub(crate) recover_at: Option<f64>,
}

/// Memory a waiting request holds (body, context, deadline): the figure behind the queue's
/// memory column, an assumption rather than a measurement.
pub(crate) const REQUEST_FOOTPRINT_KIB: f64 = 32.0;

/// Summarises one run.
pub(crate) fn summarise(
    policy: &str,
    rows: &mut [Row],
    totals: &Totals,
    interval: f64,
    focus: Focus,
) -> Summary {
    for row in rows.iter_mut() {
        row.derive();
    }
    let in_focus = |r: &&Row| r.t >= focus.from - 1e-9 && r.t < focus.to - 1e-9;
    let window: Vec<&Row> = rows.iter().filter(in_focus).collect();
    let seconds = window.len() as f64 * interval;
    let sum = |f: fn(&Row) -> u64| window.iter().map(|r| f(r)).sum::<u64>();
    let originals = sum(|r| r.offered_originals);
    let offered = sum(Row::offered);
    let per_second = |n: u64| {
        if seconds > 0.0 {
            n as f64 / seconds
        } else {
            0.0
        }
    };

    // The operating point's neighbourhood: the window and the interval before it, so the
    // slope sees the load and failure rate the system left.
    let before = rows.iter().rfind(|r| r.t < focus.from - 1e-9).into_iter();
    let points: Vec<(f64, f64)> = before
        .chain(window.iter().copied())
        .filter(|r| r.offered() > 0)
        .map(|r| (r.offered() as f64 / interval, r.failure_probability))
        .collect();
    // Where almost nothing or almost everything fails the curve is flat by saturation, not
    // by stability: the slope is read on the responsive part when there is one.
    let responsive: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|&(_, p)| p > 0.01 && p < 0.99)
        .collect();
    let p_slope = if responsive.len() >= 3 {
        slope(&responsive)
    } else {
        slope(&points)
    }
    .max(0.0);
    let r = ratio(totals.retries, totals.first_failed);
    let a0 = per_second(originals);
    let gain = r * a0 * p_slope;
    let p_star = ratio(sum(|r| r.attempts_failed), offered);
    let stability = Stability {
        r,
        a0,
        a_star: per_second(offered),
        p_star,
        p_slope,
        gain,
        // When the originals alone exceed the capacity there is no healthy operating point
        // to linearise about: the system is simply overloaded, retries or not.
        verdict: if focus.capacity > 0.0 && a0 >= focus.capacity {
            "overloaded"
        } else if gain < 1.0 {
            "stable"
        } else {
            "storm"
        },
    };

    let recovery_s = focus.recover_at.and_then(|at| {
        back_after(rows, at, |r| {
            r.offered_originals > 0 && r.goodput as f64 >= 0.9 * r.offered_originals as f64
        })
    });
    let to_capacity_s = focus.recover_at.and_then(|at| {
        let per_interval = focus.capacity * interval;
        back_after(rows, at, |r| {
            let allowed = (r.offered_originals as f64).min(per_interval);
            r.offered_originals > 0 && r.goodput as f64 >= 0.9 * allowed
        })
    });
    let return_inflight = focus
        .recover_at
        .and_then(|at| rows.iter().find(|r| r.t >= at - 1e-9))
        .map(|r| r.inflight);

    let departures = totals.served + totals.refused;
    let l = ratio_f(totals.time_in_system, totals.seconds);
    let lambda = ratio_f(departures as f64, totals.seconds);
    let w = ratio_f(totals.sojourn, departures as f64);
    let little = Little {
        l,
        lambda,
        w_ms: w * 1e3,
        lambda_w: lambda * w,
        relative_error: ratio_f((l - lambda * w).abs(), l),
    };

    Summary {
        policy: policy.to_owned(),
        logical: totals.logical,
        success: ratio(totals.logical_ok, totals.logical),
        attempts: totals.attempts,
        retries: totals.retries,
        hedges: totals.hedges,
        amplification: ratio(
            totals.attempts,
            totals.attempts - totals.retries - totals.hedges,
        ),
        focus_from: focus.from,
        focus_to: focus.to.min(rows.last().map_or(0.0, |r| r.t + interval)),
        focus_amplification: ratio(offered, originals),
        focus_goodput: per_second(sum(|r| r.goodput)),
        focus_capacity: focus.capacity,
        focus_wasted: per_second(sum(|r| r.wasted)),
        focus_p99_ms: window.iter().map(|r| r.p99_ms).fold(0.0, f64::max),
        wasted: totals.wasted,
        refused: totals.refused,
        peak_queue: totals.peak_queue,
        peak_queue_mib: totals.peak_queue as f64 * REQUEST_FOOTPRINT_KIB / 1024.0,
        stops: totals.stops.clone(),
        stability,
        recovery_s,
        to_capacity_s,
        return_inflight,
        recovery_timed: focus.recover_at.is_some(),
        little,
    }
}

/// Seconds from `at` until the first of three intervals in a row that are all `healthy`.
fn back_after(rows: &[Row], at: f64, healthy: impl Fn(&Row) -> bool) -> Option<f64> {
    let after: Vec<&Row> = rows.iter().filter(|r| r.t >= at - 1e-9).collect();
    after
        .windows(3)
        .find(|w| w.iter().all(|r| healthy(r)))
        .map(|w| w[0].t - at)
}

/// Least-squares slope of `y` on `x`; 0 without spread in `x`.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= f64::EPSILON { 0.0 } else { sxy / sxx }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

fn ratio_f(a: f64, b: f64) -> f64 {
    if b == 0.0 { 0.0 } else { a / b }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_and_of_a_point() {
        assert!((slope(&[(1.0, 2.0), (2.0, 4.0), (3.0, 6.0)]) - 2.0).abs() < 1e-12);
        assert_eq!(slope(&[(1.0, 2.0)]), 0.0);
        assert_eq!(slope(&[(1.0, 2.0), (1.0, 5.0)]), 0.0);
    }
}
