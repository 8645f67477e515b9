//! The client stack against real servers on 127.0.0.1:0, over a pooled hyper-util client.
//!
//! Nothing here asserts on wall-clock durations: slow servers wait far longer (seconds) than
//! anything the assertions depend on, and the assertions are about what the servers saw.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use backstop::client::connect::{self, Endpoint, HttpClient};
use backstop::client::replay::ReplayBody;
use backstop::client::retry::RetryStopped;
use backstop::client::{ClientStack, Destination};
use backstop::deadline::decode_grpc_timeout;
use backstop::idempotency::MemoryStore;
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicy};
use backstop::server::ServerStack;
use bytes::Bytes;
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use support::policies::keyed;
use tokio::net::TcpListener;
use tower::ServiceExt;

type Body = ReplayBody<Full<Bytes>>;

async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn client() -> HttpClient<Body> {
    connect::pooled(false)
}

fn charge_contract() -> MethodPolicy {
    MethodPolicy::builder("Charge", Idempotency::Keyed)
        .timeout(Duration::from_secs(5))
        .key_ttl(KEY_TTL_PAYMENTS)
        .build()
}

fn post_charge(uri: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post(uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

/// What a server saw of each request.
#[derive(Debug, Clone)]
struct Seen {
    key: Option<String>,
    timeout: Option<Duration>,
    previous: Option<String>,
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Seen>>>);

impl Recorder {
    fn push(&self, headers: &HeaderMap) -> usize {
        let text = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
        let mut seen = self.0.lock().unwrap();
        seen.push(Seen {
            key: text("idempotency-key"),
            timeout: text("grpc-timeout").map(|t| decode_grpc_timeout(&t).unwrap()),
            previous: text("grpc-previous-rpc-attempts"),
        });
        seen.len()
    }

    fn seen(&self) -> Vec<Seen> {
        self.0.lock().unwrap().clone()
    }
}

#[tokio::test]
async fn one_logical_call_is_attempts_with_one_key_and_a_shrinking_timeout() {
    let recorder = Recorder::default();
    let app = Router::new()
        .route(
            "/v1/charges",
            post(|State(r): State<Recorder>, headers: HeaderMap| async move {
                if r.push(&headers) < 3 {
                    (StatusCode::SERVICE_UNAVAILABLE, "down")
                } else {
                    (StatusCode::CREATED, "charged")
                }
            }),
        )
        .with_state(recorder.clone());
    let addr = serve(app).await;

    let psp = Destination::new("psp");
    let stack = ClientStack::builder(&psp, charge_contract())
        .build()
        .unwrap();
    let svc = stack.layer(client());
    let response = svc
        .oneshot(post_charge(&format!("http://{addr}/v1/charges"), "{}"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "charged");

    let seen = recorder.seen();
    assert_eq!(seen.len(), 3);
    let key = seen[0].key.clone().expect("a key on the first attempt");
    assert!(seen.iter().all(|s| s.key.as_deref() == Some(key.as_str())));
    let previous: Vec<_> = seen.iter().map(|s| s.previous.as_deref()).collect();
    assert_eq!(previous, [None, Some("1"), Some("2")]);
    let budgets: Vec<Duration> = seen.iter().map(|s| s.timeout.unwrap()).collect();
    assert!(budgets[0] < Duration::from_secs(5), "{budgets:?}");
    assert!(budgets.windows(2).all(|w| w[1] < w[0]), "{budgets:?}");
}

/// A server that gave up waiting (504, `DEADLINE_EXCEEDED`) may still have done the work: a
/// call is sent again after one only when it carries a key (the server tells the retry from a
/// new call by it) and its method lists the code. A method without a key cannot list it at
/// all, and a keyed method's default codes leave it out.
#[tokio::test]
async fn a_deadline_exceeded_answer_is_retried_only_with_a_key() {
    use backstop::policy::InvalidPolicy;
    use backstop::status::Code;

    let unkeyed = MethodPolicy::builder("Transfer", Idempotency::Unsafe)
        .retryable([Code::DeadlineExceeded])
        .build()
        .validate();
    assert!(
        matches!(
            unkeyed,
            Err(InvalidPolicy::UnsafeRetry {
                code: Code::DeadlineExceeded,
                ..
            })
        ),
        "{unkeyed:?}"
    );

    let recorder = Recorder::default();
    let app = Router::new()
        .route(
            "/v1/charges",
            post(|State(r): State<Recorder>, headers: HeaderMap| async move {
                r.push(&headers);
                // Every first attempt times out; a retry is answered.
                if !headers.contains_key("grpc-previous-rpc-attempts") {
                    (StatusCode::GATEWAY_TIMEOUT, "gave up waiting")
                } else {
                    (StatusCode::CREATED, "charged")
                }
            }),
        )
        .with_state(recorder.clone());
    let addr = serve(app).await;
    let uri = format!("http://{addr}/v1/charges");
    let dest = Destination::new("psp");
    let call = async |policy: MethodPolicy| {
        let svc = ClientStack::builder(&dest, policy)
            .build()
            .unwrap()
            .layer(client());
        svc.oneshot(post_charge(&uri, "{}")).await.unwrap()
    };

    // Keyed, with the default codes: the 504 is the answer.
    let response = call(charge_contract()).await;
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    let stopped = response.extensions().get::<RetryStopped>().unwrap();
    assert_eq!(stopped.attempts, 1);
    assert_eq!(recorder.seen().len(), 1);

    // Keyed and listing the code: sent again under the same key, and answered.
    let listing = MethodPolicy::builder("Charge", Idempotency::Keyed)
        .timeout(Duration::from_secs(5))
        .key_ttl(KEY_TTL_PAYMENTS)
        .retryable([Code::Unavailable, Code::DeadlineExceeded])
        .build();
    let response = call(listing).await;
    assert_eq!(
        response.status(),
        StatusCode::CREATED,
        "{:?}",
        response.extensions().get::<RetryStopped>()
    );
    let seen = recorder.seen();
    assert_eq!(seen.len(), 3, "the keyed call was sent twice");
    assert!(seen[1].key.is_some());
    assert_eq!(seen[1].key, seen[2].key);
    assert_eq!(seen[2].previous.as_deref(), Some("1"));
}

#[tokio::test]
async fn retries_through_the_server_stack_charge_once() {
    let charges = Arc::new(AtomicUsize::new(0));
    let first = Arc::new(AtomicBool::new(true));
    let handler = {
        let (charges, first) = (charges.clone(), first.clone());
        move || async move {
            if first.swap(false, Ordering::SeqCst) {
                return (StatusCode::SERVICE_UNAVAILABLE, "flaky");
            }
            charges.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "charged")
        }
    };
    let server = ServerStack::new("payments", MemoryStore::new())
        .policies(keyed(&[(Method::POST, "/v1/payments")]));
    let app = Router::new()
        .route("/v1/payments", post(handler))
        .layer(server.into_layer());
    let addr = serve(app).await;

    let payments = Destination::new("payments");
    let svc = ClientStack::builder(&payments, charge_contract())
        .build()
        .unwrap()
        .layer(client());
    let uri = format!("http://{addr}/v1/payments");
    let response = svc
        .clone()
        .oneshot(post_charge(
            &uri,
            r#"{"order_id":"o-1","amount_cents":100}"#,
        ))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(charges.load(Ordering::SeqCst), 1);

    // A client mistake is not retried, and the response says why it stopped.
    let response = svc
        .oneshot(
            Request::post(&uri)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(b"not json")))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let stopped = response.extensions().get::<RetryStopped>().unwrap();
    assert_eq!(stopped.attempts, 1);
    assert_eq!(charges.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_refused_connection_is_sent_again_transparently() {
    let hits = Arc::new(AtomicUsize::new(0));
    let app = {
        let hits = hits.clone();
        Router::new().route(
            "/v1/charges/{id}",
            get(move || async move {
                hits.fetch_add(1, Ordering::SeqCst);
                "found"
            }),
        )
    };
    let live = serve(app).await;
    // A port with nothing listening: bind, note it, close it.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };

    // The first send goes to the dead address, every later one to the live one, as a
    // balancer would do after a failed pick.
    let sends = Arc::new(AtomicUsize::new(0));
    let transport = {
        let sends = sends.clone();
        let dead =
            Endpoint::new(client(), &format!("http://{dead}").parse::<Uri>().unwrap()).unwrap();
        let live =
            Endpoint::new(client(), &format!("http://{live}").parse::<Uri>().unwrap()).unwrap();
        tower::service_fn(move |r: Request<Body>| {
            let target = if sends.fetch_add(1, Ordering::SeqCst) == 0 {
                dead.clone()
            } else {
                live.clone()
            };
            target.oneshot(r)
        })
    };
    // One attempt allowed: only the transparent retry can make this succeed.
    let contract = MethodPolicy::builder("GetCharge", Idempotency::Safe)
        .max_attempts(1)
        .build();
    let psp = Destination::new("psp");
    let svc = ClientStack::builder(&psp, contract)
        .build()
        .unwrap()
        .layer(transport);
    let response = svc
        .oneshot(
            Request::get("http://psp/v1/charges/ch_1")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(sends.load(Ordering::SeqCst), 2);
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    // The transparent retry did not count as an attempt and spent one budget token.
    assert!(response.extensions().get::<RetryStopped>().is_none());
    assert_eq!(psp.spend().retry_budget().available(), 19.0);
}

#[tokio::test]
async fn a_slow_replica_is_hedged_to_another_endpoint() {
    let slow = Arc::new(AtomicBool::new(false));
    let replica = |name: &'static str, slow: Option<Arc<AtomicBool>>| {
        Router::new().route(
            "/v1/charges/{id}",
            get(move || {
                let slow = slow.clone();
                async move {
                    if slow.is_some_and(|s| s.load(Ordering::SeqCst)) {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                    }
                    name
                }
            }),
        )
    };
    let a = serve(replica("slow", Some(slow.clone()))).await;
    let b = serve(replica("fast", None)).await;
    let endpoints = connect::endpoints(
        client(),
        [a, b].map(|addr| format!("http://{addr}").parse::<Uri>().unwrap()),
    )
    .unwrap();
    let transport = connect::balanced(endpoints, 64);

    let contract = MethodPolicy::builder("GetCharge", Idempotency::Safe)
        .timeout(Duration::from_secs(20))
        .hedging(true)
        .build();
    let psp = Destination::new("psp").budget(backstop::retry::RetryBudget::new(0.5, 50).unwrap());
    let svc = ClientStack::builder(&psp, contract)
        .build()
        .unwrap()
        .layer(transport);
    let get = || {
        Request::get("http://psp/v1/charges/ch_1")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };

    // Learn the usual latency while both replicas are fast.
    let mut replicas = HashMap::new();
    for _ in 0..40 {
        let response = svc.clone().oneshot(get()).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        *replicas.entry(body).or_insert(0) += 1;
    }
    assert_eq!(replicas.len(), 2, "both replicas served: {replicas:?}");

    // One replica turns slow: every call is answered by the other, whichever was picked first.
    slow.store(true, Ordering::SeqCst);
    for _ in 0..10 {
        let response = svc.clone().oneshot(get()).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "fast");
    }
}

#[tokio::test]
async fn a_refused_http2_stream_is_sent_again_transparently() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let streams = Arc::new(AtomicUsize::new(0));
    {
        let streams = streams.clone();
        tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            let mut conn = h2::server::handshake(socket).await.unwrap();
            while let Some(Ok((_request, mut respond))) = conn.accept().await {
                if streams.fetch_add(1, Ordering::SeqCst) == 0 {
                    // RFC 9113 section 8.7: refused before any processing.
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                } else {
                    respond
                        .send_response(http::Response::new(()), true)
                        .unwrap();
                }
            }
        });
    }
    let transport = Endpoint::new(
        connect::pooled::<Body>(true),
        &format!("http://{addr}").parse::<Uri>().unwrap(),
    )
    .unwrap();
    // One attempt allowed: only the transparent retry can make this succeed.
    let contract = MethodPolicy::builder("GetCharge", Idempotency::Safe)
        .max_attempts(1)
        .build();
    let psp = Destination::new("psp");
    let svc = ClientStack::builder(&psp, contract)
        .build()
        .unwrap()
        .layer(transport);
    let response = svc
        .oneshot(
            Request::get("http://psp/v1/charges/ch_1")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(streams.load(Ordering::SeqCst), 2);
    assert!(response.extensions().get::<RetryStopped>().is_none());
    assert_eq!(psp.spend().retry_budget().available(), 19.0);
}

mod support {
    pub(crate) mod policies;
}
