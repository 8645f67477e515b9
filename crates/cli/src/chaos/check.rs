//! The history of a chaos run and the checker that judges it.
//!
//! The checker is a pure function of what the run recorded (every attempt and answer of every
//! logical payment, what a lookup and a same-key replay answered afterwards, the PSP's charges
//! per order and the intents the store still holds `running`), so it can be fed synthetic
//! histories in tests.

use serde::Serialize;

/// One request of one logical payment, as the client saw it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Attempt {
    /// Milliseconds since the start of the run when the request was sent.
    pub(crate) at_ms: u64,
    /// Which instance it was sent to.
    pub(crate) instance: usize,
    /// How long it took, in milliseconds.
    pub(crate) took_ms: u64,
    /// The HTTP status, or `None` when no answer came (connection refused, reset, timed out).
    pub(crate) status: Option<u16>,
    /// The answer's body, or what went wrong when there was none.
    pub(crate) body: String,
}

impl Attempt {
    /// Whether this attempt acknowledged the payment (a created or replayed payment).
    pub(crate) fn acknowledged(&self) -> bool {
        matches!(self.status, Some(200 | 201))
    }
}

/// An answer compared byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Answer {
    /// HTTP status.
    pub(crate) status: u16,
    /// Body bytes (as text: the service answers JSON).
    pub(crate) body: String,
}

/// One PSP charge of an order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct PspCharge {
    /// The PSP's id.
    pub(crate) charge_id: String,
    /// The effect key it was made under.
    pub(crate) effect_key: String,
}

/// A logical payment and everything recorded about it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Payment {
    /// The merchant's order id (one per logical payment).
    pub(crate) order_id: String,
    /// The `Idempotency-Key` every attempt carried.
    pub(crate) key: String,
    /// Every attempt, in order.
    pub(crate) attempts: Vec<Attempt>,
    /// Milliseconds from the first attempt to the final answer, if one came.
    pub(crate) final_after_ms: Option<u64>,
    /// `GET /v1/payments/{id}` after the run, for an acknowledged payment.
    pub(crate) lookup: Option<Answer>,
    /// The same request sent once more after the run, for an acknowledged payment.
    pub(crate) replay: Option<Answer>,
    /// The PSP's charges for this order.
    pub(crate) charges: Vec<PspCharge>,
}

impl Payment {
    /// The final answer: the last attempt, when it was acknowledged or a final refusal.
    pub(crate) fn final_answer(&self) -> Option<&Attempt> {
        self.final_after_ms.and(self.attempts.last())
    }

    /// Every acknowledgement the client saw.
    fn acknowledgements(&self) -> impl Iterator<Item = &Attempt> {
        self.attempts.iter().filter(|a| a.acknowledged())
    }
}

/// An intent the store still holds `running` after the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct RunningIntent {
    /// Its id.
    pub(crate) intent_id: String,
    /// Its order.
    pub(crate) order_id: String,
}

/// What a run's answers and effects are checked against.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Promise {
    /// `serve`: each payment charged once at the PSP, its acknowledgement naming the charge
    /// and read back as stored.
    #[default]
    Payments,
    /// `proxy`: each key's request executed at most once by the upstream (once when
    /// acknowledged), every answer of a key the same bytes. The `charges` are the upstream's
    /// effects; nothing is looked up.
    Effects,
}

/// What the run recorded.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct History {
    /// What the run promises.
    pub(crate) promise: Promise,
    /// Every logical payment.
    pub(crate) payments: Vec<Payment>,
    /// Intents left `running`.
    pub(crate) running: Vec<RunningIntent>,
    /// Every charge the PSP holds, the run's orders' and any other.
    pub(crate) psp_charges: u64,
}

