//! `backstop proxy` as a real process in front of a real upstream that is not Rust: a Python
//! standard-library HTTP server (`support/upstream.py`) that records every request it gets and
//! every effect it executes in a file, and can be told to be slow. Crashes and lost answers
//! are in `proxy_crash.rs`, several upstreams, slow start and hedging in `proxy_upstreams.rs`.
//!
//! Nothing here synchronises by sleeping: each test waits for a condition (a line in the
//! upstream's events file, a log line, an answer), bounded by a generous timeout.

// The per-test PostgreSQL schema and the check that the servers answer, shared with the
// other crates' tests.
#[path = "../../backstop/tests/support/postgres_schema.rs"]
mod postgres_schema;
#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;
#[path = "../../backstop/tests/support/services.rs"]
mod services;

#[path = "support/proxy_harness.rs"]
mod proxy_harness;

use std::time::Duration;

use serde_json::Value;
use tokio::process::Command;

use self::proxy_harness::{
    BIN, PATIENCE, Proxy, ROUTES, Rig, Upstream, call, charge, client, free_port, grpc_unary,
    python_ready, send, support, wait_for,
};

#[tokio::test]
async fn duplicate_keyed_requests_in_parallel_are_forwarded_once() {
    let Some(Rig {
        http,
        proxy,
        upstream,
        dir: _dir,
    }) = Rig::start(&[]).await
    else {
        return;
    };

    let mut calls = Vec::new();
    for _ in 0..8 {
        let request = charge(
            &http,
            &proxy.base,
            "/v1/charges",
            "dup-1",
            r#"{"amount":100}"#,
        )
        .header("X-Upstream-Sleep-Ms", "300");
        calls.push(tokio::spawn(send(request)));
    }
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap().unwrap());
    }
    assert!(answers.iter().all(|a| a.status == 201), "all 201");
    let first = &answers[0].body;
    assert!(
        answers.iter().all(|a| a.body == *first),
        "byte-identical answers"
    );
    assert_eq!(
        answers.iter().filter(|a| !a.replayed()).count(),
        1,
        "one forwarded, the others replayed"
    );
    let effects = upstream.effects("dup-1");
    assert_eq!(effects.len(), 1, "{effects:?}");
    assert_eq!(upstream.received("dup-1").len(), 1);
    let effect_key = effects[0]["effect_key"]
        .as_str()
        .expect("an effect key was sent");
    assert_eq!(effect_key.len(), 32);
    assert!(effect_key.chars().all(|c| c.is_ascii_hexdigit()));
    assert!(
        answers.iter().all(|a| a.headers["x-upstream"] == "python"),
        "the headers the routes file names are replayed too"
    );

    // The library's metric names, under the proxy's service label.
    let metrics = proxy.metrics().await;
    for name in [
        "rpc_server_requests_total",
        "rpc_server_duration_seconds",
        "idempotency_claims_total",
        "rpc_server_connections",
    ] {
        assert!(metrics.contains(name), "{name} missing:\n{metrics}");
    }
    assert!(metrics.contains(r#"service="proxy""#), "{metrics}");
    assert!(
        metrics.contains(r#"method="POST /v1/charges""#),
        "labelled by route: {metrics}"
    );
}

#[tokio::test]
async fn a_retry_after_the_client_timed_out_gets_the_first_answer_replayed() {
    let Some(Rig {
        http,
        proxy,
        upstream,
        dir: _dir,
    }) = Rig::start(&[]).await
    else {
        return;
    };
    let body = r#"{"amount":250}"#;

    let impatient = tokio::spawn(send(
        charge(&http, &proxy.base, "/v1/charges", "late-1", body)
            .header("X-Upstream-Sleep-Ms", "1500"),
    ));
    // Once the request reached the upstream, its client gives up (its connection closes).
    wait_for("the first effect", async || {
        (!upstream.effects("late-1").is_empty()).then_some(())
    })
    .await;
    impatient.abort();
    assert!(impatient.await.unwrap_err().is_cancelled());

    // The retry waits for the forwarded request's answer and gets it replayed.
    let retry = call(charge(&http, &proxy.base, "/v1/charges", "late-1", body)).await;
    retry.assert_status(201);
    assert!(retry.replayed());
    let again = call(charge(&http, &proxy.base, "/v1/charges", "late-1", body)).await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, retry.body, "byte for byte");
    assert_eq!(upstream.effects("late-1").len(), 1);
    assert_eq!(upstream.received("late-1").len(), 1);
    assert!(
        upstream.of("cancelled", Some("late-1")).is_empty(),
        "the proxy kept the forwarded request going when its caller left"
    );
}

#[tokio::test]
async fn the_same_key_with_another_body_is_refused_and_not_forwarded() {
    let Some(Rig {
        http,
        proxy,
        upstream,
        dir: _dir,
    }) = Rig::start(&[]).await
    else {
        return;
    };

    let first = call(charge(
        &http,
        &proxy.base,
        "/v1/charges",
        "reuse-1",
        r#"{"amount":1}"#,
    ))
    .await;
    assert_eq!(first.status, 201);
    let other = call(charge(
        &http,
        &proxy.base,
        "/v1/charges",
        "reuse-1",
        r#"{"amount":2}"#,
    ))
    .await;
    assert_eq!(other.status, 409);
    assert_eq!(other.json()["code"], "idempotency_key_reused");
    assert_eq!(upstream.received("reuse-1").len(), 1);

    // A body that is not JSON, or none, is compared byte for byte.
    for (key, body) in [("form-1", "amount=1&currency=EUR"), ("empty-1", "")] {
        let form = |body: &str| {
            http.post(format!("{}/v1/charges", proxy.base))
                .header("Idempotency-Key", key)
                .header("Content-Type", "application/x-www-form-urlencoded")
                .body(body.to_owned())
        };
        let first = call(form(body)).await;
        first.assert_status(201);
        let again = call(form(body)).await;
        assert_eq!((again.status, again.replayed()), (201, true));
        assert_eq!(again.body, first.body);
        let other = call(form("amount=2")).await;
        assert_eq!(other.json()["code"], "idempotency_key_reused");
        assert_eq!(upstream.received(key).len(), 1);
    }

    // A keyed route without a key is refused before anything is forwarded.
    let keyless = call(
        http.post(format!("{}/v1/charges", proxy.base))
            .header("Content-Type", "application/json")
            .body("{}"),
    )
    .await;
    assert_eq!(keyless.status, 400);
    assert_eq!(keyless.json()["code"], "missing_idempotency_key");
    assert_eq!(upstream.of("received", None).len(), 3);
}

#[tokio::test]
async fn a_budget_that_runs_out_is_504_and_the_upstream_sees_the_request_dropped() {
    let Some(Rig {
        http,
        proxy,
        upstream,
        dir: _dir,
    }) = Rig::start(&[]).await
    else {
        return;
    };

    let started = std::time::Instant::now();
    let late = call(
        http.get(format!("{}/v1/charges/c-1", proxy.base))
            .header("X-Request-Timeout", "1000")
            .header("X-Upstream-Sleep-Ms", "20000"),
    )
    .await;
    assert_eq!(late.status, 504);
    assert_eq!(late.json()["code"], "deadline_exceeded");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "cut at the deadline"
    );
    wait_for("the upstream to see the request dropped", async || {
        upstream
            .of("cancelled", None)
            .into_iter()
            .find(|e| e["path"] == "/v1/charges/c-1")
    })
    .await;
    // The upstream got the budget in the caller's form, less what the proxy spent.
    let received = &upstream.of("received", None)[0];
    let ms: u64 = received["x_request_timeout"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..1000).contains(&ms), "{ms}");
    assert!(received["grpc_timeout"].is_null());

    // gRPC's header form goes out as grpc-timeout.
    let quick = call(
        http.get(format!("{}/v1/charges/c-2", proxy.base))
            .header("grpc-timeout", "2S"),
    )
    .await;
    assert_eq!(quick.status, 200);
    let echo = quick.json()["echo"].clone();
    let timeout = echo["grpc_timeout"].as_str().unwrap();
    let budget = backstop::deadline::decode_grpc_timeout(timeout).unwrap();
    assert!(
        budget < Duration::from_secs(2) && budget > Duration::from_secs(1),
        "{timeout}"
    );
}

