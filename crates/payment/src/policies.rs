//! The service's method table: the entries a config file's `[policies]` may tune, the table
//! the service runs by when none is given, and the rules any table is held to before the
//! service starts (or reloads) with it.
//!
//! Both [`crate::config`] (validation) and [`crate::server`] (the stack) build on this module;
//! it imports neither.

use std::collections::BTreeMap;
use std::time::Duration;

use backstop::admission::Quota;
use backstop::policy::{Idempotency, MethodPolicies, MethodPolicy, Takeover};
use backstop::status::Code;
use http::Method;

use crate::grpc;

/// The entries of the service's method table, as a policy file names them: a config file's
/// `[policies]` may tune these (and the fallback), and only these.
pub const POLICY_ENTRIES: [&str; 4] = [
    "POST /v1/payments",
    "GET /v1/payments/{intent_id}",
    grpc::CHARGE,
    grpc::GET_CHARGE,
];

/// Why the service cannot run by `policies`, checked before it starts: `Charge` (by either
/// protocol) stays `Keyed`, since the handler moves money only under a claimed key, and keeps
/// resuming a dead run's key under the same effect key (the PSP charges once); every entry
/// [`POLICY_ENTRIES`] names keeps its policy's name, which the metrics, the dashboard and the
/// alerts go by; and every rate class a policy names has a quota in `rate_classes`.
pub fn check_policies(
    policies: &MethodPolicies,
    rate_classes: &BTreeMap<String, Quota>,
) -> Result<(), String> {
    policies.validate().map_err(|e| e.to_string())?;
    let charges = [
        (
            "POST /v1/payments",
            policies.for_route(&Method::POST, "/v1/payments"),
        ),
        (grpc::CHARGE, policies.for_path(grpc::CHARGE)),
    ];
    for (entry, policy) in charges {
        if policy.idempotency() != Idempotency::Keyed {
            return Err(format!(
                "{entry} moves money: it stays keyed (idempotency = \"keyed\")"
            ));
        }
        if policy.takeover() != Takeover::Resume {
            return Err(format!(
                "{entry} resumes a dead run's key under the same effect key: its takeover \
                 stays `resume`"
            ));
        }
    }
    let names = [
        (
            "POST /v1/payments",
            policies.for_route(&Method::POST, "/v1/payments"),
            "Charge",
        ),
        (
            "GET /v1/payments/{intent_id}",
            policies.for_route(&Method::GET, "/v1/payments/{intent_id}"),
            "GetPayment",
        ),
        (grpc::CHARGE, policies.for_path(grpc::CHARGE), "Charge"),
        (
            grpc::GET_CHARGE,
            policies.for_path(grpc::GET_CHARGE),
            "GetCharge",
        ),
    ];
    for (entry, policy, name) in names {
        if policy.name() != name {
            return Err(format!(
                "{entry} is named {name} (its metrics and alerts go by it), not {:?}",
                policy.name()
            ));
        }
    }
    for policy in policies.iter() {
        let class = policy.rate_class();
        if class != backstop::policy::DEFAULT_RATE_CLASS && !rate_classes.contains_key(class) {
            return Err(format!(
                "{} spends rate class `{class}`, which has no quota",
                policy.name()
            ));
        }
    }
    Ok(())
}

/// The service's own table: `Charge` (`POST /v1/payments` and `payment.v1.Payment/Charge`)
/// is `Keyed`, its keys kept `key_ttl`, retried after the answers its error tables call
/// retryable and hedged; the reads (`GET /v1/payments/{intent_id}` and `GetCharge`) are
/// `Safe`; every method's deadline is `timeout` unless the caller's is shorter; anything else
/// is `Unsafe`. `Config::validate` keeps both positive.
pub fn default_policies(timeout: Duration, key_ttl: Duration) -> MethodPolicies {
    let charge = MethodPolicy::builder("Charge", Idempotency::Keyed)
        .timeout(timeout)
        .key_ttl(key_ttl)
        .retryable([
            Code::Unavailable,
            Code::Aborted,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
        ])
        .hedging(true)
        // A run that took over a dead one's key charges its intent again under the same
        // effect key (the PSP charges once), so it may resume; see `service::phases`.
        .takeover(Takeover::Resume)
        .build();
    // Unary and small, so read whole before the gate, like Charge's: a client sending a read
    // slowly holds no permit.
    let read = |name: &str| {
        MethodPolicy::builder(name, Idempotency::Safe)
            .timeout(timeout)
            .buffer_body(true)
            .build()
    };
    MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(Method::POST, "/v1/payments", charge.clone())
        .route(Method::GET, "/v1/payments/{intent_id}", read("GetPayment"))
        .method(grpc::CHARGE, charge)
        .method(grpc::GET_CHARGE, read("GetCharge"))
        .validated()
        .expect("the payment service's policies are valid")
}
