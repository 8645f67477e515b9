//! Metric and log names, in one place.
//!
//! Dashboards, alerts and their PromQL queries depend on these names, so every layer takes
//! them from here instead of spelling them out. Two rules come with them:
//!
//! - labels have bounded cardinality: `service`, `method`, `outcome` (six values, see
//!   [`Outcome`]), `attempt` (see [`attempt_label`]), `reason`, `result`. Never an
//!   idempotency key, tenant or user id as a label: those go into logs.
//! - the retry ratio is `retries / logical requests`
//!   (`rpc_client_retries_total / rpc_client_requests_total`), never retries / attempts.
//!
//! ```
//! use backstop::observe::{self, Outcome, label};
//!
//! observe::describe_metrics(); // once, after installing a recorder
//! metrics::counter!(
//!     observe::RPC_SERVER_REQUESTS_TOTAL,
//!     label::SERVICE => "payment",
//!     label::METHOD => "Charge",
//!     label::OUTCOME => Outcome::Ok.as_str(),
//! )
//! .increment(1);
//! assert_eq!(observe::attempt_label(2), "2");
//! assert_eq!(observe::attempt_label(9), "6+");
//! ```
//!
//! # Durations are histograms
//!
//! Every duration the library records ([`DURATION_METRICS`]: attempt, request and queue
//! times, in seconds) is meant to be exported as a histogram over
//! [`LATENCY_BUCKETS_SECONDS`]: bucket counts add up across instances, quantile summaries do
//! not, and dashboards and alerts (`histogram_quantile` over `_bucket` series) expect them. A
//! library cannot choose this: `metrics` leaves how a histogram is rendered to the recorder,
//! and `metrics-exporter-prometheus` renders summaries unless told buckets. With the
//! `prometheus` feature, one call on the builder does it, for these metrics only (the
//! application's own histograms keep its settings):
//!
//! ```
//! # #[cfg(feature = "prometheus")] {
//! use metrics_exporter_prometheus::PrometheusBuilder;
//!
//! let recorder = backstop::observe::with_duration_buckets(PrometheusBuilder::new())
//!     .build_recorder();
//! # let _ = recorder;
//! # }
//! ```
//!
//! A recorder of another kind takes [`DURATION_METRICS`] and [`LATENCY_BUCKETS_SECONDS`].

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

pub use crate::status::Outcome;

#[cfg(feature = "trace-context")]
#[cfg_attr(docsrs, doc(cfg(feature = "trace-context")))]
pub mod trace_context;

