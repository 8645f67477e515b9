//! Reconciliation: compares the PSP's charges with the `payment_intent` rows and repairs what
//! it safely can.
//!
//! Exactly-once holds in the service by construction (one live intent per order, one charge
//! per effect key). Reconciliation is the check from outside, and the way to clean history
//! written before a constraint existed or around the service: a second intent for an order, a
//! charge made directly at the PSP, an intent left `running` whose charge went through.
//!
//! # What it finds
//! For each order of the [`Scope`] (its intents, and the PSP's charges for its reference
//! `MERCHANT:ORDER_ID`), [`examine`] lists the [`Finding`]s:
//! - [`Kind::DuplicateCharge`]: a live charge beyond the one the kept intent stands for;
//! - [`Kind::OrphanIntent`]: a `running` intent the PSP charged;
//! - [`Kind::OrphanCharge`], [`Kind::MissingCharge`], [`Kind::AmountMismatch`],
//!   [`Kind::CurrencyMismatch`], [`Kind::StatusMismatch`]: reported, left to a person.
//!
//! # What it fixes
//! [`Reconciler::apply`] refunds each duplicate through the PSP's refund endpoint, under an
//! idempotency key derived from the charge ([`refund_key`]), so a repeated run (after a crash,
//! or by a second operator) cannot refund twice; then, in one transaction of the payment
//! store, marks the intent behind the duplicate `failed` (its row stays as the audit record,
//! and no longer holds the order) and writes a [`Record`] to the `reconciliation` table. A
//! `running` intent with a charge is marked `succeeded` with it, and recorded, likewise.
//!
//! With the duplicates released, a unique index on the live order (`(merchant_id,
//! order_id) WHERE status <> 'failed'`) can be built on a table that had them.
//!
//! # Example
//! ```no_run
//! # async fn run() -> Result<(), backstop_payment::reconcile::ReconcileError> {
//! use backstop_payment::config::StoreLocation;
//! use backstop_payment::reconcile::{Ledger, PspApi, Reconciler, Scope};
//!
//! let store = StoreLocation::parse("backstop.db").expect("a path");
//! let reconciler = Reconciler::new(Ledger::open(&store).await?, PspApi::new("http://127.0.0.1:8090")?);
//! let scan = reconciler
//!     .scan(&Scope::Window { since_ms: 0, until_ms: i64::MAX }, &|_| {})
//!     .await?;
//! let outcomes = reconciler.apply(&scan.findings, "ops", 1_700_000_000_000).await;
//! # let _ = outcomes;
//! # Ok(())
//! # }
//! ```

mod examine;
mod ledger;
mod psp;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;

pub use examine::{Finding, Fix, Kind, REFUND_KEY_PREFIX, examine, refund_key};
pub use ledger::{ActionKind, Ledger, MIGRATION_NAME, MIGRATION_SQL, PG_MIGRATION_SQL, Record};
pub use psp::PspApi;

use crate::intents::{Intent, IntentStatus, IntentsError};
use crate::psp::listing::MAX_PAGE;
use crate::psp::{Charge, PageQuery};
use crate::psp_client::psp_reference;

/// Rows read per page, from the PSP and from the store.
const PAGE: u32 = MAX_PAGE;

/// Why reconciliation could not run (or one fix could not be applied).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReconcileError {
    /// The SQLite store file does not exist.
    #[error("no payment store at {}", .0.display())]
    NoStore(PathBuf),
    /// The payment store failed.
    #[error("the payment store failed")]
    Intents(#[from] IntentsError),
    /// PostgreSQL could not be reached or prepared.
    #[error("cannot open the PostgreSQL store")]
    Postgres(#[source] Box<backstop::idempotency::StoreError>),
    /// The PSP URL is not an `http(s)://` URL.
    #[error("the PSP URL must start with http:// or https://, got {0:?}")]
    PspUrl(String),
    /// The PSP could not be reached, or its answer not read.
    #[error("the PSP did not answer")]
    Http(#[source] reqwest::Error),
    /// The PSP refused a request.
    #[error("the PSP refused to {what}: {status} {code}: {detail}")]
    Psp {
        /// What was asked.
        what: &'static str,
        /// HTTP status.
        status: u16,
        /// The problem's `code`.
        code: String,
        /// The problem's `detail`.
        detail: String,
    },
    /// A charge's reference is not `MERCHANT:ORDER_ID`.
    #[error("order {0:?} is not MERCHANT:ORDER_ID")]
    OrderRef(String),
}

/// A merchant's order, as the PSP's reference names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct OrderRef {
    /// The merchant.
    pub merchant_id: String,
    /// The order id.
    pub order_id: String,
}

impl OrderRef {
    /// Parses `MERCHANT:ORDER_ID` (the PSP reference): the first `:` splits, both sides
    /// non-empty.
    pub fn parse(s: &str) -> Result<OrderRef, ReconcileError> {
        match s.split_once(':') {
            Some((merchant, order)) if !merchant.is_empty() && !order.is_empty() => Ok(OrderRef {
                merchant_id: merchant.to_owned(),
                order_id: order.to_owned(),
            }),
            _ => Err(ReconcileError::OrderRef(s.chars().take(64).collect())),
        }
    }

    /// The PSP reference, `MERCHANT:ORDER_ID`.
    pub fn reference(&self) -> String {
        psp_reference(&self.merchant_id, &self.order_id)
    }
}

/// Which orders to reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every order with a charge or an intent created in `[since_ms, until_ms)` (unix ms).
    Window {
        /// Start, inclusive.
        since_ms: i64,
        /// End, exclusive.
        until_ms: i64,
    },
    /// These orders, whatever their time.
    Orders(Vec<OrderRef>),
}

