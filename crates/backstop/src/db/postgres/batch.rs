//! The batching writer: concurrent claims and outcomes share one transaction and one round trip.
//!
//! PostgreSQL makes a COMMIT durable with a WAL flush; a store that commits once per call pays
//! one flush, one round trip and one transaction per call. Here a call with nothing queued ahead
//! of it and a free pool connection runs at once on the caller's own task, alone, in autocommit:
//! no hand-off, no batching cost. When every connection is busy, calls queue up on one queue that
//! the writer tasks ([`PostgresOptions::writers`]) wait on. A writer takes the first queued call,
//! waits for a connection, then takes everything queued by then (up to `max_batch`) and sends
//! `BEGIN`, the statements (claims of distinct keys as one array statement, completions as
//! another...) and `COMMIT` pipelined on that connection: one round trip, one transaction and
//! one flush for the whole batch. Each caller is answered after the COMMIT that made its row
//! durable.
//!
//! [`PostgresOptions::writers`]: crate::idempotency::postgres::PostgresOptions::writers
//!
//! - A batch of one runs alone, in autocommit: no batching cost when there is no concurrency.
//! - Statements run in `(scope, key)` order, so two batches (on this instance or another) lock
//!   rows in the same order and cannot deadlock each other.
//! - If one statement fails, PostgreSQL aborts the batch's transaction and nothing of it was
//!   written; the statements then run again one by one, so only the failing caller sees its
//!   error.
//! - A call whose start-by time passes before it runs is answered at once without being sent
//!   (nothing written); one whose caller went away is dropped before it runs.
//! - A call that was sent is always answered with what the database did: a caller that waits
//!   for its answer knows whether its claim was taken, and can release it. A batch is waited
//!   for until the latest deadline of its callers, and at least the store's timeout; one that
//!   does not finish by then is abandoned and its connection discarded (a connection left
//!   mid-pipeline cannot be reused).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_postgres::{Object, Pool, PoolError, TimeoutType, Timeouts};
use futures_util::future::maybe_done;
use futures_util::poll;
use tokio::sync::oneshot;
use tokio::time::{Instant, timeout_at};
use tokio_postgres::Row;

use super::Error;

/// Jobs queued before callers wait to enqueue.
const QUEUE: usize = 4096;

/// `INSERT` a running record, or take over a failed / expired one with the same fingerprint by
/// a conditional `DO UPDATE` (the row lock makes concurrent takeovers see each other: exactly one
/// wins); when neither happened, return the record as it stood.
pub(crate) const CLAIM_SQL: &str = "\
WITH taken AS ( \
  INSERT INTO idempotency_key AS k \
    (scope, key, fingerprint, status, lease_until, created_at, expires_at) \
  VALUES ($1, $2, $3, 'running', $4, $5, $6) \
  ON CONFLICT (scope, key) DO UPDATE SET status = 'running', \
    lease_until = GREATEST(EXCLUDED.lease_until, k.lease_until + 1), \
    expires_at = GREATEST(k.expires_at, EXCLUDED.expires_at), \
    http_status = NULL, response_body = NULL, response_headers = NULL \
  WHERE k.fingerprint = EXCLUDED.fingerprint \
    AND (k.status = 'failed' OR (k.status = 'running' AND k.lease_until <= EXCLUDED.created_at)) \
  RETURNING k.lease_until) \
SELECT true, lease_until, NULL::text, NULL::text, NULL::integer, NULL::bytea, NULL::text \
  FROM taken \
UNION ALL \
SELECT false, lease_until, fingerprint, status, http_status, response_body, response_headers \
  FROM idempotency_key \
  WHERE scope = $1 AND key = $2 AND NOT EXISTS (SELECT 1 FROM taken)";

/// Store the response, if the lease (fencing token) still holds the record.
pub(crate) const COMPLETE_SQL: &str = "\
UPDATE idempotency_key SET status = 'succeeded', http_status = $4, response_body = $5, \
  response_headers = $6, expires_at = GREATEST(expires_at, $7) \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3";

