//! The request's OpenTelemetry span (feature `otel`).

use http::Request;
use opentelemetry::Context;
use opentelemetry::trace::TraceContextExt;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::Route;
use crate::observe::{event, trace_context};

/// The span a request is served in: named `rpc_server_request`, exported under the route name,
/// a child of the caller's span when the request carries a valid `traceparent` (else the root
/// of a new trace, or a child of the span current where the service was called).
pub(super) fn request_span<B>(route: &Route, request: &Request<B>) -> Span {
    let span = tracing::info_span!(
        target: super::TARGET,
        event::RPC_SERVER_REQUEST,
        otel.name = route.method(),
        otel.kind = "server",
        rpc.service = route.service(),
    );
    if let Some(parent) = trace_context::extract(request.headers()) {
        // Fails only when no OpenTelemetry layer records the span: then there is no parent
        // to set.
        let _ = span.set_parent(Context::new().with_remote_span_context(parent));
    }
    span
}
