//! [`PaymentService`]: the generated trait over the shared payment logic.

use backstop::deadline::Deadline;
use backstop::idempotency::IdempotencyKey;
use backstop::policy::DEFAULT_TIMEOUT;
use backstop::server::tenant::Tenant;
use backstop::status::GRPC_RETRY_PUSHBACK_MS;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Request, Response, Status};

use super::STORE_PUSHBACK;
use super::proto::payment_server::Payment;
use super::proto::{ChargeRequest, ChargeResponse, GetChargeRequest};
use crate::intents::Intent;
use crate::service::payments::{self, ChargeOutcome, Lookup};
use crate::service::phases::Charging;
use crate::service::request;
use crate::state::AppState;
use crate::trace;

/// The `payment.v1.Payment` service. Runs below the server stack, which has set the request's
/// [`Deadline`], [`Tenant`] and (on `Charge`) claimed its [`IdempotencyKey`].
#[derive(Debug, Clone)]
pub struct PaymentService {
    state: AppState,
}

impl PaymentService {
    /// The service over the same state as the HTTP handlers.
    pub fn new(state: AppState) -> Self {
        Self { state }
    }
}

/// What the stack put on the request: tenant, deadline (the default budget when the service
/// runs without the stack) and the idempotency key, if claimed.
fn context<T>(request: &Request<T>) -> (Tenant, Deadline, Option<IdempotencyKey>) {
    let extensions = request.extensions();
    let tenant = extensions.get::<Tenant>().cloned().unwrap_or_default();
    let deadline = extensions
        .get::<Deadline>()
        .copied()
        .unwrap_or_else(|| Deadline::after(DEFAULT_TIMEOUT));
    let key = extensions.get::<IdempotencyKey>().cloned();
    (tenant, deadline, key)
}

fn response(intent: &Intent) -> ChargeResponse {
    ChargeResponse {
        charge_id: intent.psp_charge_id.clone().unwrap_or_default(),
        status: intent.status.as_str().to_owned(),
        amount_cents: intent.amount_cents,
        intent_id: intent.intent_id.clone(),
    }
}

fn with_pushback(code: Code, message: String, pushback: std::time::Duration) -> Status {
    let mut metadata = MetadataMap::new();
    let ms = u64::try_from(pushback.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    metadata.insert(GRPC_RETRY_PUSHBACK_MS, MetadataValue::from(ms));
    Status::with_metadata(code, message, metadata)
}

fn store_unavailable(detail: &str) -> Status {
    with_pushback(Code::Unavailable, detail.to_owned(), STORE_PUSHBACK)
}

#[tonic::async_trait]
impl Payment for PaymentService {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeResponse>, Status> {
        let (tenant, deadline, key) = context(&request);
        let Some(key) = key else {
            // Only without the idempotency layer in front: Charge is a keyed method.
            return Err(Status::invalid_argument(
                "Charge requires the idempotency-key metadata",
            ));
        };
        let trace = trace::incoming(request.metadata().as_ref());
        let charging = request.extensions().get::<Charging>().cloned();
        let message = request.into_inner();
        let req = request::from_fields(message.order_id, message.amount_cents, message.currency)
            .map_err(|e| Status::invalid_argument(format!("{}: {e}", e.code())))?;
        match payments::charge(
            &self.state,
            tenant.as_str(),
            deadline,
            &key,
            trace,
            req,
            charging.as_ref().map(|c| &*c.0),
        )
        .await
        {
            ChargeOutcome::Charged(intent) | ChargeOutcome::Declined(intent) => {
                Ok(Response::new(response(&intent)))
            }
            ChargeOutcome::OrderConflict(intent) => Err(Status::already_exists(format!(
                "order {} already has payment {} created with another idempotency-key",
                intent.order_id, intent.intent_id
            ))),
            ChargeOutcome::KeyReused { fingerprint_prefix } => {
                Err(Status::failed_precondition(format!(
                    "this idempotency-key already created a payment with other parameters \
                     (fingerprint_prefix={fingerprint_prefix})"
                )))
            }
            ChargeOutcome::StoreUnavailable(detail) => Err(store_unavailable(detail)),
            ChargeOutcome::PspConflict(intent) => Err(Status::internal(format!(
                "the payment provider holds payment {}'s effect key with other parameters",
                intent.intent_id
            ))),
            ChargeOutcome::Unknown {
                intent,
                detail,
                retry_after,
            } => Err(with_pushback(
                Code::Unavailable,
                format!(
                    "payment outcome unknown (intent_id={}): {detail}; retrying with the same \
                     idempotency-key is safe and charges at most once",
                    intent.intent_id
                ),
                retry_after,
            )),
            ChargeOutcome::DeadlineExceeded { intent } => {
                Err(Status::deadline_exceeded(match intent {
                    Some(intent) => format!(
                        "the deadline left no time to reach the payment provider; nothing was \
                         charged by this call (intent_id={})",
                        intent.intent_id
                    ),
                    None => "the deadline left no time to reach the payment provider; nothing \
                             was written or charged"
                        .to_owned(),
                }))
            }
            ChargeOutcome::PspUnavailable {
                intent,
                retry_after,
            } => Err(with_pushback(
                Code::Unavailable,
                format!(
                    "the payment provider charged nothing and cannot be reached now \
                     (intent_id={}); retry with the same idempotency-key after the pushback",
                    intent.intent_id
                ),
                retry_after,
            )),
        }
    }

    async fn get_charge(
        &self,
        request: Request<GetChargeRequest>,
    ) -> Result<Response<ChargeResponse>, Status> {
        let (tenant, deadline, _) = context(&request);
        let intent_id = request.into_inner().intent_id;
        match payments::lookup(&self.state, tenant.as_str(), deadline, &intent_id).await {
            Lookup::Found(intent) => Ok(Response::new(response(&intent))),
            Lookup::NotFound => Err(Status::not_found(
                "no payment with this id for this merchant",
            )),
            Lookup::StoreUnavailable => {
                Err(store_unavailable("the payment store did not answer; retry"))
            }
        }
    }
}
