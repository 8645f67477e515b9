use tower_layer::Layer;

use super::{Limiter, RateLimit};
use crate::admission::KeyedTokenBucket;
#[cfg(feature = "redis")]
use crate::admission::redis::SharedLimiter;

/// Applies [`RateLimit`]: per-tenant token buckets, 429 + `Retry-After` when empty.
///
/// Clones share the buckets.
#[derive(Debug, Clone)]
pub struct RateLimitLayer {
    limiter: Limiter,
}

impl RateLimitLayer {
    /// A layer spending from `buckets`, one bucket per tenant, in this process.
    pub fn new(buckets: KeyedTokenBucket) -> Self {
        Self {
            limiter: Limiter::Local(buckets),
        }
    }

    /// A layer spending from buckets shared with other instances through Redis.
    #[cfg(feature = "redis")]
    pub fn shared(limiter: SharedLimiter) -> Self {
        Self {
            limiter: Limiter::Shared(limiter),
        }
    }

    /// The local buckets, when the limit is kept in this process.
    pub fn buckets(&self) -> Option<&KeyedTokenBucket> {
        match &self.limiter {
            Limiter::Local(buckets) => Some(buckets),
            #[cfg(feature = "redis")]
            Limiter::Shared(_) => None,
        }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::with_limiter(inner, self.limiter.clone())
    }
}
