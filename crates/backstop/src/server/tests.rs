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

/// The metrics name a request by the policy entry selected for it from the table in effect:
/// a route a reload adds is counted under its own name from its first request, never as
/// `other` until a restart; a gRPC method by its path; a path entry called with another
/// method than gRPC's POST, and whole services, as `other`; an entry at a path no request has
/// (a variant of a route the application selects, as the proxy's keyed `auto` requests) as the
/// route of the request's own path.
#[test]
fn a_route_added_by_a_reload_is_counted_under_its_own_name() {
    use crate::observe::RPC_SERVER_REQUESTS_TOTAL;
    use crate::policy::{Idempotency, MethodPolicy};
    use crate::server::testing::with_metrics;

    let table = |routes: &[&str]| {
        let other = MethodPolicy::builder("other", Idempotency::Unsafe).build();
        let named = |name: &str| MethodPolicy::builder(name, Idempotency::Unsafe).build();
        routes.iter().fold(
            MethodPolicies::new(other)
                .method("/pay.v1.Pay/Charge", named("Charge"))
                .method("keyed /v1/payments", named("PayKeyed"))
                .service("pay.v1.Refunds", named("Refunds")),
            |table, route| table.route(Method::POST, route, named(route)),
        )
    };
    let policies = ReloadablePolicies::new(table(&["/v1/payments"])).unwrap();
    let ((), m) = with_metrics(|| async {
        #[derive(Clone)]
        struct Variant;
        let svc = ServerStack::new("payments", MemoryStore::new())
            .reloadable_policies(policies.clone())
            .matched_path_from(|ext| ext.get::<Variant>().map(|_| "keyed /v1/payments"))
            .into_layer()
            .layer(service_fn(|_req: Request<ServerStackBody<Body>>| async {
                Ok::<_, Infallible>(Response::new(Body::from("{}")))
            }));
        let send = |method: Method, path: &'static str| {
            let request = Request::builder().method(method).uri(path);
            svc.clone().oneshot(request.body(Body::default()).unwrap())
        };
        send(Method::POST, "/v1/payments").await.unwrap();
        send(Method::POST, "/v1/refunds/r_1").await.unwrap();
        policies
            .replace(table(&["/v1/payments", "/v1/refunds/{id}"]))
            .unwrap();
        send(Method::POST, "/v1/payments").await.unwrap();
        send(Method::POST, "/v1/refunds/r_2").await.unwrap();
        send(Method::POST, "/pay.v1.Pay/Charge").await.unwrap();
        send(Method::GET, "/pay.v1.Pay/Charge").await.unwrap();
        send(Method::POST, "/pay.v1.Refunds/Refund").await.unwrap();
        let mut variant = Request::post("/v1/payments").body(Body::default()).unwrap();
        variant.extensions_mut().insert(Variant);
        svc.clone().oneshot(variant).await.unwrap();
    });
    let count = |label: &str| m.counter(RPC_SERVER_REQUESTS_TOTAL, &[("method", label)]);
    assert_eq!(count("POST /v1/payments"), 3, "with its variant");
    assert_eq!(count("POST /v1/refunds/{id}"), 1, "the reloaded route");
    assert_eq!(count("POST /pay.v1.Pay/Charge"), 1);
    assert_eq!(count("GET other"), 1);
    assert_eq!(count("POST other"), 2, "before the reload, and the service");
}
