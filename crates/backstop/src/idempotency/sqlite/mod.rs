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
//! # Windows
//!
//! Records live in **window tables** (`idempotency_window_{class_ms}_{index}`), one per TTL
//! class and slice of the store's time ([`window`](crate::idempotency::window) says how they
//! are sized and why). A claim inserts into the current window of its TTL's class, so writes
//! touch one small index; it first looks for the key in the other windows, skipping each
//! sealed window whose summary rules the key out. A takeover of a record in an older window
//! moves it into the current one. [`Store::expire`] (what the [`Sweeper`](super::Sweeper)
//! calls) drops a sealed window whose records have all expired with one `DROP TABLE`, instead
//! of deleting them one by one at random places of a large index. Uniqueness across windows
//! needs no lock of its own: the single writer decides every claim in turn.
//!
//! Each window table holds a record per `(scope, key)` with its fingerprint, status, lease
//! (the fencing token), stored answer, expiry and recovery point (the last phase committed),
//! and an index on expiry.
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
//! assert_eq!(store.record_count().await?, 1);
//! # Ok(())
//! # }
//! ```

use std::path::Path;
use std::sync::Arc;

use rusqlite::{OptionalExtension, params};

use super::store::duration_ms;
use super::store::{Ending, Resume};
use super::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Lease, Record, RecordStatus, Store,
    StoreError, StoredResponse,
};
use crate::db::sqlite::{Db, SqliteOptions};

mod catalog;
mod records;
mod upkeep;

use catalog::{Catalog, Tables};
use records::{
    ClaimJob, Found, corrupt, existing_columns, fenced, headers_json, point_columns, response_from,
};

/// The writes a phase commits with a [`SqliteStore`] record: a closure run on the writer's
/// connection inside the record's transaction (after the lease was checked). An error rolls
/// back the whole phase. It must not run `BEGIN`/`COMMIT`/`ROLLBACK` (savepoints are fine).
pub type SqliteWrites<T> = Box<dyn FnOnce(&rusqlite::Connection) -> rusqlite::Result<T> + Send>;

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

/// The [`Store`] on SQLite: claims, completions, failures, releases and expiry go through the
/// group-commit writer of a [`Db`]; `get` reads on the read pool. Records live in time
/// windows (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct SqliteStore {
    db: Db,
    tables: Arc<Tables>,
}

impl SqliteStore {
    /// Opens (or creates) the database at `path` and reads which record tables it has.
    pub async fn open(
        path: impl AsRef<Path>,
        options: SqliteOptions,
    ) -> Result<SqliteStore, StoreError> {
        SqliteStore::new(Db::open(path, options)?).await
    }

    /// A store on an existing [`Db`] (shared with the application). A new database has no
    /// table until the first claim creates its window.
    pub async fn new(db: Db) -> Result<SqliteStore, StoreError> {
        let catalog = db.write(Catalog::load).await?;
        Ok(SqliteStore {
            db,
            tables: Arc::new(Tables::new(catalog)),
        })
    }

    /// The database handle, to put the application's own tables in the same writer.
    pub fn db(&self) -> &Db {
        &self.db
    }

    /// How many records the store holds, in every window.
    pub async fn record_count(&self) -> Result<u64, StoreError> {
        Ok(self.db.read(count_records).await?)
    }
}

/// How many idempotency records the database on `conn` holds, in every window: for tests and
/// tools reading the file directly.
pub fn count_records(conn: &rusqlite::Connection) -> rusqlite::Result<u64> {
    let catalog = Catalog::load(conn)?;
    let mut total = 0u64;
    for table in &catalog.tables {
        let n: i64 = conn.query_row(&format!("SELECT count(*) FROM {}", table.name), [], |r| {
            r.get(0)
        })?;
        total += n.unsigned_abs();
    }
    Ok(total)
}

