//! What a chaos run prints: the counts, the time to a final answer, and the first violation
//! with the whole history of its payment.

use std::error::Error;
use std::time::Duration;

use backstop_payment::psp::faults::FaultCounts;
use hdrhistogram::Histogram;
use serde::Serialize;

use super::check::{History, Payment, Violation};
use super::{ChaosArgs, StoreKind, Target};

/// Upper bound of the time-to-final-answer histogram.
const HOUR_MS: u64 = 3_600_000;

/// One SIGKILL and restart.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Kill {
    /// Milliseconds since the start of the run.
    pub(super) at_ms: u64,
    /// Which instance.
    pub(super) instance: usize,
    /// How long the new process took to listen, in milliseconds.
    pub(super) restart_ms: u64,
}

/// What a run prints.
#[derive(Debug, Serialize)]
pub(super) struct Summary {
    pub(super) target: &'static str,
    pub(super) store: &'static str,
    pub(super) instances: usize,
    pub(super) seed: u64,
    pub(super) psp_seed: u64,
    pub(super) commit_then_timeout_rate: f64,
    pub(super) commit_then_drop_rate: f64,
    pub(super) payments: usize,
    pub(super) acknowledged: usize,
    pub(super) refused: usize,
    pub(super) unfinished: usize,
    pub(super) attempts: usize,
    pub(super) attempts_per_payment: f64,
    /// Payments that needed more than one attempt.
    pub(super) retried: usize,
    /// Attempts that got no answer (connection refused or cut, timed out).
    pub(super) unanswered: usize,
    pub(super) kills: usize,
    pub(super) psp_charges: u64,
    /// Faults the PSP injected, by kind.
    pub(super) psp_faults: FaultCounts,
    pub(super) final_answer_p50_ms: u64,
    pub(super) final_answer_p99_ms: u64,
    pub(super) final_answer_max_ms: u64,
    pub(super) workload_secs: f64,
    pub(super) elapsed_secs: f64,
    pub(super) violations: usize,
    /// The first violation, and the whole history of its payment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) first_violation: Option<Evidence>,
    /// Where the logs (and SQLite store) are, when kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) kept: Option<String>,
}

/// A violation with everything recorded about its order.
#[derive(Debug, Serialize)]
pub(super) struct Evidence {
    pub(super) violation: Violation,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) payment: Option<Payment>,
    pub(super) kills: Vec<Kill>,
}

#[allow(clippy::too_many_arguments)]
pub(super) fn summarize(
    args: &ChaosArgs,
    kind: &StoreKind,
    seed: u64,
    psp_seed: u64,
    history: &History,
    violations: &[Violation],
    kills: Vec<Kill>,
    (psp_charges, psp_faults): (u64, FaultCounts),
    workload_time: Duration,
    elapsed: Duration,
) -> Summary {
    let payments = &history.payments;
    let attempts: usize = payments.iter().map(|p| p.attempts.len()).sum();
    let acknowledged = payments
        .iter()
        .filter(|p| p.final_answer().is_some_and(|a| a.acknowledged()))
        .count();
    let unfinished = payments
        .iter()
        .filter(|p| p.final_answer().is_none())
        .count();
    // Up to an hour in milliseconds, 3 significant figures; longer is clamped.
    let mut histogram =
        Histogram::<u64>::new_with_bounds(1, HOUR_MS, 3).expect("valid histogram bounds");
    for ms in payments.iter().filter_map(|p| p.final_after_ms) {
        histogram.saturating_record(ms.clamp(1, HOUR_MS));
    }
    let first_violation = violations.first().map(|violation| Evidence {
        violation: violation.clone(),
        payment: payments
            .iter()
            .find(|p| p.order_id == violation.order_id())
            .cloned(),
        kills: kills.clone(),
    });
    Summary {
        target: match args.target {
            Target::Serve => "serve",
            Target::Proxy => "proxy",
        },
        store: match kind {
            StoreKind::Sqlite => "sqlite",
            StoreKind::Postgres(_) => "postgres",
        },
        instances: args.instances.get(),
        seed,
        psp_seed,
        commit_then_timeout_rate: args.commit_then_timeout_rate,
        commit_then_drop_rate: args.commit_then_drop_rate,
        payments: payments.len(),
        acknowledged,
        refused: payments.len() - acknowledged - unfinished,
        unfinished,
        attempts,
        attempts_per_payment: attempts as f64 / payments.len().max(1) as f64,
        retried: payments.iter().filter(|p| p.attempts.len() > 1).count(),
        unanswered: payments
            .iter()
            .flat_map(|p| &p.attempts)
            .filter(|a| a.status.is_none())
            .count(),
        kills: kills.len(),
        psp_charges,
        psp_faults,
        final_answer_p50_ms: histogram.value_at_quantile(0.50),
        final_answer_p99_ms: histogram.value_at_quantile(0.99),
        final_answer_max_ms: histogram.max(),
        workload_secs: workload_time.as_secs_f64(),
        elapsed_secs: elapsed.as_secs_f64(),
        violations: violations.len(),
        first_violation,
        kept: None,
    }
}

