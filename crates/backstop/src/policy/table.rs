//! [`MethodPolicies`]: the policies of every method a client calls or a server serves.

use std::collections::HashMap;
use std::fmt;

use http::{Method, Request};

use super::{InvalidPolicy, MethodPolicy, human};
use crate::policy::route::RoutePattern;

/// What an entry of the table applies to.
#[derive(Debug, Clone)]
pub(crate) enum Key {
    /// Every call no other entry names.
    Fallback,
    /// One path: a gRPC method (`/pkg.Service/Method`) or an HTTP path without parameters.
    Path(Box<str>),
    /// Every method of a gRPC service (`pkg.Service`).
    Service(Box<str>),
    /// An HTTP route, `{param}` matching one segment.
    Route(Method, Box<str>),
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Fallback => f.write_str("*"),
            Key::Path(path) => f.write_str(path),
            Key::Service(service) => write!(f, "/{service}/*"),
            Key::Route(method, pattern) => write!(f, "{method} {pattern}"),
        }
    }
}

/// The [`MethodPolicy`] of every method, looked up by request the way a gRPC service config
/// is: the entry for the call's full method path (`/payment.v1.Payment/Charge`) first, then
/// an HTTP route matching its method and path, then the entry for its gRPC service
/// (`payment.v1.Payment`), then the fallback. `Display` prints it as a table.
///
/// A table of one policy (`MethodPolicies::from(policy)`) applies it to every call.
#[derive(Debug, Clone)]
pub struct MethodPolicies {
    /// The fallback first.
    entries: Vec<(Key, MethodPolicy)>,
    paths: HashMap<Box<str>, usize>,
    services: HashMap<Box<str>, usize>,
    routes: Vec<(RoutePattern, usize)>,
    /// The first key declared twice, reported by `validate`.
    duplicate: Option<String>,
}

impl MethodPolicies {
    /// A table whose calls all run by `fallback` until entries are added. A method nobody
    /// declared is best sent once: `MethodPolicy::builder("other", Idempotency::Unsafe)`.
    pub fn new(fallback: MethodPolicy) -> Self {
        Self {
            entries: vec![(Key::Fallback, fallback)],
            paths: HashMap::new(),
            services: HashMap::new(),
            routes: Vec::new(),
            duplicate: None,
        }
    }

    /// Replaces the fallback, the policy of calls no other entry names.
    pub fn fallback(mut self, policy: MethodPolicy) -> Self {
        self.entries[0].1 = policy;
        self
    }

    /// The policy of calls to `path`: a full gRPC method path (`/payment.v1.Payment/Charge`)
    /// or an HTTP path without parameters (`/v1/payments`, whatever the HTTP method).
    pub fn method(mut self, path: impl Into<String>, policy: MethodPolicy) -> Self {
        let path: Box<str> = path.into().into_boxed_str();
        let index = self.push(Key::Path(path.clone()), policy);
        if self.paths.insert(path, index).is_some() {
            self.duplicated(index);
        }
        self
    }

    /// The policy of every method of the gRPC service `service` (`payment.v1.Payment`) that
    /// has no entry of its own.
    pub fn service(mut self, service: impl Into<String>, policy: MethodPolicy) -> Self {
        let service: Box<str> = service.into().into_boxed_str();
        let index = self.push(Key::Service(service.clone()), policy);
        if self.services.insert(service, index).is_some() {
            self.duplicated(index);
        }
        self
    }

    /// The policy of the HTTP route `method pattern`, where `{name}` matches one path segment
    /// (`GET /v1/payments/{id}`).
    pub fn route(mut self, method: Method, pattern: &str, policy: MethodPolicy) -> Self {
        let index = self.push(Key::Route(method.clone(), pattern.into()), policy);
        let key = self.entries[index].0.to_string();
        let twice = self.entries[..index]
            .iter()
            .any(|(k, _)| matches!(k, Key::Route(..)) && k.to_string() == key);
        if twice {
            self.duplicated(index);
        }
        self.routes
            .push((RoutePattern::new(method, pattern), index));
        self
    }

    fn push(&mut self, key: Key, policy: MethodPolicy) -> usize {
        self.entries.push((key, policy));
        self.entries.len() - 1
    }

