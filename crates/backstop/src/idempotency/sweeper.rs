//! [`Sweeper`]: deletes expired records on a timer.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use super::{Store, StoreError};
use crate::clock::Clock;

/// A background task that calls [`Store::sweep`] every `interval`, in batches of `batch`
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
}

impl<S: Store, C: Clock> Sweeper<S, C> {
    /// A sweeper of `store`, reading "now" from `clock`; every 60 s, 1000 records per batch.
    pub fn new(store: S, clock: C) -> Self {
        Sweeper {
            store,
            clock,
            interval: Duration::from_secs(60),
            batch: 1_000,
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

    /// Sweeps once now: batches until one comes back short. Returns how many records went.
    pub async fn sweep_now(&self) -> Result<usize, StoreError> {
        let now_ms = self.clock.now_ms();
        let mut total = 0;
        loop {
            let deleted = self.store.sweep(now_ms, self.batch).await?;
            total += deleted;
            if deleted < self.batch {
                return Ok(total);
            }
            // Let other work (claims) through between batches.
            tokio::task::yield_now().await;
        }
    }

    /// Runs forever: a sweep at once, then every interval (a late tick is not made up for). A
    /// failed sweep is logged and retried at the next tick.
    pub async fn run(self) {
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            match self.sweep_now().await {
                Ok(0) => {}
                Ok(deleted) => tracing::debug!(deleted, "idempotency sweep"),
                Err(error) => tracing::warn!(%error, "idempotency sweep failed"),
            }
        }
    }

    /// Spawns [`Sweeper::run`] on the current tokio runtime. Abort the handle to stop it.
    pub fn start(self) -> JoinHandle<()> {
        tokio::spawn(self.run())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::idempotency::{
        Claim, ClaimRequest, Fingerprint, IdempotencyKey, MemoryStore, RecordStatus,
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
}
