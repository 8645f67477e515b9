//! Refusals built from a [`Status`]: RFC 9457 `application/problem+json` for HTTP, a
//! trailers-only response for gRPC.
//!
//! Every refusal the server layers produce is a problem document with a stable `code` that
//! clients can switch on, the HTTP status of its gRPC code (grpc-gateway's mapping), and, when
//! the server asks the client to back off, a `Retry-After` header (delta-seconds, at least 1)
//! mirrored in the `retry_after` field.
//!
//! ```
//! use backstop::server::problem::Problem;
//! use backstop::status::{Code, Status};
//! use std::time::Duration;
//!
//! let status = Status::new(Code::Unavailable, "server at capacity")
//!     .with_problem("overloaded")
//!     .with_pushback(Duration::from_millis(1500));
//! let response: http::Response<bytes::Bytes> = Problem::from_status(&status).into_http_response();
//! assert_eq!(response.status(), 503);
//! assert_eq!(response.headers()["retry-after"], "2");
//! assert_eq!(response.headers()["content-type"], "application/problem+json");
//! let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
//! assert_eq!(body["code"], "overloaded");
//! assert_eq!(body["retry_after"], 2);
//! ```
//!
//! # gRPC
//!
//! A request whose `Content-Type` is `application/grpc` (or `application/grpc+proto`, ...)
//! speaks [`Protocol::Grpc`], and [`Problem::into_response_for`] answers it the way gRPC
//! expects a refusal: HTTP 200 with no body ("trailers-only"), `grpc-status` the code,
//! `grpc-message` the detail (percent-encoded), and `grpc-retry-pushback-ms` (whole
//! milliseconds, at least 1) where HTTP would send `Retry-After`; `-1` when the server asks
//! the client not to retry at all ([`Status::with_no_retry`]). Every server layer answers
//! through it, so each refusal speaks the caller's protocol.
//!
//! ```
//! use backstop::server::problem::{Problem, Protocol};
//! use backstop::status::Status;
//! use std::time::Duration;
//!
//! let mut request = http::HeaderMap::new();
//! request.insert("content-type", "application/grpc".parse().unwrap());
//! let protocol = Protocol::of(&request);
//! assert_eq!(protocol, Protocol::Grpc);
//! let status = Status::rate_limited(Duration::from_millis(250));
//! let response: http::Response<bytes::Bytes> =
//!     Problem::from_status(&status).into_response_for(protocol);
//! assert_eq!(response.status(), 200);
//! assert_eq!(response.headers()["grpc-status"], "8"); // RESOURCE_EXHAUSTED
//! assert_eq!(response.headers()["grpc-retry-pushback-ms"], "250");
//! assert!(response.body().is_empty());
//! ```

use std::borrow::Cow;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde::Serialize;
use serde_json::{Map, Value};

use http::HeaderMap;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

use crate::admission::RetryAfter;
use crate::status::{Code, GRPC_RETRY_PUSHBACK_MS, Outcome, Status};

/// The media type of a problem document (RFC 9457 section 3).
pub const CONTENT_TYPE: &str = "application/problem+json";

/// Prefix of the `type` URI; the stable `code` follows it (`urn:backstop:problem:overloaded`).
pub const TYPE_PREFIX: &str = "urn:backstop:problem:";

/// Response header carrying the gRPC status code.
pub const GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");

/// Response header carrying the gRPC status message (percent-encoded).
pub const GRPC_MESSAGE: http::HeaderName = http::HeaderName::from_static("grpc-message");

/// Response header asking a gRPC client to wait this many milliseconds before retrying.
pub const GRPC_PUSHBACK: http::HeaderName = http::HeaderName::from_static(GRPC_RETRY_PUSHBACK_MS);

/// The media type of a gRPC message stream.
pub const GRPC_CONTENT_TYPE: &str = "application/grpc";

/// What `grpc-message` escapes (gRPC over HTTP/2: percent-encode everything outside
/// printable ASCII, and `%` itself).
const GRPC_MESSAGE_ESCAPES: &AsciiSet = &CONTROLS.add(b'%');

/// The protocol a request speaks, and so the form its refusal takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// Plain HTTP: problem+json.
    #[default]
    Http,
    /// gRPC over HTTP/2: a trailers-only response with `grpc-status`.
    Grpc,
}

