//! Payment intents: the `payment_intent` table and the only queries that touch it.
//!
//! Three keys, three unique constraints:
//!
//! | key | constraint | stops |
//! |---|---|---|
//! | business key `(merchant_id, order_id)` | `UNIQUE INDEX ... WHERE status <> 'failed'` | a second live intent for the same order (a client that generated a fresh key per attempt); a `failed` intent charged nothing, so it frees its order for another key |
//! | request key `(merchant_id, request_key)` | `UNIQUE` | two concurrent inserts for the same `Idempotency-Key` |
//! | effect key `(merchant_id, effect_key)` | `UNIQUE INDEX` | one intent producing two downstream effects |
//!
//! The effect key is the intent id: it is what the PSP deduplicates on, so re-sending it after an
//! unknown outcome charges once.
//!
//! Creating an intent is one `INSERT ... ON CONFLICT DO NOTHING`: the constraints decide, never
//! an application-level "look, then insert" (which two concurrent requests would both pass). Only
//! when the insert did nothing do we read which existing row stopped it.
//!
//! [`sqlite`] holds the table and its queries on SQLite (synchronous, on a connection, so they
//! run in the group-commit writer and inside an idempotency record's transaction alike);
//! [`postgres`] holds the same on PostgreSQL. [`Intents`] runs either; [`PaymentWrites`]
//! carries writes of both forms into a phase of the idempotency store (see
//! `backstop::server::idempotency::Phases`).

pub mod postgres;
pub mod sqlite;

use backstop::db::postgres::Error as PgError;
use backstop::db::sqlite::{Db, Error as DbError};
use std::time::Duration;

use backstop::db::postgres::deadpool_postgres::Pool;
use backstop::idempotency::postgres::PostgresWrites;
use backstop::idempotency::sqlite::SqliteWrites;
use rusqlite::OptionalExtension;
use serde::Serialize;

/// Where an intent stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum IntentStatus {
    /// Created; the PSP outcome is not known yet (or was unknown when the last attempt ended).
    Running,
    /// The PSP charged; `psp_charge_id` is set. Terminal.
    Succeeded,
    /// The PSP refused definitively; nothing was charged. Terminal.
    Failed,
}

impl IntentStatus {
    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            IntentStatus::Running => "running",
            IntentStatus::Succeeded => "succeeded",
            IntentStatus::Failed => "failed",
        }
    }

    fn from_column(s: &str) -> Option<Self> {
        match s {
            "running" => Some(IntentStatus::Running),
            "succeeded" => Some(IntentStatus::Succeeded),
            "failed" => Some(IntentStatus::Failed),
            _ => None,
        }
    }
}

/// One row of `payment_intent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intent {
    /// Primary key; also the effect key sent to the PSP.
    pub intent_id: String,
    /// Tenant that owns the intent.
    pub merchant_id: String,
    /// Business key, unique per merchant.
    pub order_id: String,
    /// Amount in minor units, always positive.
    pub amount_cents: i64,
    /// ISO 4217 code (three uppercase letters).
    pub currency: String,
    /// The `Idempotency-Key` of the request that created the intent.
    pub request_key: String,
    /// Hex SHA-256 of the normalized request parameters.
    pub fingerprint: String,
    /// Idempotency key for the downstream side effect (equal to `intent_id`).
    pub effect_key: String,
    /// Current status.
    pub status: IntentStatus,
    /// The PSP's charge id once succeeded.
    pub psp_charge_id: Option<String>,
    /// Creation time, unix epoch milliseconds.
    pub created_at: i64,
}

/// The values of a new intent (status starts as `running`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewIntent {
    /// Primary key and effect key (a UUIDv7 string).
    pub intent_id: String,
    /// Tenant that owns the intent.
    pub merchant_id: String,
    /// Business key.
    pub order_id: String,
    /// Amount in minor units.
    pub amount_cents: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// The request's `Idempotency-Key`.
    pub request_key: String,
    /// Hex fingerprint of the normalized parameters.
    pub fingerprint: String,
    /// Creation time, unix epoch milliseconds.
    pub created_at: i64,
}

/// What [`sqlite::insert`] (or its PostgreSQL twin) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Created {
    /// A new intent was inserted.
    New(Intent),
    /// The merchant already has an intent for this request key and these parameters: carry on
    /// with it (same effect key), never create a second one.
    Resumed(Intent),
    /// The order already has a live (running or succeeded) intent created under another
    /// request key.
    OrderConflict(Intent),
    /// The request key already names an intent with other parameters.
    KeyReused(Intent),
    /// The generated intent id collided with an existing one (practically impossible with
    /// UUIDv7); nothing was written.
    IdCollision,
}

