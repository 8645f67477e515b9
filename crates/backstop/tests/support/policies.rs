//! Method tables for the integration tests: the stack's one list of methods.

use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
use http::Method;

/// A table in which each `(method, route)` is `Keyed`, its keys kept for the payments TTL, and
/// everything else `Unsafe`.
pub(crate) fn keyed(routes: &[(Method, &str)]) -> MethodPolicies {
    let keyed = MethodPolicy::builder("Keyed", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .build();
    routes.iter().fold(
        MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build()),
        |table, (method, route)| table.route(method.clone(), route, keyed.clone()),
    )
}

/// A `Safe` method whose body the server reads whole before admitting it.
#[allow(dead_code)] // not every test binary reads bodies first
pub(crate) fn buffered(name: &str) -> MethodPolicy {
    MethodPolicy::builder(name, Idempotency::Safe)
        .buffer_body(true)
        .build()
}
