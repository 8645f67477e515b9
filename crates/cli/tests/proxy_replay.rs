//! What `backstop proxy` keeps of a keyed answer: up to `--max-replay-body` (or a route's
//! `max_replay_body`) it is stored and replayed byte for byte; a larger one streams through
//! as it comes, and a retry with its key gets its status with `replay_body_too_large`, never
//! a second forward. Against the Python upstream's `POST .../big/N`, which answers N bytes.

#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;

#[path = "support/proxy_harness.rs"]
mod proxy_harness;

use self::proxy_harness::{Answer, Proxy, Upstream, call, client, python_ready, send, wait_for};

/// The proxy's default bound in these tests (`--max-replay-body`).
const BOUND: usize = 1000;
/// The bound `POST /v2/big/{n}` sets for itself.
const ROUTE_BOUND: usize = 100;

const ROUTES: &str = r#"
[[policies.route]]
match = "POST /big/{n}"
idempotency = "keyed"
timeout = "30s"

[[policies.route]]
match = "POST /v2/big/{n}"
idempotency = "keyed"
timeout = "30s"
max_replay_body = 100

[proxy]
replay_headers = ["x-upstream"]
"#;

/// The Python upstream and a proxy keeping `bound` (`--max-replay-body`).
async fn start(dir: &std::path::Path, bound: &str) -> (Upstream, Proxy) {
    let upstream = Upstream::start(dir).await;
    let proxy = Proxy::options(dir, &[&upstream.url])
        .routes(ROUTES)
        .args(&["--max-replay-body", bound])
        .start()
        .await;
    (upstream, proxy)
}

fn big(http: &reqwest::Client, proxy: &Proxy, path: &str, key: &str) -> reqwest::RequestBuilder {
    http.post(format!("{}{path}", proxy.base))
        .header("Idempotency-Key", key)
        .body("{}")
}

/// What `/big/N` answers: N bytes of 0, 1, ..., 255, 0, ...
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| i as u8).collect()
}

#[track_caller]
fn assert_too_large(answer: &Answer, bound: usize) {
    assert_eq!(answer.status, 200, "the original status: {}", answer.text());
    assert!(answer.replayed());
    assert_eq!(answer.headers["content-type"], "application/problem+json");
    assert_eq!(
        answer.headers["x-upstream"], "python",
        "the original headers"
    );
    let doc = answer.json();
    assert_eq!(doc["code"], "replay_body_too_large", "{doc}");
    assert_eq!(doc["max_replay_body"], bound, "{doc}");
    assert_eq!(doc["status"], 200, "{doc}");
}

#[tokio::test]
async fn answers_below_at_and_above_the_bound_and_a_retry_of_each_is_never_forwarded() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (upstream, proxy) = start(dir.path(), &BOUND.to_string()).await;
    let http = client();
    let cases = [
        ("/big/999", 999, true),
        ("/big/1000", 1000, true),
        ("/big/1001", 1001, false),
        // Its length unknown in advance: read up to the bound, then streamed.
        ("/big/1000?chunked=1", 1000, true),
        ("/big/1001?chunked=1", 1001, false),
        ("/big/300000?chunked=1", 300_000, false),
        // Its Content-Length over the bound: not read ahead at all.
        ("/big/300000", 300_000, false),
    ];
    for (path, n, kept) in cases {
        let key = format!("k{path}");
        let first = call(big(&http, &proxy, path, &key)).await;
        first.assert_status(200);
        assert!(!first.replayed());
        assert!(
            first.body == pattern(n),
            "{path}: the whole answer streams through"
        );
        for _ in 0..2 {
            let again = call(big(&http, &proxy, path, &key)).await;
            if kept {
                assert_eq!((again.status, again.replayed()), (200, true), "{path}");
                assert!(again.body == first.body, "{path}: byte for byte");
            } else {
                assert_too_large(&again, BOUND);
            }
        }
        assert_eq!(upstream.received(&key).len(), 1, "{path}: forwarded once");
    }
    // A route's own bound wins over the flag's.
    let first = call(big(&http, &proxy, "/v2/big/150", "route-1")).await;
    assert!(first.body == pattern(150));
    assert_too_large(
        &call(big(&http, &proxy, "/v2/big/150", "route-1")).await,
        ROUTE_BOUND,
    );
    assert_eq!(upstream.received("route-1").len(), 1);
}

