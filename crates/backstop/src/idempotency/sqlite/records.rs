//! Reading records back, and the claim's decision, run inside the writer's transaction over
//! every table that may hold the key.

use bytes::Bytes;
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension, Row, params};

use super::catalog::{Table, TableSql, Tables};
use crate::idempotency::store::{PriorRun, RecoveryPoint};
use crate::idempotency::window::Window;
use crate::idempotency::{RecordStatus, StoreError, StoredResponse};

/// A claim, as the writer job sees it.
pub(super) struct ClaimJob {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) fingerprint: String,
    pub(super) now: i64,
    pub(super) lease_until: i64,
    pub(super) expires_at: i64,
    pub(super) ttl_ms: i64,
}

/// What the claim job found, decided inside the write transaction.
pub(super) enum Found {
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
    /// The window the claim would insert into has no table yet: create it, then claim again.
    NeedWindow(Window),
    /// A takeover must move the record out of an older window, which takes two statements:
    /// claim again in a job that may.
    MustMove,
    /// The record disappeared between two statements of the job (it cannot, with one writer).
    Vanished,
}

/// `http_status, response_body, response_headers` of a succeeded record.
pub(super) struct Row6 {
    pub(super) status: Option<i64>,
    pub(super) body: Option<Vec<u8>>,
    pub(super) headers: Option<String>,
}

