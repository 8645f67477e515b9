//! Reading an attempt's result as a [`Status`]: HTTP status, `grpc-status`, pushback.
//!
//! The classification table itself lives in [`crate::status`], and so does the reading of an
//! answer's head ([`Status::from_head`], which the server's request metrics use too); this
//! module applies them to a response or an error:
//!
//! - a `grpc-status` header wins (a gRPC *trailers-only* response, which is how servers answer
//!   errors before any message, carries it in the headers), with `grpc-message`;
//! - otherwise the HTTP status, by [`Code::from_http`]. A 409 without pushback is a definitive
//!   conflict (key reused, order exists), not "in progress", so it is fatal;
//! - pushback from `grpc-retry-pushback-ms` (milliseconds) or `Retry-After` (seconds or an
//!   HTTP-date). A negative or unparseable value means "do not retry" (gRPC A6): it is read as
//!   an endless pushback, which the executor refuses to wait for (`pushback`);
//! - a gRPC response with HTTP 200 and no `grpc-status` header carries its status in trailers,
//!   after the body: at this layer it counts as a success;
//! - errors: an attempt whose own request body failed is its caller's fault, with the status
//!   [`RequestBodyError::status`] reads from it (400, 408, 413; never the peer's), an attempt
//!   the deadline layer refused is `DEADLINE_EXCEEDED`, an open circuit is `UNAVAILABLE`
//!   marked [`problem::CIRCUIT_OPEN`], anything else (a transport failure) is `UNAVAILABLE`.

use std::error::Error as StdError;
use std::time::Duration;

use http::{HeaderMap, Response, StatusCode};

use super::body_error::RequestBodyError;
use super::circuit_open::CircuitOpen;
use crate::deadline::DeadlineExceeded;
use crate::status::{Code, Status, problem};

/// Header carrying a gRPC status code.
pub const GRPC_STATUS: &str = "grpc-status";
/// Header carrying a gRPC status message (percent-encoded on the wire).
pub const GRPC_MESSAGE: &str = "grpc-message";

/// Reads an attempt's response head (status and headers) as a failure, or `None` for a
/// success. [`classify_head`] is the default; a destination whose answers mean something else
/// (a provider whose 500 means "try again") gives the retry layer its own.
pub type Classifier = fn(StatusCode, &HeaderMap) -> Option<Status>;

/// The failure an attempt's response reports, or `None` when it succeeded ([`classify_head`]).
pub fn response_status<B>(response: &Response<B>) -> Option<Status> {
    classify_head(response.status(), response.headers())
}

/// The default [`Classifier`]: `grpc-status` first, else the HTTP status (module docs). It is
/// [`Status::from_head`], the reading the server's request metrics use too, so that a client
/// and a server say the same of one answer.
pub fn classify_head(http: StatusCode, headers: &HeaderMap) -> Option<Status> {
    Status::from_head(http, headers)
}

/// The pushback a response asks for. `Some(Duration::MAX)` for a value that is negative or
/// cannot be read: the server said something other than "retry after", so do not retry
/// ([`status::pushback`](crate::status::pushback)).
pub fn pushback(headers: &HeaderMap) -> Option<Duration> {
    crate::status::pushback(headers)
}

