//! Response future of [`Metrics`](super::Metrics).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::net::SocketAddr;

use http::{HeaderName, Request, Response, StatusCode};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tracing::Level;

use super::{PeerFn, Rejected, Route, trace_id};
use crate::deadline::Deadline;
use crate::idempotency::IdempotencyKey;
use crate::server::problem::grpc_status;
use crate::status::Outcome;

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
        let result = std::task::ready!(this.inner.poll(cx));
        match &result {
            Ok(response) => {
                let extensions = response.extensions();
                let outcome = if extensions.get::<Rejected>().is_some() {
                    Outcome::Rejected
                } else {
                    // A problem answer says its own outcome; a status alone is ambiguous (409).
                    // A gRPC error answered trailers-only says its code in the head.
                    extensions.get::<Outcome>().copied().unwrap_or_else(|| {
                        match grpc_status(response.headers()) {
                            Some(code) => Outcome::of_code(code),
                            None => outcome_of(response.status()),
                        }
                    })
                };
                this.record.finish(response.status(), outcome);
            }
            Err(_) => this
                .record
                .finish(StatusCode::INTERNAL_SERVER_ERROR, Outcome::Fatal),
        }
        Poll::Ready(result)
    }
}

/// The outcome label of an HTTP status (DESIGN section 3).
pub(crate) fn outcome_of(status: StatusCode) -> Outcome {
    Outcome::from_http(status)
}

/// Target of the per-request log event.
const TARGET: &str = "backstop::server";

/// Request headers read only for the log event.
static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
static PREVIOUS_ATTEMPTS: HeaderName = HeaderName::from_static("grpc-previous-rpc-attempts");

/// Fields of the log event read from the request, only when the event is enabled.
#[derive(Debug, Default)]
struct LogFields {
    idempotency_key: Option<Box<str>>,
    trace_id: Option<Box<str>>,
    peer: Option<SocketAddr>,
    /// 1 for a first attempt; the caller's `grpc-previous-rpc-attempts` + 1 otherwise.
    attempt: u32,
}

impl LogFields {
    fn read<B>(request: &Request<B>, peer_fn: Option<PeerFn>) -> Self {
        let headers = request.headers();
        let header = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
        Self {
            idempotency_key: header(&IDEMPOTENCY_KEY)
                .and_then(|v| IdempotencyKey::parse(v).ok())
                .map(|k| Box::from(k.as_str())),
            trace_id: header(&TRACEPARENT).and_then(trace_id).map(Box::from),
            peer: peer_fn.and_then(|f| f(request.extensions())),
            attempt: header(&PREVIOUS_ATTEMPTS)
                .and_then(|v| v.trim().parse::<u32>().ok())
                .map_or(1, |previous| previous.saturating_add(1)),
        }
    }
}

/// What is known about a request in flight; records it exactly once.
#[derive(Debug)]
pub(super) struct Record {
    route: Route,
    start: Instant,
    deadline: Option<Deadline>,
    /// Read from the request only when the log event is enabled.
    log: Option<Box<LogFields>>,
    done: bool,
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
        route.inflight(1.0);
        Self {
            route,
            start: Instant::now(),
            deadline,
            log,
            done: false,
        }
    }

    pub(super) fn finish(&mut self, status: StatusCode, outcome: Outcome) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.start);
        self.route.inflight(-1.0);
        self.route.finished(outcome, elapsed.as_secs_f64());
        let log = self.log.as_deref();
        tracing::info!(
            target: TARGET,
            service = self.route.service(),
            method = self.route.method(),
            status = status.as_u16(),
            outcome = outcome.as_str(),
            duration_ms = elapsed.as_secs_f64() * 1000.0,
            deadline_remaining_ms = self.deadline.map(|d| {
                u64::try_from(d.instant().saturating_duration_since(now).as_millis())
                    .unwrap_or(u64::MAX)
            }),
            idempotency_key = log.and_then(|l| l.idempotency_key.as_deref()),
            attempt = log.map(|l| l.attempt),
            peer = log.and_then(|l| l.peer).map(tracing::field::display),
            trace_id = log.and_then(|l| l.trace_id.as_deref()),
            "rpc_server_request"
        );
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Dropped before answering: the deadline layer cut it (504), or the client went away.
        if self.deadline.is_some_and(|d| d.expired()) {
            self.finish(StatusCode::GATEWAY_TIMEOUT, Outcome::Timeout);
        } else {
            let cancelled = StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST);
            self.finish(cancelled, outcome_of(cancelled));
        }
    }
}
