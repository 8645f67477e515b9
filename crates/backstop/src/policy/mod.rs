//! One policy per method: what a failure allows, written down once.
//!
//! An IDL describes the success path; it says nothing about what a failure allows. Whether a
//! method may be retried, hedged, or must carry an idempotency key is a property of the method,
//! and when it is left implicit each caller guesses, and some guess wrong: a hedged `Unsafe`
//! call charges a card twice. A [`MethodPolicy`] writes the answers down in one place:
//! idempotency class, timeout, retryable codes, attempts, backoff, hedging, key TTL and rate
//! class. Everything that acts on a call reads it from there: the client stack's retry, hedge
//! and deadline layers, the retry executor, and the server's idempotency and rate-limit
//! configuration; a gRPC service config is read into the same type
//! ([`ServiceConfig::policies`](crate::client::service_config::ServiceConfig::policies)).
//!
//! A service declares its policies once, in a [`MethodPolicies`] table keyed the way gRPC
//! service configs are: by full method path (`/payment.v1.Payment/Charge`), by service
//! (`payment.v1.Payment`), with a fallback for everything else; HTTP routes
//! (`POST /v1/payments/{id}`) take their place beside the gRPC paths. One
//! [`ClientStack`](crate::client::ClientStack) serves a whole channel with it, each call run by
//! its method's policy. [`MethodPolicies::validate`] refuses an unsafe combination before the
//! first request, instead of in production.
//!
//! Every value nobody configured comes from [`defaults`], where each default is defined once
//! (the backoff's beside the backoff, in [`retry`](crate::retry)).
//!
//! ```
//! use std::time::Duration;
//! use backstop::policy::{Idempotency, MethodPolicies, MethodPolicy, KEY_TTL_PAYMENTS};
//! use backstop::status::Code;
//!
//! let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
//!     .method(
//!         "/payment.v1.Payment/Charge",
//!         MethodPolicy::builder("Charge", Idempotency::Keyed)
//!             .timeout(Duration::from_secs(2))
//!             .retryable([Code::Unavailable, Code::DeadlineExceeded])
//!             .hedging(true)
//!             .key_ttl(KEY_TTL_PAYMENTS)
//!             .rate_class("payments")
//!             .build(),
//!     )
//!     .service("payment.v1.Payment", MethodPolicy::builder("Payment", Idempotency::Safe).build())
//!     .validated()
//!     .unwrap();
//! assert!(policies.for_path("/payment.v1.Payment/Charge").requires_key());
//! assert_eq!(policies.for_path("/payment.v1.Payment/GetCharge").name(), "Payment");
//! assert_eq!(policies.for_path("/other.Service/Call").max_attempts(), 1);
//! println!("{policies}");
//!
//! // Hedging a method without idempotency is refused at start-up.
//! let bad = MethodPolicy::builder("Refund", Idempotency::Unsafe).hedging(true).build();
//! assert!(bad.validate().is_err());
//! ```

pub mod defaults;
mod reload;
/// Route patterns (`METHOD /literal/{param}`) the table matches by; the server's metrics take
/// their bounded labels from them too.
#[cfg_attr(not(feature = "server"), allow(dead_code))]
pub(crate) mod route;
pub(crate) mod table;

pub use self::defaults::{
    DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_REPLAY_BODY, DEFAULT_RATE_CLASS, DEFAULT_TIMEOUT,
    KEY_TTL_ASYNC, KEY_TTL_PAYMENTS, KEY_TTL_SYNC, MAX_ATTEMPTS_CAP,
};
pub use self::reload::ReloadablePolicies;
pub use self::table::MethodPolicies;

use std::fmt;
use std::time::Duration;

use crate::retry::Backoff;
use crate::status::{Code, RetryClass};

/// What repeating a call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Idempotency {
    /// No side effect (reads): repeat freely.
    Safe,
    /// A side effect made idempotent by a required idempotency key: repeat with the same key.
    Keyed,
    /// A side effect with no key: a repeat may apply it twice.
    Unsafe,
}

impl Idempotency {
    /// Lower-case name: `safe`, `keyed`, `unsafe`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Idempotency::Safe => "safe",
            Idempotency::Keyed => "keyed",
            Idempotency::Unsafe => "unsafe",
        }
    }
}

