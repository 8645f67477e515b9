//! Response future of [`Metrics`](super::Metrics).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{HeaderMap, HeaderName, Response, StatusCode};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tracing::Level;

use super::{Rejected, Route, trace_id};
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

/// What is known about a request in flight; records it exactly once.
#[derive(Debug)]
pub(super) struct Record {
    route: Route,
    start: Instant,
    deadline: Option<Deadline>,
    /// Read from the request only when the log event is enabled.
    idempotency_key: Option<Box<str>>,
    trace_id: Option<Box<str>>,
    done: bool,
}

impl Record {
    pub(super) fn start(route: Route, deadline: Option<Deadline>, headers: &HeaderMap) -> Self {
        // The key and trace id only go into the log event: skip reading (and copying) them
        // when no subscriber wants it.
        let (idempotency_key, trace_id) = if tracing::enabled!(target: TARGET, Level::INFO) {
            let idempotency_key = headers
                .get(&IDEMPOTENCY_KEY)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| IdempotencyKey::parse(v).ok())
                .map(|k| Box::from(k.as_str()));
            let trace_id = headers
                .get(&TRACEPARENT)
                .and_then(|v| v.to_str().ok())
                .and_then(trace_id)
                .map(Box::from);
            (idempotency_key, trace_id)
        } else {
            (None, None)
        };
        route.inflight(1.0);
        Self {
            route,
            start: Instant::now(),
            deadline,
            idempotency_key,
            trace_id,
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
            idempotency_key = self.idempotency_key.as_deref(),
            trace_id = self.trace_id.as_deref(),
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