#[tokio::test]
async fn unknown_routes_pass_through_and_callers_cannot_choose_the_effect_key() {
    let Some(Rig {
        http,
        proxy,
        upstream,
        dir: _dir,
    }) = Rig::start(&[]).await
    else {
        return;
    };

    let get = call(
        http.get(format!("{}/anything/at/all?x=1", proxy.base))
            .header("Idempotency-Effect-Key", "forged"),
    )
    .await;
    assert_eq!(get.status, 200);
    let echo = get.json()["echo"].clone();
    assert_eq!(echo["path"], "/anything/at/all?x=1");
    assert!(
        echo["effect_key"].is_null(),
        "a caller's effect key is removed"
    );
    assert_eq!(echo["x_forwarded_for"], "127.0.0.1");
    assert!(
        echo["grpc_timeout"].is_string(),
        "the fallback's budget goes along"
    );

    // An unknown POST without a key is forwarded as it came, each time; one with a key is
    // keyed (the fallback is `auto`), whatever its body.
    for _ in 0..2 {
        let post = call(
            http.post(format!("{}/v2/other", proxy.base))
                .body("not json"),
        )
        .await;
        assert_eq!(post.status, 201);
        assert!(!post.replayed());
    }
    assert_eq!(upstream.received_at("/v2/other"), 2);
    for replayed in [false, true] {
        let post = call(
            http.post(format!("{}/v2/other", proxy.base))
                .header("Idempotency-Key", "an-unrouted-key")
                .body("not json"),
        )
        .await;
        assert_eq!(post.status, 201);
        assert_eq!(post.replayed(), replayed);
    }
    assert_eq!(upstream.effects("an-unrouted-key").len(), 1);
    // A body larger than what the proxy keeps to send again streams through, once.
    let large = vec![b'x'; 3 << 20];
    let upload = call(http.post(format!("{}/v2/upload", proxy.base)).body(large)).await;
    assert_eq!(upload.status, 201);
    let uploads: Vec<Value> = upstream
        .of("received", None)
        .into_iter()
        .filter(|e| e["path"] == "/v2/upload")
        .collect();
    assert_eq!(uploads.len(), 1);
    assert_eq!(uploads[0]["body_len"], 3 << 20);
    // The upstream's own status passes through.
    let teapot = call(
        http.get(format!("{}/brew", proxy.base))
            .header("X-Upstream-Status", "418"),
    )
    .await;
    assert_eq!(teapot.status, 418);
}