impl Protocol {
    /// The protocol of a request, by its `Content-Type`: `application/grpc` and its
    /// `+proto`/`+json` variants are gRPC (gRPC-Web is not: it needs its own framing).
    pub fn of(headers: &HeaderMap) -> Protocol {
        match headers.get(header::CONTENT_TYPE) {
            Some(value) if is_grpc(value.as_bytes()) => Protocol::Grpc,
            _ => Protocol::Http,
        }
    }

    /// Whether this is [`Protocol::Grpc`].
    pub fn is_grpc(self) -> bool {
        self == Protocol::Grpc
    }
}

fn is_grpc(content_type: &[u8]) -> bool {
    let Some(rest) = content_type.strip_prefix(GRPC_CONTENT_TYPE.as_bytes()) else {
        return false;
    };
    matches!(rest.first(), None | Some(b'+' | b';'))
}

/// The gRPC code a response carries in its head (`grpc-status`), as a trailers-only response
/// does; `None` when the status will come in the trailers (or the response is not gRPC).
pub fn grpc_status(headers: &HeaderMap) -> Option<Code> {
    let value = headers.get(GRPC_STATUS)?.to_str().ok()?;
    Some(Code::from_i32(value.parse().ok()?))
}

/// A problem document under construction.
///
/// Built from a [`Status`] (the usual way) or from an HTTP status and a code; extra members
/// (such as `fingerprint_prefix`) are added with [`Problem::with`].
#[derive(Debug, Clone)]
pub struct Problem {
    status: StatusCode,
    code: Cow<'static, str>,
    title: Cow<'static, str>,
    detail: Option<String>,
    retry_after: Option<Duration>,
    no_retry: bool,
    outcome: Option<Outcome>,
    grpc_code: Option<Code>,
    extra: Map<String, Value>,
}

/// The stable `code` of a refusal answered through [`Problem`], put on the response in either
/// protocol: an in-process caller (a test, [`coverage`](crate::server::idempotency::coverage))
/// can tell refusals apart even in gRPC's trailers-only form, which carries only a status and
/// a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProblemCode(pub Cow<'static, str>);

#[derive(Serialize)]
struct Document<'a> {
    #[serde(rename = "type")]
    type_: String,
    title: &'a str,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a str>,
    code: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after: Option<u64>,
    #[serde(flatten)]
    extra: &'a Map<String, Value>,
}

