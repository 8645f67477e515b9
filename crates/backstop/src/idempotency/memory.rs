//! [`MemoryStore`]: the dedup table in process memory (tests, single-process development).

use std::borrow::Borrow;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::Future;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::protocol::{self, ClaimRule};
use super::store::duration_ms;
use super::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Lease, Record, RecordStatus, Store,
    StoreError, StoredResponse,
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

type Map = HashMap<Id, Slot>;

/// Where a record is kept: its scope and key, owned once, by the map.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Id {
    scope: String,
    key: IdempotencyKey,
}

/// A `(scope, key)` to look a record up by, owned ([`Id`]) or borrowed (`(&str, &str)`), so
/// that a lookup needs no copy of either string. Hashes and compares as [`Id`] does (its
/// derived `Hash` feeds the scope, then the key, each as a `str`), as `Borrow` requires.
trait IdRef {
    fn parts(&self) -> (&str, &str);
}

impl IdRef for Id {
    fn parts(&self) -> (&str, &str) {
        (&self.scope, self.key.as_str())
    }
}

impl IdRef for (&str, &str) {
    fn parts(&self) -> (&str, &str) {
        *self
    }
}

impl<'a> Borrow<dyn IdRef + 'a> for Id {
    fn borrow(&self) -> &(dyn IdRef + 'a) {
        self
    }
}

impl Hash for dyn IdRef + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let (scope, key) = self.parts();
        scope.hash(state);
        key.hash(state);
    }
}

impl PartialEq for dyn IdRef + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn IdRef + '_ {}

/// The borrowed id of `key` in `scope`.
fn id<'a>(scope: &'a str, key: &'a str) -> (&'a str, &'a str) {
    (scope, key)
}

/// A record's columns but its scope and key, which its [`Id`] holds.
#[derive(Debug, Clone)]
struct Slot {
    fingerprint: Fingerprint,
    status: RecordStatus,
    lease_until_ms: i64,
    response: Option<StoredResponse>,
    created_at_ms: i64,
    expires_at_ms: i64,
}

impl Slot {
    fn record(&self, id: &Id) -> Record {
        Record {
            scope: id.scope.clone(),
            key: id.key.clone(),
            fingerprint: self.fingerprint,
            status: self.status,
            lease_until_ms: self.lease_until_ms,
            response: self.response.clone(),
            created_at_ms: self.created_at_ms,
            expires_at_ms: self.expires_at_ms,
        }
    }

    fn is_sweepable(&self, now_ms: i64) -> bool {
        protocol::sweepable(self.status, self.lease_until_ms, self.expires_at_ms, now_ms)
    }
}

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

    fn claim_now(&self, req: ClaimRequest) -> Claim {
        let mut records = self.shard(&req.scope, req.key.as_str());
        let lease_until = req.lease_until_ms();
        let expires_at = req.expires_at_ms();
        let lease = |id: &Id, lease_until_ms| Lease {
            scope: id.scope.clone(),
            key: id.key.clone(),
            lease_until_ms,
            ttl: req.ttl,
        };
        // The request's own strings become the record's id: a fresh claim copies them only
        // into its lease.
        let entry = records.entry(Id {
            scope: req.scope,
            key: req.key,
        });
        let mut occupied = match entry {
            Entry::Vacant(vacant) => {
                let lease = lease(vacant.key(), lease_until);
                vacant.insert(Slot {
                    fingerprint: req.fingerprint,
                    status: RecordStatus::Running,
                    lease_until_ms: lease_until,
                    response: None,
                    created_at_ms: req.now_ms,
                    expires_at_ms: expires_at,
                });
                return Claim::Claimed(lease);
            }
            Entry::Occupied(occupied) => occupied,
        };
        let rec = occupied.get();
        let existing = protocol::Existing {
            status: rec.status,
            lease_until_ms: rec.lease_until_ms,
            same_fingerprint: rec.fingerprint == req.fingerprint,
        };
        match protocol::claim(Some(existing), req.now_ms, lease_until) {
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
                let lease = lease(occupied.key(), lease_until_ms);
                let rec = occupied.get_mut();
                rec.status = RecordStatus::Running;
                rec.lease_until_ms = lease_until_ms;
                rec.response = None;
                rec.expires_at_ms = rec.expires_at_ms.max(expires_at);
                Claim::Claimed(lease)
            }
        }
    }

    fn finish(
        &self,
        lease: &Lease,
        status: RecordStatus,
        response: Option<StoredResponse>,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let (scope, key) = (lease.scope.as_str(), lease.key.as_str());
        let mut records = self.shard(scope, key);
        match records.get_mut(&id(scope, key) as &dyn IdRef) {
            Some(rec) if protocol::holds(rec.status, rec.lease_until_ms, lease.lease_until_ms) => {
                rec.status = status;
                rec.response = response;
                rec.expires_at_ms = rec
                    .expires_at_ms
                    .max(now_ms.saturating_add(duration_ms(lease.ttl)));
                Ok(())
            }
            _ => Err(StoreError::lease_lost(lease)),
        }
    }

    fn release_now(&self, lease: &Lease) -> Result<(), StoreError> {
        let (scope, key) = (lease.scope.as_str(), lease.key.as_str());
        let id = id(scope, key);
        let mut records = self.shard(scope, key);
        match records.get(&id as &dyn IdRef) {
            Some(rec) if protocol::holds(rec.status, rec.lease_until_ms, lease.lease_until_ms) => {
                records.remove(&id as &dyn IdRef);
                Ok(())
            }
            _ => Err(StoreError::lease_lost(lease)),
        }
    }
}

fn lock(map: &Mutex<Map>) -> MutexGuard<'_, Map> {
    // No operation leaves a record half-written, so a poisoned map is still consistent.
    map.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Store for MemoryStore {
    fn claim(&self, req: ClaimRequest) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        std::future::ready(Ok(self.claim_now(req)))
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
        std::future::ready(self.release_now(lease))
    }

    fn get(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        let record = self
            .shard(scope, key.as_str())
            .get_key_value(&id(scope, key.as_str()) as &dyn IdRef)
            .map(|(id, slot)| slot.record(id));
        std::future::ready(Ok(record))
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
            let doomed: Vec<Id> = records
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

    /// The map is searched by the borrowed `(scope, key)`: it must hash and compare exactly
    /// as the owned id it finds, or a lookup would miss its record.
    #[test]
    fn a_borrowed_id_hashes_and_compares_as_the_owned_one() {
        let hasher = RandomState::new();
        for (scope, key) in [
            ("s", "k"),
            ("", "k"),
            ("sk", "x"),
            ("s", "kx"),
            ("a\u{ff}", "b"),
        ] {
            let owned = Id {
                scope: scope.to_owned(),
                key: IdempotencyKey::new(key).unwrap(),
            };
            let borrowed = id(scope, key);
            let owned_ref: &dyn IdRef = owned.borrow();
            assert_eq!(
                hasher.hash_one(&owned),
                hasher.hash_one(&borrowed as &dyn IdRef)
            );
            assert_eq!(hasher.hash_one(&owned), hasher.hash_one(owned_ref));
            assert!(owned_ref == &borrowed as &dyn IdRef);
        }
        let owned = Id {
            scope: "sk".to_owned(),
            key: IdempotencyKey::new("x").unwrap(),
        };
        let owned_ref: &dyn IdRef = owned.borrow();
        assert!(owned_ref != &id("s", "kx") as &dyn IdRef);
    }

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