/// Mark failed, if the lease still holds the record.
pub(crate) const FAIL_SQL: &str = "\
UPDATE idempotency_key SET status = 'failed', expires_at = GREATEST(expires_at, $4) \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3";

/// Forget the key, if the lease still holds the record.
pub(crate) const RELEASE_SQL: &str = "\
DELETE FROM idempotency_key \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3";

/// Opens a batch's transaction, pinning how its array statements are planned (`SET LOCAL`:
/// for this transaction only, so a pool shared with the application keeps its settings).
///
/// Left to itself the planner joins the input arrays to the table by whatever looks cheapest
/// under the table's statistics. On a new or freshly emptied table (no statistics yet, a few
/// pages) that is a sequential scan, and a connection caches such a plan: every later batch on
/// it then reads the whole table, slower as the table grows. Small batches would otherwise be
/// re-planned on every execution too (their custom plans look cheaper than the generic one).
/// Every statement here looks rows up by primary key, so index lookups are right at any size.
const BEGIN_SQL: &str = "BEGIN; \
SET LOCAL enable_seqscan = off; SET LOCAL enable_hashjoin = off; \
SET LOCAL enable_mergejoin = off; SET LOCAL plan_cache_mode = force_generic_plan";

/// [`CLAIM_SQL`] for many distinct keys at once. Returns `scope, key, taken, lease_until,
/// fingerprint, status, http_status, response_body, response_headers`: a row per key taken,
/// and a row per key that already had a record as of the statement's snapshot (the
/// record as it stood; a takeover has both). A key with neither vanished in between.
///
/// Answers are matched to callers by key rather than by joining the inputs to what was taken:
/// with hash joins off (see [`BEGIN_SQL`]) that join would compare every pair of rows.
const CLAIM_MANY_SQL: &str = "\
WITH input AS ( \
  SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[], $6::int8[]) \
    WITH ORDINALITY AS u(scope, key, fingerprint, lease_until, now, expires_at, ord)), \
taken AS ( \
  INSERT INTO idempotency_key AS k \
    (scope, key, fingerprint, status, lease_until, created_at, expires_at) \
  SELECT scope, key, fingerprint, 'running', lease_until, now, expires_at FROM input ORDER BY ord \
  ON CONFLICT (scope, key) DO UPDATE SET status = 'running', \
    lease_until = GREATEST(EXCLUDED.lease_until, k.lease_until + 1), \
    expires_at = GREATEST(k.expires_at, EXCLUDED.expires_at), \
    http_status = NULL, response_body = NULL, response_headers = NULL \
  WHERE k.fingerprint = EXCLUDED.fingerprint \
    AND (k.status = 'failed' OR (k.status = 'running' AND k.lease_until <= EXCLUDED.created_at)) \
  RETURNING k.scope, k.key, k.lease_until) \
SELECT scope, key, true, lease_until, NULL::text, NULL::text, NULL::integer, NULL::bytea, \
  NULL::text \
FROM taken \
UNION ALL \
SELECT k.scope, k.key, false, k.lease_until, k.fingerprint, k.status, k.http_status, \
  k.response_body, k.response_headers \
FROM input i JOIN idempotency_key k ON k.scope = i.scope AND k.key = i.key";

/// [`COMPLETE_SQL`] for many records; returns the `ord` of each input that was applied.
const COMPLETE_MANY_SQL: &str = "\
UPDATE idempotency_key k SET status = 'succeeded', http_status = u.http_status, \
  response_body = u.body, response_headers = u.headers, \
  expires_at = GREATEST(k.expires_at, u.keep_until) \
FROM unnest($1::text[], $2::text[], $3::int8[], $4::int4[], $5::bytea[], $6::text[], $7::int8[]) \
  WITH ORDINALITY AS u(scope, key, token, http_status, body, headers, keep_until, ord) \
WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'running' AND k.lease_until = u.token \
RETURNING u.ord";

/// [`FAIL_SQL`] for many records.
const FAIL_MANY_SQL: &str = "\
UPDATE idempotency_key k SET status = 'failed', expires_at = GREATEST(k.expires_at, u.keep_until) \
FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[]) \
  WITH ORDINALITY AS u(scope, key, token, keep_until, ord) \
WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'running' AND k.lease_until = u.token \
RETURNING u.ord";

