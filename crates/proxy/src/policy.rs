//! The routes file: the library's method policy table ([`MethodPolicies`]) written as TOML.
//!
//! ```toml
//! [policies.fallback]            # every request no route names (optional)
//! timeout = "30s"
//!
//! [[policies.route]]
//! match = "POST /v1/charges"     # HTTP method and path, `{param}` matching one segment
//! idempotency = "keyed"          # safe | keyed | unsafe | auto (default auto)
//! timeout = "5s"
//! key_ttl = "24h"
//! max_replay_body = "1MiB"       # largest answer kept for replay (default --max-replay-body)
//! upstream_dedups_by_effect_key = true
//!
//! [[policies.route]]
//! match = "/shop.v1.Orders/Create"   # a gRPC method (or an HTTP path, any method)
//! idempotency = "keyed"
//!
//! [[policies.route]]
//! match = "GET /v1/catalog"
//! scope = "shared"                # every caller's keys in one scope (default: per caller)
//!
//! [policies.rate_class.payments]
//! rate = 50                       # requests per second
//! burst = 100
//!
//! [proxy]
//! scope_headers = ["authorization", "x-api-key"]   # whose a key is (default authorization)
//! ```
//!
//! A route (or the fallback) that names no `idempotency` is `auto`: a `POST` or `PATCH`
//! carrying an `Idempotency-Key` is keyed, anything else passes through as `unsafe` does. The
//! server stack sees such a request under the route's keyed twin, an entry of the library's
//! table at a path no request has (`Route::keyed_twin`), chosen by the proxy's front.
//!
//! The section is self-contained (`[policies]` and below), so that another command's config
//! file can hold the same table. Every key is checked: one this file does not know is an error
//! naming it, and the table is validated by the library's own rules
//! ([`MethodPolicies::validate`]) before anything starts, and again before a reload on SIGHUP
//! puts it in effect (see `routes`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::num::NonZeroU32;
use std::path::Path;
use std::time::Duration;

use backstop::policy::{
    Idempotency, KEY_TTL_SYNC, MAX_ATTEMPTS_CAP, MethodPolicies, MethodPolicy, MethodPolicyBuilder,
    Takeover,
};
use http::Method;
use serde::{Deserialize, Deserializer};

use super::auto::twin_path;
pub(crate) use super::auto::{KeyedTwin, Keying};
pub use super::route_match::RouteMatch;
use super::scope::ScopeHeaders;

/// Largest routes file read.
const MAX_FILE: u64 = 1 << 20;

/// The whole file: the policy table and the proxy's own settings.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ProxyFile {
    /// The method policy table.
    #[serde(default)]
    pub(crate) policies: PoliciesSection,
    /// Settings of the proxy that are not per route.
    #[serde(default)]
    pub(crate) proxy: ProxySection,
}

/// `[proxy]`: settings that apply to every route.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ProxySection {
    /// Response headers stored with a keyed answer and replayed with it (besides
    /// `Content-Type` and `Location`).
    #[serde(default)]
    pub(crate) replay_headers: Vec<String>,
    /// The request headers whose values (hashed) make a caller's scope (default
    /// `authorization`; `[]`: every caller in one scope). See [`super::scope`].
    pub(crate) scope_headers: Option<Vec<String>>,
}

/// `[policies]`: the fallback, the routes and the rate classes.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoliciesSection {
    /// The policy of requests no route names.
    #[serde(default)]
    pub fallback: Option<RouteSpec>,
    /// The routes, matched in the library's order (exact path, then HTTP route, then gRPC
    /// service, then the fallback).
    #[serde(default, rename = "route")]
    pub routes: Vec<RouteSpec>,
    /// Quotas of the rate classes the routes name.
    #[serde(default, rename = "rate_class")]
    pub rate_classes: BTreeMap<String, RateSpec>,
}

