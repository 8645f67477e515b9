//! The `POST /v1/payments` body: parsed and validated by hand so each mistake gets its own
//! stable problem code (a derive would report every mistake as one "bad JSON").
//!
//! Accepted: a JSON object with exactly these members:
//!
//! | member | rule |
//! |---|---|
//! | `order_id` | required string, 1..=128 visible ASCII characters (0x21..=0x7E) |
//! | `amount_cents` | required JSON integer, 1..=[`MAX_AMOUNT_CENTS`] (no fraction, no exponent) |
//! | `currency` | optional string of three uppercase ASCII letters, default `"USD"` |
//!
//! Anything else is refused before any row is written.

use serde::Serialize;
use serde_json::{Map, Value};

/// Largest accepted amount: 10^12 minor units (ten billion in a two-decimal currency), far
/// below `i64::MAX` and exactly representable by every JSON consumer (< 2^53).
pub const MAX_AMOUNT_CENTS: i64 = 1_000_000_000_000;

/// Longest accepted `order_id`.
pub const MAX_ORDER_ID_LEN: usize = 128;

/// Currency used when the body names none.
pub const DEFAULT_CURRENCY: &str = "USD";

/// A validated payment request, normalized (the default currency filled in).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PaymentRequest {
    /// Business key of the payment.
    pub order_id: String,
    /// Positive amount in minor units.
    pub amount_cents: i64,
    /// ISO 4217 code.
    pub currency: String,
}

/// Why a body was refused. Every variant maps to a 400 with its own problem code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The body is not JSON at all.
    #[error("the body is not valid JSON")]
    MalformedJson,
    /// The body is JSON but not an object.
    #[error("the body must be a JSON object")]
    NotAnObject,
    /// The object has a member this endpoint does not know.
    #[error("unknown field {0:?}")]
    UnknownField(String),
    /// A required member is absent.
    #[error("missing field {0:?}")]
    MissingField(&'static str),
    /// `order_id` is not a string of 1..=128 visible ASCII characters.
    #[error("order_id must be a string of 1 to 128 visible ASCII characters")]
    InvalidOrderId,
    /// `amount_cents` is not an integer in 1..=10^12.
    #[error("amount_cents must be an integer between 1 and 1000000000000")]
    InvalidAmount,
    /// `currency` is not three uppercase ASCII letters.
    #[error("currency must be three uppercase letters (ISO 4217)")]
    InvalidCurrency,
}

impl RequestError {
    /// Stable problem code (`code` member of the problem+json answer).
    pub fn code(&self) -> &'static str {
        match self {
            RequestError::MalformedJson => "malformed_json",
            RequestError::NotAnObject => "invalid_body",
            RequestError::UnknownField(_) => "unknown_field",
            RequestError::MissingField(_) => "missing_field",
            RequestError::InvalidOrderId => "invalid_order_id",
            RequestError::InvalidAmount => "invalid_amount",
            RequestError::InvalidCurrency => "invalid_currency",
        }
    }

    /// The member at fault, if any.
    pub fn field(&self) -> Option<&str> {
        match self {
            RequestError::UnknownField(f) => Some(f),
            RequestError::MissingField(f) => Some(f),
            RequestError::InvalidOrderId => Some("order_id"),
            RequestError::InvalidAmount => Some("amount_cents"),
            RequestError::InvalidCurrency => Some("currency"),
            RequestError::MalformedJson | RequestError::NotAnObject => None,
        }
    }
}

/// Longest unknown member name echoed back in an error (the rest is cut, never allocated from
/// client input beyond this).
const MAX_ECHOED_FIELD: usize = 64;

fn echo(name: &str) -> String {
    name.chars().take(MAX_ECHOED_FIELD).collect()
}

/// Parses and validates a body. The caller bounds the body size before calling.
pub fn parse(body: &[u8]) -> Result<PaymentRequest, RequestError> {
    let value: Value = serde_json::from_slice(body).map_err(|_| RequestError::MalformedJson)?;
    let Value::Object(map) = value else {
        return Err(RequestError::NotAnObject);
    };
    validate(&map)
}

