//! Keeping the windows on PostgreSQL: creating each window's partition before it is needed,
//! and dropping a sealed window whose records have all expired.
//!
//! One parent, `idempotency_record`, partitioned by range on `(class_ms, win)`, rather than a
//! parent per class: a claim, a completion or a `get` is then one statement whatever the
//! record's class (a takeover may move a record to another class), and the partitions of all
//! classes are created, listed and dropped by the same code.
//!
//! A record goes to the window of the **database's clock** (`clock_timestamp()`, inside the
//! claim function), the one clock every instance shares. A window is **sealed** once that clock
//! is [`SEAL_GRACE_MS`] past its end (the model's grace G): nothing is inserted into it after
//! its end, and a claim still in flight from before is waited for by the drop's locks below.
//!
//! Dropping a sealed window takes four steps, none of which holds a lock on the parent that
//! claims wait for:
//!
//! 1. **barrier:** `LOCK TABLE` on the window, committed at once, waits for every transaction
//!    still writing into it; after it no insert lands there;
//! 2. **check**, unlocked: every record has expired by the caller's time and none runs under a
//!    live lease (in a sealed window a lease is never renewed: a takeover moves the record);
//! 3. **close**, one short transaction under the window's lock: the expiry is read again (a
//!    completion may have pushed one) and a `CHECK (false) NOT VALID` constraint is added, so
//!    from then on no completion can change a record there (it is answered as a lost lease,
//!    the record being as good as swept); a takeover may still move a record out;
//! 4. `DETACH PARTITION ... CONCURRENTLY` (outside a transaction block, as PostgreSQL
//!    requires), then `DROP TABLE`.
//!
//! A crash between the steps leaves a closed partition (dropped at the next expiry), a detach
//! half done (`DETACH ... FINALIZE`, then dropped) or a detached table (dropped).
//!
//! # Summaries
//!
//! A claim must show that no live window holds its key, and a statement on the parent reads
//! every partition's key index to show it: with 10 million records in 24 windows, 24 random
//! index pages per claim, as costly as one large index. Each instance therefore keeps a
//! [`Summary`] (a Bloom filter) of every sealed window, built once the window has sealed, and
//! passes the claim the windows it rules out for the key; the claim reads the others only (the
//! current ones, and about 1 % of the sealed). A sealed window's key set only shrinks (a
//! takeover moves a record out, never in), so a summary stays right while the window lives.
//! It is built behind a lock that waits for every transaction still writing into the window,
//! and the claim refuses an insert whose window ended while it ran (SQLSTATE `BK001`), so no
//! key can land in a window after its summary was read.
//!
//! The outcome statements (phase, completion, failure, release) are aimed at the window the
//! claim placed the record in, which each instance remembers for the leases it holds.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use deadpool_postgres::Object;
use futures_util::{StreamExt, pin_mut};
use tokio::time::timeout_at;

use super::PostgresStore;
use super::batch::Place;
use crate::db::postgres::{self as db, tokio_postgres};
use crate::idempotency::store::duration_ms;
use crate::idempotency::window::{Summary, TABLE_PREFIX, Window, class_of};
use crate::idempotency::{Lease, StoreError};

/// The partitioned table of records.
pub(super) const PARENT: &str = "idempotency_record";

/// The single-table layout's table, kept after an upgrade as the window `(0, 0)`.
pub(super) const LEGACY: &str = "idempotency_key";

/// Suffix of the constraint that closes a window for its drop.
pub(super) const CLOSED_SUFFIX: &str = "_closed";

/// The grace G after a window's end before it is sealed, ms of the database's clock. The
/// drop's barrier waits for claims slower than that, so G only keeps the barrier from waiting
/// for claims still running normally.
pub(super) const SEAL_GRACE_MS: i64 = 10_000;

/// Session advisory lock held by the instance that expires windows, one at a time: per
/// parent table (advisory locks are database-wide; stores in other schemas expire apart).
const EXPIRE_LOCK_SQL: &str = "SELECT hashtextextended('backstop_idempotency_expire', \
    to_regclass('idempotency_record')::oid::int8)";

