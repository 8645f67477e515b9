//! Retry at one layer: a request that arrived as a retry is served without the calls it makes
//! retrying again.
//!
//! Every hop of a call chain that retries on its own multiplies: three hops of three attempts
//! each send up to 27 attempts to the deepest one for one click. The chapter's rule is that
//! retries happen at one layer. A backstop server reads how many attempts came before a
//! request (`grpc-previous-rpc-attempts`, which backstop clients and gRPC set on retries and
//! hedges) and serves it with that count as [`previous_attempts`]; the client stack, called
//! from the handler, then sends each call once: no retry (the call stops with
//! [`StopReason::RetriedAbove`](super::StopReason::RetriedAbove)) and no hedge. The layer
//! above is already retrying; its next attempt comes back through this one.
//!
//! A destination that must keep its own retries (a call that cannot be repeated from above,
//! say) turns this off with
//! [`Destination::retry_at_one_layer(false)`](crate::client::Destination::retry_at_one_layer).
//!
//! ```
//! use backstop::retry::inbound;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! assert_eq!(inbound::previous_attempts(), 0, "outside a request: a first attempt");
//! let served = inbound::scope(2, async { inbound::previous_attempts() }).await;
//! assert_eq!(served, 2);
//! # }
//! ```

use std::future::Future;

/// `grpc-previous-rpc-attempts`, read by the server stack.
#[cfg_attr(not(feature = "server"), allow(dead_code))]
pub(crate) static PREVIOUS_ATTEMPTS: http::HeaderName =
    http::HeaderName::from_static("grpc-previous-rpc-attempts");

tokio::task_local! {
    static PREVIOUS: u32;
}

/// How many attempts came before the request the current task serves, as the server stack
/// read them (`grpc-previous-rpc-attempts`); 0 for a first attempt, and outside any request.
pub fn previous_attempts() -> u32 {
    PREVIOUS.try_with(|n| *n).unwrap_or(0)
}

/// Runs `fut` as the work of a request that `previous` attempts came before: for a server
/// that is not behind the server stack (which does this itself), or work handed to a task of
/// its own ([`deadline::carry`](crate::deadline::carry) carries it with the deadline).
pub async fn scope<F: Future>(previous: u32, fut: F) -> F::Output {
    PREVIOUS.scope(previous, fut).await
}

/// Runs `f` with `previous` as the current count: for a `poll` that scopes its inner future
/// without boxing it.
#[cfg_attr(not(feature = "server"), allow(dead_code))]
pub(crate) fn enter<R>(previous: u32, f: impl FnOnce() -> R) -> R {
    PREVIOUS.sync_scope(previous, f)
}

/// The count a `grpc-previous-rpc-attempts` value gives: its digits, else 0 (the header is a
/// hint; a value that is not a count is ignored, as gRPC does).
#[cfg_attr(not(feature = "server"), allow(dead_code))]
pub(crate) fn parse(value: Option<&http::HeaderValue>) -> u32 {
    value
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 9 && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_count_is_read() {
        let v = |s: &str| http::HeaderValue::from_str(s).unwrap();
        assert_eq!(parse(None), 0);
        assert_eq!(parse(Some(&v("2"))), 2);
        for bad in ["", "-1", "1.0", " 1", "x", "9999999999"] {
            assert_eq!(parse(Some(&v(bad))), 0, "{bad:?}");
        }
    }
}
