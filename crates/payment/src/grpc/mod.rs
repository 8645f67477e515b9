//! The gRPC payment service: `payment.v1.Payment` (`proto/payment/v1/payment.proto`).
//!
//! [`PaymentService`] implements the generated [`proto::payment_server::Payment`] trait over the
//! same payment logic as the HTTP handlers, and [`routes`] puts it on tonic's own router, which
//! the server stack wraps as it is, with no HTTP router in between: the deadline from
//! `grpc-timeout`, metrics, authentication (`authorization: Bearer` metadata), the rate limit,
//! the gate and idempotency (metadata `idempotency-key`), each answering a gRPC caller with a
//! gRPC status.
//!
//! Beside the stack, on the same port: `grpc.health.v1.Health` and server reflection
//! ([`health`]).
//!
//! # Status codes
//!
//! | outcome | code |
//! |---|---|
//! | charged (or replayed: `idempotent-replayed: true`) | `OK`, `status` `succeeded` |
//! | the PSP declined; nothing charged | `OK`, `status` `failed` |
//! | missing, invalid or repeated key, invalid field, malformed `grpc-timeout`, a message that does not decode (the key stays unused) | `INVALID_ARGUMENT` |
//! | key reused with other parameters | `FAILED_PRECONDITION` |
//! | same key still running when the call's deadline nears (until then it waits for that answer) | `ABORTED` + `grpc-retry-pushback-ms` |
//! | same order, other key | `ALREADY_EXISTS` (names the intent) |
//! | merchant over quota | `RESOURCE_EXHAUSTED` + pushback |
//! | message over 4 MiB (decided from the length prefix) | `RESOURCE_EXHAUSTED` |
//! | server overloaded, store unavailable | `UNAVAILABLE` + pushback |
//! | the PSP charged nothing and the PSP client gave up | `UNAVAILABLE` + pushback, "the payment provider charged nothing ..." |
//! | a charge was sent and its outcome is unknown | `UNAVAILABLE` + pushback, "payment outcome unknown ... safe to retry with the same idempotency-key" |
//! | the request's deadline passed, or cannot cover a PSP round trip | `DEADLINE_EXCEEDED` |
//! | unknown bearer key | `UNAUTHENTICATED` |
//! | no such payment (`GetCharge`) | `NOT_FOUND` |

pub mod codec;
pub mod health;
pub mod proto;
pub(crate) mod server;
mod service;

pub use self::service::PaymentService;

use backstop::server::grpc::{DEFAULT_MAX_MESSAGE, UnaryLimitLayer};
use tonic::service::Routes;

use crate::state::AppState;

/// Path of `Charge`.
pub const CHARGE: &str = "/payment.v1.Payment/Charge";

/// Path of `GetCharge`.
pub const GET_CHARGE: &str = "/payment.v1.Payment/GetCharge";

/// The gRPC routes on tonic's own router, without the server stack: the caller puts it in
/// front (see [`build_routers`](crate::server::build_routers)). Unknown methods are
/// `UNIMPLEMENTED`.
pub fn routes(state: AppState) -> Routes {
    let payments = proto::payment_server::PaymentServer::new(PaymentService::new(state))
        .max_decoding_message_size(DEFAULT_MAX_MESSAGE);
    Routes::new(payments)
}

/// The layer that goes right in front of [`routes`]: both methods are unary, so the message
/// cap is decided from the length prefix, before tonic's decoder (which would answer
/// `OUT_OF_RANGE`, not `RESOURCE_EXHAUSTED`).
pub fn unary_limit() -> UnaryLimitLayer {
    UnaryLimitLayer::new(DEFAULT_MAX_MESSAGE)
}
