//! `GET /openapi.json` on a live service: the document the code generates, served as JSON; and
//! the answers a client meets match it: a created payment and a read carry the documented
//! members, and refusals carry a documented status and a `code` of the document's list.

mod support;

use std::collections::BTreeSet;

use serde_json::Value;
use support::{Harness, body};
use utoipa::OpenApi;

fn document() -> Value {
    let json = backstop_payment::service::openapi::ApiDoc::openapi()
        .to_json()
        .expect("the document serializes");
    serde_json::from_str(&json).unwrap()
}

/// The statuses the document gives `method` on `path`.
fn statuses(doc: &Value, path: &str, method: &str) -> BTreeSet<String> {
    doc["paths"][path][method]["responses"]
        .as_object()
        .unwrap_or_else(|| panic!("{method} {path} is documented"))
        .keys()
        .cloned()
        .collect()
}

fn codes(doc: &Value) -> BTreeSet<String> {
    let code = &doc["components"]["schemas"]["Problem"]["properties"]["code"];
    code["enum"]
        .as_array()
        .or_else(|| code["oneOf"][0]["enum"].as_array())
        .expect("Problem.code is an enum")
        .iter()
        .map(|c| c.as_str().unwrap().to_owned())
        .collect()
}

/// The required members of the schema `name` are in `answer`.
fn has_required(doc: &Value, name: &str, answer: &Value) {
    for member in doc["components"]["schemas"][name]["required"]
        .as_array()
        .expect("required members")
    {
        let member = member.as_str().unwrap();
        assert!(
            !answer[member].is_null(),
            "{name}.{member} missing in {answer}"
        );
    }
}

#[tokio::test]
async fn the_served_document_is_the_generated_one_and_answers_match_it() {
    let h = Harness::start().await;
    let served = h.get("/openapi.json", &[]).await;
    assert_eq!(served.status, 200);
    assert_eq!(served.header("content-type"), Some("application/json"));
    let doc = document();
    assert_eq!(served.json, doc);
    assert_eq!(doc["openapi"], "3.1.0");
    let documented: BTreeSet<&str> = doc["paths"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        documented,
        BTreeSet::from([
            "/healthz",
            "/metrics",
            "/openapi.json",
            "/readyz",
            "/v1/payments",
            "/v1/payments/{intent_id}",
        ])
    );
    let codes = codes(&doc);

    // A payment, as documented.
    let created = h.post(Some("oa-1"), &body("oa-order-1", 1999), &[]).await;
    assert_eq!(created.status, 201, "{:?}", created.json);
    assert!(statuses(&doc, "/v1/payments", "post").contains("201"));
    has_required(&doc, "Payment", &created.json);
    let id = created.json["intent_id"].as_str().unwrap();
    let read = h.get(&format!("/v1/payments/{id}"), &[]).await;
    assert_eq!(read.status, 200);
    has_required(&doc, "Payment", &read.json);

    // Refusals: a documented status, a documented code, the Problem's members.
    let refusals = [
        h.post(None, &body("oa-order-2", 1), &[]).await,
        h.post(Some("oa-2"), "{", &[]).await,
        h.post(
            Some("oa-3"),
            r#"{"order_id":"o","amount_cents":1,"x":1}"#,
            &[],
        )
        .await,
        h.post(Some("oa-1"), &body("oa-order-1", 2999), &[]).await,
        h.post(Some("oa-4"), &body("oa-order-1", 1999), &[]).await,
        h.post(
            Some("oa-5"),
            &body("oa-order-5", 1),
            &[("grpc-timeout", "1n")],
        )
        .await,
    ];
    for answer in &refusals {
        let status = answer.status.as_u16().to_string();
        assert!(
            statuses(&doc, "/v1/payments", "post").contains(&status),
            "undocumented status {status}: {:?}",
            answer.json
        );
        assert!(codes.contains(answer.code()), "{:?}", answer.json);
        has_required(&doc, "Problem", &answer.json);
    }
    let missing = h.get("/v1/payments/no-such-payment", &[]).await;
    assert_eq!(missing.status, 404);
    assert!(statuses(&doc, "/v1/payments/{intent_id}", "get").contains("404"));
    assert!(codes.contains(missing.code()), "{:?}", missing.json);
}
