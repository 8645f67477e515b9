//! The PSP's own store: one `charge` row per effect key, in its own SQLite database.
//!
//! `UNIQUE (effect_key)` is the PSP's dedup. [`ChargeStore::charge`] inserts or reads the
//! existing row inside one `BEGIN IMMEDIATE` transaction, so concurrent requests with one
//! effect key create one charge whatever their interleaving. A file database runs in WAL mode
//! with `synchronous=FULL`: a charge that was answered survives a power cut.
//!
//! [`ChargeStore::void`] settles an effect key that has no charge: it records the key as
//! voided (or returns the charge it already made), in one transaction as well, so from then on
//! a charge with that key is refused ([`ChargeOutcome::Voided`]). A caller that gave up on a
//! key can thus learn its outcome for good: charged, or never to be.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::{Connection, OptionalExtension, Row, TransactionBehavior, params};
use serde::{Deserialize, Serialize};

/// The most rows one listing returns (the newest ones).
pub const LIST_LIMIT: usize = 1000;

const MIGRATION: &str = "
CREATE TABLE IF NOT EXISTS charge (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    charge_id    TEXT    NOT NULL UNIQUE,
    effect_key   TEXT    NOT NULL,
    reference    TEXT    NOT NULL,
    amount_cents INTEGER NOT NULL CHECK (amount_cents > 0),
    currency     TEXT    NOT NULL,
    status       TEXT    NOT NULL CHECK (status IN ('succeeded')),
    budget_ms    INTEGER,
    traceparent  TEXT,
    UNIQUE (effect_key)
);
CREATE INDEX IF NOT EXISTS charge_reference ON charge (reference, id);
CREATE TABLE IF NOT EXISTS voided_effect_key (
    effect_key TEXT PRIMARY KEY NOT NULL
);
";

const COLUMNS: &str =
    "charge_id, effect_key, reference, amount_cents, currency, status, budget_ms, traceparent";

/// The state of a charge. The simulator only ever records successful charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChargeStatus {
    /// The money moved.
    Succeeded,
}

impl ChargeStatus {
    /// The name stored and sent on the wire (`"succeeded"`).
    pub fn as_str(self) -> &'static str {
        match self {
            ChargeStatus::Succeeded => "succeeded",
        }
    }
}

/// One charge, as stored and as the PSP answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    /// `"ch_"` + a UUIDv7 in simple form, assigned on creation.
    pub charge_id: String,
    /// The `Idempotency-Key` of the request that created it (the caller's effect key).
    pub effect_key: String,
    /// The caller's reference (the order id).
    pub reference: String,
    /// Amount in minor units, always positive.
    pub amount_cents: i64,
    /// ISO 4217 code, e.g. `"USD"`.
    pub currency: String,
    /// Always [`ChargeStatus::Succeeded`].
    pub status: ChargeStatus,
    /// The time budget the creating request carried in `grpc-timeout`, in whole
    /// milliseconds, or `None` when it carried none.
    pub budget_ms: Option<i64>,
    /// The `traceparent` header of the creating request, if any.
    pub traceparent: Option<String>,
}

/// What the caller asks to charge (validated by the server before it gets here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCharge {
    /// The dedup key.
    pub effect_key: String,
    /// The caller's reference (the order id).
    pub reference: String,
    /// Amount in minor units, positive.
    pub amount_cents: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// Budget seen in `grpc-timeout`, in milliseconds.
    pub budget_ms: Option<i64>,
    /// `traceparent` seen on the request.
    pub traceparent: Option<String>,
}

/// Result of [`ChargeStore::charge`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeOutcome {
    /// First request with this effect key: a new charge.
    Created(Charge),
    /// The effect key was seen with the same reference, amount and currency: the existing
    /// charge, nothing new written.
    Replayed(Charge),
    /// The effect key was seen with other parameters: the existing charge, nothing written.
    Conflict(Charge),
    /// The effect key was voided ([`ChargeStore::void`]): nothing charged, ever.
    Voided,
}

/// Result of [`ChargeStore::void`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VoidOutcome {
    /// The key has no charge and now never will (also when it was voided before).
    Voided,
    /// The key had already charged: nothing changed.
    Charged(Charge),
}

