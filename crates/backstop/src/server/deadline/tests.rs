use crate::deadline::GRPC_TIMEOUT;
use std::convert::Infallible;
use std::future::pending;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use tokio::time::{Instant, advance, sleep};
use tower::{ServiceExt, service_fn};
use tower_layer::Layer;

use super::*;
use crate::server::testing::flat;

fn request(timeout: Option<&str>) -> Request<Bytes> {
    let mut builder = Request::builder().uri("/v1/payments");
    if let Some(t) = timeout {
        builder = builder.header(&GRPC_TIMEOUT_HEADER, t);
    }
    builder.body(Bytes::new()).unwrap()
}

/// Answers with the remaining budget it saw, in milliseconds.
async fn report_budget(req: Request<Bytes>) -> Result<Response<Bytes>, Infallible> {
    let deadline = req.extensions().get::<Deadline>().expect("deadline set");
    let ms = deadline.remaining().as_millis().to_string();
    Ok(Response::new(Bytes::from(ms)))
}

fn problem_code(res: &Response<Bytes>) -> String {
    let doc: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
    doc["code"].as_str().unwrap().to_owned()
}

#[tokio::test(start_paused = true)]
async fn header_becomes_a_deadline_extension() {
    let svc = DeadlineLayer::default().layer(service_fn(report_budget));
    let res = flat(svc.oneshot(request(Some("250m"))).await.unwrap());
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.body(), "250");
}

#[tokio::test(start_paused = true)]
async fn absent_header_gets_the_default_timeout() {
    let svc = DeadlineLayer::new(Duration::from_secs(3)).layer(service_fn(report_budget));
    let res = flat(svc.oneshot(request(None)).await.unwrap());
    assert_eq!(res.body(), "3000");
}

#[tokio::test(start_paused = true)]
async fn timeout_is_clamped_to_the_maximum() {
    let layer = DeadlineLayer::new(Duration::from_secs(120)).max(Duration::from_secs(30));
    assert_eq!(layer.default_timeout(), Duration::from_secs(30));
    let res = flat(
        layer
            .layer(service_fn(report_budget))
            .oneshot(request(Some("5H")))
            .await
            .unwrap(),
    );
    assert_eq!(res.body(), "30000");
}

#[tokio::test(start_paused = true)]
async fn malformed_or_nine_digit_grpc_timeout_is_400() {
    let called = Arc::new(AtomicUsize::new(0));
    for bad in [
        "",
        "abc",
        "10",
        "m",
        "0m",
        "-5m",
        "1.5S",
        "123456789m",
        "5x",
        "5 m",
    ] {
        let called = called.clone();
        let svc = DeadlineLayer::default().layer(service_fn(move |req| {
            called.fetch_add(1, Ordering::SeqCst);
            report_budget(req)
        }));
        let res = flat(svc.oneshot(request(Some(bad))).await.unwrap());
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{bad:?}");
        assert_eq!(problem_code(&res), "invalid_grpc_timeout", "{bad:?}");
        assert_eq!(
            res.headers()["content-type"],
            "application/problem+json",
            "{bad:?}"
        );
    }
    assert_eq!(
        called.load(Ordering::SeqCst),
        0,
        "bad requests never reach the service"
    );
}

#[tokio::test(start_paused = true)]
async fn non_ascii_header_is_400() {
    let svc = DeadlineLayer::default().layer(service_fn(report_budget));
    let mut req = request(None);
    req.headers_mut().insert(
        GRPC_TIMEOUT,
        http::HeaderValue::from_bytes(b"5\xffm").unwrap(),
    );
    let res = flat(svc.oneshot(req).await.unwrap());
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
}

fn flag_dropped(flag: &AtomicBool) -> bool {
    flag.load(Ordering::SeqCst)
}

