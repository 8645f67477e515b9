//! Response future of [`Metrics`](super::Metrics).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::net::SocketAddr;

use http::{HeaderName, Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tracing::Level;

use super::{PeerFn, Rejected, Route, TARGET};
use crate::deadline::Deadline;
use crate::idempotency::IdempotencyKey;
use crate::observe::trace_context;
use crate::server::problem::grpc_status;
use crate::status::{Code, Outcome};

pin_project! {
    /// Polls the inner future and records the request when it answers (or is dropped).
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        record: Record,
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn new(inner: F, record: Record) -> Self {
        Self { inner, record }
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = {
            // The service runs in the request's span, so its own spans and the calls it makes
            // join the caller's trace.
            #[cfg(feature = "otel")]
            let _entered = this.record.span.enter();
            std::task::ready!(this.inner.poll(cx))
        };
        match &result {
            Ok(response) => {
                let extensions = response.extensions();
                // A gRPC error answered trailers-only says its code in the head.
                let grpc_code = grpc_status(response.headers());
                let outcome = if extensions.get::<Rejected>().is_some() {
                    Outcome::Rejected
                } else {
                    // A problem answer says its own outcome; any other is read as the client
                    // reads it, so that both say the same of it.
                    extensions
                        .get::<Outcome>()
                        .copied()
                        .unwrap_or_else(|| Outcome::of_head(response.status(), response.headers()))
                };
                this.record.finish(response.status(), grpc_code, outcome);
            }
            Err(_) => this.record.finish(
                StatusCode::INTERNAL_SERVER_ERROR,
                Some(Code::Internal),
                Outcome::Fatal,
            ),
        }
        Poll::Ready(result)
    }
}

/// Request headers read only for the log event.
static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
static PREVIOUS_ATTEMPTS: HeaderName = HeaderName::from_static("grpc-previous-rpc-attempts");

/// Whether a request is a gRPC call (`application/grpc`, `application/grpc+proto`, ...).
fn is_grpc<B>(request: &Request<B>) -> bool {
    request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// `duration` in milliseconds to the microsecond, e.g. `1.25`: a whole number of microseconds
/// divided by 1000 prints as a short decimal, where `as_secs_f64() * 1000.0` would print binary
/// noise such as `1.2500000000000002`.
pub(crate) fn millis(duration: std::time::Duration) -> f64 {
    // Exact up to 2^53 µs (285 years).
    duration.as_micros() as f64 / 1000.0
}

/// Fields of the log event read from the request, only when the event is enabled.
#[derive(Debug, Default)]
struct LogFields {
    idempotency_key: Option<Box<str>>,
    trace_id: Option<Box<str>>,
    peer: Option<SocketAddr>,
    /// The request is a gRPC call: the event carries a `grpc_code`.
    grpc: bool,
}

/// The trace id of a valid `traceparent`, for the log event.
pub(super) fn trace_id(headers: &http::HeaderMap) -> Option<Box<str>> {
    trace_context::extract(headers).map(|span| span.trace_id().to_string().into_boxed_str())
}

impl LogFields {
    fn read<B>(request: &Request<B>, peer_fn: Option<PeerFn>) -> Self {
        let headers = request.headers();
        let header = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
        Self {
            idempotency_key: header(&IDEMPOTENCY_KEY)
                .and_then(|v| IdempotencyKey::parse(v).ok())
                .map(|k| Box::from(k.as_str())),
            trace_id: trace_id(headers),
            peer: peer_fn.and_then(|f| f(request.extensions())),
            grpc: is_grpc(request),
        }
    }
}

/// What is known about a request in flight; records it exactly once.
#[derive(Debug)]
pub(super) struct Record {
    route: Route,
    start: Instant,
    deadline: Option<Deadline>,
    /// 1 for a first attempt; the caller's `grpc-previous-rpc-attempts` + 1 otherwise (a value
    /// that is not a number counts as a first attempt).
    attempt: u32,
    /// Read from the request only when the log event is enabled.
    log: Option<Box<LogFields>>,
    done: bool,
    /// The span the inner service is polled in.
    #[cfg(feature = "otel")]
    span: tracing::Span,
}

impl Record {
    pub(super) fn start<B>(
        route: Route,
        deadline: Option<Deadline>,
        request: &Request<B>,
        peer_fn: Option<PeerFn>,
    ) -> Self {
        // These fields only go into the log event: skip reading (and copying) them when no
        // subscriber wants it.
        let log = tracing::enabled!(target: TARGET, Level::INFO)
            .then(|| Box::new(LogFields::read(request, peer_fn)));
        #[cfg(feature = "otel")]
        let span = super::otel::request_span(&route, request);
        route.inflight(1.0);
        Self {
            route,
            start: Instant::now(),
            deadline,
            attempt: request
                .headers()
                .get(&PREVIOUS_ATTEMPTS)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u32>().ok())
                .map_or(1, |previous| previous.saturating_add(1)),
            log,
            done: false,
            #[cfg(feature = "otel")]
            span,
        }
    }

    /// Records the request once. `grpc_code` is the code the answer's head carries (a
    /// trailers-only gRPC answer: every gRPC error this stack sends), `None` otherwise.
    pub(super) fn finish(&mut self, status: StatusCode, grpc_code: Option<Code>, outcome: Outcome) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.start);
        self.route.inflight(-1.0);
        self.route
            .finished(self.attempt, outcome, elapsed.as_secs_f64());
        let log = self.log.as_deref();
        // A gRPC answer without a code in its head sends it in the trailers after the message,
        // which only a successful call does here.
        let grpc_code = log.filter(|l| l.grpc).map(|_| {
            grpc_code
                .unwrap_or_else(|| {
                    if status.is_success() {
                        Code::Ok
                    } else {
                        Code::from_http(status)
                    }
                })
                .as_str()
        });
        tracing::info!(
            target: TARGET,
            service = self.route.service(),
            method = self.route.method(),
            status = status.as_u16(),
            outcome = outcome.as_str(),
            grpc_code,
            duration_ms = millis(elapsed),
            deadline_remaining_ms = self.deadline.map(|d| {
                u64::try_from(d.instant().saturating_duration_since(now).as_millis())
                    .unwrap_or(u64::MAX)
            }),
            idempotency_key = log.and_then(|l| l.idempotency_key.as_deref()),
            attempt = log.map(|_| self.attempt),
            peer = log.and_then(|l| l.peer).map(tracing::field::display),
            trace_id = log.and_then(|l| l.trace_id.as_deref()),
            "{}",
            super::EVENT
        );
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Dropped before answering: the deadline layer cut it (504), or the client went away
        // (it disconnected, or it was a hedge that lost): 499, `cancelled`, not a failure.
        if self.deadline.is_some_and(|d| d.expired()) {
            self.finish(
                StatusCode::GATEWAY_TIMEOUT,
                Some(Code::DeadlineExceeded),
                Outcome::Timeout,
            );
        } else {
            let cancelled = StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST);
            self.finish(cancelled, Some(Code::Cancelled), Outcome::Cancelled);
        }
    }
}
