//! Servers that push clients back under sustained overload, over real sockets on 127.0.0.1:
//! HTTP/2 clients get `GOAWAY` and reconnect, HTTP/1.1 responses close a share of the
//! connections, gRPC refusals say "do not retry" and the library's client does not.
//!
//! The overload is driven, not timed: a gate of one place is held by a request that waits
//! for the test, so every other request is refused at once (no budget to wait), and the
//! shedding window counts it as sustained from the first refusal on (no sustain time, an
//! hour-long window). The push-away interval is an hour too, so each test's share of pushes
//! is exact however slow the machine.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use backstop::admission::{Gate, Shedding, SheddingConfig};
use backstop::client::connect;
use backstop::client::retry::RetryStopped;
use backstop::client::{ClientStack, Destination};
use backstop::observe::{self, label, protocol};
use backstop::policy::{Idempotency, MethodPolicy};
use backstop::retry::StopReason;
use backstop::server::concurrency::GateLayer;
use backstop::server::listen::{ConnectionInfo, ListenConfig, Listener, PushAway};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, oneshot};
use tower::{ServiceBuilder, ServiceExt};

const HOUR: Duration = Duration::from_secs(3600);

/// Shedding counted as sustained from the first refusal, or (`never`) not at all.
fn shedding(never: bool) -> Shedding {
    Shedding::new(SheddingConfig {
        window: HOUR,
        threshold: if never { 1.0 } else { 0.0 },
        sustain: Duration::ZERO,
        min_requests: 1,
    })
    .unwrap()
}

/// A listener in front of a gate of one place and a tiny handler: `/hold` answers once the
/// test releases it, anything else at once.
struct Server {
    addr: SocketAddr,
    /// A permit per `/hold` request that entered the handler.
    entered: Arc<Semaphore>,
    /// A permit per `/hold` request allowed to answer.
    release: Arc<Semaphore>,
    /// The peer of every request that reached the listener, refused or not.
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    _stop: oneshot::Sender<()>,
}

impl Server {
    async fn start(name: &str, shedding: Shedding, share: f64) -> Server {
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = tcp.local_addr().unwrap();
        let gate = Gate::new(1, Duration::from_millis(1))
            .with_retry_after(Duration::from_millis(10))
            .with_shedding(shedding.clone());
        let entered = Arc::new(Semaphore::new(0));
        let release = Arc::new(Semaphore::new(0));
        let peers = Arc::new(Mutex::new(Vec::new()));
        let handler = {
            let (entered, release) = (Arc::clone(&entered), Arc::clone(&release));
            tower::service_fn(move |request: Request<Incoming>| {
                let (entered, release) = (Arc::clone(&entered), Arc::clone(&release));
                async move {
                    if request.uri().path() == "/hold" {
                        entered.add_permits(1);
                        release.acquire().await.unwrap().forget();
                    }
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                }
            })
        };
        let service = ServiceBuilder::new()
            .map_request({
                let peers = Arc::clone(&peers);
                move |request: Request<Incoming>| {
                    let info = request.extensions().get::<ConnectionInfo>().unwrap();
                    peers.lock().unwrap().push(info.peer());
                    request
                }
            })
            // No budget to wait: a request finding the place taken is refused at once.
            .layer(GateLayer::new(gate).default_timeout(Duration::ZERO))
            .service(handler);
        let mut config = ListenConfig::default();
        config.push_away = Some(
            PushAway::new(shedding)
                .with_share(share)
                .unwrap()
                .with_interval(HOUR)
                .unwrap(),
        );
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(Listener::new(name, tcp, config).serve(service, async move {
            let _ = stopped.await;
        }));
        Server {
            addr,
            entered,
            release,
            peers,
            _stop: stop,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Distinct connections requests came on so far.
    fn connections(&self) -> usize {
        let mut peers = self.peers.lock().unwrap().clone();
        peers.sort();
        peers.dedup();
        peers.len()
    }
}

/// The metrics recorder of this test binary; each test's listener has its own name.
fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().unwrap();
        snapshotter
    })
}

