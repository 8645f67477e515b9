//! Per-key (per-tenant) token buckets with a hard bound on how many keys are held.
//!
//! A limiter keyed by tenant id is itself an attack surface: every new id costs memory, and
//! ids come from clients. So the map is bounded. A key's state is its GCRA TAT; a bucket whose
//! TAT has passed is full, and a full bucket is indistinguishable from one never created, so
//! forgetting it loses nothing. When a shard is at its bound, full buckets are swept out; when
//! every held bucket is still in use, a new key shares one *overflow* bucket with the same
//! quota. A flood of fresh tenant ids therefore costs no memory beyond the bound and gets, all
//! together, the rate of one tenant, while established tenants keep their own limits. A shard
//! is swept at most once a millisecond, so a flood cannot make each request pay for a scan.
//!
//! Keys are stored as 64-bit SipHash values under a random per-limiter key, never as the
//! client's bytes: memory per entry is fixed whatever the key's length, and two tenants can
//! only share a bucket by a 2^-64 accident that an outsider cannot steer.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::num::NonZeroUsize;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use super::token_bucket::{Cell, Quota};
use crate::clock::MonotonicClock;

/// Most shards a limiter splits its keys over.
const MAX_SHARDS: usize = 16;
/// Fewest keys per shard before a limiter uses more than one shard.
const MIN_KEYS_PER_SHARD: usize = 1024;
/// Bits of the key hash that pick the shard: neither the low bits (bucket index) nor the top
/// seven (control bytes) that the map itself uses.
const SHARD_SHIFT: u32 = 40;
/// Least time between two sweeps of one shard, so a flood cannot make every request pay for
/// a scan of the whole shard.
const SWEEP_GAP_NS: u64 = 1_000_000;

/// Token buckets per key, at most `max_keys` of them, plus one shared overflow bucket.
///
/// Cloning shares the state.
///
/// ```
/// use std::num::{NonZeroU32, NonZeroUsize};
/// use std::time::Duration;
/// use backstop::admission::{KeyedTokenBucket, Quota};
/// use backstop::clock::MonotonicClock;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let quota = Quota::per_second(NonZeroU32::new(5).unwrap(), NonZeroU32::new(1).unwrap());
/// let max_keys = NonZeroUsize::new(10_000).unwrap();
/// // tokio's clock, so that paused time holds still; `new` reads the CPU's counter.
/// let limiter = KeyedTokenBucket::with_clock(quota, max_keys, MonotonicClock::tokio());
/// assert!(limiter.check("tenant-a").is_ok());
/// assert_eq!(limiter.check("tenant-a"), Err(Duration::from_millis(200)));
/// // Another tenant has its own bucket.
/// assert!(limiter.check("tenant-b").is_ok());
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct KeyedTokenBucket {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    quota: Quota,
    clock: MonotonicClock,
    hasher: RandomState,
    shards: Box<[RwLock<Shard>]>,
    shard_mask: usize,
    shard_cap: usize,
    overflow: Cell,
}

#[derive(Debug, Default)]
struct Shard {
    buckets: HashMap<u64, Cell, BuildHasherDefault<Prehashed>>,
    /// No sweep can free a slot before this time (nanoseconds since the epoch): a lower bound
    /// on the TATs held.
    min_tat_ns: u64,
    /// No sweep runs before this time: the last sweep plus [`SWEEP_GAP_NS`].
    sweep_not_before_ns: u64,
}

/// Hasher for keys that already are hashes.
#[derive(Debug, Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

impl KeyedTokenBucket {
    /// Buckets of `quota` per key, holding at most `max_keys` keys (see [`max_keys`](Self::max_keys)).
    pub fn new(quota: Quota, max_keys: NonZeroUsize) -> Self {
        Self::with_clock(quota, max_keys, MonotonicClock::new())
    }

    /// [`new`](Self::new), reading time from `clock`.
    pub fn with_clock(quota: Quota, max_keys: NonZeroUsize, clock: MonotonicClock) -> Self {
        let max_keys = max_keys.get();
        let shards = prev_power_of_two((max_keys / MIN_KEYS_PER_SHARD).clamp(1, MAX_SHARDS));
        let shard_cap = max_keys / shards;
        Self {
            inner: Arc::new(Inner {
                quota,
                clock,
                hasher: RandomState::new(),
                shards: (0..shards).map(|_| RwLock::default()).collect(),
                shard_mask: shards - 1,
                shard_cap,
                overflow: Cell::new(),
            }),
        }
    }

