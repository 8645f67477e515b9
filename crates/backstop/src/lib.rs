//! backstop makes an RPC's outcome knowable and its retries safe.
//!
//! Deadlines that shrink hop by hop, retries that cannot multiply load, idempotency that turns
//! "unknown" into "exactly one effect", and admission control that says "not now" instead of
//! collapsing. The primitives know nothing of HTTP or gRPC; the [`server`] layers adapt them.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod admission;
pub mod clock;
pub mod contract;
pub mod deadline;
pub mod idempotency;
pub mod observe;
pub mod retry;
pub mod server;
pub mod status;
