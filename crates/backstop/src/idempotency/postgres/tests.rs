//! The windows of the PostgreSQL store, each test in a schema of its own on the test database:
//! placement, lookup across windows, the move on takeover, drops (and what prevents them),
//! instances racing at a window boundary, an interrupted drop, and the upgrade of a database
//! of the single-table layout.
//!
//! Instances are moved into the future by a clock offset instead of waiting for a window to
//! seal: nothing here sleeps or depends on timing.

use std::sync::Arc;
use std::time::Duration;

use super::sql::{CLAIM_SQL, PHASE_SQL};
use super::windows::{LEGACY, PARENT};
use super::{MIGRATION, MIGRATION_V2, PostgresOptions, PostgresStore};
use crate::db::postgres::{self as db, tokio_postgres};
use crate::idempotency::window::{Window, class_of};
use crate::idempotency::{
    Claim, ClaimRequest, Fingerprint, IdempotencyKey, Lease, PriorRun, RecordStatus, Store,
    StoreError, StoredResponse,
};

const HOUR: i64 = 3_600_000;
const DAY: i64 = 24 * HOUR;
const T0: i64 = 1_700_000_000_000;

async fn admin() -> tokio_postgres::Client {
    let url = crate::test_services::postgres_url();
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect to the test database");
    tokio::spawn(connection);
    client
}

/// A schema of its own, dropped when the test ends.
struct Schema {
    name: String,
    client: tokio_postgres::Client,
}

impl Schema {
    async fn create(prefix: &str) -> Schema {
        let name = format!("{prefix}_{}_{}", std::process::id(), rand::random::<u32>());
        let client = admin().await;
        client
            .batch_execute(&format!("CREATE SCHEMA {name}; SET search_path = {name}"))
            .await
            .expect("create schema");
        Schema { name, client }
    }

    /// A store (a pool of its own: an instance) placing records `offset_ms` past the
    /// database's clock.
    async fn store(&self, offset_ms: i64) -> PostgresStore {
        let mut config: tokio_postgres::Config = crate::test_services::postgres_url()
            .parse()
            .expect("test URL");
        config.options(format!("-c search_path={}", self.name));
        let options = PostgresOptions {
            max_connections: 4,
            writers: 2,
            ..PostgresOptions::default()
        };
        let pool = db::pool(config, options.max_connections, options.timeout).expect("pool");
        PostgresStore::with_clock_offset(pool, options, offset_ms)
            .await
            .expect("open store")
    }

    /// The database's clock, unix ms.
    async fn clock(&self) -> i64 {
        self.client
            .query_one(
                "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8",
                &[],
            )
            .await
            .expect("clock")
            .get(0)
    }

    /// The table holding `key`, if any.
    async fn table_of(&self, key: &str) -> Option<String> {
        self.client
            .query_opt(
                &format!("SELECT tableoid::regclass::text FROM {PARENT} WHERE key = $1"),
                &[&key],
            )
            .await
            .expect("table of")
            .map(|row| row.get(0))
    }

    async fn exists(&self, table: &str) -> bool {
        self.client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
            .await
            .expect("to_regclass")
            .get(0)
    }

    async fn count(&self, table: &str) -> i64 {
        self.client
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .expect("count")
            .get(0)
    }

    /// A connection of its own in this schema, as a writer's would be.
    async fn connection(&self) -> tokio_postgres::Client {
        let client = admin().await;
        client
            .batch_execute(&format!("SET search_path = {}", self.name))
            .await
            .expect("search path");
        client
    }

    async fn drop(self) {
        self.client
            .batch_execute(&format!("DROP SCHEMA {} CASCADE", self.name))
            .await
            .expect("drop schema");
    }
}

fn req(key: &str, ttl_ms: i64, lease_ms: u64, now_ms: i64) -> ClaimRequest {
    ClaimRequest {
        scope: "merchant-1".into(),
        key: IdempotencyKey::new(key).expect("valid key"),
        fingerprint: Fingerprint::of_bytes("POST /v1/payments", b"{}"),
        lease: Duration::from_millis(lease_ms),
        ttl: Duration::from_millis(ttl_ms.unsigned_abs()),
        now_ms,
    }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: bytes::Bytes::from_static(b"{\"id\":1}"),
    }
}

