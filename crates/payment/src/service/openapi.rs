//! The HTTP API as an OpenAPI 3.1 document, served at `GET /openapi.json`.
//!
//! utoipa builds it from the handlers' own annotations and wire types ([`PaymentRequest`],
//! the payment view, [`IntentStatus`]), so a field or route that changes changes the
//! document. Refusals are one schema, `Problem` (RFC 9457 problem+json, declared in
//! `problem_schema` beside the handlers that name it), whose `code` lists every problem code
//! the service answers; a test reads the codes from the sources and checks each is listed, so
//! the list cannot fall behind.

use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::handlers;
use super::problem_schema::ProblemDocument;
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
