//! Which tables hold records: the window tables. An immutable snapshot, swapped on change, so
//! a claim reads it without holding a lock while it queries.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError};

use rusqlite::Connection;

use crate::idempotency::window::{HighWater, Summary, TABLE_PREFIX, Window};

/// Keys a window's summary is sized for when its class has no summarised window yet.
const DEFAULT_EXPECTED_KEYS: usize = 1_000_000;

/// One table holding records, with its statements written out once.
#[derive(Debug, Clone)]
pub(super) struct Table {
    pub(super) window: Window,
    pub(super) name: String,
    /// Set once the table is sealed and summarised.
    pub(super) summary: Option<Arc<Summary>>,
    /// For a window this process created empty: the keys inserted so far, kept by the claims
    /// that insert them, so that sealing it costs no scan.
    pub(super) building: Option<Arc<Mutex<Option<Summary>>>>,
    pub(super) sql: Arc<TableSql>,
}

impl Table {
    fn new(name: String, window: Window) -> Table {
        Table {
            sql: Arc::new(TableSql::new(&name)),
            name,
            window,
            summary: None,
            building: None,
        }
    }

    /// Whether the table may hold `key` in `scope`: false only when its summary rules it out.
    pub(super) fn may_hold(&self, scope: &str, key: &str) -> bool {
        self.summary.as_ref().is_none_or(|s| s.may_hold(scope, key))
    }

    /// Notes a key inserted into it (by a claim or a takeover's move).
    pub(super) fn inserted(&self, scope: &str, key: &str) {
        if let Some(building) = &self.building {
            if let Some(summary) = building
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_mut()
            {
                summary.insert(scope, key);
            }
        }
    }

    /// Whether nothing is inserted into it any more at the store's time `high_water_ms`.
    pub(super) fn sealed_at(&self, high_water_ms: i64) -> bool {
        self.window.sealed_at(high_water_ms)
    }
}

/// The statements on one table (the same text for the same table, so the connection's
/// statement cache finds them).
#[derive(Debug)]
pub(super) struct TableSql {
    pub(super) select: String,
    pub(super) insert: String,
    pub(super) insert_moved: String,
    pub(super) take_over: String,
    pub(super) take_out: String,
    pub(super) complete: String,
    pub(super) fail: String,
    pub(super) release: String,
    pub(super) mark_phase: String,
    pub(super) get: String,
    pub(super) sweep: String,
}

impl TableSql {
    fn new(t: &str) -> TableSql {
        TableSql {
            select: format!(
                "SELECT fingerprint, status, lease_until, http_status, response_body, \
                 response_headers FROM {t} WHERE scope = ?1 AND key = ?2"
            ),
            insert: format!(
                "INSERT INTO {t} (scope, key, fingerprint, status, lease_until, created_at, \
                 expires_at) VALUES (?1, ?2, ?3, 'running', ?4, ?5, ?6) \
                 ON CONFLICT (scope, key) DO NOTHING"
            ),
            insert_moved: format!(
                "INSERT INTO {t} (scope, key, fingerprint, status, lease_until, created_at, \
                 expires_at, phase, phase_data) VALUES (?1, ?2, ?3, 'running', ?4, ?5, ?6, ?7, ?8)"
            ),
            // Failed, or the lease ended: the new lease_until is the fencing token, so it must
            // move strictly forward.
            take_over: format!(
                "UPDATE {t} SET status = 'running', lease_until = MAX(?3, lease_until + 1), \
                 expires_at = MAX(expires_at, ?5), \
                 http_status = NULL, response_body = NULL, response_headers = NULL \
                 WHERE scope = ?1 AND key = ?2 AND fingerprint = ?6 \
                 AND (status = 'failed' OR (status = 'running' AND lease_until <= ?4)) \
                 RETURNING lease_until, created_at, phase, phase_data"
            ),
            // The same condition, deleting: the record moves to the current window.
            take_out: format!(
                "DELETE FROM {t} WHERE scope = ?1 AND key = ?2 AND fingerprint = ?3 \
                 AND (status = 'failed' OR (status = 'running' AND lease_until <= ?4)) \
                 RETURNING lease_until, created_at, expires_at, phase, phase_data"
            ),
            complete: format!(
                "UPDATE {t} SET status = 'succeeded', http_status = ?4, response_body = ?5, \
                 response_headers = ?6, expires_at = MAX(expires_at, ?7) \
                 WHERE scope = ?1 AND key = ?2 AND status = 'running' AND lease_until = ?3"
            ),
            fail: format!(
                "UPDATE {t} SET status = 'failed', expires_at = MAX(expires_at, ?4) \
                 WHERE scope = ?1 AND key = ?2 AND status = 'running' AND lease_until = ?3"
            ),
            release: format!(
                "DELETE FROM {t} \
                 WHERE scope = ?1 AND key = ?2 AND status = 'running' AND lease_until = ?3"
            ),
            mark_phase: format!(
                "UPDATE {t} SET phase = ?4, phase_data = ?5 \
                 WHERE scope = ?1 AND key = ?2 AND status = 'running' AND lease_until = ?3"
            ),
            get: format!(
                "SELECT fingerprint, status, lease_until, http_status, response_body, \
                 response_headers, created_at, expires_at, phase, phase_data \
                 FROM {t} WHERE scope = ?1 AND key = ?2"
            ),
            sweep: format!(
                "DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} WHERE expires_at <= ?1 \
                 AND NOT (status = 'running' AND lease_until > ?1) LIMIT ?2)"
            ),
        }
    }
}

