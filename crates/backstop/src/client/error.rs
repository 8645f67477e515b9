//! [`Error`]: why a call through the client stack got no answer, in a form a handler can use.

use std::fmt;
use std::time::Duration;

use tower::BoxError;

use http::Response;

use super::classify::{classify_head, error_status};
use super::retry::RetryStopped;
use super::{Reach, RequestBodyError};
use crate::retry::{RetryError, StopReason};
use crate::status::{Code, Status, problem};

/// Why a call through the client stack got no answer, in a form a handler can use.
///
/// A call that ends on an answer from the peer (a 503 after three attempts, a 400 at once)
/// returns that answer: the stack adds a [`RetryStopped`](super::retry::RetryStopped) extension
/// saying why it sent no further attempt. A call that ends with no answer to show (its deadline
/// passed, the peer could not be reached, the circuit is open, the retry budget or the storm
/// alarm stopped it) fails with an [`Error`]: the [`Status`] to tell the caller, the
/// [`StopReason`], the attempts sent, the last attempt's own status, and whether the request
/// may have reached the peer ([`Error::reach`]: never sent, sent with the outcome unknown, or
/// answered), which decides whether sending it again is safe.
///
/// A handler that must turn a peer's refusal into an answer of its own (a tonic method; an
/// HTTP handler may relay the answer as it is) reads it as an `Error` too, with
/// [`Error::for_status`].
///
/// A handler turns it into the right answer for its own caller in one step:
///
/// | what happened | [`Error::status`] | HTTP (problem+json) | gRPC |
/// |---|---|---|---|
/// | the deadline passed, or too little of it was left to send | `DEADLINE_EXCEEDED`, `deadline_exceeded` | 504 | `DEADLINE_EXCEEDED` |
/// | the circuit is open | `UNAVAILABLE`, `circuit_open` | 503 + `Retry-After` (when the breaker probes again) | `UNAVAILABLE` + `grpc-retry-pushback-ms` |
/// | the peer is unreachable, or retries stopped on it (budget, storm, throttle, attempts) | `UNAVAILABLE`, `unavailable` | 503 + `Retry-After` | `UNAVAILABLE` + pushback |
/// | the request's own body failed ([`Error::is_request_body`]: malformed, cut short, too large, too slow; the caller's side) | the [`RequestBodyError`]'s: `INVALID_ARGUMENT` `request_body_invalid`, `request_body_timeout`; `RESOURCE_EXHAUSTED` `body_too_large` | 400, 408, 413 | `INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED` |
/// | the peer answered another refusal ([`Error::for_status`]) | the peer's | the peer's | the peer's |
///
/// The `Retry-After` of a 503 is the peer's own pushback when its last answer gave one, the
/// breaker's time to its next probe when the circuit is open, and otherwise
/// [`Error::DEFAULT_RETRY_AFTER`]: an unreachable peer is not "retry at once".
///
/// - with the `axum` feature, `Error` (like [`Status`] and
///   [`Problem`](crate::server::problem::Problem)) is an `axum::response::IntoResponse`, so a
///   handler returns `Result<_, backstop::client::Error>` and uses `?`;
/// - with the `tonic` feature, `tonic::Status: From<Error>`, so a tonic method uses `?` too;
/// - otherwise [`Error::status`] is the [`Status`] the server layers answer with
///   ([`Problem::from_status`](crate::server::problem::Problem::from_status)).
///
/// ```
/// use std::time::Duration;
/// use backstop::client::{ClientStack, Destination, Error, Reach};
/// use backstop::policy::{Idempotency, MethodPolicy};
/// use backstop::retry::StopReason;
/// use backstop::status::Code;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tower::{ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// // A peer that never answers.
/// let silent = service_fn(|_: Request<_>| async {
///     std::future::pending::<Result<Response<()>, std::io::Error>>().await
/// });
/// let policy = MethodPolicy::builder("Get", Idempotency::Safe)
///     .timeout(Duration::from_millis(300))
///     .build();
/// let client = ClientStack::builder(&Destination::new("silent"), policy).build().unwrap().layer(silent);
///
/// let request = Request::get("http://peer/v1/thing").body(Full::new(Bytes::new())).unwrap();
/// let error: Error = client.oneshot(request).await.unwrap_err();
/// assert_eq!(error.status().code(), Code::DeadlineExceeded);
/// assert_eq!(error.status().http_status(), 504);
/// assert_eq!(error.reason(), Some(StopReason::Deadline));
/// // Sent and never answered: whether it ran is unknown.
/// assert_eq!(error.reach(), Reach::Unknown);
/// # }
/// ```
///
/// One pointer wide, so that `Result<Response, Error>` stays small on every call's path.
#[derive(Debug)]
pub struct Error(Box<Inner>);

