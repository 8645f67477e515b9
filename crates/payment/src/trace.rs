//! W3C `traceparent` (Trace Context level 1): read from the incoming request, propagated to the
//! PSP with the same trace id and a new span id, generated when absent or malformed.

use std::fmt;

/// The `traceparent` header name.
pub const TRACEPARENT: &str = "traceparent";

/// A parsed `traceparent` (version 00).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    flags: u8,
}

impl TraceParent {
    /// Parses `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`. All-zero ids and the
    /// reserved version `ff` are invalid; a future version is read by its version-00 prefix, as
    /// the specification asks.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        let b = s.as_bytes();
        // ASCII first: the slicing below must never cut a multi-byte character.
        if !s.is_ascii() || b.len() < 55 || (b.len() > 55 && b[55] != b'-') {
            return None;
        }
        let version = decode::<1>(&s[0..2])?[0];
        if version == 0xff || (version == 0 && b.len() != 55) {
            return None;
        }
        if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let trace_id = decode::<16>(&s[3..35])?;
        let span_id = decode::<8>(&s[36..52])?;
        let flags = decode::<1>(&s[53..55])?[0];
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            flags,
        })
    }

    /// A new root context (random trace and span ids, sampled flag set).
    pub fn generate() -> Self {
        let mut trace_id: [u8; 16] = rand::random();
        if trace_id == [0; 16] {
            trace_id[15] = 1;
        }
        TraceParent {
            trace_id,
            span_id: new_span_id(),
            flags: 0x01,
        }
    }

    /// The context from an incoming header value, or a new root when absent or malformed.
    pub fn from_header(value: Option<&http::HeaderValue>) -> Self {
        value
            .and_then(|v| v.to_str().ok())
            .and_then(Self::parse)
            .unwrap_or_else(Self::generate)
    }

    /// The context for an outgoing call: same trace id and flags, a new span id.
    pub fn child(&self) -> Self {
        TraceParent {
            span_id: new_span_id(),
            ..*self
        }
    }

    /// Lowercase hex trace id (the `trace_id` log field).
    pub fn trace_id(&self) -> String {
        hex::encode(self.trace_id)
    }

    /// Lowercase hex span id.
    pub fn span_id(&self) -> String {
        hex::encode(self.span_id)
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex::encode(self.trace_id),
            hex::encode(self.span_id),
            self.flags
        )
    }
}

fn new_span_id() -> [u8; 8] {
    let mut id: [u8; 8] = rand::random();
    if id == [0; 8] {
        id[7] = 1;
    }
    id
}

fn decode<const N: usize>(s: &str) -> Option<[u8; N]> {
    // Lowercase only, as the specification requires.
    if s.bytes().any(|c| c.is_ascii_uppercase()) {
        return None;
    }
    let mut out = [0u8; N];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn round_trips_the_spec_example() {
        let t = TraceParent::parse(EXAMPLE).unwrap();
        assert_eq!(t.to_string(), EXAMPLE);
        assert_eq!(t.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
    }

    #[test]
    fn child_keeps_the_trace_and_changes_the_span() {
        let t = TraceParent::parse(EXAMPLE).unwrap();
        let c = t.child();
        assert_eq!(c.trace_id(), t.trace_id());
        assert_ne!(c.span_id(), t.span_id());
        assert!(TraceParent::parse(&c.to_string()).is_some());
    }

    #[test]
    fn rejects_malformed_values() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47é6-00f067aa0ba902b7-01",
        ] {
            assert!(TraceParent::parse(bad).is_none(), "{bad}");
        }
        // A future version with extra fields is read by its prefix.
        assert!(TraceParent::parse(&format!("01{}-abc", &EXAMPLE[2..])).is_some());
    }

    #[test]
    fn absent_header_generates_a_valid_root() {
        let t = TraceParent::from_header(None);
        assert!(TraceParent::parse(&t.to_string()).is_some());
    }
}
