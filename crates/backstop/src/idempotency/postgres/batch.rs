//! The idempotency store's calls as the batching writer runs them.
//!
//! [`Op`] is one call of the store (claim, complete, fail, release); the writer of
//! [`db::postgres`](crate::db::postgres) runs it alone, or with others in one pipelined
//! transaction. In a batch, claims of distinct keys go in one array statement, as do
//! completions, failures and releases; a second claim of a key already claimed in the batch
//! runs as a statement of its own after them. Calls are ordered by `(scope, key)`, so two
//! batches (on this instance or another) lock rows in the same order.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};
use std::future::Future;

use deadpool_postgres::Object;
use tokio_postgres::Row;

use super::sql::{
    BEGIN_SQL, CLAIM_MANY_SQL, CLAIM_SQL, COMPLETE_MANY_SQL, COMPLETE_SQL, FAIL_MANY_SQL, FAIL_SQL,
    RELEASE_MANY_SQL, RELEASE_SQL,
};
use crate::db::postgres::{Group, Statement, alone};

/// Where an outcome statement looks for its record: its class (the lease's TTL class, which
/// the claim placed it in) and the windows from `lo` to `hi`. One window when the claim that
/// took the record said where it went: the statement then reads that partition alone
/// (PostgreSQL prunes the others as it runs); every window of the class otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    pub(super) class_ms: i64,
    pub(super) lo: i64,
    pub(super) hi: i64,
}

impl Place {
    /// The record's own window.
    pub(super) fn window(class_ms: i64, win: i64) -> Place {
        Place {
            class_ms,
            lo: win,
            hi: win,
        }
    }

    /// Any window of the class.
    pub(super) fn class(class_ms: i64) -> Place {
        Place {
            class_ms,
            lo: i64::MIN,
            hi: i64::MAX,
        }
    }
}

/// One statement of the store.
#[derive(Debug)]
pub(super) enum Op {
    Claim {
        scope: String,
        key: String,
        fingerprint: String,
        lease_until: i64,
        now: i64,
        expires_at: i64,
        /// The TTL class and its window width: which windows it goes to.
        class_ms: i64,
        width_ms: i64,
        /// Added to the database's clock for placement (0 but in tests).
        clock_offset_ms: i64,
        /// The sealed windows this instance's summaries rule out for the key, comma-separated.
        skip: String,
    },
    Complete {
        scope: String,
        key: String,
        token: i64,
        http_status: i32,
        body: bytes::Bytes,
        headers: String,
        keep_until: i64,
        place: Place,
    },
    Fail {
        scope: String,
        key: String,
        token: i64,
        keep_until: i64,
        place: Place,
    },
    Release {
        scope: String,
        key: String,
        token: i64,
        place: Place,
    },
}

impl Op {
    fn row_key(&self) -> (&str, &str) {
        match self {
            Op::Claim { scope, key, .. }
            | Op::Complete { scope, key, .. }
            | Op::Fail { scope, key, .. }
            | Op::Release { scope, key, .. } => (scope, key),
        }
    }
}

/// What a claim statement found: the lease it took, or the record as it stood.
#[derive(Debug, Default)]
pub(super) struct ClaimRow {
    /// Whether this claim inserted or took over the record.
    pub(super) taken: bool,
    /// The new lease end when taken; else the record's.
    pub(super) lease_until: Option<i64>,
    /// The record's fingerprint when not taken (`None`: the record vanished since the
    /// conflict, e.g. released or swept).
    pub(super) fingerprint: Option<String>,
    pub(super) status: Option<String>,
    pub(super) http_status: Option<i32>,
    pub(super) body: Option<Vec<u8>>,
    pub(super) headers: Option<String>,
    /// When the key was first claimed.
    pub(super) created_at: Option<i64>,
    /// The record's recovery point.
    pub(super) phase: Option<String>,
    pub(super) phase_data: Option<Vec<u8>>,
    /// The window the claim would write into has no partition: nothing was written.
    pub(super) need_window: Option<i64>,
    /// The window a taken record is in now.
    pub(super) placed_win: Option<i64>,
}

