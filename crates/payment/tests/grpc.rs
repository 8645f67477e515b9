//! The gRPC service end to end: a real service on 127.0.0.1:0 behind the same server stack as
//! HTTP, a real PSP, a tonic client (and a raw HTTP/2 client for the frame bomb). Each status
//! of the README's mapping table has its test.

mod support;

use std::sync::Arc;
use std::time::Duration;

use backstop_payment::grpc::proto::payment_client::PaymentClient;
use backstop_payment::grpc::proto::{ChargeRequest, ChargeResponse, GetChargeRequest};
use backstop_payment::psp::Fault;
use support::Harness;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

async fn client(h: &Harness) -> PaymentClient<Channel> {
    PaymentClient::connect(format!("http://{}", h.server.grpc_addr()))
        .await
        .expect("gRPC channel connects")
}

fn charge_request(order: &str, amount: i64, key: Option<&str>) -> Request<ChargeRequest> {
    let mut request = Request::new(ChargeRequest {
        order_id: order.to_owned(),
        amount_cents: amount,
        currency: String::new(),
    });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    request
}

async fn charge(
    h: &Harness,
    order: &str,
    amount: i64,
    key: Option<&str>,
    timeout: Duration,
) -> Result<Response<ChargeResponse>, Status> {
    let mut request = charge_request(order, amount, key);
    request.set_timeout(timeout);
    client(h).await.charge(request).await
}

fn pushback_ms(status: &Status) -> Option<u64> {
    status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Waits (without sleeping) until the service has claimed `n` idempotency keys.
async fn until_claimed(h: &Harness, n: u64) {
    while h.idempotency_rows().await < n {
        tokio::task::yield_now().await;
    }
}

const FIVE_S: Duration = Duration::from_secs(5);

#[tokio::test]
async fn charge_then_replay_byte_for_byte_with_replayed_metadata() {
    let h = Harness::start().await;
    let first = charge(&h, "g-order-1", 1999, Some("g-key-1"), FIVE_S)
        .await
        .expect("charged");
    assert!(first.metadata().get("idempotent-replayed").is_none());
    let first = first.into_inner();
    assert_eq!(first.status, "succeeded");
    assert_eq!(first.amount_cents, 1999);
    assert!(!first.charge_id.is_empty());

    // The replay comes from the idempotency store, trailers (grpc-status 0) included: the
    // tonic client would report a protocol error otherwise.
    let again = charge(&h, "g-order-1", 1999, Some("g-key-1"), FIVE_S)
        .await
        .expect("replayed");
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(again.into_inner(), first);
    assert_eq!(h.charges("g-order-1").await.len(), 1, "charged once");

    let got = client(&h)
        .await
        .get_charge(GetChargeRequest {
            intent_id: first.intent_id.clone(),
        })
        .await
        .expect("found")
        .into_inner();
    assert_eq!(got, first);
}

#[tokio::test]
async fn missing_or_invalid_key_and_bad_fields_are_invalid_argument() {
    let h = Harness::start().await;
    let missing = charge(&h, "g-o", 100, None, FIVE_S).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert!(missing.message().contains("Idempotency-Key"), "{missing:?}");

    let long = "k".repeat(256);
    let invalid = charge(&h, "g-o", 100, Some(&long), FIVE_S)
        .await
        .unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument, "{invalid:?}");

    for (order, amount, currency, field) in [
        ("", 100, "", "invalid_order_id"),
        ("g-o", 0, "", "invalid_amount"),
        ("g-o", 100, "usd", "invalid_currency"),
    ] {
        let mut request = charge_request(order, amount, Some(&format!("g-bad-{field}")));
        request.get_mut().currency = currency.to_owned();
        let status = client(&h).await.charge(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().starts_with(field), "{status:?}");
    }
    assert_eq!(h.intent_count().await, 0, "nothing was written");
    // A client mistake releases the key: the corrected request runs under it.
    let fixed = charge(&h, "g-o", 100, Some("g-bad-invalid_amount"), FIVE_S).await;
    assert_eq!(fixed.expect("runs").into_inner().status, "succeeded");
}