/// Sets a flag when dropped: proves the inner future was cut.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[tokio::test(start_paused = true)]
async fn passed_deadline_is_504_never_408_or_499() {
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = dropped.clone();
    let svc = DeadlineLayer::default().layer(service_fn(move |_req: Request<Bytes>| {
        let guard = DropFlag(flag.clone());
        async move {
            let _guard = guard;
            pending::<()>().await;
            Ok::<_, Infallible>(Response::new(Bytes::new()))
        }
    }));
    let start = Instant::now();
    let mut fut = Box::pin(svc.oneshot(request(Some("100m"))));
    let res = loop {
        tokio::select! {
            res = &mut fut => break flat(res.unwrap()),
            () = sleep(Duration::from_millis(10)) => {
                assert!(!flag_dropped(&dropped), "not cut before the deadline");
            }
        }
    };
    // Cut before the answer is handed back, not when the caller drops the future.
    assert!(flag_dropped(&dropped));
    drop(fut);
    assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(problem_code(&res), "deadline_exceeded");
    assert_eq!(start.elapsed(), Duration::from_millis(100));
}

#[tokio::test(start_paused = true)]
async fn answer_before_the_deadline_passes_through() {
    let svc = DeadlineLayer::default().layer(service_fn(|_req: Request<Bytes>| async {
        sleep(Duration::from_millis(99)).await;
        Ok::<_, Infallible>(Response::new(Bytes::from_static(b"done")))
    }));
    let res = flat(svc.oneshot(request(Some("100m"))).await.unwrap());
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.body(), "done");
}

#[tokio::test(start_paused = true)]
async fn deadline_starts_when_the_request_arrives_not_when_polled() {
    let mut svc = DeadlineLayer::default().layer(service_fn(report_budget));
    let svc = svc.ready().await.unwrap();
    let fut = svc.call(request(Some("1S")));
    // The response future sits unpolled (queued behind other work) for 300 ms.
    advance(Duration::from_millis(300)).await;
    let res = flat(fut.await.unwrap());
    assert_eq!(res.body(), "700");
}

#[test]
fn an_answer_ready_at_once_never_arms_the_timer() {
    // No time driver: arming the deadline's timer would panic.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let svc = DeadlineLayer::default().layer(service_fn(|_req: Request<Bytes>| async {
        Ok::<_, Infallible>(Response::new(Bytes::new()))
    }));
    let res = runtime.block_on(svc.oneshot(request(Some("1S")))).unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

fn grpc_request(timeout: &str) -> Request<Bytes> {
    Request::builder()
        .uri("/payment.v1.Payment/Charge")
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(GRPC_TIMEOUT, timeout)
        .body(Bytes::new())
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn grpc_request_past_its_deadline_gets_deadline_exceeded_trailers_only() {
    let svc = DeadlineLayer::default().layer(service_fn(|_req: Request<Bytes>| async {
        pending::<Result<Response<Bytes>, Infallible>>().await
    }));
    let res = flat(svc.oneshot(grpc_request("100m")).await.unwrap());
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.body().is_empty());
    assert_eq!(res.headers()["content-type"], "application/grpc");
    assert_eq!(res.headers()["grpc-status"], "4"); // DEADLINE_EXCEEDED
}

#[tokio::test(start_paused = true)]
async fn grpc_request_with_malformed_timeout_is_invalid_argument() {
    let svc = DeadlineLayer::default().layer(service_fn(report_budget));
    let res = flat(svc.oneshot(grpc_request("soon")).await.unwrap());
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["grpc-status"], "3"); // INVALID_ARGUMENT
    assert!(
        res.headers()["grpc-message"]
            .to_str()
            .unwrap()
            .contains("grpc-timeout")
    );
}

