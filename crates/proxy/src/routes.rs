//! The routes in effect, and their reload on SIGHUP.
//!
//! Two stacks read the routes file: the server stack (deadline, rate class, idempotency class,
//! admission) and the client stack that sends requests upstream (attempts, hedging). Both are
//! replaced together: the server stack's table is the library's [`ReloadablePolicies`], and the
//! client side is a [`Generation`] (the table and the client stacks made from it) swapped
//! whole, so a request is forwarded by one table's client policies, never a mix.
//!
//! A reload re-reads the file with the checks of `--check-config`, then refuses what cannot
//! change while the proxy runs ([`check_reload`]); anything refused is logged with the file and
//! the reason, and the routes in effect stay.
//!
//! A request keeps the server table it arrived under (the library's rule); the client side
//! is read when the request is forwarded. The two agree except for a request that arrived
//! just before a reload, and then what matters is kept: a request that arrived keyed is sent
//! at most once unless the routes in effect at the forward say its upstream deduplicates by
//! the effect key (see [`Generation::client_for`]).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use backstop::client::{ClientService, ClientStack, Destination, StackError};
use backstop::policy::{Idempotency, MethodPolicies, MethodPolicy, ReloadablePolicies, Takeover};
use http::Method;

use super::forward::Transport;
use super::policy::{Keying, Route, RouteMatch, RouteTable};
use crate::error_chain::Chain;
use crate::hangups::Hangups;

/// `method` label (of the `rpc_client_*` metrics) of a keyed request sent after a reload
/// made its route not keyed: sent once, by a policy of its own.
pub(crate) const KEYED_BEFORE_RELOAD: &str = "keyed-before-reload";

/// The routes in effect for both stacks; cheap to clone (the clones share them).
#[derive(Clone)]
pub(crate) struct Routes {
    inner: Arc<Inner>,
}

struct Inner {
    /// The server stack's table.
    server: ReloadablePolicies,
    /// The client side.
    current: ArcSwap<Generation>,
    /// What makes a generation's client stacks.
    maker: ClientMaker,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes").finish_non_exhaustive()
    }
}

/// One routes file's table and the client stacks made from it.
pub(crate) struct Generation {
    /// The table.
    pub(crate) table: RouteTable,
    /// Sends each route as far as sending again is safe
    /// ([`RouteTable::client_policies`]).
    client: ClientService<Transport>,
    /// Sends every request once: for a request that arrived keyed on a route a reload has
    /// made not keyed since.
    once: ClientService<Transport>,
}

impl Generation {
    /// The client stack to send a request of `method` and `path` by; `keyed` says whether the
    /// server stack took it as keyed (the table it arrived under). A keyed request whose route
    /// this table does not key (a reload came between its arrival and its forward) is sent
    /// once: its key's record promises it. A keyed request of an `auto` route goes by the
    /// route's own policy, `unsafe`: sent again only on an answer that says nothing ran.
    pub(crate) fn client_for(
        &self,
        method: &Method,
        path: &str,
        keyed: bool,
    ) -> &ClientService<Transport> {
        if keyed && self.table.route_for(method, path).keying() == Keying::Never {
            &self.once
        } else {
            &self.client
        }
    }

    /// Whether a keyed request of `method` and `path` records that it was forwarded before it
    /// is (its route's upstream deduplicates by the effect key, so a run that takes the key
    /// over after a crash forwards again).
    pub(crate) fn resumes(&self, method: &Method, path: &str) -> bool {
        let policy = self.table.policies.for_route(method, path);
        policy.requires_key() && policy.takeover() != Takeover::Refuse
    }
}

/// Makes the client stacks of a table: over one destination (its retry budget, margin and
/// latencies shared by every generation) and one transport (its pooled connections and
/// endpoint breakers shared too).
#[derive(Clone)]
pub(crate) struct ClientMaker {
    pub(crate) destination: Destination,
    pub(crate) transport: Transport,
    pub(crate) replay_cap: usize,
    /// The client stacks' timeout: the deadline is the server stack's.
    pub(crate) max_timeout: Duration,
}

impl ClientMaker {
    fn generation(&self, table: RouteTable) -> Result<Generation, StackError> {
        let stack = |policies: MethodPolicies| {
            ClientStack::builder(&self.destination, policies)
                .replay_cap(self.replay_cap)
                .build()
                .map(|stack| stack.layer(self.transport.clone()))
        };
        let once = MethodPolicy::builder(KEYED_BEFORE_RELOAD, Idempotency::Unsafe)
            .timeout(self.max_timeout)
            .build();
        Ok(Generation {
            client: stack(table.client_policies(self.max_timeout))?,
            once: stack(MethodPolicies::new(once))?,
            table,
        })
    }
}

