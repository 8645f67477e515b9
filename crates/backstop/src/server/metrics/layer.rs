use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, PoisonError, RwLock};

use arc_swap::ArcSwapOption;
use http::{Extensions, Method, Request};
use metrics::SharedString;
use tower_layer::Layer;

use super::{Metrics, Route};
use crate::policy::MethodPolicies;
use crate::policy::route::{OTHER_LABELS, RoutePattern, other_index};
use crate::policy::table::Key;
use crate::server::select::{MatchedPathFn, PolicyLookup, TableSource};

/// Names the route of a request from its method and path: must return one of a small, fixed
/// set of names (never a value taken from the path).
pub type RouteFn = dyn Fn(&Method, &str) -> Option<SharedString> + Send + Sync;

/// Reads the remote address of a request from its extensions (where the server's accept loop
/// or framework put it, e.g. axum's `ConnectInfo<SocketAddr>` or tonic's `TcpConnectInfo`), for
/// the log event's `peer` field.
pub type PeerFn = fn(&Extensions) -> Option<SocketAddr>;

/// Applies [`Metrics`]: server metrics and one log event per request.
#[derive(Clone)]
pub struct MetricsLayer {
    shared: Arc<Shared>,
}

/// Names given by a [`RouteFn`] whose [`Route`]s are kept; past this, a name gets a fresh
/// `Route` (and uncached metric handles) per request.
const MAX_NAMED: usize = 64;

pub(super) struct Shared {
    pub(super) service: SharedString,
    /// Declared routes, each with the `Route` handed to its requests.
    routes: Vec<(RoutePattern, Route)>,
    /// The `Route` of each [`OTHER_LABELS`] entry.
    others: [Route; OTHER_LABELS.len()],
    route_fn: Option<Arc<RouteFn>>,
    pub(super) peer_fn: Option<PeerFn>,
    /// `Route`s of the names the route function gave so far (at most [`MAX_NAMED`]).
    named: RwLock<Vec<Route>>,
    /// Set by [`MetricsLayer::unmatched`]: the one `Route` of every request.
    unmatched: Option<Route>,
    /// The stack's policy table: a request is labelled by the entry selected for it, from
    /// the table in effect, so a route a reload adds is counted under its own name.
    policies: Option<PolicyLookup>,
    /// The labels of the last table a request was selected from.
    labels: ArcSwapOption<EntryLabels>,
}

/// The `Route` of each entry of one policy table that names a route (`None`: the fallback
/// and whole gRPC services, labelled as if the table had no entry for them).
struct EntryLabels {
    /// Held, so that another table cannot take its address while these labels are kept.
    table: Arc<MethodPolicies>,
    routes: Box<[Option<(Method, Route)>]>,
}

impl EntryLabels {
    /// The labels of `table`'s entries, keeping the `Route` (and its resolved metric
    /// handles) of every label `previous` already had.
    fn new(table: Arc<MethodPolicies>, service: &SharedString, previous: Option<&Self>) -> Self {
        let kept = |label: &str| {
            previous?
                .routes
                .iter()
                .flatten()
                .find(|(_, route)| route.method() == label)
                .map(|(_, route)| route.clone())
        };
        let routes = (0..table.len())
            .map(|index| {
                // A gRPC method (or an HTTP path) is called with POST.
                let (method, label) = match table.key_at(index) {
                    Key::Path(path) => (Method::POST, format!("POST {path}")),
                    key @ Key::Route(method, _) => (method.clone(), key.to_string()),
                    Key::Fallback | Key::Service(_) => return None,
                };
                let route = kept(&label)
                    .unwrap_or_else(|| Route::new(service.clone(), Arc::<str>::from(label)));
                Some((method, route))
            })
            .collect();
        Self { table, routes }
    }
}

/// The `method` label of the requests no route of the server matched (see
/// [`MetricsLayer::unmatched`]).
pub const UNMATCHED: &str = "unmatched";

impl Clone for Shared {
    fn clone(&self) -> Self {
        Self {
            service: self.service.clone(),
            routes: self.routes.clone(),
            others: self.others.clone(),
            route_fn: self.route_fn.clone(),
            peer_fn: self.peer_fn,
            named: RwLock::default(),
            unmatched: self.unmatched.clone(),
            policies: self.policies.clone(),
            labels: ArcSwapOption::empty(),
        }
    }
}

impl fmt::Debug for MetricsLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetricsLayer")
            .field("service", &self.shared.service)
            .field(
                "routes",
                &self
                    .shared
                    .routes
                    .iter()
                    .map(|(p, _)| p)
                    .collect::<Vec<_>>(),
            )
            .field("route_fn", &self.shared.route_fn.as_ref().map(|_| ".."))
            .finish()
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("service", &self.service)
            .finish_non_exhaustive()
    }
}

impl MetricsLayer {
    /// A layer labelling every metric with `service`.
    pub fn new(service: impl Into<String>) -> Self {
        let service: Arc<str> = service.into().into();
        let service = SharedString::from(service);
        Self {
            shared: Arc::new(Shared {
                others: OTHER_LABELS
                    .map(|label| Route::new(service.clone(), SharedString::const_str(label))),
                service,
                routes: Vec::new(),
                route_fn: None,
                peer_fn: None,
                named: RwLock::default(),
                unmatched: None,
                policies: None,
                labels: ArcSwapOption::empty(),
            }),
        }
    }

