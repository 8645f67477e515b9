//! [`PaymentStore`]: the idempotency store of whichever backend `--store` names.

use backstop::idempotency::postgres::{PostgresStore, PostgresWrites};
use backstop::idempotency::sqlite::{SqliteStore, SqliteWrites};
use backstop::idempotency::{
    Claim, ClaimRequest, Ending, IdempotencyKey, Lease, Record, RecoveryPoint, Store, StoreError,
    StoredResponse,
};

use crate::intents::PaymentWrites;

/// The idempotency store the service runs on: SQLite (one instance) or PostgreSQL (shared by
/// several instances).
#[derive(Debug, Clone)]
pub enum PaymentStore {
    /// `sqlite://PATH`: shares the group-commit writer with the intent table.
    Sqlite(SqliteStore),
    /// `postgres://...`: shares the pool with the intent table.
    Postgres(PostgresStore),
}

/// A store the payment service can run its phases on: it turns [`PaymentWrites`] (the
/// intent table's writes in the form of each backend) into its own writes.
pub trait PaymentBackend: Store {
    /// The part of `writes` this store runs.
    fn writes<T: Send + 'static>(writes: PaymentWrites<T>) -> Self::Writes<T>;
}

impl PaymentBackend for PaymentStore {
    fn writes<T: Send + 'static>(writes: PaymentWrites<T>) -> PaymentWrites<T> {
        writes
    }
}

impl PaymentBackend for SqliteStore {
    fn writes<T: Send + 'static>(writes: PaymentWrites<T>) -> SqliteWrites<T> {
        writes.sqlite
    }
}

impl PaymentBackend for PostgresStore {
    fn writes<T: Send + 'static>(writes: PaymentWrites<T>) -> PostgresWrites<T> {
        writes.postgres
    }
}

impl Store for PaymentStore {
    type Writes<T: Send + 'static> = PaymentWrites<T>;

    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.claim(req).await,
            PaymentStore::Postgres(s) => s.claim(req).await,
        }
    }

    async fn claim_deferred(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.claim_deferred(req).await,
            PaymentStore::Postgres(s) => s.claim_deferred(req).await,
        }
    }

    async fn commit_phase<T: Send + 'static>(
        &self,
        lease: &Lease,
        point: RecoveryPoint,
        writes: PaymentWrites<T>,
    ) -> Result<T, StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.commit_phase(lease, point, writes.sqlite).await,
            PaymentStore::Postgres(s) => s.commit_phase(lease, point, writes.postgres).await,
        }
    }

    async fn finish(
        &self,
        lease: &Lease,
        ending: Ending,
        now_ms: i64,
        writes: PaymentWrites<()>,
    ) -> Result<(), StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.finish(lease, ending, now_ms, writes.sqlite).await,
            PaymentStore::Postgres(s) => s.finish(lease, ending, now_ms, writes.postgres).await,
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

    async fn expire(&self, now_ms: i64, limit: usize) -> Result<usize, StoreError> {
        match self {
            PaymentStore::Sqlite(s) => s.expire(now_ms, limit).await,
            PaymentStore::Postgres(s) => s.expire(now_ms, limit).await,
        }
    }
}
