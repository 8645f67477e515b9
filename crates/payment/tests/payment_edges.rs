//! The payment path at its edges: ambiguous input, tiny budgets, PSP answers that charged
//! nothing, abandoned intents, and merchants sharing order ids at the PSP.

mod support;
// The per-test PostgreSQL schema and the check that the server answers, shared with the
// library's and the CLI's tests.
#[path = "../../backstop/tests/support/postgres_schema.rs"]
mod postgres_schema;
#[path = "../../backstop/tests/support/services.rs"]
mod services;

use std::sync::Arc;
use std::time::Duration;

use backstop::clock::{Clock, SystemClock};
use backstop::retry::RetryBudget;
use backstop_payment::config::StoreLocation;
use backstop_payment::intents::IntentStatus;
use backstop_payment::psp::Fault;
use backstop_payment::psp_client::PspClient;
use backstop_payment::resolver::{self, SETTLE_AFTER};
use backstop_payment::server::prometheus_handle;
use backstop_payment::service::AppState;
use reqwest::StatusCode;
use support::{Answer, Harness, body};

#[tokio::test]
async fn duplicate_json_member_is_refused_and_charges_nothing() {
    let h = Harness::start().await;
    let r = h
        .post(
            Some("dup-1"),
            r#"{"order_id":"o-dup","amount_cents":1,"amount_cents":99999}"#,
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
    assert_eq!(r.code(), "duplicate_field");
    assert_eq!(r.json["field"], "amount_cents");
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(h.intent_count().await, 0);
    assert_eq!(h.all_charges().await, 0);
    // The key was left unused.
    let ok = h.post(Some("dup-1"), &body("o-dup", 1), &[]).await;
    assert_eq!(ok.status, StatusCode::CREATED, "{:?}", ok.json);
    assert_eq!(h.charges("o-dup").await.len(), 1);
}

fn two_merchants(c: &mut backstop_payment::config::Config) {
    use backstop_payment::config::ApiKey;
    c.api_keys = vec![
        ApiKey::parse("acme=key-acme-0001").unwrap(),
        ApiKey::parse("globex=key-globex-0002").unwrap(),
    ];
}

const ACME: (&str, &str) = ("authorization", "Bearer key-acme-0001");
const GLOBEX: (&str, &str) = ("authorization", "Bearer key-globex-0002");

#[tokio::test]
async fn two_authorization_headers_are_401_never_first_wins() {
    let h = Harness::start_with(two_merchants).await;
    for headers in [
        vec![ACME, GLOBEX],
        vec![GLOBEX, ACME],
        vec![ACME, ACME],
        vec![ACME, ("authorization", "Bearer nope")],
    ] {
        let r = h
            .post(Some("two-auth"), &body("o-auth", 100), &headers)
            .await;
        assert_eq!(
            r.status,
            StatusCode::UNAUTHORIZED,
            "{headers:?}: {:?}",
            r.json
        );
        assert_eq!(r.code(), "unauthenticated");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    assert_eq!(h.intent_count().await, 0);
    assert_eq!(h.all_charges().await, 0);
}

#[tokio::test]
async fn every_401_carries_a_bearer_challenge() {
    let h = Harness::start_with(two_merchants).await;
    for headers in [
        vec![],
        vec![("authorization", "Bearer nope")],
        vec![("authorization", "Basic a2V5")],
    ] {
        let post = h.post(Some("k-401"), &body("o-401", 100), &headers).await;
        let get = h.get("/v1/payments/anything", &headers).await;
        for r in [post, get] {
            assert_eq!(r.status, StatusCode::UNAUTHORIZED);
            assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{headers:?}");
            assert_eq!(r.header("content-type"), Some("application/problem+json"));
        }
    }
    let ok = h.post(Some("k-401"), &body("o-401", 100), &[ACME]).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert!(ok.header("www-authenticate").is_none());
}

#[tokio::test]
async fn two_merchants_same_order_id_never_share_a_psp_reference() {
    let h = Harness::start_with(two_merchants).await;
    let a = h.post(Some("k-a"), &body("o-1", 100), &[ACME]).await;
    let b = h.post(Some("k-b"), &body("o-1", 700), &[GLOBEX]).await;
    assert_eq!(a.status, StatusCode::CREATED, "{:?}", a.json);
    assert_eq!(b.status, StatusCode::CREATED, "{:?}", b.json);
    let acme = h.merchant_charges("acme", "o-1").await;
    let globex = h.merchant_charges("globex", "o-1").await;
    assert_eq!(acme.len(), 1);
    assert_eq!(globex.len(), 1);
    assert_eq!(acme[0].amount_cents, 100);
    assert_eq!(globex[0].amount_cents, 700);
    assert_eq!(acme[0].effect_key, a.json["intent_id"].as_str().unwrap());
    assert_eq!(globex[0].effect_key, b.json["intent_id"].as_str().unwrap());
    assert!(h.charges("o-1").await.is_empty(), "no bare order id");
    // Each merchant's GET converges with its own charge.
    let got = h
        .get(
            &format!("/v1/payments/{}", a.json["intent_id"].as_str().unwrap()),
            &[ACME],
        )
        .await;
    assert_eq!(got.json["charge_id"], acme[0].charge_id.as_str());
}

// ---- tiny budgets, and what "unknown" means ----

/// The service's production margin floor: 20 ms kept for the way back, per hop and attempt.
fn production_margin(c: &mut backstop_payment::config::Config) {
    c.psp_margin_floor = Duration::from_millis(20);
}

#[tokio::test]
async fn tiny_budgets_write_no_intent_and_never_block_the_order() {
    let h = Harness::start_with(production_margin).await;
    for (i, budget) in ["1n", "1u", "999u", "5m", "10m", "20m", "25m", "40m"]
        .iter()
        .enumerate()
    {
        let order = format!("o-tiny-{i}");
        let r = h
            .post(
                Some(&format!("tiny-{i}")),
                &body(&order, 100),
                &[("grpc-timeout", budget)],
            )
            .await;
        assert_eq!(
            r.status,
            StatusCode::GATEWAY_TIMEOUT,
            "{budget}: {:?}",
            r.json
        );
        assert_eq!(r.code(), "deadline_exceeded", "{budget}: nothing was sent");
        assert_eq!(h.intent_count().await, i as u64, "{budget} wrote an intent");
        assert_eq!(
            h.idempotency_rows().await,
            i as u64,
            "{budget} left an idempotency record"
        );
        // Another key pays the order at once: nothing holds it.
        let ok = h
            .post(Some(&format!("ok-{i}")), &body(&order, 100), &[])
            .await;
        assert_eq!(ok.status, StatusCode::CREATED, "{budget}: {:?}", ok.json);
        assert_eq!(h.intent_count().await, i as u64 + 1);
    }
    assert_eq!(h.all_charges().await, 8, "one charge per good request only");
}

/// One unary `Charge` over a raw HTTP/2 connection with `grpc-timeout: budget` (a tonic
/// client would enforce a budget this small itself and report `CANCELLED`): the `grpc-status`.
async fn raw_grpc_charge(h: &Harness, key: &str, order: &str, budget: &str) -> String {
    use backstop_payment::grpc::proto::ChargeRequest;
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use prost::Message;
    let message = ChargeRequest {
        order_id: order.into(),
        amount_cents: 100,
        currency: String::new(),
    }
    .encode_to_vec();
    let mut framed = vec![0];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&message);
    let tcp = tokio::net::TcpStream::connect(h.server.grpc_addr())
        .await
        .unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let request = http::Request::post(format!(
        "http://{}/payment.v1.Payment/Charge",
        h.server.grpc_addr()
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .header("idempotency-key", key)
    .header("grpc-timeout", budget)
    .body(Full::new(bytes::Bytes::from(framed)))
    .unwrap();
    let (head, body) = sender.send_request(request).await.unwrap().into_parts();
    let trailers = body
        .collect()
        .await
        .unwrap()
        .trailers()
        .cloned()
        .unwrap_or_default();
    head.headers
        .get("grpc-status")
        .or_else(|| trailers.get("grpc-status"))
        .expect("a grpc-status")
        .to_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn tiny_grpc_budgets_are_deadline_exceeded_and_write_nothing() {
    let h = Harness::start_with(production_margin).await;
    for (i, budget) in ["1n", "1u", "999u", "5m", "20m"].iter().enumerate() {
        let status =
            raw_grpc_charge(&h, &format!("g-tiny-{i}"), &format!("g-tiny-{i}"), budget).await;
        // 4: DEADLINE_EXCEEDED, never UNAVAILABLE "outcome unknown".
        assert_eq!(status, "4", "{budget}");
        assert_eq!(h.intent_count().await, 0, "{budget} wrote an intent");
    }
    assert_eq!(h.all_charges().await, 0);
}

#[tokio::test]
async fn psp_refusing_every_attempt_is_503_with_retry_after_not_unknown() {
    let h = Harness::start().await;
    // More 503s (each "nothing charged", Retry-After: 1) than the client will try.
    h.script(&[Fault::Unavailable; 8]);
    let r = h.post(Some("k-503"), &body("o-503", 100), &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", r.json);
    assert_eq!(r.code(), "psp_unavailable");
    assert!(r.header("retry-after").is_some(), "back-off is said");
    let intent_id = r.json["intent_id"]
        .as_str()
        .expect("names the intent")
        .to_owned();
    assert!(h.charges("o-503").await.is_empty());
    // Once the PSP is back the same key charges the same intent, once.
    h.script(&[]);
    h.psp.faults().set(Default::default()).unwrap();
    let ok = h.post(Some("k-503"), &body("o-503", 100), &[]).await;
    assert_eq!(ok.status, StatusCode::CREATED, "{:?}", ok.json);
    assert_eq!(ok.json["intent_id"], intent_id.as_str());
    assert_eq!(h.charges("o-503").await.len(), 1);
}

#[tokio::test]
async fn grpc_psp_refusing_every_attempt_is_unavailable_with_pushback() {
    use backstop_payment::grpc::proto::ChargeRequest;
    use backstop_payment::grpc::proto::payment_client::PaymentClient;
    let h = Harness::start().await;
    h.script(&[Fault::Unavailable; 8]);
    let mut request = tonic::Request::new(ChargeRequest {
        order_id: "g-503".into(),
        amount_cents: 100,
        currency: String::new(),
    });
    request
        .metadata_mut()
        .insert("idempotency-key", "g-503".parse().unwrap());
    request.set_timeout(Duration::from_secs(10));
    let mut client = PaymentClient::connect(format!("http://{}", h.server.grpc_addr()))
        .await
        .unwrap();
    let status = client.charge(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("charged nothing"), "{status:?}");
    assert!(status.metadata().get("grpc-retry-pushback-ms").is_some());
    assert!(h.charges("g-503").await.is_empty());
}

// ---- the resolver ----

/// An [`AppState`] over the harness's intents and PSP, as `serve` builds it for the resolver.
fn state_of(h: &Harness) -> AppState {
    let psp = PspClient::new(
        &h.psp.url(),
        RetryBudget::new(0.1, 20).unwrap(),
        Duration::from_millis(20),
    )
    .unwrap();
    AppState::new(
        h.server.intents().clone(),
        psp,
        Arc::new(SystemClock),
        prometheus_handle(),
    )
}

/// Leaves a running intent behind: the PSP's answer never arrives in time (`fault`), the
/// request gives up. Returns the intent id.
async fn abandon(h: &Harness, key: &str, order: &str, fault: Fault) -> String {
    h.script(&[fault]);
    let r = h
        .post(Some(key), &body(order, 100), &[("grpc-timeout", "1S")])
        .await;
    assert!(r.status.is_server_error(), "{:?}", r.json);
    let id = r.json["intent_id"]
        .as_str()
        .expect("names the intent")
        .to_owned();
    let intent = h
        .server
        .intents()
        .get("default", &id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(intent.status, IntentStatus::Running, "work was abandoned");
    id
}

/// Settles `h`'s abandoned intents as the background resolver would once they are old.
async fn resolve(h: &Harness) -> usize {
    let later = SystemClock.now_ms() + i64::try_from(SETTLE_AFTER.as_millis()).unwrap() + 1000;
    resolver::settle_abandoned(&state_of(h), later, SETTLE_AFTER)
        .await
        .unwrap()
}

async fn charge_directly(h: &Harness, effect_key: &str, reference: &str) -> StatusCode {
    h.http
        .post(format!("{}/v1/charges", h.psp.url()))
        .header("idempotency-key", effect_key)
        .json(&serde_json::json!({"reference": reference, "amount_cents": 100, "currency": "USD"}))
        .send()
        .await
        .unwrap()
        .status()
}

async fn resolver_settles_abandoned_intents_both_ways(h: &Harness) {
    // Charged, but the answer came too late: the resolver finds the charge.
    let charged = abandon(h, "k-late", "o-late", Fault::CommitThenTimeout).await;
    // Never charged: the PSP dropped the request before charging (a 503 the client did not
    // wait out is just as possible; either way nothing landed).
    h.latency(Duration::from_secs(60));
    let uncharged = abandon(h, "k-lost", "o-lost", Fault::None).await;
    h.latency(Duration::ZERO);
    // Fresh intents are left alone.
    let state = state_of(h);
    assert_eq!(
        resolver::settle_abandoned(&state, SystemClock.now_ms(), SETTLE_AFTER)
            .await
            .unwrap(),
        0
    );
    // Both are counted as left running, the oldest first created.
    let left = resolver::observe_running(&state, SystemClock.now_ms())
        .await
        .unwrap();
    assert_eq!(left.count, 2);
    let created = intents_created_at(h, &charged).await;
    assert_eq!(left.oldest_created_at, Some(created));

    assert_eq!(resolve(h).await, 2);
    let intents = h.server.intents();
    let ok = intents.get("default", &charged).await.unwrap().unwrap();
    assert_eq!(ok.status, IntentStatus::Succeeded);
    assert_eq!(
        ok.psp_charge_id.as_deref(),
        Some(h.charges("o-late").await[0].charge_id.as_str())
    );
    let failed = intents.get("default", &uncharged).await.unwrap().unwrap();
    assert_eq!(failed.status, IntentStatus::Failed);
    // Settling failed is safe: a charge with that effect key can no longer land.
    assert_eq!(
        charge_directly(h, &uncharged, "default:o-lost").await,
        StatusCode::GONE
    );
    assert!(h.charges("o-lost").await.is_empty());
    // The same key converges on the settled outcomes...
    let again = h.post(Some("k-late"), &body("o-late", 100), &[]).await;
    assert_eq!(again.status, StatusCode::CREATED, "{:?}", again.json);
    let again = h.post(Some("k-lost"), &body("o-lost", 100), &[]).await;
    assert_eq!(
        again.status,
        StatusCode::PAYMENT_REQUIRED,
        "{:?}",
        again.json
    );
    // ... and the failed intent's order is free for another key.
    let other = h.post(Some("k-lost-2"), &body("o-lost", 100), &[]).await;
    assert_eq!(other.status, StatusCode::CREATED, "{:?}", other.json);
    assert_eq!(h.charges("o-lost").await.len(), 1);
    assert_eq!(h.charges("o-late").await.len(), 1);
    assert_eq!(resolve(h).await, 0, "nothing left running");
    let left = resolver::observe_running(&state, SystemClock.now_ms())
        .await
        .unwrap();
    assert_eq!(left.count, 0, "the gauge falls back to 0 once settled");
    assert_eq!(left.oldest_created_at, None);
}

async fn intents_created_at(h: &Harness, intent_id: &str) -> i64 {
    let intent = h.server.intents().get("default", intent_id).await.unwrap();
    intent.expect("the intent exists").created_at
}

#[tokio::test]
async fn resolver_settles_abandoned_intents_both_ways_on_sqlite() {
    let h = Harness::start().await;
    resolver_settles_abandoned_intents_both_ways(&h).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolver_settles_abandoned_intents_both_ways_on_postgres() {
    if !services::postgres() {
        return;
    }
    let schema = postgres_schema::Schema::create("payment_edges").await;
    let store = StoreLocation::parse(&schema.store_url(None)).expect("store URL");
    let h = Harness::start_with(move |c| c.store = store).await;
    resolver_settles_abandoned_intents_both_ways(&h).await;
}

/// Makes every intent of `h` look `SETTLE_AFTER` older (SQLite).
async fn age_intents(h: &Harness) {
    let by = i64::try_from(SETTLE_AFTER.as_millis()).unwrap() + 1000;
    h.server
        .intents()
        .db()
        .expect("a SQLite store")
        .write(move |c| {
            c.execute(
                "UPDATE payment_intent SET created_at = created_at - ?1",
                [by],
            )
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn get_settles_an_abandoned_intent() {
    let h = Harness::start().await;
    h.latency(Duration::from_secs(60));
    let id = abandon(&h, "k-get", "o-get", Fault::None).await;
    h.latency(Duration::ZERO);
    let running = h.get(&format!("/v1/payments/{id}"), &[]).await;
    assert_eq!(running.json["status"], "running", "too young to settle");
    age_intents(&h).await;
    let settled: Answer = h.get(&format!("/v1/payments/{id}"), &[]).await;
    assert_eq!(settled.status, StatusCode::OK);
    assert_eq!(settled.json["status"], "failed", "{:?}", settled.json);
    let other = h.post(Some("k-get-2"), &body("o-get", 100), &[]).await;
    assert_eq!(other.status, StatusCode::CREATED, "the order is free");
}

#[tokio::test]
async fn serve_runs_the_resolver_in_the_background() {
    let h = Harness::start().await;
    let id = abandon(&h, "k-bg", "o-bg", Fault::CommitThenTimeout).await;
    age_intents(&h).await;
    // The background round comes within `resolver::EVERY`; the test's own timeout bounds it.
    loop {
        let intent = h
            .server
            .intents()
            .get("default", &id)
            .await
            .unwrap()
            .unwrap();
        if intent.status != IntentStatus::Running {
            assert_eq!(intent.status, IntentStatus::Succeeded);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
