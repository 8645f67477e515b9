//! The client-side intent journal: the key is on disk before the first send.
//!
//! A client that crashes between sending a charge and hearing the answer does not know whether
//! it happened. If it comes back with a *new* key, the server cannot tell the second charge
//! from a new one. The journal closes that gap: [`IntentJournal::begin`] stores the key of an
//! operation (durably, `synchronous=FULL` by default) before the first attempt, and returns the
//! same key every time it is asked about the same operation, across restarts, until
//! [`complete`](IntentJournal::complete) marks the outcome known. [`pending`](IntentJournal::pending)
//! lists what a restarted client must resume.
//!
//! It runs on the crate's SQLite group-commit writer ([`Db`]), so concurrent calls share fsyncs.
//!
//! ```
//! use backstop::client::idempotency::IntentJournal;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("client.db");
//! let journal = IntentJournal::open(&path).await?;
//! let key = journal.begin("order-42/charge").await?;
//! // ... the client crashes before the answer arrives; after the restart:
//! drop(journal);
//! let journal = IntentJournal::open(&path).await?;
//! assert_eq!(journal.pending().await?, vec![("order-42/charge".to_owned(), key.clone())]);
//! assert_eq!(journal.begin("order-42/charge").await?, key); // the same key, not a new one
//! journal.complete("order-42/charge").await?;
//! assert!(journal.pending().await?.is_empty());
//! # Ok(())
//! # }
//! ```

use std::path::Path;

use rusqlite::{OptionalExtension, params};

use crate::clock::{Clock, SystemClock};
use crate::db::sqlite::{self, Db, SqliteOptions};
use crate::idempotency::IdempotencyKey;

/// Name under which [`MIGRATION`] is recorded.
const MIGRATION_NAME: &str = "backstop_client_intent_v1";

/// The journal's table.
const MIGRATION: &str = "CREATE TABLE IF NOT EXISTS client_intent (
    operation TEXT PRIMARY KEY,
    idempotency_key TEXT NOT NULL,
    created_at_ms INTEGER NOT NULL,
    completed_at_ms INTEGER
);
CREATE INDEX IF NOT EXISTS client_intent_pending ON client_intent (completed_at_ms)
    WHERE completed_at_ms IS NULL;";

/// Longest operation id accepted, in bytes.
pub const MAX_OPERATION_LEN: usize = 512;

/// A journal operation failed.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The database failed.
    #[error("intent journal database error")]
    Db(#[from] sqlite::Error),
    /// The operation id is empty or longer than [`MAX_OPERATION_LEN`].
    #[error("operation id must be 1 to {MAX_OPERATION_LEN} bytes, got {len}")]
    Operation {
        /// Its length.
        len: usize,
    },
    /// A stored key is no longer a valid key (the file was edited by hand).
    #[error("stored idempotency key for {operation} is invalid")]
    CorruptKey {
        /// The operation.
        operation: String,
    },
}

/// Operations and the keys they were started with; clones share the database.
#[derive(Debug, Clone)]
pub struct IntentJournal {
    db: Db,
}

