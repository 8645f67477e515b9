//! gRPC service config: bring `retryPolicy`, `hedgingPolicy` and `retryThrottling` as they are.
//!
//! Teams that already run gRPC keep their retry settings in a service config (gRPC proposal
//! A6). [`ServiceConfig::from_json`] reads one and [`ServiceConfig::policies`] turns it into a
//! [`MethodPolicies`] table, the one per-method policy type every client layer runs by, keyed
//! the way the config names its methods (method, service, or every call). So the same JSON
//! drives the same mechanisms:
//!
//! | service config | backstop |
//! |---|---|
//! | `name` (service and method, service, or empty) | a [`MethodPolicies`] entry for the method path, the service, or the fallback |
//! | `retryPolicy.maxAttempts` (values above 5 are read as 5, as gRPC does) | [`MethodPolicy::max_attempts`] |
//! | `initialBackoff`, `maxBackoff`, `backoffMultiplier` | [`Backoff`] base, cap and multiplier, full jitter (gRPC's own) |
//! | `retryableStatusCodes` (names or numbers) | [`MethodPolicy::retryable`] |
//! | `hedgingPolicy.hedgingDelay` | [`MethodPolicy::hedge_delay`]: a slow attempt is hedged after exactly this delay (`0s` when absent), from the first call, not at the p95 |
//! | `hedgingPolicy.maxAttempts` (values above 5 are read as 5, as gRPC does) | [`MethodPolicy::max_hedges`], one less: up to that many hedges, each `hedgingDelay` after the one before, while no final answer has come, each paid for from the budget or held back by the retry throttling (see [`HedgeSpec`]) |
//! | `retryThrottling {maxTokens, tokenRatio}` | gRPC's token bucket, [`RetryThrottle`] from [`ServiceConfig::retry_throttle`], for [`Throttling::Grpc`]; or backstop's [`RetryBudget`] from [`ServiceConfig::budget`] (ratio `tokenRatio`, burst `maxTokens / 2`), for [`Throttling::Budget`] |
//! | `timeout` | [`MethodPolicy::timeout`]: a cap on the call's deadline. The stack sends the earliest of the caller's deadline, the one inherited from the request being served, and this timeout, as gRPC takes the earlier of the caller's deadline and the config's `timeout`; [`DEFAULT_TIMEOUT`](crate::policy::DEFAULT_TIMEOUT) when absent |
//!
//! `retryThrottling` is read two ways because the two limits differ (see [`Throttling`]):
//! gRPC's bucket stops retries once failures have taken half its tokens and lets them through
//! again as successes come back, so a client using it sends the attempts a gRPC client with
//! the same config would; backstop's budget bounds retries to a share of the logical requests,
//! so a destination down for everyone never sees more than `1 + tokenRatio` times its load.
//! For gRPC's attempt counts, also leave out what gRPC does not have: the destination's storm
//! alarm, circuit breaker and attempt limit ([`Destination::storm_alarm`],
//! [`Destination::breaker`], [`Destination::attempt_limit`] with `None`).
//!
//! Hedging as the config asks needs no warm-up: with a `hedgingDelay` the hedge goes out after
//! that delay from the first call on. (A policy that hedges at the destination's p95 instead
//! sends none until [`HedgePolicy::MIN_SAMPLES`](crate::hedge::HedgePolicy::MIN_SAMPLES)
//! answers have been measured.) A hedge of a `Keyed` method, with the policy applied through
//! [`MethodConfig::apply`], carries the first attempt's key: against a store shared by the
//! server's instances it waits on the first attempt's claim, so it cannot cut a slow tail that
//! starts after the claim was taken (see [`client::hedge`](crate::client::hedge)).
//!
//! A method a config names is taken to be safe to repeat ([`Idempotency::Safe`]), as gRPC
//! assumes of every method it retries or hedges; one without a `retryPolicy` is sent once.
//! A method the config does not name at all falls back to a policy that sends it once. To keep
//! a method's own idempotency class (a `Keyed` charge, an `Unsafe` refund) and take only the
//! config's numbers, apply its entry to the method's policy with [`MethodConfig::apply`].
//!
//! Invalid configs are refused with an error naming the field (a missing `maxAttempts`, a
//! `"1.5"` without its `s`, `retryPolicy` and `hedgingPolicy` on the same method, a fatal code
//! listed as retryable, ...), never silently half-applied.
//!
//! ```
//! use std::time::Duration;
//! use backstop::client::service_config::ServiceConfig;
//!
//! let config = ServiceConfig::from_json(r#"{
//!   "methodConfig": [{
//!     "name": [{"service": "payment.v1.Payment", "method": "GetCharge"}],
//!     "timeout": "2s",
//!     "retryPolicy": {
//!       "maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1s",
//!       "backoffMultiplier": 1.5, "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]
//!     }
//!   }],
//!   "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
//! }"#).unwrap();
//! let policies = config.policies().unwrap();
//! let get = policies.for_path("/payment.v1.Payment/GetCharge");
//! assert_eq!(get.timeout(), Duration::from_secs(2));
//! assert_eq!(get.max_attempts(), 4);
//! assert_eq!(get.backoff().multiplier(), 1.5);
//! // Not named: sent once.
//! assert_eq!(policies.for_path("/payment.v1.Payment/Charge").max_attempts(), 1);
//! assert_eq!(config.budget().unwrap().burst(), 5);
//! assert_eq!(config.retry_throttle().unwrap().max_tokens(), 10);
//! ```

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

