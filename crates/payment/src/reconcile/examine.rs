//! What is wrong with one order: the pure rules, from the order's intents and the PSP's
//! charges for its reference. No I/O, so every case is a unit test.

use serde::Serialize;

use crate::intents::{Intent, IntentStatus};
use crate::psp::Charge;

/// Prefix of the idempotency key of a refund that undoes a duplicate charge; the charge id
/// follows, so every run that finds the same duplicate sends the same key and the PSP refunds
/// it once.
pub const REFUND_KEY_PREFIX: &str = "reconcile-refund:";

/// The refund idempotency key for undoing `charge_id`.
pub fn refund_key(charge_id: &str) -> String {
    format!("{REFUND_KEY_PREFIX}{charge_id}")
}

/// What kind of discrepancy a [`Finding`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A live charge for an order beyond the one its intent stands for (a second intent for
    /// the order, or a charge made around the service). Fixed by refunding it.
    DuplicateCharge,
    /// An intent still `running` whose charge the PSP made. Fixed by marking it succeeded
    /// with that charge.
    OrphanIntent,
    /// A live charge no intent stands for, and no other charge for the order. Left to a
    /// person: the money moved with no payment recorded.
    OrphanCharge,
    /// An intent `succeeded` whose charge the PSP does not have. Left to a person.
    MissingCharge,
    /// The charge's amount differs from its intent's. Left to a person.
    AmountMismatch,
    /// The charge's currency differs from its intent's. Left to a person.
    CurrencyMismatch,
    /// An intent `succeeded` with another charge id than the charge its effect key made, or
    /// a `failed` intent whose charge is live. Left to a person.
    StatusMismatch,
}

impl Kind {
    /// The name used in the table and the JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::DuplicateCharge => "duplicate_charge",
            Kind::OrphanIntent => "orphan_intent",
            Kind::OrphanCharge => "orphan_charge",
            Kind::MissingCharge => "missing_charge",
            Kind::AmountMismatch => "amount_mismatch",
            Kind::CurrencyMismatch => "currency_mismatch",
            Kind::StatusMismatch => "status_mismatch",
        }
    }
}

/// How reconciliation fixes a finding with `--apply`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Fix {
    /// Refund what is left of the charge, under [`refund_key`] of it, and, when an intent
    /// other than the kept one stands for the charge, mark that intent `failed` (it keeps its
    /// row and its charge id as the audit record; `failed` frees the order).
    Refund {
        /// The duplicate charge.
        charge_id: String,
        /// What is left to refund on it (0 when a previous run refunded it already).
        amount_cents: i64,
        /// The refund's idempotency key.
        idempotency_key: String,
        /// The intent that made the duplicate charge and is still live, if any.
        release_intent: Option<String>,
    },
    /// Mark the running intent succeeded with the PSP's charge.
    MarkSucceeded {
        /// The intent.
        intent_id: String,
        /// The charge its effect key made.
        charge_id: String,
    },
}

/// One discrepancy between the payment store and the PSP.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// What it is.
    pub kind: Kind,
    /// The merchant of the order (empty for a charge whose reference names no merchant).
    pub merchant_id: String,
    /// The order.
    pub order_id: String,
    /// The intent concerned, if any.
    pub intent_id: Option<String>,
    /// The charge concerned, if any.
    pub charge_id: Option<String>,
    /// The amount at stake, in minor units.
    pub amount_cents: i64,
    /// Its currency.
    pub currency: String,
    /// One sentence for a person.
    pub detail: String,
    /// What `--apply` does about it; `None`: left to a person.
    pub fix: Option<Fix>,
}

/// Whether `charge` is the one `intent` made: its effect key, or the charge id it recorded.
fn made_by(charge: &Charge, intent: &Intent) -> bool {
    charge.effect_key == intent.effect_key
        || intent.psp_charge_id.as_deref() == Some(charge.charge_id.as_str())
}

fn is_live(intent: &Intent) -> bool {
    intent.status != IntentStatus::Failed
}

