//! `backstop proxy` through crashes and lost answers, against the Python upstream
//! (`support/upstream.py`): kill -9 of the proxy mid-request then a retry (outcome unknown,
//! or forwarded again under the same effect key where the upstream deduplicates), an answer
//! lost on its way back, keys retried through several SIGKILLs, and a SIGTERM under load (the
//! requests in flight finish, nothing is executed twice).

#[path = "support/proxy_harness.rs"]
mod proxy_harness;
#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;

use std::time::Duration;

use self::proxy_harness::{
    Answer, PATIENCE, Proxy, Rig, Upstream, call, charge, client, free_port, python_ready, send,
    wait_for,
};

/// Sends a keyed request that the upstream holds, waits for its effect, kills the proxy with
/// SIGKILL, and starts it again on the same store.
async fn crash_mid_request(rig: &mut Rig, path: &str, key: &str, body: &str) {
    let Rig {
        http,
        proxy,
        upstream,
        dir,
    } = rig;
    let request = charge(http, &proxy.base, path, key, body)
        .header("X-Upstream-Sleep-Ms", "20000")
        .header("X-Request-Timeout", "4000");
    let pending = tokio::spawn(send(request));
    wait_for("the effect", async || {
        (!upstream.effects(key).is_empty()).then_some(())
    })
    .await;
    proxy.kill9().await;
    assert!(
        pending.await.unwrap().is_err(),
        "no answer from a killed proxy"
    );
    // The upstream sees its connection dropped.
    wait_for("the upstream to see the request dropped", async || {
        (!upstream.of("cancelled", Some(key)).is_empty()).then_some(())
    })
    .await;
    *proxy = Proxy::start(dir.path(), &upstream.url).await;
}

#[tokio::test]
async fn a_retry_after_a_crash_answers_outcome_unknown_and_forwards_nothing() {
    let Some(mut rig) = Rig::start(&[]).await else {
        return;
    };
    let body = r#"{"amount":999}"#;
    crash_mid_request(&mut rig, "/v1/charges", "crash-1", body).await;
    let Rig {
        http,
        proxy,
        upstream,
        ..
    } = rig;

    // The retry waits for the dead run's lease to end, then learns that its outcome is
    // unknown: nothing is forwarded again.
    let retry = call(charge(&http, &proxy.base, "/v1/charges", "crash-1", body)).await;
    retry.assert_status(500);
    assert_eq!(retry.json()["code"], "outcome_unknown");
    let again = call(charge(&http, &proxy.base, "/v1/charges", "crash-1", body)).await;
    assert_eq!((again.status, again.replayed()), (500, true));
    assert_eq!(again.json()["code"], "outcome_unknown");
    assert_eq!(upstream.received("crash-1").len(), 1);
    assert_eq!(upstream.effects("crash-1").len(), 1);
}

#[tokio::test]
async fn after_a_crash_a_route_whose_upstream_dedups_is_forwarded_again_with_the_same_effect_key() {
    let Some(mut rig) = Rig::start(&[]).await else {
        return;
    };
    let body = r#"{"amount":7}"#;
    crash_mid_request(&mut rig, "/dedup/charges", "crash-2", body).await;
    let Rig {
        http,
        proxy,
        upstream,
        ..
    } = rig;

    let retry = call(charge(
        &http,
        &proxy.base,
        "/dedup/charges",
        "crash-2",
        body,
    ))
    .await;
    retry.assert_status(201);
    assert!(
        !retry.replayed(),
        "forwarded again, the upstream's own answer"
    );
    let received = upstream.received("crash-2");
    assert_eq!(received.len(), 2, "{received:?}");
    assert_eq!(
        received[0]["effect_key"], received[1]["effect_key"],
        "the same effect key both times"
    );
    assert_eq!(upstream.effects("crash-2").len(), 1, "executed once");
    assert_eq!(upstream.of("deduped", Some("crash-2")).len(), 1);
    let effect = &upstream.effects("crash-2")[0];
    assert_eq!(retry.json()["effect_id"], effect["effect_id"]);

    let again = call(charge(
        &http,
        &proxy.base,
        "/dedup/charges",
        "crash-2",
        body,
    ))
    .await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, retry.body);
    assert_eq!(upstream.received("crash-2").len(), 2);
}

