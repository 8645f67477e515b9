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