/// The discrepancies of one order (`merchant_id`, `order_id`), from all of its intents and
/// all of the PSP's charges for its reference.
///
/// The intent kept is the oldest live one (succeeded before running) whose charge is live;
/// every other live charge of the order is a duplicate to refund, and the other live intent
/// behind it, if any, is released. An order whose intents and charges agree has no finding.
pub fn examine(
    merchant_id: &str,
    order_id: &str,
    intents: &[Intent],
    charges: &[Charge],
) -> Vec<Finding> {
    let charge_of = |intent: &Intent| charges.iter().find(|charge| made_by(charge, intent));
    let finding =
        |kind, intent: Option<&Intent>, charge: Option<&Charge>, detail: String| Finding {
            kind,
            merchant_id: merchant_id.to_owned(),
            order_id: order_id.to_owned(),
            intent_id: intent.map(|i| i.intent_id.clone()),
            charge_id: charge.map(|c| c.charge_id.clone()),
            amount_cents: charge
                .map(|c| c.amount_cents)
                .or(intent.map(|i| i.amount_cents))
                .unwrap_or(0),
            currency: charge
                .map(|c| c.currency.clone())
                .or(intent.map(|i| i.currency.clone()))
                .unwrap_or_default(),
            detail,
            fix: None,
        };
    let mut found = Vec::new();

    let mut candidates: Vec<(&Intent, &Charge)> = intents
        .iter()
        .filter(|intent| is_live(intent))
        .filter_map(|intent| Some((intent, charge_of(intent).filter(|c| c.is_live())?)))
        .collect();
    candidates.sort_by(|(a, _), (b, _)| {
        let rank = |i: &Intent| u8::from(i.status != IntentStatus::Succeeded);
        (rank(a), a.created_at, &a.intent_id).cmp(&(rank(b), b.created_at, &b.intent_id))
    });
    let kept = candidates.first().copied();

    if let Some((intent, charge)) = kept {
        if intent.status == IntentStatus::Running {
            let mut orphan = finding(
                Kind::OrphanIntent,
                Some(intent),
                Some(charge),
                "the intent is running but the PSP charged it".to_owned(),
            );
            orphan.fix = Some(Fix::MarkSucceeded {
                intent_id: intent.intent_id.clone(),
                charge_id: charge.charge_id.clone(),
            });
            found.push(orphan);
        } else if intent.psp_charge_id.as_deref() != Some(charge.charge_id.as_str()) {
            found.push(finding(
                Kind::StatusMismatch,
                Some(intent),
                Some(charge),
                format!(
                    "the intent records charge {:?}, its effect key made {}",
                    intent.psp_charge_id.as_deref().unwrap_or(""),
                    charge.charge_id
                ),
            ));
        }
        if intent.amount_cents != charge.amount_cents {
            found.push(finding(
                Kind::AmountMismatch,
                Some(intent),
                Some(charge),
                format!(
                    "the intent is for {} but the PSP charged {}",
                    intent.amount_cents, charge.amount_cents
                ),
            ));
        }
        if intent.currency != charge.currency {
            found.push(finding(
                Kind::CurrencyMismatch,
                Some(intent),
                Some(charge),
                format!(
                    "the intent is in {} but the PSP charged in {}",
                    intent.currency, charge.currency
                ),
            ));
        }
    }

    for charge in charges {
        if kept.is_some_and(|(_, kept)| kept.charge_id == charge.charge_id) {
            continue;
        }
        let maker = intents.iter().find(|intent| made_by(charge, intent));
        let live_maker = maker.filter(|intent| is_live(intent));
        match kept {
            Some((kept_intent, _)) if charge.is_live() || live_maker.is_some() => {
                let mut duplicate = finding(
                    Kind::DuplicateCharge,
                    maker,
                    Some(charge),
                    match maker {
                        Some(_) => format!(
                            "a second charge for the order; intent {} is kept",
                            kept_intent.intent_id
                        ),
                        None => format!(
                            "a charge made around the service (effect key {}); intent {} is kept",
                            charge.effect_key, kept_intent.intent_id
                        ),
                    },
                );
                duplicate.fix = Some(Fix::Refund {
                    charge_id: charge.charge_id.clone(),
                    amount_cents: charge.amount_cents - charge.amount_refunded_cents,
                    idempotency_key: refund_key(&charge.charge_id),
                    release_intent: live_maker.map(|intent| intent.intent_id.clone()),
                });
                found.push(duplicate);
            }
            None if charge.is_live() => match maker {
                None => found.push(finding(
                    Kind::OrphanCharge,
                    None,
                    Some(charge),
                    format!(
                        "no intent stands for this charge (effect key {})",
                        charge.effect_key
                    ),
                )),
                Some(intent) => found.push(finding(
                    Kind::StatusMismatch,
                    Some(intent),
                    Some(charge),
                    format!(
                        "the intent is {} but its charge is live",
                        intent.status.as_str()
                    ),
                )),
            },
            _ => {}
        }
    }

    for intent in intents {
        if intent.status == IntentStatus::Succeeded && charge_of(intent).is_none() {
            found.push(finding(
                Kind::MissingCharge,
                Some(intent),
                None,
                format!(
                    "the intent succeeded with charge {:?}, which the PSP does not have",
                    intent.psp_charge_id.as_deref().unwrap_or("")
                ),
            ));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::psp::ChargeStatus;

    fn intent(id: &str, status: IntentStatus, charge: Option<&str>, at: i64) -> Intent {
        Intent {
            intent_id: id.into(),
            merchant_id: "m".into(),
            order_id: "o".into(),
            amount_cents: 500,
            currency: "USD".into(),
            request_key: format!("key-{id}"),
            fingerprint: "f".into(),
            effect_key: id.into(),
            status,
            psp_charge_id: charge.map(str::to_owned),
            created_at: at,
        }
    }

    fn charge(id: &str, effect_key: &str) -> Charge {
        Charge {
            charge_id: id.into(),
            effect_key: effect_key.into(),
            reference: "m:o".into(),
            amount_cents: 500,
            currency: "USD".into(),
            status: ChargeStatus::Succeeded,
            budget_ms: None,
            traceparent: None,
            created_ms: 1,
            amount_refunded_cents: 0,
        }
    }

    fn kinds(found: &[Finding]) -> Vec<Kind> {
        found.iter().map(|f| f.kind).collect()
    }

    #[test]
    fn an_order_that_agrees_has_no_finding() {
        let intents = [intent("i1", IntentStatus::Succeeded, Some("ch_1"), 1)];
        assert!(examine("m", "o", &intents, &[charge("ch_1", "i1")]).is_empty());
        // A running intent the PSP never charged is the resolver's, not a discrepancy.
        let running = [intent("i1", IntentStatus::Running, None, 1)];
        assert!(examine("m", "o", &running, &[]).is_empty());
        // A failed intent with nothing charged frees the order for the next one.
        let retried = [
            intent("i0", IntentStatus::Failed, None, 0),
            intent("i1", IntentStatus::Succeeded, Some("ch_1"), 1),
        ];
        assert!(examine("m", "o", &retried, &[charge("ch_1", "i1")]).is_empty());
    }

    #[test]
    fn two_succeeded_intents_keep_the_oldest_and_refund_the_other() {
        let intents = [
            intent("i2", IntentStatus::Succeeded, Some("ch_2"), 2),
            intent("i1", IntentStatus::Succeeded, Some("ch_1"), 1),
        ];
        let found = examine(
            "m",
            "o",
            &intents,
            &[charge("ch_1", "i1"), charge("ch_2", "i2")],
        );
        assert_eq!(kinds(&found), [Kind::DuplicateCharge]);
        assert_eq!(
            found[0].fix,
            Some(Fix::Refund {
                charge_id: "ch_2".into(),
                amount_cents: 500,
                idempotency_key: "reconcile-refund:ch_2".into(),
                release_intent: Some("i2".into()),
            })
        );
    }

    #[test]
    fn a_charge_made_around_the_service_is_a_duplicate_without_an_intent() {
        let intents = [intent("i1", IntentStatus::Succeeded, Some("ch_1"), 1)];
        let found = examine(
            "m",
            "o",
            &intents,
            &[charge("ch_1", "i1"), charge("ch_x", "other")],
        );
        assert_eq!(kinds(&found), [Kind::DuplicateCharge]);
        assert!(matches!(
            &found[0].fix,
            Some(Fix::Refund { charge_id, release_intent: None, .. }) if charge_id == "ch_x"
        ));
    }

    #[test]
    fn once_refunded_and_released_a_duplicate_is_no_longer_found() {
        let intents = [
            intent("i1", IntentStatus::Succeeded, Some("ch_1"), 1),
            intent("i2", IntentStatus::Failed, Some("ch_2"), 2),
        ];
        let mut refunded = charge("ch_2", "i2");
        refunded.amount_refunded_cents = 500;
        assert!(
            examine(
                "m",
                "o",
                &intents,
                &[charge("ch_1", "i1"), refunded.clone()]
            )
            .is_empty()
        );
        // Refunded but its intent not released yet (a run stopped in between): release it,
        // with nothing left to refund.
        let unreleased = [
            intent("i1", IntentStatus::Succeeded, Some("ch_1"), 1),
            intent("i2", IntentStatus::Succeeded, Some("ch_2"), 2),
        ];
        let found = examine("m", "o", &unreleased, &[charge("ch_1", "i1"), refunded]);
        assert!(matches!(
            &found[..],
            [Finding { fix: Some(Fix::Refund { amount_cents: 0, release_intent: Some(i), .. }), .. }]
                if i == "i2"
        ));
    }

    #[test]
    fn a_running_intent_with_a_charge_is_marked_succeeded() {
        let intents = [intent("i1", IntentStatus::Running, None, 1)];
        let found = examine("m", "o", &intents, &[charge("ch_1", "i1")]);
        assert_eq!(kinds(&found), [Kind::OrphanIntent]);
        assert_eq!(
            found[0].fix,
            Some(Fix::MarkSucceeded {
                intent_id: "i1".into(),
                charge_id: "ch_1".into()
            })
        );
        // A succeeded intent is kept over an older running one, whose charge is refunded.
        let both = [
            intent("i0", IntentStatus::Running, None, 0),
            intent("i1", IntentStatus::Succeeded, Some("ch_1"), 1),
        ];
        let found = examine(
            "m",
            "o",
            &both,
            &[charge("ch_0", "i0"), charge("ch_1", "i1")],
        );
        assert_eq!(kinds(&found), [Kind::DuplicateCharge]);
        assert_eq!(found[0].intent_id.as_deref(), Some("i0"));
    }

    #[test]
    fn what_cannot_be_fixed_safely_is_left_to_a_person() {
        let orphan = examine("m", "o", &[], &[charge("ch_1", "k")]);
        assert_eq!(kinds(&orphan), [Kind::OrphanCharge]);
        assert!(orphan[0].fix.is_none());

        let missing = examine(
            "m",
            "o",
            &[intent("i1", IntentStatus::Succeeded, Some("ch_1"), 1)],
            &[],
        );
        assert_eq!(kinds(&missing), [Kind::MissingCharge]);

        let mut other = charge("ch_1", "i1");
        other.amount_cents = 499;
        other.currency = "EUR".into();
        let mismatch = examine(
            "m",
            "o",
            &[intent("i1", IntentStatus::Succeeded, Some("ch_1"), 1)],
            &[other],
        );
        assert_eq!(
            kinds(&mismatch),
            [Kind::AmountMismatch, Kind::CurrencyMismatch]
        );
        assert!(mismatch.iter().all(|f| f.fix.is_none()));

        let failed = examine(
            "m",
            "o",
            &[intent("i1", IntentStatus::Failed, None, 1)],
            &[charge("ch_1", "i1")],
        );
        assert_eq!(kinds(&failed), [Kind::StatusMismatch]);
    }
}
