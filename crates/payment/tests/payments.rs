//! The payment service end to end: real servers on 127.0.0.1:0, a real PSP simulator, a real
//! SQLite store. The three regression scenarios of a payment retried (the same key, the same
//! order under a new key, a PSP that commits and then times out), the accidents retrying
//! clients and servers commonly cause, concurrency, bad input and tenant isolation.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use backstop_payment::psp::Fault;
use reqwest::StatusCode;
use serde_json::json;
use support::{Harness, body};

// ---- the three regression scenarios ----

#[tokio::test]
async fn same_request_key_retried_returns_original_result() {
    let h = Harness::start().await;
    let first = h.post(Some("key-1"), &body("order-1", 1250), &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.json);
    assert_eq!(first.json["status"], "succeeded");
    assert_eq!(first.json["order_id"], "order-1");
    assert_eq!(first.json["amount_cents"], 1250);
    assert_eq!(first.json["currency"], "USD");
    let intent_id = first.json["intent_id"].as_str().unwrap();
    assert!(first.json["charge_id"].as_str().unwrap().starts_with("ch_"));
    assert_eq!(
        first.header("location").unwrap(),
        format!("/v1/payments/{intent_id}")
    );

    let again = h.post(Some("key-1"), &body("order-1", 1250), &[]).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.bytes, first.bytes, "replayed byte for byte");
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.header("location"), first.header("location"));

    assert_eq!(h.charges("order-1").await.len(), 1);
    assert_eq!(h.intent_count().await, 1);

    let got = h.get(&format!("/v1/payments/{intent_id}"), &[]).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.json["status"], "succeeded");
    assert_eq!(got.json["charge_id"], first.json["charge_id"]);
}

