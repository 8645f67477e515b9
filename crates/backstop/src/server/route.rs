//! Route patterns: `METHOD /literal/{param}/literal`, matched segment by segment.
//!
//! Used for bounded-cardinality metric labels and for selecting keyed routes. A pattern never
//! grows with client input: `{param}` matches exactly one non-empty segment and the label is the
//! pattern text, not the path.

use std::sync::Arc;

use http::Method;
use metrics::SharedString;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(Box<str>),
    Param,
}

/// One `(method, path pattern)` with its precomputed label `"METHOD /pattern"`.
#[derive(Debug, Clone)]
pub(crate) struct RoutePattern {
    method: Method,
    segments: Vec<Segment>,
    label: SharedString,
}

impl RoutePattern {
    pub(crate) fn new(method: Method, pattern: &str) -> Self {
        let segments = split(pattern)
            .map(|s| {
                if s.starts_with('{') && s.ends_with('}') {
                    Segment::Param
                } else {
                    Segment::Literal(s.into())
                }
            })
            .collect();
        let label: Arc<str> = format!("{method} {pattern}").into();
        Self {
            method,
            segments,
            label: SharedString::from(label),
        }
    }

    pub(crate) fn matches(&self, method: &Method, path: &str) -> bool {
        if *method != self.method {
            return false;
        }
        let mut parts = split(path);
        for seg in &self.segments {
            match (seg, parts.next()) {
                (Segment::Literal(lit), Some(p)) if **lit == *p => {}
                (Segment::Param, Some(p)) if !p.is_empty() => {}
                _ => return false,
            }
        }
        parts.next().is_none()
    }

    pub(crate) fn label(&self) -> &SharedString {
        &self.label
    }
}

/// Path segments without the leading slash; a trailing slash is ignored.
fn split(path: &str) -> impl Iterator<Item = &str> {
    let trimmed = path.strip_prefix('/').unwrap_or(path);
    let trimmed = trimmed.strip_suffix('/').unwrap_or(trimmed);
    trimmed.split('/').filter({
        let empty = trimmed.is_empty();
        move |_| !empty
    })
}

/// A static label for a standard method; extension methods collapse into `OTHER` so that a
/// client cannot mint label values.
pub(crate) fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "OTHER",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literal_and_param_segments() {
        let p = RoutePattern::new(Method::GET, "/v1/payments/{id}");
        assert!(p.matches(&Method::GET, "/v1/payments/pi_1"));
        assert!(p.matches(&Method::GET, "/v1/payments/pi_1/"));
        assert!(!p.matches(&Method::GET, "/v1/payments"));
        assert!(!p.matches(&Method::GET, "/v1/payments//"));
        assert!(!p.matches(&Method::GET, "/v1/payments/pi_1/refunds"));
        assert!(!p.matches(&Method::POST, "/v1/payments/pi_1"));
        assert_eq!(&**p.label(), "GET /v1/payments/{id}");
    }

    #[test]
    fn root_and_exact() {
        let root = RoutePattern::new(Method::GET, "/");
        assert!(root.matches(&Method::GET, "/"));
        assert!(!root.matches(&Method::GET, "/x"));
        let p = RoutePattern::new(Method::POST, "/v1/payments");
        assert!(p.matches(&Method::POST, "/v1/payments"));
        assert!(!p.matches(&Method::POST, "/v1/payment"));
        assert!(!p.matches(&Method::POST, "/v1"));
    }

    #[test]
    fn extension_methods_collapse() {
        let m = Method::from_bytes(b"BREW").unwrap();
        assert_eq!(method_label(&m), "OTHER");
        assert_eq!(method_label(&Method::POST), "POST");
    }
}
