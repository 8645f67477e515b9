//! The PSP simulator over real HTTP: a server on 127.0.0.1:0 and a reqwest client.
//!
//! Faults are scripted through `PUT /admin/faults` (`"next"`), so every scenario is exact.
//! Nothing here asserts on elapsed time; where the client must give up first, its timeout is
//! far shorter than the time the PSP holds the answer.

use std::time::Duration;

use backstop_payment::psp::{
    self, Charge, ChargePage, ChargeStatus, Faults, PspConfig, PspHandle, Refund,
};
use reqwest::StatusCode;
use serde_json::{Value, json};

async fn start() -> PspHandle {
    psp::spawn(PspConfig::default()).await.expect("psp starts")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client builds")
}

fn body(reference: &str, amount_cents: i64) -> Value {
    json!({ "reference": reference, "amount_cents": amount_cents, "currency": "USD" })
}

async fn charge(
    client: &reqwest::Client,
    psp: &PspHandle,
    key: &str,
    body: &Value,
) -> reqwest::Response {
    client
        .post(format!("{}/v1/charges", psp.url()))
        .header("Idempotency-Key", key)
        .json(body)
        .send()
        .await
        .expect("charge request answered")
}

async fn list(client: &reqwest::Client, psp: &PspHandle, reference: Option<&str>) -> Vec<Charge> {
    let mut request = client.get(format!("{}/v1/charges", psp.url()));
    if let Some(reference) = reference {
        request = request.query(&[("reference", reference)]);
    }
    let response = request.send().await.expect("list answered");
    assert_eq!(response.status(), StatusCode::OK);
    response
        .json()
        .await
        .expect("list is a JSON array of charges")
}

async fn script(client: &reqwest::Client, psp: &PspHandle, settings: Value) -> Value {
    let response = client
        .put(format!("{}/admin/faults", psp.url()))
        .json(&settings)
        .send()
        .await
        .expect("admin answered");
    assert_eq!(response.status(), StatusCode::OK, "settings {settings}");
    response.json().await.expect("settings echoed")
}

async fn problem_code(response: reqwest::Response) -> String {
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let problem: Value = response.json().await.expect("problem body");
    problem["code"]
        .as_str()
        .expect("problem has a code")
        .to_owned()
}

