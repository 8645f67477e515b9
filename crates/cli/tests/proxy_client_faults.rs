//! One caller's broken request bodies are that caller's fault: `backstop proxy` answers each
//! with a 4xx of its own (or nothing, when the caller's connection is gone), and none of them
//! counts against the upstream. After twenty-odd of them, another client's well-formed
//! requests all succeed: the upstream's circuit breaker is still closed and the admission
//! limit (slow start) has not moved. The faults are written byte by byte on raw sockets, to
//! the route that streams its body to the upstream (an unsafe `POST`) and to one that reads
//! it first, to send it again if need be (a safe `GET`).
//!
//! Nothing here waits for a time: each faulty request waits for its answer (or for the proxy
//! to close the connection), and what follows is counted.

#[path = "support/proxy_harness.rs"]
mod proxy_harness;
#[path = "../../backstop/tests/support/python.rs"]
#[allow(dead_code)]
mod python;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use self::proxy_harness::{PATIENCE, Rig, breaker_state, call, client, limit};

/// Faulty requests sent to each route, each answered before the next: more than the
/// breaker's `min_requests` (20), so that, counted against the upstream, they would open it.
const FAULTY: usize = 24;
/// Well-formed requests another client sends after them.
const WELL_FORMED: usize = 40;

/// What the caller does after the head and the first bytes of its body.
#[derive(Debug, Clone, Copy)]
enum Then {
    /// Waits for the answer.
    Wait,
    /// Closes its sending side (a half-close) and waits for the answer.
    HalfClose,
    /// Resets the connection.
    Reset,
}

