//! Keeping the windows: creating them, summarising the sealed ones, dropping the expired ones.
//!
//! Every step that needs "nothing is inserted into this window any more" starts with a
//! **barrier**: a writer job that moves the store's time to `now` and answers it. Every job
//! after it places records at that time or later; every job before it has committed when the
//! barrier answers. So a window ending by the barrier's time is sealed for good, and the read
//! pool sees all of it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use rusqlite::Connection;

use super::SqliteStore;
use super::catalog::{Table, create_sql};
use crate::idempotency::StoreError;
use crate::idempotency::window::{Summary, Window};

impl SqliteStore {
    /// Creates `window`'s table (if another claim has not already) and adds it to the catalog
    /// once committed.
    pub(super) async fn create_window(&self, window: Window) -> Result<(), StoreError> {
        let sql = create_sql(window);
        let name = window.table_name();
        let created = self
            .db
            .write_deferred(move |conn| {
                let existed: bool = conn.query_row(
                    "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
                    [&name],
                    |r| r.get(0),
                )?;
                conn.execute_batch(&sql)?;
                Ok(!existed)
            })
            .await?;
        self.tables.add(window, created);
        Ok(())
    }

    /// Starts [`upkeep`](Self::upkeep) in the background when a sealed table has no summary
    /// yet and no upkeep is running: a store keeps its claims cheap without a sweeper.
    pub(super) fn upkeep_if_due(&self) {
        let high_water = self.tables.high_water.get();
        let due = self
            .tables
            .snapshot()
            .tables
            .iter()
            .any(|t| t.summary.is_none() && t.sealed_at(high_water));
        if due
            && tokio::runtime::Handle::try_current().is_ok()
            && !self.tables.upkeep_running.swap(true, Ordering::AcqRel)
        {
            let store = self.clone();
            tokio::spawn(async move {
                if let Err(error) = store.upkeep(high_water).await {
                    tracing::warn!(%error, "idempotency window upkeep failed");
                }
                store.tables.upkeep_running.store(false, Ordering::Release);
            });
        }
    }

    /// The barrier: moves the store's time to `now_ms` and answers the store's time, once
    /// every write placed before it has committed.
    async fn barrier(&self, now_ms: i64) -> Result<i64, StoreError> {
        let tables = Arc::clone(&self.tables);
        Ok(self
            .db
            .write_statement_deferred(move |_| Ok(tables.high_water.advance(now_ms)))
            .await?)
    }

    /// Seals and summarises the windows the store's time (moved to `now_ms`) has passed, and
    /// creates the next window of each class in its last quarter, so the first claims of a
    /// window do not wait for its table. Claims start it in the background when a window has
    /// sealed, and [`expire`](crate::idempotency::Store::expire) runs it first; call it at start-up to have the
    /// summaries of a large store built before serving (a few seconds for 10 million records)
    /// instead of while claims read the sealed windows' indexes. Answers the store's time it
    /// sealed by.
    pub async fn upkeep(&self, now_ms: i64) -> Result<i64, StoreError> {
        let started = std::time::Instant::now();
        let sealed_by = self.barrier(now_ms).await?;
        let catalog = self.tables.snapshot();
        let next: Vec<Window> = catalog
            .tables
            .iter()
            .map(|t| t.window)
            .filter(|w| {
                !w.sealed_at(sealed_by)
                    && sealed_by >= w.end_ms() - w.width_ms() / 4
                    && catalog.find(w.next()).is_none()
            })
            .collect();
        for window in next {
            self.create_window(window.next()).await?;
        }
        let (mut summarised, mut keys, mut bytes) = (0, 0, 0);
        for table in catalog
            .tables
            .iter()
            .filter(|t| t.summary.is_none() && t.sealed_at(sealed_by))
        {
            let name = table.name.clone();
            // Kept by the claims since the window was created: complete, as the barrier
            // passed its end. Else (a window from before this process) read it.
            let summary = match &table.building {
                Some(building) => {
                    match building
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take()
                    {
                        Some(summary) => Ok(summary),
                        // Another upkeep took it and installs it.
                        None => continue,
                    }
                }
                None => self.db.read(move |conn| summarise(conn, &name)).await,
            };
            match summary {
                Ok(summary) => {
                    summarised += 1;
                    keys += summary.keys();
                    bytes += summary.bytes();
                    self.tables.summarise(&table.name, Arc::new(summary));
                }
                // Dropped meanwhile.
                Err(crate::db::sqlite::Error::Sqlite(e)) if super::is_missing_table(&e) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if summarised > 0 {
            tracing::info!(
                windows = summarised,
                keys,
                bytes,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "idempotency windows summarised"
            );
        }
        Ok(sealed_by)
    }
}

/// The summary of a sealed table: every key it holds.
fn summarise(conn: &Connection, table: &str) -> rusqlite::Result<Summary> {
    let count: i64 = conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))?;
    let mut summary = Summary::with_capacity(usize::try_from(count).unwrap_or(0));
    let mut stmt = conn.prepare(&format!("SELECT scope, key FROM {table}"))?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let (scope, key) = (row.get_ref(0)?.as_str()?, row.get_ref(1)?.as_str()?);
        summary.insert(scope, key);
    }
    Ok(summary)
}

