//! [`MemoryStore`]: the dedup table in process memory (tests, single-process development).

use std::borrow::Borrow;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::Future;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::protocol::{self, ClaimRule};
use super::store::duration_ms;
use super::store::{BoxError, Ending, PriorRun, RecoveryPoint, Resume};
use super::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Lease, Record, RecordStatus, Store,
    StoreError, StoredResponse,
};

/// The writes a phase commits with a [`MemoryStore`] record: a closure run under the record's
/// lock, only while the lease holds it. An error writes nothing of the phase (the closure must
/// not have changed anything before failing).
pub type MemoryWrites<T> = Box<dyn FnOnce() -> Result<T, BoxError> + Send>;

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

type Map = HashMap<Id, Slot, BuildHasherDefault<Precomputed>>;

/// Where a record is kept: its scope and key, owned once, by the map, and their hash.
///
/// The hash is computed once per operation, with the store's random keys: it picks the shard,
/// then the map's bucket (the map's hasher passes it through), so neither hashes the strings
/// again, not even when the map grows.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Id {
    hash: u64,
    scope: String,
    key: IdempotencyKey,
}

/// A record's id as borrowed strings and their hash: what a lookup needs, copying neither.
#[derive(Clone, Copy)]
struct Lookup<'a> {
    hash: u64,
    scope: &'a str,
    key: &'a str,
}

/// An [`Id`] or a [`Lookup`], so that the map of [`Id`]s can be searched by a [`Lookup`].
/// Both hash as their precomputed hash and compare by scope and key, as `Borrow` requires.
trait IdRef {
    fn hash(&self) -> u64;
    fn parts(&self) -> (&str, &str);
}

impl IdRef for Id {
    fn hash(&self) -> u64 {
        self.hash
    }

    fn parts(&self) -> (&str, &str) {
        (&self.scope, self.key.as_str())
    }
}

impl IdRef for Lookup<'_> {
    fn hash(&self) -> u64 {
        self.hash
    }

    fn parts(&self) -> (&str, &str) {
        (self.scope, self.key)
    }
}

impl<'a> Borrow<dyn IdRef + 'a> for Id {
    fn borrow(&self) -> &(dyn IdRef + 'a) {
        self
    }
}

impl Hash for Id {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl Hash for dyn IdRef + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(IdRef::hash(self));
    }
}

impl PartialEq for dyn IdRef + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn IdRef + '_ {}

/// The map's hasher: passes an [`Id`]'s precomputed hash through.
#[derive(Debug, Default)]
struct Precomputed(u64);

impl Hasher for Precomputed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }

    // Ids hash with `write_u64` alone; anything else is still mixed in rather than dropped.
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x100_0000_01b3);
        }
    }
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
    point: Option<RecoveryPoint>,
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
            point: self.point.clone(),
        }
    }

    fn is_sweepable(&self, now_ms: i64) -> bool {
        protocol::sweepable(self.status, self.lease_until_ms, self.expires_at_ms, now_ms)
    }
}

#[derive(Debug)]
struct Shards {
    /// Hashes a `(scope, key)` once: the hash picks its shard and its bucket.
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