#[tokio::test]
async fn an_answer_lost_on_the_way_back_is_not_forwarded_again_unless_the_upstream_dedups() {
    let Some(Rig {
        http,
        proxy,
        upstream,
        dir: _dir,
    }) = Rig::start(&[]).await
    else {
        return;
    };
    let body = r#"{"amount":11}"#;
    // The upstream executes the effect and closes the connection without answering.
    let lossy = |path: &str, key: &str| {
        charge(&http, &proxy.base, path, key, body)
            .header("X-Upstream-Drop", "1")
            .header("X-Request-Timeout", "2000")
    };

    // By default the key is never forwarded again: the caller learns that the outcome is
    // unknown, and so does its retry once the run's lease ends.
    let lost = call(lossy("/v1/charges", "lost-1")).await;
    lost.assert_status(502);
    assert_eq!(lost.json()["code"], "upstream_outcome_unknown");
    let retry = call(charge(&http, &proxy.base, "/v1/charges", "lost-1", body)).await;
    retry.assert_status(500);
    assert_eq!(retry.json()["code"], "outcome_unknown");
    assert_eq!(upstream.received("lost-1").len(), 1);

    // Where the upstream deduplicates by the effect key, the proxy's own retry sends it again
    // under the same one (from the retry budget) and gets the upstream's answer to the first.
    let recovered = call(lossy("/dedup/charges", "lost-2")).await;
    recovered.assert_status(201);
    let received = upstream.received("lost-2");
    assert_eq!(received.len(), 2);
    assert_eq!(received[0]["effect_key"], received[1]["effect_key"]);
    let effects = upstream.effects("lost-2");
    assert_eq!(effects.len(), 1);
    assert_eq!(recovered.json()["effect_id"], effects[0]["effect_id"]);
    let again = call(charge(&http, &proxy.base, "/dedup/charges", "lost-2", body)).await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(upstream.received("lost-2").len(), 2);

    // The retry is counted as the client stack counts its own.
    let metrics = proxy.metrics().await;
    let retries = metrics
        .lines()
        .find(|l| {
            l.starts_with("rpc_client_retries_total")
                && l.contains(r#"service="upstream""#)
                && l.contains(r#"method="DedupCharge""#)
        })
        .unwrap_or_else(|| panic!("no retry counted:\n{metrics}"));
    assert!(retries.ends_with(" 1"), "{retries}");
}

/// Sends `key` until a final answer (201, or 500 `outcome_unknown`), through whatever proxy
/// answers at `base`, retrying with the same key and body after anything else.
async fn until_final(http: &reqwest::Client, base: &str, path: &str, key: &str) -> Answer {
    let body = format!(r#"{{"key":"{key}"}}"#);
    let give_up = tokio::time::Instant::now() + PATIENCE;
    loop {
        let request = charge(http, base, path, key, &body)
            .header("X-Upstream-Sleep-Ms", "150")
            .header("X-Request-Timeout", "2000")
            .timeout(Duration::from_secs(10));
        if let Ok(answer) = send(request).await {
            let code = answer.json()["code"].clone();
            if answer.status == 201 || code == "outcome_unknown" {
                return answer;
            }
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "{key}: no final answer"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn keys_retried_through_sigkills_of_the_proxy_are_executed_at_most_once() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start(dir.path()).await;
    // One address for every incarnation of the proxy, so that clients find the next one.
    let port = free_port();
    let options = Proxy::options(dir.path(), &[&upstream.url]).listen(&format!("127.0.0.1:{port}"));
    let mut proxy = options.start().await;
    let base = format!("http://127.0.0.1:{port}");
    assert_eq!(proxy.base, base);

    // Thirty keys, half on a route whose upstream deduplicates by the effect key, each sent
    // until it has a final answer while the proxy is killed with SIGKILL and started again.
    let http = client();
    let mut clients = Vec::new();
    for i in 0..30 {
        let (http, base) = (http.clone(), base.clone());
        let path = if i % 2 == 0 {
            "/v1/charges"
        } else {
            "/dedup/charges"
        };
        let key = format!("chaos-{i}");
        clients.push(tokio::spawn(async move {
            // Spread over the kills (load shaping, not synchronisation).
            tokio::time::sleep(Duration::from_millis(60 * i)).await;
            let answer = until_final(&http, &base, path, &key).await;
            (path, key, answer)
        }));
    }
    for _ in 0..4 {
        // Each kill lands while requests are at the upstream, a few requests after the last.
        let seen = upstream.of("received", None).len();
        wait_for("requests at the upstream", async || {
            (upstream.of("received", None).len() >= seen + 4).then_some(())
        })
        .await;
        proxy.kill9().await;
        proxy = options.start().await;
    }
    let mut finals = Vec::new();
    for client in clients {
        finals.push(client.await.unwrap());
    }

    let (mut acked, mut unknown) = (0, 0);
    for (path, key, answer) in &finals {
        let effects = upstream.effects(key).len();
        assert!(effects <= 1, "{key}: executed {effects} times");
        if answer.status == 201 {
            acked += 1;
            assert_eq!(effects, 1, "{key}: acknowledged, so executed");
            // Every later retry gets the acknowledged answer, byte for byte.
            let replay = until_final(&http, &base, path, key).await;
            assert_eq!(replay.body, answer.body, "{key}");
            assert!(replay.replayed(), "{key}");
        } else {
            unknown += 1;
            assert_eq!(
                *path, "/v1/charges",
                "{key}: a deduplicating route always converges"
            );
        }
        let received = upstream.received(key);
        let effect_keys: std::collections::BTreeSet<_> = received
            .iter()
            .map(|e| e["effect_key"].to_string())
            .collect();
        // None when a kill landed between the key's claim and its forward: the retry then
        // learns `outcome_unknown` (nothing says the forward did not happen), never forwards.
        assert!(
            effect_keys.len() <= 1,
            "{key}: one effect key for every forward: {received:?}"
        );
    }
    eprintln!("chaos: {acked} acknowledged, {unknown} outcome_unknown, 4 kills");
    assert_eq!(acked + unknown, 30);
}

/// SIGTERM while keyed requests are at the upstream: the proxy stops taking new ones, lets
/// those in flight finish (each answered 201) and exits cleanly; a proxy started again on the
/// same store replays each key's answer, and the upstream executed each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_lets_requests_in_flight_finish_and_executes_nothing_twice() {
    const IN_FLIGHT: usize = 10;
    let Some(rig) = Rig::start(&[]).await else {
        return;
    };
    let Rig {
        http,
        mut proxy,
        upstream,
        dir,
    } = rig;
    let body = r#"{"amount":5}"#;
    let key = |i: usize| format!("drain-{i}");
    let mut pending = tokio::task::JoinSet::new();
    for i in 0..IN_FLIGHT {
        let request = charge(&http, &proxy.base, "/v1/charges", &key(i), body)
            .header("X-Upstream-Sleep-Ms", "1500");
        pending.spawn(send(request));
    }
    wait_for("every request to be at the upstream", async || {
        (upstream.of("effect", None).len() == IN_FLIGHT).then_some(())
    })
    .await;

    let pid = proxy.child.id().expect("running").to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(sent.success());
    for answer in pending.join_all().await {
        let answer = answer.expect("a request in flight is answered, not cut");
        answer.assert_status(201);
    }
    let status = tokio::time::timeout(PATIENCE, proxy.child.wait())
        .await
        .expect("the proxy exits once drained")
        .unwrap();
    assert!(status.success(), "{status}");

    let proxy = Proxy::start(dir.path(), &upstream.url).await;
    for i in 0..IN_FLIGHT {
        let again = call(charge(&http, &proxy.base, "/v1/charges", &key(i), body)).await;
        assert_eq!(
            (again.status, again.replayed()),
            (201, true),
            "{}",
            again.text()
        );
        assert_eq!(upstream.effects(&key(i)).len(), 1, "{}", key(i));
    }
}
