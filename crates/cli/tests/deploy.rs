//! `deploy/`: every metric the Prometheus rules and the Grafana dashboard use exists in the
//! `/metrics` of a real `backstop serve` that has seen a little traffic (successes, a PSP
//! failing until the client stops retrying, tenant rate-limit refusals, an unknown route), and
//! of a real `backstop proxy` in front of the Python upstream (all but the payment service's
//! own), and both files are well formed. A few metrics appear only in some configurations
//! ([`CONDITIONAL`]): each is checked to be the library's, and shown live by the test named.

#[path = "support/proxy_harness.rs"]
mod proxy_harness;
#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;
#[path = "support/serve_process.rs"]
mod serve_process;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use backstop_payment::psp::{self, Fault, PspConfig};
use serde::Deserialize;
use serde_json::{Value, json};
use serve_process::{ServeProcess, serve_command};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

// ---- PromQL: the metric names an expression reads ----

/// Keywords followed by a parenthesised label list (not an expression).
const LABEL_LIST_KEYWORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
/// Aggregation operators: they may be followed by `by (..)` instead of `(`.
const AGGREGATIONS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
/// Keywords and literals that are not metric names.
const OTHER_KEYWORDS: &[&str] = &[
    "bool", "and", "or", "unless", "offset", "atan2", "inf", "nan", "Inf", "NaN",
];

/// Index just past the bracket that closes the one opening at `start` (`open`/`close`),
/// skipping quoted strings.
fn skip_balanced(b: &[u8], start: usize, open: u8, close: u8) -> usize {
    let mut depth = 0usize;
    let mut i = start;
    while i < b.len() {
        match b[i] {
            q @ (b'"' | b'\'' | b'`') => i = skip_string(b, i, q),
            c if c == open => {
                depth += 1;
                i += 1;
            }
            c if c == close => {
                depth -= 1;
                i += 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => i += 1,
        }
    }
    panic!(
        "unbalanced {:?} in {:?}",
        open as char,
        String::from_utf8_lossy(b)
    );
}

/// Index just past the string literal opening at `start` with quote `q`.
fn skip_string(b: &[u8], start: usize, q: u8) -> usize {
    let mut i = start + 1;
    while i < b.len() {
        if b[i] == b'\\' && q != b'`' {
            i += 2;
        } else if b[i] == q {
            return i + 1;
        } else {
            i += 1;
        }
    }
    panic!("unterminated string in {:?}", String::from_utf8_lossy(b));
}

fn is_ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b':'
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b':'
}

/// Metric names read by a PromQL expression: identifiers outside label matchers (`{..}`),
/// ranges (`[..]`), strings and label lists (`by (..)`), that are neither keywords nor
/// function or aggregation names (followed by `(`).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let b = expr.as_bytes();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if matches!(c, b'"' | b'\'' | b'`') {
            i = skip_string(b, i, c);
        } else if c == b'{' {
            i = skip_balanced(b, i, b'{', b'}');
        } else if c == b'[' {
            i = skip_balanced(b, i, b'[', b']');
        } else if c == b'#' {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c.is_ascii_digit() || c == b'.' {
            // A number (0.99, 1e-9, 0x1f) or a duration (5m).
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.') {
                let exponent = matches!(b[i], b'e' | b'E');
                i += 1;
                if exponent && i < b.len() && matches!(b[i], b'+' | b'-') {
                    i += 1;
                }
            }
        } else if is_ident_start(c) {
            let start = i;
            while i < b.len() && is_ident(b[i]) {
                i += 1;
            }
            let ident = &expr[start..i];
            let mut next = i;
            while next < b.len() && b[next].is_ascii_whitespace() {
                next += 1;
            }
            let call = next < b.len() && b[next] == b'(';
            if LABEL_LIST_KEYWORDS.contains(&ident) {
                if call {
                    i = skip_balanced(b, next, b'(', b')');
                }
            } else if !call && !OTHER_KEYWORDS.contains(&ident) && !AGGREGATIONS.contains(&ident) {
                names.insert(ident.to_owned());
            }
        } else {
            i += 1;
        }
    }
    names
}

