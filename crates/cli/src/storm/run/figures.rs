//! The figures particular to each claim's scenario, read from a variant's run: its load's
//! summary, its seconds, and the load's series rows as written (100 ms apart for `jitter`).

use std::collections::BTreeMap;

use serde_json::Value;

use super::plan::Plan;
use super::result::{Second, VariantResult};
use crate::storm::kind::ScenarioKind;

/// The window of `jitter`'s pulse figure: the share of the retries sent within the busiest
/// 300 ms.
pub(super) const PULSE_WINDOW_S: f64 = 0.3;

/// The figures of `variant`, a run of `scenario` planned as `plan` (times already scaled);
/// `capacity` is the measured one, for scenarios that measure it; `rows` are the load's series
/// rows.
pub(super) fn of(
    scenario: ScenarioKind,
    plan: &Plan,
    capacity: Option<f64>,
    variant: &VariantResult,
    rows: &[Second],
) -> BTreeMap<String, f64> {
    let load = &variant.load;
    let logical = count(load, "logical_requests");
    let per_logical = |n: u64| {
        if logical == 0 {
            0.0
        } else {
            n as f64 / logical as f64
        }
    };
    let mut figures = BTreeMap::new();
    let mut put = |name: &str, value: f64| {
        figures.insert(name.to_owned(), value);
    };
    let load_share = capacity.filter(|c| *c > 0.0).map(|c| variant.rate / c);
    match scenario {
        ScenarioKind::Slowdown
        | ScenarioKind::Overload
        | ScenarioKind::Outage
        | ScenarioKind::LittlesLaw
        | ScenarioKind::OutageRecovery
        | ScenarioKind::Hedging
        | ScenarioKind::Amplification => {}
        ScenarioKind::Jitter => {
            let retries: u64 = rows.iter().map(|r| r.retries).sum();
            put("retries", retries as f64);
            if let Some(share) = pulse_share(rows, PULSE_WINDOW_S) {
                put("retry_pulse_share", share);
            }
        }
        ScenarioKind::Utilization => {
            if let Some(share) = load_share {
                put("load_share", share);
            }
            put("retries_per_logical", per_logical(count(load, "retries")));
            // The second half of what follows the slowdown: drained, or not.
            if let Some(at) = plan.recovery_at {
                let from = at.as_secs_f64() + (plan.duration - at).as_secs_f64() / 2.0;
                let to = plan.duration.as_secs_f64();
                if let Some(ok) = per_second(&variant.seconds, from, to, |s| s.ok as f64) {
                    put("late_goodput_share", ok / variant.rate);
                }
                // From the end of the slowdown to the first second the server's queue gauge
                // read empty.
                let drained = variant
                    .seconds
                    .iter()
                    .filter(|s| s.t_s >= at.as_secs_f64())
                    .find(|s| s.queue == Some(0.0));
                if let Some(s) = drained {
                    put("queue_drained_s", s.t_s - at.as_secs_f64());
                }
            }
        }
        ScenarioKind::Cold => {
            let cold = plan.phases.iter().position(|p| p.slow_above > 0);
            if let Some(i) = cold {
                let from = plan.phases[i].at.as_secs_f64();
                let to = plan
                    .phases
                    .get(i + 1)
                    .map_or(plan.duration.as_secs_f64(), |p| p.at.as_secs_f64());
                if let Some(ok) = per_second(&variant.seconds, from, to, |s| s.ok as f64) {
                    put("goodput_while_cold", ok);
                }
                let inflight = window(&variant.seconds, from, to)
                    .filter_map(|s| s.inflight)
                    .reduce(f64::max);
                if let Some(peak) = inflight {
                    put("server_inflight_peak_while_cold", peak);
                }
            }
            put("timeouts", outcome(load, "timeout") as f64);
        }
        ScenarioKind::Burst => {
            // Attempts the server refused (429, or 503 with its queue full: the PSP is healthy
            // throughout), the burst's load included.
            let refused = |l: &Value| {
                let of = |k: &str| l["attempt_outcomes"][k].as_u64().unwrap_or(0);
                of("rejected") + of("retryable")
            };
            let refused = refused(load) + variant.burst_load.as_ref().map_or(0, refused);
            put("attempts_refused", refused as f64);
            let not_ok = |l: &Value| count(l, "logical_requests").saturating_sub(outcome(l, "ok"));
            let not_ok = not_ok(load) + variant.burst_load.as_ref().map_or(0, not_ok);
            put("not_ok", not_ok as f64);
            let peak = |f: fn(&Second) -> Option<f64>| {
                variant.seconds.iter().filter_map(f).reduce(f64::max)
            };
            if let Some(queue) = peak(|s| s.queue) {
                put("server_queue_peak", queue);
            }
            if let Some(p99) = peak(|s| s.p99_ms) {
                put("p99_ms_worst_second", p99);
            }
        }
        ScenarioKind::HedgeDrift => {
            if let Some(share) = load_share {
                put("load_share", share);
            }
            put("hedge_share", per_logical(count(load, "hedges")));
            put(
                "hedges_won_share",
                per_logical(load["hedge_results"]["won"].as_u64().unwrap_or(0)),
            );
            put(
                "retries_and_hedges",
                (count(load, "retries") + count(load, "hedges")) as f64,
            );
        }
        ScenarioKind::HiddenQueue => {
            if let Some(peak) = load["client_pending_peak"].as_u64() {
                put("client_pending_peak", peak as f64);
            }
            let peak = |f: fn(&Second) -> Option<f64>| {
                variant.seconds.iter().filter_map(f).reduce(f64::max)
            };
            if let Some(inflight) = peak(|s| s.inflight) {
                put("server_inflight_peak", inflight);
            }
            if let Some(p99) = peak(|s| s.p99_ms) {
                put("p99_ms_worst_second", p99);
            }
            put(
                "not_ok_share",
                per_logical(logical.saturating_sub(outcome(load, "ok"))),
            );
        }
    }
    figures
}

