//! The payment logic both protocols share: create-or-resume an intent and charge it once, and
//! look a payment up (converging a running one with the PSP). The HTTP handlers and the gRPC
//! service build on it and only translate requests in and outcomes out.

use std::time::Duration;

use backstop::deadline::Deadline;
use backstop::idempotency::{Fingerprint, IdempotencyKey, StoreError};
use backstop::retry::StopReason;

use super::phases::{ChargePhases, Charging, INTENT_CREATED};
use super::request::PaymentRequest;
use crate::intents::{Created, Intent, IntentStatus, Intents, IntentsError, NewIntent};
use crate::psp_client::{ChargeCall, ChargeError};
use crate::resolver;
use crate::state::AppState;
use crate::trace::SpanContext;

/// How a charge ended.
#[derive(Debug)]
pub(crate) enum ChargeOutcome {
    /// The payment succeeded (now, or earlier under the same key).
    Charged(Intent),
    /// The PSP refused definitively: the intent is `failed`, nothing was charged.
    Declined(Intent),
    /// The order already has an intent under another key.
    OrderConflict(Intent),
    /// The key already created an intent with other parameters.
    KeyReused {
        /// First 8 hex digits of the original request's fingerprint.
        fingerprint_prefix: String,
    },
    /// The store did not answer (or an id collided): retry with the same key.
    StoreUnavailable(&'static str),
    /// The PSP holds the effect key with other parameters (never expected).
    PspConflict(Intent),
    /// The PSP's outcome is not known (a charge may have been sent): retry with the same key
    /// after `retry_after`, or query.
    Unknown {
        /// The running intent.
        intent: Intent,
        /// What happened, for the caller.
        detail: &'static str,
        /// When to retry.
        retry_after: Duration,
    },
    /// The budget could not cover a call to the PSP, and nothing was sent: before any write
    /// (`intent` is `None`), or after the intent was created or resumed (it stays running).
    DeadlineExceeded {
        /// The intent, if one was created or resumed.
        intent: Option<Intent>,
    },
    /// The PSP charged nothing (no attempt reached it, or every one was refused) and the
    /// client gave up: retry budget spent, PSP unreachable or pushing back. The intent stays
    /// running; retry with the same key after `retry_after`.
    PspUnavailable {
        /// The running intent.
        intent: Intent,
        /// When to retry.
        retry_after: Duration,
    },
}

/// How a lookup ended.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// The merchant's payment, converged with the PSP when it was running.
    Found(Box<Intent>),
    /// No such payment for this merchant.
    NotFound,
    /// The store did not answer.
    StoreUnavailable,
}

const STORE_DID_NOT_ANSWER: &str =
    "the payment store did not answer; retry with the same Idempotency-Key";

fn store_failed(error: &dyn std::error::Error) -> &'static str {
    tracing::error!(error = %error, source = ?error.source(), "payment store failed");
    STORE_DID_NOT_ANSWER
}

/// What the idempotency layer handed a charge: its key, the request's fingerprint as the
/// claim compared it, and its phases (none on a store the service cannot run them on).
#[derive(Debug)]
pub(crate) struct Claimed {
    /// The request's `Idempotency-Key`: the intent's request key.
    pub(crate) key: IdempotencyKey,
    /// The request's parameters, stored with the intent: a resumed intent must match them.
    pub(crate) fingerprint: Fingerprint,
    /// The claim's phases.
    pub(crate) phases: Option<Charging>,
}