#[test]
fn metric_names_skips_functions_labels_ranges_and_keywords() {
    let names = |e| metric_names(e).into_iter().collect::<Vec<_>>();
    assert_eq!(
        names(
            "histogram_quantile(0.99, sum by (service, le) \
             (rate(a_seconds_bucket{outcome!=\"rejected\", x=~\"$instance\"}[$__rate_interval])))"
        ),
        ["a_seconds_bucket"]
    );
    assert_eq!(
        names(
            "sum by (reason) (rate(r_total[5m])) / on (service) group_left () \
             (sum without (instance) (q_total offset 1h) > 0) and bool 1e-9 # c_total\n"
        ),
        ["q_total", "r_total"]
    );
    assert_eq!(
        names("rec:ratio:rate5m > 0.1 unless g{l=\"a}b\"} == 1"),
        ["g", "rec:ratio:rate5m"]
    );
}

// ---- the rules and the dashboard ----

#[derive(Debug, Deserialize)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(Debug, Deserialize)]
struct RuleGroup {
    name: String,
    rules: Vec<Rule>,
}

#[derive(Debug, Deserialize)]
struct Rule {
    record: Option<String>,
    alert: Option<String>,
    expr: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

fn rules() -> RuleFile {
    let path = deploy_dir().join("prometheus/backstop-rules.yml");
    let text = std::fs::read_to_string(&path).expect("the rules file exists");
    serde_norway::from_str(&text).expect("the rules file is valid YAML of rule groups")
}

fn dashboard() -> Value {
    let path = deploy_dir().join("grafana/backstop-dashboard.json");
    let text = std::fs::read_to_string(&path).expect("the dashboard exists");
    serde_json::from_str(&text).expect("the dashboard is valid JSON")
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        out.push(p);
        if let Some(nested) = p["panels"].as_array() {
            out.extend(nested);
        }
    }
    out
}

/// The PromQL expressions of the dashboard: panel targets and query variables.
fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    let mut exprs = Vec::new();
    for p in panels(dashboard) {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.push(t["expr"].as_str().expect("a PromQL target").to_owned());
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if v["type"] == "query" {
            let q = v["definition"]
                .as_str()
                .expect("a query variable's definition");
            // label_values(metric, label): the metric is an expression.
            let q = q
                .strip_prefix("label_values(")
                .and_then(|rest| rest.rsplit_once(','))
                .map_or(q, |(metric, _)| metric);
            exprs.push(q.to_owned());
        }
    }
    exprs
}

#[test]
fn alerts_say_what_to_do_and_page_on_a_retry_storm() {
    let file = rules();
    let mut alerts = BTreeMap::new();
    for group in &file.groups {
        assert!(!group.rules.is_empty(), "group {} is empty", group.name);
        for rule in &group.rules {
            assert!(
                rule.record.is_some() != rule.alert.is_some(),
                "a rule is a recording or an alert: {rule:?}"
            );
            let Some(name) = &rule.alert else { continue };
            let severity = rule.labels.get("severity").map(String::as_str);
            assert!(
                matches!(severity, Some("warning" | "page")),
                "{name}: severity {severity:?}"
            );
            for key in ["summary", "description"] {
                let text = rule.annotations.get(key).map_or("", |s| s.trim());
                assert!(
                    text.len() > 20,
                    "{name}: {key} must tell the operator what to do"
                );
            }
            alerts.insert(name.clone(), (rule.expr.clone(), severity.unwrap()));
        }
    }
    // The retry ratio: over 0.1 warns, over 0.2 pages.
    let ratio = |threshold: &str, severity: &str| {
        alerts.values().any(|(expr, s)| {
            *s == severity
                && expr.contains("retry_ratio")
                && expr.replace(' ', "").ends_with(&format!(">{threshold}"))
        })
    };
    assert!(ratio("0.1", "warning"), "{alerts:?}");
    assert!(ratio("0.2", "page"), "{alerts:?}");
    for name in [
        "BackstopStormAlarmTripped",
        "BackstopAttemptLatencyHigh",
        "BackstopRejecting",
        "BackstopIntentsLeftRunning",
        "BackstopRetriesSwitchedOff",
    ] {
        assert!(alerts.contains_key(name), "missing alert {name}");
    }
}

