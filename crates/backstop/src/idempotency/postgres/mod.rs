//! PostgreSQL backend (feature `postgres`): [`PostgresStore`], shared by every instance of a
//! service.
//!
//! The table is the SQLite store's, column for column (`BYTEA` for the body, `BIGINT` for unix
//! milliseconds), created by a versioned [`migrate`] that several instances may run at once:
//!
//! ```sql
#![doc = include_str!("migration_v1.sql")]
//! ```
//!
//! Every decision is one statement, correct under READ COMMITTED with any number of instances:
//!
//! - **claim** is one `INSERT ... ON CONFLICT (scope, key) DO UPDATE ... WHERE <takeover>`:
//!   the insert, or the takeover of a `failed` record or an ended lease with the same
//!   fingerprint. PostgreSQL locks the conflicting row and re-checks the `WHERE` on its latest
//!   version, so of N concurrent takeovers (any pools, any instances) exactly one wins; the same
//!   statement returns the record as it stood when nothing was taken. There is no
//!   check-then-insert anywhere.
//! - **complete / fail / release** are one `UPDATE` / `DELETE` fenced by `lease_until`.
//! - **sweep** deletes rows picked with `FOR UPDATE SKIP LOCKED` and re-checks the condition on
//!   the row it deletes: sweepers on several instances split the work, never wait on each other,
//!   and never delete a running record whose lease is live.
//!
//! A call runs at once, in autocommit, while a pool connection is free. Calls that find every
//! connection busy are batched, the way the SQLite store group-commits: one round trip and one
//! transaction (one WAL flush) for many callers, each answered after its row committed. The
//! batching writer is [`db::postgres`](crate::db::postgres)'s (its rules are in
//! `db/postgres/writer.rs`); how the store's calls are grouped into statements is in `batch.rs`,
//! and the statements themselves in `sql.rs`.
//!
//! Phases carry the handler's own writes ([`PostgresWrites`]), code no statement batch can
//! hold: a deferred claim, a [phase](Store::commit_phase) and a [finish](Store::finish) each
//! run as a unit of work in a transaction shared with other requests' units, inside a
//! savepoint of its own (`db/postgres/shared.rs`): the fenced record update and the handler's
//! writes commit together, or roll back together and alone, and the phases of many requests
//! share one COMMIT and one WAL flush. A deferred claim asks for no flush of its own: the
//! request's first phase flushes it.
//!
//! A claim waits to *start* (for a pool connection, for a place in a batch) no longer than the
//! request's [`Deadline`] allows when one is set ([`Deadline::scope`]; the server's
//! idempotency layer sets it): when that passes first the claim is
//! [`StoreError::DeadlineExceeded`] and nothing was sent. Once a statement is sent, its answer
//! is awaited (until the request's deadline, and at least [`PostgresOptions::timeout`]; never
//! cut short because the deadline is about to pass), so the caller always learns
//! whether its claim was taken and can release it; cutting a statement at the request's
//! deadline would leave a committed claim nobody knows of. Outcomes (complete, fail, release)
//! finish the request's record, so the request's deadline does not bound them at all.
//! PostgreSQL down or slow is a [`StoreError::Postgres`] whose
//! [`db::postgres::Error`](crate::db::postgres::Error) says which
//! ([`is_unavailable`](crate::db::postgres::Error::is_unavailable)); the server answers it with
//! 503 + `Retry-After`, and the pool reconnects by itself when the database comes back.
//!
//! ```no_run
//! use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
//! # async fn run() -> Result<(), backstop::idempotency::StoreError> {
//! let store = PostgresStore::connect(
//!     "postgres://postgres@127.0.0.1:5432/app",
//!     PostgresOptions::default(),
//! )
//! .await?;
//! # let _ = store;
//! # Ok(())
//! # }
//! ```
//!
//! Connections are plain TCP (`NoTls`): run the database on a trusted network or a local
//! socket.

mod batch;
mod sql;

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{Object, Pool};
use futures_util::future::BoxFuture;
use tokio::time::Instant;

