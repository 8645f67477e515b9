//! SQLite backend (feature `sqlite`, default): [`SqliteStore`] on the group-commit handle
//! [`Db`] of [`db::sqlite`](crate::db::sqlite).
//!
//! SQLite is the embedded default: one file, no server. It runs in WAL mode with
//! `synchronous=FULL` by default, because an idempotency record lost in a power cut lets a
//! retry run the side effect a second time. FULL costs one fsync per COMMIT; [`Db`] makes that
//! affordable by group commit: concurrent claims and completions (and the application's own
//! writes, when it shares the `Db`) are batched into one transaction by a single writer thread,
//! each caller answered once its row is durable.
//!
//! The table:
//!
//! ```sql
#![doc = include_str!("migration_v1.sql")]
//! ```
//!
//! ```
//! use std::time::Duration;
//! use backstop::db::sqlite::SqliteOptions;
//! use backstop::idempotency::sqlite::SqliteStore;
//! use backstop::idempotency::{Claim, ClaimRequest, Fingerprint, IdempotencyKey, Store};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("backstop.db"), SqliteOptions::default()).await?;
//! // The application keeps its own tables in the same database and writer.
//! store.db().migrate("app_v1", "CREATE TABLE app_event (id INTEGER PRIMARY KEY)").await?;
//! let req = ClaimRequest {
//!     scope: "merchant-1".into(),
//!     key: IdempotencyKey::generate(),
//!     fingerprint: Fingerprint::of_json("POST /v1/payments", br#"{"amount_cents":100}"#)?,
//!     lease: Duration::from_secs(5),
//!     ttl: Duration::from_secs(7 * 24 * 3600),
//!     now_ms: 1_700_000_000_000,
//! };
//! assert!(matches!(store.claim(req).await?, Claim::Claimed(_)));
//! # Ok(())
//! # }
//! ```

use std::path::Path;

use bytes::Bytes;
use rusqlite::types::ValueRef;
use rusqlite::{OptionalExtension, Row, params};

use super::store::duration_ms;
use super::store::{Ending, PriorRun, RecoveryPoint, Resume};
use super::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Lease, Record, RecordStatus, Store,
    StoreError, StoredResponse,
};
use crate::db::sqlite::{Db, SqliteOptions};

/// Name under which [`MIGRATION`] is recorded by [`Db::migrate`].
pub const MIGRATION_NAME: &str = "backstop_idempotency_key_v1";

/// The `idempotency_key` table and its expiry index.
pub const MIGRATION: &str = include_str!("migration_v1.sql");

/// Name under which [`MIGRATION_V2`] is recorded.
pub const MIGRATION_V2_NAME: &str = "backstop_idempotency_key_v2_phases";

/// The recovery point of a record: the last phase its handler committed and what it recorded.
pub const MIGRATION_V2: &str = "ALTER TABLE idempotency_key ADD COLUMN phase TEXT; \
ALTER TABLE idempotency_key ADD COLUMN phase_data BLOB;";

/// The writes a phase commits with a [`SqliteStore`] record: a closure run on the writer's
/// connection inside the record's transaction (after the lease was checked). An error rolls
/// back the whole phase. It must not run `BEGIN`/`COMMIT`/`ROLLBACK` (savepoints are fine).
pub type SqliteWrites<T> = Box<dyn FnOnce(&rusqlite::Connection) -> rusqlite::Result<T> + Send>;

/// Stores the response, if the lease (fencing token `?3`) still holds the record.
const COMPLETE_SQL: &str = "UPDATE idempotency_key SET status = 'succeeded', http_status = ?4, \
     response_body = ?5, response_headers = ?6, expires_at = MAX(expires_at, ?7) \
     WHERE scope = ?1 AND key = ?2 AND status = 'running' AND lease_until = ?3";