impl ClaimRow {
    /// From `taken, lease_until, fingerprint, status, http_status, response_body,
    /// response_headers, created_at, phase, phase_data, need_window, placed_win` starting at
    /// column `at`. A
    /// taken row's `status` is the record's status before the takeover (`None` for a fresh
    /// insert).
    fn read(row: &Row, at: usize) -> Result<ClaimRow, tokio_postgres::Error> {
        Ok(ClaimRow {
            taken: row.try_get::<_, Option<bool>>(at)?.unwrap_or(false),
            lease_until: row.try_get(at + 1)?,
            fingerprint: row.try_get(at + 2)?,
            status: row.try_get(at + 3)?,
            http_status: row.try_get(at + 4)?,
            body: row.try_get(at + 5)?,
            headers: row.try_get(at + 6)?,
            created_at: row.try_get(at + 7)?,
            phase: row.try_get(at + 8)?,
            phase_data: row.try_get(at + 9)?,
            need_window: row.try_get(at + 10)?,
            placed_win: row.try_get(at + 11)?,
        })
    }
}

/// What a statement returned.
#[derive(Debug)]
pub(super) enum Outcome {
    /// What the claim found.
    Claim(ClaimRow),
    /// Rows changed by an outcome statement.
    Changed(u64),
}

impl Statement for Op {
    type Output = Outcome;

    const BEGIN: &'static str = BEGIN_SQL;

    const PREPARE: &'static [&'static str] = &[
        CLAIM_SQL,
        COMPLETE_SQL,
        FAIL_SQL,
        RELEASE_SQL,
        CLAIM_MANY_SQL,
        COMPLETE_MANY_SQL,
        FAIL_MANY_SQL,
        RELEASE_MANY_SQL,
    ];

    fn lock_order(&self, other: &Self) -> Ordering {
        self.row_key().cmp(&other.row_key())
    }

    fn run(
        &self,
        client: &Object,
    ) -> impl Future<Output = Result<Outcome, tokio_postgres::Error>> + Send {
        run_one(client, self)
    }

    fn pipeline<'a>(client: &'a Object, ops: &'a [&'a Op]) -> Vec<Group<'a, Outcome>> {
        let mut seen = HashSet::new();
        let (mut claims, mut again, mut completes, mut fails, mut releases) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, op) in ops.iter().enumerate() {
            match op {
                Op::Claim { .. } if seen.insert(op.row_key()) => claims.push(i),
                Op::Claim { .. } => again.push(i),
                Op::Complete { .. } => completes.push(i),
                Op::Fail { .. } => fails.push(i),
                Op::Release { .. } => releases.push(i),
            }
        }
        let mut groups: Vec<Group<'_, Outcome>> = Vec::new();
        if !claims.is_empty() {
            groups.push(claim_many(client, ops, claims));
        }
        groups.extend(again.into_iter().map(|i| alone(client, ops, i)));
        for indices in [completes, fails, releases] {
            if !indices.is_empty() {
                groups.push(change_many(client, ops, indices));
            }
        }
        groups
    }

    /// Every statement answers for each of its inputs; a missing answer reads as "not
    /// applied" (a claim runs again, an outcome reports its lease lost).
    fn unanswered(&self) -> Outcome {
        match self {
            Op::Claim { .. } => Outcome::Claim(ClaimRow::default()),
            _ => Outcome::Changed(0),
        }
    }
}