/// [`RELEASE_SQL`] for many records.
const RELEASE_MANY_SQL: &str = "\
DELETE FROM idempotency_key k \
USING unnest($1::text[], $2::text[], $3::int8[]) WITH ORDINALITY AS u(scope, key, token, ord) \
WHERE k.scope = u.scope AND k.key = u.key AND k.status = 'running' AND k.lease_until = u.token \
RETURNING u.ord";

/// One statement of the store.
#[derive(Debug)]
pub(crate) enum Op {
    Claim {
        scope: String,
        key: String,
        fingerprint: String,
        lease_until: i64,
        now: i64,
        expires_at: i64,
    },
    Complete {
        scope: String,
        key: String,
        token: i64,
        http_status: i32,
        body: bytes::Bytes,
        headers: String,
        keep_until: i64,
    },
    Fail {
        scope: String,
        key: String,
        token: i64,
        keep_until: i64,
    },
    Release {
        scope: String,
        key: String,
        token: i64,
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
pub(crate) struct ClaimRow {
    /// Whether this claim inserted or took over the record.
    pub(crate) taken: bool,
    /// The new lease end when taken; else the record's.
    pub(crate) lease_until: Option<i64>,
    /// The record's fingerprint when not taken (`None`: the record vanished since the
    /// conflict, e.g. released or swept).
    pub(crate) fingerprint: Option<String>,
    pub(crate) status: Option<String>,
    pub(crate) http_status: Option<i32>,
    pub(crate) body: Option<Vec<u8>>,
    pub(crate) headers: Option<String>,
}

impl ClaimRow {
    /// From `taken, lease_until, fingerprint, status, http_status, response_body,
    /// response_headers` starting at column `at`.
    fn read(row: &Row, at: usize) -> Result<ClaimRow, tokio_postgres::Error> {
        Ok(ClaimRow {
            taken: row.try_get(at)?,
            lease_until: row.try_get(at + 1)?,
            fingerprint: row.try_get(at + 2)?,
            status: row.try_get(at + 3)?,
            http_status: row.try_get(at + 4)?,
            body: row.try_get(at + 5)?,
            headers: row.try_get(at + 6)?,
        })
    }
}

/// What a statement returned.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// What the claim found.
    Claim(ClaimRow),
    /// Rows changed by an outcome statement.
    Changed(u64),
}

/// By when a call must have been sent, and what it is answered when it was not.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StartBy {
    /// The latest instant the call may be sent.
    pub(crate) until: Instant,
    /// Whether `until` is the request's deadline (else the store's timeout).
    pub(crate) by_request: bool,
}

impl StartBy {
    /// The error of a call that was not sent by `until`.
    pub(crate) fn missed(self) -> Error {
        if self.by_request {
            Error::DeadlineExceeded
        } else {
            Error::Timeout
        }
    }
}

struct Job {
    op: Op,
    start: StartBy,
    reply: oneshot::Sender<Result<Outcome, Error>>,
}

/// Counters of the writer (for tests and benchmarks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriterStats {
    /// Statements run.
    pub jobs: u64,
    /// Round trips that carried them (batches, or single autocommit statements).
    pub batches: u64,
}

#[derive(Debug, Default)]
struct Counters {
    jobs: AtomicU64,
    batches: AtomicU64,
}

/// Handle on the writer tasks; they stop when the last handle is dropped.
#[derive(Debug, Clone)]
pub(crate) struct Writer {
    tx: async_channel::Sender<Job>,
    pool: Pool,
    counters: Arc<Counters>,
    /// Bound on a statement once sent.
    timeout: Duration,
}

impl Writer {
    /// Spawns `writers` writer tasks on the current runtime.
    /// `timeout` bounds a statement (or batch) once sent.
    pub(crate) fn start(pool: Pool, writers: usize, max_batch: usize, timeout: Duration) -> Writer {
        let (tx, rx) = async_channel::bounded(QUEUE);
        let counters = Arc::new(Counters::default());
        for _ in 0..writers.max(1) {
            tokio::spawn(drive(
                pool.clone(),
                rx.clone(),
                max_batch.max(1),
                timeout,
                Arc::clone(&counters),
            ));
        }
        Writer {
            tx,
            pool,
            counters,
            timeout,
        }
    }

