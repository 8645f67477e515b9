//! A TCP proxy a test controls, to take a database "down" without touching the shared server.

use std::net::SocketAddr;

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
    task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    pub(crate) async fn start(upstream: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (mode, watch) = watch::channel(Mode::Forward);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(serve(client, upstream, watch.clone()));
            }
        });
        TcpProxy { addr, mode, task }
    }

    pub(crate) fn port(&self) -> u16 {
        self.addr.port()
    }

    pub(crate) fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.mode.send_replace(Mode::Down);
    }
}

async fn serve(mut client: TcpStream, upstream: SocketAddr, mut mode: watch::Receiver<Mode>) {
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
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = async {
            while mode.changed().await.is_ok() {
                if *mode.borrow() != Mode::Forward {
                    break;
                }
            }
        } => {
            if *mode.borrow() == Mode::Silent {
                // Keep both sockets open, forwarding nothing, until the mode changes again.
                let _ = mode.changed().await;
            }
        }
    }
}
