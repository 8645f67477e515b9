//! The PSP client: how the payment service charges, and how it knows (or admits it does not
//! know) what happened.
//!
//! Every charge carries three things across the hop:
//! - the **effect key** (`Idempotency-Key: <intent_id>`), the same on every attempt and on every
//!   later retry of the same intent, so the PSP's own dedup turns "timed out, send again" into
//!   one charge;
//! - the **child deadline** (`grpc-timeout`): the request's deadline minus a margin of
//!   `max(floor, 2 x RTT_p99 + 5 ms)`, never a fresh budget; when nothing is left
//!   the call is not made at all;
//! - the **trace** (`traceparent`): the caller's trace id with a new span id per attempt.
//!
//! Charges go through the library's client stack ([`ClientStack`], HTTP flavour, over a pooled
//! hyper-util client): the effect key is the call's idempotency key, the outbound call's
//! deadline is the child of the incoming one, each attempt sends what is left of it minus the
//! PSP's margin, and retries (and transparent re-sends of attempts that never left) spend the
//! retry budget shared by every call to the PSP. The method is keyed: because of the effect
//! key, an attempt that timed out may be sent again. The answer is classified as:
//!
//! | PSP answer | class | result when it is the last |
//! |---|---|---|
//! | 200 / 201 + charge | ok | [`Charge`] |
//! | 503 / 429 (+ `Retry-After`) | retryable after pushback | [`ChargeError::Unknown`] |
//! | 500, 502, other 5xx, connection refused or reset, unreadable answer | retryable | [`ChargeError::Unknown`] |
//! | 504, 408, no answer before the deadline | timeout (retried: keyed) | [`ChargeError::Unknown`] |
//! | 409 (effect key seen with other parameters) | fatal | [`ChargeError::EffectKeyConflict`] |
//! | other 4xx (`410` when the effect key was voided) | fatal: a definitive refusal, nothing charged | [`ChargeError::Declined`] |
//!
//! "Unknown" is said only when a charge may have been sent, which the client stack tells
//! ([`Reach`], over every attempt of the call): an attempt answered by the PSP with an error
//! charged nothing (the PSP's contract), one that provably never left (connection refused, an
//! attempt refused for lack of time) neither; one that got no answer (reset, cut at the
//! deadline, a hedge that lost) may have. When no attempt may have charged, the result is
//! [`ChargeError::NotCharged`] instead of [`ChargeError::Unknown`].
//!
//! [`PspClient::void`] settles an effect key whose outcome is unknown for good: the PSP answers
//! with the charge it made, or voids the key so that no charge with it can ever land. That is
//! what makes it safe to mark an abandoned intent failed and free its order.

use std::sync::Arc;
use std::time::Duration;

use backstop::client::retry::RetryStopped;
use backstop::client::{ClientStack, Destination, HttpService, Reach, StackError};
use backstop::deadline::{Deadline, DeadlineExceeded, GRPC_TIMEOUT, Margin, encode_grpc_timeout};
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicy};
use backstop::retry::{RetryBudget, RetryError, StopReason};
use backstop::status::{Code, Status};
use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full, Limited};
use tokio::time::Instant;
use tower::ServiceExt;

use crate::psp::{Charge, ChargeRequest, Void};
use crate::trace::{self, SpanContext, TRACEPARENT};

/// Largest PSP answer body read (a charge is a few hundred bytes; a list is bounded by the
/// PSP's list limit).
const MAX_ANSWER: usize = 1024 * 1024;
/// Most seconds of `Retry-After` honoured from the PSP (the deadline bounds it anyway).
const MAX_PUSHBACK_SECS: u64 = 3600;

