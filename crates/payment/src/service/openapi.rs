//! The HTTP API as an OpenAPI 3.1 document, served at `GET /openapi.json`.
//!
//! utoipa builds it from the handlers' own annotations and wire types ([`PaymentRequest`],
//! the payment view, [`IntentStatus`]), so a field or route that changes changes the
//! document. Refusals are one schema, `Problem` (RFC 9457 problem+json), whose
//! `code` lists every problem code the service answers; a test reads the codes from the
//! sources and checks each is listed, so the list cannot fall behind.

use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

use super::handlers;
use super::request::PaymentRequest;
use crate::intents::IntentStatus;

/// The document: `ApiDoc::openapi()`, or `GET /openapi.json` on a running service.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "backstop payment service",
        description = "Payments with retries made safe by idempotency keys: a caller that \
                       retries with the same `Idempotency-Key` is charged once, waits no longer \
                       than its deadline, and is told \"not now\" (429/503 + `Retry-After`) \
                       instead of being queued past it."
    ),
    paths(
        handlers::create_payment,
        handlers::get_payment,
        handlers::healthz,
        handlers::readyz,
        handlers::metrics,
        openapi_json
    ),
    components(schemas(PaymentRequest, handlers::PaymentView, IntentStatus, ProblemDocument)),
    modifiers(&BearerKeys),
    tags((name = "payments", description = "Create and read payments"),
         (name = "operations", description = "Probes, metrics and this document"))
)]
pub struct ApiDoc;

/// `Authorization: Bearer KEY`, required on the payment routes when the service runs with API
/// keys.
struct BearerKeys;

impl Modify for BearerKeys {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
    }
}

/// A refusal: `application/problem+json` (RFC 9457) with a stable `code`.
#[derive(Debug, ToSchema)]
#[schema(as = Problem)]
#[allow(dead_code)] // A schema only: the answers are built by `Problem`.
pub(crate) struct ProblemDocument {
    /// A URI naming the problem type (`about:blank` when the code says it all).
    #[schema(rename = "type")]
    kind: String,
    /// Short summary of the problem type.
    title: String,
    /// The HTTP status; `"unknown"` on `payment_outcome_unknown` (the status line says 504).
    #[schema(value_type = serde_json::Value)]
    status: u16,
    /// What happened to this request.
    detail: Option<String>,
    /// The stable problem code a client acts on.
    #[schema(inline)]
    code: ProblemCode,
    /// The payment the problem is about (`order_conflict`, `psp_unavailable`,
    /// `payment_outcome_unknown`, `deadline_exceeded` after the intent was written).
    intent_id: Option<String>,
    /// First 8 hex digits of the fingerprint the key was first used with
    /// (`idempotency_key_reused`).
    fingerprint_prefix: Option<String>,
    /// The body member at fault (400 on the body).
    field: Option<String>,
}

/// Every problem code of the service and of the library's catalogue (a test reads them from
/// the sources); the descriptions of each answer say which codes it carries.
#[derive(Debug, ToSchema)]
#[schema(rename_all = "snake_case")]
#[allow(dead_code)] // A schema only.
enum ProblemCode {
    MissingIdempotencyKey,
    InvalidIdempotencyKey,
    InvalidBody,
    MalformedJson,
    DuplicateField,
    UnknownField,
    MissingField,
    InvalidOrderId,
    InvalidAmount,
    InvalidCurrency,
    InvalidGrpcTimeout,
    InvalidGrpcFrame,
    InvalidRequest,
    Unauthenticated,
    PaymentDeclined,
    NotFound,
    PaymentNotFound,
    MethodNotAllowed,
    IdempotencyKeyReused,
    RequestInProgress,
    OrderConflict,
    BodyTooLarge,
    GrpcOnHttpPort,
    RateLimited,
    Overloaded,
    RateLimiterUnavailable,
    OutcomeUnknown,
    Internal,
    PspConflict,
    StoreUnavailable,
    PspUnavailable,
    DeadlineExceeded,
    PaymentOutcomeUnknown,
    FaultInjected,
    CircuitOpen,
    Unavailable,
    Throttled,
    RequestBodyInvalid,
    RequestBodyTimeout,
    ReplayBodyTooLarge,
}

/// `GET /openapi.json`: this document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document of the HTTP API",
               content_type = "application/json"))
)]
pub(crate) async fn openapi_json() -> axum::response::Response {
    use axum::response::IntoResponse;
    // Built once: the document never changes while the process runs.
    static DOCUMENT: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| ApiDoc::openapi().to_json().unwrap_or_default());
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        DOCUMENT.as_str(),
    )
        .into_response()
}