/// How long a window's DDL waits for a lock before giving up (the next expiry tries again).
const DDL_LOCK_TIMEOUT: &str = "2s";

/// How often, at most, an instance looks for sealed windows to summarise, ms.
const SUMMARY_CHECK_MS: i64 = 5_000;

/// How many leases' windows an instance remembers; past that it forgets them all (an outcome
/// statement of a forgotten lease reads every window of its class: slower, as right).
const PLACEMENTS_CAP: usize = 100_000;

/// The windows this instance knows to exist, their summaries, where its leases' records are,
/// and the clock offset (tests only).
#[derive(Debug, Default)]
pub(super) struct Windows {
    known: Mutex<HashSet<Window>>,
    /// Added to the database's clock (and to this process's, to guess it): 0 but in tests,
    /// which move an instance into the future instead of waiting for a window to seal.
    pub(super) clock_offset_ms: i64,
    /// Set while a window is being created ahead of time.
    ahead_running: AtomicBool,
    /// Summaries of sealed windows, by table name.
    summaries: RwLock<HashMap<String, Arc<Summary>>>,
    /// Set while summaries are being built; when they were last looked for (local clock, ms).
    summarising: AtomicBool,
    summaries_checked_ms: AtomicI64,
    /// The window of each record this instance holds a lease on: (scope, key, token) -> win.
    pub(super) placements: Mutex<HashMap<(String, String, i64), i64>>,
}

impl Windows {
    pub(super) fn with_offset(clock_offset_ms: i64) -> Windows {
        Windows {
            clock_offset_ms,
            ..Windows::default()
        }
    }

    fn knows(&self, window: Window) -> bool {
        self.known
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&window)
    }

    fn learn(&self, window: Window) {
        let mut known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        // Only the recent ones matter: forget windows long sealed.
        known.retain(|w| w.class_ms != window.class_ms || w.index + 2 >= window.index);
        known.insert(window);
    }

    /// The sealed windows the summaries rule out for `key` in `scope`, comma-separated (the
    /// claim's `p_skip`).
    pub(super) fn skip_for(&self, scope: &str, key: &str) -> String {
        let summaries = self
            .summaries
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        let mut skip = String::new();
        for (name, summary) in summaries.iter() {
            if !summary.may_hold(scope, key) {
                if !skip.is_empty() {
                    skip.push(',');
                }
                skip.push_str(name);
            }
        }
        skip
    }

    /// How many windows have a summary.
    #[cfg(test)]
    pub(super) fn summarised(&self) -> usize {
        self.summaries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Remembers that the record of `lease_until`'s lease on `key` went to window `win`.
    pub(super) fn placed(&self, scope: &str, key: &str, lease_until: i64, win: i64) {
        let mut placements = self
            .placements
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if placements.len() >= PLACEMENTS_CAP {
            placements.clear();
        }
        placements.insert((scope.to_owned(), key.to_owned(), lease_until), win);
    }

    /// Where an outcome statement of `lease` looks for its record; `done` forgets it (the
    /// lease's last statement).
    pub(super) fn place_of(&self, lease: &Lease, done: bool) -> Place {
        let class_ms = class_of(duration_ms(lease.ttl));
        let id = (
            lease.scope.clone(),
            lease.key.as_str().to_owned(),
            lease.lease_until_ms,
        );
        let mut placements = self
            .placements
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let win = if done {
            placements.remove(&id)
        } else {
            placements.get(&id).copied()
        };
        win.map_or(Place::class(class_ms), |win| Place::window(class_ms, win))
    }

    /// This process's guess of the database's clock, unix ms.
    pub(super) fn local_clock_ms(&self) -> i64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        now.saturating_add(self.clock_offset_ms)
    }
}

