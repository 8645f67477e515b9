//! Transparent retry over real HTTP/2 connections: the errors that prove a request never
//! reached the server, produced by a server on 127.0.0.1:0 that writes the frames itself, and
//! seen through the pooled hyper-util client below the client stack.
//!
//! The server is a few dozen lines of raw frames (client preface, SETTINGS and its ACK,
//! HEADERS answered `:status 200`), so that it can do exactly what a real server does when it
//! goes away or refuses a stream, at a chosen request, and nothing else. Every assertion is
//! about what the servers saw and what the transport was asked to send: nothing is timed.
//!
//! The tests run on tokio's current-thread runtime on purpose. On a multi-thread runtime,
//! hyper's HTTP/2 client can see the connection's `GOAWAY` in the readiness check it makes
//! right after handing a request to h2, and then fails that request with the `GOAWAY` error
//! whatever its stream id: a request at or below `last_stream_id`, which the server may
//! process, is then taken for one that never reached it (about 1 run in 100 of the last two
//! tests, run multi-threaded). On one thread the connection task cannot run in between.

use std::collections::HashSet;
use std::error::Error as StdError;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backstop::client::connect::{self, Endpoint};
use backstop::client::replay::ReplayBody;
use backstop::client::retry::RetryStopped;
use backstop::client::transparent::never_sent;
use backstop::client::{ClientStack, Destination};
use backstop::policy::{Idempotency, KEY_TTL_PAYMENTS, MethodPolicy};
use bytes::Bytes;
use http::{Request, StatusCode, Uri};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::util::BoxCloneService;
use tower::{BoxError, ServiceExt, service_fn};

type Body = ReplayBody<Full<Bytes>>;

// ---- a raw-frame HTTP/2 server (RFC 9113) ----

const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;

const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

const NO_ERROR: u32 = 0x0;
const REFUSED_STREAM: u32 = 0x7;

/// HPACK: `:status 200` is entry 8 of the static table, one byte when indexed.
const STATUS_200: &[u8] = &[0x88];

/// What the server does with the one request it misbehaves on.
#[derive(Debug, Clone, Copy)]
enum Misbehaviour {
    /// `GOAWAY` whose last stream id is the one before this stream (N - 2, or 0 for the
    /// first), then the connection closes: this stream was provably never processed.
    GoAwayBelow,
    /// `RST_STREAM` with `REFUSED_STREAM`; the connection stays up.
    RefuseStream,
    /// `GOAWAY` whose last stream id is this stream, then the connection closes without an
    /// answer: the request may have been processed.
    GoAwayAtThenClose,
}

/// One raw HTTP/2 server: answers every request `200` except the `misbehave_on`th (counted
/// from 1 over all its connections), which gets the misbehaviour.
#[derive(Debug, Clone)]
struct RawServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    misbehave: Option<(usize, Misbehaviour)>,
    /// Requests seen (HEADERS frames opening a stream).
    requests: AtomicUsize,
    /// Connections accepted.
    connections: AtomicUsize,
    /// The stream id of each request, in order.
    streams: Mutex<Vec<u32>>,
}

impl RawServer {
    async fn start(misbehave: Option<(usize, Misbehaviour)>) -> RawServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            misbehave,
            requests: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            streams: Mutex::new(Vec::new()),
        });
        let server = shared.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                server.connections.fetch_add(1, Ordering::SeqCst);
                let server = server.clone();
                tokio::spawn(async move {
                    // A client that goes away mid-frame ends its connection, nothing more.
                    let _ = serve_connection(socket, &server).await;
                });
            }
        });
        RawServer { addr, shared }
    }

    fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    fn streams(&self) -> Vec<u32> {
        self.shared.streams.lock().unwrap().clone()
    }

    fn uri(&self) -> Uri {
        format!("http://{}", self.addr).parse().unwrap()
    }
}

struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

/// The next frame, or `None` at a clean end of the connection.
async fn read_frame(socket: &mut TcpStream) -> io::Result<Option<Frame>> {
    let mut head = [0u8; 9];
    match socket.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0; len];
    socket.read_exact(&mut payload).await?;
    Ok(Some(Frame {
        kind: head[3],
        flags: head[4],
        stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
        payload,
    }))
}

async fn write_frame(
    socket: &mut TcpStream,
    kind: u8,
    flags: u8,
    stream: u32,
    payload: &[u8],
) -> io::Result<()> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut frame = Vec::with_capacity(9 + payload.len());
    frame.extend_from_slice(&len[1..]);
    frame.push(kind);
    frame.push(flags);
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    socket.write_all(&frame).await
}

