//! SQLite (feature `sqlite`, default): [`Db`], a handle with one writer thread that
//! group-commits, a pool of read connections and a migration runner; failures are [`Error`].
//!
//! With `synchronous=FULL` every COMMIT waits for an fsync of the WAL, so a store that commits
//! once per claim is bounded by the disk's sync rate (a few thousand per second here). The writer
//! here does what PostgreSQL's group commit does: while one COMMIT is syncing, new jobs queue up;
//! the next round drains them all (up to [`SqliteOptions::max_batch`]) into ONE
//! `BEGIN IMMEDIATE ... COMMIT`, so one fsync makes a whole batch durable.
//!
//! Each job runs inside its own `SAVEPOINT`: a job that fails is rolled back alone and only its
//! caller sees the error. Jobs that change the database with one statement at most (the
//! idempotency store's) skip the savepoint: SQLite already undoes a failed statement alone.
//! Every caller is answered only after the COMMIT that made its writes durable; if that COMMIT
//! fails, every job of the batch gets the error and nothing was written.
//!
//! Reads run on a small pool of separate connections (WAL lets them proceed while the writer
//! commits) on tokio's blocking pool.

/// The driver, re-exported: a job (and a phase's writes) runs on its `Connection`.
pub use rusqlite;

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};
use tokio::sync::{Semaphore, mpsc, oneshot};

/// How hard SQLite syncs on COMMIT (`PRAGMA synchronous`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// `synchronous=FULL`: a committed transaction survives a power cut. The default: a lost
    /// idempotency record would let a retry run the side effect a second time.
    #[default]
    Full,
    /// `synchronous=NORMAL`: in WAL mode a power cut may lose the last transactions (never
    /// corrupts). Faster, but only safe when losing recent records is acceptable.
    Normal,
}