/// [`Store::expire`](crate::idempotency::Store::expire) for [`SqliteStore`]: upkeep, then every
/// sealed window whose records may all be swept dropped whole.
pub(super) async fn expire(store: &SqliteStore, now_ms: i64) -> Result<usize, StoreError> {
    let sealed_by = store.upkeep(now_ms).await?;
    let mut total = 0;
    let catalog = store.tables.snapshot();
    for table in catalog
        .tables
        .iter()
        .filter(|t| t.window.sealed_at(sealed_by))
    {
        total += drop_if_expired(store, table, now_ms).await?;
    }
    Ok(total)
}

/// Drops a sealed window if every record in it may be swept at `now_ms`; answers how many
/// records it held.
///
/// Two steps. On the read pool, off the writer: no record expires after `now_ms` (through the
/// expiry index, so a window not yet due costs one index lookup), no record runs under a live lease (in a sealed
/// window that only becomes more true: a lease there is never renewed, a takeover moves the
/// record out) and how many records there are. Then in one writer job, against completions
/// that may still push an expiry later: no record expires after `now_ms`, read through the
/// expiry index, and the `DROP TABLE`.
async fn drop_if_expired(
    store: &SqliteStore,
    table: &Table,
    now_ms: i64,
) -> Result<usize, StoreError> {
    let name = table.name.clone();
    let checked = store
        .db
        .read(move |conn| {
            // Through the expiry index first: a window not yet expired is not read further.
            let last: Option<i64> =
                conn.query_row(&format!("SELECT max(expires_at) FROM {name}"), [], |r| {
                    r.get(0)
                })?;
            if last.is_some_and(|last| last > now_ms) {
                return Ok(None);
            }
            let live: bool = conn.query_row(
                &format!(
                    "SELECT EXISTS (SELECT 1 FROM {name} \
                     WHERE status = 'running' AND lease_until > ?1)"
                ),
                [now_ms],
                |r| r.get(0),
            )?;
            if live {
                return Ok(None);
            }
            let count: i64 =
                conn.query_row(&format!("SELECT count(*) FROM {name}"), [], |r| r.get(0))?;
            Ok(Some(count))
        })
        .await;
    let count = match checked {
        Ok(Some(count)) => count,
        Ok(None) => return Ok(0),
        Err(crate::db::sqlite::Error::Sqlite(e)) if super::is_missing_table(&e) => return Ok(0),
        Err(e) => return Err(e.into()),
    };
    let (tables, name, window) = (Arc::clone(&store.tables), table.name.clone(), table.window);
    let dropped = store
        .db
        .write(move |conn| {
            let last: Option<i64> =
                conn.query_row(&format!("SELECT max(expires_at) FROM {name}"), [], |r| {
                    r.get(0)
                })?;
            if last.is_some_and(|last| last > now_ms) {
                return Ok(false);
            }
            // Out of the catalog before the jobs after this one look: they must not read a
            // table this transaction dropped.
            tables.remove(&name);
            if let Err(e) = conn.execute_batch(&format!("DROP TABLE {name}")) {
                tables.restore(&name, window);
                return Err(e);
            }
            Ok(true)
        })
        .await;
    match dropped {
        Ok(true) => {
            tracing::debug!(table = %table.name, records = count, "idempotency window dropped");
            Ok(usize::try_from(count).unwrap_or(0))
        }
        Ok(false) => Ok(0),
        Err(e) => {
            // The transaction rolled back: the table is still there.
            store.tables.restore(&table.name, table.window);
            Err(e.into())
        }
    }
}
