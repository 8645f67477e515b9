//! Each attempt's OpenTelemetry span (feature `otel`).

use http::Request;
use opentelemetry::Context;
use opentelemetry::trace::TraceContextExt;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::observe::trace_context;

/// Name of the span of one attempt.
const ATTEMPT_SPAN: &str = "rpc_client_attempt";

/// The attempt's span, kept in the request's extensions: it ends when the transport below has
/// sent the request and dropped it.
#[derive(Debug, Clone)]
struct AttemptSpan {
    /// Held, never read: dropping it ends the span.
    _open: Span,
}

/// Opens the span of attempt `number`, a child of the current span, and sends its context as
/// the attempt's `traceparent`. A `traceparent` the caller put on the request from another
/// trace than the current span's (a service that read its caller's header itself) is the
/// parent instead, so the attempt stays in the trace the caller named.
pub(super) fn start_attempt<B>(request: &mut Request<B>, number: u32) {
    let span = tracing::info_span!(
        target: "backstop::client",
        ATTEMPT_SPAN,
        otel.kind = "client",
        attempt = number,
    );
    if let Some(named) = trace_context::extract(request.headers()) {
        let current = Span::current().context();
        if current.span().span_context().trace_id() != named.trace_id() {
            // Fails only when no OpenTelemetry layer records the span.
            let _ = span.set_parent(Context::new().with_remote_span_context(named));
        }
    }
    let context = span.context();
    // Without an OpenTelemetry layer the context is invalid and the request keeps its header.
    trace_context::inject(context.span().span_context(), request.headers_mut());
    request.extensions_mut().insert(AttemptSpan { _open: span });
}