/// The DDL of a window's table: its columns, key and expiry index.
pub(super) fn create_sql(window: Window) -> String {
    let t = window.table_name();
    format!(
        "CREATE TABLE IF NOT EXISTS {t} (
  scope            TEXT    NOT NULL,
  key              TEXT    NOT NULL,
  fingerprint      TEXT    NOT NULL,
  status           TEXT    NOT NULL CHECK (status IN ('running','succeeded','failed')),
  lease_until      INTEGER NOT NULL,
  http_status      INTEGER,
  response_body    TEXT,
  response_headers TEXT,
  created_at       INTEGER NOT NULL,
  expires_at       INTEGER NOT NULL,
  phase            TEXT,
  phase_data       BLOB,
  PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS {t}_expires ON {t} (expires_at);"
    )
}

/// The tables holding records, newest window first.
#[derive(Debug, Default)]
pub(super) struct Catalog {
    pub(super) tables: Vec<Table>,
}

impl Catalog {
    /// Reads which record tables the database has.
    pub(super) fn load(conn: &Connection) -> rusqlite::Result<Catalog> {
        let mut stmt = conn.prepare(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND substr(name, 1, ?2) = ?1",
        )?;
        let names = stmt
            .query_map(rusqlite::params![TABLE_PREFIX, TABLE_PREFIX.len()], |r| {
                r.get::<_, String>(0)
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let mut tables: Vec<Table> = names
            .into_iter()
            .filter_map(|name| Window::from_table_name(&name).map(|w| Table::new(name, w)))
            .collect();
        sort(&mut tables);
        Ok(Catalog { tables })
    }

    /// The table of `window`, if it exists.
    pub(super) fn find(&self, window: Window) -> Option<&Table> {
        self.tables.iter().find(|t| t.window == window)
    }
}

/// Newest window first (by end, then class).
fn sort(tables: &mut [Table]) {
    tables
        .sort_by_key(|t| std::cmp::Reverse((t.window.end_ms(), t.window.class_ms, t.window.index)));
}

/// The catalog shared by a store's clones, and the store's time.
#[derive(Debug, Default)]
pub(super) struct Tables {
    current: Mutex<Arc<Catalog>>,
    pub(super) high_water: HighWater,
    /// Set while an upkeep task runs, so claims start one at a time.
    pub(super) upkeep_running: AtomicBool,
}

impl Tables {
    pub(super) fn new(catalog: Catalog) -> Tables {
        Tables {
            current: Mutex::new(Arc::new(catalog)),
            high_water: HighWater::default(),
            upkeep_running: AtomicBool::new(false),
        }
    }

    /// The catalog now.
    pub(super) fn snapshot(&self) -> Arc<Catalog> {
        Arc::clone(&self.current.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn change(&self, f: impl FnOnce(&Catalog) -> Vec<Table>) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        let mut tables = f(&current);
        sort(&mut tables);
        *current = Arc::new(Catalog { tables });
    }

    /// Adds `window`'s table (created and committed), if it is not there yet; `empty` when
    /// this process created it, so its summary is kept as claims insert.
    pub(super) fn add(&self, window: Window, empty: bool) {
        self.change(|c| {
            let mut tables = c.tables.to_vec();
            if c.find(window).is_none() {
                let mut table = Table::new(window.table_name(), window);
                if empty {
                    // Sized like the class's last summarised window, with room to grow.
                    let expected = c
                        .tables
                        .iter()
                        .filter(|t| t.window.class_ms == window.class_ms)
                        .find_map(|t| t.summary.as_ref().map(|s| s.keys() + s.keys() / 2))
                        .unwrap_or(DEFAULT_EXPECTED_KEYS)
                        .max(DEFAULT_EXPECTED_KEYS / 10);
                    table.building =
                        Some(Arc::new(Mutex::new(Some(Summary::with_capacity(expected)))));
                }
                tables.push(table);
            }
            tables
        });
    }

    /// Forgets the table `name` (dropped, or being dropped).
    pub(super) fn remove(&self, name: &str) {
        self.change(|c| {
            c.tables
                .iter()
                .filter(|t| t.name != name)
                .cloned()
                .collect()
        });
    }

    /// Puts back a table whose drop rolled back.
    pub(super) fn restore(&self, name: &str, window: Window) {
        self.change(|c| {
            let mut tables = c.tables.to_vec();
            if !c.tables.iter().any(|t| t.name == name) {
                tables.push(Table::new(name.to_owned(), window));
            }
            tables
        });
    }

    /// Installs `summary` for the table `name`, if it still exists and has none yet (two
    /// upkeeps may race; the first one's stays).
    pub(super) fn summarise(&self, name: &str, summary: Arc<Summary>) {
        self.change(|c| {
            c.tables
                .iter()
                .map(|t| {
                    let mut t = t.clone();
                    if t.name == name && t.summary.is_none() {
                        t.summary = Some(Arc::clone(&summary));
                    }
                    t
                })
                .collect()
        });
    }
}
