//! `[policies]` in `backstop serve --config FILE`: the payment service's method table, tuned
//! from the same file as the flags.
//!
//! ```toml
//! [[policies.route]]
//! match = "POST /v1/payments"
//! timeout = "3s"
//! key_ttl = "30d"
//! rate_class = "charges"
//!
//! [policies.rate_class.charges]
//! rate = 50                      # per merchant, requests per second
//! burst = 100
//! ```
//!
//! The format is the proxy's routes file ([`backstop_proxy::policy`]), so one table reads the
//! same in front of a service and inside one. What differs is whose routes they are: the
//! service's handlers exist already, so the file tunes the entries the service declares
//! ([`POLICY_ENTRIES`]) and its fallback, and nothing else. An entry keeps its idempotency
//! class (the handlers rely on it: `Charge` moves money only under a claimed key), its name
//! (the metrics, the dashboard and the alerts go by it) and its takeover; the timeout, the
//! retries and hedging the service's own clients use, the key TTL and the rate class are the
//! file's to set. Anything else is refused with the entry named, before the service starts.

use std::collections::BTreeMap;

use backstop::admission::Quota;
use backstop::policy::{MethodPolicies, MethodPolicy};
use backstop_payment::config::Config;
use backstop_payment::policies::{POLICY_ENTRIES, check_policies, default_policies};
use backstop_proxy::policy::{PoliciesSection, RouteMatch, RouteSpec};

/// Sets `config.policies` and `config.rate_classes` from a config file's `[policies]` table,
/// over the table the rest of `config` gives (its default timeout and key TTL). The error says
/// what is wrong and where, for a message naming the file.
pub(crate) fn apply(config: &mut Config, section: toml::Value) -> Result<(), String> {
    let section: PoliciesSection = section
        .try_into()
        .map_err(|e: toml::de::Error| format!("[policies]: {}", e.message()))?;
    let base = default_policies(config.default_timeout, config.key_ttl);
    let mut specs: BTreeMap<String, &RouteSpec> = BTreeMap::new();
    for (i, spec) in section.routes.iter().enumerate() {
        let Some(text) = &spec.matches else {
            return Err(format!(
                "[[policies.route]] number {}: `match` is missing",
                i + 1
            ));
        };
        let entry = RouteMatch::parse(text)
            .map_err(|e| format!("[[policies.route]] number {}: match {e}", i + 1))?
            .to_string();
        if !POLICY_ENTRIES.contains(&entry.as_str()) {
            return Err(format!(
                "route {entry}: the service has no such entry; its entries are {}",
                POLICY_ENTRIES.join(", ")
            ));
        }
        if specs.insert(entry.clone(), spec).is_some() {
            return Err(format!("route {entry} is declared twice"));
        }
    }
    let fallback_spec = section.fallback.as_ref();
    if fallback_spec.is_some_and(|spec| spec.matches.is_some()) {
        return Err(
            "[policies.fallback] applies to every request no route names: it takes no \
                    `match`"
                .into(),
        );
    }
    let fallback = tuned(base.fallback_policy(), fallback_spec, "[policies.fallback]")?;
    let mut table = MethodPolicies::new(fallback);
    for entry in POLICY_ENTRIES {
        let what = format!("route {entry}");
        let matches = RouteMatch::parse(entry).expect("the service's entries parse");
        let policy = match &matches {
            RouteMatch::Route(method, pattern) => base.for_route(method, pattern),
            RouteMatch::Path(path) => base.for_path(path),
            RouteMatch::Service(_) => unreachable!("the service declares no whole service"),
        };
        let policy = tuned(policy, specs.get(entry).copied(), &what)?;
        table = match matches {
            RouteMatch::Route(method, pattern) => table.route(method, &pattern, policy),
            RouteMatch::Path(path) => table.method(path, policy),
            RouteMatch::Service(service) => table.service(service, policy),
        };
    }
    let rate_classes: BTreeMap<String, Quota> = section
        .rate_classes
        .iter()
        .map(|(class, spec)| {
            let quota = Quota::per_second(spec.rate, spec.burst.unwrap_or(spec.rate));
            (class.clone(), quota)
        })
        .collect();
    check_policies(&table, &rate_classes)?;
    config.policies = Some(table);
    config.rate_classes = rate_classes;
    Ok(())
}

/// The table `file`'s `[policies]` gives now, over `config` (the settings the service started
/// with): what a reload puts in effect. The rest of the file is not read again (its settings
/// take a restart), nor may the rate classes change: their buckets are made at start.
pub(crate) fn reload(config: &Config, file: &std::path::Path) -> Result<MethodPolicies, String> {
    let mut table = crate::config_file::read(file).map_err(|e| e.to_string().trim().to_owned())?;
    let mut next = config.clone();
    match table.remove(crate::config_file::POLICIES) {
        Some(section) => apply(&mut next, section)?,
        None => {
            next.policies = None;
            next.rate_classes = BTreeMap::new();
        }
    }
    if next.rate_classes != config.rate_classes {
        return Err(
            "the rate classes and their quotas change only with a restart (their buckets are \
             made at start)"
                .into(),
        );
    }
    Ok(next.method_policies())
}

