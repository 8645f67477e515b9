use std::convert::Infallible;
use std::future::pending;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use tokio::time::sleep;
use tower::{ServiceExt, service_fn};
use tower_layer::Layer;

use super::*;
use crate::observe::*;
use crate::server::deadline::DeadlineLayer;
use crate::server::testing::{with_logs, with_metrics};

fn layer() -> MetricsLayer {
    MetricsLayer::new("payments")
        .route(Method::POST, "/v1/payments")
        .route(Method::GET, "/v1/payments/{id}")
}

fn request(method: Method, path: &str) -> Request<Bytes> {
    Request::builder()
        .method(method)
        .uri(path)
        .body(Bytes::new())
        .unwrap()
}

async fn answer(status: StatusCode) -> Response<Bytes> {
    let svc = layer().layer(service_fn(move |_req: Request<Bytes>| async move {
        sleep(Duration::from_millis(40)).await;
        let mut res = Response::new(Bytes::new());
        *res.status_mut() = status;
        Ok::<_, Infallible>(res)
    }));
    svc.oneshot(request(Method::POST, "/v1/payments"))
        .await
        .unwrap()
}

#[test]
fn counts_requests_by_route_and_outcome() {
    let cases = [
        (StatusCode::CREATED, "ok"),
        (StatusCode::SERVICE_UNAVAILABLE, "retryable"),
        (StatusCode::BAD_REQUEST, "fatal"),
        (StatusCode::INTERNAL_SERVER_ERROR, "fatal"),
        (StatusCode::GATEWAY_TIMEOUT, "timeout"),
        (StatusCode::TOO_MANY_REQUESTS, "rejected"),
    ];
    for (status, outcome) in cases {
        let (_, m) = with_metrics(|| answer(status));
        let labels = [
            ("service", "payments"),
            ("method", "POST /v1/payments"),
            ("outcome", outcome),
        ];
        assert_eq!(m.counter(RPC_SERVER_REQUESTS_TOTAL, &labels), 1, "{status}");
        assert_eq!(m.counter(RPC_SERVER_REQUESTS_TOTAL, &[]), 1, "{status}");
        assert_eq!(m.samples(RPC_SERVER_DURATION_SECONDS, &labels), 1);
        assert_eq!(
            m.gauge(RPC_SERVER_INFLIGHT, &[]),
            0.0,
            "inflight back to zero"
        );
    }
}

#[test]
fn rejected_marker_makes_a_503_rejected() {
    let (_, m) = with_metrics(|| async {
        let svc = layer().layer(service_fn(|_req: Request<Bytes>| async {
            let mut res = Response::new(Bytes::new());
            *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            res.extensions_mut().insert(Rejected("overloaded"));
            Ok::<_, Infallible>(res)
        }));
        svc.oneshot(request(Method::POST, "/v1/payments"))
            .await
            .unwrap()
    });
    assert_eq!(
        m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("outcome", "rejected")]),
        1
    );
}

#[test]
fn conflict_is_fatal_and_in_progress_is_retryable() {
    use crate::server::problem::Problem;
    use crate::status::{Code, Status};

    let count = |problem: Problem| {
        let (_, m) = with_metrics(|| async move {
            let svc = layer().layer(service_fn(move |_req: Request<Bytes>| {
                let problem = problem.clone();
                async move { Ok::<_, Infallible>(problem.into_http_response::<Bytes>()) }
            }));
            svc.oneshot(request(Method::POST, "/v1/payments"))
                .await
                .unwrap()
        });
        Outcome::ALL
            .map(Outcome::as_str)
            .into_iter()
            .find(|o| m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("outcome", *o)]) == 1)
            .unwrap()
    };
    // Both are HTTP 409; only the metrics layer's reading of the answer tells them apart.
    assert_eq!(
        count(Problem::new(StatusCode::CONFLICT, "order_conflict")),
        "fatal"
    );
    let in_progress = Status::new(Code::Aborted, "in progress")
        .with_problem("request_in_progress")
        .with_pushback(Duration::from_secs(1));
    assert_eq!(count(Problem::from_status(&in_progress)), "retryable");
}

