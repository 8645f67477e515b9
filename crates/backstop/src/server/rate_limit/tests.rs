use std::convert::Infallible;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use tower::{ServiceExt, service_fn};
use tower_layer::Layer;

use super::*;
use crate::admission::Quota;
use crate::observe::{RPC_SERVER_REJECTED_TOTAL, RPC_SERVER_REQUESTS_TOTAL};
use crate::server::metrics::MetricsLayer;
use crate::server::testing::{flat, problem_code, with_metrics};

fn buckets(rate: u32, burst: u32) -> KeyedTokenBucket {
    let quota = Quota::per_second(
        NonZeroU32::new(rate).unwrap(),
        NonZeroU32::new(burst).unwrap(),
    );
    // tokio's clock: the tests move time with `tokio::time::advance`.
    KeyedTokenBucket::with_clock(
        quota,
        NonZeroUsize::new(100).unwrap(),
        crate::clock::MonotonicClock::tokio(),
    )
}

fn request(tenant: Option<&str>) -> Request<Bytes> {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri("/v1/payments")
        .body(Bytes::new())
        .unwrap();
    if let Some(t) = tenant {
        req.extensions_mut().insert(Tenant::new(t));
    }
    req
}

#[test]
fn tenant_over_quota_gets_429_with_retry_after() {
    let calls = Arc::new(AtomicUsize::new(0));
    let (statuses, m) = with_metrics(|| {
        let calls = calls.clone();
        async move {
            let inner = {
                let calls = calls.clone();
                service_fn(move |_req: Request<Bytes>| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    async { Ok::<_, Infallible>(Response::new(Bytes::new())) }
                })
            };
            let svc = MetricsLayer::new("payments")
                .route(Method::POST, "/v1/payments")
                .layer(
                    RateLimitLayer::new(buckets(1, 2))
                        .layer(inner)
                        .map_response(flat),
                );
            let mut out = Vec::new();
            for _ in 0..3 {
                out.push(svc.clone().oneshot(request(Some("acme"))).await.unwrap());
            }
            out
        }
    });
    assert_eq!(statuses[0].status(), StatusCode::OK);
    assert_eq!(statuses[1].status(), StatusCode::OK);
    let refused = &statuses[2];
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()[header::RETRY_AFTER], "1");
    assert_eq!(problem_code(refused.body()), "rate_limited");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the refused request never ran"
    );
    assert_eq!(
        m.counter(
            RPC_SERVER_REJECTED_TOTAL,
            &[
                ("reason", "rate_limited"),
                ("service", "payments"),
                ("method", "POST /v1/payments")
            ]
        ),
        1
    );
    assert_eq!(
        m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("outcome", "rejected")]),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn tenants_have_their_own_buckets() {
    let svc = RateLimitLayer::new(buckets(1, 1))
        .layer(service_fn(|_req: Request<Bytes>| async {
            Ok::<_, Infallible>(Response::new(Bytes::new()))
        }))
        .map_response(flat);
    let status = |res: Response<Bytes>| res.status();
    assert_eq!(
        status(svc.clone().oneshot(request(Some("a"))).await.unwrap()),
        200
    );
    assert_eq!(
        status(svc.clone().oneshot(request(Some("a"))).await.unwrap()),
        429
    );
    assert_eq!(
        status(svc.clone().oneshot(request(Some("b"))).await.unwrap()),
        200
    );
    // No tenant: the shared default bucket.
    assert_eq!(
        status(svc.clone().oneshot(request(None)).await.unwrap()),
        200
    );
    assert_eq!(
        status(
            svc.clone()
                .oneshot(request(Some(Tenant::DEFAULT)))
                .await
                .unwrap()
        ),
        429
    );
    // Tokens come back with time.
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(
        status(svc.clone().oneshot(request(Some("a"))).await.unwrap()),
        200
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_never_zero() {
    // 50 tokens per second: the next token is 20 ms away, announced as 1 s.
    let svc = RateLimitLayer::new(buckets(50, 1))
        .layer(service_fn(|_req: Request<Bytes>| async {
            Ok::<_, Infallible>(Response::new(Bytes::new()))
        }))
        .map_response(flat);
    svc.clone().oneshot(request(Some("a"))).await.unwrap();
    let res = svc.oneshot(request(Some("a"))).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(res.headers()[header::RETRY_AFTER], "1");
    let doc: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
    assert_eq!(doc["retry_after"], 1);
}

/// The table of `rate_class_spends_its_own_buckets`: status polls in `reads`, the rest in
/// the default class.
fn classed_policies() -> crate::policy::MethodPolicies {
    use crate::policy::{Idempotency, MethodPolicies, MethodPolicy};
    let read = MethodPolicy::builder("GetPayment", Idempotency::Safe)
        .rate_class("reads")
        .build();
    MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build()).route(
        Method::GET,
        "/v1/payments/{id}",
        read,
    )
}

fn get(tenant: &str) -> Request<Bytes> {
    let mut req = Request::get("/v1/payments/p-1").body(Bytes::new()).unwrap();
    req.extensions_mut().insert(Tenant::new(tenant));
    req
}

#[tokio::test(start_paused = true)]
async fn rate_class_spends_its_own_buckets() {
    let ok = service_fn(|_req: Request<Bytes>| async {
        Ok::<_, Infallible>(Response::new(Bytes::new()))
    });
    let svc = RateLimitLayer::new(buckets(1, 1))
        .class("reads", buckets(1, 2))
        .policies(classed_policies())
        .layer(ok);
    let status = |r: Response<_>| r.status();

    // The one default token goes to a POST; the next POST is refused...
    assert_eq!(
        status(svc.clone().oneshot(request(Some("acme"))).await.unwrap()),
        StatusCode::OK
    );
    let refused = svc.clone().oneshot(request(Some("acme"))).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // ...while the tenant's polls spend from their class's two tokens, then are refused too.
    for _ in 0..2 {
        assert_eq!(
            status(svc.clone().oneshot(get("acme")).await.unwrap()),
            StatusCode::OK
        );
    }
    let polls_refused = svc.clone().oneshot(get("acme")).await.unwrap();
    assert_eq!(polls_refused.status(), StatusCode::TOO_MANY_REQUESTS);
    // The default class was not spent by the polls: a second tenant's POST still passes.
    assert_eq!(
        status(svc.clone().oneshot(request(Some("beta"))).await.unwrap()),
        StatusCode::OK
    );
}

#[tokio::test(start_paused = true)]
async fn without_a_table_every_class_spends_the_default_buckets() {
    let ok = service_fn(|_req: Request<Bytes>| async {
        Ok::<_, Infallible>(Response::new(Bytes::new()))
    });
    // A class's buckets but no table to find a request's class: the default buckets decide.
    let svc = RateLimitLayer::new(buckets(1, 1))
        .class("reads", buckets(1, 100))
        .layer(ok);
    assert_eq!(
        svc.clone().oneshot(get("acme")).await.unwrap().status(),
        StatusCode::OK
    );
    let refused = svc.clone().oneshot(get("acme")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
}