impl Synchronous {
    fn pragma_value(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// Options for [`Db::open`] (and `SqliteStore::open`).
#[derive(Debug, Clone)]
pub struct SqliteOptions {
    /// `PRAGMA synchronous`; [`Synchronous::Full`] by default.
    pub synchronous: Synchronous,
    /// Batch concurrent write jobs into one transaction (default `true`). With `false` every job
    /// runs in its own `BEGIN IMMEDIATE ... COMMIT` (the autocommit baseline).
    pub group_commit: bool,
    /// Most jobs per transaction (default 256; 0 counts as 1).
    pub max_batch: usize,
    /// `busy_timeout` for every connection (default 5 s): how long to wait for a lock held by
    /// another process before failing with `SQLITE_BUSY`.
    pub busy_timeout: Duration,
    /// Size of the read connection pool (default 4; 0 counts as 1).
    pub read_connections: usize,
    /// Copy the WAL into the database file from a thread of its own (default `true`), instead
    /// of inside the writer's COMMIT as SQLite does by itself every 1000 pages. A checkpoint
    /// writes the pages and syncs the database file; done by the writer, every job of the
    /// batches behind it waits for that. The background checkpointer runs a `PASSIVE`
    /// checkpoint (which never blocks the writer) at most every 100 ms after commits; the
    /// writer still checkpoints by itself past [`WAL_PAGES_FALLBACK`] pages, should the
    /// checkpointer fall behind. Durability is the same either way: a commit is on disk once
    /// its WAL frames are synced.
    pub background_checkpoint: bool,
}

/// WAL size (pages) at which the writer checkpoints by itself when a background checkpointer
/// runs: far above SQLite's 1000, so it happens only if the checkpointer falls behind.
pub const WAL_PAGES_FALLBACK: u32 = 16_384;

/// Least time between two background checkpoints.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

impl Default for SqliteOptions {
    fn default() -> Self {
        SqliteOptions {
            synchronous: Synchronous::Full,
            group_commit: true,
            max_batch: 256,
            busy_timeout: Duration::from_secs(5),
            read_connections: 4,
            background_checkpoint: true,
        }
    }
}

/// Errors of [`Db`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database file could not be opened or configured.
    #[error("cannot open SQLite database {}", path.display())]
    Open {
        /// The path given to [`Db::open`].
        path: PathBuf,
        /// What SQLite said.
        #[source]
        source: rusqlite::Error,
    },
    /// The database refused WAL mode (for instance `:memory:`); [`Db`] needs a file in WAL mode.
    #[error("SQLite database {} is in journal mode {mode:?}, not WAL", path.display())]
    NotWal {
        /// The path given to [`Db::open`].
        path: PathBuf,
        /// The journal mode SQLite reported.
        mode: String,
    },
    /// The writer thread could not be started.
    #[error("cannot start the SQLite writer thread")]
    Spawn(#[source] std::io::Error),
    /// The job's own statement failed; only this job was rolled back.
    #[error("SQLite statement failed")]
    Sqlite(#[from] rusqlite::Error),
    /// BEGIN or COMMIT of the batch failed: every job of the batch was rolled back.
    #[error("SQLite transaction failed; the batch was rolled back")]
    Transaction(#[source] Arc<rusqlite::Error>),
    /// A job ended the batch's transaction itself (e.g. ran COMMIT or ROLLBACK); the batch was
    /// rolled back.
    #[error("a write job ended the batch transaction; the batch was rolled back")]
    Aborted,
    /// The job panicked; its writes were rolled back.
    #[error("a database job panicked")]
    Panicked,
    /// The writer thread has stopped; nothing was written.
    #[error("the SQLite writer has stopped")]
    Closed,
    /// The blocking read task was cancelled (runtime shutting down).
    #[error("SQLite read task failed")]
    ReadTask(#[source] tokio::task::JoinError),
    /// A migration failed; it was rolled back.
    #[error("migration {name} failed")]
    Migration {
        /// The migration's name.
        name: String,
        /// Why.
        #[source]
        source: Box<Error>,
    },
}

impl Error {
    /// The underlying SQLite error, if this error carries one (e.g. to recognise a UNIQUE
    /// constraint violation).
    pub fn sqlite_error(&self) -> Option<&rusqlite::Error> {
        match self {
            Error::Open { source, .. } => Some(source),
            Error::Sqlite(e) => Some(e),
            Error::Transaction(e) => Some(e),
            Error::Migration { source, .. } => source.sqlite_error(),
            _ => None,
        }
    }

    /// Whether SQLite refused a statement because it breaks a constraint (UNIQUE, PRIMARY
    /// KEY, FOREIGN KEY, CHECK, NOT NULL): running it again will not help.
    pub fn is_constraint_violation(&self) -> bool {
        self.sqlite_error()
            .and_then(rusqlite::Error::sqlite_error_code)
            == Some(rusqlite::ErrorCode::ConstraintViolation)
    }
}

/// How the batch a job ran in ended.
enum BatchEnd<'a> {
    Committed,
    Failed(&'a Arc<rusqlite::Error>),
    Aborted,
}

/// A queued write job, type-erased.
trait Job: Send {
    /// Whether the job needs its own SAVEPOINT to be rolled back alone.
    fn savepoint(&self) -> bool;
    /// Whether the job's caller needs its writes durable when answered (else they become
    /// durable with the next synced commit).
    fn synced(&self) -> bool;
    /// Runs the job on the writer connection; `true` when it succeeded.
    fn run(self: Box<Self>, conn: &Connection) -> (bool, Box<dyn Reply>);
    /// Fails the job without running it.
    fn abort(self: Box<Self>, end: BatchEnd<'_>);
}

/// A job that ran and waits for its batch to end.
trait Reply: Send {
    fn finish(self: Box<Self>, end: BatchEnd<'_>);
}

struct WriteJob<F, T> {
    f: F,
    tx: oneshot::Sender<Result<T, Error>>,
    savepoint: bool,
    synced: bool,
}

struct Done<T> {
    out: Result<T, Error>,
    tx: oneshot::Sender<Result<T, Error>>,
}

fn end_error(end: BatchEnd<'_>) -> Option<Error> {
    match end {
        BatchEnd::Committed => None,
        BatchEnd::Failed(e) => Some(Error::Transaction(Arc::clone(e))),
        BatchEnd::Aborted => Some(Error::Aborted),
    }
}

impl<F, T> Job for WriteJob<F, T>
where
    F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    T: Send + 'static,
{
    fn savepoint(&self) -> bool {
        self.savepoint
    }

    fn synced(&self) -> bool {
        self.synced
    }

    fn run(self: Box<Self>, conn: &Connection) -> (bool, Box<dyn Reply>) {
        let WriteJob { f, tx, .. } = *self;
        let out = match catch_unwind(AssertUnwindSafe(|| f(conn))) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Error::Sqlite(e)),
            Err(_) => Err(Error::Panicked),
        };
        (out.is_ok(), Box::new(Done { out, tx }))
    }

    fn abort(self: Box<Self>, end: BatchEnd<'_>) {
        let err = end_error(end).unwrap_or(Error::Aborted);
        let _ = self.tx.send(Err(err));
    }
}

impl<T: Send + 'static> Reply for Done<T> {
    fn finish(self: Box<Self>, end: BatchEnd<'_>) {
        let out = match (self.out, end_error(end)) {
            // The job's own error wins: it was rolled back whatever happened next.
            (Err(e), _) => Err(e),
            (Ok(_), Some(e)) => Err(e),
            (Ok(v), None) => Ok(v),
        };
        // The caller may have stopped waiting; the write stands either way.
        let _ = self.tx.send(out);
    }
}

/// Counters of the writer, for benchmarks and tests: `jobs / transactions` is the mean batch size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DbStats {
    /// Transactions committed by the writer.
    pub transactions: u64,
    /// Of those, the ones committed with a sync (`synchronous` as configured): with
    /// [`Synchronous::Full`], each is one fsync of the WAL. The others held only
    /// [deferred](Db::write_deferred) jobs.
    pub synced: u64,
    /// Write jobs committed by the writer.
    pub jobs: u64,
}

#[derive(Default)]
struct Counters {
    transactions: AtomicU64,
    synced: AtomicU64,
    jobs: AtomicU64,
}

struct Inner {
    path: PathBuf,
    counters: Arc<Counters>,
    options: SqliteOptions,
    jobs: mpsc::Sender<Box<dyn Job>>,
    readers: Mutex<Vec<Connection>>,
    read_slots: Arc<Semaphore>,
}

/// A SQLite database with one group-committing writer thread and a pool of read connections.
///
/// Cheap to clone (an `Arc`); the idempotency store and the application share one `Db`, so their
/// writes are batched together. The writer thread stops when the last clone is dropped.
///
/// ```
/// use backstop::db::sqlite::{Db, SqliteOptions};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let dir = tempfile::tempdir()?;
/// let db = Db::open(dir.path().join("app.db"), SqliteOptions::default())?;
/// db.migrate("note_v1", "CREATE TABLE note (id INTEGER PRIMARY KEY, body TEXT NOT NULL);")
///     .await?;
/// // Answered only once the COMMIT that holds this row is durable.
/// let id = db
///     .write(|conn| {
///         conn.execute("INSERT INTO note (body) VALUES (?1)", ["hello"])?;
///         Ok(conn.last_insert_rowid())
///     })
///     .await?;
/// let body: String = db
///     .read(move |conn| conn.query_row("SELECT body FROM note WHERE id = ?1", [id], |r| r.get(0)))
///     .await?;
/// assert_eq!(body, "hello");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Db {
    inner: Arc<Inner>,
}

impl fmt::Debug for Db {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Db")
            .field("path", &self.inner.path)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

const MIGRATIONS_TABLE: &str = "CREATE TABLE IF NOT EXISTS backstop_migration (
  name       TEXT    PRIMARY KEY,
  applied_at INTEGER NOT NULL
);";

impl Db {
    /// Opens (creating if needed) the database file at `path` in WAL mode and starts the writer
    /// thread. Does not need a tokio runtime; `write`/`read` do.
    pub fn open(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Db, Error> {
        let path = path.as_ref().to_path_buf();
        let open_err = |source| Error::Open {
            path: path.clone(),
            source,
        };
        let conn = Connection::open(&path).map_err(open_err)?;
        conn.busy_timeout(options.busy_timeout).map_err(open_err)?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .map_err(open_err)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(Error::NotWal { path, mode });
        }
        conn.pragma_update(None, "synchronous", options.synchronous.pragma_value())
            .map_err(open_err)?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(open_err)?;
        conn.set_prepared_statement_cache_capacity(64);

        let max_batch = if options.group_commit {
            options.max_batch.max(1)
        } else {
            1
        };
        let commits = if options.background_checkpoint {
            conn.pragma_update(None, "wal_autocheckpoint", WAL_PAGES_FALLBACK)
                .map_err(open_err)?;
            let checkpointer = open_checkpointer(&path, &options)?;
            // One slot: commits made while a checkpoint runs ask for one more, not one each.
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            std::thread::Builder::new()
                .name("backstop-sqlite-checkpoint".into())
                .spawn(move || checkpoint_loop(&checkpointer, &rx))
                .map_err(Error::Spawn)?;
            Some(tx)
        } else {
            None
        };
        let synchronous = options.synchronous;
        let (jobs, rx) = mpsc::channel(max_batch.saturating_mul(4).max(64));
        let counters = Arc::new(Counters::default());
        let writer_counters = Arc::clone(&counters);
        std::thread::Builder::new()
            .name("backstop-sqlite-writer".into())
            .spawn(move || {
                let sync = SyncMode {
                    configured: synchronous,
                    at_configured: true,
                };
                writer_loop(conn, rx, max_batch, &writer_counters, commits, sync)
            })
            .map_err(Error::Spawn)?;

        let slots = options.read_connections.max(1);
        Ok(Db {
            inner: Arc::new(Inner {
                path,
                counters,
                options,
                jobs,
                readers: Mutex::new(Vec::with_capacity(slots)),
                read_slots: Arc::new(Semaphore::new(slots)),
            }),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// What the writer has committed so far.
    pub fn stats(&self) -> DbStats {
        DbStats {
            transactions: self.inner.counters.transactions.load(Ordering::Relaxed),
            synced: self.inner.counters.synced.load(Ordering::Relaxed),
            jobs: self.inner.counters.jobs.load(Ordering::Relaxed),
        }
    }

    /// Write jobs queued and not yet taken by the writer (a gauge of write backlog).
    pub fn queued_jobs(&self) -> usize {
        self.inner.jobs.max_capacity() - self.inner.jobs.capacity()
    }

    /// The options this handle was opened with.
    pub fn options(&self) -> &SqliteOptions {
        &self.inner.options
    }

    /// Runs `f` on the writer connection inside the current batch's transaction (in its own
    /// SAVEPOINT) and returns its value once the batch's COMMIT is durable.
    ///
    /// If `f` returns an error (or panics) only its own writes are rolled back and only this call
    /// fails. If the batch's COMMIT fails, every call of the batch fails with
    /// [`Error::Transaction`]. `f` must not run `BEGIN`/`COMMIT`/`ROLLBACK` itself (savepoints
    /// are fine). If the returned future is dropped, the job still runs and commits.
    pub async fn write<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        self.submit(f, true, true).await
    }

    /// [`write`](Self::write) for a job whose caller does not need it durable when answered:
    /// it commits like any job (visible to every later read and write), but a batch made only
    /// of such jobs commits without a sync, and they become durable with the next synced
    /// commit (a later [`write`](Self::write) of anyone's, or a checkpoint). A crash may lose
    /// them; it never loses a synced commit made after them, because the WAL is synced as a
    /// whole, in order.
    ///
    /// The idempotency store claims this way for routes whose handler commits a phase before
    /// its effect: the claim becomes durable with that phase, one sync for both.
    pub async fn write_deferred<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        self.submit(f, true, false).await
    }

    /// [`write`](Self::write) for a job that changes the database with one statement at most
    /// (reads before it are fine) and returns `Ok` once that statement changed anything: SQLite
    /// undoes a failed statement by itself, so the job runs without a SAVEPOINT of its own (two
    /// statements fewer per job).
    pub(crate) async fn write_statement<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        self.submit(f, false, true).await
    }

    /// [`write_statement`](Self::write_statement), [deferred](Self::write_deferred).
    pub(crate) async fn write_statement_deferred<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        self.submit(f, false, false).await
    }

    async fn submit<T, F>(&self, f: F, savepoint: bool, synced: bool) -> Result<T, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        self.inner
            .jobs
            .send(Box::new(WriteJob {
                f,
                tx,
                savepoint,
                synced,
            }))
            .await
            .map_err(|_| Error::Closed)?;
        rx.await.map_err(|_| Error::Closed)?
    }