#[tokio::test]
async fn same_order_new_key_is_order_conflict() {
    let h = Harness::start().await;
    let first = h.post(Some("key-a"), &body("order-7", 500), &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let second = h.post(Some("key-b"), &body("order-7", 500), &[]).await;
    assert_eq!(second.status, StatusCode::CONFLICT);
    assert_eq!(second.code(), "order_conflict");
    assert_eq!(
        second.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(second.json["intent_id"], first.json["intent_id"]);
    assert_eq!(h.charges("order-7").await.len(), 1);
    assert_eq!(h.intent_count().await, 1);
}

#[tokio::test]
async fn psp_commit_then_timeout_then_retry_charges_once() {
    let h = Harness::start().await;
    h.script(&[Fault::CommitThenTimeout]);
    let first = h
        .post(
            Some("key-t"),
            &body("order-t", 990),
            &[("grpc-timeout", "1S")],
        )
        .await;
    assert_eq!(
        first.status,
        StatusCode::GATEWAY_TIMEOUT,
        "{:?}",
        first.json
    );
    assert_eq!(first.code(), "payment_outcome_unknown");
    assert_eq!(first.json["status"], "unknown");
    let intent_id = first.json["intent_id"].as_str().unwrap().to_owned();
    // The PSP did charge: the outcome really was unknown, not "failed".
    assert_eq!(h.charges("order-t").await.len(), 1);

    let retry = h
        .post(
            Some("key-t"),
            &body("order-t", 990),
            &[("grpc-timeout", "5S")],
        )
        .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.json);
    assert_eq!(retry.json["intent_id"], intent_id.as_str());
    let charges = h.charges("order-t").await;
    assert_eq!(charges.len(), 1, "charged exactly once");
    assert_eq!(
        charges[0].effect_key, intent_id,
        "effect key is the intent id"
    );
    assert_eq!(retry.json["charge_id"], charges[0].charge_id.as_str());
    assert_eq!(h.intent_count().await, 1);
}

// ---- the accidents: what retrying clients and servers commonly get wrong ----

/// A client that makes a new key per attempt gets its second attempt refused by the business
/// key, and the PSP sees one charge; the same key converges.
#[tokio::test]
async fn a_key_generated_inside_the_retry_loop_is_refused_by_the_order() {
    let h = Harness::start().await;
    h.script(&[Fault::CommitThenTimeout]);
    let attempt1 = h
        .post(
            Some("loop-k1"),
            &body("order-loop", 700),
            &[("grpc-timeout", "1S")],
        )
        .await;
    assert_eq!(attempt1.status, StatusCode::GATEWAY_TIMEOUT);
    let intent_id = attempt1.json["intent_id"].as_str().unwrap().to_owned();

    // The accident: a fresh key for the same logical request.
    let attempt2 = h.post(Some("loop-k2"), &body("order-loop", 700), &[]).await;
    assert_eq!(attempt2.status, StatusCode::CONFLICT);
    assert_eq!(attempt2.code(), "order_conflict");
    assert_eq!(attempt2.json["intent_id"], intent_id.as_str());
    assert_eq!(h.charges("order-loop").await.len(), 1);
    assert_eq!(h.intent_count().await, 1, "no second intent");

    // The fix: the key generated once, before the loop, converges.
    let fixed = h.post(Some("loop-k1"), &body("order-loop", 700), &[]).await;
    assert_eq!(fixed.status, StatusCode::CREATED);
    assert_eq!(fixed.json["intent_id"], intent_id.as_str());
    assert_eq!(h.charges("order-loop").await.len(), 1);
}

/// The PSP must see what is left of the caller's budget minus the margin, never a new budget.
#[tokio::test]
async fn deadline_is_reduced_at_a_hop_never_reset() {
    let h = Harness::start().await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = h
        .post(
            Some("dl-1"),
            &body("order-dl", 100),
            &[("grpc-timeout", "3S"), ("traceparent", traceparent)],
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let charges = h.charges("order-dl").await;
    let budget = charges[0].budget_ms.expect("the PSP saw a grpc-timeout");
    // What the caller had left, less at least the hop's margin floor: never the caller's
    // whole budget again, never a fresh one.
    let floor = 300; // the harness's `psp_margin_floor`
    assert!(
        budget <= 3000 - floor,
        "budget {budget} ms: the hop's margin ({floor} ms at least) was not kept back"
    );
    assert!(budget > 0);
    // The trace crosses the hop: same trace id, new span id.
    let seen = charges[0].traceparent.as_deref().expect("traceparent sent");
    assert_eq!(&seen[3..35], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_ne!(&seen[36..52], "00f067aa0ba902b7");

    // Without a grpc-timeout the default budget applies, still reduced.
    let r = h.post(Some("dl-2"), &body("order-dl2", 100), &[]).await;
    assert_eq!(r.status, StatusCode::CREATED);
    let budget = h.charges("order-dl2").await[0].budget_ms.unwrap();
    assert!(
        budget <= 10_000 - floor,
        "default budget {budget} ms not reduced"
    );
    let seen = h.charges("order-dl2").await[0].traceparent.clone().unwrap();
    assert_eq!(seen.len(), 55, "a traceparent is generated when absent");
}

/// With one slot and a slow PSP, a second request is answered 503 + Retry-After, never 500,
/// and nothing is written for it.
#[tokio::test]
async fn overload_is_answered_503_with_retry_after_never_500() {
    let h = Arc::new(
        Harness::start_with(|c| {
            c.max_inflight = 1;
        })
        .await,
    );
    h.latency(Duration::from_millis(1500));
    let slow = {
        let h = Arc::clone(&h);
        tokio::spawn(async move {
            h.post(
                Some("slow"),
                &body("order-slow", 100),
                &[("grpc-timeout", "10S")],
            )
            .await
        })
    };
    let mut rejected = None;
    for i in 0..50 {
        let r = h
            .post(
                Some(&format!("fast-{i}")),
                &body(&format!("order-fast-{i}"), 100),
                &[("grpc-timeout", "200m")],
            )
            .await;
        assert_ne!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(
            !r.status.is_server_error()
                || r.status == StatusCode::SERVICE_UNAVAILABLE
                || r.status == StatusCode::GATEWAY_TIMEOUT,
            "{:?}",
            r
        );
        if r.status == StatusCode::SERVICE_UNAVAILABLE {
            rejected = Some((i, r));
            break;
        }
    }
    let (i, r) = rejected.expect("a request beyond max-inflight is refused");
    assert_eq!(r.code(), "overloaded");
    let retry_after: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(retry_after >= 1);
    assert!(h.charges(&format!("order-fast-{i}")).await.is_empty());
    let slow = slow.await.unwrap();
    assert_eq!(slow.status, StatusCode::CREATED, "{:?}", slow.json);
    // The refused key is unused: it can run now.
    h.latency(Duration::ZERO);
    let later = h
        .post(
            Some(&format!("fast-{i}")),
            &body(&format!("order-fast-{i}"), 100),
            &[],
        )
        .await;
    assert_eq!(later.status, StatusCode::CREATED);
}

#[tokio::test]
async fn same_key_with_other_parameters_is_refused_409_never_replayed() {
    let h = Harness::start().await;
    let first = h.post(Some("param-k"), &body("order-p", 100), &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = h.post(Some("param-k"), &body("order-p", 1000), &[]).await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(other.code(), "idempotency_key_reused");
    let prefix = other.json["fingerprint_prefix"].as_str().unwrap();
    assert_eq!(prefix.len(), 8);
    assert!(prefix.bytes().all(|b| b.is_ascii_hexdigit()));
    let charges = h.charges("order-p").await;
    assert_eq!(charges.len(), 1);
    assert_eq!(charges[0].amount_cents, 100, "the first parameters stand");
}

// ---- concurrency ----

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_attempts_with_one_key_charge_once() {
    let h = Arc::new(Harness::start().await);
    h.latency(Duration::from_millis(300));
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let h = Arc::clone(&h);
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            h.post(Some("one-key"), &body("order-32", 4200), &[]).await
        }));
    }
    let mut created = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            StatusCode::CREATED => created.push(r),
            other => panic!("unexpected {other}: {:?}", r.json),
        }
    }
    // Those that found the key running waited for its answer: all 32 have it, none a 409.
    assert_eq!(created.len(), 32);
    assert!(created.iter().all(|r| r.bytes == created[0].bytes));
    assert_eq!(h.intent_count().await, 1);
    assert_eq!(h.charges("order-32").await.len(), 1);
}