impl fmt::Display for Idempotency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a keyed method's server does when a retry finds the key's previous run abandoned (its
/// lease ended while it ran: the holder died or overran), so its effect may or may not have
/// happened. A run that answered a retryable failure said it may run again; this is only
/// about runs that never answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Takeover {
    /// Answer a definite `outcome_unknown` problem (stored: every later retry gets it too)
    /// without running anything. The default: never runs a possibly-done effect twice.
    #[default]
    Refuse,
    /// Run the handler, which learns that it resumes and from which committed phase
    /// (`server::idempotency::Phases`), so it can ask the downstream for the effect instead of
    /// repeating it. For handlers that commit a phase before their effect; their claims are
    /// made durable by that phase's commit (one sync for both).
    Resume,
    /// Run the handler again from the start: only for methods whose effect is safe to repeat
    /// (it is itself idempotent downstream, by the effect key).
    Rerun,
}

impl Takeover {
    /// Lower-case name: `refuse`, `resume`, `rerun`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Takeover::Refuse => "refuse",
            Takeover::Resume => "resume",
            Takeover::Rerun => "rerun",
        }
    }
}

/// The failure behaviour of one method. Build with [`MethodPolicy::builder`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodPolicy {
    name: String,
    idempotency: Idempotency,
    timeout: Duration,
    retryable: Vec<Code>,
    max_attempts: u32,
    backoff: Backoff,
    hedging: bool,
    min_hedge_delay: Duration,
    hedge_delay: Option<Duration>,
    max_hedges: u32,
    key_ttl: Option<Duration>,
    rate_class: String,
    buffer_body: bool,
    takeover: Takeover,
    max_replay_body: Option<usize>,
}

/// Builder for [`MethodPolicy`]; check the result with [`MethodPolicy::validate`].
#[derive(Debug, Clone)]
#[must_use = "call build() to get the policy"]
pub struct MethodPolicyBuilder {
    policy: MethodPolicy,
}

/// A policy (or a table of them) that must not go live.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidPolicy {
    /// A method has an empty name.
    #[error("a method has an empty name")]
    EmptyName,
    /// Two policies for the same path, service or route.
    #[error("{key}: declared twice")]
    Duplicate {
        /// The path, service or route.
        key: String,
    },
    /// Hedging sends a second copy while the first may still apply its effect.
    #[error("method {method}: hedging an unsafe method would apply its effect twice")]
    HedgingUnsafe {
        /// The method.
        method: String,
    },
    /// Hedges per call must be between 1 and one less than [`MAX_ATTEMPTS_CAP`]: the first
    /// attempt and its hedges are attempts too.
    #[error("method {method}: max_hedges {max_hedges} is outside 1..={}", MAX_ATTEMPTS_CAP - 1)]
    MaxHedges {
        /// The method.
        method: String,
        /// The value given.
        max_hedges: u32,
    },
    /// Attempts must be between 1 and [`MAX_ATTEMPTS_CAP`].
    #[error("method {method}: max_attempts {max_attempts} is outside 1..={MAX_ATTEMPTS_CAP}")]
    MaxAttempts {
        /// The method.
        method: String,
        /// The value given.
        max_attempts: u32,
    },
    /// A keyed method needs a TTL for its keys, or the key store grows without bound.
    #[error("method {method}: keyed method without a key TTL")]
    KeyedWithoutTtl {
        /// The method.
        method: String,
    },
    /// A zero timeout would fail every request.
    #[error("method {method}: timeout is zero")]
    ZeroTimeout {
        /// The method.
        method: String,
    },
    /// A code whose retry class is fatal listed as retryable.
    #[error("method {method}: {code} is fatal and cannot be retried")]
    FatalCodeRetryable {
        /// The method.
        method: String,
        /// The code.
        code: Code,
    },
    /// An unsafe method retrying a code after which the effect may already have happened.
    #[error(
        "method {method}: unsafe method retries {code}, after which the effect may have happened"
    )]
    UnsafeRetry {
        /// The method.
        method: String,
        /// The code.
        code: Code,
    },
}

