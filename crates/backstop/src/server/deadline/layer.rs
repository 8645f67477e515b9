use std::time::Duration;

use tower_layer::Layer;

use super::{DEFAULT_MAX_TIMEOUT, DEFAULT_TIMEOUT, DeadlineService};

/// Applies [`DeadlineService`] to requests: `grpc-timeout` on arrival, 504 when it passes.
///
/// `Copy`-cheap to clone; the layer holds no other state.
#[derive(Debug, Clone, Copy)]
pub struct DeadlineLayer {
    default: Duration,
    max: Duration,
}

impl DeadlineLayer {
    /// A layer giving requests without `grpc-timeout` the budget `default` (clamped by the
    /// maximum, 60 s unless [`DeadlineLayer::max`] is set).
    pub fn new(default: Duration) -> Self {
        Self {
            default,
            max: DEFAULT_MAX_TIMEOUT,
        }
    }

    /// The largest budget a caller may ask for; larger `grpc-timeout` values are clamped to it.
    pub fn max(mut self, max: Duration) -> Self {
        self.max = max;
        self
    }

    /// The budget of a request without `grpc-timeout`.
    pub fn default_timeout(&self) -> Duration {
        self.default.min(self.max)
    }

    /// The largest budget a request can get.
    pub fn max_timeout(&self) -> Duration {
        self.max
    }
}

impl Default for DeadlineLayer {
    /// 10 s default budget, 60 s maximum.
    fn default() -> Self {
        Self::new(DEFAULT_TIMEOUT)
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = DeadlineService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DeadlineService::new(inner, self.default, self.max)
    }
}