impl Problem {
    /// A problem with the given HTTP status and stable code; the title is the status's reason
    /// phrase.
    pub fn new(status: StatusCode, code: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status,
            code: code.into(),
            title: Cow::Borrowed(status.canonical_reason().unwrap_or("Error")),
            detail: None,
            retry_after: None,
            no_retry: false,
            outcome: None,
            grpc_code: None,
            extra: Map::new(),
        }
    }

    /// The problem for a [`Status`]: its HTTP status, its stable problem code, its message as
    /// `detail` and its pushback as `Retry-After`.
    pub fn from_status(status: &Status) -> Self {
        let mut problem = Self::new(status.http_status(), status.problem());
        if !status.message().is_empty() {
            problem.detail = Some(status.message().to_owned());
        }
        problem.retry_after = status.pushback();
        problem.no_retry = status.no_retry();
        problem.outcome = Some(status.outcome());
        problem.grpc_code = Some(status.code());
        problem
    }

    /// Sets the gRPC code of the answer to a gRPC request. Without it the code is the
    /// [`Status`]'s (for [`Problem::from_status`]), else follows the HTTP status: 409 with
    /// `Retry-After` is `ABORTED`, 409 without it `ALREADY_EXISTS`, 413 `RESOURCE_EXHAUSTED`,
    /// anything else by [`Code::from_http`].
    pub fn grpc_code(mut self, code: Code) -> Self {
        self.grpc_code = Some(code);
        self
    }

    /// The gRPC code of this answer (see [`Problem::grpc_code`]).
    pub fn code_for_grpc(&self) -> Code {
        self.grpc_code.unwrap_or_else(|| match self.status {
            StatusCode::CONFLICT if self.retry_after.is_some() => Code::Aborted,
            StatusCode::CONFLICT => Code::AlreadyExists,
            StatusCode::PAYLOAD_TOO_LARGE => Code::ResourceExhausted,
            status => Code::from_http(status),
        })
    }

    /// Sets the outcome the metrics record for this answer. Without it the outcome follows the
    /// HTTP status, except that a 409 without `Retry-After` is a conflict (`ALREADY_EXISTS`,
    /// `FAILED_PRECONDITION`: fatal), not an `ABORTED` request in progress.
    pub fn outcome(mut self, outcome: Outcome) -> Self {
        self.outcome = Some(outcome);
        self
    }

    /// The outcome label of this answer (see [`Problem::outcome`]).
    pub fn outcome_label(&self) -> Outcome {
        self.outcome.unwrap_or_else(|| {
            if self.status == StatusCode::CONFLICT && self.retry_after.is_none() {
                Outcome::Fatal
            } else {
                Outcome::from_http(self.status)
            }
        })
    }

    /// Sets the human-readable `detail`.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Sets the `title` (defaults to the HTTP reason phrase).
    pub fn title(mut self, title: impl Into<Cow<'static, str>>) -> Self {
        self.title = title.into();
        self
    }

    /// Asks the client to wait: adds `Retry-After` (delta-seconds, rounded up, at least 1) and the
    /// same number in the `retry_after` member.
    pub fn retry_after(mut self, wait: Duration) -> Self {
        self.retry_after = Some(wait);
        self
    }

    /// Asks the client not to retry at all: a gRPC answer carries `grpc-retry-pushback-ms: -1`
    /// (gRPC's "do not retry"); an HTTP answer, which has no such word, carries the same header
    /// beside its `Retry-After` (for clients that read only that).
    pub fn no_retry(mut self) -> Self {
        self.no_retry = true;
        self
    }

    /// Adds an extension member (RFC 9457 section 3.2), e.g. `fingerprint_prefix`.
    ///
    /// The standard members (`type`, `title`, `status`, `detail`, `code`, `retry_after`) cannot be
    /// overridden this way; such names are ignored.
    pub fn with(mut self, name: &str, value: impl Into<Value>) -> Self {
        const RESERVED: [&str; 6] = ["type", "title", "status", "detail", "code", "retry_after"];
        if !RESERVED.contains(&name) {
            self.extra.insert(name.to_owned(), value.into());
        }
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable problem code.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// The pushback asked of the client, if any.
    pub fn pushback(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Whole seconds the client is asked to wait, as sent in `Retry-After`.
    fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(|d| RetryAfter(d).seconds())
    }

    /// The JSON document.
    pub fn to_json(&self) -> Bytes {
        let doc = Document {
            type_: format!("{TYPE_PREFIX}{}", self.code),
            title: &self.title,
            status: self.status.as_u16(),
            detail: self.detail.as_deref(),
            code: &self.code,
            retry_after: self.retry_after_secs(),
            extra: &self.extra,
        };
        // Serializing strings, integers and `serde_json::Value`s into a Vec cannot fail.
        Bytes::from(serde_json::to_vec(&doc).unwrap_or_default())
    }

    /// The response: status, `Content-Type: application/problem+json`, `Retry-After` when there
    /// is pushback, and the document as body.
    ///
    /// Any body type made from bytes will do: `axum::body::Body`, `Full<Bytes>`, or, as the
    /// server layers answer, [`ResponseBody<B>`](super::body::ResponseBody) for any inner
    /// body `B`.
    pub fn into_http_response<B: From<Bytes>>(self) -> Response<B> {
        let body = self.to_json();
        let mut response = Response::new(B::from(body));
        // Carried to the metrics layer: an HTTP status alone cannot tell a 409 conflict from a
        // 409 in progress.
        response.extensions_mut().insert(self.outcome_label());
        response
            .extensions_mut()
            .insert(ProblemCode(self.code.clone()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
        if let Some(wait) = self.retry_after {
            headers.insert(header::RETRY_AFTER, RetryAfter(wait).header_value());
        }
        // HTTP has no word for "do not retry": gRPC's travels beside `Retry-After`, and
        // backstop clients (and gRPC-aware proxies) read it first.
        if self.no_retry {
            headers.insert(GRPC_PUSHBACK, HeaderValue::from_static("-1"));
        }
        response
    }
}

impl Problem {
    /// The answer in the request's protocol: [`Problem::into_http_response`] for HTTP,
    /// [`Problem::into_grpc_response`] for gRPC.
    pub fn into_response_for<B: From<Bytes>>(self, protocol: Protocol) -> Response<B> {
        match protocol {
            Protocol::Http => self.into_http_response(),
            Protocol::Grpc => self.into_grpc_response(),
        }
    }

    /// The trailers-only gRPC answer: HTTP 200, no body, `grpc-status`, `grpc-message` (the
    /// detail, else the title; extension members appended as `name=value`) and
    /// `grpc-retry-pushback-ms` when there is pushback.
    pub fn into_grpc_response<B: From<Bytes>>(self) -> Response<B> {
        let mut response = Response::new(B::from(Bytes::new()));
        response.extensions_mut().insert(self.outcome_label());
        // gRPC's trailers-only form has no room for the stable code: in process it stays
        // readable.
        response
            .extensions_mut()
            .insert(ProblemCode(self.code.clone()));
        let code = self.code_for_grpc();
        let message = self.grpc_message();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(GRPC_CONTENT_TYPE),
        );
        headers.insert(GRPC_STATUS, HeaderValue::from(code.as_i32()));
        let encoded = utf8_percent_encode(&message, GRPC_MESSAGE_ESCAPES).to_string();
        if let Ok(value) = HeaderValue::from_str(&encoded) {
            headers.insert(GRPC_MESSAGE, value);
        }
        if self.no_retry {
            headers.insert(GRPC_PUSHBACK, HeaderValue::from_static("-1"));
        } else if let Some(wait) = self.retry_after {
            headers.insert(GRPC_PUSHBACK, HeaderValue::from(pushback_ms(wait)));
        }
        response
    }
}

impl Problem {
    /// The `grpc-message` of this answer: the detail (else the title), then each extension
    /// member as ` (name=value)`, which is where gRPC callers find what an HTTP caller reads
    /// from the document's members.
    pub fn grpc_message(&self) -> String {
        let mut message = self
            .detail
            .clone()
            .unwrap_or_else(|| self.title.to_string());
        for (name, value) in &self.extra {
            let value = match value {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            message.push_str(&format!(" ({name}={value})"));
        }
        message
    }
}

/// A tonic method answers a [`Problem`] as the stack's gRPC refusals do: its gRPC code
/// ([`Problem::code_for_grpc`]), [`Problem::grpc_message`], and `grpc-retry-pushback-ms` (`-1`
/// for "do not retry").
#[cfg(feature = "tonic")]
impl From<Problem> for tonic::Status {
    fn from(problem: Problem) -> Self {
        let mut status = tonic::Status::new(
            tonic::Code::from_i32(problem.code_for_grpc().as_i32()),
            problem.grpc_message(),
        );
        let pushback = if problem.no_retry {
            Some(tonic::metadata::MetadataValue::from_static("-1"))
        } else {
            problem
                .retry_after
                .map(|wait| tonic::metadata::MetadataValue::from(pushback_ms(wait)))
        };
        if let Some(value) = pushback {
            status
                .metadata_mut()
                .insert(crate::status::GRPC_RETRY_PUSHBACK_MS, value);
        }
        status
    }
}

/// Whole milliseconds of a pushback, rounded up and at least 1: "retry at once" would only
/// feed the overload.
fn pushback_ms(wait: Duration) -> u64 {
    let ms = wait.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(u64::MAX).max(1)
}

/// An axum handler returns a `Problem` (or `Result<_, Problem>`) as it is.
#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for Problem {
    fn into_response(self) -> axum_core::response::Response {
        self.into_http_response()
    }
}

/// An axum handler returns a [`Status`] as its problem+json answer, with `Retry-After` when it
/// carries pushback.
#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for Status {
    fn into_response(self) -> axum_core::response::Response {
        Problem::from_status(&self).into_http_response()
    }
}

