//! The store conformance suite, run from outside the crate as any backend would run it.

use backstop::idempotency::MemoryStore;

backstop::store_conformance!(memory, async { MemoryStore::new() });

#[cfg(feature = "sqlite")]
mod sqlite {
    use backstop::db::sqlite::{SqliteOptions, Synchronous};
    use backstop::idempotency::conformance::WithGuard;
    use backstop::idempotency::sqlite::SqliteStore;

    async fn open(options: SqliteOptions) -> WithGuard<SqliteStore, tempfile::TempDir> {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(dir.path().join("idem.db"), options)
            .await
            .expect("open store");
        WithGuard(store, dir)
    }

    backstop::store_conformance!(group_commit, open(SqliteOptions::default()));

    backstop::store_conformance!(
        autocommit,
        open(SqliteOptions {
            group_commit: false,
            synchronous: Synchronous::Normal,
            ..SqliteOptions::default()
        })
    );
}

#[cfg(feature = "postgres")]
mod support {
    pub(crate) mod postgres_schema;
    pub(crate) mod services;
    pub(crate) mod tcp_proxy;
}

/// Against the PostgreSQL on 127.0.0.1:5432 (user `postgres`, database `test`, or
/// `BACKSTOP_TEST_POSTGRES`), each test in a schema of its own.
#[cfg(feature = "postgres")]
mod postgres {
    use std::sync::Arc;
    use std::time::Duration;

    use backstop::deadline::Deadline;
    use backstop::idempotency::conformance::WithGuard;
    use backstop::idempotency::postgres::{PostgresOptions, PostgresStore};
    use backstop::idempotency::{
        Claim, ClaimRequest, Fingerprint, IdempotencyKey, Store, StoreError,
    };

    use super::support::postgres_schema::Schema;
    use super::support::services;
    use super::support::tcp_proxy::{Mode, TcpProxy};

    async fn open(options: PostgresOptions) -> WithGuard<PostgresStore, Schema> {
        let schema = Schema::create("conformance").await;
        let store = PostgresStore::connect_with(schema.config(), options)
            .await
            .expect("connect store");
        WithGuard(store, schema)
    }

    // Small pools: the server is shared, and fewer writers than racing callers make batches.
    backstop::store_conformance!(
        batched,
        run_if = services::postgres(),
        open(PostgresOptions {
            max_connections: 4,
            writers: 2,
            ..PostgresOptions::default()
        })
    );

    backstop::store_conformance!(
        autocommit,
        run_if = services::postgres(),
        open(PostgresOptions {
            group_commit: false,
            max_connections: 4,
            writers: 4,
            ..PostgresOptions::default()
        })
    );

    fn claim_req(key: &str, now_ms: i64) -> ClaimRequest {
        ClaimRequest {
            scope: "merchant-1".into(),
            key: IdempotencyKey::new(key).unwrap(),
            fingerprint: Fingerprint::of_bytes("POST /v1/payments", b"{}"),
            lease: Duration::from_secs(5),
            ttl: Duration::from_secs(3600),
            now_ms,
        }
    }

    /// N instances (each its own pool) starting at once migrate once, and N concurrent
    /// takeovers across them have exactly one winner.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_takeovers_across_pools_have_one_winner() {
        const INSTANCES: usize = 8;

        if !services::postgres() {
            return;
        }
        let schema = Schema::create("conformance").await;
        let options = PostgresOptions {
            max_connections: 2,
            writers: 1,
            ..PostgresOptions::default()
        };
        let opened = futures_util::future::join_all(
            (0..INSTANCES).map(|_| PostgresStore::connect_with(schema.config(), options.clone())),
        )
        .await;
        let stores: Vec<PostgresStore> = opened.into_iter().map(|s| s.expect("open")).collect();

