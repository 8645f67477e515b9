//! `examples/streaming_gateway.rs` over real sockets: a gateway written with the client stack
//! that streams its caller's body to an upstream answers a caller whose body breaks on the
//! way in with that caller's 4xx, and the upstream's circuit breaker never hears of it.

#[path = "../examples/streaming_gateway.rs"]
#[allow(dead_code)]
mod example;

use backstop::client::Destination;
use backstop::client::breaker::BreakerState;

use self::example::{BROKEN_ORDER, ORDER, gateway, send_raw, upstream};

/// An order whose body announces 100 bytes and brings 10 before its sender half-closes.
async fn cut_short(addr: std::net::SocketAddr) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(
        b"POST /v1/orders HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n\
content-length: 100\r\n\r\n{\"a\":1234",
    )
    .await
    .unwrap();
    tcp.shutdown().await.unwrap();
    let mut answer = Vec::new();
    tcp.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text.split(' ').nth(1).unwrap().parse().unwrap();
    (status, text)
}

#[tokio::test]
async fn broken_caller_bodies_are_4xx_and_leave_the_upstreams_breaker_closed() {
    let destination = Destination::new("orders");
    let breaker = destination.circuit_breaker().unwrap().clone();
    let gateway = gateway(upstream().await.unwrap(), &destination)
        .await
        .unwrap();
    assert_eq!(send_raw(gateway, ORDER).await.unwrap().0, 201);

    // More than the breaker's 20 failures, had they counted against the upstream.
    for _ in 0..25 {
        let (status, body) = send_raw(gateway, BROKEN_ORDER).await.unwrap();
        assert_eq!(status, 400, "{body}");
        assert!(body.contains(r#""code":"request_body_invalid""#), "{body}");
        let (status, text) = cut_short(gateway).await;
        assert_eq!(status, 400, "{text}");
        assert!(text.contains("request_body_invalid"), "{text}");
    }
    assert_eq!(breaker.state(), BreakerState::Closed);
    for _ in 0..10 {
        assert_eq!(send_raw(gateway, ORDER).await.unwrap().0, 201);
    }
    assert_eq!(breaker.state(), BreakerState::Closed);
}