impl MethodPolicy {
    /// Starts a policy for the method `name` (its `method` metric label: keep it to a small
    /// fixed set) with the [`defaults`]: timeout [`DEFAULT_TIMEOUT`]; for `Safe` and `Keyed`
    /// methods [`DEFAULT_MAX_ATTEMPTS`] attempts retrying
    /// [`DEFAULT_RETRYABLE`](defaults::DEFAULT_RETRYABLE), for `Unsafe` ones a single attempt
    /// retrying nothing; the default [`Backoff`]; no hedging; no key TTL; rate class
    /// [`DEFAULT_RATE_CLASS`].
    pub fn builder(name: impl Into<String>, idempotency: Idempotency) -> MethodPolicyBuilder {
        let is_unsafe = idempotency == Idempotency::Unsafe;
        MethodPolicyBuilder {
            policy: MethodPolicy {
                name: name.into(),
                idempotency,
                timeout: DEFAULT_TIMEOUT,
                retryable: if is_unsafe {
                    Vec::new()
                } else {
                    defaults::DEFAULT_RETRYABLE.to_vec()
                },
                max_attempts: if is_unsafe { 1 } else { DEFAULT_MAX_ATTEMPTS },
                backoff: Backoff::default(),
                hedging: false,
                min_hedge_delay: Duration::ZERO,
                hedge_delay: None,
                max_hedges: 1,
                key_ttl: None,
                rate_class: DEFAULT_RATE_CLASS.to_owned(),
                buffer_body: false,
                takeover: Takeover::Refuse,
                max_replay_body: None,
            },
        }
    }

    /// This policy as a builder, to change some of it.
    pub fn to_builder(&self) -> MethodPolicyBuilder {
        MethodPolicyBuilder {
            policy: self.clone(),
        }
    }

    /// The method name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The idempotency class.
    pub fn idempotency(&self) -> Idempotency {
        self.idempotency
    }

    /// Whether requests must carry an idempotency key.
    pub fn requires_key(&self) -> bool {
        self.idempotency == Idempotency::Keyed
    }

    /// Budget of a call whose caller set no deadline (on a server: of a request that arrives
    /// without one).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Codes after which another attempt may be made.
    pub fn retryable(&self) -> &[Code] {
        &self.retryable
    }

    /// Whether `code` is in [`retryable`](Self::retryable).
    pub fn is_retryable(&self, code: Code) -> bool {
        self.retryable.contains(&code)
    }

    /// Most attempts per logical request, first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Delays between attempts when the server gave no pushback.
    pub fn backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// Whether a slow attempt may be hedged (at most [`max_hedges`](Self::max_hedges) copies
    /// per call).
    pub fn hedging(&self) -> bool {
        self.hedging
    }

    /// The earliest a hedge is sent, whatever the destination's p95 says.
    pub fn min_hedge_delay(&self) -> Duration {
        self.min_hedge_delay
    }

    /// The fixed delay after which a slow attempt is hedged (a gRPC `hedgingDelay`), or
    /// `None` to hedge at the destination's rolling p95.
    pub fn hedge_delay(&self) -> Option<Duration> {
        self.hedge_delay
    }

    /// The most hedges a call may send when [hedging](Self::hedging) (1 unless set).
    pub fn max_hedges(&self) -> u32 {
        self.max_hedges
    }

    /// How long idempotency keys are kept.
    pub fn key_ttl(&self) -> Option<Duration> {
        self.key_ttl
    }

    /// What a retry does when it finds the key's previous run abandoned (`Keyed` methods).
    pub fn takeover(&self) -> Takeover {
        self.takeover
    }

    /// The largest answer body of this (`Keyed`) method a server keeps for replay, if the
    /// policy sets one; else the server's default
    /// ([`DEFAULT_MAX_REPLAY_BODY`] unless the server sets its own). See
    /// [`MethodPolicyBuilder::max_replay_body`].
    pub fn max_replay_body(&self) -> Option<usize> {
        self.max_replay_body
    }

    /// The rate-limit class: the server's rate limit spends the caller's tokens in this
    /// class's buckets (`RateLimitLayer::class` in `server::rate_limit`).
    pub fn rate_class(&self) -> &str {
        &self.rate_class
    }

