//! [`Fingerprint`]: same key, other parameters must be refused.

use std::fmt;
use std::io::Write;

use serde_json::{Number, Value};
use sha2::{Digest, Sha256};

/// SHA-256 of a request's method and canonical parameters.
///
/// The key says "same intent"; the fingerprint says "same parameters". A store keeps both, and a
/// second request with the same key but another fingerprint is a conflict, answered with the
/// first 8 hex digits of the ORIGINAL fingerprint ([`Fingerprint::prefix8`]) to help debugging.
///
/// [`Fingerprint::of_json`] hashes `method + "\n" + JCS(body)`, where JCS is the RFC 8785 JSON
/// canonical form: object members sorted, no insignificant whitespace, numbers and strings in
/// one spelling. So `{"a":1, "b":2}` and `{"b":2,"a":1}` fingerprint alike, while `{"a":1}` and
/// `{"a":2}` do not.
///
/// ```
/// use backstop::idempotency::Fingerprint;
///
/// let a = Fingerprint::of_json("POST /v1/payments", br#"{"amount_cents":100, "order_id":"o-1"}"#)?;
/// let b = Fingerprint::of_json("POST /v1/payments", br#"{ "order_id": "o-1", "amount_cents": 100 }"#)?;
/// let c = Fingerprint::of_json("POST /v1/payments", br#"{"order_id":"o-1","amount_cents":1000}"#)?;
/// assert_eq!(a, b);
/// assert_ne!(a, c);
/// assert_eq!(a.to_hex().len(), 64);
/// assert_eq!(a.prefix8(), &a.to_hex()[..8]);
/// # Ok::<(), backstop::idempotency::FingerprintError>(())
/// ```
///
/// Numbers are compared as IEEE doubles (RFC 8785 follows I-JSON): integers beyond 2^53 lose
/// precision, so carry such values (and money) as integers of cents or as strings.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