/// `rpc_server_connections_pushed_total{service, protocol}` so far. A snapshot takes the
/// counters' increments since the last one, of every test: they are added up here.
fn pushed(service: &str, proto: &str) -> u64 {
    static TOTALS: Mutex<Vec<(String, String, u64)>> = Mutex::new(Vec::new());
    let mut totals = TOTALS.lock().unwrap();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let key = key.key();
        if key.name() != observe::RPC_SERVER_CONNECTIONS_PUSHED_TOTAL {
            continue;
        }
        let label = |name: &str| {
            key.labels()
                .find(|l| l.key() == name)
                .map(|l| l.value().to_owned())
                .unwrap_or_default()
        };
        let DebugValue::Counter(n) = value else {
            panic!("{value:?}");
        };
        let (s, p) = (label(label::SERVICE), label(label::PROTOCOL));
        match totals.iter_mut().find(|(ts, tp, _)| *ts == s && *tp == p) {
            Some(total) => total.2 += n,
            None => totals.push((s, p, n)),
        }
    }
    totals
        .iter()
        .filter(|(s, p, _)| s == service && p == proto)
        .map(|(_, _, n)| n)
        .sum()
}

fn get(url: &str) -> Request<Full<Bytes>> {
    Request::get(url).body(Full::new(Bytes::new())).unwrap()
}