/// Client: logical requests (one per user intent, whatever the attempts).
pub const RPC_CLIENT_REQUESTS_TOTAL: &str = "rpc_client_requests_total";
/// Client: attempts sent, labelled `attempt` and `outcome`. An attempt refused locally before
/// it was sent (open circuit, too little time left for the margin, adaptive throttling) is
/// none: such a request counts under [`RPC_CLIENT_RETRY_STOPS_TOTAL`] with its reason.
pub const RPC_CLIENT_ATTEMPTS_TOTAL: &str = "rpc_client_attempts_total";
/// Client: retries sent (attempts after the first, hedges excluded).
pub const RPC_CLIENT_RETRIES_TOTAL: &str = "rpc_client_retries_total";
/// Client: hedged attempts.
pub const RPC_CLIENT_HEDGES_TOTAL: &str = "rpc_client_hedges_total";
/// Client: duration of each attempt in seconds, labelled `attempt`.
pub const RPC_CLIENT_ATTEMPT_DURATION_SECONDS: &str = "rpc_client_attempt_duration_seconds";
/// Client: logical requests that failed, by why no further attempt was made, labelled `reason`
/// (one of [`StopReason::as_str`](crate::retry::StopReason::as_str)); a request refused before
/// its first send counts here (`circuit_open`, `deadline`, `throttled`) and under no attempt.
pub const RPC_CLIENT_RETRY_STOPS_TOTAL: &str = "rpc_client_retry_stops_total";
/// Gauge: the storm alarm per destination, labelled `service` and `level` (`warning`,
/// `tripped`): 1 while at or above that level, else 0.
pub const RPC_CLIENT_STORM_ALARM: &str = "rpc_client_storm_alarm";
/// Gauge: attempts waiting for one of their destination's call slots now (see
/// [`CallSlots`](crate::client::slots::CallSlots)), label `service`.
pub const RPC_CLIENT_PENDING_REQUESTS: &str = "rpc_client_pending_requests";
/// Client: how long each attempt waited for a call slot, in seconds (zero when one was free),
/// label `service`.
pub const RPC_CLIENT_PENDING_SECONDS: &str = "rpc_client_pending_seconds";
/// Gauge: the fleet's retry setting this process applies (see
/// [`RetrySwitch`](crate::retry::RetrySwitch)), labelled `setting` (`on`, `off`, `ratio`):
/// 1 for the setting in effect, 0 for the others.
pub const RPC_CLIENT_RETRY_SWITCH: &str = "rpc_client_retry_switch";
/// Gauge: retry-budget tokens a destination has left now (retries and hedges it may still
/// send), label `service`.
pub const RPC_CLIENT_RETRY_BUDGET_TOKENS: &str = "rpc_client_retry_budget_tokens";
/// Gauge: a destination's circuit breaker as of its last change: 0 closed, 1 half-open,
/// 2 open; label `service`.
pub const RPC_CLIENT_BREAKER_STATE: &str = "rpc_client_breaker_state";
/// Gauge, always 1: which backstop library a process runs, label `version`.
pub const BACKSTOP_BUILD_INFO: &str = "backstop_build_info";
/// Server: requests, labelled `outcome`.
pub const RPC_SERVER_REQUESTS_TOTAL: &str = "rpc_server_requests_total";
/// Server: request duration in seconds.
pub const RPC_SERVER_DURATION_SECONDS: &str = "rpc_server_duration_seconds";
/// Server: requests being served now.
pub const RPC_SERVER_INFLIGHT: &str = "rpc_server_inflight";
/// Server: the concurrency limit of the gate now (fixed or adaptive), labelled `service`.
pub const RPC_SERVER_CONCURRENCY_LIMIT: &str = "rpc_server_concurrency_limit";
/// Server: requests holding a slot under the concurrency limit now, labelled `service`.
pub const RPC_SERVER_CONCURRENCY_INFLIGHT: &str = "rpc_server_concurrency_inflight";
/// Server: requests waiting for a slot in the gate's queue now, labelled `service`.
pub const RPC_SERVER_QUEUE_LENGTH: &str = "rpc_server_queue_length";
/// Server: time admitted requests waited in the gate's queue in seconds (zero for those
/// admitted at once), labelled `service`.
pub const RPC_SERVER_QUEUE_DELAY_SECONDS: &str = "rpc_server_queue_delay_seconds";
/// Server: requests refused by admission control, labelled `reason` (see [`reject_reason`]).
pub const RPC_SERVER_REJECTED_TOTAL: &str = "rpc_server_rejected_total";
/// Server: connections open now, per listener (`service`).
pub const RPC_SERVER_CONNECTIONS: &str = "rpc_server_connections";
/// Server: connections refused or closed by the connection cap, labelled `reason` (see
/// [`connection_rejected`]).
pub const RPC_SERVER_CONNECTIONS_REJECTED_TOTAL: &str = "rpc_server_connections_rejected_total";
/// Server: connections asked to go elsewhere under sustained overload (HTTP/2 `GOAWAY`,
/// HTTP/1.1 `Connection: close`), labelled `protocol` (see [`protocol`]).
pub const RPC_SERVER_CONNECTIONS_PUSHED_TOTAL: &str = "rpc_server_connections_pushed_total";
/// Server: idempotency claims, labelled `result` (see [`claim_result`]).
pub const IDEMPOTENCY_CLAIMS_TOTAL: &str = "idempotency_claims_total";
/// Server: injected faults, labelled `fault` (`abort`, `delay`).
pub const RPC_SERVER_FAULTS_INJECTED_TOTAL: &str = "rpc_server_faults_injected_total";
/// Server: rate-limit decisions made without Redis because it failed or did not answer in
/// time, labelled `result` (see [`redis_unavailable_result`]).
pub const RATE_LIMIT_REDIS_UNAVAILABLE_TOTAL: &str = "rate_limit_redis_unavailable_total";