use self::batch::{ClaimRow, Op, Outcome};
use self::sql::{GET_SQL, PHASE_SQL, SWEEP_SQL};
use super::store::{Ending, PriorRun, RecoveryPoint, Resume, duration_ms};
use super::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Lease, Record, RecordStatus, Store,
    StoreError, StoredResponse,
};
use crate::db::postgres::{
    self as db, SharedTransactions, StartBy, Writer, WriterStats, migrate, tokio_postgres,
};
use crate::deadline::Deadline;

/// Name under which [`MIGRATION`] is recorded by [`migrate`].
pub const MIGRATION_NAME: &str = "backstop_idempotency_key_v1";

/// The `idempotency_key` table (with each record's recovery point: the last phase its handler
/// committed and what it recorded) and its expiry index.
pub const MIGRATION: &str = include_str!("migration_v1.sql");

/// The writes a phase commits with a [`PostgresStore`] record: a closure given the pooled
/// connection inside the record's transaction (after the lease was checked). An error rolls
/// back the whole phase. It must not run `BEGIN`/`COMMIT`/`ROLLBACK` (savepoints are fine).
pub type PostgresWrites<T> =
    Box<dyn for<'c> FnOnce(&'c Object) -> BoxFuture<'c, Result<T, tokio_postgres::Error>> + Send>;

/// How many times a claim runs again when the record changed under it (released, swept, or
/// freed between its statement's snapshot and its row lock). Each retry needs another writer to
/// have changed the row in between.
const CLAIM_ATTEMPTS: usize = 8;

/// Time kept between a store operation giving up and the request's deadline.
const DEADLINE_MARGIN: Duration = Duration::from_millis(20);

/// Options of [`PostgresStore`] (`max_connections` and `timeout` also shape the pool it opens,
/// see [`db::pool`]).
#[derive(Debug, Clone)]
pub struct PostgresOptions {
    /// Most connections open at once (default 20; 0 counts as 1).
    pub max_connections: usize,
    /// Writer tasks running queued calls, each with one batch in flight (default 4; at most
    /// `max_connections`). A call runs at once on a free connection when nothing is queued;
    /// calls queue only while every connection is busy, and a writer that gets a connection
    /// takes everything queued as one batch. Fewer writers make bigger batches (less work for
    /// the database per call); more let batches overlap.
    pub writers: usize,
    /// Most statements per batch (default 256; 0 counts as 1).
    pub max_batch: usize,
    /// Batch concurrent calls into one transaction (default `true`). With `false` every call is
    /// its own autocommit statement (the baseline).
    pub group_commit: bool,
    /// Longest an operation waits for a connection and for the database (default 2 s). Under a
    /// request's [`Deadline`] the earlier of the two ends the wait.
    pub timeout: Duration,
}

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions {
            max_connections: 20,
            writers: 4,
            max_batch: 256,
            group_commit: true,
            timeout: Duration::from_secs(2),
        }
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        db::Error::from(e).into()
    }
}

