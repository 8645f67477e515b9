//! The full backstop server stack on a fresh axum app.
//!
//! `cargo run -p backstop --example axum_stack`, then:
//! `curl -si localhost:3000/v1/payments -H 'Idempotency-Key: k1' -H 'grpc-timeout: 2S' -d '{"amount_cents":100}'`
//! twice: the second answer is the first one replayed (`Idempotent-Replayed: true`).
use std::time::Duration;

use axum::{Extension, Json, Router, http::StatusCode, response::IntoResponse, routing::post};
use backstop::admission::Gate;
use backstop::idempotency::{IdempotencyKey, MemoryStore};
use backstop::server::{KeyedRoute, ServerStack};
use http::Method;
use serde_json::{Value, json};

async fn pay(
    Extension(key): Extension<IdempotencyKey>,
    Json(req): Json<Value>,
) -> impl IntoResponse {
    // The claimed key is this request's key: store it with the effect it causes.
    (
        StatusCode::CREATED,
        Json(json!({ "request_key": key.as_str(), "request": req })),
    )
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let stack = ServerStack::new("payments", MemoryStore::new())
        .keyed(Method::POST, "/v1/payments", KeyedRoute::payments())
        .gate(Gate::new(256, Duration::from_millis(20)));
    let app = Router::new()
        .route("/v1/payments", post(pay))
        .layer(stack.into_layer());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app).await
}