/// A broken promise.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum Violation {
    /// An order was charged more than once at the PSP.
    DoubleCharge {
        /// The order.
        order_id: String,
        /// How many charges.
        charges: usize,
    },
    /// A key's request was executed more than once by the upstream (behind a proxy).
    DoubleEffect {
        /// The order.
        order_id: String,
        /// How many effects.
        effects: usize,
    },
    /// An acknowledged request has no effect at the upstream (behind a proxy).
    AcknowledgedNotExecuted {
        /// The order.
        order_id: String,
    },
    /// An acknowledged payment has no charge at the PSP.
    AcknowledgedNotCharged {
        /// The order.
        order_id: String,
    },
    /// An acknowledged payment does not read back as succeeded with the PSP's charge.
    AcknowledgedNotStored {
        /// The order.
        order_id: String,
        /// What the lookup answered (`None`: no lookup was possible).
        lookup: Option<Answer>,
    },
    /// An acknowledgement does not name the PSP's charge or says something else than
    /// `succeeded`.
    AcknowledgementWrong {
        /// The order.
        order_id: String,
        /// The acknowledgement.
        body: String,
    },
    /// Two answers of one key meant to be the same payment differ in a byte.
    AnswersDiffer {
        /// The order.
        order_id: String,
        /// The first acknowledgement.
        first: Answer,
        /// The answer that differs from it.
        other: Answer,
    },
    /// A payment never got a final answer within the run's bounds.
    NoFinalAnswer {
        /// The order.
        order_id: String,
    },
    /// The PSP holds charges that belong to none of the run's orders.
    UnattributedCharges {
        /// Charges at the PSP.
        total: u64,
        /// Charges found under the run's orders.
        attributed: u64,
    },
    /// An intent is still `running` after the run settled.
    LeftRunning {
        /// The order.
        order_id: String,
        /// The intent.
        intent_id: String,
    },
}

impl Violation {
    /// The order the violation is about (none for charges of no order).
    pub(crate) fn order_id(&self) -> &str {
        match self {
            Violation::UnattributedCharges { .. } => "",
            Violation::DoubleCharge { order_id, .. }
            | Violation::DoubleEffect { order_id, .. }
            | Violation::AcknowledgedNotExecuted { order_id }
            | Violation::AcknowledgedNotCharged { order_id }
            | Violation::AcknowledgedNotStored { order_id, .. }
            | Violation::AcknowledgementWrong { order_id, .. }
            | Violation::AnswersDiffer { order_id, .. }
            | Violation::NoFinalAnswer { order_id }
            | Violation::LeftRunning { order_id, .. } => order_id,
        }
    }
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::DoubleCharge { order_id, charges } => {
                write!(f, "{order_id}: charged {charges} times at the PSP")
            }
            Violation::DoubleEffect { order_id, effects } => {
                write!(f, "{order_id}: executed {effects} times by the upstream")
            }
            Violation::AcknowledgedNotExecuted { order_id } => {
                write!(
                    f,
                    "{order_id}: acknowledged, but the upstream has no effect"
                )
            }
            Violation::AcknowledgedNotCharged { order_id } => {
                write!(f, "{order_id}: acknowledged, but the PSP has no charge")
            }
            Violation::AcknowledgedNotStored { order_id, lookup } => match lookup {
                Some(a) => write!(
                    f,
                    "{order_id}: acknowledged, but the lookup answered {} {}",
                    a.status, a.body
                ),
                None => write!(f, "{order_id}: acknowledged, but it could not be looked up"),
            },
            Violation::AcknowledgementWrong { order_id, body } => write!(
                f,
                "{order_id}: the acknowledgement does not match the PSP's charge: {body}"
            ),
            Violation::AnswersDiffer {
                order_id,
                first,
                other,
            } => write!(
                f,
                "{order_id}: same-key answers differ: {} {} then {} {}",
                first.status, first.body, other.status, other.body
            ),
            Violation::NoFinalAnswer { order_id } => {
                write!(f, "{order_id}: no final answer within the run's bounds")
            }
            Violation::UnattributedCharges { total, attributed } => write!(
                f,
                "the PSP holds {total} charges, only {attributed} of them under the run's orders"
            ),
            Violation::LeftRunning {
                order_id,
                intent_id,
            } => write!(f, "{order_id}: intent {intent_id} is still running"),
        }
    }
}

/// Every violation in `history`, payment by payment, then the intents left running.
pub(crate) fn check(history: &History) -> Vec<Violation> {
    let mut violations = Vec::new();
    for payment in &history.payments {
        match history.promise {
            Promise::Payments => check_payment(payment, &mut violations),
            Promise::Effects => check_effects(payment, &mut violations),
        }
    }
    let attributed: u64 = history
        .payments
        .iter()
        .map(|p| p.charges.len() as u64)
        .sum();
    if history.psp_charges > attributed {
        violations.push(Violation::UnattributedCharges {
            total: history.psp_charges,
            attributed,
        });
    }
    for intent in &history.running {
        violations.push(Violation::LeftRunning {
            order_id: intent.order_id.clone(),
            intent_id: intent.intent_id.clone(),
        });
    }
    violations
}