impl Routes {
    /// `table` in effect for both stacks.
    pub(crate) fn new(table: RouteTable, maker: ClientMaker) -> Result<Routes, StackError> {
        let server = ReloadablePolicies::new(table.policies.clone())?;
        let generation = maker.generation(table)?;
        Ok(Routes {
            inner: Arc::new(Inner {
                server,
                current: ArcSwap::from_pointee(generation),
                maker,
            }),
        })
    }

    /// The server stack's table, for [`ServerStack::reloadable_policies`].
    ///
    /// [`ServerStack::reloadable_policies`]: backstop::server::ServerStack::reloadable_policies
    pub(crate) fn server_policies(&self) -> &ReloadablePolicies {
        &self.inner.server
    }

    /// The client side in effect.
    pub(crate) fn current(&self) -> Arc<Generation> {
        self.inner.current.load_full()
    }

    /// Reads `file` again and puts its routes in effect for the requests that arrive from now
    /// on; otherwise says why, and the routes in effect stay.
    pub(crate) fn reload(&self, file: &Path) -> Result<Arc<Generation>, String> {
        let table = RouteTable::load(file).map_err(|e| e.to_string())?;
        let in_effect = self.current();
        check_reload(&in_effect.table, &table).map_err(|e| format!("{}: {e}", file.display()))?;
        let generation = Arc::new(
            self.inner
                .maker
                .generation(table)
                .map_err(|e| format!("{}: {}", file.display(), Chain(&e)))?,
        );
        self.inner
            .server
            .replace(generation.table.policies.clone())
            .map_err(|e| format!("{}: {e}", file.display()))?;
        self.inner.current.store(generation.clone());
        Ok(generation)
    }
}

/// Refuses what a reload must not change while the proxy runs (the rest of the table may):
///
/// - a request that a keyed route matched must stay keyed: its key's record (kept `key_ttl`)
///   promises a retry the first answer, and a route no longer keyed would forward the retry
///   again. Checked on a path of every route of both tables, so a route removed, made safe or
///   unsafe, or hidden by a new route is refused alike;
/// - a route that keys a request (keyed, or auto for a write that carries a key) keeps its
///   scope (`scope = "shared"` or not): a retry must find its record where the first
///   request left it;
/// - the rate classes and their quotas: their buckets are made at start;
/// - `[proxy] replay_headers`: answers are stored with the headers named at start;
/// - `[proxy] scope_headers`: every record is kept under a scope made of them.
pub(crate) fn check_reload(in_effect: &RouteTable, next: &RouteTable) -> Result<(), String> {
    let restart = "changes only with a restart";
    if next.rate_classes != in_effect.rate_classes {
        return Err(format!(
            "the rate classes and their quotas: [policies.rate_class] {restart} (their buckets \
             are made at start)"
        ));
    }
    if next.replay_headers != in_effect.replay_headers {
        return Err(format!(
            "[proxy] replay_headers {restart} (answers are stored with the headers named at \
             start)"
        ));
    }
    if next.scope_headers != in_effect.scope_headers {
        return Err(format!(
            "[proxy] scope_headers {restart} (every record is kept under a scope made of them)"
        ));
    }
    kept(
        "[policies.fallback]",
        fallback_of(in_effect),
        fallback_of(next),
        "its new settings",
    )?;
    for (method, path) in in_effect
        .routes
        .iter()
        .chain(&next.routes)
        .filter_map(|route| route.matches.as_ref().map(probe))
    {
        let before = in_effect.route_for(&method, &path);
        let after = next.route_for(&method, &path);
        let by = if after.policy.name() == before.policy.name() {
            "its new settings".to_owned()
        } else {
            format!("route {}", after.policy.name())
        };
        kept(
            &format!(
                "route {} ({})",
                before.policy.name(),
                describe(&method, &path)
            ),
            before,
            after,
            &by,
        )?;
    }
    Ok(())
}

fn fallback_of(table: &RouteTable) -> &Route {
    table.routes.last().expect("the fallback")
}

