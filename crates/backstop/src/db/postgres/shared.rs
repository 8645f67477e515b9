//! Group commit of arbitrary transactions: concurrent units of work share one transaction and
//! one WAL flush, each inside a savepoint of its own.
//!
//! The [batching writer](super::writer) groups statements it knows (it can put many claims in
//! one array statement); a phase of a handler is code it does not know: a closure that runs
//! its own statements on the connection. [`SharedTransactions`] runs such units the way the
//! SQLite writer does: a writer task takes a connection and everything queued (up to
//! `max_batch`), sends `BEGIN`, then runs each unit in turn inside `SAVEPOINT` (released when
//! the unit succeeds, rolled back to when it fails, so only its own caller sees its failure)
//! and one `COMMIT` for all. Each caller is answered after that COMMIT: its writes are durable,
//! or it learns that they were not made.
//!
//! - A unit runs on a writer task, never on its caller's: a caller that goes away cannot leave
//!   a connection inside an open transaction, and a unit once started always finishes (its
//!   caller may no longer hear of it, which is the same as a lost answer).
//! - A unit whose caller is gone, or whose start-by time passed, before it starts is dropped
//!   unrun: nothing is written for a caller that nobody answers.
//! - A batch where no unit asked for durability commits with `synchronous_commit = off`
//!   (such a unit is made durable by the next durable commit on the database).
//! - A unit that panics is rolled back to its savepoint and answered with an error; the writer
//!   goes on.
//! - A batch that does not finish by the latest start-by time of its units, and at least the
//!   writer's timeout, is abandoned with its connection (a connection left mid-transaction
//!   cannot be reused); its units are answered [`Error::Timeout`] and nothing of it commits.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use tokio::sync::oneshot;
use tokio::time::{Instant, timeout_at};

use super::queue::{Counters, Next, Queued, next_batch, spawn_writers};
use super::{Error, StartBy, WriterStats};

/// What a unit tells the writer: keep its writes, or roll them back.
type Kept = bool;

/// A type-erased unit: runs the caller's closure, leaves its result for the caller, and says
/// whether its writes are kept.
type Unit = Box<dyn for<'c> FnOnce(&'c Object) -> BoxFuture<'c, Kept> + Send>;

struct Job {
    unit: Unit,
    durable: bool,
    start: StartBy,
    /// Answered once the batch's COMMIT (or its failure) is known.
    done: oneshot::Sender<Result<(), Error>>,
}

impl Queued for Job {
    type Answer = ();

    fn start(&self) -> StartBy {
        self.start
    }

    fn reply(&mut self) -> &mut oneshot::Sender<Result<(), Error>> {
        &mut self.done
    }

    fn answer(self, answer: Result<(), Error>) {
        let _ = self.done.send(answer);
    }
}

/// Handle on the writer tasks that run units of work in shared transactions; they stop when
/// the last handle is dropped. See the [module docs](self).
#[derive(Clone)]
pub(crate) struct SharedTransactions {
    tx: async_channel::Sender<Job>,
    counters: Arc<Counters>,
}

impl fmt::Debug for SharedTransactions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedTransactions")
            .field("queued", &self.tx.len())
            .field("counters", &self.counters)
            .finish()
    }
}

impl SharedTransactions {
    /// Spawns `writers` writer tasks on the current runtime; `timeout` bounds a batch once
    /// started.
    pub(crate) fn start(pool: Pool, writers: usize, max_batch: usize, timeout: Duration) -> Self {
        let (tx, counters) = spawn_writers(&pool, writers, max_batch, timeout, drive);
        SharedTransactions { tx, counters }
    }