/// Claims of distinct keys in one statement.
fn claim_many<'a>(
    client: &'a Object,
    ops: &'a [&'a Op],
    indices: Vec<usize>,
) -> Group<'a, Outcome> {
    if let [i] = indices[..] {
        return alone(client, ops, i);
    }
    Box::pin(async move {
        let stmt = client.prepare_cached(CLAIM_MANY_SQL).await?;
        let n = indices.len();
        let (mut scopes, mut keys, mut fps) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut leases, mut nows, mut expiries) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut classes, mut widths, mut skips, mut offset) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            0i64,
        );
        for &i in &indices {
            if let Op::Claim {
                scope,
                key,
                fingerprint,
                lease_until,
                now,
                expires_at,
                class_ms,
                width_ms,
                clock_offset_ms,
                skip,
            } = ops[i]
            {
                scopes.push(scope.as_str());
                keys.push(key.as_str());
                fps.push(fingerprint.as_str());
                leases.push(*lease_until);
                nows.push(*now);
                expiries.push(*expires_at);
                classes.push(*class_ms);
                widths.push(*width_ms);
                skips.push(skip.as_str());
                // One store's claims: one offset.
                offset = *clock_offset_ms;
            }
        }
        let rows = client
            .query(
                &stmt,
                &[
                    &scopes, &keys, &fps, &leases, &nows, &expiries, &classes, &widths, &offset,
                    &skips,
                ],
            )
            .await?;
        // The keys are distinct (see `run_in_transaction`).
        let by_key: HashMap<(&str, &str), usize> =
            indices.iter().map(|&i| (ops[i].row_key(), i)).collect();
        let mut answers: HashMap<usize, ClaimRow> = HashMap::with_capacity(n);
        for row in rows {
            let (scope, key): (&str, &str) = (row.try_get(0)?, row.try_get(1)?);
            let Some(&i) = by_key.get(&(scope, key)) else {
                continue;
            };
            answers.insert(i, ClaimRow::read(&row, 2)?);
        }
        Ok(answers
            .into_iter()
            .map(|(i, row)| (i, Outcome::Claim(row)))
            .collect())
    })
}

/// Completions, failures or releases (all of one kind) in one statement.
fn change_many<'a>(
    client: &'a Object,
    ops: &'a [&'a Op],
    indices: Vec<usize>,
) -> Group<'a, Outcome> {
    if let [i] = indices[..] {
        return alone(client, ops, i);
    }
    Box::pin(async move {
        let n = indices.len();
        let (mut scopes, mut keys, mut tokens, mut keeps) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut statuses, mut bodies, mut headers) = (Vec::new(), Vec::new(), Vec::new());
        let (mut classes, mut los, mut his) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for &i in &indices {
            let (scope, key) = ops[i].row_key();
            scopes.push(scope);
            keys.push(key);
            let place = match ops[i] {
                Op::Complete {
                    token,
                    http_status,
                    body,
                    headers: h,
                    keep_until,
                    place,
                    ..
                } => {
                    tokens.push(*token);
                    statuses.push(*http_status);
                    bodies.push(&body[..]);
                    headers.push(h.as_str());
                    keeps.push(*keep_until);
                    place
                }
                Op::Fail {
                    token,
                    keep_until,
                    place,
                    ..
                } => {
                    tokens.push(*token);
                    keeps.push(*keep_until);
                    place
                }
                Op::Release { token, place, .. } => {
                    tokens.push(*token);
                    place
                }
                Op::Claim { .. } => continue,
            };
            classes.push(place.class_ms);
            los.push(place.lo);
            his.push(place.hi);
        }
        let rows = match ops[indices[0]] {
            Op::Complete { .. } => {
                let stmt = client.prepare_cached(COMPLETE_MANY_SQL).await?;
                client
                    .query(
                        &stmt,
                        &[
                            &scopes, &keys, &tokens, &statuses, &bodies, &headers, &keeps,
                            &classes, &los, &his,
                        ],
                    )
                    .await?
            }
            Op::Fail { .. } => {
                let stmt = client.prepare_cached(FAIL_MANY_SQL).await?;
                client
                    .query(
                        &stmt,
                        &[&scopes, &keys, &tokens, &keeps, &classes, &los, &his],
                    )
                    .await?
            }
            Op::Release { .. } | Op::Claim { .. } => {
                let stmt = client.prepare_cached(RELEASE_MANY_SQL).await?;
                client
                    .query(&stmt, &[&scopes, &keys, &tokens, &classes, &los, &his])
                    .await?
            }
        };
        let mut applied = vec![false; n];
        for row in rows {
            let ord: i64 = row.try_get(0)?;
            if let Some(slot) = usize::try_from(ord - 1)
                .ok()
                .and_then(|o| applied.get_mut(o))
            {
                *slot = true;
            }
        }
        Ok(indices
            .into_iter()
            .zip(applied)
            .map(|(i, applied)| (i, Outcome::Changed(u64::from(applied))))
            .collect())
    })
}