/// The DDL creating `window`'s partition, race-safe: under an advisory lock on its name,
/// created if missing and attached if not yet. `CREATE TABLE ... PARTITION OF` would lock the
/// parent against every claim; `ATTACH PARTITION` takes only a lock claims do not conflict
/// with, and the bound's CHECK spares it a scan.
pub(super) fn create_sql(window: Window) -> String {
    let t = window.table_name();
    let (c, i) = (window.class_ms, window.index);
    let j = i.saturating_add(1);
    format!(
        "SET LOCAL client_min_messages = warning; \
         SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'; \
         SELECT pg_advisory_xact_lock(hashtextextended('{t}', 0)); \
         CREATE TABLE IF NOT EXISTS {t} (LIKE {PARENT} INCLUDING DEFAULTS, \
           PRIMARY KEY (scope, key), \
           CONSTRAINT {t}_status CHECK (status IN ('running', 'succeeded', 'failed')), \
           CONSTRAINT {t}_bound CHECK (class_ms = {c} AND win = {i})); \
         CREATE INDEX IF NOT EXISTS {t}_expires ON {t} (expires_at); \
         DO $$ BEGIN \
           IF NOT (SELECT relispartition FROM pg_class WHERE oid = '{t}'::regclass) THEN \
             ALTER TABLE {PARENT} ATTACH PARTITION {t} FOR VALUES FROM ({c}, {i}) TO ({c}, {j}); \
           END IF; \
         END $$;"
    )
}

impl PostgresStore {
    /// Builds the summaries of sealed windows in the background, at most every
    /// [`SUMMARY_CHECK_MS`] and one run at a time.
    pub(super) fn summarise_if_due(&self) {
        let now = self.windows.local_clock_ms();
        let last = self.windows.summaries_checked_ms.load(Ordering::Acquire);
        if now.saturating_sub(last) < SUMMARY_CHECK_MS
            || tokio::runtime::Handle::try_current().is_err()
            || self.windows.summarising.swap(true, Ordering::AcqRel)
        {
            return;
        }
        self.windows
            .summaries_checked_ms
            .store(now, Ordering::Release);
        let store = self.clone();
        tokio::spawn(async move {
            if let Err(error) = store.summarise().await {
                tracing::warn!(%error, "summarising sealed idempotency windows failed");
            }
            store.windows.summarising.store(false, Ordering::Release);
        });
    }

    /// Summarises every sealed window that has no summary yet, and forgets the summaries of
    /// windows that are gone. A window whose writers do not finish within the DDL lock timeout
    /// waits for the next run.
    ///
    /// Claims start it in the background every few seconds; call it at start-up to have the
    /// summaries of a large store built before serving (it reads every sealed window's keys
    /// once: seconds for 10 million records) instead of while claims read the sealed windows'
    /// indexes.
    pub async fn summarise(&self) -> Result<(), StoreError> {
        let client = self.pool.get().await.map_err(db::Error::connect)?;
        // The database's own clock, without this instance's offset: a window is sealed for
        // every instance alike (tests move an instance ahead in time; one moved ahead must not
        // summarise a window the others still insert into).
        let clock: i64 = client
            .query_one(
                "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8",
                &[],
            )
            .await?
            .get(0);
        let partitions = partitions(&client, false).await?;
        self.windows
            .summaries
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|name, _| partitions.contains(name));
        for name in &partitions {
            let sealed = name == LEGACY
                || Window::from_table_name(name)
                    .is_some_and(|w| clock >= w.end_ms().saturating_add(SEAL_GRACE_MS));
            let known = self
                .windows
                .summaries
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .contains_key(name);
            if !sealed || known || !is_ours(name) {
                continue;
            }
            if let Some(summary) = summarise_window(&client, name).await? {
                tracing::debug!(window = %name, keys = summary.keys(), bytes = summary.bytes(), "idempotency window summarised");
                self.windows
                    .summaries
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(name.clone(), Arc::new(summary));
            }
        }
        Ok(())
    }

    /// Creates `window`'s partition unless this instance knows it exists, and remembers it.
    pub(super) async fn ensure_window(&self, window: Window) -> Result<(), StoreError> {
        if self.windows.knows(window) {
            return Ok(());
        }
        self.create_window(window).await
    }

    /// Creates `window`'s partition if it does not exist yet (any number of instances may race
    /// to), and remembers it.
    pub(super) async fn create_window(&self, window: Window) -> Result<(), StoreError> {
        let sql = create_sql(window);
        // Bounded as the claim it is made for: by the request's deadline or the store's
        // timeout. A connection given up mid-DDL is discarded, never reused.
        let until = self.operation_deadline();
        let mut client = timeout_at(until, self.pool.get())
            .await
            .map_err(|_| db::Error::Timeout)?
            .map_err(db::Error::connect)?;
        let made = timeout_at(until, async {
            let tx = client.transaction().await?;
            tx.batch_execute(&sql).await?;
            tx.commit().await
        })
        .await;
        match made {
            Ok(made) => made?,
            Err(_) => {
                drop(Object::take(client));
                return Err(db::Error::Timeout.into());
            }
        }
        tracing::debug!(window = %window.table_name(), "idempotency window ready");
        self.windows.learn(window);
        Ok(())
    }

    /// Before a claim of TTL `ttl_ms`: the window it will most likely go to exists, and in the
    /// last half of a window the next one is created in the background, so that the first
    /// claims of a window do not wait for its DDL.
    ///
    /// Best effort: a window this instance has not seen yet is usually there already (made
    /// ahead by another instance), so a failure to create it (its DDL waiting behind a detach)
    /// does not fail the claim; a claim that does find it missing creates it and says so.
    pub(super) async fn prepare_window(&self, ttl_ms: i64) {
        self.summarise_if_due();
        let now = self.windows.local_clock_ms();
        let window = Window::of(ttl_ms, now);
        if let Err(error) = self.ensure_window(window).await {
            tracing::debug!(%error, window = %window.table_name(), "idempotency window not made");
        }
        let next = window.next();
        if now >= window.end_ms() - window.width_ms() / 2
            && !self.windows.knows(next)
            && tokio::runtime::Handle::try_current().is_ok()
            && !self.windows.ahead_running.swap(true, Ordering::AcqRel)
        {
            let store = self.clone();
            tokio::spawn(async move {
                if let Err(error) = store.ensure_window(next).await {
                    tracing::warn!(%error, "creating the next idempotency window failed");
                }
                store.windows.ahead_running.store(false, Ordering::Release);
            });
        }
    }
}

