//! The `payment_intent` table on SQLite: its migrations and the only queries that touch it.
//!
//! The functions are synchronous and take a [`rusqlite::Connection`], so they run inside the
//! group-commit writer of [`Db`](backstop::db::sqlite::Db) (see [`Intents`](super::Intents)),
//! inside an idempotency record's transaction (a phase, see [`PaymentWrites`](super::PaymentWrites)),
//! and in plain unit tests alike.

use rusqlite::{Connection, OptionalExtension, Row, params};

use super::{Created, Intent, IntentStatus, NewIntent, RunningStats};

/// Migration name registered with the shared database.
pub const MIGRATION_NAME: &str = "payment_intent_v1";

/// Schema of `payment_intent`: three keys. The business key binds live intents only (a
/// `failed` intent frees its order), and running intents are indexed by age for the resolver.
pub const MIGRATION_SQL: &str = "
CREATE TABLE IF NOT EXISTS payment_intent (
  intent_id     TEXT PRIMARY KEY,
  merchant_id   TEXT    NOT NULL,
  order_id      TEXT    NOT NULL,
  amount_cents  INTEGER NOT NULL,
  request_key   TEXT    NOT NULL,
  fingerprint   TEXT    NOT NULL,
  effect_key    TEXT    NOT NULL,
  status        TEXT    NOT NULL CHECK (status IN ('running','succeeded','failed')),
  psp_charge_id TEXT,
  created_at    INTEGER NOT NULL,
  currency      TEXT    NOT NULL DEFAULT 'USD',
  UNIQUE (merchant_id, request_key)
);
CREATE UNIQUE INDEX IF NOT EXISTS idx_effect_key ON payment_intent (merchant_id, effect_key);
CREATE UNIQUE INDEX IF NOT EXISTS idx_live_order ON payment_intent (merchant_id, order_id)
  WHERE status <> 'failed';
CREATE INDEX IF NOT EXISTS idx_running_age ON payment_intent (created_at) WHERE status = 'running';
";

const COLUMNS: &str = "intent_id, merchant_id, order_id, amount_cents, currency, request_key, \
     fingerprint, effect_key, status, psp_charge_id, created_at";

fn from_row(row: &Row<'_>) -> rusqlite::Result<Intent> {
    let status: String = row.get(8)?;
    let status = IntentStatus::from_column(&status).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            8,
            rusqlite::types::Type::Text,
            format!("unknown intent status {status:?}").into(),
        )
    })?;
    Ok(Intent {
        intent_id: row.get(0)?,
        merchant_id: row.get(1)?,
        order_id: row.get(2)?,
        amount_cents: row.get(3)?,
        currency: row.get(4)?,
        request_key: row.get(5)?,
        fingerprint: row.get(6)?,
        effect_key: row.get(7)?,
        status,
        psp_charge_id: row.get(9)?,
        created_at: row.get(10)?,
    })
}

fn select_one(
    conn: &Connection,
    filter: &str,
    a: &str,
    b: &str,
) -> rusqlite::Result<Option<Intent>> {
    let sql = format!("SELECT {COLUMNS} FROM payment_intent WHERE {filter}");
    conn.prepare_cached(&sql)?
        .query_row(params![a, b], from_row)
        .optional()
}

