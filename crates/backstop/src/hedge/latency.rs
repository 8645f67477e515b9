//! A rolling window of recent latencies and its percentiles.

use std::time::Duration;

use crate::sample_window::SampleWindow;

/// The last `capacity` latencies of a destination, in a fixed ring.
#[derive(Debug)]
pub struct LatencyWindow {
    window: SampleWindow,
    min_samples: usize,
}

impl LatencyWindow {
    /// A window of the last `capacity` samples (at least one) that reports percentiles once it
    /// holds `min_samples` (at least one).
    pub fn new(capacity: usize, min_samples: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            window: SampleWindow::new(capacity),
            min_samples: min_samples.clamp(1, capacity),
        }
    }

    /// Records one latency.
    pub fn record(&self, latency: Duration) {
        self.window.record(latency);
    }

    /// The nearest-rank `q` quantile (`0 < q <= 1`) of the window, or `None` while it holds
    /// fewer than `min_samples` samples. It may lag the newest few samples: it is recomputed
    /// every few records, not on every read.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        self.window.quantile(q, self.min_samples)
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
