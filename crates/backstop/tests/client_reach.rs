//! Whether a failed call may have reached the server ([`Reach`]), against real sockets on
//! 127.0.0.1: a port nobody listens on, a server that reads the request and hangs up, one that
//! answers 503.
//!
//! Nothing here asserts on durations: every server either answers at once or closes.

use std::net::SocketAddr;
use std::time::Duration;

use backstop::client::retry::RetryStopped;
use backstop::client::{ClientStack, Destination, Error, Reach};
use backstop::policy::{Idempotency, MethodPolicy};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

/// A `Safe` method: retried on every transport failure.
fn get() -> MethodPolicy {
    MethodPolicy::builder("Get", Idempotency::Safe)
        .timeout(Duration::from_secs(10))
        .build()
}

async fn call(addr: SocketAddr, policy: MethodPolicy) -> Result<http::Response<()>, Error> {
    let client = ClientStack::builder(&Destination::new("peer"), policy)
        .build()
        .unwrap()
        .http();
    let request = Request::get(format!("http://{addr}/x"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = client.oneshot(request).await?;
    Ok(response.map(|_| ()))
}

/// An address on which nothing listens: every connection to it is refused.
async fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

/// Reads one request head from `stream`, then closes it without answering.
async fn read_and_hang_up(mut stream: TcpStream) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test]
async fn a_refused_connection_was_never_sent() {
    let addr = closed_port().await;
    let error = call(addr, get()).await.unwrap_err();
    assert_eq!(error.reach(), Reach::NotSent, "{error}");
    assert!(error.attempts() >= 1, "retried: {error}");
}

#[tokio::test]
async fn a_request_read_and_never_answered_has_an_unknown_outcome() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(read_and_hang_up(stream));
        }
    });
    let once = MethodPolicy::builder("Charge", Idempotency::Unsafe)
        .timeout(Duration::from_secs(10))
        .build();
    let error = call(addr, once).await.unwrap_err();
    assert_eq!(error.reach(), Reach::Unknown, "{error}");
    assert_eq!(error.attempts(), 1);
    // Retried, each attempt read and unanswered: unknown too.
    let error = call(addr, get()).await.unwrap_err();
    assert_eq!(error.reach(), Reach::Unknown, "{error}");
}

#[tokio::test]
async fn a_503_after_the_last_retry_was_answered() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                // One request per connection: answer each and close.
                if stream.read(&mut buf).await.is_ok_and(|n| n > 0) {
                    let answer = "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\
                                  connection: close\r\n\r\n";
                    let _ = stream.write_all(answer.as_bytes()).await;
                }
            });
        }
    });
    let response = call(addr, get()).await.unwrap();
    assert_eq!(response.status(), 503);
    let stopped = *response.extensions().get::<RetryStopped>().unwrap();
    assert!(stopped.attempts > 1, "retried: {stopped:?}");
    assert_eq!(stopped.reach, Reach::Answered);
    let error = Error::for_status(response).unwrap_err();
    assert_eq!(error.reach(), Reach::Answered);
}

/// The call's reach is the least known of any attempt: a first attempt read and never
/// answered, then retries refused at connect (the server is gone), is unknown, not "never
/// sent" as the last attempt alone would say.
#[tokio::test]
async fn a_sent_attempt_followed_by_refused_retries_is_unknown() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        // Gone before hanging up: every later connection is refused.
        drop(listener);
        read_and_hang_up(stream).await;
    });
    let error = call(addr, get()).await.unwrap_err();
    assert!(error.attempts() >= 2, "retried: {error}");
    assert_eq!(error.reach(), Reach::Unknown, "{error}");
}