    /// The clock the buckets read; its [`now_ns`](MonotonicClock::now_ns) is what
    /// [`check_at`](Self::check_at) takes.
    pub fn clock(&self) -> &MonotonicClock {
        &self.inner.clock
    }

    /// The quota each key gets.
    pub fn quota(&self) -> Quota {
        self.inner.quota
    }

    /// The bound on keys held: the configured `max_keys`, rounded down to a multiple of the
    /// shard count.
    pub fn max_keys(&self) -> usize {
        self.inner.shard_cap * self.inner.shards.len()
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| {
                s.read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .buckets
                    .len()
            })
            .sum()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes one token from `key`'s bucket, or says how long until one is available.
    #[inline]
    pub fn check(&self, key: &str) -> Result<(), Duration> {
        self.check_at(key, self.inner.clock.now_ns())
    }

    /// [`check`](Self::check) at `now_ns` on the limiter's [`clock`](Self::clock).
    pub fn check_at(&self, key: &str, now_ns: u64) -> Result<(), Duration> {
        let inner = &*self.inner;
        let hash = inner.hasher.hash_one(key);
        let shard = &inner.shards[(hash >> SHARD_SHIFT) as usize & inner.shard_mask];
        let (inc, tolerance) = (inner.quota.interval_ns(), inner.quota.tolerance_ns());
        {
            let read = shard.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(cell) = read.buckets.get(&hash) {
                return cell
                    .decide(now_ns, inc, tolerance)
                    .map_err(Duration::from_nanos);
            }
        }
        let mut write = shard.write().unwrap_or_else(PoisonError::into_inner);
        let shard = &mut *write;
        if !shard.buckets.contains_key(&hash) && shard.buckets.len() >= inner.shard_cap {
            shard.sweep(now_ns);
        }
        if shard.buckets.len() < inner.shard_cap || shard.buckets.contains_key(&hash) {
            let cell = shard.buckets.entry(hash).or_default();
            let decision = cell.decide(now_ns, inc, tolerance);
            shard.min_tat_ns = shard.min_tat_ns.min(cell.tat());
            return decision.map_err(Duration::from_nanos);
        }
        drop(write);
        inner
            .overflow
            .decide(now_ns, inc, tolerance)
            .map_err(Duration::from_nanos)
    }
}

impl Shard {
    /// Forgets full buckets, unless none can be full yet or the last sweep was too recent.
    fn sweep(&mut self, now_ns: u64) {
        if now_ns < self.min_tat_ns || now_ns < self.sweep_not_before_ns {
            return;
        }
        self.buckets.retain(|_, cell| !cell.is_full(now_ns));
        self.min_tat_ns = self.buckets.values().map(Cell::tat).min().unwrap_or(0);
        self.sweep_not_before_ns = now_ns.saturating_add(SWEEP_GAP_NS);
    }
}

