//! One error type for every outcome, with its retry class decided in one place.
//!
//! Whether a failure may be retried is a property of the failure, not of the code path that saw
//! it. A [`Status`] carries the gRPC [`Code`], the HTTP status it maps to (grpc-gateway's table),
//! its [`RetryClass`], an optional pushback (`Retry-After` /
//! `grpc-retry-pushback-ms`) and a stable problem code that `application/problem+json` bodies
//! carry in their `code` field. The HTTP and gRPC adapters both read this one table, so the two
//! protocols cannot drift apart.
//!
//! The easy mistake this module guards against: `DEADLINE_EXCEEDED` means "I stopped waiting",
//! not "the server did nothing". It is its own class, [`RetryClass::Timeout`], retried only with
//! an idempotency key and time left.
//!
//! ```
//! use std::time::Duration;
//! use backstop::status::{Code, Outcome, RetryClass, Status, problem};
//!
//! let busy = Status::new(Code::Aborted, "another request with this key is running")
//!     .with_problem(problem::REQUEST_IN_PROGRESS)
//!     .with_pushback(Duration::from_secs(1));
//! assert_eq!(busy.http_status(), http::StatusCode::CONFLICT);
//! assert_eq!(busy.retry_class(), RetryClass::RetryAfterPushback);
//! assert_eq!(busy.outcome(), Outcome::Retryable);
//! assert_eq!(busy.problem(), "request_in_progress");
//!
//! let overloaded = Status::overloaded(Duration::from_millis(1500));
//! assert_eq!(overloaded.http_status(), http::StatusCode::SERVICE_UNAVAILABLE);
//! assert_eq!(overloaded.outcome(), Outcome::Rejected);
//! ```

use std::borrow::Cow;
use std::fmt;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, StatusCode};

use crate::admission::RetryAfter;
use crate::deadline::DeadlineExceeded;

/// gRPC response metadata key carrying the server's pushback in milliseconds.
pub const GRPC_RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";

// Typed header names: looking a `&str` up in a `HeaderMap` parses it first, on every answer.
static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
pub(crate) static GRPC_RETRY_PUSHBACK_MS_NAME: HeaderName =
    HeaderName::from_static(GRPC_RETRY_PUSHBACK_MS);

/// Longest `grpc-message` kept in a status read from an answer, in bytes.
const MAX_MESSAGE: usize = 256;

/// HTTP 499 "client closed request" (nginx), the grpc-gateway mapping of `CANCELLED`.
const CLIENT_CLOSED_REQUEST: u16 = 499;