/// Why a fingerprint could not be computed or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FingerprintError {
    /// The body is not JSON.
    #[error("request body is not valid JSON")]
    NotJson(#[source] serde_json::Error),
    /// The JSON could not be put in canonical form (e.g. a number out of the I-JSON range).
    #[error("request body cannot be canonicalized (RFC 8785)")]
    Canonical(#[source] serde_json::Error),
    /// A stored fingerprint is not 64 hex digits.
    #[error("fingerprint is not 64 hex digits")]
    Hex(#[source] hex::FromHexError),
}

impl Fingerprint {
    /// SHA-256 of `method + "\n" + ` the RFC 8785 canonical form of the JSON `body`.
    pub fn of_json(method: &str, body: &[u8]) -> Result<Fingerprint, FingerprintError> {
        json(prefixed(&[method]), body)
    }

    /// SHA-256 of `method + "\n" + body` with the body taken byte for byte, for requests whose
    /// body is not JSON (or is already canonical).
    pub fn of_bytes(method: &str, body: &[u8]) -> Fingerprint {
        bytes(prefixed(&[method]), body)
    }

    /// [`of_json`](Self::of_json) of the operation `verb + " " + path` (as in
    /// `"POST /v1/payments"`), hashed from its parts without building the string.
    ///
    /// ```
    /// use backstop::idempotency::Fingerprint;
    ///
    /// let body = br#"{"amount_cents":100}"#;
    /// assert_eq!(
    ///     Fingerprint::of_json_operation("POST", "/v1/payments", body)?,
    ///     Fingerprint::of_json("POST /v1/payments", body)?,
    /// );
    /// # Ok::<(), backstop::idempotency::FingerprintError>(())
    /// ```
    pub fn of_json_operation(
        verb: &str,
        path: &str,
        body: &[u8],
    ) -> Result<Fingerprint, FingerprintError> {
        json(prefixed(&[verb, " ", path]), body)
    }

    /// [`of_bytes`](Self::of_bytes) of the operation `verb + " " + path`, hashed from its parts
    /// without building the string.
    pub fn of_bytes_operation(verb: &str, path: &str, body: &[u8]) -> Fingerprint {
        bytes(prefixed(&[verb, " ", path]), body)
    }

    /// A fingerprint from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Fingerprint {
        Fingerprint(bytes)
    }

    /// Reads a fingerprint back from [`Fingerprint::to_hex`] form (as stores keep it).
    pub fn from_hex(hex: &str) -> Result<Fingerprint, FingerprintError> {
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(hex, &mut bytes).map_err(FingerprintError::Hex)?;
        Ok(Fingerprint(bytes))
    }

    /// The 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The first 8 hex digits: what a conflict answer shows of the original fingerprint.
    pub fn prefix8(&self) -> String {
        hex::encode(&self.0[..4])
    }
}

/// A hash fed the method, given in pieces hashed one after the other, and the newline.
fn prefixed(method: &[&str]) -> Sha256 {
    let mut hasher = Sha256::new();
    for piece in method {
        hasher.update(piece.as_bytes());
    }
    hasher.update(b"\n");
    hasher
}

fn json(prefixed: Sha256, body: &[u8]) -> Result<Fingerprint, FingerprintError> {
    let value: Value = serde_json::from_slice(body).map_err(FingerprintError::NotJson)?;
    let mut hasher = HashWriter(prefixed);
    write_canonical(&value, &mut hasher).map_err(FingerprintError::Canonical)?;
    Ok(Fingerprint(hasher.0.finalize().into()))
}

fn bytes(mut prefixed: Sha256, body: &[u8]) -> Fingerprint {
    prefixed.update(body);
    Fingerprint(prefixed.finalize().into())
}

/// Writes the RFC 8785 canonical form of `value` to `out`.
///
/// Most request bodies hold only integers, strings and ASCII member names. For those,
/// serde_json's own compact output already is the canonical form, and it costs a fraction of
/// the canonicalizer's, which buffers every member and parses its name again to sort it. Any
/// other value goes through the canonicalizer.
fn write_canonical<W: Write>(value: &Value, out: &mut W) -> serde_json::Result<()> {
    if compact_is_canonical(value) {
        serde_json::to_writer(out, value)
    } else {
        serde_json_canonicalizer::to_writer(value, out)
    }
}

/// Whether serde_json's compact output of `value` is its RFC 8785 form, byte for byte.
///
/// - Strings, member names included: the canonicalizer escapes through serde_json's own
///   escaper, with the same spelling for every escape that escaper produces (`\"`, `\\`,
///   `\b \t \n \f \r`, `\u00xx` in lowercase for the other controls, and nothing else
///   escaped, not even U+2028 and U+2029), so every string is written alike.
/// - Numbers: RFC 8785 writes a number as ECMAScript writes its double. For an integer of
///   magnitude at most 2^53 the double is exact and is written as its decimal digits, as
///   serde_json writes the integer. Fractions, exponents and `-0` parse to floats, larger
///   integers would be rounded: all of them take the canonicalizer.
/// - Member order: RFC 8785 sorts names by UTF-16 code units; serde_json's map iterates by
///   bytes (by insertion with its `preserve_order` feature, which any crate in a build can turn
///   on). The two orders agree on ASCII names, so an object qualifies when its names are ASCII
///   and come strictly ascending by bytes, whatever the map's order.
fn compact_is_canonical(value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(_) | Value::String(_) => true,
        Value::Number(number) => is_exact_integer(number),
        Value::Array(items) => items.iter().all(compact_is_canonical),
        Value::Object(members) => {
            let mut previous: Option<&str> = None;
            members.iter().all(|(name, member)| {
                let ascending =
                    name.is_ascii() && previous.is_none_or(|p| p.as_bytes() < name.as_bytes());
                previous = Some(name);
                ascending && compact_is_canonical(member)
            })
        }
    }
}

/// An integer from -2^53 to 2^53 that serde_json writes as its plain decimal digits.
fn is_exact_integer(number: &Number) -> bool {
    const EXACT: u64 = 1 << 53;
    match (number.as_u64(), number.as_i64()) {
        (Some(n), _) => n <= EXACT,
        // Strictly negative: with serde_json's `arbitrary_precision` a `-0` keeps its spelling
        // and reads as the integer 0 here, but RFC 8785 writes it `0`.
        (None, Some(n)) => n < 0 && n.unsigned_abs() <= EXACT,
        (None, None) => false,
    }
}

