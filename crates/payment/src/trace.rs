//! W3C `traceparent` (Trace Context level 1): read from the incoming request, propagated to the
//! PSP with the same trace id and a new span id, generated when absent or malformed.
//!
//! Reading and writing the header is OpenTelemetry's propagator, through
//! [`backstop::observe::trace_context`]; the context is OpenTelemetry's [`SpanContext`].

use http::HeaderMap;

pub use backstop::observe::trace_context::{
    SpanContext, TRACEPARENT, child, new_root, parse, traceparent,
};

/// The context of an incoming request: the caller's `traceparent`, or a new trace when it sent
/// none or a malformed one.
pub fn incoming(headers: &HeaderMap) -> SpanContext {
    backstop::observe::trace_context::extract(headers).unwrap_or_else(new_root)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(traceparent: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, traceparent.parse().unwrap());
        headers
    }

    #[test]
    fn keeps_the_callers_trace() {
        let trace = incoming(&headers(EXAMPLE));
        assert_eq!(
            trace.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(traceparent(&trace).unwrap(), EXAMPLE);
    }

    #[test]
    fn absent_or_malformed_header_starts_a_valid_new_trace() {
        let absent = incoming(&HeaderMap::new());
        let malformed = incoming(&headers(
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        ));
        for trace in [&absent, &malformed] {
            let value = traceparent(trace).unwrap();
            assert!(parse(value.to_str().unwrap()).is_some(), "{value:?}");
        }
        assert_ne!(absent.trace_id(), malformed.trace_id());
    }
}
