//! The listeners: one protocol per port, HTTP/2 on the HTTP port, and shutdown that stops both
//! ports at once and releases the keys of the calls it cuts.

mod support;

use std::time::Duration;

use backstop_payment::psp::Fault;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use reqwest::StatusCode;
use support::{Harness, answer, body};
use tokio::net::TcpStream;

#[tokio::test]
async fn grpc_content_type_on_the_http_port_is_refused_with_415_problem_json() {
    let h = Harness::start().await;
    let r = h
        .http
        .post(format!("{}/v1/payments", h.base))
        .header("content-type", "application/grpc")
        .header("idempotency-key", "grpc-on-http")
        .body(body("order-grpc-on-http", 100))
        .send()
        .await
        .unwrap();
    let a = answer(r).await;
    assert_eq!(a.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{:?}", a.json);
    assert_eq!(a.header("content-type"), Some("application/problem+json"));
    assert_eq!(a.code(), "grpc_on_http_port");
    assert!(a.header("grpc-status").is_none());
    // Also when it hides behind a JSON Content-Type.
    let a = h
        .post(
            Some("grpc-on-http"),
            &body("order-grpc-on-http", 100),
            &[("content-type", "application/grpc")],
        )
        .await;
    assert_eq!(a.code(), "grpc_on_http_port");
    assert_eq!(h.intent_count().await, 0, "nothing was written");
    assert_eq!(h.idempotency_rows().await, 0, "the key is unused");
}

#[tokio::test]
async fn http1_json_on_the_grpc_port_is_refused_with_415_problem_json() {
    let h = Harness::start().await;
    let grpc = h.server.grpc_addr();
    for content_type in ["application/json", "application/grpc"] {
        let r = h
            .http
            .post(format!("http://{grpc}/payment.v1.Payment/Charge"))
            .header("content-type", content_type)
            .header("idempotency-key", "json-on-grpc")
            .body(body("order-json-on-grpc", 100))
            .send()
            .await
            .expect("an HTTP/1.1 answer");
        let a = answer(r).await;
        assert_eq!(
            a.status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "{content_type}"
        );
        assert_eq!(a.header("content-type"), Some("application/problem+json"));
        assert_eq!(a.code(), "grpc_required");
        assert!(a.header("grpc-status").is_none());
    }
    assert_eq!(h.idempotency_rows().await, 0, "the key is unused");
}

#[tokio::test]
async fn h2c_prior_knowledge_on_the_http_port_is_answered() {
    let h = Harness::start().await;
    let stream = TcpStream::connect(h.server.local_addr()).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("the HTTP port speaks HTTP/2 with prior knowledge");
    tokio::spawn(conn);
    let request = http::Request::get(format!("{}/healthz", h.base))
        .body(Empty::<bytes::Bytes>::new())
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(30), send.send_request(request))
        .await
        .expect("answered, not hung")
        .expect("an HTTP/2 answer");
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), http::Version::HTTP_2);
    response.into_body().collect().await.unwrap();
}

#[tokio::test]
async fn shutdown_stops_both_ports_at_once_and_a_call_cut_at_the_bound_releases_its_key() {
    let Harness {
        psp,
        server,
        http,
        base,
        dir: _dir,
    } = Harness::start_with(|c| c.drain_timeout = Duration::from_secs(3)).await;
    let grpc = server.grpc_addr();
    let intents = server.intents().clone();
    // The PSP commits, then holds its answer well past the drain bound.
    psp.faults().script([Fault::CommitThenTimeout]).unwrap();
    let held = tokio::spawn(async move {
        http.post(format!("{base}/v1/payments"))
            .header("idempotency-key", "cut-at-drain")
            .header("grpc-timeout", "60S")
            .body(body("order-cut", 100))
            .send()
            .await
    });
    let reference = backstop_payment::psp_client::psp_reference(
        backstop_payment::config::DEFAULT_MERCHANT,
        "order-cut",
    );
    // Bounded, so a charge that never comes fails the test instead of hanging it.
    tokio::time::timeout(Duration::from_secs(60), async {
        while psp
            .store()
            .list(Some(reference.clone()))
            .await
            .unwrap()
            .is_empty()
        {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the PSP was charged");
    let stopping = tokio::spawn(server.shutdown());
    // The gRPC port closes at once, while the HTTP call is still being drained.
    while TcpStream::connect(grpc).await.is_ok() {
        tokio::task::yield_now().await;
    }
    assert!(
        !held.is_finished(),
        "the gRPC port waited for the HTTP drain"
    );
    stopping.await.unwrap().expect("a clean stop");
    assert!(
        held.await.unwrap().is_err(),
        "the call was cut at the drain bound"
    );
    // Its key is not held for the lease: the release landed before shutdown returned.
    let status: String = intents
        .db()
        .expect("a SQLite store")
        .read(|c| {
            // Whichever time window holds the record.
            let tables: Vec<String> = c
                .prepare(
                    "SELECT name FROM sqlite_master WHERE type = 'table' \
                     AND name LIKE 'idempotency_window_%'",
                )?
                .query_map([], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            let union = tables
                .iter()
                .map(|t| format!("SELECT status FROM {t} WHERE key = 'cut-at-drain'"))
                .collect::<Vec<_>>()
                .join(" UNION ALL ");
            c.query_row(&union, [], |r| r.get(0))
        })
        .await
        .unwrap();
    assert_ne!(status, "running", "the cut call still holds its key");
}
