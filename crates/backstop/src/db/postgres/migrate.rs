//! Versioned migrations that several instances may run at the same moment.

use deadpool_postgres::Pool;

use super::Error;

/// Table recording which migrations ran (in the connection's schema).
pub const MIGRATIONS_TABLE: &str = "backstop_migration";

/// Key of the transaction-scoped advisory lock that serializes migrations ("backstop").
const MIGRATION_LOCK: i64 = 0x6261_636b_7374_6f70;

/// Runs `sql` once per database schema under the name `name`, recorded in
/// [`MIGRATIONS_TABLE`]. Returns whether it ran now (`false`: it already had).
///
/// Everything happens in one transaction holding `pg_advisory_xact_lock`: instances starting
/// together queue on the lock, the first applies the migration, the others find it recorded.
/// A migration that fails is rolled back whole, record included, and reported as
/// [`Error::Migration`].
pub async fn migrate(pool: &Pool, name: &str, sql: &str) -> Result<bool, Error> {
    apply(pool, name, sql).await.map_err(|e| Error::Migration {
        name: name.to_owned(),
        source: Box::new(e),
    })
}

async fn apply(pool: &Pool, name: &str, sql: &str) -> Result<bool, Error> {
    let mut client = pool.get().await.map_err(Error::connect)?;
    let tx = client.transaction().await?;
    // `IF NOT EXISTS` on every start makes PostgreSQL send a NOTICE ("already exists,
    // skipping"), which the driver logs at INFO: noise in every instance's start-up log.
    tx.batch_execute("SET LOCAL client_min_messages = warning")
        .await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS backstop_migration ( \
         name TEXT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )
    .await?;
    let applied = tx
        .query_opt("SELECT 1 FROM backstop_migration WHERE name = $1", &[&name])
        .await?
        .is_some();
    if !applied {
        tx.batch_execute(sql).await?;
        tx.execute(
            "INSERT INTO backstop_migration (name) VALUES ($1)",
            &[&name],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(!applied)
}
