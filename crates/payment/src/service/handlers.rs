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
#[allow(unused_imports)] // Named by the `utoipa::path` annotations.
use super::problem_schema::ProblemDocument;
use super::request::{self, PaymentRequest};
use crate::intents::{Intent, IntentStatus};
use crate::state::AppState;
use crate::trace::{self, SpanContext};

/// Problem code of a 404 on an unknown route.
pub const NOT_FOUND: &str = "not_found";
/// Problem code of a 405.
pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";

/// Wire form of a payment (201 on create, 200 on `GET`).
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = Payment)]
pub(crate) struct PaymentView<'a> {
    /// The payment's id, also the effect key the PSP deduplicates on.
    intent_id: &'a str,
    /// The merchant's business key of the payment.
    order_id: &'a str,
    /// Amount in minor units.
    amount_cents: i64,
    /// ISO 4217 code.
    currency: &'a str,
    /// Where the payment stands.
    status: IntentStatus,
    /// The PSP's charge id once the payment succeeded.
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
#[utoipa::path(
    post,
    path = "/v1/payments",
    tag = "payments",
    params(
        ("Idempotency-Key" = String, Header, pattern = "^[!#-~]{1,255}$", description = "1-255 visible ASCII characters (a token, or a quoted Structured Field string such as `\"k-1\"`); one per logical payment, the same on every retry"),
        ("grpc-timeout" = Option<String>, Header, nullable = false, pattern = "^[1-9][0-9]{0,7}[HMSmun]$", description = "The caller's remaining budget, gRPC syntax (`250m`, `2S`); default 10 s"),
        ("traceparent" = Option<String>, Header, nullable = false, description = "W3C trace context, propagated to the PSP")
    ),
    request_body(content = PaymentRequest, content_type = "application/json", description = "At most 1 MiB; unknown members and members named twice are refused"),
    responses(
        (status = 201, description = "Payment created; the same key again with the same parameters replays this answer byte for byte", body = PaymentView,
            headers(("Location" = String, description = "`/v1/payments/{intent_id}`"),
                    ("Idempotent-Replayed" = bool, description = "`true` on a replayed answer"))),
        (status = 400, description = "Bad input (`missing_idempotency_key`, `invalid_idempotency_key`, `invalid_body`, `malformed_json`, `duplicate_field`, `unknown_field`, `missing_field`, `invalid_order_id`, `invalid_amount`, `invalid_currency`, `invalid_grpc_timeout`); nothing is written", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 401, description = "Missing or unknown bearer key (`unauthenticated`)", body = ProblemDocument, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer`"))),
        (status = 402, description = "The PSP refused the charge for good (`payment_declined`)", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 409, description = "The key was used with other parameters (`idempotency_key_reused`), is still running when this request's budget ends (`request_in_progress`, with `Retry-After`), or the order has a payment under another key (`order_conflict`)", body = ProblemDocument, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait (`request_in_progress`)"))),
        (status = 500, description = "`outcome_unknown` (never on this route: its takeover resumes), or `internal`: the answer could not be stored; the key is released", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 502, description = "The PSP holds this payment's effect key with other parameters (`psp_conflict`)", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 404, description = "No such route (`not_found`)", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 405, description = "The route does not take this method (`method_not_allowed`)", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 413, description = "Body over 1 MiB (`body_too_large`)", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 415, description = "`Content-Type: application/grpc` on the HTTP port (`grpc_on_http_port`)", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "The merchant is over its quota (`rate_limited`)", body = ProblemDocument, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying"))),
        (status = 503, description = "Not now: overloaded, a dependency down or the PSP charged nothing (`overloaded`, `rate_limiter_unavailable`, `store_unavailable`, `psp_unavailable`, `fault_injected`)", body = ProblemDocument, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying"))),
        (status = 504, description = "The request's deadline ran out (`deadline_exceeded`), or a charge's outcome is unknown (`payment_outcome_unknown`: retry with the same key)", body = ProblemDocument, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying (`payment_outcome_unknown`)")))
    ),
    security((), ("bearer" = []))
)]
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
#[utoipa::path(
    get,
    path = "/v1/payments/{intent_id}",
    tag = "payments",
    params(
        ("intent_id" = String, Path, description = "The payment's id"),
        ("grpc-timeout" = Option<String>, Header, nullable = false, pattern = "^[1-9][0-9]{0,7}[HMSmun]$", description = "The caller's remaining budget, gRPC syntax")
    ),
    responses(
        (status = 200, description = "The payment", body = PaymentView),
        (status = 400, description = "Bad input (`missing_idempotency_key`, `invalid_idempotency_key`, `invalid_body`, `malformed_json`, `duplicate_field`, `unknown_field`, `missing_field`, `invalid_order_id`, `invalid_amount`, `invalid_currency`, `invalid_grpc_timeout`); nothing is written", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 401, description = "Missing or unknown bearer key (`unauthenticated`)", body = ProblemDocument, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer`"))),
        (status = 404, description = "No payment of this merchant with this id (`payment_not_found`)", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 405, description = "The route does not take this method (`method_not_allowed`)", body = ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "The merchant is over its quota (`rate_limited`)", body = ProblemDocument, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying"))),
        (status = 503, description = "Not now (`overloaded`, `rate_limiter_unavailable`, `store_unavailable`, `fault_injected`)", body = ProblemDocument, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying"))),
        (status = 504, description = "The request's deadline ran out (`deadline_exceeded`)", body = ProblemDocument, content_type = "application/problem+json")
    ),
    security((), ("bearer" = []))
)]
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
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "The process is up: `{\"status\":\"ok\"}`", content_type = "application/json")))]
pub(crate) async fn healthz() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"status":"ok"}"#,
    )
        .into_response()
}

/// `GET /readyz`: the store answers a read.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses((status = 200, description = "The store answers: `{\"status\":\"ready\"}`", content_type = "application/json"),
              (status = 503, description = "The store does not answer (`store_unavailable`)", body = ProblemDocument, content_type = "application/problem+json")))]
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
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain")))]
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