/// Histogram buckets (seconds) for the duration metrics, 250 µs (a loopback or same-rack call)
/// to 10 s. Exporters should render the durations as histograms over these buckets: bucket
/// counts add up across instances (quantile summaries do not), and recording a sample is a
/// bucket increment instead of a sketch update.
pub const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Every histogram the library records: durations in seconds, each to be exported as a
/// histogram over [`LATENCY_BUCKETS_SECONDS`] (see [Durations are histograms](self#durations-are-histograms)).
pub const DURATION_METRICS: [&str; 4] = [
    RPC_CLIENT_ATTEMPT_DURATION_SECONDS,
    RPC_CLIENT_PENDING_SECONDS,
    RPC_SERVER_DURATION_SECONDS,
    RPC_SERVER_QUEUE_DELAY_SECONDS,
];

/// `builder` set to render every metric of [`DURATION_METRICS`] as a histogram over
/// [`LATENCY_BUCKETS_SECONDS`] rather than as the exporter's default quantile summary; other
/// metrics keep the builder's settings. Call it before building or installing the recorder:
///
/// ```
/// use metrics_exporter_prometheus::PrometheusBuilder;
///
/// let recorder = backstop::observe::with_duration_buckets(PrometheusBuilder::new())
///     .build_recorder();
/// # let _ = recorder;
/// ```
///
/// Buckets a builder sets for every histogram ([`set_buckets`]) take precedence, as the
/// exporter rules.
///
/// [`set_buckets`]: metrics_exporter_prometheus::PrometheusBuilder::set_buckets
#[cfg(feature = "prometheus")]
#[cfg_attr(docsrs, doc(cfg(feature = "prometheus")))]
pub fn with_duration_buckets(
    builder: metrics_exporter_prometheus::PrometheusBuilder,
) -> metrics_exporter_prometheus::PrometheusBuilder {
    use metrics_exporter_prometheus::Matcher;
    DURATION_METRICS.iter().fold(builder, |builder, name| {
        builder
            .set_buckets_for_metric(Matcher::Full((*name).to_owned()), LATENCY_BUCKETS_SECONDS)
            .expect("LATENCY_BUCKETS_SECONDS is not empty")
    })
}

/// Label names.
pub mod label {
    /// The service name; on every metric.
    pub const SERVICE: &str = "service";
    /// The method name; on every metric.
    pub const METHOD: &str = "method";
    /// One of the six [`Outcome`](super::Outcome) values.
    pub const OUTCOME: &str = "outcome";
    /// The attempt number, see [`attempt_label`](super::attempt_label).
    pub const ATTEMPT: &str = "attempt";
    /// Why a request was refused, see [`reject_reason`](super::reject_reason).
    pub const REASON: &str = "reason";
    /// The result of an idempotency claim, see [`claim_result`](super::claim_result).
    pub const RESULT: &str = "result";
    /// The library's version, on [`BACKSTOP_BUILD_INFO`](super::BACKSTOP_BUILD_INFO).
    pub const VERSION: &str = "version";
    /// The storm alarm level, on [`RPC_CLIENT_STORM_ALARM`](super::RPC_CLIENT_STORM_ALARM).
    pub const LEVEL: &str = "level";
    /// The retry switch's setting, on [`RPC_CLIENT_RETRY_SWITCH`](super::RPC_CLIENT_RETRY_SWITCH).
    pub const SETTING: &str = "setting";
    /// The kind of injected fault, on
    /// [`RPC_SERVER_FAULTS_INJECTED_TOTAL`](super::RPC_SERVER_FAULTS_INJECTED_TOTAL).
    pub const FAULT: &str = "fault";
    /// The HTTP version of a connection, see [`protocol`](super::protocol).
    pub const PROTOCOL: &str = "protocol";
}

/// Values of the `protocol` label on [`RPC_SERVER_CONNECTIONS_PUSHED_TOTAL`].
pub mod protocol {
    /// HTTP/1.0 or HTTP/1.1.
    pub const HTTP1: &str = "http1";
    /// HTTP/2 (gRPC, h2c).
    pub const HTTP2: &str = "http2";
}

/// Values of the `reason` label on [`RPC_SERVER_REJECTED_TOTAL`].
pub mod reject_reason {
    /// The server's own capacity (gate full): 503.
    pub const OVERLOADED: &str = "overloaded";
    /// The tenant's quota: 429.
    pub const RATE_LIMITED: &str = "rate_limited";
    /// Too little time left to serve the request in time: refused at the gate, or dropped
    /// from its queue before being served.
    pub const DEADLINE: &str = "deadline";
    /// Waited in the gate's queue longer than it allows (a standing queue formed): 503.
    pub const SOJOURN: &str = "sojourn";
    /// A retry refused before first attempts while the gate sheds (criticality): 503.
    pub const RETRY: &str = "retry";
    /// The gate's queue is at its bound, by count or by memory: 503.
    pub const FULL: &str = "full";
    /// The tenant holds more than its share of the gate's queue: 503.
    pub const TENANT_SHARE: &str = "tenant_share";
    /// The shared rate limiter (Redis) is unavailable and fails closed: 503.
    pub const RATE_LIMITER_UNAVAILABLE: &str = "rate_limiter_unavailable";
}

