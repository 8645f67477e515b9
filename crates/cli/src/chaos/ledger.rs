//! Behind a proxy (`--target proxy`): the routes file of the proxies, and the upstream's
//! ledger of effects, read after the run.

use std::error::Error;
use std::time::Duration;

use super::check::PspCharge;
use super::workload;

/// The upstream's effects of one run, by `Idempotency-Key`.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    pub(super) by_key: std::collections::HashMap<String, Vec<PspCharge>>,
}

impl Ledger {
    /// Every effect of the run's keys.
    pub(super) fn total(&self) -> u64 {
        self.by_key.values().map(|e| e.len() as u64).sum()
    }

    /// Reads a ledger's JSON: an array of effects, each with `key`; only the keys of run
    /// `run_id` are kept (an upstream may have served others).
    pub(super) fn parse(json: &str, run_id: &str) -> Result<Ledger, String> {
        let effects: Vec<serde_json::Value> = serde_json::from_str(json)
            .map_err(|e| format!("the ledger is not a JSON array of effects: {e}"))?;
        let prefix = format!("key-{run_id}-");
        let mut ledger = Ledger::default();
        for effect in effects {
            let Some(key) = effect["key"].as_str() else {
                return Err(format!("a ledger entry has no \"key\": {effect}"));
            };
            if !key.starts_with(&prefix) {
                continue;
            }
            let text = |field: &str| effect[field].as_str().unwrap_or_default().to_owned();
            ledger
                .by_key
                .entry(key.to_owned())
                .or_default()
                .push(PspCharge {
                    charge_id: text("effect_id"),
                    effect_key: text("effect_key"),
                });
        }
        Ok(ledger)
    }
}

/// GETs the ledger at `url` (after the workload, while nothing is in flight).
pub(super) async fn read_ledger(url: &str, run_id: &str) -> Result<Ledger, Box<dyn Error>> {
    let http = workload::client(Duration::from_secs(10));
    let response = http
        .get(url)
        .send()
        .await
        .map_err(|e| format!("cannot read the ledger at {url}: {e}"))?;
    if !response.status().is_success() {
        return Err(format!("the ledger at {url} answered {}", response.status()).into());
    }
    let text = response.text().await?;
    Ok(Ledger::parse(&text, run_id).map_err(|e| format!("{url}: {e}"))?)
}

/// The routes file of the proxies of a run: the payments' `path`, keyed, declared
/// deduplicated by the upstream when it `dedups`.
pub(super) fn proxy_routes(path: &str, dedups: bool) -> String {
    format!(
        "[[policies.route]]\nmatch = \"POST {}\"\nname = \"ChaosPayment\"\nidempotency = \"keyed\"\nupstream_dedups_by_effect_key = {}\n",
        path, dedups
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_is_keyed_and_the_ledger_keeps_the_runs_keys() {
        let routes = proxy_routes("/v1/charges", true);
        assert!(routes.contains(r#"match = "POST /v1/charges""#), "{routes}");
        assert!(
            routes.contains("upstream_dedups_by_effect_key = true"),
            "{routes}"
        );

        let ledger = Ledger::parse(
            r#"[{"key":"key-r1-0","effect_key":"k","effect_id":"e"},{"key":"key-r1-0"},
                {"key":"key-other-0"},{"key":"key-r1-1","n":3}]"#,
            "r1",
        )
        .unwrap();
        assert_eq!(ledger.total(), 3);
        assert_eq!(ledger.by_key["key-r1-0"].len(), 2);
        assert_eq!(ledger.by_key["key-r1-0"][0].effect_key, "k");
        assert!(
            Ledger::parse("{}", "r1")
                .unwrap_err()
                .contains("JSON array")
        );
        assert!(
            Ledger::parse(r#"[{"n":1}]"#, "r1")
                .unwrap_err()
                .contains("key")
        );
    }
}
