//! The PSP's own store: one `charge` row per effect key, in its own SQLite database.
//!
//! `UNIQUE (effect_key)` is the PSP's dedup. [`ChargeStore::charge`] inserts or reads the
//! existing row inside one `BEGIN IMMEDIATE` transaction, so concurrent requests with one
//! effect key create one charge whatever their interleaving. A file database runs in WAL mode
//! with `synchronous=FULL`: a charge that was answered survives a power cut.
//!
//! Writes go through the library's SQLite writer ([`Db`]): one thread, and concurrent charges
//! group-committed, so one fsync makes a whole batch durable instead of one per charge, each
//! charge in a savepoint of its own. Reads run on its read pool.
//!
//! [`ChargeStore::void`] settles an effect key that has no charge: it records the key as
//! voided (or returns the charge it already made), in one transaction as well, so from then on
//! a charge with that key is refused ([`ChargeOutcome::Voided`]). A caller that gave up on a
//! key can thus learn its outcome for good: charged, or never to be.

use std::path::Path;
use std::sync::Arc;

use backstop::db::sqlite::{Db, SqliteOptions, Synchronous};
use rusqlite::types::Type;
use rusqlite::{Connection, OptionalExtension, Row, params};
use serde::{Deserialize, Serialize};

use super::listing::PageQuery;

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
    created_ms   INTEGER NOT NULL DEFAULT 0,
    amount_refunded_cents INTEGER NOT NULL DEFAULT 0
        CHECK (amount_refunded_cents BETWEEN 0 AND amount_cents),
    UNIQUE (effect_key)
);
CREATE INDEX IF NOT EXISTS charge_reference ON charge (reference, id);
CREATE TABLE IF NOT EXISTS voided_effect_key (
    effect_key TEXT PRIMARY KEY NOT NULL
);
";

/// Refunds, and the index their listing reads.
const MIGRATION_REFUNDS: &str = "
CREATE INDEX IF NOT EXISTS charge_created ON charge (created_ms, id);
CREATE TABLE IF NOT EXISTS refund (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    refund_id       TEXT    NOT NULL UNIQUE,
    idempotency_key TEXT    NOT NULL UNIQUE,
    charge_id       TEXT    NOT NULL REFERENCES charge (charge_id),
    amount_cents    INTEGER NOT NULL CHECK (amount_cents > 0),
    created_ms      INTEGER NOT NULL
);
";

const COLUMNS: &str = "charge_id, effect_key, reference, amount_cents, currency, status, \
     budget_ms, traceparent, created_ms, amount_refunded_cents";

const REFUND_COLUMNS: &str = "refund_id, idempotency_key, charge_id, amount_cents, created_ms";

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
    /// When the PSP recorded it, unix epoch milliseconds (0 for a charge recorded before the
    /// PSP kept the time).
    #[serde(default)]
    pub created_ms: i64,
    /// How much of it was given back by refunds, in minor units (0 to `amount_cents`).
    #[serde(default)]
    pub amount_refunded_cents: i64,
}

impl Charge {
    /// Whether money is still held on it: not refunded in full.
    pub fn is_live(&self) -> bool {
        self.amount_refunded_cents < self.amount_cents
    }
}

/// One refund, as stored and as `POST /v1/refunds` answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refund {
    /// `"re_"` + a UUIDv7 in simple form, assigned on creation.
    pub refund_id: String,
    /// The `Idempotency-Key` of the request that created it.
    pub idempotency_key: String,
    /// The charge it gives money back on.
    pub charge_id: String,
    /// Amount given back, in minor units, positive.
    pub amount_cents: i64,
    /// When the PSP recorded it, unix epoch milliseconds.
    pub created_ms: i64,
}

/// What the caller asks to refund (validated by the server before it gets here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRefund {
    /// The dedup key of the refund (not the charge's effect key).
    pub idempotency_key: String,
    /// The charge to give money back on.
    pub charge_id: String,
    /// Amount in minor units, positive.
    pub amount_cents: i64,
}