/// The service and method labels of the client metrics.
pub const SERVICE_LABEL: &str = "psp";
/// The method label of charges.
pub const METHOD_LABEL: &str = "Charge";
/// The least time the PSP is given to commit a charge: below it (after both margins), no
/// charge is attempted and nothing is written.
pub const MIN_PSP_BUDGET: Duration = Duration::from_millis(5);
/// How long a caller is asked to wait when the PSP charged nothing and said nothing about
/// when to come back.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The PSP `reference` of a merchant's order: `MERCHANT:ORDER_ID`. Order ids are unique per
/// merchant only, so the bare order id would let two merchants' `o-1` share one reference in
/// the PSP's listing. Merchant names never contain `:` (see
/// [`ApiKey::parse`](crate::config::ApiKey::parse)), so the first `:` splits the two
/// unambiguously; at most 64 + 1 + 128 bytes, within the PSP's 255.
pub fn psp_reference(merchant_id: &str, order_id: &str) -> String {
    format!("{merchant_id}:{order_id}")
}

/// What a charge needs to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeCall {
    /// The effect key: the intent id.
    pub effect_key: String,
    /// The merchant whose order it is.
    pub merchant_id: String,
    /// The order id; the PSP's `reference` is [`psp_reference`] of both.
    pub order_id: String,
    /// Amount in minor units.
    pub amount_cents: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// The incoming request's deadline (the child deadline is derived from it).
    pub deadline: Deadline,
    /// The incoming request's trace context.
    pub trace: SpanContext,
}