/// The [`Store`] on PostgreSQL; see the [module docs](self). Clones share the pool and writers.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    writer: Writer<Op>,
    /// Claims deferred to the first phase, phases and finishes: the caller's writes with ours.
    shared: SharedTransactions,
    timeout: Duration,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("pool", &self.pool.status())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host:port/db?options=...`), applies the migration
    /// and starts the writers (on the current tokio runtime).
    pub async fn connect(url: &str, options: PostgresOptions) -> Result<PostgresStore, StoreError> {
        let config = url
            .parse::<tokio_postgres::Config>()
            .map_err(db::Error::Url)?;
        PostgresStore::connect_with(config, options).await
    }

    /// [`PostgresStore::connect`] with a parsed configuration.
    pub async fn connect_with(
        config: tokio_postgres::Config,
        options: PostgresOptions,
    ) -> Result<PostgresStore, StoreError> {
        let pool = db::pool(config, options.max_connections, options.timeout)?;
        PostgresStore::new(pool, options).await
    }

    /// A store on an existing pool (shared with the application's own tables); applies the
    /// migration and starts the writers.
    pub async fn new(pool: Pool, options: PostgresOptions) -> Result<PostgresStore, StoreError> {
        migrate(&pool, MIGRATION_NAME, MIGRATION).await?;
        let max_batch = if options.group_commit {
            options.max_batch
        } else {
            1
        };
        let writers = options.writers.min(options.max_connections).max(1);
        Ok(PostgresStore {
            writer: Writer::start(pool.clone(), writers, max_batch, options.timeout),
            shared: SharedTransactions::start(pool.clone(), writers, max_batch, options.timeout),
            pool,
            timeout: options.timeout,
        })
    }

    /// The connection pool, for the application's own queries.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The longest any one operation of the store may take ([`PostgresOptions::timeout`]).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How many statements the writers ran, in how many round trips.
    pub fn writer_stats(&self) -> WriterStats {
        self.writer.stats()
    }

    /// How many units of work (deferred claims, phases and finishes, each with the handler's
    /// writes) ran, in how many shared transactions: `jobs / batches` is the mean number of
    /// requests one COMMIT made durable.
    pub fn phase_stats(&self) -> WriterStats {
        self.shared.stats()
    }

    /// When the current operation gives up: shortly before the request's deadline, or after
    /// the store's timeout, whichever comes first.
    pub fn operation_deadline(&self) -> Instant {
        self.start_by().until
    }

    /// [`operation_deadline`](Self::operation_deadline), and whether the request's deadline
    /// or the store's timeout sets it.
    fn start_by(&self) -> StartBy {
        let now = Instant::now();
        let fallback = now + self.timeout;
        // Give up a little before the request's deadline, so the caller still has time to
        // answer rather than be cut at the deadline itself.
        match Deadline::current().map(|d| d.child(DEADLINE_MARGIN).map_or(now, |d| d.instant())) {
            Some(until) if until < fallback => StartBy {
                until,
                by_request: true,
            },
            _ => StartBy {
                until: fallback,
                by_request: false,
            },
        }
    }

    /// Runs `query` on a pooled connection, all of it bounded by [`operation_deadline`]. A
    /// connection that timed out mid-query is discarded.
    ///
    /// [`operation_deadline`]: PostgresStore::operation_deadline
    pub async fn with_client<T>(
        &self,
        query: impl for<'c> FnOnce(&'c Object) -> BoxFuture<'c, Result<T, tokio_postgres::Error>>,
    ) -> Result<T, db::Error> {
        db::with_client(&self.pool, self.operation_deadline(), query).await
    }

    /// Whether the database answers a trivial query (for readiness checks).
    pub async fn ping(&self) -> Result<(), db::Error> {
        self.with_client(|c| Box::pin(async move { c.simple_query("SELECT 1").await }))
            .await
            .map(|_| ())
    }

    /// Runs an outcome statement. It finishes a request's record, so the request's deadline
    /// never cuts it short (a `fail` or `release` given up at the deadline would leave the key
    /// held until its lease ends): it may take until that deadline, and at least the store's
    /// timeout.
    async fn changed(&self, op: Op) -> Result<u64, StoreError> {
        match self.writer.run(op, self.finish_by()).await? {
            Outcome::Changed(n) => Ok(n),
            Outcome::Claim(_) => Ok(0),
        }
    }
}

fn corrupt(scope: &str, key: &str, what: &'static str) -> StoreError {
    StoreError::Corrupt {
        scope: scope.to_owned(),
        key: key.to_owned(),
        what,
    }
}

fn response_from(
    scope: &str,
    key: &str,
    status: Option<i32>,
    body: Option<Vec<u8>>,
    headers: Option<String>,
) -> Result<StoredResponse, StoreError> {
    let status = status
        .and_then(|s| u16::try_from(s).ok())
        .ok_or_else(|| corrupt(scope, key, "http_status"))?;
    let headers = match headers {
        None => Vec::new(),
        Some(json) => {
            serde_json::from_str(&json).map_err(|_| corrupt(scope, key, "response_headers"))?
        }
    };
    Ok(StoredResponse {
        status,
        headers,
        body: Bytes::from(body.unwrap_or_default()),
    })
}

/// Reads what the claim statement found: `None` when the claim must run again.
fn decide(
    req: &ClaimRequest,
    fingerprint: &str,
    row: ClaimRow,
) -> Result<Option<Claim>, StoreError> {
    let (scope, key) = (req.scope.as_str(), req.key.as_str());
    let lease_until = row.lease_until;
    if row.taken {
        let lease_until = lease_until.ok_or_else(|| corrupt(scope, key, "lease_until"))?;
        let lease = req.lease_at(lease_until);
        // A taken row's status is the record's before the takeover: none for a fresh insert.
        let prior = match row.status.as_deref().map(RecordStatus::parse) {
            None => return Ok(Some(Claim::Claimed(lease))),
            Some(Some(RecordStatus::Failed)) => PriorRun::Failed,
            Some(Some(RecordStatus::Running)) => PriorRun::Abandoned,
            Some(_) => return Err(corrupt(scope, key, "status")),
        };
        return Ok(Some(Claim::Claimed(Lease {
            created_at_ms: row
                .created_at
                .ok_or_else(|| corrupt(scope, key, "created_at"))?,
            resume: Some(Resume {
                prior,
                point: point_of(row.phase, row.phase_data),
            }),
            ..lease
        })));
    }
    // The record vanished between the conflict and the read (released or swept): claim again.
    let Some(stored) = row.fingerprint else {
        return Ok(None);
    };
    if stored != fingerprint {
        return Ok(Some(Claim::Conflict {
            fingerprint_prefix: Fingerprint::from_hex(&stored)
                .map_err(|_| corrupt(scope, key, "fingerprint"))?
                .prefix8(),
        }));
    }
    let lease_until = lease_until.ok_or_else(|| corrupt(scope, key, "lease_until"))?;
    let status = row.status.as_deref().and_then(RecordStatus::parse);
    match status {
        None => Err(corrupt(scope, key, "status")),
        Some(RecordStatus::Succeeded) => Ok(Some(Claim::Replay(response_from(
            scope,
            key,
            row.http_status,
            row.body,
            row.headers,
        )?))),
        Some(RecordStatus::Running) if lease_until > req.now_ms => {
            Ok(Some(Claim::in_progress(lease_until, req.now_ms)))
        }
        // Free again, but after the takeover statement looked: claim again.
        Some(RecordStatus::Running | RecordStatus::Failed) => Ok(None),
    }
}

fn point_of(phase: Option<String>, data: Option<Vec<u8>>) -> Option<RecoveryPoint> {
    phase.map(|phase| RecoveryPoint {
        phase,
        data: Bytes::from(data.unwrap_or_default()),
    })
}

/// Why a phase transaction rolled back.
enum Abort {
    LeaseLost,
    Writes(tokio_postgres::Error),
    Store(tokio_postgres::Error),
}

impl PostgresStore {
    /// Runs `body` in a transaction shared with other units of work (group commit, see
    /// [`SharedTransactions`]), inside a savepoint of its own: its writes commit with the
    /// batch, or roll back alone when it fails. The lease check and the caller's writes of a
    /// phase thus commit together, and many requests' phases share one WAL flush.
    async fn transaction<T: Send + 'static>(
        &self,
        start: StartBy,
        durable: bool,
        body: impl for<'c> FnOnce(&'c Object) -> BoxFuture<'c, Result<T, Abort>> + Send + 'static,
    ) -> Result<Result<T, Abort>, StoreError> {
        Ok(self.shared.run(start, durable, body).await?)
    }

    /// By when a write that ends or advances a request's record must start: it may take until
    /// the request's deadline, and at least the store's timeout (given up at the deadline, it
    /// would leave the key held until its lease ends).
    fn finish_by(&self) -> StartBy {
        let at_least = Instant::now() + self.timeout;
        StartBy {
            until: Deadline::current().map_or(at_least, |d| d.instant().max(at_least)),
            by_request: false,
        }
    }
}

/// The claim statement of `req`, whose fingerprint is `fingerprint` in hex.
fn claim_op(req: &ClaimRequest, fingerprint: &str) -> Op {
    Op::Claim {
        scope: req.scope.clone(),
        key: req.key.as_str().to_owned(),
        fingerprint: fingerprint.to_owned(),
        lease_until: req.lease_until_ms(),
        now: req.now_ms,
        expires_at: req.expires_at_ms(),
    }
}

fn abort_error(abort: Abort, lease: &Lease, phase: &str) -> StoreError {
    match abort {
        Abort::LeaseLost => StoreError::lease_lost(lease),
        Abort::Writes(source) => StoreError::PhaseWrites {
            phase: phase.to_owned(),
            source: Box::new(source),
        },
        Abort::Store(e) => StoreError::from(db::Error::from(e)),
    }
}

fn headers_json(headers: &[(String, String)]) -> String {
    // Serializing strings to JSON cannot fail.
    serde_json::to_string(headers).unwrap_or_else(|_| "[]".to_owned())
}

impl Store for PostgresStore {
    type Writes<T: Send + 'static> = PostgresWrites<T>;

    async fn claim_deferred(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let fingerprint = req.fingerprint.to_hex();
        for _ in 0..CLAIM_ATTEMPTS {
            let op = claim_op(&req, &fingerprint);
            // Committed without waiting for the WAL flush: the handler's first phase, which
            // waits for it, makes the claim durable too.
            let found = self
                .transaction(self.start_by(), false, move |c| {
                    Box::pin(async move {
                        match batch::run_one(c, &op).await.map_err(Abort::Store)? {
                            Outcome::Claim(row) => Ok(row),
                            Outcome::Changed(_) => Ok(ClaimRow::default()),
                        }
                    })
                })
                .await?;
            let row = match found {
                Ok(row) => row,
                Err(Abort::Store(e)) | Err(Abort::Writes(e)) => {
                    return Err(StoreError::from(db::Error::from(e)));
                }
                Err(Abort::LeaseLost) => ClaimRow::default(),
            };
            if let Some(claim) = decide(&req, &fingerprint, row)? {
                return Ok(claim);
            }
        }
        Err(StoreError::Contended {
            scope: req.scope,
            key: req.key,
        })
    }

    async fn commit_phase<T: Send + 'static>(
        &self,
        lease: &Lease,
        point: RecoveryPoint,
        writes: PostgresWrites<T>,
    ) -> Result<T, StoreError> {
        let (scope, key, token) = (
            lease.scope.clone(),
            lease.key.to_string(),
            lease.lease_until_ms,
        );
        let phase = point.phase.clone();
        let outcome = self
            .transaction(self.finish_by(), true, move |c| {
                Box::pin(async move {
                    let stmt = c.prepare_cached(PHASE_SQL).await.map_err(Abort::Store)?;
                    let data: &[u8] = &point.data;
                    let marked = c
                        .execute(&stmt, &[&scope, &key, &token, &point.phase, &data])
                        .await
                        .map_err(Abort::Store)?;
                    if marked != 1 {
                        return Err(Abort::LeaseLost);
                    }
                    writes(c).await.map_err(Abort::Writes)
                })
            })
            .await?;
        outcome.map_err(|abort| abort_error(abort, lease, &phase))
    }

    async fn finish(
        &self,
        lease: &Lease,
        ending: Ending,
        now_ms: i64,
        writes: PostgresWrites<()>,
    ) -> Result<(), StoreError> {
        let (scope, key, token) = (
            lease.scope.clone(),
            lease.key.to_string(),
            lease.lease_until_ms,
        );
        let keep_until = now_ms.saturating_add(duration_ms(lease.ttl));
        let op = match ending {
            Ending::Complete(response) => Op::Complete {
                scope,
                key,
                token,
                http_status: i32::from(response.status),
                headers: headers_json(&response.headers),
                body: response.body,
                keep_until,
            },
            Ending::Fail => Op::Fail {
                scope,
                key,
                token,
                keep_until,
            },
            Ending::Release => Op::Release { scope, key, token },
        };
        let outcome = self
            .transaction(self.finish_by(), true, move |c| {
                Box::pin(async move {
                    match batch::run_one(c, &op).await.map_err(Abort::Store)? {
                        Outcome::Changed(1) => {}
                        _ => return Err(Abort::LeaseLost),
                    }
                    writes(c).await.map_err(Abort::Writes)
                })
            })
            .await?;
        outcome.map_err(|abort| abort_error(abort, lease, "finish"))
    }

    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let start = self.start_by();
        let fingerprint = req.fingerprint.to_hex();
        for _ in 0..CLAIM_ATTEMPTS {
            let op = claim_op(&req, &fingerprint);
            let row = match self.writer.run(op, start).await? {
                Outcome::Claim(row) => row,
                Outcome::Changed(_) => ClaimRow::default(),
            };
            if let Some(claim) = decide(&req, &fingerprint, row)? {
                return Ok(claim);
            }
        }
        Err(StoreError::Contended {
            scope: req.scope,
            key: req.key,
        })
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: StoredResponse,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let op = Op::Complete {
            scope: lease.scope.clone(),
            key: lease.key.to_string(),
            token: lease.lease_until_ms,
            http_status: i32::from(response.status),
            headers: headers_json(&response.headers),
            body: response.body,
            keep_until: now_ms.saturating_add(duration_ms(lease.ttl)),
        };
        match self.changed(op).await? {
            1 => Ok(()),
            _ => Err(StoreError::lease_lost(lease)),
        }
    }

    async fn fail(&self, lease: &Lease, now_ms: i64) -> Result<(), StoreError> {
        let op = Op::Fail {
            scope: lease.scope.clone(),
            key: lease.key.to_string(),
            token: lease.lease_until_ms,
            keep_until: now_ms.saturating_add(duration_ms(lease.ttl)),
        };
        match self.changed(op).await? {
            1 => Ok(()),
            _ => Err(StoreError::lease_lost(lease)),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let op = Op::Release {
            scope: lease.scope.clone(),
            key: lease.key.to_string(),
            token: lease.lease_until_ms,
        };
        match self.changed(op).await? {
            1 => Ok(()),
            _ => Err(StoreError::lease_lost(lease)),
        }
    }

    async fn get(&self, scope: &str, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let (s, k) = (scope.to_owned(), key.as_str().to_owned());
        let row = self
            .with_client(move |c| {
                Box::pin(async move {
                    let stmt = c.prepare_cached(GET_SQL).await?;
                    c.query_opt(&stmt, &[&s, &k]).await
                })
            })
            .await?;
        let Some(row) = row else { return Ok(None) };
        let k = key.as_str();
        let status: String = row.try_get(1)?;
        let status = RecordStatus::parse(&status).ok_or_else(|| corrupt(scope, k, "status"))?;
        let response = if status == RecordStatus::Succeeded {
            Some(response_from(
                scope,
                k,
                row.try_get(3)?,
                row.try_get(4)?,
                row.try_get(5)?,
            )?)
        } else {
            None
        };
        let fingerprint: String = row.try_get(0)?;
        Ok(Some(Record {
            scope: scope.to_owned(),
            key: key.clone(),
            fingerprint: Fingerprint::from_hex(&fingerprint)
                .map_err(|_| corrupt(scope, k, "fingerprint"))?,
            status,
            lease_until_ms: row.try_get(2)?,
            response,
            created_at_ms: row.try_get(6)?,
            expires_at_ms: row.try_get(7)?,
            point: point_of(row.try_get(8)?, row.try_get(9)?),
        }))
    }

    async fn sweep(&self, now_ms: i64, limit: usize) -> Result<usize, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let deleted = self
            .with_client(move |c| {
                Box::pin(async move {
                    let stmt = c.prepare_cached(SWEEP_SQL).await?;
                    c.execute(&stmt, &[&now_ms, &limit]).await
                })
            })
            .await?;
        Ok(usize::try_from(deleted).unwrap_or(usize::MAX))
    }
}