/// The partitions of the parent (`pending`: those half detached instead).
async fn partitions(client: &Object, pending: bool) -> Result<Vec<String>, tokio_postgres::Error> {
    Ok(client
        .query(
            &format!(
                "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                 WHERE i.inhparent = '{PARENT}'::regclass AND i.inhdetachpending = $1"
            ),
            &[&pending],
        )
        .await?
        .into_iter()
        .map(|row| row.get(0))
        .collect())
}

/// The summary of the sealed window `name`, read after a barrier that waits for every
/// transaction still writing into it; `None` when that wait timed out.
async fn summarise_window(client: &Object, name: &str) -> Result<Option<Summary>, StoreError> {
    let barrier = format!(
        "BEGIN; SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'; \
         LOCK TABLE {name} IN SHARE MODE; COMMIT"
    );
    match client.batch_execute(&barrier).await {
        Ok(()) => {}
        Err(e) if lock_not_available(&e) => {
            client.batch_execute("ROLLBACK").await?;
            return Ok(None);
        }
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            return Err(e.into());
        }
    }
    let count: i64 = client
        .query_one(&format!("SELECT count(*) FROM {name}"), &[])
        .await?
        .get(0);
    let mut summary = Summary::with_capacity(usize::try_from(count).unwrap_or(0));
    let rows = client
        .query_raw(
            &format!("SELECT scope, key FROM {name}"),
            std::iter::empty::<i32>(),
        )
        .await?;
    pin_mut!(rows);
    while let Some(row) = rows.next().await {
        let row = row?;
        summary.insert(row.try_get(0)?, row.try_get(1)?);
    }
    Ok(Some(summary))
}

/// Discards a connection unless defused: one holding a session lock, dropped mid-way (a
/// cancelled expiry), must not go back to the pool with the lock.
struct Holding(Option<Object>);

impl Holding {
    fn client(&self) -> &Object {
        self.0.as_ref().expect("held until released")
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            drop(Object::take(client));
        }
    }
}

