//! [`ChargePhases`]: a keyed charge's atomic phases ([`Phases`]) as the payment logic uses
//! them, whichever store the server runs on.
//!
//! A charge is two durable commits: the claim committed with the intent (phase
//! [`INTENT_CREATED`], its recovery point naming the intent), and the intent's outcome
//! committed with the stored answer. The handlers see a type-erased [`Charging`] so that they
//! need not be generic over the store.

use std::sync::Arc;

use backstop::idempotency::{RecoveryPoint, StoreError};
use backstop::server::idempotency::Phases;
use futures_util::future::BoxFuture;

use super::store::PaymentBackend;
use crate::intents::{Created, Intents, IntentsError, NewIntent, PaymentWrites};

/// The recovery point of a charge whose intent is written: its data is the intent id. A run
/// that takes the key over from here charges that intent again under its effect key (the PSP
/// deduplicates on it), instead of creating another.
pub(crate) const INTENT_CREATED: &str = "intent_created";

/// The phases of one keyed charge, object-safe.
pub(crate) trait ChargePhases: Send + Sync {
    /// The last phase an earlier run of this key committed, if this run took it over.
    fn recovery_point(&self) -> Option<&RecoveryPoint>;

    /// Creates the intent and records [`INTENT_CREATED`] in the claim's transaction.
    fn create_intent(
        &self,
        new: NewIntent,
    ) -> BoxFuture<'_, Result<Result<Created, IntentsError>, StoreError>>;

    /// Writes to commit with the record's end (the intent's outcome, with the stored answer).
    fn on_finish(&self, writes: PaymentWrites<()>);
}

impl<St: PaymentBackend> ChargePhases for Phases<St> {
    fn recovery_point(&self) -> Option<&RecoveryPoint> {
        Phases::recovery_point(self)
    }

    fn create_intent(
        &self,
        new: NewIntent,
    ) -> BoxFuture<'_, Result<Result<Created, IntentsError>, StoreError>> {
        let id = new.intent_id.clone();
        let writes = St::writes(Intents::create_writes(new));
        Box::pin(self.commit(INTENT_CREATED, id, writes))
    }

    fn on_finish(&self, writes: PaymentWrites<()>) {
        Phases::on_finish(self, St::writes(writes));
    }
}

/// Request extension: the claim's phases, type-erased (see [`erase`]).
#[derive(Clone)]
pub(crate) struct Charging(pub(crate) Arc<dyn ChargePhases>);

impl std::fmt::Debug for Charging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Charging").finish_non_exhaustive()
    }
}

/// Adds [`Charging`] to a request the idempotency layer claimed (it carries [`Phases<St>`]).
pub(crate) fn erase<St: PaymentBackend, B>(mut request: http::Request<B>) -> http::Request<B> {
    if let Some(phases) = request.extensions().get::<Phases<St>>().cloned() {
        request.extensions_mut().insert(Charging(Arc::new(phases)));
    }
    request
}