fn prev_power_of_two(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU32;

    fn quota(rate: u32, burst: u32) -> Quota {
        Quota::per_second(
            NonZeroU32::new(rate).unwrap(),
            NonZeroU32::new(burst).unwrap(),
        )
    }

    fn nz(n: usize) -> NonZeroUsize {
        NonZeroUsize::new(n).unwrap()
    }

    /// A limiter on tokio's clock, for tests on paused time.
    fn paused(quota: Quota, max_keys: usize) -> KeyedTokenBucket {
        KeyedTokenBucket::with_clock(quota, nz(max_keys), MonotonicClock::tokio())
    }

    #[tokio::test(start_paused = true)]
    async fn keys_are_limited_independently() {
        let l = paused(quota(10, 2), 100);
        assert!(l.check("a").is_ok());
        assert!(l.check("a").is_ok());
        assert_eq!(l.check("a"), Err(Duration::from_millis(100)));
        assert!(l.check("b").is_ok());
        assert_eq!(l.len(), 2);
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(l.check("a").is_ok());
        assert!(l.check("a").is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn flood_of_new_keys_stays_bounded_and_established_limit_holds() {
        let l = paused(quota(10, 10), 1_000);
        assert_eq!(l.max_keys(), 1_000);
        // The established tenant spends its burst.
        for _ in 0..10 {
            assert!(l.check("acme").is_ok());
        }
        assert!(l.check("acme").is_err());

        let mut flood_granted = 0;
        for i in 0..100_000u32 {
            if i % 1_000 == 0 {
                // 100 ms over the whole flood: one token back for acme at the end.
                tokio::time::advance(Duration::from_millis(1)).await;
                assert!(l.len() <= l.max_keys());
            }
            if l.check(&format!("tenant-{i}")).is_ok() {
                flood_granted += 1;
            }
            assert!(l.len() <= l.max_keys(), "{} keys after {i}", l.len());
        }
        assert!(l.len() <= 1_000);
        // The flood got far fewer grants than its 100k keys would have had on their own:
        // its own slots (at most the bound) plus the shared overflow bucket.
        assert!(flood_granted < 1_000 + 10 + 1, "{flood_granted}");

        // acme was never evicted while it was in use: exactly its earned token now.
        assert!(l.check("acme").is_ok());
        assert_eq!(l.check("acme"), Err(Duration::from_millis(100)));
    }

    #[tokio::test(start_paused = true)]
    async fn full_buckets_are_forgotten_to_make_room() {
        let l = paused(quota(10, 1), 2);
        assert!(l.check("a").is_ok());
        assert!(l.check("b").is_ok());
        // Full of active keys: "c" shares the overflow bucket.
        assert!(l.check("c").is_ok());
        assert_eq!(l.check("d"), Err(Duration::from_millis(100)));
        assert_eq!(l.len(), 2);
        // Once "a" and "b" refilled they can be forgotten losslessly: "c" gets its own bucket.
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(l.check("c").is_ok());
        assert!(l.check("c").is_err());
        assert_eq!(l.len(), 1);
        // "a" comes back with a full bucket, as if it had been held all along.
        assert!(l.check("a").is_ok());
        assert!(l.check("a").is_err());
    }

    #[test]
    fn sweeps_are_spaced_out() {
        const MS: u64 = 1_000_000;
        let mut shard = Shard::default();
        for (key, full_at) in [(0u64, 10 * MS), (1, 10 * MS + MS / 2), (2, 30 * MS)] {
            let cell = shard.buckets.entry(key).or_default();
            cell.decide(0, full_at, u64::MAX).unwrap();
        }
        shard.sweep(0);
        assert_eq!(shard.buckets.len(), 3);
        assert_eq!(shard.min_tat_ns, 10 * MS);
        // Nothing can be full before the smallest TAT: no scan.
        shard.sweep(9 * MS);
        assert_eq!(shard.sweep_not_before_ns, MS);
        shard.sweep(10 * MS);
        assert_eq!(shard.buckets.len(), 2);
        // Key 1 is full at 10.5 ms, but a sweep within 1 ms of the last one is skipped.
        shard.sweep(10 * MS + MS / 2);
        assert_eq!(shard.buckets.len(), 2);
        shard.sweep(11 * MS);
        assert_eq!(shard.buckets.len(), 1);
        shard.sweep(30 * MS);
        assert!(shard.buckets.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn long_keys_cost_no_extra_memory() {
        let l = paused(quota(1, 1), 4);
        let long = "x".repeat(100_000);
        assert!(l.check(&long).is_ok());
        assert!(l.check(&long).is_err());
        assert_eq!(l.len(), 1);
    }

    #[test]
    fn shard_layout() {
        let cases = [
            (1, 1, 1),
            (1_000, 1, 1_000),
            (2_048, 2, 2_048),
            (3_000, 2, 3_000),
            (100_001, 16, 100_000),
        ];
        for (max, shards, bound) in cases {
            let l = KeyedTokenBucket::new(quota(1, 1), nz(max));
            assert_eq!(l.inner.shards.len(), shards, "{max}");
            assert_eq!(l.max_keys(), bound, "{max}");
            assert!(l.max_keys() <= max);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn clones_share_state() {
        let a = paused(quota(1, 1), 8);
        let b = a.clone();
        assert!(a.check("t").is_ok());
        assert!(b.check("t").is_err());
        assert!(!b.is_empty());
    }
}
