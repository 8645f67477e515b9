//! The chapter's remaining claims, one scenario each: retry pulses and jitter, the utilization
//! sweep, a cold downstream and slow start, queue sizing under bursts, hedge drift with load,
//! client-side hidden queues, and retry amplification across hops.
//!
//! Each is a list of parts (a model and the variants run in it: a sweep runs the same variant
//! in several models) whose runs are read together at the end: the scenario's own figures are
//! added to each run and a sentence says what they show. Amplification needs several hops and
//! has an engine of its own.

mod amplification;
mod burst;
mod cold;
mod hedge_drift;
mod hidden_queue;
mod jitter;
mod utilization;

use super::kind::ScenarioKind;
use super::scenario::{Knobs, Scenario};
use super::{Report, SimError, VariantRun};

/// A claim ready to run: its parts, what it is (notes) and how to read its runs.
pub(super) struct Claim {
    pub(super) name: &'static str,
    pub(super) parts: Vec<Scenario>,
    pub(super) notes: Vec<String>,
    /// Adds the scenario's figures to each run and returns the sentence on what they show;
    /// given every run, in the parts' order (a run `--policy` left out is missing).
    pub(super) conclude: fn(&mut [VariantRun]) -> String,
}

/// Simulates claim `kind` (the variants `policy` selects, or `all`).
pub(super) fn simulate(kind: ScenarioKind, knobs: Knobs, policy: &str) -> Result<Report, SimError> {
    let shortest = min_duration(kind);
    if knobs.duration.is_some_and(|d| d.as_secs_f64() < shortest) {
        return Err(SimError::Unfit(format!(
            "scenario {} needs --duration of at least {shortest:.0}s to show what it is about",
            kind.as_str()
        )));
    }
    let claim = match kind {
        ScenarioKind::Jitter => jitter::build(knobs),
        ScenarioKind::Utilization => utilization::build(knobs),
        ScenarioKind::Cold => cold::build(knobs)?,
        ScenarioKind::Burst => burst::build(knobs)?,
        ScenarioKind::HedgeDrift => hedge_drift::build(knobs)?,
        ScenarioKind::HiddenQueue => hidden_queue::build(knobs)?,
        ScenarioKind::Amplification => return amplification::simulate(knobs, policy),
        ScenarioKind::Slowdown
        | ScenarioKind::LittlesLaw
        | ScenarioKind::OutageRecovery
        | ScenarioKind::Hedging
        | ScenarioKind::Overload
        | ScenarioKind::Outage => {
            return Err(SimError::Unfit(format!(
                "{} is a scenario of its own, not one of the chapter's claims",
                kind.as_str()
            )));
        }
    };
    let names: Vec<&str> = claim
        .parts
        .iter()
        .flat_map(|p| p.variants.iter().map(|v| v.name.as_str()))
        .collect();
    if policy != "all" && !names.contains(&policy) {
        return Err(SimError::UnknownPolicy {
            scenario: claim.name,
            policy: policy.to_owned(),
            choices: names.join(", "),
        });
    }
    let mut runs = Vec::new();
    let mut duration_s: f64 = 0.0;
    for part in &claim.parts {
        super::check_size(&part.model)?;
        duration_s = duration_s.max(part.model.duration.as_secs_f64());
        let selected: Vec<_> = part
            .variants
            .iter()
            .filter(|v| policy == "all" || v.name == policy)
            .collect();
        runs.extend(super::run_variants(part, &selected));
    }
    let mut notes = claim.notes;
    notes.push((claim.conclude)(&mut runs));
    Ok(Report {
        scenario: claim.name,
        seed: knobs.seed,
        scale: knobs.scale,
        duration_s,
        interval_s: knobs.interval.as_secs_f64(),
        notes,
        runs,
    })
}

/// The shortest run, in seconds, in which claim `kind` still shows what it is about: past its
/// event and long enough after it for the figures read there.
fn min_duration(kind: ScenarioKind) -> f64 {
    match kind {
        ScenarioKind::Jitter => 17.0,
        ScenarioKind::Utilization => 35.0,
        ScenarioKind::Cold => 25.0,
        ScenarioKind::Burst => 20.0,
        ScenarioKind::HedgeDrift => 60.0,
        ScenarioKind::Amplification => 11.0,
        _ => 0.0,
    }
}

/// The run named `name`, if it was run.
fn find<'a>(runs: &'a [VariantRun], name: &str) -> Option<&'a VariantRun> {
    runs.iter().find(|r| r.policy == name)
}

/// Rows whose start lies in `[from, to)` seconds.
fn rows_in(run: &VariantRun, from: f64, to: f64) -> impl Iterator<Item = &super::series::Row> {
    run.rows
        .iter()
        .filter(move |r| r.t >= from - 1e-9 && r.t < to - 1e-9)
}

/// `a / b`, 0 when `b` is 0.
fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 { 0.0 } else { a / b }
}

#[cfg(test)]
mod tests;
