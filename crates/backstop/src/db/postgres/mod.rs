//! PostgreSQL (feature `postgres`): a bounded pool that recovers by itself, versioned
//! [`migrate`] that several instances may run at once, the batching writer the idempotency
//! store runs its statements through, and group commit of the units of work (a handler's
//! phase and the record update that fences it) that it runs in shared transactions.
//!
//! Everything here speaks plain SQL to a [`Pool`]: which tables and which statements is the
//! business of the code on top (the idempotency store, the payment service's tables). Failures
//! are one typed [`Error`], which tells an unavailable database
//! ([`Error::is_unavailable`]) from a statement it refused ([`Error::code`],
//! [`Error::is_constraint_violation`]).
//!
//! Connections are plain TCP (`NoTls`): run the database on a trusted network or a local
//! socket.

mod error;
mod migrate;
mod queue;
mod shared;
mod writer;

pub use error::Error;
pub use migrate::{MIGRATIONS_TABLE, migrate};
pub(crate) use shared::SharedTransactions;
pub use writer::WriterStats;
pub(crate) use writer::{Group, StartBy, Statement, Writer, alone};
pub use {deadpool_postgres, tokio_postgres};

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use futures_util::future::BoxFuture;
use tokio::time::{Instant, timeout_at};
use tokio_postgres::NoTls;

/// A bounded pool on `config` (plain TCP): at most `max_connections` (0 counts as 1), every
/// wait (for a free connection, to connect, to check a returned one) bounded by `timeout`.
/// Broken connections are dropped when returned and new ones opened on demand, so the pool
/// recovers by itself when the database comes back.
pub fn pool(
    mut config: tokio_postgres::Config,
    max_connections: usize,
    timeout: Duration,
) -> Result<Pool, Error> {
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(timeout);
    }
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(max_connections.max(1))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(timeout))
        .create_timeout(Some(timeout))
        .recycle_timeout(Some(timeout))
        .build()
        .map_err(Error::Pool)
}

/// Runs `query` on a connection of `pool`, the wait for the connection and the query together
/// bounded by `until`. A connection that timed out mid-query is discarded, never handed out
/// again.
pub async fn with_client<T>(
    pool: &Pool,
    until: Instant,
    query: impl for<'c> FnOnce(&'c Object) -> BoxFuture<'c, Result<T, tokio_postgres::Error>>,
) -> Result<T, Error> {
    let client = match timeout_at(until, pool.get()).await {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => return Err(Error::connect(e)),
        Err(_) => return Err(Error::Timeout),
    };
    match timeout_at(until, query(&client)).await {
        Ok(answer) => Ok(answer?),
        Err(_) => {
            drop(Object::take(client));
            Err(Error::Timeout)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test_pool(config: tokio_postgres::Config) -> Pool {
        pool(config, 2, Duration::from_secs(2)).expect("build pool")
    }

    /// A statement the database refused is a constraint violation, with its SQLSTATE, and not
    /// an outage.
    #[tokio::test]
    async fn a_refused_statement_is_told_from_an_outage() {
        if !crate::test_services::postgres() {
            return;
        }
        let url = crate::test_services::postgres_url();
        let pool = test_pool(url.parse().expect("test URL"));
        let until = Instant::now() + Duration::from_secs(10);
        let err = with_client(&pool, until, |c| {
            Box::pin(async move {
                c.batch_execute(
                    "CREATE TEMP TABLE db_error_kinds (id INTEGER PRIMARY KEY); \
                     INSERT INTO db_error_kinds VALUES (1)",
                )
                .await?;
                c.execute("INSERT INTO db_error_kinds VALUES (1)", &[])
                    .await
            })
        })
        .await
        .unwrap_err();
        assert!(matches!(err, Error::Database(_)), "{err:?}");
        assert_eq!(
            err.code(),
            Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
        );
        assert!(err.is_constraint_violation(), "{err:?}");
        assert!(!err.is_unavailable(), "{err:?}");
    }

    /// A failed migration names itself and keeps its cause; it is not an outage either.
    #[tokio::test]
    async fn a_failed_migration_says_which_and_why() {
        if !crate::test_services::postgres() {
            return;
        }
        let url = crate::test_services::postgres_url();
        let pool = test_pool(url.parse().expect("test URL"));
        let err = migrate(&pool, "db_error_kinds_bad", "NOT SQL")
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Migration { name, .. } if name == "db_error_kinds_bad"),
            "{err:?}"
        );
        assert_eq!(
            err.code(),
            Some(&tokio_postgres::error::SqlState::SYNTAX_ERROR)
        );
        assert!(!err.is_constraint_violation(), "{err:?}");
        assert!(!err.is_unavailable(), "{err:?}");
    }

    /// Nothing listening: no connection to be had, an outage, with no SQLSTATE.
    #[tokio::test]
    async fn no_database_is_an_outage() {
        // A port just released: nothing listens on it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(port)
            .user("postgres")
            .dbname("test");
        let pool = test_pool(config);
        let until = Instant::now() + Duration::from_secs(10);
        let err = with_client(&pool, until, |c| {
            Box::pin(async move { c.simple_query("SELECT 1").await })
        })
        .await
        .unwrap_err();
        assert!(matches!(err, Error::Connect(_)), "{err:?}");
        assert!(err.is_unavailable(), "{err:?}");
        assert!(err.code().is_none(), "{err:?}");
        assert!(!err.is_constraint_violation(), "{err:?}");
    }
}
