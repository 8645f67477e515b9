//! A TCP proxy a test controls, to take a database "down" without touching the shared server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Forwards both ways.
    Forward,
    /// Closes every connection, and new ones at once: the server is down.
    Down,
    /// Accepts new connections and never answers; established ones go silent: the server hangs.
    Silent,
}

/// A proxy on 127.0.0.1 (port 0) to `upstream`; stops when dropped.
#[derive(Debug)]
pub(crate) struct TcpProxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    forwarding: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    pub(crate) async fn start(upstream: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (mode, watch) = watch::channel(Mode::Forward);
        let forwarding = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&forwarding);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(serve(client, upstream, watch.clone(), Arc::clone(&count)));
            }
        });
        TcpProxy {
            addr,
            mode,
            forwarding,
            task,
        }
    }

    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Switches to `mode`; away from `Forward`, returns once no byte is forwarded any more.
    pub(crate) async fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
        if mode != Mode::Forward {
            while self.forwarding.load(Ordering::SeqCst) > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.mode.send_replace(Mode::Down);
    }
}

async fn serve(
    mut client: TcpStream,
    upstream: SocketAddr,
    mut mode: watch::Receiver<Mode>,
    forwarding: Arc<AtomicUsize>,
) {
    let current = *mode.borrow_and_update();
    match current {
        Mode::Down => return,
        Mode::Silent => {
            // Hold the socket open until the mode changes, then drop it.
            let _ = mode.changed().await;
            return;
        }
        Mode::Forward => {}
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    forwarding.fetch_add(1, Ordering::SeqCst);
    let stopped = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => false,
        _ = async {
            while mode.changed().await.is_ok() {
                if *mode.borrow() != Mode::Forward {
                    break;
                }
            }
        } => true,
    };
    forwarding.fetch_sub(1, Ordering::SeqCst);
    if stopped && *mode.borrow() == Mode::Silent {
        // Keep both sockets open, forwarding nothing, until the mode changes again.
        let _ = mode.changed().await;
    }
}