/// Whether `e` says a table is gone: a read that raced a window's drop.
fn is_missing_table(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(_, Some(m)) if m.starts_with("no such table"))
}
impl SqliteStore {
    async fn claim_with(&self, req: ClaimRequest, deferred: bool) -> Result<Claim, StoreError> {
        let job = Arc::new(ClaimJob {
            scope: req.scope.clone(),
            key: req.key.as_str().to_owned(),
            fingerprint: req.fingerprint.to_hex(),
            now: req.now_ms,
            lease_until: req.lease_until_ms(),
            expires_at: req.expires_at_ms(),
            ttl_ms: duration_ms(req.ttl),
        });
        // Normally one pass: the window exists and the job changes one row at most. A new
        // window is created first; a takeover out of an older window runs again as a job
        // with a savepoint of its own, since it deletes there and inserts here.
        let mut may_move = false;
        let mut created = 0;
        let found = loop {
            let (tables, job) = (Arc::clone(&self.tables), Arc::clone(&job));
            let run =
                move |conn: &rusqlite::Connection| records::decide(conn, &tables, &job, may_move);
            let found = match (may_move, deferred) {
                (true, true) => self.db.write_deferred(run).await?,
                (true, false) => self.db.write(run).await?,
                (false, true) => self.db.write_statement_deferred(run).await?,
                (false, false) => self.db.write_statement(run).await?,
            };
            match found {
                Found::NeedWindow(window) if created < 3 => {
                    created += 1;
                    self.create_window(window).await?;
                }
                Found::MustMove if !may_move => may_move = true,
                Found::NeedWindow(_) | Found::MustMove | Found::Vanished => {
                    return Err(StoreError::Contended {
                        scope: req.scope,
                        key: req.key,
                    });
                }
                found => break found,
            }
        };
        self.upkeep_if_due();
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
            Found::InProgress(l) => Claim::in_progress(l, req.now_ms),
            Found::Conflict(fp0) => Claim::Conflict {
                fingerprint_prefix: Fingerprint::from_hex(&fp0)
                    .map_err(|_| corrupt(scope, key, "fingerprint"))?
                    .prefix8(),
            },
            Found::Replay(row) => Claim::Replay(response_from(scope, key, row)?),
            Found::BadStatus => return Err(corrupt(scope, key, "status")),
            Found::NeedWindow(_) | Found::MustMove | Found::Vanished => {
                unreachable!("handled in the loop")
            }
        })
    }

    /// Runs a fenced single-statement write (complete, fail, release) on the table holding
    /// the lease's key.
    async fn fenced_statement(
        &self,
        lease: &Lease,
        statement: impl Fn(
            &catalog::TableSql,
            &rusqlite::Connection,
            &str,
            &str,
            i64,
        ) -> rusqlite::Result<usize>
        + Send
        + 'static,
    ) -> Result<(), StoreError> {
        let (scope, key, token) = (
            lease.scope.clone(),
            lease.key.to_string(),
            lease.lease_until_ms,
        );
        let tables = Arc::clone(&self.tables);
        let done = self
            .db
            .write_statement(move |conn| {
                fenced(&tables, &scope, &key, |sql| {
                    statement(sql, conn, &scope, &key, token)
                })
            })
            .await?;
        if done {
            Ok(())
        } else {
            Err(StoreError::lease_lost(lease))
        }
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
        point: crate::idempotency::RecoveryPoint,
        writes: SqliteWrites<T>,
    ) -> Result<T, StoreError> {
        let (scope, key, token) = (
            lease.scope.clone(),
            lease.key.to_string(),
            lease.lease_until_ms,
        );
        let phase = point.phase.clone();
        let tables = Arc::clone(&self.tables);
        self.db
            .write(move |conn| {
                let marked = fenced(&tables, &scope, &key, |sql| {
                    conn.prepare_cached(&sql.mark_phase)?.execute(params![
                        scope,
                        key,
                        token,
                        point.phase,
                        &point.data[..]
                    ])
                })?;
                if !marked {
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
        let tables = Arc::clone(&self.tables);
        self.db
            .write(move |conn| {
                let ended = fenced(&tables, &scope, &key, |sql| match &ending {
                    Ending::Complete(response) => {
                        conn.prepare_cached(&sql.complete)?.execute(params![
                            scope,
                            key,
                            token,
                            response.status,
                            &response.body[..],
                            headers_json(&response.headers),
                            keep_until
                        ])
                    }
                    Ending::Fail => conn
                        .prepare_cached(&sql.fail)?
                        .execute(params![scope, key, token, keep_until]),
                    Ending::Release => conn
                        .prepare_cached(&sql.release)?
                        .execute(params![scope, key, token]),
                })?;
                if !ended {
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
        let keep_until = now_ms.saturating_add(duration_ms(lease.ttl));
        let headers = headers_json(&response.headers);
        self.fenced_statement(lease, move |sql, conn, scope, key, token| {
            conn.prepare_cached(&sql.complete)?.execute(params![
                scope,
                key,
                token,
                response.status,
                &response.body[..],
                headers,
                keep_until
            ])
        })
        .await
    }

    async fn fail(&self, lease: &Lease, now_ms: i64) -> Result<(), StoreError> {
        let keep_until = now_ms.saturating_add(duration_ms(lease.ttl));
        self.fenced_statement(lease, move |sql, conn, scope, key, token| {
            conn.prepare_cached(&sql.fail)?
                .execute(params![scope, key, token, keep_until])
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.fenced_statement(lease, |sql, conn, scope, key, token| {
            conn.prepare_cached(&sql.release)?
                .execute(params![scope, key, token])
        })
        .await
    }

    async fn get(&self, scope: &str, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        // A window dropped between the snapshot and the read is retried with a new snapshot.
        let mut attempts = 0;
        let row = loop {
            let (s, k) = (scope.to_owned(), key.as_str().to_owned());
            let catalog = self.tables.snapshot();
            let read = self
                .db
                .read(move |conn| {
                    for table in catalog.tables.iter().filter(|t| t.may_hold(&s, &k)) {
                        let row = conn
                            .prepare_cached(&table.sql.get)?
                            .query_row(params![s, k], |r| {
                                Ok((
                                    existing_columns(r)?,
                                    r.get::<_, i64>(6)?,
                                    r.get::<_, i64>(7)?,
                                    point_columns(r, 8)?,
                                ))
                            })
                            .optional()?;
                        if row.is_some() {
                            return Ok(row);
                        }
                    }
                    Ok(None)
                })
                .await;
            match read {
                Err(crate::db::sqlite::Error::Sqlite(e))
                    if is_missing_table(&e) && attempts < 3 =>
                {
                    attempts += 1;
                }
                read => break read?,
            }
        };
        let Some(((fp, status, lease_until_ms, raw), created_at_ms, expires_at_ms, point)) = row
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

    /// Deletes expired records one at a time, in every window. The [`Sweeper`](super::Sweeper)
    /// calls [`expire`](Store::expire) instead, which drops whole windows.
    async fn sweep(&self, now_ms: i64, limit: usize) -> Result<usize, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let tables = Arc::clone(&self.tables);
        let deleted = self
            .db
            .write(move |conn| {
                let mut left = limit;
                for table in &tables.snapshot().tables {
                    if left == 0 {
                        break;
                    }
                    let n = conn
                        .prepare_cached(&table.sql.sweep)?
                        .execute(params![now_ms, left])?;
                    left -= i64::try_from(n).unwrap_or(left);
                }
                Ok(limit - left)
            })
            .await?;
        Ok(usize::try_from(deleted).unwrap_or(0))
    }

    /// Drops whole windows: `_limit` bounds nothing, a window goes in one statement.
    async fn expire(&self, now_ms: i64, _limit: usize) -> Result<usize, StoreError> {
        upkeep::expire(self, now_ms).await
    }
}

#[cfg(test)]
mod tests;