#[test]
fn inflight_gauge_counts_running_requests() {
    let ((), m) = with_metrics(|| async {
        let svc = layer().layer(service_fn(|_req: Request<Bytes>| async {
            pending::<()>().await;
            Ok::<_, Infallible>(Response::new(Bytes::new()))
        }));
        let a = svc.clone().oneshot(request(Method::POST, "/v1/payments"));
        let b = svc.oneshot(request(Method::GET, "/v1/payments/pi_1"));
        let a = tokio::spawn(a);
        let b = tokio::spawn(b);
        tokio::task::yield_now().await;
        // Keep both running: the snapshot is taken after the runtime returns.
        std::mem::forget((a, b));
    });
    assert_eq!(m.gauge(RPC_SERVER_INFLIGHT, &[]), 2.0);
}

#[test]
fn route_names_never_carry_ids() {
    let ((), m) = with_metrics(|| async {
        let svc = layer().layer(service_fn(|req: Request<Bytes>| async move {
            // The layers below see the same labels.
            let route = req.extensions().get::<Route>().unwrap().clone();
            Ok::<_, Infallible>(Response::new(Bytes::from(route.method().to_owned())))
        }));
        for (method, path, label) in [
            (Method::GET, "/v1/payments/pi_1", "GET /v1/payments/{id}"),
            (Method::GET, "/v1/payments/pi_2", "GET /v1/payments/{id}"),
            (Method::GET, "/v1/payments/pi_2/x", "GET other"),
            (Method::DELETE, "/anything/key-123", "DELETE other"),
            (Method::from_bytes(b"BREW").unwrap(), "/pot", "OTHER other"),
        ] {
            let res = svc.clone().oneshot(request(method, path)).await.unwrap();
            assert_eq!(res.body(), label);
        }
    });
    assert_eq!(
        m.counter(
            RPC_SERVER_REQUESTS_TOTAL,
            &[("method", "GET /v1/payments/{id}")]
        ),
        2
    );
}

#[test]
fn route_name_function_is_used_for_unmatched_routes() {
    let layer = MetricsLayer::new("svc").route_name(|_m, path| {
        path.starts_with("/admin/")
            .then(|| SharedString::const_str("admin"))
    });
    let ((), m) = with_metrics(|| async {
        let svc = layer.layer(service_fn(|_req: Request<Bytes>| async {
            Ok::<_, Infallible>(Response::new(Bytes::new()))
        }));
        svc.clone()
            .oneshot(request(Method::GET, "/admin/users/7"))
            .await
            .unwrap();
        svc.oneshot(request(Method::GET, "/x")).await.unwrap();
    });
    assert_eq!(
        m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("method", "admin")]),
        1
    );
    assert_eq!(
        m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("method", "GET other")]),
        1
    );
}

#[test]
fn request_cut_by_the_deadline_is_a_timeout() {
    let (res, m) = with_metrics(|| async {
        let svc = DeadlineLayer::default().layer(layer().layer(service_fn(
            |_req: Request<Bytes>| async {
                pending::<()>().await;
                Ok::<_, Infallible>(Response::new(Bytes::new()))
            },
        )));
        let req = Request::builder()
            .method(Method::POST)
            .uri("/v1/payments")
            .header("grpc-timeout", "20m")
            .body(Bytes::new())
            .unwrap();
        svc.oneshot(req).await.unwrap()
    });
    assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(
        m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("outcome", "timeout")]),
        1
    );
    assert_eq!(m.gauge(RPC_SERVER_INFLIGHT, &[]), 0.0);
}