impl From<&Status> for Problem {
    fn from(status: &Status) -> Self {
        Self::from_status(status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;

    fn json(response: &Response<Bytes>) -> Value {
        serde_json::from_slice(response.body()).unwrap()
    }

    #[test]
    fn document_members() {
        let response: Response<Bytes> =
            Problem::new(StatusCode::CONFLICT, "idempotency_key_reused")
                .detail("the key was used with other parameters")
                .with("fingerprint_prefix", "0a1b2c3d")
                .into_http_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::CONTENT_TYPE], CONTENT_TYPE);
        assert!(response.headers().get(header::RETRY_AFTER).is_none());
        let doc = json(&response);
        assert_eq!(doc["type"], "urn:backstop:problem:idempotency_key_reused");
        assert_eq!(doc["title"], "Conflict");
        assert_eq!(doc["status"], 409);
        assert_eq!(doc["code"], "idempotency_key_reused");
        assert_eq!(doc["fingerprint_prefix"], "0a1b2c3d");
        assert!(doc.get("retry_after").is_none());
    }

    #[test]
    fn conflicts_are_fatal_and_in_progress_is_retryable() {
        let outcome = |p: Problem| {
            let response: Response<Bytes> = p.into_http_response();
            *response.extensions().get::<Outcome>().unwrap()
        };
        // Same order with another key, key reused: conflicts, retrying cannot help.
        assert_eq!(
            outcome(Problem::new(StatusCode::CONFLICT, "order_conflict")),
            Outcome::Fatal
        );
        let in_progress = Status::new(Code::Aborted, "in progress")
            .with_problem("request_in_progress")
            .with_pushback(Duration::from_secs(1));
        assert_eq!(
            outcome(Problem::from_status(&in_progress)),
            Outcome::Retryable
        );
        assert_eq!(
            outcome(Problem::new(StatusCode::CONFLICT, "x").retry_after(Duration::from_secs(1))),
            Outcome::Retryable
        );
        assert_eq!(
            outcome(Problem::new(StatusCode::SERVICE_UNAVAILABLE, "x")),
            Outcome::Retryable
        );
        assert_eq!(
            outcome(Problem::new(StatusCode::CONFLICT, "x").outcome(Outcome::Rejected)),
            Outcome::Rejected
        );
    }