/// Result of [`ChargeStore::refund`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefundOutcome {
    /// A new refund; the charge as it stands afterwards.
    Created(Refund, Charge),
    /// The key was seen with the same charge and amount: that refund, nothing new written.
    Replayed(Refund),
    /// The key was seen with another charge or amount: nothing written.
    Conflict(Refund),
    /// No charge has this id.
    NoSuchCharge,
    /// The amount is more than what is left to refund on the charge (`remaining_cents`).
    ExceedsCharge {
        /// What can still be refunded.
        remaining_cents: i64,
    },
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
    /// SQLite refused an operation, or the database could not be opened.
    #[error("PSP store operation failed")]
    Db(#[from] backstop::db::sqlite::Error),
    /// The directory of a private database could not be made.
    #[error("PSP store could not create its private database directory")]
    PrivateDir(#[source] std::io::Error),
}

/// A stored row that does not read back as a charge (an unknown `status`).
#[derive(Debug, thiserror::Error)]
#[error("stored charge has unknown status {0:?}")]
pub struct UnknownStatus(pub String);

/// The PSP's charges, refunds and voided keys. Cloning shares the database.
#[derive(Debug, Clone)]
pub struct ChargeStore {
    db: Db,
    /// The directory holding a private database (`open(None)`), removed with the last clone.
    _private: Option<Arc<tempfile::TempDir>>,
}

impl ChargeStore {
    /// Opens (creating if needed) the database at `path` (WAL, `synchronous=FULL`), or a
    /// private one in a temporary directory when `path` is `None` (not durable: it goes with
    /// the store), and runs the migration.
    pub async fn open(path: Option<&Path>) -> Result<Self, StoreError> {
        let (private, path, synchronous) = match path {
            Some(path) => (None, path.to_path_buf(), Synchronous::Full),
            None => {
                let dir = tempfile::Builder::new()
                    .prefix("backstop-psp-")
                    .tempdir()
                    .map_err(StoreError::PrivateDir)?;
                let path = dir.path().join("psp.db");
                (Some(Arc::new(dir)), path, Synchronous::Normal)
            }
        };
        let options = SqliteOptions {
            synchronous,
            // The PSP lists and pages rarely: one reader is enough.
            read_connections: 1,
            ..SqliteOptions::default()
        };
        let db = Db::open(&path, options)?;
        db.write(|conn| {
            conn.execute_batch(MIGRATION)?;
            conn.execute_batch(MIGRATION_REFUNDS)
        })
        .await?;
        Ok(ChargeStore {
            db,
            _private: private,
        })
    }

    /// Creates the charge for `new.effect_key`, or returns the one that key already made.
    pub async fn charge(&self, new: NewCharge) -> Result<ChargeOutcome, StoreError> {
        let charge_id = format!("ch_{}", uuid::Uuid::now_v7().simple());
        let created_ms = now_ms();
        self.write(move |tx| {
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
                                             currency, status, budget_ms, traceparent,
                                             created_ms)
                         VALUES (?1, ?2, ?3, ?4, ?5, 'succeeded', ?6, ?7, ?8)
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
                        created_ms,
                    ],
                    read_charge,
                )
                .optional()?;
            let outcome = match inserted {
                Some(charge) => ChargeOutcome::Created(charge),
                None => {
                    let existing = tx.query_row(
                        &format!("SELECT {COLUMNS} FROM charge WHERE effect_key = ?1"),
                        [&new.effect_key],
                        read_charge,
                    )?;
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
            Ok(outcome)
        })
        .await
    }

    /// Settles `effect_key`: its charge if it made one, else voided for good (see the module
    /// documentation). Idempotent.
    pub async fn void(&self, effect_key: String) -> Result<VoidOutcome, StoreError> {
        self.write(move |tx| {
            let charged = tx
                .query_row(
                    &format!("SELECT {COLUMNS} FROM charge WHERE effect_key = ?1"),
                    [&effect_key],
                    read_charge,
                )
                .optional()?;
            let outcome = match charged {
                Some(charge) => VoidOutcome::Charged(charge),
                None => {
                    tx.execute(
                        "INSERT INTO voided_effect_key (effect_key) VALUES (?1) \
                         ON CONFLICT (effect_key) DO NOTHING",
                        [&effect_key],
                    )?;
                    VoidOutcome::Voided
                }
            };
            Ok(outcome)
        })
        .await
    }

    /// The newest charges (at most [`LIST_LIMIT`]), newest first; only those for `reference`
    /// when given.
    pub async fn list(&self, reference: Option<String>) -> Result<Vec<Charge>, StoreError> {
        self.read(move |conn| {
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
            Ok(rows)
        })
        .await
    }

    /// One page of charges in creation order (see [`PageQuery`]): at most `query.limit`, and
    /// whether more follow.
    pub async fn page(&self, query: PageQuery) -> Result<(Vec<Charge>, bool), StoreError> {
        self.read(move |conn| {
            // The cursor is a charge id; its row id orders the page. An unknown cursor starts
            // after nothing rather than from the beginning (the caller gets an empty page).
            let after: i64 = match &query.starting_after {
                Some(charge_id) => conn
                    .query_row(
                        "SELECT id FROM charge WHERE charge_id = ?1",
                        [charge_id],
                        |row| row.get(0),
                    )
                    .optional()?
                    .unwrap_or(i64::MAX),
                None => 0,
            };
            // One row more than asked tells whether another page follows.
            let fetch = i64::from(query.limit) + 1;
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM charge
                 WHERE id > ?1 AND created_ms >= ?2 AND created_ms < ?3
                   AND (?4 IS NULL OR reference = ?4)
                 ORDER BY id LIMIT ?5"
            ))?;
            let mut rows = stmt
                .query_map(
                    params![
                        after,
                        query.created_gte.unwrap_or(i64::MIN),
                        query.created_lt.unwrap_or(i64::MAX),
                        query.reference,
                        fetch
                    ],
                    read_charge,
                )?
                .collect::<Result<Vec<_>, _>>()?;
            let more = rows.len() > query.limit as usize;
            rows.truncate(query.limit as usize);
            Ok((rows, more))
        })
        .await
    }

    /// Gives back `new.amount_cents` of a charge, once per idempotency key (see the module
    /// documentation).
    pub async fn refund(&self, new: NewRefund) -> Result<RefundOutcome, StoreError> {
        let refund_id = format!("re_{}", uuid::Uuid::now_v7().simple());
        let created_ms = now_ms();
        self.write(move |tx| {
            let seen = tx
                .query_row(
                    &format!("SELECT {REFUND_COLUMNS} FROM refund WHERE idempotency_key = ?1"),
                    [&new.idempotency_key],
                    read_refund,
                )
                .optional()?;
            if let Some(seen) = seen {
                return Ok(
                    if seen.charge_id == new.charge_id && seen.amount_cents == new.amount_cents {
                        RefundOutcome::Replayed(seen)
                    } else {
                        RefundOutcome::Conflict(seen)
                    },
                );
            }
            let charge = tx
                .query_row(
                    &format!("SELECT {COLUMNS} FROM charge WHERE charge_id = ?1"),
                    [&new.charge_id],
                    read_charge,
                )
                .optional()?;
            let Some(mut charge) = charge else {
                return Ok(RefundOutcome::NoSuchCharge);
            };
            let remaining_cents = charge.amount_cents - charge.amount_refunded_cents;
            if new.amount_cents > remaining_cents {
                return Ok(RefundOutcome::ExceedsCharge { remaining_cents });
            }
            tx.execute(
                "INSERT INTO refund (refund_id, idempotency_key, charge_id, amount_cents,
                                     created_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    refund_id,
                    new.idempotency_key,
                    new.charge_id,
                    new.amount_cents,
                    created_ms
                ],
            )?;
            tx.execute(
                "UPDATE charge SET amount_refunded_cents = amount_refunded_cents + ?2
                 WHERE charge_id = ?1",
                params![new.charge_id, new.amount_cents],
            )?;
            charge.amount_refunded_cents += new.amount_cents;
            Ok(RefundOutcome::Created(
                Refund {
                    refund_id,
                    idempotency_key: new.idempotency_key,
                    charge_id: new.charge_id,
                    amount_cents: new.amount_cents,
                    created_ms,
                },
                charge,
            ))
        })
        .await
    }

    /// How many charges the store holds.
    pub async fn count(&self) -> Result<u64, StoreError> {
        self.read(|conn| {
            let n: i64 = conn.query_row("SELECT COUNT(*) FROM charge", [], |row| row.get(0))?;
            Ok(u64::try_from(n).unwrap_or(0))
        })
        .await
    }

    /// Runs `f` as one write job: its writes commit together (in their own savepoint of a
    /// group-committed transaction) once `f` returns `Ok`, and are rolled back alone if it
    /// fails.
    async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        Ok(self.db.write(f).await?)
    }

    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        Ok(self.db.read(f).await?)
    }
}

