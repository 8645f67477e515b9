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

/// The server labels each request with the caller's attempt, as the client labels its own:
/// 1 + `grpc-previous-rpc-attempts`, bounded at `6+`; no header (or not a number) is a first
/// attempt.
#[test]
fn requests_are_labelled_with_the_callers_attempt() {
    let previous = [
        None,
        Some("0"),
        Some("1"),
        Some("2"),
        Some("9"),
        Some("junk"),
    ];
    let ((), m) = with_metrics(|| async {
        for header in previous {
            let svc = layer().layer(service_fn(|_req: Request<Bytes>| async {
                Ok::<_, Infallible>(Response::new(Bytes::new()))
            }));
            let mut req = request(Method::POST, "/v1/payments");
            if let Some(value) = header {
                req.headers_mut()
                    .insert("grpc-previous-rpc-attempts", value.parse().unwrap());
            }
            svc.oneshot(req).await.unwrap();
        }
    });
    for (attempt, count) in [("1", 3), ("2", 1), ("3", 1), ("6+", 1)] {
        let labels = [("attempt", attempt), ("outcome", "ok")];
        assert_eq!(
            m.counter(RPC_SERVER_REQUESTS_TOTAL, &labels),
            count,
            "attempt {attempt}"
        );
        assert_eq!(
            m.samples(RPC_SERVER_DURATION_SECONDS, &labels),
            count as usize
        );
    }
    assert_eq!(m.counter(RPC_SERVER_REQUESTS_TOTAL, &[]), 6);
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

/// The client and the server say the same of one answer: the same outcome in the client's
/// attempt metrics and `rpc_attempt` event as in the server's request metrics and
/// `rpc_server_request` event, for plain HTTP answers, trailers-only gRPC answers and the
/// server's own problem answers.
#[cfg(feature = "client")]
mod one_reading_of_an_answer {
    use std::sync::Arc;

    use http::HeaderMap;
    use http_body_util::Full;

    use super::*;
    use crate::client::{ClientStack, Destination};
    use crate::policy::{Idempotency, MethodPolicy};
    use crate::server::problem::Problem;
    use crate::status::{Code, Status, problem};

    type Answer = Arc<dyn Fn() -> Response<Bytes> + Send + Sync>;

    fn plain(status: u16, headers: &'static [(&'static str, &'static str)]) -> Answer {
        Arc::new(move || {
            let mut response = Response::builder().status(status);
            for (name, value) in headers {
                response = response.header(*name, *value);
            }
            response.body(Bytes::new()).unwrap()
        })
    }

    fn grpc(code: &'static str, headers: &'static [(&'static str, &'static str)]) -> Answer {
        Arc::new(move || {
            let mut response = Response::builder()
                .header("content-type", "application/grpc")
                .header("grpc-status", code);
            for (name, value) in headers {
                response = response.header(*name, *value);
            }
            response.body(Bytes::new()).unwrap()
        })
    }

    fn problem_http(status: fn() -> Status) -> Answer {
        Arc::new(move || Problem::from_status(&status()).into_http_response())
    }

    fn problem_grpc(status: fn() -> Status) -> Answer {
        Arc::new(move || Problem::from_status(&status()).into_grpc_response())
    }

    fn in_progress() -> Status {
        Status::new(Code::Aborted, "another request with this key is running")
            .with_problem(problem::REQUEST_IN_PROGRESS)
            .with_pushback(Duration::from_secs(1))
    }

    fn key_reused() -> Status {
        Status::new(Code::FailedPrecondition, "key reused with other parameters")
            .with_problem(problem::IDEMPOTENCY_KEY_REUSED)
            .with_http_status(StatusCode::CONFLICT)
    }

    fn too_late() -> Status {
        Status::new(Code::DeadlineExceeded, "deadline exceeded")
    }

    fn invalid() -> Status {
        Status::new(Code::InvalidArgument, "amount must be positive")
    }

    fn quota() -> Status {
        Status::rate_limited(Duration::from_secs(1))
    }

    /// The one outcome `name` was counted under, with labels `who`.
    fn counted(
        m: &crate::server::testing::Recorded,
        name: &str,
        who: [(&str, &str); 2],
    ) -> Outcome {
        let found: Vec<_> = Outcome::ALL
            .into_iter()
            .filter(|o| m.counter(name, &[who[0], who[1], ("outcome", o.as_str())]) > 0)
            .collect();
        assert_eq!(found.len(), 1, "{name}: {found:?}");
        found[0]
    }

    /// The outcome field of the one `event` logged.
    fn logged(logs: &[serde_json::Value], event: &str) -> String {
        let lines: Vec<_> = logs
            .iter()
            .filter(|line| line["message"] == event || line["event"] == event)
            .collect();
        assert_eq!(lines.len(), 1, "{event}: {lines:?}");
        lines[0]["outcome"].as_str().unwrap().to_owned()
    }

    /// The outcome the server's metrics and log give `answer`.
    fn on_the_server(answer: &Answer) -> (Outcome, String) {
        let answer = answer.clone();
        let ((_, m), logs) = with_logs(|| {
            with_metrics(|| async move {
                let svc = layer().layer(service_fn(move |_req: Request<Bytes>| {
                    let response = answer();
                    async move { Ok::<_, Infallible>(response) }
                }));
                svc.oneshot(request(Method::POST, "/v1/payments"))
                    .await
                    .unwrap()
            })
        });
        let who = [("service", "payments"), ("method", "POST /v1/payments")];
        (
            counted(&m, RPC_SERVER_REQUESTS_TOTAL, who),
            logged(&logs, "rpc_server_request"),
        )
    }

    /// The outcome the client's metrics and log give `answer` to its one attempt.
    fn on_the_client(answer: &Answer) -> (Outcome, String) {
        let answer = answer.clone();
        let ((_, m), logs) = with_logs(|| {
            with_metrics(|| async move {
                let dest = Destination::new("psp").breaker(None).storm_alarm(None);
                let charge = MethodPolicy::builder("Charge", Idempotency::Safe)
                    .max_attempts(1)
                    .build();
                let client =
                    ClientStack::builder(&dest, charge)
                        .build()
                        .unwrap()
                        .layer(service_fn(move |_req| {
                            let response = answer().map(|_| ());
                            async move { Ok::<_, std::io::Error>(response) }
                        }));
                let request = Request::post("http://psp/v1/payments")
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                client.oneshot(request).await
            })
        });
        let who = [("service", "psp"), ("method", "Charge")];
        (
            counted(&m, RPC_CLIENT_ATTEMPTS_TOTAL, who),
            logged(&logs, "rpc_attempt"),
        )
    }

    #[test]
    fn the_client_and_the_server_give_an_answer_the_same_outcome() {
        use Outcome::*;
        let cases: Vec<(&str, Answer, Outcome)> = vec![
            ("200", plain(200, &[]), Ok),
            ("201", plain(201, &[]), Ok),
            ("400", plain(400, &[]), Fatal),
            ("404", plain(404, &[]), Fatal),
            ("409 conflict", plain(409, &[]), Fatal),
            (
                "409 in progress",
                plain(409, &[("retry-after", "1")]),
                Retryable,
            ),
            (
                "409 in progress (gRPC pushback)",
                plain(409, &[("grpc-retry-pushback-ms", "250")]),
                Retryable,
            ),
            ("429", plain(429, &[]), Rejected),
            (
                "429 retry-after",
                plain(429, &[("retry-after", "2")]),
                Rejected,
            ),
            ("499", plain(499, &[]), Cancelled),
            ("500", plain(500, &[]), Fatal),
            ("502", plain(502, &[]), Retryable),
            ("503", plain(503, &[]), Retryable),
            (
                "503 retry-after",
                plain(503, &[("retry-after", "2")]),
                Retryable,
            ),
            ("504", plain(504, &[]), Timeout),
            ("grpc OK", grpc("0", &[]), Ok),
            ("grpc UNAVAILABLE", grpc("14", &[]), Retryable),
            ("grpc ABORTED", grpc("10", &[]), Retryable),
            ("grpc ALREADY_EXISTS", grpc("6", &[]), Fatal),
            ("grpc DEADLINE_EXCEEDED", grpc("4", &[]), Timeout),
            (
                "grpc RESOURCE_EXHAUSTED",
                grpc("8", &[("grpc-retry-pushback-ms", "100")]),
                Rejected,
            ),
            ("grpc garbled", grpc("x", &[]), Fatal),
            ("problem in progress", problem_http(in_progress), Retryable),
            ("problem key reused", problem_http(key_reused), Fatal),
            ("problem deadline", problem_http(too_late), Timeout),
            ("problem invalid", problem_http(invalid), Fatal),
            ("problem quota", problem_http(quota), Rejected),
            (
                "grpc problem in progress",
                problem_grpc(in_progress),
                Retryable,
            ),
            ("grpc problem key reused", problem_grpc(key_reused), Fatal),
            ("grpc problem deadline", problem_grpc(too_late), Timeout),
            ("grpc problem quota", problem_grpc(quota), Rejected),
        ];
        for (name, answer, outcome) in cases {
            let want = (outcome, outcome.as_str().to_owned());
            assert_eq!(on_the_server(&answer), want, "server: {name}");
            assert_eq!(on_the_client(&answer), want, "client: {name}");
            let head = answer();
            assert_eq!(
                Outcome::of_head(head.status(), head.headers()),
                outcome,
                "{name}"
            );
        }
        // What the server alone knows: it refused the request itself. Its caller sees a 503
        // asking to come back later.
        let overloaded = problem_http(|| Status::overloaded(Duration::from_secs(1)));
        assert_eq!(on_the_server(&overloaded).0, Rejected);
        assert_eq!(on_the_client(&overloaded).0, Retryable);
        assert_eq!(
            Outcome::of_head(StatusCode::CONFLICT, &HeaderMap::new()),
            Fatal
        );
    }
}