async fn go_away(socket: &mut TcpStream, last_stream_id: u32) -> io::Result<()> {
    let mut payload = last_stream_id.to_be_bytes().to_vec();
    payload.extend_from_slice(&NO_ERROR.to_be_bytes());
    write_frame(socket, GOAWAY, 0, 0, &payload).await
}

/// Closes the connection the way a server going away does: FIN after the last frame, then
/// reading until the client closes too, so the kernel never turns unread bytes into a reset
/// that could overtake the `GOAWAY`.
async fn close(mut socket: TcpStream) -> io::Result<()> {
    socket.shutdown().await?;
    let mut sink = [0u8; 1024];
    while socket.read(&mut sink).await? > 0 {}
    Ok(())
}

async fn serve_connection(mut socket: TcpStream, server: &Shared) -> io::Result<()> {
    let mut preface = [0u8; 24];
    socket.read_exact(&mut preface).await?;
    assert_eq!(&preface, PREFACE, "an HTTP/2 client preface");
    write_frame(&mut socket, SETTINGS, 0, 0, &[]).await?;
    // Streams answered once their request ends (a refused stream is not among them).
    let mut open = HashSet::new();
    while let Some(frame) = read_frame(&mut socket).await? {
        match frame.kind {
            SETTINGS if frame.flags & ACK == 0 => {
                write_frame(&mut socket, SETTINGS, ACK, 0, &[]).await?;
            }
            PING if frame.flags & ACK == 0 => {
                write_frame(&mut socket, PING, ACK, 0, &frame.payload).await?;
            }
            HEADERS => {
                let n = server.requests.fetch_add(1, Ordering::SeqCst) + 1;
                server.streams.lock().unwrap().push(frame.stream);
                let misbehaviour = server
                    .misbehave
                    .and_then(|(on, how)| (on == n).then_some(how));
                match misbehaviour {
                    None => {
                        open.insert(frame.stream);
                    }
                    Some(Misbehaviour::RefuseStream) => {
                        let code = REFUSED_STREAM.to_be_bytes();
                        write_frame(&mut socket, RST_STREAM, 0, frame.stream, &code).await?;
                        continue;
                    }
                    Some(Misbehaviour::GoAwayBelow) => {
                        go_away(&mut socket, frame.stream.saturating_sub(2)).await?;
                        return close(socket).await;
                    }
                    Some(Misbehaviour::GoAwayAtThenClose) => {
                        go_away(&mut socket, frame.stream).await?;
                        return close(socket).await;
                    }
                }
                if frame.flags & END_STREAM != 0 && open.remove(&frame.stream) {
                    answer(&mut socket, frame.stream).await?;
                }
            }
            DATA if frame.flags & END_STREAM != 0 && open.remove(&frame.stream) => {
                answer(&mut socket, frame.stream).await?;
            }
            _ => {}
        }
    }
    Ok(())
}

async fn answer(socket: &mut TcpStream, stream: u32) -> io::Result<()> {
    write_frame(
        socket,
        HEADERS,
        END_HEADERS | END_STREAM,
        stream,
        STATUS_200,
    )
    .await
}

// ---- the transport below the stack ----

/// How one send below the stack failed, read off the error's `source()` chain.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failure {
    never_sent: bool,
    /// The HTTP/2 error code, when the failure is an HTTP/2 error carrying one.
    reason: Option<h2::Reason>,
    /// Whether the peer's `GOAWAY` failed the stream.
    remote_go_away: bool,
}

impl Failure {
    fn of(error: &(dyn StdError + 'static)) -> Failure {
        let mut h2 = None;
        let mut cause = Some(error);
        while let Some(e) = cause {
            if let Some(e) = e.downcast_ref::<h2::Error>() {
                h2 = Some(e);
                break;
            }
            cause = e.source();
        }
        Failure {
            never_sent: never_sent(error),
            reason: h2.and_then(h2::Error::reason),
            remote_go_away: h2.is_some_and(|e| e.is_go_away() && e.is_remote()),
        }
    }
}

/// Every send the transport was asked for, and how the failed ones failed.
#[derive(Debug, Clone, Default)]
struct Sends {
    sent: Arc<AtomicUsize>,
    failures: Arc<Mutex<Vec<Failure>>>,
}

impl Sends {
    fn sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }

    fn failures(&self) -> Vec<Failure> {
        self.failures.lock().unwrap().clone()
    }
}

type SendFuture = Pin<Box<dyn Future<Output = Result<http::Response<Incoming>, BoxError>> + Send>>;