    /// Runs `op` at once on a free connection, or else in the next batch. Gives up without
    /// sending it when it cannot be sent by `start.until`; once sent, waits for its answer.
    pub(crate) async fn run(&self, op: Op, start: StartBy) -> Result<Outcome, Error> {
        if start.until <= Instant::now() {
            return Err(start.missed());
        }
        // Nothing queued and a connection free: run it here, alone and in autocommit, with no
        // hand-off to a writer task and back. Calls queue (and are batched) only while every
        // connection is busy, or behind calls already queued.
        if self.tx.is_empty() {
            let now = Timeouts {
                wait: Some(Duration::ZERO),
                ..self.pool.timeouts()
            };
            match timeout_at(start.until, self.pool.timeout_get(&now)).await {
                Ok(Ok(client)) => return self.run_at_once(client, &op, start).await,
                Ok(Err(PoolError::Timeout(TimeoutType::Wait))) => {}
                Ok(Err(e)) => return Err(Error::connect(e)),
                // Nothing to wait for but a new connection: the database is slow to answer.
                Err(_) => return Err(Error::Timeout),
            }
        }
        let (reply, answer) = oneshot::channel();
        let job = Job { op, start, reply };
        match timeout_at(start.until, self.tx.send(job)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(Error::Closed),
            Err(_) => return Err(start.missed()),
        }
        // Queued: a writer answers every job, by `start.until` if it did not send it, else
        // with what the database did (bounded by the store's timeout).
        answer.await.map_err(|_| Error::Closed)?
    }

    async fn run_at_once(
        &self,
        client: Object,
        op: &Op,
        start: StartBy,
    ) -> Result<Outcome, Error> {
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.jobs.fetch_add(1, Ordering::Relaxed);
        let until = answer_by(start.until, self.timeout);
        match timeout_at(until, run_one(&client, op)).await {
            Ok(outcome) => Ok(outcome?),
            Err(_) => {
                // The connection may be mid-statement: never hand it out again.
                drop(Object::take(client));
                Err(Error::Timeout)
            }
        }
    }

    pub(crate) fn stats(&self) -> WriterStats {
        WriterStats {
            jobs: self.counters.jobs.load(Ordering::Relaxed),
            batches: self.counters.batches.load(Ordering::Relaxed),
        }
    }
}