/// Stable problem codes used in `application/problem+json` bodies (field `code`).
///
/// A status without an explicit problem code uses [`Code::problem`], the code's name in
/// snake case (`"unavailable"`, `"deadline_exceeded"`, ...).
pub mod problem {
    /// Another request with the same idempotency key is still running (409 + Retry-After).
    pub const REQUEST_IN_PROGRESS: &str = "request_in_progress";
    /// The idempotency key was used before with other parameters (409).
    pub const IDEMPOTENCY_KEY_REUSED: &str = "idempotency_key_reused";
    /// The `Idempotency-Key` header is required and missing (400).
    pub const MISSING_IDEMPOTENCY_KEY: &str = "missing_idempotency_key";
    /// The `Idempotency-Key` header is malformed (400).
    pub const INVALID_IDEMPOTENCY_KEY: &str = "invalid_idempotency_key";
    /// The `grpc-timeout` header is malformed (400).
    pub const INVALID_GRPC_TIMEOUT: &str = "invalid_grpc_timeout";
    /// A retry found the key's earlier run stopped before it answered, on a route that does
    /// not repeat an effect that may have happened: the outcome is unknown (500, stored and
    /// replayed; not retryable).
    pub const OUTCOME_UNKNOWN: &str = "outcome_unknown";
    /// The server itself is over capacity (503 + Retry-After).
    pub const OVERLOADED: &str = "overloaded";
    /// The tenant is over its quota (429 + Retry-After).
    pub const RATE_LIMITED: &str = "rate_limited";
    /// The request's deadline passed (504); its outcome may be unknown.
    pub const DEADLINE_EXCEEDED: &str = "deadline_exceeded";
    /// A client-side circuit breaker is open for the destination: the attempt was not sent
    /// (`UNAVAILABLE`); the retry executor stops with `circuit_open`.
    pub const CIRCUIT_OPEN: &str = "circuit_open";
    /// The request body is larger than allowed (413).
    pub const BODY_TOO_LARGE: &str = "body_too_large";
    /// A retry of a keyed request that was carried out, whose answer's body was larger than
    /// its method keeps for replay: the original status and headers with this problem as the
    /// body, naming the limit (`max_replay_body`). Not retryable: the request is not run
    /// again.
    pub const REPLAY_BODY_TOO_LARGE: &str = "replay_body_too_large";
    /// The request body or parameters are invalid (400).
    pub const INVALID_REQUEST: &str = "invalid_request";
    /// The request body broke on its way in: malformed framing (a bad chunk size) or cut
    /// short (400). The caller's fault, never counted against the service called
    /// (`client::RequestBodyError`).
    pub const REQUEST_BODY_INVALID: &str = "request_body_invalid";
    /// The request body came too slowly (408). The caller's fault, like
    /// [`REQUEST_BODY_INVALID`].
    pub const REQUEST_BODY_TIMEOUT: &str = "request_body_timeout";
    /// Missing or bad credentials (401).
    pub const UNAUTHENTICATED: &str = "unauthenticated";
    /// The shared rate limiter (Redis) did not answer and the policy is to refuse
    /// (503 + Retry-After).
    pub const RATE_LIMITER_UNAVAILABLE: &str = "rate_limiter_unavailable";
}

/// gRPC status codes, with their wire values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i32)]
pub enum Code {
    /// Success.
    Ok = 0,
    /// The caller cancelled the call.
    Cancelled = 1,
    /// An error with no better code.
    Unknown = 2,
    /// The request is invalid whatever the server's state.
    InvalidArgument = 3,
    /// The deadline passed before the call finished; the effect may or may not have happened.
    DeadlineExceeded = 4,
    /// The entity does not exist.
    NotFound = 5,
    /// The entity already exists.
    AlreadyExists = 6,
    /// The caller may not do this.
    PermissionDenied = 7,
    /// A quota or a resource ran out (rate limits).
    ResourceExhausted = 8,
    /// The system is not in a state where the operation can run.
    FailedPrecondition = 9,
    /// A concurrency conflict; retry later, at a higher level.
    Aborted = 10,
    /// Out of the valid range.
    OutOfRange = 11,
    /// Not implemented or not supported.
    Unimplemented = 12,
    /// An invariant broke.
    Internal = 13,
    /// Transiently unavailable; a retry may succeed.
    Unavailable = 14,
    /// Unrecoverable data loss or corruption.
    DataLoss = 15,
    /// No valid credentials.
    Unauthenticated = 16,
}

/// How a failure may be retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryClass {
    /// Transient: retry with backoff (a non-idempotent method only with its key).
    Retryable,
    /// The server said "not now": retry only after its pushback / `Retry-After`.
    RetryAfterPushback,
    /// The caller stopped waiting; retry only with an idempotency key and time left, else the
    /// outcome is unknown.
    Timeout,
    /// Retrying cannot help (also the class of [`Code::Ok`], which has nothing to retry).
    Fatal,
}

/// The `outcome` metric label: exactly six values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Succeeded.
    Ok,
    /// Failed in a way a retry may fix.
    Retryable,
    /// Failed in a way a retry cannot fix.
    Fatal,
    /// The deadline passed.
    Timeout,
    /// Refused by admission control (overload or quota) before any work was done.
    Rejected,
    /// The caller went away (disconnected, or cancelled a hedge that lost) before the answer:
    /// not a failure of the server.
    Cancelled,
}

