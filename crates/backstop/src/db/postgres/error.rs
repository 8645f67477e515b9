//! [`Error`]: what can go wrong between this process and PostgreSQL, kept typed so that callers
//! can tell an unavailable database from a statement the database refused.

use std::sync::Arc;

use deadpool_postgres::PoolError;
use tokio_postgres::error::SqlState;

/// Errors of the PostgreSQL plumbing: the pool, the batching writer and [`migrate`].
///
/// [`is_unavailable`](Error::is_unavailable) and [`code`](Error::code) classify an error by
/// type: the database could not be reached (or did not answer), or it answered and refused the
/// statement with a SQLSTATE (a constraint violation, say).
///
/// [`migrate`]: super::migrate
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection URL does not parse.
    #[error("invalid PostgreSQL connection URL")]
    Url(#[source] tokio_postgres::Error),
    /// The pool could not be built.
    #[error("cannot build the PostgreSQL connection pool")]
    Pool(#[source] deadpool_postgres::BuildError),
    /// No connection could be had (the database is down, refused, or the pool stayed busy).
    #[error("no PostgreSQL connection available")]
    Connect(#[source] Arc<PoolError>),
    /// A statement (or its batch's transaction) failed; nothing of it was written. Shared by
    /// every call of a batch whose transaction failed as a whole.
    #[error("PostgreSQL statement failed")]
    Database(#[source] Arc<tokio_postgres::Error>),
    /// The database did not answer in time; the statement may or may not have been applied.
    #[error("PostgreSQL did not answer in time")]
    Timeout,
    /// The request's deadline passed before the statement was sent: nothing was written.
    #[error("the request's deadline passed before the statement was sent")]
    DeadlineExceeded,
    /// The writer tasks have stopped (the runtime is shutting down); nothing was sent.
    #[error("the PostgreSQL writers have stopped")]
    Closed,
    /// A unit of work run in a shared transaction panicked; its writes were rolled back and
    /// the others' stand.
    #[error("a unit of work panicked; its writes were rolled back")]
    Panicked,
    /// A migration failed; it was rolled back whole, its record included.
    #[error("migration {name} failed")]
    Migration {
        /// The migration's name.
        name: String,
        /// Why.
        #[source]
        source: Box<Error>,
    },
}

impl Error {
    pub(crate) fn connect(e: PoolError) -> Error {
        Error::Connect(Arc::new(e))
    }

    /// The driver's error, if this error carries one (a refused statement, or a failed
    /// attempt to connect).
    pub fn postgres_error(&self) -> Option<&tokio_postgres::Error> {
        match self {
            Error::Url(e) => Some(e),
            Error::Database(e) => Some(e),
            Error::Connect(e) => match &**e {
                PoolError::Backend(e) => Some(e),
                _ => None,
            },
            Error::Migration { source, .. } => source.postgres_error(),
            _ => None,
        }
    }

    /// The SQLSTATE the database answered with, when it answered at all: for instance
    /// [`SqlState::UNIQUE_VIOLATION`].
    pub fn code(&self) -> Option<&SqlState> {
        self.postgres_error()?.code()
    }

    /// Whether the database answered that the statement breaks a constraint (SQLSTATE class
    /// 23: unique, foreign key, check, not null, exclusion): running it again will not help.
    pub fn is_constraint_violation(&self) -> bool {
        self.code().is_some_and(|c| c.code().starts_with("23"))
    }

    /// Whether the database was out of reach: no connection could be had, the connection was
    /// lost or shut down by the server, or no answer came in time. The same call may succeed
    /// once the database is back (the pool reconnects by itself).
    pub fn is_unavailable(&self) -> bool {
        match self {
            Error::Connect(_) | Error::Timeout => true,
            Error::Database(e) => connection_lost(e),
            Error::Migration { source, .. } => source.is_unavailable(),
            _ => false,
        }
    }
}

/// A connection that closed, failed on the socket, or that the server ended (SQLSTATE class
/// 08, connection exception; 57P01-57P03, the server shutting down or starting).
fn connection_lost(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    match e.code() {
        Some(code) => {
            let code = code.code();
            code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03")
        }
        None => std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>()),
    }
}

impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        Error::Database(Arc::new(e))
    }
}
