//! W3C Trace Context (`traceparent`) read from and written to HTTP headers.
//!
//! The header is read and written by OpenTelemetry's [`TraceContextPropagator`], so the values
//! here are OpenTelemetry's own [`SpanContext`]s: a service that also exports spans (the `otel`
//! feature) hands them to its tracer as they are. The `trace_id` field of the `rpc_attempt` and
//! `rpc_server_request` log events is the trace id read here.
//!
//! ```
//! use backstop::observe::trace_context;
//! use http::HeaderMap;
//!
//! let mut incoming = HeaderMap::new();
//! incoming.insert(
//!     trace_context::TRACEPARENT,
//!     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap(),
//! );
//! // The caller's context, or a new trace when it sent none (or a malformed one).
//! let trace = trace_context::extract(&incoming).unwrap_or_else(trace_context::new_root);
//! assert_eq!(trace.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
//!
//! // An outgoing call: the same trace, a new span id.
//! let mut outgoing = HeaderMap::new();
//! trace_context::inject(&trace_context::child(&trace), &mut outgoing);
//! let sent = trace_context::extract(&outgoing).unwrap();
//! assert_eq!(sent.trace_id(), trace.trace_id());
//! assert_ne!(sent.span_id(), trace.span_id());
//! ```

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::Context;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TraceContextExt;
pub use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};

/// The `traceparent` header.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The remote span context of `headers`' `traceparent` (and `tracestate`), if it is valid:
/// version `00` with exactly four fields (a later version may append fields), a 32-digit trace
/// id and a 16-digit span id in lowercase hex, neither all zeros, two-digit flags; version
/// `ff` is invalid.
pub fn extract(headers: &HeaderMap) -> Option<SpanContext> {
    let value = headers.get(&TRACEPARENT)?.to_str().ok()?;
    if !well_formed(value) {
        return None;
    }
    let context = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    let span = context.span().span_context().clone();
    span.is_valid().then_some(span)
}

/// The remote span context of one `traceparent` value, as [`extract`] reads it.
pub fn parse(traceparent: &str) -> Option<SpanContext> {
    let mut headers = HeaderMap::new();
    headers.insert(TRACEPARENT, HeaderValue::from_str(traceparent).ok()?);
    extract(&headers)
}

/// Writes `span`'s `traceparent` (and `tracestate`, when it has one) into `headers`,
/// replacing what they carried; an invalid context writes nothing.
pub fn inject(span: &SpanContext, headers: &mut HeaderMap) {
    let context = Context::new().with_remote_span_context(span.clone());
    TraceContextPropagator::new().inject_context(&context, &mut HeaderInjector(headers));
}

/// The `traceparent` value of `span`, e.g.
/// `00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01`; `None` for an invalid context.
pub fn traceparent(span: &SpanContext) -> Option<HeaderValue> {
    let mut headers = HeaderMap::new();
    inject(span, &mut headers);
    headers.remove(&TRACEPARENT)
}

/// A new trace: random trace and span ids, sampled.
pub fn new_root() -> SpanContext {
    let ids = RandomIdGenerator::default();
    let trace_id = std::iter::repeat_with(|| ids.new_trace_id())
        .find(|id| *id != TraceId::INVALID)
        .unwrap_or(TraceId::INVALID);
    SpanContext::new(
        trace_id,
        new_span_id(&ids),
        TraceFlags::SAMPLED,
        false,
        TraceState::default(),
    )
}

/// The context of a call made on behalf of `parent`: the same trace id, flags and state, a new
/// span id.
pub fn child(parent: &SpanContext) -> SpanContext {
    SpanContext::new(
        parent.trace_id(),
        new_span_id(&RandomIdGenerator::default()),
        parent.trace_flags(),
        false,
        parent.trace_state().clone(),
    )
}

fn new_span_id(ids: &RandomIdGenerator) -> SpanId {
    // The generator may, once in 2^64, draw the invalid all-zero id.
    std::iter::repeat_with(|| ids.new_span_id())
        .find(|id| *id != SpanId::INVALID)
        .unwrap_or(SpanId::INVALID)
}

/// The field lengths and digits of a `traceparent`. The propagator checks the version, the
/// field count, the case and the all-zero ids, but reads the ids as integers, so it would take
/// `00-1-1-01` or a `+` sign: the shape is checked here first.
fn well_formed(value: &str) -> bool {
    let value = value.trim();
    let mut fields = value.split('-');
    [2, 32, 16, 2]
        .into_iter()
        .all(|len| fields.next().is_some_and(|f| f.len() == len && is_hex(f)))
        // Version 00 has exactly four fields: not even an empty fifth after a trailing `-`.
        && (!value.starts_with("00") || fields.next().is_none())
}

fn is_hex(field: &str) -> bool {
    field.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn round_trips_the_spec_example() {
        let span = parse(EXAMPLE).unwrap();
        assert_eq!(
            span.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(span.span_id().to_string(), "00f067aa0ba902b7");
        assert!(span.is_sampled());
        assert!(span.is_remote());
        assert_eq!(traceparent(&span).unwrap(), EXAMPLE);
    }

    #[test]
    fn a_later_version_is_read_by_its_first_four_fields() {
        let later = format!("01{}-abc", &EXAMPLE[2..]);
        let span = parse(&later).unwrap();
        assert_eq!(
            span.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
    }

    #[test]
    fn rejects_malformed_values() {
        for bad in [
            "",
            "00",
            // Three fields.
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            // Version 00 with more than four fields, even an empty one.
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            // The reserved version, and versions that are not two hex digits.
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // All-zero ids.
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // Uppercase hex.
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            // Wrong lengths: short and long ids, one-digit flags.
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47360-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-1-1-01",
            // A sign or a non-ASCII character in an id.
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47é6-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert_eq!(extract(&HeaderMap::new()), None);
    }

    #[test]
    fn a_child_keeps_the_trace_and_changes_the_span() {
        let parent = parse(EXAMPLE).unwrap();
        let child = child(&parent);
        assert_eq!(child.trace_id(), parent.trace_id());
        assert_eq!(child.trace_flags(), parent.trace_flags());
        assert_ne!(child.span_id(), parent.span_id());
        let mut headers = HeaderMap::new();
        inject(&child, &mut headers);
        assert_eq!(extract(&headers).unwrap().span_id(), child.span_id());
    }

    #[test]
    fn a_new_root_is_valid_and_new() {
        let a = new_root();
        let b = new_root();
        assert!(a.is_valid() && a.is_sampled());
        assert_ne!(a.trace_id(), b.trace_id());
        let value = traceparent(&a).unwrap();
        assert_eq!(
            parse(value.to_str().unwrap()).unwrap().trace_id(),
            a.trace_id()
        );
    }

    #[test]
    fn an_invalid_context_writes_nothing() {
        let mut headers = HeaderMap::new();
        inject(&SpanContext::empty_context(), &mut headers);
        assert!(headers.is_empty());
        assert_eq!(traceparent(&SpanContext::empty_context()), None);
    }
}
