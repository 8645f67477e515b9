//! The batching writer: concurrent claims and outcomes share one transaction and one round trip.
//!
//! PostgreSQL makes a COMMIT durable with a WAL flush; a store that commits once per call pays
//! one flush, one round trip and one transaction per call. Here callers put their statement on
//! a queue; each of [`PostgresOptions::writers`](super::PostgresOptions::writers) writer tasks
//! takes everything queued (up to `max_batch`), and sends `BEGIN`, every statement and `COMMIT`
//! pipelined on one connection: one round trip and one flush for the whole batch. Each caller is
//! answered after the COMMIT that made its row durable.
//!
//! - A batch of one runs alone, in autocommit: no batching cost when there is no concurrency.
//! - Statements run in `(scope, key)` order, so two batches (on this instance or another) lock
//!   rows in the same order and cannot deadlock each other.
//! - If one statement fails, PostgreSQL aborts the batch's transaction and nothing of it was
//!   written; the statements then run again one by one, so only the failing caller sees its
//!   error.
//! - A caller that has given up (its deadline passed) is dropped from the batch before it runs.
//! - A batch that does not finish by the latest deadline of its callers is abandoned and its
//!   connection discarded (a connection left mid-pipeline cannot be reused).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use deadpool_postgres::{Object, Pool};
use futures_util::future::maybe_done;
use futures_util::poll;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::time::{Instant, timeout_at};
use tokio_postgres::Row;

use super::PgError;

/// Jobs queued before callers wait to enqueue.
const QUEUE: usize = 4096;

/// `INSERT` a running record, or take over a failed / expired one with the same fingerprint by
/// a conditional `DO UPDATE` (the row lock makes concurrent takeovers see each other: exactly one
/// wins); when neither happened, return the record as it stood.
pub(super) const CLAIM_SQL: &str = "\
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
pub(super) const COMPLETE_SQL: &str = "\
UPDATE idempotency_key SET status = 'succeeded', http_status = $4, response_body = $5, \
  response_headers = $6, expires_at = GREATEST(expires_at, $7) \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3";

/// Mark failed, if the lease still holds the record.
pub(super) const FAIL_SQL: &str = "\
UPDATE idempotency_key SET status = 'failed', expires_at = GREATEST(expires_at, $4) \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3";

/// Forget the key, if the lease still holds the record.
pub(super) const RELEASE_SQL: &str = "\
DELETE FROM idempotency_key \
WHERE scope = $1 AND key = $2 AND status = 'running' AND lease_until = $3";

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

/// What a statement returned.
#[derive(Debug)]
pub(super) enum Outcome {
    /// The claim statement's row (none: the record vanished between conflict and read).
    Claim(Option<Row>),
    /// Rows changed by an outcome statement.
    Changed(u64),
}

