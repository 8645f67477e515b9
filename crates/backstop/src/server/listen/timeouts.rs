//! The timers of one connection: the header read timeout, which starts at the first byte of a
//! request head (seen on the socket), and the idle timeout.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::ConnState;

impl ConnState {
    /// Bytes arrived: when no request is in flight they start a request head.
    fn bytes_read(&self, first: &[u8], first_read: bool) {
        if first_read && first.starts_with(HTTP2_PREFACE_START) {
            self.http2.store(true, Ordering::Relaxed);
        }
        if self.http2.load(Ordering::Relaxed) || self.in_flight.load(Ordering::Acquire) > 0 {
            return;
        }
        let since = u64::try_from(self.opened.elapsed().as_millis())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1);
        if self
            .head_since
            .compare_exchange(0, since, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.head_started.notify_one();
        }
    }
}

/// How an HTTP/2 connection with prior knowledge starts (`PRI * HTTP/2.0`).
const HTTP2_PREFACE_START: &[u8] = b"PRI ";

/// Resolves once a request head has taken longer than `timeout` since its first byte.
pub(super) async fn head_too_slow(conn: &ConnState, timeout: Duration) {
    loop {
        conn.head_started.notified().await;
        loop {
            let since = conn.head_since.load(Ordering::Acquire);
            if since == 0 {
                // The request started: wait for the next head.
                break;
            }
            let started = conn.opened + Duration::from_millis(since - 1);
            tokio::time::sleep_until(started + timeout).await;
            if conn.head_since.load(Ordering::Acquire) == since {
                return;
            }
        }
    }
}

/// Resolves once the connection has had no request in flight and none started for a whole
/// `idle_timeout`.
pub(super) async fn idle_for(conn: &ConnState, idle_timeout: Duration) {
    let mut seen = conn.started.load(Ordering::Relaxed);
    loop {
        tokio::time::sleep(idle_timeout).await;
        let started = conn.started.load(Ordering::Relaxed);
        if started == seen && conn.in_flight.load(Ordering::Acquire) == 0 {
            return;
        }
        seen = started;
    }
}

pin_project! {
    /// The connection's socket, telling its state when the bytes of a request head arrive.
    pub(super) struct ReadWatch {
        #[pin]
        pub(super) stream: TcpStream,
        pub(super) conn: Arc<ConnState>,
        pub(super) first_read: bool,
    }
}

impl AsyncRead for ReadWatch {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        ready!(this.stream.poll_read(cx, buf))?;
        let read = &buf.filled()[before..];
        if !read.is_empty() {
            this.conn.bytes_read(read, *this.first_read);
            *this.first_read = false;
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for ReadWatch {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.project().stream.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.project().stream.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().stream.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().stream.poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
