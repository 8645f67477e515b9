//! What the two writers share: the queue a batch is taken from, and their counters.
//!
//! Every idle writer task waits on one queue, so a queued call finds a writer at once while any
//! is free. A writer takes the first call, waits for a connection for it, then takes everything
//! queued by then: every call queued while it waited joins its batch.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use tokio::sync::oneshot;
use tokio::time::{Instant, timeout_at};

use super::{Error, StartBy, WriterStats};

/// Calls queued before callers wait to enqueue.
const QUEUE: usize = 4096;

/// Starts `writers` tasks (at least one) running `drive` on one queue of `max_batch`-call
/// batches (at least one call), each batch bounded by `timeout` once sent. Answers the
/// queue's sending end and the counters the tasks keep; the tasks stop when every sender is
/// gone.
pub(super) fn spawn_writers<J, Fut>(
    pool: &Pool,
    writers: usize,
    max_batch: usize,
    timeout: Duration,
    drive: impl Fn(Pool, async_channel::Receiver<J>, usize, Duration, Arc<Counters>) -> Fut,
) -> (async_channel::Sender<J>, Arc<Counters>)
where
    Fut: Future<Output = ()> + Send + 'static,
{
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
    (tx, counters)
}

/// A queued call: by when it must start, and where its answer goes.
pub(super) trait Queued: Sized {
    /// What the call answers.
    type Answer;

    /// By when the call must have been sent.
    fn start(&self) -> StartBy;

    /// The caller's end of the answer.
    fn reply(&mut self) -> &mut oneshot::Sender<Result<Self::Answer, Error>>;

    /// Answers the caller (who may have left).
    fn answer(self, answer: Result<Self::Answer, Error>);
}

/// What [`next_batch`] found.
// Made once per batch and taken apart at once: boxing the connection would only add an
// allocation.
#[allow(clippy::large_enum_variant)]
pub(super) enum Next {
    /// The queue is closed: every handle is gone.
    Closed,
    /// Nothing to run this round (the calls taken were answered already).
    Nothing,
    /// The calls in the batch, to run on this connection.
    Batch(Object),
}

/// Waits for the next batch: the first queued call, a connection for it, then the rest of the
/// queue (up to `max_batch` calls in all) into `jobs`. A call whose caller is gone, or that can
/// no longer start in time, is answered and left out: never write what nobody will hear of.
pub(super) async fn next_batch<J: Queued>(
    pool: &Pool,
    rx: &async_channel::Receiver<J>,
    max_batch: usize,
    jobs: &mut Vec<J>,
) -> Next {
    let Ok(mut first) = rx.recv().await else {
        return Next::Closed;
    };
    let start = first.start();
    let client = tokio::select! {
        got = timeout_at(start.until, pool.get()) => got,
        // The caller is gone: stop waiting on its behalf.
        () = first.reply().closed() => return Next::Nothing,
    };
    let client = match client {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => {
            first.answer(Err(Error::connect(e)));
            return Next::Nothing;
        }
        Err(_) => {
            first.answer(Err(start.missed()));
            return Next::Nothing;
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
    let (late, live): (Vec<_>, Vec<_>) = jobs.drain(..).partition(|job| job.start().until <= now);
    jobs.extend(live);
    for job in late {
        let missed = job.start().missed();
        job.answer(Err(missed));
    }
    jobs.retain_mut(|job| !job.reply().is_closed());
    if jobs.is_empty() {
        Next::Nothing
    } else {
        Next::Batch(client)
    }
}

/// Calls run and batches sent, for [`WriterStats`].
#[derive(Debug, Default)]
pub(super) struct Counters {
    jobs: AtomicU64,
    batches: AtomicU64,
}

impl Counters {
    /// Counts one batch of `jobs` calls.
    pub(super) fn batch(&self, jobs: usize) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.jobs.fetch_add(jobs as u64, Ordering::Relaxed);
    }

    pub(super) fn stats(&self) -> WriterStats {
        WriterStats {
            jobs: self.jobs.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
        }
    }
}
