use tower_layer::Layer;

use super::TransparentRetry;
use crate::retry::RetryBudget;

/// Applies [`TransparentRetry`].
#[derive(Debug, Clone, Default)]
pub struct TransparentRetryLayer {
    budget: Option<RetryBudget>,
}

impl TransparentRetryLayer {
    /// Re-sends without spending a budget.
    pub fn new() -> Self {
        Self::default()
    }

    /// Re-sends spend from `budget` (the destination's).
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }
}

impl<S: Clone> Layer<S> for TransparentRetryLayer {
    type Service = TransparentRetry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TransparentRetry::new(inner, self.budget.clone())
    }
}
