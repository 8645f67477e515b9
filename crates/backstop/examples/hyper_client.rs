//! The client stack over a pooled hyper-util client: one logical call, sent as many attempts
//! as its policy allows, all with the same idempotency key and one shrinking deadline.
//!
//! `cargo run -p backstop --example hyper_client` starts an HTTP server on a free port of
//! 127.0.0.1 that answers 503 to the first attempt, calls it through the stack, prints what
//! the server saw of each attempt and exits. The caller sees one answer, 201; the server saw
//! two attempts carrying the same `Idempotency-Key` (so a server with the idempotency layer
//! charges once), the second numbered by `grpc-previous-rpc-attempts`, each with the budget
//! left in `grpc-timeout`. The client's metrics, as Prometheus would scrape them, count both
//! attempts and render their durations as a histogram (`observe::with_duration_buckets`).
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use backstop::client::connect;
use backstop::client::replay::ReplayBody;
use backstop::client::{ClientStack, Destination};
use backstop::deadline::decode_grpc_timeout;
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicy};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{BoxError, ServiceExt};

/// The headers the stack sets on an attempt, as the server saw them.
#[derive(Debug, Clone, PartialEq)]
struct Attempt {
    idempotency_key: Option<String>,
    grpc_timeout: Option<String>,
    previous_attempts: Option<String>,
}

type Seen = Arc<Mutex<Vec<Attempt>>>;

async fn create_payment(
    State(seen): State<Seen>,
    headers: HeaderMap,
) -> (StatusCode, &'static str) {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let mut seen = seen.lock().unwrap();
    seen.push(Attempt {
        idempotency_key: text("idempotency-key"),
        grpc_timeout: text("grpc-timeout"),
        previous_attempts: text("grpc-previous-rpc-attempts"),
    });
    // The first attempt meets a server restarting; a retry is worth it.
    if seen.len() == 1 {
        (StatusCode::SERVICE_UNAVAILABLE, "restarting")
    } else {
        (StatusCode::CREATED, "payment created")
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // The process's metrics recorder: the library's durations as histograms over its buckets.
    let metrics = backstop::observe::with_duration_buckets(
        metrics_exporter_prometheus::PrometheusBuilder::new(),
    )
    .install_recorder()?;
    let seen = Seen::default();
    let app = Router::new()
        .route("/v1/payments", post(create_payment))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let uri = format!("http://{}/v1/payments", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    // `Keyed`: the call has an effect, so every attempt carries one idempotency key (the stack
    // makes one when the request has none) and a retry is safe on a server that honours it.
    // The key must outlive every retry: the server keeps payment keys 7 days. The 5 s
    // deadline covers all attempts together; a retry never extends it.
    let policy = MethodPolicy::builder("CreatePayment", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .timeout(Duration::from_secs(5))
        .build();
    // Everything calling this server shares the destination: retry budget, breaker, latency.
    let destination = Destination::new("payments");
    // A pooled HTTP/1.1 client (HTTP/2 only for gRPC); the stack hands it replayable bodies.
    let transport = connect::pooled::<ReplayBody<Full<Bytes>>>(false);
    let client = ClientStack::builder(&destination, policy)
        .build()?
        .layer(transport);

    let request = Request::post(&uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"order_id":"42","amount_cents":1999}"#,
        )))?;
    let response = client.oneshot(request).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    println!("caller got: {status} {}", String::from_utf8_lossy(&body));

    let seen = seen.lock().unwrap().clone();
    for (i, attempt) in seen.iter().enumerate() {
        println!("attempt {}: {attempt:?}", i + 1);
    }
    check(status == StatusCode::CREATED, "the call succeeds")?;
    check(seen.len() == 2, "two attempts")?;
    check(
        seen[0].idempotency_key.is_some() && seen[0].idempotency_key == seen[1].idempotency_key,
        "both attempts carry the same key",
    )?;
    check(
        seen[1].previous_attempts.as_deref() == Some("1"),
        "the retry says one attempt came before it",
    )?;
    let budget = |a: &Attempt| {
        a.grpc_timeout
            .as_deref()
            .and_then(|t| decode_grpc_timeout(t).ok())
    };
    check(
        budget(&seen[1]) < budget(&seen[0]) && budget(&seen[1]).is_some(),
        "the retry has less budget left than the first attempt",
    )?;
    let exposition = metrics.render();
    let attempts: Vec<&str> = exposition
        .lines()
        .filter(|line| line.starts_with("rpc_client_attempts_total{"))
        .collect();
    println!("metrics: {}", attempts.join(", "));
    check(
        exposition.contains("# TYPE rpc_client_attempt_duration_seconds histogram"),
        "attempt durations are rendered as a histogram",
    )?;

    println!("ok: one call, two attempts with one key and a shrinking budget, 201 for the caller");
    Ok(())
}

/// Fails the example (exit status 1) when what it shows did not happen.
fn check(ok: bool, what: &str) -> Result<(), BoxError> {
    if ok {
        Ok(())
    } else {
        Err(format!("expected: {what}").into())
    }
}