/// Marks the record failed, if the lease still holds it.
const FAIL_SQL: &str = "UPDATE idempotency_key SET status = 'failed', \
     expires_at = MAX(expires_at, ?4) \
     WHERE scope = ?1 AND key = ?2 AND status = 'running' AND lease_until = ?3";

/// Forgets the key, if the lease still holds the record.
const RELEASE_SQL: &str = "DELETE FROM idempotency_key \
     WHERE scope = ?1 AND key = ?2 AND status = 'running' AND lease_until = ?3";

/// Why a phase job rolled back, carried out of the writer as a `rusqlite` user error.
#[derive(Debug, thiserror::Error)]
enum PhaseAbort {
    #[error("the lease no longer holds the record")]
    LeaseLost,
    #[error("the phase's writes failed")]
    Writes(#[source] rusqlite::Error),
}

impl PhaseAbort {
    fn into_sqlite(self) -> rusqlite::Error {
        rusqlite::Error::ToSqlConversionFailure(Box::new(self))
    }

    /// The store error of a phase job's failure.
    fn store_error(error: crate::db::sqlite::Error, lease: &Lease, phase: &str) -> StoreError {
        if let crate::db::sqlite::Error::Sqlite(rusqlite::Error::ToSqlConversionFailure(inner)) =
            &error
        {
            match inner.downcast_ref::<PhaseAbort>() {
                Some(PhaseAbort::LeaseLost) => return StoreError::lease_lost(lease),
                Some(PhaseAbort::Writes(_)) => {
                    return StoreError::PhaseWrites {
                        phase: phase.to_owned(),
                        source: Box::new(error),
                    };
                }
                None => {}
            }
        }
        StoreError::Sqlite(error)
    }
}

/// The [`Store`] on SQLite: claims, completions, failures, releases and sweeps go through the
/// group-commit writer of a [`Db`]; `get` reads on the read pool.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    db: Db,
}

impl SqliteStore {
    /// Opens (or creates) the database at `path` and applies the migration.
    pub async fn open(
        path: impl AsRef<Path>,
        options: SqliteOptions,
    ) -> Result<SqliteStore, StoreError> {
        SqliteStore::new(Db::open(path, options)?).await
    }

    /// A store on an existing [`Db`] (shared with the application); applies the migration.
    pub async fn new(db: Db) -> Result<SqliteStore, StoreError> {
        db.migrate(MIGRATION_NAME, MIGRATION).await?;
        db.migrate(MIGRATION_V2_NAME, MIGRATION_V2).await?;
        Ok(SqliteStore { db })
    }

    /// The database handle, to put the application's own tables in the same writer.
    pub fn db(&self) -> &Db {
        &self.db
    }
}

/// What the claim job found, decided inside the write transaction.
enum Found {
    Claimed(i64),
    TakenOver {
        lease_until: i64,
        created_at: i64,
        prior: PriorRun,
        point: Option<RecoveryPoint>,
    },
    Conflict(String),
    Replay(Row6),
    InProgress(i64),
    BadStatus,
}

/// `http_status, response_body, response_headers` of a succeeded record.
struct Row6 {
    status: Option<i64>,
    body: Option<Vec<u8>>,
    headers: Option<String>,
}

fn bytes_column(row: &Row<'_>, idx: usize) -> rusqlite::Result<Option<Vec<u8>>> {
    Ok(match row.get_ref(idx)? {
        ValueRef::Null => None,
        ValueRef::Blob(b) | ValueRef::Text(b) => Some(b.to_vec()),
        ValueRef::Integer(_) | ValueRef::Real(_) => {
            return Err(rusqlite::Error::InvalidColumnType(
                idx,
                "response_body".into(),
                row.get_ref(idx)?.data_type(),
            ));
        }
    })
}

fn corrupt(scope: &str, key: &str, what: &'static str) -> StoreError {
    StoreError::Corrupt {
        scope: scope.to_owned(),
        key: key.to_owned(),
        what,
    }
}