impl Outcome {
    /// All label values.
    pub const ALL: [Outcome; 6] = [
        Outcome::Ok,
        Outcome::Retryable,
        Outcome::Fatal,
        Outcome::Timeout,
        Outcome::Rejected,
        Outcome::Cancelled,
    ];

    /// Position in [`Outcome::ALL`]: an index into per-outcome tables.
    pub(crate) const fn index(self) -> usize {
        match self {
            Outcome::Ok => 0,
            Outcome::Retryable => 1,
            Outcome::Fatal => 2,
            Outcome::Timeout => 3,
            Outcome::Rejected => 4,
            Outcome::Cancelled => 5,
        }
    }

    /// The label value: `ok`, `retryable`, `fatal`, `timeout`, `rejected` or `cancelled`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Retryable => "retryable",
            Outcome::Fatal => "fatal",
            Outcome::Timeout => "timeout",
            Outcome::Rejected => "rejected",
            Outcome::Cancelled => "cancelled",
        }
    }

    /// The outcome of an HTTP response seen only by its status: 2xx/3xx ok, 429 rejected,
    /// otherwise by the class of [`Code::from_http`] (409 as `ABORTED`, in progress). A layer
    /// that knows it refused the request itself (for example a 503 from the gate) should report
    /// [`Outcome::Rejected`] directly. An answer's outcome is [`Outcome::of_head`], which also
    /// reads `grpc-status` and the pushback its headers carry.
    pub fn from_http(status: StatusCode) -> Outcome {
        if status == StatusCode::TOO_MANY_REQUESTS {
            return Outcome::Rejected;
        }
        Outcome::of_code(Code::from_http(status))
    }

    /// The outcome of an answer, read from its head as [`Status::from_head`] reads it: `ok`
    /// for a success, else the outcome of the failure. The one reading of an answer that the
    /// client (its `rpc_attempt` events and attempt metrics) and the server (its request
    /// metrics and `rpc_server_request` events) share, so that both say the same of it: a 409
    /// with a pushback (in progress) is `retryable`, a bare 409 (a conflict) `fatal`.
    ///
    /// ```
    /// use backstop::status::Outcome;
    /// use http::{HeaderMap, StatusCode, header::RETRY_AFTER};
    ///
    /// let mut in_progress = HeaderMap::new();
    /// in_progress.insert(RETRY_AFTER, "1".parse().unwrap());
    /// assert_eq!(Outcome::of_head(StatusCode::CONFLICT, &in_progress), Outcome::Retryable);
    /// assert_eq!(Outcome::of_head(StatusCode::CONFLICT, &HeaderMap::new()), Outcome::Fatal);
    /// ```
    pub fn of_head(http: StatusCode, headers: &HeaderMap) -> Outcome {
        Status::from_head(http, headers).map_or(Outcome::Ok, |status| status.outcome())
    }

    /// The outcome for a code: `Ok` is ok, `CANCELLED` (the caller went away) cancelled;
    /// otherwise by [`Code::retry_class`] (quota refusals, `RESOURCE_EXHAUSTED`, are rejected).
    pub const fn of_code(code: Code) -> Outcome {
        match code {
            Code::Ok => Outcome::Ok,
            Code::Cancelled => Outcome::Cancelled,
            Code::ResourceExhausted => Outcome::Rejected,
            _ => match code.retry_class() {
                RetryClass::Retryable | RetryClass::RetryAfterPushback => Outcome::Retryable,
                RetryClass::Timeout => Outcome::Timeout,
                RetryClass::Fatal => Outcome::Fatal,
            },
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Code {
    /// Every code, in wire order.
    pub const ALL: [Code; 17] = [
        Code::Ok,
        Code::Cancelled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    /// The code for a wire value; values outside 0..=16 are `Unknown`, as gRPC specifies.
    pub fn from_i32(value: i32) -> Code {
        usize::try_from(value)
            .ok()
            .and_then(|i| Code::ALL.get(i).copied())
            .unwrap_or(Code::Unknown)
    }

    /// The wire value.
    pub const fn as_i32(self) -> i32 {
        self as i32
    }

    /// The canonical name, e.g. `"UNAVAILABLE"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Code::Ok => "OK",
            Code::Cancelled => "CANCELLED",
            Code::Unknown => "UNKNOWN",
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::PermissionDenied => "PERMISSION_DENIED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::Aborted => "ABORTED",
            Code::OutOfRange => "OUT_OF_RANGE",
            Code::Unimplemented => "UNIMPLEMENTED",
            Code::Internal => "INTERNAL",
            Code::Unavailable => "UNAVAILABLE",
            Code::DataLoss => "DATA_LOSS",
            Code::Unauthenticated => "UNAUTHENTICATED",
        }
    }

    /// The default problem code: the name in snake case, e.g. `"deadline_exceeded"`.
    pub const fn problem(self) -> &'static str {
        match self {
            Code::Ok => "ok",
            Code::Cancelled => "cancelled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status (grpc-gateway's mapping). `FAILED_PRECONDITION` is
    /// 400 here; a key or state conflict answers 409 through [`Status::with_http_status`].
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Ok => StatusCode::OK,
            Code::Cancelled => StatusCode::from_u16(CLIENT_CLOSED_REQUEST)
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                StatusCode::BAD_REQUEST
            }
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }

    /// The retry class.
    pub const fn retry_class(self) -> RetryClass {
        match self {
            Code::Unavailable => RetryClass::Retryable,
            Code::ResourceExhausted | Code::Aborted => RetryClass::RetryAfterPushback,
            Code::DeadlineExceeded => RetryClass::Timeout,
            Code::Ok
            | Code::Cancelled
            | Code::Unknown
            | Code::InvalidArgument
            | Code::NotFound
            | Code::AlreadyExists
            | Code::PermissionDenied
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::Unimplemented
            | Code::Internal
            | Code::DataLoss
            | Code::Unauthenticated => RetryClass::Fatal,
        }
    }

    /// The code for an HTTP status, the reverse of [`Code::http_status`]: 409 reads as
    /// `ABORTED` (in progress, retry after pushback); other 4xx as `INVALID_ARGUMENT`
    /// (`FAILED_PRECONDITION` for 412), 502 and 503 as `UNAVAILABLE`, other 5xx as `UNKNOWN`.
    pub fn from_http(status: StatusCode) -> Code {
        match status.as_u16() {
            200..=399 => Code::Ok,
            400 | 413 | 422 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            409 => Code::Aborted,
            412 => Code::FailedPrecondition,
            429 => Code::ResourceExhausted,
            CLIENT_CLOSED_REQUEST => Code::Cancelled,
            500 => Code::Internal,
            501 => Code::Unimplemented,
            502 | 503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            405..=499 => Code::InvalidArgument,
            _ => Code::Unknown,
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of a call: code, message, pushback, problem code and (optionally) an HTTP status
/// that overrides the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    code: Code,
    message: Cow<'static, str>,
    pushback: Option<Duration>,
    problem: &'static str,
    http: Option<StatusCode>,
    rejected: bool,
    no_retry: bool,
}

impl Status {
    /// A status with `code` and a human-readable `message`.
    pub fn new(code: Code, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            code,
            message: message.into(),
            pushback: None,
            problem: code.problem(),
            http: None,
            rejected: false,
            no_retry: false,
        }
    }

    /// The server is over its own capacity: `UNAVAILABLE` / 503, problem `overloaded`,
    /// pushback `retry_after`, outcome `rejected`.
    pub fn overloaded(retry_after: Duration) -> Self {
        Self {
            rejected: true,
            ..Self::new(Code::Unavailable, "server overloaded, retry later")
                .with_problem(problem::OVERLOADED)
                .with_pushback(retry_after)
        }
    }

    /// The tenant is over its quota: `RESOURCE_EXHAUSTED` / 429, problem `rate_limited`,
    /// pushback `retry_after`, outcome `rejected`.
    pub fn rate_limited(retry_after: Duration) -> Self {
        Self {
            rejected: true,
            ..Self::new(Code::ResourceExhausted, "rate limit exceeded, retry later")
                .with_problem(problem::RATE_LIMITED)
                .with_pushback(retry_after)
        }
    }

    /// The shared rate limiter could not decide and fails closed: `UNAVAILABLE` / 503, problem
    /// `rate_limiter_unavailable`, pushback `retry_after`, outcome `rejected`.
    pub fn rate_limiter_unavailable(retry_after: Duration) -> Self {
        Self {
            rejected: true,
            ..Self::new(Code::Unavailable, "rate limiter unavailable, retry later")
                .with_problem(problem::RATE_LIMITER_UNAVAILABLE)
                .with_pushback(retry_after)
        }
    }

    /// A status read from an HTTP response status: code by [`Code::from_http`], message the
    /// canonical reason, and `status` kept as the HTTP status so it round-trips.
    pub fn from_http(status: StatusCode) -> Self {
        Self::new(
            Code::from_http(status),
            status
                .canonical_reason()
                .unwrap_or("unrecognised HTTP status"),
        )
        .with_http_status(status)
    }

    /// The failure an answer reports, read from its head (status and headers), or `None` for
    /// a success:
    ///
    /// - a `grpc-status` header wins (a gRPC *trailers-only* answer, which is how servers
    ///   answer errors before any message, carries it in the headers), with `grpc-message`;
    ///   a gRPC answer with HTTP 200 and no `grpc-status` header carries its status in
    ///   trailers, after the body: read from its head, it is a success;
    /// - otherwise the HTTP status, by [`Status::from_http`];
    /// - the pushback, by [`pushback`]. A 409 without one is a definitive conflict (key
    ///   reused, order exists), `FAILED_PRECONDITION` and fatal; "in progress" always says
    ///   when to come back.
    ///
    /// The client's default classifier
    /// ([`classify_head`](crate::client::classify::classify_head)) and the server's request
    /// metrics both read answers through it.
    pub fn from_head(http: StatusCode, headers: &HeaderMap) -> Option<Status> {
        let status = match headers.get(&GRPC_STATUS) {
            Some(value) => {
                let code = value
                    .to_str()
                    .ok()
                    .and_then(|v| v.trim().parse::<i32>().ok())
                    .map_or(Code::Unknown, Code::from_i32);
                if code == Code::Ok {
                    return None;
                }
                let message = headers
                    .get(&GRPC_MESSAGE)
                    .and_then(|m| m.to_str().ok())
                    .map_or_else(String::new, |m| {
                        m.chars().take(MAX_MESSAGE).collect::<String>()
                    });
                Status::new(code, message)
            }
            None => {
                if http.is_success() || http.is_redirection() || http.is_informational() {
                    return None;
                }
                Status::from_http(http)
            }
        };
        Some(match pushback(headers) {
            Some(wait) => status.with_pushback(wait),
            None if status.code == Code::Aborted && http == StatusCode::CONFLICT => Status {
                code: Code::FailedPrecondition,
                problem: Code::FailedPrecondition.problem(),
                ..status
            },
            None => status,
        })
    }

    /// Sets the pushback: how long the caller should wait before retrying.
    pub fn with_pushback(mut self, pushback: Duration) -> Self {
        self.pushback = Some(pushback);
        self
    }

    /// Counts this status as a refusal made before any work was done: its
    /// [`outcome`](Status::outcome) is [`Outcome::Rejected`], whatever its code. For a call the
    /// client itself refused to send (an open circuit, too little of the deadline left, adaptive
    /// throttling), as for a server's admission refusals.
    pub fn as_rejected(mut self) -> Self {
        self.rejected = true;
        self
    }

    /// Asks the caller not to retry this request at all (a server shedding hard). gRPC answers
    /// carry it as a negative `grpc-retry-pushback-ms`; HTTP ones as the pushback, which should
    /// then be long.
    pub fn with_no_retry(mut self) -> Self {
        self.no_retry = true;
        self
    }

    /// Whether the caller is asked not to retry at all (see [`Status::with_no_retry`]).
    pub fn no_retry(&self) -> bool {
        self.no_retry
    }

    /// Sets the stable problem code (see [`problem`]).
    pub fn with_problem(mut self, problem: &'static str) -> Self {
        self.problem = problem;
        self
    }

    /// Overrides the HTTP status of the table, e.g. 409 for a `FAILED_PRECONDITION` that is a
    /// key or state conflict.
    pub fn with_http_status(mut self, status: StatusCode) -> Self {
        self.http = Some(status);
        self
    }

    /// The gRPC code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The pushback, if the server asked for one.
    pub fn pushback(&self) -> Option<Duration> {
        self.pushback
    }

    /// The stable problem code for problem+json bodies.
    pub fn problem(&self) -> &'static str {
        self.problem
    }

    /// The HTTP status: the override if set, else the code's row of the table.
    pub fn http_status(&self) -> StatusCode {
        self.http.unwrap_or_else(|| self.code.http_status())
    }

    /// The retry class of the code.
    pub fn retry_class(&self) -> RetryClass {
        self.code.retry_class()
    }

    /// The `outcome` metric label: `rejected` for admission refusals (see
    /// [`Status::overloaded`], [`Status::rate_limited`], [`Status::as_rejected`]), else
    /// [`Outcome::of_code`].
    pub fn outcome(&self) -> Outcome {
        if self.rejected {
            Outcome::Rejected
        } else {
            Outcome::of_code(self.code)
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)?;
        if let Some(p) = self.pushback {
            write!(f, " (retry after {p:?})")?;
        }
        Ok(())
    }
}

