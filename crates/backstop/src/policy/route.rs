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
    /// For a pattern without parameters, its segments joined by `/`: a path matches when it is
    /// this string once trimmed, a single comparison instead of a walk through the segments
    /// (this runs for every request, in the metrics layer).
    literal: Option<Box<str>>,
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
            .collect::<Vec<_>>();
        let literal = segments
            .iter()
            .map(|s| match s {
                Segment::Literal(lit) => Some(&**lit),
                Segment::Param => None,
            })
            .collect::<Option<Vec<&str>>>()
            .map(|lits| lits.join("/").into_boxed_str());
        let label: Arc<str> = format!("{method} {pattern}").into();
        Self {
            method,
            segments,
            literal,
            label: SharedString::from(label),
        }
    }

    pub(crate) fn matches(&self, method: &Method, path: &str) -> bool {
        if *method != self.method {
            return false;
        }
        if let Some(literal) = &self.literal {
            return trim(path) == &**literal;
        }
        self.matches_segments(path)
    }

    fn matches_segments(&self, path: &str) -> bool {
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
    let trimmed = trim(path);
    trimmed.split('/').filter({
        let empty = trimmed.is_empty();
        move |_| !empty
    })
}

/// `path` without one leading and one trailing slash.
fn trim(path: &str) -> &str {
    let trimmed = path.strip_prefix('/').unwrap_or(path);
    trimmed.strip_suffix('/').unwrap_or(trimmed)
}

/// Labels of the requests no declared route matched, by method: `"GET other"` ..
/// `"OPTIONS other"`, and `"OTHER other"` for every other method (extension methods included,
/// so that a client cannot mint label values). Indexed by [`other_index`].
pub(crate) const OTHER_LABELS: [&str; 8] = [
    "GET other",
    "POST other",
    "PUT other",
    "DELETE other",
    "PATCH other",
    "HEAD other",
    "OPTIONS other",
    "OTHER other",
];

/// Index into [`OTHER_LABELS`] of a request's method.
pub(crate) fn other_index(method: &Method) -> usize {
    match *method {
        Method::GET => 0,
        Method::POST => 1,
        Method::PUT => 2,
        Method::DELETE => 3,
        Method::PATCH => 4,
        Method::HEAD => 5,
        Method::OPTIONS => 6,
        _ => 7,
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

    proptest::proptest! {
        /// The one-comparison path for patterns without parameters agrees with the walk
        /// through the segments on any path, slashes doubled, leading or trailing included.
        #[test]
        fn a_literal_pattern_matches_as_its_segments_do(
            pattern in "(/[ab]{0,2}){0,3}/?",
            path in "/?([ab]{0,2}/?){0,4}",
        ) {
            let p = RoutePattern::new(Method::GET, &pattern);
            proptest::prop_assert!(p.literal.is_some());
            proptest::prop_assert_eq!(
                p.matches(&Method::GET, &path),
                p.matches_segments(&path),
                "pattern {:?} path {:?}", pattern, path
            );
        }
    }

    #[test]
    fn extension_methods_collapse() {
        let label = |m: &Method| OTHER_LABELS[other_index(m)];
        assert_eq!(label(&Method::from_bytes(b"BREW").unwrap()), "OTHER other");
        assert_eq!(label(&Method::TRACE), "OTHER other");
        assert_eq!(label(&Method::POST), "POST other");
        assert_eq!(label(&Method::OPTIONS), "OPTIONS other");
    }
}
