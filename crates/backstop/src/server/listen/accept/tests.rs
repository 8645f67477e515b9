//! The accept loop: both protocols on one port, and the drain at shutdown.

use std::sync::atomic::Ordering;
use std::time::Duration;

use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::server::listen::ListenConfig;
use crate::server::listen::test_support::{closed_without_answer, http1_get, start};

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