#[tokio::test]
async fn key_reused_with_other_parameters_is_failed_precondition() {
    let h = Harness::start().await;
    charge(&h, "g-order-r", 100, Some("g-key-r"), FIVE_S)
        .await
        .expect("charged");
    let reused = charge(&h, "g-order-r", 200, Some("g-key-r"), FIVE_S)
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");
    assert!(
        reused.message().contains("fingerprint_prefix="),
        "{reused:?}"
    );
    assert_eq!(h.charges("g-order-r").await.len(), 1);
}

#[tokio::test]
async fn same_order_other_key_is_already_exists() {
    let h = Harness::start().await;
    let first = charge(&h, "g-order-c", 100, Some("g-key-c1"), FIVE_S)
        .await
        .expect("charged")
        .into_inner();
    let other = charge(&h, "g-order-c", 100, Some("g-key-c2"), FIVE_S)
        .await
        .unwrap_err();
    assert_eq!(other.code(), Code::AlreadyExists, "{other:?}");
    assert!(other.message().contains(&first.intent_id), "{other:?}");
    assert_eq!(h.charges("g-order-c").await.len(), 1);
}

#[tokio::test]
async fn same_key_in_progress_past_the_budget_is_aborted_with_pushback() {
    let h = Arc::new(Harness::start().await);
    h.latency(Duration::from_millis(1500));
    let slow = {
        let h = Arc::clone(&h);
        tokio::spawn(async move { charge(&h, "g-order-p", 100, Some("g-key-p"), FIVE_S).await })
    };
    until_claimed(&h, 1).await;
    // It would wait for the running call's answer, but its own deadline ends first.
    let busy = charge(
        &h,
        "g-order-p",
        100,
        Some("g-key-p"),
        Duration::from_millis(300),
    )
    .await
    .unwrap_err();
    assert_eq!(busy.code(), Code::Aborted, "{busy:?}");
    assert!(pushback_ms(&busy).is_some_and(|ms| ms >= 1), "{busy:?}");
    let slow = slow.await.unwrap().expect("the first attempt finishes");
    assert_eq!(slow.into_inner().status, "succeeded");
    assert_eq!(h.charges("g-order-p").await.len(), 1);
}

#[tokio::test]
async fn tenant_over_quota_is_resource_exhausted_with_pushback() {
    let h = Harness::start_with(|c| {
        c.tenant_rate = std::num::NonZeroU32::new(1).unwrap();
        c.tenant_burst = std::num::NonZeroU32::new(1).unwrap();
    })
    .await;
    charge(&h, "g-order-q1", 100, Some("g-q1"), FIVE_S)
        .await
        .expect("within quota");
    let over = charge(&h, "g-order-q2", 100, Some("g-q2"), FIVE_S)
        .await
        .unwrap_err();
    assert_eq!(over.code(), Code::ResourceExhausted, "{over:?}");
    assert!(pushback_ms(&over).is_some_and(|ms| ms >= 1), "{over:?}");
    assert!(h.charges("g-order-q2").await.is_empty());
}

#[tokio::test]
async fn overload_is_unavailable_with_pushback_and_http_shares_the_gate() {
    let h = Arc::new(Harness::start_with(|c| c.max_inflight = 1).await);
    h.latency(Duration::from_millis(1500));
    // The one slot is taken by an HTTP request: the gate is the same for both protocols.
    let slow = {
        let h = Arc::clone(&h);
        tokio::spawn(async move {
            h.post(
                Some("g-slow"),
                &support::body("g-order-slow", 100),
                &[("grpc-timeout", "10S")],
            )
            .await
        })
    };
    until_claimed(&h, 1).await;
    let mut request = charge_request("g-order-fast", 100, Some("g-fast"));
    request.set_timeout(Duration::from_millis(200));
    let refused = client(&h).await.charge(request).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        pushback_ms(&refused).is_some_and(|ms| ms >= 1),
        "{refused:?}"
    );
    assert!(h.charges("g-order-fast").await.is_empty());
    assert_eq!(slow.await.unwrap().status, 201);
    // The refused key was never used: it runs now.
    h.latency(Duration::ZERO);
    let later = charge(&h, "g-order-fast", 100, Some("g-fast"), FIVE_S).await;
    assert_eq!(later.expect("runs").into_inner().status, "succeeded");
}