/// Creates the intent with one `INSERT`, letting the unique constraints decide.
///
/// When the insert is stopped, the row that stopped it is read back: the same request key with
/// the same parameters resumes that intent; the same request key with other parameters is
/// [`Created::KeyReused`]; the same order under another key, while that intent is live, is
/// [`Created::OrderConflict`].
/// Run it inside one transaction (the group-commit writer does) so the read sees the row that
/// stopped the insert.
pub fn insert(conn: &Connection, new: &NewIntent) -> rusqlite::Result<Created> {
    let inserted = conn
        .prepare_cached(
            "INSERT INTO payment_intent (intent_id, merchant_id, order_id, amount_cents, currency, \
             request_key, fingerprint, effect_key, status, psp_charge_id, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?1, 'running', NULL, ?8) \
             ON CONFLICT DO NOTHING",
        )?
        .execute(params![
            new.intent_id,
            new.merchant_id,
            new.order_id,
            new.amount_cents,
            new.currency,
            new.request_key,
            new.fingerprint,
            new.created_at,
        ])?;
    if inserted == 1 {
        return Ok(Created::New(Intent {
            intent_id: new.intent_id.clone(),
            merchant_id: new.merchant_id.clone(),
            order_id: new.order_id.clone(),
            amount_cents: new.amount_cents,
            currency: new.currency.clone(),
            request_key: new.request_key.clone(),
            fingerprint: new.fingerprint.clone(),
            effect_key: new.intent_id.clone(),
            status: IntentStatus::Running,
            psp_charge_id: None,
            created_at: new.created_at,
        }));
    }
    if let Some(existing) = select_one(
        conn,
        "merchant_id = ?1 AND request_key = ?2",
        &new.merchant_id,
        &new.request_key,
    )? {
        return Ok(
            if existing.order_id == new.order_id && existing.fingerprint == new.fingerprint {
                Created::Resumed(existing)
            } else {
                Created::KeyReused(existing)
            },
        );
    }
    if let Some(existing) = select_one(
        conn,
        "merchant_id = ?1 AND order_id = ?2 AND status <> 'failed'",
        &new.merchant_id,
        &new.order_id,
    )? {
        return Ok(Created::OrderConflict(existing));
    }
    Ok(Created::IdCollision)
}

/// Marks a running intent succeeded with the PSP's charge id. Returns whether a row changed
/// (false when it was already terminal: the first answer wins).
pub fn mark_succeeded(
    conn: &Connection,
    merchant_id: &str,
    intent_id: &str,
    psp_charge_id: &str,
) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(
            "UPDATE payment_intent SET status = 'succeeded', psp_charge_id = ?3 \
             WHERE merchant_id = ?1 AND intent_id = ?2 AND status = 'running'",
        )?
        .execute(params![merchant_id, intent_id, psp_charge_id])?;
    Ok(n == 1)
}

/// Marks a running intent failed (the PSP refused definitively). Returns whether a row changed.
pub fn mark_failed(
    conn: &Connection,
    merchant_id: &str,
    intent_id: &str,
) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(
            "UPDATE payment_intent SET status = 'failed' \
             WHERE merchant_id = ?1 AND intent_id = ?2 AND status = 'running'",
        )?
        .execute(params![merchant_id, intent_id])?;
    Ok(n == 1)
}

/// Reads one intent of one merchant; another merchant's intent is `None`.
pub fn get(
    conn: &Connection,
    merchant_id: &str,
    intent_id: &str,
) -> rusqlite::Result<Option<Intent>> {
    select_one(
        conn,
        "merchant_id = ?1 AND intent_id = ?2",
        merchant_id,
        intent_id,
    )
}

/// Every intent a merchant has for an order: at most one live, any number failed.
pub fn by_order(
    conn: &Connection,
    merchant_id: &str,
    order_id: &str,
) -> rusqlite::Result<Vec<Intent>> {
    let sql =
        format!("SELECT {COLUMNS} FROM payment_intent WHERE merchant_id = ?1 AND order_id = ?2");
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params![merchant_id, order_id], from_row)?;
    rows.collect()
}

/// Running intents (all merchants) created at or before `created_before` (unix ms), oldest
/// first, at most `limit`: candidates for the resolver.
pub fn running_before(
    conn: &Connection,
    created_before: i64,
    limit: u32,
) -> rusqlite::Result<Vec<Intent>> {
    let sql = format!(
        "SELECT {COLUMNS} FROM payment_intent WHERE status = 'running' AND created_at <= ?1 \
         ORDER BY created_at LIMIT ?2"
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params![created_before, limit], from_row)?;
    rows.collect()
}

