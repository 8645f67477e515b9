//! What `backstop proxy` does towards its upstreams, against Python upstreams
//! (`support/upstream.py`): of two, one goes down, the traffic goes to the other, the breaker
//! of the one that is down opens, and closes again once it is back; an upstream failing most
//! requests drops the admission limit to slow start's floor, and it ramps back as they
//! succeed; slow attempts are hedged on safe routes only; with every endpoint down at once,
//! every breaker opens, requests are answered 503 + `Retry-After` instead of waiting out their
//! budget, and traffic flows again once one endpoint is back. Every step waits for a
//! condition, never a time.

#[path = "support/proxy_harness.rs"]
mod proxy_harness;
#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;

use self::proxy_harness::{
    Proxy, ROUTES, Rig, Upstream, breaker_state, call, charge, client, free_port, limit,
    python_ready, wait_for,
};

#[tokio::test]
async fn an_upstream_that_goes_down_is_left_out_by_its_breaker_until_it_is_back() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let one = Upstream::start(dir.path()).await;
    // The second on a port of its own, so that it can come back on it.
    let port = free_port().to_string();
    let port_args = ["--port", port.as_str()];
    let start_two = || Upstream::start_script(dir.path(), "upstream.py", &port_args);
    let mut two = start_two().await;
    let proxy = Proxy::options(dir.path(), &[&one.url, &two.url])
        .args(&["--endpoint-breaker-min-requests", "4"])
        .args(&["--endpoint-breaker-open-for", "1s"])
        .start()
        .await;
    let http = client();
    let two_label = format!("upstream@127.0.0.1:{port}");
    let mut n = 0;
    let mut read = async || {
        n += 1;
        call(http.get(format!("{}/v1/charges/c-{n}", proxy.base))).await
    };
    assert_eq!(breaker_state(&proxy, &two_label).await, Some(0.0));

    two.kill().await;
    // Every request is answered by the other one: a refused connection is sent again, to an
    // endpoint that did not refuse it. The failures open the breaker of the one that is down.
    wait_for(
        "the breaker of the upstream that is down to open",
        async || {
            let answer = read().await;
            answer.assert_status(200);
            (breaker_state(&proxy, &two_label).await == Some(2.0)).then_some(())
        },
    )
    .await;
    let served = one.of("received", None).len();
    for _ in 0..10 {
        read().await.assert_status(200);
    }
    assert_eq!(one.of("received", None).len(), served + 10);

    // Back on its port: once its open period ends a request probes it, and the breaker closes.
    let two = start_two().await;
    wait_for("the breaker to close again", async || {
        read().await.assert_status(200);
        (breaker_state(&proxy, &two_label).await == Some(0.0)).then_some(())
    })
    .await;
    wait_for("traffic to reach the upstream that came back", async || {
        read().await.assert_status(200);
        (!two.of("received", None).is_empty()).then_some(())
    })
    .await;
    // The upstream as a whole never failed: its own breaker stayed closed.
    assert_eq!(breaker_state(&proxy, "upstream").await, Some(0.0));
}

/// Both endpoints down at once: their breakers open, then the upstream's own; every request is
/// answered 503 with `Retry-After` (a budget of 30 s is never waited out: no 504), and once one
/// endpoint is back on its port the requests reach it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_endpoint_down_every_breaker_opens_and_requests_get_503_until_one_is_back() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let port_args = ["--port", port.as_str()];
    let start_one = || Upstream::start_script(dir.path(), "upstream.py", &port_args);
    let mut one = start_one().await;
    let mut two = Upstream::start(dir.path()).await;
    let proxy = Proxy::options(dir.path(), &[&one.url, &two.url])
        .args(&["--endpoint-breaker-min-requests", "4"])
        .args(&["--endpoint-breaker-open-for", "1s"])
        .start()
        .await;
    let http = client();
    let labels = [
        format!("upstream@127.0.0.1:{port}"),
        two.url.replace("http://", "upstream@"),
    ];
    let get = |n: usize| {
        http.get(format!("{}/v1/charges/c-{n}", proxy.base))
            .header("grpc-timeout", "30S")
    };
    let read = async |n: usize| call(get(n)).await;
    read(0).await.assert_status(200);

    one.kill().await;
    two.kill().await;
    let mut n = 0;
    wait_for("every breaker to open", async || {
        // A wave at once, so that the upstream's breaker sees its minimum of requests.
        let mut wave = tokio::task::JoinSet::new();
        for i in 0..8 {
            wave.spawn(call(get(n * 8 + i + 1)));
        }
        n += 1;
        for answer in wave.join_all().await {
            answer.assert_status(503);
            assert!(
                answer.headers.contains_key("retry-after"),
                "{}",
                answer.text()
            );
        }
        let mut open = true;
        for label in labels.iter().map(String::as_str).chain(["upstream"]) {
            open &= breaker_state(&proxy, label).await == Some(2.0);
        }
        open.then_some(())
    })
    .await;
    for i in 0..5 {
        let answer = read(1000 + i).await;
        answer.assert_status(503);
        assert!(
            answer.headers.contains_key("retry-after"),
            "{}",
            answer.text()
        );
    }

    let one = start_one().await;
    let mut n = 2000;
    wait_for(
        "a request to reach the endpoint that came back",
        async || {
            n += 1;
            let answer = read(n).await;
            (answer.status == 200).then_some(())
        },
    )
    .await;
    assert!(!one.of("received", None).is_empty());
}