pub(super) fn print(summary: &Summary, json: bool) -> Result<(), Box<dyn Error>> {
    if json {
        println!("{}", serde_json::to_string(summary)?);
        return Ok(());
    }
    let s = summary;
    let proxy = s.target == "proxy";
    if proxy {
        println!(
            "chaos on proxy, {} with {} instance(s), seed {}",
            s.store, s.instances, s.seed
        );
    } else {
        println!(
            "chaos on {} with {} instance(s), seed {}, PSP seed {} (commit-then-timeout {}, commit-then-drop {})",
            s.store,
            s.instances,
            s.seed,
            s.psp_seed,
            s.commit_then_timeout_rate,
            s.commit_then_drop_rate
        );
    }
    println!(
        "payments      {} (acknowledged {}, refused {}, unfinished {})",
        s.payments, s.acknowledged, s.refused, s.unfinished
    );
    println!(
        "attempts      {} ({:.2} per payment; {} payments retried, {} attempts unanswered)",
        s.attempts, s.attempts_per_payment, s.retried, s.unanswered
    );
    println!("kills         {} (SIGKILL, restarted at once)", s.kills);
    if proxy {
        println!("upstream      {} effects of the run's keys", s.psp_charges);
    } else {
        println!(
            "psp           {} charges; faults injected: {} commit-then-timeout, {} commit-then-drop",
            s.psp_charges, s.psp_faults.commit_then_timeout, s.psp_faults.commit_then_drop
        );
    }
    println!(
        "final answer  p50 {} ms, p99 {} ms, max {} ms",
        s.final_answer_p50_ms, s.final_answer_p99_ms, s.final_answer_max_ms
    );
    println!(
        "elapsed       {:.1} s (workload {:.1} s)",
        s.elapsed_secs, s.workload_secs
    );
    println!("violations    {}", s.violations);
    if let Some(kept) = &s.kept {
        println!("kept          {kept}");
    }
    if let Some(evidence) = &s.first_violation {
        println!();
        println!("first violation: {}", evidence.violation);
        if let Some(p) = &evidence.payment {
            println!("  key {}", p.key);
            for a in &p.attempts {
                let status = a.status.map_or("no answer".to_owned(), |s| s.to_string());
                println!(
                    "  +{} ms  instance {}  {} after {} ms  {}",
                    a.at_ms, a.instance, status, a.took_ms, a.body
                );
            }
            if let Some(l) = &p.lookup {
                println!("  lookup: {} {}", l.status, l.body);
            }
            if let Some(r) = &p.replay {
                println!("  replay: {} {}", r.status, r.body);
            }
            let what = if proxy {
                "upstream effects"
            } else {
                "PSP charges"
            };
            println!("  {what}: {}", p.charges.len());
            for c in &p.charges {
                println!("    {} (effect key {})", c.charge_id, c.effect_key);
            }
        }
        let kills: Vec<String> = evidence
            .kills
            .iter()
            .map(|k| format!("+{} ms #{}", k.at_ms, k.instance))
            .collect();
        println!("  kills: {}", kills.join(", "));
    }
    Ok(())
}
