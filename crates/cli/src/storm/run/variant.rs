//! One variant run end to end: the PSP, the server and the load started, the PSP's phases
//! applied on schedule, the server sampled, and the load's series read back.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use backstop_payment::psp::{self, Faults, PspConfig, PspHandle};
use serde_json::Value;
use tokio::process::Command;
use tokio::time::Instant;

use super::plan::{Phase, Plan, S, Variant, healthy};
use super::result::{Second, VariantResult};
use super::server::Server;

/// Offers far more than the service can take for a few seconds and counts what it served per
/// second while it was offered that: the whole seconds after the first (which fills the
/// places), so that neither the start nor what the queue serves after the offer ends counts.
pub(super) async fn measure_capacity(
    plan: &Plan,
    work: &Path,
    scale: f64,
) -> Result<f64, Box<dyn std::error::Error>> {
    let probe = Plan {
        // At least 3 s: two whole seconds to count.
        duration: S(5).mul_f64(scale.max(0.6)),
        recovery_at: None,
        ..plan.clone()
    };
    let dir = work.join("capacity");
    std::fs::create_dir_all(&dir)?;
    let variant = plan
        .probe
        .as_ref()
        .or(plan.variants.first())
        .ok_or("the plan has no variant")?;
    let (measured, _) = run_variant(&probe, variant, plan.probe_rate, &dir).await?;
    Ok(steady_goodput(&measured.seconds, probe.duration).unwrap_or(measured.goodput_per_s))
}

/// The mean goodput of the whole seconds from the second one until `duration`.
fn steady_goodput(seconds: &[Second], duration: Duration) -> Option<f64> {
    let end = duration.as_secs_f64();
    let steady: Vec<f64> = seconds
        .iter()
        .filter(|s| s.t_s >= 1.0 && s.t_s + 1.0 <= end)
        .map(|s| s.ok as f64)
        .collect();
    (!steady.is_empty()).then(|| steady.iter().sum::<f64>() / steady.len() as f64)
}