#[tokio::test]
async fn an_upstream_failing_most_requests_drops_the_limit_to_the_floor_then_it_ramps_back() {
    let Some(Rig {
        http,
        proxy,
        upstream: _upstream,
        dir: _dir,
    }) = Rig::start(&["--max-inflight", "8", "--slow-start-floor", "2"]).await
    else {
        return;
    };
    // The gauge is set as requests come and go.
    call(http.get(format!("{}/v1/charges/first", proxy.base)))
        .await
        .assert_status(200);
    assert_eq!(limit(&proxy).await, 8.0);
    let mut n = 0;
    // The upstream answers 503 to everything: the limit drops to the floor.
    wait_for("the limit to drop to the floor", async || {
        n += 1;
        let failing = http
            .get(format!("{}/v1/charges/f-{n}", proxy.base))
            .header("X-Upstream-Status", "503");
        assert_eq!(call(failing).await.status, 503);
        (limit(&proxy).await == 2.0).then_some(())
    })
    .await;
    // It recovers: once requests succeed again (after the upstream's breaker, opened by the
    // same failures, lets one probe through), the limit ramps back to its maximum.
    wait_for("the limit to ramp back to its maximum", async || {
        n += 1;
        let answer = call(http.get(format!("{}/v1/charges/r-{n}", proxy.base))).await;
        assert!(matches!(answer.status, 200 | 503), "{}", answer.text());
        (limit(&proxy).await == 8.0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn slow_attempts_are_hedged_on_safe_routes_only() {
    if !python_ready().await {
        return;
    }
    let routes = format!(
        "{ROUTES}
[[policies.route]]
match = \"GET /v1/slow/{{id}}\"
idempotency = \"safe\"
hedging = true
hedge_delay = \"50ms\"

[[policies.route]]
match = \"POST /v1/hedged\"
idempotency = \"keyed\"
hedging = true
hedge_delay = \"50ms\"
"
    );
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    let proxy = Proxy::options(dir.path(), &[&upstream.url])
        .routes(&routes)
        .start()
        .await;
    let http = client();

    // A safe read that takes a while gets a second attempt after 50 ms; the first answer wins.
    let read = http
        .get(format!("{}/v1/slow/s-1", proxy.base))
        .header("X-Upstream-Sleep-Ms", "1000");
    call(read).await.assert_status(200);
    assert_eq!(upstream.received_at("/v1/slow/s-1"), 2, "hedged once");

    // A keyed route whose upstream does not deduplicate is sent once, hedging or not.
    let write =
        charge(&http, &proxy.base, "/v1/hedged", "h-1", "{}").header("X-Upstream-Sleep-Ms", "1000");
    call(write).await.assert_status(201);
    assert_eq!(upstream.received("h-1").len(), 1, "never hedged");
    assert_eq!(upstream.effects("h-1").len(), 1);

    // An unsafe route cannot ask for it: the file is refused, naming why.
    let unsafe_routes = dir.path().join("unsafe.toml");
    std::fs::write(
        &unsafe_routes,
        "[[policies.route]]\nmatch = \"POST /v1/x\"\nhedging = true\n",
    )
    .unwrap();
    let out = tokio::process::Command::new(proxy_harness::BIN)
        .args(["proxy", "--check-config"])
        .arg(&unsafe_routes)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let error = String::from_utf8_lossy(&out.stderr);
    assert!(error.contains("hedging an unsafe method"), "{error}");
}
