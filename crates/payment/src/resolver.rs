//! The resolver: settles payment intents left `running` by abandoned work.
//!
//! An intent stays `running` when the work charging it stopped without learning the PSP's
//! outcome: its deadline passed, its client went away, the process died, or the PSP did not
//! answer. A retry with the same key converges it; when none comes, the resolver does, once
//! the intent is [`SETTLE_AFTER`] old (longer than any request's budget, so no attempt of the
//! work that created it can still be on its way).
//!
//! Settling asks the PSP to *void* the intent's effect key ([`PspClient::void`](crate::psp_client::PspClient::void)). The PSP
//! answers in one transaction with either the charge the key made (the intent becomes
//! `succeeded`) or "voided": no charge was made and none can be made with that key from then
//! on, so the intent becomes `failed` and its order is free for another key. Marking an intent
//! failed on "no charge found" alone would not be safe: a charge still in flight, or a late
//! retry with the same key, could land after it, and the money would move with the payment
//! recorded as failed. With the void, such a charge is refused by the PSP instead.
//!
//! The resolver runs in `serve` ([`spawn`], every [`EVERY`], at most [`BATCH`] intents a
//! round), and on `GET` of a running intent that is old enough.
//!
//! Each round (and once at start) it publishes what is left running as two gauges,
//! [`PAYMENT_INTENTS_RUNNING`] and [`PAYMENT_INTENTS_RUNNING_OLDEST_AGE_SECONDS`]: intents that
//! stay running well past [`SETTLE_AFTER`] mean the resolver cannot settle them (the PSP does
//! not answer the void, or the store fails), which an operator must look at.

use std::time::Duration;

use backstop::deadline::Deadline;
use backstop::status::Status;
use tokio::task::JoinHandle;

use metrics::{Unit, describe_gauge};

use crate::intents::{Intent, IntentStatus, IntentsError, RunningStats};
use crate::psp::VoidStatus;
use crate::state::AppState;

/// Age (from `created_at`) at which a running intent counts as abandoned: above the longest
/// budget a request may have (60 s), with room for the way back.
pub const SETTLE_AFTER: Duration = Duration::from_secs(120);
/// How often `serve` looks for abandoned intents.
pub const EVERY: Duration = Duration::from_secs(10);
/// Most intents settled per round.
pub const BATCH: u32 = 100;
/// Budget of one settlement in the background: one void at the PSP and one write.
const SETTLE_BUDGET: Duration = Duration::from_secs(5);

/// Gauge: payment intents in status `running` now (all merchants).
pub const PAYMENT_INTENTS_RUNNING: &str = "payment_intents_running";
/// Gauge: age in seconds of the oldest intent still `running` (0 when none is).
pub const PAYMENT_INTENTS_RUNNING_OLDEST_AGE_SECONDS: &str =
    "payment_intents_running_oldest_age_seconds";

/// Registers the resolver's gauges (units and help) with the installed `metrics` recorder.
pub fn describe_metrics() {
    describe_gauge!(
        PAYMENT_INTENTS_RUNNING,
        Unit::Count,
        "Payment intents in status running now (the resolver settles those older than 120 s)."
    );
    describe_gauge!(
        PAYMENT_INTENTS_RUNNING_OLDEST_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest payment intent still running (0 when none is)."
    );
}

/// Sets the two gauges from `stats` as seen at `now_ms` (unix ms).
pub fn publish(stats: RunningStats, now_ms: i64) {
    // Gauges are f64: counts and ages far below 2^53 are exact.
    #[allow(clippy::cast_precision_loss)]
    let (count, age_ms) = (
        stats.count as f64,
        stats
            .oldest_created_at
            .map_or(0, |at| now_ms.saturating_sub(at).max(0)) as f64,
    );
    metrics::gauge!(PAYMENT_INTENTS_RUNNING).set(count);
    metrics::gauge!(PAYMENT_INTENTS_RUNNING_OLDEST_AGE_SECONDS).set(age_ms / 1000.0);
}

/// Reads what is left running from the store and [`publish`]es it.
pub async fn observe_running(state: &AppState, now_ms: i64) -> Result<RunningStats, IntentsError> {
    let stats = state.intents.running_stats().await?;
    publish(stats, now_ms);
    Ok(stats)
}