/// The status line's code and the body of the answer to `request` (a head and whatever of a
/// body the caller sends), written on a new connection to `addr`; `None` when the connection
/// closed without one.
async fn raw(addr: &str, request: &[u8], then: Then) -> Option<(u16, String)> {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(request).await.unwrap();
    match then {
        Then::Wait => {}
        Then::HalfClose => tcp.shutdown().await.unwrap(),
        Then::Reset => {
            // SO_LINGER 0: closing sends RST.
            tcp.set_zero_linger().unwrap();
            drop(tcp);
            return None;
        }
    }
    let mut answer = Vec::new();
    let read = tokio::time::timeout(PATIENCE, async {
        let mut buf = [0u8; 4096];
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
            if complete(&answer) {
                break;
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the proxy answers or closes the connection");
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

/// Whether `answer` holds a whole head and the body its `content-length` announces.
fn complete(answer: &[u8]) -> bool {
    let text = String::from_utf8_lossy(answer);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    head.lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .is_some_and(|len| body.len() >= len)
}

/// The two routes a fault is sent to: one streaming the body (unsafe `POST`, the fallback
/// policy), one reading it first (the safe `GET /v1/charges/{id}`).
fn route(n: usize) -> (&'static str, String) {
    if n % 2 == 0 {
        ("POST", "/v1/orders".to_owned())
    } else {
        ("GET", format!("/v1/charges/c-{n}"))
    }
}

/// Sends [`FAULTY`] requests to each route, made by `request` (given the method and path),
/// with `then`, each getting `expected` (status and problem code; `None`: no answer), then
/// [`WELL_FORMED`] from another client: all succeed, the breaker stays closed and the limit
/// where it was.
async fn faults_leave_the_upstream_healthy(
    args: &[&str],
    request: impl Fn(&str, &str) -> Vec<u8>,
    then: Then,
    expected: Option<(u16, &str)>,
) {
    let Some(Rig {
        http,
        proxy,
        upstream: _upstream,
        dir: _dir,
    }) = Rig::start(args).await
    else {
        return;
    };
    // One answered request first: the gauges are set as requests come and go.
    call(http.get(format!("{}/v1/charges/first", proxy.base)))
        .await
        .assert_status(200);
    let before = limit(&proxy).await;
    assert_eq!(breaker_state(&proxy, "upstream").await, Some(0.0));

    let addr = proxy.base.strip_prefix("http://").unwrap();
    for n in 0..2 * FAULTY {
        let (method, path) = route(n);
        let answer = raw(addr, &request(method, &path), then).await;
        match (expected, answer) {
            (None, _) => {}
            (Some((status, code)), Some((got, body))) => {
                assert_eq!(got, status, "{method} {path}: {body}");
                let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
                assert_eq!(problem["code"], code, "{body}");
            }
            (Some(_), None) => panic!("{method} {path}: no answer"),
        }
    }
    assert_eq!(
        breaker_state(&proxy, "upstream").await,
        Some(0.0),
        "the caller's faults left the upstream's breaker closed"
    );
    assert_eq!(
        limit(&proxy).await,
        before,
        "and the admission limit as it was"
    );

    let other = client();
    for n in 0..WELL_FORMED {
        let (method, path) = route(n);
        let answer = call(
            other
                .request(method.parse().unwrap(), format!("{}{path}", proxy.base))
                .header("content-type", "application/json")
                .body("{}"),
        )
        .await;
        assert!(
            matches!(answer.status, 200 | 201),
            "{method} {path}: {} {}",
            answer.status,
            answer.text()
        );
    }
    assert_eq!(breaker_state(&proxy, "upstream").await, Some(0.0));
    assert_eq!(limit(&proxy).await, before);
}

/// A head for `method` `path` with `headers`, then `body`.
fn head(method: &str, path: &str, headers: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n{headers}\r\n"
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

#[tokio::test]
async fn a_malformed_chunk_size_is_a_400_and_not_the_upstreams_failure() {
    let request =
        |method: &str, path: &str| head(method, path, "transfer-encoding: chunked\r\n", b"-4\r\n");
    faults_leave_the_upstream_healthy(
        &[],
        request,
        Then::Wait,
        Some((400, "request_body_invalid")),
    )
    .await;
}

#[tokio::test]
async fn a_body_cut_short_then_half_closed_is_a_400_and_not_the_upstreams_failure() {
    let request =
        |method: &str, path: &str| head(method, path, "content-length: 100\r\n", b"{\"a\":12345");
    faults_leave_the_upstream_healthy(
        &[],
        request,
        Then::HalfClose,
        Some((400, "request_body_invalid")),
    )
    .await;
}

#[tokio::test]
async fn a_body_reset_midway_gets_no_answer_and_is_not_the_upstreams_failure() {
    let request =
        |method: &str, path: &str| head(method, path, "content-length: 100\r\n", b"{\"a\":12345");
    faults_leave_the_upstream_healthy(&[], request, Then::Reset, None).await;
}

#[tokio::test]
async fn a_body_too_slow_for_its_deadline_is_a_408_and_not_the_upstreams_failure() {
    // The body's first bytes, and then nothing: the request's own deadline passes while the
    // proxy still waits for the rest from the caller.
    let request = |method: &str, path: &str| {
        head(
            method,
            path,
            "content-length: 100\r\ngrpc-timeout: 200m\r\n",
            b"{\"a\":12345",
        )
    };
    faults_leave_the_upstream_healthy(
        &[],
        request,
        Then::Wait,
        Some((408, "request_body_timeout")),
    )
    .await;
}

#[tokio::test]
async fn a_keyed_body_over_the_size_limit_is_a_413_and_not_the_upstreams_failure() {
    // Chunked, so that the size is only known once read: past the keyed routes' 1 MiB.
    let chunk = vec![b' '; 64 * 1024];
    let request = |_: &str, _: &str| {
        let mut body = Vec::new();
        for _ in 0..17 {
            body.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
            body.extend_from_slice(&chunk);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(b"0\r\n\r\n");
        head(
            "POST",
            "/v1/charges",
            "transfer-encoding: chunked\r\nidempotency-key: too-large\r\n",
            &body,
        )
    };
    faults_leave_the_upstream_healthy(&[], request, Then::Wait, Some((413, "body_too_large")))
        .await;
}