fn response_from(scope: &str, key: &str, raw: Row6) -> Result<StoredResponse, StoreError> {
    let status = raw
        .status
        .and_then(|s| u16::try_from(s).ok())
        .ok_or_else(|| corrupt(scope, key, "http_status"))?;
    let headers = match raw.headers {
        None => Vec::new(),
        Some(json) => {
            serde_json::from_str(&json).map_err(|_| corrupt(scope, key, "response_headers"))?
        }
    };
    Ok(StoredResponse {
        status,
        headers,
        body: Bytes::from(raw.body.unwrap_or_default()),
    })
}

fn headers_json(headers: &[(String, String)]) -> String {
    // Serializing strings to JSON cannot fail.
    serde_json::to_string(headers).unwrap_or_else(|_| "[]".to_owned())
}

/// The recovery point in `phase, phase_data` columns starting at `at`.
fn point_columns(row: &Row<'_>, at: usize) -> rusqlite::Result<Option<RecoveryPoint>> {
    let phase: Option<String> = row.get(at)?;
    Ok(match phase {
        Some(phase) => Some(RecoveryPoint {
            phase,
            data: Bytes::from(bytes_column(row, at + 1)?.unwrap_or_default()),
        }),
        None => None,
    })
}

impl SqliteStore {
    async fn claim_with(&self, req: ClaimRequest, deferred: bool) -> Result<Claim, StoreError> {
        let scope = req.scope.clone();
        let key = req.key.as_str().to_owned();
        let fp = req.fingerprint.to_hex();
        let now = req.now_ms;
        let lease_until = req.lease_until_ms();
        let expires_at = req.expires_at_ms();
        // At most one statement changes the row (the INSERT, or else the takeover UPDATE), so
        // the job needs no savepoint; so do the other jobs here, each one statement.
        let job = move |conn: &rusqlite::Connection| {
            let inserted = conn
                .prepare_cached(
                    "INSERT INTO idempotency_key \
                         (scope, key, fingerprint, status, lease_until, created_at, expires_at) \
                         VALUES (?1, ?2, ?3, 'running', ?4, ?5, ?6) \
                         ON CONFLICT (scope, key) DO NOTHING",
                )?
                .execute(params![scope, key, fp, lease_until, now, expires_at])?;
            if inserted == 1 {
                return Ok(Found::Claimed(lease_until));
            }
            let (fp0, status, lease0, row) = conn
                .prepare_cached(
                    "SELECT fingerprint, status, lease_until, http_status, response_body, \
                         response_headers FROM idempotency_key WHERE scope = ?1 AND key = ?2",
                )?
                .query_row(params![scope, key], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, i64>(2)?,
                        Row6 {
                            status: r.get(3)?,
                            body: bytes_column(r, 4)?,
                            headers: r.get(5)?,
                        },
                    ))
                })?;
            if fp0 != fp {
                return Ok(Found::Conflict(fp0));
            }
            let prior = match RecordStatus::parse(&status) {
                None => return Ok(Found::BadStatus),
                Some(RecordStatus::Succeeded) => return Ok(Found::Replay(row)),
                Some(RecordStatus::Running) if lease0 > now => {
                    return Ok(Found::InProgress(lease0));
                }
                Some(RecordStatus::Running) => PriorRun::Abandoned,
                Some(RecordStatus::Failed) => PriorRun::Failed,
            };
            // Failed, or the lease ended: one conditional UPDATE decides the takeover. The
            // new lease_until is the fencing token, so it must move strictly forward.
            let taken = conn
                .prepare_cached(
                    "UPDATE idempotency_key SET status = 'running', \
                         lease_until = MAX(?3, lease_until + 1), \
                         expires_at = MAX(expires_at, ?5), \
                         http_status = NULL, response_body = NULL, response_headers = NULL \
                         WHERE scope = ?1 AND key = ?2 AND fingerprint = ?6 \
                         AND (status = 'failed' OR (status = 'running' AND lease_until <= ?4)) \
                         RETURNING lease_until, created_at, phase, phase_data",
                )?
                .query_row(params![scope, key, lease_until, now, expires_at, fp], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        point_columns(r, 2)?,
                    ))
                })
                .optional()?;
            Ok(match taken {
                Some((lease_until, created_at, point)) => Found::TakenOver {
                    lease_until,
                    created_at,
                    prior,
                    point,
                },
                None => Found::InProgress(lease_until),
            })
        };
        let found = if deferred {
            self.db.write_statement_deferred(job).await?
        } else {
            self.db.write_statement(job).await?
        };
        let scope = &req.scope;
        let key = req.key.as_str();
        Ok(match found {
            Found::Claimed(l) => Claim::Claimed(req.lease_at(l)),
            Found::TakenOver {
                lease_until,
                created_at,
                prior,
                point,
            } => Claim::Claimed(Lease {
                created_at_ms: created_at,
                resume: Some(Resume { prior, point }),
                ..req.lease_at(lease_until)
            }),
            Found::InProgress(l) => Claim::in_progress(l, now),
            Found::Conflict(fp0) => Claim::Conflict {
                fingerprint_prefix: Fingerprint::from_hex(&fp0)
                    .map_err(|_| corrupt(scope, key, "fingerprint"))?
                    .prefix8(),
            },
            Found::Replay(row) => Claim::Replay(response_from(scope, key, row)?),
            Found::BadStatus => return Err(corrupt(scope, key, "status")),
        })
    }
}

