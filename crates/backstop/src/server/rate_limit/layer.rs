use tower_layer::Layer;

use super::RateLimit;
use crate::admission::KeyedTokenBucket;

/// Applies [`RateLimit`]: per-tenant token buckets, 429 + `Retry-After` when empty.
///
/// Clones share the buckets.
#[derive(Debug, Clone)]
pub struct RateLimitLayer {
    buckets: KeyedTokenBucket,
}

impl RateLimitLayer {
    /// A layer spending from `buckets`, one bucket per tenant.
    pub fn new(buckets: KeyedTokenBucket) -> Self {
        Self { buckets }
    }

    /// The shared buckets.
    pub fn buckets(&self) -> &KeyedTokenBucket {
        &self.buckets
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, self.buckets.clone())
    }
}