fn validate(map: &Map<String, Value>) -> Result<PaymentRequest, RequestError> {
    if let Some(unknown) = map
        .keys()
        .find(|k| !matches!(k.as_str(), "order_id" | "amount_cents" | "currency"))
    {
        return Err(RequestError::UnknownField(echo(unknown)));
    }
    let order_id = match map.get("order_id") {
        None => return Err(RequestError::MissingField("order_id")),
        Some(Value::String(s)) if valid_order_id(s) => s.clone(),
        Some(_) => return Err(RequestError::InvalidOrderId),
    };
    let amount_cents = match map.get("amount_cents") {
        None => return Err(RequestError::MissingField("amount_cents")),
        Some(Value::Number(n)) => match n.as_i64() {
            // `as_i64` is None for floats (1.0, 1e3) and for integers beyond i64.
            Some(a) if (1..=MAX_AMOUNT_CENTS).contains(&a) => a,
            _ => return Err(RequestError::InvalidAmount),
        },
        Some(_) => return Err(RequestError::InvalidAmount),
    };
    let currency = match map.get("currency") {
        None => DEFAULT_CURRENCY.to_owned(),
        Some(Value::String(s)) if valid_currency(s) => s.clone(),
        Some(_) => return Err(RequestError::InvalidCurrency),
    };
    Ok(PaymentRequest {
        order_id,
        amount_cents,
        currency,
    })
}

/// Validates a request given field by field (the gRPC `ChargeRequest`), by the same rules as
/// the JSON body; an empty `currency` (proto3's unset string) means [`DEFAULT_CURRENCY`].
pub fn from_fields(
    order_id: String,
    amount_cents: i64,
    currency: String,
) -> Result<PaymentRequest, RequestError> {
    if !valid_order_id(&order_id) {
        return Err(RequestError::InvalidOrderId);
    }
    if !(1..=MAX_AMOUNT_CENTS).contains(&amount_cents) {
        return Err(RequestError::InvalidAmount);
    }
    let currency = if currency.is_empty() {
        DEFAULT_CURRENCY.to_owned()
    } else if valid_currency(&currency) {
        currency
    } else {
        return Err(RequestError::InvalidCurrency);
    };
    Ok(PaymentRequest {
        order_id,
        amount_cents,
        currency,
    })
}

fn valid_currency(s: &str) -> bool {
    s.len() == 3 && s.bytes().all(|b| b.is_ascii_uppercase())
}

