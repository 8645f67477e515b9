use std::time::Duration;

use tower_layer::Layer;

use super::{DEFAULT_TIMEOUT, GateService};
use crate::admission::Gate;

/// Applies [`GateService`]: bounded concurrency with deadline-bounded waiting.
///
/// Clones share the gate.
#[derive(Debug, Clone)]
#[doc(alias = "concurrency limit", alias = "ConcurrencyLimitLayer")]
pub struct GateLayer {
    gate: Gate,
    default_timeout: Duration,
}

impl GateLayer {
    /// A layer admitting requests through `gate`.
    pub fn new(gate: Gate) -> Self {
        Self {
            gate,
            default_timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The timeout of a request that carries no deadline (10 s unless set).
    pub fn default_timeout(mut self, timeout: Duration) -> Self {
        self.default_timeout = timeout;
        self
    }

    /// The shared gate.
    pub fn gate(&self) -> &Gate {
        &self.gate
    }
}

impl<S> Layer<S> for GateLayer {
    type Service = GateService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GateService::new(inner, self.gate.clone(), self.default_timeout)
    }
}
