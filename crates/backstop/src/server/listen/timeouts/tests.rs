//! The header read and idle timeouts, on a paused clock.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::server::listen::ListenConfig;
use crate::server::listen::test_support::{closed_without_answer, start};

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