/// Values of the `reason` label on [`RPC_SERVER_CONNECTIONS_REJECTED_TOTAL`].
pub mod connection_rejected {
    /// A new connection closed at once: every open one was serving a request.
    pub const REFUSED: &str = "refused";
    /// An idle or slow connection (no request in flight) closed to make room for a new one.
    pub const EVICTED: &str = "evicted";
}

/// Values of the `result` label on [`RATE_LIMIT_REDIS_UNAVAILABLE_TOTAL`].
pub mod redis_unavailable_result {
    /// Failure open: decided by the instance's local fallback bucket.
    pub const FALLBACK: &str = "fallback";
    /// Failure closed: refused with 503.
    pub const REJECTED: &str = "rejected";
}

/// Values of the `result` label on [`IDEMPOTENCY_CLAIMS_TOTAL`].
pub mod claim_result {
    /// The key was free (or taken over): this request runs.
    pub const CLAIMED: &str = "claimed";
    /// A stored response was replayed.
    pub const REPLAY: &str = "replay";
    /// The key was used with other parameters.
    pub const CONFLICT: &str = "conflict";
    /// Another request with the key is running.
    pub const IN_PROGRESS: &str = "in_progress";
}

/// Log event names (the tracing event name, message and `event` field), and the fields of
/// `rpc_attempt`.
pub mod event {
    /// Client: one attempt ended.
    pub const RPC_ATTEMPT: &str = "rpc_attempt";
    /// Client: a logical request failed and no further attempt was made, with the `reason`.
    pub const RPC_RETRY_STOPPED: &str = "rpc_retry_stopped";
    /// Client: an attempt got no answer within the attempt limit and was left for the next.
    pub const RPC_ATTEMPT_ABANDONED: &str = "rpc_attempt_abandoned";
    /// Client: an attempt that never reached the server is sent again.
    pub const RPC_TRANSPARENT_RETRY: &str = "rpc_transparent_retry";
    /// Client: the storm alarm of a destination changed level.
    pub const RPC_STORM_ALARM: &str = "rpc_storm_alarm";
    /// Client: the fleet's retry switch changed setting in this process.
    pub const RPC_RETRY_SWITCH: &str = "rpc_retry_switch";
    /// Server: one request served (the server metrics layer's event).
    pub const RPC_SERVER_REQUEST: &str = "rpc_server_request";
    /// Field: timestamp.
    pub const TS: &str = "ts";
    /// Field: method.
    pub const METHOD: &str = "method";
    /// Field: idempotency key (a log field, never a metric label).
    pub const IDEMPOTENCY_KEY: &str = "idempotency_key";
    /// Field: attempt number, 1-based.
    pub const ATTEMPT: &str = "attempt";
    /// Field: outcome label.
    pub const OUTCOME: &str = "outcome";
    /// Field: time left before the deadline when the attempt started, in milliseconds.
    pub const DEADLINE_REMAINING_MS: &str = "deadline_remaining_ms";
    /// Field: peer address.
    pub const PEER: &str = "peer";
    /// Field: W3C trace id.
    pub const TRACE_ID: &str = "trace_id";
}

/// The `attempt` label for a 1-based attempt number: `"1"` to `"5"`, then `"6+"`, so the label
/// stays bounded whatever a caller's configuration (`"0"` for zero).
pub fn attempt_label(attempt: u32) -> &'static str {
    const LABELS: [&str; 7] = ["0", "1", "2", "3", "4", "5", "6+"];
    LABELS[(attempt as usize).min(LABELS.len() - 1)]
}

/// Identity of the metrics recorder in effect on this thread (a local one, else the global
/// one), or `None` for a stateless recorder such as the no-op one, whose handles are not worth
/// keeping and whose address says nothing. Metric handles registered once are kept per
/// recorder: registering on every call builds a key (an allocation) and looks it up.
pub(crate) fn recorder_id() -> Option<usize> {
    metrics::with_recorder(|recorder| {
        (std::mem::size_of_val(recorder) != 0)
            .then(|| std::ptr::from_ref(recorder).cast::<()>().addr())
    })
}