    /// Runs `work` inside a transaction shared with other units, within a savepoint of its
    /// own, and answers once that transaction committed: `Ok(Ok(value))` when `work` succeeded
    /// and its writes are committed (durably when `durable`); `Ok(Err(e))` when `work` failed
    /// and its writes were rolled back (the others' stand); `Err` when the batch did not
    /// commit (nothing of `work` was written) or its outcome is unknown (the connection was
    /// lost at the COMMIT), or when `work` could not start by `start.until` (not run).
    ///
    /// `work` must not run `BEGIN`/`COMMIT`/`ROLLBACK` (savepoints of its own are fine).
    pub(crate) async fn run<T, E>(
        &self,
        start: StartBy,
        durable: bool,
        work: impl for<'c> FnOnce(&'c Object) -> BoxFuture<'c, Result<T, E>> + Send + 'static,
    ) -> Result<Result<T, E>, Error>
    where
        T: Send + 'static,
        E: Send + 'static,
    {
        if start.until <= Instant::now() {
            return Err(start.missed());
        }
        let (result_tx, result_rx) = oneshot::channel::<Result<T, E>>();
        let unit: Unit = Box::new(move |client| {
            Box::pin(async move {
                let result = work(client).await;
                let kept = result.is_ok();
                let _ = result_tx.send(result);
                kept
            })
        });
        let (done, committed) = oneshot::channel();
        let job = Job {
            unit,
            durable,
            start,
            done,
        };
        match timeout_at(start.until, self.tx.send(job)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(Error::Closed),
            Err(_) => return Err(start.missed()),
        }
        committed.await.map_err(|_| Error::Closed)??;
        // The unit ran (or the writer would have answered an error): its result is there,
        // unless it panicked.
        result_rx.await.map_err(|_| Error::Panicked)
    }

    /// How many units ran, in how many transactions.
    pub(crate) fn stats(&self) -> WriterStats {
        self.counters.stats()
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
        let client = match next_batch(&pool, &rx, max_batch, &mut jobs).await {
            Next::Closed => return,
            Next::Nothing => continue,
            Next::Batch(client) => client,
        };
        counters.batch(jobs.len());
        let latest = jobs.iter().map(|job| job.start.until).max();
        let until = latest
            .unwrap_or_else(Instant::now)
            .max(Instant::now() + timeout);
        run_batch(client, &mut jobs, until).await;
    }
}

/// Runs every unit of `jobs` in one transaction on `client` and answers each (leaving `jobs`
/// empty), giving up at `until`.
async fn run_batch(client: Object, jobs: &mut Vec<Job>, until: Instant) {
    let durable = jobs.iter().any(|job| job.durable);
    let (units, done): (Vec<Unit>, Vec<_>) = jobs.drain(..).map(|job| (job.unit, job.done)).unzip();
    let outcome = match timeout_at(until, transaction(&client, units, durable)).await {
        Ok(outcome) => outcome.map_err(Arc::new),
        Err(_) => {
            // The connection may be mid-transaction: never hand it out again.
            drop(Object::take(client));
            for done in done {
                let _ = done.send(Err(Error::Timeout));
            }
            return;
        }
    };
    for done in done {
        let _ = done.send(outcome.clone().map_err(Error::Database));
    }
}

