use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, PoisonError, RwLock};

use http::{Extensions, Method};
use metrics::SharedString;
use tower_layer::Layer;

use super::{Metrics, Route};
use crate::policy::route::{OTHER_LABELS, RoutePattern, other_index};

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

    /// The `service` label.
    pub fn service(&self) -> &str {
        &self.shared.service
    }

    pub(super) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }
}

impl Shared {
    /// The `Route` of a request: the first declared pattern it matches, else the route
    /// function's name for it, else `"<METHOD> other"`.
    pub(super) fn route_of(&self, method: &Method, path: &str) -> Route {
        if let Some(route) = &self.unmatched {
            return route.clone();
        }
        if let Some((_, route)) = self.routes.iter().find(|(p, _)| p.matches(method, path)) {
            return route.clone();
        }
        if let Some(name) = self.route_fn.as_ref().and_then(|f| f(method, path)) {
            return self.named(name);
        }
        self.others[other_index(method)].clone()
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
