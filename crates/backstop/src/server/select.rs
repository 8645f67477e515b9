//! How the server layers find a request's [`MethodPolicy`]: one table, one rule.
//!
//! The idempotency layer (keyed or not, key TTL, body read first) and the rate limit (rate
//! class) read the same [`MethodPolicies`] the clients use, each through a [`PolicyLookup`],
//! so they can never disagree on which method a request is.

use std::ops::Deref;
use std::sync::Arc;

use http::{Extensions, Request};

use crate::policy::{MethodPolicies, MethodPolicy, ReloadablePolicies};

/// Reads the route template the application's router matched from a request's extensions
/// (with axum: `|ext| ext.get::<MatchedPath>().map(MatchedPath::as_str)`).
pub type MatchedPathFn = for<'a> fn(&'a Extensions) -> Option<&'a str>;

/// Where the layers read their table: one for good, or one replaced while serving.
#[derive(Debug, Clone)]
pub(crate) enum TableSource {
    Fixed(Arc<MethodPolicies>),
    Reloadable(ReloadablePolicies),
}

impl TableSource {
    /// Shared by the layers reading the same source, and by no other.
    fn id(&self) -> usize {
        match self {
            TableSource::Fixed(table) => Arc::as_ptr(table).addr(),
            TableSource::Reloadable(policies) => policies.id(),
        }
    }

    /// The table in effect.
    pub(crate) fn load(&self) -> Arc<MethodPolicies> {
        match self {
            TableSource::Fixed(table) => table.clone(),
            TableSource::Reloadable(policies) => policies.load(),
        }
    }
}

impl From<MethodPolicies> for TableSource {
    fn from(table: MethodPolicies) -> Self {
        TableSource::Fixed(Arc::new(table))
    }
}

/// A table and where to find the route the router matched.
#[derive(Debug, Clone)]
pub(crate) struct PolicyLookup {
    pub(crate) source: TableSource,
    pub(crate) matched_path: Option<MatchedPathFn>,
}

/// The request's policy as the outermost layer that reads the table selected it: the layers
/// after it (the rate limit, the intake, the idempotency layer) read this instead of matching
/// the route again, and so read the same table for the whole request even when it is
/// replaced meanwhile. Only a layer reading the same source trusts it.
#[derive(Debug, Clone)]
pub(crate) struct Selected {
    table: Arc<MethodPolicies>,
    source: usize,
    index: usize,
}

/// A request's policy: borrowed from a fixed table, or held with the (replaceable) table it
/// came from.
pub(crate) enum PolicyRef<'a> {
    Borrowed(&'a MethodPolicy),
    Held(Arc<MethodPolicies>, usize),
}

impl Deref for PolicyRef<'_> {
    type Target = MethodPolicy;

    fn deref(&self) -> &MethodPolicy {
        match self {
            PolicyRef::Borrowed(policy) => policy,
            PolicyRef::Held(table, index) => table.by_index(*index),
        }
    }
}

impl PolicyLookup {
    pub(crate) fn new(source: TableSource, matched_path: Option<MatchedPathFn>) -> Self {
        Self {
            source,
            matched_path,
        }
    }

    /// The policy of `request`: the one a layer before this one selected from the same
    /// source, else by the route template its router matched when that is known, else by its
    /// method and path (a gRPC call by its `/package.Service/Method` path).
    pub(crate) fn policy_of<B>(&self, request: &Request<B>) -> PolicyRef<'_> {
        if let Some(selected) = self.selected(request) {
            return self.policy_at(selected.table.clone(), selected.index);
        }
        match &self.source {
            // The usual case reads a fixed table: no reference counted.
            TableSource::Fixed(table) => {
                PolicyRef::Borrowed(table.by_index(self.match_in(table, request)))
            }
            TableSource::Reloadable(policies) => {
                let table = policies.load();
                let index = self.match_in(&table, request);
                PolicyRef::Held(table, index)
            }
        }
    }

    /// [`policy_of`](Self::policy_of), remembered on `request` for the layers after this one:
    /// the outermost layer of a stack selects, the others read.
    pub(crate) fn select<B>(&self, request: &mut Request<B>) -> PolicyRef<'_> {
        let (table, index) = self.select_entry(request);
        self.policy_at(table, index)
    }

    /// The table and the index of the entry `request` runs by, selected once as
    /// [`select`](Self::select) does: for a layer that keeps something of its own per entry
    /// (the metrics layer's labels).
    pub(crate) fn select_entry<B>(&self, request: &mut Request<B>) -> (Arc<MethodPolicies>, usize) {
        if let Some(selected) = self.selected(request) {
            return (selected.table.clone(), selected.index);
        }
        let table = self.source.load();
        let index = self.match_in(&table, request);
        request.extensions_mut().insert(Selected {
            table: table.clone(),
            source: self.source.id(),
            index,
        });
        (table, index)
    }

    /// The table in effect.
    pub(crate) fn table(&self) -> Arc<MethodPolicies> {
        self.source.load()
    }

    fn policy_at(&self, table: Arc<MethodPolicies>, index: usize) -> PolicyRef<'_> {
        match &self.source {
            TableSource::Fixed(fixed) => PolicyRef::Borrowed(fixed.by_index(index)),
            TableSource::Reloadable(_) => PolicyRef::Held(table, index),
        }
    }

    fn selected<'r, B>(&self, request: &'r Request<B>) -> Option<&'r Selected> {
        request
            .extensions()
            .get::<Selected>()
            .filter(|selected| selected.source == self.source.id())
    }

    fn match_in<B>(&self, table: &MethodPolicies, request: &Request<B>) -> usize {
        let matched = self.matched_path.and_then(|f| f(request.extensions()));
        let path = matched.unwrap_or_else(|| request.uri().path());
        table.select(request.method(), path)
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
        PolicyLookup::new(TableSource::from(table), Some(counted))
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

    #[test]
    fn a_request_keeps_the_table_it_arrived_under_and_the_next_one_gets_the_new_one() {
        let table = |name: &str| {
            MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build()).route(
                Method::POST,
                "/v1/payments",
                MethodPolicy::builder(name, Idempotency::Safe).build(),
            )
        };
        let policies = ReloadablePolicies::new(table("Before")).unwrap();
        let outer = PolicyLookup::new(TableSource::Reloadable(policies.clone()), None);
        let inner = PolicyLookup::new(TableSource::Reloadable(policies.clone()), None);
        let mut early = Request::post("/v1/payments").body(()).unwrap();
        assert_eq!(outer.select(&mut early).name(), "Before");
        policies.replace(table("After")).unwrap();
        assert_eq!(
            inner.policy_of(&early).name(),
            "Before",
            "the whole request, one table"
        );
        let mut late = Request::post("/v1/payments").body(()).unwrap();
        assert_eq!(outer.select(&mut late).name(), "After");
        assert_eq!(inner.policy_of(&late).name(), "After");
        // A layer reading another source matches for itself.
        let other = PolicyLookup::new(TableSource::from(table("Other")), None);
        assert_eq!(other.policy_of(&early).name(), "Other");
    }
}
