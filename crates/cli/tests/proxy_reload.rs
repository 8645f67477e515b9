//! `backstop proxy` reloads its routes file on SIGHUP: the new routes apply to the server stack
//! (a route's timeout) and to the client stack towards the upstream (a route's attempts)
//! alike, and a file that is refused (a keyed route made unsafe, a file that does not parse)
//! is logged with the file and the reason while the routes in effect stay and the proxy goes
//! on serving.
//!
//! Nothing is timed: each step waits for the reload's log line, and the behaviour is read from
//! answers and from what the upstream received.

#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;

#[path = "support/proxy_harness.rs"]
mod proxy_harness;

use self::proxy_harness::{Proxy, Upstream, call, charge, client, python_ready};

/// Route A: a read of one attempt and a 300 ms budget.
const ROUTES_A: &str = r#"
[[policies.route]]
match = "POST /v1/charges"
name = "CreateCharge"
idempotency = "keyed"

[[policies.route]]
match = "GET /v1/items/{id}"
idempotency = "safe"
timeout = "300ms"
retries = 0
hedging = false
"#;

/// Route B: the same read, three attempts and a 20 s budget.
const ROUTES_B: &str = r#"
[[policies.route]]
match = "POST /v1/charges"
name = "CreateCharge"
idempotency = "keyed"

[[policies.route]]
match = "GET /v1/items/{id}"
idempotency = "safe"
timeout = "20s"
retries = 2
hedging = false
"#;

/// How long the upstream takes over a slow read: longer than route A's budget, far shorter
/// than route B's.
const SLOW_MS: &str = "1500";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_routes_for_both_stacks_and_a_refused_file_keeps_them() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let options = Proxy::options(dir.path(), &[&upstream.url]).routes(ROUTES_A);
    let file = options.routes_file();
    let mut proxy = options.start().await;
    let http = client();
    let base = proxy.base.clone();
    let failing_read = |id: &str| {
        http.get(format!("{base}/v1/items/{id}"))
            .header("X-Upstream-Status", "503")
    };
    let slow_read = |id: &str| {
        http.get(format!("{base}/v1/items/{id}"))
            .header("X-Upstream-Sleep-Ms", SLOW_MS)
    };
    // Every attempt is recorded before its answer is sent: once the answer is here, the count
    // is final.
    let sent = |id: &str| upstream.received_at(&format!("/v1/items/{id}"));

    // Route A: a failing read is sent once, a slow one runs out of its budget.
    call(failing_read("a1")).await.assert_status(503);
    assert_eq!(sent("a1"), 1, "route A sends once");
    let slow = call(slow_read("a2")).await;
    slow.assert_status(504);
    assert_eq!(slow.json()["code"], "deadline_exceeded", "{}", slow.text());

    // Route B, after SIGHUP.
    std::fs::write(&file, ROUTES_B).unwrap();
    let reloaded = proxy.hangup().await;
    assert_eq!(
        reloaded["fields"]["message"], "policies reloaded",
        "{reloaded}"
    );
    assert_eq!(
        reloaded["fields"]["file"],
        file.display().to_string(),
        "{reloaded}"
    );
    call(failing_read("b1")).await.assert_status(503);
    assert_eq!(sent("b1"), 3, "route B's client stack makes three attempts");
    call(slow_read("b2")).await.assert_status(200);

    // A keyed route made unsafe: refused, naming the file and the route; route B stays.
    std::fs::write(
        &file,
        ROUTES_B.replace(
            "name = \"CreateCharge\"\nidempotency = \"keyed\"",
            "name = \"CreateCharge\"\nidempotency = \"unsafe\"",
        ),
    )
    .unwrap();
    assert!(std::fs::read_to_string(&file).unwrap().contains("unsafe"));
    let refused = proxy.hangup().await;
    let message = refused["fields"]["message"].as_str().unwrap();
    assert!(message.starts_with("policy reload refused"), "{refused}");
    let error = refused["fields"]["error"].as_str().unwrap();
    assert!(error.contains(&file.display().to_string()), "{error}");
    assert!(error.contains("route CreateCharge"), "{error}");
    assert!(error.contains("is keyed and stays so"), "{error}");
    call(failing_read("c1")).await.assert_status(503);
    assert_eq!(sent("c1"), 3, "route B is still in effect");
    let unkeyed = call(
        http.post(format!("{base}/v1/charges"))
            .header("Content-Type", "application/json")
            .body("{}"),
    )
    .await;
    unkeyed.assert_status(400);
    assert_eq!(unkeyed.json()["code"], "missing_idempotency_key");

    // A file that does not parse: refused, naming the file and the key; route B stays.
    std::fs::write(&file, ROUTES_A.replace("retries = 0", "retries = \"none\"")).unwrap();
    let refused = proxy.hangup().await;
    let message = refused["fields"]["message"].as_str().unwrap();
    assert!(message.starts_with("policy reload refused"), "{refused}");
    let error = refused["fields"]["error"].as_str().unwrap();
    assert!(error.contains(&file.display().to_string()), "{error}");
    assert!(error.contains("retries"), "{error}");
    call(failing_read("d1")).await.assert_status(503);
    assert_eq!(sent("d1"), 3, "route B is still in effect");
    call(slow_read("d2")).await.assert_status(200);
    call(charge(&http, &base, "/v1/charges", "after-refusals", "{}"))
        .await
        .assert_status(201);
}