#[derive(Debug)]
struct Inner {
    status: Status,
    last: Status,
    reason: Option<StopReason>,
    attempts: u32,
    reach: Reach,
    source: BoxError,
}

impl Error {
    /// The `Retry-After` of a 503 when nothing better is known: an unreachable peer is not
    /// worth calling again at once.
    pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

    /// Reads what a layer of the stack failed with.
    ///
    /// The retry layer fails with an [`Error`] that knows how far its attempts got; any other
    /// error is read from its types alone: [`Reach::NotSent`] when they prove it, else
    /// [`Reach::Unknown`].
    pub fn from_box(error: BoxError) -> Self {
        let error = match error.downcast::<Error>() {
            Ok(error) => return *error,
            Err(error) => error,
        };
        let reach = match error.downcast_ref::<RetryError>() {
            Some(stopped) if stopped.attempts == 0 => Reach::NotSent,
            Some(_) => Reach::Unknown,
            None => Reach::of_error(&*error),
        };
        Self::reached(error, reach)
    }

    /// `error`, from a call whose attempts got as far as `reach`.
    pub(crate) fn reached(error: BoxError, reach: Reach) -> Self {
        let (last, reason, attempts) = match error.downcast_ref::<RetryError>() {
            Some(stopped) => (stopped.last.clone(), Some(stopped.reason), stopped.attempts),
            // Refused before any attempt (no budget left to send one), or failed below the
            // retry layer in a stack without one.
            None => {
                let status = error_status(&*error);
                let refused = status.code() == Code::DeadlineExceeded
                    || status.problem() == problem::CIRCUIT_OPEN
                    || RequestBodyError::find(&*error).is_some();
                (status, None, u32::from(!refused))
            }
        };
        Self(Box::new(Inner {
            status: for_caller(&last, reason, attempts),
            last,
            reason,
            attempts,
            reach,
            source: error,
        }))
    }

    /// The answer itself when it is a success, else the failure it reports as an [`Error`]
    /// (how many attempts the stack sent and why it stopped, from the answer's
    /// [`RetryStopped`]): for a handler that must turn a peer's refusal into a status of its
    /// own, as a tonic method does, where an HTTP handler might relay the answer as it is.
    ///
    /// ```
    /// use backstop::client::Error;
    /// use http::Response;
    ///
    /// let refused = Response::builder().status(503).header("retry-after", "4").body(()).unwrap();
    /// let error = Error::for_status(refused).unwrap_err();
    /// assert_eq!(error.status().http_status(), 503);
    /// assert_eq!(error.status().pushback(), Some(std::time::Duration::from_secs(4)));
    /// assert!(Error::for_status(Response::new(())).is_ok());
    /// ```
    pub fn for_status<B>(response: Response<B>) -> Result<Response<B>, Error> {
        let Some(last) = classify_head(response.status(), response.headers()) else {
            return Ok(response);
        };
        let stopped = response.extensions().get::<RetryStopped>().copied();
        let (reason, attempts) = (stopped.map(|s| s.reason), stopped.map_or(1, |s| s.attempts));
        Err(Self(Box::new(Inner {
            status: for_caller(&last, reason, attempts),
            source: Box::new(last.clone()),
            last,
            reason,
            attempts,
            reach: stopped.map_or(Reach::Answered, |s| s.reach),
        })))
    }

    /// What to tell this call's own caller: 504 `DEADLINE_EXCEEDED` when its deadline is
    /// gone, else 503 `UNAVAILABLE` with a `Retry-After` (see [`Error`]).
    pub fn status(&self) -> &Status {
        &self.0.status
    }

    /// The status of the last attempt as the stack read it (a transport error, an open
    /// circuit, a refusal for lack of budget).
    pub fn last(&self) -> &Status {
        &self.0.last
    }

    /// Why no further attempt was sent, when the retry layer ran the call.
    pub fn reason(&self) -> Option<StopReason> {
        self.0.reason
    }

