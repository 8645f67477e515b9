//! The last N samples of a duration and a quantile of them, read on every call.
//!
//! The per-peer margin (p99 of round trips) and the hedge delay (p95 of latencies) are read
//! once per attempt and fed once per attempt. Sorting the window on every read costs a copy,
//! an allocation and a lock held across it, on the hot path of every call; a quantile that
//! lags the window by a few samples changes nothing a caller could notice. So the quantile is
//! kept in an atomic and recomputed only after [`REFRESH`] new samples (or when asked for
//! another quantile).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// New samples after which a read recomputes the quantile.
pub(crate) const REFRESH: u32 = 16;

/// `value` when nothing is cached.
const NONE: u64 = u64::MAX;

#[derive(Debug)]
pub(crate) struct SampleWindow {
    ring: Mutex<Ring>,
    /// Samples recorded since the cached quantile was computed.
    stale: AtomicU32,
    /// Bits of the quantile (`f64`) the cache holds.
    cached_q: AtomicU64,
    /// The cached quantile in nanoseconds, or [`NONE`].
    value: AtomicU64,
}

#[derive(Debug)]
struct Ring {
    samples: Vec<Duration>,
    next: usize,
    capacity: usize,
}

impl SampleWindow {
    /// A window of the last `capacity` samples (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            ring: Mutex::new(Ring {
                samples: Vec::with_capacity(capacity),
                next: 0,
                capacity,
            }),
            stale: AtomicU32::new(0),
            cached_q: AtomicU64::new(0),
            value: AtomicU64::new(NONE),
        }
    }

    /// Records one sample.
    pub(crate) fn record(&self, sample: Duration) {
        {
            let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
            if ring.samples.len() < ring.capacity {
                ring.samples.push(sample);
            } else {
                let i = ring.next;
                ring.samples[i] = sample;
            }
            ring.next = (ring.next + 1) % ring.capacity;
        }
        self.stale.fetch_add(1, Ordering::Relaxed);
    }

    /// The nearest-rank `q` quantile (`0 < q <= 1`) of the window, or `None` while it holds
    /// fewer than `min_samples` samples. At most [`REFRESH`] samples behind the window.
    pub(crate) fn quantile(&self, q: f64, min_samples: usize) -> Option<Duration> {
        let cached = self.value.load(Ordering::Acquire);
        if cached != NONE
            && self.cached_q.load(Ordering::Relaxed) == q.to_bits()
            && self.stale.load(Ordering::Relaxed) < REFRESH
        {
            return Some(Duration::from_nanos(cached));
        }
        // Selected on a copy: the ring's order is what tells the oldest sample apart.
        let mut sorted = {
            let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
            if ring.samples.len() < min_samples.max(1) {
                return None;
            }
            self.stale.store(0, Ordering::Relaxed);
            ring.samples.clone()
        };
        let n = sorted.len();
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as usize).clamp(1, n);
        let (_, value, _) = sorted.select_nth_unstable(rank - 1);
        let value = *value;
        let nanos = u64::try_from(value.as_nanos()).unwrap_or(NONE - 1);
        self.cached_q.store(q.to_bits(), Ordering::Relaxed);
        self.value.store(nanos, Ordering::Release);
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn quantile_follows_the_window_within_the_refresh() {
        let w = SampleWindow::new(100);
        assert_eq!(w.quantile(0.95, 10), None);
        for ms in 1..=100 {
            w.record(ms * MS);
        }
        assert_eq!(w.quantile(0.95, 10), Some(95 * MS));
        // A few new samples may be ignored for a while ...
        for _ in 0..REFRESH - 1 {
            w.record(1000 * MS);
        }
        assert_eq!(w.quantile(0.95, 10), Some(95 * MS));
        // ... but never more than REFRESH of them.
        w.record(1000 * MS);
        assert_eq!(w.quantile(0.95, 10), Some(1000 * MS));
        // Another quantile is computed afresh: 1..=16 rolled out, 17..=100 and 16 x 1000 left.
        assert_eq!(w.quantile(0.5, 10), Some(66 * MS));
    }

    #[test]
    fn the_oldest_sample_rolls_out_first() {
        let w = SampleWindow::new(8);
        for ms in [5, 1, 7, 3, 8, 2, 6, 4] {
            w.record(ms * MS);
        }
        assert_eq!(w.quantile(1.0, 1), Some(8 * MS));
        // Five new samples replace 5, 1, 7, 3 and 8: the largest left is 6.
        for _ in 0..5 {
            w.record(MS);
        }
        assert_eq!(w.quantile(0.0001, 1), Some(MS));
        assert_eq!(w.quantile(1.0, 1), Some(6 * MS));
        for _ in 0..REFRESH {
            w.record(MS);
        }
        assert_eq!(
            w.quantile(1.0, 1),
            Some(MS),
            "every old sample was overwritten"
        );
    }
}
