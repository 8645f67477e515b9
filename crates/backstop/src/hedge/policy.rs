//! [`HedgePolicy`]: when a destination's attempts are hedged, and what a hedge may spend.
//!
//! Apart from the client's layer so that the client stack's per-method settings and the storm
//! simulator can hold one without depending on the layer that reads them.

use std::sync::Arc;
use std::time::Duration;

use metrics::SharedString;
use tokio::time::Instant;

use super::latency::LatencyWindow;
use crate::retry::RetrySpend;

/// How a destination is hedged.
#[derive(Debug, Clone)]
pub struct HedgePolicy {
    spend: RetrySpend,
    latencies: Arc<LatencyWindow>,
    quantile: f64,
    min_delay: Duration,
    fixed_delay: Option<Duration>,
    max_hedges: u32,
    // The metric labels of the client's hedge layer.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    pub(crate) service: SharedString,
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    pub(crate) method: SharedString,
}

impl HedgePolicy {
    /// Samples in the latency window.
    pub const WINDOW: usize = 256;
    /// Samples needed before hedging starts.
    pub const MIN_SAMPLES: usize = 20;

    /// Hedge at the rolling p95, paying from `spend` (the destination's, or a
    /// [`RetryBudget`](crate::retry::RetryBudget) alone); `service` and `method` label
    /// `rpc_client_hedges_total`.
    pub fn new(
        spend: impl Into<RetrySpend>,
        service: impl Into<SharedString>,
        method: impl Into<SharedString>,
    ) -> Self {
        Self {
            spend: spend.into(),
            latencies: Arc::new(LatencyWindow::new(Self::WINDOW, Self::MIN_SAMPLES)),
            quantile: 0.95,
            min_delay: Duration::ZERO,
            fixed_delay: None,
            max_hedges: 1,
            service: service.into(),
            method: method.into(),
        }
    }

    /// Never hedge sooner than `delay`, whatever the p95.
    pub fn min_delay(mut self, delay: Duration) -> Self {
        self.min_delay = delay;
        self
    }

    /// Hedge after exactly `delay` (a gRPC `hedgingDelay`), or at the p95 with `None` (the
    /// default). A fixed delay needs no latency samples, so it hedges from the first call.
    pub fn fixed_delay(mut self, delay: Option<Duration>) -> Self {
        self.fixed_delay = delay;
        self
    }

    /// Sends up to `hedges` hedges per call (default 1, at least 1), each a delay after the one
    /// before, while no final answer has come; a failure that leaves the race open sends the
    /// next one at once. The call's
    /// [`HedgeAllowance`](crate::client::hedge::HedgeAllowance) counts them
    /// across its attempts, and each is paid for like the first.
    pub fn hedges(mut self, hedges: u32) -> Self {
        self.max_hedges = hedges.max(1);
        self
    }

    /// The most hedges a call may send.
    pub fn max_hedges(&self) -> u32 {
        self.max_hedges
    }

    /// The shortest delay before a hedge: the fixed delay if set, else the floor under the p95.
    pub fn min_hedge_delay(&self) -> Duration {
        self.fixed_delay.unwrap_or(self.min_delay)
    }

    /// Shares a latency window (e.g. one per destination across methods).
    pub fn latencies(mut self, window: Arc<LatencyWindow>) -> Self {
        self.latencies = window;
        self
    }

    /// The delay after which an attempt is hedged: the fixed delay if set, else the p95 (no
    /// sooner than the floor) once the window holds [`MIN_SAMPLES`](Self::MIN_SAMPLES).
    pub fn delay(&self) -> Option<Duration> {
        if let Some(delay) = self.fixed_delay {
            return Some(delay);
        }
        self.latencies
            .quantile(self.quantile)
            .map(|d| d.max(self.min_delay))
    }

    /// Hedge at the `quantile` (in `(0, 1]`) of recent latencies instead of the p95.
    pub fn quantile(mut self, quantile: f64) -> Self {
        self.quantile = quantile;
        self
    }

    /// Records the latency of a successful attempt in the window the delay is read from.
    pub fn record_latency(&self, latency: Duration) {
        self.latencies.record(latency);
    }

    /// What the hedges spend from.
    pub fn spend(&self) -> &RetrySpend {
        &self.spend
    }

    /// Whether a hedge may be sent at `now`, taking its token when it may (see
    /// [`RetrySpend::try_hedge_at`]).
    pub fn try_hedge_at(&self, now: Instant) -> bool {
        self.spend.try_hedge_at(now)
    }
}
