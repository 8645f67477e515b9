//! The schema of a refusal in the OpenAPI document: `Problem` (RFC 9457 problem+json) and the
//! list of its codes. The handlers' annotations and the document both name it; the answers
//! themselves are built by the library's `Problem`.

use utoipa::ToSchema;

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