impl IntentJournal {
    /// Opens (creating if needed) the journal at `path` with durable commits.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, JournalError> {
        Self::with_db(Db::open(path, SqliteOptions::default())?).await
    }

    /// A journal in `db` (which may hold other tables too).
    pub async fn with_db(db: Db) -> Result<Self, JournalError> {
        db.migrate(MIGRATION_NAME, MIGRATION).await?;
        Ok(Self { db })
    }

    /// The key of `operation`: the stored one if the operation was begun before (even by an
    /// earlier process), else a new UUIDv7 key, stored durably before this returns.
    pub async fn begin(&self, operation: &str) -> Result<IdempotencyKey, JournalError> {
        check(operation)?;
        let op = operation.to_owned();
        let fresh = IdempotencyKey::generate();
        let now = SystemClock.now_ms();
        let stored: String = self
            .db
            .write(move |conn| {
                conn.execute(
                    "INSERT INTO client_intent (operation, idempotency_key, created_at_ms)
                     VALUES (?1, ?2, ?3) ON CONFLICT (operation) DO NOTHING",
                    params![op, fresh.as_str(), now],
                )?;
                conn.query_row(
                    "SELECT idempotency_key FROM client_intent WHERE operation = ?1",
                    params![op],
                    |row| row.get(0),
                )
            })
            .await?;
        IdempotencyKey::new(stored).map_err(|_| JournalError::CorruptKey {
            operation: operation.to_owned(),
        })
    }

    /// Marks `operation`'s outcome as known (succeeded or definitively refused). Its key stays
    /// stored, so a late `begin` still returns it.
    pub async fn complete(&self, operation: &str) -> Result<(), JournalError> {
        check(operation)?;
        let op = operation.to_owned();
        let now = SystemClock.now_ms();
        self.db
            .write(move |conn| {
                conn.execute(
                    "UPDATE client_intent SET completed_at_ms = ?2
                     WHERE operation = ?1 AND completed_at_ms IS NULL",
                    params![op, now],
                )
            })
            .await?;
        Ok(())
    }

    /// Whether `operation` was begun and not completed.
    pub async fn is_pending(&self, operation: &str) -> Result<bool, JournalError> {
        check(operation)?;
        let op = operation.to_owned();
        let row: Option<Option<i64>> = self
            .db
            .read(move |conn| {
                conn.query_row(
                    "SELECT completed_at_ms FROM client_intent WHERE operation = ?1",
                    params![op],
                    |row| row.get(0),
                )
                .optional()
            })
            .await?;
        Ok(matches!(row, Some(None)))
    }

    /// Operations begun and not completed, oldest first, with their keys: what a restarted
    /// client resumes.
    pub async fn pending(&self) -> Result<Vec<(String, IdempotencyKey)>, JournalError> {
        let rows: Vec<(String, String)> = self
            .db
            .read(|conn| {
                let mut stmt = conn.prepare(
                    "SELECT operation, idempotency_key FROM client_intent
                     WHERE completed_at_ms IS NULL ORDER BY created_at_ms, operation",
                )?;
                let rows = stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?;
                rows.collect()
            })
            .await?;
        rows.into_iter()
            .map(|(op, key)| match IdempotencyKey::new(key) {
                Ok(key) => Ok((op, key)),
                Err(_) => Err(JournalError::CorruptKey { operation: op }),
            })
            .collect()
    }
}

fn check(operation: &str) -> Result<(), JournalError> {
    if operation.is_empty() || operation.len() > MAX_OPERATION_LEN {
        return Err(JournalError::Operation {
            len: operation.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_key_per_operation_across_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.db");
        let journal = IntentJournal::open(&path).await.unwrap();
        let a = journal.begin("a").await.unwrap();
        let b = journal.begin("b").await.unwrap();
        assert_ne!(a, b);
        assert_eq!(journal.begin("a").await.unwrap(), a);
        journal.complete("b").await.unwrap();
        assert!(journal.is_pending("a").await.unwrap());
        assert!(!journal.is_pending("b").await.unwrap());
        assert!(!journal.is_pending("never").await.unwrap());
        drop(journal);

        let journal = IntentJournal::open(&path).await.unwrap();
        assert_eq!(
            journal.pending().await.unwrap(),
            vec![("a".to_owned(), a.clone())]
        );
        assert_eq!(journal.begin("a").await.unwrap(), a);
        assert_eq!(
            journal.begin("b").await.unwrap(),
            b,
            "completed keys are kept"
        );
    }

    #[tokio::test]
    async fn bad_operation_ids_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let journal = IntentJournal::open(dir.path().join("j.db")).await.unwrap();
        assert!(matches!(
            journal.begin("").await,
            Err(JournalError::Operation { len: 0 })
        ));
        let long = "x".repeat(MAX_OPERATION_LEN + 1);
        assert!(matches!(
            journal.complete(&long).await,
            Err(JournalError::Operation { .. })
        ));
    }
}
