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

/// The request's policy as the outermost layer that reads the table selected it: the layers
/// after it (the rate limit, the intake, the idempotency layer) read this instead of matching
/// the route again. Only a layer reading the same table trusts it.
#[derive(Debug, Clone)]
pub(crate) struct Selected {
    table: Arc<MethodPolicies>,
    index: usize,
}

impl PolicyLookup {
    /// The policy of `request`: the one a layer before this one selected from the same table,
    /// else by the route template its router matched when that is known, else by its method
    /// and path (a gRPC call by its `/package.Service/Method` path).
    pub(crate) fn policy_of<B>(&self, request: &Request<B>) -> &MethodPolicy {
        self.policies.by_index(self.index_of(request))
    }

    /// [`policy_of`](Self::policy_of), remembered on `request` for the layers after this one:
    /// the outermost layer of a stack selects, the others read.
    pub(crate) fn select<B>(&self, request: &mut Request<B>) -> &MethodPolicy {
        let index = self.index_of(request);
        if self.selected(request).is_none() {
            request.extensions_mut().insert(Selected {
                table: self.policies.clone(),
                index,
            });
        }
        self.policies.by_index(index)
    }

    fn selected<B>(&self, request: &Request<B>) -> Option<usize> {
        request
            .extensions()
            .get::<Selected>()
            .filter(|selected| Arc::ptr_eq(&selected.table, &self.policies))
            .map(|selected| selected.index)
    }

    fn index_of<B>(&self, request: &Request<B>) -> usize {
        if let Some(index) = self.selected(request) {
            return index;
        }
        let matched = self.matched_path.and_then(|f| f(request.extensions()));
        let path = matched.unwrap_or_else(|| request.uri().path());
        self.policies.select(request.method(), path)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::Method;

    use super::*;
    use crate::policy::Idempotency;

    static MATCHES: AtomicUsize = AtomicUsize::new(0);

    fn counted(_: &Extensions) -> Option<&str> {
        MATCHES.fetch_add(1, Ordering::SeqCst);
        None
    }

    fn lookup() -> PolicyLookup {
        let table =
            MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build()).route(
                Method::POST,
                "/v1/payments",
                MethodPolicy::builder("Pay", Idempotency::Safe).build(),
            );
        PolicyLookup {
            policies: Arc::new(table),
            matched_path: Some(counted),
        }
    }

    #[test]
    fn the_route_is_matched_once_and_read_after() {
        let lookup = lookup();
        let mut request = Request::post("/v1/payments").body(()).unwrap();
        let before = MATCHES.load(Ordering::SeqCst);
        assert_eq!(lookup.select(&mut request).name(), "Pay");
        assert_eq!(lookup.policy_of(&request).name(), "Pay");
        assert_eq!(lookup.select(&mut request).name(), "Pay");
        assert_eq!(MATCHES.load(Ordering::SeqCst) - before, 1);

        // Another table does not trust the selection: it matches for itself.
        let other = self::lookup();
        assert_eq!(other.policy_of(&request).name(), "Pay");
        assert_eq!(MATCHES.load(Ordering::SeqCst) - before, 2);
    }
}
