//! One connection's task: closed from a request, and ended at once by a drain when it has no
//! request to finish.

use std::convert::Infallible;

use http::{Request, Response};
use http_body_util::Empty;
use hyper::body::Incoming;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::server::listen::test_support::{closed_without_answer, http1_get, start};
use crate::server::listen::{ConnectionInfo, ListenConfig, Listener};

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