/// The intents left `running` (all merchants): how many, and when the oldest was created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunningStats {
    /// Intents in status `running`.
    pub count: u64,
    /// `created_at` (unix ms) of the oldest running intent; `None` when there is none.
    pub oldest_created_at: Option<i64>,
}

/// Writes to the payment tables in the form of each backend, so that they can commit inside an
/// idempotency record's transaction (a phase, see `backstop::server::idempotency::Phases`):
/// the store runs the one of its own backend. [`Intents::run`] runs them alone.
pub struct PaymentWrites<T> {
    /// On the SQLite writer's connection.
    pub sqlite: SqliteWrites<T>,
    /// On a PostgreSQL connection.
    pub postgres: PostgresWrites<T>,
}

impl<T> std::fmt::Debug for PaymentWrites<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PaymentWrites").finish_non_exhaustive()
    }
}

/// Errors of [`Intents`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IntentsError {
    /// The SQLite database failed.
    #[error(transparent)]
    Sqlite(#[from] DbError),
    /// PostgreSQL failed or did not answer in time.
    #[error(transparent)]
    Postgres(#[from] PgError),
    /// A stored row could not be read back.
    #[error("stored payment intent {intent_id:?} is corrupt: {what}")]
    Corrupt {
        /// The row's `intent_id`.
        intent_id: String,
        /// Which column is wrong.
        what: &'static str,
    },
}

/// The intent table: on the shared group-commit SQLite [`Db`] (every write through
/// [`Db::write`], batched with the idempotency store's writes and answered only once durable,
/// every read through [`Db::read`]), or on PostgreSQL (the idempotency store's pool, each
/// operation one statement bounded by the request's deadline).
#[derive(Debug, Clone)]
pub struct Intents {
    backend: Backend,
}

#[derive(Debug, Clone)]
enum Backend {
    Sqlite(Db),
    Postgres(postgres::PgIntents),
}

impl Intents {
    /// Runs the `payment_intent` migration on `db` (once per database) and returns the handle.
    pub async fn open(db: Db) -> Result<Self, DbError> {
        db.migrate(sqlite::MIGRATION_NAME, sqlite::MIGRATION_SQL)
            .await?;
        Ok(Intents {
            backend: Backend::Sqlite(db),
        })
    }

    /// Runs the PostgreSQL `payment_intent` migration ([`postgres::MIGRATION_SQL`]; safe when
    /// several instances start at once) and returns the handle on `pool` (the service shares
    /// the idempotency store's), each operation bounded by the request's deadline or `timeout`.
    pub async fn postgres(pool: Pool, timeout: Duration) -> Result<Self, PgError> {
        Ok(Intents {
            backend: Backend::Postgres(postgres::PgIntents::open(pool, timeout).await?),
        })
    }

    /// The SQLite database handle (`None` on PostgreSQL).
    pub fn db(&self) -> Option<&Db> {
        match &self.backend {
            Backend::Sqlite(db) => Some(db),
            Backend::Postgres(_) => None,
        }
    }

    /// The writes creating `new` ([`sqlite::insert`]), for a phase or for [`run`](Self::run).
    pub fn create_writes(new: NewIntent) -> PaymentWrites<Result<Created, IntentsError>> {
        let pg = new.clone();
        PaymentWrites {
            sqlite: Box::new(move |c| sqlite::insert(c, &new).map(Ok)),
            postgres: Box::new(move |c| Box::pin(postgres::create_on(c, pg))),
        }
    }

    /// The writes settling a running intent: succeeded with `charge_id`, or failed without
    /// one ([`sqlite::settle`]); for a phase or for [`run`](Self::run).
    pub fn settle_writes(
        merchant_id: &str,
        intent_id: &str,
        charge_id: Option<&str>,
    ) -> PaymentWrites<()> {
        let (m, i, ch) = (
            merchant_id.to_owned(),
            intent_id.to_owned(),
            charge_id.map(str::to_owned),
        );
        let (pm, pi, pch) = (m.clone(), i.clone(), ch.clone());
        PaymentWrites {
            sqlite: Box::new(move |c| sqlite::settle(c, &m, &i, ch.as_deref()).map(|_| ())),
            postgres: Box::new(move |c| {
                Box::pin(async move {
                    postgres::settle_on(c, &pm, &pi, pch.as_deref())
                        .await
                        .map(|_| ())
                })
            }),
        }
    }

    /// Runs `writes` alone: one write job, or one autocommit statement sequence on PostgreSQL.
    pub async fn run<T: Send + 'static>(
        &self,
        writes: PaymentWrites<T>,
    ) -> Result<T, IntentsError> {
        match &self.backend {
            Backend::Sqlite(db) => Ok(db.write(writes.sqlite).await?),
            Backend::Postgres(pg) => Ok(pg.run(writes.postgres).await?),
        }
    }

    /// [`sqlite::insert`]: one write job, or one `INSERT ... ON CONFLICT DO NOTHING` on PostgreSQL.
    pub async fn create(&self, new: NewIntent) -> Result<Created, IntentsError> {
        match &self.backend {
            Backend::Sqlite(db) => Ok(db.write(move |c| sqlite::insert(c, &new)).await?),
            Backend::Postgres(pg) => pg.create(new).await,
        }
    }

    /// [`sqlite::settle`] in one write job (one `UPDATE ... RETURNING`): the intent as it is then, if
    /// this changed it (it was running).
    pub async fn settle(
        &self,
        merchant_id: &str,
        intent_id: &str,
        charge_id: Option<&str>,
    ) -> Result<Option<Intent>, IntentsError> {
        let (m, i, ch) = (
            merchant_id.to_owned(),
            intent_id.to_owned(),
            charge_id.map(str::to_owned),
        );
        match &self.backend {
            Backend::Sqlite(db) => Ok(db
                .write(move |c| sqlite::settle(c, &m, &i, ch.as_deref()))
                .await?),
            Backend::Postgres(pg) => pg.settle(m, i, ch).await,
        }
    }

    /// [`sqlite::get`] on a read connection.
    pub async fn get(
        &self,
        merchant_id: &str,
        intent_id: &str,
    ) -> Result<Option<Intent>, IntentsError> {
        let (m, i) = (merchant_id.to_owned(), intent_id.to_owned());
        match &self.backend {
            Backend::Sqlite(db) => Ok(db.read(move |c| sqlite::get(c, &m, &i)).await?),
            Backend::Postgres(pg) => pg.get(m, i).await,
        }
    }

    /// [`sqlite::by_order`] on a read connection.
    pub async fn by_order(
        &self,
        merchant_id: &str,
        order_id: &str,
    ) -> Result<Vec<Intent>, IntentsError> {
        let (m, o) = (merchant_id.to_owned(), order_id.to_owned());
        match &self.backend {
            Backend::Sqlite(db) => Ok(db.read(move |c| sqlite::by_order(c, &m, &o)).await?),
            Backend::Postgres(pg) => pg.by_order(m, o).await,
        }
    }

    /// [`sqlite::running_before`] on a read connection (one statement on PostgreSQL).
    pub async fn running_before(
        &self,
        created_before: i64,
        limit: u32,
    ) -> Result<Vec<Intent>, IntentsError> {
        match &self.backend {
            Backend::Sqlite(db) => Ok(db
                .read(move |c| sqlite::running_before(c, created_before, limit))
                .await?),
            Backend::Postgres(pg) => pg.running_before(created_before, limit).await,
        }
    }

    /// [`sqlite::created_between`] on a read connection (one statement on PostgreSQL).
    pub async fn created_between(
        &self,
        since: i64,
        until: i64,
        after: Option<(i64, String)>,
        limit: u32,
    ) -> Result<Vec<Intent>, IntentsError> {
        match &self.backend {
            Backend::Sqlite(db) => Ok(db
                .read(move |c| {
                    let after = after.as_ref().map(|(at, id)| (*at, id.as_str()));
                    sqlite::created_between(c, since, until, after, limit)
                })
                .await?),
            Backend::Postgres(pg) => pg.created_between(since, until, after, limit).await,
        }
    }

    /// [`sqlite::running_stats`] on a read connection (one statement on PostgreSQL).
    pub async fn running_stats(&self) -> Result<RunningStats, IntentsError> {
        match &self.backend {
            Backend::Sqlite(db) => Ok(db.read(sqlite::running_stats).await?),
            Backend::Postgres(pg) => Ok(pg.running_stats().await?),
        }
    }

    /// [`sqlite::count`] on a read connection.
    pub async fn count(&self) -> Result<u64, IntentsError> {
        match &self.backend {
            Backend::Sqlite(db) => Ok(db.read(sqlite::count).await?),
            Backend::Postgres(pg) => Ok(pg.count().await?),
        }
    }

    /// A trivial read: whether the store answers (for `/readyz`).
    pub async fn ping(&self) -> Result<(), IntentsError> {
        match &self.backend {
            Backend::Sqlite(db) => Ok(db
                .read(|c| {
                    c.query_row("SELECT 1 FROM payment_intent LIMIT 1", [], |_| Ok(()))
                        .optional()
                })
                .await
                .map(|_| ())?),
            Backend::Postgres(pg) => Ok(pg.ping().await?),
        }
    }
}
