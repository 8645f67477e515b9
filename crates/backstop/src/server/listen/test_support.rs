//! What the listener's tests share: a listener serving a small service, and raw clients.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot};

use super::{ConnectionInfo, ListenConfig, Listener};

/// A running listener whose service answers `hello`, except `/hold`, which waits for `release`
/// (and records its drop in `dropped`).
pub(super) struct Running {
    pub(super) addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    pub(super) served: tokio::task::JoinHandle<()>,
    pub(super) release: Arc<Notify>,
    pub(super) entered: Arc<Notify>,
    pub(super) dropped: Arc<AtomicBool>,
}

struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

pub(super) async fn start(config: ListenConfig) -> Running {
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
    pub(super) async fn stop(&mut self) {
        let _ = self.stop.take().unwrap().send(());
    }
}

/// Sends one HTTP/1.1 request on a new connection and returns the raw answer.
pub(super) async fn http1_get(addr: SocketAddr, path: &str) -> String {
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
pub(super) async fn closed_without_answer(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(stream.read(&mut buf).await, Ok(0) | Err(_))
}
