//! gRPC service config: bring `retryPolicy`, `hedgingPolicy` and `retryThrottling` as they are.
//!
//! Teams that already run gRPC keep their retry settings in a service config (gRPC proposal
//! A6). [`ServiceConfig::from_json`] reads one and turns it into backstop's own types, so the
//! same JSON drives the same mechanisms:
//!
//! | service config | backstop |
//! |---|---|
//! | `retryPolicy.maxAttempts` (values above 5 are read as 5, as gRPC does) | [`RetryPolicy::max_attempts`] |
//! | `initialBackoff`, `maxBackoff` | [`Backoff`] base and cap, full jitter (gRPC's own) |
//! | `backoffMultiplier` | validated; backstop's backoff doubles, the usual value |
//! | `retryableStatusCodes` (names or numbers) | [`RetryPolicyBuilder::retryable_codes`](crate::retry::RetryPolicyBuilder::retryable_codes) |
//! | `hedgingPolicy.maxAttempts`, `hedgingDelay` | one hedge (backstop never sends more), no sooner than the delay |
//! | `retryThrottling {maxTokens, tokenRatio}` | [`RetryBudget`]: ratio `tokenRatio`, burst `maxTokens / 2` (gRPC stops retrying below half the tokens) |
//! | `timeout` | the call's default deadline |
//!
//! Invalid configs are refused with an error naming the field (a missing `maxAttempts`, a
//! `"1.5"` without its `s`, `retryPolicy` and `hedgingPolicy` on the same method, ...), never
//! silently half-applied.
//!
//! ```
//! use std::time::Duration;
//! use backstop::client::config::ServiceConfig;
//!
//! let config = ServiceConfig::from_json(r#"{
//!   "methodConfig": [{
//!     "name": [{"service": "payment.v1.Payment", "method": "Charge"}],
//!     "timeout": "2s",
//!     "retryPolicy": {
//!       "maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1s",
//!       "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]
//!     }
//!   }],
//!   "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
//! }"#).unwrap();
//! let charge = config.method("payment.v1.Payment", "Charge").unwrap();
//! assert_eq!(charge.timeout, Some(Duration::from_secs(2)));
//! let budget = config.budget().unwrap();
//! let policy = charge.retry_policy("payment", "Charge", budget).unwrap().unwrap();
//! assert_eq!(policy.max_attempts(), 4);
//! ```

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::retry::{Backoff, BackoffError, Jitter, RetryBudget, RetryPolicy};
use crate::status::Code;

/// Most attempts gRPC honours (and backstop allows).
const MAX_ATTEMPTS: u32 = RetryPolicy::MAX_ATTEMPTS_LIMIT;
/// Largest `maxTokens` gRPC accepts.
const MAX_TOKENS: u32 = 1000;
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HedgeSpec {
    /// Attempts the config allows (2 to 5); backstop sends at most one hedge whatever it says.
    pub max_attempts: u32,
    /// The earliest a hedge is sent.
    pub delay: Duration,
    /// Codes after which the other attempt is still awaited.
    pub non_fatal: Vec<Code>,
}

/// One `methodConfig` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodConfig {
    /// The calls it applies to.
    pub names: Vec<MethodName>,
    /// Default deadline.
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

    /// The retry budget `retryThrottling` describes, or the default budget (ratio 0.1, burst
    /// 20) when it is absent.
    pub fn budget(&self) -> Result<RetryBudget, ConfigError> {
        match self.throttling {
            None => Ok(RetryBudget::default()),
            Some((max_tokens, ratio)) => RetryBudget::new(ratio, max_tokens.div_ceil(2))
                .map_err(|e| invalid("retryThrottling.tokenRatio", e.to_string())),
        }
    }
}

impl MethodConfig {
    /// The retry policy for this method, labelled `service`/`method`, spending `budget`; `None`
    /// when the method config has no `retryPolicy`.
    pub fn retry_policy(
        &self,
        service: &'static str,
        method: &'static str,
        budget: RetryBudget,
    ) -> Result<Option<RetryPolicy>, ConfigError> {
        let Some(spec) = &self.retry else {
            return Ok(None);
        };
        RetryPolicy::builder(service, method)
            .max_attempts(spec.max_attempts)
            .backoff(spec.backoff)
            .budget(budget)
            .retryable_codes(spec.retryable.iter().copied())
            .build()
            .map(Some)
            .map_err(|e| invalid("retryPolicy.maxAttempts", e.to_string()))
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
        .map_err(|e: BackoffError| invalid(field("initialBackoff"), e.to_string()))?;
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
    if !(ratio > 0.0 && ratio <= 1.0) {
        return Err(invalid(
            "retryThrottling.tokenRatio",
            "must be in (0, 1]: more than one retry per request would multiply load",
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
    Ok(u32::try_from(n).unwrap_or(u32::MAX).min(MAX_ATTEMPTS))
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
        let policy = charge
            .retry_policy("payment", "Charge", budget)
            .unwrap()
            .unwrap();
        assert_eq!(policy.retryable_codes(), Some(&[Code::Unavailable][..]));
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
        fn any_attempt_count_is_rejected_or_capped(n in 0u64..1_000_000) {
            let json = format!(r#"{{"methodConfig":[{{"hedgingPolicy":{{"maxAttempts":{n}}}}}]}}"#);
            match ServiceConfig::from_json(&json) {
                Ok(c) => {
                    prop_assert!(n >= 2);
                    let h = c.methods[0].hedging.as_ref().unwrap();
                    prop_assert_eq!(h.max_attempts, (n as u32).min(5));
                }
                Err(_) => prop_assert!(n < 2),
            }
        }
    }
}
