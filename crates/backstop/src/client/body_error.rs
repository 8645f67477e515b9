//! [`RequestBodyError`]: the request's own body failed on its way out, which is the caller's
//! side of a call, not the peer's.

use std::error::Error as StdError;
use std::fmt;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use http::StatusCode;
use tower::BoxError;

use crate::deadline::DeadlineExceeded;
use crate::status::{Code, Status, problem};

/// The request's own body failed while an attempt was sending it: the caller's side, never
/// the peer's.
///
/// A gateway forwards the body its own caller is still sending. When that body breaks
/// (malformed chunked framing, cut short, reset, over the gateway's size limit, too slow), the
/// attempt fails although the peer did nothing wrong. The stack tells the two apart: every
/// error of a request body an attempt sends comes out as a [`RequestBodyError`], and a call
/// whose body failed is never retried and never counts toward the destination's health (its
/// circuit breaker, its retry budget, its storm alarm, adaptive throttling): the call stops
/// with [`StopReason::RequestBody`](crate::retry::StopReason::RequestBody), and
/// [`Error::is_request_body`](super::Error::is_request_body) says so. Its
/// [`status`](RequestBodyError::status) is the answer the caller earned, whose outcome is
/// `rejected` (a server stack's gate learns nothing from it):
///
/// | what broke, in the body's error chain | HTTP | problem `code` | gRPC |
/// |---|---|---|---|
/// | over a size limit (`http_body_util::LengthLimitError`) | 413 | `body_too_large` | `RESOURCE_EXHAUSTED` |
/// | too slow: a timeout (`tokio::time::error::Elapsed`, `io::ErrorKind::TimedOut`, hyper's), or the call's deadline passed while the body was still waiting on its sender | 408 | `request_body_timeout` | `INVALID_ARGUMENT` |
/// | the caller's connection is gone (`ConnectionReset`, `ConnectionAborted`, `BrokenPipe`) | 499, which no one reads | `cancelled` | `CANCELLED` |
/// | anything else: malformed framing, cut short | 400 | `request_body_invalid` | `INVALID_ARGUMENT` |
///
/// The transport need not keep the body's error in its own: the body marks the attempt's
/// request as it fails, and the breaker and the retry layer read that mark (an HTTP/2 stream
/// reset for a broken body says only "cancelled").
///
/// ```
/// use backstop::client::RequestBodyError;
/// use http_body_util::{BodyExt, Full, Limited};
/// use bytes::Bytes;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let over = Limited::new(Full::new(Bytes::from_static(b"0123456789")), 4).collect().await;
/// let error = RequestBodyError::new(over.unwrap_err());
/// assert_eq!(error.status().http_status(), 413);
/// assert_eq!(error.status().problem(), "body_too_large");
///
/// let cut = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "cut short");
/// assert_eq!(RequestBodyError::new(cut).status().http_status(), 400);
/// # }
/// ```
#[derive(Debug)]
pub struct RequestBodyError {
    status: Status,
    source: BoxError,
}

impl RequestBodyError {
    /// The body failed with `source`; the status the caller gets is read from its chain.
    pub fn new(source: impl Into<BoxError>) -> Self {
        let source = source.into();
        Self {
            status: status_of(&*source),
            source,
        }
    }

    /// The call's deadline passed while its body was still coming in from its sender.
    pub(crate) fn too_slow() -> Self {
        Self::new(DeadlineExceeded::PASSED)
    }

    /// What the caller whose body this was should be told (outcome `rejected`).
    pub fn status(&self) -> &Status {
        &self.status
    }

    /// The first [`RequestBodyError`] in `error`'s chain of sources, itself included.
    pub fn find<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a RequestBodyError> {
        let mut cause: Option<&(dyn StdError + 'static)> = Some(error);
        while let Some(e) = cause {
            if let Some(body) = e.downcast_ref::<RequestBodyError>() {
                return Some(body);
            }
            cause = e.source();
        }
        None
    }
}

impl fmt::Display for RequestBodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the request body failed: {}", self.source)
    }
}

impl StdError for RequestBodyError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

