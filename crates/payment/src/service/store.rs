//! [`PaymentStore`]: the idempotency store of whichever backend `--store` names.

use backstop::idempotency::postgres::PostgresStore;
use backstop::idempotency::sqlite::SqliteStore;
use backstop::idempotency::{
    Claim, ClaimRequest, IdempotencyKey, Lease, Record, Store, StoreError, StoredResponse,
};

/// The idempotency store the service runs on: SQLite (one instance) or PostgreSQL (shared by
/// several instances).
#[derive(Debug, Clone)]
pub enum PaymentStore {
    /// `sqlite://PATH`: shares the group-commit writer with the intent table.
    Sqlite(SqliteStore),
    /// `postgres://...`: shares the pool with the intent table.
    Postgres(PostgresStore),
}

impl Store for PaymentStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.claim(req).await,
            PaymentStore::Postgres(s) => s.claim(req).await,
        }
    }

    async fn complete(
        &self,
        lease: &Lease,
        response: StoredResponse,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.complete(lease, response, now_ms).await,
            PaymentStore::Postgres(s) => s.complete(lease, response, now_ms).await,
        }
    }

    async fn fail(&self, lease: &Lease, now_ms: i64) -> Result<(), StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.fail(lease, now_ms).await,
            PaymentStore::Postgres(s) => s.fail(lease, now_ms).await,
        }
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.release(lease).await,
            PaymentStore::Postgres(s) => s.release(lease).await,
        }
    }

    async fn get(&self, scope: &str, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.get(scope, key).await,
            PaymentStore::Postgres(s) => s.get(scope, key).await,
        }
    }

    async fn sweep(&self, now_ms: i64, limit: usize) -> Result<usize, StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.sweep(now_ms, limit).await,
            PaymentStore::Postgres(s) => s.sweep(now_ms, limit).await,
        }
    }
}
