//! [`SelectMethod`]: which method's policy a call runs by, decided once per call by its path;
//! the layers below read the choice from the request's extensions.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use tower::BoxError;
use tower_service::Service;

use super::error::Error;
use super::future::CallFuture;
use super::retry::config::Config as RetryConfig;
use crate::hedge::HedgePolicy;
use crate::policy::{Idempotency, MethodPolicies};

/// One method's policy as the client layers run it.
#[derive(Debug)]
pub(crate) struct Resolved {
    /// Whether the key layer gives its calls a key (`Keyed`).
    pub(crate) idempotency: Idempotency,
    /// The method's timeout: the deadline of a call whose caller set none, and the cap on one
    /// it did.
    pub(crate) timeout: Duration,
    /// Attempts, backoff, eligibility, attempt limit.
    pub(crate) retry: Arc<RetryConfig>,
    /// Hedging, if the method allows it.
    pub(crate) hedge: Option<HedgePolicy>,
}

/// Put in a call's extensions by [`SelectMethod`]: its method's [`Resolved`] settings.
#[derive(Debug, Clone)]
pub(crate) struct Selected(pub(crate) Arc<Resolved>);

/// The policies of a stack and their runtime settings, in the same order.
#[derive(Debug)]
pub(crate) struct MethodTable {
    pub(crate) policies: MethodPolicies,
    pub(crate) resolved: Vec<Arc<Resolved>>,
}

/// Chooses each call's method policy by its path, once per call: the outermost layer of a
/// [`ClientStack`](super::ClientStack).
///
/// A tonic `Channel` carries every method of a service, and an HTTP client every route; their
/// policies differ (a read is retried three times, a refund never). This layer looks the call
/// up in the stack's [`MethodPolicies`] by its path (and, for HTTP routes, its method) and
/// hands the chosen method's settings to the key, deadline, retry and hedge layers below, in
/// the request's extensions. A stack with one policy skips the lookup: its layers were built
/// with that policy.
#[derive(Debug, Clone)]
pub struct SelectMethod<S> {
    inner: S,
    table: Arc<MethodTable>,
}

impl<S> SelectMethod<S> {
    pub(crate) fn new(inner: S, table: Arc<MethodTable>) -> Self {
        Self { inner, table }
    }
}

impl<S, B> Service<Request<B>> for SelectMethod<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = Error;
    type Future = CallFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|e| Error::from_box(e.into()))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        if self.table.resolved.len() > 1 {
            let index = self
                .table
                .policies
                .select(request.method(), request.uri().path());
            let selected = Selected(Arc::clone(&self.table.resolved[index]));
            request.extensions_mut().insert(selected);
        } else if request.extensions().get::<Selected>().is_some() {
            // Chosen by another stack above this one: here the layers' own policy rules.
            request.extensions_mut().remove::<Selected>();
        }
        CallFuture::new(self.inner.call(request))
    }
}