    /// Runs `f` on a read connection (`query_only`) on tokio's blocking pool. Sees every write
    /// whose `write` call has returned.
    pub async fn read<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let permit = Arc::clone(&self.inner.read_slots)
            .acquire_owned()
            .await
            .map_err(|_| Error::Closed)?;
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let pooled = inner
                .readers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            let conn = match pooled {
                Some(conn) => conn,
                None => open_reader(&inner.path, &inner.options)?,
            };
            let out = catch_unwind(AssertUnwindSafe(|| f(&conn)));
            // A connection left inside a transaction would pin an old snapshot: drop it.
            if out.is_ok() && conn.is_autocommit() {
                inner
                    .readers
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(conn);
            }
            match out {
                Ok(r) => r.map_err(Error::Sqlite),
                Err(_) => Err(Error::Panicked),
            }
        })
        .await
        .map_err(Error::ReadTask)?
    }

    /// Applies the migration `sql` (one or more statements) once: if a migration called `name`
    /// was already applied to this database, does nothing. Returns whether it ran. The script
    /// and its bookkeeping row commit atomically.
    pub async fn migrate(&self, name: &str, sql: &str) -> Result<bool, Error> {
        let owned_name = name.to_owned();
        let sql = sql.to_owned();
        self.write(move |conn| {
            conn.execute_batch(MIGRATIONS_TABLE)?;
            let done: bool = conn.query_row(
                "SELECT EXISTS (SELECT 1 FROM backstop_migration WHERE name = ?1)",
                [&owned_name],
                |r| r.get(0),
            )?;
            if done {
                return Ok(false);
            }
            conn.execute_batch(&sql)?;
            conn.execute(
                "INSERT INTO backstop_migration (name, applied_at) \
                 VALUES (?1, CAST(unixepoch('subsec') * 1000 AS INTEGER))",
                [&owned_name],
            )?;
            Ok(true)
        })
        .await
        .map_err(|e| Error::Migration {
            name: name.to_owned(),
            source: Box::new(e),
        })
    }
}