#[tokio::test]
async fn an_upstream_that_is_down_is_503_with_retry_after_and_the_key_stays_unused() {
    let dir = tempfile::tempdir().unwrap();
    // A port nobody listens on.
    let closed = free_port();
    let proxy = Proxy::start(dir.path(), &format!("http://127.0.0.1:{closed}")).await;
    let http = client();
    for _ in 0..2 {
        let answer = call(charge(&http, &proxy.base, "/v1/charges", "down-1", "{}")).await;
        answer.assert_status(503);
        assert_eq!(answer.json()["code"], "upstream_unavailable");
        assert!(answer.headers.contains_key("retry-after"));
    }
}

#[tokio::test]
async fn sigterm_lets_a_request_in_flight_finish() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let mut proxy = Proxy::start(dir.path(), &upstream.url).await;
    let http = client();
    let pending = tokio::spawn(send(
        charge(&http, &proxy.base, "/v1/charges", "drain-1", "{}")
            .header("X-Upstream-Sleep-Ms", "3000"),
    ));
    wait_for("the effect", async || {
        (!upstream.effects("drain-1").is_empty()).then_some(())
    })
    .await;
    let pid = proxy.child.id().unwrap().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(sent.success());
    // While it drains, the admin port says so (and still serves the metrics).
    wait_for("/readyz to say draining", async || {
        let r = http
            .get(format!("{}/readyz", proxy.admin))
            .send()
            .await
            .ok()?;
        (r.status() == 503).then_some(())
    })
    .await;
    let answer = pending.await.unwrap().unwrap();
    assert_eq!(answer.status, 201);
    let status = tokio::time::timeout(PATIENCE, proxy.child.wait())
        .await
        .expect("the proxy exits after the drain")
        .unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn check_config_explains_a_good_file_and_names_the_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(&good, ROUTES).unwrap();
    let out = Command::new(BIN)
        .args(["proxy", "--check-config"])
        .arg(&good)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    for want in [
        "POST /v1/charges (CreateCharge):",
        "answered 500 outcome_unknown",
        "POST /dedup/charges (DedupCharge):",
        "forwarded again with the same effect key",
        "fallback (other):",
    ] {
        assert!(text.contains(want), "{want}:\n{text}");
    }

    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[policies.route]]\nmatch = \"POST /v1/charges\"\nidempotency = \"keyed\"\nretrys = 2\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["proxy", "--check-config"])
        .arg(&bad)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let error = String::from_utf8(out.stderr).unwrap();
    assert!(
        error.contains("retrys") && error.contains("bad.toml"),
        "{error}"
    );

    // The same file given to a proxy stops it at start, naming the key.
    let out = Command::new(BIN)
        .args(["proxy", "--upstream", "http://127.0.0.1:9", "--config"])
        .arg(&bad)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("retrys"));
}