/// How far a scan is, for a progress indicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    /// Charges read from the PSP's listing so far.
    pub charges: u64,
    /// Intents read from the store so far.
    pub intents: u64,
    /// Orders examined so far.
    pub orders_done: u64,
    /// Orders to examine, once known.
    pub orders_total: Option<u64>,
}

/// What a scan read and found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Scan {
    /// Charges read.
    pub charges: u64,
    /// Intents read.
    pub intents: u64,
    /// Orders examined.
    pub orders: u64,
    /// The discrepancies, by order.
    pub findings: Vec<Finding>,
}

/// What applying one fix did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Outcome {
    /// Done and recorded (`recorded` false: a previous run had recorded it).
    Applied {
        /// The record (as written, or as it would have been).
        record: Record,
        /// Whether this run wrote the record.
        recorded: bool,
    },
    /// Nothing was needed any more (the intent had been settled meanwhile).
    Skipped {
        /// The charge concerned.
        charge_id: String,
    },
    /// The fix failed; the rest went on.
    Failed {
        /// The charge concerned.
        charge_id: String,
        /// Why.
        error: String,
    },
}

/// Compares a payment store with a PSP, and repairs.
#[derive(Debug, Clone)]
pub struct Reconciler {
    ledger: Ledger,
    psp: PspApi,
}

impl Reconciler {
    /// A reconciler of `ledger` against `psp`.
    pub fn new(ledger: Ledger, psp: PspApi) -> Reconciler {
        Reconciler { ledger, psp }
    }

    /// The payment store.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Reads the scope's charges and intents and examines every order concerned. Changes
    /// nothing. `progress` is called after each page and each order.
    pub async fn scan(
        &self,
        scope: &Scope,
        progress: &(dyn Fn(Progress) + Sync),
    ) -> Result<Scan, ReconcileError> {
        let mut seen = Progress::default();
        // Per order: what the window showed, to examine again in full only when it does not
        // plainly agree (most orders do, and cost no further request).
        let mut orders: BTreeMap<OrderRef, (Vec<Intent>, Vec<Charge>)> = BTreeMap::new();
        let mut unmapped: Vec<Charge> = Vec::new();
        let complete = match scope {
            Scope::Orders(list) => {
                for order in list {
                    orders.entry(order.clone()).or_default();
                }
                false
            }
            Scope::Window { since_ms, until_ms } => {
                let mut query = PageQuery {
                    created_gte: Some(*since_ms),
                    created_lt: Some(*until_ms),
                    limit: PAGE,
                    ..PageQuery::default()
                };
                loop {
                    let page = self.psp.page(&query).await?;
                    seen.charges += page.data.len() as u64;
                    for charge in page.data {
                        match OrderRef::parse(&charge.reference) {
                            Ok(order) => orders.entry(order).or_default().1.push(charge),
                            Err(_) => unmapped.push(charge),
                        }
                    }
                    progress(seen);
                    match page.next_starting_after {
                        Some(next) if page.has_more => query.starting_after = Some(next),
                        _ => break,
                    }
                }
                let mut after = None;
                loop {
                    let intents = self
                        .ledger
                        .intents()
                        .created_between(*since_ms, *until_ms, after.clone(), PAGE)
                        .await?;
                    seen.intents += intents.len() as u64;
                    let full = intents.len() as u64 == u64::from(PAGE);
                    after = intents
                        .last()
                        .map(|last| (last.created_at, last.intent_id.clone()));
                    for intent in intents {
                        let order = OrderRef {
                            merchant_id: intent.merchant_id.clone(),
                            order_id: intent.order_id.clone(),
                        };
                        orders.entry(order).or_default().0.push(intent);
                    }
                    progress(seen);
                    if !full {
                        break;
                    }
                }
                true
            }
        };

        seen.orders_total = Some(orders.len() as u64);
        progress(seen);
        let mut findings = Vec::new();
        for (order, (intents, charges)) in &orders {
            let plainly_agrees = complete && agrees(intents, charges);
            if !plainly_agrees {
                let intents = self
                    .ledger
                    .intents()
                    .by_order(&order.merchant_id, &order.order_id)
                    .await?;
                let charges = self.psp.charges_for(&order.reference()).await?;
                if !complete {
                    seen.intents += intents.len() as u64;
                    seen.charges += charges.len() as u64;
                }
                findings.extend(examine(
                    &order.merchant_id,
                    &order.order_id,
                    &intents,
                    &charges,
                ));
            }
            seen.orders_done += 1;
            progress(seen);
        }
        // A charge whose reference names no order of this service cannot have an intent.
        for charge in unmapped.iter().filter(|charge| charge.is_live()) {
            findings.push(Finding {
                kind: Kind::OrphanCharge,
                merchant_id: String::new(),
                order_id: charge.reference.clone(),
                intent_id: None,
                charge_id: Some(charge.charge_id.clone()),
                amount_cents: charge.amount_cents,
                currency: charge.currency.clone(),
                detail: "the charge's reference is not MERCHANT:ORDER_ID".to_owned(),
                fix: None,
            });
        }
        Ok(Scan {
            charges: seen.charges,
            intents: seen.intents,
            orders: seen.orders_done,
            findings,
        })
    }

