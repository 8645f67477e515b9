//! [`Sweeper`]: expires records on a timer ([`Store::expire`]).

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use super::{Store, StoreError};
use crate::clock::Clock;

/// A background task that calls [`Store::expire`] every `interval`, in batches of `batch`
/// records, until a batch comes back short. The store itself guarantees that a running record
/// whose lease is live is never deleted, whatever the clock says.
///
/// Time: the schedule runs on tokio's clock (pausable in tests); "now" for the store comes from
/// the [`Clock`].
///
/// ```
/// use std::time::Duration;
/// use backstop::clock::SystemClock;
/// use backstop::idempotency::{MemoryStore, Sweeper};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let store = MemoryStore::new();
/// let task = Sweeper::new(store.clone(), SystemClock)
///     .interval(Duration::from_secs(60))
///     .batch(1_000)
///     .start();
/// // ... serve ...
/// task.abort();
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Sweeper<S, C> {
    store: S,
    clock: C,
    interval: Duration,
    batch: usize,
    share: f64,
}

impl<S: Store, C: Clock> Sweeper<S, C> {
    /// A sweeper of `store`, reading "now" from `clock`; every 60 s, [`DEFAULT_BATCH`] records
    /// per batch, taking at most [`DEFAULT_SHARE`] of the store's time.
    pub fn new(store: S, clock: C) -> Self {
        Sweeper {
            store,
            clock,
            interval: Duration::from_secs(60),
            batch: DEFAULT_BATCH,
            share: DEFAULT_SHARE,
        }
    }

    /// Spawns a sweeper of `store` running every `interval` (on the current tokio runtime),
    /// with the default batch. Abort the handle to stop it.
    pub fn spawn(store: S, clock: C, interval: Duration) -> JoinHandle<()> {
        Sweeper::new(store, clock).interval(interval).start()
    }

    /// Sets the time between sweeps (at least 1 ms).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Sets how many records one `sweep` call may delete (at least 1), bounding how long one
    /// statement holds the store.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// Sets the most of the store's time a sweep takes while it has more to delete, in
    /// `(0, 1]`: after each batch it waits `took x (1 / share - 1)`, so claims queued behind a
    /// batch find the store free for a while before the next one (1.0: no wait). A backlog of
    /// expired records (after an outage, or a first sweep of a large table) then goes at a
    /// bounded pace instead of holding the writer for seconds. Values outside the range are
    /// clamped.
    pub fn max_share(mut self, share: f64) -> Self {
        self.share = if share.is_nan() {
            DEFAULT_SHARE
        } else {
            share.clamp(0.01, 1.0)
        };
        self
    }

    /// Sweeps once now: batches until one comes back short, pausing between them as
    /// [`Sweeper::max_share`] says. Returns how many records went.
    pub async fn sweep_now(&self) -> Result<usize, StoreError> {
        let now_ms = self.clock.now_ms();
        let mut total = 0;
        loop {
            let started = tokio::time::Instant::now();
            let deleted = self.store.expire(now_ms, self.batch).await?;
            total += deleted;
            if deleted < self.batch {
                return Ok(total);
            }
            let pause = pause_after(started.elapsed(), self.share);
            if pause.is_zero() {
                // Let other work (claims) through between batches.
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(pause).await;
            }
        }
    }

    /// Runs forever: a sweep at once, then every interval (a late tick is not made up for). A
    /// failed sweep is logged and retried at the next tick.
    pub async fn run(self) {
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let started = tokio::time::Instant::now();
            match self.sweep_now().await {
                Ok(0) => {}
                // At most once per interval, and what an operator asks first when latency moves.
                Ok(deleted) => tracing::info!(
                    deleted,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "idempotency sweep"
                ),
                Err(error) => tracing::warn!(%error, "idempotency sweep failed"),
            }
        }
    }

    /// Spawns [`Sweeper::run`] on the current tokio runtime. Abort the handle to stop it.
    pub fn start(self) -> JoinHandle<()> {
        tokio::spawn(self.run())
    }
}

/// Records one sweep statement deletes at most, by default: small enough that a claim
/// committed in the same transaction waits a few milliseconds for it, not tens.
pub const DEFAULT_BATCH: usize = 1_000;

/// Share of the store's time a sweep takes at most while it has a backlog, by default.
pub const DEFAULT_SHARE: f64 = 0.5;

