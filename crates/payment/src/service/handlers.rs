//! The payment handlers. They run below the whole server stack: the request already has its
//! [`Deadline`], its [`Tenant`] and (on `POST /v1/payments`) a claimed [`IdempotencyKey`];
//! replays, key reuse and in-progress answers never get here.

use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use backstop::deadline::Deadline;
use backstop::idempotency::IdempotencyKey;
use backstop::server::problem::Problem;
use backstop::server::tenant::Tenant;
use backstop::status::problem as codes;
use serde::Serialize;
use tracing::Instrument;

use super::payments::{self, ChargeOutcome, Lookup};
use super::phases::Charging;
use super::request::{self, PaymentRequest};
use crate::intents::{Intent, IntentStatus};
use crate::state::AppState;
use crate::trace::{self, SpanContext};

/// Problem code of a 504 whose payment outcome is unknown.
pub const PAYMENT_OUTCOME_UNKNOWN: &str = "payment_outcome_unknown";
/// Problem code of a 402: the PSP refused the charge definitively; nothing was charged.
pub const PAYMENT_DECLINED: &str = "payment_declined";
/// Problem code of a 404 on `GET /v1/payments/{intent_id}`.
pub const PAYMENT_NOT_FOUND: &str = "payment_not_found";
/// Problem code of a 503 when the store does not answer (retry with the same key).
pub const STORE_UNAVAILABLE: &str = "store_unavailable";
/// Problem code of a 503 when the PSP charged nothing and the service's client gave up
/// (retry budget spent, PSP unreachable or pushing back): retry with the same key later.
pub const PSP_UNAVAILABLE: &str = "psp_unavailable";
/// Problem code of a 502 when the PSP holds the effect key with other parameters.
pub const PSP_CONFLICT: &str = "psp_conflict";
/// Problem code of a 404 on an unknown route.
pub const NOT_FOUND: &str = "not_found";
/// Problem code of a 405.
pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";

/// Wire form of a payment (201 on create, 200 on `GET`).
#[derive(Debug, Serialize)]
struct PaymentView<'a> {
    intent_id: &'a str,
    order_id: &'a str,
    amount_cents: i64,
    currency: &'a str,
    status: IntentStatus,
    charge_id: Option<&'a str>,
}

impl<'a> From<&'a Intent> for PaymentView<'a> {
    fn from(i: &'a Intent) -> Self {
        PaymentView {
            intent_id: &i.intent_id,
            order_id: &i.order_id,
            amount_cents: i.amount_cents,
            currency: &i.currency,
            status: i.status,
            charge_id: i.psp_charge_id.as_deref(),
        }
    }
}

fn json(status: StatusCode, intent: &Intent) -> Response {
    // Serializing plain strings and integers cannot fail.
    let body = serde_json::to_vec(&PaymentView::from(intent)).unwrap_or_default();
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn created(intent: &Intent) -> Response {
    let mut response = json(StatusCode::CREATED, intent);
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/payments/{}", intent.intent_id)) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

fn problem(p: Problem) -> Response {
    p.into_http_response::<Body>()
}

/// 504 with `"status": "unknown"` and `Retry-After`: the charge may or may not have happened.
/// The `status` member carries the payment status instead of repeating the HTTP status (RFC
/// 9457 lets consumers ignore a non-numeric `status`; the status line says 504).
fn unknown(intent: &Intent, detail: &str, retry_after: std::time::Duration) -> Response {
    let p = Problem::new(StatusCode::GATEWAY_TIMEOUT, PAYMENT_OUTCOME_UNKNOWN)
        .detail(detail)
        .with("intent_id", intent.intent_id.as_str())
        .with("order_id", intent.order_id.as_str());
    let mut doc: serde_json::Value = match serde_json::from_slice(&p.to_json()) {
        Ok(doc) => doc,
        Err(_) => return problem(p),
    };
    doc["status"] = serde_json::Value::from("unknown");
    let mut response = Response::new(Body::from(doc.to_string()));
    *response.status_mut() = StatusCode::GATEWAY_TIMEOUT;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(backstop::server::problem::CONTENT_TYPE),
    );
    response.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from(retry_after.as_secs().max(1)),
    );
    response
}

fn declined(intent: &Intent) -> Response {
    problem(
        Problem::new(StatusCode::PAYMENT_REQUIRED, PAYMENT_DECLINED)
            .detail(
                "the payment failed and nothing was charged: the payment provider declined \
                 it, or it was abandoned with its outcome unknown and then voided",
            )
            .with("intent_id", intent.intent_id.as_str()),
    )
}

fn store_unavailable(error: &dyn std::error::Error) -> Response {
    tracing::error!(error = %error, source = ?error.source(), "payment store failed");
    problem(
        Problem::new(StatusCode::SERVICE_UNAVAILABLE, STORE_UNAVAILABLE)
            .detail("the payment store did not answer; retry with the same Idempotency-Key")
            .retry_after(std::time::Duration::from_secs(1)),
    )
}

fn invalid(e: &request::RequestError) -> Response {
    let mut p = Problem::new(StatusCode::BAD_REQUEST, e.code()).detail(e.to_string());
    if let Some(field) = e.field() {
        p = p.with("field", field);
    }
    problem(p)
}