/// Creates (or resumes) the intent of `req` under the claimed key for `merchant` and charges
/// it once.
pub(crate) async fn charge(
    state: &AppState,
    merchant: &str,
    deadline: Deadline,
    claimed: &Claimed,
    trace: SpanContext,
    req: PaymentRequest,
) -> ChargeOutcome {
    let phases = claimed.phases.as_ref().map(|c| &*c.0);
    // Before any write: a budget that cannot cover a PSP round trip leaves nothing behind.
    if let Err(e) = state.psp.check_budget(deadline) {
        tracing::info!(error = %e, "budget too small for a charge; nothing written");
        return ChargeOutcome::DeadlineExceeded { intent: None };
    }
    let new = NewIntent {
        intent_id: uuid::Uuid::now_v7().to_string(),
        merchant_id: merchant.to_owned(),
        order_id: req.order_id.clone(),
        amount_cents: req.amount_cents,
        currency: req.currency.clone(),
        request_key: claimed.key.as_str().to_owned(),
        fingerprint: claimed.fingerprint.to_hex(),
        created_at: state.clock.now_ms(),
    };
    let created = match create(state, merchant, phases, new).await {
        Ok(created) => created,
        Err(outcome) => return outcome,
    };
    let intent = match created {
        Created::New(i) => i,
        Created::Resumed(i) => match i.status {
            IntentStatus::Running => {
                tracing::info!(intent_id = %i.intent_id, "resuming intent: same effect key");
                i
            }
            IntentStatus::Succeeded => return ChargeOutcome::Charged(i),
            IntentStatus::Failed => return ChargeOutcome::Declined(i),
        },
        Created::OrderConflict(i) => return ChargeOutcome::OrderConflict(i),
        Created::KeyReused(i) => {
            return ChargeOutcome::KeyReused {
                fingerprint_prefix: i.fingerprint[..8.min(i.fingerprint.len())].to_owned(),
            };
        }
        Created::IdCollision => {
            return ChargeOutcome::StoreUnavailable(
                "intent id collision; retry with the same Idempotency-Key",
            );
        }
    };

    let call = ChargeCall {
        effect_key: intent.effect_key.clone(),
        merchant_id: intent.merchant_id.clone(),
        order_id: intent.order_id.clone(),
        amount_cents: intent.amount_cents,
        currency: intent.currency.clone(),
        deadline,
        trace,
    };
    match state.psp.charge(&call).await {
        Ok(charge) => {
            let charged = Intent {
                status: IntentStatus::Succeeded,
                psp_charge_id: Some(charge.charge_id.clone()),
                ..intent
            };
            match settle(state, phases, &charged, Some(&charge.charge_id)).await {
                Ok(()) => ChargeOutcome::Charged(charged),
                // Charged but not recorded: the PSP holds the charge under the effect key, so
                // a retry with the same key converges; tell the caller the outcome is unknown.
                Err(e) => {
                    tracing::error!(error = %e, intent_id = %charged.intent_id, "charged but not recorded");
                    ChargeOutcome::Unknown {
                        intent: Intent {
                            status: IntentStatus::Running,
                            ..charged
                        },
                        detail: "charged, but the result was not recorded; retrying with the same idempotency-key is safe (it charges at most once)",
                        retry_after: crate::psp_client::DEFAULT_RETRY_AFTER,
                    }
                }
            }
        }
        Err(ChargeError::Declined { status, .. }) => {
            tracing::info!(intent_id = %intent.intent_id, psp_status = %status, "charge declined");
            let declined = Intent {
                status: IntentStatus::Failed,
                ..intent
            };
            if let Err(e) = settle(state, phases, &declined, None).await {
                return ChargeOutcome::StoreUnavailable(store_failed(&e));
            }
            ChargeOutcome::Declined(declined)
        }
        Err(ChargeError::EffectKeyConflict(e)) => {
            tracing::error!(error = %e, intent_id = %intent.intent_id, "PSP holds the effect key with other parameters");
            ChargeOutcome::PspConflict(intent)
        }
        Err(ChargeError::NoBudget(e)) => {
            tracing::info!(error = %e, intent_id = %intent.intent_id, "no budget left for the PSP call; nothing sent");
            ChargeOutcome::DeadlineExceeded {
                intent: Some(intent),
            }
        }
        Err(ChargeError::NotCharged { tried, source }) => {
            tracing::info!(
                intent_id = %intent.intent_id,
                attempts = source.attempts,
                reason = source.reason.as_str(),
                code = source.last.code().as_str(),
                tried,
                "the PSP charged nothing"
            );
            if !tried && source.reason == StopReason::Deadline {
                ChargeOutcome::DeadlineExceeded {
                    intent: Some(intent),
                }
            } else {
                let retry_after = ChargeError::NotCharged { tried, source }.retry_after();
                ChargeOutcome::PspUnavailable {
                    intent,
                    retry_after,
                }
            }
        }
        Err(ChargeError::Unknown(e)) => {
            tracing::warn!(
                intent_id = %intent.intent_id,
                attempts = e.attempts,
                reason = e.reason.as_str(),
                code = e.last.code().as_str(),
                "PSP outcome unknown"
            );
            let retry_after = e
                .last
                .pushback()
                .unwrap_or(crate::psp_client::DEFAULT_RETRY_AFTER);
            ChargeOutcome::Unknown {
                intent,
                detail: "a charge was sent but its answer did not arrive; retrying with the same idempotency-key is safe (it charges at most once), or query the payment",
                retry_after: retry_after.max(Duration::from_secs(1)),
            }
        }
    }
}

