//! `payment_intent` on PostgreSQL: the same columns and the same three unique constraints as
//! the SQLite table, and the same rule: the constraints decide, one `INSERT ... ON CONFLICT DO
//! NOTHING`, never a look-then-insert.
//!
//! Statements run on a [`db::postgres`](backstop::db::postgres) pool (the idempotency store's,
//! in the service), each bounded by the request's deadline or the operation timeout.
//!
//! A statement that finds one intent by its id (`get`, `mark`) names the id alone as an
//! indexable condition and checks the merchant and status with `IS NOT DISTINCT FROM`, which no
//! index and no partial-index predicate matches, so the primary key is the only plan. Written
//! as `merchant_id = $1 AND intent_id = $2 AND status = 'running'`, the planner could pick an
//! index leading with `merchant_id`, or scan the partial index of running intents, whenever its
//! statistics made those look as cheap (a table not yet analyzed, or one whose running intents
//! look few): each call then read every intent of the merchant, or every dead entry of that
//! index, and the cost of a payment grew with the table. The columns are `NOT NULL`, so the
//! two forms select the same rows.

use std::sync::LazyLock;
use std::time::Duration;

use backstop::db::postgres::deadpool_postgres::{Object, Pool};
use backstop::db::postgres::tokio_postgres;
use backstop::db::postgres::tokio_postgres::Row;
use backstop::db::postgres::{Error as PgError, migrate, with_client};
use backstop::deadline::Deadline;
use backstop::idempotency::postgres::PostgresWrites;
use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::{
    Created, Intent, IntentStatus, IntentsError, NewIntent, RunningStats, sqlite::MIGRATION_NAME,
};

/// Schema of `payment_intent` on PostgreSQL: as on SQLite, the business key binds live
/// intents only (a `failed` intent frees its order), and running intents are indexed by age
/// for the resolver.
pub const MIGRATION_SQL: &str = "
CREATE TABLE payment_intent (
  intent_id     TEXT   PRIMARY KEY,
  merchant_id   TEXT   NOT NULL,
  order_id      TEXT   NOT NULL,
  amount_cents  BIGINT NOT NULL,
  request_key   TEXT   NOT NULL,
  fingerprint   TEXT   NOT NULL,
  effect_key    TEXT   NOT NULL,
  status        TEXT   NOT NULL CHECK (status IN ('running','succeeded','failed')),
  psp_charge_id TEXT,
  created_at    BIGINT NOT NULL,
  currency      TEXT   NOT NULL DEFAULT 'USD',
  UNIQUE (merchant_id, request_key)
);
CREATE UNIQUE INDEX idx_effect_key ON payment_intent (merchant_id, effect_key);
CREATE UNIQUE INDEX idx_live_order ON payment_intent (merchant_id, order_id)
  WHERE status <> 'failed';
CREATE INDEX idx_running_age ON payment_intent (created_at) WHERE status = 'running';
";

const COLUMNS: &str = "intent_id, merchant_id, order_id, amount_cents, currency, request_key, \
     fingerprint, effect_key, status, psp_charge_id, created_at";

const INSERT_SQL: &str = "INSERT INTO payment_intent (intent_id, merchant_id, order_id, \
     amount_cents, currency, request_key, fingerprint, effect_key, status, psp_charge_id, \
     created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $1, 'running', NULL, $8) \
     ON CONFLICT DO NOTHING";

/// One intent by its id, if the merchant (`$1`) owns it (the lookup shape of the module doc).
/// Built once from [`COLUMNS`], so [`from_row`] reads its columns in the same order.
static GET_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {COLUMNS} FROM payment_intent \
         WHERE intent_id = $2 AND merchant_id IS NOT DISTINCT FROM $1"
    )
});

/// The PostgreSQL side of [`Intents`](super::Intents).
#[derive(Debug, Clone)]
pub(crate) struct PgIntents {
    pool: Pool,
    /// The longest any one operation may take, when the request's deadline is later.
    timeout: Duration,
}

/// Time kept between an operation giving up and the request's deadline, to answer.
const DEADLINE_MARGIN: Duration = Duration::from_millis(20);

/// Every column of the merchant's (`$1`) intents whose `column` is `$2`.
fn select_sql(column: &str) -> String {
    format!("SELECT {COLUMNS} FROM payment_intent WHERE merchant_id = $1 AND {column} = $2")
}

fn from_row(row: &Row) -> Result<Intent, IntentsError> {
    let intent_id: String = row.try_get(0).map_err(PgError::from)?;
    let status: String = row.try_get(8).map_err(PgError::from)?;
    let Some(status) = IntentStatus::from_column(&status) else {
        return Err(IntentsError::Corrupt {
            intent_id,
            what: "status",
        });
    };
    let get = |e| PgError::from(e);
    Ok(Intent {
        merchant_id: row.try_get(1).map_err(get)?,
        order_id: row.try_get(2).map_err(get)?,
        amount_cents: row.try_get(3).map_err(get)?,
        currency: row.try_get(4).map_err(get)?,
        request_key: row.try_get(5).map_err(get)?,
        fingerprint: row.try_get(6).map_err(get)?,
        effect_key: row.try_get(7).map_err(get)?,
        status,
        psp_charge_id: row.try_get(9).map_err(get)?,
        created_at: row.try_get(10).map_err(get)?,
        intent_id,
    })
}