        for round in 0..8 {
            let key = format!("k-{round}");
            let Claim::Claimed(first) = stores[0].claim(claim_req(&key, 1_000)).await.unwrap()
            else {
                panic!("first claim")
            };
            if round % 2 == 0 {
                stores[0].fail(&first, 1_001).await.unwrap();
            }
            // Ended lease (odd rounds) or failed record (even rounds): everyone tries at once.
            let now = first.lease_until_ms + 1;
            let barrier = Arc::new(tokio::sync::Barrier::new(INSTANCES * 4));
            let tasks: Vec<_> = (0..INSTANCES * 4)
                .map(|i| {
                    let store = stores[i % INSTANCES].clone();
                    let barrier = Arc::clone(&barrier);
                    let req = claim_req(&key, now);
                    tokio::spawn(async move {
                        barrier.wait().await;
                        store.claim(req).await.unwrap()
                    })
                })
                .collect();
            let mut winners = Vec::new();
            for t in tasks {
                match t.await.unwrap() {
                    Claim::Claimed(lease) => winners.push(lease),
                    Claim::InProgress { .. } => {}
                    other => panic!("a loser must get InProgress, got {other:?}"),
                }
            }
            assert_eq!(winners.len(), 1, "round {round}: {winners:?}");
            assert!(winners[0].lease_until_ms > first.lease_until_ms);
        }
        // The store's migration recorded once, however many instances raced to run it.
        let migrations = schema.count("backstop_migration").await;
        assert_eq!(migrations, 1);
        drop(stores);
    }

    /// Sweepers on several instances split the work: every expired record deleted exactly
    /// once in total, a running record with a live lease never.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_sweepers_across_pools_delete_each_record_once() {
        if !services::postgres() {
            return;
        }
        let schema = Schema::create("conformance").await;
        let options = PostgresOptions {
            max_connections: 2,
            writers: 1,
            ..PostgresOptions::default()
        };
        let mut stores = Vec::new();
        for _ in 0..4 {
            stores.push(
                PostgresStore::connect_with(schema.config(), options.clone())
                    .await
                    .unwrap(),
            );
        }
        let expiring = |key: String, lease_ms: u64| ClaimRequest {
            ttl: Duration::from_millis(10),
            lease: Duration::from_millis(lease_ms),
            ..claim_req(&key, 1_000)
        };
        for i in 0..200 {
            let Claim::Claimed(lease) =
                stores[0].claim(expiring(format!("k{i}"), 1)).await.unwrap()
            else {
                panic!("claim")
            };
            stores[0].fail(&lease, 1_000).await.unwrap();
        }
        // Expired, but its lease runs far past the sweep time.
        stores[0]
            .claim(expiring("live".into(), 1_000_000))
            .await
            .unwrap();
        let now = 100_000;
        let tasks: Vec<_> = stores
            .iter()
            .cloned()
            .map(|store| {
                tokio::spawn(async move {
                    let mut total = 0;
                    loop {
                        let n = store.sweep(now, 25).await.unwrap();
                        total += n;
                        if n == 0 {
                            return total;
                        }
                    }
                })
            })
            .collect();
        let mut total = 0;
        for t in tasks {
            total += t.await.unwrap();
        }
        assert_eq!(total, 200);
        let live = stores[0]
            .get("merchant-1", &IdempotencyKey::new("live").unwrap())
            .await
            .unwrap();
        assert!(live.is_some());
        drop(stores);
    }

    /// Concurrent claims share transactions: fewer round trips than statements.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_claims_share_batches() {
        if !services::postgres() {
            return;
        }
        let fixture = open(PostgresOptions {
            writers: 1,
            ..PostgresOptions::default()
        })
        .await;
        let store = fixture.0.clone();
        let before = store.writer_stats();
        let tasks: Vec<_> = (0..64)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move { store.claim(claim_req(&format!("k{i}"), 1_000)).await })
            })
            .collect();
        for t in tasks {
            assert!(matches!(t.await.unwrap().unwrap(), Claim::Claimed(_)));
        }
        let after = store.writer_stats();
        assert_eq!(after.jobs - before.jobs, 64);
        assert!(
            after.batches - before.batches < 64,
            "{before:?} -> {after:?}"
        );
    }

    /// Batched claims over records in every state (fresh, succeeded, live lease, other
    /// fingerprint, failed, ended lease) each get their own answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn batched_claims_answer_each_caller() {
        if !services::postgres() {
            return;
        }
        let fixture = open(PostgresOptions {
            writers: 1,
            ..PostgresOptions::default()
        })
        .await;
        let store = fixture.0.clone();
        let response = backstop::idempotency::StoredResponse {
            status: 201,
            headers: vec![("location".into(), "/x".into())],
            body: bytes::Bytes::from_static(b"\x00\xffbody"),
        };
        const EACH: usize = 8;
        let mut first_leases = Vec::new();
        for i in 0..EACH {
            for state in ["done", "live", "other", "failed", "ended"] {
                let Claim::Claimed(lease) = store
                    .claim(claim_req(&format!("{state}-{i}"), 1_000))
                    .await
                    .unwrap()
                else {
                    panic!("first claim of {state}-{i}")
                };
                match state {
                    "done" => store
                        .complete(&lease, response.clone(), 1_001)
                        .await
                        .unwrap(),
                    "failed" => store.fail(&lease, 1_001).await.unwrap(),
                    _ => {}
                }
                first_leases.push((format!("{state}-{i}"), lease.lease_until_ms));
            }
        }
        let lease_end = first_leases[0].1;
        let before = store.writer_stats();
        let requests: Vec<(String, ClaimRequest)> = (0..EACH)
            .flat_map(|i| {
                ["fresh", "done", "live", "other", "failed", "ended"].map(|state| {
                    let key = format!("{state}-{i}");
                    let req = match state {
                        "other" => ClaimRequest {
                            fingerprint: Fingerprint::of_bytes("POST /v1/payments", b"{\"x\":1}"),
                            ..claim_req(&key, 2_000)
                        },
                        "ended" => claim_req(&key, lease_end + 1),
                        _ => claim_req(&key, 2_000),
                    };
                    (state.to_owned(), req)
                })
            })
            .collect();
        let claims = futures_util::future::join_all(
            requests.iter().map(|(_, req)| store.claim(req.clone())),
        )
        .await;
        let after = store.writer_stats();
        assert!(
            after.batches - before.batches < after.jobs - before.jobs,
            "{before:?} -> {after:?}"
        );
        for ((state, req), claim) in requests.iter().zip(claims) {
            let claim = claim.unwrap();
            let ok = match (state.as_str(), &claim) {
                ("fresh", Claim::Claimed(_)) => true,
                ("done", Claim::Replay(r)) => *r == response,
                ("live", Claim::InProgress { retry_after }) => {
                    *retry_after == Duration::from_millis((lease_end - 2_000) as u64)
                }
                ("other", Claim::Conflict { fingerprint_prefix }) => {
                    *fingerprint_prefix == claim_req("x", 0).fingerprint.prefix8()
                }
                ("failed" | "ended", Claim::Claimed(lease)) => lease.lease_until_ms > lease_end,
                _ => false,
            };
            assert!(ok, "{state} {}: {claim:?}", req.key.as_str());
        }
    }

    /// Batched outcomes (completions, failures, releases, stale leases mixed) each get their
    /// own answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn batched_outcomes_answer_each_caller() {
        if !services::postgres() {
            return;
        }
        let fixture = open(PostgresOptions {
            writers: 1,
            ..PostgresOptions::default()
        })
        .await;
        let store = fixture.0.clone();
        let claims = futures_util::future::join_all(
            (0..48).map(|i| store.claim(claim_req(&format!("k{i}"), 1_000))),
        )
        .await;
        let leases: Vec<_> = claims
            .into_iter()
            .map(|c| match c.unwrap() {
                Claim::Claimed(lease) => lease,
                other => panic!("{other:?}"),
            })
            .collect();
        let response = backstop::idempotency::StoredResponse {
            status: 201,
            headers: vec![("location".into(), "/x".into())],
            body: bytes::Bytes::from_static(b"\x00\xffbody"),
        };
        let tasks: Vec<_> = leases
            .iter()
            .enumerate()
            .map(|(i, lease)| {
                let (store, lease, response) = (store.clone(), lease.clone(), response.clone());
                tokio::spawn(async move {
                    let stale = backstop::idempotency::Lease {
                        lease_until_ms: lease.lease_until_ms - 1,
                        ..lease.clone()
                    };
                    match i % 4 {
                        0 => store.complete(&lease, response, 1_100).await,
                        1 => store.fail(&lease, 1_100).await,
                        2 => store.release(&lease).await,
                        _ => store.complete(&stale, response, 1_100).await,
                    }
                })
            })
            .collect();
        for (i, t) in tasks.into_iter().enumerate() {
            let result = t.await.unwrap();
            if i % 4 == 3 {
                assert!(
                    matches!(result, Err(StoreError::LeaseLost { .. })),
                    "{i}: {result:?}"
                );
            } else {
                assert!(result.is_ok(), "{i}: {result:?}");
            }
        }
        for (i, lease) in leases.iter().enumerate() {
            let record = store.get("merchant-1", &lease.key).await.unwrap();
            let status = record.as_ref().map(|r| r.status);
            use backstop::idempotency::RecordStatus::*;
            let want = match i % 4 {
                0 => Some(Succeeded),
                1 => Some(Failed),
                2 => None,
                _ => Some(Running),
            };
            assert_eq!(status, want, "{i}");
            if i % 4 == 0 {
                assert_eq!(record.unwrap().response, Some(response.clone()));
            }
        }
    }

    /// PostgreSQL down or hanging: every call fails with a backend error by its deadline, never
    /// hangs and never half-writes; calls succeed again once it is back, with no restart.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn database_down_or_silent_fails_fast_and_recovers() {
        if !services::postgres() {
            return;
        }
        let schema = Schema::create("conformance").await;
        let upstream = tokio::net::lookup_host(("127.0.0.1", schema.config().get_ports()[0]))
            .await
            .unwrap()
            .next()
            .unwrap();
        let proxy = TcpProxy::start(upstream).await;
        let store = PostgresStore::connect_with(
            schema.config_via(proxy.port()),
            PostgresOptions {
                timeout: Duration::from_secs(1),
                ..PostgresOptions::default()
            },
        )
        .await
        .unwrap();
        assert!(matches!(
            store.claim(claim_req("before", 1_000)).await.unwrap(),
            Claim::Claimed(_)
        ));

        // Outer bound only so a regression fails instead of hanging the suite.
        let bounded = |f| tokio::time::timeout(Duration::from_secs(30), f);
        for mode in [Mode::Down, Mode::Silent] {
            proxy.set(mode).await;
            for i in 0..3 {
                let deadline = Deadline::after(Duration::from_millis(300));
                let result = bounded(
                    deadline.scope(store.claim(claim_req(&format!("{mode:?}-{i}"), 2_000))),
                )
                .await
                .expect("the claim must end by its deadline");
                assert!(
                    matches!(&result, Err(StoreError::Postgres(e)) if e.is_unavailable()),
                    "{mode:?}: {result:?}"
                );
                assert!(store.ping().await.is_err());
            }
            proxy.set(Mode::Forward).await;
            // Back by itself: broken connections are replaced on demand.
            let mut recovered = false;
            for _ in 0..50 {
                if store.ping().await.is_ok() {
                    recovered = true;
                    break;
                }
            }
            assert!(recovered, "the store must recover after {mode:?}");
            let claim = store
                .claim(claim_req(&format!("after-{mode:?}"), 3_000))
                .await
                .unwrap();
            assert!(matches!(claim, Claim::Claimed(_)));
        }
        // Only the claims made while the database answered exist.
        let rows = schema.count("idempotency_key").await;
        assert!((3..=9).contains(&rows), "{rows}");
        drop(store);
    }
}