fn open_reader(path: &Path, options: &SqliteOptions) -> Result<Connection, Error> {
    let open_err = |source| Error::Open {
        path: path.to_path_buf(),
        source,
    };
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_URI;
    let conn = Connection::open_with_flags(path, flags).map_err(open_err)?;
    conn.busy_timeout(options.busy_timeout).map_err(open_err)?;
    conn.pragma_update(None, "query_only", "ON")
        .map_err(open_err)?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// The checkpointer's connection: read-write (a checkpoint writes the database file).
fn open_checkpointer(path: &Path, options: &SqliteOptions) -> Result<Connection, Error> {
    let open_err = |source| Error::Open {
        path: path.to_path_buf(),
        source,
    };
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(open_err)?;
    conn.busy_timeout(options.busy_timeout).map_err(open_err)?;
    conn.pragma_update(None, "synchronous", options.synchronous.pragma_value())
        .map_err(open_err)?;
    Ok(conn)
}

/// Runs a `PASSIVE` checkpoint after commits, at most every [`CHECKPOINT_EVERY`], until the
/// writer has stopped (its end of `commits` dropped).
fn checkpoint_loop(conn: &Connection, commits: &std::sync::mpsc::Receiver<()>) {
    while commits.recv().is_ok() {
        // PASSIVE copies what it can without waiting for the writer or readers; what it could
        // not copy is copied next time.
        if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            tracing::warn!(error = %e, "sqlite background checkpoint failed");
        }
        std::thread::sleep(CHECKPOINT_EVERY);
    }
}