#[test]
fn client_going_away_is_cancelled_not_fatal() {
    let ((), m) = with_metrics(|| async {
        let svc = layer().layer(service_fn(|_req: Request<Bytes>| async {
            pending::<()>().await;
            Ok::<_, Infallible>(Response::new(Bytes::new()))
        }));
        let fut = svc.oneshot(request(Method::POST, "/v1/payments"));
        // The connection closes after 10 ms: the future is dropped unanswered.
        let _ = tokio::time::timeout(Duration::from_millis(10), fut).await;
    });
    assert_eq!(
        m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("outcome", "cancelled")]),
        1
    );
    assert_eq!(
        m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("outcome", "fatal")]),
        0
    );
    assert_eq!(m.gauge(RPC_SERVER_INFLIGHT, &[]), 0.0);
}

#[test]
fn one_log_event_per_request_with_design_fields() {
    let (_, logs) = with_logs(|| {
        with_metrics(|| async {
            let peer_layer = layer().peer_from(|ext| ext.get::<std::net::SocketAddr>().copied());
            let svc = DeadlineLayer::default().layer(peer_layer.layer(service_fn(
                |_req: Request<Bytes>| async {
                    sleep(Duration::from_millis(30)).await;
                    let mut res = Response::new(Bytes::new());
                    *res.status_mut() = StatusCode::CREATED;
                    Ok::<_, Infallible>(res)
                },
            )));
            let req = Request::builder()
                .method(Method::POST)
                .uri("/v1/payments")
                .header("grpc-timeout", "1S")
                .header("idempotency-key", "key-1")
                .header(
                    "traceparent",
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                )
                .header("grpc-previous-rpc-attempts", "2")
                .extension(std::net::SocketAddr::from(([127, 0, 0, 1], 4711)))
                .body(Bytes::new())
                .unwrap();
            svc.oneshot(req).await.unwrap()
        })
    });
    let events: Vec<_> = logs
        .iter()
        .filter(|l| l["message"] == "rpc_server_request")
        .collect();
    assert_eq!(events.len(), 1, "{logs:?}");
    let e = events[0];
    assert_eq!(e["service"], "payments");
    assert_eq!(e["method"], "POST /v1/payments");
    assert_eq!(e["status"], 201);
    assert_eq!(e["outcome"], "ok");
    assert_eq!(e["deadline_remaining_ms"], 970);
    assert_eq!(e["idempotency_key"], "key-1");
    assert_eq!(e["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(e["duration_ms"], 30.0);
    assert_eq!(e["attempt"], 3);
    assert_eq!(e["peer"], "127.0.0.1:4711");
}

#[test]
fn traceparent_parsing() {
    let traced = |value: &str| {
        let mut headers = http::HeaderMap::new();
        headers.insert("traceparent", value.parse().unwrap());
        super::future::trace_id(&headers)
    };
    let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    assert_eq!(
        traced(valid).as_deref(),
        Some("4bf92f3577b34da6a3ce929d0e0e4736")
    );
    // A future version may append fields.
    assert!(traced("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz").is_some());
    for bad in [
        "",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
    ] {
        assert_eq!(traced(bad), None, "{bad:?}");
    }
}

#[test]
fn handles_follow_the_recorder_in_effect() {
    use crate::server::testing::Recorded;
    use metrics_util::debugging::DebuggingRecorder;

    fn requests(recorder: &DebuggingRecorder) -> u64 {
        Recorded::of(recorder).counter(RPC_SERVER_REQUESTS_TOTAL, &[])
    }

    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let svc = layer().layer(service_fn(|_req: Request<Bytes>| async {
        Ok::<_, Infallible>(Response::new(Bytes::new()))
    }));
    let (first, second) = (DebuggingRecorder::new(), DebuggingRecorder::new());
    // The route's handles are resolved under `first`; `second` must still see its requests.
    for recorder in [&first, &second, &first, &second, &second] {
        metrics::with_local_recorder(recorder, || {
            runtime
                .block_on(svc.clone().oneshot(request(Method::POST, "/v1/payments")))
                .unwrap()
        });
    }
    assert_eq!(requests(&first), 2);
    assert_eq!(requests(&second), 3);
}

#[test]
fn a_lost_hedge_is_logged_cancelled_with_its_grpc_code() {
    let ((), logs) = with_logs(|| {
        with_metrics(|| async {
            let svc = layer().layer(service_fn(|_req: Request<Bytes>| async {
                pending::<()>().await;
                Ok::<_, Infallible>(Response::new(Bytes::new()))
            }));
            let req = Request::builder()
                .method(Method::POST)
                .uri("/payment.v1.Payment/Charge")
                .header("content-type", "application/grpc")
                .body(Bytes::new())
                .unwrap();
            // The other hedge answered first: the client resets this stream.
            let _ = tokio::time::timeout(Duration::from_millis(10), svc.oneshot(req)).await;
        })
        .0
    });
    let event = logs
        .iter()
        .find(|l| l["message"] == "rpc_server_request")
        .unwrap();
    assert_eq!(event["outcome"], "cancelled");
    assert_eq!(event["status"], 499);
    assert_eq!(event["grpc_code"], "CANCELLED");
}

/// The log event of one gRPC-or-not request answered by `respond`.
fn logged(grpc: bool, respond: fn() -> Response<Bytes>) -> serde_json::Value {
    let (_, logs) = with_logs(|| {
        with_metrics(|| async move {
            let svc = layer().layer(service_fn(move |_req: Request<Bytes>| async move {
                Ok::<_, Infallible>(respond())
            }));
            let mut req = Request::builder().method(Method::POST).uri("/v1/payments");
            if grpc {
                req = req.header("content-type", "application/grpc+proto");
            }
            svc.oneshot(req.body(Bytes::new()).unwrap()).await.unwrap()
        })
    });
    logs.into_iter()
        .find(|l| l["message"] == "rpc_server_request")
        .unwrap()
}

#[test]
fn grpc_log_lines_carry_the_grpc_code() {
    let unavailable = logged(true, || {
        let mut res = Response::new(Bytes::new());
        res.headers_mut()
            .insert("grpc-status", http::HeaderValue::from_static("14"));
        res
    });
    assert_eq!(unavailable["grpc_code"], "UNAVAILABLE");
    assert_eq!(unavailable["outcome"], "retryable");
    // A success sends its status in the trailers, after the message.
    let ok = logged(true, || Response::new(Bytes::new()));
    assert_eq!(ok["grpc_code"], "OK");
    // Plain HTTP has no gRPC code to log.
    let http = logged(false, || Response::new(Bytes::new()));
    assert!(http.get("grpc_code").is_none(), "{http}");
}

#[test]
fn durations_are_logged_without_float_noise() {
    for (micros, text) in [
        (1_100, "1.1"),
        (1_250, "1.25"),
        (12_345, "12.345"),
        (10_000_000, "10000.0"),
        (7, "0.007"),
    ] {
        let millis = future::millis(Duration::from_micros(micros));
        assert_eq!(serde_json::to_string(&millis).unwrap(), text, "{micros} µs");
    }
    // The nanoseconds below a microsecond are dropped, not printed as noise.
    let millis = future::millis(Duration::from_nanos(1_100_999));
    assert_eq!(serde_json::to_string(&millis).unwrap(), "1.1");
}

#[test]
fn unmatched_requests_are_counted_under_one_label() {
    let ((), m) = with_metrics(|| async {
        let svc = layer()
            .unmatched()
            .layer(service_fn(|_req: Request<Bytes>| async {
                let mut res = Response::new(Bytes::new());
                *res.status_mut() = StatusCode::NOT_FOUND;
                Ok::<_, Infallible>(res)
            }));
        for (method, path) in [
            (Method::GET, "/wp-login.php"),
            (Method::POST, "/v1/payments/x/y"),
            (Method::from_bytes(b"BREW").unwrap(), "/pot-123"),
        ] {
            svc.clone().oneshot(request(method, path)).await.unwrap();
        }
    });
    let labels = [
        ("service", "payments"),
        ("method", UNMATCHED),
        ("outcome", "fatal"),
    ];
    assert_eq!(m.counter(RPC_SERVER_REQUESTS_TOTAL, &labels), 3);
    assert_eq!(m.counter(RPC_SERVER_REQUESTS_TOTAL, &[]), 3);
}