#[tokio::test]
async fn a_keyed_grpc_method_is_forwarded_once_over_h2c_and_streams_pass_through() {
    if !python::python_ready("grpc", "the proxy's gRPC test", "grpcio==1.85.1").await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start_grpc(dir.path()).await;
    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    let target = proxy.base.strip_prefix("http://").unwrap();

    let out = python::output_of(
        "the gRPC calls through the proxy",
        python::python3()
            .arg(support("grpc_upstream.py"))
            .args(["call", "--target", target, "--key", "g-1", "--count", "6"])
            .args(["--payload", "0a03616263"]),
    )
    .await;
    let results: Vec<Value> = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(results.len(), 6);
    let first = &results[0]["response"];
    assert!(first.is_string(), "{results:?}");
    assert!(
        results.iter().all(|r| r["response"] == *first),
        "{results:?}"
    );
    assert_eq!(
        results.iter().filter(|r| r["replayed"] == false).count(),
        1,
        "{results:?}"
    );
    let effects = upstream.effects("g-1");
    assert_eq!(effects.len(), 1, "{effects:?}");
    assert_eq!(effects[0]["effect_key"].as_str().map(str::len), Some(32));
    // The caller's budget (not the route's 3 s), less what the proxy spent and its margin,
    // reaches the upstream, never more. A grpcio caller rounds its own budget up (20 s goes
    // out as up to 20.1 s), so this call is sent with exactly 20 s.
    let grpc_status = grpc_unary(target, "/shop.v1.Orders/Create", "g-budget", "20S").await;
    assert_eq!(grpc_status.as_deref(), Some("0"));
    let effects = upstream.effects("g-budget");
    assert_eq!(effects.len(), 1, "{effects:?}");
    let left = effects[0]["time_remaining"].as_f64();
    assert!(
        left.is_some_and(|left| left > 3.0 && left < 20.0),
        "{:?}",
        effects[0]
    );

    // A streaming method is not keyed: it passes through.
    let out = python::output_of(
        "the gRPC stream through the proxy",
        python::python3()
            .arg(support("grpc_upstream.py"))
            .args(["watch", "--target", target]),
    )
    .await;
    let messages: Vec<String> = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(messages, ["update:0", "update:1", "update:2"]);
}

#[tokio::test]
async fn keys_are_scoped_by_the_scope_header() {
    let Some(Rig {
        http,
        proxy,
        upstream,
        dir,
    }) = Rig::start(&["--scope-header", "X-Api-Key"]).await
    else {
        return;
    };
    let as_caller = |caller: &str| {
        charge(
            &http,
            &proxy.base,
            "/v1/charges",
            "shared-1",
            r#"{"amount":5}"#,
        )
        .header("X-Api-Key", caller.to_owned())
    };

    let a = call(as_caller("caller-a")).await;
    let b = call(as_caller("caller-b")).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(!b.replayed(), "another caller's key is its own");
    assert_ne!(a.body, b.body);
    let a_again = call(as_caller("caller-a")).await;
    assert!(a_again.replayed());
    assert_eq!(a_again.body, a.body);
    assert_eq!(upstream.effects("shared-1").len(), 2);
    let db = std::fs::read(dir.path().join("proxy.db")).unwrap();
    assert!(
        !db.windows(8).any(|w| w == b"caller-a"),
        "only a hash of the scope is stored"
    );
}