/// `promtool check rules` and `promtool test rules` when promtool is installed (CI runs them
/// in `.ci/run` too, where it is installed when missing).
#[test]
fn promtool_accepts_the_rules_and_their_unit_tests() {
    let dir = deploy_dir().join("prometheus");
    for args in [
        ["check", "rules", "backstop-rules.yml"],
        ["test", "rules", "backstop-rules.test.yml"],
    ] {
        let out = match std::process::Command::new("promtool")
            .args(args)
            .current_dir(&dir)
            .output()
        {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                eprintln!("skipped: no promtool on PATH (Debian package `prometheus`)");
                return;
            }
            Err(e) => panic!("promtool: {e}"),
        };
        assert!(
            out.status.success(),
            "promtool {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_dashboard_uses_a_prometheus_datasource_variable() {
    let d = dashboard();
    assert!(
        d["schemaVersion"].as_u64().unwrap() >= 41,
        "a current Grafana schema"
    );
    let vars = d["templating"]["list"].as_array().unwrap();
    assert!(
        vars.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "{vars:?}"
    );
    let mut ids = BTreeSet::new();
    let mut titles = Vec::new();
    for p in panels(&d) {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "duplicate panel id");
        titles.push(p["title"].as_str().unwrap().to_owned());
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        for t in p["targets"].as_array().unwrap() {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{}", p["title"]);
        }
    }
    // The retry ratio panel draws the 0.1 and 0.2 thresholds.
    let ratio = panels(&d)
        .into_iter()
        .find(|p| p["title"] == "Retry ratio")
        .expect("a retry ratio panel");
    let steps: Vec<f64> = ratio["fieldConfig"]["defaults"]["thresholds"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["value"].as_f64())
        .collect();
    assert_eq!(steps, [0.1, 0.2], "{titles:?}");
}

// ---- a live service ----

/// A running `backstop serve` child.
struct Serve {
    _process: ServeProcess,
    base: String,
    http: reqwest::Client,
}

impl Serve {
    async fn start(store: &Path, psp_url: &str, extra: &[&str]) -> Serve {
        let mut command = serve_command();
        command
            .arg("--store")
            .arg(store)
            .args(["--psp", psp_url, "--log-format", "json"])
            .args(extra);
        // A connection per request: the connection cap below evicts idle connections, and a
        // pooled one must not be among them.
        let http = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        let process = serve_process::spawn(command, &http).await;
        Serve {
            base: process.base.clone(),
            _process: process,
            http,
        }
    }

    async fn pay(&self, key: &str, order: &str) -> u16 {
        self.http
            .post(format!("{}/v1/payments", self.base))
            .header("idempotency-key", key)
            .json(&json!({"order_id": order, "amount_cents": 100}))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    }

    async fn metrics(&self) -> String {
        let r = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.text().await.unwrap()
    }
}

/// The exposition's sample names (`x_bucket`, `x_sum`, `x_count` as they appear) and the type
/// declared for each metric family.
fn exposition(text: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let mut samples = BTreeSet::new();
    let mut types = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                types.insert(name.to_owned(), kind.to_owned());
            }
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            samples.insert(line[..end].to_owned());
        }
    }
    (samples, types)
}

/// The names among `used` that the live exposition lacks. A histogram's series are used by
/// their exposed names (`_bucket`, `_sum`, `_count`), and the family must be declared a
/// histogram: a counter that happens to end in `_count` is not stripped.
fn missing(
    used: &BTreeSet<String>,
    samples: &BTreeSet<String>,
    types: &BTreeMap<String, String>,
) -> Vec<String> {
    used.iter()
        .filter(|name| {
            if !samples.contains(*name) {
                return true;
            }
            ["_bucket", "_sum", "_count"].iter().any(|suffix| {
                name.strip_suffix(suffix).is_some_and(|family| {
                    !types.contains_key(*name)
                        && types.get(family).map(String::as_str) != Some("histogram")
                })
            })
        })
        .cloned()
        .collect()
}

/// The metric names the rules and the dashboard read (recording rules resolved to the rules
/// that define them, which must exist).
fn used_names() -> BTreeSet<String> {
    let file = rules();
    let recorded: BTreeSet<String> = file
        .groups
        .iter()
        .flat_map(|g| g.rules.iter().filter_map(|r| r.record.clone()))
        .collect();
    let mut used = BTreeSet::new();
    for rule in file.groups.iter().flat_map(|g| &g.rules) {
        used.extend(metric_names(&rule.expr));
    }
    let dashboard = dashboard();
    for expr in dashboard_exprs(&dashboard) {
        used.extend(metric_names(&expr));
    }
    let (rule_names, exported): (BTreeSet<_>, BTreeSet<_>) =
        used.into_iter().partition(|n| n.contains(':'));
    let undefined: Vec<_> = rule_names.difference(&recorded).collect();
    assert!(
        undefined.is_empty(),
        "recording rules used but not defined: {undefined:?}"
    );
    assert!(
        exported.len() >= 15,
        "too few names extracted: {exported:?}"
    );
    exported
}