/// [`Store::expire`](crate::idempotency::Store::expire) for [`PostgresStore`]: one instance
/// at a time (the others answer 0), the next window of each class created in the last half of
/// its current one, leftovers of an interrupted drop finished, every sealed
/// window whose records may all be swept dropped whole, and the single-table layout's records
/// swept one by one (at most `limit`).
pub(super) async fn expire(
    store: &PostgresStore,
    now_ms: i64,
    limit: usize,
) -> Result<usize, StoreError> {
    let client = store.pool.get().await.map_err(db::Error::connect)?;
    let lock: i64 = client.query_one(EXPIRE_LOCK_SQL, &[]).await?.get(0);
    let locked: bool = client
        .query_one("SELECT pg_try_advisory_lock($1)", &[&lock])
        .await?
        .get(0);
    if !locked {
        return Ok(0);
    }
    let mut held = Holding(Some(client));
    let expired = expire_locked(store, held.client(), now_ms, limit).await;
    held.client()
        .execute("SELECT pg_advisory_unlock($1)", &[&lock])
        .await?;
    // Unlocked: the connection may serve again.
    held.0.take();
    expired
}

async fn expire_locked(
    store: &PostgresStore,
    client: &Object,
    now_ms: i64,
    limit: usize,
) -> Result<usize, StoreError> {
    let clock: i64 = client
        .query_one(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8 + $1",
            &[&store.windows.clock_offset_ms],
        )
        .await?
        .get(0);
    finish_interrupted(client).await?;
    let partitions = partitions(client, false).await?;
    // Upkeep: the next window of each class in the last half of its current one.
    for name in &partitions {
        if let Some(w) = Window::from_table_name(name) {
            let (start, end) = (w.start_ms(), w.end_ms());
            if (start..end).contains(&clock) && clock >= end - w.width_ms() / 2 {
                store.ensure_window(w.next()).await?;
            }
        }
    }
    let mut total = 0;
    let mut legacy = false;
    for name in partitions {
        let sealed = if name == LEGACY {
            legacy = true;
            true
        } else {
            Window::from_table_name(&name)
                .is_some_and(|w| clock >= w.end_ms().saturating_add(SEAL_GRACE_MS))
        };
        if !sealed {
            continue;
        }
        if let Some(records) = drop_if_expired(client, &name, now_ms).await? {
            total += records;
            legacy &= name != LEGACY;
        }
    }
    if legacy {
        total += sweep_legacy(client, now_ms, limit).await?;
    }
    Ok(total)
}

/// Finishes what an interrupted drop left: a detach half done, a detached table not dropped.
async fn finish_interrupted(client: &Object) -> Result<(), StoreError> {
    let pending = partitions(client, true).await?;
    for name in pending.iter().filter(|n| is_ours(n)) {
        client
            .batch_execute(&format!(
                "ALTER TABLE {PARENT} DETACH PARTITION {name} FINALIZE"
            ))
            .await?;
        tracing::info!(window = %name, "idempotency window: interrupted detach finished");
    }
    // Detached by an earlier drop (after its checks), not yet dropped.
    let detached: Vec<String> = client
        .query(
            &format!(
                "SELECT c.relname::text FROM pg_class c \
                 WHERE c.relkind = 'r' AND NOT c.relispartition \
                   AND c.relnamespace = (SELECT relnamespace FROM pg_class \
                                         WHERE oid = '{PARENT}'::regclass) \
                   AND (c.relname = '{LEGACY}' OR starts_with(c.relname, '{TABLE_PREFIX}')) \
                   AND EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conrelid = c.oid \
                               AND k.conname = c.relname || '{CLOSED_SUFFIX}')"
            ),
            &[],
        )
        .await?
        .into_iter()
        .map(|row| row.get(0))
        .collect();
    for name in detached.iter().filter(|n| is_ours(n)) {
        client
            .batch_execute(&format!("DROP TABLE IF EXISTS {name}"))
            .await?;
        tracing::info!(window = %name, "idempotency window: detached table dropped");
    }
    Ok(())
}

/// A table name the store made: a window's exact name, or the legacy table. Only such names
/// are ever spliced into DDL.
fn is_ours(name: &str) -> bool {
    name == LEGACY || Window::from_table_name(name).is_some()
}