#[tokio::test]
async fn unknown_psp_outcome_is_unavailable_and_the_same_key_charges_once() {
    let h = Harness::start().await;
    h.script(&[Fault::CommitThenTimeout]);
    let unknown = charge(
        &h,
        "g-order-u",
        990,
        Some("g-key-u"),
        // Well above the harness's margin: on a loaded machine the service's answer still
        // beats the client's own timer.
        Duration::from_secs(3),
    )
    .await
    .unwrap_err();
    assert_eq!(unknown.code(), Code::Unavailable, "{unknown:?}");
    assert!(
        unknown.message().contains("outcome unknown")
            && unknown.message().contains("same idempotency-key is safe"),
        "{unknown:?}"
    );
    let charged = h.charges("g-order-u").await;
    assert_eq!(charged.len(), 1, "the PSP did charge");
    // The PSP was given what was left of the caller's 3 s, minus the margin: never a new
    // budget, so it could not still be working once the caller had given up.
    let budget = charged[0].budget_ms.expect("the PSP saw a grpc-timeout");
    assert!(budget > 0 && budget < 3000, "the PSP's budget: {budget} ms");
    let retry = charge(&h, "g-order-u", 990, Some("g-key-u"), FIVE_S)
        .await
        .expect("the retry converges")
        .into_inner();
    assert_eq!(retry.status, "succeeded");
    let charges = h.charges("g-order-u").await;
    assert_eq!(charges.len(), 1, "charged exactly once");
    assert_eq!(retry.charge_id, charges[0].charge_id);
    assert_eq!(charges[0].effect_key, retry.intent_id);
}

/// A PSP slower than the caller's deadline: the service gives up on it before that deadline
/// and says so, so the caller gets the service's answer (the outcome is unknown, the same key
/// is safe), never its own client-side timeout (tonic's `CANCELLED`). The PSP started nothing
/// it could not finish; once it is back, the same key charges exactly once.
#[tokio::test]
async fn psp_slower_than_the_deadline_is_unknown_never_cancelled_and_the_key_charges_once() {
    let h = Harness::start().await;
    h.latency(Duration::from_secs(60));
    let unknown = charge(
        &h,
        "g-order-s",
        700,
        Some("g-key-s"),
        Duration::from_secs(1),
    )
    .await
    .unwrap_err();
    assert_ne!(unknown.code(), Code::Cancelled, "{unknown:?}");
    // UNAVAILABLE with pushback: "outcome unknown" when the attempt was cut before the PSP's
    // answer, "charged nothing" when the PSP's 504 (which charges nothing) came back first.
    assert_eq!(unknown.code(), Code::Unavailable, "{unknown:?}");
    assert!(pushback_ms(&unknown).is_some(), "{unknown:?}");
    let message = unknown.message();
    assert!(
        (message.contains("outcome unknown") || message.contains("charged nothing"))
            && message.contains("same idempotency-key"),
        "{unknown:?}"
    );
    let intent_id = message
        .split_once("intent_id=")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(id, _)| id.to_owned())
        .expect("the message names the intent");
    assert!(
        h.charges("g-order-s").await.is_empty(),
        "the PSP charged nothing past its deadline"
    );

    h.latency(Duration::ZERO);
    let retry = charge(&h, "g-order-s", 700, Some("g-key-s"), FIVE_S)
        .await
        .expect("the same key goes through once the PSP is back")
        .into_inner();
    assert_eq!(retry.status, "succeeded");
    assert_eq!(
        retry.intent_id, intent_id,
        "the same payment, not a new one"
    );
    let charges = h.charges("g-order-s").await;
    assert_eq!(charges.len(), 1, "charged exactly once");
    assert_eq!(charges[0].charge_id, retry.charge_id);
    assert_eq!(charges[0].effect_key, intent_id);
    let budget = charges[0].budget_ms.expect("the PSP saw a grpc-timeout");
    assert!(budget > 0 && budget < 5000, "the PSP's budget: {budget} ms");
}

