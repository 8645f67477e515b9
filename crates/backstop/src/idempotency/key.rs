//! [`IdempotencyKey`]: one user intent, one key.

use std::borrow::Cow;
use std::fmt;

/// Longest key accepted, in bytes (= characters: keys are ASCII).
pub const MAX_KEY_LEN: usize = 255;

/// Longest header value considered: a key of [`MAX_KEY_LEN`] characters, every one escaped, in
/// quotes. Anything longer is rejected before it is parsed.
const MAX_HEADER_LEN: usize = 2 * MAX_KEY_LEN + 2;

/// An idempotency key: 1 to 255 visible ASCII characters (`0x21..=0x7E`).
///
/// The client generates it once per logical request, persists it before the first send and
/// reuses it on every retry ([`IdempotencyKey::generate`] gives a UUIDv7). On the wire it is the
/// `Idempotency-Key` header, either a bare value (`Idempotency-Key: 8e03978e-...`, as Stripe
/// sends it) or a Structured Field string (`Idempotency-Key: "8e03978e-..."`, as the IETF httpapi
/// draft specifies); [`IdempotencyKey::parse`] accepts both.
///
/// ```
/// use backstop::idempotency::{IdempotencyKey, KeyError};
///
/// let bare = IdempotencyKey::parse("order-42-attempt")?;
/// let quoted = IdempotencyKey::parse("\"order-42-attempt\"")?;
/// assert_eq!(bare, quoted);
/// assert_eq!(bare.as_str(), "order-42-attempt");
///
/// assert_eq!(IdempotencyKey::parse(""), Err(KeyError::Empty));
/// assert!(matches!(IdempotencyKey::parse(&"k".repeat(256)), Err(KeyError::TooLong { .. })));
/// assert!(matches!(IdempotencyKey::parse("has space"), Err(KeyError::InvalidChar { .. })));
///
/// let fresh = IdempotencyKey::generate();
/// assert_eq!(IdempotencyKey::parse(&fresh.header_value())?, fresh);
/// # Ok::<(), KeyError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

/// Why a string is not an [`IdempotencyKey`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key (or header value) is empty.
    #[error("idempotency key is empty")]
    Empty,
    /// The key is longer than 255 characters (`len` is the length seen, possibly of the raw
    /// header value when that alone is too long).
    #[error("idempotency key is too long ({len} bytes, at most {MAX_KEY_LEN})")]
    TooLong {
        /// Length seen, in bytes.
        len: usize,
    },
    /// The key holds a byte outside visible ASCII (`0x21..=0x7E`).
    #[error("idempotency key has an invalid byte 0x{byte:02x} at {index}")]
    InvalidChar {
        /// Byte offset in the key.
        index: usize,
        /// The offending byte.
        byte: u8,
    },
    /// The value starts with `"` but is not a valid Structured Field string (RFC 9651).
    #[error("idempotency key is not a valid structured-field string")]
    Malformed,
}

impl IdempotencyKey {
    /// Validates `key` as it is (no header unquoting): 1 to 255 visible ASCII characters.
    pub fn new(key: impl Into<String>) -> Result<IdempotencyKey, KeyError> {
        let key = key.into();
        validate(&key)?;
        Ok(IdempotencyKey(key))
    }

    /// Parses an `Idempotency-Key` header value: a bare key, or a Structured Field string
    /// (`"..."`, with `\"` and `\\` escapes; parameters are ignored) whose content is the key.
    /// Surrounding spaces and tabs are ignored. Never panics; rejects values too long to hold a
    /// valid key before looking at them.
    pub fn parse(value: &str) -> Result<IdempotencyKey, KeyError> {
        let value = value.trim_matches([' ', '\t']);
        if value.len() > MAX_HEADER_LEN {
            return Err(KeyError::TooLong { len: value.len() });
        }
        if !value.starts_with('"') {
            return IdempotencyKey::new(value);
        }
        let item: sfv::Item = sfv::Parser::new(value)
            .parse()
            .map_err(|_| KeyError::Malformed)?;
        let inner = item.bare_item.as_string().ok_or(KeyError::Malformed)?;
        IdempotencyKey::new(inner.as_str())
    }

    /// A new random key: a UUIDv7 (time-ordered, so keys sort by creation and index well).
    pub fn generate() -> IdempotencyKey {
        IdempotencyKey(uuid::Uuid::now_v7().to_string())
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as a header value that [`IdempotencyKey::parse`] reads back to this key: the bare
    /// key, or a quoted Structured Field string when the key itself starts with `"`.
    pub fn header_value(&self) -> Cow<'_, str> {
        if self.0.starts_with('"') {
            Cow::Owned(self.to_sf_string())
        } else {
            Cow::Borrowed(&self.0)
        }
    }

    /// The key as a Structured Field string (`"..."`, escaping `"` and `\`), the IETF draft's
    /// form.
    pub fn to_sf_string(&self) -> String {
        let mut out = String::with_capacity(self.0.len() + 2);
        out.push('"');
        for c in self.0.chars() {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }

    /// Consumes the key, returning the string.
    pub fn into_string(self) -> String {
        self.0
    }
}

fn validate(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: key.len() });
    }
    match key.bytes().position(|b| !(0x21..=0x7e).contains(&b)) {
        Some(index) => Err(KeyError::InvalidChar {
            index,
            byte: key.as_bytes()[index],
        }),
        None => Ok(()),
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = KeyError;

    /// Same as [`IdempotencyKey::parse`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        IdempotencyKey::parse(s)
    }
}

