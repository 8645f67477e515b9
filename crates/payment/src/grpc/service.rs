//! [`PaymentService`]: the generated trait over the shared payment logic.

use backstop::deadline::Deadline;
use backstop::idempotency::{Fingerprint, IdempotencyKey};
use backstop::policy::DEFAULT_TIMEOUT;
use backstop::server::tenant::Tenant;
use tonic::{Request, Response, Status};

use super::proto::payment_server::Payment;
use super::proto::{ChargeRequest, ChargeResponse, GetChargeRequest};
use crate::intents::Intent;
use crate::service::answer::ChargeAnswer;
use crate::service::payments::{self, Claimed};
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
        let Some(fingerprint) = request.extensions().get::<Fingerprint>().copied() else {
            return Err(Status::invalid_argument(
                "Charge requires the idempotency-key metadata",
            ));
        };
        let claimed = Claimed {
            key,
            fingerprint,
            phases: request.extensions().get::<Charging>().cloned(),
        };
        let trace = trace::incoming(request.metadata().as_ref());
        let message = request.into_inner();
        let req = request::from_fields(message.order_id, message.amount_cents, message.currency)
            .map_err(|e| Status::invalid_argument(format!("{}: {e}", e.code())))?;
        match payments::charge(&self.state, tenant.as_str(), deadline, &claimed, trace, req)
            .await
            .answer()
        {
            ChargeAnswer::Charged(intent) | ChargeAnswer::Declined(intent, _) => {
                Ok(Response::new(response(&intent)))
            }
            ChargeAnswer::Refused(problem) => Err(problem.into()),
        }
    }

    async fn get_charge(
        &self,
        request: Request<GetChargeRequest>,
    ) -> Result<Response<ChargeResponse>, Status> {
        let (tenant, deadline, _) = context(&request);
        let intent_id = request.into_inner().intent_id;
        payments::lookup(&self.state, tenant.as_str(), deadline, &intent_id)
            .await
            .answer()
            .map(|intent| Response::new(response(&intent)))
            .map_err(tonic::Status::from)
    }
}