async fn claimed(store: &PostgresStore, r: ClaimRequest) -> Lease {
    match store.claim(r).await.expect("claim") {
        Claim::Claimed(lease) => lease,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// The window the database's clock (plus `offset_ms`) placed a record of `ttl_ms` in, between
/// two readings of that clock.
fn window_between(ttl_ms: i64, before: i64, after: i64, table: &str) -> bool {
    let (first, last) = (Window::of(ttl_ms, before), Window::of(ttl_ms, after));
    (first.index..=last.index).any(|index| {
        Window {
            class_ms: first.class_ms,
            index,
        }
        .table_name()
            == table
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_goes_to_the_current_window_of_its_class() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_placement").await;
    let store = schema.store(0).await;
    for (key, ttl) in [("minute", 60_000), ("day", DAY), ("week", 7 * DAY)] {
        let before = schema.clock().await;
        claimed(&store, req(key, ttl, 5_000, T0)).await;
        let after = schema.clock().await;
        let table = schema.table_of(key).await.expect("stored");
        assert!(window_between(ttl, before, after, &table), "{key}: {table}");
        assert_eq!(
            Window::from_table_name(&table).map(|w| w.class_ms),
            Some(class_of(ttl))
        );
    }
    drop(store);
    schema.drop().await;
}

/// An instance two windows ahead finds the record of another's window: in progress while its
/// lease is live, replayed once completed, and a new key goes to its own window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_found_in_an_older_window() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_found").await;
    let (now, later) = (schema.store(0).await, schema.store(2 * HOUR).await);
    let lease = claimed(&now, req("k", DAY, 5_000, T0)).await;
    let old = schema.table_of("k").await.expect("stored");
    assert!(matches!(
        later.claim(req("k", DAY, 5_000, T0 + 1)).await.unwrap(),
        Claim::InProgress { .. }
    ));
    now.complete(&lease, response(), T0 + 2).await.unwrap();
    assert_eq!(
        later.claim(req("k", DAY, 5_000, T0 + 3)).await.unwrap(),
        Claim::Replay(response())
    );
    assert_eq!(schema.table_of("k").await, Some(old.clone()));
    claimed(&later, req("other", DAY, 5_000, T0 + 4)).await;
    let newer = schema.table_of("other").await.expect("stored");
    let index = |t: &str| Window::from_table_name(t).expect("a window").index;
    assert!(index(&newer) >= index(&old) + 2, "{old} {newer}");
    drop((now, later));
    schema.drop().await;
}

/// A takeover moves the record into the taker's current window, keeping its first-claim time
/// and recovery point; the old window no longer holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_moves_the_record_into_the_current_window() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_move").await;
    let (now, later) = (schema.store(0).await, schema.store(2 * HOUR).await);
    for (key, failed) in [("failed", true), ("abandoned", false)] {
        let first = claimed(&now, req(key, DAY, 5_000, T0)).await;
        let point = crate::idempotency::RecoveryPoint {
            phase: "intent_created".into(),
            data: bytes::Bytes::from_static(b"pi_1"),
        };
        now.commit_phase(
            &first,
            point.clone(),
            Box::new(|_| Box::pin(async { Ok(()) })),
        )
        .await
        .unwrap();
        if failed {
            now.fail(&first, T0 + 1).await.unwrap();
        }
        let old = schema.table_of(key).await.expect("stored");
        let taken = claimed(&later, req(key, DAY, 5_000, first.lease_until_ms)).await;
        let new = schema.table_of(key).await.expect("moved");
        assert_ne!(old, new);
        assert_eq!(schema.count(&old).await, 0);
        assert_eq!(taken.created_at_ms, T0);
        let resume = taken.resume.clone().expect("a takeover");
        let prior = if failed {
            PriorRun::Failed
        } else {
            PriorRun::Abandoned
        };
        assert_eq!((resume.prior, resume.point), (prior, Some(point)));
        assert!(taken.lease_until_ms > first.lease_until_ms);
        // The old holder is fenced out; the new one completes in the new window.
        assert!(matches!(
            now.complete(&first, response(), T0 + 2).await,
            Err(StoreError::LeaseLost { .. })
        ));
        later
            .complete(&taken, response(), first.lease_until_ms + 1)
            .await
            .unwrap();
    }
    drop((now, later));
    schema.drop().await;
}

/// A sealed window whose records have all expired is dropped whole: not while one runs under
/// a live lease, not while a completion has pushed one's expiry later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_expired_window_is_dropped_whole_and_only_then() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_drop").await;
    let (now, sweeper) = (schema.store(0).await, schema.store(HOUR).await);
    let minute = 60_000;
    // Three done at T0 (expire by T0 + 1 min), two running under leases live until T0 + 10
    // and T0 + 30 min.
    for i in 0..3 {
        let lease = claimed(&now, req(&format!("done-{i}"), minute, 5_000, T0)).await;
        now.complete(&lease, response(), T0 + 1).await.unwrap();
    }
    let live = claimed(&now, req("live", minute, 10 * minute as u64, T0)).await;
    let late = claimed(&now, req("late", minute, 30 * minute as u64, T0)).await;
    let table = schema.table_of("done-0").await.expect("stored");
    assert_eq!(schema.table_of("live").await, Some(table.clone()));

    // Not sealed for the instance of now: nothing goes, whatever the time.
    assert_eq!(now.expire(T0 + 365 * DAY, 100).await.unwrap(), 0);
    // Sealed for the instance an hour ahead, all expired, but leases are live.
    assert_eq!(sweeper.expire(T0 + 5 * minute, 100).await.unwrap(), 0);
    assert!(schema.exists(&table).await);
    // Both complete, the second late: its expiry is pushed to T0 + 21 min.
    now.complete(&live, response(), T0 + 9 * minute)
        .await
        .unwrap();
    now.complete(&late, response(), T0 + 20 * minute)
        .await
        .unwrap();
    assert_eq!(sweeper.expire(T0 + 15 * minute, 100).await.unwrap(), 0);
    assert!(schema.exists(&table).await);
    assert_eq!(schema.count(&table).await, 5);
    // All expired: the window goes whole, and its keys are unused again.
    assert_eq!(sweeper.expire(T0 + 22 * minute, 100).await.unwrap(), 5);
    assert!(!schema.exists(&table).await);
    assert_eq!(
        now.get("merchant-1", &IdempotencyKey::new("late").unwrap())
            .await
            .unwrap(),
        None
    );
    claimed(&now, req("late", minute, 5_000, T0 + 23 * minute)).await;
    drop((now, sweeper));
    schema.drop().await;
}

/// Once a window is closed for its drop, a completion there changes nothing and is answered as
/// a lost lease (the record is as good as swept); a takeover still moves a record out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_closed_for_its_drop_takes_no_completion() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_closed").await;
    let (now, later) = (schema.store(0).await, schema.store(2 * HOUR).await);
    let late = claimed(&now, req("late", DAY, 5_000, T0)).await;
    let moved = claimed(&now, req("moved", DAY, 5_000, T0)).await;
    let table = schema.table_of("late").await.expect("stored");
    schema
        .client
        .batch_execute(&format!(
            "ALTER TABLE {table} ADD CONSTRAINT {table}_closed CHECK (false) NOT VALID"
        ))
        .await
        .unwrap();
    assert!(matches!(
        now.complete(&late, response(), T0 + 1).await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert!(matches!(
        now.fail(&late, T0 + 1).await,
        Err(StoreError::LeaseLost { .. })
    ));
    let taken = claimed(&later, req("moved", DAY, 5_000, moved.lease_until_ms)).await;
    assert_ne!(schema.table_of("moved").await, Some(table.clone()));
    later
        .complete(&taken, response(), moved.lease_until_ms + 1)
        .await
        .unwrap();
    drop((now, later));
    schema.drop().await;
}

/// Instances (each its own pool) whose clocks straddle window boundaries (half a window apart,
/// so they disagree on the current window) race to claim the same keys: exactly one winner
/// per key, and one record per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_racing_at_a_window_boundary_have_one_winner_per_key() {
    const INSTANCES: usize = 6;
    const KEYS: usize = 12;
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_race").await;
    let minute = 60_000;
    let half = Window::of(minute, 0).width_ms() / 2;
    let mut stores = Vec::new();
    for i in 0..INSTANCES {
        stores.push(schema.store(i as i64 * half).await);
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(INSTANCES * 2 * KEYS));
    let mut tasks = Vec::new();
    for key in 0..KEYS {
        for i in 0..INSTANCES * 2 {
            let store = stores[i % INSTANCES].clone();
            let barrier = Arc::clone(&barrier);
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let claim = store
                    .claim(req(&format!("k{key}"), minute, 60_000, T0))
                    .await
                    .expect("claim");
                (key, claim)
            }));
        }
    }
    let mut winners = vec![0; KEYS];
    for task in tasks {
        match task.await.unwrap() {
            (key, Claim::Claimed(_)) => winners[key] += 1,
            (_, Claim::InProgress { .. }) => {}
            (_, other) => panic!("a loser must get InProgress, got {other:?}"),
        }
    }
    assert_eq!(winners, vec![1; KEYS]);
    let per_key: Vec<i64> = schema
        .client
        .query(
            &format!("SELECT count(*) FROM {PARENT} GROUP BY scope, key"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(per_key, vec![1; KEYS]);
    drop(stores);
    schema.drop().await;
}

/// A window missing when a claim needs it (this instance thought it existed: another
/// instance's clock, a drop) is created on demand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_window_is_created_on_demand() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_missing").await;
    let store = schema.store(0).await;
    claimed(&store, req("first", DAY, 5_000, T0)).await;
    let table = schema.table_of("first").await.expect("stored");
    schema
        .client
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
    claimed(&store, req("second", DAY, 5_000, T0)).await;
    assert!(schema.table_of("second").await.is_some());
    drop(store);
    schema.drop().await;
}