/// How the writer syncs its commits: `synchronous` as configured for batches with a job that
/// needs it, `NORMAL` (no sync in WAL mode) for batches of [deferred](Db::write_deferred) jobs
/// only. The pragma is changed between transactions, only when the batch's need differs from
/// the last one's.
struct SyncMode {
    configured: Synchronous,
    /// Whether the connection is set to `configured` now (else to `NORMAL`).
    at_configured: bool,
}

impl SyncMode {
    /// Sets the connection up for a batch that does (or does not) need a synced commit;
    /// whether its commit counts as synced.
    fn prepare(&mut self, conn: &Connection, synced: bool) -> bool {
        if self.configured == Synchronous::Normal {
            return false;
        }
        if synced != self.at_configured {
            let value = if synced {
                self.configured.pragma_value()
            } else {
                Synchronous::Normal.pragma_value()
            };
            match conn.pragma_update(None, "synchronous", value) {
                Ok(()) => self.at_configured = synced,
                // Left as it was: at worst a deferred batch is synced, never the reverse
                // (the connection only leaves `configured` through this call succeeding).
                Err(e) => tracing::warn!(error = %e, "sqlite synchronous pragma failed"),
            }
        }
        self.at_configured
    }
}

fn writer_loop(
    conn: Connection,
    mut rx: mpsc::Receiver<Box<dyn Job>>,
    max_batch: usize,
    counters: &Counters,
    commits: Option<std::sync::mpsc::SyncSender<()>>,
    mut sync: SyncMode,
) {
    let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(max_batch);
    let mut replies: Vec<Box<dyn Reply>> = Vec::with_capacity(max_batch);
    // Block for the first job; then take whatever queued up meanwhile (while the previous COMMIT
    // was syncing), without waiting for more.
    while let Some(job) = rx.blocking_recv() {
        batch.push(job);
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let synced = sync.prepare(&conn, batch.iter().any(|job| job.synced()));
        run_batch(&conn, &mut batch, &mut replies, counters, synced);
        if let Some(commits) = &commits {
            // Full: a checkpoint is already asked for.
            let _ = commits.try_send(());
        }
    }
}