/// Why an intent could not be settled now (it stays `running`; a later round tries again).
#[derive(Debug, thiserror::Error)]
pub enum SettleError {
    /// The PSP did not answer the void.
    #[error("the PSP did not settle the effect key: {0}")]
    Psp(#[source] Status),
    /// The intent table failed.
    #[error("the payment store failed")]
    Store(#[source] IntentsError),
}

/// Whether `intent` is running and at least [`SETTLE_AFTER`] old at `now_ms` (unix ms).
pub fn is_abandoned(intent: &Intent, now_ms: i64) -> bool {
    intent.status == IntentStatus::Running
        && now_ms.saturating_sub(intent.created_at) >= settle_after_ms(SETTLE_AFTER)
}

fn settle_after_ms(age: Duration) -> i64 {
    i64::try_from(age.as_millis()).unwrap_or(i64::MAX)
}

/// Settles one running intent through the PSP's void (see the module documentation) and
/// returns it as stored afterwards. An intent that is no longer running is returned as is.
pub async fn settle(
    state: &AppState,
    intent: &Intent,
    deadline: Deadline,
) -> Result<Intent, SettleError> {
    if intent.status != IntentStatus::Running {
        return Ok(intent.clone());
    }
    let void = state
        .psp
        .void(&intent.effect_key, deadline)
        .await
        .map_err(SettleError::Psp)?;
    let (merchant, id) = (intent.merchant_id.as_str(), intent.intent_id.as_str());
    let charge_id = match (void.status, void.charge) {
        (VoidStatus::Charged, Some(charge)) => Some(charge.charge_id),
        (VoidStatus::Charged, None) => {
            return Err(SettleError::Psp(Status::new(
                backstop::status::Code::Unavailable,
                "the PSP said charged without the charge",
            )));
        }
        (VoidStatus::Voided, _) => None,
    };
    let settled = state
        .intents
        .settle(merchant, id, charge_id.as_deref())
        .await
        .map_err(SettleError::Store)?;
    if let Some(settled) = settled {
        match &charge_id {
            Some(charge) => {
                tracing::info!(intent_id = %id, charge_id = %charge, "abandoned intent settled: succeeded")
            }
            None => {
                tracing::info!(intent_id = %id, "abandoned intent settled: failed, nothing charged, order freed")
            }
        }
        return Ok(settled);
    }
    // A concurrent settlement (another instance, a GET) won: the stored row says.
    state
        .intents
        .get(merchant, id)
        .await
        .map_err(SettleError::Store)?
        .ok_or_else(|| {
            SettleError::Store(IntentsError::Corrupt {
                intent_id: id.to_owned(),
                what: "vanished while settled",
            })
        })
}

/// One round: settles the running intents at least `settle_after` old at `now_ms` (at most
/// [`BATCH`], oldest first), each within its own budget (5 s). Returns how many were
/// settled; failures are logged and left for the next round.
pub async fn settle_abandoned(
    state: &AppState,
    now_ms: i64,
    settle_after: Duration,
) -> Result<usize, IntentsError> {
    let before = now_ms.saturating_sub(settle_after_ms(settle_after));
    let abandoned = state.intents.running_before(before, BATCH).await?;
    let mut settled = 0;
    for intent in &abandoned {
        let deadline = Deadline::after(SETTLE_BUDGET);
        match deadline.scope(settle(state, intent, deadline)).await {
            Ok(_) => settled += 1,
            Err(error) => {
                tracing::warn!(intent_id = %intent.intent_id, %error, "abandoned intent not settled yet");
            }
        }
    }
    Ok(settled)
}

/// Runs [`settle_abandoned`] every [`EVERY`] on a background task (aborted on shutdown; an
/// interrupted settlement is idempotent and runs again on the next start), and publishes the
/// running intents at start and after each round ([`observe_running`]).
pub fn spawn(state: AppState) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            // At start too: the gauges exist (at 0) before any intent runs, so an alert on
            // them has a series to evaluate from the first scrape.
            if let Err(error) = observe_running(&state, state.clock.now_ms()).await {
                tracing::warn!(%error, "resolver could not count running intents");
            }
            tokio::time::sleep(EVERY).await;
            let now_ms = state.clock.now_ms();
            if let Err(error) = settle_abandoned(&state, now_ms, SETTLE_AFTER).await {
                tracing::warn!(%error, "resolver could not list abandoned intents");
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    fn gauges(recorder: &DebuggingRecorder) -> Vec<(String, f64)> {
        let mut got: Vec<_> = recorder
            .snapshotter()
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(key, _, _, value)| match value {
                DebugValue::Gauge(v) => Some((key.key().name().to_owned(), v.into_inner())),
                _ => None,
            })
            .collect();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        got
    }

    #[test]
    fn publish_sets_the_count_and_the_oldest_age() {
        let recorder = DebuggingRecorder::new();
        metrics::with_local_recorder(&recorder, || {
            publish(
                RunningStats {
                    count: 3,
                    oldest_created_at: Some(10_000),
                },
                250_500,
            );
        });
        assert_eq!(
            gauges(&recorder),
            [
                (PAYMENT_INTENTS_RUNNING.to_owned(), 3.0),
                (PAYMENT_INTENTS_RUNNING_OLDEST_AGE_SECONDS.to_owned(), 240.5),
            ]
        );
        // Nothing running: both back to 0, never a stale age.
        metrics::with_local_recorder(&recorder, || publish(RunningStats::default(), 250_500));
        assert_eq!(
            gauges(&recorder),
            [
                (PAYMENT_INTENTS_RUNNING.to_owned(), 0.0),
                (PAYMENT_INTENTS_RUNNING_OLDEST_AGE_SECONDS.to_owned(), 0.0),
            ]
        );
    }
}
