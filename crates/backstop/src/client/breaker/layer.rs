use tower_layer::Layer;

use super::{Breaker, CircuitBreaker};

/// Applies [`Breaker`] with one destination's [`CircuitBreaker`].
#[derive(Debug, Clone)]
pub struct BreakerLayer {
    breaker: CircuitBreaker,
}

impl BreakerLayer {
    /// A layer sharing `breaker` (clone it for every stack calling the same destination).
    pub fn new(breaker: CircuitBreaker) -> Self {
        Self { breaker }
    }
}

impl<S> Layer<S> for BreakerLayer {
    type Service = Breaker<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Breaker::new(inner, self.breaker.clone())
    }
}