/// A drop interrupted mid-detach (`DETACH ... CONCURRENTLY` cancelled while an old snapshot
/// still saw the window) is finished by the next expiry: `FINALIZE`, then dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_detach_is_finished() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_finalize").await;
    let store = schema.store(0).await;
    let lease = claimed(&store, req("k", 60_000, 1_000, T0)).await;
    store.complete(&lease, response(), T0).await.unwrap();
    let table = schema.table_of("k").await.expect("stored");
    // Closed, as a drop does before its detach.
    schema
        .client
        .batch_execute(&format!(
            "ALTER TABLE {table} ADD CONSTRAINT {table}_closed CHECK (false) NOT VALID"
        ))
        .await
        .unwrap();
    let set_path = format!("SET search_path = {}", schema.name);
    // An old snapshot that sees the window keeps the detach waiting.
    let reader = admin().await;
    reader
        .batch_execute(&format!(
            "{set_path}; BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM {PARENT}"
        ))
        .await
        .unwrap();
    let detacher = admin().await;
    detacher.batch_execute(&set_path).await.unwrap();
    let pid: i32 = detacher
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let detach = format!("ALTER TABLE {PARENT} DETACH PARTITION {table} CONCURRENTLY");
    let detaching = tokio::spawn(async move { detacher.batch_execute(&detach).await });
    // Until the detach waits, then cancel it: the partition stays half detached.
    loop {
        let pending: bool = schema
            .client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass($1) \
                 AND inhdetachpending) AND EXISTS (SELECT 1 FROM pg_stat_activity \
                 WHERE pid = $2 AND wait_event_type = 'Lock')",
                &[&table, &pid],
            )
            .await
            .unwrap()
            .get(0);
        if pending {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    schema
        .client
        .execute("SELECT pg_cancel_backend($1)", &[&pid])
        .await
        .unwrap();
    assert!(detaching.await.unwrap().is_err());
    reader.batch_execute("COMMIT").await.unwrap();

    // A later instance's expiry finalizes the detach and drops the table.
    let sweeper = schema.store(HOUR).await;
    sweeper.expire(T0 + HOUR, 100).await.unwrap();
    assert!(!schema.exists(&table).await);
    drop((store, sweeper));
    schema.drop().await;
}