/// One `[[policies.route]]` (or the `[policies.fallback]`, which has no `match`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    /// `METHOD /path/{param}`, `/pkg.Service/Method` (or an HTTP path, any method), or
    /// `/pkg.Service/*` (every method of a gRPC service).
    #[serde(rename = "match")]
    pub matches: Option<String>,
    /// The route's name in `--check-config` and the policy table (default: the `match`
    /// text). The metrics label a request by the `match` text.
    pub name: Option<String>,
    /// `safe`, `keyed`, `unsafe` or `auto` (default).
    pub idempotency: Option<IdempotencySpec>,
    /// `caller` (default: keys and rate limits per caller) or `shared` (one scope for all).
    pub scope: Option<ScopeSpec>,
    /// Budget of a request that brings none.
    #[serde(default, deserialize_with = "duration")]
    timeout: Option<Duration>,
    /// Attempts after the first one.
    retries: Option<u32>,
    /// Whether a slow attempt may be hedged.
    hedging: Option<bool>,
    /// A fixed hedging delay (default: the upstream's rolling p95).
    #[serde(default, deserialize_with = "duration")]
    hedge_delay: Option<Duration>,
    /// How long a keyed route's records (and replayable answers) are kept.
    #[serde(default, deserialize_with = "duration")]
    key_ttl: Option<Duration>,
    /// The largest answer body of a keyed route kept for replay (bytes, or `"64KiB"`); a
    /// larger one is streamed and a retry gets `replay_body_too_large`.
    #[serde(default, deserialize_with = "crate::byte_size::deserialize")]
    max_replay_body: Option<usize>,
    /// The rate class whose quota the route spends.
    rate_class: Option<String>,
    /// The upstream deduplicates by the effect key header: after a crash of the proxy, a retry
    /// forwards again (with the same effect key) instead of answering `outcome_unknown`.
    pub upstream_dedups_by_effect_key: Option<bool>,
}

/// A route's `idempotency`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdempotencySpec {
    /// Safe to repeat: retried and hedged freely.
    Safe,
    /// Forwarded at most once per key, its answer replayed to a retry.
    Keyed,
    /// Never repeated by the proxy.
    Unsafe,
    /// Keyed when a `POST` or `PATCH` carries an `Idempotency-Key`, else unsafe: the proxy's
    /// default.
    Auto,
}

impl IdempotencySpec {
    /// The library's class, or `None` for `auto` (the proxy's alone).
    pub fn class(self) -> Option<Idempotency> {
        match self {
            IdempotencySpec::Safe => Some(Idempotency::Safe),
            IdempotencySpec::Keyed => Some(Idempotency::Keyed),
            IdempotencySpec::Unsafe => Some(Idempotency::Unsafe),
            IdempotencySpec::Auto => None,
        }
    }
}

/// A route's `scope`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScopeSpec {
    /// Keys and rate limits per caller.
    Caller,
    /// One scope for all callers.
    Shared,
}

/// `[policies.rate_class.NAME]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateSpec {
    /// Requests per second.
    pub rate: NonZeroU32,
    /// Requests at once after a quiet spell (default: the rate).
    pub burst: Option<NonZeroU32>,
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = String::deserialize(d)?;
    let parsed = humantime::parse_duration(&text).map_err(|e| {
        serde::de::Error::custom(format!(
            "{text:?} is not a duration like 250ms, 5s or 24h: {e}"
        ))
    })?;
    Ok(Some(parsed))
}

/// One route of the table, as the proxy acts on it.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    /// What it applies to (`None`: the fallback).
    pub(crate) matches: Option<RouteMatch>,
    /// Its policy (an `auto` route's is `unsafe`: a request without a key).
    pub(crate) policy: MethodPolicy,
    /// An `auto` route's keyed twin.
    pub(crate) keyed_twin: Option<KeyedTwin>,
    /// Whether every caller's keys and rate limits share one scope (`scope = "shared"`).
    pub(crate) shared: bool,
}

impl Route {
    /// Whether the upstream deduplicates this keyed route by the effect key, so a retry after
    /// a crash may forward again.
    pub(crate) fn upstream_dedups(&self) -> bool {
        self.policy.takeover() != Takeover::Refuse
    }
}