/// The intent of the charge: created in the claim's transaction (phase [`INTENT_CREATED`]),
/// or, when this run took over one that got that far, the intent it created. Without phases
/// (a store the payment service cannot run them on), created in a write of its own.
async fn create(
    state: &AppState,
    merchant: &str,
    phases: Option<&dyn ChargePhases>,
    new: NewIntent,
) -> Result<Created, ChargeOutcome> {
    let Some(phases) = phases else {
        return state
            .intents
            .create(new)
            .await
            .map_err(|e| ChargeOutcome::StoreUnavailable(store_failed(&e)));
    };
    if let Some(point) = phases
        .recovery_point()
        .filter(|point| point.phase == INTENT_CREATED)
    {
        let intent_id = String::from_utf8_lossy(&point.data);
        match state.intents.get(merchant, &intent_id).await {
            Ok(Some(intent)) => {
                tracing::info!(intent_id = %intent.intent_id, "took over a charge from its recovery point");
                return Ok(Created::Resumed(intent));
            }
            // The phase committed without creating it (the order or the key was taken):
            // this run decides afresh.
            Ok(None) => {}
            Err(e) => return Err(ChargeOutcome::StoreUnavailable(store_failed(&e))),
        }
    }
    match phases.create_intent(new).await {
        Ok(Ok(created)) => Ok(created),
        Ok(Err(e)) => Err(ChargeOutcome::StoreUnavailable(store_failed(&e))),
        Err(StoreError::LeaseLost { .. }) => Err(ChargeOutcome::StoreUnavailable(
            "another request took this Idempotency-Key over; retry with the same key",
        )),
        Err(e) => Err(ChargeOutcome::StoreUnavailable(store_failed(&e))),
    }
}

/// Records the charge's outcome on `intent`: with the record's end (its stored answer) when
/// the request holds phases, else in a write of its own.
async fn settle(
    state: &AppState,
    phases: Option<&dyn ChargePhases>,
    intent: &Intent,
    charge_id: Option<&str>,
) -> Result<(), IntentsError> {
    let writes = Intents::settle_writes(&intent.merchant_id, &intent.intent_id, charge_id);
    match phases {
        Some(phases) => {
            phases.on_finish(writes);
            Ok(())
        }
        None => state.intents.run(writes).await,
    }
}

/// The merchant's payment `intent_id`. A running intent is converged by asking the PSP for a
/// charge under its effect key; one old enough to be abandoned is settled by the resolver
/// (charged, or failed with its effect key voided at the PSP).
pub(crate) async fn lookup(
    state: &AppState,
    merchant: &str,
    deadline: Deadline,
    intent_id: &str,
) -> Lookup {
    if intent_id.is_empty() || intent_id.len() > 64 {
        return Lookup::NotFound;
    }
    let intent = match state.intents.get(merchant, intent_id).await {
        Ok(Some(i)) => i,
        Ok(None) => return Lookup::NotFound,
        Err(e) => {
            store_failed(&e);
            return Lookup::StoreUnavailable;
        }
    };
    if resolver::is_abandoned(&intent, state.clock.now_ms()) {
        return match resolver::settle(state, &intent, deadline).await {
            Ok(settled) => Lookup::Found(Box::new(settled)),
            Err(e) => {
                tracing::info!(error = %e, intent_id = %intent.intent_id, "abandoned intent not settled; answering the stored state");
                Lookup::Found(Box::new(intent))
            }
        };
    }
    if intent.status == IntentStatus::Running {
        match state
            .psp
            .find_charge(merchant, &intent.order_id, &intent.effect_key, deadline)
            .await
        {
            Ok(Some(charge)) => {
                return match state
                    .intents
                    .settle(merchant, &intent.intent_id, Some(&charge.charge_id))
                    .await
                {
                    Ok(Some(settled)) => Lookup::Found(Box::new(settled)),
                    // Settled meanwhile (by the charge's own request or the resolver).
                    Ok(None) => match state.intents.get(merchant, &intent.intent_id).await {
                        Ok(Some(i)) => Lookup::Found(Box::new(i)),
                        Ok(None) => Lookup::NotFound,
                        Err(e) => {
                            store_failed(&e);
                            Lookup::StoreUnavailable
                        }
                    },
                    Err(e) => {
                        store_failed(&e);
                        Lookup::StoreUnavailable
                    }
                };
            }
            Ok(None) => {}
            Err(e) => {
                tracing::info!(error = %e, intent_id = %intent.intent_id, "PSP query failed; answering the stored state")
            }
        }
    }
    Lookup::Found(Box::new(intent))
}
