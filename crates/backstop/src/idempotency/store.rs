//! The [`Store`] trait: the dedup table and its state machine.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

use super::{Fingerprint, IdempotencyKey};

/// One claim attempt: "I am about to run `key` in `scope` with these parameters".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    /// Namespace of the key (tenant, merchant, method...): keys never collide across scopes.
    pub scope: String,
    /// The client's key for this logical request.
    pub key: IdempotencyKey,
    /// The request's parameters; the same key with another fingerprint is a conflict.
    pub fingerprint: Fingerprint,
    /// How long the claimer may run before another request may take the key over (default 5 s).
    pub lease: Duration,
    /// How long the record (and so the replayable response) is kept (24 h for synchronous APIs,
    /// 7 days for payments).
    pub ttl: Duration,
    /// Wall-clock time of the claim, unix epoch milliseconds (from a `Clock`).
    pub now_ms: i64,
}

impl ClaimRequest {
    /// `now_ms + lease`: the lease end (and fencing token) a fresh claim gets.
    pub fn lease_until_ms(&self) -> i64 {
        self.now_ms.saturating_add(duration_ms(self.lease))
    }

    /// `now_ms + ttl`: when a fresh record expires.
    pub fn expires_at_ms(&self) -> i64 {
        self.now_ms.saturating_add(duration_ms(self.ttl))
    }

    /// The lease a fresh claim by this request holds, ending at `lease_until_ms`.
    pub fn lease_at(&self, lease_until_ms: i64) -> Lease {
        Lease {
            scope: self.scope.clone(),
            key: self.key.clone(),
            lease_until_ms,
            ttl: self.ttl,
            created_at_ms: self.now_ms,
            resume: None,
        }
    }
}

/// The answer to a claim: one of four outcomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key is ours: run the request, then [`Store::complete`], [`Store::fail`] or
    /// [`Store::release`] with this lease.
    Claimed(Lease),
    /// The key already succeeded: answer with the stored response, byte for byte.
    Replay(StoredResponse),
    /// The key was used with other parameters: refuse (409 `idempotency_key_reused`), showing
    /// the first 8 hex digits of the ORIGINAL fingerprint.
    Conflict {
        /// [`Fingerprint::prefix8`] of the fingerprint stored with the key.
        fingerprint_prefix: String,
    },
    /// Another request holds a live lease on the key: retry after `retry_after` (409
    /// `request_in_progress` + Retry-After). Never zero.
    InProgress {
        /// Time until the holder's lease ends (at least 1 ms).
        retry_after: Duration,
    },
}

impl Claim {
    /// `InProgress` for a lease ending at `lease_until_ms`, seen at `now_ms`:
    /// `retry_after = lease_until - now`, at least 1 ms.
    pub fn in_progress(lease_until_ms: i64, now_ms: i64) -> Claim {
        let ms = lease_until_ms.saturating_sub(now_ms).max(1);
        Claim::InProgress {
            retry_after: Duration::from_millis(ms.unsigned_abs()),
        }
    }

    /// Stable label for metrics (`idempotency_claims_total{result}`): `claimed`, `replay`,
    /// `conflict` or `in_progress`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Claim::Claimed(_) => "claimed",
            Claim::Replay(_) => "replay",
            Claim::Conflict { .. } => "conflict",
            Claim::InProgress { .. } => "in_progress",
        }
    }
}

/// Proof of a claim. `lease_until_ms` is the fencing token: [`Store::complete`],
/// [`Store::fail`] and [`Store::release`] succeed only while the record still carries this
/// value, i.e. nobody took the key over since. Every takeover moves it strictly forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Scope of the claimed key.
    pub scope: String,
    /// The claimed key.
    pub key: IdempotencyKey,
    /// When the lease ends, unix epoch milliseconds; also the fencing token.
    pub lease_until_ms: i64,
    /// The claim's TTL: completing or failing keeps the record at least this long from then on.
    pub ttl: Duration,
    /// When the key was first claimed (unix epoch ms): the same for every run of the key while
    /// its record lives, so it tells one use of a key from a later reuse after expiry.
    pub created_at_ms: i64,
    /// Set when this claim took the key over from an earlier run: how that run ended and the
    /// last phase it committed.
    pub resume: Option<Resume>,
}

impl Lease {
    /// A key for the downstream effect of this record: the same for every run of the key
    /// (a takeover resends the same one, so a downstream that deduplicates by it applies the
    /// effect once), different for another scope, another key, or the same key reused after
    /// its record expired. 32 hex digits of SHA-256 over scope, key and first-claim time.
    pub fn effect_key(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        hash.update(self.scope.as_bytes());
        hash.update([0]);
        hash.update(self.key.as_str().as_bytes());
        hash.update([0]);
        hash.update(self.created_at_ms.to_be_bytes());
        let digest = hash.finalize();
        let mut out = String::with_capacity(32);
        for byte in &digest[..16] {
            out.push_str(&format!("{byte:02x}"));
        }
        out
    }
}