/// Feeds the canonical output straight into the hash, without building the string.
struct HashWriter(Sha256);

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const M: &str = "POST /v1/payments";

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::of_json(M, body.as_bytes()).unwrap()
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let a = fp(r#"{"order_id":"o-1","amount_cents":100,"meta":{"x":1,"y":[1,2]}}"#);
        let b = fp(
            "{ \"meta\" : { \"y\" : [ 1 , 2 ] , \"x\" : 1 } ,\n\t\"amount_cents\": 100, \"order_id\": \"o-1\" }",
        );
        assert_eq!(a, b);
    }

    #[test]
    fn number_and_string_spellings_are_canonical() {
        assert_eq!(fp(r#"{"a":1.0}"#), fp(r#"{"a":1}"#));
        assert_eq!(fp(r#"{"a":1e2}"#), fp(r#"{"a":100}"#));
        assert_eq!(fp(r#"{"s":"\u0041"}"#), fp(r#"{"s":"A"}"#));
    }

    #[test]
    fn different_values_differ() {
        assert_ne!(
            fp(r#"{"amount_cents":100}"#),
            fp(r#"{"amount_cents":1000}"#)
        );
        assert_ne!(fp(r#"{"a":"1"}"#), fp(r#"{"a":1}"#));
        assert_ne!(fp(r#"[1,2]"#), fp(r#"[2,1]"#));
        assert_ne!(fp(r#"{"a":null}"#), fp(r#"{}"#));
    }

    #[test]
    fn method_is_part_of_the_fingerprint() {
        let body = br#"{"a":1}"#;
        assert_ne!(
            Fingerprint::of_json("POST /a", body).unwrap(),
            Fingerprint::of_json("POST /b", body).unwrap()
        );
    }

    #[test]
    fn matches_sha256_of_method_newline_canonical_json() {
        let got = fp(r#"{"b":2,"a":1}"#);
        let want: [u8; 32] = Sha256::digest(format!("{M}\n{{\"a\":1,\"b\":2}}")).into();
        assert_eq!(got.as_bytes(), &want);
    }

    #[test]
    fn non_json_is_a_typed_error() {
        for bad in [
            &b"not json"[..],
            b"",
            b"{\"a\":",
            b"\xff\xfe",
            b"{\"a\":1} trailing",
        ] {
            assert!(matches!(
                Fingerprint::of_json(M, bad),
                Err(FingerprintError::NotJson(_))
            ));
        }
    }

    #[test]
    fn hex_roundtrip_and_prefix() {
        let f = fp("{}");
        assert_eq!(Fingerprint::from_hex(&f.to_hex()).unwrap(), f);
        assert_eq!(f.prefix8().len(), 8);
        assert!(f.to_hex().starts_with(&f.prefix8()));
        assert!(matches!(
            Fingerprint::from_hex("zz"),
            Err(FingerprintError::Hex(_))
        ));
    }

    /// The fingerprint as the canonicalizer alone computes it.
    fn through_canonicalizer(body: &[u8]) -> Option<Fingerprint> {
        let value: Value = serde_json::from_slice(body).ok()?;
        let mut hasher = HashWriter(prefixed(&[M]));
        serde_json_canonicalizer::to_writer(&value, &mut hasher).ok()?;
        Some(Fingerprint(hasher.0.finalize().into()))
    }

    /// `value` written by `write_canonical`, and by the canonicalizer alone.
    fn both_ways(value: &Value) -> (Vec<u8>, Vec<u8>) {
        let mut ours = Vec::new();
        write_canonical(value, &mut ours).unwrap();
        (ours, serde_json_canonicalizer::to_vec(value).unwrap())
    }

    fn parse(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn integer_string_and_ascii_name_bodies_take_the_compact_path() {
        for text in [
            r#"{"order_id":"o-8812","amount_cents":1999,"currency":"EUR"}"#,
            r#"{"meta":{"tags":["a","b"],"n":[0,-1,9007199254740992,-9007199254740992]}}"#,
            r#"{"s":"quote \" backslash \\ tab \t nul \u0000 del \u007f ls \u2028 ps \u2029"}"#,
            r#"{"v":"é is fine in a value"}"#,
            r#"{"v":"é 😀 \ud83d\ude00"}"#,
            r#"[null,true,false,{},[]]"#,
            r#""just a string""#,
        ] {
            let value = parse(text);
            assert!(compact_is_canonical(&value), "{text}");
            let (ours, theirs) = both_ways(&value);
            assert_eq!(ours, theirs, "{text}");
        }
    }

    #[test]
    fn floats_big_integers_and_non_ascii_names_take_the_canonicalizer() {
        for text in [
            r#"{"a":1.0}"#,
            r#"{"a":1e2}"#,
            r#"{"a":0.5}"#,
            r#"{"a":-0}"#,
            r#"{"a":-0.0}"#,
            r#"{"a":9007199254740993}"#,
            r#"{"a":-9007199254740993}"#,
            r#"{"a":18446744073709551615}"#,
            r#"{"a":-9223372036854775808}"#,
            r#"[[{"deep":1.5}]]"#,
            r#"{"é":1}"#,
            r#"{"ok":{"\ue000":1}}"#,
        ] {
            let value = parse(text);
            assert!(!compact_is_canonical(&value), "{text}");
            let (ours, theirs) = both_ways(&value);
            assert_eq!(ours, theirs, "{text}");
        }
    }

    #[test]
    fn numbers_are_written_as_their_double() {
        let canonical = |text: &str| String::from_utf8(both_ways(&parse(text)).0).unwrap();
        assert_eq!(canonical("-0"), "0");
        assert_eq!(canonical("-0.0"), "0");
        assert_eq!(canonical("1E2"), "100");
        assert_eq!(canonical("1.50"), "1.5");
        assert_eq!(canonical("1e21"), "1e+21");
        assert_eq!(canonical("9007199254740992"), "9007199254740992");
        // Beyond 2^53 the double rounds: the canonical form says what a JSON reader sees.
        assert_eq!(canonical("9007199254740993"), "9007199254740992");
        assert_eq!(canonical("18446744073709551615"), "18446744073709552000");
    }

    #[test]
    fn names_sort_by_utf16_code_units_not_by_bytes() {
        // U+10000 is D800 DC00 in UTF-16, before U+E000; in UTF-8 it comes after.
        let value = parse(r#"{"\ue000":1,"\ud800\udc00":2,"b":3,"B":4}"#);
        let (ours, theirs) = both_ways(&value);
        assert_eq!(ours, theirs);
        assert_eq!(
            String::from_utf8(ours).unwrap(),
            "{\"B\":4,\"b\":3,\"\u{10000}\":2,\"\u{e000}\":1}"
        );
    }

    #[test]
    fn every_control_character_is_escaped_alike() {
        let controls: String = (0u8..0x20).chain([0x7f]).map(char::from).collect();
        let with_separators = format!("{controls}\u{2028}\u{2029}/\"\\");
        let value = serde_json::json!({ "s": with_separators, "k": { controls.clone(): 1 } });
        let (ours, theirs) = both_ways(&value);
        assert_eq!(ours, theirs);
        let text = String::from_utf8(ours).unwrap();
        assert!(text.contains(r#"\u0000\u0001"#), "{text}");
        assert!(text.contains(r#"\b\t\n\u000b\f\r"#), "{text}");
        assert!(text.contains("\u{7f}\u{2028}\u{2029}/\\\"\\\\"), "{text}");
    }

    #[test]
    fn a_repeated_member_fingerprints_as_its_last_value_either_way() {
        // Refusing repeated members is the request parser's job (the payment service answers
        // `duplicate_field`); the fingerprint reads them as serde_json does, on both paths.
        let body = br#"{"amount_cents":1,"amount_cents":2}"#;
        assert_eq!(
            Fingerprint::of_json(M, body).ok(),
            through_canonicalizer(body)
        );
        assert_eq!(
            Fingerprint::of_json(M, body).unwrap(),
            fp(r#"{"amount_cents":2}"#)
        );
    }

    /// Any JSON value: nested arrays and objects of integers (near +/-2^53 too), floats and
    /// strings, with names of any Unicode (astral and U+E000..U+FFFF ones to test the order).
    fn any_json() -> impl Strategy<Value = Value> {
        const EXACT: i64 = 1 << 53;
        let text = prop_oneof![
            any::<String>(),
            "[a-z\u{0}-\u{1f}\u{7f}\u{80}-\u{ff}\u{2028}\u{2029}\"\\\\/]{0,8}",
        ];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-EXACT - 2..=-EXACT + 2).prop_map(Value::from),
            (EXACT - 2..=EXACT + 2).prop_map(Value::from),
            (-1000i64..1000).prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            (-1000i64..1000).prop_map(|n| Value::from(n as f64 / 8.0)),
            text.prop_map(Value::from),
        ];
        let name = prop_oneof![
            "[a-zA-Z0-9_]{0,6}",
            any::<String>(),
            "[a\u{e000}-\u{ffff}\u{10000}-\u{10ffff}]{1,3}",
        ];
        leaf.prop_recursive(4, 64, 8, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
                proptest::collection::btree_map(name.clone(), inner, 0..8)
                    .prop_map(|members| Value::Object(members.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn compact_path_writes_what_the_canonicalizer_writes(value in any_json()) {
            let (ours, theirs) = both_ways(&value);
            prop_assert_eq!(ours, theirs);
        }

        #[test]
        fn fingerprint_equals_the_canonicalizers(value in any_json()) {
            let body = serde_json::to_vec(&value).unwrap();
            let ours = Fingerprint::of_json(M, &body).unwrap();
            prop_assert_eq!(Some(ours), through_canonicalizer(&body));
        }

        #[test]
        fn every_number_spelling_fingerprints_as_through_the_canonicalizer(
            number in r"-?(0|[1-9][0-9]{0,3}|[1-9][0-9]{14,20})(\.[0-9]{1,4})?([eE][+-]?[0-9]{1,3})?",
        ) {
            for body in [format!(r#"{{"n":{number}}}"#), format!("[{number},1]"), number.clone()] {
                prop_assert_eq!(
                    Fingerprint::of_json(M, body.as_bytes()).ok(),
                    through_canonicalizer(body.as_bytes()),
                    "{}", body
                );
            }
        }

        #[test]
        fn an_operation_in_parts_fingerprints_as_its_formatted_string(
            verb in "[A-Z]{0,8}",
            path in "[ -~]{0,40}",
            value in any_json(),
        ) {
            let body = serde_json::to_vec(&value).unwrap();
            let operation = format!("{verb} {path}");
            prop_assert_eq!(
                Fingerprint::of_json_operation(&verb, &path, &body).unwrap(),
                Fingerprint::of_json(&operation, &body).unwrap()
            );
            prop_assert_eq!(
                Fingerprint::of_bytes_operation(&verb, &path, &body),
                Fingerprint::of_bytes(&operation, &body)
            );
            // The parts are the operation's, not just its bytes in any split.
            prop_assert_ne!(
                Fingerprint::of_bytes_operation(&verb, &path, &body),
                Fingerprint::of_bytes(&format!("{verb}{path}"), &body)
            );
        }

        #[test]
        fn of_json_never_panics(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Fingerprint::of_json(M, &body);
        }

        #[test]
        fn object_member_order_is_irrelevant(entries in proptest::collection::btree_map("[a-z]{1,6}", any::<i32>(), 0..8)) {
            let forward: Vec<String> = entries.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
            let backward: Vec<String> = forward.iter().rev().cloned().collect();
            prop_assert_eq!(
                fp(&format!("{{{}}}", forward.join(","))),
                fp(&format!("{{ {} }}", backward.join(" , ")))
            );
        }
    }
}