// On one thread, as in `transparent_h2`: hyper's HTTP/2 client then handles the `GOAWAY`
// before the test's next request, never in between.
#[tokio::test(flavor = "current_thread")]
async fn http2_clients_get_goaway_finish_their_requests_and_reconnect() {
    snapshotter();
    let server = Server::start("push-h2", shedding(false), 0.1).await;
    let client = connect::pooled::<Full<Bytes>>(true);

    // A request holds the gate's only place.
    let held = tokio::spawn(client.request(get(&server.url("/hold"))));
    server.entered.acquire().await.unwrap().forget();
    // The next is refused, and the overload is sustained: its connection is pushed away.
    let refused = client.request(get(&server.url("/work"))).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(refused.headers().contains_key(http::header::RETRY_AFTER));
    assert!(!refused.headers().contains_key(http::header::CONNECTION));
    assert_eq!(pushed("push-h2", protocol::HTTP2), 1);
    assert_eq!(server.connections(), 1, "both requests on one connection");

    // The request in flight on the pushed connection finishes.
    server.release.add_permits(1);
    let held = held.await.unwrap().unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    assert_eq!(held.into_body().collect().await.unwrap().to_bytes(), "ok");

    // The client's next requests go on a new connection, and are served.
    for _ in 0..3 {
        let next = client.request(get(&server.url("/work"))).await.unwrap();
        assert_eq!(next.status(), StatusCode::OK);
    }
    assert_eq!(server.connections(), 2, "one new connection");
    assert_eq!(
        pushed("push-h2", protocol::HTTP2),
        1,
        "the interval's share is spent"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn the_goaway_ends_the_connection_once_its_streams_finish() {
    let server = Server::start("push-h2-raw", shedding(false), 1.0).await;
    let tcp = TcpStream::connect(server.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let conn = tokio::spawn(conn);
    let held = tokio::spawn(send.send_request(get(&server.url("/hold"))));
    server.entered.acquire().await.unwrap().forget();
    let refused = send.send_request(get(&server.url("/work"))).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);

    server.release.add_permits(1);
    let held = held.await.unwrap().unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    // The server ends the connection gracefully: the client's side ends without an error.
    conn.await.unwrap().unwrap();
}

/// A request on each connection, one at a time (the gate's place is free again before the
/// next): the status of each answer, and whether it closes its connection.
async fn round(
    server: &Server,
    conns: &mut [hyper::client::conn::http1::SendRequest<Full<Bytes>>],
) -> Vec<(StatusCode, bool)> {
    let mut answers = Vec::new();
    for send in conns {
        let response = send.send_request(get(&server.url("/work"))).await.unwrap();
        let close = response
            .headers()
            .get(http::header::CONNECTION)
            .is_some_and(|v| v == "close");
        let status = response.status();
        response.into_body().collect().await.unwrap();
        answers.push((status, close));
    }
    answers
}

#[tokio::test(flavor = "current_thread")]
async fn http1_responses_close_a_share_of_the_connections_only_under_sustained_overload() {
    snapshotter();
    let server = Server::start("push-h1", shedding(false), 0.1).await;
    // Ten keep-alive connections.
    let mut conns = Vec::new();
    for _ in 0..10 {
        let tcp = TcpStream::connect(server.addr).await.unwrap();
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .unwrap();
        tokio::spawn(conn);
        conns.push(send);
    }

    // Not overloaded: served, every connection kept.
    for _ in 0..3 {
        let answers = round(&server, &mut conns).await;
        assert!(
            answers.iter().all(|&a| a == (StatusCode::OK, false)),
            "{answers:?}"
        );
    }
    assert_eq!(pushed("push-h1", protocol::HTTP1), 0);

    // Overloaded: the gate held, every request refused; a tenth of the 11 connections (one)
    // is told to close.
    let hold = {
        let tcp = TcpStream::connect(server.addr).await.unwrap();
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .unwrap();
        tokio::spawn(conn);
        tokio::spawn(send.send_request(get(&server.url("/hold"))))
    };
    server.entered.acquire().await.unwrap().forget();
    let answers = round(&server, &mut conns).await;
    assert!(
        answers
            .iter()
            .all(|&(s, _)| s == StatusCode::SERVICE_UNAVAILABLE),
        "{answers:?}"
    );
    let closed: Vec<usize> = (0..answers.len()).filter(|&i| answers[i].1).collect();
    assert_eq!(closed, [0], "{answers:?}");
    assert_eq!(pushed("push-h1", protocol::HTTP1), 1);
    // The pushed connection is closed; the others still serve.
    conns[0].ready().await.unwrap_err();
    server.release.add_permits(1);
    assert_eq!(hold.await.unwrap().unwrap().status(), StatusCode::OK);
}

/// A gRPC call through the library's client stack: three attempts allowed.
fn grpc_stack() -> ClientStack {
    let policy = MethodPolicy::builder("Charge", Idempotency::Safe)
        .timeout(Duration::from_secs(30))
        .max_attempts(3)
        .build();
    ClientStack::builder(&Destination::new("push-grpc"), policy)
        .build()
        .unwrap()
}

fn grpc_call(server: &Server) -> Request<Full<Bytes>> {
    Request::post(server.url("/payment.v1.Payment/GetCharge"))
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from_static(&[0, 0, 0, 0, 0])))
        .unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn grpc_refusals_under_sustained_overload_say_do_not_retry_and_are_not_retried() {
    for sustained in [false, true] {
        let server = Server::start("push-grpc", shedding(!sustained), 0.1).await;
        let raw = connect::pooled::<Full<Bytes>>(true);
        let held = tokio::spawn(raw.request(get(&server.url("/hold"))));
        server.entered.acquire().await.unwrap().forget();
        let before = server.peers.lock().unwrap().len();

        let refused = raw.request(grpc_call(&server)).await.unwrap();
        assert_eq!(refused.headers()["grpc-status"], "14");
        let pushback = refused.headers()["grpc-retry-pushback-ms"]
            .to_str()
            .unwrap();
        if sustained {
            assert_eq!(pushback, "-1", "do not retry");
        } else {
            assert!(pushback.parse::<u64>().is_ok(), "retry later: {pushback}");
        }

        let stack = grpc_stack();
        let client = stack.http2();
        let answer = client.oneshot(grpc_call(&server)).await;
        let stopped = match &answer {
            Ok(response) => response.extensions().get::<RetryStopped>().cloned(),
            Err(error) => panic!("{error}"),
        }
        .expect("a refusal says why the client stopped");
        // The raw call, then the client's attempts.
        let attempts = server.peers.lock().unwrap().len() - before - 1;
        if sustained {
            assert_eq!((stopped.attempts, attempts), (1, 1), "{stopped:?}");
            assert_eq!(stopped.reason, StopReason::Pushback);
        } else {
            assert_eq!((stopped.attempts, attempts), (3, 3), "{stopped:?}");
        }
        server.release.add_permits(1);
        assert_eq!(held.await.unwrap().unwrap().status(), StatusCode::OK);
    }
}