/// Refuses `after` in place of `before` for `what` when it keys fewer requests, or moves keyed
/// ones to another scope; `by` names what made `after`.
fn kept(what: &str, before: &Route, after: &Route, by: &str) -> Result<(), String> {
    let class = |route: &Route| match route.keying() {
        Keying::WhenSent => "auto",
        _ => route.policy.idempotency().as_str(),
    };
    if after.keying() < before.keying() {
        return Err(format!(
            "{what} is {} and stays so until a restart (its keys' records promise a retry the \
             first answer, never a second forward), not {} by {by}",
            class(before),
            class(after),
        ));
    }
    if before.keying() != Keying::Never && after.shared != before.shared {
        return Err(format!(
            "{what} keys requests and keeps its scope until a restart (a retry must find its \
             key's record where the first request left it): scope = \"shared\" {} by {by}",
            if after.shared { "added" } else { "removed" }
        ));
    }
    Ok(())
}

/// `POST /v1/charges`, or `/shop.v1.Orders/Create` for a gRPC path.
fn describe(method: &Method, path: &str) -> String {
    format!("{method} {path}")
}

/// A request a route's `match` takes: its method (`POST` for a path of any method, as gRPC
/// sends) and a path, each `{param}` a segment of its own.
fn probe(matches: &RouteMatch) -> (Method, String) {
    match matches {
        RouteMatch::Route(method, pattern) => {
            let path = pattern
                .split('/')
                .map(|segment| {
                    if segment.starts_with('{') {
                        "0"
                    } else {
                        segment
                    }
                })
                .collect::<Vec<_>>()
                .join("/");
            (method.clone(), path)
        }
        RouteMatch::Path(path) => (Method::POST, path.clone()),
        RouteMatch::Service(service) => (Method::POST, format!("/{service}/ReloadProbe")),
    }
}

