//! The `backstop` policy: every logical request goes through the library's client stack
//! ([`ClientStack`]: logical key, deadline, retry with replay, budget and pushback, hedging,
//! attempt timeout, circuit breaker, transparent retry) over the library's transport, and the
//! report is read back from two thin observers on either side of the stack:
//!
//! ```text
//! Observe -> ClientStack -> Record -> transport (pooled hyper-util client, or a tonic Channel)
//! ```
//!
//! - [`Record`], the transport as the stack sees it, sees every physical send: attempts,
//!   hedges and transparent re-sends alike. It reads each one's number from
//!   `grpc-previous-rpc-attempts` (one more than the attempts before it), a hedge from the
//!   [`Hedged`] marker (a hedge carries the header value the next retry would carry), and a
//!   transparent re-send from a repeat: the retry layer numbers its attempts 1, 2, 3, and a
//!   call has one hedge at most, so a second send with the same number and kind can only be
//!   the transparent re-send of the first.
//! - [`Observe`], what the tool calls, sees how the logical request ended: its answer, or the
//!   stack's [`RetryError`], and why the attempts stopped ([`RetryStopped`] on a failed
//!   answer, the [`RetryError`]'s reason on an error).
//!
//! Both find the logical request's [`Probe`] in the request's extensions, which the stack
//! copies onto every attempt, hedge and re-send.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use backstop::client::classify::{classify_head, error_status};
use backstop::client::hedge::Hedged;
use backstop::client::replay::ReplayBody;
use backstop::client::retry::{GRPC_PREVIOUS_RPC_ATTEMPTS, RetryStopped};
use backstop::client::{ClientService, ClientStack, Destination, connect};
use backstop::deadline::Deadline;
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicy};
use backstop::retry::RetryError;
use backstop::status::{Code, Outcome};
use backstop_payment::grpc::proto::ChargeRequest;
use backstop_payment::grpc::proto::payment_client::PaymentClient;
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderValue, Request, Response, Uri};
use http_body_util::{BodyExt, Full, Limited};
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tower::util::MapRequest;
use tower::{BoxError, Layer, Service, ServiceExt};

use super::logical::Logical;
use super::report::{AttemptOutcome, AttemptRecord, LogicalRecord};
use super::target::{Target, from_tonic};

/// Most bytes of an answer read (and dropped) so its connection can be reused.
const MAX_BODY: usize = 64 * 1024;

/// The policy of `Charge` (`POST /v1/payments`, `payment.v1.Payment/Charge`) as the payment
/// service states it: `Keyed` (the same key on every attempt and hedge makes a repeat safe, so
/// hedging is allowed), keys kept for the payments TTL, and another attempt after each answer
/// its error tables call retryable: `UNAVAILABLE` (overloaded, store unavailable, PSP outcome
/// unknown over gRPC), `ABORTED` (the same key still running: 409 `request_in_progress`),
/// `RESOURCE_EXHAUSTED` (over the merchant's quota, with pushback) and `DEADLINE_EXCEEDED`
/// (504 `payment_outcome_unknown` over HTTP: "retry with the same key"); no hedge sooner
/// than `hedge_delay`.
fn charge_policy(timeout: Duration, hedge_delay: Duration) -> MethodPolicy {
    MethodPolicy::builder("Charge", Idempotency::Keyed)
        .timeout(timeout)
        .min_hedge_delay(hedge_delay)
        .key_ttl(KEY_TTL_PAYMENTS)
        .retryable([
            Code::Unavailable,
            Code::Aborted,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
        ])
        .hedging(true)
        .build()
}

/// A client of the target through the library's client stack, for either protocol. One
/// destination (budget, margin, latency window, breaker) for every logical request; clones
/// share it.
#[derive(Debug, Clone)]
pub(crate) enum StackClient {
    Http(Arc<HttpStack>),
    Grpc(Arc<GrpcStack>),
}

pub(crate) struct HttpStack {
    service: HttpService,
    payments: Uri,
    authorization: Option<HeaderValue>,
}

pub(crate) struct GrpcStack {
    client: PaymentClient<GrpcService>,
    authorization: Option<MetadataValue<Ascii>>,
}

impl std::fmt::Debug for HttpStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpStack")
            .field("payments", &self.payments)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for GrpcStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcStack").finish_non_exhaustive()
    }
}

type HttpService = Observe<ClientService<Record<connect::HttpClient<ReplayBody<Full<Bytes>>>>>>;
type GrpcService = Observe<ClientService<Record<GrpcTransport>>>;

/// The stack sends a replayable body; tonic's channel takes its own body type.
type GrpcTransport =
    MapRequest<Channel, fn(Request<ReplayBody<tonic::body::Body>>) -> Request<tonic::body::Body>>;

