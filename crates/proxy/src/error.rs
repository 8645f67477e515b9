//! What [`run`](crate::run) returns when it does not serve until shutdown.

use std::error::Error as StdError;
use std::fmt;

/// Why [`run`](crate::run) did not serve until shutdown.
#[derive(Debug)]
pub enum Error {
    /// The flags do not make a proxy (a combination `clap` cannot refuse itself): report it as
    /// `clap` does its own, with the command's usage ([`clap::Error::format`]).
    Usage(clap::Error),
    /// The proxy could not start (an address, the store), or stopped on an error.
    Serve(Box<dyn StdError + Send + Sync>),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Usage(error) => error.fmt(f),
            Error::Serve(error) => error.fmt(f),
        }
    }
}

// Transparent: the inner error's text, then its causes.
impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Error::Usage(error) => error.source(),
            Error::Serve(error) => error.source(),
        }
    }
}
