//! [`Fingerprint`]: same key, other parameters must be refused.

use std::fmt;
use std::io::Write;

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
        let value: serde_json::Value =
            serde_json::from_slice(body).map_err(FingerprintError::NotJson)?;
        let mut hasher = HashWriter(prefixed(method));
        serde_json_canonicalizer::to_writer(&value, &mut hasher)
            .map_err(FingerprintError::Canonical)?;
        Ok(Fingerprint(hasher.0.finalize().into()))
    }

    /// SHA-256 of `method + "\n" + body` with the body taken byte for byte, for requests whose
    /// body is not JSON (or is already canonical).
    pub fn of_bytes(method: &str, body: &[u8]) -> Fingerprint {
        let mut hasher = prefixed(method);
        hasher.update(body);
        Fingerprint(hasher.finalize().into())
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

fn prefixed(method: &str) -> Sha256 {
    let mut hasher = Sha256::new();
    hasher.update(method.as_bytes());
    hasher.update(b"\n");
    hasher
}

/// Feeds the canonicalizer's output straight into the hash, without building the string.
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

    proptest! {
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
