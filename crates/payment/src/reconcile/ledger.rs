//! The payment store's side of reconciliation: the intents to compare, and the
//! `reconciliation` table recording what was done, on SQLite or PostgreSQL.
//!
//! Each action's database part is one transaction: the intent's new status and the record of
//! the action commit together. A record is unique per `(kind, charge_id)`, so a run repeated
//! after a crash records an action once.

use backstop::db::postgres::{Error as PgError, migrate};
use backstop::db::sqlite::{Db, Error as DbError, SqliteOptions};
use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
use rusqlite::params;
use serde::Serialize;

use crate::config::StoreLocation;
use crate::intents::{Intents, IntentsError};

use super::ReconcileError;

/// Name of the `reconciliation` migration, on both stores.
pub const MIGRATION_NAME: &str = "reconciliation_v1";

/// The `reconciliation` table on SQLite.
pub const MIGRATION_SQL: &str = "
CREATE TABLE reconciliation (
  id           INTEGER PRIMARY KEY AUTOINCREMENT,
  kind         TEXT    NOT NULL CHECK (kind IN ('refund_duplicate','mark_succeeded')),
  merchant_id  TEXT    NOT NULL,
  order_id     TEXT    NOT NULL,
  intent_id    TEXT,
  charge_id    TEXT    NOT NULL,
  refund_id    TEXT,
  amount_cents INTEGER NOT NULL,
  currency     TEXT    NOT NULL,
  operator     TEXT    NOT NULL,
  created_at   INTEGER NOT NULL,
  UNIQUE (kind, charge_id)
);
";

/// The `reconciliation` table on PostgreSQL.
pub const PG_MIGRATION_SQL: &str = "
CREATE TABLE reconciliation (
  id           BIGSERIAL PRIMARY KEY,
  kind         TEXT   NOT NULL CHECK (kind IN ('refund_duplicate','mark_succeeded')),
  merchant_id  TEXT   NOT NULL,
  order_id     TEXT   NOT NULL,
  intent_id    TEXT,
  charge_id    TEXT   NOT NULL,
  refund_id    TEXT,
  amount_cents BIGINT NOT NULL,
  currency     TEXT   NOT NULL,
  operator     TEXT   NOT NULL,
  created_at   BIGINT NOT NULL,
  UNIQUE (kind, charge_id)
);
";

/// What an action did, as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    /// A duplicate charge was refunded (and the intent behind it, if live, marked failed).
    RefundDuplicate,
    /// A running intent was marked succeeded with the PSP's charge.
    MarkSucceeded,
}

impl ActionKind {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::RefundDuplicate => "refund_duplicate",
            ActionKind::MarkSucceeded => "mark_succeeded",
        }
    }

    fn from_column(s: &str) -> Option<Self> {
        match s {
            "refund_duplicate" => Some(ActionKind::RefundDuplicate),
            "mark_succeeded" => Some(ActionKind::MarkSucceeded),
            _ => None,
        }
    }
}

/// One row of `reconciliation`: who did what, when, to which charge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Record {
    /// What was done.
    pub kind: ActionKind,
    /// The order's merchant.
    pub merchant_id: String,
    /// The order.
    pub order_id: String,
    /// The intent whose status changed, if any.
    pub intent_id: Option<String>,
    /// The charge acted on.
    pub charge_id: String,
    /// The PSP's refund, for a refund.
    pub refund_id: Option<String>,
    /// The charge's amount, minor units.
    pub amount_cents: i64,
    /// Its currency.
    pub currency: String,
    /// Who ran the reconciliation.
    pub operator: String,
    /// When, unix epoch milliseconds.
    pub created_at: i64,
}

/// The payment store opened for reconciliation.
#[derive(Debug, Clone)]
pub struct Ledger {
    intents: Intents,
    backend: Backend,
}

#[derive(Debug, Clone)]
enum Backend {
    Sqlite(Db),
    Postgres(PostgresStore),
}