/// The caller's answer for a body that failed with `error` (the table in the module docs).
fn status_of(error: &(dyn StdError + 'static)) -> Status {
    let mut cause: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(e) = cause {
        if e.is::<http_body_util::LengthLimitError>() {
            return Status::new(
                Code::ResourceExhausted,
                "the request body is larger than allowed",
            )
            .with_http_status(StatusCode::PAYLOAD_TOO_LARGE)
            .with_problem(problem::BODY_TOO_LARGE)
            .as_rejected();
        }
        let timed_out = e.is::<tokio::time::error::Elapsed>()
            || e.is::<DeadlineExceeded>()
            || e.downcast_ref::<hyper::Error>()
                .is_some_and(hyper::Error::is_timeout)
            || e.downcast_ref::<io::Error>()
                .is_some_and(|io| io.kind() == io::ErrorKind::TimedOut);
        if timed_out {
            return Status::new(Code::InvalidArgument, "the request body came too slowly")
                .with_http_status(StatusCode::REQUEST_TIMEOUT)
                .with_problem(problem::REQUEST_BODY_TIMEOUT)
                .as_rejected();
        }
        let gone = e.downcast_ref::<io::Error>().is_some_and(|io| {
            matches!(
                io.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            )
        });
        if gone {
            return Status::new(
                Code::Cancelled,
                "the caller went away while sending the request body",
            )
            .as_rejected();
        }
        cause = e.source();
    }
    Status::new(
        Code::InvalidArgument,
        "the request body could not be read: malformed framing, or cut short",
    )
    .with_problem(problem::REQUEST_BODY_INVALID)
    .as_rejected()
}

/// Request extension shared with the body an attempt sends: set when that body fails, so that
/// the layers below the retry layer (the breaker) and the retry layer itself know the failure
/// is the caller's whatever error the transport reports; and whether the body is waiting on
/// its sender, so that a deadline passing then is the caller's slowness, not the peer's.
#[derive(Debug, Clone, Default)]
pub(crate) struct BodyFault(Arc<Mark>);

#[derive(Debug, Default)]
struct Mark {
    failed: OnceLock<Status>,
    waiting: AtomicBool,
}

impl BodyFault {
    /// The body failed and its caller is to be told `status`.
    pub(crate) fn set(&self, status: &Status) {
        let _ = self.0.failed.set(status.clone());
    }

    /// The caller's status, if the body failed.
    pub(crate) fn get(&self) -> Option<&Status> {
        self.0.failed.get()
    }

    /// The body was asked for more and has `waiting` for its sender to send it.
    pub(crate) fn waiting(&self, waiting: bool) {
        self.0.waiting.store(waiting, Ordering::Relaxed);
    }

    /// Whether the body was last asked for more and its sender has not sent it yet.
    pub(crate) fn is_waiting(&self) -> bool {
        self.0.waiting.load(Ordering::Relaxed)
    }
}

/// What the caller is told if the attempt that failed with `error`, whose request carried
/// `extensions`, failed because of its own body; `None` if the body did not fail.
pub(crate) fn caller_fault<'a>(
    error: &'a (dyn StdError + 'static),
    extensions: &'a http::Extensions,
) -> Option<&'a Status> {
    RequestBodyError::find(error)
        .map(RequestBodyError::status)
        .or_else(|| extensions.get::<BodyFault>().and_then(BodyFault::get))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Outcome;

    #[tokio::test]
    async fn each_kind_of_body_failure_gets_its_own_answer() {
        use http_body_util::{BodyExt, Full, Limited};
        let over = Limited::new(Full::new(bytes::Bytes::from_static(b"12345")), 4);
        let limit = over.collect().await.unwrap_err();
        let cases: [(BoxError, u16, &str); 5] = [
            (limit, 413, problem::BODY_TOO_LARGE),
            (
                Box::new(io::Error::from(io::ErrorKind::TimedOut)),
                408,
                problem::REQUEST_BODY_TIMEOUT,
            ),
            (
                Box::new(io::Error::from(io::ErrorKind::ConnectionReset)),
                499,
                "cancelled",
            ),
            (
                Box::new(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "bad chunk size",
                )),
                400,
                problem::REQUEST_BODY_INVALID,
            ),
            (
                Box::new(io::Error::from(io::ErrorKind::UnexpectedEof)),
                400,
                problem::REQUEST_BODY_INVALID,
            ),
        ];
        for (source, http, code) in cases {
            let error = RequestBodyError::new(source);
            assert_eq!(error.status().http_status().as_u16(), http, "{error}");
            assert_eq!(error.status().problem(), code);
            assert_eq!(error.status().outcome(), Outcome::Rejected);
        }
    }

    #[test]
    fn found_anywhere_in_a_chain_of_sources() {
        #[derive(Debug, thiserror::Error)]
        #[error("transport")]
        struct Transport(#[source] RequestBodyError);
        let wrapped = Transport(RequestBodyError::new(io::Error::from(
            io::ErrorKind::UnexpectedEof,
        )));
        assert!(RequestBodyError::find(&wrapped).is_some());
        let other = io::Error::from(io::ErrorKind::ConnectionRefused);
        assert!(RequestBodyError::find(&other).is_none());
    }

    #[test]
    fn the_mark_on_the_request_stands_in_for_a_lost_error() {
        let fault = BodyFault::default();
        let mut extensions = http::Extensions::new();
        extensions.insert(fault.clone());
        let reset = io::Error::other("stream reset: CANCEL");
        assert!(caller_fault(&reset, &extensions).is_none());
        fault.set(RequestBodyError::new(io::Error::from(io::ErrorKind::UnexpectedEof)).status());
        assert_eq!(
            caller_fault(&reset, &extensions).map(Status::http_status),
            Some(StatusCode::BAD_REQUEST)
        );
    }

    type Broken = http_body_util::StreamBody<
        futures_util::stream::Iter<
            std::vec::IntoIter<Result<http_body::Frame<bytes::Bytes>, io::Error>>,
        >,
    >;

    /// A body that sends a few bytes, then breaks (its sender cut it short).
    fn broken() -> Broken {
        use http_body::Frame;
        let frames: Vec<Result<Frame<bytes::Bytes>, io::Error>> = vec![
            Ok(Frame::data(bytes::Bytes::from_static(b"{\"a\":"))),
            Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
        ];
        http_body_util::StreamBody::new(futures_util::stream::iter(frames))
    }

    /// Through a stack whose breaker opens after two failures, `calls` calls of `method` with
    /// a broken body, over a transport that reads the body and fails as hyper's HTTP/1 client
    /// does (the body's error in its chain) or as an HTTP/2 stream reset does (`keeps`
    /// false: a bare error); each fails as the caller's 400. Returns the attempts sent.
    async fn broken_bodies(idempotency: crate::policy::Idempotency, keeps: bool) -> usize {
        use crate::client::breaker::{BreakerConfig, BreakerState, CircuitBreaker};
        use crate::client::{ClientStack, Destination, Error};
        use crate::policy::MethodPolicy;
        use http_body_util::BodyExt;
        use std::sync::atomic::AtomicUsize;
        use tower::ServiceExt;

        let breaker = CircuitBreaker::new(BreakerConfig {
            min_requests: 2,
            ..BreakerConfig::default()
        })
        .unwrap();
        let dest = Destination::new("gw").breaker(Some(breaker.clone()));
        let sent = Arc::new(AtomicUsize::new(0));
        let transport = tower::service_fn({
            let sent = sent.clone();
            move |request: http::Request<crate::client::replay::ReplayBody<Broken>>| {
                sent.fetch_add(1, Ordering::Relaxed);
                async move {
                    match request.into_body().collect().await {
                        Ok(_) => Ok(http::Response::new(())),
                        Err(e) if keeps => Err(BoxError::from(e)),
                        Err(_) => Err(BoxError::from(io::Error::other("stream reset: CANCEL"))),
                    }
                }
            }
        });
        let policy = MethodPolicy::builder("Forward", idempotency).build();
        let client = ClientStack::builder(&dest, policy)
            .build()
            .unwrap()
            .layer(transport);
        for _ in 0..10 {
            let request = http::Request::post("http://peer/v1/orders")
                .body(broken())
                .unwrap();
            let error: Error = client.clone().oneshot(request).await.unwrap_err();
            assert!(error.is_request_body(), "{error}");
            assert_eq!(error.status().http_status(), StatusCode::BAD_REQUEST);
            assert_eq!(error.status().problem(), problem::REQUEST_BODY_INVALID);
            assert_eq!(error.attempts(), 0, "no attempt of the peer's");
        }
        assert_eq!(breaker.state(), BreakerState::Closed);
        sent.load(Ordering::Relaxed)
    }

    #[tokio::test(start_paused = true)]
    async fn a_broken_streamed_body_is_sent_once_and_never_opens_the_breaker() {
        use crate::policy::Idempotency;
        // Streamed (an unsafe method: sent once), the transport keeping the body's error in
        // its own or not.
        assert_eq!(broken_bodies(Idempotency::Unsafe, true).await, 10);
        assert_eq!(broken_bodies(Idempotency::Unsafe, false).await, 10);
        // Read first to be sent again (a safe method): broken before anything is sent.
        assert_eq!(broken_bodies(Idempotency::Safe, true).await, 0);
    }
}
