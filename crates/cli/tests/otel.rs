//! `backstop serve --otlp-endpoint` as a real process, exporting to a small OTLP/HTTP receiver
//! on 127.0.0.1: a payment's span arrives with the caller's trace id, sent by the time a
//! graceful shutdown ends.

#[path = "support/serve_process.rs"]
mod serve_process;

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use serde_json::json;
use serve_process::serve_command;
use tokio::net::TcpListener;

const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER_SPAN_ID: &str = "b7ad6b7169203331";

/// A span as received: trace id, parent span id (hex), kind, name.
#[derive(Debug, Clone)]
struct Received {
    trace_id: String,
    parent_span_id: String,
    kind: i32,
    name: String,
}

#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<Received>>>);

/// OTLP/HTTP with protobuf bodies: `POST /v1/traces`, an `ExportTraceServiceRequest` in, an
/// empty `ExportTraceServiceResponse` out.
async fn traces(State(spans): State<Spans>, body: Bytes) -> (StatusCode, Vec<u8>) {
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, Vec::new());
    };
    let mut seen = spans.0.lock().unwrap();
    for span in request
        .resource_spans
        .iter()
        .flat_map(|r| &r.scope_spans)
        .flat_map(|s| &s.spans)
    {
        seen.push(Received {
            trace_id: hex(&span.trace_id),
            parent_span_id: hex(&span.parent_span_id),
            kind: span.kind,
            name: span.name.clone(),
        });
    }
    (
        StatusCode::OK,
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn serve_exports_the_callers_trace_and_flushes_on_shutdown() {
    let spans = Spans::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = listener.local_addr().unwrap();
    let app = Router::new()
        .route("/v1/traces", post(traces))
        .with_state(spans.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let dir = tempfile::tempdir().unwrap();
    let mut command = serve_command();
    command
        .arg("--store")
        .arg(dir.path().join("backstop.db"))
        .args(["--otlp-endpoint", &format!("http://{collector}")])
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut process = serve_process::spawn(command, &http).await;

    let response = http
        .post(format!("{}/v1/payments", process.base))
        .header("idempotency-key", "otel-1")
        .header("traceparent", format!("00-{TRACE_ID}-{CALLER_SPAN_ID}-01"))
        .json(&json!({"order_id": "o-otel-1", "amount_cents": 1250, "currency": "EUR"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201, "{:?}", response.text().await);

    // A graceful stop: the spans still batched go out before the process exits.
    let pid = process.child.id().expect("running").to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(sent.success());
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), process.child.wait())
        .await
        .expect("serve exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");

    let received = spans.0.lock().unwrap().clone();
    let server = received
        .iter()
        .find(|s| s.trace_id == TRACE_ID && s.kind == SpanKind::Server as i32)
        .unwrap_or_else(|| panic!("no server span of trace {TRACE_ID} in {received:#?}"));
    assert_eq!(server.parent_span_id, CALLER_SPAN_ID, "{server:?}");
    assert_eq!(server.name, "POST /v1/payments");
    // The charge to the embedded PSP is an attempt of the same trace.
    assert!(
        received
            .iter()
            .any(|s| s.trace_id == TRACE_ID && s.kind == SpanKind::Client as i32),
        "no client attempt of trace {TRACE_ID} in {received:#?}"
    );
}