/// Where a keyed request's handler got to: the name of the last phase it committed and what
/// that phase recorded (Brandur Leach's "recovery point"). Written with the phase's own writes,
/// in one transaction, by [`Store::commit_phase`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryPoint {
    /// The phase's name, chosen by the handler (`"intent_created"`).
    pub phase: String,
    /// What the phase recorded for a successor to resume from (an id, a small document).
    pub data: Bytes,
}

/// What a claim that took a key over learns about the run before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// How that run ended.
    pub prior: PriorRun,
    /// The last phase it committed, if any: nothing before it needs doing again, and its
    /// effect (if it had one after that phase) may or may not have happened.
    pub point: Option<RecoveryPoint>,
}

/// How the run before a takeover ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PriorRun {
    /// It answered a retryable failure ([`Store::fail`]): it said it may run again.
    Failed,
    /// Its lease ended while it was running: it died or overran, and it may have performed its
    /// effect or not.
    Abandoned,
}

/// How a [`Store::finish`] ends a record, together with the handler's last writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// [`Store::complete`] with this response.
    Complete(StoredResponse),
    /// [`Store::fail`].
    Fail,
    /// [`Store::release`].
    Release,
}
/// A response kept for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// The headers worth replaying, in order (names as sent).
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub body: Bytes,
}

/// The name, in [`StoredResponse::headers`], of the marker of an answer whose body was too
/// large to keep (see [`StoredResponse::withheld`]); its value is the bound, in bytes. No HTTP
/// header can have this name (it holds a colon), so every backend keeps the marker in the
/// header list it already stores, and no replay can send it as a header.
pub const BODY_WITHHELD: &str = "backstop:body-withheld";

impl StoredResponse {
    /// An answer whose body was larger than `limit` bytes, the most its method keeps for
    /// replay: its status and headers, no body, and the [`BODY_WITHHELD`] marker naming the
    /// limit. Replaying it tells the retry that the request was carried out and that its
    /// answer's body cannot be sent again.
    ///
    /// ```
    /// use backstop::idempotency::StoredResponse;
    ///
    /// let kept = StoredResponse::withheld(200, vec![("content-type".into(), "text/csv".into())], 1 << 20);
    /// assert_eq!(kept.body_withheld(), Some(1 << 20));
    /// assert!(kept.body.is_empty());
    /// let whole = StoredResponse { status: 200, headers: vec![], body: "id,n\n".into() };
    /// assert_eq!(whole.body_withheld(), None);
    /// ```
    pub fn withheld(status: u16, mut headers: Vec<(String, String)>, limit: usize) -> Self {
        headers.push((BODY_WITHHELD.to_owned(), limit.to_string()));
        Self {
            status,
            headers,
            body: Bytes::new(),
        }
    }

    /// The limit an answer's body was over when it was stored without it
    /// ([`withheld`](Self::withheld)); `None` for an answer stored whole.
    pub fn body_withheld(&self) -> Option<u64> {
        self.headers
            .iter()
            .find(|(name, _)| name == BODY_WITHHELD)
            .map(|(_, limit)| limit.parse().unwrap_or(0))
    }
}

/// State of a record: running, then succeeded or failed (a failed key may run again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordStatus {
    /// Claimed; someone runs (or ran and crashed, if the lease has ended).
    Running,
    /// Terminal: the response is stored and replayed.
    Succeeded,
    /// The run failed in a retryable way: the same key may run again.
    Failed,
}

impl RecordStatus {
    /// The value stored in the `status` column: `running`, `succeeded`, `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordStatus::Running => "running",
            RecordStatus::Succeeded => "succeeded",
            RecordStatus::Failed => "failed",
        }
    }

    /// Reads a `status` column value.
    pub fn parse(s: &str) -> Option<RecordStatus> {
        match s {
            "running" => Some(RecordStatus::Running),
            "succeeded" => Some(RecordStatus::Succeeded),
            "failed" => Some(RecordStatus::Failed),
            _ => None,
        }
    }
}

/// A dedup record, as [`Store::get`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Scope of the key.
    pub scope: String,
    /// The key.
    pub key: IdempotencyKey,
    /// Fingerprint of the parameters the key was first used with.
    pub fingerprint: Fingerprint,
    /// Where the record is in its state machine.
    pub status: RecordStatus,
    /// End of the current (or last) lease, unix epoch ms.
    pub lease_until_ms: i64,
    /// The stored response (when `Succeeded`).
    pub response: Option<StoredResponse>,
    /// When the key was first claimed, unix epoch ms.
    pub created_at_ms: i64,
    /// When the record may be swept, unix epoch ms.
    pub expires_at_ms: i64,
    /// The last phase the record's handler committed, if any.
    pub point: Option<RecoveryPoint>,
}