/// Metrics the rules or the dashboard use that a process exports only in some configurations,
/// and where each is shown live.
const CONDITIONAL: [(&str, &str); 4] = [
    (
        backstop::observe::RPC_SERVER_CONNECTIONS_PUSHED_TOTAL,
        "under sustained overload: tests/push_away.rs",
    ),
    (
        backstop::observe::RPC_CLIENT_RETRY_SWITCH,
        "following the fleet's retry switch (serve with --redis, the proxy with \
         --retry-switch-redis): tests/retry_switch.rs, and the proxy's test here",
    ),
    (
        backstop::observe::RPC_CLIENT_PENDING_REQUESTS,
        "a destination with call slots (Destination::max_in_flight), which neither serve nor \
         the proxy sets: the library's client::slots tests",
    ),
    (
        backstop::observe::RPC_CLIENT_PENDING_SECONDS,
        "as rpc_client_pending_requests",
    ),
];

/// Whether `name` (a histogram's series by its exposed name) is one of [`CONDITIONAL`].
fn conditional(name: &str) -> bool {
    CONDITIONAL.iter().any(|(family, _)| {
        name == *family
            || name
                .strip_prefix(family)
                .is_some_and(|suffix| ["_bucket", "_sum", "_count"].contains(&suffix))
    })
}

#[test]
fn conditional_metrics_are_used_and_are_the_librarys() {
    let used = used_names();
    for (family, live) in CONDITIONAL {
        assert!(
            used.iter()
                .any(|name| conditional(name) && name.starts_with(family)),
            "{family} ({live}) is used by no panel or rule: drop it from CONDITIONAL"
        );
    }
    // Their panels are there.
    let titles: Vec<String> = panels(&dashboard())
        .iter()
        .filter_map(|p| p["title"].as_str().map(str::to_owned))
        .collect();
    for title in [
        "Connections pushed away",
        "Retry switch",
        "Waiting for a call slot",
        "Call-slot wait p99",
    ] {
        assert!(titles.iter().any(|t| t == title), "no panel {title:?}");
    }
}