/// The insert on `c`; when the constraints stopped it, the row that did (read in a statement of
/// its own, whose snapshot sees the conflicting row once its transaction committed). The outer
/// error is the database's; the inner one a row that could not be read back.
pub(crate) async fn create_on(
    c: &Object,
    new: NewIntent,
) -> Result<Result<Created, IntentsError>, tokio_postgres::Error> {
    let insert = c.prepare_cached(INSERT_SQL).await?;
    let inserted = c
        .execute(
            &insert,
            &[
                &new.intent_id,
                &new.merchant_id,
                &new.order_id,
                &new.amount_cents,
                &new.currency,
                &new.request_key,
                &new.fingerprint,
                &new.created_at,
            ],
        )
        .await?;
    if inserted == 1 {
        return Ok(Ok(Created::New(Intent {
            effect_key: new.intent_id.clone(),
            intent_id: new.intent_id,
            merchant_id: new.merchant_id,
            order_id: new.order_id,
            amount_cents: new.amount_cents,
            currency: new.currency,
            request_key: new.request_key,
            fingerprint: new.fingerprint,
            status: IntentStatus::Running,
            psp_charge_id: None,
            created_at: new.created_at,
        })));
    }
    let by_key = c
        .query_opt(
            &select_sql("request_key"),
            &[&new.merchant_id, &new.request_key],
        )
        .await?;
    if let Some(row) = by_key {
        return Ok(from_row(&row).map(|existing| {
            if existing.order_id == new.order_id && existing.fingerprint == new.fingerprint {
                Created::Resumed(existing)
            } else {
                Created::KeyReused(existing)
            }
        }));
    }
    let live = format!("{} AND status <> 'failed'", select_sql("order_id"));
    let by_order = c
        .query_opt(&live, &[&new.merchant_id, &new.order_id])
        .await?;
    Ok(match by_order {
        Some(row) => from_row(&row).map(Created::OrderConflict),
        None => Ok(Created::IdCollision),
    })
}

/// `succeeded` with the charge id (`Some`) or `failed` (`None`), only from `running`, on `c`;
/// the intent as it is then, if this changed it.
pub(crate) async fn settle_on(
    c: &Object,
    merchant_id: &str,
    intent_id: &str,
    charge_id: Option<&str>,
) -> Result<Option<Row>, tokio_postgres::Error> {
    match charge_id {
        Some(charge) => {
            let stmt = c.prepare_cached(&SUCCEED_SQL).await?;
            c.query_opt(&stmt, &[&merchant_id, &intent_id, &charge])
                .await
        }
        None => {
            let stmt = c.prepare_cached(&FAIL_SQL).await?;
            c.query_opt(&stmt, &[&merchant_id, &intent_id]).await
        }
    }
}

static SUCCEED_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE payment_intent SET status = 'succeeded', psp_charge_id = $3 \
         WHERE intent_id = $2 AND (merchant_id, status) IS NOT DISTINCT FROM ($1, 'running') \
         RETURNING {COLUMNS}"
    )
});

static FAIL_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE payment_intent SET status = 'failed' \
         WHERE intent_id = $2 AND (merchant_id, status) IS NOT DISTINCT FROM ($1, 'running') \
         RETURNING {COLUMNS}"
    )
});

impl PgIntents {
    pub(crate) async fn open(pool: Pool, timeout: Duration) -> Result<PgIntents, PgError> {
        migrate(&pool, MIGRATION_NAME, MIGRATION_SQL).await?;
        Ok(PgIntents { pool, timeout })
    }