impl std::error::Error for Status {}

/// A tonic method answers a [`Status`] with its code, message and pushback
/// (`grpc-retry-pushback-ms`, or `-1` for "do not retry").
#[cfg(feature = "tonic")]
impl From<Status> for tonic::Status {
    fn from(status: Status) -> Self {
        let mut answer = tonic::Status::new(
            tonic::Code::from_i32(status.code().as_i32()),
            status.message().to_owned(),
        );
        let pushback = if status.no_retry() {
            Some(tonic::metadata::MetadataValue::from_static("-1"))
        } else {
            status.pushback().map(|wait| {
                let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
                tonic::metadata::MetadataValue::from(ms)
            })
        };
        if let Some(value) = pushback {
            answer.metadata_mut().insert(GRPC_RETRY_PUSHBACK_MS, value);
        }
        answer
    }
}

/// The pushback an answer's headers ask for: `grpc-retry-pushback-ms` (milliseconds), else
/// `Retry-After` (seconds or an HTTP-date). `Some(Duration::MAX)` for a value that is negative
/// or cannot be read: the server said something other than "retry after", so do not retry
/// (gRPC A6).
pub fn pushback(headers: &HeaderMap) -> Option<Duration> {
    if let Some(value) = headers.get(&GRPC_RETRY_PUSHBACK_MS_NAME) {
        let ms = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<i64>().ok());
        return Some(match ms {
            Some(ms) if ms >= 0 => Duration::from_millis(ms.unsigned_abs()),
            _ => Duration::MAX,
        });
    }
    let value = headers.get(http::header::RETRY_AFTER)?;
    Some(
        RetryAfter::parse_bytes(value.as_bytes(), SystemTime::now())
            .map_or(Duration::MAX, |r| r.duration()),
    )
}

