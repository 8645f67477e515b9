//! `backstop proxy` in front of two Python upstreams (`support/upstream.py`): one goes down,
//! the traffic goes to the other, the breaker of the one that is down opens, and closes again
//! once it is back and a probe succeeds. Every step waits for a condition, never a time.

#[path = "support/proxy_harness.rs"]
mod proxy_harness;
#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;

use self::proxy_harness::{Proxy, Upstream, call, client, free_port, python_ready, wait_for};

/// The value of `rpc_client_breaker_state` for `service` (0 closed, 1 half-open, 2 open).
async fn breaker_state(proxy: &Proxy, service: &str) -> Option<f64> {
    let label = format!(r#"service="{service}""#);
    proxy
        .metrics()
        .await
        .lines()
        .find(|l| l.starts_with("rpc_client_breaker_state{") && l.contains(&label))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

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
