//! OpenTelemetry spans across a hop (feature `otel`): a request with a known `traceparent`
//! through the server metrics layer, whose handler calls a downstream server through the client
//! stack; the real SDK exports the spans into memory.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use backstop::client::connect::{self, HttpClient};
use backstop::client::replay::ReplayBody;
use backstop::client::{ClientStack, Destination};
use backstop::observe::trace_context;
use backstop::policy::{Idempotency, MethodPolicy};
use backstop::server::MetricsLayer;
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use opentelemetry::trace::{SpanKind, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tokio::net::TcpListener;
use tower::ServiceExt;
use tracing_subscriber::layer::SubscriberExt;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN_ID: &str = "00f067aa0ba902b7";

async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The `traceparent` values the downstream server received.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<String>>>);

#[derive(Clone)]
struct Front {
    downstream: SocketAddr,
    stack: ClientStack,
    client: HttpClient<ReplayBody<Full<Bytes>>>,
}

async fn front(State(front): State<Front>) -> StatusCode {
    let request = Request::post(format!("http://{}/v1/charges", front.downstream))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let response = front
        .stack
        .layer(front.client.clone())
        .oneshot(request)
        .await
        .unwrap();
    response.status()
}

/// Every span exported so far, once one named `name` is among them (bounded wait: the
/// attempt's span ends when the transport drops the request, which may follow the answer).
async fn spans_with(exporter: &InMemorySpanExporter, name: &str) -> Vec<SpanData> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let spans = exporter.get_finished_spans().unwrap();
        if spans.iter().any(|s| s.name == name) {
            return spans;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no span {name} in {spans:#?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_trace_crosses_the_server_layer_and_the_client_stack() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("backstop-test")));
    // A current-thread runtime: every task runs on this thread, under this subscriber.
    let _default = tracing::subscriber::set_default(subscriber);

    let received = Received::default();
    let downstream = serve(
        Router::new()
            .route(
                "/v1/charges",
                post(|State(r): State<Received>, headers: HeaderMap| async move {
                    let value = headers.get("traceparent").map(|v| v.to_str().unwrap());
                    r.0.lock().unwrap().push(value.unwrap_or("").to_owned());
                    StatusCode::CREATED
                }),
            )
            .with_state(received.clone()),
    )
    .await;
    let policy = MethodPolicy::builder("Charge", Idempotency::Safe)
        .timeout(Duration::from_secs(5))
        .build();
    let stack = ClientStack::builder(&Destination::new("downstream"), policy)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/v1/payments", post(front))
        .with_state(Front {
            downstream,
            stack,
            client: connect::pooled(false),
        })
        .layer(MetricsLayer::new("front").route(Method::POST, "/v1/payments"));
    let addr = serve(app).await;

    let response = reqwest::Client::new()
        .post(format!("http://{addr}/v1/payments"))
        .header("traceparent", format!("00-{TRACE_ID}-{CALLER_SPAN_ID}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);

    let spans = spans_with(&exporter, "rpc_client_attempt").await;
    let server = spans
        .iter()
        .find(|s| s.span_kind == SpanKind::Server)
        .unwrap_or_else(|| panic!("no server span in {spans:#?}"));
    assert_eq!(server.name, "POST /v1/payments");
    assert_eq!(server.span_context.trace_id().to_string(), TRACE_ID);
    assert_eq!(server.parent_span_id.to_string(), CALLER_SPAN_ID);
    assert!(server.parent_span_is_remote);

    let attempt = spans
        .iter()
        .find(|s| s.name == "rpc_client_attempt")
        .unwrap();
    assert_eq!(attempt.span_kind, SpanKind::Client);
    assert_eq!(attempt.span_context.trace_id().to_string(), TRACE_ID);
    // Under the server span (the handler ran in it), not beside it.
    assert_eq!(attempt.parent_span_id, server.span_context.span_id());

    let received = received.0.lock().unwrap().clone();
    assert_eq!(received.len(), 1, "{received:?}");
    let sent = trace_context::parse(&received[0]).expect("a valid traceparent downstream");
    assert_eq!(sent.trace_id().to_string(), TRACE_ID);
    assert_ne!(sent.span_id().to_string(), CALLER_SPAN_ID);
    // The attempt's own span is the downstream's parent.
    assert_eq!(sent.span_id(), attempt.span_context.span_id());
    provider.shutdown().unwrap();
}
