//! The `auto` class, a route's default: an HTTP `POST` or `PATCH` carrying an
//! `Idempotency-Key` is keyed, anything else passes through as on an `unsafe` route. The
//! server stack sees such a request under the route's keyed twin, an entry of the library's
//! table at a path no request has, which the proxy's front names for it.

use std::sync::Arc;

use backstop::policy::MethodPolicy;
use backstop::server::problem::Protocol;
use http::Method;

use super::policy::{Route, RouteMatch};

/// The policy an `auto` route's keyed requests run by, and where it is in the table.
#[derive(Debug, Clone)]
pub(crate) struct KeyedTwin {
    /// Its path in the library's table ([`twin_path`]).
    pub(crate) path: Arc<str>,
    /// The route's policy, keyed.
    pub(crate) policy: MethodPolicy,
}

/// Which requests of a route are keyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Keying {
    /// None (safe or unsafe).
    Never,
    /// A `POST` or `PATCH` carrying an `Idempotency-Key` (`auto`).
    WhenSent,
    /// Every one (keyed).
    Always,
}

/// Where an `auto` route's keyed twin is in the library's table: a path no request has (a
/// request's path starts with `/`, or is `*`), stable across reloads.
pub(crate) fn twin_path(matches: Option<&RouteMatch>) -> Arc<str> {
    match matches {
        Some(matches) => format!("auto-keyed {matches}").into(),
        None => "auto-keyed fallback".into(),
    }
}

impl Route {
    /// Which of its requests are keyed.
    pub(crate) fn keying(&self) -> Keying {
        if self.policy.requires_key() {
            Keying::Always
        } else if self.keyed_twin.is_some() {
            Keying::WhenSent
        } else {
            Keying::Never
        }
    }

    /// The keyed twin's path a request of `method` with `headers` runs under: on an `auto`
    /// route, an HTTP `POST` or `PATCH` carrying an `Idempotency-Key`. Not a gRPC call: its
    /// streams cannot be read whole, so only a route that says `keyed` keys it.
    pub(crate) fn twin_for(&self, method: &Method, headers: &http::HeaderMap) -> Option<&Arc<str>> {
        let twin = self.keyed_twin.as_ref()?;
        let writes = *method == Method::POST || *method == Method::PATCH;
        (writes
            && headers.contains_key(backstop::server::idempotency::IDEMPOTENCY_KEY)
            && Protocol::of(headers) == Protocol::Http)
            .then_some(&twin.path)
    }
}