impl StackClient {
    /// The stack for `Charge` on `target` through `destination`: each logical request's
    /// deadline is `timeout`; no hedge before `hedge_delay`.
    pub(crate) fn new(
        target: &Target,
        api_key: Option<&str>,
        timeout: Duration,
        destination: &Destination,
        hedge_delay: Duration,
    ) -> Result<Self, String> {
        let stack = ClientStack::builder(destination, charge_policy(timeout, hedge_delay))
            .build()
            .map_err(|e| format!("client stack: {e}"))?;
        let bearer = api_key.map(|k| format!("Bearer {k}"));
        match target {
            Target::Http { base } => {
                let payments = format!("{base}/v1/payments")
                    .parse()
                    .map_err(|e| format!("target {base:?}: {e}"))?;
                let authorization = bearer
                    .map(|b| {
                        HeaderValue::try_from(b)
                            .map_err(|_| "the API key is not a valid header value")
                    })
                    .transpose()?;
                let transport = Record::new(connect::pooled(false));
                Ok(StackClient::Http(Arc::new(HttpStack {
                    service: Observe::new(stack.layer(transport)),
                    payments,
                    authorization,
                })))
            }
            Target::Grpc { endpoint, .. } => {
                let channel = Channel::from_shared(endpoint.clone())
                    .map_err(|e| format!("gRPC endpoint {endpoint:?}: {e}"))?
                    .tcp_nodelay(true)
                    .connect_lazy();
                let to_tonic: fn(
                    Request<ReplayBody<tonic::body::Body>>,
                ) -> Request<tonic::body::Body> = |r| r.map(tonic::body::Body::new);
                let transport = Record::new(channel.map_request(to_tonic));
                let authorization = bearer
                    .map(|b| {
                        MetadataValue::try_from(b)
                            .map_err(|_| "the API key is not a valid metadata value")
                    })
                    .transpose()?;
                Ok(StackClient::Grpc(Arc::new(GrpcStack {
                    client: PaymentClient::new(Observe::new(stack.layer(transport))),
                    authorization,
                })))
            }
        }
    }

    /// Runs one logical request through the stack: its attempts, and how it ended.
    pub(crate) async fn run(&self, logical: &Logical) -> (Vec<AttemptRecord>, LogicalRecord) {
        let probe = Probe::default();
        let grpc_failure = match self {
            StackClient::Http(http) => {
                let HttpStack {
                    service,
                    payments,
                    authorization,
                } = &**http;
                let body = serde_json::json!({
                    "order_id": logical.order_id,
                    "amount_cents": logical.amount_cents,
                    "currency": "USD",
                });
                let mut request = Request::post(payments.clone())
                    .header(CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .expect("a request from a parsed URI and static headers is valid");
                if let Some(auth) = authorization {
                    request.headers_mut().insert(AUTHORIZATION, auth.clone());
                }
                request.extensions_mut().insert(probe.clone());
                if let Ok(response) = service.clone().oneshot(request).await {
                    // Read to the end so the connection goes back to the pool.
                    let _ = Limited::new(response.into_body(), MAX_BODY).collect().await;
                }
                None
            }
            StackClient::Grpc(grpc) => {
                let GrpcStack {
                    client,
                    authorization,
                } = &**grpc;
                let mut request = tonic::Request::new(ChargeRequest {
                    order_id: logical.order_id.clone(),
                    amount_cents: i64::try_from(logical.amount_cents).unwrap_or(i64::MAX),
                    currency: "USD".to_owned(),
                });
                if let Some(auth) = authorization {
                    request.metadata_mut().insert("authorization", auth.clone());
                }
                request.extensions_mut().insert(probe.clone());
                client.clone().charge(request).await.err()
            }
        };
        let log = probe.take();
        let end = match (log.end, grpc_failure) {
            // The stack saw an answer without a status in its head; gRPC carried a failure in
            // the trailers, after it: the stack had nothing to retry.
            (Some(end), Some(status)) if end.outcome == Outcome::Ok => LogicalRecord {
                outcome: from_tonic(&status).outcome(),
                stop_reason: None,
            },
            (Some(end), _) => end,
            (None, Some(status)) => LogicalRecord {
                outcome: from_tonic(&status).outcome(),
                stop_reason: None,
            },
            // Unreachable: the stack is always ready, so `Observe` always calls it and records
            // the end.
            (None, None) => LogicalRecord {
                outcome: Outcome::Fatal,
                stop_reason: None,
            },
        };
        (log.attempts, end)
    }
}

/// One logical request's record, shared by every attempt the stack makes of it (the stack
/// copies request extensions onto each attempt, hedge and re-send).
#[derive(Debug, Clone, Default)]
pub(crate) struct Probe(Arc<Mutex<CallLog>>);

#[derive(Debug, Default)]
struct CallLog {
    attempts: Vec<AttemptRecord>,
    /// `grpc-previous-rpc-attempts` of the sends that were not hedges, so far.
    sent: Vec<u32>,
    /// A hedge was sent.
    hedged: bool,
    end: Option<LogicalRecord>,
}

impl Probe {
    fn lock(&self) -> std::sync::MutexGuard<'_, CallLog> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn take(&self) -> CallLog {
        std::mem::take(&mut *self.lock())
    }

