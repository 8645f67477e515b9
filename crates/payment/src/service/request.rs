//! The `POST /v1/payments` body: parsed and validated by hand so each mistake gets its own
//! stable problem code (a derive would report every mistake as one "bad JSON").
//!
//! Accepted: a JSON object with exactly these members:
//!
//! | member | rule |
//! |---|---|
//! | `order_id` | required string, 1..=128 visible ASCII characters (0x21..=0x7E) |
//! | `amount_cents` | required JSON integer, 1..=[`MAX_AMOUNT_CENTS`]; a number with no fractional part written with one (`1999.0`, `1.999e3`) is that integer, as JSON Schema's `integer` and the fingerprint's canonical form (RFC 8785) both read it. The number is read from its text, digit by digit: a fraction that is not zero is refused however small (`999999999999.99999999999999999` is not 10^12, though a double rounds it there) |
//! | `currency` | optional string of three uppercase ASCII letters, default `"USD"` |
//!
//! A member named twice (`{"amount_cents":1,"amount_cents":99999}`) is refused as
//! `duplicate_field`: parsers disagree on which one wins, so the request is ambiguous.
//!
//! Anything else is refused before any row is written.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;

/// Largest accepted amount: 10^12 minor units (ten billion in a two-decimal currency), far
/// below `i64::MAX` and exactly representable by every JSON consumer (< 2^53).
pub const MAX_AMOUNT_CENTS: i64 = 1_000_000_000_000;

/// Longest accepted `order_id`.
pub const MAX_ORDER_ID_LEN: usize = 128;

/// Currency used when the body names none.
pub const DEFAULT_CURRENCY: &str = "USD";

/// A validated payment request, normalized (the default currency filled in). As a schema,
/// the body of `POST /v1/payments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PaymentRequest {
    /// Business key of the payment: 1 to 128 visible ASCII characters, one payment per order
    /// and merchant.
    #[schema(min_length = 1, max_length = 128, pattern = "^[!-~]+$")]
    pub order_id: String,
    /// Positive amount in minor units.
    #[schema(minimum = 1, maximum = 1_000_000_000_000_i64)]
    pub amount_cents: i64,
    /// ISO 4217 code.
    #[schema(required = false, default = "USD", pattern = "^[A-Z]{3}$")]
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
    /// The object names a member twice: which value was meant is ambiguous.
    #[error("field {0:?} appears more than once")]
    DuplicateField(String),
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
            RequestError::DuplicateField(_) => "duplicate_field",
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
            RequestError::UnknownField(f) | RequestError::DuplicateField(f) => Some(f),
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
    let top: TopLevel = serde_json::from_slice(body).map_err(|_| RequestError::MalformedJson)?;
    match top {
        TopLevel::Object(map) => validate(&map),
        TopLevel::Duplicate(name) => Err(RequestError::DuplicateField(name)),
        TopLevel::Other => Err(RequestError::NotAnObject),
    }
}

/// An object's members, each value as the text it was sent as: an amount is read from its
/// digits, not from the binary float `serde_json::Value` would make of it.
type Members = BTreeMap<String, Box<RawValue>>;

/// The body's top-level value as read by [`TopLevel::deserialize`]: `serde_json::Value` keeps
/// the last of two members with one name, which would let the second `amount_cents` win.
enum TopLevel {
    /// An object whose member names are all distinct.
    Object(Members),
    /// An object naming this member (echo-bounded) more than once.
    Duplicate(String),
    /// Any other JSON value.
    Other,
}

impl<'de> serde::Deserialize<'de> for TopLevel {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(TopLevelVisitor)
    }
}

struct TopLevelVisitor;

impl<'de> serde::de::Visitor<'de> for TopLevelVisitor {
    type Value = TopLevel;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut access: A) -> Result<TopLevel, A::Error> {
        let mut map = Members::new();
        let mut duplicate = None;
        while let Some(name) = access.next_key::<String>()? {
            // Every value is still read, so a malformed document stays malformed_json.
            let value: Box<RawValue> = access.next_value()?;
            match map.entry(name) {
                Entry::Occupied(taken) => {
                    duplicate.get_or_insert_with(|| echo(taken.key()));
                }
                Entry::Vacant(free) => {
                    free.insert(value);
                }
            }
        }
        Ok(match duplicate {
            Some(name) => TopLevel::Duplicate(name),
            None => TopLevel::Object(map),
        })
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut access: A) -> Result<TopLevel, A::Error> {
        while access.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(TopLevel::Other)
    }

    fn visit_bool<E>(self, _: bool) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }
    fn visit_i64<E>(self, _: i64) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }
    fn visit_u64<E>(self, _: u64) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }
    fn visit_f64<E>(self, _: f64) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }
    fn visit_str<E>(self, _: &str) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }
    fn visit_unit<E>(self) -> Result<TopLevel, E> {
        Ok(TopLevel::Other)
    }
}

