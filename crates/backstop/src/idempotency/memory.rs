//! [`MemoryStore`]: the dedup table in process memory (tests, single-process development).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::store::duration_ms;
use super::{
    Claim, ClaimRequest, IdempotencyKey, Lease, Record, RecordStatus, Store, StoreError,
    StoredResponse,
};

/// The [`Store`] in a `Mutex<HashMap>`: every operation is one short critical section, so the
/// claim's insert-or-inspect-or-take-over is atomic exactly like the SQL version's conditional
/// statements. Nothing survives a restart; bound its size with a `Sweeper`.
///
/// ```
/// use std::time::Duration;
/// use backstop::idempotency::{Claim, ClaimRequest, Fingerprint, IdempotencyKey, MemoryStore, Store, StoredResponse};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let req = ClaimRequest {
///     scope: "merchant-1".into(),
///     key: IdempotencyKey::parse("k-1")?,
///     fingerprint: Fingerprint::of_json("POST /v1/payments", br#"{"amount_cents":100}"#)?,
///     lease: Duration::from_secs(5),
///     ttl: Duration::from_secs(24 * 3600),
///     now_ms: 1_000,
/// };
/// let Claim::Claimed(lease) = store.claim(req.clone()).await? else { unreachable!() };
/// let response = StoredResponse { status: 201, headers: vec![], body: "{\"id\":1}".into() };
/// store.complete(&lease, response.clone(), 1_050).await?;
/// // A retry with the same key and parameters gets the stored response.
/// assert_eq!(store.claim(ClaimRequest { now_ms: 2_000, ..req }).await?, Claim::Replay(response));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    records: Arc<Mutex<HashMap<(String, String), Record>>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// Number of records held (of any state).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<(String, String), Record>> {
        // No operation leaves a record half-written, so a poisoned map is still consistent.
        self.records.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn claim_now(&self, req: &ClaimRequest) -> Claim {
        let mut records = self.lock();
        let id = (req.scope.clone(), req.key.as_str().to_owned());
        let Some(rec) = records.get_mut(&id) else {
            let lease_until = req.lease_until_ms();
            records.insert(
                id,
                Record {
                    scope: req.scope.clone(),
                    key: req.key.clone(),
                    fingerprint: req.fingerprint,
                    status: RecordStatus::Running,
                    lease_until_ms: lease_until,
                    response: None,
                    created_at_ms: req.now_ms,
                    expires_at_ms: req.expires_at_ms(),
                },
            );
            return Claim::Claimed(req.lease_at(lease_until));
        };
        if rec.fingerprint != req.fingerprint {
            return Claim::Conflict {
                fingerprint_prefix: rec.fingerprint.prefix8(),
            };
        }
        match rec.status {
            RecordStatus::Succeeded => {
                if let Some(response) = &rec.response {
                    return Claim::Replay(response.clone());
                }
                // Unreachable through this API: a succeeded record always has its response.
                Claim::in_progress(rec.lease_until_ms, req.now_ms)
            }
            RecordStatus::Running if rec.lease_until_ms > req.now_ms => {
                Claim::in_progress(rec.lease_until_ms, req.now_ms)
            }
            // Failed, or running with an ended lease: take over, moving the fencing token on.
            RecordStatus::Running | RecordStatus::Failed => {
                let lease_until = req
                    .lease_until_ms()
                    .max(rec.lease_until_ms.saturating_add(1));
                rec.status = RecordStatus::Running;
                rec.lease_until_ms = lease_until;
                rec.response = None;
                rec.expires_at_ms = rec.expires_at_ms.max(req.expires_at_ms());
                Claim::Claimed(req.lease_at(lease_until))
            }
        }
    }

    /// Runs `f` on the record `lease` holds, or fails with `LeaseLost`.
    fn with_held(
        &self,
        lease: &Lease,
        f: impl FnOnce(&mut HashMap<(String, String), Record>, (String, String)),
    ) -> Result<(), StoreError> {
        let mut records = self.lock();
        let id = (lease.scope.clone(), lease.key.as_str().to_owned());
        match records.get(&id) {
            Some(rec)
                if rec.status == RecordStatus::Running
                    && rec.lease_until_ms == lease.lease_until_ms =>
            {
                f(&mut records, id);
                Ok(())
            }
            _ => Err(StoreError::lease_lost(lease)),
        }
    }

    fn finish(
        &self,
        lease: &Lease,
        status: RecordStatus,
        response: Option<StoredResponse>,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        self.with_held(lease, |records, id| {
            if let Some(rec) = records.get_mut(&id) {
                rec.status = status;
                rec.response = response;
                rec.expires_at_ms = rec
                    .expires_at_ms
                    .max(now_ms.saturating_add(duration_ms(lease.ttl)));
            }
        })
    }
}

impl Store for MemoryStore {
    fn claim(&self, req: ClaimRequest) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        std::future::ready(Ok(self.claim_now(&req)))
    }

    fn complete(
        &self,
        lease: &Lease,
        response: StoredResponse,
        now_ms: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.finish(lease, RecordStatus::Succeeded, Some(response), now_ms))
    }

    fn fail(
        &self,
        lease: &Lease,
        now_ms: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.finish(lease, RecordStatus::Failed, None, now_ms))
    }

    fn release(&self, lease: &Lease) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.with_held(lease, |records, id| {
            records.remove(&id);
        }))
    }

    fn get(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        let id = (scope.to_owned(), key.as_str().to_owned());
        std::future::ready(Ok(self.lock().get(&id).cloned()))
    }

    fn sweep(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send {
        let mut records = self.lock();
        let doomed: Vec<(String, String)> = records
            .iter()
            .filter(|(_, rec)| rec.is_sweepable(now_ms))
            .map(|(id, _)| id.clone())
            .take(limit)
            .collect();
        for id in &doomed {
            records.remove(id);
        }
        std::future::ready(Ok(doomed.len()))
    }
}