/// A database of the single-table layout (migrations v1 and v2) opens without losing a record:
/// every record is found as it was, a takeover moves one out, expiry sweeps the expired ones
/// one by one, and the table is dropped once all have expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_table_database_upgrades_in_place() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_upgrade").await;
    let fp = Fingerprint::of_bytes("POST /v1/payments", b"{}").to_hex();
    schema
        .client
        .batch_execute(&format!(
            "{MIGRATION} {MIGRATION_V2} \
             CREATE TABLE backstop_migration (name TEXT PRIMARY KEY, \
               applied_at TIMESTAMPTZ NOT NULL DEFAULT now()); \
             INSERT INTO backstop_migration (name) VALUES ('{}'), ('{}'); \
             INSERT INTO {LEGACY} (scope, key, fingerprint, status, lease_until, http_status, \
               response_body, response_headers, created_at, expires_at) VALUES \
             ('merchant-1', 'done', '{fp}', 'succeeded', {t1}, 201, '\\x7b7d', '[]', {T0}, {e1}), \
             ('merchant-1', 'failed', '{fp}', 'failed', {t1}, NULL, NULL, NULL, {T0}, {e1}), \
             ('merchant-1', 'running', '{fp}', 'running', {t9}, NULL, NULL, NULL, {T0}, {e1}), \
             ('merchant-1', 'old', '{fp}', 'succeeded', {t1}, 200, '', '[]', {T0}, {t1});",
            super::MIGRATION_NAME,
            super::MIGRATION_V2_NAME,
            t1 = T0 + 1_000,
            t9 = T0 + 9_000,
            e1 = T0 + DAY,
        ))
        .await
        .expect("the single-table layout");
    let store = schema.store(0).await;
    assert_eq!(schema.count(PARENT).await, 4);
    let key = |k: &str| IdempotencyKey::new(k).unwrap();
    let get = |k: &'static str| {
        let store = store.clone();
        async move { store.get("merchant-1", &key(k)).await.unwrap() }
    };
    let done = get("done").await.expect("kept");
    assert_eq!(
        (done.status, done.expires_at_ms, done.created_at_ms),
        (RecordStatus::Succeeded, T0 + DAY, T0)
    );
    assert_eq!(
        store
            .claim(req("done", DAY, 5_000, T0 + 2_000))
            .await
            .unwrap(),
        Claim::Replay(StoredResponse {
            status: 201,
            headers: Vec::new(),
            body: bytes::Bytes::from_static(b"{}"),
        })
    );
    assert!(matches!(
        store
            .claim(req("running", DAY, 5_000, T0 + 2_000))
            .await
            .unwrap(),
        Claim::InProgress { .. }
    ));
    // A takeover moves the failed record into a window.
    let taken = claimed(&store, req("failed", DAY, 5_000, T0 + 2_000)).await;
    assert_eq!(taken.created_at_ms, T0);
    assert_ne!(schema.table_of("failed").await.as_deref(), Some(LEGACY));
    assert_eq!(schema.count(LEGACY).await, 3);

    // Expiry sweeps the legacy table record by record: `old` first.
    assert_eq!(store.expire(T0 + 2_000, 100).await.unwrap(), 1);
    assert_eq!(schema.count(LEGACY).await, 2);
    // Then everything there has expired: the table goes (with what was left in it).
    assert_eq!(store.expire(T0 + 2 * DAY, 100).await.unwrap(), 2);
    assert!(!schema.exists(LEGACY).await);
    assert!(get("failed").await.is_some());
    // Opening again finds nothing left to migrate.
    drop(store);
    let again = schema.store(0).await;
    assert!(get_via(&again, "failed").await.is_some());
    drop(again);
    schema.drop().await;
}