/// `POST /v1/payments`.
pub(crate) async fn create_payment(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Extension(deadline): Extension<Deadline>,
    Extension(key): Extension<IdempotencyKey>,
    charging: Option<Extension<Charging>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let charging = charging.map(|Extension(charging)| charging);
    let trace = trace::incoming(&headers);
    let span = tracing::info_span!(
        "payment",
        trace_id = %trace.trace_id(),
        idempotency_key = %key.as_str(),
        merchant = %tenant.as_str(),
    );
    create(state, tenant, deadline, key, charging, trace, body)
        .instrument(span)
        .await
}

async fn create(
    state: AppState,
    tenant: Tenant,
    deadline: Deadline,
    key: IdempotencyKey,
    charging: Option<Charging>,
    trace: SpanContext,
    body: Bytes,
) -> Response {
    let req: PaymentRequest = match request::parse(&body) {
        Ok(r) => r,
        Err(e) => return invalid(&e),
    };
    match payments::charge(
        &state,
        tenant.as_str(),
        deadline,
        &key,
        trace,
        req,
        charging.as_ref().map(|c| &*c.0),
    )
    .await
    {
        ChargeOutcome::Charged(intent) => created(&intent),
        ChargeOutcome::Declined(intent) => declined(&intent),
        ChargeOutcome::OrderConflict(i) => problem(
            Problem::new(StatusCode::CONFLICT, codes::ORDER_CONFLICT)
                .detail("this order already has a payment created with another Idempotency-Key")
                .with("intent_id", i.intent_id.as_str())
                .with("order_id", i.order_id.as_str()),
        ),
        ChargeOutcome::KeyReused { fingerprint_prefix } => problem(
            Problem::new(StatusCode::CONFLICT, codes::IDEMPOTENCY_KEY_REUSED)
                .detail("this Idempotency-Key already created a payment with other parameters")
                .with("fingerprint_prefix", fingerprint_prefix),
        ),
        ChargeOutcome::StoreUnavailable(detail) => problem(
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, STORE_UNAVAILABLE)
                .detail(detail)
                .retry_after(std::time::Duration::from_secs(1)),
        ),
        ChargeOutcome::PspConflict(intent) => problem(
            Problem::new(StatusCode::BAD_GATEWAY, PSP_CONFLICT)
                .detail(
                    "the payment provider holds this payment's effect key with other parameters",
                )
                .with("intent_id", intent.intent_id.as_str()),
        ),
        ChargeOutcome::Unknown {
            intent,
            detail,
            retry_after,
        } => unknown(&intent, detail, retry_after),
        ChargeOutcome::DeadlineExceeded { intent } => {
            let mut p = Problem::new(StatusCode::GATEWAY_TIMEOUT, codes::DEADLINE_EXCEEDED).detail(
                "the deadline left no time to reach the payment provider; nothing was charged \
                 by this request: retry with the same Idempotency-Key and a longer deadline",
            );
            if let Some(intent) = intent {
                p = p.with("intent_id", intent.intent_id.as_str());
            }
            problem(p)
        }
        ChargeOutcome::PspUnavailable {
            intent,
            retry_after,
        } => problem(
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, PSP_UNAVAILABLE)
                .detail(
                    "the payment provider charged nothing and cannot be reached now; retry \
                     with the same Idempotency-Key after Retry-After",
                )
                .with("intent_id", intent.intent_id.as_str())
                .retry_after(retry_after),
        ),
    }
}

/// `GET /v1/payments/{intent_id}`: the merchant's own intents only. A running intent is
/// converged by asking the PSP for a charge under its effect key.
pub(crate) async fn get_payment(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Extension(deadline): Extension<Deadline>,
    Path(intent_id): Path<String>,
) -> Response {
    match payments::lookup(&state, tenant.as_str(), deadline, &intent_id).await {
        Lookup::Found(intent) => json(StatusCode::OK, &intent),
        Lookup::NotFound => problem(
            Problem::new(StatusCode::NOT_FOUND, PAYMENT_NOT_FOUND)
                .detail("no payment with this id for this merchant"),
        ),
        Lookup::StoreUnavailable => problem(
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, STORE_UNAVAILABLE)
                .detail("the payment store did not answer; retry")
                .retry_after(std::time::Duration::from_secs(1)),
        ),
    }
}

/// `GET /healthz`: the process is up.
pub(crate) async fn healthz() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"status":"ok"}"#,
    )
        .into_response()
}

/// `GET /readyz`: the store answers a read.
pub(crate) async fn readyz(State(state): State<AppState>) -> Response {
    match state.intents.ping().await {
        Ok(()) => (
            [(header::CONTENT_TYPE, "application/json")],
            r#"{"status":"ready"}"#,
        )
            .into_response(),
        Err(e) => store_unavailable(&e),
    }
}

/// `GET /metrics`: Prometheus text format.
pub(crate) async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

/// Unknown route.
pub(crate) async fn not_found() -> Response {
    problem(Problem::new(StatusCode::NOT_FOUND, NOT_FOUND).detail("no such route"))
}

/// Known route, other method.
pub(crate) async fn method_not_allowed() -> Response {
    problem(
        Problem::new(StatusCode::METHOD_NOT_ALLOWED, METHOD_NOT_ALLOWED)
            .detail("this route does not take this method"),
    )
}
