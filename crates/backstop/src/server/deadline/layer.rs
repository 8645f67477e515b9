use std::time::Duration;

use tower_layer::Layer;

use super::{DEFAULT_MAX_TIMEOUT, DEFAULT_TIMEOUT, DeadlineService};
use crate::policy::MethodPolicies;
use crate::server::select::{MatchedPathFn, PolicyLookup, TableSource};

/// Applies [`DeadlineService`] to requests: `grpc-timeout` on arrival, 504 when it passes.
///
/// Cheap to clone: the policies, if any, are shared.
#[derive(Debug, Clone)]
pub struct DeadlineLayer {
    default: Duration,
    max: Duration,
    policies: Option<PolicyLookup>,
    server_timing: bool,
}

impl DeadlineLayer {
    /// A layer giving requests without `grpc-timeout` the timeout `default` (clamped by the
    /// maximum, 60 s unless [`DeadlineLayer::max`] is set).
    pub fn new(default: Duration) -> Self {
        Self {
            default,
            max: DEFAULT_MAX_TIMEOUT,
            policies: None,
            server_timing: true,
        }
    }

    /// The methods' policies: a request without `grpc-timeout` gets its method's
    /// [`timeout`](crate::policy::MethodPolicy::timeout) (clamped by the maximum) instead of
    /// the layer's default, the same timeout the method's clients set. With
    /// [`ServerStack::policies`](crate::server::ServerStack::policies) the stack gives its
    /// table here too.
    pub fn policies(self, policies: MethodPolicies) -> Self {
        self.policies_shared(TableSource::from(policies), None)
    }

    pub(crate) fn policies_shared(
        mut self,
        source: TableSource,
        matched_path: Option<MatchedPathFn>,
    ) -> Self {
        self.policies = Some(PolicyLookup::new(source, matched_path));
        self
    }

    /// The largest timeout a caller may ask for; larger `grpc-timeout` values are clamped to it.
    pub fn max(mut self, max: Duration) -> Self {
        self.max = max;
        self
    }

    /// Whether answers say how long the server held them (`Server-Timing: backstop;dur=..`,
    /// on by default): the calling client stack learns its margin from the rest of the
    /// attempt's time. Turn it off for callers that must not learn processing times (its
    /// clients then keep their margin floor, or a margin they fix).
    pub fn server_timing(mut self, on: bool) -> Self {
        self.server_timing = on;
        self
    }

    /// The timeout of a request without `grpc-timeout` whose method no
    /// [policies](Self::policies) name.
    pub fn default_timeout(&self) -> Duration {
        self.default.min(self.max)
    }

    /// The largest timeout a request can get.
    pub fn max_timeout(&self) -> Duration {
        self.max
    }
}

impl Default for DeadlineLayer {
    /// 10 s default timeout, 60 s maximum.
    fn default() -> Self {
        Self::new(DEFAULT_TIMEOUT)
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = DeadlineService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let mut service = DeadlineService::new(inner, self.default, self.max);
        service.policies = self.policies.clone();
        service.server_timing = self.server_timing;
        service
    }
}