impl From<DeadlineExceeded> for Status {
    fn from(e: DeadlineExceeded) -> Self {
        Status::new(Code::DeadlineExceeded, e.to_string()).with_problem(problem::DEADLINE_EXCEEDED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_index_is_the_position_in_all() {
        for (i, outcome) in Outcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome.index(), i, "{outcome:?}");
        }
    }

    /// This module's one table, row by row: code, HTTP status, retry class.
    #[test]
    fn classification_table() {
        use RetryClass::*;
        let table: [(Code, u16, RetryClass); 17] = [
            (Code::Ok, 200, Fatal),
            (Code::Unavailable, 503, Retryable),
            (Code::ResourceExhausted, 429, RetryAfterPushback),
            (Code::Aborted, 409, RetryAfterPushback),
            (Code::DeadlineExceeded, 504, Timeout),
            (Code::Cancelled, 499, Fatal),
            (Code::InvalidArgument, 400, Fatal),
            (Code::NotFound, 404, Fatal),
            (Code::AlreadyExists, 409, Fatal),
            (Code::PermissionDenied, 403, Fatal),
            (Code::FailedPrecondition, 400, Fatal),
            (Code::Unauthenticated, 401, Fatal),
            (Code::Unimplemented, 501, Fatal),
            (Code::Internal, 500, Fatal),
            (Code::Unknown, 500, Fatal),
            (Code::DataLoss, 500, Fatal),
            (Code::OutOfRange, 400, Fatal),
        ];
        for (code, http, class) in table {
            let s = Status::new(code, "x");
            assert_eq!(s.http_status().as_u16(), http, "{code}");
            assert_eq!(s.retry_class(), class, "{code}");
            assert_eq!(code.http_status().as_u16(), http, "{code}");
        }
    }

