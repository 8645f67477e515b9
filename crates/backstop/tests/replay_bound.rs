//! A user's axum service with a keyed route whose answers can be large, served over loopback
//! behind the server stack: an answer up to its method's `max_replay_body` is replayed byte
//! for byte, a larger one streams through whole and a retry with its key gets its status with
//! `replay_body_too_large`; the handler runs once either way.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use backstop::idempotency::MemoryStore;
use backstop::policy::{Idempotency, KEY_TTL_SYNC, MethodPolicies, MethodPolicy};
use backstop::server::ServerStack;
use bytes::Bytes;
use http::{Method, header};
use serde::Deserialize;
use serde_json::Value;

/// What the export route keeps for replay.
const BOUND: usize = 1000;

#[derive(Deserialize)]
struct Shape {
    /// Answer as a stream of 64 KiB chunks, its length unknown in advance.
    #[serde(default)]
    stream: bool,
}

/// `POST /v1/exports/{n}`: `n` bytes of CSV-ish text, counting its runs.
async fn export(
    State(runs): State<Arc<AtomicUsize>>,
    Path(n): Path<usize>,
    Query(shape): Query<Shape>,
) -> Response {
    runs.fetch_add(1, Ordering::SeqCst);
    let bytes: Vec<u8> = (0..n).map(|i| b'a' + (i % 26) as u8).collect();
    let body = if shape.stream {
        let chunks: Vec<Result<Bytes, Infallible>> = bytes
            .chunks(64 * 1024)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        Body::from_stream(futures_util::stream::iter(chunks))
    } else {
        Body::from(bytes)
    };
    ([(header::CONTENT_TYPE, "text/csv")], body).into_response()
}

async fn serve() -> (String, Arc<AtomicUsize>) {
    let policy = MethodPolicy::builder("Export", Idempotency::Keyed)
        .key_ttl(KEY_TTL_SYNC)
        .max_replay_body(BOUND)
        .build();
    let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(Method::POST, "/v1/exports/{n}", policy)
        .validated()
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/v1/exports/{n}", post(export))
        .layer(
            ServerStack::new("exports", MemoryStore::new())
                .policies(policies)
                .into_layer(),
        )
        .with_state(runs.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), runs)
}

async fn post_export(base: &str, path: &str, key: &str) -> (u16, http::HeaderMap, Bytes) {
    let response = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.bytes().await.unwrap())
}

#[tokio::test]
async fn answers_up_to_the_bound_replay_and_larger_ones_stream_and_say_so() {
    let (base, runs) = serve().await;
    let cases = [
        ("/v1/exports/999", 999, true),
        ("/v1/exports/1000", 1000, true),
        ("/v1/exports/1001", 1001, false),
        ("/v1/exports/1000?stream=true", 1000, true),
        ("/v1/exports/1001?stream=true", 1001, false),
        ("/v1/exports/4194304?stream=true", 4 << 20, false),
    ];
    for (i, (path, n, kept)) in cases.into_iter().enumerate() {
        let key = format!("export-{i}");
        let before = runs.load(Ordering::SeqCst);
        let (status, headers, first) = post_export(&base, path, &key).await;
        assert_eq!(status, 200, "{path}");
        assert_eq!(first.len(), n, "{path}: the whole answer");
        assert!(!headers.contains_key("idempotent-replayed"));
        for _ in 0..2 {
            let (status, headers, again) = post_export(&base, path, &key).await;
            assert_eq!(status, 200, "{path}: the original status");
            assert_eq!(headers["idempotent-replayed"], "true");
            if kept {
                assert_eq!(again, first, "{path}: byte for byte");
                assert_eq!(headers[header::CONTENT_TYPE], "text/csv");
            } else {
                assert_eq!(headers[header::CONTENT_TYPE], "application/problem+json");
                let doc: Value = serde_json::from_slice(&again).unwrap();
                assert_eq!(doc["code"], "replay_body_too_large", "{doc}");
                assert_eq!(doc["max_replay_body"], BOUND);
            }
        }
        assert_eq!(runs.load(Ordering::SeqCst), before + 1, "{path}: one run");
    }
}
