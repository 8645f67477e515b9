//! One mapping from a payment's outcome to its answer: the payment, or the [`Problem`] to
//! refuse with. Each protocol renders it ([`Problem::into_http_response`], or
//! `tonic::Status::from`), so HTTP and gRPC cannot drift apart.

use std::time::Duration;

use backstop::server::problem::Problem;
use backstop::status::Code;
use backstop::status::problem as library;
use http::StatusCode;

use super::payments::{ChargeOutcome, Lookup};
use crate::intents::Intent;

/// Problem code of a 504 whose payment outcome is unknown.
pub const PAYMENT_OUTCOME_UNKNOWN: &str = "payment_outcome_unknown";
/// Problem code of a 402: the PSP refused the charge definitively; nothing was charged.
pub const PAYMENT_DECLINED: &str = "payment_declined";
/// Problem code of a 404 on `GET /v1/payments/{intent_id}`.
pub const PAYMENT_NOT_FOUND: &str = "payment_not_found";
/// Problem code of a 409: the order already has a payment made with another key.
pub const ORDER_CONFLICT: &str = "order_conflict";
/// Problem code of a 503 when the store does not answer (retry with the same key).
pub const STORE_UNAVAILABLE: &str = "store_unavailable";
/// Problem code of a 503 when the PSP charged nothing and the service's client gave up
/// (retry budget spent, PSP unreachable or pushing back): retry with the same key later.
pub const PSP_UNAVAILABLE: &str = "psp_unavailable";
/// Problem code of a 502 when the PSP holds the effect key with other parameters.
pub const PSP_CONFLICT: &str = "psp_conflict";

/// How soon to retry when the store did not answer.
const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The answer to a charge.
#[derive(Debug)]
pub(crate) enum ChargeAnswer {
    /// Charged (now, or earlier under the same key).
    Charged(Intent),
    /// Declined: nothing was charged. HTTP answers the problem (402); gRPC answers the payment
    /// with its status `failed`.
    Declined(Intent, Problem),
    /// Refused, or the outcome is not known.
    Refused(Problem),
}

impl ChargeOutcome {
    /// The answer this outcome gives, whatever the protocol.
    pub(crate) fn answer(self) -> ChargeAnswer {
        let problem = match self {
            ChargeOutcome::Charged(intent) => return ChargeAnswer::Charged(intent),
            ChargeOutcome::Declined(intent) => {
                let problem = Problem::new(StatusCode::PAYMENT_REQUIRED, PAYMENT_DECLINED)
                    .detail(
                        "the payment failed and nothing was charged: the payment provider \
                         declined it, or it was abandoned with its outcome unknown and then \
                         voided",
                    )
                    .with("intent_id", intent.intent_id.as_str());
                return ChargeAnswer::Declined(intent, problem);
            }
            ChargeOutcome::OrderConflict(intent) => {
                Problem::new(StatusCode::CONFLICT, ORDER_CONFLICT)
                    .detail("this order already has a payment created with another idempotency-key")
                    .with("intent_id", intent.intent_id.as_str())
                    .with("order_id", intent.order_id.as_str())
            }
            ChargeOutcome::KeyReused { fingerprint_prefix } => {
                Problem::new(StatusCode::CONFLICT, library::IDEMPOTENCY_KEY_REUSED)
                    .detail("this idempotency-key already created a payment with other parameters")
                    .with("fingerprint_prefix", fingerprint_prefix)
                    .grpc_code(Code::FailedPrecondition)
            }
            ChargeOutcome::StoreUnavailable(detail) => store_unavailable(detail),
            ChargeOutcome::PspConflict(intent) => Problem::new(
                StatusCode::BAD_GATEWAY,
                PSP_CONFLICT,
            )
            .detail("the payment provider holds this payment's effect key with other parameters")
            .with("intent_id", intent.intent_id.as_str())
            .grpc_code(Code::Internal),
            ChargeOutcome::Unknown {
                intent,
                detail,
                retry_after,
            } => Problem::new(StatusCode::GATEWAY_TIMEOUT, PAYMENT_OUTCOME_UNKNOWN)
                .detail(format!("payment outcome unknown: {detail}"))
                .with("intent_id", intent.intent_id.as_str())
                .with("order_id", intent.order_id.as_str())
                .retry_after(retry_after)
                // The call did not run out of time: the caller may retry at once with the key.
                .grpc_code(Code::Unavailable),
            ChargeOutcome::DeadlineExceeded { intent } => {
                let problem = Problem::new(StatusCode::GATEWAY_TIMEOUT, library::DEADLINE_EXCEEDED)
                    .detail(
                        "the deadline left no time to reach the payment provider; nothing was \
                         charged by this request: retry with the same idempotency-key and a \
                         longer deadline",
                    );
                match intent {
                    Some(intent) => problem.with("intent_id", intent.intent_id.as_str()),
                    None => problem,
                }
            }
            ChargeOutcome::PspUnavailable {
                intent,
                retry_after,
            } => Problem::new(StatusCode::SERVICE_UNAVAILABLE, PSP_UNAVAILABLE)
                .detail(
                    "the payment provider charged nothing and cannot be reached now; retry with \
                     the same idempotency-key after the pushback",
                )
                .with("intent_id", intent.intent_id.as_str())
                .retry_after(retry_after),
        };
        ChargeAnswer::Refused(problem)
    }
}

impl Lookup {
    /// The payment, or the problem to answer instead.
    pub(crate) fn answer(self) -> Result<Intent, Problem> {
        match self {
            Lookup::Found(intent) => Ok(*intent),
            Lookup::NotFound => Err(Problem::new(StatusCode::NOT_FOUND, PAYMENT_NOT_FOUND)
                .detail("no payment with this id for this merchant")),
            Lookup::StoreUnavailable => {
                Err(store_unavailable("the payment store did not answer; retry"))
            }
        }
    }
}

/// 503 `store_unavailable` with `detail`, retryable after [`STORE_RETRY_AFTER`].
pub(crate) fn store_unavailable(detail: &str) -> Problem {
    Problem::new(StatusCode::SERVICE_UNAVAILABLE, STORE_UNAVAILABLE)
        .detail(detail)
        .retry_after(STORE_RETRY_AFTER)
}