fn validate(map: &Members) -> Result<PaymentRequest, RequestError> {
    // A member's value as JSON: its text was checked when the body was read.
    let value = |raw: &RawValue| serde_json::from_str::<Value>(raw.get()).ok();
    if let Some(unknown) = map
        .keys()
        .find(|k| !matches!(k.as_str(), "order_id" | "amount_cents" | "currency"))
    {
        return Err(RequestError::UnknownField(echo(unknown)));
    }
    let order_id = match map.get("order_id").map(|raw| value(raw)) {
        None => return Err(RequestError::MissingField("order_id")),
        Some(Some(Value::String(s))) if valid_order_id(&s) => s,
        Some(_) => return Err(RequestError::InvalidOrderId),
    };
    let amount_cents = match map.get("amount_cents") {
        None => return Err(RequestError::MissingField("amount_cents")),
        Some(raw) => whole_amount(raw.get()).ok_or(RequestError::InvalidAmount)?,
    };
    let currency = match map.get("currency").map(|raw| value(raw)) {
        None => DEFAULT_CURRENCY.to_owned(),
        Some(Some(Value::String(s))) if valid_currency(&s) => s,
        Some(_) => return Err(RequestError::InvalidCurrency),
    };
    Ok(PaymentRequest {
        order_id,
        amount_cents,
        currency,
    })
}