/// `BEGIN`, each unit inside a savepoint, `COMMIT`. Any error of the transaction itself (not
/// of a unit's statements, which its savepoint contains) means nothing was committed; an error
/// of the COMMIT may also mean that its outcome is unknown.
async fn transaction(
    client: &Object,
    units: Vec<Unit>,
    durable: bool,
) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute(if durable {
            "BEGIN; SAVEPOINT unit"
        } else {
            "BEGIN; SET LOCAL synchronous_commit = off; SAVEPOINT unit"
        })
        .await?;
    let last = units.len().saturating_sub(1);
    for (i, unit) in units.into_iter().enumerate() {
        // A panic is the unit's failure: its writes roll back, the others' stand.
        let kept = AssertUnwindSafe(unit(client))
            .catch_unwind()
            .await
            .unwrap_or(false);
        let next = match (kept, i == last) {
            (true, false) => "RELEASE SAVEPOINT unit; SAVEPOINT unit",
            (false, false) => "ROLLBACK TO SAVEPOINT unit",
            (true, true) => "COMMIT",
            (false, true) => "ROLLBACK TO SAVEPOINT unit; COMMIT",
        };
        client.batch_execute(next).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of one connection on a schema of its own holding `t (id INT PRIMARY KEY)`.
    async fn one_connection() -> (Pool, String) {
        let schema = format!("shared_tx_{}_{}", std::process::id(), rand::random::<u32>());
        let url = crate::test_services::postgres_url();
        let pool = super::super::pool(url.parse().expect("test URL"), 1, Duration::from_secs(5))
            .expect("pool");
        let c = pool.get().await.expect("connection");
        c.batch_execute(&format!(
            "CREATE SCHEMA {schema}; SET search_path = {schema}; \
             CREATE TABLE t (id INT PRIMARY KEY)"
        ))
        .await
        .expect("schema");
        (pool, schema)
    }

    async fn ids(pool: &Pool) -> Vec<i32> {
        let c = pool.get().await.expect("connection");
        let rows = c
            .query("SELECT id FROM t ORDER BY id", &[])
            .await
            .expect("select");
        rows.iter().map(|r| r.get(0)).collect()
    }

    async fn drop_schema(pool: &Pool, schema: &str) {
        let c = pool.get().await.expect("connection");
        c.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
            .expect("drop schema");
    }

    fn start_by(secs: u64) -> StartBy {
        StartBy {
            until: Instant::now() + Duration::from_secs(secs),
            by_request: false,
        }
    }

    fn insert(
        id: i32,
    ) -> impl for<'c> FnOnce(&'c Object) -> BoxFuture<'c, Result<u64, tokio_postgres::Error>>
    + Send
    + 'static {
        move |c| Box::pin(async move { c.execute("INSERT INTO t VALUES ($1)", &[&id]).await })
    }

    /// Units queued while the only connection is busy run as one batch: one transaction, the
    /// failing unit (a duplicate key, and a unit that panics) rolled back alone, every other
    /// unit committed, and each caller told its own outcome.
    #[tokio::test]
    async fn units_share_a_transaction_and_fail_alone() {
        if !crate::test_services::postgres() {
            return;
        }
        let (pool, schema) = one_connection().await;
        let shared = SharedTransactions::start(pool.clone(), 1, 64, Duration::from_secs(5));
        // Hold the only connection so that every unit queues behind it.
        let held = pool.get().await.expect("connection");
        let s = shared.clone();
        let first = tokio::spawn(async move { s.run(start_by(10), true, insert(1)).await });
        // Let the writer take the first unit and wait for the connection.
        while !shared.tx.is_empty() {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut units = Vec::new();
        for id in [2, 1, 3] {
            let s = shared.clone();
            units.push(tokio::spawn(async move {
                s.run(start_by(10), true, insert(id)).await
            }));
        }
        let s = shared.clone();
        let panics = tokio::spawn(async move {
            s.run(
                start_by(10),
                true,
                |c: &Object| -> BoxFuture<'_, Result<(), ()>> {
                    Box::pin(async move {
                        c.execute("INSERT INTO t VALUES (4)", &[])
                            .await
                            .expect("insert");
                        panic!("a unit that panics after writing");
                    })
                },
            )
            .await
        });
        let s = shared.clone();
        let last = tokio::spawn(async move { s.run(start_by(10), true, insert(5)).await });
        while shared.tx.len() < 5 {
            tokio::task::yield_now().await;
        }
        drop(held);

        assert!(matches!(first.await.unwrap(), Ok(Ok(1))));
        let outcomes: Vec<_> = futures_util::future::join_all(units).await;
        assert!(matches!(outcomes[0], Ok(Ok(Ok(1)))), "{:?}", outcomes[0]);
        let duplicate = outcomes[1]
            .as_ref()
            .unwrap()
            .as_ref()
            .unwrap()
            .as_ref()
            .unwrap_err();
        assert_eq!(
            duplicate.code(),
            Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
        );
        assert!(matches!(outcomes[2], Ok(Ok(Ok(1)))), "{:?}", outcomes[2]);
        assert!(matches!(panics.await.unwrap(), Err(Error::Panicked)));
        assert!(matches!(last.await.unwrap(), Ok(Ok(1))));
        assert_eq!(ids(&pool).await, [1, 2, 3, 5]);
        // The writer took the connection for the first unit, then everything queued by then:
        // all six in one transaction.
        assert_eq!(
            shared.stats(),
            WriterStats {
                jobs: 6,
                batches: 1
            }
        );
        drop_schema(&pool, &schema).await;
    }

    /// A unit whose caller went away before it started, or whose start-by time passed, is
    /// never run: nothing is written for a caller nobody answers.
    #[tokio::test]
    async fn a_unit_nobody_waits_for_is_not_run() {
        if !crate::test_services::postgres() {
            return;
        }
        let (pool, schema) = one_connection().await;
        let shared = SharedTransactions::start(pool.clone(), 1, 64, Duration::from_secs(5));
        let held = pool.get().await.expect("connection");
        let s = shared.clone();
        let gone = tokio::spawn(async move { s.run(start_by(10), true, insert(1)).await });
        let s = shared.clone();
        let late = tokio::spawn(async move {
            let start = StartBy {
                until: Instant::now() + Duration::from_millis(50),
                by_request: true,
            };
            s.run(start, true, insert(2)).await
        });
        // Whichever the writer took first waits for the held connection; by now `late` cannot
        // start in time.
        tokio::time::sleep(Duration::from_millis(100)).await;
        gone.abort();
        assert!(matches!(late.await.unwrap(), Err(Error::DeadlineExceeded)));
        drop(held);
        // A unit behind them runs, alone.
        assert!(matches!(
            shared.run(start_by(10), true, insert(3)).await,
            Ok(Ok(1))
        ));
        assert_eq!(ids(&pool).await, [3]);
        drop_schema(&pool, &schema).await;
    }
}