async fn drive(
    pool: Pool,
    rx: async_channel::Receiver<Job>,
    max_batch: usize,
    timeout: Duration,
    counters: Arc<Counters>,
) {
    let mut jobs = Vec::with_capacity(max_batch);
    loop {
        // Every idle writer waits on the queue, so a queued job finds one at once while any is
        // free.
        let mut first = match rx.recv().await {
            Ok(job) => job,
            Err(_) => return,
        };
        // Take the connection first and the rest of the queue after: every call queued while
        // this one waited for a connection joins its batch.
        let client = tokio::select! {
            got = timeout_at(first.start.until, pool.get()) => got,
            // The caller is gone: stop waiting on its behalf.
            () = first.reply.closed() => continue,
        };
        let client = match client {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => {
                let _ = first.reply.send(Err(Error::connect(e)));
                continue;
            }
            Err(_) => {
                let _ = first.reply.send(Err(first.start.missed()));
                continue;
            }
        };
        jobs.push(first);
        while jobs.len() < max_batch {
            match rx.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        let now = Instant::now();
        // A caller that is gone, or a call that can no longer start in time: never write what
        // nobody will hear of.
        let (late, live): (Vec<_>, Vec<_>) = jobs
            .drain(..)
            .partition(|job| job.reply.is_closed() || job.start.until <= now);
        jobs.extend(live);
        for job in late {
            let _ = job.reply.send(Err(job.start.missed()));
        }
        if jobs.is_empty() {
            continue;
        }
        // Stable: one key's statements keep their queue order.
        jobs.sort_by(|a, b| a.op.row_key().cmp(&b.op.row_key()));
        counters.batches.fetch_add(1, Ordering::Relaxed);
        counters
            .jobs
            .fetch_add(jobs.len() as u64, Ordering::Relaxed);
        let latest = jobs.iter().map(|job| job.start.until).max();
        let until = answer_by(latest.unwrap_or_else(Instant::now), timeout);
        run_batch(client, &mut jobs, until).await;
    }
}

/// How long a sent statement is waited for: until its caller's start-by time (the request's
/// deadline, for a request), and at least `timeout` from now. Never cut short at a deadline
/// that is about to pass: the caller must learn what its statement did.
fn answer_by(start_by: Instant, timeout: Duration) -> Instant {
    start_by.max(Instant::now() + timeout)
}

/// Runs and answers every job of `jobs` (leaving it empty) on `client`, giving up at `until`.
async fn run_batch(client: Object, jobs: &mut Vec<Job>, until: Instant) {
    let ops: Vec<&Op> = jobs.iter().map(|j| &j.op).collect();
    let ran = timeout_at(until, async {
        if ops.len() == 1 {
            return Ok(vec![run_one(&client, ops[0]).await]);
        }
        match run_in_transaction(&client, &ops).await {
            Ok(outcomes) => Ok(outcomes.into_iter().map(Ok).collect()),
            Err(e) if client.is_closed() => Err(e),
            // One statement failed and took the transaction with it: nothing was written.
            // Run each alone so only its own caller sees its error.
            Err(_) => {
                let mut outcomes = Vec::with_capacity(ops.len());
                for op in &ops {
                    outcomes.push(run_one(&client, op).await);
                }
                Ok(outcomes)
            }
        }
    })
    .await;
    match ran {
        Ok(Ok(outcomes)) => {
            for (job, outcome) in jobs.drain(..).zip(outcomes) {
                let _ = job.reply.send(outcome.map_err(Error::from));
            }
        }
        Ok(Err(e)) => {
            let e = Arc::new(e);
            answer_all(jobs, || Error::Database(Arc::clone(&e)));
        }
        Err(_) => {
            // The connection may be mid-pipeline: never hand it out again.
            drop(Object::take(client));
            answer_all(jobs, || Error::Timeout);
        }
    }
}

fn answer_all(jobs: &mut Vec<Job>, error: impl Fn() -> Error) {
    for job in jobs.drain(..) {
        let _ = job.reply.send(Err(error()));
    }
}

/// The answers of a group of statements, by index into the batch.
type Group<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<(usize, Outcome)>, tokio_postgres::Error>> + Send + 'a>>;

/// `BEGIN`, the statements and `COMMIT`, pipelined: one round trip. Claims of distinct keys go
/// in one array statement, as do completions, failures and releases; a second claim of a key
/// already claimed in the batch runs as a statement of its own after them. Any failure means
/// the transaction was rolled back.
async fn run_in_transaction(
    client: &Object,
    ops: &[&Op],
) -> Result<Vec<Outcome>, tokio_postgres::Error> {
    // Prepared once per connection, then served from the connection's cache without waiting,
    // so each group's first poll below sends its statement.
    for sql in [
        CLAIM_SQL,
        COMPLETE_SQL,
        FAIL_SQL,
        RELEASE_SQL,
        CLAIM_MANY_SQL,
        COMPLETE_MANY_SQL,
        FAIL_MANY_SQL,
        RELEASE_MANY_SQL,
    ] {
        client.prepare_cached(sql).await?;
    }
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
    let mut groups: Vec<Group<'_>> = Vec::new();
    if !claims.is_empty() {
        groups.push(claim_many(client, ops, claims));
    }
    groups.extend(again.into_iter().map(|i| single(client, ops, i)));
    for indices in [completes, fails, releases] {
        if !indices.is_empty() {
            groups.push(change_many(client, ops, indices));
        }
    }

    // A request goes out when its future is first polled: poll each once, in order, so the
    // connection carries BEGIN, every statement, COMMIT, before awaiting any answer.
    let mut begin = Box::pin(maybe_done(client.batch_execute(BEGIN_SQL)));
    let _ = poll!(begin.as_mut());
    let mut groups: Vec<_> = groups
        .into_iter()
        .map(|g| Box::pin(maybe_done(g)))
        .collect();
    for group in &mut groups {
        let _ = poll!(group.as_mut());
    }
    let mut commit = Box::pin(maybe_done(client.batch_execute("COMMIT")));
    let _ = poll!(commit.as_mut());

    begin.as_mut().await;
    for group in &mut groups {
        group.as_mut().await;
    }
    commit.as_mut().await;
    begin.as_mut().take_output().unwrap_or(Ok(()))?;
    let mut outcomes: Vec<Option<Outcome>> = ops.iter().map(|_| None).collect();
    for group in &mut groups {
        if let Some(answers) = group.as_mut().take_output() {
            for (i, outcome) in answers? {
                if let Some(slot) = outcomes.get_mut(i) {
                    *slot = Some(outcome);
                }
            }
        }
    }
    // COMMIT of an aborted transaction rolls back without an error; the statements told us.
    commit.as_mut().take_output().unwrap_or(Ok(()))?;
    // Every statement answers for each of its inputs; a missing answer would read as "not
    // applied" (a claim runs again, an outcome reports its lease lost).
    Ok(outcomes
        .into_iter()
        .zip(ops)
        .map(|(outcome, op)| {
            outcome.unwrap_or(match op {
                Op::Claim { .. } => Outcome::Claim(ClaimRow::default()),
                _ => Outcome::Changed(0),
            })
        })
        .collect())
}

fn single<'a>(client: &'a Object, ops: &'a [&'a Op], i: usize) -> Group<'a> {
    Box::pin(async move { Ok(vec![(i, run_one(client, ops[i]).await?)]) })
}