/// Intents (all merchants) created in `[since, until)` (unix ms) after the position `after`
/// (`(created_at, intent_id)` of the last row of the previous page), in that order, at most
/// `limit`: a page of a time window, for reconciliation.
pub fn created_between(
    conn: &Connection,
    since: i64,
    until: i64,
    after: Option<(i64, &str)>,
    limit: u32,
) -> rusqlite::Result<Vec<Intent>> {
    let (after_at, after_id) = after.unwrap_or((i64::MIN, ""));
    let sql = format!(
        "SELECT {COLUMNS} FROM payment_intent WHERE created_at >= ?1 AND created_at < ?2 \
         AND (created_at, intent_id) > (?3, ?4) ORDER BY created_at, intent_id LIMIT ?5"
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params![since, until, after_at, after_id, limit], from_row)?;
    rows.collect()
}

/// [`RunningStats`] in one statement (the partial index on running intents answers it).
pub fn running_stats(conn: &Connection) -> rusqlite::Result<RunningStats> {
    conn.query_row(
        "SELECT COUNT(*), MIN(created_at) FROM payment_intent WHERE status = 'running'",
        [],
        |r| {
            Ok(RunningStats {
                count: r.get(0)?,
                oldest_created_at: r.get(1)?,
            })
        },
    )
}

/// Number of intents in the table (all merchants).
pub fn count(conn: &Connection) -> rusqlite::Result<u64> {
    conn.query_row("SELECT COUNT(*) FROM payment_intent", [], |r| r.get(0))
}

/// [`mark_succeeded`] (with a charge id) or [`mark_failed`] (without), returning the intent as
/// it is then when this changed it (`UPDATE ... RETURNING`; `None`: it was not running).
pub fn settle(
    conn: &Connection,
    merchant_id: &str,
    intent_id: &str,
    charge_id: Option<&str>,
) -> rusqlite::Result<Option<Intent>> {
    match charge_id {
        Some(charge) => conn
            .prepare_cached(&format!(
                "UPDATE payment_intent SET status = 'succeeded', psp_charge_id = ?3 \
                 WHERE merchant_id = ?1 AND intent_id = ?2 AND status = 'running' \
                 RETURNING {COLUMNS}"
            ))?
            .query_row(params![merchant_id, intent_id, charge], from_row)
            .optional(),
        None => conn
            .prepare_cached(&format!(
                "UPDATE payment_intent SET status = 'failed' \
                 WHERE merchant_id = ?1 AND intent_id = ?2 AND status = 'running' \
                 RETURNING {COLUMNS}"
            ))?
            .query_row(params![merchant_id, intent_id], from_row)
            .optional(),
    }
}

#[cfg(test)]
mod tests {
    use backstop::db::sqlite::Db;

    use super::*;
    use crate::intents::Intents;