/// Sets [`BACKSTOP_BUILD_INFO`] to 1 with this library's version, so a dashboard can tell
/// which processes run which release. Call it once, after installing a recorder.
pub fn publish_build_info() {
    metrics::gauge!(BACKSTOP_BUILD_INFO, label::VERSION => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// Registers units and help texts of every metric above with the installed `metrics` recorder.
pub fn describe_metrics() {
    describe_counter!(
        RPC_CLIENT_REQUESTS_TOTAL,
        Unit::Count,
        "Logical client requests (one per user intent, all attempts together)."
    );
    describe_counter!(
        RPC_CLIENT_ATTEMPTS_TOTAL,
        Unit::Count,
        "Client attempts (first sends, retries and hedges) by attempt number and outcome."
    );
    describe_counter!(
        RPC_CLIENT_RETRIES_TOTAL,
        Unit::Count,
        "Client retries; retry ratio = retries / logical requests."
    );
    describe_counter!(
        RPC_CLIENT_HEDGES_TOTAL,
        Unit::Count,
        "Hedged client attempts."
    );
    describe_histogram!(
        RPC_CLIENT_ATTEMPT_DURATION_SECONDS,
        Unit::Seconds,
        "Duration of each client attempt by attempt number."
    );
    describe_counter!(
        RPC_CLIENT_RETRY_STOPS_TOTAL,
        Unit::Count,
        "Logical client requests that failed, by why no further attempt was made."
    );
    describe_gauge!(
        RPC_CLIENT_STORM_ALARM,
        "The storm alarm per destination: 1 while at or above the level, else 0."
    );
    describe_gauge!(
        RPC_CLIENT_PENDING_REQUESTS,
        Unit::Count,
        "Attempts waiting for a call slot of their destination now."
    );
    describe_histogram!(
        RPC_CLIENT_PENDING_SECONDS,
        Unit::Seconds,
        "How long each attempt waited for a call slot of its destination."
    );
    describe_gauge!(
        RPC_CLIENT_RETRY_SWITCH,
        "The fleet's retry setting this process applies: 1 for the setting in effect."
    );
    describe_gauge!(
        RPC_CLIENT_RETRY_BUDGET_TOKENS,
        Unit::Count,
        "Retry-budget tokens a destination has left (retries and hedges it may still send)."
    );
    describe_gauge!(
        RPC_CLIENT_BREAKER_STATE,
        "A destination's circuit breaker as of its last change: 0 closed, 1 half-open, 2 open."
    );
    describe_gauge!(
        BACKSTOP_BUILD_INFO,
        "Always 1; the backstop library's version as the `version` label."
    );
    describe_counter!(
        RPC_SERVER_REQUESTS_TOTAL,
        Unit::Count,
        "Requests served, by outcome (ok, retryable, fatal, timeout, rejected, cancelled)."
    );
    describe_histogram!(
        RPC_SERVER_DURATION_SECONDS,
        Unit::Seconds,
        "Server request duration."
    );
    describe_gauge!(
        RPC_SERVER_INFLIGHT,
        Unit::Count,
        "Requests being served now."
    );
    describe_gauge!(
        RPC_SERVER_CONCURRENCY_LIMIT,
        Unit::Count,
        "Requests the admission gate lets run at once now (fixed or adaptive limit)."
    );
    describe_gauge!(
        RPC_SERVER_CONCURRENCY_INFLIGHT,
        Unit::Count,
        "Requests holding a slot under the concurrency limit now."
    );
    describe_gauge!(
        RPC_SERVER_QUEUE_LENGTH,
        Unit::Count,
        "Requests waiting in the admission gate's queue now."
    );
    describe_histogram!(
        RPC_SERVER_QUEUE_DELAY_SECONDS,
        Unit::Seconds,
        "Time admitted requests waited in the admission gate's queue."
    );
    describe_counter!(
        RPC_SERVER_REJECTED_TOTAL,
        Unit::Count,
        "Requests refused by admission control, by reason."
    );
    describe_gauge!(
        RPC_SERVER_CONNECTIONS,
        Unit::Count,
        "Connections open now, per listener."
    );
    describe_counter!(
        RPC_SERVER_CONNECTIONS_REJECTED_TOTAL,
        Unit::Count,
        "Connections refused or evicted by the connection cap, by reason."
    );
    describe_counter!(
        RPC_SERVER_CONNECTIONS_PUSHED_TOTAL,
        Unit::Count,
        "Connections asked to go elsewhere under sustained overload, by protocol."
    );
    describe_counter!(
        IDEMPOTENCY_CLAIMS_TOTAL,
        Unit::Count,
        "Idempotency key claims by result (claimed, replay, conflict, in_progress)."
    );
    describe_counter!(
        RPC_SERVER_FAULTS_INJECTED_TOTAL,
        Unit::Count,
        "Faults injected by the server's fault layer, by kind (abort, delay)."
    );
    describe_counter!(
        RATE_LIMIT_REDIS_UNAVAILABLE_TOTAL,
        Unit::Count,
        "Rate-limit decisions made without Redis (fallback or rejected) because it failed."
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString};
    use std::sync::Mutex;

    #[derive(Debug, Default)]
    struct Descriptions(Mutex<Vec<(String, &'static str, Option<Unit>)>>);

    impl Descriptions {
        fn push(&self, kind: &'static str, key: KeyName, unit: Option<Unit>) {
            self.0
                .lock()
                .unwrap()
                .push((key.as_str().to_owned(), kind, unit));
        }
    }

    impl Recorder for Descriptions {
        fn describe_counter(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
            self.push("counter", key, unit);
        }
        fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
            self.push("gauge", key, unit);
        }
        fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
            self.push("histogram", key, unit);
        }
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    #[test]
    fn every_metric_is_described_once_with_its_kind() {
        let recorder = Descriptions::default();
        metrics::with_local_recorder(&recorder, describe_metrics);
        let mut got = recorder.0.into_inner().unwrap();
        got.sort_by(|a, b| a.0.cmp(&b.0));
        let mut want = vec![
            (IDEMPOTENCY_CLAIMS_TOTAL, "counter", Unit::Count),
            (RATE_LIMIT_REDIS_UNAVAILABLE_TOTAL, "counter", Unit::Count),
            (RPC_CLIENT_ATTEMPTS_TOTAL, "counter", Unit::Count),
            (
                RPC_CLIENT_ATTEMPT_DURATION_SECONDS,
                "histogram",
                Unit::Seconds,
            ),
            (RPC_CLIENT_HEDGES_TOTAL, "counter", Unit::Count),
            (RPC_CLIENT_REQUESTS_TOTAL, "counter", Unit::Count),
            (RPC_CLIENT_RETRIES_TOTAL, "counter", Unit::Count),
            (RPC_CLIENT_RETRY_STOPS_TOTAL, "counter", Unit::Count),
            (RPC_SERVER_FAULTS_INJECTED_TOTAL, "counter", Unit::Count),
            (RPC_SERVER_CONNECTIONS, "gauge", Unit::Count),
            (
                RPC_SERVER_CONNECTIONS_REJECTED_TOTAL,
                "counter",
                Unit::Count,
            ),
            (RPC_SERVER_CONNECTIONS_PUSHED_TOTAL, "counter", Unit::Count),
            (RPC_SERVER_DURATION_SECONDS, "histogram", Unit::Seconds),
            (RPC_SERVER_INFLIGHT, "gauge", Unit::Count),
            (RPC_SERVER_CONCURRENCY_LIMIT, "gauge", Unit::Count),
            (RPC_SERVER_CONCURRENCY_INFLIGHT, "gauge", Unit::Count),
            (RPC_SERVER_QUEUE_LENGTH, "gauge", Unit::Count),
            (RPC_SERVER_QUEUE_DELAY_SECONDS, "histogram", Unit::Seconds),
            (RPC_SERVER_REJECTED_TOTAL, "counter", Unit::Count),
            (RPC_SERVER_REQUESTS_TOTAL, "counter", Unit::Count),
        ]
        .into_iter()
        .map(|(n, k, u)| (n.to_owned(), k, Some(u)))
        .collect::<Vec<_>>();
        want.push((
            RPC_CLIENT_RETRY_BUDGET_TOKENS.to_owned(),
            "gauge",
            Some(Unit::Count),
        ));
        // A state and an identity: no unit.
        want.push((RPC_CLIENT_BREAKER_STATE.to_owned(), "gauge", None));
        want.push((BACKSTOP_BUILD_INFO.to_owned(), "gauge", None));
        want.push((RPC_CLIENT_STORM_ALARM.to_owned(), "gauge", None));
        want.push((RPC_CLIENT_RETRY_SWITCH.to_owned(), "gauge", None));
        want.push((
            RPC_CLIENT_PENDING_REQUESTS.to_owned(),
            "gauge",
            Some(Unit::Count),
        ));
        want.push((
            RPC_CLIENT_PENDING_SECONDS.to_owned(),
            "histogram",
            Some(Unit::Seconds),
        ));
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, want);
    }

    /// Every histogram described is in [`DURATION_METRICS`], so that no duration the library
    /// adds is left a summary.
    #[test]
    fn every_histogram_is_a_duration_metric() {
        let recorder = Descriptions::default();
        metrics::with_local_recorder(&recorder, describe_metrics);
        let mut histograms: Vec<String> = recorder
            .0
            .into_inner()
            .unwrap()
            .into_iter()
            .filter(|(_, kind, _)| *kind == "histogram")
            .map(|(name, _, _)| name)
            .collect();
        histograms.sort();
        let mut durations = DURATION_METRICS.map(str::to_owned).to_vec();
        durations.sort();
        assert_eq!(histograms, durations);
    }

    /// A Prometheus recorder set up by [`with_duration_buckets`] renders the library's
    /// durations as histograms (`_bucket` series over [`LATENCY_BUCKETS_SECONDS`]), and leaves
    /// any other histogram as the builder says (the exporter's default: a summary).
    #[cfg(feature = "prometheus")]
    #[test]
    fn the_prometheus_builder_renders_durations_as_histograms() {
        use metrics_exporter_prometheus::PrometheusBuilder;

        let recorder = with_duration_buckets(PrometheusBuilder::new()).build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            for name in DURATION_METRICS {
                metrics::histogram!(name, label::SERVICE => "psp").record(0.003);
            }
            metrics::histogram!("app_batch_size").record(12.0);
        });
        let text = handle.render();
        for name in DURATION_METRICS {
            assert!(text.contains(&format!("# TYPE {name} histogram")), "{text}");
            assert!(
                text.contains(&format!("{name}_bucket{{service=\"psp\",le=\"0.005\"}} 1")),
                "{text}"
            );
            let buckets = text
                .lines()
                .filter(|l| l.starts_with(&format!("{name}_bucket")))
                .count();
            // One per bound, and `+Inf`.
            assert_eq!(buckets, LATENCY_BUCKETS_SECONDS.len() + 1, "{text}");
        }
        assert!(text.contains("# TYPE app_batch_size summary"), "{text}");
    }

    #[test]
    fn names_follow_prometheus_conventions() {
        for name in [
            RPC_CLIENT_REQUESTS_TOTAL,
            RPC_CLIENT_ATTEMPTS_TOTAL,
            RPC_CLIENT_RETRIES_TOTAL,
            RPC_CLIENT_HEDGES_TOTAL,
            RPC_CLIENT_RETRY_STOPS_TOTAL,
            RPC_SERVER_FAULTS_INJECTED_TOTAL,
            RPC_SERVER_REQUESTS_TOTAL,
            RPC_SERVER_REJECTED_TOTAL,
            RPC_SERVER_CONNECTIONS_REJECTED_TOTAL,
            RPC_SERVER_CONNECTIONS_PUSHED_TOTAL,
            IDEMPOTENCY_CLAIMS_TOTAL,
            RATE_LIMIT_REDIS_UNAVAILABLE_TOTAL,
        ] {
            assert!(name.ends_with("_total"), "{name}");
        }
        for name in [
            RPC_CLIENT_ATTEMPT_DURATION_SECONDS,
            RPC_SERVER_DURATION_SECONDS,
            RPC_SERVER_QUEUE_DELAY_SECONDS,
        ] {
            assert!(name.ends_with("_seconds"), "{name}");
        }
        assert!(LATENCY_BUCKETS_SECONDS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn attempt_labels_are_bounded() {
        assert_eq!(attempt_label(0), "0");
        assert_eq!(attempt_label(1), "1");
        assert_eq!(attempt_label(5), "5");
        assert_eq!(attempt_label(6), "6+");
        assert_eq!(attempt_label(u32::MAX), "6+");
    }
}
