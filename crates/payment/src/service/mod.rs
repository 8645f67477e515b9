//! The payment service: the payment logic both protocols share, and its HTTP API.
//!
//! The gRPC API is an adapter over the same logic (the crate's `grpc` module); the layer stack
//! in front of both, start-up and graceful shutdown are the crate's `server` module. Neither is
//! imported here: they build on this module, not the reverse.
//!
//! # HTTP contract
//!
//! | request | answers |
//! |---|---|
//! | `POST /v1/payments` + `Idempotency-Key` | `201` payment + `Location`; a replay of a stored answer byte for byte + `Idempotent-Replayed: true` |
//! | `GET /v1/payments/{intent_id}` | `200` payment (this merchant's only), else `404` `payment_not_found` |
//! | `GET /healthz` | `200` while the process runs |
//! | `GET /readyz` | `200` when the store answers a read, else `503` `store_unavailable` (PostgreSQL down or slow included) |
//! | `GET /metrics` | Prometheus text |
//!
//! A payment is `{"intent_id", "order_id", "amount_cents", "currency", "status", "charge_id"}`
//! with `status` one of `running` (outcome not known yet), `succeeded`, `failed`.
//!
//! Errors are `application/problem+json` with a stable `code`:
//!
//! | status | code | when |
//! |---|---|---|
//! | 400 | `missing_idempotency_key`, `invalid_idempotency_key` | key absent, sent twice, or not 1-255 visible ASCII |
//! | 400 | `invalid_body` | the body is not JSON (the idempotency layer fingerprints it first) |
//! | 400 | `malformed_json`, `invalid_body`, `duplicate_field`, `unknown_field`, `missing_field`, `invalid_order_id`, `invalid_amount`, `invalid_currency` | see [`request`] |
//! | 400 | `invalid_grpc_timeout` | malformed `grpc-timeout` (no unit, 9 digits, zero) |
//! | 401 | `unauthenticated` + `WWW-Authenticate: Bearer` | keys configured and no, an unknown, or more than one bearer key |
//! | 402 | `payment_declined` | the PSP refused definitively (a 4xx): intent `failed`, nothing charged. 402 rather than 422: the request was valid, the payment was refused |
//! | 409 | `order_conflict` | the order already has a running or succeeded intent under another key; names `intent_id` |
//! | 409 | `idempotency_key_reused` | the key was used with other parameters; `fingerprint_prefix` |
//! | 409 | `request_in_progress` + `Retry-After` | the same key is still running when this request's budget ends (until then it waits for that answer, which it replays) |
//! | 413 | `body_too_large` | body over 1 MiB (decided on `Content-Length` before reading when present) |
//! | 415 | `grpc_on_http_port` | `Content-Type: application/grpc` on the HTTP port (gRPC has its own address) |
//! | 429 | `rate_limited` + `Retry-After` | the merchant is over `--tenant-rate` / `--tenant-burst` |
//! | 503 | `rate_limiter_unavailable` + `Retry-After` | `--redis` does not answer and `--redis-failure closed` |
//! | 502 | `psp_conflict` | the PSP holds the effect key with other parameters (never expected) |
//! | 503 | `overloaded` + `Retry-After` | the concurrency limit (`--max-inflight`, the adaptive one, or the slow start's ramp after an outage) is reached and no slot frees in time |
//! | 503 | `store_unavailable` + `Retry-After` | the store failed; retry with the same key |
//! | 503 | `psp_unavailable` + `Retry-After`, `intent_id` | the PSP charged nothing and the PSP client gave up (retry budget spent, PSP unreachable or pushing back): retry with the same key |
//! | 504 | `payment_outcome_unknown` + `Retry-After`, `"status": "unknown"`, `intent_id` | a charge was sent and no answer came: retry with the same key (the same effect key is re-sent; the PSP charges once) or `GET` the payment |
//! | 504 | `deadline_exceeded` | the request's own deadline passed (also before the store was reached: the key stays unused), or cannot cover a PSP round trip (checked before any write) |
//!
//! A running payment two minutes old is settled by [`crate::resolver`] (in the background and
//! on `GET`): charged, or its effect key voided at the PSP and the payment failed.
//!
//! # Layout
//! - [`request`]: the `POST /v1/payments` body, validated with one problem code per mistake.
//! - [`trace`]: W3C `traceparent` read, generated and propagated (also at [`crate::trace`]).
//! - [`handlers`]: the route handlers.
//! - [`openapi`]: the OpenAPI document of the HTTP API, built from the handlers' annotations;
//!   `problem_schema`: the schema of a refusal they name.
//! - `payments`: the payment logic the HTTP handlers and the gRPC service share.
//! - [`protocol`]: one protocol per port (`415` for the other one).
//! - `store`: [`PaymentStore`], the idempotency store on SQLite or PostgreSQL.

pub mod answer;
pub mod handlers;
pub mod openapi;
pub(crate) mod payments;
pub(crate) mod phases;
mod problem_schema;
pub mod protocol;
pub mod request;
mod store;

pub use crate::state::AppState;
pub use crate::trace;
pub use store::{PaymentBackend, PaymentStore};