    fn db() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(MIGRATION_SQL).unwrap();
        conn
    }

    fn new(id: &str, merchant: &str, order: &str, key: &str, fp: &str) -> NewIntent {
        NewIntent {
            intent_id: id.into(),
            merchant_id: merchant.into(),
            order_id: order.into(),
            amount_cents: 100,
            currency: "USD".into(),
            request_key: key.into(),
            fingerprint: fp.into(),
            created_at: 1,
        }
    }

    #[test]
    fn first_insert_creates_a_running_intent_whose_effect_key_is_its_id() {
        let c = db();
        let Created::New(i) = insert(&c, &new("i1", "m", "o1", "k1", "f")).unwrap() else {
            panic!("expected a new intent");
        };
        assert_eq!(i.status, IntentStatus::Running);
        assert_eq!(i.effect_key, "i1");
        assert_eq!(get(&c, "m", "i1").unwrap(), Some(i));
    }

    #[test]
    fn same_request_key_resumes_the_existing_intent() {
        let c = db();
        insert(&c, &new("i1", "m", "o1", "k1", "f")).unwrap();
        let Created::Resumed(i) = insert(&c, &new("i2", "m", "o1", "k1", "f")).unwrap() else {
            panic!("expected resume");
        };
        assert_eq!(i.intent_id, "i1");
        assert_eq!(count(&c).unwrap(), 1);
    }

    #[test]
    fn same_request_key_other_parameters_is_key_reused() {
        let c = db();
        insert(&c, &new("i1", "m", "o1", "k1", "f")).unwrap();
        assert!(matches!(
            insert(&c, &new("i2", "m", "o1", "k1", "g")).unwrap(),
            Created::KeyReused(_)
        ));
        assert!(matches!(
            insert(&c, &new("i3", "m", "o2", "k1", "f")).unwrap(),
            Created::KeyReused(_)
        ));
        assert_eq!(count(&c).unwrap(), 1);
    }

    #[test]
    fn same_order_other_key_is_order_conflict_naming_the_intent() {
        let c = db();
        insert(&c, &new("i1", "m", "o1", "k1", "f")).unwrap();
        let Created::OrderConflict(i) = insert(&c, &new("i2", "m", "o1", "k2", "f")).unwrap()
        else {
            panic!("expected order conflict");
        };
        assert_eq!(i.intent_id, "i1");
        assert_eq!(count(&c).unwrap(), 1);
    }

    #[test]
    fn a_failed_intent_frees_its_order_for_another_key() {
        let c = db();
        insert(&c, &new("i1", "m", "o1", "k1", "f")).unwrap();
        assert!(mark_failed(&c, "m", "i1").unwrap());
        let Created::New(i) = insert(&c, &new("i2", "m", "o1", "k2", "f")).unwrap() else {
            panic!("expected a new intent for the freed order");
        };
        assert_eq!(i.order_id, "o1");
        // The new live intent binds the order again.
        let Created::OrderConflict(live) = insert(&c, &new("i3", "m", "o1", "k3", "f")).unwrap()
        else {
            panic!("expected order conflict");
        };
        assert_eq!(live.intent_id, "i2");
        // The failed intent's own key still answers with it.
        assert!(matches!(
            insert(&c, &new("i4", "m", "o1", "k1", "f")).unwrap(),
            Created::Resumed(i) if i.intent_id == "i1" && i.status == IntentStatus::Failed
        ));
        assert_eq!(by_order(&c, "m", "o1").unwrap().len(), 2);
    }

    #[test]
    fn running_before_lists_old_running_intents_oldest_first() {
        let c = db();
        for (id, at) in [("i3", 30), ("i1", 10), ("i2", 20), ("i4", 40)] {
            let mut n = new(id, "m", id, id, "f");
            n.created_at = at;
            insert(&c, &n).unwrap();
        }
        assert!(mark_succeeded(&c, "m", "i2", "ch").unwrap());
        let ids = |v: Vec<Intent>| v.into_iter().map(|i| i.intent_id).collect::<Vec<_>>();
        assert_eq!(ids(running_before(&c, 30, 10).unwrap()), ["i1", "i3"]);
        assert_eq!(ids(running_before(&c, 30, 1).unwrap()), ["i1"]);
    }

    #[test]
    fn running_stats_count_running_intents_and_the_oldest() {
        let c = db();
        assert_eq!(running_stats(&c).unwrap(), RunningStats::default());
        for (id, at) in [("i3", 30), ("i1", 10), ("i2", 20)] {
            let mut n = new(id, "m", id, id, "f");
            n.created_at = at;
            insert(&c, &n).unwrap();
        }
        assert_eq!(
            running_stats(&c).unwrap(),
            RunningStats {
                count: 3,
                oldest_created_at: Some(10)
            }
        );
        assert!(mark_succeeded(&c, "m", "i1", "ch").unwrap());
        assert!(mark_failed(&c, "m", "i2").unwrap());
        assert_eq!(
            running_stats(&c).unwrap(),
            RunningStats {
                count: 1,
                oldest_created_at: Some(30)
            }
        );
    }

    #[test]
    fn a_live_intent_holds_its_order() {
        let c = db();
        insert(&c, &new("i1", "m", "o1", "k1", "f")).unwrap();
        assert!(mark_succeeded(&c, "m", "i1", "ch_1").unwrap());
        assert!(matches!(
            insert(&c, &new("i2", "m", "o1", "k2", "f")).unwrap(),
            Created::OrderConflict(_)
        ));
    }

    #[test]
    fn created_between_pages_a_window_in_time_order() {
        let c = db();
        for (id, at) in [("i3", 30), ("i1", 10), ("i2", 20), ("i2b", 20), ("i4", 40)] {
            let mut n = new(id, "m", id, id, "f");
            n.created_at = at;
            insert(&c, &n).unwrap();
        }
        let ids = |v: Vec<Intent>| v.into_iter().map(|i| i.intent_id).collect::<Vec<_>>();
        assert_eq!(
            ids(created_between(&c, 10, 40, None, 10).unwrap()),
            ["i1", "i2", "i2b", "i3"]
        );
        assert_eq!(
            ids(created_between(&c, 10, 40, Some((20, "i2")), 10).unwrap()),
            ["i2b", "i3"]
        );
        assert_eq!(
            ids(created_between(&c, 0, 100, None, 2).unwrap()),
            ["i1", "i2"]
        );
    }

    #[test]
    fn merchants_are_independent() {
        let c = db();
        assert!(matches!(
            insert(&c, &new("i1", "a", "o1", "k1", "f")).unwrap(),
            Created::New(_)
        ));
        assert!(matches!(
            insert(&c, &new("i2", "b", "o1", "k1", "f")).unwrap(),
            Created::New(_)
        ));
        assert_eq!(get(&c, "b", "i1").unwrap(), None);
        assert_eq!(count(&c).unwrap(), 2);
    }

    #[test]
    fn id_collision_writes_nothing() {
        let c = db();
        insert(&c, &new("i1", "m", "o1", "k1", "f")).unwrap();
        assert_eq!(
            insert(&c, &new("i1", "m", "o2", "k2", "f")).unwrap(),
            Created::IdCollision
        );
        assert_eq!(count(&c).unwrap(), 1);
    }

    #[test]
    fn terminal_status_is_not_overwritten() {
        let c = db();
        insert(&c, &new("i1", "m", "o1", "k1", "f")).unwrap();
        assert!(mark_succeeded(&c, "m", "i1", "ch_1").unwrap());
        assert!(!mark_succeeded(&c, "m", "i1", "ch_2").unwrap());
        assert!(!mark_failed(&c, "m", "i1").unwrap());
        let i = get(&c, "m", "i1").unwrap().unwrap();
        assert_eq!(i.status, IntentStatus::Succeeded);
        assert_eq!(i.psp_charge_id.as_deref(), Some("ch_1"));
        assert_eq!(by_order(&c, "m", "o1").unwrap().len(), 1);
    }

    #[test]
    fn other_merchant_cannot_change_an_intent() {
        let c = db();
        insert(&c, &new("i1", "a", "o1", "k1", "f")).unwrap();
        assert!(!mark_failed(&c, "b", "i1").unwrap());
        assert!(!mark_succeeded(&c, "b", "i1", "x").unwrap());
    }

    #[test]
    fn status_check_constraint_rejects_unknown_values() {
        let c = db();
        insert(&c, &new("i1", "m", "o1", "k1", "f")).unwrap();
        assert!(
            c.execute("UPDATE payment_intent SET status = 'weird'", [])
                .is_err()
        );
    }

    #[tokio::test]
    async fn concurrent_creates_with_one_request_key_insert_one_intent() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path().join("t.db"), Default::default()).unwrap();
        let intents = Intents::open(db.clone()).await.unwrap();
        // A second open is a no-op migration.
        let intents2 = Intents::open(db).await.unwrap();
        let mut tasks = Vec::new();
        for i in 0..32 {
            let intents = if i % 2 == 0 {
                intents.clone()
            } else {
                intents2.clone()
            };
            tasks.push(tokio::spawn(async move {
                intents
                    .create(new(&format!("i{i}"), "m", "o1", "k1", "f"))
                    .await
                    .unwrap()
            }));
        }
        let mut fresh = 0;
        for t in tasks {
            match t.await.unwrap() {
                Created::New(_) => fresh += 1,
                Created::Resumed(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(fresh, 1);
        assert_eq!(intents.count().await.unwrap(), 1);
        assert_eq!(intents.by_order("m", "o1").await.unwrap().len(), 1);
        intents.ping().await.unwrap();
    }
}
