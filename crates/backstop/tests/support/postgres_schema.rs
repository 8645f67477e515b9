//! A PostgreSQL schema of its own for each test, on the shared test database (127.0.0.1:5432,
//! user `postgres`, database `test`, or `BACKSTOP_TEST_POSTGRES`). Tests of several crates
//! include this file with `#[path]`, so it uses only what each of them has: tokio-postgres
//! through the library's re-export, and `rand`; and `services.rs`, which they include beside it
//! (a test checks `services::postgres()` before it makes a schema).
// Each including test uses part of it.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use backstop::db::postgres::tokio_postgres;

/// The test database's URL.
pub(crate) fn url() -> String {
    super::services::postgres_url()
}

/// A connection to the test database, outside any test schema.
pub(crate) async fn admin() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
        .await
        .expect("connect to the test database");
    tokio::spawn(connection);
    client
}

/// A name no other test, run or process uses at the same time: `prefix`, this process, a
/// counter and a random number (runs of several crates share the database).
pub(crate) fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        rand::random::<u32>()
    )
}

/// A schema dropped (with everything in it) when the test ends.
#[derive(Debug)]
pub(crate) struct Schema(String);

impl Schema {
    /// A new empty schema named after `prefix` (see [`unique`]).
    pub(crate) async fn create(prefix: &str) -> Schema {
        let name = unique(prefix);
        admin()
            .await
            .batch_execute(&format!("CREATE SCHEMA {name}"))
            .await
            .expect("create schema");
        Schema(name)
    }

    pub(crate) fn name(&self) -> &str {
        &self.0
    }

    /// The test database with this schema first on the search path.
    pub(crate) fn config(&self) -> tokio_postgres::Config {
        let mut config: tokio_postgres::Config = url().parse().expect("test URL");
        config.options(format!("-c search_path={}", self.0));
        config
    }

    /// The same database and schema, reached through 127.0.0.1:`port` (a proxy's).
    pub(crate) fn config_via(&self, port: u16) -> tokio_postgres::Config {
        let base = self.config();
        let mut config = tokio_postgres::Config::new();
        config.host("127.0.0.1").port(port);
        if let Some(user) = base.get_user() {
            config.user(user);
        }
        if let Some(password) = base.get_password() {
            config.password(password);
        }
        if let Some(db) = base.get_dbname() {
            config.dbname(db);
        }
        if let Some(options) = base.get_options() {
            config.options(options);
        }
        config
    }

    /// A store URL (what `--store` takes) for this schema: the test database's URL, or the
    /// same database reached through 127.0.0.1:`port` (a proxy's) when one is given.
    pub(crate) fn store_url(&self, port: Option<u16>) -> String {
        let search_path = format!("options=-c%20search_path%3D{}", self.0);
        let Some(port) = port else {
            let url = url();
            let separator = if url.contains('?') { '&' } else { '?' };
            return format!("{url}{separator}{search_path}");
        };
        let config = self.config();
        let user = config.get_user().unwrap_or("postgres");
        let db = config.get_dbname().unwrap_or("test");
        format!("postgres://{user}@127.0.0.1:{port}/{db}?{search_path}")
    }

    /// Rows in `table` of this schema.
    pub(crate) async fn count(&self, table: &str) -> i64 {
        admin()
            .await
            .query_one(&format!("SELECT count(*) FROM {}.{table}", self.0), &[])
            .await
            .expect("count")
            .get(0)
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        let sql = format!("DROP SCHEMA IF EXISTS {} CASCADE", self.0);
        // Drop runs inside the test's runtime: drop the schema from a thread of its own. A
        // database already gone (a failing test) leaves the schema behind rather than panic
        // inside a panic.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok((client, connection)) =
                    tokio_postgres::connect(&url(), tokio_postgres::NoTls).await
                {
                    tokio::spawn(connection);
                    let _ = client.batch_execute(&sql).await;
                }
            });
        })
        .join();
    }
}
