use std::sync::Arc;

use tower_layer::Layer;

use super::{Classes, Limiter, RateLimit};
use crate::admission::KeyedTokenBucket;
#[cfg(feature = "redis")]
use crate::admission::redis::SharedLimiter;
use crate::policy::MethodPolicies;
use crate::server::select::{MatchedPathFn, PolicyLookup, TableSource};

/// Applies [`RateLimit`]: per-tenant token buckets, 429 + `Retry-After` when empty.
///
/// With [`policies`](Self::policies), a request spends from the buckets of its method's rate
/// class when that class was given its own ([`class`](Self::class)), else from the default
/// ones.
///
/// Clones share the buckets.
#[derive(Debug, Clone)]
pub struct RateLimitLayer {
    limiter: Limiter,
    classes: Option<Arc<Classes>>,
}

impl RateLimitLayer {
    /// A layer spending from `buckets`, one bucket per tenant, in this process.
    pub fn new(buckets: KeyedTokenBucket) -> Self {
        Self {
            limiter: Limiter::Local(buckets),
            classes: None,
        }
    }

    /// A layer spending from buckets shared with other instances through Redis.
    #[cfg(feature = "redis")]
    pub fn shared(limiter: SharedLimiter) -> Self {
        Self {
            limiter: Limiter::Shared(limiter),
            classes: None,
        }
    }

    /// Gives the rate class `class` (see
    /// [`MethodPolicy::rate_class`](crate::policy::MethodPolicy::rate_class)) its own
    /// per-tenant `buckets`, in this process. A class named twice keeps the last buckets.
    pub fn class(self, class: impl Into<String>, buckets: KeyedTokenBucket) -> Self {
        self.with_class(class.into(), Limiter::Local(buckets))
    }

    /// Gives the rate class `class` its own buckets shared through Redis (give each class's
    /// limiter its own key prefix).
    #[cfg(feature = "redis")]
    pub fn shared_class(self, class: impl Into<String>, limiter: SharedLimiter) -> Self {
        self.with_class(class.into(), Limiter::Shared(limiter))
    }

    /// The methods' policies, by which a request finds its rate class: the table the
    /// idempotency layer and the clients use.
    pub fn policies(self, policies: MethodPolicies) -> Self {
        self.policies_shared(TableSource::from(policies), None)
    }

    /// [`policies`](Self::policies), sharing a table other layers read too, looked up by the
    /// route the application's router matched when `matched_path` finds one.
    pub(crate) fn policies_shared(
        self,
        source: TableSource,
        matched_path: Option<MatchedPathFn>,
    ) -> Self {
        self.edit(|c| c.lookup = Some(PolicyLookup::new(source, matched_path)))
    }

    fn with_class(self, class: String, limiter: Limiter) -> Self {
        self.edit(|c| {
            c.limiters.retain(|(name, _)| **name != *class);
            c.limiters.push((class.into_boxed_str(), limiter));
        })
    }

    fn edit(mut self, f: impl FnOnce(&mut Classes)) -> Self {
        let mut classes = match self.classes.take() {
            Some(classes) => Arc::try_unwrap(classes).unwrap_or_else(|shared| Classes {
                lookup: shared.lookup.clone(),
                limiters: shared.limiters.clone(),
            }),
            None => Classes::default(),
        };
        f(&mut classes);
        self.classes = Some(Arc::new(classes));
        self
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
        RateLimit::with_limiter(inner, self.limiter.clone(), self.classes.clone())
    }
}
