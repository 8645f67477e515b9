//! The batching writer: concurrent calls share one transaction and one round trip.
//!
//! PostgreSQL makes a COMMIT durable with a WAL flush; code that commits once per call pays
//! one flush, one round trip and one transaction per call. Here a call with nothing queued ahead
//! of it and a free pool connection runs at once on the caller's own task, alone, in autocommit:
//! no hand-off, no batching cost. When every connection is busy, calls queue up on one queue that
//! the writer tasks wait on. A writer takes the first queued call, waits for a connection, then
//! takes everything queued by then (up to `max_batch`) and sends `BEGIN`, the statements (as
//! the [`Statement`] type groups them: several calls may share one array statement) and
//! `COMMIT` pipelined on that connection: one round trip, one transaction and one flush for the
//! whole batch. Each caller is answered after the COMMIT that made its rows durable.
//!
//! - A batch of one runs alone, in autocommit: no batching cost when there is no concurrency.
//! - Calls run in [`Statement::lock_order`], so two batches (on this instance or another) lock
//!   rows in the same order and cannot deadlock each other.
//! - If one statement fails, PostgreSQL aborts the batch's transaction and nothing of it was
//!   written; the calls then run again one by one, so only the failing caller sees its error.
//! - A call whose start-by time passes before it runs is answered at once without being sent
//!   (nothing written); one whose caller went away is dropped before it runs.
//! - A call that was sent is always answered with what the database did: a caller that waits
//!   for its answer knows whether its write happened. A batch is waited for until the latest
//!   start-by time of its callers, and at least the writer's timeout; one that does not finish
//!   by then is abandoned and its connection discarded (a connection left mid-pipeline cannot
//!   be reused).
//!
//! The writer knows no table: what a call is, how it runs alone and how calls of one batch are
//! grouped into statements is the [`Statement`] implementation's business.

use std::cmp::Ordering as Order;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Object, Pool, PoolError, TimeoutType, Timeouts};
use futures_util::future::{BoxFuture, maybe_done};
use futures_util::poll;
use tokio::sync::oneshot;
use tokio::time::{Instant, timeout_at};

use super::Error;
use super::queue::{Counters, Next, Queued, next_batch, spawn_writers};

/// The answers of a group of a batch's calls sent as one statement, by index into the batch.
pub(crate) type Group<'a, T> = BoxFuture<'a, Result<Vec<(usize, T)>, tokio_postgres::Error>>;

/// One call the [`Writer`] runs: alone in autocommit, or with others in one pipelined
/// transaction.
pub(crate) trait Statement: Sized + Send + Sync + 'static {
    /// What a call answers.
    type Output: Send + 'static;

    /// Opens a batch's transaction (it may add `SET LOCAL` settings for the batch).
    const BEGIN: &'static str = "BEGIN";

    /// Statements prepared on a connection before a batch is pipelined on it, so that each
    /// group's first poll finds its statement prepared and sends it at once.
    const PREPARE: &'static [&'static str] = &[];

    /// The order the calls of a batch run in. Calls that lock the same rows must compare by
    /// those rows, so that every batch locks them in one order; the sort is stable, so calls
    /// that compare equal keep their queue order.
    fn lock_order(&self, other: &Self) -> Order;

    /// Runs the call alone, in autocommit (or inside the batch's transaction, when
    /// [`pipeline`](Statement::pipeline) sends it alone).
    fn run(
        &self,
        client: &Object,
    ) -> impl Future<Output = Result<Self::Output, tokio_postgres::Error>> + Send;

    /// The groups a batch's calls are sent as, inside the batch's transaction, in the order
    /// given; each answers for the indices into `batch` it covers. By default every call is
    /// its own group ([`alone`]).
    fn pipeline<'a>(client: &'a Object, batch: &'a [&'a Self]) -> Vec<Group<'a, Self::Output>> {
        (0..batch.len()).map(|i| alone(client, batch, i)).collect()
    }

    /// The answer of a call its group returned nothing for.
    fn unanswered(&self) -> Self::Output;
}

/// The group of the call `batch[i]` sent alone.
pub(crate) fn alone<'a, S: Statement>(
    client: &'a Object,
    batch: &'a [&'a S],
    i: usize,
) -> Group<'a, S::Output> {
    Box::pin(async move { Ok(vec![(i, batch[i].run(client).await?)]) })
}

/// By when a call must have been sent, and what it is answered when it was not.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StartBy {
    /// The latest instant the call may be sent.
    pub(crate) until: Instant,
    /// Whether `until` is the request's deadline (else the caller's timeout).
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

struct Job<S: Statement> {
    op: S,
    start: StartBy,
    reply: oneshot::Sender<Result<S::Output, Error>>,
}

impl<S: Statement> Queued for Job<S> {
    type Answer = S::Output;

    fn start(&self) -> StartBy {
        self.start
    }

    fn reply(&mut self) -> &mut oneshot::Sender<Result<S::Output, Error>> {
        &mut self.reply
    }

    fn answer(self, answer: Result<S::Output, Error>) {
        let _ = self.reply.send(answer);
    }
}