#[cfg(doc)]
use super::{Destination, Throttling};
use crate::policy::{
    Idempotency, MAX_ATTEMPTS_CAP, MethodPolicies, MethodPolicy, MethodPolicyBuilder,
};
use crate::retry::{Backoff, BackoffError, Jitter, RetryBudget, RetryThrottle};
use crate::status::Code;

/// Largest `maxTokens` gRPC accepts.
const MAX_TOKENS: u32 = crate::retry::retry_throttle::MAX_TOKENS;
/// Longest service config read, in bytes.
pub const MAX_CONFIG_LEN: usize = 1024 * 1024;

/// A service config that cannot be used; `field` names where, as a JSON path.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON, or a field of the wrong JSON type.
    #[error("service config is not valid JSON for its schema: {0}")]
    Json(String),
    /// Longer than [`MAX_CONFIG_LEN`].
    #[error("service config is {len} bytes, at most {MAX_CONFIG_LEN} are read")]
    TooLong {
        /// Its length.
        len: usize,
    },
    /// A required field is missing.
    #[error("{field} is required")]
    Missing {
        /// The field.
        field: String,
    },
    /// A field's value is outside what the spec allows.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field.
        field: String,
        /// What is wrong.
        reason: String,
    },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Which calls a method config applies to (gRPC `name`): a method, a whole service (no
/// method), or every call (neither).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MethodName {
    /// The fully qualified service, e.g. `payment.v1.Payment`.
    pub service: Option<String>,
    /// The method, e.g. `Charge`.
    pub method: Option<String>,
}

/// A validated `retryPolicy`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetrySpec {
    /// Attempts, first included, 2 to 5.
    pub max_attempts: u32,
    /// Backoff between attempts.
    pub backoff: Backoff,
    /// Codes to retry.
    pub retryable: Vec<Code>,
}

/// A validated `hedgingPolicy`.
///
/// The call's first attempt and `max_attempts - 1` hedges, sent `delay` apart while no final
/// answer has come (a failure that leaves the race open sends the next hedge at once, as gRPC
/// does). Each hedge is paid for from the destination's retry budget, or held back by its gRPC
/// retry throttling, so more hedges per call do not mean more load than the budget allows: a
/// slow destination is usually slow because it is loaded, and copies add to that load what
/// they save in latency.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HedgeSpec {
    /// Attempts, the hedges included: 2 to 5 (values above 5 are read as 5, as gRPC does).
    pub max_attempts: u32,
    /// How long after an attempt its hedge is sent, if no answer came.
    pub delay: Duration,
    /// Codes after which the other attempt is still awaited.
    pub non_fatal: Vec<Code>,
}

/// One `methodConfig` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodConfig {
    /// The calls it applies to.
    pub names: Vec<MethodName>,
    /// The longest a call may take: caps the caller's deadline.
    pub timeout: Option<Duration>,
    /// Retries, if configured.
    pub retry: Option<RetrySpec>,
    /// Hedging, if configured.
    pub hedging: Option<HedgeSpec>,
}