impl TryFrom<String> for IdempotencyKey {
    type Error = KeyError;

    /// Same as [`IdempotencyKey::new`].
    fn try_from(s: String) -> Result<Self, Self::Error> {
        IdempotencyKey::new(s)
    }
}

impl From<IdempotencyKey> for String {
    fn from(key: IdempotencyKey) -> String {
        key.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bare_and_quoted_forms_give_the_same_key() {
        let bare = IdempotencyKey::parse("abc-123").unwrap();
        assert_eq!(IdempotencyKey::parse("\"abc-123\"").unwrap(), bare);
        assert_eq!(IdempotencyKey::parse("  abc-123\t").unwrap(), bare);
    }

    #[test]
    fn quoted_form_unescapes_and_ignores_parameters() {
        let k = IdempotencyKey::parse(r#""a\"b\\c";p=1"#).unwrap();
        assert_eq!(k.as_str(), r#"a"b\c"#);
    }

    #[test]
    fn quoted_form_applies_the_same_rules() {
        assert_eq!(IdempotencyKey::parse("\"\""), Err(KeyError::Empty));
        assert!(matches!(
            IdempotencyKey::parse("\"a b\""),
            Err(KeyError::InvalidChar {
                index: 1,
                byte: b' '
            })
        ));
        let long = format!("\"{}\"", "k".repeat(256));
        assert!(matches!(
            IdempotencyKey::parse(&long),
            Err(KeyError::TooLong { len: 256 })
        ));
        let ok = format!("\"{}\"", "k".repeat(255));
        assert_eq!(IdempotencyKey::parse(&ok).unwrap().as_str().len(), 255);
    }

    #[test]
    fn malformed_quoted_values_are_rejected() {
        for bad in ["\"open", "\"a\" trailing", "\"bad\\escape\"", "\"a\",\"b\""] {
            assert_eq!(
                IdempotencyKey::parse(bad),
                Err(KeyError::Malformed),
                "{bad}"
            );
        }
    }

    #[test]
    fn boundary_lengths() {
        assert_eq!(IdempotencyKey::parse(""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse("   "), Err(KeyError::Empty));
        assert!(IdempotencyKey::parse("k").is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        assert_eq!(
            IdempotencyKey::parse(&"k".repeat(256)),
            Err(KeyError::TooLong { len: 256 })
        );
        // Huge input is refused by its length alone.
        assert!(matches!(
            IdempotencyKey::parse(&"\"".repeat(1 << 20)),
            Err(KeyError::TooLong { .. })
        ));
    }

    #[test]
    fn invalid_bytes_are_located() {
        assert_eq!(
            IdempotencyKey::new("ab\u{7f}"),
            Err(KeyError::InvalidChar {
                index: 2,
                byte: 0x7f
            })
        );
        assert_eq!(
            IdempotencyKey::new("é"),
            Err(KeyError::InvalidChar {
                index: 0,
                byte: 0xc3
            })
        );
    }

    #[test]
    fn generated_keys_are_uuid_v7_and_distinct() {
        let a = IdempotencyKey::generate();
        let b = IdempotencyKey::generate();
        assert_ne!(a, b);
        let u = uuid::Uuid::parse_str(a.as_str()).unwrap();
        assert_eq!(u.get_version_num(), 7);
    }

    proptest! {
        #[test]
        fn parse_never_panics(s in ".{0,600}") {
            let _ = IdempotencyKey::parse(&s);
        }

        #[test]
        fn parse_never_panics_on_quoted_input(s in "\"[ -~]{0,300}\"?") {
            let _ = IdempotencyKey::parse(&s);
        }

        #[test]
        fn valid_keys_roundtrip(s in "[!-~]{1,255}") {
            let k = IdempotencyKey::new(s.clone()).unwrap();
            prop_assert_eq!(k.as_str(), s.as_str());
            prop_assert_eq!(&IdempotencyKey::parse(&k.header_value()).unwrap(), &k);
            prop_assert_eq!(&IdempotencyKey::parse(&k.to_sf_string()).unwrap(), &k);
        }

        #[test]
        fn keys_of_256_or_more_are_rejected(s in "[!#-~][!-~]{255,399}") {
            let rejected = matches!(IdempotencyKey::parse(&s), Err(KeyError::TooLong { .. }));
            prop_assert!(rejected);
            let inner: String = s.chars().filter(|c| *c != '"' && *c != '\\').collect();
            if inner.len() >= 256 {
                let quoted = format!("\"{inner}\"");
                let rejected = matches!(IdempotencyKey::parse(&quoted), Err(KeyError::TooLong { .. }));
                prop_assert!(rejected);
            }
        }

        #[test]
        fn accepted_keys_are_visible_ascii(s in "\\PC{0,300}") {
            if let Ok(k) = IdempotencyKey::parse(&s) {
                prop_assert!((1..=255).contains(&k.as_str().len()));
                prop_assert!(k.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
            }
        }
    }
}
