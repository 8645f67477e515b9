//! The service's one policy table says which methods are keyed, for its clients and its server
//! stack alike, and every keyed method it serves over HTTP is claimed before its handler runs.

use std::sync::Arc;
use std::time::Duration;

use backstop::clock::SystemClock;
use backstop::db::sqlite::{Db, SqliteOptions};
use backstop::idempotency::sqlite::SqliteStore;
use backstop::retry::RetryBudget;
use backstop::server::idempotency::coverage::keyed_routes_uncovered;
use backstop_payment::config::{Config, StoreLocation};
use backstop_payment::grpc;
use backstop_payment::intents::Intents;
use backstop_payment::psp_client::PspClient;
use backstop_payment::server::{build_routers, prometheus_handle, rate_limit_layer};
use backstop_payment::state::AppState;
use http::Method;

#[test]
fn one_table_describes_every_method() {
    let config = Config::new(StoreLocation::Sqlite("unused.db".into()));
    let policies = config.method_policies();
    assert!(policies.for_path(grpc::CHARGE).requires_key());
    assert_eq!(
        policies.for_path(grpc::CHARGE).key_ttl(),
        Some(config.key_ttl)
    );
    assert!(!policies.for_path(grpc::GET_CHARGE).requires_key());
    assert!(
        policies
            .for_route(&Method::POST, "/v1/payments")
            .requires_key()
    );
    assert!(
        !policies
            .for_route(&Method::GET, "/v1/payments/{intent_id}")
            .requires_key()
    );
    assert!(
        !policies
            .for_path("/payment.v1.Payment/Refund")
            .requires_key()
    );
}

#[tokio::test]
async fn every_keyed_http_route_is_claimed_before_its_handler() {
    let dir = tempfile::tempdir().unwrap();
    let config = Config::new(StoreLocation::Sqlite(dir.path().join("pay.db")));
    let db = Db::open(dir.path().join("pay.db"), SqliteOptions::default()).unwrap();
    let store = SqliteStore::new(db.clone()).await.unwrap();
    let intents = Intents::open(db).await.unwrap();
    // Never called: a probe is refused before any handler.
    let psp = PspClient::new(
        "http://127.0.0.1:9",
        RetryBudget::new(0.1, 20).unwrap(),
        Duration::from_millis(100),
    )
    .unwrap();
    let state = AppState::new(intents, psp, Arc::new(SystemClock), prometheus_handle());
    let rate_limit = rate_limit_layer(&config).unwrap();
    let routers = build_routers(state, store, &config, rate_limit);

    let uncovered = keyed_routes_uncovered(routers.http, &config.method_policies(), |b| b).await;
    // `Charge` over HTTP is claimed; its gRPC path is served on the other port only.
    let routes: Vec<(&str, bool)> = uncovered
        .iter()
        .map(|u| (u.route.as_str(), u.unserved))
        .collect();
    assert_eq!(
        routes,
        [("POST /payment.v1.Payment/Charge", true)],
        "{uncovered:?}"
    );
}