    fn duplicated(&mut self, index: usize) {
        if self.duplicate.is_none() {
            self.duplicate = Some(self.entries[index].0.to_string());
        }
    }

    /// Checks every policy and that no path, service or route is declared twice; the first
    /// error wins.
    pub fn validate(&self) -> Result<(), InvalidPolicy> {
        if let Some(key) = &self.duplicate {
            return Err(InvalidPolicy::Duplicate { key: key.clone() });
        }
        self.entries.iter().try_for_each(|(_, p)| p.validate())
    }

    /// The table, validated.
    pub fn validated(self) -> Result<Self, InvalidPolicy> {
        self.validate()?;
        Ok(self)
    }

    /// The policy of a gRPC call to `path` (`/payment.v1.Payment/Charge`); HTTP routes are
    /// matched as `POST`, the method every gRPC call uses.
    pub fn for_path(&self, path: &str) -> &MethodPolicy {
        &self.entries[self.select(&Method::POST, path)].1
    }

    /// The policy of `request`, by its method and path.
    pub fn for_request<B>(&self, request: &Request<B>) -> &MethodPolicy {
        &self.entries[self.select(request.method(), request.uri().path())].1
    }

    /// The policy of a request of `method` to `path`, where `path` is the request's path or
    /// the route template the application's router matched (`/v1/payments/{intent_id}`): a
    /// `{param}` segment of a template matches a `{param}` segment of an entry, so the
    /// router's names for parameters need not be the table's.
    pub fn for_route(&self, method: &Method, path: &str) -> &MethodPolicy {
        &self.entries[self.select(method, path)].1
    }

    /// Where the policy [`for_route`](Self::for_route) gives is in [`iter`](Self::iter)'s
    /// order (0: the fallback): for a caller that keeps settings of its own beside each entry.
    ///
    /// ```
    /// use backstop::policy::{Idempotency, MethodPolicies, MethodPolicy};
    /// use http::Method;
    ///
    /// let table = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
    ///     .route(Method::POST, "/v1/orders", MethodPolicy::builder("Order", Idempotency::Keyed).build());
    /// let mine = ["fallback settings", "order settings"];
    /// assert_eq!(mine[table.position_for_route(&Method::POST, "/v1/orders")], "order settings");
    /// assert_eq!(mine[table.position_for_route(&Method::GET, "/v1/orders")], "fallback settings");
    /// ```
    pub fn position_for_route(&self, method: &Method, path: &str) -> usize {
        self.select(method, path)
    }

    /// The policy at `index` of [`select`](Self::select).
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    pub(crate) fn by_index(&self, index: usize) -> &MethodPolicy {
        &self.entries[index].1
    }

    /// What the entry at `index` of [`select`](Self::select) applies to.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    pub(crate) fn key_at(&self, index: usize) -> &Key {
        &self.entries[index].0
    }

    /// The policy of calls no other entry names.
    pub fn fallback_policy(&self) -> &MethodPolicy {
        &self.entries[0].1
    }

    /// Every policy, the fallback first, then in the order they were added.
    pub fn iter(&self) -> impl Iterator<Item = &MethodPolicy> {
        self.entries.iter().map(|(_, p)| p)
    }

    /// Every entry but the fallback, with what it applies to, in the order they were added.
    // The server's idempotency layer walks the table; nothing else does.
    #[cfg_attr(not(feature = "server"), allow(dead_code))]
    pub(crate) fn entries(&self) -> impl Iterator<Item = (&Key, &MethodPolicy)> {
        self.entries.iter().skip(1).map(|(k, p)| (k, p))
    }

    /// Number of policies, the fallback included.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Always `false`: a table has at least its fallback.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The index in [`iter`](Self::iter)'s order of the policy for a call of `method` to
    /// `path`.
    pub(crate) fn select(&self, method: &Method, path: &str) -> usize {
        if self.entries.len() == 1 {
            return 0;
        }
        if let Some(&index) = self.paths.get(path) {
            return index;
        }
        if let Some((_, index)) = self.routes.iter().find(|(r, _)| r.matches(method, path)) {
            return *index;
        }
        grpc_service(path)
            .and_then(|service| self.services.get(service).copied())
            .unwrap_or(0)
    }
}

