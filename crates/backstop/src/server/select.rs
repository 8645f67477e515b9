//! How the server layers find a request's [`MethodPolicy`]: one table, one rule.
//!
//! The idempotency layer (keyed or not, key TTL, body read first) and the rate limit (rate
//! class) read the same [`MethodPolicies`] the clients use, each through a [`PolicyLookup`],
//! so they can never disagree on which method a request is.

use std::sync::Arc;

use http::{Extensions, Request};

use crate::policy::{MethodPolicies, MethodPolicy};

/// Reads the route template the application's router matched from a request's extensions
/// (with axum: `|ext| ext.get::<MatchedPath>().map(MatchedPath::as_str)`).
pub type MatchedPathFn = for<'a> fn(&'a Extensions) -> Option<&'a str>;

/// A table and where to find the route the router matched.
#[derive(Debug, Clone)]
pub(crate) struct PolicyLookup {
    pub(crate) policies: Arc<MethodPolicies>,
    pub(crate) matched_path: Option<MatchedPathFn>,
}

impl PolicyLookup {
    /// The policy of `request`: by the route template its router matched when that is known,
    /// else by its method and path (a gRPC call by its `/package.Service/Method` path).
    pub(crate) fn policy_of<B>(&self, request: &Request<B>) -> &MethodPolicy {
        let matched = self.matched_path.and_then(|f| f(request.extensions()));
        let path = matched.unwrap_or_else(|| request.uri().path());
        self.policies.for_route(request.method(), path)
    }
}