impl Store for SqliteStore {
    type Writes<T: Send + 'static> = SqliteWrites<T>;

    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        self.claim_with(req, false).await
    }

    async fn claim_deferred(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        self.claim_with(req, true).await
    }

    async fn commit_phase<T: Send + 'static>(
        &self,
        lease: &Lease,
        point: RecoveryPoint,
        writes: SqliteWrites<T>,
    ) -> Result<T, StoreError> {
        let (scope, key, token) = (
            lease.scope.clone(),
            lease.key.to_string(),
            lease.lease_until_ms,
        );
        let phase = point.phase.clone();
        self.db
            .write(move |conn| {
                let marked = conn
                    .prepare_cached(
                        "UPDATE idempotency_key SET phase = ?4, phase_data = ?5 \
                         WHERE scope = ?1 AND key = ?2 AND status = 'running' AND lease_until = ?3",
                    )?
                    .execute(params![scope, key, token, point.phase, &point.data[..]])?;
                if marked != 1 {
                    return Err(PhaseAbort::LeaseLost.into_sqlite());
                }
                writes(conn).map_err(|e| PhaseAbort::Writes(e).into_sqlite())
            })
            .await
            .map_err(|e| PhaseAbort::store_error(e, lease, &phase))
    }

    async fn finish(
        &self,
        lease: &Lease,
        ending: Ending,
        now_ms: i64,
        writes: SqliteWrites<()>,
    ) -> Result<(), StoreError> {
        let (scope, key, token) = (
            lease.scope.clone(),
            lease.key.to_string(),
            lease.lease_until_ms,
        );
        let keep_until = now_ms.saturating_add(duration_ms(lease.ttl));
        self.db
            .write(move |conn| {
                let ended = match &ending {
                    Ending::Complete(response) => {
                        conn.prepare_cached(COMPLETE_SQL)?.execute(params![
                            scope,
                            key,
                            token,
                            response.status,
                            &response.body[..],
                            headers_json(&response.headers),
                            keep_until
                        ])?
                    }
                    Ending::Fail => conn
                        .prepare_cached(FAIL_SQL)?
                        .execute(params![scope, key, token, keep_until])?,
                    Ending::Release => conn
                        .prepare_cached(RELEASE_SQL)?
                        .execute(params![scope, key, token])?,
                };
                if ended != 1 {
                    return Err(PhaseAbort::LeaseLost.into_sqlite());
                }
                writes(conn).map_err(|e| PhaseAbort::Writes(e).into_sqlite())
            })
            .await
            .map_err(|e| PhaseAbort::store_error(e, lease, "finish"))
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: StoredResponse,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let (scope, key, token) = (
            lease.scope.clone(),
            lease.key.to_string(),
            lease.lease_until_ms,
        );
        let keep_until = now_ms.saturating_add(duration_ms(lease.ttl));
        let headers = headers_json(&response.headers);
        let updated = self
            .db
            .write_statement(move |conn| {
                conn.prepare_cached(COMPLETE_SQL)?.execute(params![
                    scope,
                    key,
                    token,
                    response.status,
                    &response.body[..],
                    headers,
                    keep_until
                ])
            })
            .await?;
        if updated == 1 {
            Ok(())
        } else {
            Err(StoreError::lease_lost(lease))
        }
    }

    async fn fail(&self, lease: &Lease, now_ms: i64) -> Result<(), StoreError> {
        let (scope, key, token) = (
            lease.scope.clone(),
            lease.key.to_string(),
            lease.lease_until_ms,
        );
        let keep_until = now_ms.saturating_add(duration_ms(lease.ttl));
        let updated = self
            .db
            .write_statement(move |conn| {
                conn.prepare_cached(FAIL_SQL)?
                    .execute(params![scope, key, token, keep_until])
            })
            .await?;
        if updated == 1 {
            Ok(())
        } else {
            Err(StoreError::lease_lost(lease))
        }
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let (scope, key, token) = (
            lease.scope.clone(),
            lease.key.to_string(),
            lease.lease_until_ms,
        );
        let deleted = self
            .db
            .write_statement(move |conn| {
                conn.prepare_cached(RELEASE_SQL)?
                    .execute(params![scope, key, token])
            })
            .await?;
        if deleted == 1 {
            Ok(())
        } else {
            Err(StoreError::lease_lost(lease))
        }
    }

    async fn get(&self, scope: &str, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let (s, k) = (scope.to_owned(), key.as_str().to_owned());
        let row = self
            .db
            .read(move |conn| {
                conn.prepare_cached(
                    "SELECT fingerprint, status, lease_until, http_status, response_body, \
                     response_headers, created_at, expires_at, phase, phase_data \
                     FROM idempotency_key WHERE scope = ?1 AND key = ?2",
                )?
                .query_row(params![s, k], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, i64>(2)?,
                        Row6 {
                            status: r.get(3)?,
                            body: bytes_column(r, 4)?,
                            headers: r.get(5)?,
                        },
                        r.get::<_, i64>(6)?,
                        r.get::<_, i64>(7)?,
                        point_columns(r, 8)?,
                    ))
                })
                .optional()
            })
            .await?;
        let Some((fp, status, lease_until_ms, raw, created_at_ms, expires_at_ms, point)) = row
        else {
            return Ok(None);
        };
        let k = key.as_str();
        let status = RecordStatus::parse(&status).ok_or_else(|| corrupt(scope, k, "status"))?;
        let response = if status == RecordStatus::Succeeded {
            Some(response_from(scope, k, raw)?)
        } else {
            None
        };
        Ok(Some(Record {
            scope: scope.to_owned(),
            key: key.clone(),
            fingerprint: Fingerprint::from_hex(&fp)
                .map_err(|_| corrupt(scope, k, "fingerprint"))?,
            status,
            lease_until_ms,
            response,
            created_at_ms,
            expires_at_ms,
            point,
        }))
    }

    async fn sweep(&self, now_ms: i64, limit: usize) -> Result<usize, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let deleted = self
            .db
            .write_statement(move |conn| {
                conn.prepare_cached(
                    "DELETE FROM idempotency_key WHERE rowid IN ( \
                     SELECT rowid FROM idempotency_key WHERE expires_at <= ?1 \
                     AND NOT (status = 'running' AND lease_until > ?1) LIMIT ?2)",
                )?
                .execute(params![now_ms, limit])
            })
            .await?;
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::conformance::WithGuard;

    async fn store() -> WithGuard<SqliteStore, tempfile::TempDir> {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())
            .await
            .expect("open store");
        WithGuard(store, dir)
    }

    /// Claims and completions from concurrent callers share the writer's transactions.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_claims_are_group_committed() {
        let guard = store().await;
        let store = guard.0.clone();
        let (unblock, blocked) = std::sync::mpsc::channel::<()>();
        let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
        let blocker = store.db().clone();
        let blocker = tokio::spawn(async move {
            blocker
                .write(move |_| {
                    let _ = started_tx.send(());
                    blocked.recv().ok();
                    Ok(())
                })
                .await
        });
        started.await.unwrap();
        let before = store.db().stats();
        let claims: Vec<_> = (0..32)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    let req = ClaimRequest {
                        scope: "s".into(),
                        key: IdempotencyKey::new(format!("k{i}")).unwrap(),
                        fingerprint: Fingerprint::of_bytes("M", b""),
                        lease: std::time::Duration::from_secs(5),
                        ttl: std::time::Duration::from_secs(60),
                        now_ms: 1_000,
                    };
                    store.claim(req).await
                })
            })
            .collect();
        while store.db().queued_jobs() < 32 {
            tokio::task::yield_now().await;
        }
        unblock.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        for c in claims {
            assert!(matches!(c.await.unwrap().unwrap(), Claim::Claimed(_)));
        }
        let after = store.db().stats();
        assert_eq!(after.jobs - before.jobs, 33);
        assert_eq!(after.transactions - before.transactions, 2);
    }

    #[tokio::test]
    async fn records_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("idem.db");
        let req = ClaimRequest {
            scope: "s".into(),
            key: IdempotencyKey::new("k").unwrap(),
            fingerprint: Fingerprint::of_bytes("M", b"x"),
            lease: std::time::Duration::from_secs(5),
            ttl: std::time::Duration::from_secs(60),
            now_ms: 1_000,
        };
        let response = StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::from_static(b"{\"ok\":true}"),
        };
        {
            let store = SqliteStore::open(&path, SqliteOptions::default())
                .await
                .unwrap();
            let Claim::Claimed(lease) = store.claim(req.clone()).await.unwrap() else {
                panic!("not claimed")
            };
            store
                .complete(&lease, response.clone(), 1_100)
                .await
                .unwrap();
        }
        let store = SqliteStore::open(&path, SqliteOptions::default())
            .await
            .unwrap();
        assert_eq!(
            store
                .claim(ClaimRequest {
                    now_ms: 2_000,
                    ..req
                })
                .await
                .unwrap(),
            Claim::Replay(response)
        );
    }

    #[tokio::test]
    async fn corrupt_rows_are_typed_errors() {
        let guard = store().await;
        let store = guard.0.clone();
        store
            .db()
            .write(|c| {
                c.execute(
                    "INSERT INTO idempotency_key (scope, key, fingerprint, status, lease_until, \
                     http_status, created_at, expires_at) \
                     VALUES ('s', 'k', 'not-hex', 'succeeded', 0, 99999, 0, 9999999999999)",
                    [],
                )
            })
            .await
            .unwrap();
        let err = store
            .get("s", &IdempotencyKey::new("k").unwrap())
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn table_matches_the_seed_schema() {
        let guard = store().await;
        let cols: Vec<String> = guard
            .0
            .db()
            .read(|c| {
                let mut stmt =
                    c.prepare("SELECT name FROM pragma_table_info('idempotency_key')")?;
                let rows = stmt.query_map([], |r| r.get(0))?;
                rows.collect()
            })
            .await
            .unwrap();
        assert_eq!(
            cols,
            [
                "scope",
                "key",
                "fingerprint",
                "status",
                "lease_until",
                "http_status",
                "response_body",
                "response_headers",
                "created_at",
                "expires_at",
                "phase",
                "phase_data",
            ]
        );
    }
}