fn valid_order_id(s: &str) -> bool {
    (1..=MAX_ORDER_ID_LEN).contains(&s.len()) && s.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

/// Hex SHA-256 fingerprint of the normalized request (method + canonical JSON), stored with the
/// intent: a resumed intent must carry the same parameters.
pub fn fingerprint(req: &PaymentRequest) -> String {
    use sha2::{Digest, Sha256};
    // RFC 8785 for this flat shape: members in lexicographic order, no whitespace, strings as
    // serde_json writes them (ASCII only here), the integer as is. Written out so a map
    // ordering feature elsewhere in the build cannot change it.
    let canonical = format!(
        r#"{{"amount_cents":{},"currency":{},"order_id":{}}}"#,
        req.amount_cents,
        Value::from(req.currency.as_str()),
        Value::from(req.order_id.as_str()),
    );
    let mut h = Sha256::new();
    h.update(b"payment_intent\n");
    h.update(canonical.as_bytes());
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> &'static str {
        parse(body.as_bytes()).unwrap_err().code()
    }

    #[test]
    fn accepts_a_minimal_body_and_defaults_the_currency() {
        let r = parse(br#"{"order_id":"o-1","amount_cents":1999}"#).unwrap();
        assert_eq!(
            r,
            PaymentRequest {
                order_id: "o-1".into(),
                amount_cents: 1999,
                currency: "USD".into()
            }
        );
        let r = parse(br#"{"order_id":"o-1","amount_cents":1,"currency":"EUR"}"#).unwrap();
        assert_eq!(r.currency, "EUR");
    }

    #[test]
    fn each_mistake_has_its_code() {
        assert_eq!(err("not json"), "malformed_json");
        assert_eq!(err(""), "malformed_json");
        assert_eq!(err("[1]"), "invalid_body");
        assert_eq!(
            err(r#"{"order_id":"o","amount_cents":1,"x":1}"#),
            "unknown_field"
        );
        assert_eq!(err(r#"{"amount_cents":1}"#), "missing_field");
        assert_eq!(err(r#"{"order_id":"o"}"#), "missing_field");
        assert_eq!(
            err(r#"{"order_id":"","amount_cents":1}"#),
            "invalid_order_id"
        );
        assert_eq!(
            err(r#"{"order_id":"a b","amount_cents":1}"#),
            "invalid_order_id"
        );
        assert_eq!(
            err(r#"{"order_id":7,"amount_cents":1}"#),
            "invalid_order_id"
        );
        let long = "x".repeat(129);
        assert_eq!(
            err(&format!(r#"{{"order_id":"{long}","amount_cents":1}}"#)),
            "invalid_order_id"
        );
        for amount in [
            "1.5",
            "1.0",
            "1e3",
            "-5",
            "0",
            "\"10\"",
            "1000000000001",
            "99999999999999999999",
        ] {
            assert_eq!(
                err(&format!(r#"{{"order_id":"o","amount_cents":{amount}}}"#)),
                "invalid_amount",
                "{amount}"
            );
        }
        for cur in ["\"usd\"", "\"US\"", "\"USDD\"", "null", "1"] {
            assert_eq!(
                err(&format!(
                    r#"{{"order_id":"o","amount_cents":1,"currency":{cur}}}"#
                )),
                "invalid_currency",
                "{cur}"
            );
        }
    }

    #[test]
    fn longest_order_id_and_largest_amount_pass() {
        let long = "x".repeat(128);
        let r =
            parse(format!(r#"{{"order_id":"{long}","amount_cents":1000000000000}}"#).as_bytes())
                .unwrap();
        assert_eq!(r.amount_cents, MAX_AMOUNT_CENTS);
    }

    #[test]
    fn unknown_field_echo_is_bounded() {
        let name = "f".repeat(10_000);
        let e = parse(format!(r#"{{"{name}":1}}"#).as_bytes()).unwrap_err();
        assert_eq!(e.field().unwrap().len(), MAX_ECHOED_FIELD);
    }

    #[test]
    fn fields_follow_the_json_rules() {
        let ok = from_fields("o-1".into(), 5, String::new()).unwrap();
        assert_eq!(
            ok,
            parse(br#"{"order_id":"o-1","amount_cents":5}"#).unwrap()
        );
        let err = |o: &str, a: i64, c: &str| from_fields(o.into(), a, c.into()).unwrap_err().code();
        assert_eq!(err("", 5, ""), "invalid_order_id");
        assert_eq!(err("o", 0, ""), "invalid_amount");
        assert_eq!(err("o", MAX_AMOUNT_CENTS + 1, ""), "invalid_amount");
        assert_eq!(err("o", 5, "usd"), "invalid_currency");
    }

    #[test]
    fn fingerprint_ignores_member_order_and_the_default_currency() {
        let a = parse(br#"{"order_id":"o","amount_cents":5}"#).unwrap();
        let b = parse(br#"{"currency":"USD","amount_cents":5,"order_id":"o"}"#).unwrap();
        let c = parse(br#"{"order_id":"o","amount_cents":6}"#).unwrap();
        assert_eq!(fingerprint(&a), fingerprint(&b));
        assert_ne!(fingerprint(&a), fingerprint(&c));
        assert_eq!(fingerprint(&a).len(), 64);
    }
}