/// An HTTP/2 pooled client sending the first `first_sends` sends to `first` and the rest to
/// `then`, as a balancer turns away from an endpoint that went away. With `first == then`,
/// every send shares the one connection the pool keeps to it.
fn transport(
    first: &RawServer,
    first_sends: usize,
    then: &RawServer,
    sends: &Sends,
) -> BoxCloneService<Request<Body>, http::Response<Incoming>, BoxError> {
    let client = connect::pooled::<Body>(true);
    let first = Endpoint::new(client.clone(), &first.uri()).unwrap();
    let then = Endpoint::new(client, &then.uri()).unwrap();
    let sends = sends.clone();
    BoxCloneService::new(service_fn(move |request: Request<Body>| {
        let n = sends.sent.fetch_add(1, Ordering::SeqCst);
        let target = if n < first_sends {
            first.clone()
        } else {
            then.clone()
        };
        let sends = sends.clone();
        let send: SendFuture = Box::pin(async move {
            let result = target.oneshot(request).await.map_err(BoxError::from);
            if let Err(error) = &result {
                sends.failures.lock().unwrap().push(Failure::of(&**error));
            }
            result
        });
        send
    }))
}

/// `Charge`, keyed, with one attempt: only a transparent re-send can get past a failure.
fn charge_once() -> MethodPolicy {
    MethodPolicy::builder("Charge", Idempotency::Keyed)
        .timeout(Duration::from_secs(10))
        .key_ttl(KEY_TTL_PAYMENTS)
        .max_attempts(1)
        .build()
}

fn post_charge() -> Request<Full<Bytes>> {
    Request::post("http://payments/v1/payments")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"order_id":"o-1","amount_cents":100}"#,
        )))
        .unwrap()
}

/// Tokens in a fresh destination's budget (the default burst).
const FULL_BUDGET: f64 = 20.0;

// ---- a stream the server never processed is sent again, once ----

