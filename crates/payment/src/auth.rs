//! Bearer API keys to merchants.
//!
//! With keys configured, every `/v1/...` request needs `Authorization: Bearer KEY`; the key
//! names the merchant, which becomes the library's [`Tenant`] request extension. The rate
//! limiter keys its buckets by it, the idempotency layer scopes its records by it (so one
//! merchant's key can never replay another merchant's response) and the handlers scope intents
//! by it. Without keys the service is open and every request is merchant
//! [`DEFAULT_MERCHANT`] (allowed on loopback only, see
//! [`Config::validate`](crate::config::Config::validate)).
//!
//! Keys are compared by their SHA-256 digest through a map lookup, so the time taken does not
//! depend on how many leading bytes of a guess match a real key.

use std::collections::HashMap;
use std::sync::Arc;

use backstop::server::tenant::{Tenant, TenantLayer};
use backstop::status::{Code, Status, problem};
use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::config::{ApiKey, DEFAULT_MERCHANT};

/// Longest `Authorization` value looked at.
const MAX_AUTHORIZATION: usize = 512;

/// Maps bearer keys to merchants. Cheap to clone.
#[derive(Clone)]
pub struct Authenticator {
    keys: Arc<HashMap<[u8; 32], String>>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("merchants", &self.keys.len())
            .field("open", &self.is_open())
            .finish()
    }
}

/// Why a request was not authenticated (all answered 401 `unauthenticated`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization` header.
    #[error("missing Authorization: Bearer header")]
    Missing,
    /// More than one `Authorization` header: which one is meant is ambiguous, so none is
    /// taken.
    #[error("exactly one Authorization header is allowed")]
    Repeated,
    /// Not a `Bearer` credential, or not readable.
    #[error("the Authorization header must be \"Bearer <key>\"")]
    Malformed,
    /// A well-formed key that is not configured.
    #[error("unknown API key")]
    UnknownKey,
}

impl Authenticator {
    /// An authenticator for `keys`; with no keys it is open.
    pub fn new(keys: &[ApiKey]) -> Self {
        let keys = keys
            .iter()
            .map(|k| (digest(k.key.as_bytes()), k.merchant.clone()))
            .collect();
        Authenticator {
            keys: Arc::new(keys),
        }
    }

    /// Whether every request is let in as the default merchant.
    pub fn is_open(&self) -> bool {
        self.keys.is_empty()
    }

    /// The merchant of a request head.
    pub fn authenticate(&self, head: &Parts) -> Result<String, AuthError> {
        if self.is_open() {
            return Ok(DEFAULT_MERCHANT.to_owned());
        }
        let mut values = head.headers.get_all(http::header::AUTHORIZATION).iter();
        let value = values.next().ok_or(AuthError::Missing)?;
        if values.next().is_some() {
            return Err(AuthError::Repeated);
        }
        if value.len() > MAX_AUTHORIZATION {
            return Err(AuthError::Malformed);
        }
        let value = value.to_str().map_err(|_| AuthError::Malformed)?;
        let (scheme, token) = value.split_once(' ').ok_or(AuthError::Malformed)?;
        let token = token.trim();
        if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
            return Err(AuthError::Malformed);
        }
        self.keys
            .get(&digest(token.as_bytes()))
            .cloned()
            .ok_or(AuthError::UnknownKey)
    }

    /// The tower layer setting the [`Tenant`] extension, or answering 401 problem+json
    /// `unauthenticated`.
    pub fn layer(&self) -> TenantLayer {
        let auth = self.clone();
        TenantLayer::from_fn(move |head: &Parts| {
            auth.authenticate(head).map(Tenant::new).map_err(|e| {
                Status::new(Code::Unauthenticated, e.to_string())
                    .with_problem(problem::UNAUTHENTICATED)
            })
        })
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_authorization_headers_are_refused_never_first_wins() {
        let a = Authenticator::new(&[
            ApiKey::parse("acme=key-a").unwrap(),
            ApiKey::parse("globex=key-b").unwrap(),
        ]);
        for second in ["Bearer key-b", "Bearer key-a", "Bearer nope"] {
            let mut h = head(Some("Bearer key-a"));
            h.headers.append("authorization", second.parse().unwrap());
            assert_eq!(a.authenticate(&h), Err(AuthError::Repeated), "{second}");
        }
    }

    fn head(auth: Option<&str>) -> Parts {
        let mut b = http::Request::builder().uri("/v1/payments");
        if let Some(a) = auth {
            b = b.header("authorization", a);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn open_service_is_the_default_merchant() {
        let a = Authenticator::new(&[]);
        assert!(a.is_open());
        assert_eq!(a.authenticate(&head(None)).unwrap(), "default");
        assert_eq!(a.authenticate(&head(Some("Bearer x"))).unwrap(), "default");
    }

    #[test]
    fn keys_name_merchants() {
        let a = Authenticator::new(&[
            ApiKey::parse("acme=key-a").unwrap(),
            ApiKey::parse("globex=key-b").unwrap(),
        ]);
        assert_eq!(a.authenticate(&head(Some("Bearer key-a"))).unwrap(), "acme");
        assert_eq!(
            a.authenticate(&head(Some("bearer key-b"))).unwrap(),
            "globex"
        );
        assert_eq!(a.authenticate(&head(None)), Err(AuthError::Missing));
        assert_eq!(
            a.authenticate(&head(Some("Bearer key-c"))),
            Err(AuthError::UnknownKey)
        );
        assert_eq!(
            a.authenticate(&head(Some("Basic a2V5LWE="))),
            Err(AuthError::Malformed)
        );
        assert_eq!(
            a.authenticate(&head(Some("Bearer "))),
            Err(AuthError::Malformed)
        );
        assert_eq!(
            a.authenticate(&head(Some("key-a"))),
            Err(AuthError::Malformed)
        );
        let long = format!("Bearer {}", "k".repeat(1000));
        assert_eq!(
            a.authenticate(&head(Some(&long))),
            Err(AuthError::Malformed)
        );
        assert!(!format!("{a:?}").contains("key-a"));
    }
}
