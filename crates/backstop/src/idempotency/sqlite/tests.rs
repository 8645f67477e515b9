//! Unit tests of the SQLite store: group commit, reopening, windows, the upgrade in place.

use super::*;
use std::time::Duration;

use bytes::Bytes;

use crate::idempotency::conformance::WithGuard;
use crate::idempotency::window::Window;

async fn store() -> WithGuard<SqliteStore, tempfile::TempDir> {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())
        .await
        .expect("open store");
    WithGuard(store, dir)
}

/// Claims and completions from concurrent callers share the writer's transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_are_group_committed() {
    let guard = store().await;
    let store = guard.0.clone();
    // The window's table exists before the batch is measured.
    claim_at(&store, "first", 1_000, 60_000).await;
    let (unblock, blocked) = std::sync::mpsc::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let blocker = store.db().clone();
    let blocker = tokio::spawn(async move {
        blocker
            .write(move |_| {
                let _ = started_tx.send(());
                blocked.recv().ok();
                Ok(())
            })
            .await
    });
    started.await.unwrap();
    let before = store.db().stats();
    let claims: Vec<_> = (0..32)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let req = ClaimRequest {
                    scope: "s".into(),
                    key: IdempotencyKey::new(format!("k{i}")).unwrap(),
                    fingerprint: Fingerprint::of_bytes("M", b""),
                    lease: std::time::Duration::from_secs(5),
                    ttl: std::time::Duration::from_secs(60),
                    now_ms: 1_000,
                };
                store.claim(req).await
            })
        })
        .collect();
    while store.db().queued_jobs() < 32 {
        tokio::task::yield_now().await;
    }
    unblock.send(()).unwrap();
    blocker.await.unwrap().unwrap();
    for c in claims {
        assert!(matches!(c.await.unwrap().unwrap(), Claim::Claimed(_)));
    }
    let after = store.db().stats();
    assert_eq!(after.jobs - before.jobs, 33);
    assert_eq!(after.transactions - before.transactions, 2);
}

#[tokio::test]
async fn records_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let req = ClaimRequest {
        scope: "s".into(),
        key: IdempotencyKey::new("k").unwrap(),
        fingerprint: Fingerprint::of_bytes("M", b"x"),
        lease: std::time::Duration::from_secs(5),
        ttl: std::time::Duration::from_secs(60),
        now_ms: 1_000,
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Bytes::from_static(b"{\"ok\":true}"),
    };
    {
        let store = SqliteStore::open(&path, SqliteOptions::default())
            .await
            .unwrap();
        let Claim::Claimed(lease) = store.claim(req.clone()).await.unwrap() else {
            panic!("not claimed")
        };
        store
            .complete(&lease, response.clone(), 1_100)
            .await
            .unwrap();
    }
    let store = SqliteStore::open(&path, SqliteOptions::default())
        .await
        .unwrap();
    assert_eq!(
        store
            .claim(ClaimRequest {
                now_ms: 2_000,
                ..req
            })
            .await
            .unwrap(),
        Claim::Replay(response)
    );
}

const HOUR: i64 = 3_600_000;
const DAY: i64 = 24 * HOUR;
/// The start of an hour window of the day class.
const T0: i64 = 1_700_002_800_000;

fn request(key: &str, now_ms: i64, ttl_ms: u64) -> ClaimRequest {
    ClaimRequest {
        scope: "s".into(),
        key: IdempotencyKey::new(key).unwrap(),
        fingerprint: Fingerprint::of_bytes("M", b"x"),
        lease: Duration::from_secs(5),
        ttl: Duration::from_millis(ttl_ms),
        now_ms,
    }
}

async fn claim_at(store: &SqliteStore, key: &str, now_ms: i64, ttl_ms: u64) -> Lease {
    match store.claim(request(key, now_ms, ttl_ms)).await.unwrap() {
        Claim::Claimed(lease) => lease,
        other => panic!("{key} at {now_ms}: {other:?}"),
    }
}

fn created() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Bytes::from_static(b"{\"ok\":true}"),
    }
}