#[tokio::test]
async fn healthz_answers_ok() {
    let psp = start().await;
    let response = client()
        .get(format!("{}/healthz", psp.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    psp.shutdown().await;
}

#[tokio::test]
async fn same_effect_key_twice_charges_once_and_replays() {
    let psp = start().await;
    let client = client();

    let first = charge(&client, &psp, "pi_1", &body("order-1", 1250)).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let created: Charge = first.json().await.unwrap();
    assert!(created.charge_id.starts_with("ch_"));
    assert_eq!(created.effect_key, "pi_1");
    assert_eq!(created.reference, "order-1");
    assert_eq!(created.amount_cents, 1250);
    assert_eq!(created.currency, "USD");
    assert_eq!(created.status, ChargeStatus::Succeeded);

    let second = charge(&client, &psp, "pi_1", &body("order-1", 1250)).await;
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    let replayed: Charge = second.json().await.unwrap();
    assert_eq!(replayed, created);

    assert_eq!(list(&client, &psp, Some("order-1")).await, vec![created]);
    assert_eq!(psp.store().count().await.unwrap(), 1);
    psp.shutdown().await;
}

#[tokio::test]
async fn charge_json_has_the_documented_fields() {
    let psp = start().await;
    let response = charge(&client(), &psp, "pi_fields", &body("order-f", 1)).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let json: Value = response.json().await.unwrap();
    let mut fields: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        [
            "amount_cents",
            "amount_refunded_cents",
            "budget_ms",
            "charge_id",
            "created_ms",
            "currency",
            "effect_key",
            "reference",
            "status",
            "traceparent"
        ]
    );
    assert_eq!(json["status"], "succeeded");
    assert_eq!(json["budget_ms"], Value::Null);
    assert_eq!(json["traceparent"], Value::Null);
    psp.shutdown().await;
}

#[tokio::test]
async fn same_effect_key_other_parameters_is_409_idempotency_key_reused() {
    let psp = start().await;
    let client = client();
    assert_eq!(
        charge(&client, &psp, "pi_2", &body("order-2", 500))
            .await
            .status(),
        StatusCode::CREATED
    );
    for other in [
        body("order-2", 501),
        body("order-other", 500),
        json!({ "reference": "order-2", "amount_cents": 500, "currency": "EUR" }),
    ] {
        let response = charge(&client, &psp, "pi_2", &other).await;
        assert_eq!(response.status(), StatusCode::CONFLICT, "{other}");
        assert_eq!(problem_code(response).await, "idempotency_key_reused");
    }
    assert_eq!(psp.store().count().await.unwrap(), 1);
    psp.shutdown().await;
}

#[tokio::test]
async fn quoted_effect_key_is_the_same_key() {
    let psp = start().await;
    let client = client();
    let first: Charge = charge(&client, &psp, "pi_q", &body("order-q", 10))
        .await
        .json()
        .await
        .unwrap();
    let second = charge(&client, &psp, "\"pi_q\"", &body("order-q", 10)).await;
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(second.json::<Charge>().await.unwrap(), first);
    psp.shutdown().await;
}

#[tokio::test]
async fn thirty_two_concurrent_same_key_charge_once() {
    let psp = start().await;
    let client = client();
    let request = body("order-32", 999);
    let answers = futures_util::future::join_all(
        (0..32).map(|_| charge(&client, &psp, "pi_concurrent", &request)),
    )
    .await;
    let mut created = 0;
    let mut ids = Vec::new();
    for response in answers {
        match response.status() {
            StatusCode::CREATED => created += 1,
            StatusCode::OK => assert_eq!(response.headers()["idempotent-replayed"], "true"),
            other => panic!("unexpected status {other}"),
        }
        ids.push(response.json::<Charge>().await.unwrap().charge_id);
    }
    assert_eq!(created, 1);
    ids.dedup();
    assert_eq!(ids.len(), 1, "every answer names the same charge");
    assert_eq!(list(&client, &psp, Some("order-32")).await.len(), 1);
    psp.shutdown().await;
}

#[tokio::test]
async fn list_by_reference_and_all() {
    let psp = start().await;
    let client = client();
    for (key, reference) in [("k1", "order-a"), ("k2", "order-b"), ("k3", "order-a")] {
        assert_eq!(
            charge(&client, &psp, key, &body(reference, 100))
                .await
                .status(),
            StatusCode::CREATED
        );
    }
    let keys = |charges: Vec<Charge>| -> Vec<String> {
        charges
            .into_iter()
            .map(|charge| charge.effect_key)
            .collect()
    };
    assert_eq!(
        keys(list(&client, &psp, Some("order-a")).await),
        ["k3", "k1"]
    );
    assert_eq!(keys(list(&client, &psp, Some("order-b")).await), ["k2"]);
    assert!(list(&client, &psp, Some("order-none")).await.is_empty());
    assert_eq!(keys(list(&client, &psp, None).await), ["k3", "k2", "k1"]);

    let bad = client
        .get(format!("{}/v1/charges?colour=red", psp.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_code(bad).await, "invalid_query");
    psp.shutdown().await;
}

/// One malformed charge request and the problem code it must get.
struct BadInput {
    name: &'static str,
    key: Option<String>,
    headers: &'static [(&'static str, &'static str)],
    body: String,
    code: &'static str,
}

fn bad(name: &'static str, key: Option<&str>, body: impl ToString, code: &'static str) -> BadInput {
    BadInput {
        name,
        key: key.map(str::to_owned),
        headers: &[],
        body: body.to_string(),
        code,
    }
}

fn bad_timeout(name: &'static str, header: &'static [(&'static str, &'static str)]) -> BadInput {
    BadInput {
        headers: header,
        ..bad(name, Some("k"), body("o", 1), "invalid_grpc_timeout")
    }
}

#[tokio::test]
async fn bad_input_is_400_and_charges_nothing() {
    let psp = start().await;
    let client = client();
    let url = format!("{}/v1/charges", psp.url());
    let good = body("order-bad", 100);
    let long_key = "k".repeat(256);
    let k = Some("k");
    let cases = [
        bad("no key", None, &good, "missing_idempotency_key"),
        bad(
            "256-char key",
            Some(&long_key),
            &good,
            "invalid_idempotency_key",
        ),
        bad(
            "key with space",
            Some("a b"),
            &good,
            "invalid_idempotency_key",
        ),
        bad("not JSON", k, "charge me", "invalid_body"),
        bad("empty body", k, "", "invalid_body"),
        bad(
            "unknown field",
            k,
            json!({"reference": "o", "amount_cents": 1, "currency": "USD", "card_number": "4242"}),
            "invalid_body",
        ),
        bad(
            "float amount",
            k,
            json!({"reference": "o", "amount_cents": 1.5, "currency": "USD"}),
            "invalid_body",
        ),
        bad(
            "amount as string",
            k,
            json!({"reference": "o", "amount_cents": "100", "currency": "USD"}),
            "invalid_body",
        ),
        bad("zero amount", k, body("o", 0), "invalid_amount"),
        bad("negative amount", k, body("o", -5), "invalid_amount"),
        bad(
            "missing reference",
            k,
            json!({"amount_cents": 1, "currency": "USD"}),
            "invalid_body",
        ),
        bad("empty reference", k, body("", 1), "invalid_reference"),
        bad(
            "lower-case currency",
            k,
            json!({"reference": "o", "amount_cents": 1, "currency": "usd"}),
            "invalid_currency",
        ),
        bad_timeout("9-digit grpc-timeout", &[("grpc-timeout", "100000000m")]),
        bad_timeout("grpc-timeout without unit", &[("grpc-timeout", "100")]),
        bad_timeout("zero grpc-timeout", &[("grpc-timeout", "0S")]),
        bad_timeout(
            "grpc-timeout in seconds, lower case",
            &[("grpc-timeout", "1s")],
        ),
    ];
    for case in cases {
        let mut request = client
            .post(&url)
            .header("content-type", "application/json")
            .body(case.body);
        if let Some(key) = case.key {
            request = request.header("Idempotency-Key", key);
        }
        for (header, value) in case.headers {
            request = request.header(*header, *value);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{}", case.name);
        assert_eq!(problem_code(response).await, case.code, "{}", case.name);
    }

    let huge = json!({"reference": "x".repeat(70 * 1024), "amount_cents": 1, "currency": "USD"});
    let response = charge(&client, &psp, "k", &huge).await;
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(problem_code(response).await, "body_too_large");

    assert_eq!(psp.store().count().await.unwrap(), 0);
    psp.shutdown().await;
}

#[tokio::test]
async fn budget_ms_is_recorded_from_grpc_timeout() {
    let psp = start().await;
    let client = client();
    for (key, timeout, budget_ms) in [
        ("b1", Some("1500m"), Some(1500)),
        ("b2", Some("2S"), Some(2000)),
        ("b3", Some("2500000u"), Some(2500)),
        ("b4", None, None),
    ] {
        let mut request = client
            .post(format!("{}/v1/charges", psp.url()))
            .header("Idempotency-Key", key)
            .json(&body(key, 100));
        if let Some(timeout) = timeout {
            request = request.header("grpc-timeout", timeout);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        let charge: Charge = response.json().await.unwrap();
        assert_eq!(charge.budget_ms, budget_ms, "{timeout:?}");
        assert_eq!(list(&client, &psp, Some(key)).await[0].budget_ms, budget_ms);
    }
    psp.shutdown().await;
}

#[tokio::test]
async fn traceparent_is_recorded() {
    let psp = start().await;
    let client = client();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let response = client
        .post(format!("{}/v1/charges", psp.url()))
        .header("Idempotency-Key", "tp")
        .header("traceparent", traceparent)
        .json(&body("order-tp", 100))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let charge: Charge = response.json().await.unwrap();
    assert_eq!(charge.traceparent.as_deref(), Some(traceparent));
    assert_eq!(
        list(&client, &psp, Some("order-tp")).await[0]
            .traceparent
            .as_deref(),
        Some(traceparent)
    );
    psp.shutdown().await;
}

#[tokio::test]
async fn fault_error_is_500_without_charge() {
    let psp = start().await;
    let client = client();
    script(&client, &psp, json!({ "next": ["error"] })).await;
    let response = charge(&client, &psp, "fe", &body("order-fe", 100)).await;
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(problem_code(response).await, "psp_error");
    assert!(list(&client, &psp, Some("order-fe")).await.is_empty());

    // The script is spent: the same key now charges.
    let retry = charge(&client, &psp, "fe", &body("order-fe", 100)).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(list(&client, &psp, Some("order-fe")).await.len(), 1);
    psp.shutdown().await;
}

#[tokio::test]
async fn fault_unavailable_is_503_with_retry_after_without_charge() {
    let psp = start().await;
    let client = client();
    script(&client, &psp, json!({ "next": ["unavailable"] })).await;
    let response = charge(&client, &psp, "fu", &body("order-fu", 100)).await;
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()["retry-after"], "1");
    assert_eq!(problem_code(response).await, "psp_unavailable");
    assert!(list(&client, &psp, Some("order-fu")).await.is_empty());

    let retry = charge(&client, &psp, "fu", &body("order-fu", 100)).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    psp.shutdown().await;
}

#[tokio::test]
async fn fault_commit_then_timeout_charges_then_answers_too_late() {
    let psp = start().await;
    // The PSP holds its answer until 1 s past the 5 s deadline it was given; this client
    // gives up after 1 s, long after the charge (a local SQLite insert) was written.
    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let client = client();
    script(&client, &psp, json!({ "next": ["commit_then_timeout"] })).await;
    let error = impatient
        .post(format!("{}/v1/charges", psp.url()))
        .header("Idempotency-Key", "ft")
        .header("grpc-timeout", "5S")
        .json(&body("order-ft", 4200))
        .send()
        .await
        .expect_err("the answer comes after the client gave up");
    assert!(error.is_timeout(), "{error:?}");

    let charged = list(&client, &psp, Some("order-ft")).await;
    assert_eq!(charged.len(), 1, "the PSP charged before timing out");
    assert_eq!(charged[0].budget_ms, Some(5000));

    // Retrying with the same effect key converges on the same charge.
    let retry = charge(&client, &psp, "ft", &body("order-ft", 4200)).await;
    assert_eq!(retry.status(), StatusCode::OK);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.json::<Charge>().await.unwrap(), charged[0]);
    assert_eq!(psp.store().count().await.unwrap(), 1);
    // Shutdown cuts the request still held (its connection is closed).
    psp.shutdown().await;
}

#[tokio::test]
async fn fault_commit_then_drop_closes_the_connection_after_charging() {
    let psp = start().await;
    let client = client();
    script(&client, &psp, json!({ "next": ["commit_then_drop"] })).await;
    let patient = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let error = patient
        .post(format!("{}/v1/charges", psp.url()))
        .header("Idempotency-Key", "fd")
        .json(&body("order-fd", 4300))
        .send()
        .await
        .expect_err("no response, the connection was closed");
    assert!(!error.is_timeout(), "closed, not timed out: {error:?}");
    assert!(error.status().is_none(), "no HTTP status at all: {error:?}");

    let charged = list(&client, &psp, Some("order-fd")).await;
    assert_eq!(charged.len(), 1, "the PSP charged before dropping");

    let retry = charge(&client, &psp, "fd", &body("order-fd", 4300)).await;
    assert_eq!(retry.status(), StatusCode::OK);
    assert_eq!(retry.json::<Charge>().await.unwrap(), charged[0]);
    assert_eq!(psp.store().count().await.unwrap(), 1);
    psp.shutdown().await;
}

#[tokio::test]
async fn latency_past_the_deadline_is_504_without_charge() {
    let psp = start().await;
    let client = client();
    script(&client, &psp, json!({ "latency_ms": 60_000 })).await;
    let response = client
        .post(format!("{}/v1/charges", psp.url()))
        .header("Idempotency-Key", "fl")
        .header("grpc-timeout", "50m")
        .json(&body("order-fl", 100))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(problem_code(response).await, "deadline_exceeded");
    assert!(list(&client, &psp, Some("order-fl")).await.is_empty());

    script(&client, &psp, json!({ "latency_ms": 1 })).await;
    let slow_but_in_time = client
        .post(format!("{}/v1/charges", psp.url()))
        .header("Idempotency-Key", "fl")
        .header("grpc-timeout", "30S")
        .json(&body("order-fl", 100))
        .send()
        .await
        .unwrap();
    assert_eq!(slow_but_in_time.status(), StatusCode::CREATED);
    psp.shutdown().await;
}

#[tokio::test]
async fn scripted_faults_apply_in_order_then_stop() {
    let psp = start().await;
    let client = client();
    let echoed = script(
        &client,
        &psp,
        json!({ "next": ["unavailable", "none", "error"] }),
    )
    .await;
    assert_eq!(echoed["next"], json!(["unavailable", "none", "error"]));
    let mut statuses = Vec::new();
    for key in ["s1", "s2", "s3", "s4"] {
        statuses.push(charge(&client, &psp, key, &body(key, 1)).await.status());
    }
    assert_eq!(
        statuses,
        [
            StatusCode::SERVICE_UNAVAILABLE,
            StatusCode::CREATED,
            StatusCode::INTERNAL_SERVER_ERROR,
            StatusCode::CREATED
        ]
    );
    let settings: Value = client
        .get(format!("{}/admin/faults", psp.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(settings["next"], json!([]));
    psp.shutdown().await;
}

#[tokio::test]
async fn bad_request_consumes_no_scripted_fault() {
    let psp = start().await;
    let client = client();
    script(&client, &psp, json!({ "next": ["error"] })).await;
    let bad = charge(&client, &psp, "c1", &body("o", 0)).await;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    let faulted = charge(&client, &psp, "c1", &body("o", 1)).await;
    assert_eq!(faulted.status(), StatusCode::INTERNAL_SERVER_ERROR);
    psp.shutdown().await;
}

#[tokio::test]
async fn seeded_rates_give_the_same_faults_on_every_run() {
    let client = client();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let psp = psp::spawn(PspConfig {
            faults: Faults {
                error_rate: 0.5,
                ..Faults::default()
            },
            seed: Some(42),
            ..PspConfig::default()
        })
        .await
        .unwrap();
        let mut statuses = Vec::new();
        for n in 0..32 {
            let key = format!("seeded-{n}");
            statuses.push(charge(&client, &psp, &key, &body(&key, 1)).await.status());
        }
        psp.shutdown().await;
        runs.push(statuses);
    }
    assert_eq!(runs[0], runs[1]);
    assert!(runs[0].contains(&StatusCode::CREATED));
    assert!(runs[0].contains(&StatusCode::INTERNAL_SERVER_ERROR));
}

#[tokio::test]
async fn admin_faults_rejects_invalid_settings() {
    let psp = start().await;
    let client = client();
    for bad in [
        json!({ "error_rate": 1.5 }),
        json!({ "error_rate": -0.1 }),
        json!({ "error_rate": 0.6, "unavailable_rate": 0.6 }),
        json!({ "next": ["explode"] }),
        json!({ "error_rate": 0.1, "colour": "red" }),
        json!({ "next": vec!["none"; 1025] }),
    ] {
        let response = client
            .put(format!("{}/admin/faults", psp.url()))
            .json(&bad)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{bad}");
    }
    assert_eq!(psp.faults().faults(), Faults::default());
    let echoed = script(
        &client,
        &psp,
        json!({ "latency_ms": 5, "unavailable_rate": 0.25, "seed": 3 }),
    )
    .await;
    assert_eq!(echoed["latency_ms"], 5);
    assert_eq!(echoed["unavailable_rate"], 0.25);
    assert_eq!(psp.faults().faults().latency, Duration::from_millis(5));
    psp.shutdown().await;
}

#[tokio::test]
async fn file_store_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let config = PspConfig {
        db_path: Some(dir.path().join("psp.db")),
        ..PspConfig::default()
    };
    let client = client();
    let psp = psp::spawn(config.clone()).await.unwrap();
    let created: Charge = charge(&client, &psp, "durable", &body("order-d", 77))
        .await
        .json()
        .await
        .unwrap();
    psp.shutdown().await;

    let psp = psp::spawn(config).await.unwrap();
    let replay = charge(&client, &psp, "durable", &body("order-d", 77)).await;
    assert_eq!(replay.status(), StatusCode::OK);
    assert_eq!(replay.json::<Charge>().await.unwrap(), created);
    psp.shutdown().await;
}

#[tokio::test]
async fn serve_stops_when_its_shutdown_future_resolves() {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(psp::serve(PspConfig::default(), async move {
        let _ = stopped.await;
    }));
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn unknown_route_is_404_problem() {
    let psp = start().await;
    let response = client()
        .get(format!("{}/v1/nothing", psp.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    assert_eq!(problem_code(response).await, "not_found");
    psp.shutdown().await;
}

async fn void(client: &reqwest::Client, psp: &PspHandle, key: Option<&str>) -> reqwest::Response {
    let mut request = client.post(format!("{}/v1/voids", psp.url()));
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await.expect("void answered")
}

#[tokio::test]
async fn void_settles_an_effect_key_for_good() {
    let psp = start().await;
    let client = client();
    // No charge yet: voided, and every later charge with the key is refused.
    let voided = void(&client, &psp, Some("pi_void")).await;
    assert_eq!(voided.status(), StatusCode::OK);
    let voided: psp::Void = voided.json().await.unwrap();
    assert_eq!(voided.status, psp::VoidStatus::Voided);
    assert_eq!(voided.charge, None);
    let refused = charge(&client, &psp, "pi_void", &body("m:o-1", 100)).await;
    assert_eq!(refused.status(), StatusCode::GONE);
    assert_eq!(problem_code(refused).await, "effect_key_voided");
    assert!(list(&client, &psp, Some("m:o-1")).await.is_empty());
    // Voiding again answers the same.
    let again: psp::Void = void(&client, &psp, Some("pi_void"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(again, voided);

    // Charged first: the void answers with the charge and changes nothing.
    let created: Charge = charge(&client, &psp, "pi_paid", &body("m:o-2", 300))
        .await
        .json()
        .await
        .unwrap();
    let settled: psp::Void = void(&client, &psp, Some("pi_paid"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(settled.status, psp::VoidStatus::Charged);
    assert_eq!(settled.charge, Some(created.clone()));
    let replay = charge(&client, &psp, "pi_paid", &body("m:o-2", 300)).await;
    assert_eq!(replay.status(), StatusCode::OK);

    let missing = void(&client, &psp, None).await;
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_code(missing).await, "missing_idempotency_key");
}

async fn refund(
    client: &reqwest::Client,
    psp: &PspHandle,
    key: &str,
    body: &Value,
) -> reqwest::Response {
    client
        .post(format!("{}/v1/refunds", psp.url()))
        .header("Idempotency-Key", key)
        .json(body)
        .send()
        .await
        .expect("refund request answered")
}

#[tokio::test]
async fn refunds_replay_on_their_key_and_never_exceed_the_charge() {
    let psp = start().await;
    let client = client();
    let created: Charge = charge(&client, &psp, "pi_r", &body("order-r", 1000))
        .await
        .json()
        .await
        .unwrap();
    let half = json!({ "charge_id": created.charge_id, "amount_cents": 600 });

    let first = refund(&client, &psp, "refund-1", &half).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first: Refund = first.json().await.unwrap();
    assert_eq!(first.charge_id, created.charge_id);
    assert_eq!(first.amount_cents, 600);

    let again = refund(&client, &psp, "refund-1", &half).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<Refund>().await.unwrap(), first);

    let other = json!({ "charge_id": created.charge_id, "amount_cents": 5 });
    let reused = refund(&client, &psp, "refund-1", &other).await;
    assert_eq!(reused.status(), StatusCode::CONFLICT);
    assert_eq!(problem_code(reused).await, "idempotency_key_reused");

    let too_much = json!({ "charge_id": created.charge_id, "amount_cents": 401 });
    let exceeds = refund(&client, &psp, "refund-2", &too_much).await;
    assert_eq!(exceeds.status(), StatusCode::CONFLICT);
    assert_eq!(problem_code(exceeds).await, "refund_exceeds_charge");

    let listed = list(&client, &psp, Some("order-r")).await;
    assert_eq!(listed[0].amount_refunded_cents, 600);

    let missing = json!({ "charge_id": "ch_missing", "amount_cents": 1 });
    let missing = refund(&client, &psp, "refund-3", &missing).await;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    assert_eq!(problem_code(missing).await, "charge_not_found");

    for (name, key, body, code) in [
        (
            "zero",
            Some("r-z"),
            json!({ "charge_id": "ch_x", "amount_cents": 0 }),
            "invalid_amount",
        ),
        (
            "no charge",
            Some("r-e"),
            json!({ "charge_id": "", "amount_cents": 1 }),
            "invalid_charge_id",
        ),
        (
            "extra field",
            Some("r-x"),
            json!({ "charge_id": "ch_x", "amount_cents": 1, "why": 1 }),
            "invalid_body",
        ),
        ("no key", None, half.clone(), "missing_idempotency_key"),
    ] {
        let mut request = client.post(format!("{}/v1/refunds", psp.url())).json(&body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{name}");
        assert_eq!(problem_code(response).await, code, "{name}");
    }
    psp.shutdown().await;
}

#[tokio::test]
async fn paged_listing_walks_a_window_and_refuses_bad_parameters() {
    let psp = start().await;
    let client = client();
    for i in 0..5 {
        let response = charge(&client, &psp, &format!("pi_p{i}"), &body("order-p", 10)).await;
        assert_eq!(response.status(), StatusCode::CREATED);
    }
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut query = vec![("limit", "2".to_owned()), ("created_gte", "0".to_owned())];
        if let Some(cursor) = &cursor {
            query.push(("starting_after", cursor.clone()));
        }
        let response = client
            .get(format!("{}/v1/charges", psp.url()))
            .query(&query)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let page: ChargePage = response.json().await.unwrap();
        assert!(page.data.len() <= 2);
        seen.extend(page.data.iter().map(|c| c.effect_key.clone()));
        if !page.has_more {
            assert_eq!(page.next_starting_after, None);
            break;
        }
        cursor = page.next_starting_after;
    }
    assert_eq!(seen, ["pi_p0", "pi_p1", "pi_p2", "pi_p3", "pi_p4"]);

    for (query, code) in [
        ("limit=0", "invalid_limit"),
        ("limit=100000", "invalid_limit"),
        ("created_gte=yesterday", "invalid_created"),
        ("created_gte=10&created_lt=10", "invalid_window"),
        ("starting_after=pi_1", "invalid_cursor"),
        ("limit=1&limit=2", "invalid_query"),
        ("limit=1&page=2", "invalid_query"),
    ] {
        let response = client
            .get(format!("{}/v1/charges?{query}", psp.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{query}");
        assert_eq!(problem_code(response).await, code, "{query}");
    }
    psp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_refunds_with_their_own_keys_never_exceed_the_charge() {
    let psp = start().await;
    let client = client();
    let created: Charge = charge(&client, &psp, "pi_cr", &body("order-cr", 1000))
        .await
        .json()
        .await
        .unwrap();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let (client, url, charge_id) = (client.clone(), psp.url(), created.charge_id.clone());
            tokio::spawn(async move {
                client
                    .post(format!("{url}/v1/refunds"))
                    .header("Idempotency-Key", format!("refund-{i}"))
                    .json(&json!({ "charge_id": charge_id, "amount_cents": 100 }))
                    .send()
                    .await
                    .unwrap()
                    .status()
            })
        })
        .collect();
    let mut created_refunds = 0;
    for task in tasks {
        match task.await.unwrap() {
            StatusCode::CREATED => created_refunds += 1,
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(created_refunds, 10);
    let listed = list(&client, &psp, Some("order-cr")).await;
    assert_eq!(listed[0].amount_refunded_cents, 1000);
    psp.shutdown().await;
}