pub(super) async fn run_one(client: &Object, op: &Op) -> Result<Outcome, tokio_postgres::Error> {
    match op {
        Op::Claim {
            scope,
            key,
            fingerprint,
            lease_until,
            now,
            expires_at,
            class_ms,
            width_ms,
            clock_offset_ms,
            skip,
        } => {
            let stmt = client.prepare_cached(CLAIM_SQL).await?;
            let skip: Vec<&str> = skip.split(',').filter(|s| !s.is_empty()).collect();
            let row = client
                .query_opt(
                    &stmt,
                    &[
                        scope,
                        key,
                        fingerprint,
                        lease_until,
                        now,
                        expires_at,
                        class_ms,
                        width_ms,
                        clock_offset_ms,
                        &skip,
                    ],
                )
                .await?;
            Ok(Outcome::Claim(match row {
                Some(row) => ClaimRow::read(&row, 0)?,
                None => ClaimRow::default(),
            }))
        }
        Op::Complete {
            scope,
            key,
            token,
            http_status,
            body,
            headers,
            keep_until,
            place,
        } => {
            let stmt = client.prepare_cached(COMPLETE_SQL).await?;
            let n = client
                .execute(
                    &stmt,
                    &[
                        scope,
                        key,
                        token,
                        http_status,
                        &&body[..],
                        headers,
                        keep_until,
                        &place.class_ms,
                        &place.lo,
                        &place.hi,
                    ],
                )
                .await;
            Ok(Outcome::Changed(closed_is_lost(n)?))
        }
        Op::Fail {
            scope,
            key,
            token,
            keep_until,
            place,
        } => {
            let stmt = client.prepare_cached(FAIL_SQL).await?;
            let n = client
                .execute(
                    &stmt,
                    &[
                        scope,
                        key,
                        token,
                        keep_until,
                        &place.class_ms,
                        &place.lo,
                        &place.hi,
                    ],
                )
                .await;
            Ok(Outcome::Changed(closed_is_lost(n)?))
        }
        Op::Release {
            scope,
            key,
            token,
            place,
        } => {
            let stmt = client.prepare_cached(RELEASE_SQL).await?;
            let n = client
                .execute(
                    &stmt,
                    &[scope, key, token, &place.class_ms, &place.lo, &place.hi],
                )
                .await?;
            Ok(Outcome::Changed(n))
        }
    }
}

/// A completion of a record in a window closed for its drop (every record in it had expired
/// and no lease was live) changes nothing: the record is as good as swept.
pub(super) fn closed_is_lost(
    changed: Result<u64, tokio_postgres::Error>,
) -> Result<u64, tokio_postgres::Error> {
    match changed {
        Err(e) if in_closed_window(&e) => Ok(0),
        changed => changed,
    }
}

/// Whether `e` is a write refused by a window closed for its drop (see `windows.rs`).
pub(super) fn in_closed_window(e: &tokio_postgres::Error) -> bool {
    e.as_db_error().is_some_and(|db| {
        *db.code() == tokio_postgres::error::SqlState::CHECK_VIOLATION
            && db
                .constraint()
                .is_some_and(|c| c.ends_with(super::windows::CLOSED_SUFFIX))
    })
}
