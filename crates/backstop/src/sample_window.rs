//! The last N samples of a duration and a quantile of them, read on every call.
//!
//! The per-peer margin (p99 of round trips) and the hedge delay (p95 of latencies) are read
//! once per attempt and fed once per attempt. Sorting the window on every read costs a copy,
//! an allocation and a lock held across it, on the hot path of every call; a quantile that
//! lags the window by a few samples changes nothing a caller could notice. So the quantile is
//! kept in an atomic and recomputed only after [`REFRESH`] new samples (or when asked for
//! another quantile).

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// New samples after which a read recomputes the quantile.
pub(crate) const REFRESH: u32 = 16;

/// `value` when nothing is cached.
const NONE: u64 = u64::MAX;

/// Up to this many largest samples are kept in one pass instead of selecting in a copy.
const TOP_K: usize = 8;

/// Recording is lock-free: every attempt of every caller of a destination records into the
/// same window, from any worker thread, and a lock there would be contended on every call.
#[derive(Debug)]
pub(crate) struct SampleWindow {
    /// Samples in nanoseconds, written round-robin.
    slots: Box<[AtomicU64]>,
    /// Samples ever recorded; the next slot is `recorded % slots.len()`.
    recorded: AtomicUsize,
    /// Samples recorded since the cached quantile was computed.
    stale: AtomicU32,
    /// Bits of the quantile (`f64`) the cache holds.
    cached_q: AtomicU64,
    /// The cached quantile in nanoseconds, or [`NONE`].
    value: AtomicU64,
}

impl SampleWindow {
    /// A window of the last `capacity` samples (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            slots: (0..capacity.max(1)).map(|_| AtomicU64::new(0)).collect(),
            recorded: AtomicUsize::new(0),
            stale: AtomicU32::new(0),
            cached_q: AtomicU64::new(0),
            value: AtomicU64::new(NONE),
        }
    }

    /// Records one sample.
    pub(crate) fn record(&self, sample: Duration) {
        let nanos = u64::try_from(sample.as_nanos()).unwrap_or(NONE - 1);
        let n = self.recorded.fetch_add(1, Ordering::Relaxed);
        self.slots[n % self.slots.len()].store(nanos, Ordering::Relaxed);
        self.stale.fetch_add(1, Ordering::Relaxed);
    }

    /// How many samples the window holds (at most its capacity).
    pub(crate) fn len(&self) -> usize {
        self.recorded.load(Ordering::Relaxed).min(self.slots.len())
    }

    /// The nearest-rank `q` quantile (`0 < q <= 1`) of the window, or `None` while it holds
    /// fewer than `min_samples` samples. At most [`REFRESH`] samples behind the window (a
    /// sample being written as the quantile is computed may be seen old or new).
    pub(crate) fn quantile(&self, q: f64, min_samples: usize) -> Option<Duration> {
        let cached = self.value.load(Ordering::Acquire);
        if cached != NONE
            && self.cached_q.load(Ordering::Relaxed) == q.to_bits()
            && self.stale.load(Ordering::Relaxed) < REFRESH
        {
            return Some(Duration::from_nanos(cached));
        }
        let len = self.recorded.load(Ordering::Relaxed).min(self.slots.len());
        if len < min_samples.max(1) {
            return None;
        }
        self.stale.store(0, Ordering::Relaxed);
        // Until the window is full, only the first `len` slots hold samples.
        let slots = &self.slots[..len];
        let rank = ((q.clamp(0.0, 1.0) * len as f64).ceil() as usize).clamp(1, len);
        // The rank-th smallest is the k-th largest. For a high quantile (a p99 keeps the margin)
        // k is small: one pass keeping the k largest, without copying the window.
        let k = len - rank + 1;
        let nanos = if k <= TOP_K {
            let mut top = [0u64; TOP_K];
            for slot in slots {
                let v = slot.load(Ordering::Relaxed);
                if v > top[k - 1] {
                    // Insert `v` into the descending `top[..k]`, dropping the smallest.
                    let at = top[..k].iter().position(|&t| v > t).unwrap_or(k - 1);
                    top.copy_within(at..k - 1, at + 1);
                    top[at] = v;
                }
            }
            top[k - 1]
        } else {
            let mut sorted: Vec<u64> = slots.iter().map(|s| s.load(Ordering::Relaxed)).collect();
            let (_, value, _) = sorted.select_nth_unstable(rank - 1);
            *value
        };
        self.cached_q.store(q.to_bits(), Ordering::Relaxed);
        self.value.store(nanos, Ordering::Release);
        Some(Duration::from_nanos(nanos))
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

    proptest::proptest! {
        /// The one-pass path for high quantiles and the selection path agree with a sort.
        #[test]
        fn quantile_is_the_nearest_rank_of_the_window(
            samples in proptest::collection::vec(0u64..1_000, 1..200),
            q in 0.01f64..=1.0,
        ) {
            let w = SampleWindow::new(128);
            for &s in &samples {
                w.record(Duration::from_nanos(s));
            }
            let mut kept: Vec<u64> = if samples.len() > 128 {
                // The window holds the last 128, in slot order.
                let mut slots = vec![0; 128];
                for (i, &s) in samples.iter().enumerate() {
                    slots[i % 128] = s;
                }
                slots
            } else {
                samples.clone()
            };
            kept.sort_unstable();
            let rank = ((q * kept.len() as f64).ceil() as usize).clamp(1, kept.len());
            proptest::prop_assert_eq!(
                w.quantile(q, 1),
                Some(Duration::from_nanos(kept[rank - 1]))
            );
        }
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