#[tokio::test]
async fn an_answer_that_breaks_after_the_bound_has_an_unknown_outcome_and_is_not_forwarded_again() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (upstream, proxy) = start(dir.path(), &BOUND.to_string()).await;
    let http = client();
    // A short budget, so that the record's lease ends soon after.
    let broken = send(
        big(&http, &proxy, "/big/100000", "broken-1")
            .header("X-Upstream-Break-After", "5000")
            .header("X-Request-Timeout", "1000"),
    )
    .await;
    assert!(
        broken.is_err(),
        "the caller sees the answer break: {broken:?}"
    );
    // The retry waits for the record's lease to end, then learns that the outcome is unknown.
    let retry = call(big(&http, &proxy, "/big/100000", "broken-1")).await;
    retry.assert_status(500);
    assert_eq!(retry.json()["code"], "outcome_unknown");
    let again = call(big(&http, &proxy, "/big/100000", "broken-1")).await;
    assert_eq!(
        again.json()["code"],
        "outcome_unknown",
        "stored for the key"
    );
    assert_eq!(upstream.received("broken-1").len(), 1);
}

#[tokio::test]
async fn a_caller_that_leaves_midway_leaves_the_answer_recorded() {
    if !python_ready().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (upstream, proxy) = start(dir.path(), &BOUND.to_string()).await;
    let http = client();
    let n = 64 << 20;
    let response = big(&http, &proxy, &format!("/big/{n}"), "gone-1")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut response = response;
    let first = response.chunk().await.unwrap().unwrap();
    assert!(!first.is_empty());
    // The caller goes away with most of the answer unread.
    drop(response);
    let retry = call(big(&http, &proxy, &format!("/big/{n}"), "gone-1")).await;
    assert_too_large(&retry, BOUND);
    assert_eq!(upstream.received("gone-1").len(), 1);
}

/// The proxy's peak resident memory, from `/proc/PID/status` (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmHWM in kB");
    kib * 1024
}

#[tokio::test]
async fn eight_concurrent_256_mib_answers_leave_the_proxy_small() {
    const N: usize = 256 << 20;
    const LIMIT: u64 = 200 << 20;
    if !python_ready().await || !std::path::Path::new("/proc/self/status").exists() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (upstream, proxy) = start(dir.path(), "1MiB").await;
    let pid = proxy.child.id().expect("the proxy runs");
    let http = client();
    let mut calls = Vec::new();
    for i in 0..8 {
        // Half with a Content-Length, half chunked.
        let path = if i % 2 == 0 {
            format!("/big/{N}")
        } else {
            format!("/big/{N}?chunked=1")
        };
        let request = big(&http, &proxy, &path, &format!("rss-{i}"));
        calls.push(tokio::spawn(async move {
            let mut response = request.send().await.unwrap();
            assert_eq!(response.status(), 200);
            let mut len = 0;
            while let Some(chunk) = response.chunk().await.unwrap() {
                len += chunk.len();
            }
            len
        }));
    }
    for call in calls {
        assert_eq!(call.await.unwrap(), N, "every answer streams through whole");
    }
    let peak = peak_rss(pid);
    eprintln!("proxy peak RSS (VmHWM): {} MiB", peak >> 20);
    assert!(
        peak < LIMIT,
        "the proxy peaked at {} MiB while 8 answers of 256 MiB passed through",
        peak >> 20
    );
    // Each record is kept without its body: a retry gets the definite answer.
    for i in 0..8 {
        let key = format!("rss-{i}");
        let path = if i % 2 == 0 {
            format!("/big/{N}")
        } else {
            format!("/big/{N}?chunked=1")
        };
        let retry = wait_for("the record", async || {
            let answer = call(big(&http, &proxy, &path, &key)).await;
            (answer.status != 409).then_some(answer)
        })
        .await;
        assert_too_large(&retry, 1 << 20);
        assert_eq!(upstream.received(&key).len(), 1);
    }
    let store = std::fs::metadata(dir.path().join("proxy.db"))
        .unwrap()
        .len();
    assert!(store < 16 << 20, "the store holds no body: {store} bytes");
}