    #[test]
    fn failed_precondition_conflict_overrides_to_409() {
        let s = Status::new(Code::FailedPrecondition, "key reused with other parameters")
            .with_problem(problem::IDEMPOTENCY_KEY_REUSED)
            .with_http_status(StatusCode::CONFLICT);
        assert_eq!(s.http_status(), StatusCode::CONFLICT);
        assert_eq!(s.retry_class(), RetryClass::Fatal);
        assert_eq!(s.problem(), "idempotency_key_reused");
    }

    #[test]
    fn wire_values_and_names() {
        for (i, code) in Code::ALL.iter().enumerate() {
            assert_eq!(code.as_i32(), i as i32);
            assert_eq!(Code::from_i32(i as i32), *code);
            assert_eq!(code.problem(), code.as_str().to_ascii_lowercase());
        }
        assert_eq!(Code::from_i32(17), Code::Unknown);
        assert_eq!(Code::from_i32(-1), Code::Unknown);
        assert_eq!(Code::Unavailable.as_str(), "UNAVAILABLE");
        assert_eq!(Code::Unavailable.as_i32(), 14);
        assert_eq!(Code::Unauthenticated.as_i32(), 16);
    }

    #[test]
    fn http_reverse_mapping() {
        let cases = [
            (200, Code::Ok),
            (201, Code::Ok),
            (400, Code::InvalidArgument),
            (401, Code::Unauthenticated),
            (403, Code::PermissionDenied),
            (404, Code::NotFound),
            (409, Code::Aborted),
            (412, Code::FailedPrecondition),
            (413, Code::InvalidArgument),
            (429, Code::ResourceExhausted),
            (499, Code::Cancelled),
            (500, Code::Internal),
            (501, Code::Unimplemented),
            (502, Code::Unavailable),
            (503, Code::Unavailable),
            (504, Code::DeadlineExceeded),
            (418, Code::InvalidArgument),
            (599, Code::Unknown),
        ];
        for (http, code) in cases {
            let status = StatusCode::from_u16(http).unwrap();
            assert_eq!(Code::from_http(status), code, "{http}");
            assert_eq!(Status::from_http(status).http_status(), status);
        }
        // Every code's HTTP status maps back to a code of the same retry class, except 409
        // (ALREADY_EXISTS reads back as ABORTED) and 400 (FAILED_PRECONDITION/OUT_OF_RANGE).
        for code in Code::ALL {
            let back = Code::from_http(code.http_status());
            if code.http_status() != StatusCode::CONFLICT {
                assert_eq!(back.retry_class(), code.retry_class(), "{code}");
            }
        }
    }