    /// Attempts sent, first included: 0 when none was (the deadline left no time for one, or
    /// the circuit was open).
    pub fn attempts(&self) -> u32 {
        self.0.attempts
    }

    /// Whether the request may have reached the peer, over every attempt the stack made
    /// (retries, hedges, transparent re-sends): [`Reach::NotSent`] when none can have,
    /// [`Reach::Unknown`] when one may have and got no answer, else [`Reach::Answered`]. A call
    /// whose effect must not happen twice (a payment) is sent again blindly only when it was
    /// not sent; one whose reach is unknown is reconciled first (see [`Reach`]).
    pub fn reach(&self) -> Reach {
        self.0.reach
    }

    /// Whether the call ran out of time: its deadline passed, or what was left could not
    /// cover a round trip.
    pub fn is_deadline(&self) -> bool {
        self.0.status.code() == Code::DeadlineExceeded
    }

    /// Whether the call failed because its own request body did (malformed, cut short, over a
    /// size limit, too slow, its sender gone): the caller's fault, not the peer's. Such a call
    /// is never retried and never counts toward the destination's health; [`Error::status`]
    /// is the 4xx its caller earned (see [`RequestBodyError`]).
    pub fn is_request_body(&self) -> bool {
        self.0.reason == Some(StopReason::RequestBody)
            || RequestBodyError::find(&*self.0.source).is_some()
    }

    /// Whether the destination's circuit breaker refused the call.
    pub fn is_circuit_open(&self) -> bool {
        self.0.reason == Some(StopReason::CircuitOpen)
            || self.0.last.problem() == problem::CIRCUIT_OPEN
    }

    /// The error as the layer below reported it.
    pub fn into_source(self) -> BoxError {
        self.0.source
    }
}

/// The answer for the caller of a call whose last attempt ended in `last`: a timeout is this
/// hop's timeout too, an unavailable peer makes this hop unavailable (with a `Retry-After`),
/// and any other refusal the peer answered is passed on as it is.
///
/// Retries happen at one layer, the one nearest the failure: an unavailable peer this hop
/// already retried (`attempts` above one), or whose retries stopped for the destination's
/// sake (budget, storm alarm, retry switch), or which itself asked for no retry, makes the
/// answer "do not retry" ([`Status::no_retry`]): the caller retrying too would multiply the
/// attempts the peer gets, hop by hop.
fn for_caller(last: &Status, reason: Option<StopReason>, attempts: u32) -> Status {
    if !matches!(last.code(), Code::DeadlineExceeded | Code::Unavailable) {
        return last.clone();
    }
    if last.code() == Code::DeadlineExceeded {
        return Status::new(
            Code::DeadlineExceeded,
            "the deadline passed before the service called answered",
        )
        .with_problem(problem::DEADLINE_EXCEEDED);
    }
    let retry_after = last
        .pushback()
        .filter(|wait| *wait != Duration::MAX)
        .unwrap_or(Error::DEFAULT_RETRY_AFTER)
        .max(Duration::from_secs(1));
    let (problem, message) = if last.problem() == problem::CIRCUIT_OPEN {
        (
            problem::CIRCUIT_OPEN,
            "the service called is failing; its circuit is open",
        )
    } else {
        (
            Code::Unavailable.problem(),
            "the service called is unavailable",
        )
    };
    let answer = Status::new(Code::Unavailable, message)
        .with_problem(problem)
        .with_pushback(retry_after);
    let retried_here = attempts > 1
        || matches!(
            reason,
            Some(StopReason::BudgetExhausted | StopReason::Storm | StopReason::SwitchedOff)
        );
    if retried_here || last.no_retry() {
        answer.with_no_retry()
    } else {
        answer
    }
}

impl From<BoxError> for Error {
    fn from(error: BoxError) -> Self {
        Self::from_box(error)
    }
}

impl From<Error> for Status {
    fn from(error: Error) -> Self {
        error.0.status
    }
}

/// An axum handler returns the error as the answer its own caller should get (see
/// [`Error`]).
#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for Error {
    fn into_response(self) -> axum_core::response::Response {
        self.0.status.into_response()
    }
}