    /// A send of `request` begins (see the module docs for how it is told apart).
    fn send<B>(&self, request: &Request<B>) -> InFlight {
        let previous = request
            .headers()
            .get(&GRPC_PREVIOUS_RPC_ATTEMPTS)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0);
        let hedge = request.extensions().get::<Hedged>().is_some();
        let mut log = self.lock();
        let resend = if hedge {
            std::mem::replace(&mut log.hedged, true)
        } else if log.sent.contains(&previous) {
            true
        } else {
            log.sent.push(previous);
            false
        };
        InFlight {
            probe: self.clone(),
            number: previous.saturating_add(1),
            hedge,
            resend,
            deadline: request.extensions().get::<Deadline>().copied(),
            started: Instant::now(),
            outcome: None,
        }
    }

    /// The logical request ended with `result`, as the stack returned it.
    fn end<B>(&self, result: &Result<Response<B>, BoxError>) {
        let end = match result {
            Ok(response) => match classify_head(response.status(), response.headers()) {
                None => LogicalRecord {
                    outcome: Outcome::Ok,
                    stop_reason: None,
                },
                Some(status) => LogicalRecord {
                    outcome: status.outcome(),
                    stop_reason: response
                        .extensions()
                        .get::<RetryStopped>()
                        .map(|s| s.reason.as_str()),
                },
            },
            Err(error) => match find::<RetryError>(&**error) {
                Some(stopped) => LogicalRecord {
                    outcome: stopped.last.outcome(),
                    stop_reason: Some(stopped.reason.as_str()),
                },
                None => LogicalRecord {
                    outcome: error_status(&**error).outcome(),
                    stop_reason: None,
                },
            },
        };
        self.lock().end = Some(end);
    }
}

/// `E` in `error`'s source chain.
fn find<'a, E: StdError + 'static>(error: &'a (dyn StdError + 'static)) -> Option<&'a E> {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if let Some(found) = e.downcast_ref::<E>() {
            return Some(found);
        }
        cause = e.source();
    }
    None
}

/// One send under way; recorded when it ends, or when it is dropped unfinished (cut off at the
/// deadline, or the loser of a hedge race).
struct InFlight {
    probe: Probe,
    number: u32,
    hedge: bool,
    resend: bool,
    deadline: Option<Deadline>,
    started: Instant,
    outcome: Option<Outcome>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let outcome = match self.outcome {
            Some(outcome) => AttemptOutcome::Done(outcome),
            None if self.deadline.is_some_and(|d| d.expired()) => {
                AttemptOutcome::Done(Outcome::Timeout)
            }
            None => AttemptOutcome::Cancelled,
        };
        let record = AttemptRecord {
            number: self.number,
            latency: self.started.elapsed(),
            outcome,
            hedge: self.hedge,
            resend: self.resend,
            sent: self.started,
        };
        self.probe.lock().attempts.push(record);
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

/// The transport as the stack sees it: records every send of a request that carries a
/// [`Probe`] (module docs).
#[derive(Debug, Clone)]
pub(crate) struct Record<S> {
    inner: S,
}

impl<S> Record<S> {
    fn new(inner: S) -> Self {
        Self { inner }
    }
}

impl<S, B, ResB> Service<Request<B>> for Record<S>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = BoxFuture<Response<ResB>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let in_flight = request
            .extensions()
            .get::<Probe>()
            .map(|p| p.send(&request));
        let sent = self.inner.call(request);
        Box::pin(async move {
            let mut in_flight = in_flight;
            let result = sent.await.map_err(Into::into);
            if let Some(send) = &mut in_flight {
                // Read the way the retry layer reads it.
                send.outcome = Some(match &result {
                    Ok(response) => classify_head(response.status(), response.headers())
                        .map_or(Outcome::Ok, |s| s.outcome()),
                    Err(error) => error_status(&**error).outcome(),
                });
            }
            result
        })
    }
}

/// What the tool calls: the stack, with the end of each logical request recorded in its
/// [`Probe`] (module docs).
#[derive(Debug, Clone)]
pub(crate) struct Observe<S> {
    inner: S,
}

impl<S> Observe<S> {
    fn new(inner: S) -> Self {
        Self { inner }
    }
}

impl<S, B, ResB> Service<Request<B>> for Observe<S>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = Response<ResB>;
    type Error = BoxError;
    type Future = BoxFuture<Response<ResB>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let probe = request.extensions().get::<Probe>().cloned();
        let call = self.inner.call(request);
        Box::pin(async move {
            let result = call.await.map_err(Into::into);
            if let Some(probe) = probe {
                probe.end(&result);
            }
            result
        })
    }
}