/// Runs one variant; also returns the load's series rows as written (finer than a second
/// when the plan asks for it), the burst's included.
pub(super) async fn run_variant(
    plan: &Plan,
    variant: &Variant,
    rate: f64,
    dir: &Path,
) -> Result<(VariantResult, Vec<Second>), Box<dyn std::error::Error>> {
    let first = plan
        .phases
        .first()
        .copied()
        .unwrap_or(healthy(Duration::ZERO, Duration::ZERO));
    let psp = psp::spawn(PspConfig {
        faults: faults_of(first, Instant::now()),
        ..PspConfig::default()
    })
    .await?;
    let db = dir.join("pay.db");
    let server = Server::start(&db, &psp.url(), &variant.serve).await?;
    let target = format!("http://{}", server.http);
    let series_path = dir.join("series.csv");
    let load = load_command(plan, variant, &target, rate, plan.duration, &series_path)?.spawn()?;
    let start = Instant::now();
    // The burst: a second load on top of the first, from its start to its end.
    let burst_path = dir.join("burst.csv");
    let burst = match plan.burst {
        Some(b) => {
            let mut command =
                load_command(plan, variant, &target, b.rate, b.duration, &burst_path)?;
            Some(tokio::spawn(async move {
                tokio::time::sleep_until(start + b.at).await;
                command.spawn()?.wait_with_output().await
            }))
        }
        None => None,
    };
    let output = load.wait_with_output();
    let mut output = std::pin::pin!(output);
    let mut samples = Vec::new();
    let mut next_phase = 1;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let http = reqwest::Client::builder().no_proxy().build()?;
    let output = loop {
        tokio::select! {
            out = &mut output => break out?,
            _ = tick.tick() => {
                samples.push(server.sample(&http, start.elapsed()).await);
            }
            () = sleep_until_phase(plan, next_phase, start) => {
                psp.faults().set(faults_of(plan.phases[next_phase], start))?;
                next_phase += 1;
            }
        }
    };
    let summary = match load_summary(&output) {
        Ok(summary) => summary,
        Err(e) => {
            // The burst's load is of no use without the first: stop it with its task.
            if let Some(task) = burst {
                task.abort();
            }
            return Err(e);
        }
    };
    let burst = match (burst, plan.burst) {
        (Some(task), Some(b)) => {
            let output = task.await??;
            let summary = load_summary(&output)?;
            let mut rows = read_series(&burst_path)?;
            for row in &mut rows {
                row.t_s += b.at.as_secs_f64();
            }
            Some((summary, rows))
        }
        _ => None,
    };
    let intents_running = server.running_intents(&db).await;
    server.stop().await;
    stop_psp(psp).await;

    let mut rows = read_series(&series_path)?;
    if let Some((_, burst_rows)) = &burst {
        rows.extend(burst_rows.iter().cloned());
        rows.sort_by(|a, b| a.t_s.total_cmp(&b.t_s));
    }
    let mut seconds = by_second(&rows);
    for sample in &samples {
        let index = sample.t.as_secs() as usize;
        if let Some(second) = seconds.get_mut(index) {
            second.limit = sample.limit;
            second.inflight = sample.inflight;
            second.queue = sample.queue;
            second.rss_mib = sample.rss_mib;
        }
    }
    let count = |key: &str| {
        let of = |v: &Value| match key {
            "ok" => v["outcomes"]["ok"].as_u64().unwrap_or(0),
            _ => v[key].as_u64().unwrap_or(0),
        };
        of(&summary) + burst.as_ref().map_or(0, |(b, _)| of(b))
    };
    let (logical, ok, attempts) = (count("logical_requests"), count("ok"), count("attempts"));
    let recovery_s = plan.recovery_at.and_then(|at| recovery(&seconds, at, rate));
    let result = VariantResult {
        name: variant.name.to_owned(),
        serve_flags: variant.serve.iter().map(|s| (*s).to_owned()).collect(),
        load_flags: variant.load.iter().map(|s| (*s).to_owned()).collect(),
        rate,
        goodput_per_s: ok as f64 / plan.duration.as_secs_f64().max(1e-3),
        attempts_per_logical: if logical == 0 {
            0.0
        } else {
            attempts as f64 / logical as f64
        },
        recovery_s,
        peak_rss_mib: samples.iter().filter_map(|s| s.rss_mib).reduce(f64::max),
        intents_running,
        load: summary,
        burst_load: burst.map(|(summary, _)| summary),
        figures: BTreeMap::new(),
        seconds,
    };
    Ok((result, rows))
}

/// A `backstop load` of `variant` against `target`: `rate` per second for `duration`, its
/// series written to `series`.
fn load_command(
    plan: &Plan,
    variant: &Variant,
    target: &str,
    rate: f64,
    duration: Duration,
    series: &Path,
) -> Result<Command, Box<dyn std::error::Error>> {
    let mut load = Command::new(std::env::current_exe()?);
    load.args(["load", "--target", target])
        .args(["--rate", &rate.to_string()])
        .args(["--duration", &format!("{}ms", duration.as_millis().max(1))])
        .args(["--concurrency", "100000", "--json", "--series"])
        .arg(series);
    if let Some(interval) = plan.series_interval {
        load.args(["--series-interval", &format!("{}ms", interval.as_millis())]);
    }
    load.args(&variant.load)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    Ok(load)
}