    /// Whether a server reads a request's whole body before admitting it (always for `Keyed`
    /// methods, whose body is fingerprinted): a client sending such a body slowly then holds
    /// no concurrency permit. For unary calls with small bodies; never a streaming method.
    pub fn buffers_body(&self) -> bool {
        self.buffer_body || self.requires_key()
    }

    /// Checks the policy (see [`InvalidPolicy`]).
    pub fn validate(&self) -> Result<(), InvalidPolicy> {
        let method = || self.name.clone();
        if self.name.is_empty() {
            return Err(InvalidPolicy::EmptyName);
        }
        if !(1..=MAX_ATTEMPTS_CAP).contains(&self.max_attempts) {
            return Err(InvalidPolicy::MaxAttempts {
                method: method(),
                max_attempts: self.max_attempts,
            });
        }
        if self.timeout.is_zero() {
            return Err(InvalidPolicy::ZeroTimeout { method: method() });
        }
        if !(1..MAX_ATTEMPTS_CAP).contains(&self.max_hedges) {
            return Err(InvalidPolicy::MaxHedges {
                method: method(),
                max_hedges: self.max_hedges,
            });
        }
        if self.hedging && self.idempotency == Idempotency::Unsafe {
            return Err(InvalidPolicy::HedgingUnsafe { method: method() });
        }
        if self.idempotency == Idempotency::Keyed && self.key_ttl.is_none_or(|t| t.is_zero()) {
            return Err(InvalidPolicy::KeyedWithoutTtl { method: method() });
        }
        for &code in &self.retryable {
            match code.retry_class() {
                RetryClass::Fatal => {
                    return Err(InvalidPolicy::FatalCodeRetryable {
                        method: method(),
                        code,
                    });
                }
                RetryClass::Retryable | RetryClass::Timeout
                    if self.idempotency == Idempotency::Unsafe =>
                {
                    return Err(InvalidPolicy::UnsafeRetry {
                        method: method(),
                        code,
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }
}

impl MethodPolicyBuilder {
    /// Budget of a call whose caller set no deadline.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.policy.timeout = timeout;
        self
    }

    /// Codes after which another attempt may be made (replaces the default).
    pub fn retryable(mut self, codes: impl IntoIterator<Item = Code>) -> Self {
        self.policy.retryable = codes.into_iter().collect();
        self.policy.retryable.sort();
        self.policy.retryable.dedup();
        self
    }

    /// Most attempts per logical request (1 to [`MAX_ATTEMPTS_CAP`]).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.policy.max_attempts = attempts;
        self
    }

    /// The backoff between attempts.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.policy.backoff = backoff;
        self
    }

    /// Allows hedged attempts (`Safe` and `Keyed` methods only).
    pub fn hedging(mut self, allowed: bool) -> Self {
        self.policy.hedging = allowed;
        self
    }

    /// Never hedges sooner than `delay`, whatever the p95.
    pub fn min_hedge_delay(mut self, delay: Duration) -> Self {
        self.policy.min_hedge_delay = delay;
        self
    }

    /// Hedges a slow attempt after exactly `delay` (a gRPC `hedgingDelay`) instead of at the
    /// destination's rolling p95: from the first call, without waiting for latency samples.
    pub fn hedge_delay(mut self, delay: Duration) -> Self {
        self.policy.hedge_delay = Some(delay);
        self
    }

    /// At most `hedges` hedges per call, each `hedge_delay` (or the p95) after the one
    /// before (default 1; at most `MAX_ATTEMPTS_CAP - 1`, checked by
    /// [`validate`](MethodPolicy::validate)). A gRPC `hedgingPolicy.maxAttempts` of N is
    /// N - 1 hedges. Each is paid for like a retry, so the budget (or gRPC's retry
    /// throttling) still bounds what they add to the destination's load.
    pub fn max_hedges(mut self, hedges: u32) -> Self {
        self.policy.max_hedges = hedges;
        self
    }

    /// How long idempotency keys are kept (required for `Keyed`).
    pub fn key_ttl(mut self, ttl: Duration) -> Self {
        self.policy.key_ttl = Some(ttl);
        self
    }

    /// What a retry does when it finds the key's previous run abandoned (default
    /// [`Takeover::Refuse`]; `Keyed` methods only).
    pub fn takeover(mut self, takeover: Takeover) -> Self {
        self.policy.takeover = takeover;
        self
    }

    /// The largest answer body of this `Keyed` method a server keeps for replay (default: the
    /// server's, [`DEFAULT_MAX_REPLAY_BODY`] unless it sets its own). An answer within it is
    /// stored whole and every retry with the key gets it byte for byte. A larger one is
    /// streamed to its caller as it comes, never held whole, and its record keeps its status
    /// and headers without the body: a retry with the key gets that status with a
    /// `replay_body_too_large` problem saying the request was carried out, and the handler
    /// does not run again. Zero keeps no body at all.
    pub fn max_replay_body(mut self, bytes: usize) -> Self {
        self.policy.max_replay_body = Some(bytes);
        self
    }

    /// The rate-limit class (default [`DEFAULT_RATE_CLASS`]): a server may give each class
    /// its own quota, so that, say, status polls do not spend the tokens charges need.
    pub fn rate_class(mut self, class: impl Into<String>) -> Self {
        self.policy.rate_class = class.into();
        self
    }

    /// Has a server read the whole request body before admission (default: only for `Keyed`
    /// methods; see [`MethodPolicy::buffers_body`]). Within the server's body and message
    /// caps; for unary calls only.
    pub fn buffer_body(mut self, buffer: bool) -> Self {
        self.policy.buffer_body = buffer;
        self
    }

    /// The policy (not yet validated).
    pub fn build(self) -> MethodPolicy {
        self.policy
    }
}

/// A duration the way an operator writes it: `500ms`, `2s`, `24h`, `7d`.
fn human(d: Duration) -> String {
    const UNITS: [(u64, &str); 4] = [(86_400, "d"), (3_600, "h"), (60, "min"), (1, "s")];
    if d.subsec_nanos() == 0 && !d.is_zero() {
        let secs = d.as_secs();
        for (size, unit) in UNITS {
            if secs % size == 0 {
                return format!("{}{unit}", secs / size);
            }
        }
    }
    if d.subsec_nanos() % 1_000_000 == 0 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyed(name: &str) -> MethodPolicyBuilder {
        MethodPolicy::builder(name, Idempotency::Keyed).key_ttl(KEY_TTL_SYNC)
    }

    fn err(policy: MethodPolicy) -> InvalidPolicy {
        policy.validate().unwrap_err()
    }

    #[test]
    fn defaults_are_valid() {
        for idem in [Idempotency::Safe, Idempotency::Unsafe] {
            let c = MethodPolicy::builder("M", idem).build();
            assert_eq!(c.validate(), Ok(()));
            assert_eq!(c.timeout(), DEFAULT_TIMEOUT);
            assert_eq!(c.rate_class(), "default");
            assert!(!c.hedging());
        }
        let safe = MethodPolicy::builder("Get", Idempotency::Safe).build();
        assert_eq!(safe.max_attempts(), DEFAULT_MAX_ATTEMPTS);
        assert!(safe.is_retryable(Code::Unavailable));
        let unsafe_ = MethodPolicy::builder("Post", Idempotency::Unsafe).build();
        assert_eq!(unsafe_.max_attempts(), 1);
        assert!(unsafe_.retryable().is_empty());
        assert_eq!(keyed("Charge").build().validate(), Ok(()));
    }

    #[test]
    fn hedges_per_call_stay_under_the_attempts_cap() {
        for n in [0, MAX_ATTEMPTS_CAP, 100] {
            let p = MethodPolicy::builder("Get", Idempotency::Safe)
                .hedging(true)
                .max_hedges(n)
                .build();
            assert_eq!(
                p.validate(),
                Err(InvalidPolicy::MaxHedges {
                    method: "Get".into(),
                    max_hedges: n
                })
            );
        }
        for n in 1..MAX_ATTEMPTS_CAP {
            let p = MethodPolicy::builder("Get", Idempotency::Safe)
                .hedging(true)
                .max_hedges(n)
                .build();
            assert_eq!((p.validate(), p.max_hedges()), (Ok(()), n));
        }
    }

    #[test]
    fn hedging_an_unsafe_method_is_an_error() {
        let c = MethodPolicy::builder("Refund", Idempotency::Unsafe)
            .hedging(true)
            .build();
        assert_eq!(
            err(c),
            InvalidPolicy::HedgingUnsafe {
                method: "Refund".into()
            }
        );
        // Safe and keyed methods may hedge.
        assert!(
            MethodPolicy::builder("Get", Idempotency::Safe)
                .hedging(true)
                .build()
                .validate()
                .is_ok()
        );
        assert!(keyed("Charge").hedging(true).build().validate().is_ok());
    }

    #[test]
    fn max_attempts_must_be_one_to_five() {
        for n in [0, 6, u32::MAX] {
            let c = MethodPolicy::builder("Get", Idempotency::Safe)
                .max_attempts(n)
                .build();
            assert_eq!(
                err(c),
                InvalidPolicy::MaxAttempts {
                    method: "Get".into(),
                    max_attempts: n
                }
            );
        }
        for n in 1..=5 {
            let c = MethodPolicy::builder("Get", Idempotency::Safe)
                .max_attempts(n)
                .build();
            assert_eq!(c.validate(), Ok(()));
        }
    }

    #[test]
    fn keyed_without_ttl_is_an_error() {
        let c = MethodPolicy::builder("Charge", Idempotency::Keyed).build();
        assert_eq!(
            err(c),
            InvalidPolicy::KeyedWithoutTtl {
                method: "Charge".into()
            }
        );
        let zero = keyed("Charge").key_ttl(Duration::ZERO).build();
        assert!(matches!(err(zero), InvalidPolicy::KeyedWithoutTtl { .. }));
    }

    #[test]
    fn empty_name_and_zero_timeout_are_errors() {
        assert_eq!(
            err(MethodPolicy::builder("", Idempotency::Safe).build()),
            InvalidPolicy::EmptyName
        );
        let c = MethodPolicy::builder("Get", Idempotency::Safe)
            .timeout(Duration::ZERO)
            .build();
        assert_eq!(
            err(c),
            InvalidPolicy::ZeroTimeout {
                method: "Get".into()
            }
        );
    }

    #[test]
    fn fatal_codes_cannot_be_retryable() {
        let c = MethodPolicy::builder("Get", Idempotency::Safe)
            .retryable([Code::Unavailable, Code::InvalidArgument])
            .build();
        assert_eq!(
            err(c),
            InvalidPolicy::FatalCodeRetryable {
                method: "Get".into(),
                code: Code::InvalidArgument
            }
        );
    }

    #[test]
    fn unsafe_methods_cannot_retry_after_a_possible_effect() {
        for code in [Code::Unavailable, Code::DeadlineExceeded] {
            let c = MethodPolicy::builder("Post", Idempotency::Unsafe)
                .retryable([code])
                .max_attempts(2)
                .build();
            assert_eq!(
                err(c),
                InvalidPolicy::UnsafeRetry {
                    method: "Post".into(),
                    code
                }
            );
        }
        // Pushback codes mean "not now": the request was refused, not run.
        let c = MethodPolicy::builder("Post", Idempotency::Unsafe)
            .retryable([Code::ResourceExhausted])
            .max_attempts(2)
            .build();
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn retryable_codes_are_sorted_and_deduplicated() {
        let c = MethodPolicy::builder("Get", Idempotency::Safe)
            .retryable([Code::Unavailable, Code::Aborted, Code::Unavailable])
            .build();
        assert_eq!(c.retryable(), [Code::Aborted, Code::Unavailable]);
    }

    #[test]
    fn human_durations() {
        let cases = [
            (Duration::ZERO, "0ms"),
            (Duration::from_micros(1_500), "1500us"),
            (Duration::from_millis(250), "250ms"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(120), "2min"),
            (KEY_TTL_SYNC, "1d"),
            (Duration::from_secs(3 * 3_600), "3h"),
            (KEY_TTL_SYNC * 2, "2d"),
            (KEY_TTL_ASYNC, "30d"),
        ];
        for (d, want) in cases {
            assert_eq!(human(d), want);
        }
    }
}