pub(super) fn bytes_column(row: &Row<'_>, idx: usize) -> rusqlite::Result<Option<Vec<u8>>> {
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

pub(super) fn corrupt(scope: &str, key: &str, what: &'static str) -> StoreError {
    StoreError::Corrupt {
        scope: scope.to_owned(),
        key: key.to_owned(),
        what,
    }
}

pub(super) fn response_from(
    scope: &str,
    key: &str,
    raw: Row6,
) -> Result<StoredResponse, StoreError> {
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

pub(super) fn headers_json(headers: &[(String, String)]) -> String {
    // Serializing strings to JSON cannot fail.
    serde_json::to_string(headers).unwrap_or_else(|_| "[]".to_owned())
}

/// The recovery point in `phase, phase_data` columns starting at `at`.
pub(super) fn point_columns(row: &Row<'_>, at: usize) -> rusqlite::Result<Option<RecoveryPoint>> {
    let phase: Option<String> = row.get(at)?;
    Ok(match phase {
        Some(phase) => Some(RecoveryPoint {
            phase,
            data: Bytes::from(bytes_column(row, at + 1)?.unwrap_or_default()),
        }),
        None => None,
    })
}

/// `fingerprint, status, lease_until` and the response columns of the key in one table.
pub(super) type Existing = (String, String, i64, Row6);

/// Reads [`Existing`] from the first six columns of `row`, as both `select` and `get` lay them
/// out.
pub(super) fn existing_columns(row: &Row<'_>) -> rusqlite::Result<Existing> {
    Ok((
        row.get(0)?,
        row.get(1)?,
        row.get(2)?,
        Row6 {
            status: row.get(3)?,
            body: bytes_column(row, 4)?,
            headers: row.get(5)?,
        },
    ))
}

fn select(conn: &Connection, sql: &TableSql, job: &ClaimJob) -> rusqlite::Result<Option<Existing>> {
    conn.prepare_cached(&sql.select)?
        .query_row(params![job.scope, job.key], existing_columns)
        .optional()
}

/// Decides a claim: looks for the key in every table that may hold it (the store's time picks
/// the window a new record goes to), then inserts, takes over, or answers what it found. With
/// `may_move` false the job runs one changing statement at most, and answers
/// [`Found::MustMove`] where a takeover needs two.
pub(super) fn decide(
    conn: &Connection,
    tables: &Tables,
    job: &ClaimJob,
    may_move: bool,
) -> rusqlite::Result<Found> {
    let at = tables.high_water.advance(job.now);
    let window = Window::of(job.ttl_ms, at);
    let catalog = tables.snapshot();
    let Some(current) = catalog.find(window) else {
        return Ok(Found::NeedWindow(window));
    };
    // At most one table holds the key: every claim looked in all of them before inserting.
    for table in &catalog.tables {
        if table.window == window || !table.may_hold(&job.scope, &job.key) {
            continue;
        }
        if let Some(existing) = select(conn, &table.sql, job)? {
            return answer(conn, table, Some(current), existing, job, may_move);
        }
    }
    let inserted = conn.prepare_cached(&current.sql.insert)?.execute(params![
        job.scope,
        job.key,
        job.fingerprint,
        job.lease_until,
        job.now,
        job.expires_at
    ])?;
    if inserted == 1 {
        current.inserted(&job.scope, &job.key);
        return Ok(Found::Claimed(job.lease_until));
    }
    match select(conn, &current.sql, job)? {
        Some(existing) => answer(conn, current, None, existing, job, may_move),
        None => Ok(Found::Vanished),
    }
}

/// The answer for a key found in `holder`; a takeover moves it to `move_to` when that is
/// another table, or renews it in place.
fn answer(
    conn: &Connection,
    holder: &Table,
    move_to: Option<&Table>,
    (fp0, status, lease0, row): Existing,
    job: &ClaimJob,
    may_move: bool,
) -> rusqlite::Result<Found> {
    if fp0 != job.fingerprint {
        return Ok(Found::Conflict(fp0));
    }
    let prior = match RecordStatus::parse(&status) {
        None => return Ok(Found::BadStatus),
        Some(RecordStatus::Succeeded) => return Ok(Found::Replay(row)),
        Some(RecordStatus::Running) if lease0 > job.now => return Ok(Found::InProgress(lease0)),
        Some(RecordStatus::Running) => PriorRun::Abandoned,
        Some(RecordStatus::Failed) => PriorRun::Failed,
    };
    let Some(move_to) = move_to else {
        // In the current window: one conditional UPDATE decides the takeover.
        let taken = conn
            .prepare_cached(&holder.sql.take_over)?
            .query_row(
                params![
                    job.scope,
                    job.key,
                    job.lease_until,
                    job.now,
                    job.expires_at,
                    job.fingerprint
                ],
                |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        point_columns(r, 2)?,
                    ))
                },
            )
            .optional()?;
        return Ok(match taken {
            Some((lease_until, created_at, point)) => Found::TakenOver {
                lease_until,
                created_at,
                prior,
                point,
            },
            None => Found::InProgress(job.lease_until),
        });
    };
    if !may_move {
        return Ok(Found::MustMove);
    }
    // A sealed window is never renewed: the record leaves it for the current window, keeping
    // its first-claim time and recovery point, its token moved strictly forward.
    let taken = conn
        .prepare_cached(&holder.sql.take_out)?
        .query_row(params![job.scope, job.key, job.fingerprint, job.now], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, Option<String>>(3)?,
                bytes_column(r, 4)?,
            ))
        })
        .optional()?;
    let Some((lease0, created_at, expires0, phase, phase_data)) = taken else {
        return Ok(Found::InProgress(job.lease_until));
    };
    let lease_until = job.lease_until.max(lease0.saturating_add(1));
    let expires_at = expires0.max(job.expires_at);
    conn.prepare_cached(&move_to.sql.insert_moved)?
        .execute(params![
            job.scope,
            job.key,
            job.fingerprint,
            lease_until,
            created_at,
            expires_at,
            phase,
            phase_data
        ])?;
    move_to.inserted(&job.scope, &job.key);
    let point = phase.map(|phase| RecoveryPoint {
        phase,
        data: Bytes::from(phase_data.unwrap_or_default()),
    });
    Ok(Found::TakenOver {
        lease_until,
        created_at,
        prior,
        point,
    })
}

/// Runs `statement` on each table that may hold the key, newest first, until one changes a
/// row: the fenced writes (complete, fail, release, a phase's mark). Whether one did.
pub(super) fn fenced(
    tables: &Tables,
    scope: &str,
    key: &str,
    mut statement: impl FnMut(&TableSql) -> rusqlite::Result<usize>,
) -> rusqlite::Result<bool> {
    let catalog = tables.snapshot();
    for table in catalog.tables.iter().filter(|t| t.may_hold(scope, key)) {
        if statement(&table.sql)? == 1 {
            return Ok(true);
        }
    }
    Ok(false)
}
