//! Checking that no keyed method can reach its handler unclaimed.
//!
//! The idempotency layer decides which requests are keyed from the [`MethodPolicies`] table;
//! the application's router decides which handler runs. When the two disagree (the table
//! spells a route differently from the router, the stack was given another table, or it sits
//! on routes that do not include the keyed one), a request the table calls `Keyed` could run
//! its handler without a claimed key. Handlers of keyed methods refuse such a request (they
//! require the [`IdempotencyKey`](crate::idempotency::IdempotencyKey) extension, which only
//! a claim puts there), and [`keyed_routes_uncovered`] finds the disagreement before
//! production: in a test, or at start-up against the finished service.
//!
//! It sends each keyed entry of the table one request without an `Idempotency-Key` (path
//! parameters filled with `probe`; a gRPC method path, `/package.Service/Method` with a
//! package-qualified service, as a gRPC call with `Content-Type: application/grpc`) and
//! expects the idempotency layer's refusal, `missing_idempotency_key` (read from the
//! response's [`ProblemCode`], so gRPC's trailers-only refusal counts too). That refusal comes
//! before any handler, so the probe has no effect when the route is covered. Any other answer
//! is reported: a 404 or 405 (or gRPC `UNIMPLEMENTED`, or a 415 from a listener of the other
//! protocol) means no route serves the entry, anything else that the request went past the
//! idempotency layer unclaimed. Entries for a whole gRPC service are not probed (their methods
//! cannot be listed), nor is the fallback. A stack that also sees the requests no route takes
//! (in front of tonic's router, or on an axum fallback through `Router::layer`) refuses the
//! probe of an entry no route serves before the router can say so: such an entry is only
//! reported when the stack is on the routes alone (`Router::route_layer`).

use std::fmt;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Empty};
use tower::ServiceExt;
use tower_service::Service;

use crate::policy::MethodPolicies;
use crate::policy::table::{Key, grpc_service};
use crate::server::problem::{GRPC_CONTENT_TYPE, ProblemCode, grpc_status};
use crate::status::{Code, problem};

/// A keyed entry of a table that a probe showed unprotected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uncovered {
    /// The entry: `POST /v1/payments` or `POST /payment.v1.Payment/Charge`.
    pub route: String,
    /// The probe's answer: its status and problem code, if any.
    pub answer: String,
    /// Whether the router serves nothing there (404, 405, 415, `UNIMPLEMENTED`) rather than
    /// serving it past the idempotency layer.
    pub unserved: bool,
}

impl fmt::Display for Uncovered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = if self.unserved {
            "no route serves this keyed method"
        } else {
            "this keyed method reaches the application without an idempotency claim"
        };
        write!(f, "{}: {what} (answered {})", self.route, self.answer)
    }
}

/// Probes every keyed entry of `policies` through `service` (the application as it is
/// served, stack included) and returns those not refused by the idempotency layer for want of
/// a key. `prepare` adds what the stack needs before the idempotency layer (credentials).
pub async fn keyed_routes_uncovered<S, B>(
    service: S,
    policies: &MethodPolicies,
    prepare: impl Fn(http::request::Builder) -> http::request::Builder,
) -> Vec<Uncovered>
where
    S: Service<Request<Empty<Bytes>>, Response = Response<B>> + Clone,
    S::Error: fmt::Debug,
    B: Body<Data = Bytes>,
    B::Error: fmt::Debug,
{
    let mut uncovered = Vec::new();
    for (key, policy) in policies.entries() {
        if !policy.requires_key() {
            continue;
        }
        // A path entry whose service is package-qualified (`/payment.v1.Payment/Charge`) is a
        // gRPC method; an HTTP path (`/v1/payments`) or route is probed as HTTP.
        let (method, path, is_grpc) = match key {
            Key::Path(path) => (
                Method::POST,
                path.to_string(),
                grpc_service(path).is_some_and(|service| service.contains('.')),
            ),
            Key::Route(method, pattern) => (method.clone(), fill(pattern), false),
            Key::Fallback | Key::Service(_) => continue,
        };
        let route = format!("{method} {path}");
        let mut builder = Request::builder().method(method).uri(&path);
        if is_grpc {
            builder = builder
                .header(http::header::CONTENT_TYPE, GRPC_CONTENT_TYPE)
                .header(http::header::TE, "trailers");
        }
        let request = prepare(builder)
            .body(Empty::new())
            .expect("a probe request");
        let response = service
            .clone()
            .oneshot(request)
            .await
            .expect("the service answers a probe");
        let (head, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let code = match head.extensions.get::<ProblemCode>() {
            Some(ProblemCode(code)) => Some(code.to_string()),
            None => serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("code")?.as_str().map(str::to_owned)),
        };
        if code.as_deref() == Some(problem::MISSING_IDEMPOTENCY_KEY) {
            continue;
        }
        let grpc = grpc_status(&head.headers);
        // 415: a listener that serves the other protocol only (gRPC on an HTTP port).
        let unserved = matches!(
            head.status,
            StatusCode::NOT_FOUND
                | StatusCode::METHOD_NOT_ALLOWED
                | StatusCode::UNSUPPORTED_MEDIA_TYPE
        ) || grpc == Some(Code::Unimplemented);
        let answer = match (code, grpc) {
            (Some(code), _) => format!("{} {code}", head.status.as_u16()),
            (None, Some(grpc)) => format!("{} grpc-status {grpc}", head.status.as_u16()),
            (None, None) => head.status.as_u16().to_string(),
        };
        uncovered.push(Uncovered {
            route,
            answer,
            unserved,
        });
    }
    uncovered
}

/// [`keyed_routes_uncovered`], panicking with the list when it is not empty: for tests.
pub async fn assert_keyed_routes_covered<S, B>(
    service: S,
    policies: &MethodPolicies,
    prepare: impl Fn(http::request::Builder) -> http::request::Builder,
) where
    S: Service<Request<Empty<Bytes>>, Response = Response<B>> + Clone,
    S::Error: fmt::Debug,
    B: Body<Data = Bytes>,
    B::Error: fmt::Debug,
{
    let uncovered = keyed_routes_uncovered(service, policies, prepare).await;
    if !uncovered.is_empty() {
        let lines: Vec<String> = uncovered.iter().map(ToString::to_string).collect();
        panic!(
            "keyed methods not covered by idempotency:\n{}",
            lines.join("\n")
        );
    }
}

/// A path for `pattern`, each `{param}` segment replaced by `probe`.
fn fill(pattern: &str) -> String {
    pattern
        .split('/')
        .map(|s| {
            if s.starts_with('{') && s.ends_with('}') {
                "probe"
            } else {
                s
            }
        })
        .collect::<Vec<_>>()
        .join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_filled() {
        assert_eq!(
            fill("/v1/payments/{id}/refunds"),
            "/v1/payments/probe/refunds"
        );
        assert_eq!(fill("/v1/payments"), "/v1/payments");
    }
}