/// Whether `e` is a lock wait given up (`lock_timeout`): the next expiry tries again.
fn lock_not_available(e: &tokio_postgres::Error) -> bool {
    e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE)
}

/// Drops the sealed partition `name` if every record in it may be swept at `now_ms` (the steps
/// of the module docs); answers how many records went, or `None` when it stays.
async fn drop_if_expired(
    client: &Object,
    name: &str,
    now_ms: i64,
) -> Result<Option<usize>, StoreError> {
    if !is_ours(name) {
        return Ok(None);
    }
    let lock = format!(
        "BEGIN; SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'; \
         LOCK TABLE {name} IN SHARE ROW EXCLUSIVE MODE"
    );
    // 1. The barrier.
    match client.batch_execute(&format!("{lock}; COMMIT")).await {
        Ok(()) => {}
        Err(e) if lock_not_available(&e) => {
            client.batch_execute("ROLLBACK").await?;
            return Ok(None);
        }
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            return Err(e.into());
        }
    }
    // 2. The check, through the expiry index first: a window not yet due costs one lookup.
    let expired_sql = format!("SELECT coalesce(max(expires_at) <= $1, true) FROM {name}");
    let expired: bool = client.query_one(&expired_sql, &[&now_ms]).await?.get(0);
    if !expired {
        return Ok(None);
    }
    let row = client
        .query_one(
            &format!(
                "SELECT NOT EXISTS (SELECT 1 FROM {name} \
                   WHERE status = 'running' AND lease_until > $1), \
                 (SELECT count(*) FROM {name})"
            ),
            &[&now_ms],
        )
        .await?;
    let (no_live_lease, records): (bool, i64) = (row.get(0), row.get(1));
    if !no_live_lease {
        return Ok(None);
    }
    // 3. Closed, after the expiry is read again under the lock.
    let closed = async {
        client.batch_execute(&lock).await?;
        let still: bool = client.query_one(&expired_sql, &[&now_ms]).await?.get(0);
        if !still {
            return Ok(false);
        }
        client
            .batch_execute(&format!(
                "DO $$ BEGIN \
                   IF NOT EXISTS (SELECT 1 FROM pg_constraint \
                     WHERE conrelid = '{name}'::regclass AND conname = '{name}{CLOSED_SUFFIX}') THEN \
                     ALTER TABLE {name} ADD CONSTRAINT {name}{CLOSED_SUFFIX} CHECK (false) NOT VALID; \
                   END IF; \
                 END $$"
            ))
            .await?;
        Ok::<bool, tokio_postgres::Error>(true)
    }
    .await;
    match closed {
        Ok(true) => client.batch_execute("COMMIT").await?,
        Ok(false) => {
            client.batch_execute("ROLLBACK").await?;
            return Ok(None);
        }
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            if lock_not_available(&e) {
                return Ok(None);
            }
            return Err(e.into());
        }
    }
    // 4. Detached without blocking claims, then dropped.
    client
        .batch_execute(&format!(
            "ALTER TABLE {PARENT} DETACH PARTITION {name} CONCURRENTLY"
        ))
        .await?;
    client
        .batch_execute(&format!("DROP TABLE IF EXISTS {name}"))
        .await?;
    tracing::debug!(window = %name, records, "idempotency window dropped");
    Ok(Some(usize::try_from(records).unwrap_or(0)))
}

/// Sweeps the single-table layout's records one by one, at most `limit`.
async fn sweep_legacy(client: &Object, now_ms: i64, limit: usize) -> Result<usize, StoreError> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let deleted = client
        .execute(
            &format!(
                "DELETE FROM {LEGACY} WHERE (scope, key) IN ( \
                   SELECT scope, key FROM {LEGACY} \
                   WHERE expires_at <= $1 AND NOT (status = 'running' AND lease_until > $1) \
                   LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 AND expires_at <= $1 AND NOT (status = 'running' AND lease_until > $1)"
            ),
            &[&now_ms, &limit],
        )
        .await?;
    Ok(usize::try_from(deleted).unwrap_or(usize::MAX))
}
