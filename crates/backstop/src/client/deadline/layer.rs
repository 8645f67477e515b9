use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::{AttemptTimeout, SetDeadline};
use crate::deadline::Margin;

/// Applies [`SetDeadline`]: one deadline per logical call.
#[derive(Debug, Clone, Copy)]
pub struct SetDeadlineLayer {
    default: Duration,
}

impl SetDeadlineLayer {
    /// Calls get `default` from now, or the earlier deadline they carry (a
    /// [`Deadline`](crate::deadline::Deadline) extension) or run under
    /// ([`Deadline::current`](crate::deadline::Deadline::current)).
    pub fn new(default: Duration) -> Self {
        Self { default }
    }
}

impl<S> Layer<S> for SetDeadlineLayer {
    type Service = SetDeadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        SetDeadline::new(inner, self.default)
    }
}

/// Applies [`AttemptTimeout`]: per-attempt `grpc-timeout` with the peer's margin.
#[derive(Debug, Clone)]
pub struct AttemptTimeoutLayer {
    margin: Arc<Margin>,
}

impl AttemptTimeoutLayer {
    /// A layer keeping `margin` for the way back (share it per destination).
    pub fn new(margin: Arc<Margin>) -> Self {
        Self { margin }
    }
}

impl<S> Layer<S> for AttemptTimeoutLayer {
    type Service = AttemptTimeout<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AttemptTimeout::new(inner, self.margin.clone())
    }
}
