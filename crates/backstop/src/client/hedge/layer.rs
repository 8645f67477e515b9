use tower_layer::Layer;

use super::Hedge;
use crate::hedge::HedgePolicy;

/// Applies [`Hedge`] with one method's [`HedgePolicy`].
#[derive(Debug, Clone)]
pub struct HedgeLayer {
    policy: HedgePolicy,
}

impl HedgeLayer {
    /// A layer hedging by `policy`.
    pub fn new(policy: HedgePolicy) -> Self {
        Self { policy }
    }
}

impl<S> Layer<S> for HedgeLayer {
    type Service = Hedge<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Hedge::new(inner, self.policy.clone())
    }
}