/// The integer a JSON number's text denotes, if it is whole and in 1..=[`MAX_AMOUNT_CENTS`],
/// read from its digits, never through a binary float: `1999.0`, `1.999e3` and `199900e-2`
/// are 1999, while `999999999999.99999999999999999` is refused, though a double rounds it to
/// 10^12. The text is RFC 8259's `number` (serde_json checked its syntax); anything else
/// (a string, `null`) is `None`.
fn whole_amount(text: &str) -> Option<i64> {
    let text = text.trim_matches([' ', '\t', '\n', '\r']);
    let unsigned = text.strip_prefix('-').unwrap_or(text);
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], Some(&unsigned[at + 1..])),
        None => (unsigned, None),
    };
    let (int_digits, frac_digits) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = || int_digits.bytes().chain(frac_digits.bytes());
    if int_digits.is_empty() || !digits().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // The value is `significant` x 10^`scale`, with `significant`'s zeros at either end cut.
    let leading = digits().take_while(|&b| b == b'0').count();
    let trailing = digits().rev().take_while(|&b| b == b'0').count();
    let total = int_digits.len() + frac_digits.len();
    if leading == total || unsigned.len() != text.len() {
        return None; // zero, or negative: neither is an amount
    }
    let significant = total - leading - trailing;
    // The exponent's own digits can be as many as the body holds: past a few, the value is
    // either far too large or has a fraction, and both are refused without reading it whole.
    let exponent: i64 = match exponent {
        None => 0,
        Some(e) => {
            let (negative, e) = match e.as_bytes().first() {
                Some(b'-') => (true, &e[1..]),
                Some(b'+') => (false, &e[1..]),
                _ => (false, e),
            };
            let e = e.trim_start_matches('0');
            if e.len() > 6 || !e.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let magnitude: i64 = if e.is_empty() { 0 } else { e.parse().ok()? };
            if negative { -magnitude } else { magnitude }
        }
    };
    let scale = exponent - frac_digits.len() as i64 + trailing as i64;
    if scale < 0 {
        return None; // a fraction that is not zero
    }
    // MAX_AMOUNT_CENTS has 13 digits: a longer whole number is over it.
    if significant as i64 + scale > 13 {
        return None;
    }
    let mut value: i64 = 0;
    for b in digits().skip(leading).take(significant) {
        value = value * 10 + i64::from(b - b'0');
    }
    let value = value.checked_mul(10_i64.checked_pow(u32::try_from(scale).ok()?)?)?;
    (value <= MAX_AMOUNT_CENTS).then_some(value)
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
            "1.0000001",
            "1e-3",
            "-5",
            "-5.0",
            "0.0",
            "1e13",
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
        // A whole number written with a fraction or an exponent is that integer.
        for (amount, cents) in [
            ("1999.0", 1999),
            ("1.999e3", 1999),
            ("1.999E+3", 1999),
            ("199900e-2", 1999),
            ("0.01e2", 1),
            ("1e12", MAX_AMOUNT_CENTS),
            ("1000000000000.000000000000000000", MAX_AMOUNT_CENTS),
            ("1e000000000000000000000012", MAX_AMOUNT_CENTS),
        ] {
            let r = parse(format!(r#"{{"order_id":"o","amount_cents":{amount}}}"#).as_bytes())
                .unwrap_or_else(|e| panic!("{amount}: {e}"));
            assert_eq!(r.amount_cents, cents, "{amount}");
        }
        // A fraction a double would round away is still a fraction.
        for amount in [
            "999999999999.99999999999999999",
            "1999.0000000000000001",
            "1.9990000000000000001e3",
            "5e-1",
            "1e-999999999999999999999",
            "1e999999999999999999999",
            "0e5",
            "-0",
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
    fn duplicate_member_is_refused_never_last_wins() {
        let e = parse(br#"{"order_id":"o","amount_cents":1,"amount_cents":99999}"#).unwrap_err();
        assert_eq!(e, RequestError::DuplicateField("amount_cents".into()));
        assert_eq!(e.code(), "duplicate_field");
        assert_eq!(e.field(), Some("amount_cents"));
        // Same value twice is still ambiguous input.
        assert_eq!(
            err(r#"{"order_id":"o","order_id":"o","amount_cents":1}"#),
            "duplicate_field"
        );
        // A member of a nested object may repeat only inside a value that is refused anyway.
        assert_eq!(
            err(r#"{"order_id":"o","amount_cents":1,"currency":{"a":1,"a":2}}"#),
            "invalid_currency"
        );
        assert_eq!(
            err(r#"{"order_id":"o","amount_cents":1,"a":1"#),
            "malformed_json"
        );
    }

    proptest::proptest! {
        /// Whatever the members and their order, a name given twice is refused, and a body
        /// without repeats parses as `serde_json` reads it.
        #[test]
        fn any_repeated_member_is_refused(
            members in proptest::collection::vec(
                (proptest::sample::select(vec!["order_id", "amount_cents", "currency", "x"]),
                 proptest::sample::select(vec!["\"o-1\"", "1", "99999", "\"EUR\"", "null"])),
                0..6,
            )
        ) {
            let body = format!(
                "{{{}}}",
                members.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect::<Vec<_>>().join(",")
            );
            let mut names: Vec<&str> = members.iter().map(|(k, _)| *k).collect();
            names.sort_unstable();
            let repeated = names.windows(2).any(|w| w[0] == w[1]);
            let got = parse(body.as_bytes());
            if repeated {
                proptest::prop_assert_eq!(got.unwrap_err().code(), "duplicate_field");
            } else {
                let map: Members = serde_json::from_str(&body).unwrap();
                proptest::prop_assert_eq!(got, validate(&map));
            }
        }

        /// A whole amount parses as itself however it is written: plainly, with zeros after
        /// a decimal point, or as a mantissa with an exponent.
        #[test]
        fn a_whole_amount_is_itself_in_every_notation(
            cents in 1..=MAX_AMOUNT_CENTS,
            zeros in 0usize..30,
            shift in 0usize..14,
            upper in proptest::bool::ANY,
        ) {
            let digits = cents.to_string();
            let shift = shift.min(digits.len() - 1);
            let (int, frac) = digits.split_at(digits.len() - shift);
            let e = if upper { "E" } else { "e" };
            for text in [
                digits.clone(),
                format!("{digits}.{}", "0".repeat(zeros.max(1))),
                if frac.is_empty() && zeros == 0 {
                    format!("{int}{e}+{shift}")
                } else {
                    format!("{int}.{frac}{}{e}{shift}", "0".repeat(zeros))
                },
                format!("{digits}{}{e}-{zeros}", "0".repeat(zeros)),
            ] {
                let body = format!(r#"{{"order_id":"o","amount_cents":{text}}}"#);
                let r = parse(body.as_bytes());
                proptest::prop_assert_eq!(r.map(|r| r.amount_cents), Ok(cents), "{}", text);
            }
        }

        /// A fraction that is not zero is refused wherever its first non-zero digit sits,
        /// also past what a double can tell apart from the whole number.
        #[test]
        fn a_fraction_that_is_not_zero_is_refused(
            cents in 0..=MAX_AMOUNT_CENTS,
            zeros in 0usize..40,
            digit in 1u8..=9,
            tail in "[0-9]{0,5}",
        ) {
            let text = format!("{cents}.{}{digit}{tail}", "0".repeat(zeros));
            let body = format!(r#"{{"order_id":"o","amount_cents":{text}}}"#);
            proptest::prop_assert_eq!(parse(body.as_bytes()).unwrap_err(), RequestError::InvalidAmount);
        }
    }
}