    /// Applies the fix of every finding that has one (see the module documentation), in
    /// order, each on its own: one failing does not stop the others. `operator` and `now_ms`
    /// go into the records.
    pub async fn apply(&self, findings: &[Finding], operator: &str, now_ms: i64) -> Vec<Outcome> {
        let mut outcomes = Vec::new();
        for finding in findings {
            let Some(fix) = &finding.fix else {
                continue;
            };
            let charge_id = match fix {
                Fix::Refund { charge_id, .. } | Fix::MarkSucceeded { charge_id, .. } => charge_id,
            };
            let outcome = match self.apply_one(finding, fix, operator, now_ms).await {
                Ok(Some((record, recorded))) => Outcome::Applied { record, recorded },
                Ok(None) => Outcome::Skipped {
                    charge_id: charge_id.clone(),
                },
                Err(error) => Outcome::Failed {
                    charge_id: charge_id.clone(),
                    error: error_chain(&error),
                },
            };
            outcomes.push(outcome);
        }
        outcomes
    }

    async fn apply_one(
        &self,
        finding: &Finding,
        fix: &Fix,
        operator: &str,
        now_ms: i64,
    ) -> Result<Option<(Record, bool)>, ReconcileError> {
        let mut record = Record {
            kind: ActionKind::RefundDuplicate,
            merchant_id: finding.merchant_id.clone(),
            order_id: finding.order_id.clone(),
            intent_id: None,
            charge_id: String::new(),
            refund_id: None,
            amount_cents: finding.amount_cents,
            currency: finding.currency.clone(),
            operator: operator.to_owned(),
            created_at: now_ms,
        };
        match fix {
            Fix::Refund {
                charge_id,
                amount_cents,
                idempotency_key,
                release_intent,
            } => {
                // The PSP first: the store says "refunded" only once the money went back.
                if *amount_cents > 0 {
                    let refund = self
                        .psp
                        .refund(idempotency_key, charge_id, *amount_cents)
                        .await?;
                    record.refund_id = Some(refund.refund_id);
                }
                record.charge_id = charge_id.clone();
                record.intent_id = release_intent.clone();
            }
            Fix::MarkSucceeded {
                intent_id,
                charge_id,
            } => {
                record.kind = ActionKind::MarkSucceeded;
                record.charge_id = charge_id.clone();
                record.intent_id = Some(intent_id.clone());
            }
        }
        let recorded = self.ledger.record(record.clone()).await?;
        if record.kind == ActionKind::MarkSucceeded && !recorded {
            // Settled meanwhile (by the service, or a run before this one).
            let current = self
                .ledger
                .intents()
                .get(
                    &record.merchant_id,
                    record.intent_id.as_deref().unwrap_or(""),
                )
                .await?;
            if current.is_some_and(|i| i.status != IntentStatus::Running) {
                return Ok(None);
            }
        }
        Ok(Some((record, recorded)))
    }
}

/// Whether an order's window view plainly agrees: one intent, succeeded with the one live
/// charge, which its effect key made, for the same amount and currency.
fn agrees(intents: &[Intent], charges: &[Charge]) -> bool {
    match (intents, charges) {
        ([intent], [charge]) => {
            intent.status == IntentStatus::Succeeded
                && intent.psp_charge_id.as_deref() == Some(charge.charge_id.as_str())
                && charge.effect_key == intent.effect_key
                && charge.is_live()
                && charge.amount_cents == intent.amount_cents
                && charge.currency == intent.currency
        }
        _ => false,
    }
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_refs_split_on_the_first_colon() {
        assert_eq!(
            OrderRef::parse("m:o:1").unwrap(),
            OrderRef {
                merchant_id: "m".into(),
                order_id: "o:1".into()
            }
        );
        for bad in ["", "m", ":o", "m:"] {
            assert!(matches!(
                OrderRef::parse(bad),
                Err(ReconcileError::OrderRef(_))
            ));
        }
        assert_eq!(OrderRef::parse("m:o").unwrap().reference(), "m:o");
    }
}