impl Record {
    /// Whether `sweep` at `now_ms` may delete this record: expired, and not a running record
    /// whose lease is still live.
    pub fn is_sweepable(&self, now_ms: i64) -> bool {
        super::protocol::sweepable(self.status, self.lease_until_ms, self.expires_at_ms, now_ms)
    }
}

/// Boxed error of a store outside this crate, carried by [`StoreError::Backend`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of a [`Store`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The lease no longer holds the record: it was taken over (its lease had ended), released,
    /// already completed or failed, or swept. Nothing was written.
    #[error("lease on idempotency key {key} in scope {scope} is no longer held")]
    LeaseLost {
        /// Scope of the key.
        scope: String,
        /// The key.
        key: IdempotencyKey,
    },
    /// A stored record could not be read back.
    #[error("stored idempotency record {key:?} in scope {scope} is corrupt: {what}")]
    Corrupt {
        /// Scope of the record.
        scope: String,
        /// Key column as stored.
        key: String,
        /// Which field is wrong.
        what: &'static str,
    },
    /// The request's deadline passed before the operation reached the backend: nothing was
    /// written. The server answers it as the deadline it is (504), not as a store failure.
    #[error("the request's deadline passed before the idempotency store was reached")]
    DeadlineExceeded,
    /// A claim kept finding its record changed by other writers (released, swept or taken
    /// over between its statements), and gave up: nothing is held. Retrying later is safe.
    #[error("idempotency key {key} in scope {scope} kept changing under the claim")]
    Contended {
        /// Scope of the key.
        scope: String,
        /// The key.
        key: IdempotencyKey,
    },
    /// The SQLite store failed.
    #[cfg(feature = "sqlite")]
    #[error("SQLite idempotency store failed")]
    Sqlite(#[from] crate::db::sqlite::Error),
    /// The PostgreSQL store failed: the database was out of reach, slow, or refused a
    /// statement ([`db::postgres::Error`](crate::db::postgres::Error) tells which). A request
    /// deadline that passed before a statement was sent is [`StoreError::DeadlineExceeded`]
    /// instead.
    #[cfg(feature = "postgres")]
    #[error("PostgreSQL idempotency store failed")]
    Postgres(#[source] crate::db::postgres::Error),
    /// A phase's own writes (the application's) failed: nothing of the phase was written.
    #[error("the writes of phase {phase} failed")]
    PhaseWrites {
        /// The phase.
        phase: String,
        /// What failed.
        #[source]
        source: BoxError,
    },
    /// A store implemented outside this crate failed: such a store has no variant of its own,
    /// so it reports its failures through this one (inspect with `source()` and downcast). The
    /// stores of this crate never use it.
    #[error("idempotency store backend failed")]
    Backend(#[source] BoxError),
}

#[cfg(feature = "postgres")]
impl From<crate::db::postgres::Error> for StoreError {
    fn from(e: crate::db::postgres::Error) -> Self {
        match e {
            crate::db::postgres::Error::DeadlineExceeded => StoreError::DeadlineExceeded,
            e => StoreError::Postgres(e),
        }
    }
}

impl StoreError {
    pub(crate) fn lease_lost(lease: &Lease) -> StoreError {
        StoreError::LeaseLost {
            scope: lease.scope.clone(),
            key: lease.key.clone(),
        }
    }
}

/// The dedup table: where claims are decided and responses kept.
///
/// The state machine: `claim` inserts a `running` record (or answers replay / conflict /
/// in-progress); `complete` moves it to `succeeded` (terminal, replayed from then on); `fail`
/// to `failed` (the same key may run again); `release` deletes it (nothing happened: the request
/// was refused before it started). A `failed` record, or a `running` one whose lease has ended
/// (its runner crashed), can be taken over by a claim with the same fingerprint; of concurrent
/// takeovers exactly one wins. `sweep` deletes expired records, never a running record whose
/// lease is live.
///
/// All times are unix epoch milliseconds passed in by the caller, so tests control time.
/// Every backend runs the same conformance suite (`backstop::store_conformance!`).
///
/// # Phases
///
/// A handler's own writes can share the record's transactions ("atomic phases"):
/// [`commit_phase`](Store::commit_phase) commits the writes a handler makes before its effect
/// together with a [`RecoveryPoint`] on the record, and [`finish`](Store::finish) the writes it
/// makes after its effect together with the record's end. Each is fenced by the lease: a run
/// that lost its key writes nothing. The writes come in the backend's own form
/// ([`Store::Writes`]: a closure on the SQLite connection, on the PostgreSQL client, ...).
pub trait Store: Clone + Send + Sync + 'static {
    /// The application's writes a phase commits with the record, in this backend's form,
    /// answering `T`.
    type Writes<T: Send + 'static>: Send + 'static;

    /// Claims `req.key` in `req.scope`; see [`Claim`].
    fn claim(&self, req: ClaimRequest) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// [`claim`](Store::claim), answered once committed but not yet durable: it becomes
    /// durable with the next durable commit, which a handler's first
    /// [`commit_phase`](Store::commit_phase) is. For routes whose handlers commit a phase
    /// before their effect, so a claim and the first phase cost one sync. A crash before that
    /// loses the claim, and nothing depended on it. By default, a durable claim.
    fn claim_deferred(
        &self,
        req: ClaimRequest,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        self.claim(req)
    }

    /// Runs `writes` and records `point` on the record, in one durable transaction, if `lease`
    /// still holds it (else [`StoreError::LeaseLost`] and nothing is written). If `writes`
    /// fail, nothing is written ([`StoreError::PhaseWrites`]).
    fn commit_phase<T: Send + 'static>(
        &self,
        lease: &Lease,
        point: RecoveryPoint,
        writes: Self::Writes<T>,
    ) -> impl Future<Output = Result<T, StoreError>> + Send;

    /// Ends the record as `ending` says ([`complete`](Store::complete), [`fail`](Store::fail)
    /// or [`release`](Store::release)) and runs `writes`, in one durable transaction, if
    /// `lease` still holds it; else nothing is written.
    fn finish(
        &self,
        lease: &Lease,
        ending: Ending,
        now_ms: i64,
        writes: Self::Writes<()>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Stores `response` and marks the record `succeeded`, if `lease` still holds it
    /// (else [`StoreError::LeaseLost`]). The record is then kept at least `lease.ttl` past
    /// `now_ms`.
    fn complete(
        &self,
        lease: &Lease,
        response: StoredResponse,
        now_ms: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Marks the record `failed`, if `lease` still holds it: the same key (with the same
    /// parameters) may run again. Kept at least `lease.ttl` past `now_ms`, so the key still
    /// refuses other parameters meanwhile.
    fn fail(
        &self,
        lease: &Lease,
        now_ms: i64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes the record, if `lease` still holds it: the request was refused before it started
    /// (bad input, deadline, overload), so the key stays unused.
    fn release(&self, lease: &Lease) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The record of `key` in `scope`, if any.
    fn get(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Deletes up to `limit` expired records (`expires_at <= now_ms`), skipping running records
    /// whose lease is live. Returns how many it deleted.
    fn sweep(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// Expires records the cheapest way the backend has: what the [`Sweeper`](super::Sweeper)
    /// calls on its timer. A backend that keeps records in time windows drops each window
    /// whose records may all be swept (and may keep an expired record until its window goes,
    /// at most one window's width past its expiry); `limit` bounds what it deletes record by
    /// record. Returns how many records went. By default, [`sweep`](Store::sweep).
    fn expire(
        &self,
        now_ms: i64,
        limit: usize,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send {
        self.sweep(now_ms, limit)
    }
}

/// A duration in whole milliseconds, saturating at `i64::MAX`.
pub(crate) fn duration_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_progress_is_never_zero() {
        assert_eq!(
            Claim::in_progress(1_000, 1_000),
            Claim::InProgress {
                retry_after: Duration::from_millis(1)
            }
        );
        assert_eq!(
            Claim::in_progress(900, 1_000),
            Claim::InProgress {
                retry_after: Duration::from_millis(1)
            }
        );
        assert_eq!(
            Claim::in_progress(3_500, 1_000),
            Claim::InProgress {
                retry_after: Duration::from_millis(2_500)
            }
        );
    }

    #[test]
    fn huge_durations_saturate() {
        assert_eq!(duration_ms(Duration::MAX), i64::MAX);
        let req = ClaimRequest {
            scope: "s".into(),
            key: IdempotencyKey::new("k").unwrap(),
            fingerprint: Fingerprint::from_bytes([0; 32]),
            lease: Duration::MAX,
            ttl: Duration::MAX,
            now_ms: 10,
        };
        assert_eq!(req.lease_until_ms(), i64::MAX);
        assert_eq!(req.expires_at_ms(), i64::MAX);
    }

    #[test]
    fn status_roundtrips() {
        for s in [
            RecordStatus::Running,
            RecordStatus::Succeeded,
            RecordStatus::Failed,
        ] {
            assert_eq!(RecordStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(RecordStatus::parse("done"), None);
    }
}
