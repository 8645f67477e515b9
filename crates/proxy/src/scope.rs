//! Whose a request's `Idempotency-Key` is: its scope.
//!
//! Records and rate limits are kept per scope (the library's [`Tenant`]): a key reused under
//! another scope is another caller's key, with a record of its own, and only within one scope
//! does the fingerprint check compare bodies. By default a request's scope is a hash of its
//! credentials, the values of the scope headers it carries (`Authorization` unless
//! `--scope-header` or `[proxy] scope_headers` name others); a request carrying none of them,
//! and every request of a route marked `scope = "shared"`, is in the one shared scope
//! ([`Tenant::DEFAULT`], `default`, where every record lived before scopes were credentials).
//!
//! Only the hash is kept: the scope is stored with each record, and a credential must never
//! be. With one credential header present, the scope is what `--scope-header` made of it
//! before, so records written that way keep finding their callers.

use backstop::idempotency::Fingerprint;
use backstop::server::Tenant;
use http::{HeaderMap, HeaderName};

/// The scope headers of a proxy given neither `--scope-header` nor `[proxy] scope_headers`.
pub(crate) const DEFAULT_SCOPE_HEADERS: [HeaderName; 1] = [http::header::AUTHORIZATION];

/// The headers whose values make a request's scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScopeHeaders(Vec<HeaderName>);

impl ScopeHeaders {
    /// The headers in effect: the flag's (`--scope-header`), else the routes file's (`[proxy]
    /// scope_headers`), else [`DEFAULT_SCOPE_HEADERS`]. Both at once are refused: one setting,
    /// said in one place.
    pub(crate) fn resolve(
        flag: Vec<HeaderName>,
        file: Option<&[HeaderName]>,
    ) -> Result<ScopeHeaders, String> {
        match (flag.is_empty(), file) {
            (false, Some(_)) => Err("--scope-header and the routes file's [proxy] \
                                     scope_headers both name the scope headers: give one"
                .into()),
            (false, None) => Ok(ScopeHeaders(flag)),
            (true, Some(file)) => Ok(ScopeHeaders(file.to_vec())),
            (true, None) => Ok(ScopeHeaders(DEFAULT_SCOPE_HEADERS.to_vec())),
        }
    }

    /// The scope of a request with `headers` on a route that is `shared` or not.
    pub(crate) fn scope_of(&self, shared: bool, headers: &HeaderMap) -> Tenant {
        if shared {
            return Tenant::default();
        }
        let mut values = self
            .0
            .iter()
            .flat_map(|name| headers.get_all(name).iter().map(move |value| (name, value)));
        let Some((first_name, first)) = values.next() else {
            return Tenant::default();
        };
        let hash = match values.next() {
            // One value: the hash `--scope-header` always made of it.
            None => Fingerprint::of_bytes("scope", first.as_bytes()),
            // Several: each name and value, NUL-separated. A header value holds no NUL, so no
            // list of them hashes like a single value.
            Some(second) => {
                let mut material = Vec::new();
                for (name, value) in [(first_name, first), second].into_iter().chain(values) {
                    material.extend_from_slice(name.as_str().as_bytes());
                    material.push(0);
                    material.extend_from_slice(value.as_bytes());
                    material.push(0);
                }
                Fingerprint::of_bytes("scope", &material)
            }
        };
        Tenant::new(format!("h:{}", &hash.to_hex()[..32]))
    }

    /// What applies, in one line (the start log and `--check-config`).
    pub(crate) fn describe(&self) -> String {
        if self.0.is_empty() {
            return "every caller shares one scope (scope_headers = [])".into();
        }
        let names = self
            .0
            .iter()
            .map(HeaderName::as_str)
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "keys and rate limits are scoped by caller, a hash of {names} (never the value); a \
             request with none of them, or on a route with scope = \"shared\", is in the shared \
             scope"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, http::HeaderValue::from_static(value));
        }
        map
    }

    fn default() -> ScopeHeaders {
        ScopeHeaders::resolve(Vec::new(), None).unwrap()
    }

    #[test]
    fn a_scope_is_a_hash_of_the_credentials_never_the_value() {
        let scopes = default();
        let alice = scopes.scope_of(false, &headers(&[("authorization", "Bearer alice-token")]));
        assert!(alice.as_str().starts_with("h:"));
        assert_eq!(alice.as_str().len(), 34);
        assert!(!alice.as_str().contains("alice"));
        // What `--scope-header Authorization` made of it before: its records stay its own.
        assert_eq!(alice.as_str(), "h:96e65690325285ca2fba7778335ae326");
        let mallory = scopes.scope_of(false, &headers(&[("authorization", "Bearer mallory")]));
        assert_ne!(alice, mallory);
        assert_eq!(
            scopes.scope_of(false, &headers(&[])).as_str(),
            Tenant::DEFAULT
        );
        assert_eq!(
            scopes
                .scope_of(false, &headers(&[("x-api-key", "k")]))
                .as_str(),
            Tenant::DEFAULT,
            "not a scope header by default"
        );
        let alice_headers = headers(&[("authorization", "Bearer alice-token")]);
        assert_eq!(
            scopes.scope_of(true, &alice_headers).as_str(),
            Tenant::DEFAULT
        );
    }

    #[test]
    fn several_credentials_make_one_scope_of_them_all() {
        let name = |n: &str| HeaderName::from_bytes(n.as_bytes()).unwrap();
        let file = [name("authorization"), name("x-api-key"), name("cookie")];
        let scopes = ScopeHeaders::resolve(Vec::new(), Some(&file)).unwrap();
        let key = scopes.scope_of(false, &headers(&[("x-api-key", "k1")]));
        let both = scopes.scope_of(false, &headers(&[("x-api-key", "k1"), ("cookie", "s=1")]));
        let other_cookie =
            scopes.scope_of(false, &headers(&[("x-api-key", "k1"), ("cookie", "s=2")]));
        assert_ne!(key, both);
        assert_ne!(both, other_cookie);
        assert!(
            scopes
                .describe()
                .contains("authorization, x-api-key, cookie")
        );
        let none = ScopeHeaders::resolve(Vec::new(), Some(&[])).unwrap();
        assert_eq!(
            none.scope_of(false, &headers(&[("authorization", "a")]))
                .as_str(),
            "default"
        );
        assert!(none.describe().contains("every caller shares one scope"));
        assert!(ScopeHeaders::resolve(vec![name("x-api-key")], Some(&file)).is_err());
        assert_eq!(
            ScopeHeaders::resolve(vec![name("x-api-key")], None).unwrap(),
            ScopeHeaders(vec![name("x-api-key")])
        );
    }
}