/// Failures of the PSP store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite refused an operation.
    #[error("PSP store operation failed")]
    Sqlite(#[from] rusqlite::Error),
    /// The blocking task running the operation did not finish.
    #[error("PSP store task did not complete")]
    Task(#[from] tokio::task::JoinError),
    /// A stored row does not read back as a charge.
    #[error("stored charge has unknown status {0:?}")]
    UnknownStatus(String),
}

/// The PSP's charge table behind one connection (this is a simulator: writes are serialized).
/// Cloning shares the connection.
#[derive(Debug, Clone)]
pub struct ChargeStore {
    conn: Arc<Mutex<Connection>>,
}

impl ChargeStore {
    /// Opens (creating if needed) the database at `path`, or a private in-memory one when
    /// `path` is `None`, and runs the migration.
    pub fn open(path: Option<&Path>) -> Result<Self, StoreError> {
        let conn = match path {
            Some(path) => {
                let conn = Connection::open(path)?;
                // journal_mode answers with a row, so it cannot go through execute_batch.
                let _mode: String =
                    conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
                conn.execute_batch("PRAGMA synchronous = FULL; PRAGMA busy_timeout = 5000;")?;
                conn
            }
            None => Connection::open_in_memory()?,
        };
        conn.execute_batch(MIGRATION)?;
        Ok(ChargeStore {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    /// Creates the charge for `new.effect_key`, or returns the one that key already made.
    pub async fn charge(&self, new: NewCharge) -> Result<ChargeOutcome, StoreError> {
        let charge_id = format!("ch_{}", uuid::Uuid::now_v7().simple());
        self.with_conn(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let voided = tx
                .query_row(
                    "SELECT 1 FROM voided_effect_key WHERE effect_key = ?1",
                    [&new.effect_key],
                    |_| Ok(()),
                )
                .optional()?;
            if voided.is_some() {
                return Ok(ChargeOutcome::Voided);
            }
            let inserted = tx
                .query_row(
                    &format!(
                        "INSERT INTO charge (charge_id, effect_key, reference, amount_cents,
                                             currency, status, budget_ms, traceparent)
                         VALUES (?1, ?2, ?3, ?4, ?5, 'succeeded', ?6, ?7)
                         ON CONFLICT (effect_key) DO NOTHING
                         RETURNING {COLUMNS}"
                    ),
                    params![
                        charge_id,
                        new.effect_key,
                        new.reference,
                        new.amount_cents,
                        new.currency,
                        new.budget_ms,
                        new.traceparent,
                    ],
                    read_charge,
                )
                .optional()?;
            let outcome = match inserted {
                Some(charge) => ChargeOutcome::Created(charge?),
                None => {
                    let existing = tx.query_row(
                        &format!("SELECT {COLUMNS} FROM charge WHERE effect_key = ?1"),
                        [&new.effect_key],
                        read_charge,
                    )??;
                    if existing.reference == new.reference
                        && existing.amount_cents == new.amount_cents
                        && existing.currency == new.currency
                    {
                        ChargeOutcome::Replayed(existing)
                    } else {
                        ChargeOutcome::Conflict(existing)
                    }
                }
            };
            tx.commit()?;
            Ok(outcome)
        })
        .await
    }

    /// Settles `effect_key`: its charge if it made one, else voided for good (see the module
    /// documentation). Idempotent.
    pub async fn void(&self, effect_key: String) -> Result<VoidOutcome, StoreError> {
        self.with_conn(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let charged = tx
                .query_row(
                    &format!("SELECT {COLUMNS} FROM charge WHERE effect_key = ?1"),
                    [&effect_key],
                    read_charge,
                )
                .optional()?;
            let outcome = match charged {
                Some(charge) => VoidOutcome::Charged(charge?),
                None => {
                    tx.execute(
                        "INSERT INTO voided_effect_key (effect_key) VALUES (?1) \
                         ON CONFLICT (effect_key) DO NOTHING",
                        [&effect_key],
                    )?;
                    VoidOutcome::Voided
                }
            };
            tx.commit()?;
            Ok(outcome)
        })
        .await
    }

    /// The newest charges (at most [`LIST_LIMIT`]), newest first; only those for `reference`
    /// when given.
    pub async fn list(&self, reference: Option<String>) -> Result<Vec<Charge>, StoreError> {
        self.with_conn(move |conn| {
            let limit = i64::try_from(LIST_LIMIT).unwrap_or(i64::MAX);
            let rows = match reference {
                Some(reference) => {
                    let mut stmt = conn.prepare_cached(&format!(
                        "SELECT {COLUMNS} FROM charge WHERE reference = ?1
                         ORDER BY id DESC LIMIT ?2"
                    ))?;
                    stmt.query_map(params![reference, limit], read_charge)?
                        .collect::<Result<Vec<_>, _>>()?
                }
                None => {
                    let mut stmt = conn.prepare_cached(&format!(
                        "SELECT {COLUMNS} FROM charge ORDER BY id DESC LIMIT ?1"
                    ))?;
                    stmt.query_map([limit], read_charge)?
                        .collect::<Result<Vec<_>, _>>()?
                }
            };
            rows.into_iter().collect()
        })
        .await
    }

    /// How many charges the store holds.
    pub async fn count(&self) -> Result<u64, StoreError> {
        self.with_conn(|conn| {
            let n: i64 = conn.query_row("SELECT COUNT(*) FROM charge", [], |row| row.get(0))?;
            Ok(u64::try_from(n).unwrap_or(0))
        })
        .await
    }

    async fn with_conn<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let conn = Arc::clone(&self.conn);
        tokio::task::spawn_blocking(move || {
            // A panic cannot leave the connection mid-transaction: the transaction rolls
            // back when dropped, so a poisoned lock is still usable.
            let mut conn = conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            f(&mut conn)
        })
        .await?
    }
}