    #[test]
    fn from_status_maps_http_and_pushback() {
        let status = Status::new(Code::ResourceExhausted, "tenant over quota")
            .with_problem("rate_limited")
            .with_pushback(Duration::from_millis(10));
        let response: Response<Bytes> = Problem::from_status(&status).into_http_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        // Never "Retry-After: 0": at least one second.
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let doc = json(&response);
        assert_eq!(doc["code"], "rate_limited");
        assert_eq!(doc["detail"], "tenant over quota");
        assert_eq!(doc["retry_after"], 1);
    }

    #[test]
    fn no_retry_is_a_negative_grpc_pushback_and_a_long_retry_after() {
        let status = Status::overloaded(Duration::from_secs(45)).with_no_retry();
        assert!(status.no_retry());
        let grpc: Response<Bytes> = Problem::from_status(&status).into_grpc_response();
        assert_eq!(grpc.headers()[GRPC_PUSHBACK], "-1");
        let http: Response<Bytes> = Problem::from_status(&status).into_http_response();
        assert_eq!(http.headers()[header::RETRY_AFTER], "45");
        assert_eq!(http.headers()[GRPC_PUSHBACK], "-1");
        // The client reads a negative pushback as "do not retry".
        #[cfg(feature = "client")]
        assert_eq!(
            crate::client::classify::pushback(grpc.headers()),
            Some(Duration::MAX)
        );
        let plain: Response<Bytes> =
            Problem::from_status(&Status::overloaded(Duration::from_millis(250)))
                .into_grpc_response();
        assert_eq!(plain.headers()[GRPC_PUSHBACK], "250");
    }

    #[test]
    fn reserved_members_are_not_overridden() {
        let response: Response<Bytes> = Problem::new(StatusCode::BAD_REQUEST, "invalid_body")
            .with("status", 200)
            .with("code", "ok")
            .into_http_response();
        let doc = json(&response);
        assert_eq!(doc["status"], 400);
        assert_eq!(doc["code"], "invalid_body");
    }

    fn grpc(p: Problem) -> Response<Bytes> {
        p.into_response_for(Protocol::Grpc)
    }

