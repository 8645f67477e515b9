//! An axum app behind backstop's server stack, calling itself to show what the stack does.
//!
//! `cargo run -p backstop --example axum_server` serves on a free port of 127.0.0.1, makes a
//! few calls, prints what each one got and exits:
//!
//! - a payment retried with the same `Idempotency-Key` is answered from the store
//!   (`Idempotent-Replayed: true`): the customer is charged once;
//! - the same route without a key is refused with 400 before the handler runs;
//! - while the gate is full, a request is refused with 503 and `Retry-After` instead of
//!   joining a pile-up;
//! - `/metrics` renders what the stack recorded for Prometheus, its durations as histograms
//!   (`observe::with_duration_buckets`; the exporter's default would be summaries).
use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Extension, Router};
use backstop::Deadline;
use backstop::admission::Gate;
use backstop::idempotency::{IdempotencyKey, MemoryStore};
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
use backstop::server::ServerStack;
use http::{Method, StatusCode};
use tokio::sync::Notify;

#[derive(Clone, Default)]
struct App {
    charges: Arc<AtomicUsize>,
    // The slow report says when it has started, and waits until told to finish.
    report_started: Arc<Notify>,
    report_finish: Arc<Notify>,
}

/// The keyed route: the idempotency layer has already claimed the key, so this runs once per
/// key, and its answer is what a retry with that key gets back.
async fn pay(
    State(app): State<App>,
    Extension(key): Extension<IdempotencyKey>,
    Extension(deadline): Extension<Deadline>,
    body: String,
) -> (StatusCode, String) {
    let n = app.charges.fetch_add(1, Ordering::SeqCst) + 1;
    // The deadline layer turned the caller's `grpc-timeout` into this request's deadline.
    let left = deadline.remaining().as_millis();
    (
        StatusCode::CREATED,
        format!("charge #{n} for key {key}, {body}, {left} ms of budget left"),
    )
}

/// A slow request that holds the gate's only place until `main` lets it go.
async fn report(State(app): State<App>) -> &'static str {
    app.report_started.notify_one();
    app.report_finish.notified().await;
    "report done"
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    // The process's metrics recorder: the library's durations as histograms over its buckets.
    let metrics = backstop::observe::with_duration_buckets(
        metrics_exporter_prometheus::PrometheusBuilder::new(),
    )
    .install_recorder()?;
    backstop::observe::describe_metrics();
    // The service's methods, described once: POST /v1/payments needs an `Idempotency-Key`
    // and its answers are kept 7 days; anything else is sent once and never replayed.
    let pay_policy = MethodPolicy::builder("Pay", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .build();
    let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(Method::POST, "/v1/payments", pay_policy)
        .validated()?;
    let stack = ServerStack::new("payments", MemoryStore::new())
        .policies(policies)
        // One request at a time so that one slow request fills the gate; a request that takes
        // at least 100 ms is not worth admitting with less budget than that left.
        .gate(Gate::new(1, Duration::from_millis(100)));
    let state = App::default();
    let app = Router::new()
        .route("/v1/payments", post(pay))
        .route("/v1/report", get(report))
        .with_state(state.clone())
        .layer(stack.into_layer())
        // Outside the stack: scraping is not a request of the service.
        .route(
            "/metrics",
            get(move || std::future::ready(metrics.render())),
        );

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    println!("serving on {base}");

    let http = reqwest::Client::builder().no_proxy().build()?;
    let pay = |key: Option<&str>| {
        let mut request = http
            .post(format!("{base}/v1/payments"))
            // The caller's budget for the whole call, as gRPC carries it: 5 seconds.
            .header("grpc-timeout", "5S")
            .body(r#"{"order_id":"42","amount_cents":1999}"#);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request.send()
    };

    let first = pay(Some("order-42")).await?;
    let (status, first_body) = (first.status(), first.text().await?);
    println!("first call:  {status} {first_body}");
    check(status == StatusCode::CREATED, "the first call is served")?;

    // The client did not hear the answer (say, a timeout) and sends the same request again.
    let retry = pay(Some("order-42")).await?;
    let replayed = header(&retry, "idempotent-replayed");
    let (status, body) = (retry.status(), retry.text().await?);
    println!("retry:       {status} idempotent-replayed: {replayed} {body}");
    check(body == first_body, "the retry gets the first answer back")?;
    check(
        state.charges.load(Ordering::SeqCst) == 1,
        "charged once for two calls",
    )?;

    let keyless = pay(None).await?;
    println!("no key:      {}", keyless.status());
    check(
        keyless.status() == StatusCode::BAD_REQUEST,
        "a keyed route needs a key",
    )?;

    // Fill the gate with a slow request, then knock: the second request waits only as long as
    // its 1 s budget can still cover the 100 ms a request takes, then it is told when to retry.
    let slow = tokio::spawn(http.get(format!("{base}/v1/report")).send());
    state.report_started.notified().await;
    let refused = http
        .get(format!("{base}/v1/report"))
        .header("grpc-timeout", "1S")
        .send()
        .await?;
    let retry_after = header(&refused, "retry-after");
    println!(
        "gate full:   {} retry-after: {retry_after}",
        refused.status()
    );
    check(
        refused.status() == StatusCode::SERVICE_UNAVAILABLE && retry_after != "-",
        "a full gate answers 503 with Retry-After",
    )?;
    state.report_finish.notify_one();
    let slow = slow.await??;
    println!("slow report: {}", slow.status());
    check(slow.status() == StatusCode::OK, "the slow request finishes")?;

    let exposition = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let buckets = exposition
        .lines()
        .filter(|line| line.starts_with("rpc_server_duration_seconds_bucket{"))
        .count();
    println!("metrics:     rpc_server_duration_seconds in {buckets} histogram buckets");
    check(
        exposition.contains("# TYPE rpc_server_duration_seconds histogram") && buckets > 0,
        "request durations are rendered as a histogram",
    )?;

    println!("ok: one charge for two calls, 400 without a key, 503 + Retry-After when full");
    Ok(())
}

fn header(response: &reqwest::Response, name: &str) -> String {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned()
}

/// Fails the example (exit status 1) when what it shows did not happen.
fn check(ok: bool, what: &str) -> Result<(), Box<dyn Error>> {
    if ok {
        Ok(())
    } else {
        Err(format!("expected: {what}").into())
    }
}