impl From<MethodPolicy> for MethodPolicies {
    /// A table applying `policy` to every call.
    fn from(policy: MethodPolicy) -> Self {
        Self::new(policy)
    }
}

/// The service of a gRPC method path: `payment.v1.Payment` in `/payment.v1.Payment/Charge`.
pub(crate) fn grpc_service(path: &str) -> Option<&str> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    (!service.is_empty() && !method.is_empty() && !method.contains('/')).then_some(service)
}

impl fmt::Display for MethodPolicies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const HEADER: [&str; 10] = [
            "path",
            "method",
            "idempotency",
            "timeout",
            "retryable",
            "attempts",
            "backoff",
            "hedging",
            "key_ttl",
            "rate_class",
        ];
        // The fallback last, as it is looked up.
        let order = self.entries.iter().skip(1).chain(self.entries.first());
        let rows: Vec<[String; 10]> = order
            .map(|(key, c)| {
                let retryable = if c.retryable.is_empty() {
                    "-".to_owned()
                } else {
                    c.retryable
                        .iter()
                        .map(|code| code.as_str())
                        .collect::<Vec<_>>()
                        .join(",")
                };
                let backoff = if c.max_attempts > 1 {
                    format!(
                        "{}..{} x{}",
                        human(c.backoff.base()),
                        human(c.backoff.cap()),
                        c.backoff.multiplier()
                    )
                } else {
                    "-".to_owned()
                };
                let hedging = if !c.hedging {
                    "no".to_owned()
                } else if let Some(delay) = c.hedge_delay {
                    format!("={}", human(delay))
                } else if c.min_hedge_delay.is_zero() {
                    "p95".to_owned()
                } else {
                    format!(">={}", human(c.min_hedge_delay))
                };
                let hedging = match c.max_hedges {
                    1 => hedging,
                    n if c.hedging => format!("{hedging} x{n}"),
                    _ => hedging,
                };
                [
                    key.to_string(),
                    c.name.clone(),
                    c.idempotency.to_string(),
                    human(c.timeout),
                    retryable,
                    c.max_attempts.to_string(),
                    backoff,
                    hedging,
                    c.key_ttl.map_or_else(|| "-".to_owned(), human),
                    c.rate_class.clone(),
                ]
            })
            .collect();
        let mut widths = HEADER.map(str::len);
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let header = HEADER.map(str::to_owned);
        for row in std::iter::once(&header).chain(&rows) {
            let last = row.len() - 1;
            for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
                if i == last {
                    writeln!(f, "{cell}")?;
                } else {
                    write!(f, "{cell:<w$}  ")?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::policy::{Idempotency, KEY_TTL_PAYMENTS, KEY_TTL_SYNC};
    use crate::status::Code;

    fn named(name: &str) -> MethodPolicy {
        MethodPolicy::builder(name, Idempotency::Safe).build()
    }

    fn table() -> MethodPolicies {
        MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
            .method(
                "/p.Payment/Charge",
                MethodPolicy::builder("Charge", Idempotency::Keyed)
                    .key_ttl(KEY_TTL_SYNC)
                    .build(),
            )
            .service("p.Payment", named("Payment"))
            .route(Method::GET, "/v1/payments/{id}", named("GetPayment"))
            .method("/v1/payments", named("CreatePayment"))
    }

    #[test]
    fn a_call_gets_its_method_then_route_then_service_then_the_fallback() {
        let t = table().validated().unwrap();
        assert_eq!(t.for_path("/p.Payment/Charge").name(), "Charge");
        assert_eq!(t.for_path("/p.Payment/GetCharge").name(), "Payment");
        assert_eq!(t.for_path("/p.Other/Charge").name(), "other");
        assert_eq!(t.for_path("/p.Payment/Charge/x").name(), "other");
        assert_eq!(t.for_path("/v1/payments").name(), "CreatePayment");
        let get = Request::get("http://h/v1/payments/pi_1").body(()).unwrap();
        assert_eq!(t.for_request(&get).name(), "GetPayment");
        let post = Request::post("http://h/v1/payments/pi_1").body(()).unwrap();
        assert_eq!(t.for_request(&post).name(), "other");
        assert_eq!(t.len(), 5);
        assert_eq!(t.iter().next().unwrap().name(), "other");
    }

    #[test]
    fn a_position_is_the_index_of_the_policy_for_route() {
        let t = table().validated().unwrap();
        for (method, path) in [
            (Method::POST, "/p.Payment/Charge"),
            (Method::POST, "/p.Payment/GetCharge"),
            (Method::GET, "/v1/payments/pi_1"),
            (Method::POST, "/v1/payments"),
            (Method::POST, "/elsewhere"),
        ] {
            let at = t.position_for_route(&method, path);
            assert_eq!(
                t.iter().nth(at).unwrap().name(),
                t.for_route(&method, path).name()
            );
        }
        assert_eq!(t.position_for_route(&Method::POST, "/elsewhere"), 0);
    }

    #[test]
    fn one_policy_applies_to_every_call() {
        let t = MethodPolicies::from(named("Echo"));
        assert_eq!(t.for_path("/a.B/C").name(), "Echo");
        assert_eq!(t.for_path("/anything").name(), "Echo");
        assert_eq!(t.fallback_policy().name(), "Echo");
    }

    #[test]
    fn duplicates_and_invalid_policies_are_errors() {
        let twice = table().method("/p.Payment/Charge", named("Again"));
        assert_eq!(
            twice.validate(),
            Err(InvalidPolicy::Duplicate {
                key: "/p.Payment/Charge".into()
            })
        );
        let twice = table().service("p.Payment", named("Again"));
        assert!(matches!(
            twice.validate(),
            Err(InvalidPolicy::Duplicate { .. })
        ));
        let twice = table().route(Method::GET, "/v1/payments/{id}", named("Again"));
        assert!(matches!(
            twice.validate(),
            Err(InvalidPolicy::Duplicate { .. })
        ));
        let keyed_without_ttl = MethodPolicy::builder("Charge", Idempotency::Keyed).build();
        assert!(matches!(
            table()
                .method("/p.Payment/Refund", keyed_without_ttl)
                .validate(),
            Err(InvalidPolicy::KeyedWithoutTtl { .. })
        ));
        let bad_fallback = MethodPolicy::builder("other", Idempotency::Unsafe)
            .hedging(true)
            .build();
        assert!(matches!(
            table().fallback(bad_fallback).validate(),
            Err(InvalidPolicy::HedgingUnsafe { .. })
        ));
    }

    #[test]
    fn display_prints_a_table() {
        let t = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
            .method(
                "/p.Payment/Charge",
                MethodPolicy::builder("Charge", Idempotency::Keyed)
                    .timeout(Duration::from_millis(2_500))
                    .retryable([Code::Unavailable, Code::DeadlineExceeded])
                    .hedging(true)
                    .key_ttl(KEY_TTL_PAYMENTS)
                    .rate_class("payments")
                    .build(),
            )
            .service("p.Payment", named("Payment"))
            .validated()
            .unwrap();
        let printed = t.to_string();
        let lines: Vec<&str> = printed.lines().collect();
        assert_eq!(lines.len(), 4, "{printed}");
        let cells = |line: &str| {
            line.split_whitespace()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            cells(lines[0]),
            [
                "path",
                "method",
                "idempotency",
                "timeout",
                "retryable",
                "attempts",
                "backoff",
                "hedging",
                "key_ttl",
                "rate_class"
            ]
        );
        assert_eq!(
            cells(lines[1]),
            [
                "/p.Payment/Charge",
                "Charge",
                "keyed",
                "2500ms",
                "DEADLINE_EXCEEDED,UNAVAILABLE",
                "3",
                "50ms..2s",
                "x2",
                "p95",
                "7d",
                "payments"
            ]
        );
        assert_eq!(
            cells(lines[2]),
            [
                "/p.Payment/*",
                "Payment",
                "safe",
                "10s",
                "UNAVAILABLE",
                "3",
                "50ms..2s",
                "x2",
                "no",
                "-",
                "default"
            ]
        );
        assert_eq!(
            cells(lines[3]),
            [
                "*", "other", "unsafe", "10s", "-", "1", "-", "no", "-", "default"
            ]
        );
    }
}