/// Why a charge did not produce a [`Charge`].
#[derive(Debug, thiserror::Error)]
pub enum ChargeError {
    /// Not enough budget left for a meaningful round trip: nothing was sent by this call.
    #[error("no budget left for the PSP call")]
    NoBudget(#[source] DeadlineExceeded),
    /// The PSP refused definitively (a 4xx): nothing was charged.
    #[error("the PSP declined the charge with HTTP {status}")]
    Declined {
        /// The PSP's HTTP status.
        status: StatusCode,
        /// Why the attempts stopped.
        #[source]
        source: RetryError,
    },
    /// The PSP already holds this effect key with other parameters: an inconsistency that no
    /// retry fixes.
    #[error("the PSP holds this effect key with other parameters")]
    EffectKeyConflict(#[source] RetryError),
    /// The outcome is unknown: the PSP may or may not have charged. Converge by retrying with
    /// the same effect key or by querying.
    #[error("the PSP outcome is unknown")]
    Unknown(#[source] RetryError),
    /// No attempt of this call can have charged: none reached the PSP, or every one that did
    /// was answered with an error (which charges nothing). Safe to retry with the same key.
    #[error("the PSP charged nothing")]
    NotCharged {
        /// Whether any attempt was handed to the transport (`false`: the budget or the
        /// client's own limits stopped every attempt before it was sent).
        tried: bool,
        /// Why the attempts stopped.
        #[source]
        source: RetryError,
    },
}

impl ChargeError {
    /// How long the caller should wait before retrying: the PSP's pushback when it sent one,
    /// else [`DEFAULT_RETRY_AFTER`].
    pub fn retry_after(&self) -> Duration {
        let last = match self {
            ChargeError::NoBudget(_) => None,
            ChargeError::Declined { source, .. }
            | ChargeError::EffectKeyConflict(source)
            | ChargeError::Unknown(source)
            | ChargeError::NotCharged { source, .. } => source.last.pushback(),
        };
        last.unwrap_or(DEFAULT_RETRY_AFTER)
            .max(Duration::from_secs(1))
    }
}

/// Errors building a [`PspClient`].
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The HTTP client could not be built.
    #[error("cannot build the PSP HTTP client")]
    Http(#[source] reqwest::Error),
    /// The client stack is invalid.
    #[error("invalid PSP client stack")]
    Stack(#[source] StackError),
    /// The PSP URL is not a URL.
    #[error("invalid PSP URL {0}")]
    Url(String),
}

/// A pooled HTTP client for one PSP, with its retry policy, shared budget and margin estimator.
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct PspClient {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    charges: HttpService,
    base: String,
    charges_url: http::Uri,
    margin: Margin,
    /// The margin each attempt keeps (the client stack's, per destination).
    attempt_margin: Arc<Margin>,
}

impl PspClient {
    /// A client for the PSP at `base_url` (e.g. `http://127.0.0.1:9090`), spending retries from
    /// `budget` and keeping at least `margin_floor` of every deadline for the way back.
    pub fn new(
        base_url: &str,
        budget: RetryBudget,
        margin_floor: Duration,
    ) -> Result<Self, ClientError> {
        Self::with_retry_switch(base_url, budget, margin_floor, None)
    }

    /// [`new`](Self::new), its retries and hedges also following the fleet's retry `switch`.
    pub fn with_retry_switch(
        base_url: &str,
        budget: RetryBudget,
        margin_floor: Duration,
        switch: Option<backstop::retry::RetrySwitch>,
    ) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder()
            // The PSP is reached directly; a proxy from the environment must not reroute charges.
            .no_proxy()
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(64)
            .build()
            .map_err(ClientError::Http)?;
        let base = base_url.trim_end_matches('/').to_owned();
        let charges_url: http::Uri = format!("{base}/v1/charges")
            .parse()
            .map_err(|_| ClientError::Url(base.clone()))?;
        // The breaker stays off: a PSP that fails is reported per charge as "unknown", and the
        // service's own admission control protects it.
        let destination = Destination::new(SERVICE_LABEL)
            .budget(budget)
            .margin_floor(margin_floor)
            .breaker(None)
            .retry_switch(switch);
        let contract = MethodPolicy::builder(METHOD_LABEL, Idempotency::Keyed)
            .key_ttl(KEY_TTL_PAYMENTS)
            .retryable([
                Code::Unavailable,
                Code::ResourceExhausted,
                Code::DeadlineExceeded,
            ])
            .build();
        let stack = ClientStack::builder(&destination, contract)
            .classifier(psp_answer)
            .build()
            .map_err(ClientError::Stack)?;
        let charges = stack.http();
        Ok(PspClient {
            inner: Arc::new(Inner {
                http,
                charges,
                charges_url,
                base,
                margin: Margin::new(margin_floor),
                attempt_margin: Arc::clone(destination.margin()),
            }),
        })
    }

    /// The PSP base URL.
    pub fn base_url(&self) -> &str {
        &self.inner.base
    }

    /// The margin currently kept back from a deadline for this PSP.
    pub fn margin(&self) -> Duration {
        self.inner.margin.current()
    }

    /// Measures one round trip to the PSP (`GET /healthz`) and feeds the margin estimator.
    /// Charges are not used for this: their time includes the PSP's own work, not only the
    /// network.
    pub async fn probe_rtt(&self, timeout: Duration) -> Result<Duration, reqwest::Error> {
        let started = Instant::now();
        let response = self
            .inner
            .http
            .get(format!("{}/healthz", self.inner.base))
            .timeout(timeout)
            .send()
            .await?;
        let _ = response.bytes().await?;
        let rtt = started.elapsed();
        self.inner.margin.observe(rtt);
        Ok(rtt)
    }

    /// Whether `deadline` leaves enough for a charge to reach the PSP and come back: the child
    /// deadline's margin, each attempt's margin and [`MIN_PSP_BUDGET`] for the PSP's own work.
    /// The payment service checks it before writing anything, so a budget that cannot cover a
    /// round trip leaves no intent behind.
    pub fn check_budget(&self, deadline: Deadline) -> Result<(), DeadlineExceeded> {
        deadline.child(self.needed_budget()).map(|_| ())
    }

    /// The least budget a charge needs now ([`check_budget`](Self::check_budget)).
    pub fn needed_budget(&self) -> Duration {
        self.inner.margin.current() + self.inner.attempt_margin.current() + MIN_PSP_BUDGET
    }

    /// Charges once per effect key: attempts under the child deadline with the shared retry
    /// budget; see the module documentation for the classification.
    pub async fn charge(&self, call: &ChargeCall) -> Result<Charge, ChargeError> {
        let child = call
            .deadline
            .child(self.inner.margin.current())
            .map_err(ChargeError::NoBudget)?;
        let body = ChargeRequest {
            reference: psp_reference(&call.merchant_id, &call.order_id),
            amount_cents: call.amount_cents,
            currency: call.currency.clone(),
        };
        let json = serde_json::to_vec(&body).map_err(|e| {
            unknown(Status::new(
                Code::Internal,
                format!("cannot encode the charge: {e}"),
            ))
        })?;
        let mut request = http::Request::post(self.inner.charges_url.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", &call.effect_key)
            .body(Full::new(Bytes::from(json)))
            .map_err(|e| {
                unknown(Status::new(
                    Code::Internal,
                    format!("cannot build the charge: {e}"),
                ))
            })?;
        // The caller's trace, a new span id; an invalid context (none read) sends none.
        if let Some(traceparent) = trace::traceparent(&trace::child(&call.trace)) {
            request.headers_mut().insert(TRACEPARENT, traceparent);
        }
        request.extensions_mut().insert(child);
        let response = match self.inner.charges.clone().oneshot(request).await {
            Ok(response) => response,
            Err(e) => {
                let stopped = RetryError {
                    last: e.last().clone(),
                    attempts: e.attempts(),
                    reason: e.reason().unwrap_or(StopReason::NonRetryable),
                };
                return Err(classify_failure(stopped, e.reach()));
            }
        };
        if let Some(stopped) = response.extensions().get::<RetryStopped>().copied() {
            let last = psp_answer(response.status(), response.headers())
                .unwrap_or_else(|| Status::new(Code::Unknown, "the PSP answer ended the attempts"));
            return Err(classify_failure(
                RetryError {
                    last,
                    attempts: stopped.attempts,
                    reason: stopped.reason,
                },
                stopped.reach,
            ));
        }
        let bytes = tokio::time::timeout_at(
            child.instant(),
            Limited::new(response.into_body(), MAX_ANSWER).collect(),
        )
        .await
        .map_err(|_| {
            unknown(Status::new(
                Code::DeadlineExceeded,
                "the PSP answer came too late",
            ))
        })?
        .map_err(|_| {
            unknown(
                Status::new(Code::Unavailable, "the PSP answer could not be read")
                    .with_http_status(StatusCode::BAD_GATEWAY),
            )
        })?
        .to_bytes();
        serde_json::from_slice::<Charge>(&bytes).map_err(|_| {
            unknown(
                Status::new(Code::Unavailable, "the PSP answer is not a charge")
                    .with_http_status(StatusCode::BAD_GATEWAY),
            )
        })
    }

    /// Settles `effect_key` at the PSP for good (`POST /v1/voids`), one attempt bounded by the
    /// child of `deadline`: the charge it made, or "voided", after which no charge with that
    /// key can land. Only for an effect key whose work was abandoned: a charge still in flight
    /// with it is then refused.
    pub async fn void(&self, effect_key: &str, deadline: Deadline) -> Result<Void, Status> {
        let child = deadline
            .child(self.inner.margin.current())
            .map_err(Status::from)?;
        let query = async {
            let mut response = self
                .inner
                .http
                .post(format!("{}/v1/voids", self.inner.base))
                .header("idempotency-key", effect_key)
                .header(GRPC_TIMEOUT, encode_grpc_timeout(child.remaining()))
                .send()
                .await
                .map_err(|e| transport_status(&e))?;
            let status = response.status();
            if !status.is_success() {
                return Err(answer_status(status, retry_after(response.headers())));
            }
            let bytes = read_bounded(&mut response).await?;
            serde_json::from_slice::<Void>(&bytes).map_err(|_| {
                Status::new(Code::Unavailable, "the PSP answer is not a void")
                    .with_http_status(StatusCode::BAD_GATEWAY)
            })
        };
        tokio::time::timeout_at(child.instant(), query)
            .await
            .map_err(|_| Status::new(Code::DeadlineExceeded, "the PSP did not answer in time"))?
    }

    /// Looks for the charge made under `effect_key` for the merchant's `order_id` (`GET
    /// /v1/charges?reference=`), one attempt bounded by the child of `deadline`. `Ok(None)`
    /// means the PSP has no such charge *now*; it does not prove that none is in flight.
    pub async fn find_charge(
        &self,
        merchant_id: &str,
        order_id: &str,
        effect_key: &str,
        deadline: Deadline,
    ) -> Result<Option<Charge>, Status> {
        let child = deadline
            .child(self.inner.margin.current())
            .map_err(Status::from)?;
        let url = reqwest::Url::parse_with_params(
            &self.inner.charges_url.to_string(),
            [("reference", psp_reference(merchant_id, order_id))],
        )
        .map_err(|_| Status::new(Code::InvalidArgument, "cannot build the PSP query URL"))?;
        let query = async {
            let mut response = self
                .inner
                .http
                .get(url)
                .header(GRPC_TIMEOUT, encode_grpc_timeout(child.remaining()))
                .send()
                .await
                .map_err(|e| transport_status(&e))?;
            let status = response.status();
            if !status.is_success() {
                return Err(answer_status(status, retry_after(response.headers())));
            }
            let bytes = read_bounded(&mut response).await?;
            serde_json::from_slice::<Vec<Charge>>(&bytes).map_err(|_| {
                Status::new(Code::Unavailable, "the PSP answer is not a charge list")
                    .with_http_status(StatusCode::BAD_GATEWAY)
            })
        };
        let charges = tokio::time::timeout_at(child.instant(), query)
            .await
            .map_err(|_| Status::new(Code::DeadlineExceeded, "the PSP did not answer in time"))??;
        Ok(charges.into_iter().find(|c| c.effect_key == effect_key))
    }
}

/// Reads at most [`MAX_ANSWER`] bytes of the answer.
async fn read_bounded(response: &mut reqwest::Response) -> Result<Vec<u8>, Status> {
    let mut out = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if out.len() + chunk.len() > MAX_ANSWER {
                    return Err(
                        Status::new(Code::Unavailable, "the PSP answer is too large")
                            .with_http_status(StatusCode::BAD_GATEWAY),
                    );
                }
                out.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(out),
            Err(e) => return Err(transport_status(&e)),
        }
    }
}

/// Delta-seconds `Retry-After` (what the PSP sends), bounded.
fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    let v = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?;
    let secs: u64 = v.trim().parse().ok()?;
    Some(Duration::from_secs(secs.min(MAX_PUSHBACK_SECS)))
}

/// The client stack's classifier for PSP answers (module table): `None` for a success.
fn psp_answer(status: StatusCode, headers: &http::HeaderMap) -> Option<Status> {
    (!status.is_success()).then(|| answer_status(status, retry_after(headers)))
}

/// A charge whose outcome is unknown for a reason found after the attempts.
fn unknown(last: Status) -> ChargeError {
    ChargeError::Unknown(RetryError {
        last,
        attempts: 1,
        reason: StopReason::NonRetryable,
    })
}

/// The status of a PSP error answer (module table).
fn answer_status(status: StatusCode, pushback: Option<Duration>) -> Status {
    let code = match status.as_u16() {
        408 | 504 => Code::DeadlineExceeded,
        409 => Code::AlreadyExists,
        429 => Code::ResourceExhausted,
        500..=599 => Code::Unavailable,
        _ => Code::FailedPrecondition,
    };
    let mut s = Status::new(code, format!("the PSP answered {status}")).with_http_status(status);
    if let Some(p) = pushback {
        s = s.with_pushback(p);
    }
    s
}

/// A request that got no HTTP answer. Refused connections never reached the PSP; anything
/// else may have: either way the effect key makes another attempt safe.
fn transport_status(e: &reqwest::Error) -> Status {
    if e.is_timeout() {
        Status::new(Code::DeadlineExceeded, "the PSP did not answer in time")
    } else if e.is_connect() {
        Status::new(Code::Unavailable, "cannot connect to the PSP")
    } else {
        Status::new(
            Code::Unavailable,
            "the PSP connection failed before an answer",
        )
    }
}

/// A failed charge by its last status and by how far its attempts got.
fn classify_failure(e: RetryError, reach: Reach) -> ChargeError {
    match e.last.code() {
        Code::AlreadyExists => ChargeError::EffectKeyConflict(e),
        Code::FailedPrecondition => ChargeError::Declined {
            status: e.last.http_status(),
            source: e,
        },
        _ if reach == Reach::Unknown => ChargeError::Unknown(e),
        _ => ChargeError::NotCharged {
            tried: e.attempts > 0,
            source: e,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use backstop::status::RetryClass;

    #[test]
    fn answers_are_classified_per_the_table() {
        let class = |s: u16| answer_status(StatusCode::from_u16(s).unwrap(), None).retry_class();
        assert_eq!(class(503), RetryClass::Retryable);
        assert_eq!(class(500), RetryClass::Retryable);
        assert_eq!(class(502), RetryClass::Retryable);
        assert_eq!(class(429), RetryClass::RetryAfterPushback);
        assert_eq!(class(504), RetryClass::Timeout);
        assert_eq!(class(408), RetryClass::Timeout);
        assert_eq!(class(409), RetryClass::Fatal);
        assert_eq!(class(400), RetryClass::Fatal);
        assert_eq!(class(402), RetryClass::Fatal);
        assert_eq!(class(422), RetryClass::Fatal);
    }

    #[test]
    fn retry_after_is_read_and_bounded() {
        let mut h = http::HeaderMap::new();
        assert_eq!(retry_after(&h), None);
        h.insert(http::header::RETRY_AFTER, "2".parse().unwrap());
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert(http::header::RETRY_AFTER, "99999999".parse().unwrap());
        assert_eq!(
            retry_after(&h),
            Some(Duration::from_secs(MAX_PUSHBACK_SECS))
        );
        h.insert(http::header::RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(retry_after(&h), None);
    }

    fn stop(s: Status) -> RetryError {
        RetryError {
            last: s,
            attempts: 1,
            reason: backstop::retry::StopReason::NonRetryable,
        }
    }

    #[test]
    fn a_declined_last_attempt_is_declined_anything_unclear_is_unknown() {
        let sent = Reach::Unknown;
        assert!(matches!(
            classify_failure(stop(answer_status(StatusCode::PAYMENT_REQUIRED, None)), sent),
            ChargeError::Declined { status, .. } if status == StatusCode::PAYMENT_REQUIRED
        ));
        assert!(matches!(
            classify_failure(stop(answer_status(StatusCode::GONE, None)), sent),
            ChargeError::Declined { status, .. } if status == StatusCode::GONE
        ));
        assert!(matches!(
            classify_failure(stop(answer_status(StatusCode::CONFLICT, None)), sent),
            ChargeError::EffectKeyConflict(_)
        ));
        for s in [500, 503, 504] {
            assert!(matches!(
                classify_failure(
                    stop(answer_status(StatusCode::from_u16(s).unwrap(), None)),
                    sent
                ),
                ChargeError::Unknown(_)
            ));
        }
    }

    #[test]
    fn unknown_only_when_an_attempt_may_have_charged() {
        let e = classify_failure(
            stop(answer_status(
                StatusCode::SERVICE_UNAVAILABLE,
                Some(Duration::from_secs(3)),
            )),
            Reach::Answered,
        );
        assert!(
            matches!(e, ChargeError::NotCharged { tried: true, .. }),
            "{e:?}"
        );
        assert_eq!(e.retry_after(), Duration::from_secs(3));
        // Refused before sending: no attempt.
        let refused = RetryError {
            attempts: 0,
            ..stop(Status::new(Code::DeadlineExceeded, "no time"))
        };
        let e = classify_failure(refused, Reach::NotSent);
        assert!(
            matches!(e, ChargeError::NotCharged { tried: false, .. }),
            "{e:?}"
        );
        assert_eq!(e.retry_after(), DEFAULT_RETRY_AFTER);
        // An attempt dropped unanswered may have charged.
        assert!(matches!(
            classify_failure(
                stop(Status::new(Code::DeadlineExceeded, "cut")),
                Reach::Unknown
            ),
            ChargeError::Unknown(_)
        ));
    }
}