    /// Runs `query` on a pooled connection, bounded by the request's deadline (less the
    /// margin to answer) or the timeout, whichever ends first.
    async fn with_client<T>(
        &self,
        query: impl for<'c> FnOnce(&'c Object) -> BoxFuture<'c, Result<T, tokio_postgres::Error>>,
    ) -> Result<T, PgError> {
        let now = Instant::now();
        let by_timeout = now + self.timeout;
        let until = Deadline::current()
            .map(|d| d.child(DEADLINE_MARGIN).map_or(now, |d| d.instant()))
            .map_or(by_timeout, |until| until.min(by_timeout));
        with_client(&self.pool, until, query).await
    }

    /// The insert; when the constraints stopped it, the row that did ([`create_on`]).
    pub(crate) async fn create(&self, new: NewIntent) -> Result<Created, IntentsError> {
        self.with_client(move |c| Box::pin(create_on(c, new)))
            .await?
    }

    /// Runs a phase's writes alone, in autocommit.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        writes: PostgresWrites<T>,
    ) -> Result<T, PgError> {
        self.with_client(writes).await
    }

    /// `succeeded` with the charge id (`Some`) or `failed` (`None`), only from `running`: the
    /// intent as it is then, if this changed it (`UPDATE ... RETURNING`).
    pub(crate) async fn settle(
        &self,
        merchant_id: String,
        intent_id: String,
        charge_id: Option<String>,
    ) -> Result<Option<Intent>, IntentsError> {
        let row = self
            .with_client(move |c| {
                Box::pin(async move {
                    settle_on(c, &merchant_id, &intent_id, charge_id.as_deref()).await
                })
            })
            .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// Reads one intent of one merchant; another merchant's intent is `None`.
    pub(crate) async fn get(
        &self,
        merchant_id: String,
        intent_id: String,
    ) -> Result<Option<Intent>, IntentsError> {
        // The primary key: at most one row.
        let rows = self
            .with_client(move |c| {
                Box::pin(async move {
                    let stmt = c.prepare_cached(&GET_SQL).await?;
                    c.query(&stmt, &[&merchant_id, &intent_id]).await
                })
            })
            .await?;
        rows.iter().map(from_row).next().transpose()
    }

    /// Every intent a merchant has for an order: at most one live, any number failed.
    pub(crate) async fn by_order(
        &self,
        merchant_id: String,
        order_id: String,
    ) -> Result<Vec<Intent>, IntentsError> {
        self.select("order_id", merchant_id, order_id).await
    }

    /// The merchant's intents whose `column` is `value`, in one statement.
    async fn select(
        &self,
        column: &'static str,
        merchant_id: String,
        value: String,
    ) -> Result<Vec<Intent>, IntentsError> {
        let rows = self
            .with_client(move |c| {
                Box::pin(async move {
                    let stmt = c.prepare_cached(&select_sql(column)).await?;
                    c.query(&stmt, &[&merchant_id, &value]).await
                })
            })
            .await?;
        rows.iter().map(from_row).collect()
    }

    /// Running intents created at or before `created_before`, oldest first, at most `limit`.
    pub(crate) async fn running_before(
        &self,
        created_before: i64,
        limit: u32,
    ) -> Result<Vec<Intent>, IntentsError> {
        let limit = i64::from(limit);
        let rows = self
            .with_client(move |c| {
                Box::pin(async move {
                    let stmt = c
                        .prepare_cached(&format!(
                            "SELECT {COLUMNS} FROM payment_intent WHERE status = 'running' \
                             AND created_at <= $1 ORDER BY created_at LIMIT $2"
                        ))
                        .await?;
                    c.query(&stmt, &[&created_before, &limit]).await
                })
            })
            .await?;
        rows.iter().map(from_row).collect()
    }

    /// Intents created in `[since, until)` after `(created_at, intent_id)`, at most `limit`.
    pub(crate) async fn created_between(
        &self,
        since: i64,
        until: i64,
        after: Option<(i64, String)>,
        limit: u32,
    ) -> Result<Vec<Intent>, IntentsError> {
        let limit = i64::from(limit);
        let (after_at, after_id) = after.unwrap_or((i64::MIN, String::new()));
        let rows = self
            .with_client(move |c| {
                Box::pin(async move {
                    let stmt = c
                        .prepare_cached(&format!(
                            "SELECT {COLUMNS} FROM payment_intent WHERE created_at >= $1 \
                             AND created_at < $2 AND (created_at, intent_id) > ($3, $4) \
                             ORDER BY created_at, intent_id LIMIT $5"
                        ))
                        .await?;
                    c.query(&stmt, &[&since, &until, &after_at, &after_id, &limit])
                        .await
                })
            })
            .await?;
        rows.iter().map(from_row).collect()
    }

    pub(crate) async fn running_stats(&self) -> Result<RunningStats, PgError> {
        let (n, oldest): (i64, Option<i64>) = self
            .with_client(|c| {
                Box::pin(async move {
                    let row = c
                        .query_one(
                            "SELECT count(*), min(created_at) FROM payment_intent \
                             WHERE status = 'running'",
                            &[],
                        )
                        .await?;
                    Ok((row.try_get(0)?, row.try_get(1)?))
                })
            })
            .await?;
        Ok(RunningStats {
            count: u64::try_from(n).unwrap_or(0),
            oldest_created_at: oldest,
        })
    }

    pub(crate) async fn count(&self) -> Result<u64, PgError> {
        let n: i64 = self
            .with_client(|c| {
                Box::pin(async move {
                    c.query_one("SELECT count(*) FROM payment_intent", &[])
                        .await?
                        .try_get(0)
                })
            })
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    pub(crate) async fn ping(&self) -> Result<(), PgError> {
        self.with_client(|c| {
            Box::pin(async move { c.simple_query("SELECT 1 FROM payment_intent LIMIT 1").await })
        })
        .await
        .map(|_| ())
    }
}