fn check_payment(payment: &Payment, violations: &mut Vec<Violation>) {
    let order_id = || payment.order_id.clone();
    let double = |order_id, charges| Violation::DoubleCharge { order_id, charges };
    let Some(first) = check_answers(payment, double, violations) else {
        return;
    };
    let Some(charge) = payment.charges.first() else {
        violations.push(Violation::AcknowledgedNotCharged {
            order_id: order_id(),
        });
        return;
    };
    if !names_succeeded_charge(&first.body, &payment.order_id, &charge.charge_id) {
        violations.push(Violation::AcknowledgementWrong {
            order_id: order_id(),
            body: first.body.clone(),
        });
    }
    let stored = payment.lookup.as_ref().is_some_and(|lookup| {
        lookup.status == 200
            && names_succeeded_charge(&lookup.body, &payment.order_id, &charge.charge_id)
    });
    if !stored {
        violations.push(Violation::AcknowledgedNotStored {
            order_id: order_id(),
            lookup: payment.lookup.clone(),
        });
    }
}

/// Behind a proxy: at most one effect per key, one when acknowledged, and every
/// acknowledgement and the replay after the run the first one again.
fn check_effects(payment: &Payment, violations: &mut Vec<Violation>) {
    let double = |order_id, effects| Violation::DoubleEffect { order_id, effects };
    if check_answers(payment, double, violations).is_none() {
        return;
    }
    if payment.charges.is_empty() {
        violations.push(Violation::AcknowledgedNotExecuted {
            order_id: payment.order_id.clone(),
        });
    }
}

/// What every target is checked for: at most one effect (`double` names the violation), a
/// final answer, and every acknowledgement and the replay after the run the first one again.
/// Answers the first acknowledgement, if the key had one.
fn check_answers<'p>(
    payment: &'p Payment,
    double: impl FnOnce(String, usize) -> Violation,
    violations: &mut Vec<Violation>,
) -> Option<&'p Attempt> {
    let order_id = || payment.order_id.clone();
    if payment.charges.len() > 1 {
        violations.push(double(order_id(), payment.charges.len()));
    }
    if payment.final_answer().is_none() {
        violations.push(Violation::NoFinalAnswer {
            order_id: order_id(),
        });
    }
    let mut acks = payment.acknowledgements();
    let first = acks.next()?;
    if let Some(other) = answers_differ(first, acks, payment.replay.as_ref()) {
        violations.push(Violation::AnswersDiffer {
            order_id: order_id(),
            first: Answer {
                status: first.status.unwrap_or_default(),
                body: first.body.clone(),
            },
            other,
        });
    }
    Some(first)
}

/// The first of `others` and `replay` that is not `first`'s answer byte for byte.
fn answers_differ<'a>(
    first: &Attempt,
    others: impl Iterator<Item = &'a Attempt>,
    replay: Option<&Answer>,
) -> Option<Answer> {
    let first = Answer {
        status: first.status.unwrap_or_default(),
        body: first.body.clone(),
    };
    others
        .map(|a| Answer {
            status: a.status.unwrap_or_default(),
            body: a.body.clone(),
        })
        .chain(replay.cloned())
        .find(|other| *other != first)
}

/// Whether `body` is a payment of `order_id`, succeeded, charged as `charge_id`.
fn names_succeeded_charge(body: &str, order_id: &str, charge_id: &str) -> bool {
    let Ok(json) = serde_json::from_str::<serde_json::Value>(body) else {
        return false;
    };
    json["status"] == "succeeded" && json["order_id"] == order_id && json["charge_id"] == charge_id
}