/// `policy` with what `spec` sets; refused where the spec would change what the service's
/// handlers rely on.
fn tuned(
    policy: &MethodPolicy,
    spec: Option<&RouteSpec>,
    what: &str,
) -> Result<MethodPolicy, String> {
    let Some(spec) = spec else {
        return Ok(policy.clone());
    };
    if let Some(name) = &spec.name {
        return Err(format!(
            "{what}: its name is the service's ({}, which its metrics and alerts go by), not \
             {name:?}",
            policy.name()
        ));
    }
    let idempotency = policy.idempotency();
    if spec.scope.is_some() {
        return Err(format!(
            "{what}: scope is the proxy's setting (the service scopes keys by its tenant)"
        ));
    }
    if let Some(wanted) = spec.idempotency {
        let Some(wanted) = wanted.class() else {
            return Err(format!(
                "{what} is {} by the service's handler and stays so (auto is the proxy's)",
                idempotency.as_str()
            ));
        };
        if wanted != idempotency {
            return Err(format!(
                "{what} is {} by the service's handler and stays so (not {})",
                idempotency.as_str(),
                wanted.as_str()
            ));
        }
    }
    if spec.upstream_dedups_by_effect_key.is_some() {
        return Err(format!(
            "{what}: upstream_dedups_by_effect_key is the proxy's setting (the service resumes \
             a dead run's key under the same effect key itself)"
        ));
    }
    Ok(spec.apply(policy.to_builder(), idempotency, what)?.build())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use backstop_payment::config::StoreLocation;
    use http::Method;

    use super::*;

    fn config() -> Config {
        Config::new(StoreLocation::Sqlite("x.db".into()))
    }

    fn applied(text: &str) -> Result<Config, String> {
        let mut file: toml::Table = text.parse().unwrap();
        let mut config = config();
        apply(&mut config, file.remove("policies").unwrap())?;
        config.validate().map_err(|e| e.to_string())?;
        Ok(config)
    }

    #[test]
    fn a_route_is_tuned_and_the_rest_kept() {
        let config = applied(
            r#"
            [[policies.route]]
            match = "POST /v1/payments"
            idempotency = "keyed"
            timeout = "3s"
            key_ttl = "30d"
            rate_class = "charges"

            [[policies.route]]
            match = "/payment.v1.Payment/GetCharge"
            retries = 1

            [policies.fallback]
            timeout = "1s"

            [policies.rate_class.charges]
            rate = 50
            "#,
        )
        .unwrap();
        let table = config.policies.as_ref().unwrap();
        let charge = table.for_route(&Method::POST, "/v1/payments");
        assert_eq!(charge.name(), "Charge");
        assert!(charge.requires_key());
        assert_eq!(charge.timeout(), Duration::from_secs(3));
        assert_eq!(charge.key_ttl(), Some(Duration::from_secs(30 * 86_400)));
        assert_eq!(charge.rate_class(), "charges");
        assert!(charge.hedging(), "what the file leaves is the service's");
        let grpc_charge = table.for_path("/payment.v1.Payment/Charge");
        assert_eq!(grpc_charge.timeout(), config.default_timeout);
        assert_eq!(
            table
                .for_path("/payment.v1.Payment/GetCharge")
                .max_attempts(),
            2
        );
        assert_eq!(table.fallback_policy().timeout(), Duration::from_secs(1));
        let quota = config.rate_classes["charges"];
        assert_eq!(
            quota,
            Quota::per_second(50.try_into().unwrap(), 50.try_into().unwrap())
        );
    }

    #[test]
    fn what_the_handlers_rely_on_is_refused() {
        let cases = [
            (
                "[[policies.route]]\nmatch = \"POST /v1/payments\"\nidempotency = \"unsafe\"\n",
                "is keyed by the service's handler and stays so (not unsafe)",
            ),
            (
                "[[policies.route]]\nmatch = \"/payment.v1.Payment/Charge\"\nidempotency = \"safe\"\n",
                "stays so",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /v1/refunds\"\nidempotency = \"keyed\"\n",
                "the service has no such entry",
            ),
            (
                "[[policies.route]]\nmatch = \"GET /v1/payments/{id}\"\n",
                "no such entry",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /v1/payments\"\nname = \"Pay\"\n",
                "its name is the service's (Charge",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /v1/payments\"\nupstream_dedups_by_effect_key = true\n",
                "the proxy's setting",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /v1/payments\"\nidempotency = \"auto\"\n",
                "auto is the proxy's",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /v1/payments\"\nscope = \"shared\"\n",
                "scope is the proxy's setting",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /v1/payments\"\nrate_class = \"gold\"\n",
                "rate class `gold`",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /v1/payments\"\n[[policies.route]]\nmatch = \"POST /v1/payments\"\n",
                "declared twice",
            ),
            (
                "[[policies.route]]\nmatch = \"GET /v1/payments/{intent_id}\"\nkey_ttl = \"1h\"\n",
                "key_ttl is for keyed routes",
            ),
            (
                "[[policies.route]]\nmatch = \"POST /v1/payments\"\nhedging = true\nretries = 9\n",
                "retries 9",
            ),
            ("[policies]\nroutes = []\n", "routes"),
            (
                "[policies.fallback]\nmatch = \"GET /\"\n",
                "takes no `match`",
            ),
        ];
        for (text, want) in cases {
            let error = applied(text).unwrap_err();
            assert!(error.contains(want), "{text:?}: {error}");
        }
    }

    #[test]
    fn an_empty_section_is_the_services_own_table() {
        let config = applied("[policies]\n").unwrap();
        let ours = config.policies.as_ref().unwrap().to_string();
        assert_eq!(
            ours,
            default_policies(config.default_timeout, config.key_ttl).to_string()
        );
    }
}
