//! The `backstop` policy: every logical request goes through the library's client stack
//! ([`ClientStack`]: logical key, deadline, retry with replay, budget and pushback, hedging,
//! attempt timeout, circuit breaker, transparent retry) over the library's transport, and the
//! report is what the stack says it did, through its [`AttemptObserver`]:
//!
//! ```text
//! ClientStack (observed by Tell) -> transport (pooled hyper-util client, or a tonic Channel)
//! ```
//!
//! - Each physical send (first attempt, retry, hedge, transparent re-send) the stack tells as
//!   it ends becomes an [`AttemptRecord`]: its number, kind, outcome and latency as the stack
//!   classified them; a hedge race's loser, dropped unanswered, is `cancelled`. An attempt the
//!   stack refused to send (an open circuit, no time left) is no send.
//! - Each call's end becomes the [`LogicalRecord`]: its outcome and why the attempts stopped.
//!
//! One observer serves every call; it finds the logical request's [`Probe`] in the request
//! extensions each event carries. Over gRPC a failure can also arrive in the trailers, after
//! the stack has seen a successful head: [`StackClient::run`] reads it from tonic's answer.
//!
//! The `naive` policy does not go through the stack: it records its own attempts (see
//! [`policy`](super::policy)).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use backstop::client::observer::{AttemptEvent, AttemptKind, AttemptObserver, CallEnd};
use backstop::client::replay::ReplayBody;
use backstop::client::{ClientService, ClientStack, Destination, connect};
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicy};
use backstop::retry::StopReason;
use backstop::status::{Code, Outcome};
use backstop_payment::grpc::proto::ChargeRequest;
use backstop_payment::grpc::proto::payment_client::PaymentClient;
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tower::ServiceExt;
use tower::util::MapRequest;

use super::logical::Logical;
use super::report::{AttemptOutcome, AttemptRecord, LogicalRecord};
use super::target::{Target, from_tonic};

/// Most bytes of an answer read (and dropped) so its connection can be reused.
const MAX_BODY: usize = 64 * 1024;

/// When the `backstop` policy hedges.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Hedge {
    /// Never sooner than this, whatever the rolling p95.
    pub(crate) floor: Duration,
    /// Exactly this long after the attempt (instead of the p95).
    pub(crate) fixed: Option<Duration>,
}

/// The policy of `Charge` (`POST /v1/payments`, `payment.v1.Payment/Charge`) as the payment
/// service states it: `Keyed` (the same key on every attempt and hedge makes a repeat safe, so
/// hedging is allowed), keys kept for the payments TTL, and another attempt after each answer
/// its error tables call retryable: `UNAVAILABLE` (overloaded, store unavailable, PSP outcome
/// unknown over gRPC), `ABORTED` (the same key still running: 409 `request_in_progress`),
/// `RESOURCE_EXHAUSTED` (over the merchant's quota, with pushback) and `DEADLINE_EXCEEDED`
/// (504 `payment_outcome_unknown` over HTTP: "retry with the same key"); no hedge sooner
/// than `hedge.floor`, or exactly `hedge.fixed` after the attempt.
fn charge_policy(timeout: Duration, hedge: Hedge) -> MethodPolicy {
    let builder = MethodPolicy::builder("Charge", Idempotency::Keyed)
        .timeout(timeout)
        .min_hedge_delay(hedge.floor);
    let builder = match hedge.fixed {
        Some(delay) => builder.hedge_delay(delay),
        None => builder,
    };
    builder
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

type HttpService = ClientService<connect::HttpClient<ReplayBody<Full<Bytes>>>>;
type GrpcService = ClientService<GrpcTransport>;

/// The stack sends a replayable body; tonic's channel takes its own body type.
type GrpcTransport =
    MapRequest<Channel, fn(Request<ReplayBody<tonic::body::Body>>) -> Request<tonic::body::Body>>;

impl StackClient {
    /// The stack for `Charge` on `target` through `destination`: each logical request's
    /// deadline is `timeout`; `hedge` says when an attempt is hedged.
    pub(crate) fn new(
        target: &Target,
        api_key: Option<&str>,
        timeout: Duration,
        destination: &Destination,
        hedge: Hedge,
    ) -> Result<Self, String> {
        let stack = ClientStack::builder(destination, charge_policy(timeout, hedge))
            .observer(Arc::new(Tell))
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
                Ok(StackClient::Http(Arc::new(HttpStack {
                    service: stack.layer(connect::pooled(false)),
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
                let transport = channel.map_request(to_tonic);
                let authorization = bearer
                    .map(|b| {
                        MetadataValue::try_from(b)
                            .map_err(|_| "the API key is not a valid metadata value")
                    })
                    .transpose()?;
                Ok(StackClient::Grpc(Arc::new(GrpcStack {
                    client: PaymentClient::new(stack.layer(transport)),
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
            // Unreachable: the retry layer tells the end of every call it runs, and no layer
            // above it fails a call here (no intent journal).
            (None, None) => LogicalRecord {
                outcome: Outcome::Fatal,
                stop_reason: None,
            },
        };
        (log.attempts, end)
    }
}

/// One logical request's record, found by [`Tell`] in the extensions the stack tells it of.
#[derive(Debug, Clone, Default)]
pub(crate) struct Probe(Arc<Mutex<CallLog>>);

#[derive(Debug, Default)]
struct CallLog {
    attempts: Vec<AttemptRecord>,
    end: Option<LogicalRecord>,
}

impl Probe {
    fn lock(&self) -> std::sync::MutexGuard<'_, CallLog> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn take(&self) -> CallLog {
        std::mem::take(&mut *self.lock())
    }
}

/// The stack's observer: writes each send and each call's end into the call's [`Probe`]
/// (module docs).
#[derive(Debug, Default)]
struct Tell;

impl AttemptObserver for Tell {
    fn on_attempt(&self, attempt: &AttemptEvent<'_>) {
        let Some(probe) = attempt.extensions.get::<Probe>() else {
            return;
        };
        let record = AttemptRecord {
            number: attempt.number,
            latency: attempt.duration,
            outcome: match attempt.outcome {
                Outcome::Cancelled => AttemptOutcome::Cancelled,
                outcome => AttemptOutcome::Done(outcome),
            },
            hedge: attempt.kind == AttemptKind::Hedge,
            resend: attempt.kind == AttemptKind::Transparent,
            sent: attempt.started,
        };
        probe.lock().attempts.push(record);
    }

    fn on_call_end(&self, end: &CallEnd<'_>) {
        if let Some(probe) = end.extensions.get::<Probe>() {
            probe.lock().end = Some(LogicalRecord {
                outcome: end.outcome,
                stop_reason: end.stop_reason.map(StopReason::as_str),
            });
        }
    }
}