/// The intent id an answer names (a payment, or a 504 with the outcome unknown), if any.
pub(crate) fn intent_id(body: &str) -> Option<String> {
    let json = serde_json::from_str::<serde_json::Value>(body).ok()?;
    json["intent_id"].as_str().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(order: &str, charge: &str) -> String {
        format!(
            r#"{{"intent_id":"i-{order}","order_id":"{order}","amount_cents":500,"currency":"USD","status":"succeeded","charge_id":"{charge}"}}"#
        )
    }

    fn attempt(status: Option<u16>, body: &str) -> Attempt {
        Attempt {
            at_ms: 0,
            instance: 0,
            took_ms: 1,
            status,
            body: body.to_owned(),
        }
    }

    /// An order acknowledged after a dropped connection and a 504, charged once, read back.
    fn good(order: &str) -> Payment {
        let body = ack(order, "ch_1");
        Payment {
            order_id: order.to_owned(),
            key: format!("key-{order}"),
            attempts: vec![
                attempt(None, "connection reset"),
                attempt(Some(504), r#"{"code":"payment_outcome_unknown"}"#),
                attempt(Some(201), &body),
            ],
            final_after_ms: Some(30),
            lookup: Some(Answer {
                status: 200,
                body: body.clone(),
            }),
            replay: Some(Answer { status: 201, body }),
            charges: vec![PspCharge {
                charge_id: "ch_1".into(),
                effect_key: "e-1".into(),
            }],
        }
    }

    fn one(payment: Payment) -> Vec<Violation> {
        let psp_charges = payment.charges.len() as u64;
        check(&History {
            promise: Promise::Payments,
            payments: vec![payment],
            running: Vec::new(),
            psp_charges,
        })
    }

    #[test]
    fn a_clean_history_has_no_violation() {
        assert_eq!(one(good("o-1")), []);
    }

    #[test]
    fn a_double_charge_is_reported() {
        let mut p = good("o-1");
        p.charges.push(PspCharge {
            charge_id: "ch_2".into(),
            effect_key: "e-2".into(),
        });
        assert_eq!(
            one(p),
            [Violation::DoubleCharge {
                order_id: "o-1".into(),
                charges: 2
            }]
        );
    }

    #[test]
    fn a_double_charge_of_an_unacknowledged_order_is_reported_too() {
        let mut p = good("o-1");
        p.attempts.truncate(2);
        p.final_after_ms = None;
        p.charges.push(p.charges[0].clone());
        let v = one(p);
        assert!(
            matches!(v[0], Violation::DoubleCharge { charges: 2, .. }),
            "{v:?}"
        );
        assert!(matches!(v[1], Violation::NoFinalAnswer { .. }), "{v:?}");
    }

    #[test]
    fn differing_same_key_answers_are_reported() {
        let mut p = good("o-1");
        let replay = p.replay.as_mut().unwrap();
        replay.body = replay.body.replace("500", "501");
        let v = one(p);
        assert!(
            matches!(&v[..], [Violation::AnswersDiffer { other, .. }] if other.body.contains("501")),
            "{v:?}"
        );

        // Two acknowledgements seen during the run, one byte apart.
        let mut p = good("o-2");
        let second = ack("o-2", "ch_1").replace(',', ", ");
        p.attempts.push(attempt(Some(201), &second));
        let v = one(p);
        assert!(matches!(&v[..], [Violation::AnswersDiffer { .. }]), "{v:?}");

        // Same body, other status.
        let mut p = good("o-3");
        p.replay.as_mut().unwrap().status = 200;
        assert!(matches!(&one(p)[..], [Violation::AnswersDiffer { .. }]));
    }

    #[test]
    fn an_acknowledged_payment_missing_is_reported() {
        let mut p = good("o-1");
        p.lookup = Some(Answer {
            status: 404,
            body: r#"{"code":"payment_not_found"}"#.into(),
        });
        assert!(matches!(
            &one(p)[..],
            [Violation::AcknowledgedNotStored {
                lookup: Some(Answer { status: 404, .. }),
                ..
            }]
        ));

        let mut p = good("o-2");
        p.lookup = None;
        assert!(matches!(
            &one(p)[..],
            [Violation::AcknowledgedNotStored { lookup: None, .. }]
        ));

        // Read back, but still running.
        let mut p = good("o-3");
        p.lookup.as_mut().unwrap().body = p
            .lookup
            .as_ref()
            .unwrap()
            .body
            .replace("succeeded", "running");
        assert!(matches!(
            &one(p)[..],
            [Violation::AcknowledgedNotStored { .. }]
        ));
    }

    #[test]
    fn an_acknowledged_payment_the_psp_never_charged_is_reported() {
        let mut p = good("o-1");
        p.charges.clear();
        assert_eq!(
            one(p),
            [Violation::AcknowledgedNotCharged {
                order_id: "o-1".into()
            }]
        );
    }

    #[test]
    fn an_acknowledgement_naming_another_charge_is_reported() {
        let mut p = good("o-1");
        p.charges[0].charge_id = "ch_other".into();
        let v = one(p);
        assert!(
            matches!(v[0], Violation::AcknowledgementWrong { .. }),
            "{v:?}"
        );
    }

    #[test]
    fn no_final_answer_and_intents_left_running_are_reported() {
        let mut p = good("o-1");
        p.attempts.truncate(2);
        p.final_after_ms = None;
        p.charges.clear();
        let history = History {
            promise: Promise::Payments,
            payments: vec![p],
            running: vec![RunningIntent {
                intent_id: "i-o-1".into(),
                order_id: "o-1".into(),
            }],
            psp_charges: 0,
        };
        assert_eq!(
            check(&history),
            [
                Violation::NoFinalAnswer {
                    order_id: "o-1".into()
                },
                Violation::LeftRunning {
                    order_id: "o-1".into(),
                    intent_id: "i-o-1".into()
                }
            ]
        );
    }

    #[test]
    fn charges_under_no_order_of_the_run_are_reported() {
        let history = History {
            promise: Promise::Payments,
            payments: vec![good("o-1"), good("o-2")],
            running: Vec::new(),
            psp_charges: 3,
        };
        assert_eq!(
            check(&history),
            [Violation::UnattributedCharges {
                total: 3,
                attributed: 2
            }]
        );
    }

    #[test]
    fn intent_ids_are_read_from_payments_and_unknown_outcomes() {
        assert_eq!(intent_id(&ack("o-1", "ch_1")).as_deref(), Some("i-o-1"));
        assert_eq!(
            intent_id(r#"{"code":"payment_outcome_unknown","intent_id":"i-9"}"#).as_deref(),
            Some("i-9")
        );
        assert_eq!(intent_id("connection reset"), None);
    }

    /// Behind a proxy: a key acknowledged after a dropped connection, executed once.
    fn proxied(order: &str) -> Payment {
        let body = r#"{"effect_id":"e-1","n":1}"#.to_owned();
        Payment {
            order_id: order.to_owned(),
            key: format!("key-{order}"),
            attempts: vec![attempt(None, "connection reset"), attempt(Some(201), &body)],
            final_after_ms: Some(30),
            lookup: None,
            replay: Some(Answer { status: 201, body }),
            charges: vec![PspCharge {
                charge_id: "e-1".into(),
                effect_key: "k-1".into(),
            }],
        }
    }

    fn effects(payments: Vec<Payment>) -> Vec<Violation> {
        let psp_charges = payments.iter().map(|p| p.charges.len() as u64).sum();
        check(&History {
            promise: Promise::Effects,
            payments,
            running: Vec::new(),
            psp_charges,
        })
    }

    #[test]
    fn behind_a_proxy_effects_are_counted_and_nothing_is_looked_up() {
        assert_eq!(effects(vec![proxied("o-1")]), []);

        // An outcome the proxy cannot know is a final refusal; executed once or not at all.
        let mut unknown = proxied("o-2");
        unknown.attempts[1] = attempt(Some(500), r#"{"code":"outcome_unknown"}"#);
        unknown.replay = None;
        assert_eq!(effects(vec![unknown.clone()]), []);
        unknown.charges.clear();
        assert_eq!(effects(vec![unknown]), []);

        let mut twice = proxied("o-3");
        twice.charges.push(twice.charges[0].clone());
        assert_eq!(
            effects(vec![twice]),
            [Violation::DoubleEffect {
                order_id: "o-3".into(),
                effects: 2
            }]
        );

        let mut never = proxied("o-4");
        never.charges.clear();
        assert_eq!(
            effects(vec![never]),
            [Violation::AcknowledgedNotExecuted {
                order_id: "o-4".into()
            }]
        );

        let mut other = proxied("o-5");
        other.replay.as_mut().unwrap().body.push(' ');
        assert!(matches!(
            &effects(vec![other])[..],
            [Violation::AnswersDiffer { .. }]
        ));
    }
}
