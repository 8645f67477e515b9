//! RFC 9457 `application/problem+json` responses built from a [`Status`].
//!
//! Every refusal the server layers produce is a problem document with a stable `code` that
//! clients can switch on, the HTTP status from the DESIGN section 3 table, and, when the server
//! asks the client to back off, a `Retry-After` header (delta-seconds, at least 1) mirrored in the
//! `retry_after` field.
//!
//! ```
//! use backstop::server::problem::Problem;
//! use backstop::status::{Code, Status};
//! use std::time::Duration;
//!
//! let status = Status::new(Code::Unavailable, "server at capacity")
//!     .with_problem("overloaded")
//!     .with_pushback(Duration::from_millis(1500));
//! let response: http::Response<bytes::Bytes> = Problem::from_status(&status).into_response();
//! assert_eq!(response.status(), 503);
//! assert_eq!(response.headers()["retry-after"], "2");
//! assert_eq!(response.headers()["content-type"], "application/problem+json");
//! let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
//! assert_eq!(body["code"], "overloaded");
//! assert_eq!(body["retry_after"], 2);
//! ```

use std::borrow::Cow;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde::Serialize;
use serde_json::{Map, Value};

use crate::admission::RetryAfter;
use crate::status::{Outcome, Status};

/// The media type of a problem document (RFC 9457 section 3).
pub const CONTENT_TYPE: &str = "application/problem+json";

/// Prefix of the `type` URI; the stable `code` follows it (`urn:backstop:problem:overloaded`).
pub const TYPE_PREFIX: &str = "urn:backstop:problem:";

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
    outcome: Option<Outcome>,
    extra: Map<String, Value>,
}

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
            outcome: None,
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
        problem.outcome = Some(status.outcome());
        problem
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
    pub fn into_response<B: From<Bytes>>(self) -> Response<B> {
        let body = self.to_json();
        let mut response = Response::new(B::from(body));
        // Carried to the metrics layer: an HTTP status alone cannot tell a 409 conflict from a
        // 409 in progress.
        response.extensions_mut().insert(self.outcome_label());
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
        if let Some(wait) = self.retry_after {
            headers.insert(header::RETRY_AFTER, RetryAfter(wait).header_value());
        }
        response
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
                .into_response();
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
            let response: Response<Bytes> = p.into_response();
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
        let response: Response<Bytes> = Problem::from_status(&status).into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        // Never "Retry-After: 0": at least one second.
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let doc = json(&response);
        assert_eq!(doc["code"], "rate_limited");
        assert_eq!(doc["detail"], "tenant over quota");
        assert_eq!(doc["retry_after"], 1);
    }

    #[test]
    fn reserved_members_are_not_overridden() {
        let response: Response<Bytes> = Problem::new(StatusCode::BAD_REQUEST, "invalid_body")
            .with("status", 200)
            .with("code", "ok")
            .into_response();
        let doc = json(&response);
        assert_eq!(doc["status"], 400);
        assert_eq!(doc["code"], "invalid_body");
    }

    #[test]
    fn deadline_exceeded_is_504() {
        let status = Status::new(Code::DeadlineExceeded, "deadline exceeded")
            .with_problem("deadline_exceeded");
        let problem = Problem::from_status(&status);
        assert_eq!(problem.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(problem.code(), "deadline_exceeded");
    }
}
