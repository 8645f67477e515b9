//! What a `storm run` measured: per second, per variant and in all; printed as JSON, written
//! to `--out` and read by the report.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::storm::kind::ScenarioKind;

/// One second of one variant: the load's series and the server's samples.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Second {
    /// Seconds from the start of the load.
    pub(crate) t_s: f64,
    /// First attempts sent.
    pub(crate) originals: u64,
    /// Retries sent.
    pub(crate) retries: u64,
    /// Hedged copies sent.
    pub(crate) hedges: u64,
    /// Logical requests that succeeded.
    pub(crate) ok: u64,
    /// ... refused by admission.
    pub(crate) rejected: u64,
    /// ... whose deadline passed.
    pub(crate) timeout: u64,
    /// ... that failed otherwise.
    pub(crate) failed: u64,
    /// p99 latency of those that succeeded, in ms.
    pub(crate) p99_ms: Option<f64>,
    /// The gate's limit, as the server published it.
    pub(crate) limit: Option<f64>,
    /// Requests holding a gate slot.
    pub(crate) inflight: Option<f64>,
    /// Requests waiting in the gate's queue.
    pub(crate) queue: Option<f64>,
    /// The server's resident memory, in MiB.
    pub(crate) rss_mib: Option<f64>,
}

/// What one variant did.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct VariantResult {
    /// The variant's name.
    pub(crate) name: String,
    /// Flags its `serve` got.
    pub(crate) serve_flags: Vec<String>,
    /// Flags its `load` got.
    pub(crate) load_flags: Vec<String>,
    /// Logical requests offered per second.
    pub(crate) rate: f64,
    /// The load's own summary (`backstop load --json`).
    pub(crate) load: Value,
    /// Logical requests that succeeded per second of load.
    pub(crate) goodput_per_s: f64,
    /// Attempts sent per logical request.
    pub(crate) attempts_per_logical: f64,
    /// Seconds from the moment the load or the dependency recovered until a whole second
    /// served at least 90% of the offered rate (`None`: never within the run).
    pub(crate) recovery_s: Option<f64>,
    /// Highest resident memory of the server seen, in MiB.
    pub(crate) peak_rss_mib: Option<f64>,
    /// Intents left `running` once the load stopped.
    pub(crate) intents_running: Option<u64>,
    /// The summary of the burst's own `load`, for a scenario with a burst (its counts are in
    /// `seconds`, `goodput_per_s` and `attempts_per_logical` too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) burst_load: Option<Value>,
    /// The scenario's own figures (e.g. the hedge share), by name.
    pub(crate) figures: BTreeMap<String, f64>,
    /// Per second.
    pub(crate) seconds: Vec<Second>,
}

/// What a `storm run` measured.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunResult {
    /// Which scenario.
    pub(crate) scenario: ScenarioKind,
    /// Measured capacity (logical requests per second), for scenarios that offer a multiple.
    pub(crate) capacity_per_s: Option<f64>,
    /// What every duration of the scenario was multiplied by.
    pub(crate) time_scale: f64,
    /// Each variant, in order.
    pub(crate) variants: Vec<VariantResult>,
}