/// Scrapes `metrics` until every name of `wanted` is there or a (generous) minute passes (the
/// resolver publishes its gauges from a background task); the names still missing.
async fn scrape_until_present(
    wanted: &BTreeSet<String>,
    mut metrics: impl AsyncFnMut() -> String,
) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (samples, types) = exposition(&metrics().await);
        let missing = missing(wanted, &samples, &types);
        if missing.is_empty() || tokio::time::Instant::now() > deadline {
            return missing;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_in_the_rules_and_the_dashboard_is_exported() {
    let exported: BTreeSet<String> = used_names()
        .into_iter()
        .filter(|name| !conditional(name))
        .collect();

    // A service whose PSP fails the first charge until the client stops retrying, then
    // answers; a tenant rate that refuses once its burst is spent; a connection cap that
    // evicts idle connections.
    let dir = tempfile::tempdir().unwrap();
    let psp = psp::spawn(PspConfig::default()).await.unwrap();
    psp.faults()
        .script([Fault::Error, Fault::Error, Fault::Error, Fault::Error])
        .unwrap();
    let serve = Serve::start(
        &dir.path().join("b.db"),
        &psp.url(),
        &[
            "--tenant-rate",
            "1",
            "--tenant-burst",
            "5",
            "--max-connections",
            "4",
        ],
    )
    .await;
    let failed = serve.pay("k-fail", "o-fail").await;
    assert!((500..600).contains(&failed), "the PSP failed: {failed}");
    assert_eq!(serve.pay("k-ok", "o-ok").await, 201);
    let unmatched = serve
        .http
        .get(format!("{}/no-such-route", serve.base))
        .send()
        .await
        .unwrap();
    assert_eq!(unmatched.status(), 404);
    // Until the burst is spent (1 token a second refills it; a slow machine only takes more
    // requests to get there).
    let mut refused = false;
    for i in 0..1000 {
        if serve.pay(&format!("k-{i}"), &format!("o-{i}")).await == 429 {
            refused = true;
            break;
        }
    }
    assert!(refused, "the tenant rate never refused");

    // Six connections that send nothing, at a cap of 4: the oldest are evicted.
    let addr = serve.base.trim_start_matches("http://").to_owned();
    let mut idle = Vec::new();
    for _ in 0..6 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }

    let missing = scrape_until_present(&exported, async || serve.metrics().await).await;
    assert!(
        missing.is_empty(),
        "used in deploy/ but not in the live /metrics: {missing:?}"
    );
    // Which release a process runs, for dashboards to tell instances apart.
    let build_info = format!(
        "backstop_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    let metrics = serve.metrics().await;
    assert!(
        metrics.lines().any(|l| l == build_info),
        "{build_info} missing from\n{metrics}"
    );
    drop(idle);
}

/// The proxy's routes: the test upstream's, and a route of a tight rate class.
const PROXY_ROUTES: &str = r#"
[[policies.route]]
match = "GET /v1/charges/{id}"
idempotency = "safe"

[[policies.route]]
match = "POST /v1/charges"
idempotency = "keyed"

[[policies.route]]
match = "POST /v1/limited"
idempotency = "keyed"
rate_class = "tight"

[policies.rate_class.tight]
rate = 1
burst = 2
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_exports_every_metric_but_the_payment_services_own() {
    use proxy_harness::{Proxy, Upstream, call, charge, client, python_ready};
    if !python_ready().await {
        return;
    }
    // The dashboard and the rules work unchanged for the proxy, but for the payment intents'
    // panels and alerts: the proxy has no intents.
    // Of the metrics shown only in some configurations, the retry switch's is here: the
    // proxy follows one (Redis need not answer for the gauge to show the setting, `on`).
    let (payments, exported): (BTreeSet<_>, BTreeSet<_>) = used_names()
        .into_iter()
        .filter(|name| !conditional(name) || name == backstop::observe::RPC_CLIENT_RETRY_SWITCH)
        .partition(|name| name.starts_with("payment_"));
    assert_eq!(
        payments.iter().map(String::as_str).collect::<Vec<_>>(),
        [
            "payment_intents_running",
            "payment_intents_running_oldest_age_seconds"
        ]
    );

    // Keyed requests, reads retried while the upstream fails, a rate class refusing once its
    // burst is spent, a connection cap evicting idle connections.
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::options(dir.path(), &[&upstream.url])
        .routes(PROXY_ROUTES)
        .args(&[
            "--max-connections",
            "4",
            "--retry-switch-redis",
            "redis://127.0.0.1:6379",
            "--retry-switch-key",
            &format!("backstop:test:deploy:{}", std::process::id()),
        ])
        .start()
        .await;
    // A connection per request: the cap must not evict a pooled one.
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    call(charge(&http, &proxy.base, "/v1/charges", "k-1", "{}"))
        .await
        .assert_status(201);
    let failing = http
        .get(format!("{}/v1/charges/c-1", proxy.base))
        .header("X-Upstream-Status", "503");
    call(failing).await.assert_status(503);
    call(http.get(format!("{}/v1/charges/c-2", proxy.base)))
        .await
        .assert_status(200);
    let mut refused = false;
    for i in 0..1000 {
        let limited = charge(&http, &proxy.base, "/v1/limited", &format!("l-{i}"), "{}");
        if call(limited).await.status == 429 {
            refused = true;
            break;
        }
    }
    assert!(refused, "the rate class never refused");
    let addr = proxy.base.trim_start_matches("http://").to_owned();
    let mut idle = Vec::new();
    for _ in 0..6 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }

    let scrape = client();
    let missing = scrape_until_present(&exported, async || {
        scrape
            .get(format!("{}/metrics", proxy.admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    })
    .await;
    assert!(
        missing.is_empty(),
        "used in deploy/ but not in the proxy's /metrics: {missing:?}"
    );
    drop(idle);
}

#[test]
fn exposition_names_keep_histogram_suffixes_only_for_histograms() {
    let text = "# TYPE h_seconds histogram\nh_seconds_bucket{le=\"1\"} 1\nh_seconds_sum 1\n\
                h_seconds_count 1\n# TYPE c_count counter\nc_count 3\n\
                # TYPE g_total counter\ng_total{a=\"b\"} 2\n";
    let (samples, types) = exposition(text);
    let used = |names: &[&str]| names.iter().map(|s| (*s).to_owned()).collect();
    assert!(
        missing(
            &used(&["h_seconds_bucket", "h_seconds_count"]),
            &samples,
            &types
        )
        .is_empty()
    );
    assert!(missing(&used(&["c_count", "g_total"]), &samples, &types).is_empty());
    assert_eq!(
        missing(&used(&["h_seconds", "nope"]), &samples, &types),
        ["h_seconds", "nope"]
    );
}