/// The status of an attempt that ended in an error instead of a response.
pub fn error_status(error: &(dyn StdError + 'static)) -> Status {
    if let Some(body) = RequestBodyError::find(error) {
        return body.status().clone();
    }
    let mut cause: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(e) = cause {
        if let Some(exceeded) = e.downcast_ref::<DeadlineExceeded>() {
            return Status::from(*exceeded);
        }
        if let Some(open) = e.downcast_ref::<CircuitOpen>() {
            return Status::new(Code::Unavailable, open.to_string())
                .with_problem(problem::CIRCUIT_OPEN)
                .with_pushback(open.retry_in);
        }
        if e.is::<tokio::time::error::Elapsed>() {
            return Status::new(Code::DeadlineExceeded, "attempt timed out")
                .with_problem(problem::DEADLINE_EXCEEDED);
        }
        cause = e.source();
    }
    Status::new(Code::Unavailable, format!("transport error: {error}"))
}

/// Whether a failure says the destination is unwell (for the circuit breaker): a transient
/// failure, a timeout, or a server-side fault (`INTERNAL`, `UNKNOWN`, `DATA_LOSS`, i.e. 5xx).
/// Refusals of the request itself (4xx, quota) say the destination works.
pub(crate) fn is_failure_of_destination(status: &Status) -> bool {
    use crate::status::RetryClass;
    matches!(
        status.retry_class(),
        RetryClass::Retryable | RetryClass::Timeout
    ) || matches!(
        status.code(),
        Code::Internal | Code::Unknown | Code::DataLoss
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{GRPC_RETRY_PUSHBACK_MS, RetryClass};

    fn response(status: u16, headers: &[(&str, &str)]) -> Response<()> {
        let mut builder = Response::builder().status(status);
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        builder.body(()).unwrap()
    }

    #[test]
    fn successes_have_no_status() {
        assert!(response_status(&response(200, &[])).is_none());
        assert!(response_status(&response(201, &[])).is_none());
        assert!(response_status(&response(200, &[("grpc-status", "0")])).is_none());
        // Status in trailers, not known yet.
        assert!(response_status(&response(200, &[("content-type", "application/grpc")])).is_none());
    }

    #[test]
    fn trailers_only_grpc_errors_are_read_from_headers() {
        let s = response_status(&response(
            200,
            &[
                ("grpc-status", "14"),
                ("grpc-message", "psp down"),
                ("grpc-retry-pushback-ms", "250"),
            ],
        ))
        .unwrap();
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(s.message(), "psp down");
        assert_eq!(s.pushback(), Some(Duration::from_millis(250)));
        let s = response_status(&response(200, &[("grpc-status", "nonsense")])).unwrap();
        assert_eq!(s.code(), Code::Unknown);
    }

    #[test]
    fn http_statuses_follow_the_table_with_their_retry_after() {
        let s = response_status(&response(503, &[("retry-after", "2")])).unwrap();
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(s.pushback(), Some(Duration::from_secs(2)));
        let s = response_status(&response(429, &[])).unwrap();
        assert_eq!(s.retry_class(), RetryClass::RetryAfterPushback);
        let s = response_status(&response(504, &[])).unwrap();
        assert_eq!(s.retry_class(), RetryClass::Timeout);
        let s = response_status(&response(400, &[])).unwrap();
        assert_eq!(s.retry_class(), RetryClass::Fatal);
    }

    #[test]
    fn a_conflict_without_pushback_is_fatal_and_in_progress_is_not() {
        let conflict = response_status(&response(409, &[])).unwrap();
        assert_eq!(conflict.retry_class(), RetryClass::Fatal);
        assert_eq!(conflict.http_status(), StatusCode::CONFLICT);
        let busy = response_status(&response(409, &[("retry-after", "1")])).unwrap();
        assert_eq!(busy.code(), Code::Aborted);
        assert_eq!(busy.pushback(), Some(Duration::from_secs(1)));
    }

    #[test]
    fn negative_or_unparseable_pushback_means_do_not_retry() {
        for value in ["-1", "soon", "1.5", ""] {
            let mut h = HeaderMap::new();
            h.insert(GRPC_RETRY_PUSHBACK_MS, value.parse().unwrap());
            assert_eq!(pushback(&h), Some(Duration::MAX), "{value:?}");
        }
        let mut h = HeaderMap::new();
        h.insert(http::header::RETRY_AFTER, "never".parse().unwrap());
        assert_eq!(pushback(&h), Some(Duration::MAX));
        assert_eq!(pushback(&HeaderMap::new()), None);
    }

    #[test]
    fn errors_are_classified_by_type() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(error_status(&refused).code(), Code::Unavailable);
        let open = CircuitOpen {
            retry_in: Duration::from_secs(1),
        };
        let s = error_status(&open);
        assert_eq!(
            (s.code(), s.problem()),
            (Code::Unavailable, problem::CIRCUIT_OPEN)
        );
        let late = DeadlineExceeded {
            remaining: Duration::ZERO,
            margin: Duration::from_millis(5),
        };
        assert_eq!(error_status(&late).code(), Code::DeadlineExceeded);
    }

    #[test]
    fn a_failed_request_body_is_the_callers_not_a_transport_error() {
        #[derive(Debug, thiserror::Error)]
        #[error("client error (SendRequest)")]
        struct Transport(#[source] RequestBodyError);
        let cut = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        let status = error_status(&Transport(RequestBodyError::new(cut)));
        assert_eq!(status.http_status(), StatusCode::BAD_REQUEST);
        assert_eq!(status.problem(), problem::REQUEST_BODY_INVALID);
        assert_eq!(status.outcome(), crate::status::Outcome::Rejected);
        assert!(!is_failure_of_destination(&status));
    }
}