    /// The locked shard that holds `(scope, key)`, and the record's lookup in it.
    fn locate<'a>(&self, scope: &'a str, key: &'a str) -> (MutexGuard<'_, Map>, Lookup<'a>) {
        let hash = self.shards.hasher.hash_one((scope, key));
        // Bits 32 to 37 pick the shard: a map picks a bucket by the low bits and tags it with
        // the top seven, which must still vary among the records of one shard.
        let index = usize::try_from((hash >> 32) % SHARDS as u64).unwrap_or(0);
        (lock(&self.shards.maps[index]), Lookup { hash, scope, key })
    }

    fn claim_now(&self, req: ClaimRequest) -> Claim {
        let (mut records, lookup) = self.locate(&req.scope, req.key.as_str());
        let hash = lookup.hash;
        let lease_until = req.lease_until_ms();
        let expires_at = req.expires_at_ms();
        let lease = |id: &Id, lease_until_ms, created_at_ms, resume| Lease {
            scope: id.scope.clone(),
            key: id.key.clone(),
            lease_until_ms,
            ttl: req.ttl,
            created_at_ms,
            resume,
        };
        // The request's own strings become the record's id: a fresh claim copies them only
        // into its lease.
        let entry = records.entry(Id {
            hash,
            scope: req.scope,
            key: req.key,
        });
        let mut occupied = match entry {
            Entry::Vacant(vacant) => {
                let lease = lease(vacant.key(), lease_until, req.now_ms, None);
                vacant.insert(Slot {
                    fingerprint: req.fingerprint,
                    status: RecordStatus::Running,
                    lease_until_ms: lease_until,
                    response: None,
                    created_at_ms: req.now_ms,
                    expires_at_ms: expires_at,
                    point: None,
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
                let resume = Resume {
                    prior: match rec.status {
                        RecordStatus::Failed => PriorRun::Failed,
                        _ => PriorRun::Abandoned,
                    },
                    point: rec.point.clone(),
                };
                let lease = lease(
                    occupied.key(),
                    lease_until_ms,
                    rec.created_at_ms,
                    Some(resume),
                );
                let rec = occupied.get_mut();
                rec.status = RecordStatus::Running;
                rec.lease_until_ms = lease_until_ms;
                rec.response = None;
                rec.expires_at_ms = rec.expires_at_ms.max(expires_at);
                Claim::Claimed(lease)
            }
        }
    }

    /// Ends the record as `ending` says if `lease` holds it, running `writes` first under the
    /// same lock (nothing changes if they fail).
    fn end(
        &self,
        lease: &Lease,
        ending: Ending,
        now_ms: i64,
        writes: Option<MemoryWrites<()>>,
    ) -> Result<(), StoreError> {
        let (mut records, lookup) = self.locate(&lease.scope, lease.key.as_str());
        let Some(rec) = records
            .get_mut(&lookup as &dyn IdRef)
            .filter(|rec| protocol::holds(rec.status, rec.lease_until_ms, lease.lease_until_ms))
        else {
            return Err(StoreError::lease_lost(lease));
        };
        if let Some(writes) = writes {
            writes().map_err(|source| StoreError::PhaseWrites {
                phase: "finish".to_owned(),
                source,
            })?;
        }
        let (status, response) = match ending {
            Ending::Complete(response) => (RecordStatus::Succeeded, Some(response)),
            Ending::Fail => (RecordStatus::Failed, None),
            Ending::Release => {
                records.remove(&lookup as &dyn IdRef);
                return Ok(());
            }
        };
        rec.status = status;
        rec.response = response;
        rec.expires_at_ms = rec
            .expires_at_ms
            .max(now_ms.saturating_add(duration_ms(lease.ttl)));
        Ok(())
    }

    fn commit_phase_now<T>(
        &self,
        lease: &Lease,
        point: RecoveryPoint,
        writes: MemoryWrites<T>,
    ) -> Result<T, StoreError> {
        let (mut records, lookup) = self.locate(&lease.scope, lease.key.as_str());
        match records.get_mut(&lookup as &dyn IdRef) {
            Some(rec) if protocol::holds(rec.status, rec.lease_until_ms, lease.lease_until_ms) => {
                let out = writes().map_err(|source| StoreError::PhaseWrites {
                    phase: point.phase.clone(),
                    source,
                })?;
                rec.point = Some(point);
                Ok(out)
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
    type Writes<T: Send + 'static> = MemoryWrites<T>;

    fn commit_phase<T: Send + 'static>(
        &self,
        lease: &Lease,
        point: RecoveryPoint,
        writes: MemoryWrites<T>,
    ) -> impl Future<Output = Result<T, StoreError>> + Send {
        std::future::ready(self.commit_phase_now(lease, point, writes))
    }

    fn finish(
        &self,
        lease: &Lease,
        ending: Ending,
        now_ms: i64,
        writes: MemoryWrites<()>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.end(lease, ending, now_ms, Some(writes)))
    }
    fn claim(&self, req: ClaimRequest) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        std::future::ready(Ok(self.claim_now(req)))
    }

    fn complete(
        &self,
        lease: &Lease,
        response: StoredResponse,
        now_ms: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.end(lease, Ending::Complete(response), now_ms, None))
    }

    fn fail(
        &self,
        lease: &Lease,
        now_ms: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.end(lease, Ending::Fail, now_ms, None))
    }

    fn release(&self, lease: &Lease) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(self.end(lease, Ending::Release, 0, None))
    }

    fn get(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        let (records, lookup) = self.locate(scope, key.as_str());
        let record = records
            .get_key_value(&lookup as &dyn IdRef)
            .map(|(id, slot)| slot.record(id));
        drop(records);
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

    fn lookup_in<'a>(store: &MemoryStore, scope: &'a str, key: &'a str) -> Lookup<'a> {
        let (records, lookup) = store.locate(scope, key);
        drop(records);
        lookup
    }

    /// The map is searched by a borrowed lookup: it must hash and compare exactly as the
    /// owned id it finds, or a lookup would miss its record.
    #[test]
    fn a_lookup_hashes_and_compares_as_the_id_it_finds() {
        let store = MemoryStore::new();
        let hasher = BuildHasherDefault::<Precomputed>::default();
        for (scope, key) in [
            ("s", "k"),
            ("", "k"),
            ("sk", "x"),
            ("s", "kx"),
            ("a\u{ff}", "b"),
        ] {
            let lookup = lookup_in(&store, scope, key);
            let owned = Id {
                hash: lookup.hash,
                scope: scope.to_owned(),
                key: IdempotencyKey::new(key).unwrap(),
            };
            let owned_ref: &dyn IdRef = owned.borrow();
            let lookup_ref: &dyn IdRef = &lookup;
            assert_eq!(hasher.hash_one(&owned), hasher.hash_one(lookup_ref));
            assert_eq!(hasher.hash_one(&owned), hasher.hash_one(owned_ref));
            assert!(owned_ref == lookup_ref);
        }
        // The same bytes split otherwise are another record.
        let a = lookup_in(&store, "sk", "x");
        let b = lookup_in(&store, "s", "kx");
        assert_ne!(a.hash, b.hash);
        assert!(&a as &dyn IdRef != &Lookup { hash: a.hash, ..b } as &dyn IdRef);
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
