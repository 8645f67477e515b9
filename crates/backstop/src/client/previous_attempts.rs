//! [`GRPC_PREVIOUS_RPC_ATTEMPTS`], the header a retry and a hedge both set.
//!
//! It sits apart from the retry layer, which sets it on every retry, because the hedge layer
//! below sets it on every hedge too, while the retry layer hands the hedge layer its
//! `HedgeAllowance`. Its public path is `client::retry::GRPC_PREVIOUS_RPC_ATTEMPTS`.

use http::HeaderName;

/// Header carrying, on a retry or a hedge, how many attempts of the call came before it.
pub static GRPC_PREVIOUS_RPC_ATTEMPTS: HeaderName =
    HeaderName::from_static("grpc-previous-rpc-attempts");