/// Reloads the routes on each SIGHUP until the task is dropped; without a routes file, says
/// there is nothing to reload (a hangup must not stop the proxy).
pub(crate) async fn reload_on_hangup(
    mut hangups: Hangups,
    file: Option<std::path::PathBuf>,
    routes: Routes,
) {
    while hangups.recv().await.is_some() {
        let Some(file) = &file else {
            tracing::warn!("SIGHUP: no --config file, nothing to reload");
            continue;
        };
        match routes.reload(file) {
            Ok(generation) => {
                let table = &generation.table;
                tracing::info!(
                    file = %file.display(),
                    routes = table.routes.len() - 1,
                    keyed = table.routes.iter().filter(|r| r.policy.requires_key()).count(),
                    table = %table.policies,
                    "policies reloaded"
                );
            }
            Err(error) => tracing::error!(
                file = %file.display(),
                %error,
                "policy reload refused; the table in effect stays"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IN_EFFECT: &str = r#"
        [[policies.route]]
        match = "POST /v1/charges/{id}"
        name = "Charge"
        idempotency = "keyed"

        [[policies.route]]
        match = "/shop.v1.Orders/*"
        idempotency = "keyed"

        [[policies.route]]
        match = "GET /v1/charges/{id}"
        idempotency = "safe"
        retries = 0

        [policies.rate_class.payments]
        rate = 50

        [proxy]
        replay_headers = ["etag"]
    "#;

    fn check(next: &str) -> Result<(), String> {
        let in_effect = RouteTable::parse(IN_EFFECT).unwrap();
        check_reload(&in_effect, &RouteTable::parse(next).unwrap())
    }

    /// `IN_EFFECT` with `from` replaced by `to`.
    fn edited(from: &str, to: &str) -> String {
        assert!(IN_EFFECT.contains(from), "{from}");
        IN_EFFECT.replace(from, to)
    }

    #[test]
    fn settings_of_a_route_change_and_routes_come_and_go() {
        check(IN_EFFECT).unwrap();
        check(&edited("retries = 0", "retries = 2\ntimeout = \"1s\"")).unwrap();
        check(&edited(
            "name = \"Charge\"\n        idempotency = \"keyed\"",
            "name = \"Charge\"\nidempotency = \"keyed\"\nkey_ttl = \"1h\"\ntimeout = \"2s\"\n\
             upstream_dedups_by_effect_key = true",
        ))
        .unwrap();
        // A route that is not keyed may go, and a new one may be keyed.
        check(&edited(
            "match = \"GET /v1/charges/{id}\"\n        idempotency = \"safe\"\n        retries = 0",
            "match = \"POST /v1/refunds\"\nidempotency = \"keyed\"",
        ))
        .unwrap();
    }

    #[test]
    fn a_keyed_route_stays_keyed() {
        let cases = [
            // Made unsafe.
            edited(
                "name = \"Charge\"\n        idempotency = \"keyed\"",
                "name = \"Charge\"\nidempotency = \"unsafe\"",
            ),
            // Removed.
            edited(
                "match = \"POST /v1/charges/{id}\"\n        name = \"Charge\"\n        idempotency = \"keyed\"",
                "match = \"POST /v1/other\"",
            ),
            // A gRPC service made safe.
            edited(
                "match = \"/shop.v1.Orders/*\"\n        idempotency = \"keyed\"",
                "match = \"/shop.v1.Orders/*\"\nidempotency = \"safe\"",
            ),
        ];
        for next in &cases {
            let error = check(next).unwrap_err();
            assert!(
                error.contains("is keyed and stays so until a restart"),
                "{error}"
            );
        }
        // Hidden by a new route that is not keyed: one declared first (the first route that
        // matches wins), or an exact path (which wins over every route).
        for (hiding, name) in [
            ("match = \"POST /v1/charges/c1\"", "POST /v1/charges/c1"),
            ("match = \"/v1/charges/0\"", "/v1/charges/0"),
        ] {
            let hidden = format!("[[policies.route]]\n{hiding}\n{IN_EFFECT}");
            let error = check(&hidden).unwrap_err();
            assert!(error.contains("route Charge"), "{error}");
            assert!(error.contains(&format!("auto by route {name}")), "{error}");
        }
        // Declared after the keyed route, a route it covers is never reached: nothing changes.
        check(&format!(
            "{IN_EFFECT}\n[[policies.route]]\nmatch = \"POST /v1/charges/c1\"\n"
        ))
        .unwrap();
        // The fallback too.
        let keyed_fallback = "[policies.fallback]\nidempotency = \"keyed\"\n";
        let in_effect = RouteTable::parse(keyed_fallback).unwrap();
        let error = check_reload(&in_effect, &RouteTable::pass_through()).unwrap_err();
        assert!(error.contains("[policies.fallback] is keyed"), "{error}");
        // The default fallback (auto) stays auto.
        let error = check_reload(
            &RouteTable::pass_through(),
            &RouteTable::parse("[policies.fallback]\nidempotency = \"unsafe\"\n").unwrap(),
        )
        .unwrap_err();
        assert!(error.contains("[policies.fallback] is auto"), "{error}");
    }

    #[test]
    fn the_scope_of_keyed_requests_stays() {
        let error = check(&edited(
            "name = \"Charge\"\n        idempotency = \"keyed\"",
            "name = \"Charge\"\nidempotency = \"keyed\"\nscope = \"shared\"",
        ))
        .unwrap_err();
        assert!(error.contains("keeps its scope until a restart"), "{error}");
        // A route that keys nothing may change its scope (its rate limit's only).
        check(&edited(
            "idempotency = \"safe\"\n        retries = 0",
            "idempotency = \"safe\"\nretries = 0\nscope = \"shared\"",
        ))
        .unwrap();
        let error = check(&edited(
            "replay_headers = [\"etag\"]",
            "replay_headers = [\"etag\"]\nscope_headers = [\"x-api-key\"]",
        ))
        .unwrap_err();
        assert!(error.contains("scope_headers"), "{error}");
    }

    #[test]
    fn rate_classes_and_replay_headers_take_a_restart() {
        let error = check(&edited("rate = 50", "rate = 60")).unwrap_err();
        assert!(error.contains("[policies.rate_class]"), "{error}");
        let error = check(&edited("[\"etag\"]", "[\"etag\", \"vary\"]")).unwrap_err();
        assert!(error.contains("replay_headers"), "{error}");
    }

    #[test]
    fn a_probe_is_a_request_the_route_takes() {
        for text in [
            "POST /v1/charges/{id}/capture",
            "/shop.v1.Orders/Create",
            "/shop.v1.Orders/*",
            "GET /",
        ] {
            let matches = RouteMatch::parse(text).unwrap();
            let table = RouteTable::parse(&format!(
                "[[policies.route]]\nmatch = \"{text}\"\nname = \"it\"\n"
            ))
            .unwrap();
            let (method, path) = probe(&matches);
            assert_eq!(
                table.policies.for_route(&method, &path).name(),
                "it",
                "{text}"
            );
        }
    }
}
