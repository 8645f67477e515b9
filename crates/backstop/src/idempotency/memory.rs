//! [`MemoryStore`]: the dedup table in process memory (tests, single-process development).

use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::protocol::{self, ClaimRule};
use super::store::duration_ms;
use super::{
    Claim, ClaimRequest, IdempotencyKey, Lease, Record, RecordStatus, Store, StoreError,
    StoredResponse,
};

/// The [`Store`] in sharded `Mutex<HashMap>`s: every operation is one short critical section on
/// the shard that holds its key, so the claim's insert-or-inspect-or-take-over is atomic exactly
/// like the SQL version's conditional statements. Nothing survives a restart; bound its size
/// with a `Sweeper`.
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
    shards: Arc<Shards>,
}

/// Records are spread over this many maps, each behind its own lock: a map that grows rehashes
/// every record it holds while its lock is held, and at a few hundred thousand records in one
/// map that stalled every request for tens of milliseconds (most of it the kernel zeroing the
/// new table's pages). Sharded, a rehash moves 1/64 of the records and blocks 1/64 of the keys;
/// a sweep takes one shard's lock at a time.
const SHARDS: usize = 64;

type Map = HashMap<(String, String), Record>;

#[derive(Debug)]
struct Shards {
    /// Picks the shard of a `(scope, key)`.
    hasher: RandomState,
    maps: Box<[Mutex<Map>]>,
}

impl Default for Shards {
    fn default() -> Self {
        Shards {
            hasher: RandomState::new(),
            maps: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// Number of records held (of any state).
    pub fn len(&self) -> usize {
        self.shards.maps.iter().map(|m| lock(m).len()).sum()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.shards.maps.iter().all(|m| lock(m).is_empty())
    }

    /// The locked shard that holds `(scope, key)`.
    fn shard(&self, scope: &str, key: &str) -> MutexGuard<'_, Map> {
        let hash = self.shards.hasher.hash_one((scope, key));
        // The remainder is below SHARDS, so it fits any usize.
        let index = usize::try_from(hash % SHARDS as u64).unwrap_or(0);
        lock(&self.shards.maps[index])
    }

    fn claim_now(&self, req: &ClaimRequest) -> Claim {
        let mut records = self.shard(&req.scope, req.key.as_str());
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
        let existing = protocol::Existing {
            status: rec.status,
            lease_until_ms: rec.lease_until_ms,
            same_fingerprint: rec.fingerprint == req.fingerprint,
        };
        match protocol::claim(Some(existing), req.now_ms, req.lease_until_ms()) {
            ClaimRule::Conflict => Claim::Conflict {
                fingerprint_prefix: rec.fingerprint.prefix8(),
            },
            // Unreachable through this API without a response: a succeeded record has one.
            ClaimRule::Replay => match &rec.response {
                Some(response) => Claim::Replay(response.clone()),
                None => Claim::in_progress(rec.lease_until_ms, req.now_ms),
            },
            ClaimRule::InProgress { lease_until_ms } => {
                Claim::in_progress(lease_until_ms, req.now_ms)
            }
            ClaimRule::TakeOver { lease_until_ms } | ClaimRule::Insert { lease_until_ms } => {
                rec.status = RecordStatus::Running;
                rec.lease_until_ms = lease_until_ms;
                rec.response = None;
                rec.expires_at_ms = rec.expires_at_ms.max(req.expires_at_ms());
                Claim::Claimed(req.lease_at(lease_until_ms))
            }
        }
    }

    /// Runs `f` on the record `lease` holds, or fails with `LeaseLost`.
    fn with_held(
        &self,
        lease: &Lease,
        f: impl FnOnce(&mut Map, (String, String)),
    ) -> Result<(), StoreError> {
        let mut records = self.shard(&lease.scope, lease.key.as_str());
        let id = (lease.scope.clone(), lease.key.as_str().to_owned());
        match records.get(&id) {
            Some(rec) if protocol::holds(rec.status, rec.lease_until_ms, lease.lease_until_ms) => {
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

fn lock(map: &Mutex<Map>) -> MutexGuard<'_, Map> {
    // No operation leaves a record half-written, so a poisoned map is still consistent.
    map.lock().unwrap_or_else(PoisonError::into_inner)
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
        std::future::ready(Ok(self.shard(scope, key.as_str()).get(&id).cloned()))
    }

    fn sweep(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send {
        let mut swept = 0;
        for map in &self.shards.maps {
            if swept == limit {
                break;
            }
            let mut records = lock(map);
            let doomed: Vec<(String, String)> = records
                .iter()
                .filter(|(_, rec)| rec.is_sweepable(now_ms))
                .map(|(id, _)| id.clone())
                .take(limit - swept)
                .collect();
            for id in &doomed {
                records.remove(id);
            }
            swept += doomed.len();
        }
        std::future::ready(Ok(swept))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::idempotency::Fingerprint;

    /// No shard may end up with most of the records: a growing shard rehashes everything it
    /// holds under its lock, which is the stall sharding is there to bound.
    #[tokio::test]
    async fn records_spread_over_the_shards() {
        let store = MemoryStore::new();
        let fingerprint = Fingerprint::of_json("POST /v1/payments", b"{}").unwrap();
        for i in 0..6_400 {
            let req = ClaimRequest {
                scope: format!("merchant-{}", i % 3),
                key: IdempotencyKey::parse(&format!("k-{i}")).unwrap(),
                fingerprint,
                lease: Duration::from_secs(5),
                ttl: Duration::from_secs(60),
                now_ms: 1_000,
            };
            assert!(matches!(store.claim(req).await.unwrap(), Claim::Claimed(_)));
        }
        assert_eq!(store.len(), 6_400);
        let largest = store
            .shards
            .maps
            .iter()
            .map(|m| lock(m).len())
            .max()
            .unwrap();
        // 100 per shard on average; a fair hash stays far below twice that.
        assert!(
            largest < 200,
            "largest shard holds {largest} of 6,400 records"
        );
        // A sweep crosses shards until its limit.
        assert_eq!(store.sweep(1_000 + 61_000, 150).await.unwrap(), 150);
        assert_eq!(store.len(), 6_250);
    }
}