const SAVEPOINT: &str = "SAVEPOINT backstop_job";
const RELEASE: &str = "RELEASE backstop_job";
const ROLLBACK_TO: &str = "ROLLBACK TO backstop_job";

/// Runs a parameterless control statement through the statement cache (it runs per job).
fn exec(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// Runs `batch` in as few transactions as possible; answers every job.
fn run_batch(
    conn: &Connection,
    batch: &mut Vec<Box<dyn Job>>,
    replies: &mut Vec<Box<dyn Reply>>,
    counters: &Counters,
    synced: bool,
) {
    tracing::trace!(jobs = batch.len(), "sqlite write batch");
    let mut queue = std::mem::take(batch).into_iter();
    // Normally one pass; another only if a job ended the transaction, for the jobs after it.
    while queue.len() > 0 {
        if let Err(e) = exec(conn, "BEGIN IMMEDIATE") {
            let e = Arc::new(e);
            for job in queue {
                job.abort(BatchEnd::Failed(&e));
            }
            return;
        }
        let mut aborted = false;
        for job in queue.by_ref() {
            let savepoint = job.savepoint();
            if savepoint && exec(conn, SAVEPOINT).is_err() {
                // The transaction is unusable: what ran so far is lost, this job never ran.
                job.abort(BatchEnd::Aborted);
                aborted = true;
                break;
            }
            let (ok, reply) = job.run(conn);
            replies.push(reply);
            let closed = conn.is_autocommit()
                || (savepoint
                    && ((!ok && exec(conn, ROLLBACK_TO).is_err()) || exec(conn, RELEASE).is_err()));
            if closed {
                aborted = true;
                break;
            }
        }
        if aborted {
            rollback(conn);
            finish_all(replies, BatchEnd::Aborted);
            continue;
        }
        match exec(conn, "COMMIT") {
            Ok(()) => {
                counters.transactions.fetch_add(1, Ordering::Relaxed);
                if synced {
                    counters.synced.fetch_add(1, Ordering::Relaxed);
                }
                counters
                    .jobs
                    .fetch_add(replies.len() as u64, Ordering::Relaxed);
                finish_all(replies, BatchEnd::Committed);
            }
            Err(e) => {
                rollback(conn);
                let e = Arc::new(e);
                finish_all(replies, BatchEnd::Failed(&e));
            }
        }
    }
}

fn rollback(conn: &Connection) {
    if !conn.is_autocommit() {
        if let Err(e) = conn.execute_batch("ROLLBACK") {
            tracing::error!(error = %e, "sqlite rollback failed");
        }
    }
}

fn finish_all(replies: &mut Vec<Box<dyn Reply>>, end: BatchEnd<'_>) {
    for reply in replies.drain(..) {
        let end = match &end {
            BatchEnd::Committed => BatchEnd::Committed,
            BatchEnd::Failed(e) => BatchEnd::Failed(e),
            BatchEnd::Aborted => BatchEnd::Aborted,
        };
        reply.finish(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &tempfile::TempDir, options: SqliteOptions) -> Db {
        Db::open(dir.path().join("t.db"), options).unwrap()
    }

    async fn with_table(db: &Db) {
        db.migrate(
            "t_v1",
            "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL UNIQUE);",
        )
        .await
        .unwrap();
    }

    /// A database in a fresh directory (kept while the guard lives) with the table `t`.
    async fn table_db(options: SqliteOptions) -> (tempfile::TempDir, Db) {
        let dir = tempfile::tempdir().unwrap();
        let db = open(&dir, options);
        with_table(&db).await;
        (dir, db)
    }

    /// Inserts `v` into `t`, in a write job of its own.
    async fn insert(db: &Db, v: &'static str) {
        db.write(move |c| c.execute("INSERT INTO t (v) VALUES (?1)", [v]))
            .await
            .unwrap();
    }

    /// `n` concurrent write jobs, the `i`th inserting `i`.
    fn spawn_inserts(db: &Db, n: i64) -> Vec<tokio::task::JoinHandle<Result<usize, Error>>> {
        (0..n)
            .map(|i| {
                let db = db.clone();
                tokio::spawn(async move {
                    db.write(move |c| c.execute("INSERT INTO t (v) VALUES (?1)", [i]))
                        .await
                })
            })
            .collect()
    }

    async fn count(db: &Db) -> i64 {
        db.read(|c| c.query_row("SELECT count(*) FROM t", [], |r| r.get(0)))
            .await
            .unwrap()
    }

    /// Writes 2 MB (fewer pages than SQLite's own checkpoint threshold) in 64 jobs.
    async fn write_two_megabytes(db: &Db) {
        for i in 0..64_i64 {
            db.write(move |c| {
                c.execute(
                    "INSERT INTO t (v) VALUES (?1 || hex(zeroblob(16384)))",
                    [i.to_string()],
                )
            })
            .await
            .unwrap();
        }
    }

    /// The database file's length (without the WAL).
    fn main_file_len(dir: &tempfile::TempDir) -> u64 {
        std::fs::metadata(dir.path().join("t.db")).unwrap().len()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_background_checkpointer_copies_the_wal_into_the_database() {
        let dir = tempfile::tempdir().unwrap();
        let db = open(&dir, SqliteOptions::default());
        with_table(&db).await;
        write_two_megabytes(&db).await;
        // The writer itself would wait for 16,384 pages: only the checkpointer copies 2 MB. It
        // runs on its own thread, so the test waits for it (bounded, generously).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while main_file_len(&dir) < 2 << 20 {
            assert!(
                std::time::Instant::now() < deadline,
                "the WAL was not checkpointed within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(count(&db).await, 64);
    }

    #[tokio::test]
    async fn without_the_background_checkpointer_the_writer_checkpoints_as_sqlite_does() {
        let dir = tempfile::tempdir().unwrap();
        let options = SqliteOptions {
            background_checkpoint: false,
            ..SqliteOptions::default()
        };
        let db = open(&dir, options);
        with_table(&db).await;
        write_two_megabytes(&db).await;
        let pages: i64 = db
            .write(|c| c.query_row("PRAGMA wal_autocheckpoint", [], |r| r.get(0)))
            .await
            .unwrap();
        assert_eq!(pages, 1000, "SQLite's default");
        assert_eq!(count(&db).await, 64);
    }

    #[tokio::test]
    async fn write_then_read_sees_the_row() {
        let (_dir, db) = table_db(SqliteOptions::default()).await;
        insert(&db, "a").await;
        assert_eq!(count(&db).await, 1);
    }

    #[tokio::test]
    async fn migration_runs_once() {
        let dir = tempfile::tempdir().unwrap();
        let db = open(&dir, SqliteOptions::default());
        let sql = "CREATE TABLE m (x INTEGER);";
        assert!(db.migrate("m_v1", sql).await.unwrap());
        assert!(!db.migrate("m_v1", sql).await.unwrap());
    }

    #[tokio::test]
    async fn failed_migration_is_rolled_back_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        let db = open(&dir, SqliteOptions::default());
        let err = db
            .migrate("bad", "CREATE TABLE ok1 (x INTEGER); NOT SQL;")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Migration { ref name, .. } if name == "bad"));
        assert!(err.sqlite_error().is_some());
        assert!(!err.is_constraint_violation(), "a syntax error: {err:?}");
        let exists: bool = db
            .read(|c| {
                c.query_row(
                    "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE name = 'ok1')",
                    [],
                    |r| r.get(0),
                )
            })
            .await
            .unwrap();
        assert!(!exists, "the half-applied migration must be rolled back");
    }

    #[tokio::test]
    async fn memory_database_is_refused() {
        let err = Db::open(":memory:", SqliteOptions::default()).unwrap_err();
        assert!(matches!(err, Error::NotWal { .. }), "{err:?}");
    }

    /// Many concurrent jobs, some failing: each failure rolls back only its own writes and
    /// fails only its own caller; all the others commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn failing_job_rolls_back_only_itself() {
        let (_dir, db) = table_db(SqliteOptions::default()).await;
        insert(&db, "taken").await;
        let mut tasks = Vec::new();
        for i in 0..200 {
            let db = db.clone();
            tasks.push(tokio::spawn(async move {
                db.write(move |c| {
                    c.execute("INSERT INTO t (v) VALUES (?1)", [format!("first-{i}")])?;
                    if i % 5 == 0 {
                        // Violates UNIQUE after a successful insert: both must vanish.
                        c.execute("INSERT INTO t (v) VALUES ('taken')", [])?;
                    }
                    Ok(i)
                })
                .await
            }));
        }
        let mut failed = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(_) => {}
                Err(e) => {
                    assert!(matches!(e, Error::Sqlite(_)), "{e:?}");
                    assert!(e.is_constraint_violation(), "{e:?}");
                    failed += 1;
                }
            }
        }
        assert_eq!(failed, 40);
        assert_eq!(count(&db).await, 1 + 160);
    }

    /// Jobs that queue up while the writer is busy are committed together in one transaction.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_jobs_share_one_transaction() {
        let (_dir, db) = table_db(SqliteOptions::default()).await;
        let (unblock, blocked) = std::sync::mpsc::channel::<()>();
        let (started_tx, started) = oneshot::channel::<()>();
        let first = {
            let db = db.clone();
            tokio::spawn(async move {
                db.write(move |c| {
                    let _ = started_tx.send(());
                    blocked.recv().ok();
                    c.execute("INSERT INTO t (v) VALUES ('first')", [])
                })
                .await
            })
        };
        // The writer is now inside the first job's batch.
        started.await.unwrap();
        let before = db.stats();
        let tasks = spawn_inserts(&db, 63);
        while db.queued_jobs() < 63 {
            tokio::task::yield_now().await;
        }
        unblock.send(()).unwrap();
        first.await.unwrap().unwrap();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        let after = db.stats();
        assert_eq!(after.jobs - before.jobs, 64);
        assert_eq!(after.transactions - before.transactions, 2);
        assert_eq!(count(&db).await, 64);
    }

    /// A one-statement job runs without a savepoint: when its statement fails, SQLite undoes
    /// that statement alone, and the rest of the batch commits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn failing_statement_job_rolls_back_only_itself() {
        let (_dir, db) = table_db(SqliteOptions::default()).await;
        insert(&db, "taken").await;
        let tasks: Vec<_> = (0..100)
            .map(|i| {
                let db = db.clone();
                tokio::spawn(async move {
                    // Every fourth job inserts two rows, the second a duplicate: the statement
                    // fails as a whole.
                    let second = if i % 4 == 0 {
                        "taken".to_owned()
                    } else {
                        format!("b-{i}")
                    };
                    db.write_statement(move |c| {
                        c.execute(
                            "INSERT INTO t (v) VALUES (?1), (?2)",
                            [format!("a-{i}"), second],
                        )
                    })
                    .await
                })
            })
            .collect();
        let mut failed = 0;
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                assert!(matches!(e, Error::Sqlite(_)), "{e:?}");
                failed += 1;
            }
        }
        assert_eq!(failed, 25);
        assert_eq!(count(&db).await, 1 + 75 * 2);
    }

    #[tokio::test]
    async fn panicking_job_fails_only_its_caller() {
        let (_dir, db) = table_db(SqliteOptions::default()).await;
        let err = db
            .write(|c| -> rusqlite::Result<()> {
                c.execute("INSERT INTO t (v) VALUES ('p')", [])?;
                panic!("job bug")
            })
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Panicked));
        insert(&db, "after").await;
        assert_eq!(count(&db).await, 1);
    }

    #[tokio::test]
    async fn job_that_ends_the_transaction_aborts_the_batch() {
        let (_dir, db) = table_db(SqliteOptions::default()).await;
        let err = db
            .write(|c| c.execute_batch("INSERT INTO t (v) VALUES ('x'); ROLLBACK;"))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Aborted), "{err:?}");
        insert(&db, "y").await;
        assert_eq!(count(&db).await, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn autocommit_mode_commits_every_job() {
        let (_dir, db) = table_db(SqliteOptions {
            group_commit: false,
            synchronous: Synchronous::Normal,
            ..SqliteOptions::default()
        })
        .await;
        let tasks = spawn_inserts(&db, 50);
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert_eq!(count(&db).await, 50);
    }

    #[tokio::test]
    async fn writes_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = open(&dir, SqliteOptions::default());
            with_table(&db).await;
            insert(&db, "kept").await;
        }
        let db = open(&dir, SqliteOptions::default());
        with_table(&db).await;
        assert_eq!(count(&db).await, 1);
    }

    #[tokio::test]
    async fn read_connections_are_query_only() {
        let (_dir, db) = table_db(SqliteOptions::default()).await;
        let err = db
            .read(|c| c.execute("INSERT INTO t (v) VALUES ('no')", []))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Sqlite(_)));
    }
}
