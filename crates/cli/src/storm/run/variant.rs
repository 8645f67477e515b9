//! One variant run end to end: the PSP, the server and the load started, the PSP's phases
//! applied on schedule, the server sampled, and the load's series read back.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use backstop_payment::psp::{self, Faults, PspConfig, PspHandle};
use serde_json::Value;
use tokio::process::Command;
use tokio::time::Instant;

use super::plan::{Phase, Plan, S, Variant};
use super::server::Server;
use super::{Second, VariantResult};

/// Offers far more than the service can take for a few seconds and counts what it served.
pub(super) async fn measure_capacity(
    plan: &Plan,
    work: &Path,
    scale: f64,
) -> Result<f64, Box<dyn std::error::Error>> {
    let probe = Plan {
        duration: S(5).mul_f64(scale.max(0.2)),
        recovery_at: None,
        ..plan.clone()
    };
    let dir = work.join("capacity");
    std::fs::create_dir_all(&dir)?;
    let variant = &plan.variants[0];
    let measured = run_variant(&probe, variant, 2_000.0, &dir).await?;
    Ok(measured.goodput_per_s)
}

pub(super) async fn run_variant(
    plan: &Plan,
    variant: &Variant,
    rate: f64,
    dir: &Path,
) -> Result<VariantResult, Box<dyn std::error::Error>> {
    let first = plan.phases.first().copied().unwrap_or(Phase {
        at: Duration::ZERO,
        latency: Duration::ZERO,
        unavailable: false,
    });
    let psp = psp::spawn(PspConfig {
        faults: faults_of(first),
        ..PspConfig::default()
    })
    .await?;
    let db = dir.join("pay.db");
    let server = Server::start(&db, &psp.url(), &variant.serve).await?;
    let series_path = dir.join("series.csv");
    let mut load = Command::new(std::env::current_exe()?);
    load.args(["load", "--target", &format!("http://{}", server.http)])
        .args(["--rate", &rate.to_string()])
        .args([
            "--duration",
            &format!("{}ms", plan.duration.as_millis().max(1)),
        ])
        .args(["--concurrency", "100000", "--json", "--series"])
        .arg(&series_path)
        .args(&variant.load)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let load = load.spawn()?;
    let start = Instant::now();
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
                psp.faults().set(faults_of(plan.phases[next_phase]))?;
                next_phase += 1;
            }
        }
    };
    if !output.status.success() {
        return Err(format!(
            "load failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )
        .into());
    }
    let summary: Value = serde_json::from_slice(&output.stdout)?;
    let intents_running = server.running_intents(&db).await;
    server.stop().await;
    stop_psp(psp).await;

    let mut seconds = read_series(&series_path)?;
    for sample in &samples {
        let index = sample.t.as_secs() as usize;
        if let Some(second) = seconds.get_mut(index) {
            second.limit = sample.limit;
            second.inflight = sample.inflight;
            second.queue = sample.queue;
            second.rss_mib = sample.rss_mib;
        }
    }
    let logical = summary["logical_requests"].as_u64().unwrap_or(0);
    let ok = summary["outcomes"]["ok"].as_u64().unwrap_or(0);
    let attempts = summary["attempts"].as_u64().unwrap_or(0);
    let recovery_s = plan.recovery_at.and_then(|at| recovery(&seconds, at, rate));
    Ok(VariantResult {
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
        seconds,
    })
}

fn faults_of(phase: Phase) -> Faults {
    Faults {
        latency: phase.latency,
        unavailable_rate: if phase.unavailable { 1.0 } else { 0.0 },
        ..Faults::default()
    }
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
}