/// A tonic method answers the error as the status its own caller should get.
#[cfg(feature = "tonic")]
impl From<Error> for tonic::Status {
    fn from(error: Error) -> Self {
        error.0.status.into()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "call failed after {} attempt(s)", self.0.attempts)?;
        if let Some(reason) = self.0.reason {
            write!(f, ", stopped: {reason}")?;
        }
        write!(f, "; {}", self.0.last)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::breaker::CircuitOpen;
    use crate::deadline::DeadlineExceeded;

    fn boxed(e: impl std::error::Error + Send + Sync + 'static) -> BoxError {
        Box::new(e)
    }

    #[test]
    fn a_deadline_stop_is_a_504_for_the_caller() {
        let stopped = RetryError {
            last: Status::from(DeadlineExceeded::PASSED),
            attempts: 2,
            reason: StopReason::Deadline,
        };
        let error = Error::from_box(boxed(stopped));
        assert!(error.is_deadline());
        assert_eq!(error.status().http_status(), 504);
        assert_eq!(error.status().problem(), problem::DEADLINE_EXCEEDED);
        assert_eq!(
            (error.attempts(), error.reason()),
            (2, Some(StopReason::Deadline))
        );
    }

    #[test]
    fn a_call_refused_for_lack_of_budget_sent_nothing_and_is_a_504() {
        let refused = DeadlineExceeded {
            remaining: Duration::from_millis(3),
            margin: Duration::from_millis(5),
        };
        let error = Error::from_box(boxed(refused));
        assert_eq!(error.status().http_status(), 504);
        assert_eq!(error.attempts(), 0);
        assert_eq!(error.reach(), Reach::NotSent);
    }

    #[test]
    fn a_dead_peer_is_a_503_with_retry_after() {
        let stopped = RetryError {
            last: Status::new(Code::Unavailable, "transport error: connection refused"),
            attempts: 3,
            reason: StopReason::MaxAttempts,
        };
        let error = Error::from_box(boxed(stopped));
        assert_eq!(error.status().http_status(), 503);
        assert_eq!(error.status().pushback(), Some(Error::DEFAULT_RETRY_AFTER));
        assert!(!error.is_circuit_open());
        // Attempts were sent, and nothing here says how far they got.
        assert_eq!(error.reach(), Reach::Unknown);
        // The peer's own pushback wins, never below a second.
        let stopped = RetryError {
            last: Status::new(Code::Unavailable, "").with_pushback(Duration::from_secs(7)),
            attempts: 1,
            reason: StopReason::Pushback,
        };
        let error = Error::from_box(boxed(stopped));
        assert_eq!(error.status().pushback(), Some(Duration::from_secs(7)));
    }

    #[test]
    fn an_open_circuit_says_when_it_probes_again() {
        let open = CircuitOpen {
            retry_in: Duration::from_secs(4),
        };
        let error = Error::from_box(boxed(open));
        assert!(error.is_circuit_open());
        assert_eq!(error.attempts(), 0);
        assert_eq!(error.reach(), Reach::NotSent);
        assert_eq!(error.status().problem(), problem::CIRCUIT_OPEN);
        assert_eq!(error.status().http_status(), 503);
        assert_eq!(error.status().pushback(), Some(Duration::from_secs(4)));
    }

    #[test]
    fn a_broken_request_body_is_the_callers_4xx_not_the_peers_5xx() {
        // Read before anything was sent (a replayable body).
        let cut = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        let error = Error::from_box(boxed(RequestBodyError::new(cut)));
        assert!(error.is_request_body());
        assert_eq!(error.status().http_status(), 400);
        assert_eq!(error.attempts(), 0);
        // Failed while streamed: the retry layer stopped for it.
        let stopped = RetryError {
            last: error.status().clone(),
            attempts: 0,
            reason: StopReason::RequestBody,
        };
        let error = Error::from_box(boxed(stopped));
        assert!(error.is_request_body());
        assert_eq!(error.status().problem(), problem::REQUEST_BODY_INVALID);
        assert_eq!(error.status().http_status(), 400);
        assert!(!error.is_deadline());
        // A peer that went away is not.
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(!Error::from_box(boxed(reset)).is_request_body());
    }

    #[test]
    fn an_error_read_twice_is_the_same_error() {
        let first = Error::from_box(boxed(CircuitOpen {
            retry_in: Duration::from_secs(2),
        }));
        let again = Error::from_box(Box::new(first));
        assert!(again.is_circuit_open());
    }
}