/// The wait after a batch that took `took`, for the sweep to take at most `share` of the time.
fn pause_after(took: Duration, share: f64) -> Duration {
    if share >= 1.0 {
        return Duration::ZERO;
    }
    took.mul_f64(1.0 / share - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::idempotency::{
        Claim, ClaimRequest, Fingerprint, IdempotencyKey, Lease, MemoryStore, Record, RecordStatus,
        StoredResponse,
    };

    const T0: i64 = 1_700_000_000_000;

    async fn claim(store: &MemoryStore, key: &str, lease_ms: u64, ttl_ms: u64) {
        let req = ClaimRequest {
            scope: "s".into(),
            key: IdempotencyKey::new(key).unwrap(),
            fingerprint: Fingerprint::of_bytes("M", b""),
            lease: Duration::from_millis(lease_ms),
            ttl: Duration::from_millis(ttl_ms),
            now_ms: T0,
        };
        let Claim::Claimed(lease) = store.claim(req).await.unwrap() else {
            panic!("not claimed")
        };
        if lease_ms < 1_000 {
            store.fail(&lease, T0).await.unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn sweeps_expired_records_every_interval_but_not_live_leases() {
        let store = MemoryStore::new();
        let clock = ManualClock::new(T0);
        claim(&store, "failed", 10, 10).await;
        claim(&store, "live", 60_000, 10).await;
        let task = Sweeper::spawn(store.clone(), clock.clone(), Duration::from_secs(1));

        // The sweep at t=0 saw nothing expired.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(store.len(), 2);

        // Records expire on the wall clock; the sweep at t=1s removes them.
        clock.set(T0 + 20);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(store.len(), 1);
        let live = IdempotencyKey::new("live").unwrap();
        let rec = store.get("s", &live).await.unwrap().unwrap();
        assert_eq!(rec.status, RecordStatus::Running);

        // Its lease ends; the next sweep takes it.
        clock.set(T0 + 60_000);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(store.is_empty());
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn one_sweep_drains_every_batch() {
        let store = MemoryStore::new();
        for i in 0..25 {
            claim(&store, &format!("k{i}"), 10, 10).await;
        }
        let sweeper = Sweeper::new(store.clone(), ManualClock::new(T0 + 1_000)).batch(10);
        assert_eq!(sweeper.sweep_now().await.unwrap(), 25);
        assert!(store.is_empty());
        assert_eq!(sweeper.sweep_now().await.unwrap(), 0);
    }

    /// A memory store whose every sweep statement takes 10 ms (of tokio's paused clock).
    #[derive(Clone)]
    struct SlowSweeps(MemoryStore);

    impl Store for SlowSweeps {
        type Writes<T: Send + 'static> = crate::idempotency::memory::MemoryWrites<T>;
        async fn commit_phase<T: Send + 'static>(
            &self,
            lease: &Lease,
            point: crate::idempotency::RecoveryPoint,
            writes: Self::Writes<T>,
        ) -> Result<T, StoreError> {
            self.0.commit_phase(lease, point, writes).await
        }
        async fn finish(
            &self,
            lease: &Lease,
            ending: crate::idempotency::Ending,
            now_ms: i64,
            writes: Self::Writes<()>,
        ) -> Result<(), StoreError> {
            self.0.finish(lease, ending, now_ms, writes).await
        }
        async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
            self.0.claim(req).await
        }
        async fn complete(
            &self,
            lease: &Lease,
            response: StoredResponse,
            now_ms: i64,
        ) -> Result<(), StoreError> {
            self.0.complete(lease, response, now_ms).await
        }
        async fn fail(&self, lease: &Lease, now_ms: i64) -> Result<(), StoreError> {
            self.0.fail(lease, now_ms).await
        }
        async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
            self.0.release(lease).await
        }
        async fn get(
            &self,
            scope: &str,
            key: &IdempotencyKey,
        ) -> Result<Option<Record>, StoreError> {
            self.0.get(scope, key).await
        }
        async fn sweep(&self, now_ms: i64, limit: usize) -> Result<usize, StoreError> {
            tokio::time::sleep(Duration::from_millis(10)).await;
            self.0.sweep(now_ms, limit).await
        }
    }

    /// How long one `sweep_now` of 25 expired records in batches of 10 takes with `share`.
    async fn sweep_time(share: f64) -> Duration {
        let store = MemoryStore::new();
        for i in 0..25 {
            claim(&store, &format!("k{i}"), 10, 10).await;
        }
        let sweeper = Sweeper::new(SlowSweeps(store.clone()), ManualClock::new(T0 + 1_000))
            .batch(10)
            .max_share(share);
        let started = tokio::time::Instant::now();
        assert_eq!(sweeper.sweep_now().await.unwrap(), 25);
        assert!(store.is_empty());
        started.elapsed()
    }

    #[tokio::test(start_paused = true)]
    async fn a_backlog_is_swept_at_the_pace_its_share_allows() {
        // Three statements of 10 ms; after each full batch a pause of 10 ms x (1/share - 1).
        assert_eq!(sweep_time(1.0).await, Duration::from_millis(30));
        assert_eq!(sweep_time(0.5).await, Duration::from_millis(50));
        assert_eq!(sweep_time(0.25).await, Duration::from_millis(90));
    }

    #[test]
    fn the_share_is_clamped() {
        let sweeper =
            |share| Sweeper::new(MemoryStore::new(), ManualClock::new(T0)).max_share(share);
        assert_eq!(sweeper(2.0).share, 1.0);
        assert_eq!(sweeper(0.0).share, 0.01);
        assert_eq!(sweeper(f64::NAN).share, DEFAULT_SHARE);
        assert_eq!(pause_after(Duration::from_millis(8), 1.0), Duration::ZERO);
        assert_eq!(
            pause_after(Duration::from_millis(8), 0.25),
            Duration::from_millis(24)
        );
    }
}