/// Claims of distinct keys in one statement.
fn claim_many<'a>(client: &'a Object, ops: &'a [&'a Op], indices: Vec<usize>) -> Group<'a> {
    if let [i] = indices[..] {
        return single(client, ops, i);
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
        for &i in &indices {
            if let Op::Claim {
                scope,
                key,
                fingerprint,
                lease_until,
                now,
                expires_at,
            } = ops[i]
            {
                scopes.push(scope.as_str());
                keys.push(key.as_str());
                fps.push(fingerprint.as_str());
                leases.push(*lease_until);
                nows.push(*now);
                expiries.push(*expires_at);
            }
        }
        let rows = client
            .query(&stmt, &[&scopes, &keys, &fps, &leases, &nows, &expiries])
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
            let found = ClaimRow::read(&row, 2)?;
            // A takeover returns the lease it took and the record as it stood: the lease wins.
            match answers.get(&i) {
                Some(seen) if seen.taken => {}
                _ => {
                    answers.insert(i, found);
                }
            }
        }
        Ok(answers
            .into_iter()
            .map(|(i, row)| (i, Outcome::Claim(row)))
            .collect())
    })
}

/// Completions, failures or releases (all of one kind) in one statement.
fn change_many<'a>(client: &'a Object, ops: &'a [&'a Op], indices: Vec<usize>) -> Group<'a> {
    if let [i] = indices[..] {
        return single(client, ops, i);
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
        for &i in &indices {
            let (scope, key) = ops[i].row_key();
            scopes.push(scope);
            keys.push(key);
            match ops[i] {
                Op::Complete {
                    token,
                    http_status,
                    body,
                    headers: h,
                    keep_until,
                    ..
                } => {
                    tokens.push(*token);
                    statuses.push(*http_status);
                    bodies.push(&body[..]);
                    headers.push(h.as_str());
                    keeps.push(*keep_until);
                }
                Op::Fail {
                    token, keep_until, ..
                } => {
                    tokens.push(*token);
                    keeps.push(*keep_until);
                }
                Op::Release { token, .. } => tokens.push(*token),
                Op::Claim { .. } => {}
            }
        }
        let rows = match ops[indices[0]] {
            Op::Complete { .. } => {
                let stmt = client.prepare_cached(COMPLETE_MANY_SQL).await?;
                client
                    .query(
                        &stmt,
                        &[
                            &scopes, &keys, &tokens, &statuses, &bodies, &headers, &keeps,
                        ],
                    )
                    .await?
            }
            Op::Fail { .. } => {
                let stmt = client.prepare_cached(FAIL_MANY_SQL).await?;
                client
                    .query(&stmt, &[&scopes, &keys, &tokens, &keeps])
                    .await?
            }
            Op::Release { .. } | Op::Claim { .. } => {
                let stmt = client.prepare_cached(RELEASE_MANY_SQL).await?;
                client.query(&stmt, &[&scopes, &keys, &tokens]).await?
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

async fn run_one(client: &Object, op: &Op) -> Result<Outcome, tokio_postgres::Error> {
    match op {
        Op::Claim {
            scope,
            key,
            fingerprint,
            lease_until,
            now,
            expires_at,
        } => {
            let stmt = client.prepare_cached(CLAIM_SQL).await?;
            let row = client
                .query_opt(
                    &stmt,
                    &[scope, key, fingerprint, lease_until, now, expires_at],
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
                    ],
                )
                .await?;
            Ok(Outcome::Changed(n))
        }
        Op::Fail {
            scope,
            key,
            token,
            keep_until,
        } => {
            let stmt = client.prepare_cached(FAIL_SQL).await?;
            let n = client
                .execute(&stmt, &[scope, key, token, keep_until])
                .await?;
            Ok(Outcome::Changed(n))
        }
        Op::Release { scope, key, token } => {
            let stmt = client.prepare_cached(RELEASE_SQL).await?;
            let n = client.execute(&stmt, &[scope, key, token]).await?;
            Ok(Outcome::Changed(n))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a new, empty table (where the planner, left to itself, reads the whole table: cheap
    /// then, but a connection keeps that plan as the table grows), every array statement,
    /// planned as in a batch, reaches the table by its primary key only: no sequential scan,
    /// no hash or merge join.
    #[tokio::test]
    async fn batch_statements_look_rows_up_by_primary_key_on_a_new_table() {
        if !crate::test_services::postgres() {
            return;
        }
        let url = crate::test_services::postgres_url();
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect to the test database");
        tokio::spawn(connection);
        let schema = format!(
            "batch_plans_{}_{}",
            std::process::id(),
            rand::random::<u32>()
        );
        client
            .batch_execute(&format!(
                "CREATE SCHEMA {schema}; SET search_path = {schema}; {}",
                crate::idempotency::postgres::MIGRATION
            ))
            .await
            .expect("create table");
        let (s, k, n) = ("'{s,s,s,s}'", "'{a,b,c,d}'", "'{5,5,5,5}'");
        let statements = [
            (
                CLAIM_MANY_SQL,
                format!("{s}, {k}, '{{f,f,f,f}}', {n}, {n}, {n}"),
            ),
            (
                COMPLETE_MANY_SQL,
                format!("{s}, {k}, {n}, '{{201,201,201,201}}', '{{x,x,x,x}}', '{{h,h,h,h}}', {n}"),
            ),
            (FAIL_MANY_SQL, format!("{s}, {k}, {n}, {n}")),
            (RELEASE_MANY_SQL, format!("{s}, {k}, {n}")),
        ];
        let mut plans = Vec::new();
        for (i, (sql, args)) in statements.iter().enumerate() {
            client
                .batch_execute(&format!("PREPARE many{i} AS {sql}"))
                .await
                .expect("prepare");
            client.batch_execute(BEGIN_SQL).await.expect("begin");
            let rows = client
                .simple_query(&format!("EXPLAIN EXECUTE many{i}({args})"))
                .await
                .expect("explain");
            client.batch_execute("ROLLBACK").await.expect("rollback");
            let plan: Vec<String> = rows
                .iter()
                .filter_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                    _ => None,
                })
                .collect();
            plans.push(plan.join("\n"));
        }
        client
            .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
            .expect("drop schema");
        for plan in plans {
            assert!(plan.contains("idempotency_key_pkey"), "{plan}");
            for whole_table in ["Seq Scan on idempotency_key", "Hash", "Merge"] {
                assert!(!plan.contains(whole_table), "{plan}");
            }
        }
    }
}