impl Ledger {
    /// Opens the store at `location` and brings its tables up to date (the intent
    /// migrations, then `reconciliation`). A SQLite file must exist already: reconciling a
    /// store that was never created is a mistake in the path.
    pub async fn open(location: &StoreLocation) -> Result<Ledger, ReconcileError> {
        match location {
            StoreLocation::Sqlite(path) => {
                if !path.is_file() {
                    return Err(ReconcileError::NoStore(path.clone()));
                }
                let db = Db::open(path, SqliteOptions::default())?;
                let intents = Intents::open(db.clone()).await?;
                db.migrate(MIGRATION_NAME, MIGRATION_SQL).await?;
                Ok(Ledger {
                    intents,
                    backend: Backend::Sqlite(db),
                })
            }
            StoreLocation::Postgres(url) => {
                let store = PostgresStore::connect(url, PostgresOptions::default())
                    .await
                    .map_err(|e| ReconcileError::Postgres(Box::new(e)))?;
                let intents = Intents::postgres(store.pool().clone(), store.timeout()).await?;
                migrate(store.pool(), MIGRATION_NAME, PG_MIGRATION_SQL).await?;
                Ok(Ledger {
                    intents,
                    backend: Backend::Postgres(store),
                })
            }
        }
    }

    /// The intent table.
    pub fn intents(&self) -> &Intents {
        &self.intents
    }

    /// Applies the database part of `record` in one transaction: for
    /// [`ActionKind::MarkSucceeded`], the intent goes from `running` to `succeeded` with the
    /// charge, and the record is written only if it did; for
    /// [`ActionKind::RefundDuplicate`], the intent (if any) goes from live to `failed` and the
    /// record is written. Returns whether a record was written (false: this charge's action
    /// was recorded before, or the intent was no longer running).
    pub async fn record(&self, record: Record) -> Result<bool, ReconcileError> {
        match &self.backend {
            Backend::Sqlite(db) => Ok(db.write(move |c| record_sqlite(c, &record)).await?),
            Backend::Postgres(store) => {
                let n = store
                    .with_client(move |c| {
                        Box::pin(async move {
                            let update = match record.kind {
                                ActionKind::MarkSucceeded => {
                                    "UPDATE payment_intent SET status = 'succeeded', \
                                     psp_charge_id = $4 WHERE merchant_id = $1 \
                                     AND intent_id = $3 AND status = 'running'"
                                }
                                ActionKind::RefundDuplicate => {
                                    "UPDATE payment_intent SET status = 'failed' \
                                     WHERE merchant_id = $1 AND intent_id = $3 \
                                     AND status IN ('running', 'succeeded')"
                                }
                            };
                            // One statement, so one transaction: a data-modifying CTE runs
                            // whether or not the INSERT reads it.
                            let guard = match record.kind {
                                ActionKind::MarkSucceeded => "WHERE EXISTS (SELECT 1 FROM changed)",
                                ActionKind::RefundDuplicate => "",
                            };
                            let sql = format!(
                                "WITH changed AS ({update} RETURNING 1) \
                                 INSERT INTO reconciliation (kind, merchant_id, order_id, \
                                 intent_id, charge_id, refund_id, amount_cents, currency, \
                                 operator, created_at) \
                                 SELECT $9::text, $1::text, $2::text, $3::text, $4::text, \
                                 $5::text, $6::bigint, $7::text, $8::text, $10::bigint {guard} \
                                 ON CONFLICT (kind, charge_id) DO NOTHING"
                            );
                            c.execute(
                                &sql,
                                &[
                                    &record.merchant_id,
                                    &record.order_id,
                                    &record.intent_id,
                                    &record.charge_id,
                                    &record.refund_id,
                                    &record.amount_cents,
                                    &record.currency,
                                    &record.operator,
                                    &record.kind.as_str(),
                                    &record.created_at,
                                ],
                            )
                            .await
                        })
                    })
                    .await?;
                Ok(n == 1)
            }
        }
    }