    #[test]
    fn outcomes() {
        assert_eq!(Status::new(Code::Ok, "").outcome(), Outcome::Ok);
        assert_eq!(
            Status::new(Code::Unavailable, "").outcome(),
            Outcome::Retryable
        );
        assert_eq!(Status::new(Code::Aborted, "").outcome(), Outcome::Retryable);
        assert_eq!(
            Status::new(Code::DeadlineExceeded, "").outcome(),
            Outcome::Timeout
        );
        assert_eq!(Status::new(Code::Internal, "").outcome(), Outcome::Fatal);
        assert_eq!(
            Status::new(Code::ResourceExhausted, "").outcome(),
            Outcome::Rejected
        );
        assert_eq!(
            Status::overloaded(Duration::from_secs(1)).outcome(),
            Outcome::Rejected
        );
        assert_eq!(
            Status::rate_limited(Duration::from_secs(1)).outcome(),
            Outcome::Rejected
        );
        assert_eq!(Outcome::from_http(StatusCode::CREATED), Outcome::Ok);
        assert_eq!(
            Outcome::from_http(StatusCode::TOO_MANY_REQUESTS),
            Outcome::Rejected
        );
        assert_eq!(
            Outcome::from_http(StatusCode::SERVICE_UNAVAILABLE),
            Outcome::Retryable
        );
        assert_eq!(
            Outcome::from_http(StatusCode::GATEWAY_TIMEOUT),
            Outcome::Timeout
        );
        assert_eq!(Outcome::from_http(StatusCode::BAD_REQUEST), Outcome::Fatal);
        let client_closed = StatusCode::from_u16(CLIENT_CLOSED_REQUEST).unwrap();
        assert_eq!(Outcome::from_http(client_closed), Outcome::Cancelled);
        assert_eq!(
            Status::new(Code::Cancelled, "").outcome(),
            Outcome::Cancelled
        );
        for (i, outcome) in Outcome::ALL.iter().enumerate() {
            assert_eq!(outcome.index(), i, "{outcome}");
        }
        let labels: Vec<_> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(
            labels,
            [
                "ok",
                "retryable",
                "fatal",
                "timeout",
                "rejected",
                "cancelled"
            ]
        );
    }

    #[test]
    fn overload_answers_are_never_500() {
        let o = Status::overloaded(Duration::from_secs(2));
        assert_eq!(o.code(), Code::Unavailable);
        assert_eq!(o.http_status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(o.pushback(), Some(Duration::from_secs(2)));
        assert_eq!(o.problem(), problem::OVERLOADED);
        let r = Status::rate_limited(Duration::from_secs(3));
        assert_eq!(r.http_status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.problem(), problem::RATE_LIMITED);
        assert_eq!(r.retry_class(), RetryClass::RetryAfterPushback);
    }

    #[test]
    fn deadline_exceeded_converts() {
        let s: Status = DeadlineExceeded {
            remaining: Duration::from_millis(3),
            margin: Duration::from_millis(10),
        }
        .into();
        assert_eq!(s.code(), Code::DeadlineExceeded);
        assert_eq!(s.http_status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(s.outcome(), Outcome::Timeout);
        assert!(
            s.to_string()
                .starts_with("DEADLINE_EXCEEDED: deadline exceeded")
        );
    }
}