struct Job {
    op: Op,
    until: Instant,
    reply: oneshot::Sender<Result<Outcome, PgError>>,
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
pub(super) struct Writer {
    tx: mpsc::Sender<Job>,
    counters: Arc<Counters>,
}

impl Writer {
    /// Spawns `writers` writer tasks on the current runtime.
    pub(super) fn start(pool: Pool, writers: usize, max_batch: usize) -> Writer {
        let (tx, rx) = mpsc::channel(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let counters = Arc::new(Counters::default());
        for _ in 0..writers.max(1) {
            tokio::spawn(drive(
                pool.clone(),
                Arc::clone(&rx),
                max_batch.max(1),
                Arc::clone(&counters),
            ));
        }
        Writer { tx, counters }
    }

    /// Runs `op` in the next batch; gives up at `until`.
    pub(super) async fn run(&self, op: Op, until: Instant) -> Result<Outcome, PgError> {
        let (reply, answer) = oneshot::channel();
        let job = Job { op, until, reply };
        let waited = timeout_at(until, async {
            self.tx.send(job).await.map_err(|_| PgError::Closed)?;
            answer.await.map_err(|_| PgError::Closed)?
        })
        .await;
        waited.unwrap_or(Err(PgError::Timeout))
    }

    pub(super) fn stats(&self) -> WriterStats {
        WriterStats {
            jobs: self.counters.jobs.load(Ordering::Relaxed),
            batches: self.counters.batches.load(Ordering::Relaxed),
        }
    }
}

async fn drive(
    pool: Pool,
    rx: Arc<Mutex<mpsc::Receiver<Job>>>,
    max_batch: usize,
    counters: Arc<Counters>,
) {
    let mut jobs = Vec::with_capacity(max_batch);
    loop {
        // One writer at a time takes everything queued; the others run their batches meanwhile.
        if rx.lock().await.recv_many(&mut jobs, max_batch).await == 0 {
            return;
        }
        let now = Instant::now();
        jobs.retain(|job| {
            // The caller is gone (its deadline passed): never write what nobody will hear of.
            !job.reply.is_closed() && job.until > now
        });
        if jobs.is_empty() {
            continue;
        }
        // Stable: one key's statements keep their queue order.
        jobs.sort_by(|a, b| a.op.row_key().cmp(&b.op.row_key()));
        counters.batches.fetch_add(1, Ordering::Relaxed);
        counters
            .jobs
            .fetch_add(jobs.len() as u64, Ordering::Relaxed);
        run_batch(&pool, &mut jobs).await;
    }
}

/// Runs and answers every job of `jobs` (leaving it empty).
async fn run_batch(pool: &Pool, jobs: &mut Vec<Job>) {
    let until = jobs
        .iter()
        .map(|j| j.until)
        .max()
        .unwrap_or_else(Instant::now);
    let client = match timeout_at(until, pool.get()).await {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => {
            let e = Arc::new(e);
            return answer_all(jobs, || PgError::Connect(Arc::clone(&e)));
        }
        Err(_) => return answer_all(jobs, || PgError::Timeout),
    };
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
                let _ = job.reply.send(outcome.map_err(PgError::from));
            }
        }
        Ok(Err(e)) => {
            let e = Arc::new(e);
            answer_all(jobs, || PgError::Database(Arc::clone(&e)));
        }
        Err(_) => {
            // The connection may be mid-pipeline: never hand it out again.
            drop(Object::take(client));
            answer_all(jobs, || PgError::Timeout);
        }
    }
}

fn answer_all(jobs: &mut Vec<Job>, error: impl Fn() -> PgError) {
    for job in jobs.drain(..) {
        let _ = job.reply.send(Err(error()));
    }
}

/// `BEGIN`, the statements and `COMMIT`, pipelined: one round trip. Any failure means the
/// transaction was rolled back.
async fn run_in_transaction(
    client: &Object,
    ops: &[&Op],
) -> Result<Vec<Outcome>, tokio_postgres::Error> {
    // Prepared once per connection, then served from the connection's cache without waiting,
    // so each statement's first poll below sends it.
    for sql in [CLAIM_SQL, COMPLETE_SQL, FAIL_SQL, RELEASE_SQL] {
        client.prepare_cached(sql).await?;
    }
    // A request goes out when its future is first polled: poll each once, in order, so the
    // connection carries BEGIN, every statement, COMMIT, before awaiting any answer.
    let mut begin = Box::pin(maybe_done(client.batch_execute("BEGIN")));
    let _ = poll!(begin.as_mut());
    let mut statements: Vec<_> = ops
        .iter()
        .map(|op| Box::pin(maybe_done(run_one(client, op))))
        .collect();
    for statement in &mut statements {
        let _ = poll!(statement.as_mut());
    }
    let mut commit = Box::pin(maybe_done(client.batch_execute("COMMIT")));
    let _ = poll!(commit.as_mut());

    begin.as_mut().await;
    let mut out = Vec::with_capacity(statements.len());
    for statement in &mut statements {
        statement.as_mut().await;
        out.push(statement.as_mut().take_output());
    }
    commit.as_mut().await;
    begin.as_mut().take_output().unwrap_or(Ok(()))?;
    let mut outcomes = Vec::with_capacity(out.len());
    for outcome in out {
        // Taken once each, after it completed: never `None`.
        match outcome {
            Some(Ok(outcome)) => outcomes.push(outcome),
            Some(Err(e)) => return Err(e),
            None => unreachable!("a completed statement has an output"),
        }
    }
    // COMMIT of an aborted transaction rolls back without an error; the statements told us.
    commit.as_mut().take_output().unwrap_or(Ok(()))?;
    Ok(outcomes)
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
            Ok(Outcome::Claim(row))
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
