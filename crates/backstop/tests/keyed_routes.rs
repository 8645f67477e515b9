//! Keyed routes come from the methods' policies, the same table the clients use, looked up by
//! the route the application's router matched; a keyed method the stack would not claim, or a
//! keyed entry no route serves, is reported by the coverage check.

use axum::Router;
use axum::extract::MatchedPath;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Extension, Json};
use backstop::idempotency::{IdempotencyKey, MemoryStore};
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
use backstop::server::ServerStack;
use backstop::server::idempotency::coverage::{
    Uncovered, assert_keyed_routes_covered, keyed_routes_uncovered,
};
use http::{Method, Request, StatusCode};
use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};
use serde_json::{Value, json};
use tower::ServiceExt;

fn keyed(name: &str) -> MethodPolicy {
    MethodPolicy::builder(name, Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .build()
}

fn policies() -> MethodPolicies {
    MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(Method::POST, "/v1/payments", keyed("CreatePayment"))
        .route(
            Method::GET,
            "/v1/payments/{id}",
            MethodPolicy::builder("GetPayment", Idempotency::Safe).build(),
        )
        // A template whose tail is many segments: only the router's match names it.
        .route(Method::POST, "/v1/files/{*path}", keyed("PutFile"))
        .validated()
        .unwrap()
}

async fn pay(Extension(key): Extension<IdempotencyKey>) -> impl IntoResponse {
    (
        StatusCode::CREATED,
        Json(json!({ "key": key.as_str(), "n": rand_n() })),
    )
}

fn rand_n() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

async fn read() -> &'static str {
    "ok"
}

/// The application's routes: the keyed ones require the claimed key.
fn routes() -> Router {
    Router::new()
        .route("/v1/payments", post(pay))
        .route("/v1/payments/{intent_id}", get(read))
        .route("/v1/files/{*path}", post(pay))
}

fn stack(policies: MethodPolicies) -> ServerStack<MemoryStore> {
    ServerStack::new("payments", MemoryStore::new())
        .policies(policies)
        .matched_path_from(|ext| ext.get::<MatchedPath>().map(MatchedPath::as_str))
}