#[tokio::test]
async fn grpc_timeout_is_the_deadline_the_psp_sees_reduced() {
    let h = Harness::start().await;
    charge(
        &h,
        "g-order-d",
        100,
        Some("g-key-d"),
        Duration::from_secs(3),
    )
    .await
    .expect("charged");
    let charges = h.charges("g-order-d").await;
    let budget = charges[0].budget_ms.expect("the PSP saw a grpc-timeout");
    assert!(
        budget < 3000 && budget > 0,
        "the PSP's budget ({budget} ms) is what is left of the caller's 3 s, never a reset"
    );
}

#[tokio::test]
async fn get_charge_of_an_unknown_intent_is_not_found() {
    let h = Harness::start().await;
    let status = client(&h)
        .await
        .get_charge(GetChargeRequest {
            intent_id: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
}

#[tokio::test]
async fn unknown_bearer_key_is_unauthenticated() {
    use backstop_payment::config::ApiKey;
    let h = Harness::start_with(|c| {
        c.api_keys = vec![ApiKey::parse("acme=key-acme-0001").unwrap()];
    })
    .await;
    let mut request = charge_request("g-order-a", 100, Some("g-key-a"));
    request
        .metadata_mut()
        .insert("authorization", "Bearer wrong".parse().unwrap());
    let status = client(&h).await.charge(request).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");

    let mut request = charge_request("g-order-a", 100, Some("g-key-a"));
    request
        .metadata_mut()
        .insert("authorization", "Bearer key-acme-0001".parse().unwrap());
    let ok = client(&h).await.charge(request).await.expect("authorized");
    assert_eq!(ok.into_inner().status, "succeeded");
}

// ---- the frame bomb: a raw HTTP/2 client sends a 5-byte prefix claiming 4 GiB ----

mod raw {
    use std::convert::Infallible;

    use bytes::Bytes;
    use futures_util::StreamExt;
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    use hyper_util::rt::{TokioExecutor, TokioIo};

    /// Sends `prefix` as the request body, keeping the stream open when `keep_open`; returns
    /// the response head (a trailers-only gRPC answer carries its status there).
    pub(super) async fn send(
        addr: std::net::SocketAddr,
        path: &str,
        prefix: &'static [u8],
        keep_open: bool,
    ) -> http::Response<hyper::body::Incoming> {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(conn);
        let data = futures_util::stream::once(async move {
            Ok::<_, Infallible>(Frame::data(Bytes::from_static(prefix)))
        });
        let stream = if keep_open {
            data.chain(futures_util::stream::pending()).boxed()
        } else {
            data.boxed()
        };
        let request = http::Request::post(format!("http://{addr}{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("idempotency-key", "bomb-key")
            .header("grpc-timeout", "30S")
            .body(BodyExt::boxed_unsync(StreamBody::new(stream)))
            .unwrap();
        sender.send_request(request).await.unwrap()
    }

    /// Resident set size of this process, in KiB (Linux).
    pub(super) fn rss_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }
}

#[tokio::test]
async fn frame_claiming_4_gib_is_resource_exhausted_without_allocating() {
    let h = Harness::start().await;
    let addr = h.server.grpc_addr();
    let before = raw::rss_kib();
    for path in [
        "/payment.v1.Payment/Charge",
        "/payment.v1.Payment/GetCharge",
    ] {
        // The body never ends: only an answer decided from the prefix can come back (the
        // 30 s deadline is far beyond any test timeout, so a timeout cannot pass this test).
        let response = raw::send(addr, path, &[0, 0xFF, 0xFF, 0xFF, 0xFF], true).await;
        assert_eq!(response.status(), 200, "{path}");
        let headers = response.headers();
        assert_eq!(headers["grpc-status"], "8", "{path}: {headers:?}");
        let message = headers["grpc-message"].to_str().unwrap();
        assert!(message.contains("4294967295"), "{path}: {message}");
    }
    let grown_kib = raw::rss_kib().saturating_sub(before);
    assert!(
        grown_kib < 64 * 1024,
        "memory grew by {grown_kib} KiB for two 4 GiB claims"
    );
    assert_eq!(h.intent_count().await, 0);
    assert_eq!(h.idempotency_rows().await, 0, "the key was never claimed");
    // The service still answers.
    let ok = charge(&h, "g-order-b", 100, Some("g-key-b"), FIVE_S).await;
    assert_eq!(ok.expect("served").into_inner().status, "succeeded");
}

#[tokio::test]
async fn unknown_method_is_unimplemented() {
    let h = Harness::start().await;
    let addr = h.server.grpc_addr();
    let response = raw::send(addr, "/payment.v1.Payment/Refund", &[0, 0, 0, 0, 0], false).await;
    assert_eq!(response.headers()["grpc-status"], "12");
    let response = raw::send(addr, "/other.Service/Call", &[0, 0, 0, 0, 0], false).await;
    assert_eq!(response.headers()["grpc-status"], "12");
}

#[tokio::test]
async fn grpc_calls_are_counted_by_their_status_code() {
    let h = Harness::start().await;
    charge(&h, "g-order-m", 100, Some("g-key-m"), FIVE_S)
        .await
        .expect("charged");
    let reused = charge(&h, "g-order-m", 101, Some("g-key-m"), FIVE_S)
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition);
    let metrics = h.get("/metrics", &[]).await;
    let text = String::from_utf8_lossy(&metrics.bytes);
    let counted = |outcome: &str| {
        text.lines().any(|l| {
            l.starts_with("rpc_server_requests_total")
                && l.contains(r#"method="POST /payment.v1.Payment/Charge""#)
                && l.contains(&format!(r#"outcome="{outcome}""#))
        })
    };
    assert!(counted("ok"), "{text}");
    // A trailers-only error is counted by its grpc-status, not by HTTP 200.
    assert!(counted("fatal"), "{text}");
}

#[tokio::test]
async fn undecodable_charge_is_invalid_argument_and_leaves_the_key_unused() {
    let h = Harness::start().await;
    // One 4-byte message: field 1 (order_id, a string) sent as a varint, then a truncated
    // field 2.
    const JUNK: &[u8] = &[0, 0, 0, 0, 4, 0x08, 0x96, 0x01, 0x12];
    let response = raw::send(
        h.server.grpc_addr(),
        "/payment.v1.Payment/Charge",
        JUNK,
        false,
    )
    .await;
    let (head, body) = response.into_parts();
    let trailers = http_body_util::BodyExt::collect(body)
        .await
        .unwrap()
        .trailers()
        .cloned()
        .unwrap_or_default();
    let status = head
        .headers
        .get("grpc-status")
        .or_else(|| trailers.get("grpc-status"))
        .expect("a grpc-status");
    assert_eq!(status, "3", "{head:?} {trailers:?}");
    assert_eq!(h.intent_count().await, 0);
    assert_eq!(h.idempotency_rows().await, 0, "the key was left unused");
    // The same key with a valid message is served, not refused as reused.
    let ok = charge(&h, "g-junk", 100, Some("bomb-key"), FIVE_S).await;
    assert_eq!(ok.expect("served").into_inner().status, "succeeded");
}