#[tokio::test]
async fn goaway_below_the_stream_is_sent_again_to_another_endpoint() {
    // The first request on the connection is answered; the second, on stream 3, is told the
    // server stopped at stream 1, and the connection closes.
    let going = RawServer::start(Some((2, Misbehaviour::GoAwayBelow))).await;
    let other = RawServer::start(None).await;
    let sends = Sends::default();
    let payments = Destination::new("payments");
    let svc = ClientStack::builder(&payments, charge_once())
        .build()
        .unwrap()
        .layer(transport(&going, 2, &other, &sends));

    let warm = svc.clone().oneshot(post_charge()).await.unwrap();
    assert_eq!(warm.status(), StatusCode::OK);
    assert_eq!(payments.spend().retry_budget().available(), FULL_BUDGET);

    let response = svc.oneshot(post_charge()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // Stream 3 came after the GOAWAY's last stream id (1): h2 reports it as the peer's
    // GOAWAY, which proves the server never processed it.
    assert_eq!(going.streams(), [1, 3], "two requests on one connection");
    assert_eq!(
        sends.failures(),
        [Failure {
            never_sent: true,
            reason: Some(h2::Reason::NO_ERROR),
            remote_go_away: true,
        }]
    );
    // Sent again once, to the other endpoint, which answered.
    assert_eq!(sends.sent(), 3);
    assert_eq!(other.requests(), 1);
    // With one attempt allowed, the re-send was not an attempt: no retry stopped, and it was
    // paid with one token of the destination's budget.
    assert!(response.extensions().get::<RetryStopped>().is_none());
    assert_eq!(
        payments.spend().retry_budget().available(),
        FULL_BUDGET - 1.0
    );
}

#[tokio::test]
async fn goaway_on_the_first_stream_is_sent_again_to_another_endpoint() {
    // GOAWAY with last stream id 0: the server processed nothing on this connection.
    let going = RawServer::start(Some((1, Misbehaviour::GoAwayBelow))).await;
    let other = RawServer::start(None).await;
    let sends = Sends::default();
    let payments = Destination::new("payments");
    let svc = ClientStack::builder(&payments, charge_once())
        .build()
        .unwrap()
        .layer(transport(&going, 1, &other, &sends));

    let response = svc.oneshot(post_charge()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(going.streams(), [1]);
    assert_eq!(sends.failures().len(), 1);
    assert!(sends.failures()[0].never_sent && sends.failures()[0].remote_go_away);
    assert_eq!((sends.sent(), other.requests()), (2, 1));
    assert!(response.extensions().get::<RetryStopped>().is_none());
    assert_eq!(
        payments.spend().retry_budget().available(),
        FULL_BUDGET - 1.0
    );
}

#[tokio::test]
async fn goaway_below_the_stream_is_sent_again_on_a_new_connection() {
    // One endpoint: the pool drops the connection that went away and dials a new one, on
    // which the server answers.
    let server = RawServer::start(Some((2, Misbehaviour::GoAwayBelow))).await;
    let sends = Sends::default();
    let payments = Destination::new("payments");
    let svc = ClientStack::builder(&payments, charge_once())
        .build()
        .unwrap()
        .layer(transport(&server, 0, &server, &sends));

    let warm = svc.clone().oneshot(post_charge()).await.unwrap();
    assert_eq!(warm.status(), StatusCode::OK);
    let response = svc.oneshot(post_charge()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(sends.failures().len(), 1);
    assert!(sends.failures()[0].never_sent && sends.failures()[0].remote_go_away);
    assert_eq!(sends.sent(), 3);
    // Streams 1 and 3 on the first connection, the re-send on stream 1 of the second.
    assert_eq!(server.streams(), [1, 3, 1]);
    assert_eq!(server.connections(), 2);
    assert!(response.extensions().get::<RetryStopped>().is_none());
    assert_eq!(
        payments.spend().retry_budget().available(),
        FULL_BUDGET - 1.0
    );
}

#[tokio::test]
async fn a_refused_stream_is_sent_again_on_the_same_connection() {
    let server = RawServer::start(Some((1, Misbehaviour::RefuseStream))).await;
    let sends = Sends::default();
    let payments = Destination::new("payments");
    let svc = ClientStack::builder(&payments, charge_once())
        .build()
        .unwrap()
        .layer(transport(&server, 1, &server, &sends));

    let response = svc.oneshot(post_charge()).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        sends.failures(),
        [Failure {
            never_sent: true,
            reason: Some(h2::Reason::REFUSED_STREAM),
            remote_go_away: false,
        }]
    );
    // The refused stream 1 and its re-send on stream 3 of the same connection.
    assert_eq!(sends.sent(), 2);
    assert_eq!(server.streams(), [1, 3]);
    assert_eq!(server.connections(), 1);
    assert!(response.extensions().get::<RetryStopped>().is_none());
    assert_eq!(
        payments.spend().retry_budget().available(),
        FULL_BUDGET - 1.0
    );
}

// ---- a stream the server may have processed is not ----

/// A server that names the request's stream as processed in its `GOAWAY` and closes without
/// answering; returns the call's result, the going server, the other one and the sends.
async fn goaway_at_the_stream(
    contract: MethodPolicy,
    destination: &Destination,
) -> (
    Result<http::Response<Incoming>, BoxError>,
    RawServer,
    RawServer,
    Sends,
) {
    let going = RawServer::start(Some((1, Misbehaviour::GoAwayAtThenClose))).await;
    let other = RawServer::start(None).await;
    let sends = Sends::default();
    let svc = ClientStack::builder(destination, contract)
        .build()
        .unwrap()
        .layer(transport(&going, 1, &other, &sends));
    let result = svc.oneshot(post_charge()).await.map_err(BoxError::from);
    (result, going, other, sends)
}

#[tokio::test]
async fn goaway_at_the_stream_then_close_is_not_sent_again_for_an_unsafe_method() {
    // An unsafe call's body is streamed once, so nothing could re-send it; the failure must
    // still not be taken for one that never reached the server.
    let refund = MethodPolicy::builder("Refund", Idempotency::Unsafe)
        .timeout(Duration::from_secs(10))
        .build();
    let payments = Destination::new("payments");
    let (result, going, other, sends) = goaway_at_the_stream(refund, &payments).await;
    assert!(result.is_err(), "no answer came");
    assert_eq!(going.requests(), 1, "the server saw exactly one request");
    assert_eq!(other.requests(), 0);
    assert_eq!(sends.sent(), 1);
    assert!(!sends.failures()[0].never_sent, "{:?}", sends.failures());
    assert_eq!(payments.spend().retry_budget().available(), FULL_BUDGET);
}

#[tokio::test]
async fn goaway_at_the_stream_then_close_is_not_sent_again_even_when_replayable() {
    // A keyed call's body is kept for replay, so a re-send was possible: what stops it is
    // that the failure does not prove the request unsent.
    let payments = Destination::new("payments");
    let (result, going, other, sends) = goaway_at_the_stream(charge_once(), &payments).await;
    result.expect_err("no answer came");
    assert_eq!(going.requests(), 1, "the server saw exactly one request");
    assert_eq!(other.requests(), 0);
    assert_eq!(sends.sent(), 1);
    // The stream was at the GOAWAY's last stream id, so h2 kept it open; what failed it is
    // the connection closing under it.
    let failure = &sends.failures()[0];
    assert!(
        !failure.never_sent && !failure.remote_go_away,
        "{failure:?}"
    );
    assert_eq!(payments.spend().retry_budget().available(), FULL_BUDGET);
}
