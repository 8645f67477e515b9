//! The connection cap: eviction of idle connections, refusal when all are busy, and the
//! backlog wait while evicted connections close.

use std::convert::Infallible;

use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use crate::server::listen::test_support::{closed_without_answer, http1_get, start};
use crate::server::listen::{ListenConfig, Listener};

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
