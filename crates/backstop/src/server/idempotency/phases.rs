//! [`Phases`]: a keyed request's unit of work, bound to its claim.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;

use crate::idempotency::{Lease, RecoveryPoint, Resume, Store, StoreError};

/// A keyed request's unit of work, bound to its claim: the handler's own writes commit in the
/// record's transactions ("atomic phases", with Brandur Leach's "recovery points").
///
/// The [`IdempotencyLayer`](super::IdempotencyLayer) puts one in the request's extensions of
/// every claimed request (axum: `Extension<Phases<St>>`; tonic: `request.extensions()`).
///
/// - [`commit`](Self::commit) runs the writes a handler makes **before** its external effect
///   (create the payment intent, with the effect key the downstream deduplicates on) in one
///   durable transaction with a [`RecoveryPoint`] on the record. On a route whose
///   [`Takeover`](crate::policy::Takeover) is `Resume`, the claim itself is committed without
///   waiting for a sync, and this commit makes both durable: one sync for the two.
/// - [`on_finish`](Self::on_finish) hands the layer the writes the handler makes **after** its
///   effect (mark the intent succeeded); they commit in the transaction that ends the record
///   (stores the answer for replay, or marks it failed or released), so the application's
///   state and the replayable answer can never disagree.
/// - [`resume`](Self::resume) tells a handler that took over a run that never answered (or
///   answered a retryable failure) where that run got to, so it can ask the downstream for
///   the effect by [`effect_key`](Self::effect_key) instead of repeating it.
///
/// A handler that uses none of this keeps working as without it. On a `Resume` route, a
/// handler that answers without having committed a phase did nothing: the layer then releases
/// the key whatever the answer (a refusal leaves no record behind).
///
/// ```
/// use backstop::idempotency::MemoryStore;
/// use backstop::server::idempotency::Phases;
/// # async fn charge(_key: &str) -> Result<String, ()> { Ok("ch_1".into()) }
///
/// async fn handler(phases: Phases<MemoryStore>) -> Result<String, Box<dyn std::error::Error>> {
///     let effect_key = phases.effect_key();
///     let resumed = phases.resume().and_then(|r| r.point.as_ref()).map(|p| p.phase.clone());
///     if resumed.as_deref() != Some("intent_created") {
///         // Phase 1, before the effect: the intent and the recovery point, one transaction.
///         phases
///             .commit("intent_created", effect_key.clone(), Box::new(|| Ok(())))
///             .await?;
///     }
///     // The effect, under a key the downstream deduplicates on: safe to send again.
///     let charge = charge(&effect_key).await.map_err(|()| "declined")?;
///     // Phase 2, after the effect: committed with the stored answer.
///     phases.on_finish(Box::new(|| Ok(())));
///     Ok(charge)
/// }
/// ```
pub struct Phases<St: Store> {
    inner: Arc<Inner<St>>,
}

struct Inner<St: Store> {
    store: St,
    lease: Lease,
    /// Set when a phase commit began: from then on the run may have written, and (past its
    /// phase) performed its effect.
    began: AtomicBool,
    finish: Mutex<Option<St::Writes<()>>>,
}

impl<St: Store> Clone for Phases<St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<St: Store> fmt::Debug for Phases<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Phases")
            .field("lease", &self.inner.lease)
            .field("began", &self.inner.began.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<St: Store> Phases<St> {
    pub(super) fn new(store: St, lease: Lease) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                lease,
                began: AtomicBool::new(false),
                finish: Mutex::new(None),
            }),
        }
    }

    /// The claim this unit of work is bound to.
    pub fn lease(&self) -> &Lease {
        &self.inner.lease
    }

    /// Set when this run took the key over: how the run before ended and the last phase it
    /// committed.
    pub fn resume(&self) -> Option<&Resume> {
        self.inner.lease.resume.as_ref()
    }

    /// The last phase committed by an earlier run of this key, if any.
    pub fn recovery_point(&self) -> Option<&RecoveryPoint> {
        self.resume().and_then(|resume| resume.point.as_ref())
    }

    /// The key for this record's downstream effect, the same for every run of the key
    /// ([`Lease::effect_key`]).
    pub fn effect_key(&self) -> String {
        self.inner.lease.effect_key()
    }

    /// Runs `writes` and records the recovery point `phase`/`data` in one durable transaction,
    /// if this run still holds the key; answers what `writes` answered. On an error nothing of
    /// the phase was written: [`StoreError::LeaseLost`] (another run took the key over: stop),
    /// [`StoreError::PhaseWrites`] (the writes failed), or the store's failure.
    pub async fn commit<T: Send + 'static>(
        &self,
        phase: impl Into<String>,
        data: impl Into<Bytes>,
        writes: St::Writes<T>,
    ) -> Result<T, StoreError> {
        self.inner.began.store(true, Ordering::Release);
        let point = RecoveryPoint {
            phase: phase.into(),
            data: data.into(),
        };
        self.inner
            .store
            .commit_phase(&self.inner.lease, point, writes)
            .await
    }

    /// The writes to commit with the record's end (replacing any given before). They are
    /// dropped unwritten if the record's end does not happen (the key was lost, or the request
    /// was dropped before it answered).
    pub fn on_finish(&self, writes: St::Writes<()>) {
        *self
            .inner
            .finish
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(writes);
    }

    /// Whether a phase commit began in this run.
    pub(super) fn began(&self) -> bool {
        self.inner.began.load(Ordering::Acquire)
    }

    /// The writes given to [`on_finish`](Self::on_finish), taken.
    pub(super) fn take_finish(&self) -> Option<St::Writes<()>> {
        self.inner
            .finish
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

#[cfg(test)]
mod tests;
