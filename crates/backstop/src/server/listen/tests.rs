use std::convert::Infallible;
use std::sync::atomic::AtomicBool;

use http_body_util::{BodyExt, Empty, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

use hyper_util::rt::TokioExecutor;

use super::*;

/// A running listener whose service answers `hello`, except `/hold`, which waits for `release`
/// (and records its drop in `dropped`).
struct Running {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<()>,
    release: Arc<Notify>,
    entered: Arc<Notify>,
    dropped: Arc<AtomicBool>,
}

struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

async fn start(config: ListenConfig) -> Running {
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let release = Arc::new(Notify::new());
    let entered = Arc::new(Notify::new());
    let dropped = Arc::new(AtomicBool::new(false));
    let service = {
        let release = Arc::clone(&release);
        let entered = Arc::clone(&entered);
        let dropped = Arc::clone(&dropped);
        tower::service_fn(move |request: Request<Incoming>| {
            let release = Arc::clone(&release);
            let entered = Arc::clone(&entered);
            let dropped = Arc::clone(&dropped);
            async move {
                assert!(request.extensions().get::<ConnectionInfo>().is_some());
                if request.uri().path() == "/hold" {
                    let _flag = DropFlag(dropped);
                    entered.notify_one();
                    release.notified().await;
                    std::mem::forget(_flag);
                }
                Ok::<_, Infallible>(Response::new(Full::new(bytes::Bytes::from_static(
                    b"hello",
                ))))
            }
        })
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let served = tokio::spawn(
        Listener::new("test", tcp, config).serve(service, async move {
            let _ = stopped.await;
        }),
    );
    Running {
        addr,
        stop: Some(stop),
        served,
        release,
        entered,
        dropped,
    }
}

impl Running {
    async fn stop(&mut self) {
        let _ = self.stop.take().unwrap().send(());
    }
}

/// Sends one HTTP/1.1 request on a new connection and returns the raw answer.
async fn http1_get(addr: SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer).await;
    answer
}

/// Whether the server closed `stream` (EOF or reset) without sending anything.
async fn closed_without_answer(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(stream.read(&mut buf).await, Ok(0) | Err(_))
}

#[tokio::test]
async fn http1_and_h2c_prior_knowledge_are_served_on_the_same_port() {
    let running = start(ListenConfig::default()).await;
    assert!(http1_get(running.addr, "/").await.ends_with("hello"));

    let stream = TcpStream::connect(running.addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("h2c handshake");
    tokio::spawn(conn);
    let request = Request::get(format!("http://{}/", running.addr))
        .body(Empty::<bytes::Bytes>::new())
        .unwrap();
    let response = send.send_request(request).await.expect("h2 answer");
    assert_eq!(response.version(), http::Version::HTTP_2);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"hello");
}

#[tokio::test(start_paused = true)]
async fn a_request_head_that_never_completes_is_cut_at_the_header_read_timeout() {
    let config = ListenConfig::default();
    let (head_timeout, idle_timeout) = (config.header_read_timeout, config.idle_timeout);
    let running = start(config).await;
    let mut slow = TcpStream::connect(running.addr).await.unwrap();
    let began = tokio::time::Instant::now();
    slow.write_all(b"GET / HTTP/1.1\r\nx-slow: ").await.unwrap();
    // The paused clock jumps to the server's timer: no real waiting.
    assert!(closed_without_answer(&mut slow).await);
    let cut_after = began.elapsed();
    assert!(
        cut_after >= head_timeout && cut_after < idle_timeout,
        "cut by the head timer, after {cut_after:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_idle_keep_alive_connection_outlives_the_header_read_timeout() {
    let config = ListenConfig::default();
    let pause = config.header_read_timeout * 3;
    assert!(pause < config.idle_timeout);
    let running = start(config).await;
    let mut conn = TcpStream::connect(running.addr).await.unwrap();
    let mut buf = vec![0u8; 4096];
    for _ in 0..2 {
        conn.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        while !answer.ends_with(b"hello") {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "answered on the same connection");
            answer.extend_from_slice(&buf[..n]);
        }
        // Longer than a request head may take, shorter than the idle timeout.
        tokio::time::sleep(pause).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_connection_that_sends_nothing_is_closed_when_idle() {
    let running = start(ListenConfig::default()).await;
    let mut silent = TcpStream::connect(running.addr).await.unwrap();
    assert!(closed_without_answer(&mut silent).await);
}

#[tokio::test]
async fn at_the_cap_an_idle_connection_makes_room_for_a_new_client() {
    let config = ListenConfig {
        max_connections: 3,
        ..ListenConfig::default()
    };
    let running = start(config).await;
    // A slow client holds every place with unfinished request heads.
    let mut slow = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(running.addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nx-slow: ").await.unwrap();
        slow.push(s);
    }
    // A well-behaved client still gets its answer, and each time an idle one is closed.
    for _ in 0..3 {
        assert!(http1_get(running.addr, "/").await.ends_with("hello"));
    }
    // The oldest idle connection was the one closed.
    assert!(closed_without_answer(&mut slow[0]).await);
}

#[tokio::test]
async fn a_client_queued_right_behind_a_flood_is_served_not_reset() {
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    // Everything is in the kernel's backlog before the first accept, so the listener takes
    // the flood in one run and the connections it closes to make room have not closed yet
    // when the last client comes up.
    let mut flood = Vec::new();
    for _ in 0..40 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nx-slow: ").await.unwrap();
        flood.push(s);
    }
    let mut client = TcpStream::connect(addr).await.unwrap();
    client
        .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let config = ListenConfig {
        max_connections: 8,
        ..ListenConfig::default()
    };
    let service = tower::service_fn(|_: Request<Incoming>| async {
        Ok::<_, Infallible>(Response::new(Full::new(bytes::Bytes::from_static(
            b"hello",
        ))))
    });
    let (stop, stopped) = oneshot::channel::<()>();
    let served = tokio::spawn(
        Listener::new("test", tcp, config).serve(service, async move {
            let _ = stopped.await;
        }),
    );
    let mut answer = String::new();
    client
        .read_to_string(&mut answer)
        .await
        .expect("answered, not reset");
    assert!(answer.ends_with("hello"), "{answer}");
    let _ = stop.send(());
    served.await.unwrap();
}

#[tokio::test]
async fn at_the_cap_with_every_connection_busy_a_new_one_is_refused_at_once() {
    let config = ListenConfig {
        max_connections: 1,
        ..ListenConfig::default()
    };
    let running = start(config).await;
    let mut busy = TcpStream::connect(running.addr).await.unwrap();
    busy.write_all(b"GET /hold HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    running.entered.notified().await;
    // The only connection is serving a request: the new one finds no idle one to close.
    assert_eq!(http1_get(running.addr, "/").await, "");
    running.release.notify_one();
    let mut answer = String::new();
    busy.read_to_string(&mut answer).await.ok();
    assert!(answer.contains("hello"), "the busy request still finished");
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_accepting_at_once_and_cuts_requests_at_the_drain_bound() {
    let config = ListenConfig {
        drain_timeout: Duration::from_secs(3),
        ..ListenConfig::default()
    };
    let mut running = start(config).await;
    let mut held = TcpStream::connect(running.addr).await.unwrap();
    held.write_all(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    running.entered.notified().await;
    running.stop().await;
    // The listener is closed at once: new connections are refused.
    loop {
        if TcpStream::connect(running.addr).await.is_err() {
            break;
        }
        tokio::task::yield_now().await;
    }
    // The held request never finishes: at the drain bound it is dropped and serve returns.
    (&mut running.served).await.unwrap();
    assert!(
        running.dropped.load(Ordering::SeqCst),
        "the cut request was dropped"
    );
    assert!(closed_without_answer(&mut held).await);
}

#[tokio::test]
async fn close_from_a_request_drops_the_connection_without_an_answer() {
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let service = tower::service_fn(|request: Request<Incoming>| async move {
        request
            .extensions()
            .get::<ConnectionInfo>()
            .unwrap()
            .close();
        std::future::pending::<()>().await;
        Ok::<_, Infallible>(Response::new(Empty::<bytes::Bytes>::new()))
    });
    tokio::spawn(
        Listener::new("test", tcp, ListenConfig::default()).serve(service, std::future::pending()),
    );
    assert_eq!(http1_get(addr, "/").await, "");
}

#[tokio::test(start_paused = true)]
async fn an_http2_request_still_running_at_the_drain_bound_is_dropped() {
    let config = ListenConfig {
        drain_timeout: Duration::from_secs(3),
        ..ListenConfig::default()
    };
    let mut running = start(config).await;
    let stream = TcpStream::connect(running.addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let request = Request::get(format!("http://{}/hold", running.addr))
        .body(Empty::<bytes::Bytes>::new())
        .unwrap();
    let held = tokio::spawn(send.send_request(request));
    running.entered.notified().await;
    running.stop().await;
    // hyper runs each HTTP/2 request on a task of its own: serve returns only once it is gone.
    (&mut running.served).await.unwrap();
    assert!(
        running.dropped.load(Ordering::SeqCst),
        "the request was cut"
    );
    assert!(held.await.unwrap().is_err());
}

#[tokio::test(start_paused = true)]
async fn shutdown_closes_a_connection_with_no_request_started_at_once() {
    let config = ListenConfig::default();
    let drain = config.drain_timeout;
    let mut running = start(config).await;
    let mut slow = TcpStream::connect(running.addr).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nx-slow: ").await.unwrap();
    // Served once: the connection is open and registered.
    assert!(http1_get(running.addr, "/").await.ends_with("hello"));
    let began = tokio::time::Instant::now();
    running.stop().await;
    (&mut running.served).await.unwrap();
    assert!(
        began.elapsed() < drain,
        "no wait for a head that never ends"
    );
    assert!(closed_without_answer(&mut slow).await);
}
