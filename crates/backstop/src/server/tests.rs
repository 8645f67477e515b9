//! The composed stack: order of the layers.

use std::convert::Infallible;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use tower::{ServiceExt, service_fn};

use super::*;
use crate::deadline::Deadline;
use crate::idempotency::{IdempotencyKey, MemoryStore};
use crate::server::metrics::Route;
use crate::server::testing::problem_code;

type Body = Full<Bytes>;

fn post(key: &str, timeout: Option<&str>) -> Request<Body> {
    let mut builder = Request::builder()
        .method(Method::POST)
        .uri("/v1/payments")
        .header("idempotency-key", key)
        .header("authorization", "Bearer acme");
    if let Some(t) = timeout {
        builder = builder.header("grpc-timeout", t);
    }
    builder.body(Body::from(r#"{"amount_cents":1}"#)).unwrap()
}

fn stack(store: &MemoryStore) -> ServerStack<MemoryStore> {
    ServerStack::new("payments", store.clone())
        .policies(crate::server::testing::keyed(Method::POST, "/v1/payments"))
        .authenticate(|head| match head.headers.get("authorization") {
            Some(v) if v == "Bearer acme" => Ok(Tenant::new("acme")),
            _ => Err(Status::new(crate::status::Code::Unauthenticated, "bad key")),
        })
}

#[tokio::test(start_paused = true)]
async fn handler_sees_every_layers_extension() {
    let store = MemoryStore::new();
    let svc = stack(&store).into_layer().layer(service_fn(
        |req: Request<ServerStackBody<Body>>| async move {
            let ext = req.extensions();
            assert!(ext.get::<Deadline>().is_some());
            assert_eq!(ext.get::<Route>().unwrap().method(), "POST /v1/payments");
            assert_eq!(ext.get::<Tenant>().unwrap().as_str(), "acme");
            assert_eq!(ext.get::<IdempotencyKey>().unwrap().as_str(), "k1");
            let mut res = Response::new(Body::from("{}"));
            *res.status_mut() = StatusCode::CREATED;
            Ok::<_, Infallible>(res)
        },
    ));
    let res = svc.oneshot(post("k1", Some("1S"))).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
}

#[tokio::test(start_paused = true)]
async fn refused_requests_never_touch_the_key() {
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let quota = Quota::per_second(NonZeroU32::MIN, NonZeroU32::MIN);
    let svc = stack(&store)
        .tenant_buckets(KeyedTokenBucket::new(quota, NonZeroUsize::MIN))
        .into_layer()
        .layer(service_fn(move |_req: Request<ServerStackBody<Body>>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async {
                let mut res = Response::new(Body::from("{}"));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(res)
            }
        }));
    // Bad deadline: 400 before anything else.
    let res = svc
        .clone()
        .oneshot(post("k1", Some("123456789S")))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    // Bad credentials: 401.
    let mut anonymous = post("k1", None);
    anonymous.headers_mut().remove("authorization");
    let res = svc.clone().oneshot(anonymous).await.unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    // One token: the first request runs, the second is over quota.
    let res = svc.clone().oneshot(post("k1", None)).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let res = svc.clone().oneshot(post("k2", None)).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = crate::server::testing::body(res).await;
    assert_eq!(problem_code(&body), "rate_limited");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(store.len(), 1, "only the admitted request wrote a record");
}

/// The stack over a handler whose first call hangs, on a keyed route with `takeover`.
fn hanging_first(
    store: &MemoryStore,
    takeover: crate::policy::Takeover,
    calls: &Arc<AtomicUsize>,
) -> ServerStackService<
    impl tower::Service<
        Request<ServerStackBody<Body>>,
        Response = Response<Body>,
        Error = Infallible,
        Future: Send,
    > + Clone
    + Send
    + 'static,
    MemoryStore,
> {
    use crate::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicies, MethodPolicy};
    let keyed = MethodPolicy::builder("Keyed", Idempotency::Keyed)
        .key_ttl(KEY_TTL_PAYMENTS)
        .takeover(takeover)
        .build();
    let policies = MethodPolicies::new(MethodPolicy::builder("other", Idempotency::Unsafe).build())
        .route(Method::POST, "/v1/payments", keyed);
    let counted = calls.clone();
    stack(store)
        .policies(policies)
        .into_layer()
        .layer(service_fn(move |_req: Request<ServerStackBody<Body>>| {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    std::future::pending::<()>().await;
                }
                let mut res = Response::new(Body::from("{}"));
                *res.status_mut() = StatusCode::CREATED;
                Ok::<_, Infallible>(res)
            }
        }))
}

#[tokio::test(start_paused = true)]
async fn deadline_cut_on_a_rerun_route_fails_the_record_so_the_retry_runs() {
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = hanging_first(&store, crate::policy::Takeover::Rerun, &calls);
    let res = svc.clone().oneshot(post("k1", Some("50m"))).await.unwrap();
    assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT);
    tokio::task::yield_now().await;
    let res = svc.oneshot(post("k1", Some("1S"))).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// On a `Refuse` route (the default) a run cut mid-handler may have performed its effect: its
/// record stays running until its lease ends (then a retry gets `outcome_unknown`), and a retry
/// before that is told the key is in progress, by its own deadline; the handler does not run
/// again.
#[tokio::test(start_paused = true)]
async fn deadline_cut_on_a_refuse_route_leaves_the_key_in_progress() {
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = hanging_first(&store, crate::policy::Takeover::Refuse, &calls);
    let res = svc.clone().oneshot(post("k1", Some("50m"))).await.unwrap();
    assert_eq!(res.status(), StatusCode::GATEWAY_TIMEOUT);
    tokio::task::yield_now().await;
    let res = svc.oneshot(post("k1", Some("1S"))).await.unwrap();
    assert_eq!(res.status(), StatusCode::CONFLICT);
    let body = crate::server::testing::body(res).await;
    assert_eq!(problem_code(&body), "request_in_progress");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