    #[test]
    fn protocol_by_content_type() {
        let of = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, ct.parse().unwrap());
            Protocol::of(&h)
        };
        assert_eq!(of("application/grpc"), Protocol::Grpc);
        assert_eq!(of("application/grpc+proto"), Protocol::Grpc);
        assert_eq!(of("application/grpc;charset=utf-8"), Protocol::Grpc);
        assert_eq!(of("application/grpc-web"), Protocol::Http);
        assert_eq!(of("application/json"), Protocol::Http);
        assert_eq!(Protocol::of(&HeaderMap::new()), Protocol::Http);
    }

    #[test]
    fn grpc_refusal_is_trailers_only_with_pushback_in_ms() {
        let status = Status::new(Code::Aborted, "still running")
            .with_problem("request_in_progress")
            .with_pushback(Duration::from_micros(1500));
        let response = grpc(Problem::from_status(&status));
        assert_eq!(response.status(), StatusCode::OK);
        assert!(response.body().is_empty());
        let h = response.headers();
        assert_eq!(h[header::CONTENT_TYPE], "application/grpc");
        assert_eq!(h[GRPC_STATUS], "10");
        assert_eq!(h[GRPC_MESSAGE], "still running");
        // Rounded up, never 0; no Retry-After for gRPC.
        assert_eq!(h[GRPC_PUSHBACK], "2");
        assert!(h.get(header::RETRY_AFTER).is_none());
        assert_eq!(grpc_status(h), Some(Code::Aborted));
        assert_eq!(
            *response.extensions().get::<Outcome>().unwrap(),
            Outcome::Retryable
        );
        // The stable code the trailers cannot carry, for in-process callers.
        assert_eq!(
            response.extensions().get::<ProblemCode>().map(|c| &*c.0),
            Some("request_in_progress")
        );
    }

    #[test]
    fn grpc_codes_follow_http_when_not_set() {
        let code = |p: Problem| grpc_status(grpc(p).headers()).unwrap();
        assert_eq!(
            code(Problem::new(StatusCode::CONFLICT, "order_conflict")),
            Code::AlreadyExists
        );
        assert_eq!(
            code(Problem::new(StatusCode::CONFLICT, "x").retry_after(Duration::from_secs(1))),
            Code::Aborted
        );
        assert_eq!(
            code(Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large"
            )),
            Code::ResourceExhausted
        );
        assert_eq!(
            code(Problem::new(StatusCode::CONFLICT, "k").grpc_code(Code::FailedPrecondition)),
            Code::FailedPrecondition
        );
    }

    #[test]
    fn grpc_message_is_percent_encoded_with_members() {
        let response = grpc(
            Problem::new(StatusCode::CONFLICT, "idempotency_key_reused")
                .detail("100% reused: ключ")
                .with("fingerprint_prefix", "0a1b2c3d"),
        );
        assert_eq!(
            response.headers()[GRPC_MESSAGE],
            "100%25 reused: %D0%BA%D0%BB%D1%8E%D1%87 (fingerprint_prefix=0a1b2c3d)"
        );
    }

    #[test]
    fn deadline_exceeded_is_504() {
        let status = Status::new(Code::DeadlineExceeded, "deadline exceeded")
            .with_problem("deadline_exceeded");
        let problem = Problem::from_status(&status);
        assert_eq!(problem.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(problem.code(), "deadline_exceeded");
    }

    #[cfg(feature = "tonic")]
    #[test]
    fn a_tonic_status_carries_the_code_message_members_and_pushback() {
        let problem = Problem::new(StatusCode::CONFLICT, "order_conflict")
            .detail("taken")
            .with("intent_id", "i-1");
        let status = tonic::Status::from(problem.clone());
        assert_eq!(status.code(), tonic::Code::AlreadyExists);
        assert_eq!(status.message(), "taken (intent_id=i-1)");
        assert_eq!(status.message(), problem.grpc_message());
        assert!(
            status
                .metadata()
                .get(crate::status::GRPC_RETRY_PUSHBACK_MS)
                .is_none()
        );

        let busy = tonic::Status::from(
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable")
                .retry_after(Duration::from_millis(1500)),
        );
        assert_eq!(busy.code(), tonic::Code::Unavailable);
        assert_eq!(
            busy.metadata()
                .get(crate::status::GRPC_RETRY_PUSHBACK_MS)
                .unwrap(),
            "1500"
        );
        let shed = tonic::Status::from(
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded").no_retry(),
        );
        assert_eq!(
            shed.metadata()
                .get(crate::status::GRPC_RETRY_PUSHBACK_MS)
                .unwrap(),
            "-1"
        );
        let fatal = tonic::Status::from(
            Problem::new(StatusCode::BAD_GATEWAY, "psp_conflict").grpc_code(Code::Internal),
        );
        assert_eq!(fatal.code(), tonic::Code::Internal);
    }
}
