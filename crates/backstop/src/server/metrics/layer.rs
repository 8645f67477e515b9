use std::fmt;
use std::sync::Arc;

use http::Method;
use metrics::SharedString;
use tower_layer::Layer;

use super::Metrics;
use crate::server::route::{RoutePattern, method_label};

/// Names the route of a request from its method and path: must return one of a small, fixed
/// set of names (never a value taken from the path).
pub type RouteFn = dyn Fn(&Method, &str) -> Option<SharedString> + Send + Sync;

/// Applies [`Metrics`]: server metrics and one log event per request.
#[derive(Clone)]
pub struct MetricsLayer {
    shared: Arc<Shared>,
}

#[derive(Clone)]
pub(super) struct Shared {
    pub(super) service: SharedString,
    routes: Vec<RoutePattern>,
    route_fn: Option<Arc<RouteFn>>,
}

impl fmt::Debug for MetricsLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetricsLayer")
            .field("service", &self.shared.service)
            .field("routes", &self.shared.routes)
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
        Self {
            shared: Arc::new(Shared {
                service: SharedString::from(service),
                routes: Vec::new(),
                route_fn: None,
            }),
        }
    }

    /// Declares a route: requests with this method whose path matches `pattern` (literal
    /// segments and `{param}` segments) are labelled `"<METHOD> <pattern>"`.
    pub fn route(mut self, method: Method, pattern: &str) -> Self {
        Arc::make_mut(&mut self.shared)
            .routes
            .push(RoutePattern::new(method, pattern));
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

    /// The `service` label.
    pub fn service(&self) -> &str {
        &self.shared.service
    }

    pub(super) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }
}

impl Shared {
    pub(super) fn route_of(&self, method: &Method, path: &str) -> SharedString {
        if let Some(p) = self.routes.iter().find(|p| p.matches(method, path)) {
            return p.label().clone();
        }
        if let Some(name) = self.route_fn.as_ref().and_then(|f| f(method, path)) {
            return name;
        }
        SharedString::const_str(other_label(method))
    }
}

fn other_label(method: &Method) -> &'static str {
    match method_label(method) {
        "GET" => "GET other",
        "POST" => "POST other",
        "PUT" => "PUT other",
        "DELETE" => "DELETE other",
        "PATCH" => "PATCH other",
        "HEAD" => "HEAD other",
        "OPTIONS" => "OPTIONS other",
        _ => "OTHER other",
    }
}

impl<S> Layer<S> for MetricsLayer {
    type Service = Metrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Metrics::new(inner, self)
    }
}