#[tokio::test(start_paused = true)]
async fn absent_header_gets_the_methods_timeout_from_the_policies() {
    use crate::policy::{Idempotency, MethodPolicies, MethodPolicy};
    let quick = MethodPolicy::builder("Quick", Idempotency::Safe)
        .timeout(Duration::from_millis(1500))
        .build();
    let slow = MethodPolicy::builder("Slow", Idempotency::Safe)
        .timeout(Duration::from_secs(90))
        .build();
    let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .method("/v1/payments", quick)
        .method("/v1/reports", slow);
    let layer = DeadlineLayer::new(Duration::from_secs(3))
        .max(Duration::from_secs(60))
        .policies(policies);
    let svc = layer.layer(service_fn(report_budget));
    let budget = |path: &'static str, timeout: Option<&'static str>| {
        let svc = svc.clone();
        async move {
            let mut req = request(timeout);
            *req.uri_mut() = http::Uri::from_static(path);
            flat(svc.oneshot(req).await.unwrap()).into_body()
        }
    };
    // The method's own budget, not the layer's 3 s...
    assert_eq!(budget("/v1/payments", None).await, "1500");
    // ...clamped by the layer's maximum...
    assert_eq!(budget("/v1/reports", None).await, "60000");
    // ...the fallback policy's (the one default) for a method the table does not name...
    assert_eq!(budget("/v1/other", None).await, "10000");
    // ...and never over what the caller sent.
    assert_eq!(budget("/v1/payments", Some("250m")).await, "250");
}

/// The handler runs under the request's deadline, keyed or not, and across its awaits: a
/// client call deep inside it finds the budget without being handed it.
#[tokio::test(start_paused = true)]
async fn the_handler_runs_under_the_requests_deadline() {
    let svc = DeadlineLayer::default().layer(service_fn(|req: Request<Bytes>| async move {
        let set = *req.extensions().get::<Deadline>().unwrap();
        sleep(Duration::from_millis(40)).await;
        assert_eq!(Deadline::current(), Some(set));
        let ms = Deadline::current().unwrap().remaining().as_millis();
        Ok::<_, Infallible>(Response::new(Bytes::from(ms.to_string())))
    }));
    let res = flat(svc.oneshot(request(Some("250m"))).await.unwrap());
    assert_eq!(res.body(), "210");
    assert_eq!(Deadline::current(), None, "the scope ends with the request");
}

/// Every answer, a 504 too, says how long the server held the request, unless turned off.
#[tokio::test(start_paused = true)]
async fn answers_say_how_long_the_server_held_them() {
    use crate::deadline::server_timing::{SERVER_TIMING, from_headers};
    let slow = || {
        service_fn(|_: Request<Bytes>| async {
            sleep(Duration::from_millis(30)).await;
            let mut res = Response::new(Bytes::new());
            // The handler's own metric is kept; a relayed `backstop` entry is replaced.
            res.headers_mut()
                .append(&SERVER_TIMING, "db;dur=12".parse().unwrap());
            res.headers_mut()
                .append(&SERVER_TIMING, "backstop;dur=9000".parse().unwrap());
            Ok::<_, Infallible>(res)
        })
    };
    let res = flat(
        DeadlineLayer::default()
            .layer(slow())
            .oneshot(request(None))
            .await
            .unwrap(),
    );
    assert_eq!(from_headers(res.headers()), Some(Duration::from_millis(30)));
    let values: Vec<_> = res.headers().get_all(&SERVER_TIMING).iter().collect();
    assert_eq!(values.len(), 2);
    assert_eq!(values[0], "db;dur=12");

    let late = flat(
        DeadlineLayer::default()
            .layer(slow())
            .oneshot(request(Some("10m")))
            .await
            .unwrap(),
    );
    assert_eq!(late.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(
        from_headers(late.headers()),
        Some(Duration::from_millis(10))
    );

    let off = DeadlineLayer::default().server_timing(false).layer(slow());
    let res = flat(off.oneshot(request(None)).await.unwrap());
    assert_eq!(from_headers(res.headers()), None);
    let values: Vec<_> = res.headers().get_all(&SERVER_TIMING).iter().collect();
    assert_eq!(values, ["db;dur=12"]);
}