#[tokio::test]
async fn several_upstreams_share_the_requests() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let one = Upstream::start(dir.path()).await;
    let two = Upstream::start(dir.path()).await;
    let proxy = Proxy::options(dir.path(), &[&one.url, &two.url])
        .start()
        .await;
    let http = client();
    for i in 0..40 {
        let answer = call(http.get(format!("{}/v1/charges/c-{i}", proxy.base))).await;
        assert_eq!(answer.status, 200);
    }
    let (a, b) = (
        one.of("received", None).len(),
        two.of("received", None).len(),
    );
    assert_eq!(a + b, 40);
    assert!(a > 0 && b > 0, "{a} and {b}");
}

#[tokio::test]
async fn two_proxies_sharing_postgresql_forward_a_key_once() {
    if !services::postgres() || !python_ready().await {
        return;
    }
    let schema = postgres_schema::Schema::create("proxy").await;
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let store = schema.store_url(None);
    let on_postgres = Proxy::options(dir.path(), &[&upstream.url]).store(&store);
    let first = on_postgres.start().await;
    let second = on_postgres.start().await;
    let http = client();

    let mut calls = Vec::new();
    for i in 0..8 {
        let base = if i % 2 == 0 {
            &first.base
        } else {
            &second.base
        };
        let request = charge(&http, base, "/v1/charges", "pg-1", r#"{"amount":3}"#)
            .header("X-Upstream-Sleep-Ms", "300");
        calls.push(tokio::spawn(send(request)));
    }
    let mut bodies = Vec::new();
    for call in calls {
        let answer = call.await.unwrap().unwrap();
        answer.assert_status(201);
        bodies.push(answer.body);
    }
    assert!(bodies.iter().all(|b| *b == bodies[0]));
    assert_eq!(upstream.effects("pg-1").len(), 1);
    assert_eq!(schema.count("idempotency_key").await, 1);
}

#[tokio::test]
async fn retries_are_spent_only_where_sending_again_is_safe() {
    let Some(Rig {
        http,
        proxy,
        upstream,
        dir: _dir,
    }) = Rig::start(&[]).await
    else {
        return;
    };
    let received = |path: &str| {
        upstream
            .of("received", None)
            .into_iter()
            .filter(|e| e["path"] == path)
            .count()
    };

    // A safe route: a 503 is tried again, up to its attempts (3 by default).
    let read = call(
        http.get(format!("{}/v1/charges/c-9", proxy.base))
            .header("X-Upstream-Status", "503"),
    )
    .await;
    assert_eq!(read.status, 503, "the upstream's last answer");
    assert_eq!(received("/v1/charges/c-9"), 3);

    // A keyed route whose upstream does not deduplicate, and a route no one declared: sent
    // once, whatever the answer.
    let keyed = call(
        charge(&http, &proxy.base, "/v1/charges", "busy-1", "{}")
            .header("X-Upstream-Status", "503"),
    )
    .await;
    assert_eq!(keyed.status, 503);
    assert_eq!(upstream.received("busy-1").len(), 1);
    let unknown = call(
        http.post(format!("{}/v2/other", proxy.base))
            .header("X-Upstream-Status", "503")
            .body("x"),
    )
    .await;
    assert_eq!(unknown.status, 503);
    assert_eq!(received("/v2/other"), 1);
}

#[tokio::test]
async fn a_failing_upstream_gets_no_retry_storm() {
    let Some(Rig {
        http,
        proxy,
        upstream,
        dir: _dir,
    }) = Rig::start(&[]).await
    else {
        return;
    };

    // 100 reads of a safe route (3 attempts each allowed) while the upstream answers 503.
    const READS: usize = 100;
    let mut callers = Vec::new();
    for c in 0..10 {
        let (http, base) = (http.clone(), proxy.base.clone());
        callers.push(tokio::spawn(async move {
            let mut refused = 0;
            for i in 0..READS / 10 {
                let answer = call(
                    http.get(format!("{base}/v1/charges/s-{c}-{i}"))
                        .header("X-Upstream-Status", "503"),
                )
                .await;
                assert_eq!(answer.status, 503);
                if answer.json()["code"] == "circuit_open" {
                    assert!(answer.headers.contains_key("retry-after"));
                    refused += 1;
                }
            }
            refused
        }));
    }
    let mut refused = 0;
    for caller in callers {
        refused += caller.await.unwrap();
    }
    // Retries come from the budget (10 % of requests plus a burst of 20), stop when the storm
    // alarm trips, and the breaker stops sending at all once most calls fail: nowhere near the
    // 300 sends three attempts each would make.
    let sent = upstream.of("received", None).len();
    assert!(sent <= READS + READS / 10 + 20, "{sent} sends");
    assert!(refused > 0, "the circuit opened");
    assert!(sent + refused >= READS, "{sent} sent, {refused} refused");
}

#[tokio::test]
async fn beyond_max_inflight_requests_queue_or_get_503_with_retry_after() {
    let Some(Rig {
        http,
        proxy,
        upstream,
        dir: _dir,
    }) = Rig::start(&["--max-inflight", "2", "--queue-size", "2"]).await
    else {
        return;
    };

    // Twelve slow requests at once against two places and a queue of two.
    let mut calls = Vec::new();
    for i in 0..12 {
        let request = charge(
            &http,
            &proxy.base,
            "/v1/charges",
            &format!("busy-{i}"),
            "{}",
        )
        .header("X-Upstream-Sleep-Ms", "500")
        .header("X-Request-Timeout", "5000");
        calls.push(tokio::spawn(send(request)));
    }
    let (mut served, mut shed) = (0, 0);
    for call in calls {
        let answer = call.await.unwrap().unwrap();
        match answer.status {
            201 => served += 1,
            503 => {
                assert_eq!(answer.json()["code"], "overloaded");
                let wait: u64 = answer.headers["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!(wait >= 1, "{wait}");
                shed += 1;
            }
            other => panic!("{other}: {}", answer.text()),
        }
    }
    assert_eq!(served + shed, 12);
    assert!(served >= 2 && shed >= 1, "{served} served, {shed} shed");
    // The upstream never had more than two of them at once, and saw only the served ones.
    assert_eq!(upstream.of("received", None).len(), served);
    let most = upstream.most_in_flight();
    assert!(most <= 2, "{most} at once");
}

#[tokio::test]
async fn at_five_times_the_upstreams_capacity_goodput_stays_near_it() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Four workers, 100 ms a request: 40 requests a second.
    let upstream = Upstream::start_script(dir.path(), "upstream.py", &["--workers", "4"]).await;
    let proxy = Proxy::options(dir.path(), &[&upstream.url])
        .args(&["--max-inflight", "4"])
        .start()
        .await;
    let http = client();

    // 200 requests a second for three seconds, open loop, each with a one second budget.
    const OFFERED: usize = 600;
    let mut ticks = tokio::time::interval(Duration::from_millis(5));
    let mut calls = Vec::with_capacity(OFFERED);
    for i in 0..OFFERED {
        ticks.tick().await;
        let request = http
            .get(format!("{}/v1/charges/o-{i}", proxy.base))
            .header("X-Upstream-Sleep-Ms", "100")
            .header("X-Request-Timeout", "1000");
        calls.push(tokio::spawn(send(request)));
    }
    let (mut served, mut shed, mut late) = (0, 0, 0);
    for call in calls {
        let answer = call.await.unwrap().unwrap();
        match answer.status {
            200 => served += 1,
            503 => shed += 1,
            504 => late += 1,
            other => panic!("{other}: {}", answer.text()),
        }
    }
    eprintln!("goodput: {served} served, {shed} shed, {late} late of {OFFERED}");
    // Three seconds of capacity are 120 requests: most of them are served, in time, and the
    // excess is refused at once instead of waiting until its budget is gone.
    assert!(served >= 72, "{served} served, {shed} shed, {late} late");
    assert!(shed > served, "{served} served, {shed} shed, {late} late");
    assert!(
        late <= OFFERED / 20,
        "{served} served, {shed} shed, {late} late"
    );
    let most = upstream.most_in_flight();
    assert!(most <= 4, "{most} at once");
}