async fn get_via(store: &PostgresStore, k: &str) -> Option<crate::idempotency::Record> {
    store
        .get("merchant-1", &IdempotencyKey::new(k).unwrap())
        .await
        .unwrap()
}

/// Expiry creates the next window of a class ahead of time, in the last half of its current
/// window, so the first claims of a window do not wait for its DDL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_creates_the_next_window_ahead() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_ahead").await;
    // An instance whose clock stands three quarters into a window of day keys (1 hour wide),
    // give or take the time this test takes.
    let width = Window::of(DAY, 0).width_ms();
    let clock = schema.clock().await;
    let offset = width - clock % width - width / 4;
    let store = schema.store(offset).await;
    claimed(&store, req("k", DAY, 5_000, T0)).await;
    let current =
        Window::from_table_name(&schema.table_of("k").await.expect("stored")).expect("a window");
    store.expire(T0, 100).await.unwrap();
    assert!(schema.exists(&current.next().table_name()).await);
    drop(store);
    schema.drop().await;
}

/// A claim of a held key next to the holder's phase, in transactions shared with other units
/// as the group-commit writers run them: transaction A has written the holder's phase (the
/// row's lock) and then claims the key for a duplicate; transaction B claims it between. B
/// must answer "in progress" without waiting for A's row lock while it holds the key's
/// advisory lock, or A (waiting for that advisory lock) and B deadlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_a_held_key_never_waits_for_the_holders_row_lock() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_deadlock").await;
    let store = schema.store(0).await;
    let lease = claimed(&store, req("k", DAY, 60_000, T0)).await;
    let claim_of = |now: i64| {
        let r = req("k", DAY, 60_000, now);
        let class_ms = class_of(DAY);
        (
            r.scope.clone(),
            r.fingerprint.to_hex(),
            r.lease_until_ms(),
            r.expires_at_ms(),
            class_ms,
            Window { class_ms, index: 0 }.width_ms(),
        )
    };
    async fn claim(
        client: &tokio_postgres::Client,
        now: i64,
        (scope, fingerprint, lease_until, expires_at, class_ms, width_ms): (
            String,
            String,
            i64,
            i64,
            i64,
            i64,
        ),
    ) -> Result<Option<bool>, tokio_postgres::Error> {
        let row = client
            .query_one(
                CLAIM_SQL,
                &[
                    &scope,
                    &"k",
                    &fingerprint,
                    &lease_until,
                    &now,
                    &expires_at,
                    &class_ms,
                    &width_ms,
                    &0_i64,
                    &Vec::<String>::new(),
                ],
            )
            .await?;
        Ok(row.get("taken"))
    }

    let (a, b) = (schema.connection().await, schema.connection().await);
    a.batch_execute("BEGIN").await.unwrap();
    let phase: &[u8] = b"charged";
    let marked = a
        .execute(
            PHASE_SQL,
            &[
                &"merchant-1",
                &"k",
                &lease.lease_until_ms,
                &"psp",
                &phase,
                &class_of(DAY),
                &i64::MIN,
                &i64::MAX,
            ],
        )
        .await
        .unwrap();
    assert_eq!(marked, 1, "the holder's phase locks its row");

    b.batch_execute("BEGIN").await.unwrap();
    let b_pid: i32 = b
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let b = Arc::new(b);
    let b_claim = tokio::spawn({
        let (b, args) = (b.clone(), claim_of(T0 + 1));
        async move { claim(&b, T0 + 1, args).await }
    });
    // B either answers or ends up waiting for a lock: then A's claim makes the cycle.
    let waiting = loop {
        if b_claim.is_finished() {
            break false;
        }
        let event: Option<String> = schema
            .client
            .query_one(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
                &[&b_pid],
            )
            .await
            .unwrap()
            .get(0);
        if event.as_deref() == Some("Lock") {
            break true;
        }
        tokio::task::yield_now().await;
    };
    let a = Arc::new(a);
    let a_claim = tokio::spawn({
        let (a, args) = (a.clone(), claim_of(T0 + 2));
        async move { claim(&a, T0 + 2, args).await }
    });
    let b_answer = b_claim.await.unwrap();
    b.batch_execute(if b_answer.is_ok() {
        "COMMIT"
    } else {
        "ROLLBACK"
    })
    .await
    .unwrap();
    let a_answer = a_claim.await.unwrap();
    a.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        !waiting,
        "B waited for a lock while holding the key's advisory lock"
    );
    assert_eq!(b_answer.expect("B's claim"), Some(false), "in progress");
    assert_eq!(a_answer.expect("A's claim"), Some(false), "in progress");
    drop(store);
    schema.drop().await;
}