async fn send(app: &Router, method: Method, path: &str, key: Option<&str>) -> (StatusCode, Value) {
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = app
        .clone()
        .oneshot(request.body(axum::body::Body::from("{}")).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

#[tokio::test]
async fn the_tables_keyed_methods_are_claimed_by_the_routers_match() {
    let app = routes().route_layer(stack(policies()).into_layer());

    let (status, body) = send(&app, Method::POST, "/v1/payments", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["code"], "missing_idempotency_key");

    let (status, first) = send(&app, Method::POST, "/v1/payments", Some("k1")).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, again) = send(&app, Method::POST, "/v1/payments", Some("k1")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(first, again, "the same key replays the stored answer");

    // Matched as the router matched it: `{*path}` spans segments a path pattern would not.
    let (status, body) = send(&app, Method::POST, "/v1/files/a/b/c", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["code"], "missing_idempotency_key");

    // A safe method is not keyed; the router's parameter name need not be the table's.
    let (status, _) = send(&app, Method::GET, "/v1/payments/pi_1", None).await;
    assert_eq!(status, StatusCode::OK);

    assert_keyed_routes_covered(app, &policies(), |b| b).await;
}

#[tokio::test]
async fn without_the_routers_match_the_path_is_matched_against_the_table() {
    let stack = ServerStack::new("payments", MemoryStore::new()).policies(policies());
    let app = routes().route_layer(stack.into_layer());
    let (status, body) = send(&app, Method::POST, "/v1/payments", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["code"], "missing_idempotency_key");
    // The one-segment reading of `{*path}` does not cover a deeper path: the coverage
    // check's probe (one segment) passes, the handler refuses the unclaimed request.
    let (status, _) = send(&app, Method::POST, "/v1/files/a/b", Some("k")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
}

#[tokio::test]
async fn a_keyed_entry_no_route_serves_is_reported() {
    // The table spells the route differently from the router.
    let table = policies().route(Method::POST, "/v1/payment", keyed("Typo"));
    // On the routes only (`route_layer`): a request no route takes never reaches the stack.
    let app = routes().route_layer(stack(table.clone()).into_layer());
    let uncovered = keyed_routes_uncovered(app, &table, |b| b).await;
    assert_eq!(
        uncovered,
        [Uncovered {
            route: "POST /v1/payment".into(),
            answer: "404".into(),
            unserved: true,
        }]
    );
    assert!(uncovered[0].to_string().contains("no route serves"));
}

#[tokio::test]
async fn with_the_stack_on_the_fallback_too_an_unserved_entry_is_refused_not_reported() {
    // `Router::layer` also wraps the fallback, which matched no template: the request's path
    // is matched against the table and the stack refuses it before the fallback answers.
    let table = policies().route(Method::POST, "/v1/payment", keyed("Typo"));
    let app = routes().layer(stack(table.clone()).into_layer());
    let (status, body) = send(&app, Method::POST, "/v1/payment", None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["code"], "missing_idempotency_key");
    assert!(keyed_routes_uncovered(app, &table, |b| b).await.is_empty());
}

#[tokio::test]
async fn a_keyed_route_the_stack_does_not_claim_is_reported() {
    // The stack was given no table: the keyed method reaches its handler unclaimed, which
    // refuses it for want of the key.
    let app = routes().route_layer(ServerStack::new("payments", MemoryStore::new()).into_layer());
    let uncovered = keyed_routes_uncovered(app.clone(), &policies(), |b| b).await;
    let routes: Vec<&str> = uncovered.iter().map(|u| u.route.as_str()).collect();
    assert_eq!(routes, ["POST /v1/payments", "POST /v1/files/probe"]);
    assert!(uncovered.iter().all(|u| !u.unserved), "{uncovered:?}");
    assert!(
        uncovered[0]
            .to_string()
            .contains("without an idempotency claim")
    );

    let panicked = tokio::spawn(async move {
        assert_keyed_routes_covered(app, &policies(), |b| b).await;
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());
}

/// A gRPC server in miniature: `Charge` answers OK (it would charge), any other path
/// `UNIMPLEMENTED`, as tonic's router does.
fn grpc_app(stack: ServerStack<MemoryStore>) -> GrpcApp {
    use tower::Layer;
    let handler = tower::service_fn(
        |request: Request<backstop::server::ServerStackBody<Empty<Bytes>>>| async move {
            let status = if request.uri().path() == CHARGE {
                "0"
            } else {
                "12"
            };
            Ok::<_, Infallible>(
                http::Response::builder()
                    .header("content-type", "application/grpc")
                    .header("grpc-status", status)
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
        },
    );
    // The stack in front of the router, as on tonic's server; the probe reads heads and
    // extensions only, so the body is boxed to name the type.
    let service = stack.into_layer().layer(handler).map_response(|r| {
        r.map(|body| {
            body.map_err(|_| std::io::Error::other("body"))
                .boxed_unsync()
        })
    });
    tower::util::BoxCloneService::new(service)
}

type GrpcApp = tower::util::BoxCloneService<
    Request<Empty<Bytes>>,
    http::Response<UnsyncBoxBody<Bytes, std::io::Error>>,
    Infallible,
>;

const CHARGE: &str = "/payment.v1.Payment/Charge";

fn grpc_policies(path: &str) -> MethodPolicies {
    MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .method(path, keyed("Charge"))
        .validated()
        .unwrap()
}

#[tokio::test]
async fn a_keyed_grpc_method_is_probed_as_a_grpc_call_and_found_covered() {
    let table = grpc_policies(CHARGE);
    let app = grpc_app(stack(table.clone()));
    assert_keyed_routes_covered(app, &table, |b| b).await;
}

#[tokio::test]
async fn a_keyed_grpc_method_the_stack_does_not_claim_is_reported() {
    // The stack was given a table without Charge: a keyless Charge reaches the handler.
    let unkeyed = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build());
    let app = grpc_app(stack(unkeyed));
    let uncovered = keyed_routes_uncovered(app, &grpc_policies(CHARGE), |b| b).await;
    assert_eq!(
        uncovered,
        [Uncovered {
            route: format!("POST {CHARGE}"),
            answer: "200 grpc-status OK".to_owned(),
            unserved: false,
        }]
    );
    // Misspelt in both, and nothing keyed in the stack: the router says no one serves it.
    let typo = "/payment.v1.Payment/Chrage";
    let app = grpc_app(stack(MethodPolicies::new(
        MethodPolicy::builder("other", Idempotency::Unsafe).build(),
    )));
    let uncovered = keyed_routes_uncovered(app, &grpc_policies(typo), |b| b).await;
    assert_eq!(uncovered.len(), 1);
    assert!(uncovered[0].unserved, "{uncovered:?}");
}
