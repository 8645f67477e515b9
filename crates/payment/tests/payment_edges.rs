//! The payment path at its edges: ambiguous input, tiny budgets, PSP answers that charged
//! nothing, abandoned intents, and merchants sharing order ids at the PSP.

mod support;

use reqwest::StatusCode;
use support::{Harness, body};

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