/// Reads one row of [`COLUMNS`]; the outer result is SQLite's, the inner one ours.
fn read_charge(row: &Row<'_>) -> rusqlite::Result<Result<Charge, StoreError>> {
    let status: String = row.get(5)?;
    let status = match status.as_str() {
        "succeeded" => ChargeStatus::Succeeded,
        _ => return Ok(Err(StoreError::UnknownStatus(status))),
    };
    Ok(Ok(Charge {
        charge_id: row.get(0)?,
        effect_key: row.get(1)?,
        reference: row.get(2)?,
        amount_cents: row.get(3)?,
        currency: row.get(4)?,
        status,
        budget_ms: row.get(6)?,
        traceparent: row.get(7)?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_charge(key: &str, reference: &str, amount_cents: i64) -> NewCharge {
        NewCharge {
            effect_key: key.to_owned(),
            reference: reference.to_owned(),
            amount_cents,
            currency: "USD".to_owned(),
            budget_ms: Some(900),
            traceparent: None,
        }
    }

    #[tokio::test]
    async fn same_key_creates_once_then_replays_or_conflicts() {
        let store = ChargeStore::open(None).unwrap();
        let ChargeOutcome::Created(first) =
            store.charge(new_charge("k1", "o1", 500)).await.unwrap()
        else {
            panic!("first charge not created");
        };
        assert!(first.charge_id.starts_with("ch_"));
        assert_eq!(first.charge_id.len(), 3 + 32);
        assert_eq!(first.budget_ms, Some(900));

        let mut again = new_charge("k1", "o1", 500);
        again.budget_ms = None;
        assert_eq!(
            store.charge(again).await.unwrap(),
            ChargeOutcome::Replayed(first.clone())
        );
        assert_eq!(
            store.charge(new_charge("k1", "o1", 501)).await.unwrap(),
            ChargeOutcome::Conflict(first.clone())
        );
        assert_eq!(
            store.charge(new_charge("k1", "o2", 500)).await.unwrap(),
            ChargeOutcome::Conflict(first.clone())
        );
        assert_eq!(store.count().await.unwrap(), 1);
    }

    #[tokio::test]
    async fn a_voided_key_never_charges_and_a_charged_key_is_not_voided() {
        let store = ChargeStore::open(None).unwrap();
        assert_eq!(store.void("k1".into()).await.unwrap(), VoidOutcome::Voided);
        assert_eq!(store.void("k1".into()).await.unwrap(), VoidOutcome::Voided);
        assert_eq!(
            store.charge(new_charge("k1", "o1", 500)).await.unwrap(),
            ChargeOutcome::Voided
        );
        assert_eq!(store.count().await.unwrap(), 0);

        let ChargeOutcome::Created(charge) =
            store.charge(new_charge("k2", "o2", 500)).await.unwrap()
        else {
            panic!("k2 not charged");
        };
        assert_eq!(
            store.void("k2".into()).await.unwrap(),
            VoidOutcome::Charged(charge.clone())
        );
        assert_eq!(
            store.charge(new_charge("k2", "o2", 500)).await.unwrap(),
            ChargeOutcome::Replayed(charge)
        );
    }

    #[tokio::test]
    async fn list_filters_by_reference_newest_first() {
        let store = ChargeStore::open(None).unwrap();
        for (key, reference) in [("a", "o1"), ("b", "o2"), ("c", "o1")] {
            store.charge(new_charge(key, reference, 100)).await.unwrap();
        }
        let o1: Vec<String> = store
            .list(Some("o1".to_owned()))
            .await
            .unwrap()
            .into_iter()
            .map(|c| c.effect_key)
            .collect();
        assert_eq!(o1, ["c", "a"]);
        assert_eq!(store.list(None).await.unwrap().len(), 3);
        assert!(
            store
                .list(Some("none".to_owned()))
                .await
                .unwrap()
                .is_empty()
        );
    }

    #[tokio::test]
    async fn file_store_keeps_charges_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("psp.db");
        let created = {
            let store = ChargeStore::open(Some(&path)).unwrap();
            match store.charge(new_charge("k", "o", 700)).await.unwrap() {
                ChargeOutcome::Created(charge) => charge,
                other => panic!("expected a new charge, got {other:?}"),
            }
        };
        let store = ChargeStore::open(Some(&path)).unwrap();
        assert_eq!(
            store.charge(new_charge("k", "o", 700)).await.unwrap(),
            ChargeOutcome::Replayed(created)
        );
    }
}