    /// Every record, oldest first.
    pub async fn records(&self) -> Result<Vec<Record>, ReconcileError> {
        const SELECT: &str = "SELECT kind, merchant_id, order_id, intent_id, charge_id, \
             refund_id, amount_cents, currency, operator, created_at FROM reconciliation \
             ORDER BY id";
        match &self.backend {
            Backend::Sqlite(db) => {
                let rows = db
                    .read(|c| {
                        let mut stmt = c.prepare(SELECT)?;
                        let rows = stmt.query_map([], |row| {
                            Ok((
                                row.get::<_, String>(0)?,
                                Record {
                                    kind: ActionKind::RefundDuplicate,
                                    merchant_id: row.get(1)?,
                                    order_id: row.get(2)?,
                                    intent_id: row.get(3)?,
                                    charge_id: row.get(4)?,
                                    refund_id: row.get(5)?,
                                    amount_cents: row.get(6)?,
                                    currency: row.get(7)?,
                                    operator: row.get(8)?,
                                    created_at: row.get(9)?,
                                },
                            ))
                        })?;
                        rows.collect::<rusqlite::Result<Vec<_>>>()
                    })
                    .await?;
                rows.into_iter().map(with_kind).collect()
            }
            Backend::Postgres(store) => {
                let rows = store
                    .with_client(|c| Box::pin(async move { c.query(SELECT, &[]).await }))
                    .await?;
                rows.iter()
                    .map(|row| {
                        let get = |e| ReconcileError::from(PgError::from(e));
                        Ok((
                            row.try_get::<_, String>(0).map_err(get)?,
                            Record {
                                kind: ActionKind::RefundDuplicate,
                                merchant_id: row.try_get(1).map_err(get)?,
                                order_id: row.try_get(2).map_err(get)?,
                                intent_id: row.try_get(3).map_err(get)?,
                                charge_id: row.try_get(4).map_err(get)?,
                                refund_id: row.try_get(5).map_err(get)?,
                                amount_cents: row.try_get(6).map_err(get)?,
                                currency: row.try_get(7).map_err(get)?,
                                operator: row.try_get(8).map_err(get)?,
                                created_at: row.try_get(9).map_err(get)?,
                            },
                        ))
                    })
                    .map(|row| row.and_then(with_kind))
                    .collect()
            }
        }
    }
}

fn with_kind((kind, mut record): (String, Record)) -> Result<Record, ReconcileError> {
    record.kind = ActionKind::from_column(&kind).ok_or_else(|| {
        ReconcileError::Intents(IntentsError::Corrupt {
            intent_id: record.intent_id.clone().unwrap_or_default(),
            what: "reconciliation kind",
        })
    })?;
    Ok(record)
}

/// [`Ledger::record`] on SQLite, inside the group-commit writer's transaction (its own
/// savepoint: both statements or neither).
fn record_sqlite(c: &rusqlite::Connection, record: &Record) -> rusqlite::Result<bool> {
    let changed = match record.kind {
        ActionKind::MarkSucceeded => c.execute(
            "UPDATE payment_intent SET status = 'succeeded', psp_charge_id = ?3 \
             WHERE merchant_id = ?1 AND intent_id = ?2 AND status = 'running'",
            params![record.merchant_id, record.intent_id, record.charge_id],
        )?,
        ActionKind::RefundDuplicate => c.execute(
            "UPDATE payment_intent SET status = 'failed' \
             WHERE merchant_id = ?1 AND intent_id = ?2 AND status IN ('running', 'succeeded')",
            params![record.merchant_id, record.intent_id],
        )?,
    };
    if record.kind == ActionKind::MarkSucceeded && changed == 0 {
        return Ok(false);
    }
    let n = c.execute(
        "INSERT INTO reconciliation (kind, merchant_id, order_id, intent_id, charge_id, \
         refund_id, amount_cents, currency, operator, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) \
         ON CONFLICT (kind, charge_id) DO NOTHING",
        params![
            record.kind.as_str(),
            record.merchant_id,
            record.order_id,
            record.intent_id,
            record.charge_id,
            record.refund_id,
            record.amount_cents,
            record.currency,
            record.operator,
            record.created_at,
        ],
    )?;
    Ok(n == 1)
}

impl From<DbError> for ReconcileError {
    fn from(error: DbError) -> Self {
        ReconcileError::Intents(IntentsError::Sqlite(error))
    }
}

impl From<PgError> for ReconcileError {
    fn from(error: PgError) -> Self {
        ReconcileError::Intents(IntentsError::Postgres(error))
    }
}