fn count(summary: &Value, key: &str) -> u64 {
    summary[key].as_u64().unwrap_or(0)
}

fn outcome(summary: &Value, key: &str) -> u64 {
    summary["outcomes"][key].as_u64().unwrap_or(0)
}

/// The seconds starting within `[from, to)`.
fn window(seconds: &[Second], from: f64, to: f64) -> impl Iterator<Item = &Second> {
    seconds.iter().filter(move |s| s.t_s >= from && s.t_s < to)
}

/// The mean of `f` per second over the whole seconds starting within `[from, to)`; `None` when
/// there are none.
fn per_second(seconds: &[Second], from: f64, to: f64, f: impl Fn(&Second) -> f64) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0usize);
    for s in window(seconds, from.ceil(), to) {
        sum += f(s);
        n += 1;
    }
    (n > 0).then(|| sum / n as f64)
}

/// The share of all the retries in `rows` sent within the busiest `width` seconds (a window
/// starting at a row); `None` without retries. Retries sent in lockstep put most of them in
/// one window; jittered ones spread over their backoff.
pub(super) fn pulse_share(rows: &[Second], width: f64) -> Option<f64> {
    let total: u64 = rows.iter().map(|r| r.retries).sum();
    if total == 0 {
        return None;
    }
    // A hair less than `width`, so that a window of 3 rows of 0.1 s never takes a fourth.
    let width = width - 1e-6;
    let busiest = rows
        .iter()
        .map(|first| {
            rows.iter()
                .filter(|r| r.t_s >= first.t_s && r.t_s < first.t_s + width)
                .map(|r| r.retries)
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    Some(busiest as f64 / total as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(retries: &[u64]) -> Vec<Second> {
        retries
            .iter()
            .enumerate()
            .map(|(i, &retries)| Second {
                t_s: i as f64 / 10.0,
                retries,
                ..Second::default()
            })
            .collect()
    }

    #[test]
    fn the_pulse_share_is_the_busiest_window_over_all_retries() {
        // Lockstep: all in one row.
        assert_eq!(pulse_share(&rows(&[0, 0, 40, 0, 0]), 0.3), Some(1.0));
        // Spread evenly over ten rows: three of them hold 30%.
        let even = pulse_share(&rows(&[4; 10]), 0.3).unwrap();
        assert!((even - 0.3).abs() < 1e-9, "{even}");
        assert_eq!(pulse_share(&rows(&[0, 0]), 0.3), None);
    }
}