/// The record tables of the database and how many records each holds.
async fn tables_of(store: &SqliteStore) -> Vec<(String, i64)> {
    store
        .db()
        .read(|c| {
            let names: Vec<String> = c
                .prepare(
                    "SELECT name FROM sqlite_master WHERE type = 'table' \
                     AND (name LIKE 'idempotency_window_%' OR name = 'idempotency_key') \
                     ORDER BY name",
                )?
                .query_map([], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?;
            names
                .into_iter()
                .map(|n| {
                    let count =
                        c.query_row(&format!("SELECT count(*) FROM {n}"), [], |r| r.get(0))?;
                    Ok((n, count))
                })
                .collect()
        })
        .await
        .unwrap()
}

fn day_window(at: i64) -> String {
    Window::of(DAY, at).table_name()
}

#[tokio::test]
async fn records_go_to_the_window_of_their_class_and_time() {
    let guard = store().await;
    let store = &guard.0;
    assert!(
        tables_of(store).await.is_empty(),
        "a new store has no table"
    );
    claim_at(store, "a", T0, DAY as u64).await;
    claim_at(store, "b", T0 + HOUR - 1, DAY as u64).await;
    claim_at(store, "c", T0 + HOUR, DAY as u64).await;
    // Another class: its own windows. A claim carrying an earlier time than the store has
    // seen is placed by the store's time: a window never takes records after it sealed.
    claim_at(store, "d", T0, 60_000).await;
    let mut want = vec![
        (day_window(T0), 2),
        (day_window(T0 + HOUR), 1),
        (Window::of(60_000, T0 + HOUR).table_name(), 1),
    ];
    want.sort();
    assert_eq!(tables_of(store).await, want);
    assert_eq!(store.record_count().await.unwrap(), 4);
}

/// A claim finds the key in whichever window holds it, across a boundary, before and after
/// the sealed window is summarised.
#[tokio::test]
async fn a_key_is_found_across_windows() {
    let guard = store().await;
    let store = &guard.0;
    let lease = claim_at(store, "k", T0 + HOUR - 10, DAY as u64).await;
    // Just past the boundary, its lease is live: in progress, not a second record.
    assert!(matches!(
        store
            .claim(request("k", T0 + HOUR + 10, DAY as u64))
            .await
            .unwrap(),
        Claim::InProgress { .. }
    ));
    store
        .complete(&lease, created(), T0 + HOUR + 20)
        .await
        .unwrap();
    // Sealed and summarised.
    store.upkeep(T0 + HOUR + 30).await.unwrap();
    let snapshot = store.tables.snapshot();
    let sealed = snapshot.find(Window::of(DAY, T0)).expect("window");
    // Kept by the claim that inserted it (the window was created by this store).
    let summary = sealed.summary.as_ref().expect("summarised");
    assert_eq!(summary.keys(), 1);
    assert!(summary.may_hold("s", "k"));
    assert_eq!(
        store
            .claim(request("k", T0 + 2 * HOUR, DAY as u64))
            .await
            .unwrap(),
        Claim::Replay(created())
    );
    let other = ClaimRequest {
        fingerprint: Fingerprint::of_bytes("M", b"y"),
        ..request("k", T0 + 2 * HOUR, DAY as u64)
    };
    assert!(matches!(
        store.claim(other).await.unwrap(),
        Claim::Conflict { .. }
    ));
    assert_eq!(store.record_count().await.unwrap(), 1);
}

/// A takeover moves the record out of a sealed window into the current one, keeping its
/// first-claim time and recovery point; a sealed window's records only age.
#[tokio::test]
async fn a_takeover_moves_the_record_to_the_current_window() {
    let guard = store().await;
    let store = &guard.0;
    let first = claim_at(store, "k", T0, DAY as u64).await;
    store
        .commit_phase(
            &first,
            crate::idempotency::RecoveryPoint {
                phase: "intent".into(),
                data: Bytes::from_static(b"pi_1"),
            },
            Box::new(|_| Ok(())),
        )
        .await
        .unwrap();
    store.upkeep(T0 + 2 * HOUR).await.unwrap();
    // The lease ended long ago: a takeover, in the window of its own time.
    let second = claim_at(store, "k", T0 + 2 * HOUR, DAY as u64).await;
    assert_eq!(second.created_at_ms, T0);
    assert!(second.lease_until_ms > first.lease_until_ms);
    let resume = second.resume.clone().expect("a takeover");
    assert_eq!(resume.prior, crate::idempotency::PriorRun::Abandoned);
    assert_eq!(
        resume.point.expect("point").data,
        Bytes::from_static(b"pi_1")
    );
    let mut want = vec![(day_window(T0), 0), (day_window(T0 + 2 * HOUR), 1)];
    want.sort();
    assert_eq!(tables_of(store).await, want);
    // The first run's lease is fenced out; the second completes.
    assert!(matches!(
        store.complete(&first, created(), T0 + 2 * HOUR).await,
        Err(StoreError::LeaseLost { .. })
    ));
    store
        .complete(&second, created(), T0 + 2 * HOUR + 1)
        .await
        .unwrap();
    let record = store.get("s", &second.key).await.unwrap().expect("record");
    assert_eq!(record.status, RecordStatus::Succeeded);
    assert_eq!(record.created_at_ms, T0);
}

/// Expiry drops a window whole once every record in it may be swept, and never before.
#[tokio::test]
async fn expiry_drops_whole_windows() {
    let guard = store().await;
    let store = &guard.0;
    let ttl = HOUR as u64;
    for i in 0..5 {
        let lease = claim_at(store, &format!("done{i}"), T0 + i, ttl).await;
        store.complete(&lease, created(), T0 + 10).await.unwrap();
    }
    // Still running, its lease live for a day.
    let long = ClaimRequest {
        lease: Duration::from_millis(DAY as u64),
        ..request("long", T0 + 20, ttl)
    };
    let Claim::Claimed(long) = store.claim(long).await.unwrap() else {
        panic!("not claimed")
    };
    let window = Window::of(HOUR, T0).table_name();
    // Not yet expired.
    assert_eq!(store.expire(T0 + HOUR - 1, 100).await.unwrap(), 0);
    // Expired, but a lease is live.
    assert_eq!(store.expire(T0 + 2 * HOUR, 100).await.unwrap(), 0);
    assert!(tables_of(store).await.iter().any(|(n, _)| *n == window));
    // A late completion keeps its record past the first expiry.
    store
        .complete(&long, created(), T0 + DAY + 1)
        .await
        .unwrap();
    assert_eq!(store.expire(T0 + DAY + 2, 100).await.unwrap(), 0);
    // Once all of it has expired: dropped whole, all six records at once, whatever the limit.
    assert_eq!(store.expire(T0 + DAY + HOUR + 2, 1).await.unwrap(), 6);
    assert!(!tables_of(store).await.iter().any(|(n, _)| *n == window));
    assert!(store.get("s", &long.key).await.unwrap().is_none());
    // The key is unused again, in a new window.
    claim_at(store, "done0", T0 + DAY + HOUR + 3, ttl).await;
}

/// and taken over (moved out), and expire record by record until the old table goes.
#[tokio::test]
async fn corrupt_rows_are_typed_errors() {
    let guard = store().await;
    let store = guard.0.clone();
    claim_at(&store, "first", T0, DAY as u64).await;
    let table = day_window(T0);
    store
        .db()
        .write(move |c| {
            c.execute(
                &format!(
                    "INSERT INTO {table} (scope, key, fingerprint, status, lease_until, \
                     http_status, created_at, expires_at) \
                     VALUES ('s', 'k', 'not-hex', 'succeeded', 0, 99999, 0, 9999999999999)"
                ),
                [],
            )
        })
        .await
        .unwrap();
    let err = store
        .get("s", &IdempotencyKey::new("k").unwrap())
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
}

#[tokio::test]
async fn window_tables_have_the_seed_schema() {
    let guard = store().await;
    claim_at(&guard.0, "first", T0, DAY as u64).await;
    let table = day_window(T0);
    let cols: Vec<String> = guard
        .0
        .db()
        .read(move |c| {
            let mut stmt = c.prepare(&format!("SELECT name FROM pragma_table_info('{table}')"))?;
            let rows = stmt.query_map([], |r| r.get(0))?;
            rows.collect()
        })
        .await
        .unwrap();
    assert_eq!(
        cols,
        [
            "scope",
            "key",
            "fingerprint",
            "status",
            "lease_until",
            "http_status",
            "response_body",
            "response_headers",
            "created_at",
            "expires_at",
            "phase",
            "phase_data",
        ]
    );
}

/// A summary kept by the claims, and one read back from a window made by an earlier process,
/// hold every key the window holds.
#[tokio::test]
async fn summaries_hold_every_key_of_their_window() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let keys: Vec<String> = (0..500).map(|i| format!("key-{i}")).collect();
    let first = SqliteStore::open(&path, SqliteOptions::default())
        .await
        .unwrap();
    for (i, key) in keys.iter().enumerate() {
        claim_at(&first, key, T0 + i as i64, DAY as u64).await;
    }
    for store in [
        first.clone(),
        SqliteStore::open(&path, SqliteOptions::default())
            .await
            .unwrap(),
    ] {
        store.upkeep(T0 + HOUR).await.unwrap();
        let snapshot = store.tables.snapshot();
        let summary = snapshot
            .find(Window::of(DAY, T0))
            .and_then(|t| t.summary.clone())
            .expect("summarised");
        // Every key still in the window (the first pass below moves 20 out).
        let held = tables_of(&store)
            .await
            .into_iter()
            .find(|(name, _)| *name == day_window(T0))
            .map(|(_, n)| n)
            .unwrap();
        assert_eq!(summary.keys(), held as usize);
        assert!(
            keys[keys.len() - held as usize..]
                .iter()
                .all(|k| summary.may_hold("s", k))
        );
        // And a claim still finds each key behind it (taking the first 20 over, into the
        // next window).
        for key in keys.iter().take(20) {
            assert!(matches!(
                store
                    .claim(request(key, T0 + HOUR + 1, DAY as u64))
                    .await
                    .unwrap(),
                Claim::InProgress { .. } | Claim::Claimed(_)
            ));
        }
    }
}
