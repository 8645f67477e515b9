//! SIGHUP, watched: how `backstop serve` and `backstop proxy` are told to read their method
//! table again.
//!
//! Watch it before the first address is bound: a SIGHUP's default action ends the process, so
//! one that arrives before the handler is registered would stop a service that already
//! answers.

/// SIGHUP, watched (where there are signals).
#[derive(Debug)]
pub struct Hangups {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangups {
    /// Starts watching; from now on a SIGHUP no longer ends the process. `what` names what a
    /// hangup would reload, for the warning when it cannot be watched.
    pub fn watch(what: &str) -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let signal = signal(SignalKind::hangup())
                .inspect_err(|_| {
                    tracing::warn!("cannot watch SIGHUP: {what} reload only with a restart");
                })
                .ok();
            Self { signal }
        }
        #[cfg(not(unix))]
        {
            let _ = what;
            Self {}
        }
    }

    /// The next SIGHUP; `None` once none can come (not watched, or no signals here).
    pub async fn recv(&mut self) -> Option<()> {
        #[cfg(unix)]
        match &mut self.signal {
            Some(signal) => signal.recv().await,
            None => None,
        }
        #[cfg(not(unix))]
        None
    }
}