/// Counters of the batching writer (for tests and benchmarks): `jobs / batches` is the mean
/// batch size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriterStats {
    /// Statements run.
    pub jobs: u64,
    /// Round trips that carried them (batches, or single autocommit statements).
    pub batches: u64,
}

/// Handle on the writer tasks; they stop when the last handle is dropped.
pub(crate) struct Writer<S: Statement> {
    tx: async_channel::Sender<Job<S>>,
    pool: Pool,
    counters: Arc<Counters>,
    /// Bound on a statement once sent.
    timeout: Duration,
}

impl<S: Statement> Clone for Writer<S> {
    fn clone(&self) -> Self {
        Writer {
            tx: self.tx.clone(),
            pool: self.pool.clone(),
            counters: Arc::clone(&self.counters),
            timeout: self.timeout,
        }
    }
}

impl<S: Statement> fmt::Debug for Writer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Writer")
            .field("queued", &self.tx.len())
            .field("counters", &self.counters)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl<S: Statement> Writer<S> {
    /// Spawns `writers` writer tasks on the current runtime.
    /// `timeout` bounds a statement (or batch) once sent.
    pub(crate) fn start(pool: Pool, writers: usize, max_batch: usize, timeout: Duration) -> Self {
        let (tx, counters) = spawn_writers(&pool, writers, max_batch, timeout, drive::<S>);
        Writer {
            tx,
            pool,
            counters,
            timeout,
        }
    }

    /// Runs `op` at once on a free connection, or else in the next batch. Gives up without
    /// sending it when it cannot be sent by `start.until`; once sent, waits for its answer.
    pub(crate) async fn run(&self, op: S, start: StartBy) -> Result<S::Output, Error> {
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
        // with what the database did (bounded by the writer's timeout).
        answer.await.map_err(|_| Error::Closed)?
    }

    async fn run_at_once(
        &self,
        client: Object,
        op: &S,
        start: StartBy,
    ) -> Result<S::Output, Error> {
        self.counters.batch(1);
        let until = answer_by(start.until, self.timeout);
        match timeout_at(until, op.run(&client)).await {
            Ok(outcome) => Ok(outcome?),
            Err(_) => {
                // The connection may be mid-statement: never hand it out again.
                drop(Object::take(client));
                Err(Error::Timeout)
            }
        }
    }

    /// How many statements the writer ran, in how many round trips.
    pub(crate) fn stats(&self) -> WriterStats {
        self.counters.stats()
    }
}

async fn drive<S: Statement>(
    pool: Pool,
    rx: async_channel::Receiver<Job<S>>,
    max_batch: usize,
    timeout: Duration,
    counters: Arc<Counters>,
) {
    let mut jobs = Vec::with_capacity(max_batch);
    loop {
        let client = match next_batch(&pool, &rx, max_batch, &mut jobs).await {
            Next::Closed => return,
            Next::Nothing => continue,
            Next::Batch(client) => client,
        };
        // Stable: calls that compare equal (one row's statements) keep their queue order.
        jobs.sort_by(|a, b| a.op.lock_order(&b.op));
        counters.batch(jobs.len());
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
async fn run_batch<S: Statement>(client: Object, jobs: &mut Vec<Job<S>>, until: Instant) {
    let ops: Vec<&S> = jobs.iter().map(|j| &j.op).collect();
    let ran = timeout_at(until, async {
        if ops.len() == 1 {
            return Ok(vec![ops[0].run(&client).await]);
        }
        match run_in_transaction(&client, &ops).await {
            Ok(outcomes) => Ok(outcomes.into_iter().map(Ok).collect()),
            Err(e) if client.is_closed() => Err(e),
            // One statement failed and took the transaction with it: nothing was written.
            // Run each alone so only its own caller sees its error.
            Err(_) => {
                let mut outcomes = Vec::with_capacity(ops.len());
                for op in &ops {
                    outcomes.push(op.run(&client).await);
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

fn answer_all<S: Statement>(jobs: &mut Vec<Job<S>>, error: impl Fn() -> Error) {
    for job in jobs.drain(..) {
        let _ = job.reply.send(Err(error()));
    }
}

/// `BEGIN`, the batch's groups of statements and `COMMIT`, pipelined: one round trip. Any
/// failure means the transaction was rolled back.
async fn run_in_transaction<S: Statement>(
    client: &Object,
    ops: &[&S],
) -> Result<Vec<S::Output>, tokio_postgres::Error> {
    // Prepared once per connection, then served from the connection's cache without waiting,
    // so each group's first poll below sends its statement.
    for sql in S::PREPARE {
        client.prepare_cached(sql).await?;
    }
    let groups = S::pipeline(client, ops);

    // A request goes out when its future is first polled: poll each once, in order, so the
    // connection carries BEGIN, every statement, COMMIT, before awaiting any answer.
    let mut begin = Box::pin(maybe_done(client.batch_execute(S::BEGIN)));
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
    let mut outcomes: Vec<Option<S::Output>> = ops.iter().map(|_| None).collect();
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
    // Every group answers for each of its calls; a missing answer reads as the
    // implementation's `unanswered`.
    Ok(outcomes
        .into_iter()
        .zip(ops)
        .map(|(outcome, op)| outcome.unwrap_or_else(|| op.unanswered()))
        .collect())
}
