//! A rolling window of recent latencies and its percentiles.

use std::sync::Mutex;
use std::time::Duration;

/// The last `capacity` latencies of a destination, in a fixed ring.
#[derive(Debug)]
pub struct LatencyWindow {
    ring: Mutex<Ring>,
    min_samples: usize,
}

#[derive(Debug)]
struct Ring {
    samples: Vec<Duration>,
    next: usize,
    capacity: usize,
}

impl LatencyWindow {
    /// A window of the last `capacity` samples (at least one) that reports percentiles once it
    /// holds `min_samples` (at least one).
    pub fn new(capacity: usize, min_samples: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            ring: Mutex::new(Ring {
                samples: Vec::with_capacity(capacity),
                next: 0,
                capacity,
            }),
            min_samples: min_samples.clamp(1, capacity),
        }
    }

    /// Records one latency.
    pub fn record(&self, latency: Duration) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.samples.len() < ring.capacity {
            ring.samples.push(latency);
        } else {
            let i = ring.next;
            ring.samples[i] = latency;
        }
        ring.next = (ring.next + 1) % ring.capacity;
    }

    /// The nearest-rank `q` quantile (`0 < q <= 1`) of the window, or `None` while it holds
    /// fewer than `min_samples` samples.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let mut sorted = {
            let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
            if ring.samples.len() < self.min_samples {
                return None;
            }
            ring.samples.clone()
        };
        let n = sorted.len();
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as usize).clamp(1, n);
        let (_, value, _) = sorted.select_nth_unstable(rank - 1);
        Some(*value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p95_of_the_recent_window() {
        let w = LatencyWindow::new(100, 10);
        for ms in 1..=9 {
            w.record(Duration::from_millis(ms));
        }
        assert_eq!(w.quantile(0.95), None, "too few samples");
        for ms in 10..=100 {
            w.record(Duration::from_millis(ms));
        }
        assert_eq!(w.quantile(0.95), Some(Duration::from_millis(95)));
        // Old samples roll out.
        for _ in 0..100 {
            w.record(Duration::from_millis(7));
        }
        assert_eq!(w.quantile(0.95), Some(Duration::from_millis(7)));
    }
}