// ---- bad input ----

struct Case<'a> {
    name: &'a str,
    key: Option<&'a str>,
    body: String,
    headers: Vec<(&'a str, &'a str)>,
    status: u16,
    code: &'a str,
}

#[tokio::test]
async fn bad_input_gets_its_own_code_and_writes_nothing() {
    let h = Harness::start().await;
    let good = body("order-bad", 100);
    let long_key = "k".repeat(256);
    let big = format!(
        r#"{{"order_id":"order-bad","amount_cents":100,"pad":"{}"}}"#,
        "x".repeat(1024 * 1024)
    );
    let cases = [
        Case {
            name: "missing key",
            key: None,
            body: good.clone(),
            headers: vec![],
            status: 400,
            code: "missing_idempotency_key",
        },
        Case {
            name: "256-char key",
            key: Some(&long_key),
            body: good.clone(),
            headers: vec![],
            status: 400,
            code: "invalid_idempotency_key",
        },
        Case {
            name: "non-JSON",
            key: Some("bad-1"),
            body: "order=1&amount=2".to_owned(),
            headers: vec![],
            status: 400,
            code: "invalid_body",
        },
        Case {
            name: "unknown field",
            key: Some("bad-2"),
            body: r#"{"order_id":"order-bad","amount_cents":100,"tip":5}"#.to_owned(),
            headers: vec![],
            status: 400,
            code: "unknown_field",
        },
        Case {
            name: "float amount",
            key: Some("bad-3"),
            body: r#"{"order_id":"order-bad","amount_cents":10.5}"#.to_owned(),
            headers: vec![],
            status: 400,
            code: "invalid_amount",
        },
        Case {
            name: "a fraction a double rounds away",
            key: Some("bad-3b"),
            body: r#"{"order_id":"order-bad","amount_cents":999999999999.99999999999999999}"#
                .to_owned(),
            headers: vec![],
            status: 400,
            code: "invalid_amount",
        },
        Case {
            name: "negative amount",
            key: Some("bad-4"),
            body: r#"{"order_id":"order-bad","amount_cents":-100}"#.to_owned(),
            headers: vec![],
            status: 400,
            code: "invalid_amount",
        },
        Case {
            name: "zero amount",
            key: Some("bad-5"),
            body: r#"{"order_id":"order-bad","amount_cents":0}"#.to_owned(),
            headers: vec![],
            status: 400,
            code: "invalid_amount",
        },
        Case {
            name: "missing order",
            key: Some("bad-6"),
            body: r#"{"amount_cents":100}"#.to_owned(),
            headers: vec![],
            status: 400,
            code: "missing_field",
        },
        Case {
            name: "bad currency",
            key: Some("bad-7"),
            body: r#"{"order_id":"order-bad","amount_cents":100,"currency":"usd"}"#.to_owned(),
            headers: vec![],
            status: 400,
            code: "invalid_currency",
        },
        Case {
            name: "body over 1 MiB",
            key: Some("bad-8"),
            body: big,
            headers: vec![],
            status: 413,
            code: "body_too_large",
        },
        Case {
            name: "malformed grpc-timeout",
            key: Some("bad-9"),
            body: good.clone(),
            headers: vec![("grpc-timeout", "soon")],
            status: 400,
            code: "invalid_grpc_timeout",
        },
        Case {
            name: "9-digit grpc-timeout",
            key: Some("bad-10"),
            body: good.clone(),
            headers: vec![("grpc-timeout", "123456789m")],
            status: 400,
            code: "invalid_grpc_timeout",
        },
    ];
    for Case {
        name,
        key,
        body,
        headers,
        status,
        code,
    } in cases
    {
        let r = h.post(key, &body, &headers).await;
        assert_eq!(r.status.as_u16(), status, "{name}: {:?}", r.json);
        assert_eq!(r.code(), code, "{name}");
        assert_eq!(
            r.header("content-type"),
            Some("application/problem+json"),
            "{name}"
        );
        assert_eq!(h.intent_count().await, 0, "{name} wrote an intent");
        assert_eq!(h.idempotency_rows().await, 0, "{name} wrote a key");
    }
    assert_eq!(h.all_charges().await, 0);
    // The keys refused for bad input are unused: a good request with one of them works.
    let ok = h.post(Some("bad-3"), &good, &[]).await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

// ---- tenants ----

#[tokio::test]
async fn tenant_isolation_with_two_api_keys() {
    use backstop_payment::config::ApiKey;
    let h = Harness::start_with(|c| {
        c.api_keys = vec![
            ApiKey::parse("acme=key-acme-0001").unwrap(),
            ApiKey::parse("globex=key-globex-0002").unwrap(),
        ];
    })
    .await;
    let a = [("authorization", "Bearer key-acme-0001")];
    let b = [("authorization", "Bearer key-globex-0002")];

    let ra = h.post(Some("shared-key"), &body("order-1", 100), &a).await;
    let rb = h.post(Some("shared-key"), &body("order-1", 100), &b).await;
    assert_eq!(ra.status, StatusCode::CREATED);
    assert_eq!(rb.status, StatusCode::CREATED, "B's key is not A's key");
    assert!(rb.header("idempotent-replayed").is_none());
    assert_ne!(ra.json["intent_id"], rb.json["intent_id"]);
    assert_eq!(h.intent_count().await, 2);

    let a_id = ra.json["intent_id"].as_str().unwrap();
    let b_id = rb.json["intent_id"].as_str().unwrap();
    assert_eq!(
        h.get(&format!("/v1/payments/{a_id}"), &a).await.status,
        StatusCode::OK
    );
    let hidden = h.get(&format!("/v1/payments/{b_id}"), &a).await;
    assert_eq!(hidden.status, StatusCode::NOT_FOUND);
    assert_eq!(hidden.code(), "payment_not_found");

    // A's replay is A's answer.
    let again = h.post(Some("shared-key"), &body("order-1", 100), &a).await;
    assert_eq!(again.bytes, ra.bytes);

    for headers in [
        vec![],
        vec![("authorization", "Bearer nope")],
        vec![("authorization", "Basic a2V5")],
    ] {
        let r = h.post(Some("k-401"), &body("order-9", 100), &headers).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
        assert_eq!(r.code(), "unauthenticated");
        let r = h.get(&format!("/v1/payments/{a_id}"), &headers).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(h.intent_count().await, 2);
}

#[tokio::test]
async fn tenant_over_quota_gets_429_with_retry_after() {
    let h = Harness::start_with(|c| {
        c.tenant_rate = std::num::NonZeroU32::new(1).unwrap();
        c.tenant_burst = std::num::NonZeroU32::new(1).unwrap();
    })
    .await;
    let first = h.post(Some("q-1"), &body("order-q1", 100), &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let second = h.post(Some("q-2"), &body("order-q2", 100), &[]).await;
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(second.code(), "rate_limited");
    assert!(second.header("retry-after").is_some());
    assert!(h.charges("order-q2").await.is_empty());
}

// ---- converging an unknown ----

#[tokio::test]
async fn unknown_outcome_converges_by_query() {
    let h = Harness::start().await;
    h.script(&[Fault::CommitThenTimeout]);
    // A budget well above the harness's margin, so that on a loaded machine the charge is
    // still sent before the deadline and the handler's 504 beats the deadline layer's.
    let first = h
        .post(
            Some("q-key"),
            &body("order-query", 300),
            &[("grpc-timeout", "3S")],
        )
        .await;
    assert_eq!(
        first.status,
        StatusCode::GATEWAY_TIMEOUT,
        "{:?}",
        first.json
    );
    assert_eq!(first.code(), "payment_outcome_unknown", "{:?}", first.json);
    let id = first.json["intent_id"].as_str().unwrap();
    let got = h.get(&format!("/v1/payments/{id}"), &[]).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.json["status"], "succeeded", "{:?}", got.json);
    assert_eq!(
        got.json["charge_id"],
        h.charges("order-query").await[0].charge_id.as_str()
    );
    assert_eq!(
        h.get("/v1/payments/nope", &[]).await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn psp_connection_dropped_after_commit_is_unknown_then_converges() {
    let h = Harness::start().await;
    // The first attempt is dropped after the charge; the executor retries with the same
    // effect key and the PSP answers with the existing charge.
    h.script(&[Fault::CommitThenDrop]);
    let r = h.post(Some("drop-k"), &body("order-drop", 300), &[]).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    assert_eq!(h.charges("order-drop").await.len(), 1);
}

// ---- a PSP that refuses ----

#[tokio::test]
async fn psp_refusal_is_declined_and_never_sent_again() {
    use axum::routing::post;
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let declining = axum::Router::new().route(
        "/v1/charges",
        post(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async {
                (
                    StatusCode::PAYMENT_REQUIRED,
                    [("content-type", "application/problem+json")],
                    json!({"code": "card_declined"}).to_string(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, declining).await });

    let h = Harness::start_with(|c| {
        c.psp = backstop_payment::config::PspTarget::Url(url);
    })
    .await;
    let r = h.post(Some("dec-1"), &body("order-dec", 100), &[]).await;
    assert_eq!(r.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(r.code(), "payment_declined");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "a refusal is not retried");
    let id = r.json["intent_id"].as_str().unwrap().to_owned();
    let got = h.get(&format!("/v1/payments/{id}"), &[]).await;
    assert_eq!(got.json["status"], "failed");

    let again = h.post(Some("dec-1"), &body("order-dec", 100), &[]).await;
    assert_eq!(again.status, StatusCode::PAYMENT_REQUIRED);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the failed intent answers by itself"
    );
}

// ---- operations ----

#[tokio::test]
async fn health_readiness_and_metrics() {
    let h = Harness::start().await;
    assert_eq!(h.get("/healthz", &[]).await.status, StatusCode::OK);
    assert_eq!(h.get("/readyz", &[]).await.status, StatusCode::OK);
    let r = h.post(Some("m-1"), &body("order-m", 100), &[]).await;
    assert_eq!(r.status, StatusCode::CREATED);
    let m = h.get("/metrics", &[]).await;
    assert_eq!(m.status, StatusCode::OK);
    let text = String::from_utf8(m.bytes).unwrap();
    assert!(text.contains("rpc_server_requests_total"), "{text}");
    // Durations are histograms (bucket counts add up across instances), not quantile summaries.
    assert!(
        text.contains("rpc_server_duration_seconds_bucket{") && text.contains("le=\"0.00025\""),
        "{text}"
    );
    assert!(!text.contains("quantile="), "{text}");
    assert!(!text.contains("order-m"), "no business ids in labels");
    let nf = h.get("/nope", &[]).await;
    assert_eq!(nf.status, StatusCode::NOT_FOUND);
    assert_eq!(nf.code(), "not_found");
}

#[tokio::test]
async fn graceful_shutdown_lets_in_flight_requests_finish() {
    let h = Harness::start().await;
    h.latency(Duration::from_millis(500));
    let in_flight = tokio::spawn({
        let http = h.http.clone();
        let base = h.base.clone();
        async move {
            http.post(format!("{base}/v1/payments"))
                .header("idempotency-key", "drain-1")
                .body(body("order-drain", 100))
                .send()
                .await
        }
    });
    // The intent exists once the handler runs; the PSP then holds the call for 500 ms.
    while h
        .server
        .intents()
        .by_order("default", "order-drain")
        .await
        .unwrap()
        .is_empty()
    {
        tokio::task::yield_now().await;
    }
    let Harness { psp, server, .. } = h;
    server.shutdown().await.unwrap();
    let r = in_flight
        .await
        .unwrap()
        .expect("answered before the server stopped");
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(
        psp.store()
            .list(Some("default:order-drain".into()))
            .await
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test]
async fn embedded_psp_runs_next_to_the_store() {
    use backstop_payment::config::{Config, StoreLocation};
    use backstop_payment::server::Server;
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::new(StoreLocation::Sqlite(dir.path().join("pay.db")));
    config.http = "127.0.0.1:0".parse().unwrap();
    config.grpc = "127.0.0.1:0".parse().unwrap();
    let server = Server::bind(config).await.unwrap();
    assert!(server.embedded_psp().is_some());
    let psp_url = server.psp_url().to_owned();
    let server = server.spawn();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let r = http
        .post(format!("{}/v1/payments", server.url()))
        .header("idempotency-key", "emb-1")
        .body(body("order-emb", 100))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let charges: serde_json::Value = http
        .get(format!("{psp_url}/v1/charges?reference=default:order-emb"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(charges.as_array().unwrap().len(), 1);
    assert!(dir.path().join("pay-psp.db").exists());
    server.shutdown().await.unwrap();
}