    /// Declares a route: requests with this method whose path matches `pattern` (literal
    /// segments and `{param}` segments) are labelled `"<METHOD> <pattern>"`.
    pub fn route(mut self, method: Method, pattern: &str) -> Self {
        let shared = Arc::make_mut(&mut self.shared);
        let pattern = RoutePattern::new(method, pattern);
        let route = Route::new(shared.service.clone(), pattern.label().clone());
        shared.routes.push((pattern, route));
        self
    }

    /// Names the routes no declared pattern matched; `None` falls back to `"<METHOD> other"`.
    pub fn route_name<F>(mut self, f: F) -> Self
    where
        F: Fn(&Method, &str) -> Option<SharedString> + Send + Sync + 'static,
    {
        Arc::make_mut(&mut self.shared).route_fn = Some(Arc::new(f));
        self
    }

    /// Names the log event's `peer` from the request's extensions. Without it the field is
    /// absent: the layer cannot know where the server keeps the connection's address.
    pub fn peer_from(mut self, f: PeerFn) -> Self {
        Arc::make_mut(&mut self.shared).peer_fn = Some(f);
        self
    }

    /// This layer for a router's fallback: every request is labelled `method="unmatched"`
    /// (one value whatever the path or method, so a scan of random paths cannot grow the
    /// metric set), so requests no route takes (404, 405) are counted and logged like the
    /// others instead of passing unseen.
    pub fn unmatched(mut self) -> Self {
        let shared = Arc::make_mut(&mut self.shared);
        shared.unmatched = Some(Route::new(
            shared.service.clone(),
            SharedString::const_str(UNMATCHED),
        ));
        self
    }

    /// Labels a request by its entry in `source`, the table the stack selects each request's
    /// policy from: routes and gRPC methods by their own names, whatever table is in effect.
    pub(crate) fn policies_shared(
        mut self,
        source: TableSource,
        matched_path: Option<MatchedPathFn>,
    ) -> Self {
        Arc::make_mut(&mut self.shared).policies = Some(PolicyLookup::new(source, matched_path));
        self
    }

    /// The `service` label.
    pub fn service(&self) -> &str {
        &self.shared.service
    }

    pub(super) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }
}

impl Shared {
    /// The `Route` of a request: the first declared pattern it matches, else the entry of the
    /// stack's policy table selected for it, else the route function's name for it, else
    /// `"<METHOD> other"`.
    pub(super) fn route_of<B>(&self, request: &mut Request<B>) -> Route {
        if let Some(route) = &self.unmatched {
            return route.clone();
        }
        let (method, path) = (request.method(), request.uri().path());
        if let Some((_, route)) = self.routes.iter().find(|(p, _)| p.matches(method, path)) {
            return route.clone();
        }
        if let Some(route) = self.policy_route(request) {
            return route;
        }
        let (method, path) = (request.method(), request.uri().path());
        if let Some(name) = self.route_fn.as_ref().and_then(|f| f(method, path)) {
            return self.named(name);
        }
        self.others[other_index(method)].clone()
    }

    /// The `Route` of the policy entry selected for `request`, when that entry names a route
    /// of the request's method.
    fn policy_route<B>(&self, request: &mut Request<B>) -> Option<Route> {
        let (table, mut index) = self.policies.as_ref()?.select_entry(request);
        if let Key::Path(path) = table.key_at(index)
            && !path.starts_with('/')
        {
            // An entry at a path no request has, which the application selected by naming it
            // as the matched path (a variant of a route, such as the proxy's keyed `auto`
            // requests): labelled as the route the request's own path is.
            index = table.select(request.method(), request.uri().path());
        }
        let labels = match self.labels.load_full() {
            Some(labels) if Arc::ptr_eq(&labels.table, &table) => labels,
            // A table not seen before (the first request, or a reload): its labels are made
            // once and kept until the next one.
            previous => {
                let labels = Arc::new(EntryLabels::new(table, &self.service, previous.as_deref()));
                self.labels.store(Some(labels.clone()));
                labels
            }
        };
        let (method, route) = labels.routes.get(index)?.as_ref()?;
        (method == request.method()).then(|| route.clone())
    }

    /// The kept `Route` of a name given by the route function, kept on first sight.
    fn named(&self, name: SharedString) -> Route {
        let find = |named: &[Route]| named.iter().find(|r| r.method() == &*name).cloned();
        {
            let named = self.named.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(route) = find(&named) {
                return route;
            }
            if named.len() >= MAX_NAMED {
                return Route::new(self.service.clone(), name);
            }
        }
        let mut named = self.named.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(route) = find(&named) {
            return route;
        }
        let route = Route::new(self.service.clone(), name);
        if named.len() < MAX_NAMED {
            named.push(route.clone());
        }
        route
    }
}

impl<S> Layer<S> for MetricsLayer {
    type Service = Metrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Metrics::new(inner, self)
    }
}