fn load_summary(output: &std::process::Output) -> Result<Value, Box<dyn std::error::Error>> {
    if !output.status.success() {
        return Err(format!(
            "load failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )
        .into());
    }
    Ok(serde_json::from_slice(&output.stdout)?)
}

fn faults_of(phase: Phase, start: Instant) -> Faults {
    let rate = |on: bool| if on { 1.0 } else { 0.0 };
    Faults {
        latency: phase.latency,
        unavailable_rate: rate(phase.unavailable),
        pushback: phase.pushback,
        error_rate: rate(phase.error),
        hold_until: phase.hold.map(|hold| start + phase.at + hold),
        slow_above: phase.slow_above,
        ..Faults::default()
    }
}

/// The rows summed into whole seconds (each row into the second it starts in); the p99 of a
/// second is the highest of its rows'.
fn by_second(rows: &[Second]) -> Vec<Second> {
    let mut seconds: Vec<Second> = Vec::new();
    for row in rows {
        let index = row.t_s.max(0.0).floor() as usize;
        while seconds.len() <= index {
            seconds.push(Second {
                t_s: seconds.len() as f64,
                ..Second::default()
            });
        }
        let second = &mut seconds[index];
        second.originals += row.originals;
        second.retries += row.retries;
        second.hedges += row.hedges;
        second.ok += row.ok;
        second.rejected += row.rejected;
        second.timeout += row.timeout;
        second.failed += row.failed;
        second.p99_ms = match (second.p99_ms, row.p99_ms) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
    seconds
}

async fn sleep_until_phase(plan: &Plan, next: usize, start: Instant) {
    match plan.phases.get(next) {
        Some(phase) => tokio::time::sleep_until(start + phase.at).await,
        None => std::future::pending().await,
    }
}

async fn stop_psp(psp: PspHandle) {
    // Held requests (a slow phase) are cut: nobody is waiting for them any more.
    let _ = tokio::time::timeout(S(5), psp.shutdown()).await;
}

/// Seconds from `at` until the first whole second that served >= 90% of `rate`.
fn recovery(seconds: &[Second], at: Duration, rate: f64) -> Option<f64> {
    seconds
        .iter()
        .filter(|s| s.t_s >= at.as_secs_f64())
        .find(|s| s.ok as f64 >= 0.9 * rate)
        .map(|s| s.t_s + 1.0 - at.as_secs_f64())
}

fn read_series(path: &Path) -> Result<Vec<Second>, Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string(path)?;
    let mut seconds = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() < 10 {
            return Err(format!("unexpected series row {line:?}").into());
        }
        let n = |i: usize| f[i].parse::<u64>().unwrap_or(0);
        seconds.push(Second {
            t_s: f[0].parse().unwrap_or(0.0),
            originals: n(1),
            retries: n(2),
            hedges: n(3),
            ok: n(4),
            rejected: n(5),
            timeout: n(6),
            failed: n(7),
            p99_ms: f[9].parse().ok(),
            ..Second::default()
        });
    }
    Ok(seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_is_the_first_whole_second_at_ninety_percent() {
        let second = |t: f64, ok: u64| Second {
            t_s: t,
            ok,
            ..Second::default()
        };
        let seconds = [
            second(0.0, 100),
            second(1.0, 10),
            second(2.0, 50),
            second(3.0, 95),
            second(4.0, 100),
        ];
        assert_eq!(recovery(&seconds, S(1), 100.0), Some(3.0));
        assert_eq!(recovery(&seconds[..3], S(1), 100.0), None);
    }

    #[test]
    fn capacity_is_what_the_whole_seconds_after_the_first_served() {
        let second = |t: f64, ok: u64| Second {
            t_s: t,
            ok,
            ..Second::default()
        };
        // Filling up, two steady seconds, then the queue draining after the offer ended.
        let seconds = [
            second(0.0, 60),
            second(1.0, 150),
            second(2.0, 160),
            second(3.0, 300),
        ];
        assert_eq!(steady_goodput(&seconds, S(3)), Some(155.0));
        assert_eq!(steady_goodput(&seconds[..1], S(3)), None);
    }

    #[test]
    fn rows_finer_than_a_second_are_summed_into_seconds() {
        let row = |t: f64, retries: u64, p99: Option<f64>| Second {
            t_s: t,
            retries,
            ok: 1,
            p99_ms: p99,
            ..Second::default()
        };
        let rows = [
            row(0.0, 1, Some(10.0)),
            row(0.5, 2, Some(30.0)),
            row(0.9, 0, None),
            row(2.1, 5, None),
        ];
        let seconds = by_second(&rows);
        assert_eq!(seconds.len(), 3);
        assert_eq!((seconds[0].retries, seconds[0].ok), (3, 3));
        assert_eq!(seconds[0].p99_ms, Some(30.0));
        assert_eq!((seconds[1].t_s, seconds[1].ok), (1.0, 0));
        assert_eq!((seconds[2].retries, seconds[2].p99_ms), (5, None));
    }
}