/// The routes file, read and checked: the table the server stack runs by.
#[derive(Debug, Clone)]
pub(crate) struct RouteTable {
    /// The library's table (the fallback first in [`MethodPolicies::iter`]).
    pub(crate) policies: MethodPolicies,
    /// The routes in file order, the fallback last.
    pub(crate) routes: Vec<Route>,
    /// Quotas of the rate classes.
    pub(crate) rate_classes: BTreeMap<String, RateSpec>,
    /// Headers replayed with a keyed answer, beyond the library's.
    pub(crate) replay_headers: Vec<http::HeaderName>,
    /// `[proxy] scope_headers`, when the file names them.
    pub(crate) scope_headers: Option<Vec<http::HeaderName>>,
}

/// Why a routes file is refused.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub(crate) struct PolicyFileError {
    file: String,
    message: String,
}

impl PolicyFileError {
    pub(crate) fn new(file: &Path, message: impl Into<String>) -> Self {
        Self {
            file: file.display().to_string(),
            message: message.into(),
        }
    }
}

/// The fallback's name: what the metrics call a request no route names.
pub(crate) const FALLBACK_NAME: &str = "other";

impl RouteTable {
    /// The table of a proxy started without a routes file: every request passed through with
    /// the defaults, but a `POST` or `PATCH` carrying an `Idempotency-Key`, which is keyed.
    pub(crate) fn pass_through() -> RouteTable {
        Self::from_file(ProxyFile::default()).expect("the default table is valid")
    }

    /// Reads and checks `path`.
    pub(crate) fn load(path: &Path) -> Result<RouteTable, PolicyFileError> {
        use std::io::Read as _;
        let file = std::fs::File::open(path)
            .map_err(|e| PolicyFileError::new(path, format!("cannot read it: {e}")))?;
        let mut text = String::new();
        file.take(MAX_FILE + 1)
            .read_to_string(&mut text)
            .map_err(|e| PolicyFileError::new(path, format!("cannot read it: {e}")))?;
        if text.len() as u64 > MAX_FILE {
            return Err(PolicyFileError::new(path, "larger than 1 MiB"));
        }
        Self::parse(&text).map_err(|message| PolicyFileError::new(path, message))
    }

    /// Parses and checks the text of a routes file.
    pub(crate) fn parse(text: &str) -> Result<RouteTable, String> {
        let file: ProxyFile = toml::from_str(text).map_err(|e| e.to_string())?;
        Self::from_file(file)
    }

