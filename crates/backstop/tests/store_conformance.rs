//! The store conformance suite, run from outside the crate as any backend would run it.

use backstop::idempotency::MemoryStore;

backstop::store_conformance!(memory, async { MemoryStore::new() });

#[cfg(feature = "sqlite")]
mod sqlite {
    use backstop::idempotency::conformance::WithGuard;
    use backstop::idempotency::sqlite::{SqliteOptions, SqliteStore, Synchronous};

    async fn open(options: SqliteOptions) -> WithGuard<SqliteStore, tempfile::TempDir> {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(dir.path().join("idem.db"), options)
            .await
            .expect("open store");
        WithGuard(store, dir)
    }

    backstop::store_conformance!(group_commit, open(SqliteOptions::default()));

    backstop::store_conformance!(
        autocommit,
        open(SqliteOptions {
            group_commit: false,
            synchronous: Synchronous::Normal,
            ..SqliteOptions::default()
        })
    );
}