/// Whether a claim of the store is waiting for a table lock.
async fn a_claim_waits_for_a_lock(schema: &Schema) -> bool {
    schema
        .client
        .query_one(
            "SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE '%backstop_idempotency_claim%'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// A sealed window's summary rules it out for keys it does not hold: a claim of such a key
/// does not read it (here, it is not held up by a lock on it), while a key it holds is still
/// found there. The outcome statements reach the record through the window the claim placed
/// it in, or through its class's windows once that was forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_keeps_claims_out_of_sealed_windows_without_their_key() {
    if !crate::test_services::postgres() {
        return;
    }
    let schema = Schema::create("windows_summary").await;
    // Two hours back: the records go to a window the database's clock has sealed.
    let past = schema.store(-2 * HOUR).await;
    let lease = claimed(&past, req("old", DAY, 5_000, T0)).await;
    past.complete(&lease, response(), T0 + 1).await.unwrap();
    let sealed = schema.table_of("old").await.expect("stored");

    let store = schema.store(0).await;
    store.summarise().await.unwrap();
    // The sealed window, and maybe the one after it (made ahead by the instance in the past).
    assert!((1..=2).contains(&store.windows.summarised()));
    assert!(
        !store
            .windows
            .skip_for("merchant-1", "old")
            .contains(&sealed)
    );
    let fresh: Vec<String> = (0..20).map(|i| format!("new-{i}")).collect();
    let ruled_out = fresh
        .iter()
        .filter(|k| store.windows.skip_for("merchant-1", k).contains(&sealed))
        .count();
    assert!(ruled_out >= 15, "{ruled_out} of 20 (1 % false positives)");

    // With the sealed window locked, a claim of a key it rules out goes on; one of the key it
    // holds waits for the lock, and then finds the record.
    let locker = schema.connection().await;
    locker
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE {sealed} IN ACCESS EXCLUSIVE MODE"
        ))
        .await
        .unwrap();
    let key = fresh
        .iter()
        .find(|k| store.windows.skip_for("merchant-1", k).contains(&sealed))
        .expect("a key ruled out")
        .clone();
    let claiming = tokio::spawn({
        let (store, key) = (store.clone(), key.clone());
        async move { store.claim(req(&key, DAY, 5_000, T0)).await }
    });
    while !claiming.is_finished() && !a_claim_waits_for_a_lock(&schema).await {
        tokio::task::yield_now().await;
    }
    let went_on = claiming.is_finished();
    if !went_on {
        locker.batch_execute("ROLLBACK").await.unwrap();
    }
    assert!(went_on, "a claim read the window its summary rules out");
    let Claim::Claimed(new) = claiming.await.unwrap().unwrap() else {
        panic!("a new key is claimed");
    };
    let replay = tokio::spawn({
        let store = store.clone();
        async move { store.claim(req("old", DAY, 5_000, T0 + 2)).await }
    });
    while !replay.is_finished() && !a_claim_waits_for_a_lock(&schema).await {
        tokio::task::yield_now().await;
    }
    assert!(!replay.is_finished(), "the window holding the key is read");
    locker.batch_execute("COMMIT").await.unwrap();
    assert_eq!(replay.await.unwrap().unwrap(), Claim::Replay(response()));

    // Completed in the window the claim placed it in; and with that forgotten, in its class.
    assert_ne!(schema.table_of(&key).await, Some(sealed.clone()));
    store.complete(&new, response(), T0 + 3).await.unwrap();
    let other = claimed(&store, req("forgotten", DAY, 5_000, T0)).await;
    store.windows.placements.lock().unwrap().clear();
    store.complete(&other, response(), T0 + 4).await.unwrap();
    for key in [key.as_str(), "forgotten"] {
        assert_eq!(
            store.claim(req(key, DAY, 5_000, T0 + 5)).await.unwrap(),
            Claim::Replay(response())
        );
    }
    drop((past, store));
    schema.drop().await;
}
