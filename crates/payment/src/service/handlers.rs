//! The payment handlers. They run below the whole server stack: the request already has its
//! [`Deadline`], its [`Tenant`] and (on `POST /v1/payments`) a claimed [`IdempotencyKey`];
//! replays, key reuse and in-progress answers never get here.

use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use backstop::deadline::Deadline;
use backstop::idempotency::{Fingerprint, IdempotencyKey};
use backstop::server::problem::Problem;
use backstop::server::tenant::Tenant;
use serde::Serialize;
use tracing::Instrument;

use super::answer::{self, ChargeAnswer, PAYMENT_OUTCOME_UNKNOWN};
use super::payments::{self, Claimed};
use super::phases::Charging;
use super::request::{self, PaymentRequest};
use crate::intents::{Intent, IntentStatus};
use crate::state::AppState;
use crate::trace::{self, SpanContext};

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

/// A refusal as problem+json. A payment whose outcome is unknown carries `"status":
/// "unknown"` instead of repeating the HTTP status (RFC 9457 lets consumers ignore a
/// non-numeric `status`; the status line says 504).
fn refused(p: Problem) -> Response {
    if p.code() != PAYMENT_OUTCOME_UNKNOWN {
        return problem(p);
    }
    // The document was serialized just now from strings and integers: it reads back.
    let mut doc: serde_json::Value = serde_json::from_slice(&p.to_json()).unwrap_or_default();
    doc["status"] = serde_json::Value::from("unknown");
    let mut response = p.into_http_response::<Body>();
    *response.body_mut() = Body::from(doc.to_string());
    response
}

fn store_unavailable(error: &dyn std::error::Error) -> Response {
    tracing::error!(error = %error, source = ?error.source(), "payment store failed");
    problem(answer::store_unavailable(
        "the payment store did not answer; retry with the same Idempotency-Key",
    ))
}

fn invalid(e: &request::RequestError) -> Response {
    let mut p = Problem::new(StatusCode::BAD_REQUEST, e.code()).detail(e.to_string());
    if let Some(field) = e.field() {
        p = p.with("field", field);
    }
    problem(p)
}

/// The idempotency layer's claim, read from the request's extensions: a charge runs only
/// behind the layer (without it, the route answers 500: a wiring mistake, not a client's).
impl<S: Send + Sync> FromRequestParts<S> for Claimed {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let extensions = &parts.extensions;
        match (
            extensions.get::<IdempotencyKey>(),
            extensions.get::<Fingerprint>(),
        ) {
            (Some(key), Some(fingerprint)) => Ok(Claimed {
                key: key.clone(),
                fingerprint: *fingerprint,
                phases: extensions.get::<Charging>().cloned(),
            }),
            _ => Err(problem(Problem::from_status(&backstop::Status::new(
                backstop::status::Code::Internal,
                "the payment route runs only behind the idempotency layer",
            )))),
        }
    }
}

/// `POST /v1/payments`.
pub(crate) async fn create_payment(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Extension(deadline): Extension<Deadline>,
    claimed: Claimed,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let trace = trace::incoming(&headers);
    let span = tracing::info_span!(
        "payment",
        trace_id = %trace.trace_id(),
        idempotency_key = %claimed.key.as_str(),
        merchant = %tenant.as_str(),
    );
    create(state, tenant, deadline, claimed, trace, body)
        .instrument(span)
        .await
}

async fn create(
    state: AppState,
    tenant: Tenant,
    deadline: Deadline,
    claimed: Claimed,
    trace: SpanContext,
    body: Bytes,
) -> Response {
    let req: PaymentRequest = match request::parse(&body) {
        Ok(r) => r,
        Err(e) => return invalid(&e),
    };
    match payments::charge(&state, tenant.as_str(), deadline, &claimed, trace, req)
        .await
        .answer()
    {
        ChargeAnswer::Charged(intent) => created(&intent),
        ChargeAnswer::Declined(_, p) | ChargeAnswer::Refused(p) => refused(p),
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
    match payments::lookup(&state, tenant.as_str(), deadline, &intent_id)
        .await
        .answer()
    {
        Ok(intent) => json(StatusCode::OK, &intent),
        Err(p) => problem(p),
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