/// A parsed and validated gRPC service config.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceConfig {
    /// The method configs, in order.
    pub methods: Vec<MethodConfig>,
    /// `retryThrottling` as (maxTokens, tokenRatio), if present.
    pub throttling: Option<(u32, f64)>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawConfig {
    #[serde(default)]
    method_config: Vec<RawMethod>,
    retry_throttling: Option<RawThrottling>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawMethod {
    #[serde(default)]
    name: Vec<RawName>,
    timeout: Option<String>,
    retry_policy: Option<RawRetry>,
    hedging_policy: Option<RawHedge>,
}

#[derive(Deserialize)]
struct RawName {
    service: Option<String>,
    method: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawRetry {
    max_attempts: Option<Value>,
    initial_backoff: Option<String>,
    max_backoff: Option<String>,
    backoff_multiplier: Option<f64>,
    retryable_status_codes: Option<Vec<Value>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawHedge {
    max_attempts: Option<Value>,
    hedging_delay: Option<String>,
    #[serde(default)]
    non_fatal_status_codes: Vec<Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawThrottling {
    max_tokens: Option<Value>,
    token_ratio: Option<f64>,
}

impl ServiceConfig {
    /// Parses and validates a service config.
    pub fn from_json(json: &str) -> Result<Self, ConfigError> {
        if json.len() > MAX_CONFIG_LEN {
            return Err(ConfigError::TooLong { len: json.len() });
        }
        let raw: RawConfig =
            serde_json::from_str(json).map_err(|e| ConfigError::Json(e.to_string()))?;
        let methods = raw
            .method_config
            .into_iter()
            .enumerate()
            .map(|(i, m)| method(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        let throttling = raw.retry_throttling.map(throttling).transpose()?;
        Ok(Self {
            methods,
            throttling,
        })
    }

    /// The config for `service`/`method`: an exact match first, then the service's, then the
    /// default (an empty name), as gRPC looks them up.
    pub fn method(&self, service: &str, method: &str) -> Option<&MethodConfig> {
        let find = |pred: &dyn Fn(&MethodName) -> bool| {
            self.methods.iter().find(|m| m.names.iter().any(pred))
        };
        find(&|n| n.service.as_deref() == Some(service) && n.method.as_deref() == Some(method))
            .or_else(|| find(&|n| n.service.as_deref() == Some(service) && n.method.is_none()))
            .or_else(|| find(&|n| n.service.is_none() && n.method.is_none()))
    }

    /// The policies of the config's methods as a table: an entry per method name (`/service/
    /// method`), per service, and the config's default entry (an empty name) as the
    /// fallback; without one, a call the config does not name is sent once
    /// (`Unsafe`, labelled `other`). Each policy is labelled with its method's name, its
    /// service's for a service entry. Refused when a policy is invalid (e.g. a fatal code
    /// listed as retryable) or a name appears twice.
    pub fn policies(&self) -> Result<MethodPolicies, ConfigError> {
        let mut table =
            MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build());
        for (i, config) in self.methods.iter().enumerate() {
            for name in &config.names {
                table = match (&name.service, &name.method) {
                    (Some(service), Some(method)) => {
                        table.method(format!("/{service}/{method}"), config.policy(method))
                    }
                    (Some(service), None) => table.service(service, config.policy(service)),
                    _ => table.fallback(config.policy("other")),
                };
            }
            if let Err(e) = table.validate() {
                return Err(invalid(format!("methodConfig[{i}]"), e.to_string()));
            }
        }
        Ok(table)
    }

    /// `retryThrottling` read as backstop's retry budget ([`Throttling::Budget`]): ratio
    /// `tokenRatio`, burst `maxTokens / 2`; the default budget (ratio 0.1, burst 20) when it
    /// is absent.
    pub fn budget(&self) -> Result<RetryBudget, ConfigError> {
        match self.throttling {
            None => Ok(RetryBudget::default()),
            Some((max_tokens, ratio)) => RetryBudget::new(ratio, max_tokens.div_ceil(2))
                .map_err(|e| invalid("retryThrottling.tokenRatio", e.to_string())),
        }
    }

    /// `retryThrottling` read as gRPC reads it ([`Throttling::Grpc`]): a token bucket of
    /// `maxTokens` that every failed attempt with a retried code drains by one and every
    /// success refills by `tokenRatio`, retries and hedges sent only while more than half of
    /// it is left. `None` when the config has no `retryThrottling` (gRPC then limits retries
    /// by `maxAttempts` alone).
    pub fn retry_throttle(&self) -> Option<RetryThrottle> {
        self.throttling.map(|(max_tokens, ratio)| {
            RetryThrottle::new(max_tokens, ratio)
                .expect("retryThrottling is validated by RetryThrottle::new when read")
        })
    }
}

impl MethodConfig {
    /// `policy` with what this entry sets: its `timeout`; its `retryPolicy`'s attempts,
    /// backoff and retryable codes; its `hedgingPolicy`'s hedges, each after exactly its
    /// `hedgingDelay`. The idempotency
    /// class stays the policy's, so [`MethodPolicy::validate`] still refuses hedging or
    /// retrying an `Unsafe` method.
    pub fn apply(&self, mut policy: MethodPolicyBuilder) -> MethodPolicyBuilder {
        if let Some(timeout) = self.timeout {
            policy = policy.timeout(timeout);
        }
        if let Some(retry) = &self.retry {
            policy = policy
                .max_attempts(retry.max_attempts)
                .backoff(retry.backoff)
                .retryable(retry.retryable.iter().copied());
        }
        if let Some(hedge) = &self.hedging {
            policy = policy
                .hedging(true)
                .hedge_delay(hedge.delay)
                .max_hedges(hedge.max_attempts - 1);
        }
        policy
    }

    /// The policy of the calls this entry names, labelled `name`: `Safe`, as gRPC assumes of
    /// the methods it retries, with a single attempt unless a `retryPolicy` says more.
    fn policy(&self, name: &str) -> MethodPolicy {
        let base = MethodPolicy::builder(name, Idempotency::Safe)
            .max_attempts(1)
            .retryable([]);
        self.apply(base).build()
    }
}

fn method(i: usize, raw: RawMethod) -> Result<MethodConfig, ConfigError> {
    let at = |field: &str| format!("methodConfig[{i}].{field}");
    let mut names = Vec::with_capacity(raw.name.len());
    for (j, n) in raw.name.into_iter().enumerate() {
        if n.method.is_some() && n.service.as_deref().is_none_or(str::is_empty) {
            return Err(invalid(
                at(&format!("name[{j}]")),
                "a method name needs its service",
            ));
        }
        names.push(MethodName {
            service: n.service.filter(|s| !s.is_empty()),
            method: n.method.filter(|m| !m.is_empty()),
        });
    }
    let timeout = raw
        .timeout
        .as_deref()
        .map(|t| parse_duration(t).map_err(|reason| invalid(at("timeout"), reason)))
        .transpose()?;
    if raw.retry_policy.is_some() && raw.hedging_policy.is_some() {
        return Err(invalid(
            at("retryPolicy"),
            "retryPolicy and hedgingPolicy cannot both be set",
        ));
    }
    let retry = raw
        .retry_policy
        .map(|r| retry(&at("retryPolicy"), r))
        .transpose()?;
    let hedging = raw
        .hedging_policy
        .map(|h| hedge(&at("hedgingPolicy"), h))
        .transpose()?;
    Ok(MethodConfig {
        names,
        timeout,
        retry,
        hedging,
    })
}

fn retry(at: &str, raw: RawRetry) -> Result<RetrySpec, ConfigError> {
    let field = |f: &str| format!("{at}.{f}");
    let missing = |f: &str| ConfigError::Missing { field: field(f) };
    let max_attempts = attempts(&field("maxAttempts"), raw.max_attempts.as_ref())?;
    let initial = raw
        .initial_backoff
        .as_deref()
        .ok_or_else(|| missing("initialBackoff"))?;
    let initial = positive(&field("initialBackoff"), initial)?;
    let max = raw
        .max_backoff
        .as_deref()
        .ok_or_else(|| missing("maxBackoff"))?;
    let max = positive(&field("maxBackoff"), max)?;
    let multiplier = raw
        .backoff_multiplier
        .ok_or_else(|| missing("backoffMultiplier"))?;
    if !(multiplier > 0.0 && multiplier.is_finite()) {
        return Err(invalid(
            field("backoffMultiplier"),
            "must be greater than 0",
        ));
    }
    let codes = raw
        .retryable_status_codes
        .ok_or_else(|| missing("retryableStatusCodes"))?;
    if codes.is_empty() {
        return Err(invalid(field("retryableStatusCodes"), "must not be empty"));
    }
    let retryable = status_codes(&field("retryableStatusCodes"), &codes)?;
    let backoff = Backoff::new(initial, max.max(initial), Jitter::Full, Duration::ZERO)
        .map_err(|e: BackoffError| invalid(field("initialBackoff"), e.to_string()))?
        .with_multiplier(multiplier)
        .map_err(|e| invalid(field("backoffMultiplier"), e.to_string()))?;
    Ok(RetrySpec {
        max_attempts,
        backoff,
        retryable,
    })
}

fn hedge(at: &str, raw: RawHedge) -> Result<HedgeSpec, ConfigError> {
    let field = |f: &str| format!("{at}.{f}");
    let max_attempts = attempts(&field("maxAttempts"), raw.max_attempts.as_ref())?;
    let delay = raw
        .hedging_delay
        .as_deref()
        .map(|d| parse_duration(d).map_err(|reason| invalid(field("hedgingDelay"), reason)))
        .transpose()?
        .unwrap_or(Duration::ZERO);
    let non_fatal = status_codes(&field("nonFatalStatusCodes"), &raw.non_fatal_status_codes)?;
    Ok(HedgeSpec {
        max_attempts,
        delay,
        non_fatal,
    })
}

fn throttling(raw: RawThrottling) -> Result<(u32, f64), ConfigError> {
    let max_tokens = raw.max_tokens.as_ref().ok_or(ConfigError::Missing {
        field: "retryThrottling.maxTokens".into(),
    })?;
    let max_tokens = max_tokens
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .filter(|n| (1..=MAX_TOKENS).contains(n))
        .ok_or_else(|| {
            invalid(
                "retryThrottling.maxTokens",
                format!("must be an integer in 1..={MAX_TOKENS}"),
            )
        })?;
    let ratio = raw.token_ratio.ok_or(ConfigError::Missing {
        field: "retryThrottling.tokenRatio".into(),
    })?;
    // gRPC reads the ratio to the thousandth and refuses what rounds to nothing.
    if !(0.001..=1.0).contains(&ratio) || RetryThrottle::new(max_tokens, ratio).is_err() {
        return Err(invalid(
            "retryThrottling.tokenRatio",
            "must be in [0.001, 1]: tokens are counted in thousandths, and more than one retry \
             per request would multiply load",
        ));
    }
    Ok((max_tokens, ratio))
}

/// `maxAttempts`: an integer above 1; values above 5 are read as 5 (gRPC A6).
fn attempts(field: &str, value: Option<&Value>) -> Result<u32, ConfigError> {
    let value = value.ok_or_else(|| ConfigError::Missing {
        field: field.to_owned(),
    })?;
    let n = value
        .as_u64()
        .ok_or_else(|| invalid(field, "must be an integer"))?;
    if n < 2 {
        return Err(invalid(field, "must be greater than 1"));
    }
    Ok(u32::try_from(n).unwrap_or(u32::MAX).min(MAX_ATTEMPTS_CAP))
}

fn positive(field: &str, value: &str) -> Result<Duration, ConfigError> {
    let d = parse_duration(value).map_err(|reason| invalid(field, reason))?;
    if d.is_zero() {
        return Err(invalid(field, "must be greater than 0"));
    }
    Ok(d)
}

/// Status codes by name (`"UNAVAILABLE"`, any case) or number (`14`).
fn status_codes(field: &str, values: &[Value]) -> Result<Vec<Code>, ConfigError> {
    let mut codes = Vec::with_capacity(values.len().min(Code::ALL.len()));
    for v in values {
        let code = match v {
            Value::String(name) => Code::ALL
                .into_iter()
                .find(|c| c.as_str().eq_ignore_ascii_case(name)),
            Value::Number(n) => n
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .and_then(|i| Code::ALL.get(i).copied()),
            _ => None,
        }
        .filter(|c| *c != Code::Ok)
        .ok_or_else(|| invalid(field, format!("{v} is not a status code")))?;
        if !codes.contains(&code) {
            codes.push(code);
        }
    }
    Ok(codes)
}

/// Parses a protobuf JSON `Duration`: decimal seconds with an `s` suffix, at most nine
/// fractional digits, not negative (`"1s"`, `"0.25s"`, `"3.000000001s"`).
pub fn parse_duration(value: &str) -> Result<Duration, String> {
    let digits = value
        .strip_suffix('s')
        .ok_or_else(|| format!("{value:?} is not a duration like \"1.5s\""))?;
    let (secs, frac) = match digits.split_once('.') {
        Some((s, f)) => (s, f),
        None => (digits, ""),
    };
    let bad = || format!("{value:?} is not a duration like \"1.5s\"");
    if secs.is_empty() || !secs.bytes().all(|b| b.is_ascii_digit()) || secs.len() > 12 {
        return Err(bad());
    }
    if digits.contains('.') && (frac.is_empty() || frac.len() > 9) {
        return Err(bad());
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let secs: u64 = secs.parse().map_err(|_| bad())?;
    let nanos: u32 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<9}").parse().map_err(|_| bad())?
    };
    Ok(Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn err(json: &str) -> ConfigError {
        ServiceConfig::from_json(json).unwrap_err()
    }

    const RETRY: &str = r#""maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]"#;

    #[test]
    fn a_full_config_maps_onto_backstop_policies() {
        let config = ServiceConfig::from_json(&format!(
            r#"{{"methodConfig": [
                {{"name": [{{"service": "p.Payment", "method": "Charge"}}], "timeout": "1.5s",
                  "retryPolicy": {{ {RETRY} }} }},
                {{"name": [{{"service": "p.Payment"}}],
                  "hedgingPolicy": {{"maxAttempts": 9, "hedgingDelay": "0.05s",
                                     "nonFatalStatusCodes": [14, "unavailable"]}} }},
                {{"name": [{{}}], "timeout": "10s"}}
              ],
              "retryThrottling": {{"maxTokens": 10, "tokenRatio": 0.2}} }}"#
        ))
        .unwrap();
        let charge = config.method("p.Payment", "Charge").unwrap();
        assert_eq!(charge.timeout, Some(Duration::from_millis(1500)));
        let retry = charge.retry.as_ref().unwrap();
        assert_eq!(retry.max_attempts, 3);
        assert_eq!(retry.backoff.base(), Duration::from_millis(100));
        assert_eq!(retry.backoff.cap(), Duration::from_secs(1));
        assert_eq!(retry.backoff.jitter(), Jitter::Full);
        assert_eq!(retry.retryable, [Code::Unavailable]);

        let get = config.method("p.Payment", "GetCharge").unwrap();
        let hedge = get.hedging.as_ref().unwrap();
        assert_eq!(hedge.max_attempts, 5, "values above 5 read as 5");
        assert_eq!(hedge.delay, Duration::from_millis(50));
        assert_eq!(hedge.non_fatal, [Code::Unavailable]);

        let other = config.method("p.Other", "X").unwrap();
        assert_eq!(other.timeout, Some(Duration::from_secs(10)));

        let budget = config.budget().unwrap();
        assert_eq!((budget.ratio(), budget.burst()), (0.2, 5));
        let throttle = config.retry_throttle().unwrap();
        assert_eq!((throttle.max_tokens(), throttle.token_ratio()), (10, 0.2));
        assert_eq!(throttle.tokens(), 10.0, "gRPC's bucket starts full");
        let policies = config.policies().unwrap();
        let policy = policies.for_path("/p.Payment/Charge");
        assert_eq!(policy.retryable(), [Code::Unavailable]);
        assert_eq!(policy.backoff(), &retry.backoff);
    }

    /// Per-method, per-service and default entries, looked up by full method path as gRPC
    /// does: the method's own entry, else its service's, else the default.
    #[test]
    fn each_path_gets_its_method_then_its_service_then_the_default() {
        let config = ServiceConfig::from_json(&format!(
            r#"{{"methodConfig": [
                {{"name": [{{"service": "p.Payment", "method": "Charge"}},
                           {{"service": "p.Refunds", "method": "Refund"}}],
                  "timeout": "1.5s", "retryPolicy": {{ {RETRY} }} }},
                {{"name": [{{"service": "p.Payment"}}], "timeout": "3s",
                  "hedgingPolicy": {{"maxAttempts": 2, "hedgingDelay": "0.05s"}} }},
                {{"name": [{{}}], "timeout": "10s"}}
              ]}}"#
        ))
        .unwrap();
        let policies = config.policies().unwrap();
        assert_eq!(policies.len(), 4);
        for path in ["/p.Payment/Charge", "/p.Refunds/Refund"] {
            let p = policies.for_path(path);
            assert_eq!(p.timeout(), Duration::from_millis(1500), "{path}");
            assert_eq!(p.max_attempts(), 3, "{path}");
            assert_eq!(p.idempotency(), Idempotency::Safe);
            assert!(!p.hedging());
        }
        assert_eq!(policies.for_path("/p.Payment/Charge").name(), "Charge");

        let get = policies.for_path("/p.Payment/GetCharge");
        assert_eq!(get.name(), "p.Payment");
        assert_eq!(get.timeout(), Duration::from_secs(3));
        assert!(get.hedging());
        assert_eq!(get.hedge_delay(), Some(Duration::from_millis(50)));
        assert_eq!(
            get.max_attempts(),
            1,
            "no retryPolicy: one attempt, plus the hedge"
        );

        for path in ["/p.Refunds/Other", "/p.Other/Charge", "/v1/payments"] {
            let other = policies.for_path(path);
            assert_eq!(other.name(), "other", "{path}");
            assert_eq!(other.timeout(), Duration::from_secs(10));
            assert_eq!(other.max_attempts(), 1);
        }

        // Without a default entry, an unnamed call is sent once, with the default timeout.
        let config = ServiceConfig::from_json(&format!(
            r#"{{"methodConfig": [{{"name": [{{"service": "p.Payment"}}],
                "retryPolicy": {{ {RETRY} }} }}]}}"#
        ))
        .unwrap();
        let policies = config.policies().unwrap();
        assert_eq!(policies.for_path("/p.Payment/Charge").max_attempts(), 3);
        let other = policies.for_path("/q.Other/Call");
        assert_eq!(other.idempotency(), Idempotency::Unsafe);
        assert_eq!(other.max_attempts(), 1);
        assert_eq!(other.timeout(), crate::policy::DEFAULT_TIMEOUT);
    }

    /// `backoffMultiplier` is not only checked: the delays between attempts grow by it. Two
    /// configs that differ only in the multiplier, run without jitter on the paused clock
    /// against a method that always answers `UNAVAILABLE`: 100, 200, 400 ms apart with 2;
    /// 100, 300, 900 ms with 3.
    #[tokio::test(start_paused = true)]
    async fn the_backoff_multiplier_sets_the_delays_between_attempts() {
        use crate::deadline::Deadline;
        use crate::retry::RetryPolicy;
        use crate::status::Status;
        use std::sync::{Arc, Mutex};
        use tokio::time::Instant;

        async fn gaps(multiplier: &str) -> Vec<Duration> {
            let json = format!(
                r#"{{"methodConfig": [{{"name": [{{"service": "p.S", "method": "M"}}],
                    "retryPolicy": {{"maxAttempts": 4, "initialBackoff": "0.1s",
                      "maxBackoff": "10s", "backoffMultiplier": {multiplier},
                      "retryableStatusCodes": ["UNAVAILABLE"]}} }}]}}"#
            );
            let config = ServiceConfig::from_json(&json).unwrap();
            let policies = config.policies().unwrap();
            let method = policies.for_path("/p.S/M");
            // Jitter off, so that the delays are the ceilings themselves.
            let retry = RetryPolicy::builder("s", "M")
                .method_policy(method)
                .backoff(method.backoff().with_jitter(Jitter::None))
                .spend(RetryBudget::new(0.1, 100).unwrap())
                .build()
                .unwrap();
            let sent = Arc::new(Mutex::new(Vec::new()));
            let deadline = Deadline::after(Duration::from_secs(60));
            let result = retry
                .execute(deadline, |_| {
                    sent.lock().unwrap().push(Instant::now());
                    async { Err::<(), _>(Status::new(Code::Unavailable, "down")) }
                })
                .await;
            assert!(result.is_err());
            let sent = sent.lock().unwrap();
            sent.windows(2).map(|w| w[1] - w[0]).collect()
        }

        let ms = Duration::from_millis;
        assert_eq!(gaps("2").await, [ms(100), ms(200), ms(400)]);
        assert_eq!(gaps("3").await, [ms(100), ms(300), ms(900)]);
        assert_eq!(gaps("1.5").await, [ms(100), ms(150), ms(225)]);
    }

    /// `hedgingPolicy.maxAttempts` N is N - 1 hedges (values above 5 read as 5), each after
    /// exactly `hedgingDelay`.
    #[test]
    fn hedged_attempts_become_hedges_after_the_delay() {
        for (n, hedges) in [(2, 1), (3, 2), (5, 4), (9, 4)] {
            let json = format!(
                r#"{{"methodConfig": [{{"name": [{{"service": "p.S"}}],
                    "hedgingPolicy": {{"maxAttempts": {n}, "hedgingDelay": "0.1s"}}}}]}}"#
            );
            let config = ServiceConfig::from_json(&json).unwrap();
            let policies = config.policies().unwrap();
            let hedged = policies.for_path("/p.S/M");
            assert!(hedged.hedging());
            assert_eq!(hedged.max_hedges(), hedges, "maxAttempts {n}");
            // The delay is the delay, not a floor under the p95.
            assert_eq!(hedged.hedge_delay(), Some(Duration::from_millis(100)));
            assert_eq!(
                hedged.max_attempts(),
                1,
                "no retryPolicy: the hedges are the attempts"
            );
        }
        // Without `hedgingDelay`, gRPC sends the hedge at once.
        let config = ServiceConfig::from_json(
            r#"{"methodConfig": [{"name": [{"service": "p.S"}],
                "hedgingPolicy": {"maxAttempts": 2}}]}"#,
        )
        .unwrap();
        let policies = config.policies().unwrap();
        assert_eq!(
            policies.for_path("/p.S/M").hedge_delay(),
            Some(Duration::ZERO)
        );
    }

    /// `timeout` becomes the method's timeout, which the client stack uses as a cap on the
    /// caller's deadline; `retryThrottling` is read both as gRPC's bucket and as a budget.
    #[test]
    fn timeout_and_throttling_map_onto_their_mechanisms() {
        let config = ServiceConfig::from_json(&format!(
            r#"{{"methodConfig": [{{"name": [{{"service": "p.S"}}], "timeout": "0.25s",
                "retryPolicy": {{ {RETRY} }} }}],
              "retryThrottling": {{"maxTokens": 7, "tokenRatio": 0.25}} }}"#
        ))
        .unwrap();
        let policies = config.policies().unwrap();
        assert_eq!(
            policies.for_path("/p.S/M").timeout(),
            Duration::from_millis(250)
        );
        let throttle = config.retry_throttle().unwrap();
        assert_eq!((throttle.max_tokens(), throttle.token_ratio()), (7, 0.25));
        // 7 tokens, half is 3.5: the fourth failure leaves 3 and stops retries.
        for _ in 0..3 {
            assert!(throttle.record_failure());
        }
        assert!(!throttle.record_failure());
        assert_eq!(config.budget().unwrap().burst(), 4);
        let none = ServiceConfig::from_json(r#"{"methodConfig": []}"#).unwrap();
        assert!(none.retry_throttle().is_none());
    }

    #[test]
    fn a_policy_the_config_makes_invalid_is_refused_with_its_entry() {
        // gRPC would accept it; backstop never retries a fatal code, so it says so.
        let config = ServiceConfig::from_json(
            r#"{"methodConfig": [{}, {"name": [{"service": "p.S"}],
                "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                  "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "INTERNAL"]}}]}"#,
        )
        .unwrap();
        match config.policies().unwrap_err() {
            ConfigError::Invalid { field, reason } => {
                assert_eq!(field, "methodConfig[1]");
                assert!(reason.contains("INTERNAL"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let twice = ServiceConfig::from_json(
            r#"{"methodConfig": [{"name": [{"service": "p.S"}]}, {"name": [{"service": "p.S"}]}]}"#,
        )
        .unwrap();
        assert!(matches!(twice.policies(), Err(ConfigError::Invalid { .. })));
    }

    /// An entry applied to a method's own policy keeps its idempotency class.
    #[test]
    fn an_entry_applied_to_a_policy_keeps_its_class() {
        let config = ServiceConfig::from_json(&format!(
            r#"{{"methodConfig": [{{"name": [{{"service": "p.S"}}], "timeout": "3s",
                "retryPolicy": {{ {RETRY} }} }}]}}"#
        ))
        .unwrap();
        let entry = config.method("p.S", "Charge").unwrap();
        let charge = entry
            .apply(
                MethodPolicy::builder("Charge", Idempotency::Keyed)
                    .key_ttl(crate::policy::KEY_TTL_PAYMENTS),
            )
            .build();
        assert_eq!(charge.validate(), Ok(()));
        assert_eq!(charge.idempotency(), Idempotency::Keyed);
        assert_eq!(charge.timeout(), Duration::from_secs(3));
        assert_eq!(charge.max_attempts(), 3);
        // An unsafe method may not take the config's retries.
        let refund = entry
            .apply(MethodPolicy::builder("Refund", Idempotency::Unsafe))
            .build();
        assert!(refund.validate().is_err());
    }

    #[test]
    fn invalid_configs_name_the_field() {
        let missing = |f: &str| ConfigError::Missing { field: f.into() };
        assert_eq!(
            err(r#"{"methodConfig":[{"retryPolicy":{"initialBackoff":"1s"}}]}"#),
            missing("methodConfig[0].retryPolicy.maxAttempts")
        );
        let cases = [
            (r#""maxAttempts": 1"#, "maxAttempts"),
            (r#""maxAttempts": "3""#, "maxAttempts"),
            (r#""maxAttempts": 2.5"#, "maxAttempts"),
        ];
        for (bad, field) in cases {
            let json = format!(
                r#"{{"methodConfig":[{{"retryPolicy":{{{bad}, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}}}}]}}"#
            );
            match err(&json) {
                ConfigError::Invalid { field: f, .. } => {
                    assert_eq!(f, format!("methodConfig[0].retryPolicy.{field}"))
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        let with = |retry: &str| format!(r#"{{"methodConfig":[{{"retryPolicy":{{{retry}}}}}]}}"#);
        for (json, field) in [
            (
                with(&RETRY.replace("\"0.1s\"", "\"0.1\"")),
                "initialBackoff",
            ),
            (with(&RETRY.replace("\"0.1s\"", "\"0s\"")), "initialBackoff"),
            (
                with(&RETRY.replace("\"0.1s\"", "\"-1s\"")),
                "initialBackoff",
            ),
            (with(&RETRY.replace("2,", "0,")), "backoffMultiplier"),
            (
                with(&RETRY.replace("[\"UNAVAILABLE\"]", "[]")),
                "retryableStatusCodes",
            ),
            (
                with(&RETRY.replace("[\"UNAVAILABLE\"]", "[\"OK\"]")),
                "retryableStatusCodes",
            ),
            (
                with(&RETRY.replace("[\"UNAVAILABLE\"]", "[\"BUSY\"]")),
                "retryableStatusCodes",
            ),
            (
                with(&RETRY.replace("[\"UNAVAILABLE\"]", "[17]")),
                "retryableStatusCodes",
            ),
        ] {
            match err(&json) {
                ConfigError::Invalid { field: f, .. } => {
                    assert_eq!(f, format!("methodConfig[0].retryPolicy.{field}"), "{json}")
                }
                other => panic!("{json}: {other:?}"),
            }
        }
        assert!(matches!(
            err(&format!(
                r#"{{"methodConfig":[{{"retryPolicy":{{{RETRY}}}, "hedgingPolicy":{{"maxAttempts":2}}}}]}}"#
            )),
            ConfigError::Invalid { .. }
        ));
        assert!(matches!(
            err(r#"{"methodConfig":[{"name":[{"method":"Charge"}]}]}"#),
            ConfigError::Invalid { .. }
        ));
        for throttle in [
            r#"{"maxTokens": 0, "tokenRatio": 0.1}"#,
            r#"{"maxTokens": 1001, "tokenRatio": 0.1}"#,
            r#"{"maxTokens": 10, "tokenRatio": 0}"#,
            r#"{"maxTokens": 10, "tokenRatio": 0.0005}"#,
            r#"{"maxTokens": 10, "tokenRatio": 1.5}"#,
        ] {
            let json = format!(r#"{{"retryThrottling": {throttle}}}"#);
            assert!(matches!(err(&json), ConfigError::Invalid { .. }), "{json}");
        }
        assert!(matches!(err("{"), ConfigError::Json(_)));
        assert!(matches!(
            err(r#"{"methodConfig": 3}"#),
            ConfigError::Json(_)
        ));
    }

    #[test]
    fn durations_follow_the_protobuf_json_form() {
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("0.25s"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("3.000000001s"), Ok(Duration::new(3, 1)));
        for bad in [
            "",
            "s",
            "1",
            "1.s",
            ".5s",
            "1.0000000001s",
            "-1s",
            "1e3s",
            "1 s",
            "0x1s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn durations_round_trip(secs in 0u64..1_000_000_000_000, nanos in 0u32..1_000_000_000) {
            let text = format!("{secs}.{nanos:09}s");
            prop_assert_eq!(parse_duration(&text), Ok(Duration::new(secs, nanos)));
        }

        #[test]
        fn parsing_never_panics(text in ".{0,40}") {
            let _ = parse_duration(&text);
            let _ = ServiceConfig::from_json(&text);
        }

        #[test]
        fn any_hedged_attempt_count_is_rejected_or_capped(n in 0u64..1_000_000) {
            let json = format!(r#"{{"methodConfig":[{{"hedgingPolicy":{{"maxAttempts":{n}}}}}]}}"#);
            match ServiceConfig::from_json(&json) {
                Ok(c) => {
                    prop_assert!(n >= 2);
                    let h = c.methods[0].hedging.as_ref().unwrap();
                    prop_assert_eq!(h.max_attempts, (n as u32).min(5));
                    let policy = c.methods[0]
                        .apply(MethodPolicy::builder("M", Idempotency::Safe))
                        .build();
                    prop_assert_eq!(policy.max_hedges(), h.max_attempts - 1);
                    prop_assert_eq!(policy.validate(), Ok(()));
                }
                Err(ConfigError::Invalid { field, .. }) => {
                    prop_assert!(n < 2);
                    prop_assert_eq!(field, "methodConfig[0].hedgingPolicy.maxAttempts");
                }
                Err(other) => prop_assert!(false, "{other:?}"),
            }
        }
    }
}