    fn from_file(file: ProxyFile) -> Result<RouteTable, String> {
        let section = file.policies;
        let fallback_spec = section.fallback.unwrap_or_default();
        if fallback_spec.matches.is_some() {
            return Err(
                "[policies.fallback] applies to every request no route names: it \
                        takes no `match`"
                    .into(),
            );
        }
        let fallback = build(&fallback_spec, None)?;
        let mut policies = MethodPolicies::new(fallback.policy.clone());
        let mut routes = Vec::new();
        for (i, spec) in section.routes.iter().enumerate() {
            let Some(text) = &spec.matches else {
                return Err(format!(
                    "[[policies.route]] number {}: `match` is missing",
                    i + 1
                ));
            };
            let matches = RouteMatch::parse(text)
                .map_err(|e| format!("[[policies.route]] number {}: match {e}", i + 1))?;
            let route = build(spec, Some(matches.clone()))?;
            policies = match matches {
                RouteMatch::Route(method, pattern) => {
                    policies.route(method, &pattern, route.policy.clone())
                }
                RouteMatch::Path(path) => policies.method(path, route.policy.clone()),
                RouteMatch::Service(service) => policies.service(service, route.policy.clone()),
            };
            routes.push(route);
        }
        routes.push(fallback);
        for route in &routes {
            if let Some(twin) = &route.keyed_twin {
                policies = policies.method(&*twin.path, twin.policy.clone());
            }
        }
        policies.validate().map_err(|e| e.to_string())?;
        for route in &routes {
            let class = route.policy.rate_class();
            if class != backstop::policy::DEFAULT_RATE_CLASS
                && !section.rate_classes.contains_key(class)
            {
                return Err(format!(
                    "{}: rate class `{class}` has no [policies.rate_class.{class}]",
                    describe(route)
                ));
            }
        }
        let replay_headers = file
            .proxy
            .replay_headers
            .iter()
            .map(|name| {
                http::HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| format!("[proxy] replay_headers: {name:?} is not a header name"))
            })
            .collect::<Result<_, _>>()?;
        let scope_headers = file
            .proxy
            .scope_headers
            .map(|names| {
                names
                    .iter()
                    .map(|name| {
                        http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                            format!("[proxy] scope_headers: {name:?} is not a header name")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;
        Ok(RouteTable {
            policies,
            routes,
            rate_classes: section.rate_classes,
            replay_headers,
            scope_headers,
        })
    }

    /// The route a request of `method` to `path` runs by (the library's match).
    pub(crate) fn route_for(&self, method: &Method, path: &str) -> &Route {
        let fallback = self.routes.len() - 1;
        // The table holds the fallback first, the routes in file order, then the twins.
        match self.policies.position_for_route(method, path) {
            at @ 1.. if at <= fallback => &self.routes[at - 1],
            _ => &self.routes[fallback],
        }
    }

    /// The table the client stack sends requests upstream by: each route's policy as far as
    /// sending it again is safe. A keyed route whose upstream does not deduplicate by the
    /// effect key is sent once (its promise is "forwarded at most once"); a keyed route whose
    /// upstream does, a safe one and an unsafe one keep their attempts and hedging (an unsafe
    /// route retries only answers that say nothing ran, as the library validates). The
    /// timeouts are `max_timeout`: the deadline is the server stack's, never cut again by a
    /// route's timeout.
    pub(crate) fn client_policies(&self, max_timeout: Duration) -> MethodPolicies {
        let sent = |route: &Route| -> MethodPolicy {
            let policy = &route.policy;
            let policy = if policy.requires_key() && !route.upstream_dedups() {
                let mut once = MethodPolicy::builder(policy.name(), Idempotency::Unsafe)
                    .rate_class(policy.rate_class());
                if let Some(ttl) = policy.key_ttl() {
                    once = once.key_ttl(ttl);
                }
                once.build()
            } else {
                policy.clone()
            };
            policy.to_builder().timeout(max_timeout).build()
        };
        let fallback = self.routes.last().expect("the fallback");
        let mut table = MethodPolicies::new(sent(fallback));
        for route in &self.routes {
            table = match &route.matches {
                Some(RouteMatch::Route(method, pattern)) => {
                    table.route(method.clone(), pattern, sent(route))
                }
                Some(RouteMatch::Path(path)) => table.method(path.clone(), sent(route)),
                Some(RouteMatch::Service(service)) => table.service(service.clone(), sent(route)),
                None => table,
            };
        }
        table
    }

    /// Each route's effective policy, in words and as the library's table, for
    /// `--check-config`.
    pub(crate) fn explain(&self, scopes: &ScopeHeaders) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{}", self.policies);
        let _ = writeln!(out, "scope: {}", scopes.describe());
        for route in &self.routes {
            let policy = &route.policy;
            let _ = writeln!(out, "{}:", describe(route));
            let _ = writeln!(
                out,
                "  budget: the caller's (grpc-timeout or a timeout header), else {}; the \
                 upstream gets what is left minus the margin",
                humantime::format_duration(policy.timeout())
            );
            let ttl = humantime::format_duration(policy.key_ttl().unwrap_or(KEY_TTL_SYNC));
            let what = match policy.idempotency() {
                Idempotency::Keyed if route.upstream_dedups() => format!(
                    "keyed: requires an Idempotency-Key; forwarded, and forwarded again only \
                     under the same effect key, while its record lives (key_ttl {ttl}); \
                     answers replayed byte for byte"
                ),
                Idempotency::Keyed => format!(
                    "keyed: requires an Idempotency-Key; forwarded at most once per key while \
                     its record lives (key_ttl {ttl}), answers replayed byte for byte"
                ),
                Idempotency::Safe => "safe: passed through (no side effect declared)".into(),
                Idempotency::Unsafe if route.keyed_twin.is_some() => format!(
                    "auto: a POST or PATCH carrying an Idempotency-Key is keyed, forwarded at \
                     most once per key while its record lives (key_ttl {ttl}), answers replayed \
                     byte for byte; anything else passed through as it came (say \
                     idempotency = \"unsafe\" to pass keys through too)"
                ),
                Idempotency::Unsafe => {
                    "unsafe: passed through, sent once, an Idempotency-Key forwarded as it came"
                        .into()
                }
            };
            let _ = writeln!(out, "  {what}");
            if route.shared {
                let _ = writeln!(
                    out,
                    "  scope shared: every caller's keys and rate limits in one scope"
                );
            }
            if route.keying() != Keying::Never {
                let bound = policy.max_replay_body().map_or_else(
                    || "the --max-replay-body default".to_owned(),
                    |bytes| format!("{bytes} bytes"),
                );
                let _ = writeln!(
                    out,
                    "  answers up to {bound} replayed whole; a larger one streamed, and a retry \
                     gets its status with replay_body_too_large"
                );
                let crash = if route.upstream_dedups() {
                    "forwarded again with the same effect key (the upstream deduplicates by it)"
                } else {
                    "answered 500 outcome_unknown, never forwarded again"
                };
                let _ = writeln!(
                    out,
                    "  a key whose forward the proxy lost in a crash: {crash}"
                );
            }
            let sending = if policy.requires_key() && !route.upstream_dedups() {
                "sent to the upstream once (its upstream does not deduplicate by the effect \
                 key)"
                    .to_owned()
            } else if policy.max_attempts() == 1 {
                "sent to the upstream once".to_owned()
            } else {
                format!(
                    "up to {} attempts on {} (retries paid from the upstream's retry budget), \
                     hedging {}",
                    policy.max_attempts(),
                    policy
                        .retryable()
                        .iter()
                        .map(|code| code.as_str())
                        .collect::<Vec<_>>()
                        .join(","),
                    if policy.hedging() { "on" } else { "off" },
                )
            };
            let _ = writeln!(out, "  {sending}; rate class {}", policy.rate_class());
        }
        out
    }
}

/// `POST /v1/charges (CreateCharge)` or `fallback (other)`.
fn describe(route: &Route) -> String {
    match &route.matches {
        Some(matches) if matches.to_string() == route.policy.name() => matches.to_string(),
        Some(matches) => format!("{matches} ({})", route.policy.name()),
        None => format!("fallback ({})", route.policy.name()),
    }
}

/// The policy a spec describes, with the defaults filled in.
fn build(spec: &RouteSpec, matches: Option<RouteMatch>) -> Result<Route, String> {
    let name = spec.name.clone().unwrap_or_else(|| {
        matches
            .as_ref()
            .map_or_else(|| FALLBACK_NAME.to_owned(), ToString::to_string)
    });
    let what = match &matches {
        Some(m) => format!("route {m}"),
        None => "[policies.fallback]".to_owned(),
    };
    let shared = spec.scope == Some(ScopeSpec::Shared);
    let Some(idempotency) = spec.idempotency.unwrap_or(IdempotencySpec::Auto).class() else {
        // `auto`: unsafe, and keyed by its twin. Its `key_ttl` is its keyed requests'.
        if spec.upstream_dedups_by_effect_key == Some(true) {
            return Err(format!(
                "{what}: upstream_dedups_by_effect_key is for keyed routes (this one is auto: \
                 say idempotency = \"keyed\")"
            ));
        }
        let keyed = MethodPolicy::builder(name.clone(), Idempotency::Keyed).key_ttl(KEY_TTL_SYNC);
        let unsafe_ = MethodPolicy::builder(name, Idempotency::Unsafe);
        return Ok(Route {
            keyed_twin: Some(KeyedTwin {
                path: twin_path(matches.as_ref()),
                policy: spec.apply(keyed, Idempotency::Keyed, &what)?.build(),
            }),
            policy: spec.apply(unsafe_, Idempotency::Keyed, &what)?.build(),
            matches,
            shared,
        });
    };
    let mut builder = MethodPolicy::builder(name, idempotency);
    if idempotency == Idempotency::Keyed {
        builder = builder.key_ttl(KEY_TTL_SYNC);
    }
    builder = spec.apply(builder, idempotency, &what)?;
    match (idempotency, spec.upstream_dedups_by_effect_key) {
        // The forwarder commits a phase before it forwards, so the takeover resumes from it
        // with the same effect key.
        (Idempotency::Keyed, Some(true)) => builder = builder.takeover(Takeover::Resume),
        (_, Some(true)) => {
            return Err(format!(
                "{what}: upstream_dedups_by_effect_key is for keyed routes"
            ));
        }
        _ => {}
    }
    Ok(Route {
        matches,
        policy: builder.build(),
        keyed_twin: None,
        shared,
    })
}

impl RouteSpec {
    /// The settings this spec gives that tune a policy of class `idempotency` (timeout,
    /// retries, hedging, rate class, key TTL), applied onto `builder`; `what` names the spec
    /// in errors. The class itself, the name and the takeover are the caller's.
    pub fn apply(
        &self,
        mut builder: MethodPolicyBuilder,
        idempotency: Idempotency,
        what: &str,
    ) -> Result<MethodPolicyBuilder, String> {
        if let Some(timeout) = self.timeout {
            builder = builder.timeout(timeout);
        }
        if let Some(retries) = self.retries {
            if retries >= MAX_ATTEMPTS_CAP {
                return Err(format!(
                    "{what}: retries {retries} is more than {} (at most {MAX_ATTEMPTS_CAP} \
                     attempts)",
                    MAX_ATTEMPTS_CAP - 1
                ));
            }
            builder = builder.max_attempts(retries + 1);
        }
        if let Some(hedging) = self.hedging {
            builder = builder.hedging(hedging);
        }
        if let Some(delay) = self.hedge_delay {
            builder = builder.hedge_delay(delay);
        }
        if let Some(class) = &self.rate_class {
            builder = builder.rate_class(class.clone());
        }
        match (idempotency, self.key_ttl) {
            (Idempotency::Keyed, Some(ttl)) => builder = builder.key_ttl(ttl),
            (_, Some(_)) => return Err(format!("{what}: key_ttl is for keyed routes")),
            (_, None) => {}
        }
        match (idempotency, self.max_replay_body) {
            (Idempotency::Keyed, Some(bytes)) => builder = builder.max_replay_body(bytes),
            (_, Some(_)) => return Err(format!("{what}: max_replay_body is for keyed routes")),
            (_, None) => {}
        }
        Ok(builder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
        [policies.fallback]
        timeout = "30s"

        [[policies.route]]
        match = "POST /v1/charges"
        name = "CreateCharge"
        idempotency = "keyed"
        timeout = "5s"
        key_ttl = "7d"
        rate_class = "payments"
        max_replay_body = "64KiB"

        [[policies.route]]
        match = "POST /v1/refunds/{id}"
        idempotency = "keyed"
        upstream_dedups_by_effect_key = true

        [[policies.route]]
        match = "GET /v1/charges/{id}"
        idempotency = "safe"
        retries = 2
        hedging = true

        [[policies.route]]
        match = "/shop.v1.Orders/Create"
        idempotency = "keyed"

        [[policies.route]]
        match = "/shop.v1.Catalog/*"
        idempotency = "safe"

        [policies.rate_class.payments]
        rate = 50
        burst = 100

        [proxy]
        replay_headers = ["etag"]
    "#;

    #[test]
    fn a_file_becomes_the_librarys_table() {
        let table = RouteTable::parse(FILE).unwrap();
        let p = &table.policies;
        let charge = p.for_route(&Method::POST, "/v1/charges");
        assert_eq!(charge.name(), "CreateCharge");
        assert!(charge.requires_key());
        assert_eq!(charge.timeout(), Duration::from_secs(5));
        assert_eq!(charge.key_ttl(), Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(charge.rate_class(), "payments");
        assert_eq!(charge.takeover(), Takeover::Refuse);
        assert_eq!(charge.max_replay_body(), Some(64 * 1024));
        let refund = p.for_route(&Method::POST, "/v1/refunds/r1");
        assert_eq!(refund.name(), "POST /v1/refunds/{id}");
        assert_eq!(refund.takeover(), Takeover::Resume);
        assert_eq!(refund.key_ttl(), Some(KEY_TTL_SYNC));
        assert_eq!(refund.max_replay_body(), None, "the flag's default");
        let get = p.for_route(&Method::GET, "/v1/charges/c1");
        assert_eq!((get.max_attempts(), get.hedging()), (3, true));
        assert!(p.for_path("/shop.v1.Orders/Create").requires_key());
        assert_eq!(
            p.for_path("/shop.v1.Catalog/List").name(),
            "/shop.v1.Catalog/*"
        );
        let other = p.for_route(&Method::POST, "/v1/unknown");
        assert_eq!(other.name(), FALLBACK_NAME);
        assert_eq!(other.timeout(), Duration::from_secs(30));
        assert!(!other.requires_key());
        assert!(table.routes[1].upstream_dedups());
        assert!(!table.routes[0].upstream_dedups());
        assert!(table.routes.last().unwrap().matches.is_none());
        assert_eq!(table.replay_headers, [http::header::ETAG]);
        assert_eq!(table.rate_classes["payments"].rate.get(), 50);
    }

    #[test]
    fn explain_names_every_route_and_its_crash_answer() {
        let scopes = ScopeHeaders::resolve(Vec::new(), None).unwrap();
        let text = RouteTable::parse(FILE).unwrap().explain(&scopes);
        for want in [
            "POST /v1/charges (CreateCharge):",
            "POST /v1/refunds/{id}:",
            "fallback (other):",
            "answered 500 outcome_unknown",
            "forwarded again with the same effect key",
            "idempotency",
            "sent to the upstream once (its upstream does not deduplicate",
            "up to 3 attempts on UNAVAILABLE",
            "auto: a POST or PATCH carrying an Idempotency-Key is keyed",
            "scope: keys and rate limits are scoped by caller, a hash of authorization",
            "answers up to 65536 bytes replayed whole",
            "answers up to the --max-replay-body default replayed whole",
        ] {
            assert!(text.contains(want), "{want} missing from:\n{text}");
        }
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let cases = [
            (
                "[[policies.route]]\nmatch = \"GET /\"\nretrys = 2\n",
                "retrys",
            ),
            ("[policies]\nroutes = []\n", "routes"),
            ("[proxy]\nlisten = \"x\"\n", "listen"),
            (
                "[[policies.route]]\nidempotency = \"keyed\"\n",
                "`match` is missing",
            ),
            (
                "[[policies.route]]\nmatch = \"/v1/{id}\"\n",
                "name the HTTP method",
            ),
            ("[[policies.route]]\nmatch = \"v1\"\n", "must start with /"),
            (
                "[[policies.route]]\nmatch = \"GET /a/x{id}\"\n",
                "whole segment",
            ),
            (
                "[[policies.route]]\nmatch = \"GET /\"\nidempotency = \"maybe\"\n",
                "maybe",
            ),
            (
                "[[policies.route]]\nmatch = \"GET /\"\ntimeout = \"soon\"\n",
                "not a duration",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /\"\nhedging = true\n",
                "hedging an unsafe method",
            ),
            (
                "[[policies.route]]\nmatch = \"GET /\"\nidempotency = \"safe\"\nretries = 5\n",
                "retries 5",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /\"\nupstream_dedups_by_effect_key = true\n",
                "for keyed routes",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /\"\nrate_class = \"gold\"\n",
                "rate class `gold`",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /\"\nidempotency = \"unsafe\"\nmax_replay_body = 10\n",
                "max_replay_body is for keyed routes",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /\"\nidempotency = \"keyed\"\nmax_replay_body = \"1MB\"\n",
                "not a size like",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /a\"\n[[policies.route]]\nmatch = \"POST /a\"\n",
                "declared twice",
            ),
            (
                "[policies.fallback]\nmatch = \"GET /\"\n",
                "takes no `match`",
            ),
        ];
        for (text, want) in cases {
            let error = RouteTable::parse(text).unwrap_err();
            assert!(error.contains(want), "{text:?}: {error}");
        }
    }

    #[test]
    fn no_file_keys_a_write_that_carries_a_key_and_passes_the_rest_through() {
        let table = RouteTable::pass_through();
        let policy = table.policies.for_route(&Method::POST, "/anything");
        assert_eq!(policy.name(), FALLBACK_NAME);
        assert_eq!(policy.idempotency(), Idempotency::Unsafe);
        assert_eq!(table.routes.len(), 1);
        let route = table.route_for(&Method::POST, "/anything");
        assert_eq!(route.keying(), Keying::WhenSent);
        let mut keyed = http::HeaderMap::new();
        keyed.insert("idempotency-key", http::HeaderValue::from_static("k1"));
        let twin = route.twin_for(&Method::POST, &keyed).unwrap();
        assert!(table.policies.for_path(twin).requires_key());
        assert_eq!(table.policies.for_path(twin).name(), FALLBACK_NAME);
        let mut grpc = keyed.clone();
        grpc.insert(
            "content-type",
            http::HeaderValue::from_static("application/grpc"),
        );
        assert!(
            route.twin_for(&Method::POST, &grpc).is_none(),
            "gRPC: by a keyed route only"
        );
        assert!(route.twin_for(&Method::PATCH, &keyed).is_some());
        assert!(route.twin_for(&Method::PUT, &keyed).is_none());
        assert!(route.twin_for(&Method::GET, &keyed).is_none());
        assert!(
            route
                .twin_for(&Method::POST, &http::HeaderMap::new())
                .is_none()
        );
    }

    #[test]
    fn unsafe_passes_keys_through_and_scopes_are_read() {
        let table = RouteTable::parse(
            "[policies.fallback]\nidempotency = \"unsafe\"\n\
             [[policies.route]]\nmatch = \"POST /v1/orders\"\nkey_ttl = \"1h\"\n\
             [[policies.route]]\nmatch = \"GET /v1/catalog\"\nidempotency = \"safe\"\n\
             scope = \"shared\"\n\
             [proxy]\nscope_headers = [\"authorization\", \"x-api-key\"]\n",
        )
        .unwrap();
        let other = table.route_for(&Method::POST, "/v1/other");
        assert_eq!(other.keying(), Keying::Never);
        let orders = table.route_for(&Method::POST, "/v1/orders");
        assert_eq!(orders.keying(), Keying::WhenSent);
        let twin = orders.keyed_twin.as_ref().unwrap();
        assert_eq!(twin.policy.key_ttl(), Some(Duration::from_secs(3600)));
        assert!(!orders.shared);
        assert!(table.route_for(&Method::GET, "/v1/catalog").shared);
        assert_eq!(table.scope_headers.as_ref().unwrap().len(), 2);
        for (text, want) in [
            (
                "[proxy]\nscope_headers = [\"bad header\"]\n",
                "not a header name",
            ),
            ("[policies.fallback]\nscope = \"everyone\"\n", "everyone"),
            (
                "[policies.fallback]\nupstream_dedups_by_effect_key = true\n",
                "this one is auto",
            ),
        ] {
            let error = RouteTable::parse(text).unwrap_err();
            assert!(error.contains(want), "{text:?}: {error}");
        }
    }
}