/// The wall clock in unix milliseconds: what charges and refunds record as their time.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX)
        })
}

fn read_refund(row: &Row<'_>) -> rusqlite::Result<Refund> {
    Ok(Refund {
        refund_id: row.get(0)?,
        idempotency_key: row.get(1)?,
        charge_id: row.get(2)?,
        amount_cents: row.get(3)?,
        created_ms: row.get(4)?,
    })
}

/// Reads one row of [`COLUMNS`]. An unknown status fails like a column of the wrong type, so
/// a write job that meets one is rolled back.
fn read_charge(row: &Row<'_>) -> rusqlite::Result<Charge> {
    let status: String = row.get(5)?;
    let status = match status.as_str() {
        "succeeded" => ChargeStatus::Succeeded,
        _ => {
            return Err(rusqlite::Error::FromSqlConversionFailure(
                5,
                Type::Text,
                Box::new(UnknownStatus(status)),
            ));
        }
    };
    Ok(Charge {
        charge_id: row.get(0)?,
        effect_key: row.get(1)?,
        reference: row.get(2)?,
        amount_cents: row.get(3)?,
        currency: row.get(4)?,
        status,
        budget_ms: row.get(6)?,
        traceparent: row.get(7)?,
        created_ms: row.get(8)?,
        amount_refunded_cents: row.get(9)?,
    })
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
        let store = ChargeStore::open(None).await.unwrap();
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
        let store = ChargeStore::open(None).await.unwrap();
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
        let store = ChargeStore::open(None).await.unwrap();
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
            let store = ChargeStore::open(Some(&path)).await.unwrap();
            match store.charge(new_charge("k", "o", 700)).await.unwrap() {
                ChargeOutcome::Created(charge) => charge,
                other => panic!("expected a new charge, got {other:?}"),
            }
        };
        let store = ChargeStore::open(Some(&path)).await.unwrap();
        assert_eq!(
            store.charge(new_charge("k", "o", 700)).await.unwrap(),
            ChargeOutcome::Replayed(created)
        );
    }

    fn refund_of(key: &str, charge: &Charge, amount_cents: i64) -> NewRefund {
        NewRefund {
            idempotency_key: key.to_owned(),
            charge_id: charge.charge_id.clone(),
            amount_cents,
        }
    }

    #[tokio::test]
    async fn refunds_are_deduplicated_on_their_key_and_bounded_by_the_charge() {
        let store = ChargeStore::open(None).await.unwrap();
        let ChargeOutcome::Created(charge) = store.charge(new_charge("k", "o", 500)).await.unwrap()
        else {
            panic!("not charged");
        };
        assert!(charge.is_live());
        let RefundOutcome::Created(first, after) =
            store.refund(refund_of("r1", &charge, 200)).await.unwrap()
        else {
            panic!("not refunded");
        };
        assert!(first.refund_id.starts_with("re_"));
        assert_eq!(after.amount_refunded_cents, 200);
        assert_eq!(
            store.refund(refund_of("r1", &charge, 200)).await.unwrap(),
            RefundOutcome::Replayed(first.clone())
        );
        assert_eq!(
            store.refund(refund_of("r1", &charge, 300)).await.unwrap(),
            RefundOutcome::Conflict(first)
        );
        assert_eq!(
            store.refund(refund_of("r2", &charge, 301)).await.unwrap(),
            RefundOutcome::ExceedsCharge {
                remaining_cents: 300
            }
        );
        let RefundOutcome::Created(_, after) =
            store.refund(refund_of("r3", &charge, 300)).await.unwrap()
        else {
            panic!("rest not refunded");
        };
        assert_eq!(after.amount_refunded_cents, 500);
        assert!(!after.is_live());
        let mut unknown = refund_of("r4", &charge, 1);
        unknown.charge_id = "ch_nope".into();
        assert_eq!(
            store.refund(unknown).await.unwrap(),
            RefundOutcome::NoSuchCharge
        );
        let listed = store.list(Some("o".into())).await.unwrap();
        assert_eq!(listed[0].amount_refunded_cents, 500);
    }

    #[tokio::test]
    async fn pages_walk_a_window_in_creation_order() {
        let store = ChargeStore::open(None).await.unwrap();
        for i in 0..7 {
            store
                .charge(new_charge(&format!("k{i}"), &format!("o{}", i % 2), 100))
                .await
                .unwrap();
        }
        let mut keys = Vec::new();
        let mut query = PageQuery {
            limit: 3,
            ..PageQuery::default()
        };
        loop {
            let (page, more) = store.page(query.clone()).await.unwrap();
            assert!(page.len() <= 3);
            keys.extend(page.iter().map(|c| c.effect_key.clone()));
            if !more {
                break;
            }
            query.starting_after = page.last().map(|c| c.charge_id.clone());
        }
        assert_eq!(keys, ["k0", "k1", "k2", "k3", "k4", "k5", "k6"]);

        let only_o1 = PageQuery {
            reference: Some("o1".into()),
            ..PageQuery::default()
        };
        let (page, more) = store.page(only_o1).await.unwrap();
        assert!(!more);
        assert_eq!(page.len(), 3);

        let all = store.list(None).await.unwrap();
        let created = all.iter().map(|c| c.created_ms).max().unwrap();
        let empty = PageQuery {
            created_gte: Some(created + 1),
            ..PageQuery::default()
        };
        assert_eq!(store.page(empty).await.unwrap(), (Vec::new(), false));
        let before = PageQuery {
            created_lt: Some(created + 1),
            ..PageQuery::default()
        };
        assert_eq!(store.page(before).await.unwrap().0.len(), 7);
        let unknown_cursor = PageQuery {
            starting_after: Some("ch_unknown".into()),
            ..PageQuery::default()
        };
        assert_eq!(
            store.page(unknown_cursor).await.unwrap(),
            (Vec::new(), false)
        );
    }

    /// Concurrent charges share transactions (and fsyncs) instead of taking one each, and
    /// each still charges once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_charges_are_group_committed() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChargeStore::open(Some(&dir.path().join("psp.db")))
            .await
            .unwrap();
        let before = store.db.stats();
        let charges = (0..200).map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .charge(new_charge(
                        &format!("k{}", i % 100),
                        &format!("o{}", i % 100),
                        500,
                    ))
                    .await
                    .unwrap()
            })
        });
        let mut created = 0;
        for charge in charges.collect::<Vec<_>>() {
            match charge.await.unwrap() {
                ChargeOutcome::Created(_) => created += 1,
                ChargeOutcome::Replayed(_) => {}
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(created, 100, "one charge per key");
        assert_eq!(store.count().await.unwrap(), 100);
        let after = store.db.stats();
        assert_eq!(after.jobs - before.jobs, 200);
        assert!(
            after.transactions - before.transactions < 200,
            "{} transactions for 200 charges",
            after.transactions - before.transactions
        );
    }

    /// A row the store cannot read back fails the job that met it, and that job's writes are
    /// rolled back.
    #[tokio::test]
    async fn an_unknown_status_is_an_error_not_a_charge() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("psp.db");
        let store = ChargeStore::open(Some(&path)).await.unwrap();
        store.charge(new_charge("k", "o", 500)).await.unwrap();
        store
            .db
            .write(|conn| {
                conn.execute_batch(
                    "PRAGMA ignore_check_constraints = ON;
                     UPDATE charge SET status = 'lost' WHERE effect_key = 'k';",
                )
            })
            .await
            .unwrap();
        let error = store.charge(new_charge("k", "o", 500)).await.unwrap_err();
        assert!(
            format!("{error:?}").contains(r#"UnknownStatus("lost")"#),
            "{error:?}"
        );
        assert!(store.void("k".into()).await.is_err());
        assert_eq!(store.count().await.unwrap(), 1);
    }
}
